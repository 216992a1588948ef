"""What a scheduler's ``step()`` refuses and warns about: `StepChecks`.

It owns the optimizers already checked against the bound model and the count of optimizer steps
skipped in a row. `refuse_step` refuses a call out of order (before a forward, before its
backward, inside ``reusing_weights``); `check_optimizer` refuses, with one `RuntimeStateError` line, an optimizer
holding none of the model's parameters or none with a gradient; `count_skips` warns when steps
are skipped many times in a row (training is not progressing), saying how loss scaling stands.

Costs: per optimizer, once, a set of the model's parameter ids; per step a look over the
optimizer's parameters that stops at the first gradient found.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import RuntimeStateError

if TYPE_CHECKING:
    from ..plan import Plan
    from ..scaling import LossScaler

__all__ = ["SKIPS_BEFORE_WARNING", "StepChecks"]

logger = logging.getLogger(__name__)

# Steps skipped in a row before a warning (then again at each doubling): a few skips are loss
# scaling doing its job, ten in a row mean the model diverges at this precision.
SKIPS_BEFORE_WARNING = 10


class StepChecks:
    """The checks of one scheduler's steps (module docstring)."""

    def __init__(self) -> None:
        self._optimizers_seen: set[int] = set()  # ids of optimizers whose parameters were checked
        self._skips_in_row = 0

    def refuse_step(self, optimizers: Sequence[Any], model: Optional[nn.Module], *, forward_ran: bool, reusing: bool, backward_due: bool) -> None:
        """`RuntimeStateError` for a ``step()`` call that cannot be taken: no optimizer, inside
        `reusing_weights` (``reusing``), before any forward (not ``forward_ran``), after a forward
        whose backward has not run (``backward_due``); or an optimizer of ``model`` (the bound
        model) refused by `check_optimizer`."""
        if not optimizers:
            raise RuntimeStateError("step() needs the optimizer(s): scheduler.step(optimizer)")
        if reusing:
            raise RuntimeStateError("step() inside reusing_weights(): the optimizer writes the weights; end that block before scheduler.step(optimizer)")
        if not forward_ran or model is None:
            raise RuntimeStateError("step() before any forward ran inside precision_context()")
        if backward_due:
            raise RuntimeStateError("step() after a forward but before its backward: call scheduler.backward(loss) (or scheduler.scale(loss).backward()) before scheduler.step(optimizer)")
        for i, optimizer in enumerate(optimizers):
            self.check_optimizer(i, optimizer, model)

    def check_optimizer(self, i: int, optimizer: Any, model: nn.Module) -> None:
        """`RuntimeStateError` for an optimizer (the ``i``-th given) holding none of ``model``'s
        parameters (checked once per optimizer) or none with a gradient (each step: it stops at
        the first gradient found, so it costs one look on a normal step)."""
        where = f"step({type(optimizer).__name__}, optimizer #{i + 1})"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise RuntimeStateError(f"step({type(optimizer).__name__}): expected a torch.optim.Optimizer over the model's parameters")
        if id(optimizer) not in self._optimizers_seen:
            own = {id(p) for p in model.parameters()}
            if not any(id(p) in own for group in optimizer.param_groups for p in group["params"]):
                raise RuntimeStateError(
                    f"{where}: the optimizer holds none of {type(model).__name__}'s parameters (the model the scheduler is bound to); "
                    "pass the optimizer made from this model's parameters"
                )
            self._optimizers_seen.add(id(optimizer))
        if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeStateError(
                f"{where}: no parameter has a gradient; call scheduler.backward(loss) on a loss computed from the model's output "
                "before step() (a loss detached from the model, or zero_grad(set_to_none=True) after backward, leaves none)"
            )

    def count_skips(self, skipped: bool, layers: Sequence[str], step: int, plan: "Optional[Plan]", scaler: "LossScaler", min_scale: float) -> None:
        """Warn when steps are skipped many times in a row (at 10, 20, 40, ... skips). ``layers``:
        those with non-finite gradients at ``step``; ``plan``: the plan in force; ``scaler`` and
        the configured ``min_scale``: for the warning's note on loss scaling."""
        self._skips_in_row = self._skips_in_row + 1 if skipped else 0
        n = self._skips_in_row
        times, rest = divmod(n, SKIPS_BEFORE_WARNING)
        if rest == 0 and times > 0 and times & (times - 1) == 0:  # times is a power of two
            where = f"non-finite gradients in {', '.join(layers)}" if layers else "a non-finite loss"
            counts = plan.format_counts() if plan is not None else "the safe precision"
            logger.warning(
                "autoprec: step %d: %d optimizer steps in a row skipped (%s) under plan %s; %s; training is not progressing: "
                "lower the learning rate, set max_grad_norm, or raise min_precision", step, n, where, counts, _scaling_note(scaler, min_scale),
            )


def _scaling_note(scaler: "LossScaler", min_scale: float) -> str:
    """The loss scale and its floor, or why scaling is off (the scale then reads 1.0 whatever
    ``LossScaling(min_scale=...)`` says: the floor holds only while scaling is on)."""
    if scaler.enabled:
        return f"loss scale {scaler.get_scale():g} (floor min_scale={scaler.min_scale:g})"
    return ("loss scaling is off: no FP16 layer runs (BF16 and FP32 have FP32's range, so no scale helps), "
            f"the scale reads 1.0 and min_scale={min_scale:g} applies once an FP16 layer runs")
