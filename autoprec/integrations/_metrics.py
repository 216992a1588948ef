"""The scheduler's state as flat metrics for a framework's logger (Lightning's, the HF Trainer's)."""

from __future__ import annotations

from typing import Any, Literal, Union, overload

import torch

from ..scheduler import DynamicPrecisionScheduler

__all__ = ["scheduler_metrics"]


@overload
def scheduler_metrics(scheduler: DynamicPrecisionScheduler, prefix: str = ..., sync: Literal[True] = ...) -> dict[str, float]: ...
@overload
def scheduler_metrics(scheduler: DynamicPrecisionScheduler, prefix: str = ..., sync: bool = ...) -> dict[str, Union[float, torch.Tensor]]: ...


def scheduler_metrics(scheduler: DynamicPrecisionScheduler, prefix: str = "autoprec/", sync: bool = True) -> dict[str, Any]:  # as the overloads say
    """``{prefix + name: value}``: ``loss_scale``, ``skipped_steps`` (optimizer steps skipped for
    non-finite gradients since the start), ``plan_changes`` (promotions and demotions so far),
    ``phase`` (the index of `scheduler.phase` in `DynamicPrecisionScheduler.PHASES`, so that a
    scalar logger can plot it: 0 "unbound", 1 "profiling", 2 "searching", 3 "planned", 4 "safe"),
    ``step`` (the scheduler's optimizer steps) and, once a plan is in force, ``layers_<format>``
    (layers per format).

    ``sync=False`` gives the loss scale as the scaler's 0-d device tensor (no host sync; the
    logger reads it when it writes); ``sync=True`` as a float (one host sync when scaling is on).
    Everything else is host bookkeeping."""
    scaler = scheduler.scaler
    scale = scaler.get_scale() if sync or scaler.scale_tensor is None else scaler.scale_tensor.detach().clone()
    metrics: dict[str, Union[float, torch.Tensor]] = {
        "loss_scale": scale,
        "skipped_steps": float(scaler.skipped_steps),
        "plan_changes": float(len(scheduler.changes)),
        # The scheduler's own list, not a copy: a copy here once lacked "searching", and every
        # log that fell inside a search raised ValueError.
        "phase": float(scheduler.PHASES.index(scheduler.phase)),
        "step": float(scheduler.step_count),
    }
    if scheduler.plan is not None:
        metrics.update({f"layers_{fmt}": float(n) for fmt, n in sorted(scheduler.plan.format_counts().items())})
    return {prefix + name: value for name, value in metrics.items()}
