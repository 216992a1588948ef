"""Per-layer statistics over a monitor window: `LayerProfiler` gathers them, `Profile` keeps them.

Modules: `stats` (histograms, format fractions, per-tensor and gradient statistics), `artifact`
(the `Profile` and its JSON), `profiler` (`LayerProfiler`, the hooks), `drivers` (profiling the
built-in workload's training steps). TensorBoard writing is `autoprec.monitoring.profile`, the
overhead benchmark `autoprec.bench.measure_overhead`.

The profiler watches every covered layer (the runtime's rule: `autoprec.coverage.find_layers`)
for ``window`` optimizer steps and records, per layer:

- **gradient mean, variance and noise-to-signal ratio** of the layer's own parameters, streamed
  over every step with Welford's algorithm per element (``mean``/``M2`` on the device):
  ``var`` is the mean over elements of the unbiased variance across steps, and
  ``nsr = E‖g − ḡ‖² / ‖ḡ‖²``. Times the batch size it estimates the "simple noise scale"
  ``tr(Σ)/|G|²`` of McCandlish et al. 2018 (arXiv:1812.06162), whose Σ is per example;
- for three **tensor kinds** — ``weight`` (the layer's own parameters of two or more dimensions,
  the operands its matrix product reads), ``activation`` (the layer's input: the first floating
  tensor among its arguments) and ``grad`` (the gradient of the layer's output, what an FP8
  layer quantizes to E5M2 in backward): the per-step amax history, histograms of ``|x|``, the
  fractions of values that would underflow / overflow each candidate format after that format's
  scaling, the mean and variance of the values, and non-finite counts.

Costs (the point of the design):

- **No host-device sync per step.** Every accumulator is a device tensor updated in place; step
  indices and counts are Python ints. `LayerProfiler.profile` syncs once, at the end.
- **Every step, exactly:** the amax of every tensor (one reduction over the full tensor) and the
  Welford update of the parameter gradients.
- **Subsampled in time:** histograms and moments are taken on every ``every``-th step of a layer
  (default 8), staggered across layers (layer ``i`` on steps where ``(step + i) % every == 0``)
  so that every step costs about the same. A window of 500 steps still pools 62 steps per tensor.
- **Subsampled in space:** those steps see a strided subsample of at most ``sample`` elements
  per tensor (default 8192; all of it when smaller). The stride is the smallest integer
  ``≥ numel / sample`` that is coprime with the tensor's last dimension, so the samples cycle
  through every channel instead of hitting the same few (an outlier channel is never skipped
  systematically). Error: a fraction ``p`` estimated from ``n`` sampled values has a standard
  error ``sqrt(p(1-p)/n) ≤ 0.5/sqrt(n)`` for values without structure at the stride's period
  (≤ 0.55 % for one call at ``sample = 8192``; a window pools its steps' samples, ~0.07 % for 62
  of them). ``tests/test_profiling.py`` checks subsampled fractions against the full tensor
  within 5 standard errors, on a tensor whose channels span 12 octaves.
- **Non-finite values**: ``nonfinite_steps`` is exact (the full-tensor amax is NaN or inf exactly
  when the tensor holds a non-finite value); ``nonfinite`` counts them in the subsample (exact for
  tensors of at most ``sample`` elements). An exact full count would cost ``isfinite`` + ``sum``
  over the full tensor: a full pass more per tensor than the amax already takes.
- **Measured**: `autoprec.bench.measure_overhead` times training steps with the profiler inside
  its window, after it, and without it, interleaved in one process (ratios; see the README).

Histograms: one bin per 1/8 of a power of two (the float32 exponent and its 3 leading mantissa
bits, read from the bits of ``|x|``: ``bits >> 20``), so 2048 bins cover every float32 magnitude
with no clamping; bin 0 holds zeros (and ``|x| < 2**-129``), bins 2040.. hold inf and NaN. Each
tensor gets three: of ``|x|`` (``absolute``), of ``|x| / amax`` with the call's own amax
(``current``) and of ``|x| / ref`` with the delayed-scaling reference ``ref``, the largest finite
amax of the previous ``history_len`` steps (``delayed``; Transformer Engine's delayed recipe, as
`autoprec.formats.AmaxHistory` with reduction "max"; the layer's first step uses its own amax).

Underflow / overflow, per candidate format (numbers from `Format`, never hard-coded):

- unscaled formats (FP32, BF16, FP16; scaling ``"none"``): ``|x| < fmt.min_subnormal`` underflows,
  ``|x| > fmt.max`` overflows (read from the ``absolute`` histogram);
- scaled formats (FP8, INT8): the scale maps the reference amax onto ``fmt.max`` (margin 0), so
  ``|x| / amax < fmt.min_subnormal / fmt.max`` underflows (flushed to zero or to the smallest
  subnormal: no relative precision left). With ``"current"`` scaling nothing overflows by
  construction; with ``"delayed"`` scaling values above ``ref`` overflow (inf for E5M2, saturated
  for E4M3 / INT8) and are counted exactly in the subsample.

A threshold falls inside one bin; its count is split log-uniformly, and ``*_range`` gives the
exact lower and upper bounds (the bin wholly excluded or included).

Usage::

    profiler = LayerProfiler(model, example_inputs=x, window=500)
    with profiler:                            # attach hooks; exit removes them
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            profiler.step()                   # after backward, before clipping / optimizer.step
            optimizer.step(); optimizer.zero_grad()
    profile = profiler.profile()              # one sync
    profile.save("profile.json")

Statistics are gathered from forwards run with gradients enabled (training steps); forwards under
``torch.no_grad`` (evaluation) are ignored. Gradients are seen as autograd produces them: profile
without loss scaling (or divide by the scale yourself). The hooks never change numerics.
"""


from .artifact import LayerProfile, Profile
from .drivers import profile_workload, train_window, with_grad_formats
from .profiler import LayerProfiler
from .stats import KINDS, NUM_BINS, REFERENCES, SCHEMA_VERSION, FormatFractions, GradStats, Histogram, TensorStats

__all__ = [
    "SCHEMA_VERSION",
    "KINDS",
    "REFERENCES",
    "NUM_BINS",
    "Histogram",
    "FormatFractions",
    "TensorStats",
    "GradStats",
    "LayerProfile",
    "Profile",
    "LayerProfiler",
    "train_window",
    "with_grad_formats",
    "profile_workload",
]
