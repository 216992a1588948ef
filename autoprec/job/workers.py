"""Many worker processes measuring one search's candidates (``autoprec search JOB.toml --workers N``).

The candidates of the measured stage are independent plans, so they can be measured in parallel.
The job's parent process does the expensive part once (training and profiling, costs,
sensitivity, the k best plans), queues one trial per candidate in the measured study, and starts
N worker processes. Each worker rebuilds the trained model from the parent's weights and runs the
same `MeasuredStage.run` on the study: it takes the next queued trial (Optuna hands each queued
trial to exactly one process), measures it, and stops when no candidate is left. The parent then
runs `MeasuredStage.run` itself, which finds every candidate measured (or measures what a dead
worker left), and picks the plan exactly as the single-process job does.

Placement: with several CUDA devices (``[job].device`` "auto" or "cuda"), worker *i* runs on
device *i mod count*; otherwise every worker runs on the job's device. Each worker sets
``torch.set_num_threads`` to its share of the cores other processes leave free
(`cpu_load.measuring_threads`): N workers with ``cores`` intra-op threads each would
oversubscribe the cores, and idle OpenMP threads spin-wait on each other's cores; the
step times are ratios to interleaved FP32 steps of the same worker, so each worker's thread
count cancels out of the comparison.

Storages (`study.open_storage`): a journal file (``[search].storage = "study.journal"``) or a
server database (``postgresql://...``); SQLite is refused for N > 1 (`check_workers`). Several
machines join one search by running the same job file with ``[search].storage`` naming one
PostgreSQL database: each machine trains its own copy of the model (same seed), adopts the
candidate list the first machine stored in the study (`adopt_candidates`), and measures what no
other machine holds; a machine that dies mid-trial is found by Optuna's heartbeat and its trial
retried elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable, Optional, Sequence

import optuna
import torch
from optuna.trial import TrialState

from ..errors import SearchError
from ..plan import Plan
from ..search.candidate_runs import BudgetPruner, Candidate, enqueue
from ..search.study import storage_kind

__all__ = ["WorkerPayload", "check_workers", "worker_devices", "adopt_candidates", "run_workers"]


@dataclasses.dataclass(frozen=True)
class WorkerPayload:
    """What a worker process needs to rebuild the measured stage, written once by the job with
    `torch.save`: the job's ``config`` and ``device``, the trained model's ``state_dict`` (on the
    CPU), the ``train`` and ``val`` batches (CPU), the ``candidates``, the
    budgets (``memory`` bytes, ``loss_budget``), the study (``study_name`` in ``storage``) and
    its ``sampler`` (None: Optuna's default; the job's learning sampler otherwise)."""

    config: Any  # JobConfig
    device: torch.device
    state_dict: dict
    train: list
    val: list
    candidates: Sequence[Candidate]
    memory: float
    loss_budget: float
    study_name: str
    storage: str
    sampler: Optional[optuna.samplers.BaseSampler] = None

logger = logging.getLogger(__name__)

_CANDIDATES_ATTR = "autoprec_candidates"  # the study's user attribute holding the candidate list


def check_workers(source, storage_url: str, workers: int) -> None:
    """`SearchError` (one line naming ``[search].storage`` and the fix) when ``workers`` > 1
    processes cannot share the storage, or ``workers`` < 1."""
    if workers < 1:
        raise SearchError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and storage_kind(storage_url) == "sqlite":
        raise SearchError(
            f"{source}: [search].storage: {storage_url} is SQLite, which locks the whole database per write, so "
            f"{workers} concurrent workers time out; set it to a journal file (storage = \"study.journal\") or a "
            "PostgreSQL URL (postgresql://user@host/db), or run with --workers 1"
        )


def worker_devices(device: torch.device, requested: str, workers: int) -> list[str]:
    """The device of each worker: one per CUDA device, round robin, when ``requested`` names no
    index and there are several; else ``device`` for all."""
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count > 1 and requested in ("auto", "cuda"):
        return [f"cuda:{i % count}" for i in range(workers)]
    return [str(device)] * workers


def adopt_candidates(study: optuna.Study, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The study's candidate list: ``candidates``, stored in the study when it has none yet, else
    the list stored there (by the first machine of a search several machines run), so that every
    process measures and chooses among the same plans. One storage read, one write at most."""
    held = study.user_attrs.get(_CANDIDATES_ATTR)
    if held is None:
        study.set_user_attr(_CANDIDATES_ATTR, [[c.name, c.plan.to_dict(), c.autocast] for c in candidates])
        return list(candidates)
    return [Candidate(name, Plan.from_dict(plan, f"study {study.study_name!r}"), autocast) for name, plan, autocast in held]


def _finished(study: optuna.Study, ids: set) -> int:
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return len({t.user_attrs.get("candidate") for t in trials if "skipped" not in t.user_attrs} & ids)


def run_workers(
    job,
    payload: WorkerPayload,
    candidates: Sequence[Candidate],
    study: optuna.Study,
    workers: int,
    progress: "Callable[[int, int, str], None] | None" = None,
    threads: int = 1,
    poll_s: float = 1.0,
) -> "list[int | None]":
    """Queue every candidate not yet finished or held, run ``workers`` processes measuring them
    on ``study`` until none is left, and return their exit codes (negative: killed by that signal;
    None only for a process that has not ended, which the loop's end rules out). Each worker
    runs ``threads`` intra-op threads.

    ``payload``: what a worker needs to rebuild the measured stage, written once to ``[job].out``.
    Costs: one process start per worker (a Python and torch import, the workload built, the
    baseline held-out losses), then the measuring itself; the parent polls the study every
    ``poll_s`` seconds (one storage read) to report progress and reap dead workers, so that a
    killed worker's trial is failed and re-queued by the others at once.
    """
    from torch import multiprocessing

    ids = {c.id for c in candidates}
    done = {t.user_attrs.get("candidate") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)) if "skipped" not in t.user_attrs}
    enqueue(study, [c for c in candidates if c.id not in done])  # fastest predicted first, as one process would
    path = job.out / "workers.pt"
    torch.save(payload, path)
    devices = worker_devices(payload.device, payload.config.device, workers)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch or database state
    processes = [context.Process(target=_worker_main, args=(str(path), devices[i], threads, optuna.logging.get_verbosity()), name=f"autoprec-worker-{i}") for i in range(workers)]
    for p in processes:
        p.start()
    logger.info("started %d workers (pids %s) on %s, %d thread(s) each", workers, [p.pid for p in processes], ", ".join(sorted(set(devices))), threads)
    try:
        while True:
            alive = [p for p in processes if p.is_alive()]  # is_alive() reaps a dead worker, so its pid is gone
            if progress is not None:
                progress(_finished(study, ids), len(ids), f"measuring ({len(alive)} worker{'s' if len(alive) != 1 else ''})")
            if not alive:
                break
            time.sleep(poll_s)
    except BaseException:  # Ctrl-C: the workers fail their trials (Optuna marks them FAIL) and stop
        for p in processes:
            if p.is_alive() and p.pid is not None:  # a started process has a pid
                os.kill(p.pid, signal.SIGINT)
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()
        raise
    finally:
        path.unlink(missing_ok=True)
    for p in processes:
        if p.exitcode != 0:
            logger.warning("worker %s (pid %d) ended with exit code %s; what it left unmeasured is measured by the others or by this process", p.name, p.pid, p.exitcode)
    return [p.exitcode for p in processes]


def _worker_main(path: str, device: str, threads: int, verbosity: int) -> None:
    """One worker process: rebuild the measured stage from the parent's payload and measure
    candidates on the study until none is left."""
    from ..search.candidate_runs import MeasuredStage
    from ..search.study import open_storage, quiet_interrupts
    from ..workload import TrainStep, to_device
    from .config import load_job_workload

    torch.set_num_threads(threads)
    optuna.logging.set_verbosity(verbosity)
    payload: WorkerPayload = torch.load(path, weights_only=False)  # written by this job's parent, not a foreign file
    config = payload.config
    workload = load_job_workload(config)
    model = workload.build_model(config.seed)
    model.load_state_dict(payload.state_dict)
    model.to(device)
    stage = MeasuredStage(
        model, workload.loss, [to_device(b, device) for b in payload.train], [to_device(b, device) for b in payload.val],
        train_step=lambda m: TrainStep.for_workload(workload, m), steps=config.measure_steps,
    )
    study = optuna.load_study(study_name=payload.study_name, storage=open_storage(payload.storage), pruner=BudgetPruner(payload.loss_budget),
                              sampler=payload.sampler)
    try:
        with quiet_interrupts():
            stage.run(payload.candidates, study, payload.memory, payload.loss_budget)
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # the parent reports the interrupt in one line
