"""MXFP8 products (OCP Microscaling v1.0; Transformer Engine's ``MXFP8BlockScaling`` recipe).

Every operand is FP8 (E4M3; the output gradient E4M3 or E5M2, Transformer Engine's HYBRID) with
one power-of-two scale (E8M0) per 32 consecutive elements **along the dimension its GEMM
contracts**, so an operand used by two GEMMs along different dimensions is quantized twice, each
time from its high-precision values (as Transformer Engine does: the MXFP8 tensor and its
transpose are not the same numbers). ``y = x @ W.T (+ bias)``, x (M, K), W (N, K):

- forward ``y = x @ W.T``: x tiled along K, W tiled along K;
- input gradient ``dx = g @ W``: g tiled along N, W tiled along N (its transposed copy, made in
  the forward);
- weight gradient ``dW = g.T @ x``: g tiled along M, x tiled along M (made in the forward).

Scales are rounded up to the power of two at or above ``amax / max`` (`formats.mx_inverse_scale`:
no tile saturates). Tiles run along the contracted dimension padded with zeros to a multiple of 32
(zeros change no product).

**Emulated everywhere**: torch's MX-scaled GEMM (``scaled_mm`` with E8M0 block scales) runs on
sm_100 (Blackwell) only, which no machine this project has checked on, so every product here
dequantizes its two operands and multiplies them in FP32 (`emulated_mx_mm`), and the layer's
report and the plan's strict check say emulated. The numbers are MXFP8's exactly up to the FP32
accumulation order; the time is not MXFP8's.

Costs per training step: an amax per 32-element tile and a cast for each of x (twice), W (twice)
and g (twice), three FP32 GEMMs on dequantized copies. Saved for backward: x tiled along M and W
tiled along N, 1 byte per element each, with one E8M0 byte per tile.

With a **high-precision backward** (``grad_format="fp32"``, Transformer Engine's
``backward_override="dequantized"``) the forward is the same, and both gradients multiply the
unrounded output gradient, in its dtype, by the forward's operands (tiled along K) dequantized:
``dx = g @ Ŵ``, ``dW = g.T @ x̂``. It saves the forward's copies instead of the transposed ones
and makes no copy of g.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import MX_BLOCK, Format, block_amax, mx_inverse_scale, quantize
from .gemm import grad_input_dtype, high_precision_grads, pad_to_multiple

__all__ = ["MX_TILE", "Fp8MxLinear", "MxSpec", "emulated_mx_mm", "mx_cast"]

MX_TILE = MX_BLOCK[1]
# Saved scales are stored as E8M0 (one byte) where torch has the dtype (2.7 and later).
_E8M0 = getattr(torch, "float8_e8m0fnu", torch.float32)


def mx_cast(x: torch.Tensor, fmt: Format = Format.FP8_E4M3, margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` (R, C), any float dtype, in ``fmt`` with one power-of-two scale per 32 elements of
    a row: ``(q, inv)``, ``q`` (R, C') row-major with zero columns up to a multiple of 32, ``inv``
    (R, C'/32) FP32 powers of two (``x ≈ q * inv`` per tile). One pad, one amax per tile, one cast."""
    xp = pad_to_multiple(x, 1, MX_TILE)
    rows, cols = xp.shape
    inv = mx_inverse_scale(block_amax(xp, MX_BLOCK), fmt, margin)
    q = quantize(xp.reshape(rows, cols // MX_TILE, MX_TILE), inv.unsqueeze(-1), fmt).reshape(rows, cols)
    return q, inv


def emulated_mx_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` of two MX operands tiled along their last (contracted) dimension: ``a`` (M, K')
    and ``b`` (N, K') FP8 with K' a multiple of 32, ``scale_a`` (M, K'/32) and ``scale_b``
    (N, K'/32) powers of two (FP32 or E8M0). Both dequantized, multiplied in FP32 (autocast off),
    cast to ``out_dtype``. Two FP32 copies of the operands and one FP32 GEMM."""
    a32 = _dequantized(a, scale_a)
    b32 = _dequantized(b, scale_b)
    with torch.autocast(a.device.type, enabled=False):
        out = a32 @ b32.t()
    return out.to(out_dtype)


def _dequantized(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return (q.float().reshape(rows, cols // MX_TILE, MX_TILE) * inv.float().unsqueeze(-1)).reshape(rows, cols)


@dataclasses.dataclass(frozen=True)
class MxSpec:
    """What one MXFP8 linear computes: its output dtype (the region's), the input's margin and the
    output gradient's format (FP32: a high-precision backward, module docstring). (Its products
    come out unpadded: the tiles pad only the contracted dimension.)"""

    out_dtype: torch.dtype
    margin: int
    grad_format: Format
    # The weight gradient's GEMM in high precision from the forward's input copy, the input
    # gradient's in ``grad_format`` (`LayerPrecision.high_precision_weight_grad`).
    weight_grad_high: bool = False

    @property
    def high_products(self) -> tuple[bool, bool]:
        """Whether the input gradient's and the weight gradient's GEMMs run in high precision
        (from the forward's copies, dequantized)."""
        high = self.grad_format is Format.FP32
        return high, high or self.weight_grad_high


class Fp8MxLinear(torch.autograd.Function):
    """``x @ W.T + bias`` through three MXFP8 products (module docstring). Inputs: ``x`` (M, K)
    any float dtype, ``weight`` (N, K), ``bias`` (N,) or None, the `MxSpec`. Returns (M, N) in
    ``spec.out_dtype``; the gradients of x (its dtype), the weight and the bias (FP32)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: MxSpec):
        e4m3 = Format.FP8_E4M3
        xq, x_inv = mx_cast(x, e4m3, spec.margin)
        wq, w_inv = mx_cast(weight, e4m3)
        out = emulated_mx_mm(xq, x_inv, wq, w_inv, torch.float32)
        if bias is not None:
            out = out + bias.float()
        out = out.to(spec.out_dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        high_x, high_w = spec.high_products
        # A high-precision product takes the forward's copy (tiled along K); a low one its own,
        # tiled along the dimension it contracts: the weight along N (for dx), the input along M
        # (for dW), each from the high-precision values.
        w_t, w_t_inv = ((wq, w_inv) if high_x else mx_cast(weight.t(), e4m3)) if need_x else (None, None)
        x_t, x_t_inv = ((xq, x_inv) if high_w else mx_cast(x.t(), e4m3, spec.margin)) if need_w else (None, None)
        ctx.spec, ctx.x_dtype, ctx.has_bias, ctx.in_features = spec, x.dtype, bias is not None, x.shape[1]
        ctx.save_for_backward(w_t, _stored(w_t_inv), x_t, _stored(x_t_inv))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w_t, w_t_inv, x_t, x_t_inv = ctx.saved_tensors
        spec: MxSpec = ctx.spec
        grad_x = grad_w = grad_bias = None
        out_dtype = grad_input_dtype(ctx.x_dtype, spec.out_dtype)
        k = ctx.in_features
        high_x, high_w = spec.high_products
        if ctx.needs_input_grad[0] and high_x:  # the forward's operands (tiled along K), dequantized
            grad_x = high_precision_grads(grad_out, _dequantized(w_t, w_t_inv)[:, :k], None)[0].to(out_dtype)
        elif ctx.needs_input_grad[0]:
            g, g_inv = mx_cast(grad_out, spec.grad_format)  # (M, N') tiled along N
            grad_x = emulated_mx_mm(g, g_inv, w_t, w_t_inv, out_dtype)
        if ctx.needs_input_grad[1] and high_w:
            grad_w = high_precision_grads(grad_out, None, _dequantized(x_t, x_t_inv)[:, :k])[1]
        elif ctx.needs_input_grad[1]:
            g_t, g_t_inv = mx_cast(grad_out.t(), spec.grad_format)  # (N, M') tiled along M, as x_t
            grad_w = emulated_mx_mm(g_t, g_t_inv, x_t, x_t_inv, torch.float32)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_bias, None


def _stored(inv: "torch.Tensor | None") -> "torch.Tensor | None":
    """A saved operand's scales in E8M0 (exact: they are powers of two in its range)."""
    return None if inv is None else inv.to(_E8M0)
