"""The all-FP32 plans, with any blocks recomputed, at their exact bytes (`all_fp32`): the
search's program charges every FP32 layer its lowered neighbours' FP32 saves, which overstates
this family, so `exact.k_best` prices it apart and ranks it among the program's plans. The
recompute set is a knapsack over the blocks (`fp32_recompute_set`)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..formats import Format
from .solution import Solution, over_memory, same_plan
from .space import ChoiceKey, SearchSpace

__all__ = ["all_fp32", "fp32_recompute_set"]


def all_fp32(space: SearchSpace, memory: "float | Mapping[str, float]", loss_budget: float,
              exclude: "Sequence[Solution | Mapping[str, ChoiceKey]]" = ()) -> "Solution | None":
    """The fastest all-FP32 plan meeting the budgets at its exact totals (`SearchSpace.totals`:
    the reference's bytes less what its recomputed blocks free in an all-FP32 region), where
    the space knows them (`SearchSpace.fp32_bytes`), else None; none of ``exclude``.

    The program's additive bytes charge every FP32 layer its lowered neighbours' FP32 saves, so
    they overstate this family of plans (a diffusers UNet's recompute-everything FP32 plan,
    12 MiB as measured, was 28 MB in the program, which then lowered 39 of its 91 layers instead).
    The recompute set is a knapsack over the blocks (`fp32_recompute_set`)."""
    assignment = space.uniform(Format.FP32)
    if space.fp32_bytes is None or assignment is None or space.totals(assignment).loss > loss_budget:
        return None
    recompute = fp32_recompute_set(space, assignment, memory)
    if recompute is None:
        return None
    ordered = [b.name for b in space.blocks if b.name in recompute]
    solution = Solution(assignment, space.totals(assignment, ordered), frozenset(recompute),
                        slowest_part=space.step_seconds(assignment, ordered) if space.parts else None)
    if any(same_plan(solution, e) for e in exclude):
        return None
    return solution


def fp32_recompute_set(space: SearchSpace, assignment: Mapping[str, ChoiceKey], memory: "float | Mapping[str, float]") -> "frozenset[str] | None":
    """The blocks whose recomputation brings the all-FP32 plan within ``memory`` for the least
    predicted seconds (the slowest part's, with parts), None when even all of them do not.
    Nothing when it fits as it is; else one small integer program, a binary per block:

        minimise   Σ_b seconds[b] · r[b]            (or t >= each part's seconds)
        subject to Σ_b freed[b] · r[b] >= bytes - M  (per part: its blocks, its bytes and budget)
    """
    plain = Solution(assignment, space.totals(assignment))
    if not over_memory(space, plain, memory):
        return frozenset()
    effects = [space.fp32_recompute_effect(assignment, [b.name]) for b in space.blocks]
    nb = len(effects)
    if not nb:
        return None
    paced = bool(space.parts)
    n = nb + int(paced)
    rows, bounds = [], []
    if isinstance(memory, Mapping):
        held = space.part_bytes(assignment)
        for part in space.parts:
            own = np.array([space.part_of[b.name] == part.name for b in space.blocks] + [False] * int(paced))
            rows.append(np.where(own, [e.bytes for e in effects] + [0.0] * int(paced), 0.0))
            bounds.append(memory.get(part.name, np.inf) - held[part.name])
    else:
        rows.append(np.array([e.bytes for e in effects]))
        bounds.append(memory - plain.total.bytes)
    cost = np.zeros(n)
    if paced:  # the slowest part's seconds: t bounds each part's (its fixed and units' seconds plus its blocks')
        base = space.part_totals(assignment)
        for part in space.parts:
            row = np.array([e.seconds if space.part_of[b.name] == part.name else 0.0 for b, e in zip(space.blocks, effects)] + [-1.0])
            rows.append(row)
            bounds.append(-base[part.name].seconds)
        cost[-1] = 1.0
        cost[:nb] = 1e-3 * np.array([e.seconds for e in effects])  # a tie-break: no block recomputed off the slowest part for nothing
    else:
        cost[:nb] = [e.seconds for e in effects]
    keep = [i for i, bound in enumerate(bounds) if np.isfinite(bound)]
    upper = np.concatenate([np.ones(nb), np.full(int(paced), np.inf)])
    constraints = [LinearConstraint(np.array([rows[i] for i in keep]), -np.inf, np.array([bounds[i] for i in keep]))] if keep else []
    result = milp(cost, constraints=constraints, integrality=np.concatenate([np.ones(nb), np.zeros(int(paced))]), bounds=Bounds(0, upper))
    if result.x is None:
        return None
    return frozenset(b.name for b, r in zip(space.blocks, result.x[:nb]) if r > 0.5)
