"""One planned layer while a runtime lives (`RuntimeLayer`: its precision, quantizers and run
report), and the rules the runtime decides by: whether a layer's products have a kernel on the
device (`kernel_reason`, the one place that decides kernel or emulation; the cost model asks it
too) and which ops are one 2-D GEMM (`as_gemm`).

Costs: made once per layer and runtime; `kernel_reason` probes each ``_scaled_mm`` form once per
process (`device.scaled_mm_form`), never in a forward.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..coverage import layer_name
from ..errors import RuntimeStateError
from ..device import KERNEL_OPS, MX_EMULATED, NVFP4_EMULATED, block_support, canonical_device, format_support, scaled_mm_form
from ..formats import Format, Granularity
from ..plan import LayerPrecision, ScalingMode
from .block_gemm import BLOCK
from .calibration import Int8Calibrator
from .casts import FUSED, PYTORCH, fused_casts
from .gemm import FP8_ALIGN, INT8_ALIGN
from .quantizers import OperandRole, Quantizer, quantizer
from .tensor_parallel import sharded_reason

if TYPE_CHECKING:
    from .triton_cast import FusedCasts

__all__ = ["EmulationWarning", "RuntimeLayer", "as_gemm", "kernel_reason", "map_leaves", "row_scale_form", "row_scaled_outs", "to_fp32", "to_half",
           "unify_dtypes"]


class EmulationWarning(UserWarning):
    """A layer runs its planned format without a real kernel (low-precision storage, FP32 compute)."""


def kernel_reason(precision: LayerPrecision, device: "torch.device | str") -> "str | None":
    """Why the 2-D products of a layer in ``precision`` cannot use a real kernel on ``device``;
    None when they can. The one place that decides kernel or emulation (the cost model asks it too).

    Shapes never force emulation: operands are padded to the kernels' alignment.
    """
    fmt = precision.format
    if fmt is Format.NVFP4:
        return NVFP4_EMULATED
    support = format_support(fmt, device)
    if not support.kernel:
        return support.reason
    granularity = precision.scaling.granularity
    if granularity is Granularity.BLOCK:
        return block_support(fmt, precision.grad_format, device)
    if granularity is Granularity.MX:
        return MX_EMULATED
    if granularity is Granularity.ROW and fmt.is_fp8:
        # Row-wise scales are a form of their own (torch 2.11's CPU kernel refuses them): the
        # forward's exact call, BF16 out (the form every torch with row-wise scaling takes).
        ok, reason = row_scale_form(fmt, torch.bfloat16, device)
        if not ok:
            return reason
    return None


def row_scale_form(fmt: Format, out_dtype: torch.dtype, device: "torch.device | str") -> tuple[bool, str]:
    """Whether the installed torch runs an FP8 forward with row-wise-shaped scales on ``device``:
    ``fmt`` input x E4M3 weight, fused bias, ``out_dtype`` out (probed once, cached)."""
    return scaled_mm_form(canonical_device(device), fmt.dtype, Format.FP8_E4M3.dtype, out_dtype, row_scales=True, bias=True)


def row_scaled_outs(precision: LayerPrecision, device: torch.device) -> frozenset:
    """The half dtypes the FP8 forward kernel of a layer in ``precision`` writes on ``device``
    with its scales in row shape ((M, 1) and (1, N)); empty where it takes 0-d per-tensor scales.
    The one place that decides the scales' shape (`row_scale_form` probes once per process; never
    in a forward, which may be traced by torch.compile).

    Row-wise scaling takes that shape always. Per-tensor E4M3 on CPU takes it too where the
    installed torch does: torch 2.13's CPU kernel runs per-tensor E4M3 x E4M3 through a reference
    path hundreds of times slower than its row-wise one (the same result); CUDA keeps per-tensor
    scales (the row-wise form is as legal there, but slower), and torch 2.11's CPU kernel refuses
    row-shaped ones."""
    fmt, granularity = precision.format, precision.scaling.granularity
    rowwise = granularity is Granularity.ROW
    if not (rowwise or (device.type == "cpu" and fmt is Format.FP8_E4M3 and granularity is Granularity.TENSOR)):
        return frozenset()
    outs = frozenset(d for d in (torch.bfloat16, torch.float16) if row_scale_form(fmt, d, device)[0])
    return outs if rowwise or torch.bfloat16 in outs else frozenset()


def map_leaves(fn: Any, tree: Any) -> Any:
    """``pytree.tree_map(fn, tree)`` without pytree's flatten and unflatten where ``tree`` is a
    tensor or plain tuples, lists and dicts of tensors and scalars: a layer's usual arguments and
    outputs, mapped at every layer call (pytree's walk was about a tenth of a mixed plan's host
    time per layer). Any other object (a model output class, a KV cache) is pytree's to map."""
    kind = type(tree)
    if kind is tuple:
        return tuple(map_leaves(fn, v) for v in tree)
    if kind is list:
        return [map_leaves(fn, v) for v in tree]
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) or kind in _SCALARS:
        return fn(tree)
    return pytree.tree_map(fn, tree)


_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


def to_fp32(value: Any) -> Any:
    if torch.is_tensor(value) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


_HALF = (torch.float16, torch.bfloat16)


def to_half(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors of the other half dtype cast to ``dtype`` (FP16 or
    BF16); FP32 and everything else untouched. One cast kernel per such tensor."""
    def cast(value: Any) -> Any:
        if torch.is_tensor(value) and value.dtype in _HALF and value.dtype != dtype:
            return value.to(dtype)
        return value

    return map_leaves(cast, tree)


# Products no autocast casts, on any device (torch 2.11, 2.13): a half layer casts their operands
# itself, or they would run in the FP32 weights' dtype.
NEVER_AUTOCAST = frozenset({"grouped_mm"})


def to_dtype(tree: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``tree`` cast to ``dtype``."""
    return map_leaves(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tree)


def unify_dtypes(tree: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``tree`` cast to ``dtype`` when they do not already share one dtype.
    ``tree`` is an op's ``(args, kwargs)``: flat ones (most ops' are) are read without pytree,
    whose walk cost 0.1 ms an op, a fifth of a runtime's per-layer host time on a narrow model."""
    args, kwargs = tree
    leaves = (*args, *kwargs.values())
    if any(isinstance(v, (list, tuple, dict)) for v in leaves):
        leaves = tuple(pytree.tree_leaves(tree))
    floats = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(floats) <= 1:
        return tree
    return to_dtype(tree, dtype)


# The operands of each kernel op in their positional order (torch's parameter names).
_OPERANDS = {"linear": ("input", "weight", "bias"), "addmm": ("input", "mat1", "mat2"), "matmul": ("input", "other"), "mm": ("input", "mat2")}


def as_gemm(op: str, func, args, kwargs):
    """``(a (M,K), b (K,N), bias, beta, alpha, out_shape)`` when the op is one 2-D GEMM, else None."""
    if op not in KERNEL_OPS:
        return None
    beta, alpha, bias = 1, 1, None
    # Operands by position, whichever way the caller passed them (I-BERT calls
    # F.linear(x, weight=w, bias=b); torch.matmul(input=a, other=b) is legal too).
    operands = _OPERANDS[op]
    args = (*args, *(kwargs[name] for name in operands[len(args):] if name in kwargs))
    rest = {k: v for k, v in kwargs.items() if k not in operands}
    if op == "linear":
        if len(args) < 2:
            return None
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        b = w.t()
    elif op == "addmm":
        if len(args) < 3:
            return None
        bias, x, b = args[0], args[1], args[2]
        beta, alpha = rest.get("beta", 1), rest.get("alpha", 1)
        if bias.dim() > 1:
            return None
    else:  # matmul / mm, incl. Tensor.__rmatmul__(self, other) == other @ self
        if len(args) < 2 or rest:
            return None
        x, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else (args[0], args[1])
    if not (torch.is_tensor(x) and torch.is_tensor(b)) or x.dim() < 2 or b.dim() != 2:
        return None
    if not (x.is_floating_point() and b.is_floating_point()):
        return None
    return x.reshape(-1, x.shape[-1]), b, bias, beta, alpha, (*x.shape[:-1], b.shape[1])


class RuntimeLayer:
    """One planned layer while the runtime lives: its precision, quantizers and run report."""

    def __init__(self, fqn: str, module: nn.Module, precision: LayerPrecision, device: torch.device):
        self.fqn = fqn
        self.module = module
        self.precision = precision
        self.format = precision.format
        self.low_precision = self.format in (Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8, Format.NVFP4)
        self.device = device
        self.kernel_reason = kernel_reason(precision, device) if self.low_precision else None
        # The half dtype its own weights are stored in (a model loaded in BF16, a LoRA's frozen
        # base), or None: an FP32 layer then casts them up and hands that dtype on.
        self.stored_dtype = next((p.dtype for p in module.parameters(recurse=False) if p.dtype in _HALF), None)
        self.blocks = precision.scaling.granularity is Granularity.BLOCK and self.format.is_fp8
        # E4M3 block scaling with no block-scaled kernel here: the kernels' products and tilings,
        # each GEMM emulated (`block_gemm.emulated_block_mm`); other emulated layers round their
        # inputs once and compute the op in FP32 (`products.emulate`).
        self.block_gemms_emulated = (self.blocks and self.kernel_reason is not None
                                     and precision.format is Format.FP8_E4M3 and precision.grad_format is Format.FP8_E4M3)
        # MXFP8 (`mx_gemm.Fp8MxLinear`): its three products in MX tilings, each GEMM emulated.
        self.mx = precision.scaling.granularity is Granularity.MX and self.format.is_fp8
        # NVFP4 (`nvfp4.Nvfp4Linear`): its three products in NVFP4's blocks, each GEMM emulated.
        self.nvfp4 = self.format is Format.NVFP4
        # Its linear products run the kernels' tilings and scales with emulated GEMMs (block, MX
        # or NVFP4), not `products.emulate`'s one rounding of the inputs.
        self.tiled_gemms_emulated = self.block_gemms_emulated or self.mx or self.nvfp4
        # The half dtypes its FP8 forward kernel writes with row-shaped scales, empty where it
        # takes 0-d ones (`row_scaled_outs`): the one setting its weights' scales and its kernel
        # calls follow.
        self.row_scaled_outs: frozenset = frozenset()
        if self.format.is_fp8 and self.kernel_reason is None:
            self.row_scaled_outs = row_scaled_outs(precision, device)
        # How its FP8 kernel calls quantize: the device's fused Triton casts (chosen once per
        # device, `casts.cast_path`) or None for PyTorch ops; `casts_ran`: what its last eager call used.
        self.casts: "FusedCasts | None" = None
        self.casts_ran = PYTORCH
        self.use_fused_casts(True)
        self.keeps_thread_state = False  # set by its wrapper (`layer_wrappers.LayerWrappers`), when it has one
        self.direct = False  # its product is one kernel call, routed by its wrapper (set there)
        self.inputs: dict[str, Quantizer] = {}
        self.calibrators: dict[str, Int8Calibrator] = {}
        self.weights: dict[tuple, Quantizer] = {}
        # The output gradient's quantizer (stateless, shared by every product of the layer); None
        # where the backward stays in high precision (FP32 gradients, INT8 layers).
        grad_fmt = precision.grad_format
        self.grad: "Quantizer | None" = None
        if (self.format.is_fp8 and grad_fmt.is_fp8) or (self.nvfp4 and grad_fmt is Format.NVFP4):
            self.grad = quantizer(OperandRole.GRAD_OUTPUT, grad_fmt, precision.scaling)
        # Emulated products' quantizers, made here, not at the first product: built there they
        # were traced by torch.compile (a Scaling's field checks), three graph breaks (torch 2.11).
        self._emulation: "dict[OperandRole, Quantizer]" = {}
        if self.low_precision:
            current = dataclasses.replace(precision.scaling, mode=ScalingMode.CURRENT)
            self._emulation = {role: quantizer(role, self.format, current) for role in (OperandRole.INPUT, OperandRole.WEIGHT)}
        # Under tensor parallelism (a DTensor weight, `tensor_parallel`) the ranks its per-tensor
        # amaxes are reduced over; None otherwise.
        self.shard_group: Any = None
        self.rows_split = False  # a row-wise one's: its input rows and weight channels run across the ranks
        self.in_features = 0  # a row-wise one's whole input channels (its weight's, unsharded)
        self.ops: dict[str, str] = {}  # op -> how it ran ("kernel ...", "emulated (...)", "autocast ...")
        self.unwarned: list[str] = []  # ops emulated since the layer's last EmulationWarning

    def use_fused_casts(self, enabled: bool) -> None:
        """An FP8 kernel layer's casts: the device's fused Triton kernels where it has them
        (``enabled``), else PyTorch ops; other layers have none."""
        kernels = self.format.is_fp8 and self.kernel_reason is None
        self.casts = fused_casts(self.device) if enabled and kernels else None
        self.casts_ran = FUSED if self.casts is not None else PYTORCH

    def shard_over(self, group: Any, column_wise: bool = False, in_features: int = 0) -> None:
        """Run as a tensor-parallel layer over ``group`` (`tensor_parallel`; ``column_wise``: its
        weight split by output channels, else by input channels): every per-tensor amax it takes
        from now on (input, weight, output gradient) is max-reduced over the group, row-wise its
        rows' and channels' amaxes too, and its casts are PyTorch ops (the fused kernels reduce
        no amax across ranks). Refuses, in one line, what it cannot run sharded yet
        (`tensor_parallel.sharded_reason`). Row-wise, its INT8 calibration sees its rank's
        slice of the ``in_features`` input channels and freezes the whole input's scale
        (`Int8Calibrator.split_over`). Idempotent."""
        if self.shard_group is group:
            return
        reason = sharded_reason(self.precision, self.kernel_reason)
        if reason is not None:
            raise RuntimeStateError(
                f"layer {self.fqn!r}: {reason}; plan it in FP8 with per-tensor scaling, BF16, FP16 or FP32 (e.g. Plan.with_layers({{...: 'bf16'}}))"
            )
        self.shard_group, self.rows_split, self.in_features = group, not column_wise, in_features
        if self.rows_split:
            for calibrator in self.calibrators.values():  # loaded before the first sharded forward
                calibrator.split_over(group, in_features)
        self.casts, self.casts_ran = None, PYTORCH
        for made in (*self.inputs.values(), *self.weights.values()):
            made.group, made.rows_split = group, self.rows_split
        if self.grad is not None:
            self.grad.group = group

    def input_quantizer(self, key: str) -> Quantizer:
        made = self.inputs.get(key)
        if made is None:
            made = self.inputs[key] = quantizer(OperandRole.INPUT, self.format, self.precision.scaling)
            made.group, made.rows_split = self.shard_group, self.rows_split
        return made

    def calibrator(self, key: str, channels: int) -> Int8Calibrator:
        calibrator = self.calibrators.get(key)
        if calibrator is None:
            calibrator = self.calibrators[key] = Int8Calibrator(self.precision.calibration, channels)
            if self.rows_split:
                calibrator.split_over(self.shard_group, self.in_features)
        return calibrator

    def weight_quantizer(self, key: tuple) -> Quantizer:
        """The kernels' quantizer of the weight ``key``: E4M3 for FP8 layers (legal against E4M3
        and E5M2 inputs and gradients; E5M2 x E5M2 is not), padded to the kernel's alignment
        (128x128 blocks in the block-scaled kernels' layout, `block_gemm`). Made once."""
        made = self.weights.get(key)
        if made is None:
            fmt = Format.INT8 if self.format is Format.INT8 else Format.FP8_E4M3
            align = BLOCK if self.blocks else INT8_ALIGN if fmt is Format.INT8 else FP8_ALIGN
            made = self.weights[key] = quantizer(OperandRole.WEIGHT, fmt, self.precision.scaling, align, bool(self.row_scaled_outs))
            made.group, made.rows_split = self.shard_group, self.rows_split
        return made

    def emulation_quantizers(self) -> "dict[OperandRole, Quantizer]":
        """The input and weight quantizers of emulated products, by role: the layer's format and
        granularity (BLOCK included), current scaling (no state, so no history to share with the
        kernels' quantizers); the gradient's is `grad`. Empty for a layer not in FP8 or INT8."""
        return self._emulation

    def note(self, op: str, how: str) -> None:
        if torch.compiler.is_compiling() or self.ops.get(op) == how:
            return
        if how.startswith("emulated") and not self.ops.get(op, "").startswith("emulated"):
            self.unwarned.append(op)  # said once the layer's forward ends (`warn_emulated`), with its other ops
        self.ops[op] = how

    def warn_emulated(self) -> None:
        """One `EmulationWarning` naming every op this layer emulated since its last one (all of
        them, the first time its forward ends), grouped by why. The only channel: nothing is
        logged, so a user filtering the warning sees it nowhere."""
        ops, self.unwarned = self.unwarned, []
        by_how: dict[str, list[str]] = {}
        for op in ops:
            by_how.setdefault(self.ops[op], []).append(op)
        ways = "; ".join(f"{', '.join(names)} in {self.format.value} {how}" for how, names in by_how.items())
        # stacklevel 5: the line that called the layer (past its forward and Module.__call__'s two frames).
        warnings.warn(f"autoprec: layer {layer_name(self.fqn, self.module)!r} runs {ways}", EmulationWarning, stacklevel=5)
