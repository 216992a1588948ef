"""The planning pipeline, shared by the search job and the scheduler (`propose_plans`).

costs (`CostModel`, measured in place) -> sensitivity (Fisher estimate) -> the search space (less
the formats the profile saw overflow, `planner.space_steps`) -> budgets in bytes and loss ->
the ``k`` best plans of the additive proxy (`exact.k_best`: the optimum to `exact.MIP_GAP` first, then the
next fastest predicted, distinct in formats or recompute set; with recompute blocks, the program
chooses which to recompute together with the formats) -> `Plan` objects with a reason per layer
and per block and their predicted figures.

The offline job (`job.run`) asks for ``[search].measure_top`` plans and hands them to the
measured stage (an Optuna study in the job's storage: resumable, pruned), which runs them for
real beside the references; the training-time scheduler asks for one, in-process, the solve
bounded by ``search_timeout_s``. No Optuna sampler searches the additive table: the integer
program solves it to a proven gap (`exact.MIP_GAP`), and a sampler's best would only be a worse plan of the same table.
The job's learning sampler (`search.refine`) searches what the table cannot see instead: it
corrects the table with the measured plans and solves the corrected one with the same program.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Generator, Mapping, Optional, Sequence

import torch.nn as nn

from .._generators import drain
from ..errors import InfeasibleBudgetError
from ..formats import Format
from ..runtime import EmulationWarning
from .exact import k_best
from .solution import Solution
from .planner import in_budget_terms, layer_reasons, plan_from_solution
from .planner import space_steps as planner_space_steps
from .planning import Planning
from .budgets import Budgets
from .space import SearchSpace

__all__ = ["Planning", "Space", "Optimum", "Proposal", "measure_space", "measure_parts", "estimate_alternatives", "search_estimator", "space_of", "solve_in_budgets", "propose_plans", "propose_from",
           "uniform_reference"]


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
    """The budgets in absolute terms (bytes; loss increase), the optimum (to `exact.MIP_GAP`) under them and
    the next best plans (``best[0]`` is ``exact``), fastest predicted first."""

    fp32_bytes: int
    memory: float
    loss_budget: float
    exact: Solution
    best: tuple[Solution, ...] = ()


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What `propose_plans` found: the measured space, the budgets and the k best plans, as
    solutions and as plans (same order, fastest predicted first; ``plans[0]`` is the optimum)."""

    found: Space
    optimum: Optimum
    plans: tuple[Any, ...]  # Plan
    budgets: Mapping[str, Any]  # the plans' ``budgets`` field

    @property
    def solutions(self) -> tuple[Solution, ...]:
        return self.optimum.best

    @property
    def kth_gap(self) -> float:
        """The last plan's predicted step time over the optimum's, minus 1 (0.0 for one plan)."""
        return self.solutions[-1].total.seconds / self.optimum.exact.total.seconds - 1.0

    def summary(self) -> str:
        """One line: how many distinct plans, and how far the last is from the optimum."""
        n = len(self.solutions)
        if n == 1:
            return "k-best exact: 1 plan, the optimum (predicted)"
        return f"k-best exact: {n} distinct plans, the {_ordinal(n)} {self.kth_gap:.2%} slower than the optimum (predicted)"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def measure_space(
    model: nn.Module,
    example_inputs: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    profile: Any,
    planning: Planning,
    **measured: Any,
) -> Space:
    """Costs and sensitivity (`measure_parts`, ``measured`` its keyword arguments), the
    alternative recipes' estimates (`estimate_alternatives`) and the space they make of
    ``model`` with ``profile`` (see the module docstring)."""
    costs, sensitivity = measure_parts(model, example_inputs, batches, loss_fn, planning, **measured)
    alternatives = estimate_alternatives(model, example_inputs, batches, loss_fn, planning, costs.layers)
    return space_of(costs, sensitivity, profile, planning, alternatives)


def measure_parts(
    model: nn.Module,
    example_inputs: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    planning: Planning,
    *,
    cost_inputs: Any = None,
    cost_loss_fn: Optional[Callable] = None,
    times_file: Any = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    blocks: Sequence[str] = (),
    upstream: "bool | str" = "sampled",
) -> tuple[Any, Any]:
    """The cost model and the sensitivity estimate of ``model``, from which a space is made
    (`measure_space`; a pipeline stage's table, `search.stages`).

    ``batches`` / ``loss_fn``: what the sensitivity estimate differentiates; ``cost_inputs`` /
    ``cost_loss_fn``: the training step the cost model times (default: ``example_inputs``, a
    forward alone), in place unless ``planning.measure`` is False; ``times_file``: keep the
    measured times there and reuse them (`TimingSettings`); ``blocks``: recompute units the search may
    recompute (`autoprec.blocks.find_blocks`; none: formats only); ``upstream``: the estimate's
    upstream term (`search_estimator`). Cost: the cost model's
    in-place timing (one pass per uniform plan unless cached), the bytes' forwards per role and
    kind of block (`CostModel.build`), and `search_estimator`'s per (layer, format): linear in
    the layers.
    """
    from ..costs import CostModel, TimingSettings
    from ..sensitivity import estimate_sensitivity

    if progress is not None:
        progress(0, 1, "costing layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # the plan names its emulated layers itself
        costs = CostModel.build(
            model, cost_inputs if cost_inputs is not None else example_inputs, loss_fn=cost_loss_fn,
            formats=planning.formats, blocks=list(blocks), timing=TimingSettings(in_place=planning.measure, times_file=times_file),
            precisions=planning.precisions(), target=planning.target,
        )
        if progress is not None:
            progress(0, 1, "estimating sensitivity")
        sensitivity = estimate_sensitivity(
            model, batches, loss_fn, [lp for f, lp in planning.precisions().items() if f is not Format.FP32],
            layers=list(costs.layers), example_inputs=example_inputs, estimator=search_estimator(planning.lr, upstream),
        )
    return costs, sensitivity


def estimate_alternatives(model: nn.Module, example_inputs: Any, batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], Any],
                          planning: Planning, layers: Sequence[str], upstream: "bool | str" = "sampled") -> tuple[tuple[Any, Any], ...]:
    """Each of ``planning``'s alternative recipes (`Planning.alternatives`) with the sensitivity
    estimate that scores it on ``layers`` (`search_estimator`, as `measure_parts` scores the
    formats' own recipes), for `planner.table_steps`. An estimate scores each format once, so
    the n-th alternatives of every format share one: as many estimates as a format has
    alternatives (none without), each linear in the layers. ``upstream``: `search_estimator`'s."""
    from ..sensitivity import estimate_sensitivity

    out: list[tuple[Any, Any]] = []
    for recipes in planning.alternative_rounds():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)  # the plan names its emulated layers itself
            estimate = estimate_sensitivity(model, batches, loss_fn, recipes, layers=list(layers), example_inputs=example_inputs,
                                            estimator=search_estimator(planning.lr, upstream))
        out.extend((lp, estimate) for lp in recipes)
    return tuple(out)


def search_estimator(lr: float, upstream: "bool | str" = "sampled") -> Any:
    """The sensitivity estimate every search plans on (the job's and the scheduler's): each
    layer's own output error (``site="layer"``: the layer alone re-run, not its caller), the
    gradient term of its own parameters, and its input gradient's error on the parameters
    upstream sampled (``upstream="sampled"``: 4 random parameter directions per batch shared by
    every layer and format), so per (layer, format) one forward and one local backward of that
    layer, and per batch 8 no-grad forwards: linear in the layers, where the exact upstream term
    costs a partial backward of the model each (quadratic). The sampled term is what tells a
    recipe's input-gradient product from its weight-gradient product (a split backward from a
    whole high-precision one). On the 6-block GPT of benchmarks/search_stall.py the estimate
    without any upstream term gave the plan of the caller-output estimate, layer for layer, which
    gave those of the full estimate at two budgets. ``upstream=False``: a pipeline stage's
    (`search.stages`), which holds none of the parameters before it."""
    from ..sensitivity import FisherEstimator

    return FisherEstimator(lr=lr, upstream=upstream, site="layer")


def space_of(costs: Any, sensitivity: Any, profile: Any, planning: Planning, alternatives: Sequence[tuple[Any, Any]] = ()) -> Space:
    """`space_steps` run to its end."""
    return drain(space_steps(costs, sensitivity, profile, planning, alternatives))


def space_steps(costs: Any, sensitivity: Any, profile: Any, planning: Planning,
                alternatives: Sequence[tuple[Any, Any]] = ()) -> Generator[str, None, Space]:
    """The search space of measured ``costs`` and ``sensitivity`` (`planner.space_steps`: its
    units, one a layer), less the formats whose range ``profile`` saw too many values leave
    (`Planning.limits`); with ``alternatives`` (`estimate_alternatives`), their recipes as
    choices of their own."""
    space, ruled_out = yield from planner_space_steps(costs, sensitivity, profile, formats=planning.formats, rules=planning.rules,
                                                      min_precision=planning.min_precision, max_precision=planning.max_precision,
                                                      precisions=planning.precisions(), limits=planning.limits, alternatives=alternatives)
    return Space(costs, sensitivity, space, ruled_out)


def solve_in_budgets(found: Space, budgets: Budgets, baseline_loss: Optional[float], source: str = "", k: int = 1,
                     time_limit: Optional[float] = None) -> Optimum:
    """The budgets in bytes and loss increase (``baseline_loss``: what a relative accuracy budget
    is relative to) and the ``k`` best plans under them (`k_best`, within ``time_limit``
    seconds). Raises `InfeasibleBudgetError` stating the smallest budgets reachable, prefixed
    with ``source``."""
    fp32_bytes = found.costs.fp32_bytes()
    memory = budgets.memory_bytes(fp32_bytes)
    loss_budget = budgets.loss_increase(baseline_loss)
    try:
        best = k_best(found.space, memory, loss_budget, k, time_limit=time_limit)
    except InfeasibleBudgetError as exc:
        raise in_budget_terms(exc, fp32_bytes, baseline_loss if budgets.accuracy_relative else None, source) from None
    return Optimum(fp32_bytes, memory, loss_budget, best[0], tuple(best))


def propose_plans(
    model: nn.Module,
    example_inputs: Any,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    profile: Any,
    planning: Planning,
    *,
    baseline_loss: Optional[float],
    metadata: Optional[Mapping[str, Any]] = None,
    fingerprint: Any = None,
    source: str = "",
    **measure_kwargs: Any,
) -> Proposal:
    """The whole planning pipeline (see the module docstring): `measure_space`, then the
    ``planning.k`` best plans under its budgets (`solve_in_budgets`), each made a `Plan` with a
    reason per layer, its predicted figures, the budgets (with ``baseline_loss``), ``metadata``
    plus its rank and predicted step time against the optimum's, and ``fingerprint``
    (`find_layers` of the model).

    ``measure_kwargs``: `measure_space`'s ``cost_inputs``, ``cost_loss_fn``, ``times_file``,
    ``progress`` and ``blocks``. ``planning.time_limit`` bounds the integer programs (not the
    costs and sensitivity). Raises `InfeasibleBudgetError` (prefixed with ``source``) when no
    plan meets the budgets on the predictions.
    """
    found = measure_space(model, example_inputs, batches, loss_fn, profile, planning, **measure_kwargs)
    return propose_from(found, planning, baseline_loss=baseline_loss, metadata=metadata, fingerprint=fingerprint, source=source)


def propose_from(
    found: Space,
    planning: Planning,
    *,
    baseline_loss: Optional[float],
    metadata: Optional[Mapping[str, Any]] = None,
    fingerprint: Any = None,
    source: str = "",
) -> Proposal:
    """`propose_plans` from a space already measured: the ``planning.k`` best plans under its
    budgets (`solve_in_budgets`), each a `Plan` with its reasons, predicted figures and metadata."""
    budgets, rules = planning.budgets, planning.rules
    optimum = solve_in_budgets(found, budgets, baseline_loss, source, planning.k, planning.time_limit)
    budgets_meta = {
        "memory": budgets.memory, "memory_bytes": optimum.memory, "accuracy": budgets.accuracy,
        "accuracy_relative": budgets.accuracy_relative, "loss_increase": optimum.loss_budget, "baseline_loss": baseline_loss,
    }
    optimal = optimum.exact.total.seconds
    plans = tuple(
        plan_from_solution(
            found.space, found.costs, solution, layer_reasons(found.space, solution.assignment, rules, found.ruled_out), budgets_meta,
            {**(metadata or {}), "exact_seconds": optimal, "k_best_rank": rank,
             "predicted_vs_optimum": solution.total.seconds / optimal - 1.0 if optimal > 0 else 0.0},
            fingerprint,
        )
        for rank, solution in enumerate(optimum.best)
    )
    return Proposal(found, optimum, plans, budgets_meta)


def uniform_reference(proposal: Proposal, fmt: Format, rules: Any, fingerprint: Any = None) -> Optional[Any]:
    """The plan running every layer in ``fmt`` (no block recomputed), as a reference to measure
    beside ``proposal``'s plans: None when some layer may not take ``fmt``, when it does not meet
    the budgets as predicted, or when it is one of the proposed plans already."""
    found, optimum = proposal.found, proposal.optimum
    assignment = found.space.uniform(fmt)
    if assignment is None:
        return None
    total = found.space.totals(assignment)
    if total.bytes > optimum.memory or total.loss > optimum.loss_budget:
        return None
    plan = plan_from_solution(found.space, found.costs, Solution(assignment, total), layer_reasons(found.space, assignment, rules, found.ruled_out),
                              proposal.budgets, {"reference": f"every layer {fmt.value}"}, fingerprint)
    formats = {fqn: lp.format for fqn, lp in plan.layers.items()}
    if any({fqn: lp.format for fqn, lp in p.layers.items()} == formats and not p.recompute for p in proposal.plans):
        return None
    return plan
