"""Timing a training step of a layer or a model: device time, warm-up, median over repeats.

The clock itself is `autoprec.device_clock` (`median_ms`, `start_clock` are its, re-exported here); this
module adds what only the GPU suite needs: warm-up, input rotation against the L2 cache, TFLOP/s.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ...device_clock import median_ms, start_clock, timed

__all__ = ["warm_up", "median_ms", "rotation_count", "tflops", "start_clock"]


def warm_up(step: Callable[..., object], inputs: Sequence[tuple], calls: int, device: torch.device) -> float:
    """Run ``step`` on the first ``calls`` rotated inputs, untimed by `median_ms`; returns their wall
    seconds (compilation included, synced on CUDA before and after)."""

    def run() -> None:
        for i in range(calls):
            step(*inputs[i % len(inputs)])

    return timed(run, device)[1]


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
