"""The exact optimum of the additive proxy, as an integer program.

    minimise   Σ_u Σ_f seconds[u,f] · x[u,f]
    subject to Σ_f x[u,f] = 1                      (one format per unit)
               Σ_u Σ_f bytes[u,f] · x[u,f] <= M    (memory budget)
               Σ_u Σ_f loss[u,f]  · x[u,f] <= L    (accuracy budget)
               x binary

This is the multiple-choice knapsack with two capacity constraints. A dynamic programme would
have to discretise both capacities; HiGHS (through ``scipy.optimize.milp``) solves it exactly,
in milliseconds for hundreds of layers. It warm-starts the Optuna study and is the reference the
study's best proxy objective is checked against.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import InfeasibleBudgetError, SearchError
from ..formats import Format
from .space import Choice, SearchSpace

__all__ = ["Solution", "solve_exact", "smallest_reachable"]


@dataclasses.dataclass(frozen=True)
class Solution:
    """An assignment (unit name -> format) and its summed cost (fixed costs included)."""

    assignment: Mapping[str, Format]
    total: Choice


def _program(space: SearchSpace):
    columns = [(u.name, f, c) for u in space.units for f, c in u.choices.items()]
    n = len(columns)
    one_hot = np.zeros((len(space.units), n))
    start = 0
    for row, unit in enumerate(space.units):
        one_hot[row, start : start + len(unit.choices)] = 1
        start += len(unit.choices)
    bytes_ = np.array([c.bytes for _, _, c in columns])
    loss = np.array([c.loss for _, _, c in columns])
    seconds = np.array([c.seconds for _, _, c in columns])
    return columns, one_hot, bytes_, loss, seconds


def _solve(space: SearchSpace, objective: np.ndarray, memory: float, loss_budget: float):
    columns, one_hot, bytes_, loss, _ = _program(space)
    fixed_bytes, fixed_loss = space.fixed_total.bytes, space.fixed_total.loss
    constraints = [LinearConstraint(one_hot, 1, 1)]
    if np.isfinite(memory):
        constraints.append(LinearConstraint(bytes_[None, :], -np.inf, memory - fixed_bytes))
    if np.isfinite(loss_budget):
        constraints.append(LinearConstraint(loss[None, :], -np.inf, loss_budget - fixed_loss))
    result = milp(objective, constraints=constraints, integrality=np.ones(len(columns)), bounds=Bounds(0, 1),
                  options={"mip_rel_gap": 0.0})
    if result.x is None:
        return None
    chosen = {name: fmt for (name, fmt, _), x in zip(columns, result.x) if x > 0.5}
    return Solution(chosen, space.totals(chosen))


def smallest_reachable(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf")) -> tuple[float, float]:
    """(least bytes reachable within the loss budget, least loss reachable within the memory
    budget); a budget that is unreachable even alone is dropped from the other's computation."""
    _, _, bytes_, loss, _ = _program(space)
    any_plan = float("inf")
    least_bytes = _solve(space, bytes_, any_plan, loss_budget) or _solve(space, bytes_, any_plan, any_plan)
    least_loss = _solve(space, loss, memory_bytes, any_plan) or _solve(space, loss, any_plan, any_plan)
    return least_bytes.total.bytes, least_loss.total.loss


def solve_exact(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf")) -> Solution:
    """The assignment with the least step time meeting both budgets (absolute bytes and loss).

    Raises `InfeasibleBudgetError` stating the smallest memory and loss increase reachable.
    """
    if not space.units:
        raise SearchError("the search space has no layers")
    _, _, _, _, seconds = _program(space)
    solution = _solve(space, seconds, memory_bytes, loss_budget)
    if solution is not None:
        return solution
    min_bytes, min_loss = smallest_reachable(space, memory_bytes, loss_budget)
    floor_bytes = space.totals(space.extreme("bytes")).bytes
    floor_loss = space.totals(space.extreme("loss")).loss
    if memory_bytes < floor_bytes:
        detail = f"the memory budget {memory_bytes:,.0f} bytes is below the smallest reachable at all, {floor_bytes:,.0f} bytes"
    elif loss_budget < floor_loss:
        detail = f"the loss budget {loss_budget:.4g} is below the smallest loss increase reachable at all, {floor_loss:.4g}"
    else:
        detail = (
            f"within the loss budget the smallest memory reachable is {min_bytes:,.0f} bytes, and within the memory "
            f"budget the smallest loss increase reachable is {min_loss:.4g}"
        )
    raise InfeasibleBudgetError(
        f"no plan meets the budgets (memory <= {memory_bytes:,.0f} bytes, loss increase <= {loss_budget:.4g}): {detail}; "
        "raise a budget to at least that",
        min_bytes,
        min_loss,
    )
