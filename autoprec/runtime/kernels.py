"""Autograd functions that run a matrix product in FP8 or INT8 and save its inputs in that format.

- `Fp8Gemm`: ``a @ b`` through ``torch._scaled_mm``. Forward operands in the layer's format
  (E4M3 by default), the incoming gradient in ``grad_format`` (E5M2 by default), FP32 results
  for the gradients so FP32 master weights receive FP32 gradients.
- `Int8Gemm`: ``a @ b`` through ``torch._int_mm`` (INT8 × INT8 → INT32) with a calibrated
  activation scale, per-output-channel weight scales and outlier input channels computed apart in
  FP32. The backward pass runs in FP32 from the INT8-saved activation (INT8 has no useful
  gradient format).
- `StoredInFormat`: any other matrix product (convolution, batched matmul, attention, einsum) for
  which no low-precision kernel exists: inputs are rounded to the format and saved in it, the
  product is computed in FP32, and backward recomputes it from the saved low-precision inputs.
  This is emulation of the compute (not of the memory), and the run report says so per layer.

Weights (tensors derived from a Parameter) are never saved: backward re-quantizes them from the
FP32 master copy, which costs one elementwise pass instead of a weight-sized buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from ..formats import AmaxHistory, Format, Granularity, amax, dequantize, quantize, scale_from_amax
from ..plan import LayerPrecision, ScalingMode

__all__ = ["GemmSlot", "Fp8Gemm", "Int8Gemm", "StoredInFormat", "scaled_mm_shape_ok", "int_mm_shape_ok"]


@dataclasses.dataclass
class GemmSlot:
    """Scaling state of one matrix product inside a layer (the i-th product its forward runs).

    Histories live as long as the runtime, so delayed scaling sees earlier steps. ``int8`` holds
    the INT8 calibration state (`Int8Calibrator`) for the activation operand.
    """

    a_history: AmaxHistory
    b_history: AmaxHistory
    int8: Any = None
    kernel_calls: int = 0
    emulated_calls: int = 0

    def state_dict(self) -> dict:
        return {
            "a_history": self.a_history.state_dict(),
            "b_history": self.b_history.state_dict(),
            "int8": self.int8.state_dict() if self.int8 is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.a_history.load_state_dict(state["a_history"])
        self.b_history.load_state_dict(state["b_history"])
        if self.int8 is not None and state.get("int8") is not None:
            self.int8.load_state_dict(state["int8"])


def scaled_mm_shape_ok(device: torch.device, m: int, k: int, n: int) -> bool:
    """cuBLASLt FP8 GEMMs need K and N divisible by 16; the CPU kernel takes any shape."""
    return device.type != "cuda" or (k % 16 == 0 and n % 16 == 0)


def int_mm_shape_ok(device: torch.device, m: int, k: int, n: int) -> bool:
    """CUDA ``_int_mm`` needs M > 16 and K, N divisible by 8; the CPU kernel takes any shape."""
    return device.type != "cuda" or (m > 16 and k % 8 == 0 and n % 8 == 0)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same 2-D matrix laid out column-major (what ``_scaled_mm`` wants for its second operand)."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _operand_scale(
    x: torch.Tensor, fmt: Format, precision: LayerPrecision, history: AmaxHistory, columns: bool, record: bool
) -> torch.Tensor:
    """Scale for one GEMM operand: per tensor (delayed or current) or per row (columns for b)."""
    scaling = precision.scaling
    if scaling.granularity is Granularity.ROW:
        per_row = amax(x.t() if columns else x, Granularity.ROW)
        scale = scale_from_amax(per_row, fmt, scaling.margin)
        return scale.t() if columns else scale
    current = amax(x)
    if scaling.mode is ScalingMode.DELAYED and record:
        return history.next_scale(current, fmt, scaling.margin)
    if scaling.mode is ScalingMode.DELAYED and history.recorded:
        return scale_from_amax(history.reduced(), fmt, scaling.margin)
    return scale_from_amax(current, fmt, scaling.margin)


def _autocast_off(method):
    """Run an autograd method with autocast off on the device of its first tensor argument:
    CPU autocast changes what ``torch._scaled_mm`` computes (measured: 0.03 absolute error on a
    (64x256)·(256x128) product), and the kernels manage their dtypes themselves."""

    @functools.wraps(method)
    def wrapped(ctx, *args):
        device_type = next(a.device.type for a in args if torch.is_tensor(a))
        with torch.autocast(device_type, enabled=False):
            return method(ctx, *args)

    return wrapped


def _grad_quantized(grad: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The incoming gradient in ``fmt`` with a current per-tensor scale (gradients drift too fast
    for a history; one extra reduction per backward GEMM)."""
    scale = scale_from_amax(amax(grad), fmt)
    return quantize(grad, fmt, scale), scale


class Fp8Gemm(torch.autograd.Function):
    """``out = a @ b (+ bias)`` with FP8 operands through ``torch._scaled_mm``.

    a: (M, K) activation; b: (K, N), a weight when ``b_is_weight`` (then re-quantized from the
    FP32 master in backward instead of saved). Saves a in FP8 (1 byte per element). ``record``:
    append this step's amaxes to the delayed-scaling histories (training steps, not evaluation).
    """

    @staticmethod
    @_autocast_off
    def forward(ctx, a, b, bias, precision: LayerPrecision, slot: GemmSlot, b_is_weight: bool, record: bool):
        fmt = precision.format
        sa = _operand_scale(a, fmt, precision, slot.a_history, columns=False, record=record)
        sb = _operand_scale(b, fmt, precision, slot.b_history, columns=True, record=record)
        aq = quantize(a, fmt, sa)
        bq = quantize(b, fmt, sb)
        out = torch._scaled_mm(aq, _col_major(bq), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
        if bias is not None:
            out = out + bias.float()
        ctx.precision = precision
        ctx.b_is_weight = b_is_weight
        ctx.has_bias = bias is not None
        ctx.save_for_backward(aq, sa, b if b_is_weight else bq, sb)
        return out

    @staticmethod
    @_autocast_off
    def backward(ctx, grad_out):
        aq, sa, b_saved, sb = ctx.saved_tensors
        precision: LayerPrecision = ctx.precision
        fmt, gfmt = precision.format, precision.grad_format
        grad_out = grad_out.float()
        # Backward GEMMs contract over the dimensions the forward scales ran along when scaling is
        # per row, so those operands are brought back to one scale per tensor first.
        if sa.dim() != 0:
            a = dequantize(aq, sa)
            sa = scale_from_amax(amax(a), fmt)
            aq = quantize(a, fmt, sa)
        if ctx.b_is_weight or sb.dim() != 0:
            b = b_saved if ctx.b_is_weight else dequantize(b_saved, sb)
            sb = scale_from_amax(amax(b), fmt)
            bq = quantize(b, fmt, sb)
        else:
            bq = b_saved
        grad_a = grad_b = None
        if gfmt is Format.FP32:
            a32, b32 = dequantize(aq, sa), dequantize(bq, sb)
            if ctx.needs_input_grad[0]:
                grad_a = grad_out @ b32.t()
            if ctx.needs_input_grad[1]:
                grad_b = a32.t() @ grad_out
        else:
            gq, sg = _grad_quantized(grad_out, gfmt)
            if ctx.needs_input_grad[0]:
                # (M, N) @ (N, K): b^T must be column-major, i.e. b row-major.
                bt = bq.contiguous().t()
                grad_a = torch._scaled_mm(gq, bt, scale_a=sg.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
            if ctx.needs_input_grad[1]:
                # grad_b^T = g^T (N, M) @ a (M, K): each operand needs one layout copy this way.
                grad_bt = torch._scaled_mm(
                    gq.t().contiguous(), _col_major(aq), scale_a=sg.reciprocal(), scale_b=sa.reciprocal(), out_dtype=torch.float32
                )
                grad_b = grad_bt.t()
        grad_bias = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_a, grad_b, grad_bias, None, None, None, None


class Int8Gemm(torch.autograd.Function):
    """``out = a @ b (+ bias)`` with INT8 operands through ``torch._int_mm``.

    a: (M, K) activation, scaled per tensor with the calibrated scale (or per row with ROW
    granularity); b: (K, N) weight, one scale per output column. Outlier input channels
    (``outliers``, indices into K) are computed apart in FP32. Saves a in INT8 plus the outlier
    columns in FP32.
    """

    @staticmethod
    @_autocast_off
    def forward(ctx, a, b, bias, precision: LayerPrecision, slot: GemmSlot, b_is_weight: bool, record: bool):
        calibrator = slot.int8
        calibrator.observe(a)
        outliers = calibrator.outliers  # LongTensor of channel indices, possibly empty
        a_main = a
        if outliers.numel():
            a_main = a.index_fill(1, outliers, 0.0)
        sa = calibrator.scale(a_main)
        sb = scale_from_amax(amax(b.t(), Granularity.ROW), Format.INT8).t()  # (1, N)
        aq = quantize(a_main, Format.INT8, sa)
        bq = quantize(b, Format.INT8, sb)
        acc = torch._int_mm(aq, bq)
        out = acc.float() * sa.reciprocal() * sb.reciprocal()
        a_outliers = a[:, outliers].float() if outliers.numel() else None
        if a_outliers is not None:
            out = out + a_outliers @ b[outliers].float()
        if bias is not None:
            out = out + bias.float()
        ctx.b_is_weight = b_is_weight
        ctx.has_bias = bias is not None
        ctx.save_for_backward(aq, sa, b if b_is_weight else bq, sb, outliers, a_outliers if a_outliers is not None else aq.new_zeros(0))
        return out

    @staticmethod
    @_autocast_off
    def backward(ctx, grad_out):
        aq, sa, b_saved, sb, outliers, a_outliers = ctx.saved_tensors
        grad_out = grad_out.float()
        b = b_saved.float() if ctx.b_is_weight else dequantize(b_saved, sb)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = grad_out @ b.t()
        if ctx.needs_input_grad[1]:
            a = dequantize(aq, sa)
            if outliers.numel():
                a[:, outliers] = a_outliers
            grad_b = a.t() @ grad_out
        grad_bias = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_a, grad_b, grad_bias, None, None, None, None


def _flat(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Block scaling tiles 2-D matrices; other ranks are viewed as (rows, last dim)."""
    return x.reshape(-1, x.shape[-1]) if granularity is Granularity.BLOCK and x.dim() != 2 else x


class StoredInFormat(torch.autograd.Function):
    """Run ``fn(*inputs)`` in FP32 on inputs rounded to ``fmt``, saving them in ``fmt``.

    ``inputs`` are tensors; ``is_weight[i]`` marks those derived from parameters (rounded for the
    forward but re-derived from the FP32 master in backward, not saved). ``scaler(i, x)`` returns
    ``(scale, granularity, block)`` for input i. Backward recomputes ``fn`` under autograd from the
    saved inputs (one extra forward of the op) and rounds the incoming gradient to ``grad_fmt``
    first. ``fn`` must be pure (no in-place on its inputs).
    """

    @staticmethod
    @_autocast_off
    def forward(ctx, fn: Callable, fmt: Format, grad_fmt: Format, scaler: Callable, is_weight: tuple, *inputs):
        saved, codecs, dequantized = [], [], []
        for i, x in enumerate(inputs):
            if not torch.is_tensor(x) or not x.is_floating_point():
                saved.append(x)
                codecs.append(None)
                dequantized.append(x)
                continue
            scale, granularity, block = scaler(i, x)
            q = quantize(_flat(x, granularity), fmt, scale, granularity, block)
            dequantized.append(dequantize(q, scale, granularity, block).reshape(x.shape))
            saved.append(x if is_weight[i] else q)
            codecs.append((scale, granularity, block, x.shape))
        with torch.no_grad():
            out = fn(*dequantized)
        ctx.fn, ctx.fmt, ctx.grad_fmt, ctx.is_weight, ctx.codecs = fn, fmt, grad_fmt, is_weight, codecs
        ctx.tensor_index = [i for i, x in enumerate(saved) if torch.is_tensor(x)]
        ctx.others = [None if torch.is_tensor(x) else x for x in saved]
        ctx.save_for_backward(*[saved[i] for i in ctx.tensor_index])
        return out

    @staticmethod
    @_autocast_off
    def backward(ctx, grad_out):
        values = list(ctx.others)
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            values[i] = t
        leaves = []
        for i, x in enumerate(values):
            codec = ctx.codecs[i]
            if codec is not None:
                scale, granularity, block, shape = codec
                q = quantize(_flat(x, granularity), ctx.fmt, scale, granularity, block) if ctx.is_weight[i] else x
                x = dequantize(q, scale, granularity, block).reshape(shape).requires_grad_(ctx.needs_input_grad[5 + i])
            values[i] = x
            leaves.append(x)
        if ctx.grad_fmt is not Format.FP32:
            g_scale = scale_from_amax(amax(grad_out), ctx.grad_fmt)
            grad_out = dequantize(quantize(grad_out, ctx.grad_fmt, g_scale), g_scale, dtype=grad_out.dtype)
        with torch.enable_grad():
            out = ctx.fn(*values)
        wanted = [x for x in leaves if torch.is_tensor(x) and x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True)) if wanted else iter(())
        result = [next(grads) if torch.is_tensor(x) and x.requires_grad else None for x in leaves]
        return (None, None, None, None, None, *result)
