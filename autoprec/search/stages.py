"""One plan for the stages of a pipeline, each stage measured where it runs: `StageTable`,
`measure_stage`, `joint_plan`.

Under ``torch.distributed.pipelining`` no rank holds the whole model, and only the last stage
sees the loss. Each stage measures its own layers on its own rank: the cost model on the
stage's captured call (its input, as the schedule gave it), and the sensitivity on that call with
the gradient the schedule's backward brought to the stage's output (`LinearisedLoss`): its
gradients at every layer of the stage are the whole loss's (the chain rule from the stage's
output on), so each layer's estimate is the one a search of the whole model would make on that
micro-batch without the upstream gradient term (a stage holds none of the parameters before it:
`measure_stage`). The stages' tables (plain data, a few KiB per layer) are joined in stage order into
one search space, and one integer program chooses every layer's format and recompute flag
under a memory budget per stage (each stage's device holds its own layers: a fraction of that
stage's FP32 bytes, or the bytes given, per stage) and one accuracy budget over all of them
(relative to the loss the last stage saw), for the least predicted seconds of the slowest stage
(the stages run at once: the pipeline moves at its slowest stage's pace; `exact`'s memory
parts): `joint_plan`, run on one rank.

Costs per stage: one `measure_parts` on the stage (its cost model's timed steps when
``planning.measure``, its traced forwards, and the sensitivity's forward and weight-gradient
product per (layer, format)); the join and the program are linear in the pipeline's layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import torch.nn as nn

from .._generators import drain
from ..blocks import find_blocks
from ..coverage import LayerInfo
from ..errors import InfeasibleBudgetError
from ..formats import Format
from ..plan import Plan
from .exact import k_best
from .pipeline import estimate_alternatives, measure_parts
from .planner import LayerTable, block_reasons, format_options, in_budget_terms, layer_reasons, precision_of, table_steps
from .planning import Planning
from .space import MemoryPart, SearchSpace

__all__ = ["StageTable", "measure_stage", "joint_plan"]


@dataclasses.dataclass(frozen=True)
class StageTable:
    """What one stage measured: its ``index`` in the pipeline, its layers' `LayerTable` and its
    layers as the scheduler bound them (``fingerprint``)."""

    index: int
    table: LayerTable
    fingerprint: Mapping[str, LayerInfo]


def measure_stage(stage: nn.Module, call: Any, batches: Sequence[Any], loss_fn: Any, profile: Any, planning: Planning, *, index: int,
                  fingerprint: Mapping[str, LayerInfo], recompute: "Sequence[str] | None") -> StageTable:
    """``stage``'s table (module docstring): ``call`` its captured call, ``batches`` /
    ``loss_fn`` what its sensitivity differentiates (the last captured call and its output
    gradient, `LinearisedLoss`), ``profile`` its window's (formats it saw overflow are out),
    ``recompute`` the scheduler's ``recompute=`` (None: the stage's repeated blocks). The stage's
    weights and gradients are left as they were."""
    layers = list(fingerprint)
    blocks = find_blocks(stage, layers, recompute) if recompute != () else ()
    # No upstream term: a stage holds none of the parameters of the stages before it, so its
    # layers' input-gradient errors would reach only part of theirs (the first stage's all, the
    # last's least) and bias the joint plan toward lowering the late stages.
    costs, sensitivity = measure_parts(stage, call, batches[-1:], loss_fn, planning, cost_loss_fn=lambda m, _: loss_fn(m, batches[-1]).mean(), blocks=blocks,
                                       upstream=False)
    alternatives = estimate_alternatives(stage, call, batches[-1:], loss_fn, planning, costs.layers, upstream=False)
    table = drain(table_steps(costs, sensitivity, profile, formats=planning.formats, rules=planning.rules, precisions=planning.precisions(),
                              limits=planning.limits, alternatives=alternatives))
    return StageTable(index, table, dict(fingerprint))


def joint_plan(stages: Sequence[StageTable], planning: Planning, *, baseline_loss: Optional[float], device: Any, source: str,
               metadata: Mapping[str, Any]) -> Plan:
    """The plan of every stage's layers (module docstring): ``stages`` as each rank sent them
    (data-parallel copies of a stage send the same index; the first is taken), joined in stage
    order; the budgets are ``planning.budgets``, its memory budget per stage (`MemoryPart`) and
    its accuracy budget over the whole pipeline, relative to ``baseline_loss`` (the window's mean
    loss, which the last stage saw). Raises `InfeasibleBudgetError` (prefixed with ``source``) stating the
    smallest budgets the pipeline reaches."""
    distinct = {s.index: s for s in reversed(stages)}  # the first rank's copy of each stage
    ordered = [distinct[i] for i in sorted(distinct)]
    rows = {fqn: row for s in ordered for fqn, row in s.table.rows.items()}
    fixed = {f"stage {s.index}: {name}": choice for s in ordered for name, choice in s.table.fixed.items()}
    fp32_bytes = sum(float(s.table.fp32_bytes or 0.0) for s in ordered)
    # Each stage's device holds its own layers: one memory budget each (`MemoryPart`).
    parts = [MemoryPart(f"stage {s.index}", frozenset(s.table.rows), sum(c.bytes for c in s.table.fixed.values()), s.table.fp32_bytes,
                        sum(c.seconds for c in s.table.fixed.values())) for s in ordered]
    space = SearchSpace(rows, min_precision=planning.min_precision, max_precision=planning.max_precision, rules=planning.rules, device=device,
                        fixed=fixed, blocks=[b for s in ordered for b in s.table.blocks], fp32_bytes=fp32_bytes, parts=parts,
                        pairs=[p for s in ordered for p in s.table.pairs])
    budgets = planning.budgets
    memory = {part.name: budgets.memory_bytes(float(part.fp32_bytes or 0.0)) for part in parts}
    loss_budget = budgets.loss_increase(baseline_loss)
    try:
        solution = k_best(space, memory, loss_budget, 1, time_limit=planning.time_limit)[0]
    except InfeasibleBudgetError as exc:
        raise in_budget_terms(exc, fp32_bytes, baseline_loss if budgets.accuracy_relative else None, source) from None
    ruled_out = {fqn: why for s in ordered for fqn, why in s.table.ruled_out.items()}
    reasons = layer_reasons(space, solution.assignment, planning.rules, ruled_out)
    formats = space.layer_formats(solution.assignment)
    precisions = planning.precisions()
    layers = {fqn: precision_of(precisions, key, reasons[fqn]) for fqn, key in formats.items()}
    per_layer = {}
    stage_of = {fqn: part.name for part in parts for fqn in part.layers}  # which stage's budget pays for a later promotion
    for unit in space.units:
        share = len(unit.layers)
        chosen = unit.choices[solution.assignment[unit.name]]
        options = format_options(unit, solution.assignment[unit.name])
        for fqn in unit.layers:
            per_layer[fqn] = {"bytes": chosen.bytes / share, "seconds": chosen.seconds / share, "loss": chosen.loss / share, "options": options,
                              "stage": stage_of[fqn]}
    uniform = space.uniform(Format.FP32)  # None where a rule forbids FP32 somewhere
    per_stage = space.part_totals(solution.assignment, solution.recompute)
    # A step's seconds are the slowest stage's: the pipeline's pace (`SearchSpace.step_seconds`).
    predicted = {"bytes": solution.total.bytes, "seconds": solution.step_seconds, "loss_increase": solution.total.loss,
                 "fp32_bytes": fp32_bytes, "fp32_seconds": None if uniform is None else space.step_seconds(uniform), "layers": per_layer,
                 "bytes_per_stage": {name: t.bytes for name, t in per_stage.items()}, "seconds_per_stage": {name: t.seconds for name, t in per_stage.items()}}
    budgets_meta = {"memory": budgets.memory, "memory_bytes": sum(memory.values()), "memory_bytes_per_stage": memory, "accuracy": budgets.accuracy, "accuracy_relative": budgets.accuracy_relative,
                    "loss_increase": loss_budget, "baseline_loss": baseline_loss}
    meta = {**metadata, "pipeline_stages": len(ordered)}
    if space.blocks:
        meta["recompute_reasons"] = block_reasons(space, solution)
    if solution.gap:
        meta["optimality_gap"] = solution.gap
    fingerprint = {fqn: info for s in ordered for fqn, info in s.fingerprint.items()}
    return Plan(layers, fingerprint=fingerprint, budgets=budgets_meta, predicted=predicted, metadata=meta,
                blocks={b.name: b.name in solution.recompute for b in space.blocks})
