"""From costs, sensitivity and a profile to a search space, and from a solution to a `Plan`.

The pieces the offline job (`job.run`) and the training-time scheduler share: the additive
table of (bytes, seconds, predicted loss) per (layer, format), less the formats a profile saw
overflow; and a plan whose every layer carries the reason for its format, in the figures the
search compared. With recompute blocks costed (`CostModel.blocks`) the space holds them
(`space.Block`) and a plan carries the search's recompute flags, each block with its reason.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Generator, Iterable, Mapping, Sequence

from ..coverage import LayerInfo
from ..errors import InfeasibleBudgetError
from ..formats import Format
from ..plan import LayerPrecision, Plan
from .solution import Solution
from .planning import RangeLimits
from .space import Block, Choice, ChoiceKey, LayerRules, Pair, SearchSpace, key_format, key_name

__all__ = ["OVERFLOW_LIMIT", "range_reason", "LayerTable", "table_steps", "space_steps", "layer_reasons", "block_reasons", "measured_reasons",
           "plan_from_solution", "format_options", "precision_of", "in_budget_terms"]

# A format is ruled out for a layer when the profile saw more than this fraction of a tensor
# overflow it (after the format's scaling), or more than the scheduler promotes a planned layer
# for (`RangeLimits.overflow`, 0.1 % by default), whichever is less. Overflow to inf (FP16, E5M2)
# poisons a step, so the limit is one value in 10^4; saturating formats (E4M3, INT8) clamp
# instead, which costs accuracy only in proportion (Micikevicius et al. 2022, "FP8 formats for
# deep learning", sec. 4: E4M3 saturates rare outliers harmlessly): their own limit is 1 %, for
# a scheduler whose thresholds allow that much.
OVERFLOW_LIMIT = {False: 1e-4, True: 1e-2}  # keyed by Format.spec.saturates


def range_reason(profile, fqn: str, precision: LayerPrecision, limits: RangeLimits = RangeLimits(), name: "str | None" = None) -> "str | None":
    """Why the profile rules ``precision``'s format out for layer ``fqn``, or None: a tensor kind
    (weight, activation, gradient), cast as ``precision`` casts it (`LayerPrecision.cast_of`),
    of which more overflowed than `OVERFLOW_LIMIT` or ``limits.overflow``, or more underflowed
    than ``limits.underflow``: what the scheduler promotes a planned layer for (`RangeLimits`).
    ``name``: what the reason calls the choice (default the format's name). Reads the profile's
    fractions: no tensor work."""
    if fqn not in profile.layers:
        return None
    fmt = precision.format
    name = name or fmt.value
    for kind, ts in profile.layers[fqn].tensors.items():
        kind_fmt, scaling = precision.cast_of(kind)
        if kind_fmt.value not in ts.fractions or scaling not in ts.fractions[kind_fmt.value]:
            continue
        fraction = ts.overflow(kind_fmt, scaling)
        if fraction > min(OVERFLOW_LIMIT[kind_fmt.spec.saturates], limits.overflow):
            return f"{name} ruled out: the profile saw {fraction:.2%} of its {kind} values overflow {kind_fmt.value}"
        fraction = ts.underflow(kind_fmt, scaling)
        if fraction > limits.underflow:
            return (f"{name} ruled out: the profile saw {fraction:.2%} of its {kind} values underflow {kind_fmt.value} "
                    f"(a planned layer is promoted past {limits.underflow:.0%})")
    return None


def space_steps(
    costs,
    sensitivity,
    profile,
    *,
    formats: Iterable[Format],
    rules: LayerRules = LayerRules(),
    min_precision: int = 8,
    max_precision: int = 32,
    precisions: "Mapping[Format, LayerPrecision] | None" = None,
    limits: RangeLimits = RangeLimits(),
    alternatives: Sequence[tuple[LayerPrecision, Any]] = (),
) -> Generator[str, None, tuple[SearchSpace, dict[str, list[str]]]]:
    """The search space of `table_steps`'s table, rules and precision bounds applied
    (`SearchSpace`). Returns the space and, per layer, the formats ruled out and why; yields as
    `table_steps` does, then ``"space assembly"`` before the space's own indexing (units, blocks:
    a pass's worth at depth, so a search inside training ends the slice there)."""
    table = yield from table_steps(costs, sensitivity, profile, formats=formats, rules=rules, precisions=precisions, limits=limits,
                                   alternatives=alternatives)
    yield "space assembly"
    space = SearchSpace(table.rows, min_precision=min_precision, max_precision=max_precision, rules=rules, device=costs.device, fixed=table.fixed,
                        blocks=table.blocks, fp32_bytes=table.fp32_bytes, pairs=table.pairs)
    return space, dict(table.ruled_out)


@dataclasses.dataclass(frozen=True)
class LayerTable:
    """A model's additive table before rules and bounds make it a `SearchSpace`: ``rows`` (fqn ->
    format -> `Choice`, in model order), ``ruled_out`` (fqn -> why formats are out), ``fixed``
    (the costs outside the layers, by name), ``blocks`` (the recompute `Block` s costed) and
    ``fp32_bytes`` (the all-FP32 plan's, None where the cost model has no figure). Plain data: a
    pipeline stage sends its table to the rank that plans for every stage (`search.stages`)."""

    rows: Mapping[str, Mapping[ChoiceKey, Choice]]
    ruled_out: Mapping[str, list[str]]
    fixed: Mapping[str, Choice]
    blocks: tuple[Block, ...]
    fp32_bytes: "float | None"
    pairs: tuple[Pair, ...] = ()  # FP32 layers that hold less together (`CostModel.fp32_pair_bytes`)


def table_steps(
    costs,
    sensitivity,
    profile,
    *,
    formats: Iterable[Format],
    rules: LayerRules = LayerRules(),
    precisions: "Mapping[Format, LayerPrecision] | None" = None,
    limits: RangeLimits = RangeLimits(),
    alternatives: Sequence[tuple[LayerPrecision, Any]] = (),
) -> Generator[str, None, LayerTable]:
    """The additive table of ``costs`` (a `CostModel`) and ``sensitivity`` (predicted loss per
    (layer, format)) over ``formats``, less the formats whose range ``profile`` (a `Profile` or
    None) saw too many values leave (`range_reason`: each format as ``precisions`` plans it, the
    default `LayerPrecision` where absent; ``limits``) and those whose run raised in the
    sensitivity estimate (its ``metadata["failed"]``), unless a rule pins the layer.
    ``alternatives``: other recipes of the formats (`Planning.alternatives`), each with the
    estimate that scored it (keyed by its format), made choices of their own keyed by their
    `LayerPrecision` (`space.choice_key`): bytes their own, seconds their format's as costed
    (the cost model times one recipe per format). Each block ``costs`` has costed (`CostModel.blocks`) is a
    recompute `Block` of the table: per layer and format its modelled saved bytes (what
    recomputation frees; its gradients and its FP32-in-region extra stay) and its forward seconds,
    and the block's own ops in the lowered region (as the fixed cost below). ``rules`` only keep
    a pinned layer's formats here (`SearchSpace` applies them). A generator: it yields ``"space"`` after each
    layer's row (host work: its range checks and its costs per format, O(formats)), so a search
    inside training spreads it over steps (at 64 decoder layers, in one unit, it took about 3
    steps' time at once)."""
    table: dict[str, dict[ChoiceKey, Choice]] = {}
    ruled_out: dict[str, list[str]] = {}
    formats = tuple(Format.parse(f) for f in formats)
    planned = {f: (precisions or {}).get(f) or LayerPrecision(f) for f in formats}
    # Each choice: its key, the precision it plans and the estimate that scored it.
    options = [(f, planned[f], sensitivity) for f in formats] + [(lp, lp, est) for lp, est in alternatives if lp.format in planned]
    for fqn in costs.layers:
        pinned = any(fnmatch.fnmatchcase(fqn, p) for p in rules.pin)
        row = {}
        for key, precision, estimate in options:
            fmt, name = precision.format, key_name(key)
            reason = range_reason(profile, fqn, precision, limits, name) if fmt is not Format.FP32 and profile is not None else None
            if reason is not None and not pinned:
                ruled_out.setdefault(fqn, []).append(reason)
                continue
            # (layer, format) pairs whose run raised in the sensitivity estimate (`failing_formats`).
            failure = (getattr(estimate, "metadata", None) or {}).get("failed", {}).get(fqn, {}).get(fmt.value)
            if failure is not None and not pinned:
                ruled_out.setdefault(fqn, []).append(f"{name} ruled out: the layer's code fails in it ({failure})")
                continue
            lc = costs.layer_cost(fqn, key)
            loss = 0.0 if fmt is Format.FP32 else max(0.0, float(estimate[(fqn, fmt)]))
            if not math.isfinite(loss) and not pinned:
                # The estimate's loss overflowed in this format (a CTC loss of an FP16 head, say):
                # the format is out for this layer, not the whole search.
                ruled_out.setdefault(fqn, []).append(f"{name} ruled out: its predicted loss increase is not finite ({loss})")
                continue
            # An FP32 layer among lowered ones costs its neighbours' FP32 saves too (CostModel).
            extra = costs.fp32_in_region_bytes.get(fqn, 0) if fmt is Format.FP32 else 0
            row[key] = Choice(lc.bytes + extra, lc.seconds, loss)
        table[fqn] = row
        yield "space"
    # What ops outside the layers save depends on whether any layer is lowered (activations
    # between layers are then 2 bytes wide); the fixed cost takes the lowered figure, exact for
    # every plan but all-FP32 (whose totals `CostModel.plan_cost` reports exactly). The gradient
    # buffers of parameters outside every layer are the same in every plan.
    fixed = {"rest of the step": Choice(costs.rest_saved_bytes[1] + costs.trace.rest_grad_bytes, costs.rest_seconds, 0.0)}
    blocks = []
    for fqn, block in getattr(costs, "blocks", {}).items():
        freed = {layer: {f: float(costs.layer_cost(layer, f).saved_bytes) for f in table[layer]} for layer in block.layers}
        forward = {layer: {f: costs.layer_forward_seconds(layer, key_format(f)) for f in table[layer]} for layer in block.layers}
        blocks.append(Block(fqn, freed, forward, other_bytes=float(block.other_bytes[1]), other_seconds=float(block.other_seconds[1]),
                            fp32_other_bytes=float(block.other_bytes[0]), fp32_other_seconds=float(block.other_seconds[0])))
        yield "space"
    pairs = tuple(Pair(fqn, before, float(nbytes)) for (fqn, before), nbytes in getattr(costs, "fp32_pair_bytes", {}).items() if fqn in table and before in table)
    return LayerTable(table, ruled_out, fixed, tuple(blocks), costs.fp32_bytes() if hasattr(costs, "fp32_bytes") else None, pairs)


def layer_reasons(space: SearchSpace, assignment: Mapping[str, ChoiceKey], rules: LayerRules, ruled_out: Mapping[str, list[str]]) -> dict[str, str]:
    """Per layer: why its unit got this format, in the figures the search compared."""
    rules_note = _pin_notes(rules, space)
    out = {}
    for unit in space.units:
        fmt = assignment[unit.name]
        chosen = unit.choices[fmt]
        head = f"{key_name(fmt)}: {chosen.seconds * 1e3:.3g} ms, {chosen.bytes / 1024:.0f} KiB, predicted loss +{chosen.loss:.2g}"
        faster = [f for f, c in unit.choices.items() if c.seconds < chosen.seconds]
        if len(unit.choices) == 1:
            why = "the only format allowed (" + rules_note.get(unit.name, "precision bounds, rules, device and profile") + ")"
        elif not faster:
            smaller = [f for f, c in unit.choices.items() if c.bytes < chosen.bytes]
            why = "the fastest allowed format" + (f"; smaller {', '.join(key_name(f) for f in smaller)} not needed within the memory budget" if smaller else "")
        else:
            alt = min(faster, key=lambda f: unit.choices[f].seconds)
            d = unit.choices[alt]
            costs = []
            if d.bytes > chosen.bytes:
                costs.append(f"needs {(d.bytes - chosen.bytes) / 1024:+.0f} KiB (memory budget)")
            if d.loss > chosen.loss:
                costs.append(f"adds predicted loss {d.loss - chosen.loss:+.2g} (accuracy budget)")
            why = f"{key_name(alt)} would be {(chosen.seconds - d.seconds) * 1e3:.3g} ms faster " + (
                "but " + " and ".join(costs) if costs else "at no more bytes or loss (this candidate is not the predicted optimum)")
        notes = [n for fqn in unit.layers for n in ruled_out.get(fqn, [])]
        group = f"; shares its format with {', '.join(unit.layers)} (rule group)" if len(unit.layers) > 1 else ""
        text = f"{head}; {why}{group}" + ("; " + "; ".join(dict.fromkeys(notes)) if notes else "")
        for fqn in unit.layers:
            out[fqn] = text
    return out


def block_reasons(space: SearchSpace, solution: Solution) -> dict[str, str]:
    """Per recompute block of ``space``: why ``solution`` recomputes it or keeps it, in the bytes
    it frees and the seconds its extra forward costs with the solution's formats."""
    out = {}
    for block in space.blocks:
        effect = space.recompute_effect(solution.assignment, [block.name])
        figures = f"{-effect.bytes / 1024:.0f} KiB of activations for {effect.seconds * 1e3:.3g} ms more per step (its forward once more in the backward)"
        if block.name in solution.recompute:
            out[block.name] = f"recomputed: frees {figures}; the memory budget needs the bytes more than the step needs the time"
        else:
            out[block.name] = f"kept: recomputing would free {figures}; not needed within the memory budget"
    return out


def measured_reasons(reasons: Mapping[str, str], formats: Mapping[str, ChoiceKey], optimum: Mapping[str, ChoiceKey], evidence: str) -> dict[str, str]:
    """``reasons`` (`layer_reasons`) of a plan the learning sampler proposed, each layer whose
    format in ``formats`` differs from the proxy's optimum (``optimum``: its layer formats) marked
    as decided by a measurement, with ``evidence`` (what was measured, in words)."""
    out = dict(reasons)
    for fqn, fmt in formats.items():
        if fqn in optimum and optimum[fqn] != fmt:
            out[fqn] = (f"{out[fqn]}; decided by measurement, not the proxy: {evidence}; the proxy's optimum has "
                        f"{key_name(optimum[fqn])} here (learning sampler: the proxy corrected by the measured trials)")
    return out


def _pin_notes(rules: LayerRules, space: SearchSpace) -> dict[str, str]:
    notes = {}
    for unit in space.units:
        for pattern, fmt in rules.pin.items():
            if any(fnmatch.fnmatchcase(fqn, pattern) for fqn in unit.layers):
                notes[unit.name] = f"pinned to {Format.parse(fmt).value} by [rules].pin {pattern!r}"
    return notes


def plan_from_solution(
    space: SearchSpace, costs, solution: Solution, reasons: Mapping[str, str], budgets: Mapping, metadata: Mapping,
    fingerprint: "Mapping[str, LayerInfo] | None" = None,
) -> Plan:
    """The plan of ``solution`` with its reasons and predicted totals and per-layer figures;
    ``fingerprint`` (`find_layers` of the model) lets `Plan.validate` refuse another model."""
    formats = space.layer_formats(solution.assignment)
    layers = {fqn: precision_of(costs, formats[fqn], reasons[fqn]) for fqn in costs.layers}
    # Every block of the space is named, recomputed or not, so the review lists the choice for each.
    blocks = {b.name: b.name in solution.recompute for b in space.blocks}
    plan = Plan(layers, blocks=blocks)
    predicted_cost = costs.plan_cost(plan)
    freed = {layer: block.freed[layer] for block in space.blocks if block.name in solution.recompute for layer in block.layers}
    per_layer = {}
    for unit in space.units:
        choice = unit.choices[solution.assignment[unit.name]]
        for fqn in unit.layers:
            lc = predicted_cost.layers[fqn]
            # Every format the search allowed the layer, in the solver's terms (a recomputed
            # block's layer holds what recomputation does not free).
            options = format_options(unit, solution.assignment[unit.name], freed.get(fqn, {}))
            per_layer[fqn] = {"bytes": lc.bytes, "seconds": lc.seconds, "loss": choice.loss / len(unit.layers), "options": options}
    fp32 = costs.plan_cost(costs.uniform_plan(Format.FP32))
    predicted = {
        "bytes": predicted_cost.bytes,
        "seconds": predicted_cost.step_seconds,
        "loss_increase": solution.total.loss,
        "fp32_bytes": fp32.bytes,
        "fp32_seconds": fp32.step_seconds,
        "layers": per_layer,
    }
    target = getattr(costs, "target", None)
    if target is not None:
        # Priced for a device the machine is not: what is measured later (loss, bytes) is this
        # machine's; the seconds never are.
        predicted["seconds_for"] = f"{target.name}: roofline at its {target.peaks.source} rates, predicted, not measured (the layers' matrix products only)"
        metadata = {**metadata, "target": target.to_dict()}
    if space.blocks:
        predicted.update(recompute_freed_bytes=predicted_cost.recompute_freed_bytes, recompute_seconds=predicted_cost.recompute_seconds)
        metadata = {**metadata, "recompute_reasons": block_reasons(space, solution)}
    if solution.gap:
        metadata = {**metadata, "optimality_gap": solution.gap}  # proven by the solver: within this fraction of the optimum
    return Plan(layers, fingerprint=fingerprint, budgets=budgets, predicted=predicted, metadata=metadata, blocks=blocks)


def format_options(unit, chosen: ChoiceKey, freed: "Mapping[ChoiceKey, float] | None" = None) -> dict[str, dict[str, float]]:
    """One layer's share of ``unit`` 's choices per format (format name -> "bytes", "loss"; less
    the bytes ``freed`` by recomputation, by choice): what a plan's predicted layers hold for a
    promotion to be paid with (`scheduler.promotion_bytes`). Promotions change formats: of a
    format's recipes, the ``chosen`` one where the layer has that format, else the first allowed."""
    share, freed = len(unit.layers), freed or {}
    options: dict[str, dict[str, float]] = {}
    for key, c in sorted(unit.choices.items(), key=lambda item: item[0] != chosen):
        options.setdefault(key_format(key).value, {"bytes": c.bytes / share - freed.get(key, 0.0), "loss": c.loss / share})
    return options


def precision_of(costs, key, reason: str = "") -> LayerPrecision:
    """The `LayerPrecision` a layer planned in choice ``key`` gets (`space.choice_key`): an
    alternative recipe's own, else its format's as ``costs`` plans it (a `CostModel`, or a
    format -> `LayerPrecision` table: `Planning.precisions`)."""
    if isinstance(key, LayerPrecision):
        return dataclasses.replace(key, reason=reason)
    if isinstance(costs, Mapping):
        return dataclasses.replace(costs.get(key) or LayerPrecision(key), reason=reason)
    return costs.precision(key, reason)


def in_budget_terms(exc: InfeasibleBudgetError, fp32_bytes: float, baseline_loss: "float | None", where: str) -> InfeasibleBudgetError:
    """``exc`` restated in the units budgets are given in: a fraction of the FP32 bytes and,
    with a baseline loss, a relative loss increase (where the memory budget was met: below its
    floor, the least loss was taken with that budget dropped, which the all-FP32 plan meets)."""
    missed_memory = exc.formats_floor is not None
    loss_note = f", a relative loss increase of {exc.min_loss / abs(baseline_loss):.4g}" if baseline_loss and not missed_memory else ""
    memory = f"memory {exc.min_bytes / fp32_bytes:.3f} of the FP32 bytes"
    if exc.formats_floor is not None and exc.recompute_floor is not None:
        memory = f"memory {exc.formats_floor / fp32_bytes:.3f} of the FP32 bytes with formats alone, {exc.recompute_floor / fp32_bytes:.3f} with blocks recomputed"
    elif exc.formats_floor is not None:
        memory = f"memory {exc.formats_floor / fp32_bytes:.3f} of the FP32 bytes with formats alone"
    return InfeasibleBudgetError(f"{where}{exc} (as budgets: {memory}{loss_note})", exc.min_bytes, exc.min_loss,
                                 formats_floor=exc.formats_floor, recompute_floor=exc.recompute_floor, fp32_bytes=fp32_bytes)


def floor_settings(exc: InfeasibleBudgetError, *, memory: str, recompute: str, recompute_off: bool) -> str:
    """The settings that reach each memory floor of ``exc`` (stated in budget terms:
    `in_budget_terms`), in the caller's names (``memory``: the budget's setting; ``recompute``:
    the one that turns recomputation off; ``recompute_off``: the caller turned it off). Empty
    when the memory budget was not the one missed."""
    fp32_bytes = exc.fp32_bytes
    if exc.formats_floor is None or not fp32_bytes:
        return ""
    alone = f"{memory} >= {exc.formats_floor / fp32_bytes:.3f} is met by formats alone"
    if exc.recompute_floor is not None:
        return f"{alone}, {memory} >= {exc.recompute_floor / fp32_bytes:.3f} by recomputing blocks as well"
    if recompute_off:
        return f"{alone}; {recompute} turned recomputation off: drop it to let the search recompute blocks and go lower"
    return f"{alone}; the model has no repeated blocks to recompute ({recompute} names them by pattern)"
