"""Sensitivity: per (layer, format), the loss increase of running only that layer in that format.

One result type (`Sensitivity`, a mapping ``(fqn, Format) -> float`` split into parts), two ways
to get it:

- `estimate_sensitivity` (and `sensitivity_steps`, the same in units of work): the prediction the
  search uses. The default `FisherEstimator` adds a **forward term** (the Fisher-weighted error of
  the layer's output, as HAWQ-V2, Optimal Brain Compression and ModelOpt's ``auto_quantize``) and
  a **gradient term** (the steady-state loss of the gradient error the format adds); its
  docstring gives both formulas, their sources and their costs. Estimators are an extension
  point: subclass `SensitivityEstimator`.
- `measure_sensitivity`: the check, the real held-out loss with only that layer lowered (the
  runtime's own path) minus FP32's, split into the first-order part at the model's output and the
  second-order rest that the forward term predicts. `spearman` and `rank_agreement` compare the two.

Both run each layer under `apply_plan` with only that layer lowered, so FP8 scaling, INT8
calibration, the half output cast and emulation are the runtime's. Batches are kept in memory.

Modules: `problem` (the result type, the problem an estimator solves, recording and calibration
helpers), `fisher` (`FisherEstimator`, `estimate_sensitivity`, `adam_second_moment`), `upstream`
(the gradient term's sampled upstream part), `loss_increase` (`measure_sensitivity`,
`spearman`, `rank_agreement`).

May import the shared basics, `runtime` and `scaling`.
"""
from .fisher import FisherEstimator, adam_second_moment, estimate_sensitivity, sensitivity_steps
from .loss_increase import measure_sensitivity, rank_agreement, spearman
from .problem import Sensitivity, SensitivityEstimator, SensitivityProblem

__all__ = [
    "Sensitivity",
    "SensitivityProblem",
    "SensitivityEstimator",
    "FisherEstimator",
    "estimate_sensitivity",
    "sensitivity_steps",
    "adam_second_moment",
    "measure_sensitivity",
    "spearman",
    "rank_agreement",
]
