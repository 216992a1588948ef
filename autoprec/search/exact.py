"""The optimum of the additive proxy, as an integer program solved to a proven gap (`MIP_GAP`).

    minimise   Σ_u Σ_f seconds[u,f] · x[u,f]
    subject to Σ_f x[u,f] = 1                      (one format per unit)
               Σ_u Σ_f bytes[u,f] · x[u,f] <= M    (memory budget; or one row per memory part p,
                                                    over its units, <= M_p: a pipeline stage's device)
               Σ_u Σ_f loss[u,f]  · x[u,f] <= L    (accuracy budget)
               x binary

This is the multiple-choice knapsack with two capacity constraints. A dynamic programme would
have to discretise both capacities; HiGHS (through ``scipy.optimize``) solves it to a relative
optimality gap of `MIP_GAP`: the predicted step time of the plan returned is within that
fraction of the optimum's, a bound proven (`Solution.gap` is the one reached). The step includes
what lies outside the layers (`SearchSpace.fixed_total`, the same in every plan), so the layers'
part is proven to the looser gap that keeps the step's (`_layers_gap`). Each solve is an
LP relaxation, then a small integer program around its fractional part (`_solve`); the whole
program only where that does not prove the gap. One percent of a predicted step time is below
what the prediction itself misses by (the candidates are then judged on measured steps), and
the LP bound proves it from a few hundred layers on, where proving 0.1 % took HiGHS's branching
seconds to a minute (and 0.5 % sat at the edge of the LP bound on a 32-block Llama). The matrices
are sparse: O(variables) entries, so a solve is near-linear in the layers.

The candidates the measured stage runs are the **k best** assignments (`k_best`): the optimum,
then the optimum of the same program with a no-good cut per assignment already found,

    Σ_{(u,f) chosen in it} x[u,f] <= units - 1     (at least one unit takes another format)

so the i-th solution is the i-th fastest predicted plan that meets the budgets, distinct in
formats from the ones before it.

**Memory parts** (`SearchSpace.parts`: a pipeline's stages, each on its own device, running at
once): one memory row per part, and the step is the slowest part's, so the program minimises a
continuous t that bounds every part's seconds (`_pace_rows`), with the predicted loss as a
tie-break among plans about as fast (`_objective`):

    minimise   t + PACE_TIE · Σ loss · x
    subject to Σ_{(u,f) in part p} seconds[u,f] · x[u,f] + fixed_seconds[p] <= t     (per part p)

A sum over the stages would lower whichever stage's layers save the most, leaving the slowest
stage, which sets the pipeline's pace, as slow as before.

**Recompute blocks** (`SearchSpace.blocks`, `space.Block`): a binary r[b] per block says it runs
its forward again in the backward, freeing the saved bytes of its layers in their chosen formats
for one more forward of them; the products of x and r are linearised exactly and tightly
(`_program`), so the program is exactly the choice of formats and recompute set. Without blocks
the program is the one above, unchanged.

**Pairs** (`SearchSpace.unit_pairs`): bytes a unit's FP32 choice holds only while the unit
before it is lowered (an FP32 copy of a half input). A continuous y per pair, in [0, 1], with

    y[p] <= Σ_{f FP32} x[u,f]    y[p] <= Σ_{f FP32} x[v,f]

subtracts its bytes · y[p]: at most both units' FP32 indicators' product, and since y only
lowers the bytes and costs nothing, a plan short of memory takes it at that product. y is never
fixed by the restricted solves (`_solve`): it follows the x it bounds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..errors import InfeasibleBudgetError, SearchError
from ..formats import Format
from .all_fp32 import all_fp32
from .solution import Solution, same_plan
from .space import ChoiceKey, SearchSpace, choice_key, key_format

__all__ = ["MIP_GAP", "solve_exact", "smallest_reachable", "k_best"]

# The relative optimality gap a solve stops at: proven (by the LP bound, or HiGHS's own), not estimated.
MIP_GAP = 1e-2


@dataclasses.dataclass(frozen=True)
class _Program:
    """The variables and coefficient vectors of one space's program (see the module docstring):
    x per (unit, format) column, then r per block, then z per link (unit column, block), then y
    per pair (`SearchSpace.unit_pairs`)."""

    columns: list  # (unit name, format, Choice) per x
    blocks: tuple[str, ...]  # per r
    links: list  # (x index, r index, freed bytes, forward seconds) per z
    one_hot: sparse.csr_array  # units x variables
    bytes: np.ndarray
    loss: np.ndarray
    seconds: np.ndarray
    paced: bool = False  # one more variable, last: t, the slowest part's seconds (`_pace_rows`)
    pairs: list = dataclasses.field(default_factory=list)  # (FP32 x indices of the unit, of the unit before, bytes) per y

    @property
    def size(self) -> int:
        return len(self.columns) + len(self.blocks) + len(self.links) + len(self.pairs) + int(self.paced)

    @property
    def continuous(self) -> int:
        """Variables after x and r: z, y and t."""
        return len(self.links) + len(self.pairs) + int(self.paced)

    @property
    def upper(self) -> np.ndarray:
        """Each variable's upper bound: 1 (x, r, z, y), unbounded for t."""
        return np.concatenate([np.ones(self.size - int(self.paced)), np.full(int(self.paced), np.inf)])


def _program(space: SearchSpace, paced: bool = False) -> _Program:
    """The program of ``space``, recompute blocks included; ``paced``: with the variable t of the
    slowest part's seconds (a space with parts, minimising step time: `_pace_rows`).

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
    fp32: dict[str, list[int]] = {}
    for i, (name, f, _) in enumerate(columns):
        if key_format(f) is Format.FP32:
            fp32.setdefault(name, []).append(i)
    pairs = [(fp32[u], fp32[v], nbytes) for u, v, nbytes in space.unit_pairs if u in fp32 and v in fp32]
    nx, nb, nl, npair = len(columns), len(blocks), len(links), len(pairs)
    n = nx + nb + nl + npair + int(paced)
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
    for j, (_, _, nbytes) in enumerate(pairs):
        bytes_[nx + nb + nl + j] = -nbytes
    return _Program(columns, blocks, links, one_hot, bytes_, loss, seconds, paced, pairs)


def _cut(program: _Program, found: "Solution | Mapping[str, ChoiceKey]") -> tuple[np.ndarray, float]:
    """The no-good cut of ``found`` (a `Solution`, or an assignment recomputing nothing): a row
    and its upper bound, so that this assignment with this recompute set is not chosen again.

    With recompute set R the row adds Σ_{b in R} r[b] - Σ_{b not in R} r[b] and the bound |R|,
    so the same formats with another recompute set are another plan."""
    nx, nb = len(program.columns), len(program.blocks)
    row = _variables(program, found)
    recomputed = row[nx : nx + nb].copy()
    row[nx : nx + nb] = 2.0 * recomputed - 1.0  # +1 per block in R, -1 per block not
    row[nx + nb :] = 0.0
    units = program.one_hot.shape[0]
    return row, units + recomputed.sum() - 1


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The program's rows as ``upper @ v <= upper_bound`` and ``equal @ v == equal_bound``
    (sparse): one-hot per unit and the links' (`_program`) equal; budgets and cuts upper."""

    upper: sparse.csr_array
    upper_bound: np.ndarray
    equal: sparse.csr_array
    equal_bound: np.ndarray

    def constraints(self) -> list[LinearConstraint]:
        return [LinearConstraint(self.equal, self.equal_bound, self.equal_bound), LinearConstraint(self.upper, -np.inf, self.upper_bound)]


def _rows(space: SearchSpace, program: _Program, memory: "float | Mapping[str, float]", loss_budget: float,
          cuts: "Sequence[Solution | Mapping[str, ChoiceKey]]", pace: "float | None" = None) -> _Rows:
    nx, nb, nl = len(program.columns), len(program.blocks), len(program.links)
    # Sparse rows: a unit's one-hot row and a link's rows name 2-6 variables each, so the
    # matrices hold O(variables) entries (dense, 1,025 layers would be ~10^7 per matrix).
    equal, equal_bound = [program.one_hot], [np.ones(program.one_hot.shape[0])]
    upper, upper_bound = [], []
    if nl:
        # z = x · r exactly (`_program`): z <= x per link, and per (unit, block) the unit's z sum to r.
        rows, cols, vals = [], [], []
        pairs: dict[tuple[str, int], list[int]] = {}
        for j, (i, r, _, _) in enumerate(program.links):
            rows += [j, j]
            cols += [i, nx + nb + j]
            vals += [-1.0, 1.0]
            pairs.setdefault((program.columns[i][0], r), []).append(j)
        upper.append(sparse.csr_array((vals, (rows, cols)), shape=(nl, program.size)))
        upper_bound.append(np.zeros(nl))
        rows, cols, vals = [], [], []
        for row, ((_, r), js) in enumerate(pairs.items()):
            rows += [row] * (len(js) + 1)
            cols += [nx + nb + j for j in js] + [nx + r]
            vals += [1.0] * len(js) + [-1.0]
        equal.append(sparse.csr_array((vals, (rows, cols)), shape=(len(pairs), program.size)))
        equal_bound.append(np.zeros(len(pairs)))
    if program.pairs:
        # y <= the FP32 indicator of each of its two units (module docstring).
        rows, cols, vals = [], [], []
        for j, (unit, before, _) in enumerate(program.pairs):
            for row, indices in ((2 * j, unit), (2 * j + 1, before)):
                rows += [row] * (len(indices) + 1)
                cols += [nx + nb + nl + j] + list(indices)
                vals += [1.0] + [-1.0] * len(indices)
        upper.append(sparse.csr_array((vals, (rows, cols)), shape=(2 * len(program.pairs), program.size)))
        upper_bound.append(np.zeros(2 * len(program.pairs)))
    budgets = _memory_rows(space, program, memory) + [_scaled(program.loss, loss_budget - space.fixed_total.loss)]
    if program.paced and pace is not None:
        budgets += _pace_rows(space, program, pace)
    cut_rows = [_cut(program, found) for found in cuts]  # one no-good cut per plan found: it may not be chosen again
    for coefficients, bound in budgets + cut_rows:
        if np.isfinite(bound):
            upper.append(sparse.csr_array(coefficients[None, :]))
            upper_bound.append(np.array([bound]))
    if not upper:
        upper, upper_bound = [sparse.csr_array((1, program.size))], [np.zeros(1)]
    return _Rows(sparse.vstack(upper, format="csr"), np.concatenate(upper_bound), sparse.vstack(equal, format="csr"), np.concatenate(equal_bound))


def _owners(space: SearchSpace, program: _Program) -> np.ndarray:
    """Per variable the memory part holding it (t, of no part: None)."""
    return np.array([space.part_of[name] for name, _, _ in program.columns] + [space.part_of[name] for name in program.blocks]
                    + [space.part_of[program.columns[i][0]] for i, _, _, _ in program.links]
                    + [space.part_of[program.columns[unit[0]][0]] for unit, _, _ in program.pairs] + [None] * int(program.paced), dtype=object)


def _memory_rows(space: SearchSpace, program: _Program, memory: "float | Mapping[str, float]") -> list[tuple[np.ndarray, float]]:
    """The memory budget's rows: one over every byte, or, with a budget per memory part
    (``memory`` by part name, `SearchSpace.parts`: a pipeline stage's device), one per part over
    its units', blocks' and links' bytes, bounded by its budget less its fixed bytes."""
    if not isinstance(memory, Mapping):
        return [_scaled(program.bytes, memory - space.fixed_total.bytes)]
    owner = _owners(space, program)
    return [_scaled(np.where(owner == part.name, program.bytes, 0.0), memory.get(part.name, np.inf) - part.fixed_bytes) for part in space.parts]


def _pace_rows(space: SearchSpace, program: _Program, pace: float) -> list[tuple[np.ndarray, float]]:
    """Each part's seconds (its units', blocks' and links', plus its fixed seconds), in the
    objective's units (times ``pace``), at most t: minimising t minimises the slowest part's.

        Σ_{v in part p} seconds[v] · v - t <= -fixed_seconds[p]     (per part p)
    """
    owner = _owners(space, program)
    rows = []
    for part in space.parts:
        row = np.where(owner == part.name, program.seconds * pace, 0.0)
        row[-1] = -1.0
        rows.append(_scaled(row, -part.fixed_seconds * pace))
    return rows


def _scaled(coefficients: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """A budget row divided by its largest magnitude (its coefficients' or its bound's). HiGHS
    holds a row to an absolute feasibility tolerance (1e-7): a loss budget of a few 1e-6 (a small
    model's per-token increases) would be met with plans up to a few percent over it, and the
    least bytes within it stated too low (found with NVFP4 layers of a byte LM)."""
    scale = max(float(np.abs(coefficients).max(initial=0.0)), abs(bound) if np.isfinite(bound) else 0.0)
    return (coefficients / scale, bound / scale) if scale > 0 else (coefficients, bound)


def _components(space: SearchSpace, program: _Program) -> np.ndarray:
    """Per variable, its component: a block with its units (their x, its r, their z), or a unit
    in no block. Components are what the objective and the one-hot and link rows keep apart:
    only the budget rows and the cuts join them."""
    nb = len(program.blocks)
    unit_index = {u.name: i for i, u in enumerate(space.units)}
    parent = list(range(len(space.units) + nb))  # units, then blocks: union-find

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for r, name in enumerate(program.blocks):
        for unit, _ in space.links[name]:
            parent[root(unit_index[unit])] = root(len(space.units) + r)
    of_unit = [root(unit_index[name]) for name, _, _ in program.columns]
    of_block = [root(len(space.units) + r) for r in range(nb)]
    of_link = [of_unit[i] for i, _, _, _ in program.links]
    # y and t: a component of their own, never fixed (`_solve`): y follows the x it bounds.
    of_free = [len(space.units) + nb] * (len(program.pairs) + int(program.paced))
    return np.array(of_unit + of_block + of_link + of_free, dtype=np.int64)


def _solve(space: SearchSpace, objective: str, memory: "float | Mapping[str, float]", loss_budget: float,
           cuts: "Sequence[Solution | Mapping[str, ChoiceKey]]" = (), time_limit: "float | None" = None, proven: bool = False):
    """The program's optimum to `MIP_GAP`, None when infeasible (or, with ``proven``, when the
    gap was not proven within ``time_limit``).

    First the LP relaxation, a lower bound: the formulation is each component's convex hull
    (`_program`, `_components`), so its optimum leaves at most one component fractional per
    budget or cut row. Then the integer program with all but the fractional components and a
    few more (`FREED_NEIGHBOURS`) fixed at the LP's choice, or first, with cuts, at the last
    plan found (`_restricted`): when its optimum is within `MIP_GAP` of the LP bound, that gap
    is proven and it is the answer. Otherwise (a small model, where one block is a large share
    of the step, or an LP bound too weak to prove the k-th plan), the whole integer program: at
    once where the restricted one would free every component (a model of a few blocks).
    Costs one LP of O(variables) entries and a few programs of a few components each, where
    HiGHS on the whole program spends seconds past a few hundred layers proving a gap the LP
    bound alone cannot (on a 32-block Llama it still does, for a second plan, in some runs)."""
    program = _program(space, paced=objective == "seconds" and bool(space.parts))
    nx, nb = len(program.columns), len(program.blocks)
    vector, offset, pace = _objective(space, program, objective)
    rows = _rows(space, program, memory, loss_budget, cuts, pace)
    deadline = None if time_limit is None else time.monotonic() + max(float(time_limit), 1e-3)
    integrality = np.concatenate([np.ones(nx + nb), np.zeros(program.continuous)])  # z and y follow x and r, t bounds the parts: continuous
    upper = program.upper
    relaxed = linprog(vector, A_ub=rows.upper, b_ub=rows.upper_bound, A_eq=rows.equal, b_eq=rows.equal_bound, bounds=np.column_stack([np.zeros_like(upper), upper]),
                      method="highs", options=_limited({}, deadline))
    if relaxed.x is None:  # infeasible (so is the integer program), or out of time
        return None
    component = _components(space, program)
    # Around the LP's choice; with cuts, first around the last plan found: the next best plan
    # is most often a change of a few components of it, where the LP's choice is one of the
    # plans the cuts rule out.
    centres = ([_variables(program, cuts[-1])] if cuts else []) + [np.round(relaxed.x)]
    x, gap, feasible = None, np.inf, np.inf  # feasible: the least layers' part of a plan found, bounding the optimum's
    # The components each try frees depend on the LP alone, not on the centre: found once.
    always = {int(component[-1])} if program.paced or program.pairs else set()  # y's and t's component: never fixed
    freed = {n: _freed(relaxed, component, n) | always for n in FREED_NEIGHBOURS}
    components = len(np.unique(component))
    for centre, neighbours in ((c, n) for c in centres for n in FREED_NEIGHBOURS):
        free = freed[neighbours]
        if len(free) == components:
            # Nothing left to fix (a model of a few blocks): this is the whole program, solved
            # once below to the gap it needs, not again per centre and count.
            break
        found = _restricted(vector, rows, integrality, component, free, centre, upper, deadline)
        if found is None:
            continue
        gap = _total_gap(found.fun, relaxed.fun, offset)
        if gap <= MIP_GAP:
            x = found.x
            break
        feasible = min(feasible, found.fun)
    if x is None:
        result = milp(vector, constraints=rows.constraints(), integrality=integrality, bounds=Bounds(0, upper),
                      options=_limited({"mip_rel_gap": _layers_gap(offset, feasible)}, deadline))
        if result.x is None or (proven and result.status != 0):  # 0: proven optimal
            return None
        x, bound = result.x, getattr(result, "mip_dual_bound", None)
        if bound is None or not np.isfinite(bound):  # the bound from HiGHS's own gap
            bound = result.fun * (1.0 - float(getattr(result, "mip_gap", 0.0) or 0.0))
        gap = _total_gap(result.fun, bound, offset)
    chosen = {name: fmt for (name, fmt, _), v in zip(program.columns, x[:nx]) if v > 0.5}
    recompute = frozenset(name for name, r in zip(program.blocks, x[nx : nx + nb]) if r > 0.5)
    ordered = sorted(recompute, key=program.blocks.index)
    return Solution(chosen, space.totals(chosen, ordered), recompute, gap, space.step_seconds(chosen, ordered) if space.parts else None)


# A paced program's tie-break (`_objective`): the predicted loss's weight against the slowest
# part's seconds, each scaled to about 1e6 in total, so it moves the objective by well under
# `MIP_GAP` and only chooses among plans about as fast.
PACE_TIE = 1e-4


def _objective(space: SearchSpace, program: _Program, objective: str) -> "tuple[np.ndarray, float, float | None]":
    """The program's objective vector, its offset (the fixed costs, in the vector's units) and,
    when it is paced (`_pace_rows`), the factor that brings seconds into its units.

    HiGHS stops at an absolute gap of 1e-6 too (scipy exposes no option for it): step times of a
    few ms would differ below it, so the objective is scaled to about 1e6 in total. Its gap is the
    total's: what lies outside the layers (`SearchSpace.fixed_total`) is in every plan's step, so
    the layers' part needs a looser proof where the rest is much of the step (a narrow model's
    norms, attention and loss): proving 1 % of the layers' part alone took HiGHS's branching up to
    7 s on a 4-block narrow Llama (33 layers). A paced program minimises t, which holds the fixed
    seconds (no offset), and among plans about as fast the least predicted loss (`PACE_TIE`): a
    stage that does not set the pace keeps the precision its memory budget allows."""
    raw = {"bytes": program.bytes, "loss": program.loss, "seconds": program.seconds}[objective]
    scale = np.abs(raw).max(initial=0.0) * len(space.units)
    factor = 1e6 / scale if scale > 0 else 1.0
    if not program.paced:
        return raw * factor, float(getattr(space.fixed_total, objective)) * factor, None
    vector = np.zeros(program.size)
    vector[-1] = 1.0
    loss_scale = np.abs(program.loss).max(initial=0.0) * len(space.units)
    if loss_scale > 0:
        vector += PACE_TIE * (1e6 / loss_scale) * program.loss
    return vector, 0.0, factor


def _layers_gap(offset: float, feasible: float) -> float:
    """HiGHS's relative gap g on the layers' part P that proves `MIP_GAP` on the total: HiGHS
    stops at P - D <= g P, and g P <= MIP_GAP (P + offset) holds for g <= MIP_GAP (1 + offset
    / P). Its plan is within g of the optimum, at most ``feasible`` (a plan found), so
    P <= feasible / (1 - g), and g = MIP_GAP (1 + r) / (1 + MIP_GAP r), r = offset / feasible,
    meets both; MIP_GAP itself without a plan found."""
    if not (offset > 0 and 0 < feasible < np.inf):
        return MIP_GAP
    r = offset / feasible
    return MIP_GAP * (1 + r) / (1 + MIP_GAP * r)


def _total_gap(primal: float, bound: float, offset: float) -> float:
    """The relative gap of a plan's total (its layers' part ``primal`` plus ``offset``) to the
    best total proven (``bound`` plus ``offset``), in the program's scaled units."""
    return max(0.0, (primal - bound) / max(abs(primal + offset), 1e-12))


def _limited(options: dict, deadline: "float | None") -> dict:
    """``options`` with HiGHS's time limit set to what is left before ``deadline``."""
    return options if deadline is None else {**options, "time_limit": max(deadline - time.monotonic(), 1e-3)}


# Components `_restricted` frees beside the LP's fractional ones, in the tries it makes: those
# nearest to entering (least reduced cost), so that rounding a fractional one can be paid for
# elsewhere. Few at first: each is a block of up to a dozen units with their formats and links,
# and the restricted program's time grows with them (on a 32-block Llama 4 take 0.1-0.3 s, 16
# take 1-2 s and found no better plan); more when the LP with cuts leaves more to round.
FREED_NEIGHBOURS = (4, 16)


def _variables(program: _Program, found: "Solution | Mapping[str, ChoiceKey]") -> np.ndarray:
    """The program's variables (x, r, z) of plan ``found`` (a `Solution`, or an assignment
    recomputing nothing)."""
    assignment, recompute = (found.assignment, found.recompute) if isinstance(found, Solution) else (found, frozenset())
    nx, nb = len(program.columns), len(program.blocks)
    x = np.zeros(program.size)  # t (a paced program's) 0: it is never fixed at a plan's value
    x[:nx] = [float(choice_key(assignment[name]) == key) for name, key, _ in program.columns]
    x[nx : nx + nb] = [float(name in recompute) for name in program.blocks]
    nl = len(program.links)
    x[nx + nb : nx + nb + nl] = [x[i] * x[nx + r] for i, r, _, _ in program.links]
    x[nx + nb + nl : nx + nb + nl + len(program.pairs)] = [x[unit].sum() * x[before].sum() for unit, before, _ in program.pairs]
    return x


def _freed(relaxed: Any, component: np.ndarray, neighbours: int) -> set:
    """The components the LP ``relaxed`` left fractional and the ``neighbours`` it was nearest
    to changing (least reduced cost: what raising a variable from zero would cost per unit)."""
    x = relaxed.x
    free = set(component[np.abs(x - np.round(x)) > 1e-6].tolist())
    reduced = np.where(x < 1e-6, relaxed.lower.marginals, np.inf)
    nearest: dict[int, float] = {}
    for c, cost in zip(component.tolist(), reduced.tolist()):
        if c not in free:
            nearest[c] = min(nearest.get(c, np.inf), cost)
    free.update(sorted(nearest, key=nearest.__getitem__)[:neighbours])
    return free


def _restricted(vector: np.ndarray, rows: _Rows, integrality: np.ndarray, component: np.ndarray, free: set,
                centre: np.ndarray, upper_bounds: np.ndarray, deadline: "float | None") -> Any:
    """The integer program with every component but the ``free`` ones (`_freed`) fixed at its
    value in ``centre`` (integral), the others within ``upper_bounds``: HiGHS's result (``x``, ``fun``), None when it is
    infeasible. Its plan is the answer when its gap to the LP bound (proven: no plan beats the
    LP) is within `MIP_GAP`."""
    fixed = ~np.isin(component, list(free))
    lower, upper = np.zeros_like(centre), upper_bounds.copy()
    lower[fixed] = upper[fixed] = centre[fixed]
    result = milp(vector, constraints=rows.constraints(), integrality=integrality, bounds=Bounds(lower, upper),
                  options=_limited({"mip_rel_gap": MIP_GAP}, deadline))
    return None if result.x is None else result


def smallest_reachable(space: SearchSpace, memory_bytes: "float | Mapping[str, float]" = float("inf"), loss_budget: float = float("inf")) -> tuple[float, float]:
    """(least bytes reachable within the loss budget, least loss reachable within the memory
    budget), recomputation included; a budget that is unreachable even alone is dropped from the
    other's computation."""
    any_plan = float("inf")
    least_bytes = _solve(space, "bytes", any_plan, loss_budget) or _solve(space, "bytes", any_plan, any_plan)
    least_loss = _solve(space, "loss", memory_bytes, any_plan) or _solve(space, "loss", any_plan, any_plan)
    return least_bytes.total.bytes, least_loss.total.loss


def solve_exact(space: SearchSpace, memory_bytes: float = float("inf"), loss_budget: float = float("inf")) -> Solution:
    """The assignment with the least step time meeting both budgets (absolute bytes and loss).

    Exact (to HiGHS's relative gap `MIP_GAP`), where a sampler such as Optuna's TPE on this
    table stays far from the optimum (+72 % predicted step time after 1,000 trials on 120
    layers). Costs one solve: an LP relaxation, then small integer programs (`k_best`); a few
    more solves when infeasible, to state the floors.

    Args:
        space: the units, their choices and the blocks that may be recomputed.
        memory_bytes: the most bytes the plan may hold (`Budgets.memory_bytes`; inf: open).
        loss_budget: the largest predicted loss increase allowed, absolute
            (`Budgets.loss_increase`; inf: open).

    Returns:
        The `Solution`: unit name -> format, the blocks recomputed, and the plan's totals.

    Raises:
        InfeasibleBudgetError: no plan meets the budgets; it states the smallest memory and
            loss increase reachable.
        SearchError: the space has no units.
    """
    return k_best(space, memory_bytes, loss_budget, 1)[0]


def _infeasible(space: SearchSpace, memory_bytes: "float | Mapping[str, float]", loss_budget: float) -> InfeasibleBudgetError:
    if isinstance(memory_bytes, Mapping):
        return _infeasible_parts(space, memory_bytes, loss_budget)
    min_bytes, min_loss = smallest_reachable(space, memory_bytes, loss_budget)
    # Formats alone: each unit's least bytes add up; recomputing blocks can go lower still.
    formats_floor = space.totals(space.extreme("bytes")).bytes
    recompute_floor = _solve(space, "bytes", float("inf"), float("inf")).total.bytes if space.blocks else None
    fp32 = space.uniform(Format.FP32)
    if space.fp32_bytes is not None and fp32 is not None:  # the plans the program overstates, at their exact bytes
        plain = space.totals(fp32)
        least = space.totals(fp32, [b.name for b in space.blocks if space.fp32_recompute_effect(fp32, [b.name]).bytes < 0])
        formats_floor = min(formats_floor, plain.bytes)
        recompute_floor = None if recompute_floor is None else min(recompute_floor, least.bytes)
        if plain.loss <= loss_budget:
            min_bytes = min(min_bytes, least.bytes)
        if least.bytes <= memory_bytes:
            min_loss = min(min_loss, plain.loss)
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


def _infeasible_parts(space: SearchSpace, memory: Mapping[str, float], loss_budget: float) -> InfeasibleBudgetError:
    """`_infeasible` for a budget per memory part: the part furthest over its budget at its least
    bytes (formats alone; with blocks recomputed as well), named, with the floors as the
    largest fraction of a part's FP32 bytes that every part reaches (what a fractional budget,
    applied to each part, must be); a miss of the loss budget as `_infeasible` states it over
    the parts' summed budgets."""
    alone = space.part_bytes(space.extreme("bytes"))
    uniform = space.uniform(Format.FP32)
    fp32 = space.part_bytes(uniform) if uniform is not None else None
    if fp32 is not None:  # the one plan the program overstates, at its exact bytes
        alone = {name: min(b, fp32[name]) for name, b in alone.items()}
    least = _solve(space, "bytes", float("inf"), float("inf")) if space.blocks else None
    floor = alone if least is None else {name: min(b, alone[name]) for name, b in space.part_bytes(least.assignment, least.recompute).items()}
    over = {name: b - memory.get(name, float("inf")) for name, b in floor.items() if b > memory.get(name, float("inf"))}
    if not over:
        return _infeasible(space, sum(memory.get(p.name, float("inf")) for p in space.parts), loss_budget)
    name = max(over, key=lambda n: over[n])
    how = "with formats alone (no block to recompute)" if least is None else "with blocks recomputed as well"
    total_fp32 = sum(fp32.values()) if fp32 is not None else None
    ratio = (lambda held: max(held[n] / fp32[n] for n in held) * total_fp32) if fp32 is not None and total_fp32 else None  # noqa: E731
    floors = {"formats_floor": ratio(alone), "recompute_floor": None if least is None else ratio(floor)} if ratio is not None else {}
    return InfeasibleBudgetError(
        f"no plan meets the budgets: {name} holds at least {floor[name]:,.0f} bytes {how}, over its memory budget {memory[name]:,.0f} bytes; "
        "raise its budget to at least that", sum(floor.values()), smallest_reachable(space, memory, loss_budget)[1], **floors)


def k_best(space: SearchSpace, memory_bytes: "float | Mapping[str, float]" = float("inf"), loss_budget: float = float("inf"), k: int = 1,
           *, time_limit: "float | None" = None, exclude: "Sequence[Solution | Mapping[str, ChoiceKey]]" = ()) -> list[Solution]:
    """Up to ``k`` assignments meeting both budgets, distinct in formats, in non-decreasing
    predicted step time: the optimum (as `solve_exact`), then each next-best under no-good cuts
    of those found (see the module docstring). Fewer than ``k`` when fewer plans are feasible.

    ``memory_bytes``: the most bytes, or the most per memory part by its name (`SearchSpace.parts`,
    a pipeline stage's device: one budget row each). ``exclude``: plans none of the solutions may be (a no-good cut each, from the first
    solve on): `Solution` objects, or assignments (which then recompute no block). ``time_limit``: seconds for all the solves together; once spent, the solutions found so far
    are returned (at least the first, which HiGHS may then return short of proven optimal).
    Raises `InfeasibleBudgetError` like `solve_exact` when no plan meets the budgets. Costs one
    integer program per solution, each a little larger than the last (one row per cut). The
    all-FP32 plan, where the space knows its exact bytes (`SearchSpace.fp32_bytes`), is judged at
    them and ranked by its time among the others, outside the program.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SearchError(f"k must be an integer >= 1, got {k!r}")
    deadline = None if time_limit is None else time.monotonic() + time_limit
    left = lambda: None if deadline is None else deadline - time.monotonic()  # noqa: E731  (seconds left, None: no limit)
    spent = lambda: deadline is not None and time.monotonic() >= deadline  # noqa: E731
    if not space.units:
        raise SearchError("the search space has no layers")
    exclude = list(exclude)
    # The fastest all-FP32 plan at its exact bytes (`SearchSpace.fp32_bytes`): a candidate of
    # its own when it meets the budgets, whether or not the program's overstated figure does.
    fp32 = all_fp32(space, memory_bytes, loss_budget, exclude)
    first = _solve(space, "seconds", memory_bytes, loss_budget, cuts=exclude, time_limit=left())
    if first is None and fp32 is not None:
        return [fp32]
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
    if fp32 is not None:
        found = [s for s in found if not same_plan(fp32, s)] + [fp32]
    # Each is the best unlike those before it to the gap, so a later one may be a little faster:
    # sorted, the i-th is still within the gap of the i-th best plan.
    return sorted(found, key=lambda s: s.step_seconds)[:k]
