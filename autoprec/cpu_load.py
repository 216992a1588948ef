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

`LoadMeter` is the same figure over a span of work instead of a sleep (the load *during* a
measurement, which the one at its start does not tell: another job may start meanwhile); it
costs two file reads, at enter and exit. `ThreadGovernor` meters each span of a job's
measurement (a trial, the final rounds) and sets the threads of the next from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Callable, Iterator, Optional

from ._checks import check_fields, check_value, integer, number, optional

__all__ = ["CpuLoad", "LoadMeter", "ThreadGovernor", "sample_load", "measuring_threads"]


@dataclasses.dataclass(frozen=True)
class CpuLoad:
    """``cores``: the cores this process may run on; ``busy_elsewhere``: how many of them other
    processes kept busy over the sample (a fraction of cores, e.g. 1.0 for one spinning process);
    ``source``: how it was measured."""

    cores: int
    busy_elsewhere: float
    source: str

    def __post_init__(self):
        check_fields(self, "CpuLoad", {"cores": (integer(1), "an integer >= 1")})
        check_fields(self, "CpuLoad", {"busy_elsewhere": (number(0, self.cores), f"a finite number of cores from 0 to cores={self.cores}")})

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
    """(busy jiffies of all cores, all jiffies, this process's and its reaped children's user +
    system jiffies), or None without a Linux /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat", encoding="ascii") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    # utime, stime, and the reaped children's (cutime, cstime): a job's worker processes are
    # its own load, not another process's.
    return total - idle, total, sum(float(v) for v in own[11:15])


def _between(first, second, cores: int, source: str) -> "CpuLoad | None":
    """The other processes' load between two `_proc_times` readings (None when either is
    missing or no time passed)."""
    if first is None or second is None or second[1] <= first[1]:
        return None
    all_cores = os.cpu_count() or cores
    busy, total, own = (b - a for a, b in zip(first, second))
    # Jiffies of all cores over the window: busy / total * cores is cores kept busy.
    busy_cores = busy / total * all_cores
    own_cores = own / (total / all_cores)
    return CpuLoad(cores, max(0.0, min(float(cores), busy_cores - own_cores)), source)


def sample_load(window_s: float = 0.5, reader: Callable[[], "tuple[float, float, float] | None"] = _proc_times,
                sleep: Callable[[float], None] = time.sleep) -> CpuLoad:
    """The machine's load by other processes over ``window_s`` seconds (module docstring)."""
    window_s = check_value("sample_load", "window_s", window_s, number(0), "a finite number of seconds >= 0")
    cores = _cores()
    first = reader()
    if first is not None:
        sleep(window_s)
        load = _between(first, reader(), cores, f"/proc/stat over {window_s:g} s")
        if load is not None:
            return load
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):
        return CpuLoad(cores, 0.0, "no load figure on this system")
    return CpuLoad(cores, min(float(cores), average), "the 1-minute load average")


class LoadMeter:
    """``with LoadMeter() as meter: ...``; then ``meter.load``: the other processes' load over
    the block (`CpuLoad`, source "/proc/stat over <seconds> s of measurement"), or None without a
    Linux ``/proc`` or when the block took no measurable time."""

    def __init__(self, reader: Callable[[], "tuple[float, float, float] | None"] = _proc_times,
                 clock: Callable[[], float] = time.monotonic):
        self._reader, self._clock = reader, clock
        self._first: "tuple[float, float, float] | None" = None
        self._start = 0.0
        self.load: "CpuLoad | None" = None

    def __enter__(self) -> "LoadMeter":
        self._first, self._start = self._reader(), self._clock()
        return self

    def __exit__(self, *exc) -> None:
        seconds = self._clock() - self._start
        self.load = _between(self._first, self._reader(), _cores(), f"/proc/stat over {seconds:.0f} s of measurement")


def measuring_threads(load: CpuLoad, current: Optional[int] = None, workers: int = 1) -> int:
    """The intra-op threads one of ``workers`` measuring processes should use: the free cores
    shared among them, never more than ``current`` (the threads torch would use now)."""
    current = check_value("measuring_threads", "current", current, optional(integer(1)), "an integer >= 1 or None")
    workers = check_value("measuring_threads", "workers", workers, integer(1), "an integer >= 1")
    share = max(1, load.free_cores // max(1, workers))
    return share if current is None else max(1, min(current, share))


class ThreadGovernor:
    """Keeps the intra-op threads at what the machine gives while a job measures.

    Each `span` (one measured trial, the final rounds) is a `LoadMeter`; after it, the threads of
    the next span are the cores other processes left free over it (`measuring_threads`), never
    more than ``ceiling`` (what the job chose at its start), set through ``set_threads``
    (``torch.set_num_threads``). A process that starts mid-job thus contends with at most the one
    span it started in, not every span after it (issue 49's 30x), and the threads come back when
    it ends. ``spans``: (name, load over it, threads it ran with), in order. Costs: two small file
    reads per span; ``set_threads`` only when the count changes."""

    def __init__(self, ceiling: int, set_threads: Callable[[int], None],
                 reader: Callable[[], "tuple[float, float, float] | None"] = _proc_times, clock: Callable[[], float] = time.monotonic):
        self.ceiling = self.threads = ceiling
        self.spans: list[tuple[str, CpuLoad, int]] = []
        self._set, self._reader, self._clock = set_threads, reader, clock

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        threads = self.threads
        with LoadMeter(self._reader, self._clock) as meter:
            yield
        if meter.load is None:
            return
        self.spans.append((name, meter.load, threads))
        wanted = measuring_threads(meter.load, self.ceiling)
        if wanted != self.threads:
            self.threads = wanted
            self._set(wanted)

    def contended(self) -> list[tuple[str, CpuLoad, int]]:
        """The spans whose load left fewer free cores than the threads they ran with."""
        return [(name, load, threads) for name, load, threads in self.spans if load.free_cores < threads]
