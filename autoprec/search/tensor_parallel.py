"""The search under tensor parallelism: which layers hold a sharded weight, and the formats they
may take.

A layer whose weight its forward sees as a DTensor (torch's ``ColwiseParallel`` /
``RowwiseParallel``; under FSDP2 x TP the weight FSDP2 gathers over its own mesh dimension and
leaves sharded over the other) runs its plan on local shards (`runtime.tensor_parallel`): FP32,
BF16, FP16, FP8 per tensor or per row and INT8 (calibrated or per row) on a real kernel, and
E4M3 block scaling (kernel or emulated GEMMs), on either split. What a sharded weight cannot run
(any other emulated product) is refused there at the first forward (`runtime.tensor_parallel.sharded_reason`, the one rule), so
the search must never propose it: `sharded_rules` forbids it on that layer (the probe steps never
run it, the integer program never picks it) and says why, in a sentence each candidate plan's
reason ends with (`noted`) and in one logged line.

The memory budget holds per rank: a trial step's saved bytes, metered on one rank, are that
rank's share, which the cost model (run on the unsharded copy, `replica.plain_copy`) does not
predict; `unsharded_bytes` states them as the same fraction of the unsharded step, so a plan
meets ``memory_budget`` when each rank's step holds at most that fraction of its safe step's
bytes, scaled to FP32 by the cost model.

Costs: one pass over the model's modules and parameters when a search starts; no collective, no
device work.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import logging
from typing import Any, Mapping, Sequence

import torch.nn as nn

from ..errors import SearchError
from ..formats import Format
from ..plan import Plan
from ..runtime.layers import kernel_reason
from ..runtime.tensor_parallel import sharded_reason
from .planning import Planning
from .space import LayerRules

__all__ = ["tensor_parallel_layers", "sharded_rules", "noted", "unsharded_bytes"]

logger = logging.getLogger(__name__)


def _mesh_dims(t: Any) -> int:
    """The mesh dimensions of a DTensor ``t``; 0 for a plain tensor."""
    mesh = getattr(t, "device_mesh", None)
    return mesh.ndim if mesh is not None and hasattr(t, "placements") else 0


def tensor_parallel_layers(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """The ``layers`` of ``model`` holding a parameter their forward sees as a DTensor: one
    placed by tensor parallelism. A layer FSDP2 manages (``fully_shard`` on it or on a module
    above it) counts only when its weight's mesh has more than FSDP2's dimension (FSDP2 x TP):
    FSDP2 alone gathers the weight whole before the forward. (HSDP's 2-D mesh counts too: its
    layers are then searched as if sharded, which is safe, only narrower.)"""
    from torch.distributed.fsdp import FSDPModule

    modules = dict(model.named_modules())
    managed = {fqn for fqn, m in modules.items() if isinstance(m, FSDPModule)}
    out = []
    for fqn in layers:
        module = modules.get(fqn)
        if module is None:
            continue
        parts = fqn.split(".") if fqn else []
        under_fsdp = any(".".join(parts[:i]) in managed for i in range(len(parts) + 1))
        dims = max((_mesh_dims(p) for p in module.parameters(recurse=False)), default=0)
        if dims > 1 or (dims == 1 and not under_fsdp):
            out.append(fqn)
    return out


def sharded_rules(model: nn.Module, layers: Sequence[str], planning: Planning) -> tuple[LayerRules, dict[str, str]]:
    """``planning.rules`` with, for each tensor-parallel layer (`tensor_parallel_layers`), the
    candidate formats a sharded weight cannot run forbidden, as ``planning`` would plan them
    (its ``scaling``) on the model's device; and per such layer the note saying which and why
    (none where every candidate runs). `SearchError` in one line when a rule pins such a layer
    to such a format."""
    sharded = tensor_parallel_layers(model, layers)
    if not sharded:
        return planning.rules, {}
    device = next(model.parameters()).device
    precisions = planning.precisions()
    refused = {f: why for f, p in precisions.items() if (why := sharded_reason(p, kernel_reason(p, device) if p.format.needs_scale else None))}
    for lp in planning.alternatives():  # a recipe is forbidden with its format only: refused as a whole
        if why := sharded_reason(lp, kernel_reason(lp, device) if lp.format.needs_scale else None):
            raise SearchError(f"the search weighs {lp.recipe} per layer, which tensor-parallel layer {next(iter(sharded))!r} cannot run ({why}); "
                              f"give {lp.format.value} one scaling and gradient format under tensor parallelism")
    if not refused:
        return planning.rules, {}
    rules = planning.rules
    for pattern, fmt in rules.pin.items():
        fmt = Format.parse(fmt)
        hit = next((fqn for fqn in sharded if fnmatch.fnmatchcase(fqn, pattern) and fmt in refused), None)
        if hit is not None:
            raise SearchError(f"rules pin {pattern!r} to {fmt.value}, but layer {hit!r}: {refused[fmt]}; pin it to "
                              "fp8_e4m3 (per-tensor), int8, bf16, fp16 or fp32, or leave it to the search")
    forbid: dict[str, list[Format]] = {k: [Format.parse(f) for f in v] for k, v in rules.forbid.items()}
    note = "; ".join(f"{f.value} not searched: {why}" for f, why in refused.items())
    for fqn in sharded:
        # The exact name, escaped: a layer's name is a pattern to fnmatch.
        forbid.setdefault(glob.escape(fqn), []).extend(refused)
    logger.info("autoprec: tensor parallelism: %d of %d layers hold a sharded weight; the search plans them in %s only (%s)",
                len(sharded), len(layers), ", ".join(f.value for f in precisions if f not in refused) or "none",
                "; ".join(f"{f.value}: {why}" for f, why in refused.items()))
    return dataclasses.replace(rules, forbid=forbid), {fqn: note for fqn in sharded}


def noted(plan: Plan, notes: Mapping[str, str]) -> Plan:
    """``plan`` with each named layer's reason ending in its note (`sharded_rules`)."""
    layers = {fqn: dataclasses.replace(lp, reason=f"{lp.reason}; {notes[fqn]}" if lp.reason else notes[fqn])
              for fqn, lp in plan.layers.items() if fqn in notes}
    return plan.with_layers(layers) if layers else plan


def unsharded_bytes(saved: int, safe: "tuple[Any, int] | None", outside: int) -> int:
    """A tensor-parallel rank's metered saved bytes ``saved`` (a trial step's) in the cost model's
    unsharded terms: scaled by the ratio of predicted to metered bytes of the safe step
    (``safe``: its format and metered bytes; ``outside``: metered less predicted, so predicted =
    metered - outside), i.e. the rank holds the same share of every plan's bytes as of the safe
    step's. Exact when sharding divides the saved activations alike in every plan; the
    replicated ones (a column-wise layer's input, the norms without sequence parallel) shrink
    with the formats as much as the sharded ones do, so it errs little. Without a metered safe
    step, ``saved - outside`` (the shift the unsharded search uses)."""
    if safe is None or safe[1] <= 0:
        return saved - outside
    return round(saved * (safe[1] - outside) / safe[1])
