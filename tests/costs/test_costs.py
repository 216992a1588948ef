"""The cost model: bytes per (layer, format) against what autograd really saves, measured times
and their disk cache, the roofline fallback, plan totals, errors, and (slow) the ranking check."""

import dataclasses
import json
import math
import statistics
import time
import warnings

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.costs import (
    PEAKS,
    CostModel,
    MeasuredTimeModel,
    RooflineTimeModel,
    TimeEstimate,
    TimeModel,
    TimingSettings,
    layer_memory,
    saved_bytes_by_layer,
    trace_model,
)
from autoprec.bench import check_uniform_ranking
from autoprec.costs import product_times as timing
from autoprec.errors import CostModelError, FormatError
from autoprec.formats import Format, Granularity
from autoprec.saved_bytes import SavedTensorMeter
from autoprec.plan import LayerPrecision, Plan, Scaling, ScalingMode
from autoprec.workloads import default_workload
from support.models import TransposedProjection
from support.models import ViewWeight

ALL = [f.value for f in Format]
ROW = Scaling(granularity=Granularity.ROW, mode=ScalingMode.CURRENT)
# (format, scaling) cases: every format with its default scaling, FP8 / INT8 with row scales too.
PRECISIONS = [LayerPrecision(f) for f in ALL] + [LayerPrecision("fp8_e4m3", scaling=ROW), LayerPrecision("int8", scaling=ROW),
                                                  LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="block")),
                                                  LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="mx"))]


def _id(lp):
    granularity = lp.scaling.granularity
    return lp.format.value + ("" if granularity is Granularity.TENSOR else f"-{granularity.value}")


class Mixer(nn.Module):
    """Matrix products beyond linear: an einsum (no FP8/INT8 kernel: emulated), a bmm of two
    activations, and an mv that CPU autocast leaves in FP32 (on the FP32 input: the runtime
    cannot run mv on a half tensor and an FP32 one)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.m = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x):
        h = torch.einsum("bi,oi->bo", x, self.w)
        g = torch.bmm(h.unsqueeze(2), h.unsqueeze(1)).mean(2)
        return g + torch.mv(self.m, x[0])


class ConstantTime(TimeModel):
    """A time model that measures nothing (keeps memory tests fast; exercises the extension point)."""

    def estimate(self, calls, formats, device):
        return {(c.key, Format.parse(f)): TimeEstimate(1e-3, "constant") for c in calls for f in formats}


# The tests' timing settings: in place as cheap as it runs (no warmup, one timed step); nothing
# timed (roofline estimates); nothing timed, with the constant time model.
QUICK = TimingSettings(warmup_steps=0, timed_steps=1)
ROOFLINE = TimingSettings(in_place=False)
CONSTANT = TimingSettings(in_place=False, time_model=ConstantTime())


@pytest.fixture
def one_thread():
    """Timing tests run on one thread: OpenMP threads sharing cores with other processes wait on
    descheduled siblings (100x slower small GEMMs measured on the 2-core CI machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm():
    wl = default_workload("tiny", batch_size=4)
    model = wl.build_model()
    batch = wl.val_batches(1)[0]
    return wl, model, batch, trace_model(model, batch, wl.loss)


def _measured(model, example, layers, plan, loss_fn=None):
    runtime = ap.apply_plan(model, plan, validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        per, _ = saved_bytes_by_layer(model, example, layers, lambda: runtime, loss_fn)
    return per


def _assert_within(predicted, measured, rel=0.05):
    for fqn in measured:
        assert abs(predicted[fqn] - measured[fqn]) <= rel * measured[fqn], (fqn, predicted[fqn], measured[fqn])


# -- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS, ids=_id)
def test_saved_bytes_per_layer_match_the_runtime_on_the_builtin_lm(lm, precision):
    wl, model, batch, trace = lm
    plan = Plan({fqn: precision for fqn in trace.layers})
    measured = _measured(model, batch, trace.layers, plan, wl.loss)
    predicted = {fqn: layer_memory(layer, precision, "cpu").saved_bytes for fqn, layer in trace.layers.items()}
    assert set(measured) == {"blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj",
                             "blocks.1.attn", "blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj", "lm_head"}
    _assert_within(predicted, measured)


@pytest.mark.parametrize("precision", PRECISIONS, ids=_id)
@pytest.mark.parametrize("input_grad", [True, False], ids=["x-grad", "x-no-grad"])
def test_saved_bytes_match_on_hand_written_projections(precision, input_grad):
    torch.manual_seed(0)
    model = nn.Sequential(TransposedProjection(64, 96), nn.GELU(), ViewWeight(96, 48), TransposedProjection(48, 32))
    x = torch.randn(40, 64, requires_grad=input_grad)
    trace = trace_model(model, x)
    assert list(trace.layers) == ["0", "2", "3"]
    measured = _measured(model, x, trace.layers, Plan({fqn: precision for fqn in trace.layers}))
    predicted = {fqn: layer_memory(layer, precision, "cpu").saved_bytes for fqn, layer in trace.layers.items()}
    _assert_within(predicted, measured)


@pytest.mark.parametrize("precision", PRECISIONS, ids=_id)
def test_saved_bytes_match_on_einsum_bmm_and_mv(precision):
    torch.manual_seed(0)
    model = nn.Sequential(Mixer(16, 24), nn.Linear(24, 8))
    x = torch.randn(10, 16, requires_grad=True)
    trace = trace_model(model, x)
    assert [c.op for c in trace.layers["0"].calls] == ["einsum", "bmm", "mv"]
    measured = _measured(model, x, trace.layers, Plan({fqn: precision for fqn in trace.layers}))
    predicted = {fqn: layer_memory(layer, precision, "cpu").saved_bytes for fqn, layer in trace.layers.items()}
    _assert_within(predicted, measured)


def test_weight_copies_are_one_fp8_transpose_or_the_half_copy_and_none_for_int8():
    torch.manual_seed(0)
    proj = TransposedProjection(64, 48)
    layer = trace_model(proj, torch.randn(32, 64, requires_grad=True)).layers[""]
    for fmt in ("int8", "fp32"):
        assert layer_memory(layer, fmt, "cpu").weight_copy_bytes == 0
    assert layer_memory(layer, "fp8_e4m3", "cpu").weight_copy_bytes == 64 * 48  # the cached FP8 transpose
    assert layer_memory(layer, "bf16", "cpu").weight_copy_bytes == 64 * 48 * 2
    assert layer_memory(layer, "fp8_e4m3", "cpu").activation_bytes == 32 * 64 + 2 * 4  # FP8 input + two FP32 scales
    assert layer_memory(layer, "fp8_e4m3", "cpu").grad_bytes == (64 * 48 + 48) * 4


def test_attribution_meter_agrees_with_the_saved_tensor_meter(lm):
    wl, model, batch, trace = lm
    with SavedTensorMeter(model.parameters()) as meter:
        loss = wl.loss(model, batch)
    del loss
    per, rest = saved_bytes_by_layer(model, batch, trace.layers, loss_fn=wl.loss)
    assert sum(per.values()) + rest == meter.total_bytes


def _meter(wl, model, batch, plan) -> int:
    """Bytes the saved-tensor meter sees in one forward of ``plan`` (the loss's included)."""
    runtime = ap.apply_plan(model, plan, validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        with SavedTensorMeter(model.parameters()) as meter, runtime:
            loss = wl.loss(model, batch)
    del loss
    return meter.total_bytes


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3", "int8"])
def test_uniform_plan_saved_bytes_match_the_whole_model(lm, fmt):
    wl, model, batch, _ = lm
    costs = CostModel.build(model, batch, loss_fn=wl.loss, formats=[fmt], timing=CONSTANT)
    plan = costs.uniform_plan(fmt)
    measured = _meter(wl, model, batch, plan)
    assert abs(costs.plan_cost(plan).saved_bytes - measured) <= 0.05 * measured


def test_fp32_bytes_is_the_all_fp32_plan_and_low_precision_plans_hold_less(lm):
    wl, model, batch, _ = lm
    costs = CostModel.build(model, batch, loss_fn=wl.loss, timing=CONSTANT)
    fp32 = costs.fp32_bytes()
    assert fp32 == costs.plan_cost(costs.uniform_plan("fp32")).bytes
    # Every gradient buffer, the embeddings' and norms' (no layer's) too: against the layers' alone
    # a budget's fraction of the FP32 bytes came out a little over it, metered with every one.
    grads = sum(p.numel() * 4 for p in model.parameters())
    outside = sum(p.numel() * 4 for fqn, m in model.named_modules() if fqn not in costs.layers for p in m.parameters(recurse=False))
    assert outside > 0 and costs.trace.rest_grad_bytes == outside
    assert costs.plan_cost(costs.uniform_plan("fp32")).bytes - costs.plan_cost(costs.uniform_plan("fp32")).saved_bytes == grads
    bf16 = costs.plan_cost(costs.uniform_plan("bf16")).bytes
    fp8 = costs.plan_cost(costs.uniform_plan("fp8_e4m3")).bytes
    assert fp8 < bf16 < fp32
    mixed = costs.uniform_plan("fp32").with_layers({"lm_head": "fp8_e4m3"})
    assert costs.plan_cost(mixed).layers["lm_head"].format is Format.FP8_E4M3


# -- measured time and its cache --------------------------------------------------------------


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), TransposedProjection(64, 32)), torch.randn(24, 32)


def _counting(monkeypatch):
    calls = []
    real = timing._time_replays

    def counted(steps, warmup, repeats):
        calls.append(len(steps))
        return real(steps, warmup, repeats)

    monkeypatch.setattr(timing, "_time_replays", counted)
    return calls


def test_measured_times_round_trip_through_the_disk_cache(tmp_path, monkeypatch, one_thread):
    counted = _counting(monkeypatch)
    model, x = _tiny_model()
    calls = [c for layer in trace_model(model, x).layers.values() for c in layer.calls]
    formats = [Format.FP32, Format.BF16, Format.INT8]
    first = MeasuredTimeModel(tmp_path, warmup=1, repeats=2).estimate(calls, formats, torch.device("cpu"))
    assert counted == [3, 3]  # two distinct calls, three formats each, interleaved
    assert all(e.source == "measured" and e.seconds > 0 for e in first.values())
    files = list(tmp_path.glob("times-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["schema_version"] == 1 and data["torch"] == torch.__version__ and len(data["entries"]) == 6

    second_model = MeasuredTimeModel(tmp_path, warmup=1, repeats=2)
    second = second_model.estimate(calls, formats, torch.device("cpu"))
    assert counted == [3, 3]  # warm cache: nothing measured
    assert second_model.measured_calls == 0
    assert {k: v.seconds for k, v in second.items()} == {k: v.seconds for k, v in first.items()}
    assert all(e.source == "cache" for e in second.values())


def test_a_warm_cache_builds_a_cost_model_without_measuring(tmp_path, monkeypatch, one_thread):
    counted = _counting(monkeypatch)
    model, x = _tiny_model()
    formats = ["fp32", "fp8_e4m3"]
    cold = CostModel.build(model, x, formats=formats, timing=dataclasses.replace(QUICK, time_model=MeasuredTimeModel(tmp_path, warmup=0, repeats=1)))
    assert len(counted) == 2
    warm = CostModel.build(model, x, formats=formats, timing=dataclasses.replace(QUICK, time_model=MeasuredTimeModel(tmp_path, warmup=0, repeats=1)))
    assert len(counted) == 2
    assert warm.layer_cost("2", "fp8_e4m3").seconds == cold.layer_cost("2", "fp8_e4m3").seconds
    assert warm.layer_cost("2", "fp8_e4m3").time_source == "cache"


def test_an_unreadable_cache_is_remeasured_and_rewritten(tmp_path, monkeypatch, one_thread):
    counted = _counting(monkeypatch)
    model, x = _tiny_model()
    calls = [c for layer in trace_model(model, x).layers.values() for c in layer.calls]
    time_model = MeasuredTimeModel(tmp_path, warmup=0, repeats=1)
    time_model.cache_path(torch.device("cpu")).write_text("{not json")
    time_model.estimate(calls, ["fp32"], torch.device("cpu"))
    assert len(counted) == 2
    assert json.loads(time_model.cache_path(torch.device("cpu")).read_text())["entries"]


def test_the_replay_runs_the_runtime_kernels():
    model, x = _tiny_model()
    call = trace_model(model, x).layers["2"].calls[0]
    for fmt, how in (("int8", "kernel torch._int_mm"), ("fp8_e4m3", "kernel torch._scaled_mm")):
        step = timing._ReplayStep(call, Format(fmt), torch.device("cpu"))
        assert step() > 0
        assert step.runtime.report()[""]["ops"] == {"addmm": how}


def test_a_call_that_cannot_run_falls_back_to_the_roofline(tmp_path, monkeypatch):
    model, x = _tiny_model()
    calls = trace_model(model, x).layers["0"].calls
    real = timing._ReplayStep

    def refusing(call, fmt, device):
        if fmt is Format.INT8:
            raise RuntimeError("no int8 kernel here")
        return real(call, fmt, device)

    monkeypatch.setattr(timing, "_ReplayStep", refusing)
    out = MeasuredTimeModel(tmp_path, warmup=0, repeats=1).estimate(calls, ["fp32", "int8"], torch.device("cpu"))
    int8 = out[(calls[0].key, Format.INT8)]
    assert int8.source.startswith("roofline") and "no int8 kernel here" in int8.source
    assert math.isfinite(int8.seconds) and int8.seconds > 0
    assert out[(calls[0].key, Format.FP32)].source == "measured"


def test_measured_times_are_the_medians_of_the_replays_timed_here(tmp_path, monkeypatch, one_thread):
    """The cost model measures, it does not assume: each format's seconds for a linear are the
    median of the times its replays took on this machine (recorded as they are returned), so
    the BF16 / FP32 ratio is the one this machine shows, whatever that is."""
    recorded = {}
    real = timing._time_replays

    def recording(steps, warmup, repeats):
        times = real(steps, warmup, repeats)
        for step, seconds in zip(steps, times):
            recorded[step.runtime.plan.layers[""].format] = list(seconds)
        return times

    monkeypatch.setattr(timing, "_time_replays", recording)
    model = nn.Linear(64, 64)
    x = torch.randn(64, 64, requires_grad=True)
    costs = CostModel.build(model, x, formats=["fp32", "bf16"], timing=dataclasses.replace(QUICK, time_model=MeasuredTimeModel(tmp_path, warmup=1, repeats=5)))
    seconds = {fmt: costs.layer_cost("", fmt).seconds for fmt in (Format.FP32, Format.BF16)}
    assert {fmt: len(times) for fmt, times in recorded.items()} == {Format.FP32: 5, Format.BF16: 5}
    assert seconds == {fmt: statistics.median(recorded[fmt]) for fmt in seconds}


# -- in place -------------------------------------------------------------------------------------


def _plain_step_seconds(wl, model, batch, plans, rounds=9):
    """Median seconds of plain training steps (no timing hooks) of each plan, interleaved."""
    import copy
    import statistics

    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtimes = {name: ap.apply_plan(model, plan, validate=False) for name, plan in plans.items()}
    times = {name: [] for name in plans}
    for r in range(rounds + 2):
        for name, runtime in runtimes.items():
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with runtime:
                loss = wl.loss(model, batch)
            loss.backward()
            optimizer.step()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


class _FakeTime:
    """A ``time`` module whose clock moves only when the model says: each layer's forward and
    backward, and the loss, advance it by known amounts (`_Timed`)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds

    def __deepcopy__(self, memo):  # the model's copies (one per plan) advance this same clock
        return self


class _AdvanceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.sleep(ctx.seconds)
        return grad, None, None


class _Timed(nn.Linear):
    """A linear layer whose forward and backward take known (fake) seconds, per format."""

    def __init__(self, clock, seconds):
        super().__init__(8, 8)
        self.clock, self.seconds = clock, seconds  # format -> (forward, backward)

    def forward(self, x):
        fmt = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
        forward, backward = self.seconds[fmt]
        self.clock.sleep(forward)
        return _AdvanceInBackward.apply(super().forward(x), self.clock, backward)


def test_in_place_predictions_are_each_layers_forward_and_backward_plus_the_rest(monkeypatch):
    """The prediction's arithmetic on a clock that moves only inside the model: each layer's
    seconds in place are its forward and its backward, the rest is the loss, and a uniform plan's
    predicted step is their sum, as a step of that plan takes. (Measured against real steps on
    the machine by the ranking benchmark, `autoprec.bench.check_uniform_ranking`: a speed, not a
    test.)"""
    from autoprec.costs import inplace
    from autoprec import device_clock as timing_module

    clock = _FakeTime()
    monkeypatch.setattr(inplace, "time", clock)
    monkeypatch.setattr(timing_module, "time", clock)
    seconds = {"0": {"fp32": (0.003, 0.005), "bf16": (0.002, 0.003)}, "1": {"fp32": (0.007, 0.011), "bf16": (0.004, 0.006)}}
    model = nn.Sequential(_Timed(clock, seconds["0"]), _Timed(clock, seconds["1"]))

    def loss_fn(m, x):
        clock.sleep(0.013)
        return m(x).pow(2).mean()

    costs = CostModel.build(model, torch.randn(4, 8), loss_fn=loss_fn, formats=["fp32", "bf16"], timing=TimingSettings(cache_dir=False))
    for fmt in ("fp32", "bf16"):
        times = costs.in_place[Format.parse(fmt)]
        assert times.layer_seconds == pytest.approx({fqn: sum(s[fmt]) for fqn, s in seconds.items()}, abs=1e-12)
        assert times.rest_seconds == pytest.approx(0.013, abs=1e-12)
        step = 0.013 + sum(sum(s[fmt]) for s in seconds.values())
        assert costs.plan_cost(costs.uniform_plan(fmt)).step_seconds == pytest.approx(step, abs=1e-12)
    mixed = Plan({"0": "bf16", "1": "fp32"})
    assert costs.plan_cost(mixed).step_seconds == pytest.approx(0.013 + 0.005 + 0.018, abs=1e-12)


def test_in_place_layer_times_cover_forward_and_backward_of_every_layer(one_thread):
    # The layers' in-place FP32 seconds of one step against the same model's layers run alone
    # (forward + backward of each Linear on its recorded input): each layer costs something,
    # and the layers plus the rest add up to the measured step.
    model, x = _tiny_model()
    costs = CostModel.build(model, x, formats=["fp32"], timing=TimingSettings(warmup_steps=1, timed_steps=5, cache_dir=False))
    times = costs.in_place[Format.FP32]
    assert set(times.layer_seconds) == {"0", "2"}
    assert all(s > 0 for s in times.layer_seconds.values())
    assert costs.layer_cost("0", "fp32").time_source == "in place"


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def test_in_place_layer_times_hold_their_forward_and_backward_and_the_rest_holds_the_loss():
    # Sleeps placed in one layer's forward and backward and in the loss (outside every layer):
    # a sleep is a lower bound on any clock, so the bounds hold on a loaded machine. Had the
    # backward gone unattributed, layer 0 would fall short of both sleeps; had the loss gone to
    # a layer, the rest (the step minus its layers) would fall short of the loss's sleep.
    from autoprec.costs.inplace import measure_in_place

    class Sleepy(nn.Linear):
        def forward(self, x):
            time.sleep(0.03)
            return _SleepInBackward.apply(super().forward(x), 0.05)

    def loss_fn(model, x):
        time.sleep(0.1)
        return model(x).pow(2).mean()

    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(8, 8), nn.Linear(8, 8))
    out = measure_in_place(model, [torch.randn(4, 8)], {"fp32": Plan({"0": "fp32", "1": "fp32"})}, ["0", "1"], loss_fn, warmup=0, steps=2)
    times = out["fp32"]
    assert times.layer_seconds["0"] >= 0.08 and times.rest_seconds >= 0.1, times


def test_layers_of_one_role_pool_their_samples_over_few_steps():
    # Two roles of four layers: the sleepy ones (0.02 s a forward) and quick ones. Each layer takes
    # its role's median; with roles repeated, timing stops after MIN_TIMED_ROUNDS steps, not 8.
    from autoprec.costs.inplace import MIN_TIMED_ROUNDS, measure_in_place

    class Sleepy(nn.Linear):
        def forward(self, x):
            time.sleep(0.02)
            return super().forward(x)

    calls = []
    model = nn.Sequential(*[Sleepy(8, 8) if i % 2 else nn.Linear(8, 8) for i in range(8)])
    model[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    layers = [str(i) for i in range(8)]
    roles = {fqn: "sleepy" if int(fqn) % 2 else "quick" for fqn in layers}
    out = measure_in_place(model, [torch.randn(4, 8)], {"fp32": Plan(dict.fromkeys(layers, "fp32"))}, layers, warmup=2, steps=8, roles=roles)
    seconds = out["fp32"].layer_seconds
    assert len({seconds[fqn] for fqn in layers if roles[fqn] == "sleepy"}) == 1
    assert len({seconds[fqn] for fqn in layers if roles[fqn] == "quick"}) == 1
    assert seconds["1"] >= 0.02 > seconds["0"], seconds
    assert len(calls) == 1 + MIN_TIMED_ROUNDS  # the first step and the timed ones; no warmup: nothing calibrates


def test_warmup_steps_run_only_while_a_plan_calibrates():
    from autoprec.costs.inplace import measure_in_place
    from autoprec.layer_precision import Calibration, LayerPrecision

    calls = []
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    int8 = LayerPrecision("int8", calibration=Calibration(batches=3))
    plans = {"fp32": Plan({"0": "fp32", "1": "fp32"}), "int8": Plan({"0": int8, "1": int8})}
    measure_in_place(model, [torch.randn(4, 8)], plans, ["0", "1"], warmup=5, steps=2)
    # Each plan: its first step and 2 timed ones. The INT8 plan calibrates over its first 3
    # forwards, so 2 of the 5 warmup steps run, its own; the FP32 plan is warm after its first.
    assert len(calls) == 2 * (1 + 2) + 2


def test_a_plan_far_slower_than_the_first_is_stopped_and_extrapolated():
    from autoprec.costs.inplace import measure_in_place

    class Slow(nn.Module):
        """A projection that sleeps when its forward runs under a BF16 plan."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                slow_runs.append(self.index)
                time.sleep(0.2)
            return torch.nn.functional.linear(x, self.weight)

    slow_runs = []
    model = nn.Sequential(Slow(), Slow())
    model[0].index, model[1].index = 0, 1
    plans = {f: Plan({"0": f, "1": f}) for f in ("fp32", "bf16")}
    out = measure_in_place(model, [torch.randn(4, 8)], plans, ["0", "1"], warmup=0, steps=2, slow_factor=2.0)
    assert not out["fp32"].extrapolated and out["bf16"].extrapolated
    # Stopped before its second layer (before its first, when the machine is busy enough that the
    # step's start already took twice the FP32 step), and never run again.
    assert slow_runs in ([0], [])
    if slow_runs:  # its first layer's forward was timed: the plan is extrapolated from that layer's slowdown
        assert out["bf16"].step_seconds > 2.0 * out["fp32"].step_seconds
    else:  # no layer finished: each is taken to be slow_factor times the first plan's, the rest as it was
        for fqn, seconds in out["fp32"].layer_seconds.items():
            assert out["bf16"].layer_seconds[fqn] == pytest.approx(2.0 * seconds)


def test_extrapolation_is_against_the_first_plans_timed_steps_not_its_cold_first_one():
    # The first plan's first step is slow once (a cold call: under load it can be much slower
    # than the timed ones); the stopped plan's slowdown must not be measured against it.
    from autoprec.costs.inplace import measure_in_place

    class ColdOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if torch.is_autocast_enabled("cpu"):
                time.sleep(0.5)
            elif self.calls == 1:
                time.sleep(0.1)
            return torch.nn.functional.linear(x, self.weight)

    model = nn.Sequential(ColdOnce(), ColdOnce())
    plans = {f: Plan({"0": f, "1": f}) for f in ("fp32", "bf16")}
    out = measure_in_place(model, [torch.randn(4, 8)], plans, ["0", "1"], warmup=0, steps=2, slow_factor=2.0)
    assert out["bf16"].extrapolated
    # Its first layer's forward alone took 0.5 s; a layer of the timed FP32 steps, far less.
    assert out["bf16"].layer_seconds["0"] > 0.25


# -- roofline -------------------------------------------------------------------------------------


def test_roofline_gives_positive_finite_times_for_every_layer_and_format(lm):
    wl, model, batch, _ = lm
    costs = CostModel.build(model, batch, loss_fn=wl.loss, formats=ALL, timing=ROOFLINE)
    assert costs.rest_seconds == 0.0
    for per_format in costs.table().values():
        for cost in per_format.values():
            assert math.isfinite(cost.seconds) and cost.seconds > 0
            assert cost.time_source == "roofline"


def test_roofline_on_an_h100_orders_a_large_gemm_fp8_bf16_fp32_and_slows_small_fp8():
    # Traced on the meta device: shapes only, no compute. An 8192^3 GEMM is compute-bound (FP8
    # wins despite its quantization passes; at 4096 the unfused passes nearly cancel the gain);
    # a 16x64x64 one is launch-bound, where FP8's extra kernels make it slower than BF16.
    roofline = RooflineTimeModel(PEAKS["H100"])

    def call(m, k, n):
        model = nn.Linear(k, n, device="meta")
        return trace_model(model, torch.randn(m, k, device="meta", requires_grad=True)).layers[""].calls[0]

    big = call(8192, 8192, 8192)
    t = {f: roofline.seconds(big, f, torch.device("cpu")) for f in ("fp8_e4m3", "bf16", "fp32")}
    assert t["fp8_e4m3"] < t["bf16"] < t["fp32"]
    small = call(16, 64, 64)
    assert roofline.seconds(small, "fp8_e4m3", torch.device("cpu")) > roofline.seconds(small, "bf16", torch.device("cpu"))


def test_roofline_prices_a_high_precision_weight_gradient_between_the_low_and_the_high_backward_on_a_large_gemm():
    """Per GEMM: on an H100 an 8192^3 FP8 layer whose weight gradient alone runs in BF16 costs
    one BF16 GEMM more than the FP8 backward and one less than the whole BF16 backward."""
    model = nn.Linear(8192, 8192, device="meta")
    big = trace_model(model, torch.randn(8192, 8192, device="meta", requires_grad=True)).layers[""].calls[0]
    fp8 = Format.FP8_E4M3

    def seconds(**recipe):
        return RooflineTimeModel(PEAKS["H100"], precisions={fp8: LayerPrecision(fp8, **recipe)}).seconds(big, fp8, torch.device("cpu"))

    low, split, high = seconds(), seconds(high_precision_weight_grad=True), seconds(grad_format="fp32")
    assert low < split < high


# -- errors ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_costs():
    model, x = _tiny_model()
    return CostModel.build(model, x, timing=CONSTANT)


def test_unknown_layer_is_an_error_naming_the_layers(tiny_costs):
    with pytest.raises(CostModelError, match=r"layer_cost\('nope'\): not a layer.*'0', '2'"):
        tiny_costs.layer_cost("nope", "fp32")


def test_unknown_format_is_a_format_error(tiny_costs):
    with pytest.raises(FormatError, match="unknown format 'fp4'"):
        tiny_costs.layer_cost("0", "fp4")


def test_a_plan_that_does_not_match_the_trace_is_an_error_naming_each_layer(tiny_costs):
    plan = Plan({"0": "bf16", "1": "bf16"})
    with pytest.raises(CostModelError) as info:
        tiny_costs.plan_cost(plan)
    assert "'1': ran no matrix product" in str(info.value)
    assert "'2': a traced layer the plan lacks" in str(info.value)


def test_a_model_without_matrix_products_cannot_be_costed():
    with pytest.raises(CostModelError, match="ran no matrix product"):
        trace_model(nn.Sequential(nn.ReLU()), torch.randn(4, 4))


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"warmup": -1}, {"repeats": 1.5}])
def test_bad_measurement_settings_are_errors(kwargs):
    with pytest.raises(CostModelError, match="must be an int"):
        MeasuredTimeModel(False, **kwargs)


@pytest.mark.parametrize("field, value, fix", [
    ("in_place", "no", r"True \(time the layers in place\) or False"),
    ("warmup_steps", -1, "an int >= 0"),
    ("timed_steps", 0, "an int >= 1"),
    ("timed_steps", 2.5, "an int >= 1"),
    ("time_model", "roofline", "expected a TimeModel"),
    ("cache_dir", 3, "expected a folder path"),
    ("times_file", 3, "expected the path of a JSON file"),
])
def test_bad_timing_settings_are_one_line_errors_naming_the_field(field, value, fix):
    with pytest.raises(CostModelError, match=rf"^TimingSettings\({field}=.*\): .*{fix}") as info:
        TimingSettings(**{field: value})
    assert "\n" not in str(info.value)


def test_build_refuses_timing_that_is_not_timing_settings():
    model, x = _tiny_model()
    with pytest.raises(CostModelError, match=r"CostModel.build\(timing=dict\): expected a TimingSettings"):
        CostModel.build(model, x, timing={"in_place": False})


def test_a_cache_dir_that_is_a_file_is_an_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(CostModelError, match="is not a folder"):
        MeasuredTimeModel(path)


def test_a_ranking_needs_two_formats():
    with pytest.raises(CostModelError, match="two formats"):
        check_uniform_ranking(default_workload("tiny"), formats=["fp32"])


# -- the check against real step times ---------------------------------------------------------


def test_a_pair_ordered_against_the_prediction_disagrees_only_where_its_rounds_separate_it():
    from autoprec.bench.ranking import _compare

    predicted = {"a": 1.0, "b": 1.1}  # a predicted faster
    # Measured b faster by 20 % in the medians, beyond the 15 % tie. Rounds in step that put b
    # below a in every round separate them; rounds whose paired ratios straddle 1 (a loaded
    # machine slowing one variant in some rounds) do not.
    separated = {"a": [1.2, 1.25, 1.2, 1.3, 1.2, 1.22, 1.21, 1.2], "b": [1.0, 1.01, 1.0, 1.02, 1.0, 0.99, 1.0, 1.0]}
    straddling = {"a": [1.2, 0.9, 1.25, 0.95, 1.2, 1.3, 0.9, 1.2], "b": [1.0, 1.3, 1.0, 1.3, 1.0, 0.95, 1.35, 1.0]}
    for rounds, agree in ((separated, False), (straddling, True)):
        measured = {k: statistics.median(v) for k, v in rounds.items()}
        assert abs(measured["a"] - measured["b"]) > 0.15 * min(measured.values())
        _, exact, agreed, discordant = _compare(predicted, measured, 0.15, rounds)
        assert not exact and agreed is agree and discordant == (() if agree else (("a", "b"),))


@pytest.mark.slow
def test_predicted_uniform_plan_ranking_matches_measured_step_times(tmp_path):
    # On this CPU (2 cores, AVX2, torch 2.13, one thread) the uniform plans' measured step times
    # on the "small" workload are ~52 (fp32), 138 (fp8), 380 (int8), 684 (bf16), 783 (fp16) ms:
    # every adjacent pair differs by > 2x except bf16 vs fp16 (~15%), which may tie.
    result = check_uniform_ranking(default_workload("small"), threads=1, cache_dir=tmp_path, steps=8, warmup=2, tie=0.15)
    assert result.agree, result.table()


def test_in_place_times_saved_to_a_file_are_reused_and_predict_the_same(tmp_path, monkeypatch):
    from autoprec.costs import model as cost_model

    model, x = _tiny_model()
    path = tmp_path / "costs.json"
    first = CostModel.build(model, x, formats=("fp32", "bf16"), timing=dataclasses.replace(QUICK, times_file=path))
    measured = []
    monkeypatch.setattr(cost_model, "measure_in_place", lambda *a, **k: measured.append(1))
    again = CostModel.build(model, x, formats=("fp32", "bf16"), timing=dataclasses.replace(QUICK, times_file=path))
    assert measured == []  # read back, not measured again
    plan = first.uniform_plan(Format.BF16)
    assert again.plan_cost(plan).step_seconds == first.plan_cost(plan).step_seconds


def test_calibration_times_int_mm_in_the_runtimes_layout():
    """The INT8 peak is measured with the column-major second operand the runtime passes (its
    weight (N, K) row-major, transposed): a row-major one times a slower kernel (the NN layout
    on CUDA) and under-rates INT8."""
    from torch.utils._python_dispatch import TorchDispatchMode

    second_operands = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._int_mm.default:
                second_operands.append(args[1])
            return func(*args, **(kwargs or {}))

    with Record():
        list(timing._measure("test", "cpu"))  # uncached: this call measures
    assert second_operands
    assert all(b.stride(0) == 1 and b.stride(1) == b.shape[0] for b in second_operands)  # column-major


# -- recompute blocks (issue 24) ------------------------------------------------------------------

BLOCKS = ("blocks.0", "blocks.1")
# Uniform plans and mixed ones (an FP8 layer in a BF16 block, an FP32 attention among lowered layers).
BLOCK_PLANS = {
    "fp32": lambda c: c.uniform_plan("fp32"),
    "bf16-with-fp8": lambda c: c.uniform_plan("bf16").with_layers({"blocks.0.mlp.fc": "fp8_e4m3"}),
    "fp8-with-fp32": lambda c: c.uniform_plan("fp8_e4m3").with_layers({"blocks.1.attn": "fp32", "lm_head": "bf16"}),
    "int8": lambda c: c.uniform_plan("int8"),
}


@pytest.fixture(scope="module")
def block_costs(lm):
    wl, model, batch, _ = lm
    return CostModel.build(model, batch, loss_fn=wl.loss, formats=["fp32", "bf16", "fp8_e4m3", "int8"],
                           timing=CONSTANT, blocks=BLOCKS)


@pytest.mark.parametrize("recompute", [("blocks.0",), BLOCKS], ids=["one", "both"])
@pytest.mark.parametrize("name", list(BLOCK_PLANS))
def test_predicted_bytes_freed_by_recomputed_blocks_match_the_meter(lm, block_costs, name, recompute):
    wl, model, batch, _ = lm
    plan = BLOCK_PLANS[name](block_costs)
    kept, recomputed = _meter(wl, model, batch, plan), _meter(wl, model, batch, plan.with_recompute(recompute))
    predicted = block_costs.plan_cost(plan.with_recompute(recompute))
    assert predicted.recompute_freed_bytes > 0
    assert predicted.saved_bytes >= recomputed  # on the safe side, as without recomputation
    if "fp32" in name.split("-")[1:]:
        # An FP32 layer's extra in a lowered region is never counted as freed: less freed than measured, not more.
        assert 0.9 * (kept - recomputed) <= predicted.recompute_freed_bytes <= kept - recomputed
    else:
        assert predicted.recompute_freed_bytes == pytest.approx(kept - recomputed, rel=0.01)
    assert block_costs.plan_cost(plan).recompute_freed_bytes == 0


def test_a_block_frees_what_it_holds_beyond_its_input(lm, block_costs):
    wl, model, batch, _ = lm
    block = block_costs.blocks["blocks.0"]
    # Directly: the meter's count across the block's forward, run as it is (not checkpointed).
    marks = []
    module = dict(model.named_modules())["blocks.0"]
    with SavedTensorMeter(model.parameters()) as meter, ap.apply_plan(model, block_costs.uniform_plan("fp32"), validate=False):
        handles = [module.register_forward_pre_hook(lambda m, a: marks.append(meter.total_bytes) and None),
                   module.register_forward_hook(lambda m, a, o: marks.append(meter.total_bytes) and None)]
        try:
            loss = wl.loss(model, batch)
        finally:
            for h in handles:
                h.remove()
    del loss
    batch_size, tokens = batch[0].shape
    block_input = batch_size * tokens * model.config.d_model * 4  # the FP32 residual stream entering the block
    # Its first norm saves the input, which the checkpoint keeps all the same.
    assert block.freed_bytes[0] == marks[1] - marks[0] - block_input
    assert block.freed_bytes[1] < block.freed_bytes[0]  # lowered: 2-byte activations
    assert block.layers == tuple(f for f in block_costs.layers if f.startswith("blocks.0."))


def test_recomputation_adds_one_forward_of_the_block_timed_in_place(tmp_path, monkeypatch, one_thread):
    from autoprec.costs import model as cost_model

    wl = default_workload("tiny", batch_size=2)
    model = wl.build_model()
    batch = wl.val_batches(1)[0]
    path = tmp_path / "costs.json"
    kwargs = dict(loss_fn=wl.loss, formats=("fp32", "bf16"), timing=dataclasses.replace(QUICK, times_file=path), blocks=BLOCKS)
    first = CostModel.build(model, batch, **kwargs)
    fp32 = first.in_place[Format.FP32]
    assert set(fp32.block_seconds) == set(BLOCKS) and all(s > 0 for s in fp32.block_seconds.values())
    for fqn in first.layers:  # a layer's forward is part of its forward + backward
        assert 0 < first.layer_forward_seconds(fqn, "bf16") < first.layer_cost(fqn, "bf16").seconds
    plan = first.uniform_plan("bf16").with_recompute(["blocks.1"])
    cost = first.plan_cost(plan)
    block = first.blocks["blocks.1"]
    assert cost.recompute_seconds == pytest.approx(
        block.other_seconds[1] + sum(first.in_place[Format.BF16].forward_seconds[f] for f in block.layers))
    assert cost.step_seconds == pytest.approx(first.plan_cost(plan.with_recompute([])).step_seconds + cost.recompute_seconds)
    # The block times are in costs.json: a second build reads them back and predicts the same.
    assert set(json.loads(path.read_text())["times"]["fp32"]["block_seconds"]) == set(BLOCKS)
    monkeypatch.setattr(cost_model, "measure_in_place", lambda *a, **k: pytest.fail("measured again"))
    again = CostModel.build(model, batch, **kwargs)
    assert again.plan_cost(plan).step_seconds == cost.step_seconds
    assert again.blocks == first.blocks


def test_a_times_file_without_the_blocks_is_measured_again(tmp_path, monkeypatch, one_thread):
    from autoprec.costs import model as cost_model

    wl = default_workload("tiny", batch_size=2)
    model, batch = wl.build_model(), wl.val_batches(1)[0]
    path = tmp_path / "costs.json"
    kwargs = dict(loss_fn=wl.loss, formats=("fp32",), timing=dataclasses.replace(QUICK, times_file=path))
    CostModel.build(model, batch, **kwargs)
    assert "blocks" not in json.loads(path.read_text())  # no blocks: the file is as before issue 24
    real, measured = cost_model.measure_in_place, []
    monkeypatch.setattr(cost_model, "measure_in_place", lambda *a, **k: measured.append(k["blocks"]) or real(*a, **k))
    with_blocks = CostModel.build(model, batch, blocks=BLOCKS, **kwargs)
    assert measured == [list(BLOCKS)]  # the blocks' forwards were never timed: measured, not read back
    assert json.loads(path.read_text())["blocks"] == list(BLOCKS)
    assert with_blocks.plan_cost(with_blocks.uniform_plan("fp32").with_recompute(BLOCKS)).recompute_seconds > 0


def test_block_errors_name_the_block_and_the_fix(lm, block_costs):
    wl, model, batch, _ = lm
    with pytest.raises(CostModelError, match=r"'blocks\.9' is not a module.*find_blocks"):
        CostModel.build(model, batch, loss_fn=wl.loss, formats=["fp32"], timing=CONSTANT, blocks=["blocks.9"])
    plan = block_costs.uniform_plan("fp32").with_recompute(["blocks.0"])
    plain = CostModel.build(model, batch, loss_fn=wl.loss, formats=["fp32"], timing=CONSTANT)
    with pytest.raises(CostModelError, match=r"recomputes 'blocks\.0', a block this cost model did not cost"):
        plain.plan_cost(plan)


def test_blocks_of_one_kind_are_measured_once_and_take_the_same_figures():
    """Depth (issue 57): what recomputing a block frees is measured once per kind of block (its
    class and its layers' roles), not per block, so the stage's forwards do not grow with depth;
    the figures every block then takes are those measured block by block."""
    from autoprec.blocks import find_blocks, layers_of_blocks
    from autoprec.coverage import find_layers

    torch.manual_seed(0)
    wl = default_workload("tiny", batch_size=4)
    model = wl.build_model()
    batch = wl.val_batches(1)[0]
    fingerprint = find_layers(model, batch[0])
    blocks = layers_of_blocks(find_blocks(model, list(fingerprint)), fingerprint)
    assert len(blocks) >= 2 and all(blocks.values())
    roles = {fqn: info.role(fqn) for fqn, info in fingerprint.items()}
    runs = {}
    for key, given in (("per block", None), ("per kind", roles)):
        costs = CostModel(trace_model(model, batch, wl.loss), RooflineTimeModel(), formats=["fp32"])
        labels = list(costs.block_bytes_steps(model, batch, wl.loss, blocks, roles=given))
        runs[key] = (labels.count("block forward"), {fqn: (b.freed_bytes, b.other_bytes) for fqn, b in costs.blocks.items()})
    regions = 1 + (costs.region_format is not None)
    assert runs["per block"][0] == regions * (1 + len(blocks))
    assert runs["per kind"][0] == regions * 2  # one kind: its base and one block recomputed, per region
    assert runs["per kind"][1] == runs["per block"][1]


def test_the_peak_calibration_spread_over_steps_takes_as_many_steps_cached_or_not(monkeypatch):
    """`calibration_steps` (the in-run search's units): one step per timing the first time, the
    same steps, instant, once cached, so a search's steps do not depend on what ran before it in
    the process; `calibrate_peaks`'s cache then holds what they measured."""
    from autoprec.costs import product_times as timing

    monkeypatch.setattr(timing, "_CALIBRATED", {})
    first = list(timing.calibration_steps("cpu"))
    assert first[0] == "fp32" and first[-1] == "bandwidth" and len(first) >= 3
    key = (timing.device_key(torch.device("cpu")), "cpu")
    peaks = timing._CALIBRATED[key][0]
    measured = []
    monkeypatch.setattr(timing, "_measure", lambda *args: measured.append(args))  # a second measurement would call it
    assert list(timing.calibration_steps("cpu")) == first and timing._calibrated(*key) is peaks and not measured


@pytest.mark.parametrize("limit, size", [(0.0, 128), (math.inf, 256)])
def test_a_cpu_format_whose_small_gemm_predicts_a_long_call_is_timed_small(monkeypatch, limit, size):
    """Each format is timed at 256^3 unless its 128^3 call, times 8, predicts a call over
    `_CPU_CALL_LIMIT_S` (FP16 without FP16 units: a 256^3 call held a step of a 4-block model
    8x): then at 128^3. The rate divides by the size timed."""
    from autoprec.costs import product_times as timing

    shapes = []
    real = timing._cast_mm
    monkeypatch.setattr(timing, "_cast_mm", lambda a, b, dtype: shapes.append((a.shape[0], dtype)) or real(a, b, dtype))
    monkeypatch.setattr(timing, "_CPU_CALL_LIMIT_S", limit)
    steps = timing._measure(timing.device_key(torch.device("cpu")), "cpu")
    labels = []
    try:
        while True:
            labels.append(next(steps))
    except StopIteration as done:
        peaks = done.value
    # Per format: its 128^3 call, then the size it is timed at.
    assert shapes[:2] == [(128, torch.float32), (size, torch.float32)]
    assert labels[0] == "fp32" and peaks.flops[Format.FP32] > 0
