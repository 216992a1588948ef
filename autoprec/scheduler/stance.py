"""Whether a step of a ``torch.compile``-d model runs its compiled code: `CompiledStance`.

Compiled code calls no hook added after it was compiled, so a step whose forward hooks the model
runs eagerly (``torch.compiler.set_stance("force_eager")``): binding, the profiling window, the
search's probe steps and a candidate's metered and calibrating ones, a planned window's sampled
or metered steps, a check step that captures its call or reads an INT8 amax, and every step
while the loss scaler watches the layers' outputs. Other steps (planned ones, a candidate's
timed ones) run compiled. The one place this is decided; each collaborator says what it hooks.

Costs: a few attribute reads per step; no device work.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ..plan import Plan
    from .binding import Binding
    from .plan_checks import PlanChecks
    from .plan_keeper import PlanKeeper
    from .search_steps import SearchSteps
    from .window_measures import WindowMeasures

__all__ = ["CompiledStance"]


class CompiledStance:
    """The eager-or-compiled decision of one scheduler's steps (module docstring)."""

    def __init__(self, binding: "Binding", plans: "PlanKeeper", searches: "SearchSteps", measures: "WindowMeasures", plan_checks: "PlanChecks"):
        self._binding, self._plans, self._searches = binding, plans, searches
        self._measures, self._plan_checks = measures, plan_checks

    def eager(self, phase: str, plan: "Optional[Plan]", check_due: bool) -> bool:
        """Whether the next step's forward hooks the model. ``phase``: the scheduler's;
        ``plan``: the plan in force; ``check_due``: the step checks that plan (`plan_checks`)."""
        if self._binding.example is None or self._plans.scaler.watching_outputs:
            return True
        if phase == "searching":
            return self._searches.runs_eager()  # a compiled model's candidates are timed compiled
        return (phase != "planned" or self._measures.hooks_model(capture=False, sample=False)
                or (check_due and plan is not None and self._plan_checks.eager(plan)))  # the check's hooks and INT8 amaxes

    def enter(self, stack: contextlib.ExitStack, phase: str, plan: "Optional[Plan]", check_due: bool) -> None:
        """Run the step entered on ``stack`` eagerly when `eager` says so."""
        if self.eager(phase, plan, check_due):
            stack.enter_context(torch.compiler.set_stance("force_eager"))
