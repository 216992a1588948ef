"""The planning pipeline up to the exact optimum, shared by the search job and the scheduler.

costs (`CostModel`, measured in place) -> sensitivity (Fisher estimate) -> the search space (less
the formats the profile saw overflow, `planner.build_space`) -> budgets in bytes and loss ->
the exact optimum of the additive proxy (`solve_exact`). The offline job (`search.job`) and the
training-time scheduler run exactly this; what each does after it (a resumable study and a
measured stage; an in-memory, time-bounded study) is theirs.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from ..errors import InfeasibleBudgetError
from ..formats import Format
from ..runtime import EmulationWarning
from .exact import Solution, solve_exact
from .planner import build_space, in_budget_terms
from .space import Budgets, LayerRules, SearchSpace

__all__ = ["Space", "Optimum", "measure_space", "solve_in_budgets"]


@dataclasses.dataclass(frozen=True)
class Space:
    """The measured inputs of a search: the cost model, the sensitivity estimate, the space
    they make and the reasons formats were ruled out per layer."""

    costs: Any  # CostModel
    sensitivity: Any
    space: SearchSpace
    ruled_out: Any


@dataclasses.dataclass(frozen=True)
class Optimum:
    """The budgets in absolute terms (bytes; loss increase) and the exact optimum under them."""

    fp32_bytes: int
    memory: float
    loss_budget: float
    exact: Solution


def measure_space(
    model: nn.Module,
    example_inputs: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    profile: Any,
    *,
    formats: Sequence[Format],
    rules: LayerRules,
    min_precision: int,
    max_precision: int,
    lr: float,
    cost_inputs: Any = None,
    cost_loss_fn: Optional[Callable] = None,
    measure: bool = True,
    times_file: Any = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> Space:
    """Costs, sensitivity and the space of ``model`` (see the module docstring).

    ``batches`` / ``loss_fn``: what the sensitivity estimate differentiates; ``cost_inputs`` /
    ``cost_loss_fn``: the training step the cost model times (default: ``example_inputs``, a
    forward alone); ``measure=False``: roofline times instead of measured ones; ``times_file``:
    keep the measured times there and reuse them. Cost: the cost model's in-place timing (one
    pass per uniform plan unless cached) and one sensitivity pass per batch and format.
    """
    from ..costs import CostModel
    from ..sensitivity import FisherEstimator, estimate_sensitivity

    if progress is not None:
        progress(0, 1, "costing layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # the plan names its emulated layers itself
        costs = CostModel.build(
            model, cost_inputs if cost_inputs is not None else example_inputs, loss_fn=cost_loss_fn,
            formats=formats, measure=measure, times_file=times_file,
        )
        if progress is not None:
            progress(0, 1, "estimating sensitivity")
        sensitivity = estimate_sensitivity(
            model, batches, loss_fn, [f for f in formats if f is not Format.FP32],
            layers=list(costs.layers), example_inputs=example_inputs, estimator=FisherEstimator(lr=lr),
        )
    space, ruled_out = build_space(costs, sensitivity, profile, formats=formats, rules=rules,
                                   min_precision=min_precision, max_precision=max_precision)
    return Space(costs, sensitivity, space, ruled_out)


def solve_in_budgets(found: Space, budgets: Budgets, baseline_loss: Optional[float], source: str = "") -> Optimum:
    """The budgets in bytes and loss increase (``baseline_loss``: what a relative accuracy budget
    is relative to) and the exact optimum under them. Raises `InfeasibleBudgetError` stating the
    smallest budgets reachable, prefixed with ``source``."""
    fp32_bytes = found.costs.fp32_bytes()
    memory = budgets.memory_bytes(fp32_bytes)
    loss_budget = budgets.loss_increase(baseline_loss)
    try:
        exact = solve_exact(found.space, memory, loss_budget)
    except InfeasibleBudgetError as exc:
        raise in_budget_terms(exc, fp32_bytes, baseline_loss if budgets.accuracy_relative else None, source) from None
    return Optimum(fp32_bytes, memory, loss_budget, exact)
