"""Bad input, scheduler misuse (issue 25): a forward that returns None, step() with another
model's optimizer or without any gradient, and precision bounds that leave no format are each
refused with one line naming the call and what the scheduler needs. A model that is itself one
layer (a bare nn.Linear) trains like any other, its layer named by its class (issue 40)."""

import logging

import threading

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


# -- a search whose work follows the clock (issue 40) ----------------------------------------------


class FakeTime:
    """A ``time`` module whose clock advances ``rate`` seconds per read: deterministic, and as
    slow as asked (a loaded machine)."""

    def __init__(self, rate):
        self.now, self.rate = 0.0, rate

    def perf_counter(self):
        self.now += self.rate
        return self.now


def set_clocks(monkeypatch, measured, offpath):
    """``measured``: the clock probe and trial steps are timed with (their times choose the
    plan); ``offpath``: the one the search's off-path work would see itself run by."""
    import autoprec.costs.inplace
    import autoprec.scheduler.search_steps
    import autoprec.search.in_run
    import autoprec.device_clock

    for module in (autoprec.device_clock, autoprec.scheduler.search_steps, autoprec.costs.inplace):
        monkeypatch.setattr(module, "time", measured)
    monkeypatch.setattr(autoprec.search.in_run, "time", offpath)


SEARCH_WINDOW = 6
SEARCH_STEPS = 96  # the window, 6 probe steps, then the off-path work (device peaks, blocks' bytes, the upstream term's forwards too), the solve's 8 steps, 2 candidates' trial steps, planned steps


def formats(plan):
    return {fqn: lp.format for fqn, lp in plan.layers.items()}


def lm_run():
    from autoprec.workloads import default_workload

    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    return wl, model, torch.optim.SGD(model.parameters(), lr=0.05), wl.train_batches(0)


def searching_scheduler(model=None):
    return ap.DynamicPrecisionScheduler(model, monitor_window=SEARCH_WINDOW, monitor_steps=3, memory_budget=0.85, accuracy_budget=0.05,
                                        formats=("fp32", "bf16", "int8"))


def lm_steps(wl, model, opt, scheduler, sampler, steps):
    for _ in range(steps):
        batch = sampler.next()
        with scheduler.precision_context():
            loss = wl.loss(model, batch)
        scheduler.backward(loss)
        scheduler.step(opt)
        opt.zero_grad(set_to_none=True)


def straight_run(monkeypatch, offpath_rate):
    set_clocks(monkeypatch, FakeTime(1e-3), FakeTime(offpath_rate))
    wl, model, opt, sampler = lm_run()
    scheduler = searching_scheduler()
    lm_steps(wl, model, opt, scheduler, sampler, SEARCH_STEPS)
    assert scheduler.phase == "planned" and scheduler.plan.measured["source"] == "training steps"
    return [p.detach().clone() for p in model.parameters()], scheduler.plan


def test_the_search_trains_alike_however_slowly_its_off_path_work_runs(monkeypatch):
    fast, fast_plan = straight_run(monkeypatch, 1e-9)  # every unit of work looks instant
    slow, slow_plan = straight_run(monkeypatch, 10.0)  # every unit looks longer than a step
    assert formats(fast_plan) == formats(slow_plan)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


# Where the checkpoint falls: between the window's summary and the search it makes at the next
# step, in the probes' warm-up cycle (the off-path work waits for them), in their
# timed cycle, between two parts of a region-bytes forward (`search.paced`: the resumed search
# runs the units done again, at once, and the forward's next parts after the same steps), while
# the integer programs run beside the steps (search steps 63-70), and in a candidate's trial
# steps (71 on). A slower clock for every timing after the resume
# where the checkpoint splits no set of timed steps; where it splits the probes' timed cycle, a
# slower clock for the off-path work alone (probes timed slower on a slower machine may choose
# another plan: a measurement, not the slices).
def stage_of(search):
    if search is None:
        return "due"
    if search.candidates is not None:
        return "trying"
    if search._solve_from is not None:
        return "solving"
    return "probing" if search.steps <= search.probe_steps else "off-path"


@pytest.mark.parametrize("stop, every_clock, stage", [(SEARCH_WINDOW, True, "due"), (SEARCH_WINDOW + 1, True, "probing"),
                                                      (SEARCH_WINDOW + 4, False, "probing"), (SEARCH_WINDOW + 19, True, "off-path"),
                                                      (SEARCH_WINDOW + 65, True, "solving"), (SEARCH_WINDOW + 73, True, "trying")],
                         ids=["search-due", "probes-warm-up", "second-probe-cycle", "between-forward-parts", "solving", "trying-candidates"])
def test_a_checkpoint_mid_search_resumed_on_a_slow_clock_trains_bit_identically(monkeypatch, tmp_path, stop, every_clock, stage):
    reference, plan = straight_run(monkeypatch, 1e-3)
    set_clocks(monkeypatch, FakeTime(1e-3), FakeTime(1e-3))
    wl, model, opt, sampler = lm_run()
    scheduler = searching_scheduler()
    lm_steps(wl, model, opt, scheduler, sampler, stop)
    assert scheduler.phase == "searching" and stage_of(scheduler._searches.search) == stage
    assert (stage == "off-path") == any(t.name == "autoprec-paced" for t in threading.enumerate())  # a forward stopped between parts
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": scheduler.state_dict()}, tmp_path / "ckpt.pt")
    scheduler.close()

    set_clocks(monkeypatch, FakeTime(7e-3 if every_clock else 1e-3), FakeTime(7e-3))  # after the resume, 7x slower
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    _, model, opt, _ = lm_run()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    scheduler = searching_scheduler(model)
    scheduler.load_state_dict(saved["scheduler"])
    lm_steps(wl, model, opt, scheduler, sampler, SEARCH_STEPS - stop)
    assert formats(scheduler.plan) == formats(plan)  # the reasons quote the measured milliseconds, 7x as many
    assert all(torch.equal(a, b) for a, b in zip(reference, (p.detach() for p in model.parameters())))


# -- the memory reference: an all-FP32 plan is 1.0 of "the FP32 bytes" (issue 59) ------------------


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _search(**settings):
    torch.manual_seed(0)
    net = _Residual()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    sch = ap.DynamicPrecisionScheduler(net, monitor_window=4, monitor_steps=2, measure_costs=False, search_slice=None, **settings)
    for _ in range(6):
        with sch.precision_context():
            loss = (net(torch.randn(8, 16)) - 1).square().mean()
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad()
    return sch


def test_a_memory_budget_of_one_meets_the_all_fp32_plan():
    # Before: "no plan meets the budgets ... memory_budget >= 1.293", a budget the settings refuse:
    # the search's all-FP32 plan counted more bytes than the FP32 bytes a fraction is of.
    sch = _search(memory_budget=1.0, min_precision=32)
    assert sch.last_search_error is None and sch.plan is not None
    assert sch.plan.predicted["bytes"] == sch.plan.predicted["fp32_bytes"]


def test_an_all_fp32_floor_is_advised_as_a_budget_of_one():
    sch = _search(memory_budget=0.9, min_precision=32, recompute=[])
    assert "memory_budget >= 1.000 is met by formats alone" in sch.last_search_error
