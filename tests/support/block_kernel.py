"""A CPU reference kernel for torch's scaled GEMM with block scales, so the block-scaled runtime
path runs in CPU tests.

``aten::_scaled_mm_v2`` (``torch.nn.functional.scaled_mm``) has no CPU kernel for block scales:
torch 2.11 registers none for CPU at all, torch 2.13's refuses every recipe but tensor- and
row-wise. `reference_block_kernel` registers this one for CPU for the duration of a ``with``:
the scales are expanded to one per element exactly as the recipe lays them out (pytorch/pytorch
``ScaledBlas.cpp``: 1x128 outer-dim-major, 128x128 with the K-block count padded to 4), the
operands dequantized, multiplied in FP32, the bias added, the result cast to the output dtype.
It checks nothing about legality: `cuda_rules.CudaRules` does, at the same call. A wrong layout
here gives wrong numbers, which the numerics tests catch against a plain-PyTorch reference.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from autoprec.device import block_scaled_form

__all__ = ["reference_block_kernel", "tiles_by_hand", "blocks_by_hand", "block_products_by_hand"]

_TENSOR, _ROW, _TILE, _BLOCK = (int(F.ScalingType.TensorWise), int(F.ScalingType.RowWise), int(F.ScalingType.BlockWise1x128), int(F.ScalingType.BlockWise128x128))


def _expand(scale: torch.Tensor, recipe: int, rows: int, cols: int) -> torch.Tensor:
    """One FP32 scale per element of an operand (rows, cols) whose contracted dimension is
    ``cols`` (b is passed transposed)."""
    kb = -(-cols // 128)
    if recipe == _TENSOR:
        return scale.float().reshape(()).expand(rows, cols)
    if recipe == _ROW:
        return scale.float().reshape(rows, 1).expand(rows, cols)
    if recipe == _TILE:  # (rows, ceil(cols/128))
        return scale.float().repeat_interleave(128, dim=1)[:, :cols]
    if recipe == _BLOCK:  # (round_up(ceil(cols/128), 4), ceil(rows/128)): its first kb rows, transposed
        grid = scale.float()[:kb].t()
        return grid.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]
    raise NotImplementedError(f"reference kernel: scaling recipe {recipe}")


def _reference(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias=None, out_dtype=None, contraction_dim=(), use_fast_accum=False):
    m, k = a.shape
    n = b.shape[1]
    a_hat = a.float() * _expand(scale_a[0], recipe_a[0], m, k)
    b_hat = (b.t().float() * _expand(scale_b[0], recipe_b[0], n, k)).t()
    out = a_hat @ b_hat
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or torch.bfloat16)


@contextlib.contextmanager
def reference_block_kernel():
    """``with reference_block_kernel():`` CPU calls of ``aten::_scaled_mm_v2`` run `_reference`
    (every recipe the runtime uses), and `block_scaled_form` is probed afresh on entry and exit."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" (torch 2.13)
        library.impl("_scaled_mm_v2", _reference, "CPU")
    block_scaled_form.cache_clear()
    try:
        yield
    finally:
        library._destroy()
        block_scaled_form.cache_clear()


# The scale is amax times 1/448, rounded once (the kernels' convention, formats.inverse_scale):
# amax / 448 rounds differently in the last bit and moves values that sit on an E4M3 tie.
_INV_MAX = 1.0 / 448.0


def tiles_by_hand(x: torch.Tensor) -> torch.Tensor:
    """x (R, C) rounded through E4M3 with one scale per 1x128 tile of a row: plain PyTorch."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, -cols % 128))
    tiles = padded.reshape(rows, -1, 128)
    scale = tiles.abs().amax(-1, keepdim=True).clamp_min(1e-12) * _INV_MAX
    return ((tiles / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(rows, -1)[:, :cols]


def blocks_by_hand(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) rounded through E4M3 with one scale per 128x128 block: plain PyTorch."""
    n, k = w.shape
    padded = F.pad(w.float(), (0, -k % 128, 0, -n % 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) * _INV_MAX
    return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(padded.shape)[:n, :k]


def block_products_by_hand(x, w, b, g):
    """The recipe's three products: y = x·Wᵀ (x tiled along K), dx = g·W (g tiled along N),
    dW = gᵀ·x (both tiled along the tokens), bias gradient in FP32."""
    y = tiles_by_hand(x) @ blocks_by_hand(w).t() + b
    dx = tiles_by_hand(g) @ blocks_by_hand(w)
    dw = tiles_by_hand(g.t()) @ tiles_by_hand(x.t()).t()
    return y, dx, dw, g.sum(0)
