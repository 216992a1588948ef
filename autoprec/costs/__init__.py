"""Costs: per (layer, format) memory bytes and time, for the search to trade against accuracy.

The concerns, one module each, over one shared trace:

- `trace`: one FP32 forward records every matrix product each layer runs (function, argument
  layouts, which arguments are weights) and what autograd saves, per layer;
- `memory`: bytes per (layer, format) from those shapes: weight copies, activations saved for
  backward, gradient buffers (checked against ``saved_tensors_hooks`` measurements in the tests);
- `times_cache`: the in-place times cached per model, device and scaling (JSON);
- `inplace`: seconds per (layer, format) measured in place, over real training steps under each
  format's uniform plan (what `CostModel.build` uses by default);
- `product_times`: seconds per (call, format), measured on the device by replaying each call under
  ``apply_plan`` (cached on disk), or a roofline estimate from datasheet peaks;
- `targets`: the rates of datasheet devices, and a device the plan is priced for that the machine
  is not (`TargetDevice`: a name or a JSON profile; which products run on a kernel there);
- `model`: `CostModel` (per-layer costs, plan totals, the FP32 bytes a memory budget is a
  fraction of), reported as `figures` (`LayerCost`, `PlanCost`, `BlockCost`); `autoprec.bench.ranking.check_uniform_ranking` checks its ranking against
  measured step times.

Typical use::

    costs = CostModel.build(model, batch, loss_fn=workload.loss)   # measures once, then cached
    costs.layer_cost("blocks.0.mlp.fc", "int8")                   # LayerCost(bytes..., seconds)
    costs.plan_cost(plan).step_seconds, costs.fp32_bytes()

May import the shared basics and `runtime` (its layers and kernels are what it times).
"""

from .inplace import InPlaceTimes, measure_in_place
from .memory import MemoryCost, call_path, layer_memory
from .figures import BlockCost, LayerCost, PlanCost
from .model import DEFAULT_FORMATS, CostModel
from .product_times import (
    MeasuredTimeModel,
    TimingSettings,
    RooflineTimeModel,
    TimeEstimate,
    TimeModel,
    calibrate_peaks,
    calibration_steps,
    default_cache_dir,
    device_key,
)
from .targets import PEAKS, TARGETS, DevicePeaks, TargetDevice, load_target
from .trace import LayerTrace, MatmulCall, ModelTrace, TensorSpec, saved_bytes_by_layer, trace_model

__all__ = [
    # cost model
    "CostModel",
    "TimingSettings",
    "LayerCost",
    "PlanCost",
    "BlockCost",
    "DEFAULT_FORMATS",
    # memory
    "MemoryCost",
    "layer_memory",
    "call_path",
    # time
    "InPlaceTimes",
    "measure_in_place",
    "TimeModel",
    "TimeEstimate",
    "MeasuredTimeModel",
    "RooflineTimeModel",
    "DevicePeaks",
    "PEAKS",
    # targets
    "TargetDevice",
    "TARGETS",
    "load_target",
    "calibrate_peaks",
    "calibration_steps",
    "device_key",
    "default_cache_dir",
    # trace
    "trace_model",
    "saved_bytes_by_layer",
    "ModelTrace",
    "LayerTrace",
    "MatmulCall",
    "TensorSpec",
]
