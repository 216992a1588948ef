"""A plan the search returns (`Solution`: formats per unit, recompute set, totals), and the
checks on one: whether it holds more than a memory budget (`over_memory`), whether two are
the same plan (`same_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from .space import Choice, ChoiceKey, SearchSpace

__all__ = ["Solution", "over_memory", "same_plan"]


@dataclasses.dataclass(frozen=True)
class Solution:
    """An assignment (unit name -> format, or an alternative recipe: `space.choice_key`), the
    blocks it recomputes, and its summed cost (fixed costs and recomputation included)."""

    assignment: Mapping[str, ChoiceKey]
    total: Choice
    recompute: frozenset = frozenset()
    gap: float = 0.0  # its predicted step's relative gap to the best step proven (layers and the rest; MIP_GAP or less when solved to the end)
    slowest_part: "float | None" = None  # a space with parts: its slowest part's seconds (`SearchSpace.step_seconds`)

    @property
    def step_seconds(self) -> float:
        """The seconds of its step, what the search minimises: the slowest part's in a space with
        parts (pipeline stages), else the total's."""
        return self.total.seconds if self.slowest_part is None else self.slowest_part


def over_memory(space: SearchSpace, solution: Solution, memory: "float | Mapping[str, float]") -> bool:
    """Whether ``solution`` holds more bytes than ``memory`` allows (per part, given by part)."""
    if isinstance(memory, Mapping):
        held = space.part_bytes(solution.assignment, solution.recompute)
        return any(held[name] > memory.get(name, np.inf) for name in held)
    return solution.total.bytes > memory


def same_plan(a: Solution, b: "Solution | Mapping[str, ChoiceKey]") -> bool:
    """Whether ``b`` is the plan ``a`` is: the same formats and recompute set (an assignment recomputes nothing)."""
    assignment, recompute = (b.assignment, b.recompute) if isinstance(b, Solution) else (b, frozenset())
    return dict(a.assignment) == dict(assignment) and frozenset(a.recompute) == frozenset(recompute)
