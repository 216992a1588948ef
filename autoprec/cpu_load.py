"""What the other processes leave of this machine's cores, and the intra-op threads to measure with.

On a CPU, PyTorch's OpenMP threads spin while they wait for each other: with as many threads as
cores and another process busy on one of them, every parallel region waits for the thread the
other process holds off its core, and a step took 30x its quiet time on 2 cores (issue 49). A
measurement therefore runs with the threads the machine can give: the cores, less those other
processes keep busy.

`sample_load` reads Linux's ``/proc/stat`` (busy and idle time of all cores) and this process's
own CPU time (``/proc/self/stat``) twice, ``window_s`` apart: the cores busy over that window
less this process's share are the other processes' cores. Elsewhere (no ``/proc``) it falls back
to the one-minute load average (``os.getloadavg``), which counts this process too. Costs: two
small file reads and a sleep of ``window_s``; nothing from torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Optional

__all__ = ["CpuLoad", "sample_load", "measuring_threads"]


@dataclasses.dataclass(frozen=True)
class CpuLoad:
    """``cores``: the cores this process may run on; ``busy_elsewhere``: how many of them other
    processes kept busy over the sample (a fraction of cores, e.g. 1.0 for one spinning process);
    ``source``: how it was measured."""

    cores: int
    busy_elsewhere: float
    source: str

    @property
    def free_cores(self) -> int:
        """Cores left for this process: at least 1. A core counts as taken when another process
        kept it more than half busy."""
        return max(1, self.cores - math.floor(self.busy_elsewhere + 0.5))

    def describe(self, threads: int) -> str:
        return (f"{threads} intra-op thread{'s' if threads != 1 else ''} of {self.cores} cores "
                f"({self.busy_elsewhere:.1f} cores busy with other processes, {self.source})")

    def to_dict(self, threads: int) -> dict:
        return {"threads": threads, "cores": self.cores, "busy_elsewhere": round(self.busy_elsewhere, 3), "source": self.source}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _proc_times() -> "tuple[float, float, float] | None":
    """(busy jiffies of all cores, all jiffies, this process's user + system jiffies), or None
    without a Linux /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat", encoding="ascii") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total, float(own[11]) + float(own[12])  # utime, stime


def sample_load(window_s: float = 0.5, reader: Callable[[], "tuple[float, float, float] | None"] = _proc_times,
                sleep: Callable[[float], None] = time.sleep) -> CpuLoad:
    """The machine's load by other processes over ``window_s`` seconds (module docstring)."""
    cores = _cores()
    first = reader()
    if first is not None:
        sleep(window_s)
        second = reader()
        if second is not None and second[1] > first[1]:
            all_cores = os.cpu_count() or cores
            busy, total, own = (b - a for a, b in zip(first, second))
            # Jiffies of all cores over the window: busy / total * cores is cores kept busy.
            busy_cores = busy / total * all_cores
            own_cores = own / (total / all_cores)
            return CpuLoad(cores, max(0.0, min(float(cores), busy_cores - own_cores)), f"/proc/stat over {window_s:g} s")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return CpuLoad(cores, 0.0, "no load figure on this system")
    return CpuLoad(cores, min(float(cores), load), "the 1-minute load average")


def measuring_threads(load: CpuLoad, current: Optional[int] = None, workers: int = 1) -> int:
    """The intra-op threads one of ``workers`` measuring processes should use: the free cores
    shared among them, never more than ``current`` (the threads torch would use now)."""
    share = max(1, load.free_cores // max(1, workers))
    return share if current is None else max(1, min(current, share))
