"""Timing a step on a device: the one clock of the cost model, the search, the benches and the GPU suite.

Two ways to time, for two questions:

- `Clock` (and `start_clock`, `median_ms`): **device time**. On CUDA a mark is an event recorded
  on the current stream (no host sync); elapsed times are read after one wait at the end, so
  the host keeps queueing work while a step runs. On a CPU a mark is ``time.perf_counter()``.
- `timed`: **wall time of a step's whole work**, ``sync; perf_counter; step; sync``: what a
  training loop pays, host overhead included. Two host syncs per call on CUDA; none on a CPU.

`rotated` is the order of interleaved rounds: when several variants are compared (formats,
plans, with and without a profiler), each round runs every variant once, the first rotated, so
the machine's drift and warm caches fall on all of them alike; keep medians over the rounds.
`interleaved` runs such rounds of steps that time themselves.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence, TypeVar

import torch

__all__ = ["Clock", "interleaved", "median_ms", "rotated", "start_clock", "sync", "timed"]

T = TypeVar("T")


def sync(device: "torch.device | str") -> None:
    """Wait until ``device`` has finished the work queued so far: ``torch.cuda.synchronize`` on
    CUDA (a host-device sync), nothing on a CPU (its work is done when the call returns)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], T], device: "torch.device | str") -> tuple[T, float]:
    """``(step(), seconds)``: wall seconds from a synced device to the step's work done.

    Costs two host-device syncs on CUDA (before, so earlier work is not counted, and after, so
    the step's kernels are); on a CPU only two ``perf_counter`` reads. Includes the host's time
    to launch the step: use it for whole training steps, `Clock` for the device's time alone.
    """
    sync(device)
    start = time.perf_counter()
    out = step()
    sync(device)
    return out, time.perf_counter() - start


class Clock:
    """Marks on the device's timeline: CUDA events, or host ``perf_counter`` readings on a CPU.

    `mark` costs one event record on CUDA (no sync) and one clock read on a CPU. On CUDA,
    `seconds` may be read only after the later mark completed: call `wait` once after the timed
    work (one host sync), then read every pair.
    """

    def __init__(self, device: "torch.device | str"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def wait(self, mark: Any = None) -> None:
        """CUDA: block until ``mark`` (an event of this clock) has completed, or with no mark,
        until the device is idle. CPU: nothing to wait for."""
        if not self.cuda:
            return
        if mark is not None:
            mark.synchronize()
        else:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on CUDA, after `wait`)."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def start_clock(device: "torch.device | str") -> Callable[[], float]:
    """Start timing now; the returned ``stop()`` gives the seconds since. CUDA: device time
    between two events, ``stop()`` waits for its own event only; CPU: wall time."""
    clock = Clock(device)
    begin = clock.mark()

    def stop() -> float:
        end = clock.mark()
        clock.wait(end)
        return clock.seconds(begin, end)

    return stop


def median_ms(step: Callable[..., object], inputs: Sequence[tuple], repeats: int, device: "torch.device | str") -> float:
    """Median milliseconds of ``step(*inputs[i % len(inputs)])`` over ``repeats`` calls.

    On CUDA each call is bracketed by two `Clock` marks (events) and the host syncs once before
    the first call and once after the last, so the time is the device's and includes launch gaps
    the host causes; on a CPU it is wall time. Rotating through ``inputs`` keeps one input from
    sitting in cache.
    """
    clock = Clock(device)
    clock.wait()
    spans = []
    for i in range(repeats):
        start = clock.mark()
        step(*inputs[i % len(inputs)])
        spans.append((start, clock.mark()))
    clock.wait()
    return statistics.median(clock.seconds(start, end) * 1e3 for start, end in spans)


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in the order round ``round_`` runs them: starting from item ``round_ mod n``,
    so that over ``n`` rounds each item runs first once (the first step after a switch of
    variant, or after the previous round's bookkeeping, pays cold caches)."""
    if not items:
        return []
    shift = round_ % len(items)
    return list(items[shift:]) + list(items[:shift])


def interleaved(steps: Sequence[Callable[[], float]], warmup: int, repeats: int) -> list[list[float]]:
    """Run every step ``warmup + repeats`` rounds in `rotated` order; each step returns its own
    seconds. Returns, per step, the seconds of its ``repeats`` timed rounds (warm-up rounds are
    run, not kept). Costs ``len(steps) × (warmup + repeats)`` calls."""
    times: list[list[float]] = [[] for _ in steps]
    for r in range(warmup + repeats):
        for i in rotated(range(len(steps)), r):
            seconds = steps[i]()
            if r >= warmup:
                times[i].append(seconds)
    return times
