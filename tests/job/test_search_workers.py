"""`autoprec search JOB.toml --workers N`: several processes measuring one study, on a journal
file and on a real (throw-away) PostgreSQL server, with a worker killed mid-trial."""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from autoprec.cli import main
from autoprec.plan import Plan
from autoprec.search.study import open_storage
from support.postgres import find_binaries, throwaway_postgres
from support.jobs import write_job

POSTGRES, NO_POSTGRES = find_binaries()
# .ci/run installs the server and sets this, so there the test cannot quietly skip.
POSTGRES_REQUIRED = os.environ.get("AUTOPREC_TEST_POSTGRES") == "required"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def worker_job(folder, storage, steps=5):
    """The tiny job of test_search_job on ``storage``, measuring one proposed plan beside the
    references. One, because the two best proposed plans of this model differ in a layer or two
    and measure within a few percent of each other: which of them wins is the machine's noise, not
    the search's. ``steps`` timed steps per candidate (more: steadier times, longer trials)."""
    path = write_job(folder)
    text = path.read_text(encoding="utf-8").replace("measure_top = 2", f'measure_top = 1\nstorage = "{storage}"')
    path.write_text(text.replace("steps = 1\n", f"steps = {steps}\n"), encoding="utf-8")
    return path


def study_of(url):
    return optuna.load_study(study_name="tiny:measured", storage=open_storage(url))


def measured_once(study):
    """Candidate id -> its one finished, not skipped trial; fails when any candidate of the
    study's list has none or several, or has two COMPLETE trials."""
    ids = [plan_id for plan_id in _candidate_ids(study)]
    trials = [t for t in study.get_trials(deepcopy=False, states=FINISHED) if "skipped" not in t.user_attrs]
    by_id = {}
    for t in trials:
        by_id.setdefault(t.user_attrs["candidate"], []).append(t)
    assert sorted(by_id) == sorted(ids), "a candidate was never measured, or a trial measured something else"
    assert all(len(ts) == 1 for ts in by_id.values()), {k: [t.number for t in ts] for k, ts in by_id.items() if len(ts) > 1}
    return {k: ts[0] for k, ts in by_id.items()}


def _candidate_ids(study):
    from autoprec.search.candidate_runs import Candidate

    return [Candidate(name, Plan.from_dict(plan), autocast).id for name, plan, autocast in study.user_attrs["autoprec_candidates"]]


@contextlib.contextmanager
def worker_log():
    """The records of autoprec.job.workers, caught on that logger itself (the CLI stops
    autoprec's records from reaching the root logger, where caplog listens)."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("autoprec.job.workers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def started_worker_pids(records, workers):
    """The pids of the worker processes the search said it started (one log record)."""
    started = [r for r in records if r.getMessage().startswith(f"started {workers} workers")]
    assert len(started) == 1, [r.getMessage() for r in records]
    pids = set(started[0].args[1])
    assert len(pids) == workers and os.getpid() not in pids
    return pids


def measuring_pids(trials):
    return {int(str(t.user_attrs["worker"]).rpartition(":")[2]) for t in trials.values()}


def formats_of(folder):
    return {fqn: lp.format for fqn, lp in Plan.load(folder / "out" / "plan.json").layers.items()}


def test_sqlite_with_several_workers_is_refused_in_one_line_naming_the_key_and_the_fix(tmp_path, capsys):
    path = worker_job(tmp_path, "study.db")
    assert main(["search", str(path), "--workers", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "[search].storage" in err and "SQLite" in err and "locks the whole database per write" in err
    assert "journal file" in err and "PostgreSQL" in err
    assert not (tmp_path / "out").exists()  # refused before any work or any file


@pytest.mark.slow
def test_two_workers_on_a_journal_measure_every_candidate_once_and_choose_the_one_worker_plan(tmp_path):
    # 60 timed steps: steadier times, so both searches choose the same plan. Which worker takes
    # which trial is the operating system's scheduling: the test checks that two worker
    # processes started and that every trial was measured by one of them, never by the parent.
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert main(["search", str(worker_job(one, "study.journal", steps=60)), "--workers", "1"]) == 0
    # The proxy made deterministic: the second search predicts from the first one's measured
    # layer times (costs.json is read back, not measured again), so it proposes the same plans.
    (two / "out").mkdir()
    shutil.copy(one / "out" / "costs.json", two / "out" / "costs.json")
    with worker_log() as records:
        assert main(["search", str(worker_job(two, "study.journal", steps=60)), "--workers", "2"]) == 0

    single, parallel = (study_of(f"journal://{f / 'out' / 'study.journal'}") for f in (one, two))
    assert _candidate_ids(parallel) == _candidate_ids(single)
    trials = measured_once(parallel)
    assert measuring_pids(trials) <= started_worker_pids(records, 2)  # the workers measured, the parent none
    assert formats_of(two) == formats_of(one)


@pytest.mark.slow
@pytest.mark.skipif(POSTGRES is None and not POSTGRES_REQUIRED, reason=NO_POSTGRES)
def test_two_workers_on_a_postgresql_server_measure_every_candidate_once(tmp_path):
    if POSTGRES is None:
        pytest.fail(f"AUTOPREC_TEST_POSTGRES=required: {NO_POSTGRES}")
    with throwaway_postgres() as url, worker_log() as records:
        assert main(["search", str(worker_job(tmp_path, url)), "--workers", "2"]) == 0
        trials = measured_once(study_of(url))
    assert measuring_pids(trials) <= started_worker_pids(records, 2)
    assert (tmp_path / "out" / "plan.json").exists()


@pytest.mark.slow
def test_a_worker_killed_mid_trial_has_its_trial_failed_and_measured_once_by_another(tmp_path):
    path = worker_job(tmp_path, "study.journal", steps=60)  # trials of seconds: a kill lands inside one
    url = f"journal://{tmp_path / 'out' / 'study.journal'}"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    job = subprocess.Popen([sys.executable, "-m", "autoprec", "search", str(path), "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    victim = None
    deadline = time.monotonic() + 240
    while victim is None and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.1)
        if (tmp_path / "out" / "study.journal").exists():
            running = [t for t in _trials(url) if t.state is TrialState.RUNNING and "worker" in t.user_attrs and "bytes" in t.user_attrs]
            victim = running[0] if running else None
    assert victim is not None, f"no trial was seen running: {job.communicate()}"
    pid = int(victim.user_attrs["worker"].rpartition(":")[2])
    assert pid != job.pid
    os.kill(pid, signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]

    study = study_of(url)
    killed = study.trials[victim.number]
    assert killed.state is TrialState.FAIL
    trials = measured_once(study)
    again = trials[victim.user_attrs["candidate"]]
    assert again.state is TrialState.COMPLETE and again.number > victim.number
    assert again.user_attrs["worker"] != victim.user_attrs["worker"]
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
    assert (tmp_path / "out" / "plan.json").exists()


def _trials(url):
    try:
        return study_of(url).get_trials(deepcopy=False)
    except KeyError:
        return []


@pytest.mark.slow
def test_two_workers_with_the_learning_sampler_measure_no_plan_twice_and_keep_its_budget(tmp_path):
    # Each worker's sampler reads the study and marks its proposal held at once: whatever the race
    # between the two, no plan is measured twice and the plans measured stay within the budget.
    path = worker_job(tmp_path, "study.journal")
    path.write_text(path.read_text(encoding="utf-8").replace("measure_top = 1", "measure_top = 1\nmeasured_trials = 9"), encoding="utf-8")
    with worker_log() as records:
        assert main(["search", str(path), "--workers", "2"]) == 0
    study = study_of(f"journal://{tmp_path / 'out' / 'study.journal'}")
    taken = [t for t in study.get_trials(deepcopy=False, states=FINISHED) if "skipped" not in t.user_attrs]
    ids = [t.user_attrs["candidate"] for t in taken]
    assert len(ids) == len(set(ids)) <= 9
    assert set(_candidate_ids(study)) <= set(ids)  # the initial design all measured
    assert measuring_pids({t.number: t for t in taken}) <= started_worker_pids(records, 2)
    # Every sampler trial that proposed nothing says why; none is left running or queued.
    assert all(t.user_attrs.get("skipped") for t in study.trials if t.state is TrialState.PRUNED and "candidate" not in t.user_attrs)
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
    assert (tmp_path / "out" / "plan.json").exists()
