"""Where a step's time goes: a few steps under ``torch.profiler``, summarised per step.

What a benchmark records beside a missed speed target, so the next change aims at the right cost:

- ``host_ms``: the host's time to issue a step (until the call returns, before any sync). Near
  ``wall_ms`` the step is bound by its Python and launches; well under it, by the device;
- ``wall_ms``: the step until the device is done (a sync after each step);
- on CUDA: ``kernels`` launched, ``launches`` (the runtime's launch calls, one per kernel the host
  issues), ``memcpy`` / ``memset`` operations, ``syncs`` (the host waiting on the device inside the
  step: stream, event or device synchronizations and blocking copies; the profiler's own sync after
  each step is not counted), ``kernel_ms`` (their summed device time), and the ``top`` kernels by
  device time (name, calls and milliseconds per step);
- on a CPU: ``aten_ops`` (calls of ``aten::`` operators, nested ones included) and the ``top`` ops
  by their own CPU time.

Cost: the profiled steps run under the profiler (slower; their times are the profile's, not the
benchmark's figures), one sync per step, and the profiler's start (about a second the first time on
CUDA). Nothing is written to disk.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..device_clock import sync

__all__ = ["profile_steps"]

# CUDA runtime and driver calls: the host issuing a kernel, and the host waiting on the device.
_LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel"})
_SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
_NAME_WIDTH = 100  # kernel names (templated C++) are cut to this many characters


def profile_steps(step: Callable[[], object], steps: int, device: torch.device, *, top: int = 8) -> dict:
    """Run ``step()`` ``steps`` times under the profiler; returns the per-step summary of the module
    docstring (every count and time divided by ``steps``). ``device``: where the step computes
    (CUDA adds the device activity)."""
    if steps < 1:
        raise ValueError(f"profile_steps(steps={steps!r}): profile at least one step")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    host, wall = [], []
    sync(device)
    with profile(activities=activities, acc_events=True) as prof:  # one cycle; acc_events only spares torch 2.11 a warning
        for _ in range(steps):
            start = time.perf_counter()
            step()
            host.append(time.perf_counter() - start)
            sync(device)
            wall.append(time.perf_counter() - start)
    summary: dict = {"steps": steps, "host_ms": 1e3 * sum(host) / steps, "wall_ms": 1e3 * sum(wall) / steps}
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, microseconds]
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        name = event.name
        if event.device_type == DeviceType.CUDA:
            kind = "memcpy" if name.startswith("Memcpy") else "memset" if name.startswith("Memset") else "kernels"
            counts[kind] += 1
            if kind == "kernels":
                entry = per_name[name[:_NAME_WIDTH]]
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us()
        elif name in _LAUNCH_CALLS:
            counts["launches"] += 1
        elif name in _SYNC_CALLS:
            counts["syncs"] += 1
        elif device.type != "cuda" and name.startswith("aten::"):
            counts["aten_ops"] += 1
            entry = per_name[name]
            entry[0] += 1
            entry[1] += event.self_cpu_time_total
    if device.type == "cuda":
        counts["syncs"] = max(0, counts["syncs"] - steps)  # the sync after each step above
        for kind in ("kernels", "launches", "memcpy", "memset", "syncs"):
            summary[kind] = counts[kind] / steps
        summary["kernel_ms"] = sum(us for _, us in per_name.values()) / 1e3 / steps
    else:
        summary["aten_ops"] = counts["aten_ops"] / steps
    ranked = sorted(per_name.items(), key=lambda item: item[1][1], reverse=True)[:top]
    summary["top"] = [{"name": name, "calls": calls / steps, "ms": us / 1e3 / steps} for name, (calls, us) in ranked]
    return summary
