"""The search space: which formats each layer may take, and what each choice costs.

A search decides one format per *unit*: a single layer, or a group of layers that must share a
format (the q/k/v projections of one attention block, say). Each (unit, format) carries an
additive `Choice` — bytes, seconds, predicted loss increase — summed over the unit's layers, so a
plan's totals are the sums of its choices (the additive proxy the exact solver optimises).

A choice is keyed by its `Format` (the format as the search's `Planning` gives it), or, for an
alternative recipe of a format (another scaling, `Planning.alternatives`), by that recipe's
`LayerPrecision` (`choice_key`, named by `key_name`): a unit may then take FP8 per tensor or FP8
in blocks as two choices of one search.

A search may also decide, per recompute `Block` (`autoprec.blocks`), whether the block's forward
runs again in the backward: recomputing it frees the saved bytes of its layers in their chosen
formats and of its own ops, costs one more forward of it, and adds no loss. A plan is then an
assignment of formats to units plus a set of recomputed blocks (`SearchSpace.totals`).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
from typing import Any, Iterable, Mapping, Sequence, Union

from ..blocks import check_block_patterns
from ..device import format_support
from ..errors import SearchError
from ..formats import Format
from ..plan import LayerPrecision
from .budgets import finite_number

__all__ = ["Choice", "LayerRules", "Unit", "ChoiceKey", "choice_key", "key_format", "key_name", "Block", "MemoryPart", "Pair", "SearchSpace", "formats_for_precision", "DEFAULT_CANDIDATES"]

# Forward formats searched by default. FP8 E5M2 as a *forward* format loses a mantissa bit for
# range activations rarely need; FP8 layers already compute gradients in E5M2.
DEFAULT_CANDIDATES = (Format.FP32, Format.BF16, Format.FP16, Format.FP8_E4M3, Format.INT8)


def formats_for_precision(min_precision: int, max_precision: int, candidates: Iterable[Format] = DEFAULT_CANDIDATES) -> tuple[Format, ...]:
    """Candidates whose width in bits lies in ``[min_precision, max_precision]`` (4, 8, 16 or 32)."""
    for name, value in (("min_precision", min_precision), ("max_precision", max_precision)):
        if value not in (4, 8, 16, 32):
            raise SearchError(f"{name} must be 4, 8, 16 or 32 (bits), got {value!r}")
    if min_precision > max_precision:
        raise SearchError(f"min_precision {min_precision} is above max_precision {max_precision}; swap them")
    return tuple(f for f in candidates if min_precision <= f.bits <= max_precision)


# What a unit's choices are keyed by (module docstring).
ChoiceKey = Union[Format, LayerPrecision]


def choice_key(value: Any) -> ChoiceKey:
    """A choice's key as given: a `LayerPrecision` (an alternative recipe; its reason dropped),
    else a `Format` or its name. Raises FormatError for an unknown name."""
    if isinstance(value, LayerPrecision):
        return dataclasses.replace(value, reason="") if value.reason else value
    return Format.parse(value)


def key_format(key: Any) -> Format:
    """The format of a choice key (`choice_key`)."""
    key = choice_key(key)
    return key.format if isinstance(key, LayerPrecision) else key


def key_name(key: Any) -> str:
    """A choice key in words, one name per choice of a unit: a format's name, or an alternative
    recipe's (`LayerPrecision.recipe`), e.g. ``"fp8_e4m3/block"``, ``"fp8_e4m3/tensor"``."""
    key = choice_key(key)
    if not isinstance(key, LayerPrecision):
        return key.value
    # `LayerPrecision.recipe`, naming the granularity always: an alternative per tensor must not
    # read as its format's own recipe.
    recipe = key.recipe
    return recipe if recipe != key.format.value else f"{recipe}/{key.scaling.granularity.value}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """Additive cost of running a layer (or unit) in one format: bytes held for the step,
    seconds per training step, and the predicted loss increase."""

    bytes: float
    seconds: float
    loss: float

    def __post_init__(self):
        for name in ("bytes", "seconds", "loss"):
            value = float(getattr(self, name))
            if not math.isfinite(value):
                raise SearchError(f"a cost must be finite, got {name}={value}")
            object.__setattr__(self, name, value)

    def __add__(self, other: "Choice") -> "Choice":
        return Choice(self.bytes + other.bytes, self.seconds + other.seconds, self.loss + other.loss)


ZERO = Choice(0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class LayerRules:
    """User rules over layer names (``fnmatch`` patterns such as ``"blocks.*.attn.qkv"``).

    ``pin``: pattern -> the only format allowed. ``forbid``: pattern -> formats not allowed.
    ``groups``: each entry is a list of patterns; layers matching any pattern of one group share a
    format. Groups are literal: write one group per attention block. ``recompute``: patterns of
    the recompute units (`autoprec.blocks.find_blocks`, e.g. ``["blocks.*"]``); None: the blocks
    found automatically. Checked against the model when the job starts; the offline search
    chooses which of them to recompute together with the formats (`Block`).
    """

    pin: Mapping[str, Format] = dataclasses.field(default_factory=dict)
    forbid: Mapping[str, Sequence[Format]] = dataclasses.field(default_factory=dict)
    groups: Sequence[Sequence[str]] = ()
    recompute: "Sequence[str] | None" = None

    def __post_init__(self):
        if self.recompute is not None:
            object.__setattr__(self, "recompute", check_block_patterns(self.recompute, "LayerRules(recompute=...)"))


@dataclasses.dataclass(frozen=True)
class Unit:
    """Layers that take one format together, the formats they may take, and each choice's cost."""

    name: str
    layers: tuple[str, ...]
    choices: Mapping[ChoiceKey, Choice]

    @property
    def formats(self) -> tuple[ChoiceKey, ...]:
        return tuple(self.choices)


@dataclasses.dataclass(frozen=True)
class Block:
    """A recompute unit of the space (`autoprec.blocks`): what recomputing it frees and costs.

    ``freed``: layer fqn -> format -> the bytes that layer's choice holds and recomputation frees
    (at most its choice's bytes); ``forward``: layer fqn -> format -> seconds of one more forward
    of it; ``other_bytes`` / ``other_seconds``: the same for the block's own ops between its
    layers (beyond its input, which it keeps; may be negative when a layer saved the input), in
    a plan with any layer lowered; ``fp32_other_bytes`` / ``fp32_other_seconds``: in the
    all-FP32 plan, where the ops between layers save FP32 (`CostModel.blocks`, index 0; None:
    the lowered figures). Recomputing adds no loss increase.
    """

    name: str
    freed: Mapping[str, Mapping[ChoiceKey, float]]
    forward: Mapping[str, Mapping[ChoiceKey, float]]
    other_bytes: float = 0.0
    other_seconds: float = 0.0
    fp32_other_bytes: "float | None" = None
    fp32_other_seconds: "float | None" = None

    def __post_init__(self):
        for field in ("freed", "forward"):
            for fqn, row in getattr(self, field).items():
                for fmt, value in row.items():
                    if not (finite_number(value) and value >= 0):
                        raise SearchError(f"block {self.name!r}: {field}[{fqn!r}][{key_name(fmt)}] must be a finite number >= 0, got {value!r}")
        for field in ("other_bytes", "other_seconds", "fp32_other_bytes", "fp32_other_seconds"):
            value = getattr(self, field)
            if not finite_number(value) and not (field.startswith("fp32") and value is None):
                raise SearchError(f"block {self.name!r}: {field} must be a finite number, got {value!r}")

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self.freed)


@dataclasses.dataclass(frozen=True)
class Pair:
    """Bytes an FP32 layer's choice holds only while ``before`` (the layer that ran before it,
    most often the one its input comes from) is not FP32: the FP32 copy of a half input
    (`CostModel.fp32_pair_bytes`, measured). The additive table charges them to the layer's
    FP32 choice; a plan with both layers FP32 (and some layer lowered) holds ``bytes`` less."""

    layer: str
    before: str
    bytes: float

    def __post_init__(self):
        if not (finite_number(self.bytes) and self.bytes >= 0):
            raise SearchError(f"pair ({self.layer!r}, {self.before!r}): bytes must be a finite number >= 0, got {self.bytes!r}")


@dataclasses.dataclass(frozen=True)
class MemoryPart:
    """Layers one device holds (a pipeline stage's): the search keeps their bytes within a budget
    of their own (`exact.k_best` with ``memory_bytes`` by part name), and the devices run at once,
    so a step takes its slowest part's seconds (`SearchSpace.step_seconds`). ``fixed_bytes``,
    ``fixed_seconds``: the part's bytes and seconds outside its layers (in the space's ``fixed``
    too); ``fp32_bytes``: its all-FP32 bytes exactly (None: the additive figure)."""

    name: str
    layers: frozenset
    fixed_bytes: float = 0.0
    fp32_bytes: "float | None" = None
    fixed_seconds: float = 0.0


class SearchSpace:
    """Units (layers or groups) with their allowed formats and additive costs.

    ``table``: fqn -> {format: Choice} for every covered layer, in model order. Allowed formats
    are the table's formats within ``[min_precision, max_precision]`` bits, runnable on
    ``device``, and permitted by ``rules``. A layer left with no format is an error naming it.
    ``blocks``: recompute units the search may recompute (`Block`; none: formats only, exactly
    as before blocks existed); each names layers of the table, no layer in two blocks.
    ``fp32_bytes``: the all-FP32 plan's bytes (recomputing nothing), the memory reference a
    fractional budget is a fraction of (`CostModel.fp32_bytes`). The additive table charges an FP32
    layer its lowered neighbours' FP32 saves and the rest of the step its lowered figure, exact
    for every plan but all-FP32, which it overstates (on a diffusers UNet by half); with
    ``fp32_bytes`` that plan totals exactly it, and with blocks recomputed it less what they free
    in an all-FP32 region (`totals`, `exact.k_best`), so an all-FP32 plan is 1.0 of the reference
    a budget names and recomputation alone is priced as it runs.
    ``parts``: `MemoryPart` s covering every layer once (none: one device holds them all), each
    unit and block inside one (`part_bytes`).
    ``pairs``: `Pair` s of layers whose FP32 choices together hold less than apart; within one
    unit they fold into its FP32 choice, across two they are ``unit_pairs`` (unit, unit before,
    bytes), which `totals` subtracts where both units are FP32 (a term on two units' choices:
    `exact` linearises it).
    """

    def __init__(
        self,
        table: Mapping[str, Mapping[Any, Choice]],
        *,
        min_precision: int = 8,
        max_precision: int = 32,
        rules: LayerRules = LayerRules(),
        device=None,
        fixed: "Mapping[str, Choice] | None" = None,
        blocks: Sequence[Block] = (),
        fp32_bytes: "float | None" = None,
        parts: Sequence[MemoryPart] = (),
        pairs: Sequence[Pair] = (),
    ):
        self.fp32_bytes = None if fp32_bytes is None else float(fp32_bytes)
        allowed_bits = set(formats_for_precision(min_precision, max_precision, Format))
        runnable = {f for f in Format if format_support(f, device).runnable}
        # Costs outside any layer (the rest of the step: norms, optimizer, ...), in every plan.
        self.fixed_total = ZERO
        for choice in (fixed or {}).values():
            self.fixed_total = self.fixed_total + _choice(choice)
        problems = []
        allowed: dict[str, list[ChoiceKey]] = {}
        for fqn, options in table.items():
            formats = [choice_key(f) for f in options]
            formats = [f for f in formats if key_format(f) in allowed_bits and key_format(f) in runnable]
            for pattern, fmt in rules.pin.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    formats = [f for f in formats if key_format(f) is Format.parse(fmt)]
            for pattern, banned in rules.forbid.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    refused = {Format.parse(f) for f in banned}
                    formats = [f for f in formats if key_format(f) not in refused]
            if not formats:
                problems.append(f"{fqn!r}: no format left (costed {[key_name(f) for f in options]}, precision {min_precision}..{max_precision} bits, rules, device)")
            allowed[fqn] = formats
        for pattern in list(rules.pin) + list(rules.forbid) + [p for g in rules.groups for p in g]:
            if not any(fnmatch.fnmatchcase(fqn, pattern) for fqn in table):
                problems.append(f"rule pattern {pattern!r} matches no layer; check the name (layers look like {next(iter(table), '...')!r})")
        if problems:
            raise SearchError("the search space is empty for some layers:\n  - " + "\n  - ".join(problems))

        grouped: dict[str, int] = {}
        for index, group in enumerate(rules.groups):
            for fqn in table:
                if any(fnmatch.fnmatchcase(fqn, p) for p in group):
                    if fqn in grouped and grouped[fqn] != index:
                        raise SearchError(f"layer {fqn!r} is in two groups ({grouped[fqn]} and {index}); a layer can share a format with one group only")
                    grouped[fqn] = index
        units: list[Unit] = []
        seen_groups: set[int] = set()
        for fqn in table:
            if fqn not in grouped:
                units.append(Unit(fqn, (fqn,), {f: _choice(table[fqn][f]) for f in allowed[fqn]}))
                continue
            index = grouped[fqn]
            if index in seen_groups:
                continue
            seen_groups.add(index)
            members = tuple(m for m in table if grouped.get(m) == index)
            common = [f for f in allowed[members[0]] if all(f in allowed[m] for m in members)]
            if not common:
                raise SearchError(f"group {index} ({', '.join(members)}) has no format all its layers may take")
            choices = {}
            for f in common:
                total = ZERO
                for m in members:
                    total = total + _choice(table[m][f])
                choices[f] = total
            units.append(Unit(f"group{index}:" + "+".join(members), members, choices))
        self.units: tuple[Unit, ...] = tuple(units)
        self.layers: tuple[str, ...] = tuple(table)
        self._set_pairs(pairs)
        self.blocks: tuple[Block, ...] = ()
        self._set_blocks(blocks)
        self._set_parts(parts)

    def _set_pairs(self, pairs: Sequence[Pair]) -> None:
        """Fold the ``pairs`` within one unit into its FP32 choices; index the others by unit
        (``unit_pairs``, their bytes summed per pair of units)."""
        unit_of = {fqn: unit.name for unit in self.units for fqn in unit.layers}
        folded: dict[str, float] = {}
        across: dict[tuple[str, str], float] = {}
        for pair in pairs:
            if pair.layer not in unit_of or pair.before not in unit_of:
                raise SearchError(f"pair ({pair.layer!r}, {pair.before!r}) names a layer not in the search space")
            unit, before = unit_of[pair.layer], unit_of[pair.before]
            if unit == before:
                folded[unit] = folded.get(unit, 0.0) + pair.bytes
            elif pair.bytes > 0:
                across[(unit, before)] = across.get((unit, before), 0.0) + pair.bytes
        if folded:
            self.units = tuple(dataclasses.replace(u, choices={f: c + Choice(-folded[u.name], 0.0, 0.0) if key_format(f) is Format.FP32 else c
                                                               for f, c in u.choices.items()}) if u.name in folded else u for u in self.units)
        self.unit_pairs: tuple[tuple[str, str, float], ...] = tuple((u, v, b) for (u, v), b in across.items())

    def pair_bytes(self, assignment: Mapping[str, Any]) -> dict[str, float]:
        """Per unit: what its FP32 choice does not hold under ``assignment`` because the unit
        before it is FP32 too (`unit_pairs`); only units with such a pair."""
        fp32 = lambda name: key_format(assignment[name]) is Format.FP32  # noqa: E731
        held: dict[str, float] = {}
        for unit, before, nbytes in self.unit_pairs:
            if fp32(unit) and fp32(before):
                held[unit] = held.get(unit, 0.0) + nbytes
        return held

    def _set_parts(self, parts: Sequence[MemoryPart]) -> None:
        """Check ``parts`` against the layers and index them: ``part_of`` holds each unit's and
        each block's part (by name)."""
        self.parts = tuple(parts)
        self.part_of: dict[str, str] = {}
        if not self.parts:
            return
        holder = {fqn: part.name for part in self.parts for fqn in part.layers}
        missing = [fqn for fqn in self.layers if fqn not in holder]
        if missing or len(holder) != sum(len(part.layers) for part in self.parts):
            raise SearchError(f"memory parts must hold every layer once ({len(missing)} in none, e.g. {missing[:1]}, or one in two)")
        for name, layers in [(u.name, u.layers) for u in self.units] + [(b.name, b.layers) for b in self.blocks]:
            held = sorted({holder[fqn] for fqn in layers})
            if len(held) > 1:
                raise SearchError(f"{name!r} has layers in memory parts {held}: a rule group or block must keep to one device (pipeline stage)")
            self.part_of[name] = held[0]

    def part_totals(self, assignment: Mapping[str, Any], recompute: Iterable[str] = ()) -> dict[str, Choice]:
        """Each part's totals under an assignment with some blocks recomputed, as `totals` sums
        them: its fixed bytes and seconds, its units' and its recomputed blocks'. A part all in
        FP32 holds its ``fp32_bytes`` exactly, when given, less what its recomputed blocks free
        in an all-FP32 region (`fp32_recompute_effect`)."""
        recompute = set(recompute)
        lowered = {self.part_of[u.name] for u in self.units if key_format(assignment[u.name]) is not Format.FP32}
        exact = {part.name: part.fp32_bytes for part in self.parts if part.fp32_bytes is not None and part.name not in lowered}
        out = {part.name: Choice(exact.get(part.name, part.fixed_bytes), part.fixed_seconds, 0.0) for part in self.parts}
        for unit in self.units:
            part, choice = self.part_of[unit.name], unit.choices[choice_key(assignment[unit.name])]
            out[part] += Choice(0.0, choice.seconds, choice.loss) if part in exact else choice
        for name, nbytes in self.pair_bytes(assignment).items():
            if self.part_of[name] not in exact:
                out[self.part_of[name]] += Choice(-nbytes, 0.0, 0.0)
        for block in self.blocks:
            if block.name in recompute:
                part = self.part_of[block.name]
                out[part] += self._effect(assignment, [block.name], fp32_region=part in exact)
        return out

    def part_bytes(self, assignment: Mapping[str, Any], recompute: Iterable[str] = ()) -> dict[str, float]:
        """Each part's bytes (`part_totals`)."""
        return {name: total.bytes for name, total in self.part_totals(assignment, recompute).items()}

    def step_seconds(self, assignment: Mapping[str, Any], recompute: Iterable[str] = ()) -> float:
        """The seconds of a step under an assignment, what the search minimises: the totals'
        (`totals`), or with parts, which run at once on their own devices (a pipeline's stages:
        its steady state moves at its slowest stage's pace), the slowest part's."""
        if self.parts:
            return max(total.seconds for total in self.part_totals(assignment, recompute).values())
        return self.totals(assignment, recompute).seconds

    def _set_blocks(self, blocks: Sequence[Block]) -> None:
        """Check ``blocks`` against the units and index them: ``links`` holds, per block, each
        unit with layers in it and, per format of the unit, the bytes freed and forward seconds
        of those layers."""
        owner: dict[str, str] = {}
        for block in blocks:
            for fqn in block.layers:
                if fqn not in self.layers:
                    raise SearchError(f"block {block.name!r}: layer {fqn!r} is not in the search space; cost the block's layers (or drop the block)")
                if fqn in owner:
                    raise SearchError(f"layer {fqn!r} is in blocks {owner[fqn]!r} and {block.name!r}; blocks do not nest or overlap")
                owner[fqn] = block.name
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise SearchError(f"two recompute blocks share a name in {names}; name each block once")
        self.blocks = tuple(blocks)
        self.links: dict[str, list[tuple[str, dict[ChoiceKey, tuple[float, float]]]]] = {}
        for block in self.blocks:
            links = []
            for unit in self.units:
                inside = [fqn for fqn in unit.layers if owner.get(fqn) == block.name]
                if not inside:
                    continue
                per = {}
                for f in unit.choices:
                    missing = [fqn for fqn in inside if f not in block.freed[fqn] or f not in block.forward.get(fqn, {})]
                    if missing:
                        raise SearchError(f"block {block.name!r}: no recompute cost for layer {missing[0]!r} in {key_name(f)}; cost every format of its layers")
                    per[f] = (sum(block.freed[fqn][f] for fqn in inside), sum(block.forward[fqn][f] for fqn in inside))
                    if per[f][0] > unit.choices[f].bytes + 1e-9 * max(1.0, abs(unit.choices[f].bytes)):
                        raise SearchError(f"block {block.name!r}: unit {unit.name!r} in {key_name(f)} would free {per[f][0]:,.0f} bytes, more than its "
                                          f"{unit.choices[f].bytes:,.0f}; freed bytes are part of a layer's bytes")
                links.append((unit.name, per))
            self.links[block.name] = links

    def _block(self, name: str) -> Block:
        for block in self.blocks:
            if block.name == name:
                return block
        known = ", ".join(repr(b.name) for b in self.blocks) or "none"
        raise SearchError(f"recompute block {name!r} is not one of the search space's blocks ({known})")

    def recompute_effect(self, assignment: Mapping[str, Any], recompute: Iterable[str]) -> Choice:
        """What recomputing some blocks changes in an assignment's totals.

        Args:
            assignment: unit name -> format (a `Format` or its name), for at least the units
                with layers in the blocks.
            recompute: names of blocks of this space.

        Returns:
            A `Choice`: bytes freed (negative), seconds of the extra forwards, loss 0.

        Raises:
            SearchError: a name that is not a block of this space.
        """
        return self._effect(assignment, recompute, fp32_region=False)

    def fp32_recompute_effect(self, assignment: Mapping[str, Any], recompute: Iterable[str]) -> Choice:
        """`recompute_effect` in an all-FP32 plan: the blocks' own ops at their all-FP32 figures
        (``Block.fp32_other_bytes`` / ``fp32_other_seconds``), where the ops between layers
        save FP32, not the lowered region's 2-byte activations."""
        return self._effect(assignment, recompute, fp32_region=True)

    def _effect(self, assignment: Mapping[str, Any], recompute: Iterable[str], fp32_region: bool) -> Choice:
        freed = seconds = 0.0
        for name in recompute:
            block = self._block(name)
            own_bytes, own_seconds = block.other_bytes, block.other_seconds
            if fp32_region:
                own_bytes = block.fp32_other_bytes if block.fp32_other_bytes is not None else own_bytes
                own_seconds = block.fp32_other_seconds if block.fp32_other_seconds is not None else own_seconds
            freed += own_bytes
            seconds += own_seconds
            for unit_name, per in self.links[name]:
                b, s = per[choice_key(assignment[unit_name])]
                freed += b
                seconds += s
        return Choice(-freed, seconds, 0.0)

    def totals(self, assignment: Mapping[str, Any], recompute: Iterable[str] = ()) -> Choice:
        """Summed cost of an assignment, plus the fixed costs, with some blocks recomputed.

        Args:
            assignment: unit name -> format (a `Format` or its name), for every unit.
            recompute: names of blocks of this space to recompute (`recompute_effect`).

        Returns:
            The totals as a `Choice` (bytes, seconds per step, predicted loss increase); an
            all-FP32 assignment totals exactly ``fp32_bytes`` when given, less what its
            recomputed blocks free in an all-FP32 region (`fp32_recompute_effect`).

        Raises:
            SearchError: a name in ``recompute`` that is not a block of this space.
        """
        total = self.fixed_total
        for unit in self.units:
            total = total + unit.choices[choice_key(assignment[unit.name])]
        recompute = tuple(recompute)
        if self.fp32_bytes is not None and all(key_format(assignment[u.name]) is Format.FP32 for u in self.units):
            # The reference exactly, and what recomputation frees in it (class docstring).
            return dataclasses.replace(total, bytes=self.fp32_bytes) + self.fp32_recompute_effect(assignment, recompute)
        total = total + Choice(-sum(self.pair_bytes(assignment).values()), 0.0, 0.0)
        return total + self.recompute_effect(assignment, recompute) if recompute else total

    def fixing_recompute(self, recompute: Iterable[str]) -> "SearchSpace":
        """This space with some blocks always recomputed and no block left to choose: each
        unit's choices and the fixed cost take in what recomputing them frees and costs (a
        formats-only search around one recompute set: `search.refine`).

        Args:
            recompute: names of blocks of this space.

        Returns:
            A new space whose totals are this space's with ``recompute``; this one is unchanged.

        Raises:
            SearchError: a name that is not a block of this space.
        """
        recompute = tuple(recompute)
        extra = {u.name: {f: ZERO for f in u.choices} for u in self.units}
        fixed = self.fixed_total
        for name in recompute:
            block = self._block(name)
            fixed = fixed + Choice(-block.other_bytes, block.other_seconds, 0.0)
            for unit_name, per in self.links[name]:
                for f, (b, s) in per.items():
                    extra[unit_name][f] = extra[unit_name][f] + Choice(-b, s, 0.0)
        out = copy.copy(self)
        fp32 = self.uniform(Format.FP32)
        # The all-FP32 plan's exact bytes with ``recompute`` (`totals`): what it holds in the new space.
        exact = self.part_totals(fp32, recompute) if fp32 is not None and self.parts else {}
        out.fp32_bytes = None if self.fp32_bytes is None or fp32 is None else self.totals(fp32, recompute).bytes
        out.units = tuple(dataclasses.replace(u, choices={f: c + extra[u.name][f] for f, c in u.choices.items()}) for u in self.units)
        out.fixed_total = fixed
        out.blocks, out.links = (), {}
        own = {p.name: [self._block(b) for b in recompute if self.part_of[b] == p.name] for p in self.parts}
        out._set_parts([dataclasses.replace(p, fixed_bytes=p.fixed_bytes - sum(b.other_bytes for b in own[p.name]),
                                            fixed_seconds=p.fixed_seconds + sum(b.other_seconds for b in own[p.name]),
                                            fp32_bytes=exact[p.name].bytes if p.fp32_bytes is not None and p.name in exact else None)
                        for p in self.parts])
        return out

    def layer_formats(self, assignment: Mapping[str, Any]) -> dict[str, ChoiceKey]:
        """Every layer's choice, from a unit assignment.

        Args:
            assignment: unit name -> choice key (`choice_key`: a `Format` or its name, or an
                alternative recipe), for every unit.

        Returns:
            fqn -> the unit's choice key for every layer of the space, unit by unit.
        """
        return {fqn: choice_key(assignment[unit.name]) for unit in self.units for fqn in unit.layers}

    def extreme(self, field: str) -> dict[str, ChoiceKey]:
        """The assignment minimising one field unit by unit (fixed costs and blocks aside).

        Args:
            field: ``"bytes"``, ``"seconds"`` or ``"loss"`` (a `Choice` field).

        Returns:
            Unit name -> the format with the least ``field`` (the first in the unit's order on
            a tie).
        """
        return {u.name: min(u.choices, key=lambda f: getattr(u.choices[f], field)) for u in self.units}

    def uniform(self, fmt: Format) -> "dict[str, Format] | None":
        """The assignment putting every unit in one format.

        Args:
            fmt: a `Format` or its name.

        Returns:
            Unit name -> ``fmt``, or None when some unit may not take it.

        Raises:
            FormatError: an unknown format name.
        """
        fmt = Format.parse(fmt)
        if all(fmt in u.choices for u in self.units):
            return {u.name: fmt for u in self.units}
        return None

    def scaled(self, factors: Mapping[tuple[str, ChoiceKey], Choice], fixed: Choice = Choice(1.0, 1.0, 1.0)) -> "SearchSpace":
        """This space with its costs multiplied field by field: a corrected proxy
        (`search.refine`). Same units, names and formats; blocks' freed bytes and seconds scale
        with their units', their own ops' with the fixed costs.

        Args:
            factors: ``(unit name, Format) -> Choice`` of factors for that unit's choice (1 in
                every field where absent).
            fixed: the factors of the fixed costs.

        Returns:
            A new space; this one is unchanged.
        """
        one = Choice(1.0, 1.0, 1.0)

        def times(c: Choice, k: Choice) -> Choice:
            return Choice(c.bytes * k.bytes, c.seconds * k.seconds, c.loss * k.loss)

        out = copy.copy(self)
        out.units = tuple(dataclasses.replace(u, choices={f: times(c, factors.get((u.name, f), one)) for f, c in u.choices.items()}) for u in self.units)
        out.fixed_total = times(self.fixed_total, fixed)
        # What a block frees and costs scales with its units' bytes and seconds, its own ops with the fixed cost.
        out.links = {name: [(u, {f: (b * factors.get((u, f), one).bytes, s * factors.get((u, f), one).seconds) for f, (b, s) in per.items()})
                            for u, per in links] for name, links in self.links.items()}
        scale = lambda value, k: None if value is None else value * k  # noqa: E731
        out.blocks = tuple(dataclasses.replace(b, other_bytes=b.other_bytes * fixed.bytes, other_seconds=b.other_seconds * fixed.seconds,
                                               fp32_other_bytes=scale(b.fp32_other_bytes, fixed.bytes), fp32_other_seconds=scale(b.fp32_other_seconds, fixed.seconds))
                           for b in self.blocks)
        out._set_parts([dataclasses.replace(p, fixed_bytes=p.fixed_bytes * fixed.bytes, fixed_seconds=p.fixed_seconds * fixed.seconds, fp32_bytes=None)
                        for p in self.parts])  # additive, as corrected
        # What a pair does not hold is the region's bytes, as the fixed cost's (`refine`'s fit counts it there).
        out.unit_pairs = tuple((u, v, b * fixed.bytes) for u, v, b in self.unit_pairs)
        fp32 = self.uniform(Format.FP32)
        if self.fp32_bytes is not None and fp32 is not None:
            # The all-FP32 plan's exact bytes corrected as its additive total is.
            additive = lambda space: sum(u.choices[Format.FP32].bytes for u in space.units) + space.fixed_total.bytes  # noqa: E731
            out.fp32_bytes = self.fp32_bytes * additive(out) / additive(self) if additive(self) else self.fp32_bytes
        return out

    def __len__(self) -> int:
        return len(self.units)


def _choice(value) -> Choice:
    if isinstance(value, Choice):
        return value
    if isinstance(value, Mapping):
        return Choice(float(value["bytes"]), float(value["seconds"]), float(value["loss"]))
    return Choice(*(float(v) for v in value))
