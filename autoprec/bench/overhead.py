"""The profiler's overhead (`measure_overhead`): training steps with and without a `LayerProfiler`,
interleaved in one process."""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch

from ..calls import ModelCall
from ..device import resolve_device
from ..errors import ProfileError
from ..profiling import LayerProfiler
from ..workload import TrainStep, check_workload, to_device
from ..device_clock import rotated, timed

__all__ = ["measure_overhead"]


def measure_overhead(
    workload: Any,
    steps: int = 30,
    *,
    warmup: int = 3,
    sample: int = 8192,
    every: int = 8,
    device: "str | torch.device" = "auto",
    seed: int = 0,
) -> dict:
    """Median training-step time with and without the profiler, interleaved in one process.

    Three identical models of ``workload`` (an `autoprec.workload.Workload`) train side by side
    with its own optimizer and clipping, one step of each per round (the order rotated every
    round): ``plain`` (no profiler), ``window`` (profiler attached, inside its window for every
    timed step) and ``after`` (profiler attached whose 1-step window ended in warmup: hooks gone,
    `step` still called). A step is zero_grad, forward + loss, backward, profiler step, clipping
    and the optimizer step; timings end with a device sync. Returns medians (ms) and the overheads
    ``window / plain - 1`` and ``after / plain - 1``.
    """
    workload = check_workload(workload, type(workload).__name__)
    dev = resolve_device(device, ProfileError, "profiling")
    names = ("plain", "window", "after")
    steps_by_name = {name: TrainStep.for_workload(workload, workload.build_model(seed).to(dev)) for name in names}
    example = ModelCall.first(steps_by_name["plain"].model, lambda: workload.loss(steps_by_name["plain"].model, to_device(workload.val_batches(1)[0], dev)))
    after = LayerProfiler(steps_by_name["after"].model, example, window=1, sample=sample, every=every).attach()
    profilers = {
        "plain": None,
        "window": LayerProfiler(steps_by_name["window"].model, example, window=warmup + steps + 1, sample=sample, every=every).attach(),
        "after": after,
    }
    batches = iter(workload.train_batches(seed))
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + steps):
        batch = to_device(next(batches), dev)  # every model sees the same batches
        for name in rotated(names, round_):
            profiler = profilers[name]
            _, seconds = timed(functools.partial(steps_by_name[name], batch, profiler.step if profiler is not None else None), dev)
            if round_ >= warmup:
                times[name].append(seconds)
    for profiler in profilers.values():
        if profiler is not None:
            profiler.detach()
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    mean = {name: statistics.fmean(ts) * 1e3 for name, ts in times.items()}
    return {
        "workload": getattr(workload, "name", type(workload).__name__), "steps": steps, "sample": sample, "every": every,
        "device": str(dev), "threads": torch.get_num_threads(),
        "median_ms": med,
        "mean_ms": mean,
        "overhead_window": med["window"] / med["plain"] - 1.0,
        "overhead_after": med["after"] / med["plain"] - 1.0,
        "overhead_window_mean": mean["window"] / mean["plain"] - 1.0,
        "after_hooks_removed": not after.collecting,
    }
