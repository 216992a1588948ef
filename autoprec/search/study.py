"""The proxy stage: an Optuna study over per-unit formats on the additive cost table.

One categorical parameter per unit. The objective is the predicted step time (or, with
``multi_objective``, time, memory and loss increase for a Pareto front); the budgets are Optuna
constraints (``Trial.set_constraint``), so infeasible trials still teach the sampler where the
boundary is. The exact optimum warm-starts a fresh study and is the yardstick for its result.

Storage is any Optuna storage URL; a plain path means a local SQLite file. Trials a crashed
worker left running are retried once their heartbeat goes stale, so an interrupted study resumes
with no trial lost, and ``n_trials`` counts the study's trials across every worker and restart.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from pathlib import Path
from typing import Callable, Mapping, Sequence

import optuna
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from ..errors import SearchError
from ..formats import Format
from .exact import Solution
from .space import Choice, SearchSpace

__all__ = ["ProxyResult", "open_storage", "run_proxy_study", "feasible", "HEARTBEAT_SECONDS"]

logger = logging.getLogger(__name__)

# A running trial whose worker stopped sending heartbeats for this long is marked failed and
# retried (Optuna's RDB heartbeat; the grace period is Optuna's default of 2 intervals).
HEARTBEAT_SECONDS = 10
_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)


def open_storage(url_or_path: "str | Path", heartbeat_seconds: int = HEARTBEAT_SECONDS) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL (``sqlite:///…``, ``postgresql://…``) or a file path (SQLite).

    Raises `SearchError` with one line when the storage cannot be reached.
    """
    text = str(url_or_path)
    if "://" not in text:
        path = Path(text).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"sqlite:///{path}"
    try:
        with warnings.catch_warnings():
            # Heartbeats are "experimental" in Optuna 5 and have been since 2.8; they are what
            # makes a crashed worker's trial come back.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                text,
                heartbeat_interval=heartbeat_seconds,
                grace_period=2 * heartbeat_seconds,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
            )
    except Exception as exc:  # SQLAlchemy raises many types for an unreachable or bad URL
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SearchError(f"cannot open Optuna storage {text!r}: {reason}") from None


@dataclasses.dataclass(frozen=True)
class ProxyResult:
    """Best feasible assignment of the study, its cost, the Pareto front (multi-objective) and the
    study itself."""

    best: "Solution | None"
    pareto: tuple[Solution, ...]
    study: optuna.Study
    trials: int


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial that met both budgets (Optuna's convention: constraint values <= 0)."""
    values = list(trial.constraints.values())  # constraint name -> value
    return trial.state is TrialState.COMPLETE and bool(values) and all(v <= 0 for v in values)


def _assignment(space: SearchSpace, params: Mapping[str, str]) -> dict[str, Format]:
    return {u.name: Format.parse(params[u.name]) for u in space.units}


def run_proxy_study(
    space: SearchSpace,
    memory_bytes: float,
    loss_budget: float,
    *,
    n_trials: int = 300,
    storage: "str | Path | optuna.storages.BaseStorage | None" = None,
    study_name: str = "autoprec",
    seed: "int | None" = 0,
    warm_start: Sequence[Mapping[str, Format]] = (),
    multi_objective: bool = False,
    timeout: "float | None" = None,
    callbacks: Sequence[Callable] = (),
) -> ProxyResult:
    """Run (or resume) the proxy study until it holds ``n_trials`` finished trials.

    ``warm_start`` assignments (e.g. the exact optimum and the uniform plans) are enqueued only
    into a study that has no trials yet, so resuming never repeats them. Costs one evaluation of
    the additive table per trial (microseconds) plus the storage's write per trial.
    """
    if n_trials < 1:
        raise SearchError(f"n_trials must be >= 1, got {n_trials}")
    directions = ["minimize"] * (3 if multi_objective else 1)
    if multi_objective:
        sampler = optuna.samplers.NSGAIISampler(seed=seed)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # Multivariate TPE models the layers jointly: the budgets couple them.
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=20, multivariate=True)
    study = optuna.create_study(
        study_name=study_name,
        storage=storage if storage is None or isinstance(storage, optuna.storages.BaseStorage) else open_storage(storage),
        sampler=sampler,
        directions=directions,
        load_if_exists=True,
    )
    if not study.trials:
        for assignment in warm_start:
            study.enqueue_trial({name: Format.parse(fmt).value for name, fmt in assignment.items()}, skip_if_exists=True)

    def objective(trial: optuna.Trial):
        params = {u.name: trial.suggest_categorical(u.name, [f.value for f in u.formats]) for u in space.units}
        total = space.totals(_assignment(space, params))
        # Positive means violated; an open budget is never violated.
        trial.set_constraint("memory", total.bytes - memory_bytes if math.isfinite(memory_bytes) else -1.0)
        trial.set_constraint("loss", total.loss - loss_budget if math.isfinite(loss_budget) else -1.0)
        trial.set_user_attr("bytes", total.bytes)
        trial.set_user_attr("loss", total.loss)
        trial.set_user_attr("seconds", total.seconds)
        return (total.seconds, total.bytes, total.loss) if multi_objective else total.seconds

    done = sum(t.state in _COUNTED for t in study.trials)
    if done < n_trials:
        study.optimize(
            objective,
            n_trials=None,
            timeout=timeout,
            callbacks=[MaxTrialsCallback(n_trials, states=_COUNTED), *callbacks],
            gc_after_trial=False,
        )
    trials = study.get_trials(deepcopy=False)
    good = [t for t in trials if feasible(t)]
    best = None
    if good:
        top = min(good, key=lambda t: t.user_attrs["seconds"])
        best = _solution(space, top)
    pareto: tuple[Solution, ...] = ()
    if multi_objective:
        pareto = tuple(_solution(space, t) for t in study.best_trials if feasible(t))
    return ProxyResult(best, pareto, study, sum(t.state in _COUNTED for t in trials))


def _solution(space: SearchSpace, trial: optuna.trial.FrozenTrial) -> Solution:
    assignment = _assignment(space, trial.params)
    return Solution(assignment, Choice(trial.user_attrs["bytes"], trial.user_attrs["seconds"], trial.user_attrs["loss"]))
