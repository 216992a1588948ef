"""Bad input, scheduler misuse (issue 25): a forward that returns None, step() with another
model's optimizer or without any gradient, and precision bounds that leave no format are each
refused with one line naming the call and what the scheduler needs."""

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.errors import ModelCallError, RuntimeStateError, SettingsError


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        self.fc(x)


@pytest.mark.parametrize("bound", [True, False], ids=["model=", "bound-at-first-call"])
def test_a_forward_returning_none_says_the_scheduler_needs_the_prediction(bound):
    net = ReturnsNone()
    scheduler = ap.DynamicPrecisionScheduler(net if bound else None)
    with pytest.raises(ModelCallError, match=r"ReturnsNone's forward returned NoneType .*return the output") as info:
        with scheduler.precision_context():
            net(torch.randn(4, 8))
    assert "\n" not in str(info.value)


def test_a_fixed_plan_runs_a_forward_returning_none():
    net = ReturnsNone()
    scheduler = ap.DynamicPrecisionScheduler.from_plan(net, ap.Plan.uniform(net, "bf16"))
    with scheduler.precision_context():
        assert net(torch.randn(4, 8)) is None


def forward_and(scheduler, net, backward=True):
    with scheduler.precision_context():
        loss = net(torch.randn(4, 8)).square().mean()
    if backward:
        scheduler.backward(loss)
    else:
        scheduler.scale(loss)


def test_step_with_another_models_optimizer_is_refused_naming_it():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net)
    forward_and(scheduler, net)
    with pytest.raises(RuntimeStateError, match=r"^step\(SGD, optimizer #1\): the optimizer holds none of Sequential's parameters"):
        scheduler.step(torch.optim.SGD(model().parameters(), lr=0.1))


def test_step_with_the_right_optimizer_second_is_refused_naming_the_wrong_one():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net)
    forward_and(scheduler, net)
    with pytest.raises(RuntimeStateError, match=r"^step\(Adam, optimizer #2\): the optimizer holds none"):
        scheduler.step(torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.Adam(nn.Linear(2, 2).parameters()))


def test_step_without_any_gradient_is_refused():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net)
    forward_and(scheduler, net, backward=False)
    with pytest.raises(RuntimeStateError, match=r"^step\(SGD, optimizer #1\): no parameter has a gradient; call scheduler.backward\(loss\)"):
        scheduler.step(torch.optim.SGD(net.parameters(), lr=0.1))


def test_step_with_an_optimizer_over_part_of_the_model_steps():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net)
    forward_and(scheduler, net)
    assert scheduler.step(torch.optim.SGD(net[0].parameters(), lr=0.1)) is True


def test_bounds_that_leave_no_format_blame_the_bounds():
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(min_precision=16, max_precision=32\): no format in formats \(fp8_e4m3, fp8_e5m2\)"):
        ap.DynamicPrecisionScheduler(model(), min_precision=16, formats=["fp8_e4m3", "fp8_e5m2"])
