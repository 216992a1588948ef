"""`autoprec export PLAN.json --to transformer-engine`: the written CustomRecipe, built against
Transformer Engine 2.20.2's own source, reproduces autoprec's runtime.

Transformer Engine cannot be imported without CUDA libraries, so CI installs its pure-Python wheel
without dependencies into a folder of its own (``AUTOPREC_TE_SOURCE``, set by ``.ci/run``; unset,
these tests skip) and the tests read it: every name the written module imports must be defined
where it imports it from, and its quantizers are built by stand-ins whose constructors take
exactly the parameters of TE's own (``ast``), so a wrong keyword fails here as it would in TE.
The quantizers the written ``qfactory`` builds are then run by an emulator of TE's ``Linear``
(forward GEMM from the input's and weight's row-wise data, input gradient from the output
gradient's row-wise and the weight's column-wise data, weight gradient from the column-wise data
of both) in plain PyTorch, against autoprec's own runtime on the same layer, bit for bit."""

import ast
import dataclasses
import enum
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec import Format, LayerPrecision, Plan, Scaling, ScalingMode, apply_plan
from autoprec.cli import main
from autoprec.device import block_scaled_form
from autoprec.formats import Granularity
from autoprec.integrations.export_te import TE_RELEASE, transformer_engine_export
from autoprec.runtime.nvfp4 import hadamard_blocks, nvfp4_cast


def _te_source() -> Path:
    folder = os.environ.get("AUTOPREC_TE_SOURCE")
    if not folder:
        pytest.skip(f"AUTOPREC_TE_SOURCE unset (pip install --no-deps --target DIR transformer-engine=={TE_RELEASE})")
    root = Path(folder) / "transformer_engine"
    assert root.is_dir(), f"AUTOPREC_TE_SOURCE={folder} holds no transformer_engine package"
    assert (Path(folder) / f"transformer_engine-{TE_RELEASE}.dist-info").is_dir(), "the export targets one release; update TE_RELEASE"
    return root


class Net(nn.Module):
    """Linear layers for each kind of quantizer, one TE cannot quantize, and a module's own matmul."""

    def __init__(self):
        super().__init__()
        names = ("tensor", "e4m3_grads", "high_grads", "e5m2_forward", "row", "block", "mx", "delayed", "bf16", "int8")
        self.fc = nn.ModuleDict({n: nn.Linear(128, 128) for n in names})
        with torch.random.fork_rng():  # drawn apart: the other layers and the tests' inputs draw what they drew before it
            self.fc["nvfp4"] = nn.Linear(128, 128)
        with torch.random.fork_rng():
            self.fc["mx_high"] = nn.Linear(128, 128)
            self.fc["nvfp4_high"] = nn.Linear(128, 128)
        with torch.random.fork_rng():
            for name in ("tensor_wgrad", "block_wgrad", "mx_wgrad", "nvfp4_wgrad"):
                self.fc[name] = nn.Linear(128, 128)
        self.odd = nn.Linear(128, 24)

    def forward(self, x):
        y = sum(layer(x) for layer in self.fc.values())
        return self.odd(y) @ self.odd(y).transpose(0, 1)


LAYERS = {
    "fc.tensor": LayerPrecision(Format.FP8_E4M3),
    "fc.e4m3_grads": LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP8_E4M3),
    "fc.high_grads": LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP32),
    "fc.e5m2_forward": LayerPrecision(Format.FP8_E5M2),
    "fc.row": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.ROW)),
    "fc.block": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.BLOCK)),
    "fc.mx": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.MX)),
    "fc.nvfp4": LayerPrecision(Format.NVFP4),
    # "Forward low, backward high" (TE's backward_override="dequantized") in the tiled formats.
    "fc.mx_high": LayerPrecision(Format.FP8_E4M3, grad_format=Format.FP32, scaling=Scaling(granularity=Granularity.MX)),
    "fc.nvfp4_high": LayerPrecision(Format.NVFP4, grad_format=Format.FP32),
    # Per GEMM: the weight gradient's product alone in high precision.
    "fc.tensor_wgrad": LayerPrecision(Format.FP8_E4M3, high_precision_weight_grad=True),
    "fc.block_wgrad": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.BLOCK), high_precision_weight_grad=True),
    "fc.mx_wgrad": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.MX), high_precision_weight_grad=True),
    "fc.nvfp4_wgrad": LayerPrecision(Format.NVFP4, high_precision_weight_grad=True),
    "fc.delayed": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(mode=ScalingMode.DELAYED, history_len=8, margin=1)),
    "fc.bf16": LayerPrecision(Format.BF16),
    "fc.int8": LayerPrecision(Format.INT8),
    "odd": LayerPrecision(Format.FP8_E4M3),
}


def _plan(model, x, layers):
    base = Plan.uniform(model, Format.FP32, (x,))
    return Plan({fqn: layers.get(fqn, LayerPrecision(Format.FP32)) for fqn in base.layers}, fingerprint=base.fingerprint)


def _written(tmp_path, plan, name="te_plan"):
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "transformer-engine", "--out", str(tmp_path / f"{name}.py")]) == 0
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- Transformer Engine's names, from its source -----------------------------------------------


def _definitions(path: Path) -> dict[str, ast.AST]:
    """The top-level names a TE module defines (classes, functions, assignments, imports)."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
    return names


def _stand_in(name: str, node: ast.AST, calls: list):
    """A class taking exactly the constructor parameters of TE's ``node``: ``__init__``'s for a
    plain class, the annotated fields for a dataclass; an enum's members for an enum."""
    assert isinstance(node, ast.ClassDef), f"{name} is not a class in Transformer Engine {TE_RELEASE}"
    bases = {ast.unparse(b) for b in node.bases}
    if bases & {"Enum", "IntEnum"} or name == "DType":
        members = [t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
        return enum.Enum(name, members)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        args = init.args
        params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args.posonlyargs + args.args][1:]
        params += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in args.kwonlyargs]
    else:  # a dataclass: its fields, all keyword-able
        fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        params = [inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY) for f in fields]
    signature = inspect.Signature(params)

    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)  # TypeError on a parameter TE does not have
        self.kwargs = dict(bound.arguments)
        calls.append(self)

    return type(name, (), {"__init__": __init__, "__repr__": lambda self: f"{name}({self.kwargs})"})


def _install_transformer_engine(root: Path, written, monkeypatch) -> list:
    """Every ``from transformer_engine... import X`` of the written module, checked against TE's
    source and satisfied with stand-ins; returns the list each construction is appended to."""
    calls: list = []
    imports = [n for n in ast.walk(ast.parse(Path(written.__file__).read_text())) if isinstance(n, ast.ImportFrom)
               and n.module.startswith("transformer_engine")]
    assert imports, "the written module imports nothing from Transformer Engine"
    for node in imports:
        path = root.parent / node.module.replace(".", "/")
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert path.is_file(), f"{node.module} is no module of Transformer Engine {TE_RELEASE}"
        defined = _definitions(path)
        module = sys.modules.get(node.module) if node.module in sys.modules and hasattr(sys.modules[node.module], "_te_stand_in") else None
        if module is None:
            module = types.ModuleType(node.module)
            module._te_stand_in = True
            monkeypatch.setitem(sys.modules, node.module, module)
        for alias in node.names:
            assert alias.name in defined, f"{alias.name} is not defined in {node.module} (Transformer Engine {TE_RELEASE})"
            setattr(module, alias.name, _stand_in(alias.name, defined[alias.name], calls))
    for parent in {m.rsplit(".", i)[0] for m in [n.module for n in imports] for i in range(1, m.count(".") + 1)}:
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    return calls


def _role(root: Path):
    """TE's QuantizerRole, its fields read from its source."""
    node = _definitions(root / "pytorch" / "quantization.py")["QuantizerRole"]
    fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
    assert fields == ["module_type", "tensor_type", "name"]
    return dataclasses.make_dataclass("QuantizerRole", [(f, str, dataclasses.field(default="")) for f in fields], frozen=True)


def _linear_roles(root: Path) -> tuple[str, ...]:
    """The tensor types TE 2.20's ``Linear.get_quantizer_roles`` gives its named roles."""
    source = (root / "pytorch" / "module" / "linear.py").read_text()
    method = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "get_quantizer_roles")
    return tuple(k.value.value for k in ast.walk(method) if isinstance(k, ast.keyword) and k.arg == "tensor_type")


# -- Transformer Engine's Linear, emulated ------------------------------------------------------

_DTYPES = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}


def _current(t, dtype):
    # autoprec's scale arithmetic (amax times 1/max, then a division); TE multiplies by max/amax,
    # which can round a value lying on a tie the other way (the export's module docstring).
    inv = t.abs().amax() * (1.0 / torch.finfo(dtype).max)
    return (t / inv).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() * inv


def _tiles(t, dtype, rows, cols):
    """Per-tile scaling of 2-D ``t`` in ``rows`` x ``cols`` tiles (dimensions multiples of them)."""
    m, n = t.shape
    tiles = t.reshape(m // rows, rows, n // cols, cols)
    inv = tiles.abs().amax(dim=(1, 3), keepdim=True) * (1.0 / torch.finfo(dtype).max)
    return ((tiles / inv).clamp(-448, 448).to(dtype).float() * inv).reshape(m, n)


def _operand(q, t, direction, held):
    """The values a GEMM takes of ``t`` from TE quantizer ``q`` (a stand-in) in ``direction``
    ("row" or "column"): FP32 dequantized values, or the held dtype's for an unquantized one."""
    kind, kw = type(q).__name__, q.kwargs
    if kind == "IdentityQuantizer":
        return t.to(held)
    if kind == "HybridQuantizer":
        if direction == "row":
            return _operand(kw["rowwise_quantizer"], t, "row", held)
        source = t if kw["columnwise_source"] == "original" else _operand(kw["rowwise_quantizer"], t, "row", held).to(held)
        return _operand(kw["columnwise_quantizer"], source, "column", held)
    if kind == "NVFP4Quantizer":
        return _nvfp4(q, t, direction)
    dtype = _DTYPES[kw["fp8_dtype"].name]
    t = t.float()
    if kind == "Float8CurrentScalingQuantizer":
        assert kw["force_pow_2_scales"] is False  # as autoprec's scales
        return _current(t, dtype)
    if kind == "Float8BlockQuantizer":
        assert kw["force_pow_2_scales"] is False
        if kw["block_scaling_dim"] == 2:
            return _tiles(t, dtype, 128, 128)
        return _tiles(t, dtype, 1, 128) if direction == "row" else _tiles(t.t(), dtype, 1, 128).t()
    if kind == "MXFP8Quantizer":
        assert kw["rowwise"] and kw["columnwise"]
        return _mx(t, dtype) if direction == "row" else _mx(t.t(), dtype).t()
    raise AssertionError(f"no emulation of {kind}")


def _nvfp4(q, t, direction):
    """TE's NVFP4Quantizer as its parameters configure it: 16x16 blocks (``with_2d_quantization``,
    the same values both ways) or 1x16 blocks along the direction's rows; the Hadamard transform
    (``with_rht``) on the column-wise copy only, here with autoprec's signs (TE's are another
    fixed draw); ``stochastic_rounding`` from the default generator. The cast itself is
    autoprec's, checked against the published definition in tests/runtime/test_nvfp4.py: what is
    tested here is the mapping of the plan onto TE's parameters."""
    kw = q.kwargs
    assert kw["fp4_dtype"].name == "kFloat4E2M1" and kw["rowwise"] and kw["columnwise"]
    assert kw["with_post_rht_amax"] == kw["with_rht"]  # the amax of what is cast, as autoprec's
    t = t.float()
    if kw["with_2d_quantization"]:
        return nvfp4_cast(t, square=True, stochastic=kw["stochastic_rounding"]).dequantize()[: t.shape[0], : t.shape[1]]
    a = t if direction == "row" else t.t()
    if direction == "column" and kw["with_rht"]:
        a = (a.reshape(a.shape[0], -1, 16) @ hadamard_blocks(a.device)).reshape(a.shape)
    values = nvfp4_cast(a, stochastic=kw["stochastic_rounding"]).dequantize()[: a.shape[0], : a.shape[1]]
    return values if direction == "row" else values.t()


def _mx(t, dtype):
    """MXFP8 of 2-D ``t`` (columns a multiple of 32) along its rows, as TE computes it: one E8M0
    scale per 32 elements, the power of two at or above amax / max (TE's float_to_e8m0 rounds up),
    here from the exponent computed in float64."""
    m, n = t.shape
    tiles = t.reshape(m, n // 32, 32)
    amax = tiles.abs().amax(dim=-1, keepdim=True).double()
    scale = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(dtype).max))).float()
    return ((tiles / scale).clamp(-448, 448).to(dtype).float() * scale).reshape(m, n)


class _TELinear(torch.autograd.Function):
    """TE's Linear with one quantizer per role: which direction of which tensor each GEMM takes
    (module docstring); GEMMs accumulate in FP32 on FP32 values, or run in the held dtype where an
    operand is unquantized."""

    @staticmethod
    def forward(ctx, x, w, quantizers, held):
        ctx.save_for_backward(x, w)
        ctx.quantizers, ctx.held = quantizers, held
        a, b = _operand(quantizers["input"], x, "row", held), _operand(quantizers["weight"], w, "row", held)
        return (a.float() @ b.float().t()).to(held)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        q, held = ctx.quantizers, ctx.held
        # Each GEMM in the held dtype where its output-gradient copy is unquantized, else in FP32.
        row_compute, column_compute = (held if _unquantized(q["grad_output"], d) else torch.float32 for d in ("row", "column"))
        dx = _operand(q["grad_output"], g, "row", held).to(row_compute) @ _operand(q["weight"], w, "column", held).to(row_compute)
        dw = _operand(q["grad_output"], g, "column", held).to(column_compute).t() @ _operand(q["input"], x, "column", held).to(column_compute)
        return dx, dw.float(), None, None


def _unquantized(q, direction) -> bool:
    """Whether quantizer ``q`` (a stand-in) leaves ``direction``'s copy unquantized."""
    kind, kw = type(q).__name__, q.kwargs
    if kind == "HybridQuantizer":
        return _unquantized(kw["rowwise_quantizer" if direction == "row" else "columnwise_quantizer"], direction)
    return kind == "IdentityQuantizer"


# -- the tests ----------------------------------------------------------------------------------


def test_the_written_recipe_builds_each_layers_quantizers_with_transformer_engines_own_parameters(tmp_path, monkeypatch):
    root = _te_source()
    model, x = Net(), torch.randn(8, 128)
    written = _written(tmp_path, _plan(model, x, LAYERS))
    calls = _install_transformer_engine(root, written, monkeypatch)
    Role = _role(root)
    roles = _linear_roles(root)
    assert roles == ("input", "weight", "grad_output")
    built = {fqn: {r: written.qfactory(Role("linear", r, fqn)) for r in roles} for fqn in LAYERS}

    def kinds(fqn):
        return {r: type(q).__name__ for r, q in built[fqn].items()}

    # Per-tensor current scaling, the plan's formats per GEMM operand.
    tensor = built["fc.tensor"]
    assert kinds("fc.tensor") == dict.fromkeys(roles, "Float8CurrentScalingQuantizer")
    assert [tensor[r].kwargs["fp8_dtype"].name for r in roles] == ["kFloat8E4M3", "kFloat8E4M3", "kFloat8E5M2"]
    assert built["fc.e4m3_grads"]["grad_output"].kwargs["fp8_dtype"].name == "kFloat8E4M3"
    # High-precision gradients: FP8 forward, the backward from the dequantized operands.
    high = built["fc.high_grads"]
    assert kinds("fc.high_grads") == {"input": "HybridQuantizer", "weight": "HybridQuantizer", "grad_output": "IdentityQuantizer"}
    assert high["input"].kwargs["columnwise_source"] == "rowwise_dequantized"
    assert type(high["weight"].kwargs["columnwise_quantizer"]).__name__ == "IdentityQuantizer"
    # E5M2 forward: an E4M3 weight; the weight gradient's GEMM takes an E4M3 copy of the gradient.
    e5m2 = built["fc.e5m2_forward"]
    assert e5m2["input"].kwargs["fp8_dtype"].name == "kFloat8E5M2" and e5m2["weight"].kwargs["fp8_dtype"].name == "kFloat8E4M3"
    grad = e5m2["grad_output"].kwargs
    assert (grad["rowwise_quantizer"].kwargs["fp8_dtype"].name, grad["columnwise_quantizer"].kwargs["fp8_dtype"].name) == ("kFloat8E5M2", "kFloat8E4M3")
    # Block scaling: 1x128 activations and gradients, 128x128 weights.
    block = built["fc.block"]
    assert [block[r].kwargs["block_scaling_dim"] for r in roles] == [1, 2, 1]
    # MXFP8: every role, both directions, E4M3 (the plan's E4M3 gradients).
    assert kinds("fc.mx") == dict.fromkeys(roles, "MXFP8Quantizer")
    assert [built["fc.mx"][r].kwargs["fp8_dtype"].name for r in roles] == ["kFloat8E4M3"] * 3
    # NVFP4: TE's NVFP4BlockScaling roles: the transform on the input's and the gradient's
    # column-wise copies, 16x16 weight blocks, the gradient stochastically rounded.
    assert kinds("fc.nvfp4") == dict.fromkeys(roles, "NVFP4Quantizer")
    nv = {r: built["fc.nvfp4"][r].kwargs for r in roles}
    assert [(nv[r]["with_rht"], nv[r]["with_2d_quantization"], nv[r]["stochastic_rounding"]) for r in roles] == [
        (True, False, False), (False, True, False), (True, False, True)]
    assert any(n.startswith("fc.nvfp4: NVFP4: Transformer Engine's Hadamard transform") for n in written.NOTES)
    # MXFP8 and NVFP4 with a high-precision backward: the forward's quantizer row-wise (NVFP4's
    # without the transform), the backward from its dequantized values, the gradient unquantized.
    for fqn, kind in (("fc.mx_high", "MXFP8Quantizer"), ("fc.nvfp4_high", "NVFP4Quantizer")):
        assert kinds(fqn) == {"input": "HybridQuantizer", "weight": "HybridQuantizer", "grad_output": "IdentityQuantizer"}, fqn
        for role in ("input", "weight"):
            kw = built[fqn][role].kwargs
            assert type(kw["rowwise_quantizer"]).__name__ == kind and type(kw["columnwise_quantizer"]).__name__ == "IdentityQuantizer"
            assert kw["columnwise_source"] == "rowwise_dequantized"
    nv_high = {r: built["fc.nvfp4_high"][r].kwargs["rowwise_quantizer"].kwargs for r in ("input", "weight")}
    assert [(nv_high[r]["with_rht"], nv_high[r]["with_2d_quantization"], nv_high[r]["stochastic_rounding"]) for r in ("input", "weight")] == [
        (False, False, False), (False, True, False)]
    # Delayed scaling: the plan's history, reduction and margin; gradients scaled currently.
    delayed, scaling = built["fc.delayed"], LAYERS["fc.delayed"].scaling
    for role in ("input", "weight"):
        kw = delayed[role].kwargs
        assert (kw["amax_history_len"], kw["margin"], kw["amax_compute_algo"]) == (scaling.history_len, scaling.margin, scaling.reduction.value)
        assert kw["fp8_format"].name == "E4M3"
    assert type(delayed["grad_output"]).__name__ == "Float8CurrentScalingQuantizer"
    # Unquantized: half, INT8, FP32 layers, unplanned modules, other slots and module types.
    for fqn in ("fc.bf16", "fc.int8", "odd"):
        assert kinds(fqn) == dict.fromkeys(roles, "IdentityQuantizer"), fqn
    for role in (None, Role("linear", "output", "fc.tensor"), Role("dpa", "qkv", "fc.tensor"), Role("linear", "input", "unplanned")):
        assert type(written.qfactory(role)).__name__ == "IdentityQuantizer"
    assert "not divisible by 16" in written.HIGH_PRECISION["odd"] and "no INT8 GEMM" in written.HIGH_PRECISION["fc.int8"]
    assert any(n.startswith("fc.row: row-wise scaling in the plan") for n in written.NOTES)
    assert not any(n.startswith("fc.delayed: scaling margin") for n in written.NOTES)  # delayed requests carry the margin
    assert any(n.startswith("fc.delayed: delayed scaling: TE's starts from scale 1") for n in written.NOTES)
    # The recipe: TE's CustomRecipe with the factory.
    recipe = written.recipe()
    assert type(recipe).__name__ == "CustomRecipe" and recipe.kwargs["qfactory"] is written.qfactory
    assert written.TE_RELEASE == TE_RELEASE and calls


def test_name_modules_names_each_planned_te_module_after_its_path(tmp_path, monkeypatch):
    root = _te_source()
    model, x = Net(), torch.randn(8, 128)
    written = _written(tmp_path, _plan(model, x, LAYERS))
    _install_transformer_engine(root, written, monkeypatch)
    Base = sys.modules["transformer_engine.pytorch.module.base"].TransformerEngineBaseModule

    class TELinear(nn.Linear, Base):  # a TE module as name_modules sees it: a TransformerEngineBaseModule
        def __init__(self, *args):
            nn.Linear.__init__(self, *args)
            self.name = None

    te_model = Net()
    te_model.fc["tensor"] = TELinear(128, 128)
    te_model.fc["block"] = TELinear(128, 128)
    missing = written.name_modules(te_model)
    assert te_model.fc["tensor"].name == "fc.tensor" and te_model.fc["block"].name == "fc.block"
    assert "fc.tensor" not in missing and "fc.e4m3_grads" in missing  # still an nn.Linear: TE never sees it


def block_kernels() -> bool:
    return block_scaled_form("cpu")[0]


CASES = ["fc.tensor", "fc.e4m3_grads", "fc.high_grads", "fc.e5m2_forward", "fc.block", "fc.mx", "fc.nvfp4", "fc.mx_high", "fc.nvfp4_high",
         "fc.tensor_wgrad", "fc.block_wgrad", "fc.mx_wgrad", "fc.nvfp4_wgrad"]


@pytest.mark.parametrize("fqn", CASES)
def test_transformer_engines_linear_with_the_written_quantizers_reproduces_autoprecs_runtime(tmp_path, monkeypatch, fqn):
    root = _te_source()
    torch.manual_seed(0)
    model, x = Net(), torch.randn(128, 128)
    written = _written(tmp_path, _plan(model, x, {fqn: LAYERS[fqn]}))
    _install_transformer_engine(root, written, monkeypatch)
    Role = _role(root)
    quantizers = {r: written.qfactory(Role("linear", r, fqn)) for r in ("input", "weight", "grad_output")}
    layer = model.get_submodule(fqn)
    layer.bias = None  # TE's GEMM takes no bias here; the runtime fuses it
    single = nn.Sequential(layer)
    plan = _plan(single, x, {"0": LAYERS[fqn]})
    held = written.AUTOCAST_DTYPE or torch.float32  # TE's held compute dtype: the autocast autoprec runs the plan under

    xa = x.clone().requires_grad_()
    runtime = apply_plan(single, plan)
    with runtime:
        y = single(xa)
    g = torch.randn(y.shape).to(y.dtype)
    draws = torch.get_rng_state()  # NVFP4's stochastic rounding: both backwards draw the same numbers
    y.backward(g)
    xr, wr = x.clone().requires_grad_(), layer.weight.detach().clone().requires_grad_()
    yr = _TELinear.apply(xr, wr, quantizers, held)
    torch.set_rng_state(draws)
    yr.backward(g.to(yr.dtype))

    def error(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert error(y, yr) < 1e-3, "forward"
    assert error(xa.grad, xr.grad) < 1e-5, "input gradient"
    # NVFP4's weight gradient: TE's emulated Linear transforms and quantizes the output gradient
    # after the input gradient's draws, as the runtime does, so the two agree as well.
    assert error(layer.weight.grad, wr.grad) < 1e-5, "weight gradient"
    # A CPU has no block-scaled kernel: the block layer's three GEMMs run emulated, with the kernels'
    # tilings; MXFP8's are emulated everywhere (no sm_100 kernel is built).
    emulated = runtime.report()["0"]["ops"]["linear"].startswith("emulated")
    assert emulated == ((fqn in ("fc.block", "fc.block_wgrad") and not block_kernels())
                        or fqn in ("fc.mx", "fc.nvfp4", "fc.mx_high", "fc.nvfp4_high", "fc.mx_wgrad", "fc.nvfp4_wgrad"))
    # The comparison can fail: the gradient quantized in the other FP8 format misses by far more.
    if fqn in ("fc.tensor", "fc.e4m3_grads"):
        other = "kFloat8E4M3" if quantizers["grad_output"].kwargs["fp8_dtype"].name == "kFloat8E5M2" else "kFloat8E5M2"
        wrong = dict(quantizers, grad_output=type(quantizers["grad_output"])(fp8_dtype=type(quantizers["grad_output"].kwargs["fp8_dtype"])[other],
                                                                                 device="cpu", force_pow_2_scales=False, amax_epsilon=0.0))
        xw = x.clone().requires_grad_()
        _TELinear.apply(xw, layer.weight.detach().clone(), wrong, held).backward(g.to(yr.dtype))
        assert error(xa.grad, xw.grad) > 1e-2
    runtime.remove()


def test_export_of_a_plan_without_fingerprint_is_one_line_and_the_summary_counts(tmp_path, capsys):
    model, x = Net(), torch.randn(8, 128)
    export = transformer_engine_export(_plan(model, x, LAYERS))
    assert set(export.quantized) == {f for f in LAYERS if (LAYERS[f].format.is_fp8 or LAYERS[f].format is Format.NVFP4) and f != "odd"}
    assert export.autocast == "bfloat16"
    plan = _plan(model, x, LAYERS)
    Plan(dict(plan.layers)).save(tmp_path / "bare.json")
    assert main(["export", str(tmp_path / "bare.json"), "--to", "transformer-engine"]) != 0
    err = capsys.readouterr().err
    assert "no fingerprint" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
