"""Sensitivity: per (layer, format), the loss increase of running only that layer in that format.

Two ways to get it, with one result type (`Sensitivity`, a mapping ``(fqn, Format) -> float``):

`estimate_sensitivity` -- the prediction the search uses. Default estimator: `FisherEstimator`.

* **Forward term** (``forward``). The second-order Taylor expansion of the loss in a layer's
  output y, with the Hessian replaced by the empirical Fisher (Gauss-Newton) matrix, gives the
  loss increase of perturbing y by ``δ = y_q − y`` as ``½ δᵀ F δ`` -- the score of HAWQ-V2
  (arXiv:1911.03852, with the Hessian trace), Optimal Brain Compression (arXiv:2208.11580, layer
  by layer) and NVIDIA ModelOpt's ``auto_quantize`` (``Σ (dL/dy)² (y_q − y)²``, the diagonal). The
  first-order term is dropped: at a trained point the gradient averages to zero over the data.

  Scaling and blocks. For a loss that is the mean over N terms, ``L = (1/N) Σ_i ℓ_i``, the
  empirical Fisher is ``(1/N) Σ_i ∇ℓ_i ∇ℓ_iᵀ``; where a block B_i of the output feeds only term
  i, ``∇ℓ_i = N · dL/dy_{B_i}``, so ``½ δᵀFδ = (N/2) Σ_i (dL/dy_{B_i} · δ_{B_i})²``, averaged over
  batches, in units of the mean loss. A block is one token (a row of the last dimension) for a
  language model, one sequence for a sentence-embedding loss; ``fisher="auto"`` (default) picks
  the leading dimensions whose count is nearest to N (`_fisher_blocks`). The diagonal form
  ``(N/2) Σ (dL/dy)² δ²`` (``fisher="diagonal"``, ModelOpt's) drops the cross terms within a
  block, and so misses that a quantization error is correlated along a token (and along a
  sequence: the weight's rounding error is shared by every token); it under-predicted the
  measured second-order increase 3-10x and ranked worse on both models (figures in
  tests/test_sensitivity.py). N comes from the loss: a ``loss_fn`` returning per-term losses
  (``reduction="none"``) gives it as their count (their mean is the loss); a scalar loss takes
  ``loss_terms`` (an int or ``batch -> int``), else N = 1 (magnitudes too small by N).

  Where δ is taken (``site="parent"``, the default). A lowered layer hands the region's half
  dtype to the module that called it, whose own ops then run on half tensors too (GELU after a
  lowered ``fc``, the attention products of a module whose ``qkv`` is lowered). So the layer's
  caller (found by one traced forward; the layer itself when the model calls it directly) is
  re-run on its recorded FP32 inputs under `apply_plan` with a model-level plan in which only that
  layer is lowered and every other layer -- its children too -- stays FP32, and δ and dL/dy are
  taken at the caller's output. y_q therefore comes from the real runtime path: FP8 scaling,
  INT8 calibration (frozen first on the same batches, `_calibrate`), the BF16 output cast,
  emulation.
  Forward passes run in eval mode under ``torch.no_grad``, as the measured check does.

* **Gradient term** (``grad``). A format also changes the gradients: FP8 layers quantize the
  incoming gradient to E5M2, BF16/FP16 layers run backward in half precision, INT8 layers take the
  weight gradient from the INT8-saved activation (and, where emulated, the incoming gradient in
  INT8). Per batch, the gradient error ``e`` of every parameter is computed exactly, given the
  FP32 dL/dy at the site (times ``loss_scale``, as a loss scaler runs backward, then unscaled):
  the site's own (recursive) parameters from a local backward under the plan, every upstream
  parameter by pushing the input-gradient error back through the recorded
  FP32 graph (one vector-Jacobian product). Parameters downstream see changed gradients only
  through the forward error, which the forward term covers. Treating e as extra zero-mean
  gradient noise of covariance ``C = E[e eᵀ]``, SGD with learning rate η settles (quadratic
  model, small η) where the expected excess loss is ``(η/4) tr(C)``: the stationary covariance S
  solves ``HS + SH = ηC`` (Mandt, Hoffman & Blei, arXiv:1704.04289, eq. 11), so ``½ tr(HS) =
  (η/4) tr(C)`` whatever the curvature. With a diagonal preconditioner P (Adam: ``P = 1/(√v + ε)``,
  v the gradient second moment from the same batches) the same argument in ``P^{-1/2} θ`` gives
  ``(η/4) tr(P C)``; momentum leaves it unchanged to first order. Hence ``grad = (lr/4) · Σ_i P_i
  · mean_b(e_i²)``, for ``optimizer`` "adam" (default) or "sgd" and the given ``lr``. It is a
  steady-state estimate that no forward-only measurement validates; rank plans by the total.

`measure_sensitivity` -- the check: the real mean loss on held-out batches with only that layer
lowered (the runtime's own path), minus the FP32 loss, split into the first-order part at the
model's output (label noise: it dominates a few-batch measurement) and the second-order rest
(for a cross-entropy on logits exactly ``KL(p_fp32 ‖ p_q)``), which the forward term predicts.

`spearman` and `rank_agreement` compare the two.

Costs of `estimate_sensitivity`: three no-grad forwards to find layers and their callers; per
batch one FP32 forward + backward that records; per (layer, format, batch) one no-grad run of
the layer's caller. INT8 calibration adds ``Calibration.batches`` FP32 forwards (each INT8 layer
then replays its own inputs); the gradient term one forward + backward per batch (Adam's v)
and, per (layer, format, batch), a local backward and one partial backward of the model.
`measure_sensitivity`: one model forward per (layer, format, batch). On a CPU without INT8 matrix
units INT8 is the slow format (``torch._int_mm`` falls back to scalar code). Batches are kept in
memory.

Modules: `problem` (the result type, the problem an estimator solves, the recording and
calibration helpers), `fisher` (`FisherEstimator`, `estimate_sensitivity`), `measured`
(`measure_sensitivity`, `spearman`, `rank_agreement`).
"""

from .fisher import FisherEstimator, estimate_sensitivity, sensitivity_steps
from .measured import measure_sensitivity, rank_agreement, spearman
from .problem import Sensitivity, SensitivityEstimator, SensitivityProblem

__all__ = [
    "Sensitivity",
    "SensitivityProblem",
    "SensitivityEstimator",
    "FisherEstimator",
    "estimate_sensitivity",
    "sensitivity_steps",
    "measure_sensitivity",
    "spearman",
    "rank_agreement",
]
