"""Profiling real training steps of the built-in workload (`autoprec profile`, the search job):
`train_window` drives a `workloads.Trainer` with a profiler attached, `profile_workload` returns
the `Profile`."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Optional

import torch

from ..device import resolve_device
from ..errors import ProfileError
from ..formats import Format
from .artifact import Profile
from .profiler import LayerProfiler
from .stats import _enc


def workload_trainer(workload, seed: int, lr: float, device: torch.device):
    """The workload's model on ``device`` with its `Trainer` (the same step `workloads.train` runs)."""
    from ..workloads import Trainer

    return Trainer(workload.build_model(seed).to(device), workload, lr=lr, seed=seed)


def builtin_workload(name: str, batch_size: int):
    from ..workloads import LMConfig, default_workload

    if name not in LMConfig.preset_names():
        raise ProfileError(f"unknown workload {name!r}; choose one of {', '.join(LMConfig.preset_names())}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ProfileError(f"batch size must be a positive integer, got {batch_size!r}")
    return default_workload(name, batch_size=batch_size)


def train_window(
    trainer,
    steps: int,
    profiler: "LayerProfiler | None" = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    phase: str = "profiling",
) -> tuple[float, float]:
    """Run ``steps`` steps of a `workloads.Trainer` with ``profiler`` attached for them (None:
    plain training); returns the first and last training loss (one host sync, at the end).
    ``progress(done, steps, phase)`` is called after every step."""
    losses = []
    with profiler if profiler is not None else contextlib.nullcontext():
        for i in range(steps):
            losses.append(trainer.step(profiler.step if profiler is not None else None))
            if progress is not None:
                progress(i + 1, steps, phase)
    first, last = (float(v) for v in torch.stack([losses[0], losses[-1]]).cpu())
    return first, last


def with_grad_formats(formats: Iterable["Format | str"]) -> tuple[Format, ...]:
    """``formats`` plus the gradient formats layers in them compute in (E5M2 for FP8), in
    `Format` order: what a profile needs to judge those formats' gradients too."""
    from ..plan import LayerPrecision

    wanted = {Format.parse(f) for f in formats}
    wanted |= {LayerPrecision(f).grad_format for f in wanted}
    return tuple(f for f in Format if f in wanted)


def profile_workload(
    workload: str = "small",
    steps: int = 100,
    *,
    batch_size: int = 16,
    seed: int = 0,
    lr: float = 3e-3,
    device: "str | torch.device" = "auto",
    formats: Iterable["Format | str"] = tuple(Format),
    sample: int = 8192,
    every: int = 8,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> Profile:
    """Profile ``steps`` real training steps of the built-in LM (`default_workload(workload)`).

    The model trains as `autoprec.workloads.train` trains it; the profiler's window is ``steps``.
    ``progress(done, total, phase)`` is called after every step (no sync). Returns the `Profile`,
    with the workload, seed, first / last loss and wall time in its metadata.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ProfileError(f"steps must be a positive integer, got {steps!r}")
    wl = builtin_workload(workload, batch_size)
    dev = resolve_device(device, ProfileError, "profiling")
    trainer = workload_trainer(wl, seed, lr, dev)
    example = wl.val_batches(1)[0][0].to(dev)
    profiler = LayerProfiler(trainer.model, example, formats=formats, window=steps, sample=sample, every=every)
    start = time.perf_counter()
    first, last = train_window(trainer, steps, profiler, progress, "profiling")
    seconds = time.perf_counter() - start
    meta = {
        "workload": workload, "batch_size": batch_size, "seed": seed, "lr": lr, "device": str(dev),
        "loss_first": _enc(first), "loss_last": _enc(last), "seconds": round(seconds, 3), "torch": torch.__version__,
    }
    return profiler.profile(meta)
