"""A candidate plan on the training steps (`Trial`): how many steps it runs and which count,
and what its overflowing steps do (`promote_or_drop`). `search.in_run.TrainingSearch` keeps
its candidates as trials; nothing here runs a step."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

from ..formats import Format
from ..plan import Plan

__all__ = ["SKIPPED_TRIAL_STEPS", "TIMED_TRIAL_STEPS", "TRIAL_PROMOTIONS", "Trial", "first_to_overflow", "promote_or_drop", "restart"]

logger = logging.getLogger("autoprec")

TIMED_TRIAL_STEPS = 2  # a candidate's steps timed once its INT8 scales froze (median of these)
# Skipped steps a candidate may take before its formats are blamed: an outlier batch, or a loss
# scale backing off (by 1/2 a skip when a scaler runs: three reach a scale 8x lower), explains
# fewer; a candidate still overflowing then does so on every batch.
SKIPPED_TRIAL_STEPS = 3
# Times a candidate that keeps overflowing has the layer named first promoted to FP32 and starts
# again, before it is dropped: each costs at most SKIPPED_TRIAL_STEPS + 1 skipped steps.
TRIAL_PROMOTIONS = 3


@dataclasses.dataclass
class Trial:
    """A candidate on the training steps: it runs until its INT8 scales froze (calibration's
    ``batches`` steps), then, for a compiled model, one step that compiles it, then
    ``TIMED_TRIAL_STEPS`` timed ones; every step it runs eagerly is metered for bytes."""

    plan: Plan
    compiled: bool = False
    runtime: Any = None
    steps: int = 0  # steps counted: skipped ones are not
    skipped: int = 0
    seconds: list = dataclasses.field(default_factory=list)
    blamed: Optional[str] = None  # the layer whose output the scaler saw go non-finite first, on a skipped step
    promoted: tuple = ()  # layers promoted to FP32 for overflowing, in order
    saved_bytes: Optional[int] = None  # the most any of its metered (eager) steps saved
    dropped: Optional[str] = None
    total_bytes: Optional[int] = None  # measured saved bytes plus the gradient buffers, once judged

    @property
    def calibration(self) -> int:
        """Its first steps, run eagerly: metered and calibrating INT8 scales."""
        return max([1] + [lp.calibration.batches for lp in self.plan.layers.values() if lp.format is Format.INT8])

    @property
    def bytes_over_predicted(self) -> Optional[float]:
        """How many bytes more than its plan predicted it measured holding (negative: fewer), in
        the cost model's terms (`total_bytes`); None before it was judged or without a prediction."""
        predicted = self.plan.predicted.get("bytes")
        return None if self.total_bytes is None or not isinstance(predicted, (int, float)) else self.total_bytes - float(predicted)

    @property
    def warmup(self) -> int:
        return self.calibration + int(self.compiled)

    @property
    def over(self) -> bool:
        return self.dropped is not None or self.steps >= self.warmup + TIMED_TRIAL_STEPS

    def skip(self, first_bad_output: Optional[str], nonfinite: Sequence[str]) -> None:
        """A step of this candidate was skipped (non-finite gradients): it does not count (one
        batch's outlier, or a loss scale still backing off, is not the formats' doing) and the
        candidate runs one more; past `SKIPPED_TRIAL_STEPS` it overflows on every batch and
        `promote_or_drop` decides. ``first_bad_output`` / ``nonfinite``: the scaler's attribution
        of the step (`first_to_overflow`)."""
        self.skipped += 1
        blamed = first_to_overflow(self.plan, first_bad_output, nonfinite)
        if blamed is not None:
            self.blamed = blamed
        if self.skipped > SKIPPED_TRIAL_STEPS:
            promote_or_drop(self)


def first_to_overflow(plan: Plan, first_bad_output: Optional[str], nonfinite: Sequence[str]) -> Optional[str]:
    """The lowered layer of ``plan`` a skipped step's overflow starts at: the one whose output went
    non-finite first, else (a finite loss, gradients overflowing in the backward) the last in model
    order whose gradients were non-finite, where the backward met them first. None when neither
    is a lowered layer of the plan (an overflow outside every layer)."""
    lowered = [fqn for fqn, lp in plan.layers.items() if lp.format is not Format.FP32]
    if first_bad_output in lowered:
        return first_bad_output
    bad = set(nonfinite)
    return next((fqn for fqn in reversed(lowered) if fqn in bad), None)


def promote_or_drop(trial: Trial) -> None:
    """A candidate skipped more steps than an outlier or a backing-off scale explains: the layer
    blamed (`first_to_overflow`) goes to FP32 and it starts again (runtime, bytes and skips
    anew; at most `TRIAL_PROMOTIONS` times), else it is dropped."""
    if trial.blamed is None or len(trial.plan.metadata.get("promoted_for_overflow", ())) >= TRIAL_PROMOTIONS:
        promoted = f" ({', '.join(trial.promoted)} promoted to FP32 before)" if trial.promoted else ""
        trial.dropped = f"non-finite gradients skipped {trial.skipped} of its steps{promoted}"
        return
    fqn = trial.blamed
    logger.info("autoprec: candidate plan: layer %r (%s) overflowed on %d steps; it runs in FP32 and the candidate starts again",
                fqn, trial.plan.layers[fqn].format.value, trial.skipped)
    plan = trial.plan.with_layers({fqn: Format.FP32})
    restart(trial, plan.replace(metadata={**plan.metadata, "promoted_for_overflow": [*plan.metadata.get("promoted_for_overflow", ()), fqn]}))


def restart(trial: Trial, plan: Plan) -> None:
    """``trial`` starts again as ``plan`` (layers of its plan promoted to FP32: for overflowing,
    `promote_or_drop`; for raising in their format, `failing.without_failing`): its runtime,
    bytes and counts anew."""
    if trial.runtime is not None:
        trial.runtime.remove()
    trial.promoted += tuple(fqn for fqn, lp in plan.layers.items() if lp.format is Format.FP32 and trial.plan.layers[fqn].format is not Format.FP32)
    trial.plan = plan
    trial.runtime, trial.steps, trial.skipped, trial.blamed, trial.saved_bytes = None, 0, 0, None, None
