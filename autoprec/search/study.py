"""Optuna storages for the search (opening, crashed workers' trials, quiet interrupts), and a
proxy study over per-unit formats on the additive cost table.

The proxy study (`run_proxy_study`) is a library function, not part of the planning pipeline
(`search.pipeline`): the integer program (`exact.k_best`) solves the same table exactly, while a
sampler does not (TPE was +72 % predicted step time off the optimum after 1,000 trials on 120
layers); a study warm-started with the optimum can only report a gap of zero. One categorical
parameter per unit. The objective is the predicted step time (or, with ``multi_objective``,
time, memory and loss increase for a Pareto front); the budgets are Optuna constraints
(``Trial.set_constraint``), so infeasible trials still teach the sampler where the boundary is.

Storage is any Optuna storage URL, or a path: an Optuna journal file when it ends in ``.journal``
or ``.log`` (or is written ``journal:///path``), else a local SQLite file. Trials a crashed
worker left running are failed and queued again (`recover_interrupted_trials`): at once when the
worker was a process of this machine that no longer exists, else once its heartbeat goes stale.
So an interrupted study resumes with no trial lost, and ``n_trials`` counts the study's trials
across every worker and restart.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import socket
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

__all__ = [
    "ProxyResult", "open_storage", "storage_kind", "run_proxy_study", "feasible", "HEARTBEAT_SECONDS",
    "WORKER_ATTR", "mark_worker", "recover_interrupted_trials", "quiet_interrupts", "RetryWithFreshConstraints",
]

logger = logging.getLogger(__name__)

# A running trial whose worker stopped sending heartbeats for this long is marked failed and
# retried (Optuna's RDB heartbeat; the grace period is Optuna's default of 2 intervals).
HEARTBEAT_SECONDS = 10
_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)


class RetryWithFreshConstraints(optuna.storages.RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a failed trial, minus the constraint values the failed attempt set.

    The stock callback copies every system attribute into the retry, the ``constraints:<key>``
    values too, and ``Trial.set_constraint`` then ignores (with a warning) the values the retry
    measures itself: the trial would be judged by what its killed attempt saw.
    """

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        trial.system_attrs = {k: v for k, v in trial.system_attrs.items() if not k.startswith("constraints:")}
        super().__call__(study, trial)


# A path with one of these suffixes (or a ``journal://`` URL) is an Optuna journal file: an
# append-only log that many processes share through a lock file, on one machine or a shared
# file system. SQLite locks its whole database per write, so concurrent workers time out on it.
JOURNAL_SUFFIXES = (".journal", ".log")
JOURNAL_SCHEME = "journal://"


def storage_kind(url: str) -> str:
    """``"journal"``, ``"sqlite"`` or ``"rdb"`` (a server database: PostgreSQL, MySQL) for a
    storage URL as `open_storage` takes it."""
    if url.startswith(JOURNAL_SCHEME) or ("://" not in url and url.endswith(JOURNAL_SUFFIXES)):
        return "journal"
    return "sqlite" if url.startswith("sqlite:") or "://" not in url else "rdb"


def open_storage(url_or_path: "str | Path", heartbeat_seconds: int = HEARTBEAT_SECONDS) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL (``sqlite:///…``, ``postgresql://…``, ``journal:///path``) or a
    file path (a journal file when it ends in ``.journal`` or ``.log``, else SQLite).

    Server databases and SQLite get Optuna's heartbeat (a running trial whose worker is silent
    for ``2 × heartbeat_seconds`` is failed and retried); a journal file has none in Optuna, so a
    dead worker's trial there is found from its process id (`recover_interrupted_trials`), on the
    worker's own machine. Raises `SearchError` with one line when the storage cannot be reached.
    """
    text = str(url_or_path)
    kind = storage_kind(text)
    if "://" not in text or kind == "journal":
        path = Path(text.removeprefix(JOURNAL_SCHEME)).expanduser().resolve()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SearchError(f"cannot open Optuna storage {text!r}: cannot create {path.parent} ({exc.strerror})") from None
        if kind == "journal":
            try:
                return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
            except OSError as exc:
                raise SearchError(f"cannot open Optuna journal file {str(path)!r}: {exc.strerror}") from None
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
                heartbeat_stale_trial_callback=RetryWithFreshConstraints(max_retry=3),
            )
    except Exception as exc:  # SQLAlchemy raises many types for an unreachable or bad URL
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SearchError(f"cannot open Optuna storage {text!r}: {reason}") from None


# The user attribute naming the process that runs a trial ("host:pid"), so a resumed job can tell
# a trial whose process died (kill -9, power loss) from one another live worker is running.
WORKER_ATTR = "worker"


def mark_worker(trial: optuna.Trial) -> None:
    """Record this process as the trial's worker (one storage write)."""
    trial.set_user_attr(WORKER_ATTR, f"{socket.gethostname()}:{os.getpid()}")


def _worker_gone(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the trial's worker was a process of this machine that no longer exists."""
    host, _, pid = str(trial.user_attrs.get(WORKER_ATTR, "")).rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, under another user
        return False
    return False


def recover_interrupted_trials(study: optuna.Study) -> int:
    """Fail the RUNNING trials of ``study`` whose worker is gone and queue each again; returns
    how many were failed.

    A trial is gone when its worker was a process of this machine that no longer exists (checked
    at once), or when its heartbeat is stale (Optuna's `fail_stale_trials`, for workers elsewhere).
    Each failed trial is re-queued as WAITING with its parameters and user attributes by the
    storage's retry callback (`RetryWithFreshConstraints`, at most 3 retries). One storage read of the
    running trials, one write per failed trial.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
        # Optuna has no public call to fail a trial of a dead worker; fail_stale_trials itself goes
        # through the storage in the same way.
        storage = study._storage
        retry = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)() or RetryWithFreshConstraints(max_retry=3)
        failed = 0
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not _worker_gone(trial):
                continue
            try:
                if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:  # another process failed it first
                continue
            logger.warning("trial %d of study %r was left running by %s, which is gone: failed and queued again",
                           trial.number, study.study_name, trial.user_attrs[WORKER_ATTR])
            retry(study, copy.deepcopy(storage.get_trial(trial._trial_id)))
            failed += 1
    return failed


class _InterruptFilter(logging.Filter):
    """Drops Optuna's two "Trial N failed" records (the first with a traceback) of a trial that
    Ctrl-C stopped: the caller reports the interrupt in one line instead."""

    def __init__(self):
        super().__init__()
        self._interrupted: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        trial = message.split(" failed ", 1)[0]
        if record.exc_info and record.exc_info[0] is not None and issubclass(record.exc_info[0], KeyboardInterrupt):
            self._interrupted.add(trial)
            return False
        return trial not in self._interrupted


@contextlib.contextmanager
def quiet_interrupts():
    """While active, a Ctrl-C inside an Optuna trial leaves no traceback in Optuna's log (the trial
    is still marked FAIL and the KeyboardInterrupt still propagates)."""
    optimize_logger = logging.getLogger("optuna.study._optimize")  # where Optuna logs failed trials
    quiet = _InterruptFilter()
    optimize_logger.addFilter(quiet)
    try:
        yield
    finally:
        optimize_logger.removeFilter(quiet)


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
    study_attrs: "Mapping[str, object] | None" = None,
) -> ProxyResult:
    """Run (or resume) the proxy study until it holds ``n_trials`` finished trials.

    ``warm_start`` assignments (e.g. the exact optimum and the uniform plans) are enqueued only
    into a study that has no trials yet, so resuming never repeats them. ``study_attrs`` are set
    on the study before its first trial runs (what the trials depend on, for a later resume to
    check). Trials an interrupted run left RUNNING are failed and queued again first
    (`recover_interrupted_trials`). Costs one evaluation of the additive table per trial
    (microseconds) plus the storage's write per trial.
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
    for key, value in (study_attrs or {}).items():
        study.set_user_attr(key, value)
    recover_interrupted_trials(study)
    if not study.trials:
        for assignment in warm_start:
            study.enqueue_trial({name: Format.parse(fmt).value for name, fmt in assignment.items()}, skip_if_exists=True)

    def objective(trial: optuna.Trial):
        mark_worker(trial)
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
