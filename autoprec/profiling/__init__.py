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

No host-device sync per step: every accumulator is a device tensor updated in place, and
`LayerProfiler.profile` syncs once at the end. The costs and the subsampling (with its error
bounds) are in `LayerProfiler`'s docstring; the histogram binning and the under/overflow rules
per format in `autoprec.profiling.stats`.

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
