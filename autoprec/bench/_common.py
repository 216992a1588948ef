"""What the bench suites share: the config error, argument checks, device facts, CPU contention
and the median / ratio statistics."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import BenchConfigError


def is_positive_int(value: Any) -> bool:
    """An int (not a bool) above 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_device_and_seed(device: str, seed: Any) -> None:
    """Raises `BenchConfigError` for a device name torch does not parse or a non-integer seed
    (whether the device exists is checked when the run starts)."""
    if device != "auto":
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise BenchConfigError(f"device {device!r} is not a torch device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BenchConfigError(f"seed must be an integer, got {seed!r}")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists, tuples) as None, and keys as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def device_info(device: torch.device) -> dict:
    """Name, capability and software versions of ``device`` (no kernel runs; no sync)."""
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info.update(name=torch.cuda.get_device_name(index), capability=f"{major}.{minor}", cuda=torch.version.cuda)
    else:
        info.update(
            name=platform.processor() or platform.machine() or "unknown CPU",
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            threads=torch.get_num_threads(),
        )
    return info


class CpuContention:
    """CPU time other processes used during a run, in cores (Linux ``/proc/stat`` minus this
    process's own CPU time); None where ``/proc/stat`` is missing. Two reads of a small file."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> "tuple[float, float, float] | None":
        try:
            with open("/proc/stat", encoding="ascii") as handle:
                fields = [int(v) for v in handle.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def other_cores(self) -> "float | None":
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / (end[0] - self.start[0]))


def median_iqr(values: list[float]) -> tuple[float, float]:
    """Median and interquartile range of ``values`` (IQR 0 for a single value)."""
    if len(values) < 2:
        return values[0], 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q3 - q1


def ratio_or_nan(value: float, reference: float) -> float:
    """``value / reference``; NaN where ``reference`` is not positive."""
    return value / reference if reference > 0 else float("nan")



def build_seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under ``torch.manual_seed(seed)``, the global CPU RNG restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
