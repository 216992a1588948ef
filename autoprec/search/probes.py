"""The search's probe steps: which formats a layer may be probed in (`probe_formats`) and the
plans of one probe cycle (`probe_plans`). `search.in_run.TrainingSearch` runs them on training
steps; nothing here runs a step. Both linear in the layers (a few dict lookups each)."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping, Sequence

import torch

from ..device import format_support
from ..formats import Format
from ..plan import Calibration, LayerPrecision, Plan
from .planner import range_reason
from .space import LayerRules, RangeLimits

__all__ = ["PROBE_ROUNDS", "PROBED_PER_ROLE", "probe_formats", "probe_plans"]

# Probe cycles: the first warms up (first calls of each kernel, INT8 calibration of one batch)
# and is not sampled; the other gives each probed (layer, format) one sample. Of a role's layers
# (a transformer's blocks) at most PROBED_PER_ROLE, spread over the model, cycle through the
# formats; the others run their widest allowed format. A probe step's extra time is what its
# slower formats cost, so it falls with the layers probed.
PROBE_ROUNDS = 2
PROBED_PER_ROLE = 3


def probe_formats(layers: Sequence[str], formats: Sequence[Format], profile: Any, device: torch.device,
                  rules: LayerRules = LayerRules(), precisions: "Mapping[Format, LayerPrecision] | None" = None,
                  limits: RangeLimits = RangeLimits()) -> dict[str, list[Format]]:
    """Per layer, the formats a probe step may run it in: runnable on ``device``, allowed by the
    ``rules`` (a pinned layer runs its pinned format only, a forbidden format never) and not ruled
    out by ``profile`` (`planner.range_reason`, each format as ``precisions`` plans it, under
    ``limits``: a probe must not skip a step the search could have foreseen)."""
    runnable = [f for f in formats if format_support(f, device).runnable]
    planned = {f: (precisions or {}).get(f) or LayerPrecision(f) for f in runnable}
    allowed = {}
    for fqn in layers:
        pinned = [Format.parse(f) for pattern, f in rules.pin.items() if fnmatch.fnmatchcase(fqn, pattern)]
        forbidden = {Format.parse(f) for pattern, fs in rules.forbid.items() if fnmatch.fnmatchcase(fqn, pattern) for f in fs}
        fmts = [f for f in runnable if f not in forbidden and (not pinned or f in pinned)]
        fmts = [f for f in fmts if f is Format.FP32 or profile is None or range_reason(profile, fqn, planned[f], limits) is None]
        allowed[fqn] = fmts or [pinned[0] if pinned else Format.FP32]
    return allowed


def probe_plans(layers: Sequence[str], roles: Mapping[str, str], blocks: Mapping[str, Any], allowed: Mapping[str, list[Format]],
                precisions: Mapping[Format, LayerPrecision], known: Mapping[str, float]) -> list[Plan]:
    """One probe cycle: step p runs the j-th probed layer of a role in its formats[(j + p) %
    n], so one step mixes formats and a cycle gives each probed (layer, format) one sample.
    A role probes at most `PROBED_PER_ROLE` of its layers, evenly spread; the others run
    their widest allowed format. INT8 calibrates on one batch (the warm-up cycle's). Empty
    when every (role, format) is ``known`` already (seconds by ``"role|format"``, as
    `TrainingSearch` keeps them). ``precisions``: each format as the search would plan it."""
    all_known = "rest" in known and all(f"block|{b}" in known for b in blocks)
    if all_known and all(f"{roles[fqn]}|{f.value}" in known and (not blocks or f"forward|{roles[fqn]}|{f.value}" in known)
                     for fqn, fmts in allowed.items() for f in fmts):
        return []
    members: dict[str, list[str]] = {}
    for fqn in layers:
        members.setdefault(roles[fqn], []).append(fqn)
    position = {}
    for fqns in members.values():
        stride = -(-len(fqns) // PROBED_PER_ROLE)  # ceil: 6 blocks probe blocks 0, 2 and 4
        for j, fqn in enumerate(fqns[::stride]):
            position[fqn] = j
    one_batch = Calibration(batches=1)
    probed: dict[Format, LayerPrecision] = {}  # one (frozen) precision per format, shared by its layers

    def probing(fmt: Format) -> LayerPrecision:
        if fmt not in probed:
            chosen = precisions.get(fmt, LayerPrecision(fmt))  # timed as the search would plan it
            probed[fmt] = dataclasses.replace(chosen, calibration=one_batch, reason="probe step of the search")
        return probed[fmt]

    plans = []
    for p in range(max(len(fmts) for fmts in allowed.values())):
        chosen_layers = {}
        for fqn in layers:
            fmts = allowed[fqn]
            chosen_layers[fqn] = probing(fmts[(position[fqn] + p) % len(fmts)] if fqn in position else max(fmts, key=lambda f: f.bits))
        plans.append(Plan(chosen_layers, metadata={"source": "DynamicPrecisionScheduler probe"}))
    return plans

