"""`autoprec export PLAN.json --to torchtitan`: the written module's converters, read by torchtitan
0.3.0's own code. torchtitan cannot be imported on a CPU machine without its training stack
(wandb, datasets, spmd_types), so CI installs its wheel without dependencies and these tests read
its source: the converter Config's fields and recipe names (``ast``), and its ``module_filter_fn``
run as written on the export's ``filter_fqns``. Elsewhere they skip, unless
AUTOPREC_TEST_TORCHTITAN=required."""

import ast
import dataclasses
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec import Format, LayerPrecision, Plan, Scaling, ScalingMode
from autoprec.cli import main
from autoprec.formats import Granularity
from autoprec.integrations.export_torchtitan import TORCHTITAN_RELEASE, torchtitan_export


def _torchtitan_source() -> Path:
    spec = importlib.util.find_spec("torchtitan")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("AUTOPREC_TEST_TORCHTITAN") == "required":
            pytest.fail(f"torchtitan {TORCHTITAN_RELEASE} is not installed (pip install --no-deps torchtitan=={TORCHTITAN_RELEASE})")
        pytest.skip(f"torchtitan {TORCHTITAN_RELEASE} not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    from importlib.metadata import version

    assert version("torchtitan") == TORCHTITAN_RELEASE, "the export targets one release; update TORCHTITAN_RELEASE with the names it uses"
    return root


def _converter_config(root: Path) -> tuple[list[str], tuple[str, ...]]:
    """Float8LinearConverter.Config's own fields and its recipe_name Literal, from torchtitan's source."""
    tree = ast.parse((root / "components" / "quantization" / "float8.py").read_text())
    converter = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Float8LinearConverter")
    config = next(n for n in converter.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    fields = [n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    recipe = next(n for n in config.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "recipe_name")
    literal = tuple(e.value for e in ast.walk(recipe.annotation) if isinstance(e, ast.Constant))
    base = (root / "components" / "quantization" / "__init__.py").read_text()
    assert "model_compile_enabled" in base  # QuantizationConverter.Config's field, which the converters pass
    return fields + ["model_compile_enabled"], literal


def _module_filter_fn(root: Path):
    """torchtitan's ``module_filter_fn`` (components/quantization/utils.py), executed as written."""
    source = (root / "components" / "quantization" / "utils.py").read_text()
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "module_filter_fn")
    namespace = {"Linear": types.SimpleNamespace(Config=object)}  # its annotation's name
    exec(compile(ast.Module([function], type_ignores=[]), "torchtitan/components/quantization/utils.py", "exec"), namespace)
    return namespace["module_filter_fn"]


class Blocks(nn.Module):
    """Names torchtitan's substring filter could confuse: layers.1 and layers.11, wq and wqk."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"wq": nn.Linear(32, 32), "w2": nn.Linear(32, 32)}) for i in (1, 11)})
        self.odd = nn.Linear(32, 24)
        self.head = nn.Linear(24, 16)

    def forward(self, x):
        for i in ("1", "11"):
            x = self.layers[i]["w2"](torch.relu(self.layers[i]["wq"](x)))
        return self.head(self.odd(x))


def _plan(model, x, layers):
    base = Plan.uniform(model, Format.FP32, (x,))
    return Plan({fqn: layers.get(fqn, LayerPrecision(Format.FP32)) for fqn in base.layers}, fingerprint=base.fingerprint)


def _written(tmp_path, plan):
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--out", str(tmp_path / "titan_plan.py")]) == 0
    spec = importlib.util.spec_from_file_location("titan_plan", tmp_path / "titan_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchtitans_own_filter_converts_exactly_the_plans_fp8_layers_with_their_recipe(tmp_path, monkeypatch):
    root = _torchtitan_source()
    fields, recipes = _converter_config(root)
    module_filter_fn = _module_filter_fn(root)
    model, x = Blocks(), torch.randn(4, 32)
    fp8 = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.ROW))
    # torchao's rowwise_with_gw_hp exactly: E4M3 gradients per row, the weight gradient's GEMM high.
    gw_hp = LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.ROW), high_precision_weight_grad=True)
    plan = _plan(model, x, {
        "layers.1.wq": fp8, "layers.11.w2": gw_hp,
        "layers.11.wq": LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP32, scaling=Scaling(mode=ScalingMode.DELAYED)),
        "layers.1.w2": LayerPrecision(Format.BF16), "odd": LayerPrecision(Format.FP8_E4M3), "head": LayerPrecision(Format.INT8),
    })
    written = _written(tmp_path, plan)
    # The converters the module builds, with a Config made of torchtitan's own fields (any other
    # keyword would fail here as it fails in torchtitan).
    Config = dataclasses.make_dataclass("Config", [(f, object, dataclasses.field(default=None)) for f in fields], kw_only=True)
    fake = types.ModuleType("torchtitan.components.quantization")
    fake.Float8LinearConverter = types.SimpleNamespace(Config=Config)
    monkeypatch.setitem(sys.modules, "torchtitan.components.quantization", fake)
    converters = written.converters(model_compile_enabled=True)
    assert [c.recipe_name for c in converters] == ["rowwise", "rowwise_with_gw_hp"] and set(recipes) >= {c.recipe_name for c in converters}
    # torchtitan's filter, on each Linear's name and shape, per converter in order: a module
    # converted by an earlier one is no longer a Linear config for the next.
    converted, linear = {}, {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    for config in converters:
        assert config.model_compile_enabled is True and config.emulate is False
        for fqn, m in linear.items():
            if fqn not in converted and module_filter_fn(types.SimpleNamespace(in_features=m.in_features, out_features=m.out_features), fqn, config.filter_fqns):
                converted[fqn] = config.recipe_name
    assert converted == {"layers.1.wq": "rowwise", "layers.11.w2": "rowwise_with_gw_hp", "layers.11.wq": "rowwise_with_gw_hp"}
    assert "not divisible by 16" in written.NOT_CONVERTED["odd"] and "no INT8 path" in written.NOT_CONVERTED["head"]
    assert "one dtype" in written.NOT_CONVERTED["layers.1.w2"]
    assert written.TORCHTITAN_RELEASE == TORCHTITAN_RELEASE
    notes = "\n".join(written.NOTES)
    assert "layers.11.wq: tensor scaling in the plan" in notes and "layers.11.wq: delayed scaling in the plan" in notes
    assert "layers.1.wq: e5m2 gradients in the plan; torchtitan's recipes cast gradients to e4m3" in notes
    assert "layers.11.wq: fp32 gradients in the plan; rowwise_with_gw_hp" in notes
    assert "layers.11.w2" not in notes  # nothing it runs differs from the plan


def test_a_filter_entry_inside_a_converted_layers_name_is_named_in_the_notes():
    # torchtitan matches filter_fqns as substrings: skipping "blocks.w" (a BF16 layer) would skip
    # "blocks.w_out" (FP8) as well; the export cannot express it and says so.
    model = nn.Sequential()
    model.add_module("w", nn.Linear(32, 32))
    model.add_module("w_out", nn.Linear(32, 32))
    plan = _plan(model, torch.randn(4, 32), {"w": LayerPrecision(Format.BF16), "w_out": LayerPrecision(Format.FP8_E4M3)})
    export = torchtitan_export(plan)
    assert dict(export.recipes) == {"rowwise": ("w_out",)} and export.filter_fqns["rowwise"] == ("w",)
    assert any(n.startswith("w_out: torchtitan skips a module when a filter_fqns entry is a substring of its name, and 'w' is") for n in export.notes)


def _mx_converter_fields(root: Path, module: str = "mx", name: str = "MXFP8LinearConverter") -> list[str]:
    """A by-name converter's (MXFP8's, NVFP4's) Config fields, and its conversion rule, from torchtitan's source."""
    source = (root / "components" / "quantization" / f"{module}.py").read_text()
    converter = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    config = next(n for n in converter.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    # The rule the test applies below: a Linear config is converted when an fqns entry is a substring of its name.
    assert "any(target_fqn in fqn for target_fqn in fqns)" in source
    return [n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)] + ["model_compile_enabled"]


def _converted(root: Path, written, model, by_name: str, monkeypatch) -> tuple[set, set, object]:
    """The written converters built with stand-ins of torchtitan's Config classes (their fields
    from its source), and what each converts of ``model``'s Linear layers by torchtitan's own
    rules: (converted by the ``by_name`` converter, by the float8 one, the by-name Config)."""
    float8_fields, _ = _converter_config(root)
    module, cls = {"MXFP8LinearConverter": ("mx", by_name), "NVFP4LinearConverter": ("nvfp4", by_name)}[by_name]
    fake = types.ModuleType("torchtitan.components.quantization")
    for name, fields in (("Float8LinearConverter", float8_fields), (by_name, _mx_converter_fields(root, module, cls))):
        config = dataclasses.make_dataclass(f"{name}Config", [(f, object, dataclasses.field(default=None)) for f in fields], kw_only=True)
        setattr(fake, name, types.SimpleNamespace(Config=config))
    monkeypatch.setitem(sys.modules, "torchtitan.components.quantization", fake)
    float8, named = written.converters(model_compile_enabled=True)
    assert type(named).__name__ == f"{by_name}Config" and named.model_compile_enabled is True
    module_filter_fn = _module_filter_fn(root)
    linear = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    by_named = {fqn for fqn in linear if any(target in fqn for target in named.fqns)}
    by_float8 = {fqn for fqn, m in linear.items()
                 if module_filter_fn(types.SimpleNamespace(in_features=m.in_features, out_features=m.out_features), fqn, float8.filter_fqns)}
    return by_named, by_float8, named


def test_mxfp8_layers_go_to_torchtitans_mxfp8_converter_by_name_and_the_float8_ones_skip_them(tmp_path, monkeypatch):
    root = _torchtitan_source()
    model, x = Blocks(), torch.randn(4, 32)
    mx = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.MX))
    plan = _plan(model, x, {"layers.1.wq": mx, "layers.11.wq": mx, "layers.1.w2": LayerPrecision(Format.FP8_E4M3),
                            "layers.11.w2": LayerPrecision(Format.BF16)})
    written = _written(tmp_path, plan)
    by_mx, by_float8, _ = _converted(root, written, model, "MXFP8LinearConverter", monkeypatch)
    assert by_mx == {"layers.1.wq", "layers.11.wq"} and by_float8 == {"layers.1.w2"}
    assert not any(n.startswith(("layers.1.wq", "layers.11.wq")) for n in written.NOTES)  # torchao's RCEIL scales: the plan's numbers


def test_an_mxfp8_entry_inside_another_layers_name_is_named_in_the_notes():
    model = nn.Sequential()
    model.add_module("w", nn.Linear(32, 32))
    model.add_module("w_out", nn.Linear(32, 32))
    mx = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.MX))
    export = torchtitan_export(_plan(model, torch.randn(4, 32), {"w": mx, "w_out": LayerPrecision(Format.BF16)}))
    assert dict(export.recipes) == {"mxfp8": ("w",)}
    assert any(n.startswith("w: torchtitan's MXFP8 converter converts a module when an fqns entry is a substring of its name, so 'w_out'")
               for n in export.notes)


class Wide(nn.Module):
    """Linear layers NVFP4 can take in torchtitan (dimensions divisible by 128), one it cannot."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"wq": nn.Linear(128, 128), "w2": nn.Linear(128, 256)}) for i in (1, 11)})
        self.head = nn.Linear(256, 24)

    def forward(self, x):
        for i in ("1", "11"):
            x = self.layers[i]["w2"](torch.relu(self.layers[i]["wq"](x)))[:, :128]
        return self.head(torch.cat([x, x], dim=1))


def test_nvfp4_layers_go_to_torchtitans_nvfp4_converter_by_name(tmp_path, monkeypatch):
    """The plan's NVFP4 layers (NVIDIA's "last blocks in BF16" rule, chosen per layer) go to
    torchtitan's NVFP4LinearConverter, read by its own substring rule; a dimension not divisible
    by 128 stays in high precision with the reason, and the float8 converter skips them all."""
    root = _torchtitan_source()
    assert "_NVFP4_BLOCK = 128" in (root / "components" / "quantization" / "nvfp4.py").read_text()
    model, x = Wide(), torch.randn(4, 128)
    nv = LayerPrecision(Format.NVFP4)
    plan = _plan(model, x, {"layers.1.wq": nv, "layers.1.w2": nv, "layers.11.wq": LayerPrecision(Format.FP8_E4M3), "head": nv})
    written = _written(tmp_path, plan)
    by_nv, by_float8, _ = _converted(root, written, model, "NVFP4LinearConverter", monkeypatch)
    assert by_nv == {"layers.1.wq", "layers.1.w2"} and by_float8 == {"layers.11.wq"}
    assert "not divisible by 128" in written.NOT_CONVERTED["head"]
    assert any(n.startswith("layers.1.wq: torchao's NVFP4Linear takes its own fixed Hadamard signs") for n in written.NOTES)


def test_a_high_precision_backward_on_mxfp8_and_nvfp4_layers_is_named_where_torchtitan_cannot_keep_it():
    """torchao's MXFP8Linear and NVFP4Linear run their backward in their own format: layers the
    plan gives a high-precision backward (``grad_format="fp32"``) are converted, each with a note."""
    model = Wide()
    mx_high = LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP32, scaling=Scaling(granularity=Granularity.MX))
    nv_high = LayerPrecision(Format.NVFP4, grad_format=Format.FP32)
    nv_wgrad = LayerPrecision(Format.NVFP4, high_precision_weight_grad=True)
    export = torchtitan_export(_plan(model, torch.randn(4, 128), {"layers.1.wq": mx_high, "layers.1.w2": nv_high, "layers.11.wq": LayerPrecision(Format.NVFP4),
                                                                  "layers.11.w2": nv_wgrad}))
    assert dict(export.recipes) == {"mxfp8": ("layers.1.wq",), "nvfp4": ("layers.1.w2", "layers.11.wq", "layers.11.w2")}
    notes = set(export.notes)
    assert "layers.1.wq: fp32 gradients in the plan (a high-precision backward); torchao's MXFP8Linear runs both backward GEMMs in MXFP8 e4m3" in notes
    assert "layers.1.w2: fp32 gradients in the plan (a high-precision backward); torchao's NVFP4Linear runs both backward GEMMs in NVFP4" in notes
    assert not any(n.startswith("layers.11.wq: fp32 gradients") for n in notes)
    assert "layers.11.w2: an fp32 weight gradient in the plan; torchao's NVFP4Linear runs both backward GEMMs in NVFP4" in notes
