"""Which model a scheduler runs (`autoprec._binding`): bound to the outermost model of its first
context however it is called, and each ambiguity refused with one line naming the fix: a second
model in one context, another model in a later context, a first context that calls no model."""

import copy
import logging
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.errors import RuntimeStateError
from autoprec.scheduler import DynamicPrecisionScheduler

WINDOW = 2


class Counted(nn.Module):
    """A two-layer MLP that counts its forward calls."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1 = nn.Linear(d, 16)
        self.fc2 = nn.Linear(16, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc2(torch.relu(self.fc1(x)))


def scheduler(**kwargs):
    settings = dict(monitor_window=WINDOW, formats=("fp32", "bf16"), measure_costs=False, search_slice=None, search_timeout_s=10)
    settings.update(kwargs)
    return DynamicPrecisionScheduler(**settings)


def train_step(sch, model, opt, x):
    with sch.precision_context():
        loss = model(x).square().mean()
    sch.backward(loss)
    sch.step(opt)
    opt.zero_grad()


# --- binding ------------------------------------------------------------------------------------


def test_binds_to_the_model_not_to_the_modules_called_beside_it():
    # A parameterless module before the model and a loss module after it are no models.
    model = Counted()
    sch = scheduler()
    with sch.precision_context():
        out = model(nn.Flatten()(torch.randn(4, 2, 4)))
        nn.MSELoss()(out, torch.zeros(4, 8))
    assert sch.model is model and sch.layers == ("fc1", "fc2")


def test_the_first_call_runs_unplanned_and_the_log_says_so(caplog):
    model = Counted()
    sch = scheduler(max_precision=16)  # the safe precision is BF16: the first forward misses it
    with caplog.at_level(logging.INFO, logger="autoprec.scheduler"), sch.precision_context():
        first = model(torch.randn(4, 8))
        second = model(torch.randn(4, 8))
    assert (first.dtype, second.dtype) == (torch.float32, torch.bfloat16)
    assert "that forward ran at FP32 and unprofiled" in caplog.text


def test_a_one_step_window_plans_from_the_first_call():
    # With monitor_window=1 the search needs the first call's output gradient, taken at binding.
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sch = scheduler(monitor_window=1)
    train_step(sch, model, opt, torch.randn(16, 8))
    assert sch.last_search_error is None and sch.phase == "planned"


def test_another_threads_model_is_neither_bound_nor_refused():
    model, other = Counted(), Counted()
    sch = scheduler()
    with sch.precision_context():
        worker = threading.Thread(target=other, args=(torch.randn(2, 8),))
        worker.start()
        worker.join()
        model(torch.randn(2, 8))
    assert other.calls == 1 and sch.model is model


class ConvNet(nn.Module):
    """Convolution, BatchNorm (running statistics, saved for backward), a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_binding_between_the_first_forward_and_its_backward_leaves_both_as_without_it():
    # Binding traces the model after its first forward; its backward must still run, and the
    # BatchNorm statistics must be that forward's alone.
    torch.manual_seed(0)
    model = ConvNet()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    sch = scheduler()
    with sch.precision_context():
        loss = model(x).square().mean()
    sch.backward(loss)
    reference(x).square().mean().backward()
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert torch.equal(model.conv.weight.grad, reference.conv.weight.grad)


# --- refusals -----------------------------------------------------------------------------------


def test_a_second_model_in_the_first_context_is_refused_before_it_runs():
    model, other = Counted(), Counted()
    sch = scheduler()
    with sch.precision_context():
        model(torch.randn(2, 8))
        with pytest.raises(RuntimeStateError, match="Counted and then Counted were called in one context; a scheduler plans one model"):
            other(torch.randn(2, 8))
    assert other.calls == 0 and sch.model is model


def test_a_second_model_under_the_plan_is_refused_before_it_runs():
    torch.manual_seed(0)
    model, other = Counted(), Counted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sch = scheduler()
    for _ in range(WINDOW):
        train_step(sch, model, opt, torch.randn(16, 8))
    assert sch.phase == "planned"
    with sch.precision_context():
        model(torch.randn(2, 8))
        with pytest.raises(RuntimeStateError, match="call Counted outside the context or give it a scheduler of its own"):
            other(torch.randn(2, 8))
    assert other.calls == 0


def test_a_model_that_changes_between_steps_is_refused():
    model, other = Counted(), Counted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sch = scheduler()
    train_step(sch, model, opt, torch.randn(4, 8))
    with sch.precision_context():
        with pytest.raises(RuntimeStateError, match="bound in its first context.*make a new DynamicPrecisionScheduler"):
            other(torch.randn(2, 8))


def test_another_model_than_the_one_given_is_refused():
    model, other = Counted(), Counted()
    sch = scheduler(model=model)
    with sch.precision_context():
        with pytest.raises(RuntimeStateError, match="made with model=Counted"):
            other(torch.randn(2, 8))
        model(torch.randn(2, 8))
    assert other.calls == 0 and sch.model is model


def test_a_first_context_that_calls_no_model_is_refused_on_exit():
    weight = nn.Parameter(torch.randn(8, 4))
    sch = scheduler()
    with pytest.raises(RuntimeStateError, match="no model was called inside it.*or pass DynamicPrecisionScheduler\\(model=...\\)"):
        with sch.precision_context():
            F.linear(torch.randn(2, 8), weight.t())  # a function of weights: no module runs
    assert sch.phase == "unbound"


def test_a_model_run_through_forward_is_refused_with_the_fix():
    # model.forward(x) skips the model's own call: its parts are seen as separate models.
    model = nn.Sequential(Counted(), nn.ReLU(), Counted())
    sch = scheduler()
    with sch.precision_context():
        with pytest.raises(RuntimeStateError, match=r"call that model itself, model\(\.\.\.\), not model\.forward\(\.\.\.\)"):
            model.forward(torch.randn(2, 8))
