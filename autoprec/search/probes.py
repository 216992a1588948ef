"""The search's probe steps: which formats a layer may be probed in (`probe_formats`), the plans
of one probe cycle (`probe_plans`), a probe step's samples (`add_samples`), and the cost model of
what they measured (`probed_cost_model`). `search.in_run.TrainingSearch` runs them on training
steps; nothing here runs a step. Each is linear in the layers (a few dict lookups each, per
format)."""

from __future__ import annotations

import dataclasses
import fnmatch
import statistics
from typing import Any, Mapping, Optional, Sequence

import torch

from ..costs import CostModel, InPlaceTimes, RooflineTimeModel
from ..device import format_support
from ..formats import Format
from ..plan import Calibration, LayerPrecision, Plan
from .planner import range_reason
from .planning import RangeLimits
from .space import LayerRules

__all__ = ["PROBE_ROUNDS", "PROBED_PER_ROLE", "add_samples", "probe_formats", "probe_plans", "probed_cost_model"]

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


def add_samples(samples: dict[str, list[float]], rest: list[float], plan: Plan, roles: Mapping[str, str], blocks: Mapping[str, Sequence[str]],
                seconds: float, layer_seconds: Mapping[str, float], forward_seconds: "Optional[Mapping[str, float]]",
                block_seconds: "Optional[Mapping[str, float]]") -> None:
    """One probe step of ``plan`` (``seconds``, and its per-layer, per-layer forward and per-block
    forward seconds: `costs.inplace.StepTimer`) into ``samples`` (``"role|format"``,
    ``"forward|role|format"`` and ``"block|fqn"`` -> seconds, as `probed_cost_model` reads them)
    and ``rest`` (the step less its layers)."""
    for fqn, s in layer_seconds.items():
        samples.setdefault(f"{roles[fqn]}|{plan.layers[fqn].format.value}", []).append(s)
    rest.append(seconds - sum(layer_seconds.values()))
    if blocks and forward_seconds is not None and block_seconds is not None:
        for fqn, s in forward_seconds.items():
            samples.setdefault(f"forward|{roles[fqn]}|{plan.layers[fqn].format.value}", []).append(s)
        # A block's own ops (norms, residuals, attention glue): its forward less its layers',
        # the same in every format of the layers.
        for b, layers in blocks.items():
            if b in block_seconds:
                own = block_seconds[b] - sum(forward_seconds.get(fqn, 0.0) for fqn in layers)
                samples.setdefault(f"block|{b}", []).append(max(0.0, own))


def probed_cost_model(region: CostModel, trace: Any, known: "Optional[Mapping[str, float]]", layers: Sequence[str], roles: Mapping[str, str],
                      formats: Sequence[Format], precisions: Mapping[Format, LayerPrecision], blocks: bool) -> CostModel:
    """The cost model of every format: ``region``'s measured bytes, and the seconds per (role,
    format) the probes measured (``known``, keyed as `TrainingSearch` keeps them; None: roofline
    seconds, a search with ``measure_costs=False``). A (role, format) no probe ran (ruled out for
    every layer of the role, or not runnable) takes the role's FP32 seconds times that format's
    median ratio to FP32 over the roles that ran it. Recompute blocks (``blocks``: the search
    recomputes some) keep ``region``'s measured bytes; one more forward of a block costs its own
    ops' probe-measured seconds plus its layers' forwards (a layer's forward no probe timed: a
    third of its step, the 2:4 forward-to-backward FLOP count). O(layers x formats)."""
    in_place = {}
    known = known or {}
    rest = known.get("rest", 0.0)
    for fmt in formats if known else ():
        ratios = [known[f"{role}|{fmt.value}"] / known[f"{role}|fp32"] for role in set(roles.values())
                  if f"{role}|{fmt.value}" in known and known.get(f"{role}|fp32", 0) > 0]
        ratio = statistics.median(ratios) if ratios else 1.0
        layer_seconds = {}
        for fqn in layers:
            seconds = known.get(f"{roles[fqn]}|{fmt.value}")
            layer_seconds[fqn] = seconds if seconds is not None else known.get(f"{roles[fqn]}|fp32", 0.0) * ratio
        forward = {fqn: known.get(f"forward|{roles[fqn]}|{fmt.value}", layer_seconds[fqn] / 3) for fqn in layers} if blocks else {}
        in_place[fmt] = InPlaceTimes(rest + sum(layer_seconds.values()), layer_seconds, forward_seconds=forward)
    measured_blocks = {b: dataclasses.replace(cost, other_seconds=(known[f"block|{b}"],) * 2) if f"block|{b}" in known else cost
                       for b, cost in region.blocks.items()}
    return CostModel(trace, RooflineTimeModel(), formats=formats, rest_seconds=rest, in_place=in_place, blocks=measured_blocks,
                     precisions=precisions, rest_saved_bytes=(region.rest_saved_bytes[0], region.rest_saved_bytes[1]),
                     fp32_in_region_bytes=region.fp32_in_region_bytes, fp32_pair_bytes=region.fp32_pair_bytes,
                     low_saved_correction=region.low_saved_correction)
