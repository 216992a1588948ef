"""Bad input, scheduler misuse (issue 25): a forward that returns None, step() with another
model's optimizer or without any gradient, and precision bounds that leave no format are each
refused with one line naming the call and what the scheduler needs. A model that is itself one
layer (a bare nn.Linear) trains like any other, its layer named by its class (issue 40)."""

import logging

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


# -- a model that is itself one layer (issue 40) ---------------------------------------------------


def train_steps(scheduler, net, steps, nan_at=()):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(4, 8)
        if i in nan_at:
            x[0, 0] = float("nan")
        with scheduler.precision_context():
            loss = net(x).square().mean()
        scheduler.backward(loss)
        scheduler.step(optimizer)
        optimizer.zero_grad()


@pytest.mark.parametrize("bound", [True, False], ids=["model=", "bound-at-first-call"])
def test_a_one_layer_model_is_profiled_searched_and_planned(bound):
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    before = net.weight.detach().clone()
    scheduler = ap.DynamicPrecisionScheduler(net if bound else None, monitor_window=4)
    train_steps(scheduler, net, 4)
    steps = 0
    while scheduler.phase == "searching" and steps < 100:
        train_steps(scheduler, net, 1)
        steps += 1
    assert scheduler.phase == "planned" and scheduler.last_search_error is None
    assert list(scheduler.plan.layers) == [""] and scheduler.plan.layer_name("") == "Linear"  # the plan keys the root by its fqn
    assert torch.isfinite(net.weight).all() and not torch.equal(net.weight, before)


def test_a_one_layer_model_under_a_fixed_plan_trains_as_the_same_layer_inside_a_container():
    torch.manual_seed(0)
    bare = nn.Linear(8, 4)
    wrapped = nn.Sequential(nn.Linear(8, 4))
    wrapped.load_state_dict({f"0.{k}": v for k, v in bare.state_dict().items()})
    for net in (bare, wrapped):
        train_steps(ap.DynamicPrecisionScheduler.from_plan(net, ap.Plan.uniform(net, "bf16")), net, 5)
    assert torch.equal(bare.weight, wrapped[0].weight) and torch.equal(bare.bias, wrapped[0].bias)


def test_a_one_layer_models_skipped_steps_name_the_layer_by_its_class(caplog):
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    scheduler = ap.DynamicPrecisionScheduler.from_plan(net, ap.Plan.uniform(net, "bf16"))
    with caplog.at_level(logging.INFO):
        train_steps(scheduler, net, 10, nan_at=range(10))
    assert scheduler.scaler.last_nonfinite_layers == ("",)  # data: the fqn, as plan.layers keys it
    assert "non-finite gradients in Linear" in caplog.text  # shown: by the class
    assert "in ;" not in caplog.text and "in  " not in caplog.text


def test_a_one_layer_model_is_named_by_its_class_in_errors_warnings_and_review():
    from autoprec.monitoring.plans import plan_layers_markdown
    from autoprec.runtime import EmulationWarning

    net = nn.Linear(8, 4)
    plan = ap.Plan.uniform(net, "fp8_e4m3", scaling=ap.Scaling(granularity="block"))
    with pytest.raises(ap.PlanError, match="'Linear': block scaling has no kernel"):
        plan.validate(net, allow_emulation=False)
    with pytest.warns(EmulationWarning, match="layer 'Linear' runs linear in fp8_e4m3 emulated"), ap.apply_plan(net, plan), torch.no_grad():
        net(torch.randn(2, 8))
    assert "| `Linear` |" in plan_layers_markdown(plan)


def test_a_one_layer_models_profile_table_names_the_layer_by_its_class():
    from autoprec.profiling import LayerProfiler

    net = nn.Linear(8, 4)
    profiler = LayerProfiler(net, (torch.randn(4, 8),), window=2)
    with profiler:
        for _ in range(2):
            net(torch.randn(4, 8)).sum().backward()
            profiler.step()
    profile = profiler.profile({})
    assert list(profile.layers) == [""] and profile.format_table().splitlines()[2].startswith("Linear ")
