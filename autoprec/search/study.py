"""Optuna storages for the measured study (opening, crashed workers' trials, quiet interrupts).

There is no sampler-driven proxy study: the integer program (`exact.k_best`) solves the additive
table exactly, which TPE did not (+72 % predicted step time off the optimum after 1,000 trials
on 120 layers). Optuna runs what it is good at here, the study of measured plans
(`search.candidate_runs`): its storage, resume, heartbeats and pruning.

Storage is any Optuna storage URL, or a path: an Optuna journal file when it ends in ``.journal``
or ``.log`` (or is written ``journal:///path``), else a local SQLite file. Trials a crashed
worker left running are failed and queued again (`recover_interrupted_trials`): at once when the
worker was a process of this machine that no longer exists, else once its heartbeat goes stale.
So an interrupted study resumes with no trial lost.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import socket
import warnings
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ..errors import SearchError, first_line

__all__ = [
    "open_storage", "storage_kind", "feasible", "HEARTBEAT_SECONDS",
    "WORKER_ATTR", "mark_worker", "recover_interrupted_trials", "quiet_interrupts", "RetryWithFreshConstraints",
]

logger = logging.getLogger(__name__)

# A running trial whose worker stopped sending heartbeats for this long is marked failed and
# retried (Optuna's RDB heartbeat; the grace period is Optuna's default of 2 intervals).
HEARTBEAT_SECONDS = 10


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
                return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
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
        reason = first_line(exc)
        raise SearchError(f"cannot open Optuna storage {text!r}: {reason}") from None


# The user attribute naming the process that runs a trial ("host:pid"), so a resumed job can tell
# a trial whose process died (kill -9, power loss) from one another live worker is running.
WORKER_ATTR = "worker"


def mark_worker(trial: optuna.Trial) -> None:
    """Record this process as the trial's worker (one storage write)."""
    trial.set_user_attr(WORKER_ATTR, f"{socket.gethostname()}:{os.getpid()}")


def _worker_gone(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the trial's worker was a process of this machine that no longer exists, or died
    between Optuna creating the trial and the worker naming itself in it."""
    if WORKER_ATTR not in trial.user_attrs:
        # A live worker names itself (and Optuna records its first heartbeat) milliseconds after
        # creating the trial; a trial nameless for a whole grace period lost its worker in that
        # gap, and with no heartbeat on record `fail_stale_trials` would never fail it.
        started = trial.datetime_start
        return started is not None and (datetime.datetime.now() - started).total_seconds() > 2 * HEARTBEAT_SECONDS
    host, _, pid = str(trial.user_attrs[WORKER_ATTR]).rpartition(":")
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
                           trial.number, study.study_name, trial.user_attrs.get(WORKER_ATTR, "a worker that never named itself"))
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
    # SQLAlchemy logs "Exception during reset or similar" with a traceback when the Ctrl-C lands
    # while a pooled connection is being reset (its finalizer); the connection is discarded anyway.
    # (A logger's filter sees only its own records: each pool class logs on its own logger.)
    pool_loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("sqlalchemy.pool")]
    for pool_logger in pool_loggers:
        pool_logger.addFilter(_not_an_interrupt)
    try:
        yield
    finally:
        optimize_logger.removeFilter(quiet)
        for pool_logger in pool_loggers:
            pool_logger.removeFilter(_not_an_interrupt)


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    return not (record.exc_info and record.exc_info[0] is not None and issubclass(record.exc_info[0], KeyboardInterrupt))


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial that met both budgets (Optuna's convention: constraint values <= 0)."""
    values = list(trial.constraints.values())  # constraint name -> value
    return trial.state is TrialState.COMPLETE and bool(values) and all(v <= 0 for v in values)
