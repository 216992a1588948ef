"""The Workload protocol and its one training step (autoprec/workload.py), against plain PyTorch."""

import copy
import sys
import types

import pytest
import torch
from torch import nn

from autoprec.search.candidate_runs import MeasuredStage
from autoprec.workload import TrainStep, Workload, WorkloadError, check_workload, learning_rate, load_workload, to_device


class Regression:
    """A minimal workload: a linear model on fixed random data, optionally with its own optimizer."""

    def __init__(self, optimizer=None, max_grad_norm=None, lr=None):
        self._optimizer = optimizer
        if max_grad_norm is not None:
            self.max_grad_norm = max_grad_norm
        if lr is not None:
            self.lr = lr

    def build_model(self, seed=0):
        torch.manual_seed(seed)
        return nn.Linear(4, 3)

    def train_batches(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield {"x": torch.randn(8, 4, generator=g) * 10, "y": torch.randn(8, 3, generator=g)}

    def val_batches(self, n=2):
        batches = self.train_batches(99)
        return [next(batches) for _ in range(n)]

    def loss(self, model, batch):
        return (model(batch["x"]) - batch["y"]).pow(2).mean()

    def __getattr__(self, name):
        if name == "make_optimizer" and self.__dict__.get("_optimizer") is not None:
            return self._optimizer
        raise AttributeError(name)


def _reference_step(model, batch, optimizer, max_grad_norm=None):
    optimizer.zero_grad()
    (model(batch["x"]) - batch["y"]).pow(2).mean().backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def test_a_step_uses_the_workloads_optimizer_schedule_and_clipping():
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)

    wl = Regression(optimizer=make, max_grad_norm=0.01)
    model, reference = wl.build_model(), wl.build_model()
    step = TrainStep.for_workload(wl, model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    batches = wl.train_batches()
    for i in range(3):
        batch = next(batches)
        step(batch)
        _reference_step(reference, batch, ref_opt, max_grad_norm=0.01)
        for group in ref_opt.param_groups:
            group["lr"] *= 0.1  # StepLR(gamma=0.1), by hand
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert step.lr == 0.5  # the base rate, not the decayed one
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)


def test_without_an_optimizer_factory_a_step_is_adamw_at_the_workloads_lr():
    wl = Regression(lr=0.03)
    model, reference = wl.build_model(), wl.build_model()
    step = TrainStep.for_workload(wl, model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.03)
    batch = next(wl.train_batches())
    loss = step(batch)
    _reference_step(reference, batch, ref_opt)
    assert not loss.requires_grad
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert learning_rate(step.optimizer) == 0.03


def test_the_context_wraps_forward_only():
    entered = []

    class Probe:
        def __enter__(self):
            entered.append(torch.is_grad_enabled())

        def __exit__(self, *exc):
            return False

    wl = Regression()
    step = TrainStep.for_workload(wl, wl.build_model(), context=Probe)
    step(next(wl.train_batches()), after_backward=lambda: entered.append("backward done"))
    assert entered == [True, "backward done"]


def test_a_factory_returning_no_optimizer_is_refused_in_one_line():
    wl = Regression(optimizer=lambda model: "adam")
    with pytest.raises(WorkloadError, match="make_optimizer returned str; return a torch.optim.Optimizer"):
        TrainStep.for_workload(wl, wl.build_model())


def test_check_workload_names_what_is_missing_and_bad_clipping():
    assert isinstance(Regression(), Workload)
    with pytest.raises(WorkloadError, match="without val_batches, loss"):
        check_workload(types.SimpleNamespace(build_model=int, train_batches=int), "f")
    with pytest.raises(WorkloadError, match="max_grad_norm must be a positive number"):
        check_workload(Regression(max_grad_norm=-1.0), "f")


def test_load_workload_imports_calls_and_checks(monkeypatch):
    module = types.ModuleType("my_workloads_for_test")
    module.make = lambda lr=0.1: Regression(lr=lr)
    module.not_one = lambda: object()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert load_workload("my_workloads_for_test:make", {"lr": 0.2}).lr == 0.2
    for spec, kwargs, message in [
        ("my_workloads_for_test", None, 'expected "module:function"'),
        ("my_workloads_for_test:absent", None, "has no callable 'absent'"),
        ("no_such_module_for_test:make", None, "cannot import module 'no_such_module_for_test'"),
        ("my_workloads_for_test:make", {"rate": 1}, "rejected {'rate': 1}: .*unexpected keyword"),
        ("my_workloads_for_test:not_one", None, "returned a object without build_model"),
    ]:
        with pytest.raises(WorkloadError, match=message):
            load_workload(spec, kwargs)


def test_to_device_moves_nested_batches_and_keeps_their_types():
    batch = {"ids": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list) and moved["n"] == 3


def test_the_measured_stage_times_the_workloads_own_step():
    """The measured stage's timed steps train with the step it is given (the job passes the
    workload's), not a fixed optimizer: the optimizer factory runs for each variant it times."""
    made = []

    def make(model):
        made.append(model)
        return torch.optim.SGD(model.parameters(), lr=0.01)

    wl = Regression(optimizer=make, max_grad_norm=1.0)
    model = wl.build_model()
    before = copy.deepcopy(model.state_dict())
    batches = wl.train_batches()
    train = [next(batches) for _ in range(2)]
    stage = MeasuredStage(model, wl.loss, train, wl.val_batches(), train_step=lambda m: TrainStep.for_workload(wl, m), steps=1, warmup=0)
    assert stage.fp32_seconds > 0
    # Two copies (the stage's FP32 reference and the variant timed against it), the model untouched.
    assert len(made) == 2 and all(m is not model for m in made)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
