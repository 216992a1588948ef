"""The window clock's transitions (`autoprec.lifecycle`), each rule on its own, no model."""

import dataclasses

import pytest

from autoprec.scheduler.lifecycle import CAPTURED_STEPS, Tick, WindowClock


def test_a_profiling_window_meters_its_last_step_but_one_and_ends_after_window_steps():
    clock = WindowClock(window=10, profiled=4)
    ticks = {}
    for step in range(1, 11):
        clock, ticks[step] = clock.after_step(step)
    assert [s for s, t in ticks.items() if t.meter_next] == [8]  # the next step is the window's last but one (the last sums it up)
    assert [s for s, t in ticks.items() if t.window_end] == [10]
    assert clock.phase == "profiling" and not any(t.retry for t in ticks.values())


@pytest.mark.parametrize("window, metered", [(1, []), (2, [1]), (3, [1])])
def test_a_short_window_meters_a_step_of_its_own(window, metered):
    """A window of two steps meters its last (its first ran before any tick), one of a single step none."""
    clock, ticks = WindowClock(window=window, profiled=1), {}
    for step in range(1, window + 1):
        clock, ticks[step] = clock.after_step(step)
    assert [s for s, t in ticks.items() if t.meter_next] == metered


def test_the_last_captured_steps_of_a_profiling_window_are_captured_and_no_planned_one():
    clock = WindowClock(window=10, profiled=4)
    assert [s for s in range(10) if clock.captures(s)] == list(range(10 - CAPTURED_STEPS, 10))
    assert not any(clock.planned(0).captures(s) for s in range(10))


def test_a_planned_window_profiles_its_last_profiled_steps():
    clock = WindowClock(window=10, profiled=4).planned(20)
    assert [s for s in range(20, 30) if clock.monitors(s)] == [26, 27, 28, 29]
    assert not any(WindowClock(window=10, profiled=4).monitors(s) for s in range(10))  # profiling: the whole window, by the scheduler


def test_searching_holds_the_clock_until_the_search_ends():
    clock = WindowClock(window=10, profiled=4).searching()
    for step in range(10, 40):
        after, tick = clock.after_step(step)
        assert (after, tick) == (clock, Tick())


def test_a_search_that_succeeds_starts_a_planned_window_and_forgets_failures():
    clock = dataclasses.replace(WindowClock(window=10, profiled=4), failures=3).searching().planned(17)
    assert (clock.phase, clock.window_start, clock.failures, clock.retry_at) == ("planned", 17, 0, None)
    assert clock.after_step(25)[1] == Tick(meter_next=True)
    assert clock.after_step(26)[1] == Tick()
    assert clock.after_step(27)[1] == Tick(window_end=True)
    assert clock.next_window(27).window_start == 27


def test_failures_in_a_row_wait_twice_as_many_windows_each_then_profile_afresh():
    clock = WindowClock(window=10, profiled=4).searching().failed(12)
    assert (clock.phase, clock.failures, clock.retry_at) == ("safe", 1, 22)
    assert clock.after_step(21) == (clock, Tick())
    clock, tick = clock.after_step(22)
    assert tick == Tick(retry=True) and (clock.phase, clock.window_start, clock.retry_at) == ("profiling", 22, None)
    clock = clock.searching().failed(34)
    assert (clock.failures, clock.retry_at) == (2, 54)  # 2 windows
    clock = clock.after_step(54)[0].searching().failed(66)
    assert (clock.failures, clock.retry_at) == (3, 106)  # 4 windows


def test_a_final_failure_never_retries():
    clock = WindowClock(window=10, profiled=4).searching().failed(12, final=True)
    assert clock.phase == "safe" and clock.retry_at is None
    assert all(clock.after_step(step) == (clock, Tick()) for step in range(12, 500, 7))


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="phase='paused'"):
        WindowClock(window=10, profiled=4, phase="paused")
