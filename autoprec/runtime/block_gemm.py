"""DeepSeek-V3's fine-grained FP8 products (arXiv:2412.19437, 3.3.2) through torch's block-scaled GEMM.

Every operand is E4M3 (the fine scales are what make E4M3 safe for gradients), activations and
output gradients carry one scale per 1x128 tile of a row, weights one per 128x128 block, and the
kernel accumulates in FP32 without fast accumulation. ``y = x @ W.T (+ bias)``, x (M, K), W (N, K):

- forward ``y = x @ W.T``: ``scaled_mm(xq (M, K') 1x128 tiles along K, Wq.T (K', N') 128x128)``;
- input gradient ``dx = g @ W``: ``scaled_mm(gq (M, N') tiles along N, W (N', K') 128x128)`` — the
  same weight blocks read transposed, so the weight is quantized once (its transposed copy holds
  the same bytes);
- weight gradient ``dW = g.T @ x``: ``scaled_mm(g.T (N, M') tiles along M, x (M', K') tiles along
  M)``: both operands re-tiled along the token dimension, the input's made in the forward.

The calls (``torch.nn.functional.scaled_mm``, ``aten::_scaled_mm_v2``; pytorch/pytorch
``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_block1x128_block128x128`` and
``_scaled_block1x128_block1x128``) take FP32 scales "outer-dim-major": a 1x128 operand's (rows,
K/128) with strides (1, rows); a 128x128 operand's (round_up(K/128, 4), N/128) with strides
(1, round_up(K/128, 4)), the K-block count padded to 4 (16-byte rows). Both operands E4M3; first
row-major, second column-major; sm_90 with cuBLASLt >= 12.9 (`device.block_scaled_form` probes it; on CPU
``aten::_scaled_mm_v2`` has no block-scaled kernel). K and N are padded to whole tiles of 128, and
so are the tokens of the weight-gradient GEMM (torch 2.11's meta function counts K // 128 tiles
where the CUDA kernel counts ceil(K / 128); whole tiles keep every check in agreement); zero rows
and columns change no product. Where no block-scaled kernel runs (every CPU, GPUs before sm_90),
the same three products run through `emulated_block_mm`: the same tilings and scales, the
operands dequantized and multiplied in FP32 (the layer's report says emulated).

Costs per training step: one amax over each 1x128 tile of x (twice: along K and along M), of g
(twice) and of each 128x128 block of W (once, or not at all on a `reusing_weights` hit), one cast
per copy, three GEMMs, no host sync. With a high-precision weight gradient
(`LayerPrecision.high_precision_weight_grad`) the third GEMM takes the unrounded output gradient
and the forward's copy of x dequantized (no re-tiled copies of x or g are made). Saved for backward: x's re-tiled E4M3 copy (1 byte per
element) and its scales, the weight's transposed E4M3 copy and its block scales.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from ..formats import Format, block_amax, inverse_scale, quantize
from .casts import call_casts
from .gemm import grad_input_dtype, high_precision_grads, kernel_bias, kernel_region, pad_to_multiple

if TYPE_CHECKING:
    from .quantizers import QuantizedOperand
    from .triton_cast import FusedCasts

__all__ = [
    "BLOCK",
    "Fp8BlockLinear",
    "Fp8BlockSpec",
    "block_cast",
    "block_scaled_mm",
    "emulated_block_mm",
    "kernel_weight_scales",
    "outer_major",
    "tile_cast",
    "tile_dequantize",
]

BLOCK = 128  # the tile edge: 1x128 tiles, 128x128 blocks; also the padding of K, N and the wgrad's tokens
_E4M3 = Format.FP8_E4M3


def tile_cast(x: torch.Tensor, margin: int = 0, rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` (any float dtype, any strides) in E4M3 with one scale per 1x128 tile of a row:
    ``(q, inv)``, ``q`` (R', C') row-major with zero rows up to a multiple of ``rows_to`` and
    zero columns up to a multiple of 128, ``inv`` (R', C'/128) FP32 outer-dim-major (strides
    (1, R')), the layout the block-scaled GEMM takes. One pad, one amax per tile, one cast."""
    xp = pad_to_multiple(x, rows_to, BLOCK)
    rows, cols = xp.shape
    inv = inverse_scale(block_amax(xp, (1, BLOCK)), _E4M3, margin)
    q = quantize(xp.reshape(rows, cols // BLOCK, BLOCK), inv.unsqueeze(-1), _E4M3).reshape(rows, cols)
    return q.contiguous(), outer_major(inv)


def tile_dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """`tile_cast`'s ``(q, inv)`` back in FP32: ``q`` (R, C') times each 1x128 tile's scale (``inv``
    (R, C'/128) or more tiles, any strides). One FP32 copy of the operand."""
    rows, cols = q.shape
    return (q.float().reshape(rows, cols // BLOCK, BLOCK) * inv[:, : cols // BLOCK, None]).reshape(rows, cols)


def outer_major(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (rows, tiles) copied into strides (1, rows), whatever its sizes: the kernel checks
    ``stride(0) == 1`` even for one row, where ``.t().contiguous().t()`` would keep (tiles, 1)."""
    rows, tiles = scales.shape
    return torch.empty((tiles, rows), dtype=scales.dtype, device=scales.device).t().copy_(scales)


def block_cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``w`` (N, K) in E4M3 with one scale per 128x128 block: ``(q, grid)``, ``q`` (N', K')
    row-major padded with zeros to multiples of 128, ``grid`` (N'/128, K'/128) FP32 contiguous
    (`kernel_weight_scales` lays it out for a call). One pad, one amax per block, one cast."""
    wp = pad_to_multiple(w, BLOCK, BLOCK)
    n, k = wp.shape
    grid = inverse_scale(block_amax(wp, (BLOCK, BLOCK)), _E4M3)
    blocks = wp.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    q = quantize(blocks, grid[:, None, :, None], _E4M3).reshape(n, k)
    return q.contiguous(), grid


def kernel_weight_scales(grid: torch.Tensor) -> torch.Tensor:
    """A 128x128 operand's scales as the GEMM takes them, from its block grid (N/128, K/128) where
    K is the contracted dimension: (round_up(K/128, 4), N/128), strides (1, round_up(K/128, 4));
    the padding scales are ones. One small copy (a weight has few blocks)."""
    return F.pad(grid, (0, -grid.shape[1] % 4), value=1.0).t()


@torch.library.custom_op("autoprec::block_scaled_mm", mutates_args=())
def block_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, blocks_b: bool,
    out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a @ b`` in FP32 accumulation: ``a`` (M, K) row-major E4M3 in 1x128 tiles, ``b`` (K, N)
    column-major E4M3 in 128x128 blocks (``blocks_b``) or in 1x128 tiles along K. No fast
    accumulation (cuBLASLt's block-scaled kernels keep FP32 partial sums; DeepSeek-V3 promotes them
    every 128 elements for this reason).

    An opaque op to ``torch.compile`` (this one call, no graph break): torch 2.13's Inductor
    lowers ``aten::_scaled_mm_v2`` to ``torch._scaled_mm``, whose checks lay a 1x128 second
    operand's scales out transposed from the v2 op's, so a compiled block-scaled call would be
    refused where the eager one runs; kept opaque, compiled and eager make the same call."""
    recipe_b = F.ScalingType.BlockWise128x128 if blocks_b else F.ScalingType.BlockWise1x128
    with kernel_region(a):
        return F.scaled_mm(
            a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b,
            bias=bias, output_dtype=out_dtype, use_fast_accum=False,
        )


def emulated_block_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, blocks_b: bool,
    out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`block_scaled_mm` without its kernel: each operand dequantized with its scales as the kernel
    lays them out (``a`` (M, K) in 1x128 tiles along K, ``scale_a`` (M, K/128); ``b`` (K, N) in
    128x128 blocks, ``scale_b`` (round_up(K/128, 4), N/128), or in 1x128 tiles along K, ``scale_b``
    (N, K/128)), multiplied in FP32, the bias added, cast to ``out_dtype``. Two FP32 copies of the
    operands and one FP32 GEMM (K and N are whole tiles of 128: the runtime pads them)."""
    k, n = b.shape
    a32 = tile_dequantize(a, scale_a)
    if blocks_b:
        grid = scale_b[: k // BLOCK, : -(-n // BLOCK)]
        b32 = b.float() * grid.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:k, :n]
    else:
        b32 = tile_dequantize(b.t(), scale_b).t()
    with torch.autocast(a.device.type, enabled=False):  # an FP32 product, as the kernel accumulates
        out = a32 @ b32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _gemm(spec: "Fp8BlockSpec", *args) -> torch.Tensor:
    """The block-scaled product of ``args`` (`block_scaled_mm`'s): the kernel, or its emulation."""
    return (emulated_block_mm if spec.emulated else block_scaled_mm)(*args)


@block_scaled_mm.register_fake
def _block_scaled_mm_shape(a, b, scale_a, scale_b, blocks_b, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@dataclasses.dataclass(frozen=True)
class Fp8BlockSpec:
    """What one block-scaled linear computes: output dtype, the scales' margin and true sizes."""

    out_dtype: torch.dtype  # the region's dtype (a half dtype under autocast)
    margin: int  # the input's (`Scaling.margin`); weights and gradients take the full range, as elsewhere
    in_features: int
    out_features: int
    # The fused Triton casts (`triton_block_cast` through `FusedCasts`) for inputs and output
    # gradients of a dtype they take: one launch writes an operand's both tilings. None: PyTorch ops.
    casts: "FusedCasts | None" = None
    # No block-scaled kernel on the device: the products through `emulated_block_mm`.
    emulated: bool = False
    # The weight gradient's GEMM in high precision: the unrounded output gradient times the
    # forward's input copy (tiled along K) dequantized (`LayerPrecision.high_precision_weight_grad`).
    weight_grad_high: bool = False


class Fp8BlockLinear(torch.autograd.Function):
    """``x @ W.T + bias`` through three block-scaled GEMMs (module docstring).

    Inputs: ``x`` (M, K) any float dtype, ``weight`` (N, K) and ``bias`` (N,) or None (for
    autograd: their gradients are returned; the forward kernel takes the bias padded, in
    ``spec.out_dtype``: `gemm.kernel_bias`; an FP32 output gets it added after), then ``w_q``
    the weight's `quantizers.QuantizedOperand` in `block_cast`'s layout (``data`` (N', K'),
    ``inv_scale`` its block grid, ``transposed`` (K', N') or None when no input gradient is
    needed). Returns (M, N) in ``spec.out_dtype``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, w_q: "QuantizedOperand", spec: Fp8BlockSpec):
        casts = call_casts(spec.casts, x.dtype)
        # The re-tiled copy of x only for a block-scaled weight gradient; a high-precision one
        # takes the forward's copy.
        retiled = ctx.needs_input_grad[1] and not spec.weight_grad_high
        if casts is not None:
            # One read of x writes both tilings.
            xq, x_inv, x_t, x_t_inv = casts.tile_casts(x, spec.margin, transposed=retiled, t_rows_to=BLOCK)
        else:
            xq, x_inv = tile_cast(x, spec.margin)
            x_t = x_t_inv = None
            if retiled:
                # The weight gradient contracts over tokens: x re-tiled along M, rows padded like K'.
                x_t, x_t_inv = tile_cast(x.t(), spec.margin, rows_to=BLOCK)
        # _scaled_mm fuses no bias into an FP32 output: there it is added after the kernel.
        fused_bias = kernel_bias(bias, spec.out_dtype, BLOCK) if bias is not None and spec.out_dtype != torch.float32 else None
        w_grid = w_q.inv_scale
        out = _gemm(spec, xq, w_q.data.t(), x_inv, kernel_weight_scales(w_grid), True, spec.out_dtype, fused_bias)
        if out.shape[1] != spec.out_features:
            out = out[:, : spec.out_features]
        if bias is not None and fused_bias is None:
            out = out + bias.to(out.dtype)
        ctx.spec = spec
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        if ctx.needs_input_grad[1] and spec.weight_grad_high:
            x_t, x_t_inv = xq, x_inv  # (M, K') in tiles along K: not transposed
        ctx.save_for_backward(x_t, x_t_inv, w_q.transposed, w_grid)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_t, x_t_inv, w_t, w_grid = ctx.saved_tensors
        spec: Fp8BlockSpec = ctx.spec
        grad_x = grad_w = grad_bias = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        casts = call_casts(spec.casts, grad_out.dtype)
        low_w = need_w and not spec.weight_grad_high  # the weight gradient's GEMM block-scaled
        if casts is not None and (need_x or low_w):  # one launch: g tiled along N and along M
            gq, g_inv, g_t, g_t_inv = casts.tile_casts(grad_out, row=need_x, transposed=low_w)
        else:
            gq, g_inv = tile_cast(grad_out) if need_x else (None, None)
            g_t, g_t_inv = tile_cast(grad_out.t()) if low_w else (None, None)
        if need_x:
            out_dtype = grad_input_dtype(ctx.x_dtype, spec.out_dtype)
            grad_x = _gemm(spec, gq, w_t.t(), g_inv, kernel_weight_scales(w_grid.t()), True, out_dtype)
            if grad_x.shape[1] != spec.in_features:
                grad_x = grad_x[:, : spec.in_features]
        if need_w:
            if low_w:
                grad_w = _gemm(spec, g_t, x_t.t(), g_t_inv, x_t_inv, False, torch.float32)
            else:  # the forward's copy of x (M, K'), dequantized, against the unrounded g (M, N)
                grad_w = high_precision_grads(grad_out, None, tile_dequantize(x_t, x_t_inv))[1]
            if grad_w.shape[1] != spec.in_features:
                grad_w = grad_w[:, : spec.in_features]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_bias, None, None
