"""The scheduler's window clock as data: `WindowClock`, its phases and pure transitions.

A dynamic scheduler's steps fall in windows of ``monitor_window`` steps, and it is in one phase:

- **profiling**: the first window (or a retry's), at the safe precision, profiled throughout; the
  last `CAPTURED_STEPS` steps are captured for the sensitivity estimate; its end starts a search.
- **searching**: the steps after it, while the search runs (`search.in_run`); it ends
  **planned** (its plan in force, a new window) or **safe**.
- **planned**: the last ``profiled`` steps of each window are profiled; each window's end reviews
  the plan (promotions, demotions) and starts the next window.
- **safe**: the search failed. After the n-th failure in a row the clock waits 2**(n-1) windows,
  then profiles a fresh window and searches again; a final failure (budgets no plan meets) never
  retries.

Every transition takes a clock and returns a new one (`WindowClock` is frozen); `after_step` also
returns a `Tick`, what the scheduler must do at that step. Nothing here has side effects, so
each rule is unit-tested on its own (tests/scheduler/test_lifecycle.py), as `policy` is.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["CAPTURED_STEPS", "PHASES", "Tick", "WindowClock"]

PHASES = ("profiling", "searching", "planned", "safe")
CAPTURED_STEPS = 2  # a profiling window's last steps whose calls and output gradients feed the sensitivity estimate


@dataclasses.dataclass(frozen=True)
class Tick:
    """What a step asks of the scheduler: ``meter_next``: meter the saved bytes of the next step
    (the window's last but one); ``window_end``: the window ended (search, or review the plan);
    ``retry``: a failed search's wait is over (a fresh profiling window starts now)."""

    meter_next: bool = False
    window_end: bool = False
    retry: bool = False


@dataclasses.dataclass(frozen=True)
class WindowClock:
    """The phase, the current window's first step and the failed searches in a row (with the step
    a retry is due). ``window``: steps per window; ``profiled``: steps profiled at the end of each
    planned window (at most ``window``). Steps count optimizer steps, from 0."""

    window: int
    profiled: int
    phase: str = "profiling"
    window_start: int = 0
    failures: int = 0
    retry_at: Optional[int] = None

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"WindowClock(phase={self.phase!r}): expected one of {PHASES}")

    def after_step(self, step: int) -> "tuple[WindowClock, Tick]":
        """The clock once ``step`` steps are done, and what that asks for."""
        if self.phase == "searching":
            return self, Tick()
        if self.phase == "safe":
            if self.retry_at is None or step < self.retry_at:
                return self, Tick()
            return dataclasses.replace(self, phase="profiling", window_start=step, retry_at=None), Tick(retry=True)
        end = self.window_start + self.window
        # The saved bytes are metered on the window's last step but one (its last where the
        # window has two steps): the last step sums up the window, and both on one step, each
        # linear in the layers, made it 3-4x a step at 128 decoder layers.
        metered = max(end - 2, self.window_start + 1)
        return self, Tick(meter_next=step == metered and step < end, window_end=step >= end)

    def searching(self) -> "WindowClock":
        """A profiling window ended: its search runs over the next steps."""
        return dataclasses.replace(self, phase="searching")

    def planned(self, step: int) -> "WindowClock":
        """A plan is in force from ``step`` (a search succeeded, or one was given): a new window."""
        return dataclasses.replace(self, phase="planned", window_start=step, failures=0, retry_at=None)

    def next_window(self, step: int) -> "WindowClock":
        """A planned window was reviewed at ``step``: the next one starts."""
        return dataclasses.replace(self, window_start=step)

    def failed(self, step: int, final: bool = False) -> "WindowClock":
        """The search failed at ``step``: safe, and (unless ``final``) profiling again after
        2**(n-1) windows for the n-th failure in a row."""
        if final:
            return dataclasses.replace(self, phase="safe", window_start=step, retry_at=None)
        failures = self.failures + 1
        return dataclasses.replace(self, phase="safe", window_start=step, failures=failures, retry_at=step + 2 ** (failures - 1) * self.window)

    def captures(self, step: int) -> bool:
        """Whether the step after ``step`` done steps is captured for the sensitivity estimate."""
        return self.phase == "profiling" and step >= self.window_start + self.window - CAPTURED_STEPS

    def samples(self, step: int, every: int) -> bool:
        """Whether the step after ``step`` done steps is a profiling window's sampled one: every
        ``every``-th from the window's first."""
        return self.phase == "profiling" and (step - self.window_start) % every == 0

    def monitors(self, step: int) -> bool:
        """Whether a planned window profiles from ``step`` on (its last ``profiled`` steps)."""
        return self.phase == "planned" and step >= self.window_start + self.window - self.profiled
