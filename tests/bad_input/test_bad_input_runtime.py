"""Bad input at the runtime door (issue 25): `apply_plan` given something other than a module or
a `Plan`, and runtime or scheduler state dicts that are empty, of the wrong shape, or hold a
string or negative step, are each refused with one `RuntimeStateError` line naming the argument
or field and the fix, before anything is restored."""

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.errors import RuntimeStateError


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("bad, shown", [
    ("model.pt", "'model.pt'"), (None, "None"), (lambda x: x, "function"),
], ids=["path", "none", "function"])
def test_apply_plan_refuses_a_model_that_is_not_a_module(bad, shown):
    plan = ap.Plan.uniform(model(), "bf16")
    with pytest.raises(RuntimeStateError, match=rf"^apply_plan\(model={shown}\): expected the torch.nn.Module") as info:
        ap.apply_plan(bad, plan)
    one_line(info)


@pytest.mark.parametrize("bad, fix", [
    ("plan.json", r"Plan.load\('plan.json'\)"), (None, r"Plan.uniform"), ({"layers": {}}, r"Plan.from_dict"),
], ids=["path", "none", "dict"])
def test_apply_plan_refuses_a_plan_that_is_not_a_plan(bad, fix):
    with pytest.raises(RuntimeStateError, match=rf"^apply_plan\(plan=\w+\): expected an autoprec.Plan; .*{fix}") as info:
        ap.apply_plan(model(), bad)
    one_line(info)


@pytest.fixture
def runtime():
    m = model()
    runtime = ap.apply_plan(m, ap.Plan.uniform(m, "fp8_e4m3", scaling=ap.Scaling(mode="delayed")))
    with runtime:
        m(torch.randn(4, 8)).sum().backward()
    return runtime


@pytest.mark.parametrize("state, names", [
    ({}, "lacks 'layers'"),
    (None, r"NoneType\): expected a dict"),
    ("runtime.pt", r"str\): expected a dict"),
    ({"layers": []}, "'layers' of type list"),
    ({"layers": {"0": "x"}}, r"state\['layers'\]\['0'\] needs 'inputs'"),
    ({"layers": {"0": {"inputs": {"weight": 5}, "calibrators": {}}}}, r"state\['layers'\]\['0'\]\['inputs'\]\['weight'\] is a int"),
], ids=["empty", "none", "path", "layers-list", "layer-string", "quantizer-int"])
def test_a_runtime_state_of_the_wrong_shape_is_refused_naming_the_field(runtime, state, names):
    with pytest.raises(RuntimeStateError, match=rf"^PlanRuntime.load_state_dict\(.*{names}.*; pass the dict PlanRuntime.state_dict\(\) returned") as info:
        runtime.load_state_dict(state)
    one_line(info)


def test_recalibrate_takes_one_fqn_and_refuses_an_unknown_one_forgetting_nothing(runtime):
    history = lambda fqn: next(iter(runtime.state_dict()["layers"][fqn]["inputs"].values()))["history"]  # noqa: E731
    assert history("0").abs().sum() > 0 and history("2").abs().sum() > 0
    with pytest.raises(RuntimeStateError, match=r"^recalibrate\('nope'\): not a layer of this runtime's plan .*name layers by their fqn") as info:
        runtime.recalibrate(["2", "nope"])
    one_line(info)
    assert history("2").abs().sum() > 0  # a bad list forgets nothing, not even its good names
    runtime.recalibrate("2")  # one bare fqn: that layer, not its characters
    assert history("2").abs().sum() == 0 and history("0").abs().sum() > 0


def test_a_runtime_state_with_a_history_of_the_wrong_length_is_refused(runtime):
    state = runtime.state_dict()
    history = state["layers"]["0"]["inputs"]
    key = next(iter(history))
    history[key] = {"history": torch.zeros(3)}
    with pytest.raises(RuntimeStateError, match=r"layer '0' does not match this plan: .*history_len"):
        runtime.load_state_dict(state)


@pytest.fixture(scope="module")
def saved():
    m = model()
    scheduler = ap.DynamicPrecisionScheduler(m, monitor_window=4)
    optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(2):
        with scheduler.precision_context():
            loss = m(torch.randn(4, 8)).square().mean()
        scheduler.backward(loss)
        scheduler.step(optimizer)
        optimizer.zero_grad()
    return scheduler.state_dict()


@pytest.mark.parametrize("edit, names", [
    (dict(step="3"), r"state\['step'\] = '3' is not a step count"),
    (dict(step=-1), r"state\['step'\] = -1 is not a step count"),
    (dict(step=2.5), r"state\['step'\] = 2.5 is not a step count"),
    (dict(window_start=-2), r"state\['window_start'\] = -2"),
    (dict(window_start=9), r"state\['window_start'\] = 9 is after state\['step'\] = 2"),
    (dict(loss_count=-1), r"state\['loss_count'\] = -1"),
    (dict(changes={}), r"state\['changes'\] = \{\} is not a list"),
    (dict(window_nonfinite=[]), r"state\['window_nonfinite'\] = \[\]"),
    (dict(fingerprint=[]), r"state\['fingerprint'\] = \[\]"),
    (dict(plan="plan.json"), r"state\['plan'\] = 'plan.json'"),
    (dict(captured={}), r"state\['captured'\] = \{\}"),
    (dict(meter_next="x"), r"state\['meter_next'\] = 'x' is not True or False"),
    (dict(stable={"0": -1}), r"state\['stable'\]"),
    (dict(scaler="x"), r"state\['scaler'\] = 'x'"),
    (dict(profiler={"window": "4", "state": {}}), r"state\['profiler'\]"),
], ids=lambda v: "-".join(f"{k}={w!r}" for k, w in v.items()) if isinstance(v, dict) else None)
def test_a_scheduler_state_field_of_the_wrong_type_or_sign_is_refused_naming_it(saved, edit, names):
    scheduler = ap.DynamicPrecisionScheduler(model())
    with pytest.raises(RuntimeStateError, match=rf"^load_state_dict\(\): {names}.*; pass the whole dict") as info:
        scheduler.load_state_dict({**saved, **edit})
    one_line(info)


@pytest.mark.parametrize("state, says", [
    ({}, r"^load_state_dict\(\): the state is empty; pass the whole dict"),
    ("checkpoint.pt", r"^load_state_dict\(str\): expected a dict; .*torch.load"),
], ids=["empty", "path"])
def test_an_empty_or_path_scheduler_state_says_what_to_pass(state, says):
    with pytest.raises(RuntimeStateError, match=says):
        ap.DynamicPrecisionScheduler(model()).load_state_dict(state)


def test_a_refused_scheduler_state_restores_nothing(saved):
    scheduler = ap.DynamicPrecisionScheduler(model())
    with pytest.raises(RuntimeStateError):
        scheduler.load_state_dict({**saved, "meter_next": "x"})
    assert scheduler.step_count == 0 and scheduler.plan is None


def test_the_saved_scheduler_state_still_loads(saved):
    scheduler = ap.DynamicPrecisionScheduler(model())
    scheduler.load_state_dict(saved)
    assert scheduler.step_count == 2


def _meta_mlp():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def test_a_plan_on_a_meta_model_is_refused_until_it_is_materialised():
    model = _meta_mlp()
    plan = ap.Plan.uniform(model, "fp8_e4m3")
    with pytest.raises(ap.RuntimeStateError, match="meta device; materialise it first"):
        ap.apply_plan(model, plan)
    model.to_empty(device="cpu")
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    x = torch.randn(16, 32)
    with torch.no_grad(), ap.apply_plan(model, plan):
        out = model(x)
    assert torch.isfinite(out).all() and out.shape == (16, 8)


def test_the_scheduler_refuses_a_model_run_on_the_meta_device():
    model = _meta_mlp()
    sch = ap.DynamicPrecisionScheduler(monitor_window=2, memory_budget=0.8, accuracy_budget=0.05, measure_costs=False, search_slice=None)
    with pytest.raises(ap.RuntimeStateError, match="meta device inside precision_context"):
        with sch.precision_context():
            model(torch.randn(4, 32, device="meta"))


# -- restored tensors of the wrong shape (issue 40) ----------------------------------------------------


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # input channels 8, then 16


def int8_runtime(model, forwards):
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, "int8"))
    with runtime, torch.no_grad():
        for _ in range(forwards):
            model(torch.randn(32, 8))
    return runtime


def tensors(state):
    return {(fqn, field, key, name): value.clone() for fqn, layer in state["layers"].items() for field, entries in layer.items()
            for key, entry in entries.items() for name, value in entry.items() if torch.is_tensor(value)}


@pytest.mark.parametrize("forwards", [2, 4], ids=["calibrating", "frozen"])
def test_an_int8_calibration_of_another_layers_width_is_refused_naming_both_shapes(forwards):
    state = int8_runtime(wide_model(), forwards).state_dict()
    state["layers"]["2"]["calibrators"]["2.weight"] = state["layers"]["0"]["calibrators"]["0.weight"]  # 8 channels, not 16
    fresh = int8_runtime(wide_model(), 0)
    with pytest.raises(RuntimeStateError, match=(
        r"^PlanRuntime.load_state_dict\(\): layer '2' does not match this plan: "
        r"state\['layers'\]\['2'\]\['calibrators'\]\['2.weight'\]\['channel_amax'\] has shape \(8,\), expected \(16,\)"
    )) as info:
        fresh.load_state_dict(state)
    one_line(info)
    assert fresh.state_dict() == {"layers": {}}  # layer '0', which fitted, was not restored either


@pytest.mark.parametrize("field, value, says", [
    ("keep", torch.ones(4), r"\['keep'\] has shape \(4,\), expected \(16,\)"),
    ("frozen_inv", torch.ones(2), r"\['frozen_inv'\] has shape \(2,\), expected \(\)"),
    ("outlier_index", torch.zeros(3, dtype=torch.long), r"\['outlier_index'\] has shape \(3,\), expected \(1,\)"),
    ("channel_amax", torch.ones(16, 1), r"\['channel_amax'\] has shape \(16, 1\), expected \(16,\)"),
], ids=["keep", "frozen_inv", "outlier_index", "channel_amax-2d"])
def test_a_frozen_int8_calibration_tensor_of_the_wrong_shape_is_refused(field, value, says):
    runtime = int8_runtime(wide_model(), 4)
    state = runtime.state_dict()
    before = tensors(state)
    state["layers"]["2"]["calibrators"]["2.weight"] = {**state["layers"]["2"]["calibrators"]["2.weight"], field: value}
    with pytest.raises(RuntimeStateError, match=r"layer '2' does not match this plan: .*" + says) as info:
        runtime.load_state_dict(state)
    one_line(info)
    after = tensors(runtime.state_dict())
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_calibration_sample_of_the_wrong_width_is_refused():
    runtime = int8_runtime(wide_model(), 2)
    state = runtime.state_dict()
    entry = state["layers"]["2"]["calibrators"]["2.weight"]
    state["layers"]["2"]["calibrators"]["2.weight"] = {**entry, "samples": [entry["samples"][0], torch.zeros(32, 8)]}
    with pytest.raises(RuntimeStateError, match=r"\['samples'\]\[1\] has shape \(32, 8\), expected \(32, 16\)"):
        runtime.load_state_dict(state)


def test_a_history_of_the_wrong_length_in_a_later_layer_restores_no_earlier_layer(runtime):
    state = runtime.state_dict()
    before = tensors(state)
    for layer in state["layers"].values():
        for key in layer["inputs"]:
            layer["inputs"][key] = {"history": layer["inputs"][key]["history"] + 1.0}  # fits: would change the state
    last = list(state["layers"])[-1]
    key = next(iter(state["layers"][last]["inputs"]))
    state["layers"][last]["inputs"][key] = {"history": torch.zeros(3)}
    with pytest.raises(RuntimeStateError, match=rf"layer '{last}' does not match this plan: .*\['history'\] has shape \(3,\), expected \(16,\)"):
        runtime.load_state_dict(state)
    after = tensors(runtime.state_dict())
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_fitting_int8_calibration_still_restores_and_runs_as_saved():
    saved = int8_runtime(wide_model(), 4)
    restored = int8_runtime(wide_model(), 0)
    restored.load_state_dict(saved.state_dict())
    x = torch.randn(32, 8)
    with torch.no_grad():
        with saved:
            expected = saved.model(x)
        with restored:
            got = restored.model(x)
    assert torch.equal(got, expected)
