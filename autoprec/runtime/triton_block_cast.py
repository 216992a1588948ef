"""DeepSeek-V3's fine-grained E4M3 casts (`block_gemm`) as fused Triton kernels, one launch each.

`block_gemm.tile_cast` and `block_gemm.block_cast` quantize in PyTorch ops: a pad, the tile amaxes
(``linalg.vector_norm``), two scalar ops for the scales, divide, clamp, cast and a contiguous copy,
each its own kernel and pass over memory, and the activations' two copies (tiles along K for the
forward, along M for the weight gradient) read x twice. Here one program reads one 128x128 tile
of the operand once and writes everything made from it:

- `tile_casts` (activations, output gradients): the tile's 128 row amaxes give the row copy's
  scales (one per 1x128 tile of a row: ``tile_cast(x)``) and its 128 column amaxes the transposed
  copy's (one per 128 consecutive rows of a column: ``tile_cast(x.t(), rows_to=...)``); both
  copies are quantized from the same registers and written row-major, their scales
  outer-dim-major (strides (1, rows)) as the block-scaled GEMM takes them.
- `block_casts` (weights): one amax per 128x128 block, its scale, the block quantized and
  written twice: row-major and transposed (the input gradient's ``W`` read as (K', N')).

Per call: one launch (none for an empty operand), one read of the operand (any strides, FP32 or
BF16), one write of each copy and its scales, no host sync and no temporary of the operand's size.
The 128x128 tile and 8 warps follow `triton_cast`'s cast kernel; not tuned on a GPU yet. The grid covers the padded
outputs too: programs over the padding load nothing (masked) and write its zero bytes and, for
the transposed copy's padding rows, the scale of an all-zero tile (the 1e-12 amax floor times the
format constant), as the reference's zero padding gives.

Exactness: the arithmetic is `triton_arith`'s (`triton_cast`'s too) (``_nan_amax_rows`` / ``_nan_amax``, ``_scale``,
``_quantize``, ``_fp8_bits``): the amax in FP32 with NaN propagating (as ``vector_norm(ord=inf)``
does; inf gives an inf scale, so finite values become zeros and the inf NaN), the IEEE-rounded
division in FP32 (a BF16 operand's too), the clamp to +-448 that keeps NaN, the cast rounding to
nearest even, so BF16 operands are bit for bit on every device. The quantization covers the zero-padded tile, so padding in a
tile whose scale is NaN is NaN, as in the reference. Off CUDA (the interpreter) the FP8 rounding
runs as `triton_cast`'s integer code.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import Format
from .triton_arith import _check, _launch, _nan_amax, _nan_amax_rows, _quantize, _scale, _soft, scale_constant

__all__ = ["TILE", "block_casts", "tile_casts"]

TILE = 128  # `block_gemm.BLOCK`: 1x128 tiles, 128x128 blocks, one 128x128 tile of the operand per program
_WARPS = 8
_E4M3 = Format.FP8_E4M3


def _round_up(n: int, multiple: int) -> int:
    return n + (-n % multiple)


def _outer_major(rows: int, tiles: int, device: torch.device) -> torch.Tensor:
    """An FP32 (rows, tiles) scale tensor with strides (1, rows), as `block_gemm.outer_major`
    makes it (element (r, t) at ``t * rows + r``)."""
    return torch.empty((tiles, rows), device=device, dtype=torch.float32).t()


@triton.jit
def _tile_kernel(
    x_ptr, R, C, sxr, sxc, CQ, CT, RT, NC,
    q_ptr, inv_ptr, qt_ptr, inv_t_ptr, c,
    ROW: tl.constexpr, TRANS: tl.constexpr, MAXV: tl.constexpr, SOFT: tl.constexpr, B: tl.constexpr,
):
    """Tile (pid // NC, pid % NC) of x (R, C) zero-padded. ``ROW``: the row copy ``q`` (R, CQ)
    row-major with ``inv`` (R, CQ/B) stored at ``tile * R + row``; ``TRANS``: ``qt`` (CT, RT)
    row-major with ``inv_t`` (CT, RT/B) stored at ``tile * CT + col``. Columns past CQ (when
    CT > CQ) are the transposed copy's alone, past CT the row copy's alone."""
    pid = tl.program_id(0)
    ti = pid // NC
    tj = pid % NC
    rows = ti * B + tl.arange(0, B)
    cols = tj * B + tl.arange(0, B)
    data = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
    x = tl.load(ptrs, mask=data, other=0.0).to(tl.float32)
    if ROW:
        row_live = (rows < R) & (tj * B < CQ)
        inv = _scale(_nan_amax_rows(x, data), c)
        tl.store(inv_ptr + tj.to(tl.int64) * R + rows, inv, mask=row_live)
        q = _quantize(x, inv[:, None], MAXV, False, SOFT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * CQ + cols[None, :], q, mask=row_live[:, None])
    if TRANS:
        col_live = cols < CT
        # The column amaxes as row amaxes of the transposed tile (`triton_cast`'s NaN-keeping reduction).
        inv_t = _scale(_nan_amax_rows(tl.trans(x), tl.trans(data)), c)
        tl.store(inv_t_ptr + ti.to(tl.int64) * CT + cols, inv_t, mask=col_live)
        qt = _quantize(x, inv_t[None, :], MAXV, False, SOFT)
        # Stored through the transposed tile so each program writes rows of qt contiguously.
        t_ptrs = qt_ptr + cols[:, None].to(tl.int64) * RT + rows[None, :]
        tl.store(t_ptrs, tl.trans(qt), mask=col_live[:, None])


@triton.jit
def _block_kernel(
    w_ptr, N, K, swn, swk, NQ, KQ, q_ptr, grid_ptr, qt_ptr, c,
    TRANS: tl.constexpr, MAXV: tl.constexpr, SOFT: tl.constexpr, B: tl.constexpr,
):
    """Block ``pid`` (row-major over the (NQ/B, KQ/B) grid) of w (N, K) zero-padded: its scale at
    ``grid[pid]``, ``q`` (NQ, KQ) row-major, with ``TRANS`` ``qt`` (KQ, NQ) row-major."""
    pid = tl.program_id(0)
    nk = KQ // B
    rows = (pid // nk) * B + tl.arange(0, B)
    cols = (pid % nk) * B + tl.arange(0, B)
    data = (rows[:, None] < N) & (cols[None, :] < K)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * swn + cols[None, :].to(tl.int64) * swk
    x = tl.load(ptrs, mask=data, other=0.0).to(tl.float32)
    s = _scale(_nan_amax(x, data), c)
    tl.store(grid_ptr + pid, s)
    q = _quantize(x, s, MAXV, False, SOFT)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * KQ + cols[None, :], q)
    if TRANS:
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * NQ + rows[None, :], tl.trans(q))


def tile_casts(
    x: torch.Tensor, margin: int = 0, row: bool = True, transposed: bool = True, t_rows_to: int = 1,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(q, inv, q_t, inv_t)`` of 2-D ``x`` (R, C), FP32 or BF16, any strides:

    - ``row``: ``(q, inv) == block_gemm.tile_cast(x, margin)``: ``q`` (R, C') E4M3 row-major, C'
      the columns padded with zeros to a multiple of 128, ``inv`` (R, C'/128) FP32 strides (1, R);
    - ``transposed``: ``(q_t, inv_t) == block_gemm.tile_cast(x.t(), margin, rows_to=t_rows_to)``:
      ``q_t`` (C'', R') row-major, C'' = C padded to a multiple of ``t_rows_to``, R' = R padded to
      128, ``inv_t`` (C'', R'/128) FP32 strides (1, C'');

    None for a copy not asked. One launch, one read of x, bit for bit the reference."""
    _check(x)
    if t_rows_to < 1:
        raise ValueError(f"t_rows_to must be positive, got {t_rows_to}")
    r, c = x.shape
    cq = _round_up(c, TILE)
    ct = _round_up(c, t_rows_to)
    rt = _round_up(r, TILE)
    q = inv = q_t = inv_t = None
    if row:
        q = torch.empty((r, cq), device=x.device, dtype=_E4M3.dtype)
        inv = _outer_major(r, cq // TILE, x.device)
    if transposed:
        q_t = torch.empty((ct, rt), device=x.device, dtype=_E4M3.dtype)
        inv_t = _outer_major(ct, rt // TILE, x.device)
    nc = triton.cdiv(max(cq if row else 0, ct if transposed else 0), TILE)
    # A copy not asked for gets the other's buffers as unused arguments (the kernel never writes them).
    either = q if q is not None else q_t
    if either is None:  # neither copy asked for: nothing to write
        return q, inv, q_t, inv_t
    q_bytes = (q if q is not None else either).view(torch.uint8)
    qt_bytes = (q_t if q_t is not None else either).view(torch.uint8)
    _launch(
        _tile_kernel, triton.cdiv(r, TILE) * nc, x, r, c, x.stride(0), x.stride(1), cq, ct, rt, nc,
        q_bytes, inv if inv is not None else inv_t, qt_bytes, inv_t if inv_t is not None else inv,
        scale_constant(_E4M3, margin),
        ROW=row, TRANS=transposed, MAXV=_E4M3.max, SOFT=_soft(x.device), B=TILE, num_warps=_WARPS,
    )
    return q, inv, q_t, inv_t


def block_casts(
    w: torch.Tensor, transposed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(q, grid, q_t)`` of 2-D ``w`` (N, K), FP32 or BF16, any strides: ``(q, grid) ==
    block_gemm.block_cast(w)`` (``q`` (N', K') E4M3 row-major padded with zeros to multiples of
    128, ``grid`` (N'/128, K'/128) FP32 contiguous) and ``q_t == q.t().contiguous()`` (None
    unless ``transposed``). One launch, one read of w, bit for bit the reference."""
    _check(w)
    n, k = w.shape
    nq, kq = _round_up(n, TILE), _round_up(k, TILE)
    q = torch.empty((nq, kq), device=w.device, dtype=_E4M3.dtype)
    grid = torch.empty((nq // TILE, kq // TILE), device=w.device, dtype=torch.float32)
    q_t = torch.empty((kq, nq), device=w.device, dtype=_E4M3.dtype) if transposed else None
    _launch(
        _block_kernel, grid.numel(), w, n, k, w.stride(0), w.stride(1), nq, kq,
        q.view(torch.uint8), grid, (q_t if q_t is not None else q).view(torch.uint8), scale_constant(_E4M3),
        TRANS=transposed, MAXV=_E4M3.max, SOFT=_soft(w.device), B=TILE, num_warps=_WARPS,
    )
    return q, grid, q_t
