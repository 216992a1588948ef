"""Per-layer statistics over a monitor window: `LayerProfiler` gathers them, `Profile` keeps them.

Modules: `stats` (histograms, format fractions, per-tensor and gradient statistics; the binning
and the under/overflow rule per format), `artifact` (the `Profile` and its JSON), `profiler`
(`LayerProfiler`, the hooks; its docstring gives the costs and the subsampling's error bounds),
`drivers` (profiling the built-in workload's training steps), `watch` (`PlanWatch`: the lean
check of a plan in force that a scheduler's planned windows run).

Per covered layer (`coverage.find_layers`) over ``window`` optimizer steps: the **gradient mean,
variance and noise-to-signal ratio** ``E‖g − ḡ‖² / ‖ḡ‖²`` of its own parameters (Welford per
element; times the batch size, McCandlish et al.'s simple noise scale, arXiv:1812.06162), and
for the ``weight``, ``activation`` (its input) and ``grad`` (dL/d its output) tensors: the amax
history, histograms of ``|x|``, the fractions under/overflowing each candidate format after its
scaling, mean, variance and non-finite counts. No host sync per step (device accumulators;
`LayerProfiler.profile` syncs once); forwards under ``torch.no_grad`` are ignored; the hooks
never change numerics. Profile without loss scaling (or divide by the scale yourself).

    profiler = LayerProfiler(model, example_inputs=x, window=500)
    with profiler:                            # attach hooks; exit removes them
        for x, y in loader:
            model(x).loss.backward()
            profiler.step()                   # after backward, before clipping / optimizer.step
            optimizer.step(); optimizer.zero_grad()
    profiler.profile().save("profile.json")   # one sync

May import the shared basics and `runtime` (whose recomputation it must not count twice).
"""


from .artifact import LayerProfile, Profile
from .drivers import profile_workload, train_window, with_grad_formats
from .profiler import LayerProfiler
from .watch import PlanWatch, TensorWatch, WatchReport
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
    "PlanWatch",
    "TensorWatch",
    "WatchReport",
    "train_window",
    "with_grad_formats",
    "profile_workload",
]
