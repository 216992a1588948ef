"""Bad input and interrupts (issue 12 §2): a one-line error naming the field and the fix, and
nothing lost or measured twice when a search is killed or interrupted and run again."""

import contextlib
import logging
import math
import os
import signal
import sqlite3
import socket
import subprocess
import sys
import textwrap
import time
import types
import warnings

import optuna
import pytest
import torch
import torch.nn as nn
from optuna.trial import TrialState

from autoprec.cli import main
from autoprec.errors import RuntimeStateError, SearchError, SettingsError
from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.scheduler import DynamicPrecisionScheduler, Thresholds
from autoprec.job.run import _check_study
from autoprec.search.candidate_runs import Candidate, MeasuredStage
from autoprec.search.study import open_storage, recover_interrupted_trials
from autoprec.workloads import default_workload

# study.ask() on a storage with heartbeats: the tests play the part of a worker that died.
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")

JOB = """
[job]
name = "tiny"
out = "{out}"
device = "{device}"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = {{ {kwargs} }}

[budgets]
memory = {memory}
accuracy = 0.05

[search]
formats = ["fp32", "bf16", "int8"]
measure_top = 3
storage = "{storage}"

[profile]
steps = 5
sensitivity_batches = 1

[measure]
val_batches = 2
steps = 3
"""


def write_job(folder, out="out", device="cpu", kwargs='name = "tiny", batch_size = 4', memory=0.85, storage="study.db"):
    path = folder / "job.toml"
    path.write_text(textwrap.dedent(JOB.format(out=out, device=device, kwargs=kwargs, memory=memory, storage=storage)), encoding="utf-8")
    return path


def search_error(path, capsys) -> str:
    assert main(["search", str(path)]) != 0
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "Traceback" not in message
    return message


# -- the search job --------------------------------------------------------------------------------


def test_out_under_a_regular_file_names_job_out(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    message = search_error(write_job(tmp_path, out="afile/out"), capsys)
    assert "[job].out: cannot create" in message and "writable folder" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_names_job_out(tmp_path, capsys):
    out = tmp_path / "locked"
    out.mkdir(mode=0o500)
    assert "[job].out:" in search_error(write_job(tmp_path, out="locked"), capsys)


def test_kwargs_the_factory_rejects_name_workload_kwargs(tmp_path, capsys):
    message = search_error(write_job(tmp_path, kwargs='name = "huge"'), capsys)
    assert "[workload].kwargs" in message and "unknown preset" in message


def test_an_unopenable_storage_names_search_storage(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path}/afile/study.db"
    (tmp_path / "afile").write_text("x")
    assert "[search].storage: cannot open Optuna storage" in search_error(write_job(tmp_path, storage=storage), capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_job_device_and_leaves_no_study(tmp_path, capsys):
    message = search_error(write_job(tmp_path, device="cuda"), capsys)
    assert '[job].device = "cpu"' in message and "--device" not in message
    assert not (tmp_path / "out" / "study.db").exists()


# -- interrupts: a study in the job's storage ------------------------------------------------------


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_trial_left_running_by_a_dead_process_is_failed_and_queued_again(tmp_path):
    storage = open_storage(tmp_path / "study.db")
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead_pid()}")
    assert recover_interrupted_trials(study) == 1
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    assert study.get_trials()[1].params == study.get_trials()[0].params


def test_a_retried_trial_is_judged_by_its_own_constraints_not_the_killed_attempts(tmp_path):
    storage = open_storage(tmp_path / "study.db")
    study = optuna.create_study(study_name="s", storage=storage)
    killed = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    killed.set_constraint("memory", 5.0)  # what the killed attempt measured before it died
    killed.set_user_attr("worker", f"{socket.gethostname()}:{dead_pid()}")
    recover_interrupted_trials(study)
    retry = study.ask()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns when it ignores a constraint already set
        retry.set_constraint("memory", -1.0)
    study.tell(retry, 0.5)
    assert study.get_trials()[1].constraints == {"memory": -1.0}


def test_a_trial_of_a_live_process_is_left_running(tmp_path):
    storage = open_storage(tmp_path / "study.db")
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getppid()}")
    assert recover_interrupted_trials(study) == 0
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING]


def test_a_trial_whose_worker_died_before_naming_itself_is_failed_after_the_grace_period(tmp_path, monkeypatch):
    """kill -9 between Optuna creating the trial and the worker naming itself leaves a trial with
    no worker and no heartbeat: failed once it has been nameless for the grace period."""
    import autoprec.search.study as study_module

    storage = open_storage(tmp_path / "study.db")
    study = optuna.create_study(study_name="s", storage=storage)
    study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    assert recover_interrupted_trials(study) == 0  # just created: its worker may be naming itself now
    monkeypatch.setattr(study_module, "HEARTBEAT_SECONDS", 0)  # the grace period has passed
    assert recover_interrupted_trials(study) == 1
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.WAITING]


def test_an_interrupted_study_rerun_with_other_budgets_is_refused(tmp_path):
    storage = open_storage(tmp_path / "study.db")
    study = optuna.create_study(study_name="s:measured", storage=storage)  # the job's measured study
    study.set_user_attr("autoprec_search", "budgets A")  # as run_job sets it before the first trial

    def interrupt(study, trial):
        if len(study.trials) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=20, callbacks=[interrupt])
    job = types.SimpleNamespace(study_name="s", storage_url=str(tmp_path / "study.db"))
    _check_study(storage, job, "budgets A")  # the same search resumes
    with pytest.raises(SearchError, match="holds trials of another search"):
        _check_study(storage, job, "budgets B")


# -- interrupts: the measured stage ----------------------------------------------------------------


@pytest.fixture(scope="module")
def stage():
    wl = default_workload("tiny", batch_size=2)
    model = wl.build_model(0)
    sampler = wl.train_batches(0)
    train = [sampler.next()]
    candidates = [Candidate(f.value, Plan.uniform(model, f, train[0][0])) for f in (Format.BF16, Format.FP32)]
    return MeasuredStage(model, wl.loss, train, wl.val_batches(2), steps=1, warmup=0), candidates


def measured(study, candidate) -> int:
    """Trials that measured ``candidate`` to the end (completed, or pruned on a measurement)."""
    return sum(1 for t in study.get_trials() if t.user_attrs.get("candidate") == candidate.id
               and t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "skipped" not in t.user_attrs)


def test_resume_fails_the_killed_trial_and_measures_each_candidate_once(tmp_path, stage):
    stage, candidates = stage
    study = optuna.create_study(study_name="m", storage=open_storage(tmp_path / "study.db"))
    killed = study.ask()  # what kill -9 leaves: candidate 0 RUNNING, its process gone
    killed.set_user_attr("candidate", candidates[0].id)
    killed.set_user_attr("worker", f"{socket.gethostname()}:{dead_pid()}")
    stage.run(candidates, study, math.inf, math.inf)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert [measured(study, c) for c in candidates] == [1, 1]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # the orphan comes from ask(), on purpose
def test_a_trial_whose_worker_stopped_beating_is_failed_and_its_candidate_measured_once(tmp_path, stage):
    """A worker on another machine (no pid to check) that died mid-trial: its heartbeat goes
    stale, Optuna fails the trial and queues a retry, and the candidate is measured once."""
    stage, candidates = stage
    storage = open_storage(tmp_path / "study.db", heartbeat_seconds=1)
    study = optuna.create_study(study_name="m", storage=storage)
    orphan = study.ask()
    orphan.set_user_attr("candidate", candidates[0].id)
    orphan.set_user_attr("worker", "another-machine:1")
    storage.record_heartbeat(orphan._trial_id)
    # SQLite's CURRENT_TIMESTAMP, which Optuna stamps heartbeats with and compares them against,
    # has whole-second resolution: after 2.5 s the stamps can differ by only 2 s, which is not
    # past the 2 s grace period. 3.5 s makes them differ by at least 3 s whatever the start.
    time.sleep(2 * 1 + 1.5)
    stage.run(candidates, study, math.inf, math.inf)
    assert study.get_trials()[0].state is TrialState.FAIL
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert [measured(study, c) for c in candidates] == [1, 1]


def test_a_queued_retry_of_a_measured_candidate_is_not_measured_again(tmp_path, stage):
    stage, candidates = stage
    study = optuna.create_study(study_name="m", storage=open_storage(tmp_path / "study.db"))
    stage.run(candidates[:1], study, math.inf, math.inf)
    # What Optuna's heartbeat retry leaves after a stale trial: a WAITING copy of candidate 0.
    study.enqueue_trial({}, user_attrs={"candidate": candidates[0].id})
    stage.run(candidates, study, math.inf, math.inf)
    assert [measured(study, c) for c in candidates] == [1, 1]


# -- the scheduler ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(accuracy_budget=math.nan), "accuracy_budget"),
        (dict(memory_budget="0.5"), "memory_budget"),
        (dict(memory_budget=math.inf), "memory_budget"),
        (dict(memory_budget=1.5), "memory_budget"),  # once 1.5 bytes; now neither spelling
        (dict(lr=-1.0), "lr"),
        (dict(lr=math.nan), "lr"),
        (dict(search_timeout_s=-1.0), "search_timeout_s"),
    ],
)
def test_bad_scheduler_arguments_are_refused_at_construction(kwargs, name):
    # A settings error, not a search error: nothing was searched (and still a ValueError).
    with pytest.raises(SettingsError, match=rf"^DynamicPrecisionScheduler\({name}=.*\): expected") as info:
        DynamicPrecisionScheduler(**kwargs)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, SearchError)


@pytest.mark.parametrize("kwargs", [dict(overflow=-0.1), dict(underflow=2.0), dict(amax_drift=-16.0), dict(nonfinite_steps=-3), dict(stable_windows=0)])
def test_negative_or_out_of_range_thresholds_are_refused(kwargs):
    (name,) = kwargs
    with pytest.raises(SettingsError, match=rf"^Thresholds\({name}="):
        Thresholds(**kwargs)


class MLP(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def steps(model, sch, opt, n, poison=lambda i: False):
    """``n`` training steps of ``model`` under ``sch``; ``poison(i)`` makes step i's loss NaN."""
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        x = torch.randn(16, 8, generator=gen)
        with sch.precision_context():
            loss = model(x).pow(2).mean()
        if poison(i):
            loss = loss * math.nan
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)


def small_scheduler(**kwargs):
    settings = dict(monitor_window=6, monitor_steps=3, memory_budget=0.9, accuracy_budget=0.05, measure_costs=False, search_slice=None)
    settings.update(kwargs)
    return DynamicPrecisionScheduler(**settings)


def test_step_after_a_forward_but_before_backward_is_refused():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sch = small_scheduler()
    steps(model, sch, opt, 1)
    with sch.precision_context():
        model(torch.randn(4, 8)).sum()
    with pytest.raises(RuntimeStateError, match=r"before its backward: call scheduler\.backward\(loss\)"):
        sch.step(opt)


def test_a_nan_batch_in_the_profiling_window_is_left_out_of_the_baseline(caplog):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sch = small_scheduler()
    with caplog.at_level(logging.WARNING, logger="autoprec.scheduler"):
        steps(model, sch, opt, 7, poison=lambda i: i == 2)
    assert sch.plan is not None
    assert math.isfinite(sch.plan.budgets["baseline_loss"]) and math.isfinite(sch.plan.budgets["loss_increase"])
    assert any("1 of the window's 6 losses were NaN / inf" in r.message for r in caplog.records)


def test_many_skipped_steps_in_a_row_warn(caplog):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sch = DynamicPrecisionScheduler.from_plan(model, Plan.uniform(model, Format.BF16))
    with caplog.at_level(logging.WARNING, logger="autoprec.scheduler"):
        steps(model, sch, opt, 25, poison=lambda i: True)
    warnings = [r.message for r in caplog.records if "in a row skipped" in r.message]
    assert len(warnings) == 2  # at 10 and at 20 skips, not once per step
    assert warnings[0].startswith("autoprec: step 10: 10 optimizer steps in a row skipped (non-finite")


@pytest.fixture(scope="module")
def saved_int8_state():
    """The state of a scheduler running INT8 (started from a uniform INT8 plan, dynamic)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 8)
    sch = DynamicPrecisionScheduler.from_plan(model, Plan.uniform(model, Format.INT8, x), dynamic=True, monitor_window=50, measure_costs=False, search_slice=None)
    steps(model, sch, opt, 2)
    return sch.state_dict()


def test_loading_into_settings_that_exclude_the_plans_formats_is_refused(saved_int8_state):
    torch.manual_seed(0)
    sch = small_scheduler(model=MLP(), min_precision=16)
    with pytest.raises(RuntimeStateError, match=r"the saved plan runs 'fc1' in int8, which this scheduler's settings \(min_precision=16"):
        sch.load_state_dict(saved_int8_state)


def test_loading_into_a_model_of_other_widths_is_refused(saved_int8_state):
    sch = small_scheduler(model=MLP(hidden=32))
    with pytest.raises(RuntimeStateError, match=r"layer 'fc1' has parameter shapes .* here but .* in the state"):
        sch.load_state_dict(saved_int8_state)


def test_loading_a_state_missing_a_key_names_it(saved_int8_state):
    state = {k: v for k, v in saved_int8_state.items() if k != "scaler"}
    sch = small_scheduler(model=MLP())
    with pytest.raises(RuntimeStateError, match=r"the state lacks 'scaler'"):
        sch.load_state_dict(state)


# -- kill -9 and Ctrl-C of the real job, in a subprocess -------------------------------------------


def wait_for(predicate, process, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the job ended before the signal: {process.communicate()}")
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail("the job did not reach the state to interrupt")


def storage_ready(db):
    """The job has finished creating its SQLite storage (Optuna writes the alembic revision
    last). Read-only: opening a half-made storage with Optuna from here would race the job's own
    schema creation."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            return con.execute("select count(*) from alembic_version").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def trials_of(storage, name, states=None):
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False, states=states)
    except KeyError:
        return []


def start_search(path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-m", "autoprec", "search", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_ctrl_c_swallowed_by_a_finalizer_still_stops_the_command_at_the_next_tick(monkeypatch):
    """Python drops a KeyboardInterrupt raised inside ``__del__`` (or a weakref callback, as
    SQLAlchemy's were during a search) and prints it with a traceback; the command must stop
    all the same, and print no such traceback."""
    from autoprec.cli import _CTRL_C, _Progress

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)  # what Python would print

    class SignalsWhenCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the finalizer, and its raise is dropped

    progress = _Progress("test", stream=open(os.devnull, "w"))
    with _CTRL_C:
        SignalsWhenCollected()  # collected at once
        with pytest.raises(KeyboardInterrupt):
            progress(1, 2, "working")
    assert printed == []
    assert sys.unraisablehook == printed.append  # restored on exit


def test_ctrl_c_that_a_library_turns_into_another_error_still_ends_as_an_interrupt(tmp_path, monkeypatch, capsys):
    """Ctrl-C landing inside Optuna's trial bookkeeping once surfaced as its UnboundLocalError,
    with a traceback and exit status 1, instead of the one-line interrupt."""
    import autoprec.job.run as job_module

    def run_job(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises here
        except KeyboardInterrupt:
            raise UnboundLocalError("cannot access local variable 'updated_state'")  # as Optuna did

    monkeypatch.setattr(job_module, "run_job", run_job)
    assert main(["search", str(write_job(tmp_path))]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("autoprec: search interrupted; run the same command again")

    def unrelated(*args, **kwargs):
        raise UnboundLocalError("a bug of its own")

    monkeypatch.setattr(job_module, "run_job", unrelated)
    with pytest.raises(UnboundLocalError):  # not an interrupt: a traceback, as any bug
        main(["search", str(write_job(tmp_path))])


@pytest.mark.slow
def test_kill_and_ctrl_c_resume_with_no_trial_left_running_and_no_candidate_measured_twice(tmp_path):
    path = write_job(tmp_path)
    url = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    running = (TrialState.RUNNING,)

    # kill -9 while a candidate is being measured.
    job = start_search(path)
    # (Once the trial names its worker: a kill before that is recovered only after the grace
    # period, tested on its own above.)
    wait_for(lambda: storage_ready(tmp_path / "out" / "study.db") and any("worker" in t.user_attrs for t in trials_of(url, "tiny:measured", running)), job)
    job.send_signal(signal.SIGKILL)
    job.wait()

    # Ctrl-C in the resumed run's measured stage: one line, no traceback.
    job = start_search(path)
    this_job = f"{socket.gethostname()}:{job.pid}"  # the killed run's trial stays RUNNING until this one recovers it
    wait_for(lambda: any(t.user_attrs.get("worker") == this_job for t in trials_of(url, "tiny:measured", running)), job)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1].startswith("autoprec: search interrupted; run the same command again to resume")

    # Other budgets on the interrupted study: refused.
    other = write_job(tmp_path, memory=0.7)
    assert main(["search", str(other)]) != 0

    # The same job again: it finishes, nothing left running, every candidate measured once.
    write_job(tmp_path)
    assert main(["search", str(path)]) == 0
    assert not trials_of(url, "tiny", running) and not trials_of(url, "tiny:measured", running)
    finished = [t for t in trials_of(url, "tiny:measured", (TrialState.COMPLETE, TrialState.PRUNED)) if "skipped" not in t.user_attrs]
    ids = [t.user_attrs["candidate"] for t in finished]
    # measure_top proposals plus the references that fit (uniform plans, plain autocast), each once.
    assert len(ids) == len(set(ids)) >= 3


def test_an_unknown_scheduler_setting_is_named_with_the_known_ones():
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(monitor_windows=\.\.\.\): unknown setting; expected one of .*monitor_window"):
        DynamicPrecisionScheduler(monitor_windows=10)


def test_the_removed_search_trials_setting_says_why_and_the_fix():
    with pytest.raises(SettingsError, match=r"search_trials=\.\.\.\): removed: the search is the optimum of the integer program .* bounded by search_timeout_s; delete the argument"):
        DynamicPrecisionScheduler(search_trials=10)


def test_settings_given_both_as_config_and_keywords_are_refused():
    from autoprec.scheduler.config import SchedulerConfig

    with pytest.raises(SettingsError, match=r"config or as keywords, not both"):
        DynamicPrecisionScheduler(config=SchedulerConfig(), lr=1.0)


def test_a_config_runs_as_its_keywords_do():
    import dataclasses

    from autoprec.scheduler.config import SchedulerConfig

    config = SchedulerConfig(monitor_window=6, monitor_steps=3, memory_budget=0.9, accuracy_budget=0.05, measure_costs=False, search_slice=None)
    losses = {}
    for how in ("config", "keywords"):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sch = DynamicPrecisionScheduler(config=config) if how == "config" else DynamicPrecisionScheduler(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        steps(model, sch, opt, 8)
        losses[how] = [p.detach().clone() for p in model.parameters()], sch.plan
    assert losses["config"][1] == losses["keywords"][1] and losses["config"][1] is not None
    for a, b in zip(losses["config"][0], losses["keywords"][0]):
        assert torch.equal(a, b)


def test_a_killed_learning_sampler_trial_is_measured_once_when_the_run_resumes(tmp_path, stage):
    """kill -9 during a trial the learning sampler proposed: on resume the trial is failed and
    queued again with its plan's formats, and that queued trial measures the plan (once)."""
    from autoprec.search.refine import CorrectingSampler
    from autoprec.search.space import Choice, SearchSpace

    stage, candidates = stage
    layers = candidates[0].plan.layers
    # A proxy in which BF16 is faster for every layer; the design measures uniform FP32 only.
    space = SearchSpace({fqn: {Format.FP32: Choice(2.0, 2.0, 0.0), Format.BF16: Choice(1.0, 1.0, 0.0)} for fqn in layers})
    sampler = CorrectingSampler(space, [candidates[1].plan], math.inf, math.inf, fp32_seconds=1.0, max_trials=4)
    study = optuna.create_study(study_name="m", storage=open_storage(tmp_path / "study.db"), sampler=sampler)
    killed = study.ask()
    assert killed.relative_params  # the sampler proposes, marking the trial with its plan at once; then the kill
    killed.set_user_attr("worker", f"{socket.gethostname()}:{dead_pid()}")
    marked = study.trials[killed.number].user_attrs
    proposed = marked["candidate"]
    stage.run(candidates[1:], study, math.inf, math.inf)
    assert study.trials[killed.number].state is TrialState.FAIL
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    runs = [t for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
            if t.user_attrs.get("candidate") == proposed and "skipped" not in t.user_attrs]
    assert len(runs) == 1 and runs[0].number > killed.number
    # The queued copy itself measured it: no copy of this plan was skipped and proposed anew.
    assert not [t for t in study.trials if t.user_attrs.get("candidate") == proposed and "skipped" in t.user_attrs]
    assert runs[0].user_attrs["refined"]["assignment"] == marked["refined"]["assignment"]
    assert [measured(study, c) for c in candidates[1:]] == [1]
