"""What the scheduler's off-path search work weighs, counted in model passes (never timed):
`unit_weight` per unit of work, `weighted` for a generator of such units, and `PASSES_PER_STEP`,
a training step's worth. `search.in_run.TrainingSearch.work` spends these counts in slices, so
the same units follow the same training steps however loaded the machine is."""

from __future__ import annotations

from typing import Any, Generator

__all__ = ["PASSES_PER_STEP", "unit_weight", "weighted"]

# A training step in model passes: its forward and backward take about three forwards' FLOPs
# (2N and 4N per token for N parameters, Kaplan et al. 2020, arXiv:2001.08361, section 2.1).
PASSES_PER_STEP = 3
# What an off-path unit weighs (`unit_weight`), in model passes. A look at the whole model or a
# forward and backward of one batch: its passes. A unit of one layer: a fixed part (its calls,
# quantization and hooks) plus its FLOPs as its share of the model's pass (1 / layers): making
# its runtimes (host work only); calibration (the layer's re-run under its INT8 runtime); a
# (layer, format) estimate (its forward and local backward, as a step's
# 1 + 2). The fixed part takes the same time however deep the model, while a pass grows with
# the layers: it is the lesser of a part of a pass (the most these units took on the 31-layer
# GPT of benchmarks/search_stall.py and issue 57's 4-block Llama, 2 CPU cores, torch 2.13: 0.15,
# 0.4 and 0.35 of a pass; 0.06 and 0.1 for the first two, the GPT's alone, ran 30 of them in one
# of the Llama's steps, 5x a plain one) and a
# number of *layer shares* (a pass's time over its layers; the most they took on issue 57's
# narrow Llama at 16 and 32 blocks: 22, 25 and 18, the same at both depths). In passes alone,
# the fixed part overstated a deep model's units by its depth (5x at 64 blocks: the search ran
# ~250 steps where ~50 were its share); in layer shares alone, a shallow model's (a 3-layer
# model's estimate weighed 7 passes). Planning weighs nothing.
# A whole-model unit: its passes, and the host work of the runtime or meter around them, which
# grows with the layers as a pass does (so its weight does not depend on depth): the forwards
# under a runtime and the saved-bytes meter (region and block bytes) took 3.1-4.8 passes on issue
# 57's narrow Llama at 4, 16 and 64 blocks (2 CPU cores without BF16 arithmetic, torch 2.13; a
# pass a third of the median safe step), the trace 3.3-4.1, the recorded batch (forward and
# backward, recording every call) 3.3-3.7; on another machine of the kind up to 1.4x that (a
# bytes forward's parts 1.7 plain steps in a 3-pass slice at 64 blocks): weighed by the most
# (6, 5 and 5). Counted at 1 pass they ran three to a slice: steps
# 10x a plain one at 64 blocks. Where a device runs BF16 faster or the layers are wider, these
# units take less than their weight: the search takes more steps, none longer. Each of these
# forwards runs in parts (`paced`: `FORWARD_PARTS`), each its share of the weight, so a slice
# holds parts of one, never all of it: whole, one took 1.2-2.5 plain steps in a step of its own.
# The sensitivity's setup (`"layers"`: its candidate plans validated, every layer and format)
# took 1.2 and 2.5 passes, its scopes (one traced forward) 1.2 and 2.2, and an INT8 calibration
# round's recorded forward (every layer's inputs kept) 1.4 and 2.5, on issue 57's narrow Llama
# at 4 and 16 blocks: they grow with the layers as a pass does. Counted as host work (0), 1.5 and
# one layer's re-run, they ran with the next units in one slice: 3x a step at 16 blocks. The
# sampled upstream term's forwards (`sensitivity.upstream`: every layer's inputs kept, no grad)
# are such a recorded forward.
# A row of the search space (`planner.space_steps`: one layer's range checks and modelled costs
# per format, host work only) took 0.3 ms on issue 57's narrow Llama at 64 blocks, about 5 layer
# shares, and about a tenth of a pass at 4 blocks; the space's indexing after its rows ("space
# assembly", labelled on the last row so the slice ends before it) about 2 passes at 64 blocks.
# Built in one unit, the space took 2-3 steps' time at once at 64 blocks (5x a step with it).
# A candidate's run off-path (`preflight`: a forward and backward under its runtime on the
# snapshot) weighs the recorded batch's passes and a region forward's runtime overhead: 4.5.
# A device-peak timing (`costs.calibration_steps`: 9 GEMM calls of one format, each sized to
# about 2 ms or less on a CPU, whatever the model) weighs a step: the 4-block Llama's step.
_WHOLE_MODEL_UNITS = {"trace": 5.0, "region bytes": 6.0, "block forward": 6.0, "scopes": 2.5, "recorded batch": 5.0, "peak": 3.0,
                      "layers": 2.5, "recorded forward": 2.5, "upstream direction": 2.5, "space assembly": 2.0, "preflight": 4.5}
# (fixed passes, fixed layer shares, layer passes)
_LAYER_UNITS = {"runtimes": (0.15, 22.0, 0.0), "calibration": (0.4, 25.0, 1.0), "space": (0.1, 6.0, 0.0)}
_LAYER_ESTIMATE = (0.35, 18.0, 3.0)
_HOST_UNITS = frozenset({"sites", "second moment", "solve", "block"})


def unit_weight(label: str, layers: int) -> float:
    """An off-path unit's weight in model passes, from the label it yields (the inner one for
    the sensitivity's units, whose (layer, format) estimates yield the layer's name) and the
    model's number of ``layers``. A count, never a timing, so `TrainingSearch.work` decides alike on every run
    and machine load; it follows the time as far as the table above fits the model and device
    (where a layer's host work weighs more than on the models measured, its units take more than
    their weight, and a slice more than its share of a step)."""
    if label in _WHOLE_MODEL_UNITS:
        return _WHOLE_MODEL_UNITS[label]
    if label in _HOST_UNITS:
        return 0.0
    fixed_passes, fixed_shares, passes = _LAYER_UNITS.get(label, _LAYER_ESTIMATE)
    layers = max(1, layers)
    return min(fixed_passes, fixed_shares / layers) + passes / layers


def weighted(steps: Generator[str, None, Any], stage: str, layers: int,
             paced: "tuple[str, float] | None" = None) -> Generator[tuple[str, float], None, Any]:
    """A generator's yields as ``(stage, weight of the unit its label names)`` (`unit_weight`);
    its return value. ``paced``: (the label of a unit run in parts, a part's share of it,
    `search.paced.Pacer.part`): each ``"part"`` label and that label, after the last part,
    weigh that share of the unit's weight."""
    label_of_paced, share = paced if paced is not None else ("", 1.0)
    while True:
        try:
            label = next(steps)
        except StopIteration as done:
            return done.value
        weight = unit_weight(label_of_paced if label == "part" else label, layers)
        yield stage, weight * share if label in ("part", label_of_paced) else weight

