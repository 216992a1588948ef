"""FP8 and INT8 linear products as autograd functions that obey cuBLASLt's rules on CUDA.

``y = x @ W.T (+ bias)`` with x (M, K) and W (N, K), the layout of ``nn.Linear`` (any other 2-D
product is brought to it by the caller). Three GEMMs per training step:

- forward   ``y  = x  @ W.T``: ``_scaled_mm(xq (M,K) row-major, Wq.T (K,N) column-major)``, the
  bias fused into the kernel, output in the region's half dtype, fast accumulation (as torchao);
- input gradient  ``dx = g @ W``: ``_scaled_mm(gq (M,N) row-major, W (N,K) column-major)``;
- weight gradient ``dW = g.T @ x``: ``_scaled_mm(gq.T (N,M) row-major, xq (M,K) column-major)``,
  in FP32, since it goes straight to the FP32 master weight.

The rules each call meets (``aten/src/ATen/native/cuda/Blas.cpp``, ``_scaled_mm_out_cuda``):
first operand row-major and second column-major; K and N multiples of 16 — K is the token count
in the weight-gradient GEMM, so tokens are padded with zero rows there (zero rows change no
gradient); never E5M2 x E5M2 (weights are E4M3; an E5M2 layer's weight gradient takes an E4M3
copy of the output gradient); per-tensor scales as 0-d FP32 tensors, row-wise as (M, 1) and
(1, N) FP32 with an E4M3 second operand and BF16 output (FP16 too in torch 2.11 on sm_90 with
cuBLAS >= 12.9, where row-wise runs in cuBLASLt; the runtime probes which, `device.scaled_mm_form`). ``_int_mm`` (``_int_mm_out_cuda``): M > 16 and
K, N multiples of 8, so rows and columns are padded the same way.

INT8 layers differentiate in high precision (BF16 on CUDA, FP32 on CPU) from the INT8-saved input
and the FP32 master weight. Scales and casts come from `quantizers` as `QuantizedOperand`s (the
output gradient's quantizer rides in `Fp8Spec`). Saved for backward: the input in its 1-byte
format, the weight's low-precision transpose made in the same forward (shared under
`PlanRuntime.reusing_weights`), and scalars.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

import torch.nn.functional as F

from ..formats import Format, amax, dequantize, inverse_scale, quantize
from .tensor_parallel import amax_over

if TYPE_CHECKING:
    from .quantizers import QuantizedOperand, Quantizer
    from .triton_cast import FusedCasts

__all__ = [
    "Fp8Spec", "Int8Spec", "Fp8Linear", "Int8Linear", "FP8_ALIGN", "INT8_ALIGN", "INT8_MIN_ROWS", "pad_to_multiple", "kernel_bias", "kernel_region",
    "weight_grad_format", "grad_input_dtype", "high_precision_grads",
]

FP8_ALIGN = 16  # _scaled_mm: K and N multiples of 16
INT8_ALIGN = 8  # _int_mm: K and N multiples of 8
INT8_MIN_ROWS = 17  # _int_mm: M > 16


def pad_to_multiple(x: torch.Tensor, rows: int = 1, cols: int = 1, value: float = 0.0) -> torch.Tensor:
    """x (2-D) with rows / columns of ``value`` appended up to the given multiples; x itself when
    already aligned (no copy, no op).

    Zero rows and columns add nothing to a matrix product, so padding a GEMM's operands to the
    kernel's alignment changes no result and no gradient. (Scales are padded with ones.)
    """
    pad_rows, pad_cols = -x.shape[0] % rows, -x.shape[1] % cols
    if pad_rows == 0 and pad_cols == 0:
        return x
    return F.pad(x, (0, pad_cols, 0, pad_rows), value=value)


def kernel_bias(bias: torch.Tensor, dtype: torch.dtype, align: int = FP8_ALIGN) -> torch.Tensor:
    """``bias`` in ``dtype``, padded to the FP8 kernel's N (a multiple of ``align``): one cast
    (and a pad) of N elements per call, never kept (a kept copy would go stale as the weights do)."""
    with torch.no_grad():
        padded = bias.to(dtype)
        if bias.shape[0] % align:
            padded = pad_to_multiple(padded.unsqueeze(0), 1, align).squeeze(0)
    return padded


def kernel_region(t: torch.Tensor) -> "contextlib.AbstractContextManager":
    """Where a scaled GEMM on ``t``'s device is called: a CPU autocast region suspended, else
    nothing. torch 2.11-2.13's CPU ``_scaled_mm`` dequantizes and calls ``mm``, which a CPU
    autocast region intercepts and runs in BF16 (about 0.3 % off the FP32 accumulation a GPU's
    kernel keeps, FP32 output or not); CUDA's kernels are not intercepted."""
    if t.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def grad_input_dtype(x_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a product's input gradient is returned in: the input's own when it is a float
    one the GEMMs write, else ``out_dtype`` (the product's output dtype)."""
    return x_dtype if x_dtype in (torch.float32, torch.bfloat16, torch.float16) else out_dtype


def high_precision_grads(g: torch.Tensor, weight_hat: "torch.Tensor | None", input_hat: "torch.Tensor | None"
                         ) -> "tuple[torch.Tensor | None, torch.Tensor | None]":
    """A high-precision backward (FP32 gradients of a low-precision layer): the output gradient
    ``g`` (M, N), unrounded, times the forward's operands dequantized in FP32 and cast to g's
    dtype (a scale cast to a half first would bias every value by its rounding): ``g @ weight_hat``
    with ``weight_hat`` (N, K), and ``g.T @ input_hat`` in FP32 with ``input_hat`` (M, K); None
    for an operand not given (its gradient not needed). Two GEMMs in g's dtype."""
    compute = g.dtype
    grad_x = g @ weight_hat.to(compute) if weight_hat is not None else None
    grad_w = (g.t() @ input_hat.to(compute)).float() if input_hat is not None else None
    return grad_x, grad_w


def weight_grad_format(input_fmt: Format, grad_fmt: Format) -> Format:
    """The format of the output gradient's copy the weight-gradient GEMM takes (against the
    input's): E4M3 where both are E5M2 (cuBLASLt refuses E5M2 x E5M2), else ``grad_fmt``."""
    return Format.FP8_E4M3 if input_fmt is Format.FP8_E5M2 and grad_fmt is Format.FP8_E5M2 else grad_fmt


def _pad_rows_fp8(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended to an FP8 matrix, through its bytes (0x00 is +0.0 in both FP8 formats;
    padding kernels do not all take float8 dtypes)."""
    if q.shape[0] % multiple == 0:
        return q
    return pad_to_multiple(q.view(torch.uint8), multiple, 1).view(q.dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """What one FP8 linear computes: formats, row-wise forward, output dtype and true sizes."""

    input_format: Format  # E4M3 or E5M2
    # The output gradient's quantizer, per tensor (`TensorCurrentQuantizer.quantize_for_gemms`);
    # None: a high-precision backward.
    grad: "Quantizer | None"
    rowwise: bool
    out_dtype: torch.dtype  # the kernel's: the region's, or BF16 where row-shaped scales cannot write it
    # The forward kernel takes its scales in row shape ((M, 1), (1, N)): row-wise, or per-tensor
    # ones passed so (`layers.row_scaled_outs`; the weight's come so from its quantizer).
    row_scaled: bool
    in_features: int
    out_features: int
    # The output gradient's casts by the fused kernels (`casts.fused_casts`), or None: PyTorch ops.
    casts: "FusedCasts | None" = None
    # The ranks x's rows are split over (a row-wise tensor-parallel layer): the backward's
    # per-tensor copy of x takes the whole input's amax, reduced over them. None: x is whole.
    x_group: Any = None
    # The weight gradient's GEMM in high precision (the unrounded output gradient times the saved
    # input dequantized, in FP32) while the input gradient's takes ``grad``
    # (`LayerPrecision.high_precision_weight_grad`).
    weight_grad_high: bool = False


class Fp8Linear(torch.autograd.Function):
    """``x @ W.T + bias`` through ``torch._scaled_mm`` (three GEMMs, see the module docstring).

    Inputs: ``x`` (M, K) in any float dtype, ``weight`` (N, K) and ``bias`` (N,) or None (for
    autograd: their gradients are returned; the bias also goes into the kernel, cast to
    ``spec.out_dtype`` and padded: `kernel_bias`), then the `quantizers.QuantizedOperand`s:
    ``x_q`` the input's (``inv_scale``; ``data`` None: cast here from x, else cast already by
    the fused kernels, (M, K') with its transposed copy (K', M'), which the backward keeps: no
    transpose copy) and ``w_q`` the weight's (``data`` (N', K'), ``transposed`` (K', N') or None
    without an input gradient). Returns (M, N) in ``spec.out_dtype``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, x_q: "QuantizedOperand", w_q: "QuantizedOperand", spec: Fp8Spec):
        fmt = spec.input_format
        x_inv, w_inv = x_q.inv_scale, w_q.inv_scale
        precast = x_q.data is not None
        if precast:
            xq = x_q.data
        else:
            xp = pad_to_multiple(x, 1, FP8_ALIGN)
            # contiguous(): an elementwise cast keeps a transposed input's layout, and the first
            # operand must be row-major.
            xq = quantize(xp, x_inv, fmt).contiguous()
        if spec.rowwise:
            scale_a, scale_b = x_inv, w_inv.t()
        elif spec.row_scaled:
            # w_inv arrives already as the (1, N') row (made with the quantized weight).
            # clone, not contiguous(): a (1, 1) expanded view counts as contiguous with stride 0,
            # which _scaled_mm refuses (a one-token decoding step).
            scale_a, scale_b = x_inv.expand(xq.shape[0], 1).clone(memory_format=torch.contiguous_format), w_inv
        else:
            scale_a, scale_b = x_inv, w_inv
        fused_bias = kernel_bias(bias, spec.out_dtype) if bias is not None else None
        with kernel_region(xq):
            out = torch._scaled_mm(
                xq, w_q.data.t(), scale_a=scale_a, scale_b=scale_b, bias=fused_bias, out_dtype=spec.out_dtype, use_fast_accum=True,
            )
        if out.shape[1] != spec.out_features:
            out = out[:, : spec.out_features]
        if precast:
            xq, x_inv = x_q.transposed, x_q.transposed_inv_scale  # the transposed copy (K', M') and its scale
        elif spec.rowwise:
            # Backward GEMMs contract over the rows the forward scales ran along: they take a
            # per-tensor quantization of the same input, made now from the high-precision x.
            x_inv = inverse_scale(amax_over(amax(xp), spec.x_group), fmt)
            xq = quantize(xp, x_inv, fmt).contiguous()
        ctx.spec = spec
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.x_transposed = precast
        ctx.save_for_backward(xq, x_inv, w_q.transposed, w_q.transposed_inv_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, w_t, w_t_inv = ctx.saved_tensors
        spec: Fp8Spec = ctx.spec
        fused = spec.casts is not None and spec.grad is not None  # the kernels pad g themselves
        g = grad_out if fused else pad_to_multiple(grad_out, 1, FP8_ALIGN)
        grad_x = grad_w = grad_bias = None
        high_weight_grad = spec.grad is None or spec.weight_grad_high
        if high_weight_grad and ctx.needs_input_grad[1]:  # from the low-precision saved input
            x_rows = xq.t()[: g.shape[0]] if ctx.x_transposed else xq
            grad_w = high_precision_grads(g, None, dequantize(x_rows, x_inv))[1]
        if spec.grad is None:  # a high-precision backward from the low-precision saved operands
            if ctx.needs_input_grad[0]:
                grad_x = high_precision_grads(g, dequantize(w_t.t(), w_t_inv), None)[0]
        else:
            # An E5M2 input meets the gradient's E4M3 copy (E5M2 x E5M2 is refused).
            w_fmt = weight_grad_format(spec.input_format, spec.grad.fmt) if ctx.needs_input_grad[1] and not high_weight_grad else None
            for_input, for_weight = spec.grad.quantize_for_gemms(g, ctx.needs_input_grad[0], w_fmt, spec.casts if fused else None, FP8_ALIGN)
            if for_input is not None:
                out_dtype = grad_input_dtype(ctx.x_dtype, spec.out_dtype)
                with kernel_region(g):  # a backward a pipeline schedule runs inside the runtime's region
                    grad_x = torch._scaled_mm(for_input.data, w_t.t(), scale_a=for_input.inv_scale, scale_b=w_t_inv, out_dtype=out_dtype)
            if for_weight is not None:
                gq = for_weight.data
                # The fused casts made both transposed copies already ((N', M') and (K', M')).
                g_rows = gq if fused else _pad_rows_fp8(gq, FP8_ALIGN).t().contiguous()
                x_cols = xq.t() if ctx.x_transposed else _pad_rows_fp8(xq, FP8_ALIGN).t().contiguous().t()
                with kernel_region(g):
                    grad_w = torch._scaled_mm(g_rows, x_cols, scale_a=for_weight.inv_scale, scale_b=x_inv, out_dtype=torch.float32)
        if grad_x is not None and grad_x.shape[1] != spec.in_features:
            grad_x = grad_x[:, : spec.in_features]
        if grad_w is not None and grad_w.shape != (spec.out_features, spec.in_features):
            grad_w = grad_w[: spec.out_features, : spec.in_features]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_bias, None, None, None


@dataclasses.dataclass(frozen=True)
class Int8Spec:
    """What one INT8 linear computes: output dtype, backward dtype and true sizes."""

    out_dtype: torch.dtype
    backward_dtype: torch.dtype  # BF16 on CUDA, FP32 on CPU
    in_features: int
    out_features: int


class Int8Linear(torch.autograd.Function):
    """``x @ W.T + bias`` through ``torch._int_mm`` (INT8 x INT8 → INT32), high-precision backward.

    Inputs: ``x`` (M, K), ``weight`` (N, K) the FP32 master (used by backward), ``bias``,
    ``x_inv`` the input's inverse scale (``()`` or ``(M, 1)``), ``w_data`` (N', K') INT8 and
    ``w_inv_row`` (1, N) its per-output-channel inverse scales; ``keep`` (K,) 0/1 mask of channels quantized to INT8,
    ``outlier_index`` / ``outlier_valid`` (slots,) the channels computed apart — all three None
    when the layer keeps no outliers.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, x_inv, w_data, w_inv_row, keep, outlier_index, outlier_valid, spec: Int8Spec):
        m = x.shape[0]
        main = x if keep is None else x * keep
        rows = INT8_MIN_ROWS if m < INT8_MIN_ROWS else 1
        padded_inv = x_inv if x_inv.dim() == 0 else pad_to_multiple(x_inv, rows, 1, value=1.0)
        xq = quantize(pad_to_multiple(main, rows, INT8_ALIGN), padded_inv, Format.INT8).contiguous()
        acc = torch._int_mm(xq, w_data.t())
        if acc.shape != (m, spec.out_features):
            acc = acc[:m, : spec.out_features]
        # INT32 accumulators times the two scales, plus the bias, in one op.
        scale = x_inv * w_inv_row
        out = acc * scale if bias is None else torch.addcmul(bias, acc, scale)
        side = None
        if keep is not None:
            side = x.index_select(1, outlier_index) * outlier_valid
            w_side = weight.index_select(1, outlier_index).t().to(out.dtype)
            if torch.compiler.is_compiling():
                # torch 2.11 compiles addmm(out, side, w_side) here into a graph whose backward
                # gives every gradient of the step as zero (2.13 is right); an add of a product is
                # right on both, and inductor fuses the add anyway.
                out = out + side.to(out.dtype) @ w_side
            else:
                out = torch.addmm(out, side.to(out.dtype), w_side)
        ctx.spec = spec
        ctx.has_bias = bias is not None
        ctx.save_for_backward(xq, x_inv, weight, side, outlier_index)
        return out.to(spec.out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xq, x_inv, weight, side, outlier_index = ctx.saved_tensors
        spec: Int8Spec = ctx.spec
        compute = spec.backward_dtype
        g = grad_out.to(compute)
        m = g.shape[0]
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight.to(compute)
        if ctx.needs_input_grad[1]:
            if xq.shape != (m, spec.in_features):
                xq = xq[:m, : spec.in_features]
            x_hat = xq.to(compute) * x_inv.to(compute)
            if side is not None:
                x_hat = x_hat.index_add(1, outlier_index, side.to(compute))
            grad_w = (g.t() @ x_hat).float()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None
