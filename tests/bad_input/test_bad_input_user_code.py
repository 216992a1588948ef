"""Bad input, the user's own code failing (issue 25): a workload hook that raises or returns what it
must not is one `autoprec: error:` line naming the hook and what it did, then only the user's own
frames; ``--debug`` (or ``AUTOPREC_DEBUG=1``) prints the full traceback."""

import json
import math
import textwrap

import pytest

from autoprec.cli import main
from autoprec.errors import UserCodeError, WorkloadError
from autoprec.profiling import profile_workload
from autoprec.workload import check_workload, load_workload

WORKLOAD = '''
import itertools
import math

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.fc(x))


class Hostile:
    def __init__(self, fail="", lr=1e-3):
        self.fail = fail
        self.lr = {"nan": math.nan, "inf": math.inf, "zero": 0.0, "str": "0.1"}.get(lr, lr)

    def build_model(self, seed):
        if self.fail == "build_raises":
            raise RuntimeError("no weights file at /nowhere")
        if self.fail == "build_none":
            return None
        torch.manual_seed(seed)
        model = Net(8 if self.fail == "shape" else 16)
        if self.fail == "optimizer_frozen":
            model.out.requires_grad_(False)
        return model

    def train_batches(self, seed):
        if self.fail == "train_raises":
            raise OSError("dataset not found")
        if self.fail == "train_not_iterable":
            return 5
        g = torch.Generator().manual_seed(seed)
        batches = (self.batch(g, i) for i in itertools.count())
        return itertools.islice(batches, 2) if self.fail == "train_runs_out" else batches

    def batch(self, g, i):
        if self.fail == "train_batch_raises" and i == 1:
            raise KeyError("label")
        x = torch.randn(4, 8, generator=g)
        if self.fail == "train_nan" and i == 1:
            x[0, 0] = math.nan
        return x, x.sum(1, keepdim=True)

    def val_batches(self, n):
        if self.fail == "val_empty":
            return []
        if self.fail == "val_none":
            return None
        g = torch.Generator().manual_seed(123)
        batches = [self.batch(g, 0) for _ in range(n)]
        if self.fail in ("val_nan", "val_inf"):
            x, y = batches[-1]
            x = x.clone()
            x[0, 0] = math.nan if self.fail == "val_nan" else math.inf
            batches[-1] = (x, y)
        return batches

    def loss(self, model, batch):
        x, y = batch
        out = model(x)
        if self.fail == "loss_vector":
            return (out - y) ** 2
        if self.fail == "loss_none":
            return None
        if self.fail == "loss_int":
            return torch.tensor(1)
        if self.fail == "loss_raises":
            raise ValueError("labels out of range")
        return ((out - y) ** 2).mean()

    def make_optimizer(self, model):
        if self.fail == "optimizer_raises":
            raise TypeError("bad betas")
        if self.fail == "optimizer_nan":
            return torch.optim.SGD(model.parameters(), lr=math.nan)
        if self.fail == "optimizer_other_model":  # a copy built once, not the model passed in
            return torch.optim.SGD(Net(16).parameters(), lr=0.01)
        if self.fail in ("optimizer_part", "optimizer_frozen"):  # the output layer left out
            return torch.optim.SGD(model.fc.parameters(), lr=0.01)
        return torch.optim.SGD(model.parameters(), lr=0.01)


def make(fail="", lr=1e-3):
    if fail == "factory_raises":
        raise RuntimeError("cannot reach the data server")
    return Hostile(fail, lr)
'''


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    (tmp_path / "hostile_wl.py").write_text(textwrap.dedent(WORKLOAD), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("AUTOPREC_DEBUG", raising=False)
    return tmp_path


def profile(tmp_path, capsys, *extra, fail="", lr=None):
    kwargs = {"fail": fail} if lr is None else {"fail": fail, "lr": lr}
    out = tmp_path / "profile.json"
    status = main(["profile", "--workload", "hostile_wl:make", "--workload-kwargs", json.dumps(kwargs),
                   "--steps", "3", "--every", "1", "--device", "cpu", "--out", str(out), *extra])
    return status, capsys.readouterr().err, out


def first_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("autoprec: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("fail, says", [
    ("factory_raises", "the workload factory hostile_wl:make raised RuntimeError: cannot reach the data server"),
    ("build_raises", "Hostile.build_model(0) raised RuntimeError: no weights file"),
    ("train_raises", "Hostile.train_batches(0) raised OSError: dataset not found"),
    ("train_batch_raises", "Hostile.train_batches(0) raised KeyError: 'label' at batch 1"),
    ("loss_raises", "Hostile.loss(model, batch) raised ValueError: labels out of range"),
    ("shape", "Hostile.loss(model, batch) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("optimizer_raises", "Hostile.make_optimizer(model) raised TypeError: bad betas"),
])
def test_a_hook_that_raises_is_one_line_naming_it_then_only_the_users_frames(hostile, capsys, fail, says):
    status, err, out = profile(hostile, capsys, fail=fail)
    assert status == 1 and not out.exists()
    assert says in first_line(err)
    assert "Traceback" not in err and "autoprec/" not in err.replace("autoprec: error", "")
    assert "hostile_wl.py" in err  # the user's own frames are shown
    assert "--debug" in err


def test_the_shape_error_shows_the_forward_that_raised(hostile, capsys):
    _, err, _ = profile(hostile, capsys, fail="shape")
    frames = err[err.index("your code"):]
    assert "in loss" in frames and "in forward" in frames and "torch/" not in frames


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_prints_the_full_traceback(hostile, capsys, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("AUTOPREC_DEBUG", "1")  # read at call time, not import time
    _, err, _ = profile(hostile, capsys, *(["--debug"] if how == "flag" else []), fail="build_raises")
    assert "Traceback" in err and "autoprec/workload.py" in err
    assert "Hostile.build_model(0) raised RuntimeError" in first_line(err)


@pytest.mark.parametrize("fail, lr, says", [
    ("build_none", None, "Hostile.build_model(0) returned NoneType; return the torch.nn.Module to train"),
    ("train_not_iterable", None, "Hostile.train_batches(0) returned int, which is not iterable"),
    ("train_runs_out", None, "Hostile.train_batches(0) ran out after 2 batches"),
    ("val_empty", None, "Hostile.val_batches(1) returned no batches"),
    ("val_none", None, "Hostile.val_batches(1) returned NoneType"),
    ("loss_vector", None, "Hostile.loss(model, batch) returned a tensor of shape (4, 1); return a scalar"),
    ("loss_none", None, "Hostile.loss(model, batch) returned NoneType; return the loss"),
    ("loss_int", None, "Hostile.loss(model, batch) returned a torch.int64 tensor"),
    ("optimizer_nan", None, "Hostile.make_optimizer: the optimizer's learning rate is nan"),
])
def test_a_hook_that_returns_what_it_must_not_is_named_with_the_fix(hostile, capsys, fail, lr, says):
    status, err, out = profile(hostile, capsys, fail=fail, lr=lr)
    assert status == 1 and not out.exists()
    assert says in first_line(err)
    assert "Traceback" not in err


def test_an_optimizer_holding_none_of_the_models_parameters_is_refused_naming_the_hook(hostile, capsys):
    status, err, out = profile(hostile, capsys, fail="optimizer_other_model")
    assert status == 1 and not out.exists()
    assert "Hostile.make_optimizer(model): the optimizer holds none of Net's 4 trainable parameters" in first_line(err)
    assert "Traceback" not in err


def test_an_optimizer_holding_part_of_the_model_warns_once_with_the_count(hostile, caplog):
    import hostile_wl

    workload = check_workload(hostile_wl.Hostile("optimizer_part"), "test")
    with caplog.at_level("WARNING", logger="autoprec.workload"):
        profile_workload(workload, 2, device="cpu")
        profile_workload(workload, 2, device="cpu")  # a second model of the same workload: no second warning
    warnings = [r.getMessage() for r in caplog.records if "make_optimizer" in r.getMessage()]
    assert len(warnings) == 1 and "does not hold 2 of Net's 4 trainable parameters" in warnings[0]


def test_a_frozen_layer_left_out_of_the_optimizer_is_not_counted(hostile, caplog):
    import hostile_wl

    workload = check_workload(hostile_wl.Hostile("optimizer_frozen"), "test")
    with caplog.at_level("WARNING", logger="autoprec.workload"):
        profile_workload(workload, 2, device="cpu")
    assert "make_optimizer" not in caplog.text


@pytest.mark.parametrize("lr", ["nan", "inf", "zero", "str"])
def test_a_workload_lr_that_is_not_a_positive_finite_number_is_refused(hostile, lr):
    with pytest.raises(WorkloadError, match="lr must be a positive finite number"):
        load_workload("hostile_wl:make", {"lr": lr})


def test_a_nan_held_out_batch_is_named_by_index(hostile):
    workload = load_workload("hostile_wl:make", {"fail": "val_nan"})
    with pytest.raises(WorkloadError, match=r"held-out batch 2 holds NaN"):
        workload.val_batches(3)


def test_an_inf_held_out_batch_is_named_by_index(hostile):
    workload = load_workload("hostile_wl:make", {"fail": "val_inf"})
    with pytest.raises(WorkloadError, match=r"held-out batch 0 holds inf"):
        workload.val_batches(1)


def test_the_library_call_names_the_hook_and_keeps_the_original_as_cause(hostile):
    import hostile_wl

    with pytest.raises(UserCodeError, match=r"Hostile\.build_model\(0\) raised") as info:
        profile_workload(hostile_wl.Hostile("build_raises"), 2, device="cpu")
    assert info.value.hook == "build_model" and isinstance(info.value.__cause__, RuntimeError)


def test_a_checked_workload_keeps_the_users_attributes(hostile):
    import hostile_wl

    raw = hostile_wl.Hostile()
    raw.name = "mine"
    checked = check_workload(raw, "test")
    assert checked.name == "mine" and checked.lr == 1e-3 and check_workload(checked, "again") is checked


def test_a_well_behaved_workload_still_profiles(hostile, capsys):
    status, err, out = profile(hostile, capsys)
    assert status == 0, err
    assert math.isfinite(json.loads(out.read_text())["metadata"]["loss_last"])


# -- non-finite data -------------------------------------------------------------------------------


def test_a_nan_training_batch_while_profiling_stops_naming_the_step_and_writes_nothing(hostile, capsys):
    status, err, out = profile(hostile, capsys, fail="train_nan")
    assert status == 1 and not out.exists()
    line = first_line(err)
    assert "profiling: training step 2 of 3 (training batch 1) gave a non-finite loss (nan)" in line
    assert "Traceback" not in err


def search_job(tmp_path, fail):
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f'''
        [job]
        name = "nan"
        out = "out"
        device = "cpu"
        [workload]
        factory = "hostile_wl:make"
        kwargs = {{ fail = "{fail}" }}
        [budgets]
        memory = 0.9
        accuracy = 0.05
        [search]
        formats = ["fp32", "bf16"]
        measure_top = 2
        [profile]
        steps = 3
        sensitivity_batches = 1
        [measure]
        val_batches = 2
        steps = 2
    '''), encoding="utf-8")
    return job


def test_a_nan_training_batch_in_the_search_job_stops_before_writing_a_profile(hostile, capsys):
    job = search_job(hostile, "train_nan")
    assert main(["search", str(job)]) == 1
    err = capsys.readouterr().err
    assert "training step 2 of 3 (training batch 1) gave a non-finite loss" in first_line(err)
    assert (hostile / "out").is_dir() and not (hostile / "out" / "profile.json").exists()


def test_the_search_job_refuses_an_optimizer_holding_none_of_the_models_parameters(hostile, capsys):
    assert main(["search", str(search_job(hostile, "optimizer_other_model"))]) == 1
    err = capsys.readouterr().err
    assert "Hostile.make_optimizer(model): the optimizer holds none of Net's 4 trainable parameters" in first_line(err)
    assert "Traceback" not in err and not (hostile / "out" / "profile.json").exists()
