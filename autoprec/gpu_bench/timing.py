"""Timing a training step of a layer or a model: device time, warm-up, median over repeats."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["warm_up", "median_ms", "rotation_count", "tflops", "start_clock"]


def warm_up(step: Callable[..., object], inputs: Sequence[tuple], calls: int, device: torch.device) -> float:
    """Run ``step`` on the first ``calls`` rotated inputs, untimed by `median_ms`; returns their wall
    seconds (compilation included, synced on CUDA)."""
    t0 = time.perf_counter()
    for i in range(calls):
        step(*inputs[i % len(inputs)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def median_ms(step: Callable[..., object], inputs: Sequence[tuple], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``step(*inputs[i % len(inputs)])`` over ``repeats`` calls.

    On CUDA each call is bracketed by CUDA events and the host syncs once at the end, so the time
    is the device's and includes launch gaps the host causes; on CPU it is wall time
    (``time.perf_counter``). Rotating through ``inputs`` keeps one input from sitting in cache.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for i, (start, end) in enumerate(events):
            start.record()
            step(*inputs[i % len(inputs)])
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        step(*inputs[i % len(inputs)])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rotation_count(bytes_per_input: int, device: torch.device, at_most: int = 16) -> int:
    """How many distinct inputs to rotate through so that together they hold at least twice the
    device's L2 cache (read from the device, not assumed), so the cache cannot serve a repeat; at
    least 2. CPU: 2 (its caches are not what the suite measures)."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return max(2, min(at_most, math.ceil(2 * l2 / max(1, bytes_per_input))))


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` floating-point operations done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def start_clock(device: torch.device) -> Callable[[], float]:
    """Start timing now; the returned ``stop()`` gives the seconds since. CUDA: device time between
    two events, and ``stop()`` waits for the device; CPU: wall time."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        return lambda: time.perf_counter() - t0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()

    def stop() -> float:
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    return stop
