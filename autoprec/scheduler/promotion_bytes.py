"""What a promotion adds to the plan's bytes, and the lowerings that pay for it: `paid_for`,
`repredicted`.

A promotion (`policy.promotions`: overflow, underflow, non-finite gradients, a measured loss
over the budget) widens a layer the search had fitted into the memory budget, so the plan in
force would hold more than the budget allows: an INT8 layer of a tiny Doge promoted to BF16 for
its activations' underflow took a plan measured at 0.600 of the FP32 bytes to 0.610
(tests/models/test_arch_sweep.py), and so did one whose prediction fitted while the bytes the
trials measured beyond it did not. The plan carries, per layer, every format the search allowed
it with its predicted bytes and loss (`Plan.predicted["layers"][fqn]["options"]`, written by
`planner.plan_from_solution`); with those the promotion is paid for by lowering other layers
to formats the search allowed them, the least predicted loss per byte freed first, within the
plan's accuracy budget. Layers the policy promoted before are never lowered to pay (they would
flap). A plan without those figures (saved before them) cannot be paid for: it is promoted, the
excess estimated from its layers' bytes scaled by the formats' widths (for the warning); a plan
without predicted bytes (made by hand) is left as promoted.

Under a pipeline the plan is searched with a memory budget per stage (`search.stages`), and a
promotion on one stage is paid for by lowerings on that stage (`_over_budget`).

Plain arithmetic on the plan's figures: O(layers x formats) per promotion, no tensor work.
"""

from __future__ import annotations

import math
from typing import Any, Collection, Mapping, Optional

from ..changes import PrecisionChange
from ..formats import Format
from ..plan import Plan

__all__ = ["paid_for", "repredicted"]


def _figure(row: Mapping[str, Any], fmt: Format, name: str) -> Optional[float]:
    """A layer's predicted ``name`` ("bytes", "loss") in ``fmt`` from its search options; None
    when the search did not allow it that format (or the plan has no options)."""
    option = (row.get("options") or {}).get(fmt.value)
    value = option.get(name) if isinstance(option, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _bytes(row: Mapping[str, Any], old: Format, new: Format) -> Optional[float]:
    """The layer's predicted bytes in ``new``: its option's, else its bytes in ``old`` scaled by
    the widths (a format the search never costed for it: a promotion to a format ruled out)."""
    value = _figure(row, new, "bytes")
    if value is not None:
        return value
    held = _figure(row, old, "bytes")
    if held is None and isinstance(row.get("bytes"), (int, float)):
        held = float(row["bytes"])
    return None if held is None else held * new.bits / old.bits


def _over_budget(plan: Plan, rows: Mapping[str, Any], total: float, limit: float) -> tuple[dict[str, float], dict[str, str]]:
    """The predicted bytes ``plan`` holds over its memory budget (negative: under it), per part
    the budget bounds, and each layer's part. A plan searched on pipeline stages has one budget
    per stage (``budgets["memory_bytes_per_stage"]``, its layers' ``stage``): a stage's device
    holds its own layers, so only its own lowerings pay for its promotions. Any other plan is one
    part, ``""``: its bytes plus what the training steps measured beyond them
    (``measured["bytes_over_predicted"]``, written when the search adopted it) against the
    budget it was searched under, else its predicted bytes against the budget over the search's
    learned ``memory_margin``."""
    margin = float((plan.metadata or {}).get("memory_margin", 1.0))
    stages, held = (plan.budgets or {}).get("memory_bytes_per_stage"), (plan.predicted or {}).get("bytes_per_stage")
    if isinstance(stages, Mapping) and isinstance(held, Mapping) and all((row or {}).get("stage") in stages for row in rows.values()):
        return ({name: float(held.get(name, 0.0)) - float(cap) / margin for name, cap in stages.items()},
                {fqn: row["stage"] for fqn, row in rows.items()})
    # A tiny Doge was adopted measured at 315,304 bytes, 12,040 over its prediction and 965 under
    # its limit: a promotion predicted to fit took its planned step to 0.61 of FP32's at 0.6.
    excess = (plan.measured or {}).get("bytes_over_predicted")
    if isinstance(excess, (int, float)) and math.isfinite(excess):
        return {"": total + max(0.0, float(excess)) - limit}, {}
    return {"": total - limit / margin}, {}


def paid_for(plan: Plan, promoted: Mapping[str, Format], keep: Collection[str], step: int) -> tuple[list[PrecisionChange], float]:
    """Lowerings of other layers that keep ``plan`` within its memory budget once the layers of
    ``promoted`` (fqn -> the format it is promoted to) are widened, and the predicted bytes it
    still holds over the budget after them (0.0 when within; also when the plan has no budget
    or no per-format figures). ``keep``: layers never lowered (those the policy promoted).

    The budget is the one the plan was searched under, per pipeline stage for a plan searched
    on the stages (`_over_budget`). Each layer moves at most once, to the format of its options
    with the least predicted loss per byte freed, while the plan's predicted loss stays within
    ``budgets["loss_increase"]``; only layers of a part over its budget move."""
    predicted, budgets = plan.predicted or {}, plan.budgets or {}
    rows, total, limit = predicted.get("layers") or {}, predicted.get("bytes"), budgets.get("memory_bytes")
    if not promoted or not isinstance(total, (int, float)) or not isinstance(limit, (int, float)):
        return [], 0.0
    over, part_of = _over_budget(plan, rows, float(total), float(limit))
    loss = float(predicted.get("loss_increase") or 0.0)
    for fqn, new in promoted.items():
        row, old = rows.get(fqn) or {}, plan.layers[fqn].format
        before, after = _bytes(row, old, old), _bytes(row, old, new)
        if before is None or after is None:
            return [], 0.0  # the plan cannot say what the promotion costs
        over[part_of.get(fqn, "")] += after - before
        loss += (_figure(row, new, "loss") or 0.0) - (_figure(row, old, "loss") or 0.0)
    if all(value <= 0 for value in over.values()):
        return [], 0.0
    allowed = budgets.get("loss_increase")
    allowed = float(allowed) if isinstance(allowed, (int, float)) else math.inf
    moves = []  # (loss per byte freed, -bytes freed, fqn, format, bytes freed, loss added)
    for fqn, row in rows.items():
        if fqn in promoted or fqn in keep or fqn not in plan.layers or over[part_of.get(fqn, "")] <= 0:
            continue
        current = plan.layers[fqn].format
        held, held_loss = _figure(row, current, "bytes"), _figure(row, current, "loss")
        if held is None or held_loss is None:
            continue
        for name in row.get("options") or {}:
            fmt = Format.parse(name)
            freed, added = held - (_figure(row, fmt, "bytes") or held), max(0.0, (_figure(row, fmt, "loss") or 0.0) - held_loss)
            if fmt is not current and freed > 0:
                moves.append((added / freed, -freed, fqn, fmt, freed, added))
    changes: list[PrecisionChange] = []
    moved: set[str] = set()
    names = ", ".join(sorted(promoted))
    for _, _, fqn, fmt, freed, added in sorted(moves, key=lambda m: m[:3]):
        part = part_of.get(fqn, "")
        if over[part] <= 0 or fqn in moved or loss + added > allowed:
            continue
        moved.add(fqn)
        over[part] -= freed
        loss += added
        changes.append(PrecisionChange(step, fqn, plan.layers[fqn].format, fmt, f"pays for the promotion of {names} within the memory budget"))
    return changes, sum(max(0.0, value) for value in over.values())


def repredicted(plan: Plan, old: Plan) -> dict:
    """``plan``'s predicted figures, from ``old``'s (the plan it was changed from): each changed
    layer's bytes and loss from its options, the totals moved by the differences. Layers without
    options keep ``old``'s figures (their change is then unpriced). A copy; ``old`` unchanged."""
    predicted = dict(old.predicted or {})
    rows = dict(predicted.get("layers") or {})
    if not rows or not isinstance(predicted.get("bytes"), (int, float)):
        return predicted
    for fqn, lp in plan.layers.items():
        before = old.layers.get(fqn)
        row = rows.get(fqn)
        if before is None or row is None or lp.format is before.format:
            continue
        held, was = _bytes(row, before.format, lp.format), _bytes(row, before.format, before.format)
        if held is None or was is None:
            continue
        loss, lost = _figure(row, lp.format, "loss"), _figure(row, before.format, "loss")
        predicted["bytes"] = float(predicted["bytes"]) + held - was
        stages = predicted.get("bytes_per_stage")
        if isinstance(stages, Mapping) and row.get("stage") in stages:  # a plan searched on pipeline stages
            predicted["bytes_per_stage"] = {**stages, row["stage"]: float(stages[row["stage"]]) + held - was}
        row = {**row, "bytes": held}
        if loss is not None and lost is not None:
            predicted["loss_increase"] = float(predicted.get("loss_increase") or 0.0) + loss - lost
            row["loss"] = loss
        rows[fqn] = row
    predicted["layers"] = rows
    return predicted
