"""The optimum of the additive proxy, as an integer program solved to a proven gap (`MIP_GAP`).

    minimise   Σ_u Σ_f seconds[u,f] · x[u,f]
    subject to Σ_f x[u,f] = 1                      (one format per unit)
               Σ_u Σ_f bytes[u,f] · x[u,f] <= M    (memory budget)
               Σ_u Σ_f loss[u,f]  · x[u,f] <= L    (accuracy budget)
               x binary

This is the multiple-choice knapsack with two capacity constraints. A dynamic programme would
have to discretise both capacities; HiGHS (through ``scipy.optimize.milp``) solves it to a
relative optimality gap of `MIP_GAP` (the predicted step time of the plan returned is within
that fraction of the optimum's, a bound HiGHS proves; `Solution.gap` is the one it reached).
Closing the last 0.1 % is most of the time past a few hundred layers (the layers of one role
cost alike, so many plans tie within it), and it is far below the noise of the measured step
times the candidates are then judged on. The matrices are sparse: O(variables) entries.

The candidates the measured stage runs are the **k best** assignments (`k_best`): the optimum,
then the optimum of the same program with a no-good cut per assignment already found,

    Σ_{(u,f) chosen in it} x[u,f] <= units - 1     (at least one unit takes another format)

so the i-th solution is the i-th fastest predicted plan that meets the budgets, distinct in
formats from the ones before it.

**Recompute blocks** (`SearchSpace.blocks`, `space.Block`): a binary r[b] per block says it runs
its forward again in the backward, freeing the saved bytes of its layers in their chosen formats
for one more forward of them; the products of x and r are linearised exactly and tightly
(`_program`), so the program is exactly the choice of formats and recompute set. Without blocks
the program is the one above, unchanged.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import InfeasibleBudgetError, SearchError
from ..formats import Format
from .space import Choice, SearchSpace

__all__ = ["MIP_GAP", "Solution", "solve_exact", "smallest_reachable", "k_best"]

# The relative optimality gap the solves stop at (HiGHS's mip_rel_gap): proven, not estimated.
MIP_GAP = 1e-3


@dataclasses.dataclass(frozen=True)
class Solution:
    """An assignment (unit name -> format), the blocks it recomputes, and its summed cost (fixed
    costs and recomputation included)."""

    assignment: Mapping[str, Format]
    total: Choice
    recompute: frozenset = frozenset()
    gap: float = 0.0  # the relative optimality gap HiGHS proved for it (at most MIP_GAP when solved to the end)


@dataclasses.dataclass(frozen=True)
class _Program:
    """The variables and coefficient vectors of one space's program (see the module docstring):
    x per (unit, format) column, then r per block, then z per link (unit column, block)."""

    columns: list  # (unit name, format, Choice) per x
    blocks: tuple[str, ...]  # per r
    links: list  # (x index, r index, freed bytes, forward seconds) per z
    one_hot: sparse.csr_array  # units x variables
    bytes: np.ndarray
    loss: np.ndarray
    seconds: np.ndarray

    @property
    def size(self) -> int:
        return len(self.columns) + len(self.blocks) + len(self.links)


def _program(space: SearchSpace) -> _Program:
    """The program of ``space``, recompute blocks included.

    Recomputing block b frees the saved bytes of its layers in their chosen formats and costs one
    more forward of them: the product z[u,f,b] = x[u,f] · r[b] per (unit column, block) link,
    continuous in [0, 1], with

        z[u,f,b] <= x[u,f]                 (per link)
        Σ_f z[u,f,b] = r[b]                (per unit of the block: one format is chosen)

    which is exact (r = 1: the z of a unit sum to 1 under x, which is one-hot, so z = x; r = 0:
    z = 0) and, unlike the textbook z >= x + r - 1 per link, tight in the LP relaxation, which
    spares HiGHS from branching over blocks (a 12-block GPT: 60 s, the time limit, before).
    Bytes are x's minus freed · z, seconds add forward · z; the block's own ops add
    -other_bytes[b] · r[b] to the bytes and other_seconds[b] · r[b] to the objective;
    recomputation adds no loss.
    """
    columns = [(u.name, f, c) for u in space.units for f, c in u.choices.items()]
    index = {(name, f): i for i, (name, f, _) in enumerate(columns)}
    blocks = tuple(b.name for b in space.blocks)
    links = [(index[(unit, f)], r, freed, forward)
             for r, name in enumerate(blocks) for unit, per in space.links[name] for f, (freed, forward) in per.items()]
    nx, nb, nl = len(columns), len(blocks), len(links)
    n = nx + nb + nl
    # Unit u's row has a 1 on each of its x columns (contiguous, in unit order): sparse.
    widths = [len(unit.choices) for unit in space.units]
    one_hot = sparse.csr_array((np.ones(nx), (np.repeat(np.arange(len(widths)), widths), np.arange(nx))), shape=(len(widths), n))
    bytes_, loss, seconds = np.zeros(n), np.zeros(n), np.zeros(n)
    bytes_[:nx] = [c.bytes for _, _, c in columns]
    loss[:nx] = [c.loss for _, _, c in columns]
    seconds[:nx] = [c.seconds for _, _, c in columns]
    for r, block in enumerate(space.blocks):
        bytes_[nx + r] = -block.other_bytes
        seconds[nx + r] = block.other_seconds
    for j, (_, _, freed, forward) in enumerate(links):
        bytes_[nx + nb + j] = -freed
        seconds[nx + nb + j] = forward
    return _Program(columns, blocks, links, one_hot, bytes_, loss, seconds)


def _cut(program: _Program, found: "Solution | Mapping[str, Format]") -> tuple[np.ndarray, float]:
    """The no-good cut of ``found`` (a `Solution`, or an assignment recomputing nothing): a row
    and its upper bound, so that this assignment with this recompute set is not chosen again.

    With recompute set R the row adds Σ_{b in R} r[b] - Σ_{b not in R} r[b] and the bound |R|,
    so the same formats with another recompute set are another plan."""
    assignment, recompute = (found.assignment, found.recompute) if isinstance(found, Solution) else (found, frozenset())
    row = np.zeros(program.size)
    row[: len(program.columns)] = [float(assignment[name] is fmt) for name, fmt, _ in program.columns]
    nx = len(program.columns)
    for r, name in enumerate(program.blocks):
        row[nx + r] = 1.0 if name in recompute else -1.0
    units = program.one_hot.shape[0]
    return row, units + sum(1 for name in program.blocks if name in recompute) - 1


def _solve(space: SearchSpace, objective: str, memory: float, loss_budget: float,
           cuts: "Sequence[Solution | Mapping[str, Format]]" = (), time_limit: "float | None" = None, proven: bool = False):
    program = _program(space)
    nx, nb, nl = len(program.columns), len(program.blocks), len(program.links)
    fixed_bytes, fixed_loss = space.fixed_total.bytes, space.fixed_total.loss
    # Sparse rows: a unit's one-hot row and a link's rows name 2-6 variables each, so the
    # matrices hold O(variables) entries (dense, 1,025 layers would be ~10^7 per matrix).
    constraints = [LinearConstraint(program.one_hot, 1, 1)]
    if nl:
        # z = x · r exactly (`_program`): z <= x per link, and per (unit, block) the unit's z sum to r.
        rows, cols, vals = [], [], []
        pairs: dict[tuple[str, int], list[int]] = {}
        for j, (i, r, _, _) in enumerate(program.links):
            rows += [j, j]
            cols += [i, nx + nb + j]
            vals += [-1.0, 1.0]
            pairs.setdefault((program.columns[i][0], r), []).append(j)
        below = sparse.csr_array((vals, (rows, cols)), shape=(nl, program.size))
        rows, cols, vals = [], [], []
        for row, ((_, r), js) in enumerate(pairs.items()):
            rows += [row] * (len(js) + 1)
            cols += [nx + nb + j for j in js] + [nx + r]
            vals += [1.0] * len(js) + [-1.0]
        per_unit = sparse.csr_array((vals, (rows, cols)), shape=(len(pairs), program.size))
        constraints += [LinearConstraint(below, -np.inf, 0.0), LinearConstraint(per_unit, 0.0, 0.0)]
    if np.isfinite(memory):
        constraints.append(LinearConstraint(program.bytes[None, :], -np.inf, memory - fixed_bytes))
    if np.isfinite(loss_budget):
        constraints.append(LinearConstraint(program.loss[None, :], -np.inf, loss_budget - fixed_loss))
    if cuts:  # one no-good cut per plan found: it may not be chosen again
        cut_rows, bounds = zip(*(_cut(program, found) for found in cuts))
        constraints.append(LinearConstraint(np.array(cut_rows), -np.inf, np.array(bounds)))
    vector = {"bytes": program.bytes, "loss": program.loss, "seconds": program.seconds}[objective]
    # HiGHS stops at an absolute gap of 1e-6 too (scipy exposes no option for it): step times
    # of a few ms would differ below it, so the objective is scaled to about 1e6 in total.
    scale = np.abs(vector).max(initial=0.0) * len(space.units)
    vector = vector * (1e6 / scale) if scale > 0 else vector
    options = {"mip_rel_gap": MIP_GAP}
    if time_limit is not None:
        options["time_limit"] = max(float(time_limit), 1e-3)
    integrality = np.concatenate([np.ones(nx + nb), np.zeros(nl)])  # z follows x and r: continuous
    result = milp(vector, constraints=constraints, integrality=integrality, bounds=Bounds(0, 1), options=options)
    if result.x is None or (proven and result.status != 0):  # 0: proven optimal
        return None
    chosen = {name: fmt for (name, fmt, _), x in zip(program.columns, result.x[:nx]) if x > 0.5}
    recompute = frozenset(name for name, r in zip(program.blocks, result.x[nx : nx + nb]) if r > 0.5)
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return Solution(chosen, space.totals(chosen, sorted(recompute, key=program.blocks.index)), recompute, gap)


def smallest_reachable(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf")) -> tuple[float, float]:
    """(least bytes reachable within the loss budget, least loss reachable within the memory
    budget), recomputation included; a budget that is unreachable even alone is dropped from the
    other's computation."""
    any_plan = float("inf")
    least_bytes = _solve(space, "bytes", any_plan, loss_budget) or _solve(space, "bytes", any_plan, any_plan)
    least_loss = _solve(space, "loss", memory_bytes, any_plan) or _solve(space, "loss", any_plan, any_plan)
    return least_bytes.total.bytes, least_loss.total.loss


def solve_exact(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf")) -> Solution:
    """The assignment with the least step time meeting both budgets (absolute bytes and loss).

    Raises `InfeasibleBudgetError` stating the smallest memory and loss increase reachable.
    Exact, where a sampler such as Optuna's TPE on this table stays far from the optimum
    (+72 % predicted step time after 1,000 trials on 120 layers).
    """
    return k_best(space, memory_bytes, loss_budget, 1)[0]


def _infeasible(space: SearchSpace, memory_bytes: float, loss_budget: float) -> InfeasibleBudgetError:
    min_bytes, min_loss = smallest_reachable(space, memory_bytes, loss_budget)
    # Formats alone: each unit's least bytes add up; recomputing blocks can go lower still.
    formats_floor = space.totals(space.extreme("bytes")).bytes
    recompute_floor = _solve(space, "bytes", float("inf"), float("inf")).total.bytes if space.blocks else None
    floor_bytes = formats_floor if recompute_floor is None else recompute_floor
    floor_loss = space.totals(space.extreme("loss")).loss
    floors: dict = {}
    if memory_bytes < floor_bytes:
        floors = {"formats_floor": formats_floor, "recompute_floor": recompute_floor}
        if recompute_floor is None:
            detail = (f"the memory budget {memory_bytes:,.0f} bytes is below the smallest reachable with formats alone, "
                      f"{formats_floor:,.0f} bytes (no block to recompute)")
        else:
            detail = (f"the memory budget {memory_bytes:,.0f} bytes is below the smallest reachable: {formats_floor:,.0f} bytes "
                      f"with formats alone, {recompute_floor:,.0f} bytes with blocks recomputed as well")
    elif loss_budget < floor_loss:
        detail = f"the loss budget {loss_budget:.4g} is below the smallest loss increase reachable at all, {floor_loss:.4g}"
    else:
        detail = (
            f"within the loss budget the smallest memory reachable is {min_bytes:,.0f} bytes, and within the memory "
            f"budget the smallest loss increase reachable is {min_loss:.4g}"
        )
    return InfeasibleBudgetError(
        f"no plan meets the budgets (memory <= {memory_bytes:,.0f} bytes, loss increase <= {loss_budget:.4g}): {detail}; "
        "raise a budget to at least that",
        min_bytes,
        min_loss,
        **floors,
    )


def k_best(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf"), k: int = 1,
           *, time_limit: "float | None" = None, exclude: "Sequence[Solution | Mapping[str, Format]]" = ()) -> list[Solution]:
    """Up to ``k`` assignments meeting both budgets, distinct in formats, in non-decreasing
    predicted step time: the optimum (as `solve_exact`), then each next-best under no-good cuts
    of those found (see the module docstring). Fewer than ``k`` when fewer plans are feasible.

    ``exclude``: plans none of the solutions may be (a no-good cut each, from the first
    solve on): `Solution` objects, or assignments (which then recompute no block). ``time_limit``: seconds for all the solves together; once spent, the solutions found so far
    are returned (at least the first, which HiGHS may then return short of proven optimal).
    Raises `InfeasibleBudgetError` like `solve_exact` when no plan meets the budgets. Costs one
    integer program per solution, each a little larger than the last (one row per cut).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SearchError(f"k must be an integer >= 1, got {k!r}")
    deadline = None if time_limit is None else time.monotonic() + time_limit
    left = lambda: None if deadline is None else deadline - time.monotonic()  # noqa: E731  (seconds left, None: no limit)
    spent = lambda: deadline is not None and time.monotonic() >= deadline  # noqa: E731
    if not space.units:
        raise SearchError("the search space has no layers")
    exclude = list(exclude)
    first = _solve(space, "seconds", memory_bytes, loss_budget, cuts=exclude, time_limit=left())
    if first is None and spent():
        raise SearchError(f"the integer program found no plan within {time_limit:.3g} s; allow the search more time")
    if first is None:
        raise _infeasible(space, memory_bytes, loss_budget)
    found = [first]
    while len(found) < k and not spent():
        # Only a proven optimum keeps the order; one cut short by the time limit ends the list.
        nxt = _solve(space, "seconds", memory_bytes, loss_budget, cuts=exclude + found, time_limit=left(), proven=True)
        if nxt is None:
            break
        found.append(nxt)
    return found
