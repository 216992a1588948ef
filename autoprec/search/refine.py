"""Measured refinement: an Optuna sampler that corrects the proxy with what was measured.

The k best plans of the additive proxy and the references are the measured study's initial
design (enqueued by the job). `CorrectingSampler` decides the trials after them, each in three
steps:

1. **Fit** (`CorrectingSampler.correction`, `fit_factors`): per measured figure (step time,
   bytes, loss increase) one factor per format, a deviation per (free unit, format) and one
   factor for the fixed cost, ridge least squares over every measured trial of the study,
   pulled toward the proxy as it is. The result is a `Correction`.
2. **Re-solve**: the corrected table (`Correction.apply`) goes to the exact solver
   (`exact.k_best`) under the *measured* budgets (the factors map predictions to measurements).
3. **Propose** (`CorrectingSampler.next_plan`, a `Next`) the best corrected plan that no trial
   has measured or holds, or stop: trials spent, nothing left, or nothing likely to win.

The corrections are additive per layer: they cannot see effects between neighbouring layers
(casts at format boundaries, fusion) beyond what a layer's own factor absorbs on average. The
sampler proposes formats only, around one fixed recompute set (`CorrectingSampler`). Costs per
proposal: one storage read, three small least-squares fits and one integer program with a cut
per measured plan (milliseconds for tens of layers and trials).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from ..errors import InfeasibleBudgetError
from ..formats import Format
from ..plan import LayerPrecision, Plan
from .exact import k_best
from .planner import precision_of
from .candidate_runs import REFINED_ASSIGNMENT, REFINED_ATTR, Candidate, formats_id
from .space import Choice, ChoiceKey, SearchSpace, choice_key, key_name

__all__ = ["Correction", "Next", "CorrectingSampler", "fit_factors"]

_FIELDS = ("seconds", "bytes", "loss")


@dataclasses.dataclass(frozen=True)
class Correction:
    """Multiplicative factors per format, per (unit, format) deviations from them, one for the
    fixed cost (pinned units included), and the trials they fit."""

    factors: Mapping[ChoiceKey, Choice]
    fixed: Choice
    trials: int
    units: Mapping[tuple[str, ChoiceKey], Choice] = dataclasses.field(default_factory=dict)

    def apply(self, space: SearchSpace) -> SearchSpace:
        """``space`` corrected: a free unit's choice in format f times ``factors[f]`` plus its
        deviation (at least 0), field by field; the fixed cost and pinned units times ``fixed``."""
        zero, one = Choice(0.0, 0.0, 0.0), Choice(1.0, 1.0, 1.0)

        def factor(unit, fmt) -> Choice:
            if len(unit.choices) == 1:
                return self.fixed
            k, d = self.factors.get(fmt, one), self.units.get((unit.name, fmt), zero)
            return Choice(*(max(getattr(k, f) + getattr(d, f), 0.0) for f in ("bytes", "seconds", "loss")))

        return space.scaled({(u.name, f): factor(u, f) for u in space.units for f in u.choices}, self.fixed)

    def to_dict(self) -> dict:
        as_dict = lambda c: {f: getattr(c, f) for f in _FIELDS}  # noqa: E731
        return {"trials": self.trials, "fixed": as_dict(self.fixed), **{key_name(f): as_dict(c) for f, c in self.factors.items()},
                "units": {f"{name}:{key_name(fmt)}": as_dict(c) for (name, fmt), c in self.units.items()}}


@dataclasses.dataclass(frozen=True)
class Next:
    """The sampler's decision: a unit assignment to measure with its corrected prediction, or
    None and why it stops."""

    assignment: "dict[str, ChoiceKey] | None"
    why: str
    correction: Correction
    predicted: "Choice | None" = None


def fit_factors(rows: np.ndarray, targets: np.ndarray, prior: "float | np.ndarray" = 1.0, center: "np.ndarray | None" = None) -> np.ndarray:
    """Least squares ``rows @ c ≈ targets`` plus ``Σ_j prior_j · s_j² (c_j - center_j)²``, where
    ``s_j`` is column j's root mean square (one trial's worth of that column); ``center``
    defaults to 1 (the proxy as it is). Columns centred on 1 are factors, clipped at 0. A column
    no row uses gets exactly its centre."""
    rows = np.asarray(rows, dtype=float)
    n = rows.shape[1]
    center = np.ones(n) if center is None else np.asarray(center, dtype=float)
    if rows.shape[0] == 0:
        return center.copy()
    weight = np.sqrt(np.broadcast_to(np.asarray(prior, dtype=float), (n,)))
    scale = np.sqrt(np.mean(rows**2, axis=0))
    scale = np.where(scale > 0, scale, 1.0)
    a = np.vstack([rows, np.diag(weight * scale)])
    b = np.concatenate([np.asarray(targets, dtype=float), weight * scale * center])
    c = np.linalg.lstsq(a, b, rcond=None)[0]
    return np.where(center == 1.0, np.clip(c, 0.0, None), c)


class CorrectingSampler(optuna.samplers.BaseSampler):
    """Proposes, after the initial design, the optimum (to exact.MIP_GAP) of the proxy corrected by the
    measured trials (`correction`, then `next_plan`).

    ``space``: the proxy (the job's `SearchSpace`); ``design``: the initial design's plans, so
    their trials (keyed by candidate id, no params) can be fitted; ``memory_bytes`` /
    ``loss_budget``: the measured budgets (absolute, inf when open); ``fp32_seconds``: the proxy's
    all-FP32 step (what a trial's measured FP32 ratio is scaled by); ``max_trials``: plans
    measured in all. Params of a proposed trial are unit name -> choice name (`space.key_name`). ``recompute``:
    the blocks every plan it proposes recomputes; ``space`` must then already hold their costs
    (`SearchSpace.fixing_recompute`).

    Every decision is a function of the study's trials read from the storage, so a resumed job
    and N workers on one study need nothing more: two workers racing for one plan are settled by
    `MeasuredStage.run` (the earlier trial measures it, the other is skipped and asks again).

    **Recomputation**: the sampler proposes formats only, around one fixed recompute set — the
    recompute set of the proxy's optimum, which the job passes as ``recompute`` with the
    space folded around it. Its plans all recompute exactly those blocks, and only measured plans
    with that recompute set are fitted (another set changes bytes and time in ways the
    per-format factors do not model). Choosing recompute flags again on the corrected proxy is
    left out: the fit has no term for a block, so it could only repeat the proxy's choice.
    """

    def __init__(self, space: SearchSpace, design: Sequence[Plan], memory_bytes: float, loss_budget: float,
                 fp32_seconds: float, max_trials: int, *, prior: float = 0.1, unit_prior: float = 0.3, min_gain: float = 0.05,
                 recompute: Iterable[str] = (), precisions: "Mapping[Format, LayerPrecision] | None" = None):
        self.space = space
        self.recompute = tuple(recompute)
        self.memory_bytes = float(memory_bytes)
        self.loss_budget = float(loss_budget)
        self.fp32_seconds = float(fp32_seconds)
        self.max_trials = int(max_trials)
        self.prior = prior
        self.unit_prior = float(unit_prior)
        self.min_gain = float(min_gain)
        self.formats = tuple(dict.fromkeys(f for u in space.units if len(u.choices) > 1 for f in u.choices))
        self._pairs = [(u.name, f) for u in space.units if len(u.choices) > 1 for f in u.choices]
        self._design: dict[str, dict[str, ChoiceKey]] = {}  # formats_id -> unit assignment
        # Each format's own recipe, as the search plans it (`Planning.precisions`; None: as the
        # design's plans run it); a choice keyed by a recipe is that recipe.
        self._precisions = {lp.format: dataclasses.replace(lp, reason="") for plan in design for lp in plan.layers.values()} if precisions is None \
            else {Format.parse(f): dataclasses.replace(lp, reason="") for f, lp in precisions.items()}
        self._named = {u.name: {key_name(f): f for f in u.choices} for u in space.units}
        for plan in design:
            assignment = self.assignment_of(plan)
            if assignment is not None:
                self._design[self._id(assignment)] = assignment

    # -- plans and trials -------------------------------------------------------------------

    def assignment_of(self, plan: Plan) -> "dict[str, ChoiceKey] | None":
        """The unit assignment of ``plan``, or None when it is not one of this space (or does not
        recompute exactly the sampler's blocks)."""
        if set(plan.recompute) != set(self.recompute):
            return None
        out: dict[str, ChoiceKey] = {}
        for unit in self.space.units:
            if any(fqn not in plan.layers for fqn in unit.layers):
                return None
            keys = {self._key_of(plan.layers[fqn]) for fqn in unit.layers}
            key = keys.pop()
            if keys or key not in unit.choices:
                return None
            out[unit.name] = key
        return out

    def _key_of(self, lp: LayerPrecision) -> "Format | LayerPrecision":
        """The choice key of a plan's layer precision: its format where it is the format's own
        recipe, else the recipe (`space.choice_key`)."""
        own = self._precisions.get(lp.format)
        key = choice_key(lp)
        return lp.format if own is None or key == own else key

    def choice_names(self, unit) -> tuple[str, ...]:
        """A unit's choices as its trials' params name them (`space.key_name`)."""
        return tuple(self._named[unit.name])

    def assignment_named(self, params: Mapping[str, str]) -> dict[str, Any]:
        """The unit assignment a trial's params (unit -> choice name) stand for."""
        return {name: self._named[name][value] for name, value in params.items()}

    def candidate(self, assignment: Mapping[str, ChoiceKey], name: str = "refined") -> Candidate:
        """The plan to measure for ``assignment``: its layers' formats (in the scaling and
        calibration the k-best plans have) and the proxy's predicted figures."""
        total = self.space.totals(assignment)
        layers = {fqn: precision_of(self._precisions, key) for fqn, key in self.space.layer_formats(assignment).items()}
        predicted = {"seconds": total.seconds, "bytes": total.bytes, "loss_increase": total.loss}
        return Candidate(name, Plan(layers, predicted=predicted, blocks=dict.fromkeys(self.recompute, True)))

    def _assignment(self, trial: optuna.trial.FrozenTrial) -> "dict[str, ChoiceKey] | None":
        # Params once suggested; before that (a live trial), what `sample_relative` recorded.
        params = trial.params or trial.user_attrs.get(REFINED_ATTR, {}).get(REFINED_ASSIGNMENT)
        if params:
            return self.assignment_named(params)
        cid = trial.user_attrs.get("candidate")
        return self._design.get(cid) if cid is not None else None

    def _id(self, assignment: Mapping[str, ChoiceKey]) -> str:
        return formats_id({fqn: precision_of(self._precisions, key) for fqn, key in self.space.layer_formats(assignment).items()}, self.recompute)

    # -- the correction ---------------------------------------------------------------------

    def _row(self, assignment: Mapping[str, ChoiceKey], field: str) -> list[float]:
        """The fit's columns for one plan: fixed cost plus pinned units, each format's summed
        prediction over the free units, then each free (unit, format)'s prediction if chosen."""
        row = [getattr(self.space.fixed_total, field)] + [0.0] * (len(self.formats) + len(self._pairs))
        if field == "bytes":
            row[0] -= sum(self.space.pair_bytes(assignment).values())  # region bytes, as the fixed cost's (`SearchSpace.scaled`)
        for unit in self.space.units:
            fmt = assignment[unit.name]
            value = getattr(unit.choices[fmt], field)
            if len(unit.choices) == 1:
                row[0] += value
                continue
            row[1 + self.formats.index(fmt)] += value
            row[1 + len(self.formats) + self._pairs.index((unit.name, fmt))] = value
        return row

    def correction(self, trials: Sequence[optuna.trial.FrozenTrial]) -> Correction:
        """Factors fitted to the measured figures of ``trials`` (finished ones of this space).

        For each measured figure — step time, bytes, loss increase — one multiplicative factor
        per format, one deviation from it per (free unit, format), and one factor for the fixed
        cost (the rest of the step and the pinned units, which every plan has), so that for every
        measured plan ``measured ≈ c_fixed · fixed + Σ_u (c_f + d_{u,f}) · predicted[u, f]`` (f
        the unit's format). Ridge least squares (`fit_factors`) over every measured trial: the
        factors pulled toward 1 (the proxy as it is) with the weight of ``prior`` (0.1) trials
        each, the deviations toward 0 with ``unit_prior`` (0.3): a format no measured plan uses
        keeps its prediction, one noisy trial moves a factor only part way, and a layer is
        singled out only when the trials say so. (Per-format factors alone could not follow the
        tiny LM, where the proxy's error differs by layer; the priors were chosen on
        `benchmarks/refine_regret.py`.) Step time is fitted as the trial's ratio to interleaved
        FP32 steps times the proxy's FP32 step, one scale across workers. A trial pruned for
        memory still gives its bytes; one pruned for loss its bytes and loss.
        """
        rows: dict[str, list[list[float]]] = {f: [] for f in _FIELDS}
        targets: dict[str, list[float]] = {f: [] for f in _FIELDS}
        used = 0
        for t in trials:
            a = t.user_attrs
            assignment = self._assignment(t)
            if assignment is None or "bytes" not in a or "skipped" in a:
                continue
            used += 1
            measured = {"bytes": a["bytes"], "loss": a.get("loss_increase"),
                        "seconds": a["fp32_ratio"] * self.fp32_seconds if "fp32_ratio" in a else None}
            for field, value in measured.items():
                if value is not None and np.isfinite(value):
                    rows[field].append(self._row(assignment, field))
                    targets[field].append(float(value))
        n = 1 + len(self.formats)
        prior = np.array([self.prior] * n + [self.unit_prior] * len(self._pairs))
        center = np.array([1.0] * n + [0.0] * len(self._pairs))
        fitted = {f: fit_factors(np.array(rows[f]).reshape(-1, n + len(self._pairs)), np.array(targets[f]), prior, center) for f in _FIELDS}
        factor = lambda i: Choice(*(float(fitted[f][i]) for f in ("bytes", "seconds", "loss")))  # noqa: E731  (Choice's field order)
        return Correction({fmt: factor(1 + i) for i, fmt in enumerate(self.formats)}, factor(0), used,
                          {pair: factor(n + i) for i, pair in enumerate(self._pairs)})

    def next_plan(self, study: optuna.Study, for_trial: "int | None" = None) -> Next:
        """What to measure next, from every trial of ``study`` (one storage read) but trial
        number ``for_trial`` (the one asking).

        The best plan of the corrected problem that no trial has measured or holds (no-good cuts
        of all of them, `exact.k_best`'s ``exclude``): the corrected optimum first, and once that
        is measured the next-best corrected plan, so a proxy still wrong after the fit is
        explored further instead of trusted.

        Stops (``assignment`` None) when ``max_trials`` plans are measured or held (initial
        design included); when every plan the corrected problem allows is measured or held; or
        when the best plan left is predicted slower than the fastest measured plan that meets the
        budgets by more than the fit's own error (``max(min_gain, 2 × the corrected step times'
        root mean square relative error on the measured trials)``): then no plan left is likely
        to win. (Stopping as soon as the corrected optimum was measured ended searches after 3-4
        trials, far from the measured optimum: `benchmarks/refine_regret.py`.)
        """
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != for_trial]
        finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "skipped" not in t.user_attrs]
        live = [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING) and "skipped" not in t.user_attrs]
        correction = self.correction(finished)
        if len(finished) + len(live) >= self.max_trials:
            return Next(None, f"the budget of {self.max_trials} measured trials is spent", correction)
        corrected = correction.apply(self.space)
        taken = [a for a in map(self._assignment, finished + live) if a is not None]
        try:
            (best,) = k_best(corrected, self.memory_bytes, self.loss_budget, 1, exclude=taken)
        except InfeasibleBudgetError:
            return Next(None, "every plan within the budgets on the corrected proxy is measured or held", correction)
        incumbent = self._fastest_meeting(finished)
        margin = max(self.min_gain, 2 * self._error(finished, correction))
        if incumbent is not None and best.total.seconds > incumbent * (1 + margin):
            return Next(None, f"no plan left is predicted within {margin:.1%} of the fastest measured ({best.total.seconds * 1e3:.3g} ms "
                              f"corrected against {incumbent * 1e3:.3g} ms)", correction)
        return Next(dict(best.assignment), "the best corrected plan not yet measured", correction, best.total)

    def _seconds(self, trial: optuna.trial.FrozenTrial) -> "float | None":
        a = trial.user_attrs
        return a["fp32_ratio"] * self.fp32_seconds if "fp32_ratio" in a else None

    def _fastest_meeting(self, finished: Sequence[optuna.trial.FrozenTrial]) -> "float | None":
        """Measured seconds (on the proxy's FP32 scale) of the fastest trial meeting the budgets."""
        met = [s for t in finished if (s := self._seconds(t)) is not None
               and t.user_attrs["bytes"] <= self.memory_bytes and t.user_attrs.get("loss_increase", np.inf) <= self.loss_budget]
        return min(met, default=None)

    def _error(self, finished: Sequence[optuna.trial.FrozenTrial], correction: Correction) -> float:
        """Root mean square relative error of the corrected step times on the measured trials."""
        corrected = correction.apply(self.space)
        errors = [corrected.totals(a).seconds / s - 1 for t in finished
                  if (a := self._assignment(t)) is not None and (s := self._seconds(t)) is not None and "skipped" not in t.user_attrs]
        return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0

    # -- the sampler interface --------------------------------------------------------------

    def infer_relative_search_space(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
        return {u.name: CategoricalDistribution(list(self.choice_names(u))) for u in self.space.units}

    def sample_relative(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        """The next plan as params (unit -> format value), or {} when stopped or when the trial
        is an enqueued one of the initial design. Marks the trial with the plan's candidate id
        at once, so other workers' samplers see it held."""
        if "candidate" in trial.user_attrs:
            return {}
        nxt = self.next_plan(study, trial.number)
        if nxt.assignment is None:
            return {}
        storage = study._storage  # noqa: SLF001  (as Optuna's own samplers write trial attributes)
        storage.set_trial_user_attr(trial._trial_id, "candidate", self._id(nxt.assignment))  # noqa: SLF001
        params = {name: key_name(key) for name, key in nxt.assignment.items()}
        storage.set_trial_user_attr(trial._trial_id, REFINED_ATTR, {
            REFINED_ASSIGNMENT: params, "predicted": {f: getattr(nxt.predicted, f) for f in _FIELDS}, "correction": nxt.correction.to_dict(),
            "fp32_seconds": self.fp32_seconds,  # the scale of "predicted": measured seconds on it = fp32_ratio x this
        })
        return params

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        # Only reached for a param outside the units (none is suggested): the first choice.
        return param_distribution.choices[0]
