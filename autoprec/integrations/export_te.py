"""A plan for Transformer Engine: `autoprec export PLAN.json --to transformer-engine` writes a
Python module whose ``CustomRecipe`` gives each ``te.Linear`` and tensor role the quantizer the
plan runs, for Transformer Engine 2.20 (`TE_RELEASE`).

Transformer Engine 2.20 asks a ``CustomRecipe``'s ``qfactory(role)`` for every quantizer a module
uses; ``role`` (a ``QuantizerRole``) names the module type (``"linear"``), the tensor
(``"input"``, ``"weight"``, ``"grad_output"``; other slots get ``None``) and the module's ``name``
(its constructor's ``name=``; the written ``name_modules(model)`` sets it to each planned layer's
fully-qualified name). TE's ``Linear`` takes the forward GEMM from the input's and weight's row-wise
data, the input gradient's from the output gradient's row-wise and the weight's column-wise data,
the weight gradient's from the column-wise data of the output gradient and the input
(``module/linear.py``); a ``HybridQuantizer`` gives the two directions different quantizers. The
export maps each layer of the plan onto those roles, as autoprec's runtime runs it
(`runtime.gemm.Fp8Linear`):

- FP8, per-tensor current scaling: ``Float8CurrentScalingQuantizer`` per role in the plan's
  formats (E4M3 or E5M2 input, E4M3 weight, the gradient format); where the input and gradient
  are both E5M2 the weight gradient takes an E4M3 copy of the output gradient
  (`gemm.weight_grad_format`; cuBLAS refuses E5M2 x E5M2): a hybrid output-gradient quantizer.
- FP8, MXFP8 and NVFP4 with high-precision gradients (``grad_format="fp32"``): the forward's
  quantizers row-wise, the backward from the dequantized forward operands (``IdentityQuantizer``
  column-wise, ``columnwise_source="rowwise_dequantized"``) and the output gradient unquantized,
  as the runtime's high-precision backward does (TE's ``backward_override="dequantized"``, per
  layer).
- A high-precision weight gradient alone (``weight_grad_format="fp32"``, per GEMM): the input's
  column-wise copy its dequantized row-wise values, the output gradient's column-wise copy
  unquantized (a ``HybridQuantizer`` whose row-wise part is the gradient's quantizer for the
  input gradient's GEMM), as `runtime.gemm` multiplies the unrounded gradient by the forward's
  input; delayed scaling then scales the input currently (NOTES).
- Block scaling: ``Float8BlockQuantizer`` (1x128 activations and gradients, 128x128 weights, scales
  not rounded to powers of 2, as the runtime's).
- MXFP8 (``mx``): ``MXFP8Quantizer`` for every role, row- and column-wise (each GEMM's operands
  tiled along its contracted dimension, E8M0 scales rounded up, as `runtime.mx_gemm`).
- NVFP4: ``NVFP4Quantizer`` per role as Transformer Engine's ``NVFP4BlockScaling`` recipe makes
  them, which is what `runtime.nvfp4` computes: the input with the Hadamard transform on its
  column-wise copy (the weight gradient's), the weight in 16x16 blocks, the output gradient
  transformed column-wise and stochastically rounded. TE's transform takes its own fixed signs
  (NOTES): the weight gradient's rounding differs, its expectation does not.
- Delayed scaling: ``DelayedScalingRequest`` for the input and weight with the plan's history,
  reduction and margin; the output gradient scaled currently (the runtime's gradients always are).
- Row-wise scaling: TE 2.20 has no per-row FP8 quantizer; per-tensor current scaling runs (NOTES).
- INT8 (TE has no INT8 GEMM), BF16, FP16 and FP32 layers, and float8 layers that are not
  ``nn.Linear`` or whose dimensions are not multiples of 16: unquantized (``IdentityQuantizer``,
  which keeps the compute dtype), each listed in ``HIGH_PRECISION`` with the reason.

What it cannot carry: a per-tensor margin under current scaling (TE scales to the full range),
FP32 compute of one layer inside a half-precision model (TE computes in the held dtype: build that
module with ``params_dtype=torch.float32`` and run it outside ``torch.autocast``), recomputation per
module (``RECOMPUTE`` lists the plan's: wrap them in activation checkpointing) and per-layer
gradient communication. Pure: no Transformer Engine import here; the written module imports it
inside its functions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

from ..formats import Format, Granularity
from ..plan import Plan, ScalingMode
from ..runtime.gemm import weight_grad_format
from .export import _literal, autocast_dtype, check_fingerprint, float8_linear_problem, write_export

__all__ = ["TE_RELEASE", "TransformerEngineExport", "transformer_engine_export", "write_transformer_engine"]

TE_RELEASE = "2.20.2"
ROLES = ("input", "weight", "grad_output")  # the tensor types of te.Linear's quantizer roles
IDENTITY = ("identity",)
_DTYPES = {Format.FP8_E4M3: "e4m3", Format.FP8_E5M2: "e5m2"}

# A quantizer spec, as the written module's ``make_quantizer`` reads it (a tuple here, a list there):
#   ("identity",)                                  IdentityQuantizer(): unquantized
#   ("current", dtype)                             Float8CurrentScalingQuantizer, dtype "e4m3" / "e5m2"
#   ("block", dtype, dims)                         Float8BlockQuantizer, dims 1 (1x128) or 2 (128x128)
#   ("mx", dtype)                                  MXFP8Quantizer: 1x32 tiles, E8M0 scales, both directions
#   ("nvfp4", hadamard, blocks_2d, stochastic)     NVFP4Quantizer: 16-element blocks, E4M3 and FP32 scales
#   ("delayed", fp8_format, margin, history, algo) DelayedScalingRequest
#   ("hybrid", rowwise spec, columnwise spec, columnwise_source)  HybridQuantizer


@dataclasses.dataclass(frozen=True)
class TransformerEngineExport:
    """A plan's layers as Transformer Engine 2.20's ``CustomRecipe`` runs them (module docstring)."""

    quantizers: Mapping[str, Mapping[str, tuple]]  # fqn -> tensor role -> quantizer spec
    high_precision: Mapping[str, str]  # fqn -> why TE runs it unquantized
    notes: tuple[str, ...]  # "fqn: ..." per quantized layer whose numbers TE changes, and how
    autocast: str | None  # the torch.autocast dtype autoprec runs the plan under (None: all FP32)
    recompute: tuple[str, ...] = ()

    @property
    def quantized(self) -> tuple[str, ...]:
        return tuple(f for f, roles in self.quantizers.items() if any(spec != IDENTITY for spec in roles.values()))

    def summary(self) -> list[str]:
        """What `autoprec export` prints: the layers quantized, by quantizer, and those not."""
        kinds: dict[str, int] = {}
        for fqn in self.quantized:
            kind = self.quantizers[fqn]["input"][0]
            kinds[kind] = kinds.get(kind, 0) + 1
        return [f"{len(self.quantized)} layers quantized by the CustomRecipe ({', '.join(f'{k}: {n}' for k, n in kinds.items()) or 'none'}), "
                f"{len(self.high_precision)} in high precision (see HIGH_PRECISION)"]


def transformer_engine_export(plan: Plan) -> TransformerEngineExport:
    """Map ``plan`` onto Transformer Engine 2.20's quantizer roles (pure; module docstring)."""
    check_fingerprint(plan)
    quantizers: dict[str, dict[str, tuple]] = {}
    high: dict[str, str] = {}
    notes: list[str] = []
    for fqn, lp in plan.layers.items():
        info = plan.fingerprint.get(fqn)
        reason = _high_precision_reason(lp, info)
        if reason is not None:
            high[fqn] = reason
            if info is not None and info.module == "Linear":
                quantizers[fqn] = dict.fromkeys(ROLES, IDENTITY)
            continue
        specs, changes = _specs(lp)
        quantizers[fqn] = specs
        notes.extend(f"{fqn}: {change}" for change in changes)
    return TransformerEngineExport(quantizers, high, tuple(notes), autocast_dtype(plan), plan.recompute)


def _high_precision_reason(lp, info) -> "str | None":
    """Why TE runs a planned layer unquantized, or None where it quantizes it."""
    if lp.format.is_fp8 or lp.format is Format.NVFP4:
        return float8_linear_problem(lp, info, "Transformer Engine's recipe quantizes te.Linear roles only")
    if lp.format is Format.INT8:
        return "int8 in the plan: Transformer Engine has no INT8 GEMM; it stays in high precision"
    if lp.format is Format.FP32:
        return ("fp32 in the plan: TE computes it in the held dtype; build it with params_dtype=torch.float32 and run it outside "
                "torch.autocast to keep FP32")
    return f"{lp.format.value} in the plan: unquantized, under torch.autocast({lp.format.dtype}) as autoprec runs it"


def _specs(lp) -> tuple[dict[str, tuple], list[str]]:
    """The quantizer spec per tensor role of an FP8 or NVFP4 ``nn.Linear`` layer, and what TE runs
    differently from the plan (empty when it keeps the layer's numbers)."""
    if lp.format is Format.NVFP4 and lp.grad_format is Format.FP32:
        # The forward's NVFP4 row-wise (no transform: TE applies it to column-wise copies only),
        # the backward from its dequantized values against an unquantized output gradient.
        return {"input": _dequantized_backward(("nvfp4", False, False, False)), "weight": _dequantized_backward(("nvfp4", False, True, False)),
                "grad_output": IDENTITY}, []
    if lp.format is Format.NVFP4 and lp.high_precision_weight_grad:
        # The input gradient's GEMM as NVFP4BlockScaling's (no transform: row-wise copies), the
        # weight gradient's from the input's dequantized forward copy and the unrounded gradient.
        return {"input": _dequantized_backward(("nvfp4", False, False, False)), "weight": ("nvfp4", False, True, False),
                "grad_output": _unquantized_columns(("nvfp4", False, False, True))}, []
    if lp.format is Format.NVFP4:
        # NVFP4BlockScaling's quantizers (TE 2.20 `quantization.py`): the transform on the
        # column-wise (weight-gradient) copies of the input and output gradient, 2-D weights.
        specs = {"input": ("nvfp4", True, False, False), "weight": ("nvfp4", False, True, False), "grad_output": ("nvfp4", True, False, True)}
        return specs, ["NVFP4: Transformer Engine's Hadamard transform takes its own fixed random signs, autoprec's another fixed draw, "
                       "so the weight gradient's rounding differs (not its expectation)"]
    fwd, grad = lp.format, lp.grad_format
    granularity, mode, margin = lp.scaling.granularity, lp.scaling.mode, lp.scaling.margin
    changes = []
    inp: tuple
    weight: tuple
    grad_spec: tuple
    if granularity is Granularity.ROW:
        changes.append("row-wise scaling in the plan; Transformer Engine 2.20 has no per-row FP8 quantizer: per-tensor current scaling runs")
    if granularity is Granularity.BLOCK:
        # autoprec's blocks: 1x128 activations and gradients, 128x128 weights (DeepSeek-V3's tiles).
        inp, weight = ("block", _DTYPES[fwd], 1), ("block", "e4m3", 2)
        grad_spec = ("block", _DTYPES[grad], 1) if grad.is_fp8 else IDENTITY
    elif granularity is Granularity.MX:
        # MXFP8 both ways: each operand tiled along each GEMM's contracted dimension, power-of-two
        # scales rounded up, as autoprec's emulation (`runtime.mx_gemm`) computes them.
        inp, weight, grad_spec = ("mx", _DTYPES[fwd]), ("mx", "e4m3"), ("mx", _DTYPES[grad]) if grad.is_fp8 else IDENTITY
    elif mode is ScalingMode.DELAYED and grad.is_fp8 and not lp.high_precision_weight_grad:
        history = (margin, lp.scaling.history_len, lp.scaling.reduction.value)
        inp = ("delayed", fwd.value.removeprefix("fp8_").upper(), *history)
        weight = ("delayed", "E4M3", *history)
        grad_spec = _current_grad(fwd, grad)
        changes.append("delayed scaling: TE's starts from scale 1 (an empty history) where autoprec scales the first step from its "
                       "own amax, so the first step's numbers differ")
        if fwd is Format.FP8_E5M2:
            # A module's delayed-scaling requests share one format (TE 2.20's DelayedScalingRequest).
            weight = ("current", "e4m3")
            changes.append("e5m2 forward with delayed scaling in the plan; a TE module's delayed-scaling requests share one format, "
                           "so its e4m3 weight is scaled currently")
    else:
        if mode is ScalingMode.DELAYED:
            changes.append("delayed scaling with a high-precision weight gradient or backward in the plan; TE 2.20's hybrid quantizers take "
                           "no delayed-scaling request, so the forward scales currently")
        inp, weight = ("current", _DTYPES[fwd]), ("current", "e4m3")
        grad_spec = _current_grad(fwd, grad) if grad.is_fp8 else IDENTITY
    if margin and inp[0] != "delayed":
        changes.append(f"scaling margin {margin} in the plan (2**-{margin} of the range); TE's current, block and MXFP8 scaling use the full range")
    if not grad.is_fp8:
        inp, weight = _dequantized_backward(inp), _dequantized_backward(weight)
    elif lp.high_precision_weight_grad:
        inp, grad_spec = _dequantized_backward(inp), _unquantized_columns(grad_spec)
    return {"input": inp, "weight": weight, "grad_output": grad_spec}, changes


def _dequantized_backward(forward: tuple) -> tuple:
    """A role's spec under the runtime's high-precision backward, which multiplies the forward's
    operands dequantized: ``forward`` row-wise, the column-wise copy its dequantized values."""
    return ("hybrid", forward, IDENTITY, "rowwise_dequantized")


def _unquantized_columns(grad_spec: tuple) -> tuple:
    """The output gradient's spec under a high-precision weight gradient: its row-wise copy (the
    input gradient's GEMM) as ``grad_spec``'s, its column-wise copy (the weight gradient's) the
    unquantized gradient."""
    rowwise = grad_spec[1] if grad_spec[0] == "hybrid" else grad_spec
    return ("hybrid", rowwise, IDENTITY, "original")


def _current_grad(fwd: Format, grad: Format) -> tuple:
    """The output gradient's per-tensor spec: its row-wise copy (input gradient's GEMM, against
    the E4M3 weight) in ``grad``, its column-wise copy (weight gradient's GEMM, against the
    input) in the format the runtime gives that GEMM."""
    for_weight = weight_grad_format(fwd, grad)
    if for_weight is grad:
        return ("current", _DTYPES[grad])
    return ("hybrid", ("current", _DTYPES[grad]), ("current", _DTYPES[for_weight]), "original")


_TEMPLATE = '''"""Transformer Engine {release} training of the autoprec plan {source} (sha1 {digest}), exported by autoprec {version}.

    import transformer_engine.pytorch as te
    from {module} import name_modules, recipe

    name_modules(model)                      # each te.Linear's role name = its fully-qualified name
    with te.autocast(recipe=recipe()):       # the CustomRecipe: the plan's quantizer per layer and tensor
        loss = loss_fn(model(x), y)
{autocast_usage}
The model's planned nn.Linear layers must be te.Linear modules at the same names. Quantized:
{n_quantized} layers; in high precision: {n_high} (HIGH_PRECISION says why). NOTES says what TE runs
differently from the plan. Modules the plan recomputes: RECOMPUTE.
"""

TE_RELEASE = {release!r}

# fully-qualified name -> tensor role -> quantizer spec (make_quantizer reads them):
#   ["identity"]                                    unquantized (IdentityQuantizer)
#   ["current", dtype]                              Float8CurrentScalingQuantizer
#   ["block", dtype, dims]                          Float8BlockQuantizer, 1 (1x128) or 2 (128x128) dims
#   ["mx", dtype]                                   MXFP8Quantizer (1x32 tiles, E8M0 scales), row- and column-wise
#   ["nvfp4", hadamard, blocks_2d, stochastic]      NVFP4Quantizer (16-element blocks, E4M3 and FP32 scales)
#   ["delayed", fp8_format, margin, history, algo]  DelayedScalingRequest
#   ["hybrid", rowwise, columnwise, source]         HybridQuantizer
QUANTIZERS = {quantizers}

# planned layers TE runs unquantized, and why
HIGH_PRECISION = {high}

# "layer: what changes", per quantized layer whose numbers TE's quantizers cannot keep
NOTES = {notes}

# autoprec runs this plan under torch.autocast in this dtype (None: every layer FP32)
AUTOCAST_DTYPE = {autocast}

# modules the plan recomputes in the backward: wrap each in non-reentrant activation checkpointing
RECOMPUTE = {recompute}


def make_quantizer(spec):
    """One Transformer Engine quantizer (or delayed-scaling request) from a QUANTIZERS spec."""
    import torch
    from transformer_engine.common.recipe import Format
    from transformer_engine.pytorch.constants import DType
    from transformer_engine.pytorch.quantization import DelayedScalingRequest
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    from transformer_engine.pytorch.tensor.hybrid_tensor import HybridQuantizer
    from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    dtypes = {{"e4m3": DType.kFloat8E4M3, "e5m2": DType.kFloat8E5M2}}
    kind, *args = spec
    if kind == "identity":
        return IdentityQuantizer()
    if kind == "current":
        return Float8CurrentScalingQuantizer(fp8_dtype=dtypes[args[0]], device=torch.device("cuda"), force_pow_2_scales=False, amax_epsilon=0.0)
    if kind == "block":
        return Float8BlockQuantizer(fp8_dtype=dtypes[args[0]], rowwise=True, columnwise=True, amax_epsilon=0.0, force_pow_2_scales=False,
                                    block_scaling_dim=args[1])
    if kind == "mx":
        return MXFP8Quantizer(fp8_dtype=dtypes[args[0]], rowwise=True, columnwise=True)
    if kind == "nvfp4":
        hadamard, blocks_2d, stochastic = args
        return NVFP4Quantizer(fp4_dtype=DType.kFloat4E2M1, rowwise=True, columnwise=True, with_rht=hadamard, with_post_rht_amax=hadamard,
                              with_2d_quantization=blocks_2d, stochastic_rounding=stochastic)
    if kind == "delayed":
        fp8_format, margin, history, algo = args
        return DelayedScalingRequest(fp8_format=Format[fp8_format], margin=margin, amax_history_len=history, amax_compute_algo=algo)
    if kind == "hybrid":
        rowwise, columnwise, source = args
        return HybridQuantizer(rowwise_quantizer=make_quantizer(rowwise), columnwise_quantizer=make_quantizer(columnwise),
                               columnwise_source=source)
    raise ValueError(f"unknown quantizer spec {{spec!r}}")


def qfactory(role):
    """The CustomRecipe's factory: a planned te.Linear's role gets the plan's quantizer; every
    other slot (other modules, unplanned layers, output and input-gradient slots) stays unquantized."""
    layer = QUANTIZERS.get(role.name) if role is not None and role.module_type == "linear" else None
    return make_quantizer(layer.get(role.tensor_type, ["identity"]) if layer is not None else ["identity"])


def recipe(**kwargs):
    """The plan as a ``transformer_engine.common.recipe.CustomRecipe`` (``kwargs``: its other fields)."""
    from transformer_engine.common.recipe import CustomRecipe

    return CustomRecipe(qfactory=qfactory, **kwargs)


def name_modules(model):
    """Set each planned Transformer Engine module's ``name`` (its quantizer roles' name) to its
    fully-qualified name in ``model``; returns the planned names found as no TE module."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    found = set()
    for fqn, module in model.named_modules():
        if fqn in QUANTIZERS and isinstance(module, TransformerEngineBaseModule):
            module.name = fqn
            found.add(fqn)
    return sorted(set(QUANTIZERS) - found)
'''


def write_transformer_engine(plan_path: "str | Path", out: "str | Path | None" = None) -> tuple[Path, TransformerEngineExport]:
    """Export the plan at ``plan_path`` for Transformer Engine (atomically) to ``out`` (default:
    next to the plan, ``<plan stem>_transformer_engine.py``); returns the path written and the mapping."""
    return write_export(plan_path, out, "transformer_engine", transformer_engine_export, _render)


def _render(export: TransformerEngineExport, head: Mapping[str, str]) -> str:
    autocast_usage = (f"    # autoprec runs the plan under torch.autocast(device_type, dtype=torch.{export.autocast}) around the same region\n"
                      if export.autocast else "")
    text = _TEMPLATE.format(
        **head, release=TE_RELEASE, autocast_usage=autocast_usage, n_quantized=len(export.quantized), n_high=len(export.high_precision),
        quantizers=_literal({f: {r: _Inline(s) for r, s in roles.items()} for f, roles in export.quantizers.items()}),
        high=_literal(dict(export.high_precision)), notes=_literal(list(export.notes)),
        autocast=f"torch.{export.autocast}" if export.autocast else "None", recompute=_literal(list(export.recompute)),
    )
    return text.replace("\nTE_RELEASE =", "\nimport torch\n\nTE_RELEASE =", 1) if export.autocast else text


class _Inline:
    """A spec written on one line, as a nested list literal (`_literal` spreads lists out)."""

    def __init__(self, spec: tuple):
        self.spec = spec

    def __repr__(self) -> str:
        return repr(_as_list(self.spec))


def _as_list(spec: tuple) -> list:
    return [_as_list(p) if isinstance(p, tuple) else p for p in spec]
