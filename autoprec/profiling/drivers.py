"""Profiling real training steps of a workload (`autoprec profile`, the search job): `train_window`
runs a `workload.TrainStep` with a profiler attached, `profile_workload` returns the `Profile`."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..calls import ModelCall
from ..device import resolve_device
from ..errors import ProfileError, WorkloadError
from ..formats import Format
from ..workload import TrainStep, check_workload, to_device
from .artifact import Profile
from .profiler import LayerProfiler
from .stats import json_float


def train_window(
    step: TrainStep,
    batches: Iterator[Any],
    steps: int,
    profiler: "LayerProfiler | None" = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    phase: str = "profiling",
) -> tuple[float, float]:
    """Run ``steps`` training steps on ``next(batches)`` (moved to the model's device) with
    ``profiler`` attached for them (None: plain training); returns the first and last training
    loss (one host sync, at the end). ``progress(done, steps, phase)`` is called after every step."""
    device = next(step.model.parameters()).device
    losses = []
    with profiler if profiler is not None else contextlib.nullcontext():
        for i in range(steps):
            losses.append(step(to_device(next(batches), device), profiler.step if profiler is not None else None))
            if progress is not None:
                progress(i + 1, steps, phase)
    values = torch.stack(losses).cpu().tolist()
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        # Past a non-finite loss the optimizer has written NaN into the weights, so every statistic
        # from there on is NaN too: stop here rather than write a profile or plan built on it.
        raise WorkloadError(
            f"{phase}: training step {bad + 1} of {steps} (training batch {bad}) gave a non-finite loss ({values[bad]}); "
            "every statistic after it would be NaN: remove the non-finite values from that batch or lower the learning rate"
        )
    return values[0], values[-1]


def with_grad_formats(formats: Iterable["Format | str"]) -> tuple[Format, ...]:
    """``formats`` plus the gradient formats layers in them compute in (E5M2 for FP8), in
    `Format` order: what a profile needs to judge those formats' gradients too."""
    from ..plan import LayerPrecision

    wanted = {Format.parse(f) for f in formats}
    wanted |= {g for f in wanted if (g := LayerPrecision(f).grad_format) is not None}
    return tuple(f for f in Format if f in wanted)


def profile_workload(
    workload: Any,
    steps: int = 100,
    *,
    seed: int = 0,
    device: "str | torch.device" = "auto",
    formats: Iterable["Format | str"] = tuple(Format),
    sample: int = 8192,
    every: int = 8,
    progress: Optional[Callable[[int, int, str], None]] = None,
    metadata: Optional[dict] = None,
) -> Profile:
    """Profile ``steps`` real training steps of ``workload`` (an `autoprec.workload.Workload`),
    trained with its own optimizer, schedule and clipping; the profiler's window is ``steps``.

    ``progress(done, total, phase)`` is called after every step (no sync). Returns the `Profile`,
    with ``metadata``, the seed, learning rate, first / last loss and wall time in its metadata.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ProfileError(f"steps must be a positive integer, got {steps!r}")
    name = type(workload).__name__
    workload = check_workload(workload, name)
    dev = resolve_device(device, ProfileError, "profiling")
    model = workload.build_model(seed).to(dev)
    step = TrainStep.for_workload(workload, model)
    example = ModelCall.first(model, lambda: workload.loss(model, to_device(workload.val_batches(1)[0], dev)))
    if example is None:
        raise ProfileError(f"{name}.loss(model, batch) never called the model; it must run model(...) on the batch")
    profiler = LayerProfiler(model, example, formats=formats, window=steps, sample=sample, every=every)
    start = time.perf_counter()
    first, last = train_window(step, iter(workload.train_batches(seed)), steps, profiler, progress, "profiling")
    seconds = time.perf_counter() - start
    meta = {
        **(metadata or {}), "seed": seed, "lr": step.lr, "device": str(dev),
        "loss_first": json_float(first), "loss_last": json_float(last), "seconds": round(seconds, 3), "torch": torch.__version__,
    }
    return profiler.profile(meta)
