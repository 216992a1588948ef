"""Bad input, hand-edited files (issue 25): a plan or profile with NaN or out-of-range figures, a
fingerprint of the wrong rank or deeply nested JSON is refused, naming the file and the field."""

import copy
import json
import math

import pytest
import torch
import torch.nn as nn

from autoprec.cli import main
from autoprec.errors import PlanError, ProfileError
from autoprec.plan import Plan
from autoprec.profiling import LayerProfiler, Profile


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


@pytest.fixture(scope="module")
def plan_dict():
    plan = Plan.uniform(model(), "bf16")
    return json.loads(json.dumps(plan.replace(predicted={"bytes": 10.0, "seconds": 1e-3, "loss_increase": 0.01, "layers": {"0": {"bytes": 5.0, "seconds": 1e-4}}}).to_dict()))


@pytest.fixture(scope="module")
def profile_dict():
    m = model()
    profiler = LayerProfiler(m, (torch.randn(4, 8),), window=3)
    with profiler:
        for _ in range(3):
            m(torch.randn(4, 8)).sum().backward()
            profiler.step()
    return json.loads(json.dumps(profiler.profile({}).to_dict()))


def edited(tmp_path, base, edit, name):
    data = copy.deepcopy(base)
    edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def put(path, value):
    def edit(d):
        *head, last = path
        for key in head:
            d = d[key]
        d[last] = value
    return edit


PLAN_EDITS = {
    "predicted NaN": (put(["predicted", "seconds"], math.nan), "predicted.seconds: NaN"),
    "predicted negative bytes": (put(["predicted", "bytes"], -5.0), "predicted.bytes: must be >= 0"),
    "predicted infinite seconds": (put(["predicted", "seconds"], math.inf), "predicted.seconds: must be finite"),
    "predicted string": (put(["predicted", "seconds"], "fast"), "predicted.seconds: expected a number"),
    "predicted layer NaN": (put(["predicted", "layers", "0", "bytes"], math.nan), "predicted.layers['0'].bytes: NaN"),
    "measured NaN loss": (put(["measured", "loss"], math.nan), "measured.loss: NaN"),
    "negative budget": (put(["budgets", "memory"], -1.0), "budgets.memory: must be >= 0"),
    "NaN calibration ratio": (put(["layers", "0", "calibration", "outlier_ratio"], math.nan), "layers['0'].calibration.outlier_ratio"),
    "fingerprint of the wrong rank": (put(["fingerprint", "0", "params", "weight"], [[8, 8]]), "fingerprint['0'].params['weight']: expected a shape"),
    "negative fingerprint dimension": (put(["fingerprint", "0", "params", "weight"], [-8, 8]), "fingerprint['0'].params['weight']"),
    "fingerprint params not an object": (put(["fingerprint", "0", "params"], 5), "fingerprint['0'].params: expected an object"),
    "1-D Linear weight": (put(["fingerprint", "0", "params", "weight"], [8]), "fingerprint['0'].params['weight']: a Linear's weight is a matrix [out_features, in_features], got [8]"),
    "fingerprint ops not names": (put(["fingerprint", "0", "ops"], [1, 2]), "fingerprint['0'].ops: expected a list of op names"),
}


@pytest.mark.parametrize("edit, field", PLAN_EDITS.values(), ids=PLAN_EDITS.keys())
def test_a_hand_edited_plan_is_refused_naming_the_file_and_field(tmp_path, plan_dict, edit, field):
    with pytest.raises(PlanError, match="plan.json") as info:
        Plan.load(edited(tmp_path, plan_dict, edit, "plan.json"))
    assert field in str(info.value)


def test_an_open_budget_still_loads(tmp_path, plan_dict):
    data = copy.deepcopy(plan_dict)
    data["budgets"] = {"memory": math.inf, "loss": 0.01}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert Plan.load(path).budgets["memory"] == math.inf


def fraction(table="fp16", scaling="none", key="underflow"):
    return ["layers", "0", "tensors", "weight", "fractions", table, scaling, key]


PROFILE_EDITS = {
    "NaN gradient variance": (put(["layers", "0", "param_grad", "var"], "nan"), "layers['0'].param_grad.var: NaN over 3 steps although no tensor of the layer had a non-finite step"),
    "negative gradient variance": (put(["layers", "0", "param_grad", "var"], -1.0), "layers['0'].param_grad.var: must be >= 0"),
    "negative NSR": (put(["layers", "0", "param_grad", "nsr"], -0.5), "layers['0'].param_grad.nsr: must be >= 0"),
    "fraction above 1": (put(fraction(), 2.0), "fractions.fp16.none.underflow: expected a fraction in [0, 1]"),
    "negative fraction": (put(fraction(key="overflow"), -0.5), "fractions.fp16.none.overflow: expected a fraction in [0, 1]"),
    "NaN fraction": (put(fraction(key="overflow"), "nan"), "fractions.fp16.none.overflow: expected a fraction in [0, 1]"),
    "reversed range": (put(fraction(key="underflow_range"), [0.5, 0.1]), "fractions.fp16.none.underflow_range: expected a range"),
    "fingerprint of the wrong rank": (put(["fingerprint", "0", "params", "weight"], [[8, 8]]), "fingerprint['0'].params['weight']: expected a shape"),
    "string step": (put(["steps"], "3"), "steps: expected a non-negative integer"),
    "negative step": (put(["steps"], -3), "steps: expected a non-negative integer"),
}


@pytest.mark.parametrize("edit, field", PROFILE_EDITS.values(), ids=PROFILE_EDITS.keys())
def test_a_hand_edited_profile_is_refused_naming_the_file_and_field(tmp_path, profile_dict, edit, field):
    with pytest.raises(ProfileError, match="profile.json") as info:
        Profile.load(edited(tmp_path, profile_dict, edit, "profile.json"))
    assert field in str(info.value)


def test_a_one_step_profile_with_nan_variance_still_loads(tmp_path, profile_dict):
    data = copy.deepcopy(profile_dict)
    for entry in data["layers"].values():
        entry["param_grad"].update(steps=1, var="nan", nsr="nan")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert math.isnan(Profile.load(path)["0"].param_grad.var)


@pytest.mark.parametrize("load, error", [(Plan.load, PlanError), (Profile.load, ProfileError)], ids=["plan", "profile"])
def test_deeply_nested_json_is_refused_not_a_recursion_error(tmp_path, load, error):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(error, match="deep.json: JSON nested too deeply"):
        load(path)


@pytest.mark.parametrize("command", [["review", "--logdir", "{tmp}/tb"], ["export", "--to", "torchao"]])
def test_the_cli_refuses_a_hand_edited_plan_in_one_line(tmp_path, plan_dict, capsys, command):
    data = copy.deepcopy(plan_dict)
    data["predicted"]["bytes"] = math.nan
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    args = [a.format(tmp=tmp_path) for a in command]
    assert main([args[0], str(path), *args[1:]]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "predicted.bytes: NaN" in err and str(path) in err


def test_export_refuses_a_plan_with_a_1d_linear_weight_in_one_line(tmp_path, capsys):
    fp8 = json.loads(json.dumps(Plan.uniform(model(), "fp8_e4m3").to_dict()))  # export reads an FP8 Linear's shape
    path = edited(tmp_path, fp8, put(["fingerprint", "0", "params", "weight"], [8]), "plan.json")
    out = tmp_path / "plan_torchao.py"
    assert main(["export", str(path), "--to", "torchao", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and not out.exists()
    assert str(path) in err and "fingerprint['0'].params['weight']: a Linear's weight is a matrix" in err


# -- paths and sizes -------------------------------------------------------------------------------


def test_a_uniform_plan_of_a_model_without_matrix_products_is_refused_at_creation():
    with pytest.raises(PlanError, match="Plan.uniform: Sequential has no layer that runs a matrix product"):
        Plan.uniform(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)), "bf16")


# -- files autoprec wrote itself, damaged ----------------------------------------------------------


@pytest.mark.parametrize("text", ["{not json", "[]", '{"layers": ["0", "2"], "device": "cpu", "times": {"bf16": 5}}', "[" * 100_000])
def test_a_damaged_timing_cache_is_ignored_with_a_warning(tmp_path, caplog, text):
    from autoprec.costs.times_cache import load_times

    path = tmp_path / "costs.json"
    path.write_text(text, encoding="utf-8")
    with caplog.at_level("WARNING", logger="autoprec.costs.model"):
        assert load_times(path, ["0", "2"], ["bf16"], "cpu") is None
    assert "ignoring the damaged timing cache" in caplog.text and "costs.json" in caplog.text


# -- a hand-edited format no kernel serves -----------------------------------------------------------


class Attention(nn.Module):
    """Two heads; the score and value products are batched matmuls of activations."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Weighted(nn.Module):
    """A hand-written projection: one 2-D matmul of the input by its own matrix (a kernel serves it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.w


def attention_model():
    torch.manual_seed(0)
    return nn.Sequential(Attention(), Weighted())


@pytest.mark.parametrize("traced", [False, True], ids=["from-the-file", "with-example-inputs"])
def test_a_hand_edited_int8_attention_product_is_refused_without_emulation_naming_layer_and_op(tmp_path, traced):
    net, x = attention_model(), torch.randn(2, 4, 8)
    plan = Plan.uniform(net, "bf16", (x,)).with_layers({"0": "int8", "1": "int8", "0.qkv": "int8"})
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    with pytest.raises(PlanError) as info:
        loaded.validate(net, (x,) if traced else None, allow_emulation=False)
    message = str(info.value)
    assert "'0': int8 has no kernel for matmul on batched operands" in message
    assert "'1'" not in message and "'0.qkv'" not in message  # a 2-D product of a matrix and a linear are served
    loaded.validate(net, (x,) if traced else None)  # emulation allowed: it runs


def test_the_batched_product_the_plan_refuses_is_the_one_the_runtime_emulates():
    import autoprec as ap

    net, x = attention_model(), torch.randn(2, 4, 8)
    plan = Plan.uniform(net, "int8", (x,))
    with pytest.warns(ap.EmulationWarning, match="'0' runs matmul in int8 emulated"), ap.apply_plan(net, plan, validate=False) as runtime, torch.no_grad():
        net(x)
    batched = {fqn for fqn, info in plan.fingerprint.items() if info.batched}
    assert batched == {"0"} and set(runtime.emulated_layers()) == batched


def test_a_fingerprints_batched_ops_must_be_among_its_ops(tmp_path, plan_dict):
    path = edited(tmp_path, plan_dict, put(["fingerprint", "0", "batched"], ["bmm"]), "plan.json")
    with pytest.raises(PlanError, match=r"fingerprint\['0'\]\.batched: expected a list of names from \.ops"):
        Plan.load(path)
