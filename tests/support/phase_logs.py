"""The scheduler's phase as the integrations log it (`integrations.scheduler_metrics`), read back."""

from autoprec.scheduler import DynamicPrecisionScheduler

__all__ = ["assert_logged_through_the_search", "phase_of"]


def phase_of(logged) -> str:
    """The phase a log's ``autoprec/phase`` names (a number, or its text in a CSV row)."""
    return DynamicPrecisionScheduler.PHASES[int(float(logged["autoprec/phase"]))]


def assert_logged_through_the_search(phases: list, scheduler: DynamicPrecisionScheduler, steps: int) -> None:
    """``phases``, one logged per optimizer step of a run of ``steps``: profiling, then the search
    over several logged steps, then the plan to the end."""
    assert [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]] == ["profiling", "searching", "planned"]
    assert phases.count("searching") > 1  # the search ran over several logged steps
    assert scheduler.phase == "planned" and scheduler.step_count == steps
