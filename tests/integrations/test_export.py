"""`autoprec export PLAN.json --to torchao`: the mapping, and the written module run by real torchao."""

import copy
import importlib.util

import pytest
import torch
from torch import nn

from autoprec import Format, LayerPrecision, Plan, Scaling, ScalingMode, apply_plan
from autoprec.cli import main
from autoprec.coverage import LayerInfo
from autoprec.integrations.export import torchao_export
from autoprec.formats import Granularity


class Net(nn.Module):
    """Linear layers torchao can and cannot convert, and a module that runs its own matmul."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24)  # 24 is not a multiple of 16
        self.head = nn.Linear(24, 16)

    def forward(self, x):
        return self.head(self.odd(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


class Gram(nn.Module):
    def forward(self, x):
        return x @ x.transpose(-1, -2)


class WithGram(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.gram = Gram()

    def forward(self, x):
        return self.gram(self.fc(x))


def _plan(model, example, formats, **scaling):
    base = Plan.uniform(model, Format.FP32, example)
    layers = {fqn: LayerPrecision(formats.get(fqn, Format.FP32), scaling=scaling.get(fqn, Scaling())) for fqn in base.layers}
    return Plan(layers, fingerprint=base.fingerprint)


def test_each_layer_is_converted_or_listed_with_its_reason():
    model, x = Net(), torch.randn(4, 32)
    plan = _plan(
        model, x,
        {"fc1": Format.FP8_E4M3, "fc2": Format.FP8_E4M3, "odd": Format.FP8_E4M3, "head": Format.INT8},
        fc2=Scaling(granularity=Granularity.ROW, mode=ScalingMode.CURRENT),
        fc1=Scaling(mode=ScalingMode.DELAYED),
    )
    export = torchao_export(plan)
    # Row-wise forward, per-tensor backward, E5M2 gradients: as the runtime runs fc2 (torchao's
    # "rowwise" would take E4M3 gradients per row).
    assert dict(export.recipes) == {"tensorwise": ("fc1",), "rowwise_forward_e5m2_gradients": ("fc2",)}
    assert "Linear(32, 24) has a dimension not divisible by 16" in export.not_converted["odd"]
    assert "no INT8 path" in export.not_converted["head"]
    assert export.notes == ("fc1: delayed scaling in the plan; torchao scales currently (per tensor)",)
    assert export.autocast == "bfloat16"  # autoprec runs any lowered plan under BF16 autocast
    assert torchao_export(_plan(model, x, {})).autocast is None


@pytest.mark.parametrize("granularity, tiles", [(Granularity.BLOCK, "block scaling (1x128 / 128x128)"),
                                                 (Granularity.MX, "MXFP8 (1x32 tiles, power-of-two scales)")])
def test_a_block_scaled_or_mxfp8_layer_exports_as_torchaos_closest_recipe_and_says_so(granularity, tiles):
    model, x = Net(), torch.randn(4, 32)
    plan = _plan(model, x, {"fc1": Format.FP8_E4M3}, fc1=Scaling(granularity=granularity))
    export = torchao_export(plan)
    assert dict(export.recipes) == {"rowwise": ("fc1",)}
    assert export.notes == (f"fc1: {tiles} in the plan; torchao's float8 training has no such recipe, its closest is rowwise",)


def _grad_plan(model, x, layers):
    """``layers``: fqn -> (granularity, grad_format) of an FP8 E4M3 layer; the rest FP32."""
    base = Plan.uniform(model, Format.FP32, x)
    lowered = {fqn: LayerPrecision(Format.FP8_E4M3, grad, Scaling(granularity)) for fqn, (granularity, grad) in layers.items()}
    return Plan({**base.layers, **lowered}, fingerprint=base.fingerprint)


def _written(tmp_path, plan):
    path = plan.save(tmp_path / "plan.json")
    assert main(["export", str(path), "--to", "torchao"]) == 0
    return _load(tmp_path / "plan_torchao.py")


def _recipe_of(module, fqn):
    return next(recipe for recipe, fqns in module.RECIPES.items() if fqn in fqns)


@pytest.mark.parametrize("granularity, grad, forward", [
    (Granularity.TENSOR, Format.FP8_E5M2, "TENSORWISE"),
    (Granularity.TENSOR, Format.FP8_E4M3, "TENSORWISE"),
    (Granularity.ROW, Format.FP8_E5M2, "AXISWISE"),
    (Granularity.ROW, Format.FP8_E4M3, "AXISWISE"),
])
def test_a_layers_gradient_format_and_scaling_are_kept_by_the_exported_config(tmp_path, granularity, grad, forward):
    """Issue 59: torchao's "tensorwise" gave an E4M3-gradient layer E5M2 gradients, its "rowwise"
    an E5M2-gradient layer E4M3 ones, per row; neither was said."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]')")
    model, x = Net(), torch.randn(4, 32)
    exported = _written(tmp_path, _grad_plan(model, x, {"fc1": (granularity, grad)}))
    config = exported.make_config(_recipe_of(exported, "fc1"))
    assert config.cast_config_grad_output.target_dtype == grad.dtype
    assert config.cast_config_grad_output_for_grad_weight.target_dtype == grad.dtype
    assert config.cast_config_input.scaling_granularity.name == config.cast_config_weight.scaling_granularity.name == forward
    # The backward's operands per tensor, as the runtime quantizes them; no power-of-2 scales.
    backward = (config.cast_config_grad_output, config.cast_config_input_for_grad_weight, config.cast_config_weight_for_grad_input)
    assert {c.scaling_granularity.name for c in backward} == {"TENSORWISE"}
    assert not config.round_scales_to_power_of_2
    assert exported.NOTES == []


def _fake_fp8(t, dtype, dim=None):
    """``t`` rounded to ``dtype`` with one scale (``dim`` None) or one per slice along ``dim``."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = top / amax
    return (t * scale).clamp(-top, top).to(dtype).float() / scale


def test_a_row_scaled_layer_runs_in_torchao_as_the_runtime_runs_it(tmp_path):
    """The exported config, run by torchao (emulated on CPU), is the runtime's row-wise recipe
    computed by hand: row-wise E4M3 forward, per-tensor E4M3 operands and E5M2 gradients in the
    backward."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]')")
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 32)
    converted = _written(tmp_path, _grad_plan(model, x, {"fc1": (Granularity.ROW, Format.FP8_E5M2)})).convert(model, emulate=True)
    h, g = torch.randn(64, 32, requires_grad=True), torch.randn(64, 64)
    out = converted.fc1(h)
    out.backward(g)
    w, e4m3, e5m2 = converted.fc1.weight.detach(), torch.float8_e4m3fn, torch.float8_e5m2
    x_hat = h.detach()
    expected_out = _fake_fp8(x_hat, e4m3, -1) @ _fake_fp8(w, e4m3, -1).t() + converted.fc1.bias.detach()
    expected_dx = _fake_fp8(g, e5m2) @ _fake_fp8(w, e4m3)
    expected_dw = _fake_fp8(g, e5m2).t() @ _fake_fp8(x_hat, e4m3)
    torch.testing.assert_close(out.detach(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, expected_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(converted.fc1.weight.grad, expected_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity, grad, says", [
    (Granularity.TENSOR, Format.FP32, "FP32 gradients in the plan; torchao's high-precision gradient path fails under autocast"),
    (Granularity.ROW, Format.FP32, "FP32 gradients in the plan"),
    (Granularity.BLOCK, Format.FP8_E5M2, "e5m2 gradients in the plan; torchao's rowwise recipe casts them to e4m3"),
])
def test_an_export_that_changes_a_layers_gradients_names_the_layer_in_the_files_notes(tmp_path, granularity, grad, says):
    model, x = Net(), torch.randn(4, 32)
    exported = _written(tmp_path, _grad_plan(model, x, {"fc1": (granularity, grad), "fc2": (Granularity.TENSOR, Format.FP8_E5M2)}))
    assert any(note.startswith(f"fc1: {says}") for note in exported.NOTES), exported.NOTES
    assert not any(note.startswith("fc2:") for note in exported.NOTES)


def test_a_module_running_its_own_matmul_and_half_layers_are_not_converted():
    model, x = WithGram(), torch.randn(2, 5, 32)
    plan = _plan(model, x, {"fc": Format.BF16, "gram": Format.FP8_E4M3})
    export = torchao_export(plan)
    assert export.converted == ()
    assert "a Gram (its own matmul), not nn.Linear: torchao converts nn.Linear only" in export.not_converted["gram"]
    assert "run it under torch.autocast(torch.bfloat16)" in export.not_converted["fc"]
    assert export.autocast == "bfloat16"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_written_module_runs_the_plans_fp8_layers_in_torchao_as_autoprec_runs_them(tmp_path):
    """torchao (emulated on CPU) and autoprec's runtime quantize the same layers the same way
    (E4M3 per-tensor current scaling): a converted layer's outputs agree far more closely than
    either agrees with FP32, the whole model's error is the same size, and the layers the export
    leaves out stay nn.Linear."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]')")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 32)
    plan = _plan(model, x, {"fc1": Format.FP8_E4M3, "fc2": Format.FP8_E4M3})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["export", str(path), "--to", "torchao"]) == 0
    exported = _load(tmp_path / "plan_torchao.py")
    assert exported.RECIPES == {"tensorwise": ["fc1", "fc2"]}

    converted = exported.convert(copy.deepcopy(model), emulate=True)
    assert [type(converted.get_submodule(n)) for n in ("fc1", "fc2", "odd", "head")] == [Float8Linear, Float8Linear, nn.Linear, nn.Linear]

    h = torch.randn(64, 32)
    reference, theirs = model.fc1(h), converted.fc1(h)
    with apply_plan(model, plan, validate=False):
        ours = model.fc1(h).float()
    quantization_error = (theirs - reference).norm()
    assert quantization_error > 0  # FP8 really ran
    assert (theirs - ours).norm() < 0.25 * quantization_error

    assert exported.AUTOCAST_DTYPE is torch.bfloat16
    with torch.autocast("cpu", dtype=exported.AUTOCAST_DTYPE):
        theirs = converted(x).float()
    with apply_plan(model, plan, validate=False):
        ours = model(x).float()
    reference = model(x)
    ratio = (theirs - reference).norm() / (ours - reference).norm()
    assert 0.5 < ratio < 2.0, ratio
    theirs.sum().backward()  # torchao's backward runs too
    assert converted.fc1.weight.grad is not None and torch.isfinite(converted.fc1.weight.grad).all()


def test_cli_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.json"), "--to", "torchao"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no such plan file" in err and len(err.splitlines()) == 1
    model, x = Net(), torch.randn(4, 32)
    path = tmp_path / "plan.json"
    Plan.uniform(model, Format.FP8_E4M3, x).save(path)
    assert main(["export", str(path), "--to", "torchao", "--out", str(tmp_path / "not-a-module.py")]) == 1
    err = capsys.readouterr().err.strip()
    assert "a valid module name" in err and len(err.splitlines()) == 1


# Names that broke the written filter: JSON words rewritten as Python ones (null -> None), quotes,
# backslashes, newlines, and a plan file name that ended the module's docstring.
AWKWARD = ["null_proj", "gate_true", "false.up", 'q"uote', "it's", "back\\slash", "new\nline", '"""', "ü.层"]


def test_awkward_layer_names_survive_the_export_exactly(tmp_path):
    fingerprint = {n: LayerInfo("Linear", ("linear",), {"weight": (32, 32)}) for n in AWKWARD}
    layers = {n: LayerPrecision(Format.FP8_E4M3, scaling=Scaling(Granularity.ROW if i % 2 else Granularity.TENSOR)) for i, n in enumerate(AWKWARD)}
    layers["kept \"null\""] = LayerPrecision(Format.FP32)
    fingerprint["kept \"null\""] = LayerInfo("Linear", ("linear",), {"weight": (32, 32)})
    plan_path = Plan(layers, fingerprint).save(tmp_path / 'plan """ \\ "x.json')
    out = tmp_path / "plan_torchao.py"
    assert main(["export", str(plan_path), "--to", "torchao", "--out", str(out)]) == 0
    module = _load(out)
    chosen = {fqn for recipe in module.RECIPES for fqn in AWKWARD + ["kept \"null\"", "None_proj", "gate_True"] if module.module_filter_fn(recipe)(None, fqn)}
    assert chosen == set(AWKWARD)
    assert set(module.NOT_CONVERTED) == {"kept \"null\""}
    assert plan_path.name in module.__doc__


def test_the_export_lists_the_recomputed_modules_beside_the_filter(tmp_path):
    """RECOMPUTE: the plan's blocks with recompute true, the modules to wrap in checkpointing."""

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Net() for _ in range(3))

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    model, x = Blocks(), torch.randn(4, 32)
    plan = Plan.uniform(model, Format.FP8_E4M3, x).with_recompute({"layers.0": True, "layers.1": False, "layers.2": True})
    path = plan.save(tmp_path / "plan.json")
    assert main(["export", str(path), "--to", "torchao"]) == 0
    exported = _load(tmp_path / "plan_torchao.py")
    assert exported.RECOMPUTE == ["layers.0", "layers.2"]
    assert "layers.0.fc1" in exported.RECIPES["tensorwise"]  # the filter beside it still names layers
    assert torchao_export(Plan.uniform(Net(), Format.FP8_E4M3)).recompute == ()


def test_the_export_names_the_layers_whose_gradients_travel_compressed(tmp_path):
    """GRAD_COMM: the plan's per-layer gradient communication where it is not FP32."""
    plan = Plan.uniform(Net(), Format.FP8_E4M3)
    first, second = list(plan.layers)[:2]
    path = plan.with_comm({first: "int8", second: "fp32"}).save(tmp_path / "plan.json")
    assert main(["export", str(path), "--to", "torchao"]) == 0
    assert _load(tmp_path / "plan_torchao.py").GRAD_COMM == {first: "int8"}
    assert torchao_export(plan).grad_comm == {}
