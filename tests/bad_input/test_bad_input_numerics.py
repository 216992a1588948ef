"""Numerics the scheduler must not misread (issue 25): a window with skipped steps is never
quiet, `LossScaling(min_scale=...)` holds or the log says why scaling is off, and a failed first
search (one NaN batch) is retried at a later window with a doubling wait. A NaN input batch
skips its step under a plan of every format, INT8 included (issue 40)."""

import logging

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.formats import Format
from autoprec.scheduler.policy import PolicyState, demotions


def test_a_window_with_skipped_steps_demotes_nothing_and_restarts_the_quiet_count():
    state = PolicyState(history={"a": ("fp8_e4m3",)}, stable={"a": 1}, wait={})
    changes, after = demotions([], state, 10, 2, {"a": Format.BF16}, skipped_steps=3)
    assert changes == [] and after.stable["a"] == 0


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def train(scheduler, net, steps, bad=lambda i: False):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for i in range(steps):
        x = torch.randn(4, 8)
        if bad(i):
            x[0, 0] = float("nan")
        with scheduler.precision_context():
            loss = net(x).square().mean()
        scheduler.backward(loss)
        scheduler.step(optimizer)
        optimizer.zero_grad()


def test_one_nan_batch_at_the_end_of_the_first_window_does_not_disable_planning():
    net = model()
    # search_slice=None: the off-path work (where the NaN batch fails the sensitivity) runs in
    # the window's last step, so the failure and the retry fall on known steps.
    scheduler = ap.DynamicPrecisionScheduler(net, monitor_window=4, search_slice=None)
    train(scheduler, net, 4, bad=lambda i: i == 3)
    assert scheduler.phase == "safe"
    train(scheduler, net, 4 + 4)  # one window's wait, then a fresh window profiled and searched
    assert scheduler.phase == "searching"  # its probe and trial steps
    steps = 0
    while scheduler.phase == "searching" and steps < 100:
        train(scheduler, net, 1)
        steps += 1
    assert scheduler.phase == "planned" and scheduler.last_search_error is None


def test_a_nan_batch_fails_a_spread_search_on_a_later_step_and_it_is_retried():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net, monitor_window=4)  # the default: spread over steps
    train(scheduler, net, 4, bad=lambda i: i == 3)
    steps = 0
    while scheduler.phase == "searching" and steps < 100:
        train(scheduler, net, 1)
        steps += 1
    assert steps >= 1 and scheduler.phase == "safe" and "non-finite" in scheduler.last_search_error
    assert scheduler.state_dict()["retry_at"] == scheduler.step_count + 4  # one window after the step it failed in


def test_a_search_that_keeps_failing_waits_twice_as_long_each_time():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net, monitor_window=2, search_slice=None)
    train(scheduler, net, 2 + 2 + 2, bad=lambda i: True)  # fails at 2, waits 1 window, profiles 4..6, fails
    assert scheduler.phase == "safe" and scheduler.state_dict()["retry_at"] == 6 + 2 * 2


def test_scaling_off_under_a_bf16_plan_is_explained_in_the_skip_warning(caplog):
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net, loss_scaling=ap.LossScaling(min_scale=8.0), monitor_window=100)
    with caplog.at_level(logging.WARNING, logger="autoprec.scheduler"):
        train(scheduler, net, 10, bad=lambda i: True)
    assert scheduler.scaler.get_scale() == 1.0
    assert "loss scaling is off: no FP16 layer runs" in caplog.text and "min_scale=8 applies once an FP16 layer runs" in caplog.text


def test_min_scale_holds_under_an_fp16_plan_with_an_inf_every_step():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler.from_plan(net, ap.Plan.uniform(net, "fp16"), loss_scaling=ap.LossScaling(min_scale=8.0))
    train(scheduler, net, 50, bad=lambda i: True)
    assert scheduler.scaler.enabled and scheduler.scaler.get_scale() >= 8.0


def test_a_state_saved_without_the_retry_fields_still_loads():
    net = model()
    scheduler = ap.DynamicPrecisionScheduler(net, monitor_window=4)
    train(scheduler, net, 2)
    state = {k: v for k, v in scheduler.state_dict().items() if k not in ("window_skipped", "search_failures", "retry_at")}
    resumed = ap.DynamicPrecisionScheduler(model(), monitor_window=4)
    resumed.load_state_dict(state)
    assert resumed.step_count == 2


# -- a NaN input under every format's plan (issue 40) ----------------------------------------------


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def steps_under(fmt, nan_at, steps=8, **plan_kwargs):
    """(stepped?, layers named, weights unchanged?) per step of a fixed ``fmt`` plan, a NaN in the
    input batch at ``nan_at``."""
    net = wide_model()
    scheduler = ap.DynamicPrecisionScheduler.from_plan(net, ap.Plan.uniform(net, fmt, **plan_kwargs))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    out = []
    for i in range(steps):
        x = torch.randn(4, 8)
        if i == nan_at:
            x[1, 3] = float("nan")
        before = [p.detach().clone() for p in net.parameters()]
        with scheduler.precision_context():
            loss = net(x).square().mean()
        scheduler.backward(loss)
        stepped = scheduler.step(optimizer)
        optimizer.zero_grad()
        unchanged = all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        out.append((stepped, scheduler.scaler.last_nonfinite_layers, unchanged))
    return out


# INT8 calibrates on its first 4 forwards (Calibration.batches), then runs on a frozen scale: the
# NaN at step 6 meets the frozen scale, whose INT8 codes cannot hold it.
@pytest.mark.parametrize("fmt, plan_kwargs", [
    ("int8", {}), ("int8", {"scaling": ap.Scaling(granularity="row")}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("fp16", {}), ("bf16", {}),
], ids=["int8", "int8-row", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16"])
def test_a_nan_input_under_a_plan_skips_the_step_names_the_layers_and_leaves_the_weights(fmt, plan_kwargs):
    runs = steps_under(fmt, nan_at=6, **plan_kwargs)
    stepped, layers, unchanged = runs[6]
    assert not stepped and unchanged and layers == ("0", "2")
    assert all(s for i, (s, _, _) in enumerate(runs) if i != 6)


def test_a_nan_input_while_int8_calibrates_skips_that_step_only():
    runs = steps_under("int8", nan_at=1, steps=10)
    stepped, layers, unchanged = runs[1]
    assert not stepped and unchanged and layers == ("0", "2")
    # The calibration frozen at step 3 counted the NaN batch as not seen: later steps train.
    assert all(s for i, (s, _, _) in enumerate(runs) if i != 1)
