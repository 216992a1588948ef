"""The search space: which formats each layer may take, and what each choice costs.

A search decides one format per *unit*: a single layer, or a group of layers that must share a
format (the q/k/v projections of one attention block, say). Each (unit, format) carries an
additive `Choice` — bytes, seconds, predicted loss increase — summed over the unit's layers, so a
plan's totals are the sums of its choices (the additive proxy the exact solver optimises).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
from typing import Iterable, Mapping, Sequence

from ..blocks import check_block_patterns
from ..device import format_support
from ..errors import SearchError
from ..formats import Format

__all__ = ["Choice", "Budgets", "LayerRules", "Unit", "SearchSpace", "formats_for_precision", "DEFAULT_CANDIDATES"]

# Forward formats searched by default. FP8 E5M2 as a *forward* format loses a mantissa bit for
# range activations rarely need; FP8 layers already compute gradients in E5M2.
DEFAULT_CANDIDATES = (Format.FP32, Format.BF16, Format.FP16, Format.FP8_E4M3, Format.INT8)


def formats_for_precision(min_precision: int, max_precision: int, candidates: Iterable[Format] = DEFAULT_CANDIDATES) -> tuple[Format, ...]:
    """Candidates whose width in bits lies in ``[min_precision, max_precision]`` (8, 16 or 32)."""
    for name, value in (("min_precision", min_precision), ("max_precision", max_precision)):
        if value not in (8, 16, 32):
            raise SearchError(f"{name} must be 8, 16 or 32 (bits), got {value!r}")
    if min_precision > max_precision:
        raise SearchError(f"min_precision {min_precision} is above max_precision {max_precision}; swap them")
    return tuple(f for f in candidates if min_precision <= f.bits <= max_precision)


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


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Budgets:
    """What a plan may spend.

    ``memory``: a fraction of the all-FP32 bytes when ``<= 1``, else bytes. ``accuracy``: the
    allowed loss increase, relative to ``baseline_loss`` when ``accuracy_relative`` (0.01 = 1 %),
    else absolute. ``None`` leaves a budget open.
    """

    memory: "float | None" = None
    accuracy: "float | None" = None
    accuracy_relative: bool = True

    def __post_init__(self):
        if self.memory is not None and not (_finite_number(self.memory) and self.memory > 0):
            raise SearchError(f"memory budget must be a finite number > 0 (a fraction of FP32 bytes or bytes) or None, got {self.memory!r}")
        if self.accuracy is not None and not (_finite_number(self.accuracy) and self.accuracy >= 0):
            raise SearchError(f"accuracy budget must be a finite number >= 0 or None, got {self.accuracy!r}")

    def memory_bytes(self, fp32_bytes: float) -> float:
        if self.memory is None:
            return float("inf")
        return self.memory * fp32_bytes if self.memory <= 1 else float(self.memory)

    def loss_increase(self, baseline_loss: "float | None") -> float:
        if self.accuracy is None:
            return float("inf")
        if not self.accuracy_relative:
            return float(self.accuracy)
        if baseline_loss is None:
            raise SearchError("a relative accuracy budget needs the baseline (FP32) loss; pass baseline_loss or set accuracy_relative=False")
        return self.accuracy * abs(baseline_loss)


@dataclasses.dataclass(frozen=True)
class LayerRules:
    """User rules over layer names (``fnmatch`` patterns such as ``"blocks.*.attn.qkv"``).

    ``pin``: pattern -> the only format allowed. ``forbid``: pattern -> formats not allowed.
    ``groups``: each entry is a list of patterns; layers matching any pattern of one group share a
    format. Groups are literal: write one group per attention block. ``recompute``: patterns of
    the recompute units (`autoprec.blocks.find_blocks`, e.g. ``["blocks.*"]``); None: the blocks
    found automatically. Checked against the model when the job starts; the search does not
    choose recompute flags yet (a plan sets them: `autoprec.Plan.with_recompute`).
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
    choices: Mapping[Format, Choice]

    @property
    def formats(self) -> tuple[Format, ...]:
        return tuple(self.choices)


class SearchSpace:
    """Units (layers or groups) with their allowed formats and additive costs.

    ``table``: fqn -> {format: Choice} for every covered layer, in model order. Allowed formats
    are the table's formats within ``[min_precision, max_precision]`` bits, runnable on
    ``device``, and permitted by ``rules``. A layer left with no format is an error naming it.
    """

    def __init__(
        self,
        table: Mapping[str, Mapping[Format, Choice]],
        *,
        min_precision: int = 8,
        max_precision: int = 32,
        rules: LayerRules = LayerRules(),
        device=None,
        fixed: "Mapping[str, Choice] | None" = None,
    ):
        allowed_bits = set(formats_for_precision(min_precision, max_precision, Format))
        runnable = {f for f in Format if format_support(f, device).runnable}
        # Costs outside any layer (the rest of the step: norms, optimizer, ...), in every plan.
        self.fixed_total = ZERO
        for choice in (fixed or {}).values():
            self.fixed_total = self.fixed_total + _choice(choice)
        problems = []
        allowed: dict[str, list[Format]] = {}
        for fqn, options in table.items():
            formats = [Format.parse(f) for f in options]
            formats = [f for f in formats if f in allowed_bits and f in runnable]
            for pattern, fmt in rules.pin.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    formats = [f for f in formats if f is Format.parse(fmt)]
            for pattern, banned in rules.forbid.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    refused = {Format.parse(f) for f in banned}
                    formats = [f for f in formats if f not in refused]
            if not formats:
                problems.append(f"{fqn!r}: no format left (costed {[str(f) for f in options]}, precision {min_precision}..{max_precision} bits, rules, device)")
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

    def totals(self, assignment: Mapping[str, Format]) -> Choice:
        """Summed cost of ``assignment`` (unit name -> format), plus the fixed costs."""
        total = self.fixed_total
        for unit in self.units:
            total = total + unit.choices[Format.parse(assignment[unit.name])]
        return total

    def layer_formats(self, assignment: Mapping[str, Format]) -> dict[str, Format]:
        """fqn -> format for every layer, from a unit assignment."""
        return {fqn: Format.parse(assignment[unit.name]) for unit in self.units for fqn in unit.layers}

    def extreme(self, field: str) -> dict[str, Format]:
        """The assignment minimising one field (``bytes``, ``seconds`` or ``loss``) unit by unit."""
        return {u.name: min(u.choices, key=lambda f: getattr(u.choices[f], field)) for u in self.units}

    def uniform(self, fmt: Format) -> "dict[str, Format] | None":
        """Every unit in ``fmt``, or None when some unit may not take it."""
        fmt = Format.parse(fmt)
        if all(fmt in u.choices for u in self.units):
            return {u.name: fmt for u in self.units}
        return None

    def scaled(self, factors: Mapping[tuple[str, Format], Choice], fixed: Choice = Choice(1.0, 1.0, 1.0)) -> "SearchSpace":
        """This space with unit u's choice in format f multiplied field by field by
        ``factors[(u.name, f)]`` (1 where absent) and the fixed costs by ``fixed``: a corrected
        proxy (`search.refine`). Same units, names and formats."""
        one = Choice(1.0, 1.0, 1.0)

        def times(c: Choice, k: Choice) -> Choice:
            return Choice(c.bytes * k.bytes, c.seconds * k.seconds, c.loss * k.loss)

        out = copy.copy(self)
        out.units = tuple(dataclasses.replace(u, choices={f: times(c, factors.get((u.name, f), one)) for f, c in u.choices.items()}) for u in self.units)
        out.fixed_total = times(self.fixed_total, fixed)
        return out

    def __len__(self) -> int:
        return len(self.units)


def _choice(value) -> Choice:
    if isinstance(value, Choice):
        return value
    if isinstance(value, Mapping):
        return Choice(float(value["bytes"]), float(value["seconds"]), float(value["loss"]))
    return Choice(*(float(v) for v in value))
