"""The planned steps' checks (`autoprec.scheduler.plan_checks`), end to end through the README
loop: a gross drift past a frozen INT8 calibration or a delayed FP8 scale is acted on within
``sample_every`` steps, with one line naming the layer; the accuracy budget is measured against
the window's precision on the same batches, and layers are promoted while the measured increase
is over it; the figures reach the log and TensorBoard."""

import copy
import logging
import math
import warnings

import pytest
import torch
import torch.nn as nn

from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Plan, Scaling, ScalingMode
from autoprec.runtime import EmulationWarning
from autoprec.scheduler import DynamicPrecisionScheduler
from support.readme_loop import readme_step
from support.tb_events import accumulator

DRIFT_AT = 12  # the step from which the inputs are 100x what the calibration saw
EVERY = 8  # sample_every: a check step every 8 planned steps


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))


def drift_run(plan_of, steps=32):
    """The README loop on a fixed-format dynamic plan; the inputs grow 100x at `DRIFT_AT`. Per
    step, the planned output's error against the same weights in FP32."""
    model = mlp()
    x0, y = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), torch.randint(0, 8, (256,))
    plan = plan_of(Plan.uniform(model, Format.FP32, x0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=200, sample_every=EVERY)
    errors = []
    for step in range(steps):
        x = x0 * (100.0 if step >= DRIFT_AT else 1.0)
        with sch.precision_context():
            out = model(x)
        with torch.no_grad():
            ref = model(x)
        errors.append(((out.float() - ref).norm() / ref.norm()).item())
        sch.backward(nn.functional.cross_entropy(out.float(), y))
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
    sch.close()
    return sch, errors


def test_an_int8_calibration_the_inputs_outgrow_is_recalibrated_within_sample_every_steps(caplog):
    with caplog.at_level(logging.WARNING, logger="autoprec"):
        sch, errors = drift_run(lambda base: base.with_layers({f: "int8" for f in base.layers}))
    assert max(errors[:DRIFT_AT]) < 0.05  # calibrated on the first steps' inputs
    damaged = [step for step, e in enumerate(errors) if e > 0.5]
    # Every step from the drift to the next check step (step 16) runs 98 % off; none after it.
    assert damaged and damaged[0] == DRIFT_AT and len(damaged) <= EVERY and damaged == list(range(DRIFT_AT, damaged[-1] + 1))
    assert max(errors[damaged[-1] + 1:]) < 0.05
    lines = [r.getMessage() for r in caplog.records if "recalibrating" in r.getMessage()]
    assert len(lines) == 1 and "'0' (int8): input amax" in lines[0] and "x the range its scale covers" in lines[0]
    assert sch.plan.format_counts() == {"int8": 3}  # recalibrated, not promoted: once in the window


def test_a_delayed_fp8_scale_far_past_its_amax_is_named_at_the_next_check_step(caplog):
    delayed = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(mode=ScalingMode.DELAYED))
    with caplog.at_level(logging.WARNING, logger="autoprec"):
        sch, errors = drift_run(lambda base: base.with_layers({f: delayed for f in base.layers}))
    # Each layer's history takes the new amax one step after its input grew: a damaged step per
    # layer at most, then FP8's usual error; the drift is named at the next check step.
    damaged = [step for step, e in enumerate(errors) if e > 0.5]
    assert damaged[0] == DRIFT_AT and damaged == list(range(DRIFT_AT, DRIFT_AT + len(damaged))) and len(damaged) <= 3
    assert max(errors[damaged[-1] + 1:]) < 0.15
    lines = [r.getMessage() for r in caplog.records if "recalibrating" in r.getMessage()]
    assert lines and "'0' (fp8_e4m3): input amax 100x" in lines[0]
    assert sch.last_check is not None and all(r < 4 for r in sch.last_check.saturation.values())  # read and reset


def trained_vit():
    """The tiny HF ViT trained in FP32 on its one batch for a few steps: a plan's rounding then
    moves its loss by a measurable fraction (E5M2 layers: +1.2 % on torch 2.11, +3.7 % on 2.13)."""
    from support import hf_models

    torch.manual_seed(0)
    model, batch = hf_models.vit()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, batch


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """A plan of 8-bit layers (E5M2: two mantissa bits), attention products included (emulated:
    no kernel on CPU), under a tight accuracy budget and a loose one."""
    model0, batch = trained_vit()
    base = Plan.uniform(model0, Format.FP32, batch)
    plan = base.with_layers({f: "fp8_e5m2" for f in base.layers})
    runs = {}
    for budget, steps in ((2e-3, 60), (10.0, 30)):
        model = copy.deepcopy(model0)
        logs = tmp_path_factory.mktemp("checks")
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=100, sample_every=2, accuracy_budget=budget, log_dir=str(logs))
        figures = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)
            for _ in range(steps):
                readme_step(model, batch, sch, opt)
                figures.append(sch.last_check)
        sch.close()
        runs[budget] = (sch, figures, logs)
    return runs


def test_a_measured_loss_increase_over_the_budget_promotes_layers_until_within_it(checked):
    sch, figures, _ = checked[2e-3]
    promoted = [c for c in sch.changes if c.reason.startswith("measured loss increase")]
    assert promoted and all(c.new in (Format.BF16, Format.FP32) for c in promoted)
    first = next(f for f in figures if f is not None and f.over_budget)
    assert first.increase > first.allowed > 0
    # Promoted while over: the plan it ends with measured within the budget, over several checks.
    assert sch.last_check.checks >= 3 and sch.last_check.increase <= sch.last_check.allowed


def test_a_plan_within_the_budget_is_left_as_it_is_and_the_figure_is_logged(checked):
    sch, figures, logs = checked[10.0]
    assert not sch.changes and sch.plan.format_counts() == {"fp8_e5m2": len(sch.plan)}
    assert all(f is None or not f.over_budget for f in figures) and sch.last_check.checks >= 2
    measured = accumulator(logs / "train").Scalars("accuracy/measured_loss_increase")
    assert len(measured) >= 10 and all(math.isfinite(e.value) for e in measured)
    assert measured[-1].value == pytest.approx(sch.last_check.increase, rel=1e-5)


class Logits(nn.Module):
    """A classifier that returns logits: the loss is computed outside, as ``loss_fn(model(x), y)``."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.model(x).float(), y)


def test_without_the_loss_in_the_output_the_check_is_the_first_order_change_through_the_output():
    """The same plan and batch measured two ways: the model returning its loss (exact difference
    of losses) and returning logits (``<dL/dy, y_planned - y_reference>``): first order agrees."""
    x, y = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), torch.randint(0, 8, (256,))
    increases = {}
    for name in ("exact", "linearised"):
        model = Logits()
        wrapped = WithLoss(model) if name == "exact" else model
        plan = Plan.uniform(wrapped, "fp8_e5m2", (x, y) if name == "exact" else x)
        sch = DynamicPrecisionScheduler.from_plan(wrapped, plan, dynamic=True, monitor_window=50, sample_every=1, accuracy_budget=10.0)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)  # the same weights at every check
        for _ in range(3):
            with sch.precision_context():
                loss = wrapped(x, y) if name == "exact" else nn.functional.cross_entropy(model(x).float(), y)
            sch.backward(loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
        increases[name] = sch.last_check.increase
        sch.close()
    assert abs(increases["exact"]) > 1e-5  # E5M2's rounding moves the loss measurably (relative)
    assert increases["linearised"] == pytest.approx(increases["exact"], rel=0.5)
