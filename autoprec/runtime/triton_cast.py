"""Fused FP8 quantization kernels in Triton: the runtime's casts on CUDA where Triton imports.

Eager PyTorch quantizes an operand in about seven element-wise kernels (``amax``'s norm, two scalar
ops for the scale, divide, clamp, cast, and the transposed copy the backward needs); each reads or
writes the whole tensor. These kernels do the same arithmetic in fewer passes over memory:

- `amax_partials` + `finalize_scales` (current scaling): one read of the operand writing one
  partial amax per tile, then one program reducing the partials and writing the inverse scale(s)
  on the device. No host sync.
- `cast`: one read of a 2-D FP32 / BF16 operand (any strides) writing its FP8 copy (row-major,
  padded to the GEMM's alignment) and/or the transposed FP8 copy (row-major of the transpose, the
  layout the backward's ``_scaled_mm`` takes), each with its own per-tensor scale and format.
- Delayed scaling (`cast_delayed`): the cast pass takes its scale from the amax history and
  writes the tile amaxes of this tensor; the one-program finalize then writes the scale and
  records the amax in the history slot. Exactness where the history cannot give the scale (the
  first step, a non-finite tensor): a second cast launch gated by a device flag re-casts with the
  reference scale; when the flag is off its programs touch no memory (masked). Three launches,
  one read of the operand.
- `cast_rows` (row-wise scaling): a block of rows per program; a first loop over the row takes its
  amax, a second casts (the row is re-read from cache), scales and row amaxes written alongside.
- `FusedCasts.tile_casts` / `FusedCasts.block_casts`: DeepSeek-V3's 1x128-tile / 128x128-block E4M3 casts, one launch and one read each (`triton_block_cast`).

Every result is bit for bit what `autoprec.formats` computes on the same device (``quantize`` with
the scale ``inverse_scale`` gives, then ``.contiguous()`` / ``.t().contiguous()``, zero padding as
``gemm.pad_to_multiple`` and ``gemm._pad_rows_fp8``): the division is IEEE-rounded (``div_rn``),
the clamp keeps NaN, the cast rounds to nearest even. A BF16 operand divides in FP32 by the FP32
scale, as ``quantize`` does (eager PyTorch's own BF16-by-0-d division would round the quotient to
BF16 first, and on CUDA the scale too). NaN outputs are NaN; their sign bit follows each device's
NaN (x86 and CUDA differ), so NaN bytes are compared as NaN.

Loop counts are compile-time constants (the row-wise kernel's from K, the finalize's rounded to a
power of two): Triton 3.6's interpreter cannot take a loop bound from a kernel argument (its
scalar arguments are 1-element arrays, which NumPy 2 no longer converts to an index).

On CPU tensors these kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``, tests):
its float conversions round ties up, so there the FP8 rounding runs as integer arithmetic
(`triton_arith._fp8_bits_soft`) that reproduces torch's conversion; on CUDA it is
the hardware's round-to-nearest-even conversion (``cvt.rn.satfinite``; the operand is clamped
first, so saturation never decides a value).

Per operand and step: three launches (current scaling: amax tiles, finalize, cast; delayed:
cast, finalize, gated cast; row-wise: the row kernel, then for a backward copy finalize and cast),
two passes over the operand (delayed: one), no host sync.

Importing this module imports Triton; `autoprec.runtime.casts` decides whether to (the package
imports and runs without Triton).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import Format
from .triton_arith import _check, _launch, _nan_amax, _nan_amax_rows, _quantize, _scale, _soft, launches, scale_constant
from .triton_block_cast import block_casts, tile_casts

__all__ = [
    "FusedCasts",
    "amax_partials",
    "finalize_scales",
    "cast",
    "cast_delayed",
    "cast_rows",
    "scale_constant",
    "launches",
]

# Tile sizes. 128x128: every row segment of both copies is a whole 128-byte line (FP8) and the
# BF16 read of a row segment two; not tuned on a GPU yet (the GPU suite measures the result).
_TILE = 128
_TILE_WARPS = 8
_ROWS_BLOCK = 8  # rows per program of the row-wise kernel
_ROWS_CHUNK = 512  # columns per iteration of its loops
_FINALIZE_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# Arithmetic of this module's kernels (the shared part: `triton_arith`).


@triton.jit
def _history_amax(hist_ptr, H, MOST_RECENT: tl.constexpr, HP: tl.constexpr):
    """The delayed scale's basis: ``history[:1].amax()`` or ``history.amax()`` (NaN propagates)."""
    offs = tl.arange(0, HP)
    if MOST_RECENT:
        mask = offs < 1
    else:
        mask = offs < H
    h = tl.load(hist_ptr + offs, mask=mask, other=0.0)
    return _nan_amax(h, mask)


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _amax_kernel(x_ptr, M, K, sxm, sxk, part_ptr, BM: tl.constexpr, BK: tl.constexpr):
    """One partial amax per (BM, BK) tile of x (M, K)."""
    pid = tl.program_id(0)
    nk = tl.cdiv(K, BK)
    rows = (pid // nk) * BM + tl.arange(0, BM)
    cols = (pid % nk) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * sxm + cols[None, :].to(tl.int64) * sxk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid, _nan_amax(x, mask))


@triton.jit
def _finalize_kernel(
    part_ptr, n, inv_ptr, c, inv2_ptr, c2, hist_ptr, H, flag_ptr,
    TWO: tl.constexpr, DELAYED: tl.constexpr, MOST_RECENT: tl.constexpr, RECORD: tl.constexpr,
    HP: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    """One program: the amax from ``n`` partials, then the inverse scale(s).

    Current scaling: ``inv = inverse_scale(amax)`` (and ``inv2`` with a second constant).
    Delayed (`quantizers.TensorDelayedQuantizer`): ``basis = past if past > 0 else amax``; ``inv`` NaN when the amax
    is not finite (the reference adds ``amax * 0``); ``flag`` 1 when the cast made from the
    history alone is not that (no history yet, or a non-finite amax); with ``RECORD`` the history
    shifts by one and its slot 0 takes the amax (0 when not finite: "not seen")."""
    offs = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], tl.float32)
    seen_nan = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        p = tl.load(part_ptr + i * BLOCK + offs, mask=i * BLOCK + offs < n, other=0.0)
        seen_nan = tl.maximum(seen_nan, (p != p).to(tl.int32))
        largest = tl.maximum(largest, tl.where(p != p, 0.0, p))
    amax = tl.where(tl.max(seen_nan) > 0, float("nan"), tl.max(largest))
    if DELAYED:
        past = _history_amax(hist_ptr, H, MOST_RECENT, HP)
        finite = (amax == amax) & (amax < float("inf"))
        inv = tl.where(finite, _scale(tl.where(past > 0, past, amax), c), float("nan"))
        tl.store(inv_ptr, inv)
        tl.store(flag_ptr, tl.where((past > 0) & finite, 0, 1))
        if RECORD:
            hoffs = tl.arange(0, HP)
            older = tl.load(hist_ptr + hoffs - 1, mask=(hoffs >= 1) & (hoffs < H), other=0.0)
            # Every program thread has read before any writes (the shift reads and writes one buffer).
            tl.debug_barrier()
            shifted = tl.where(hoffs == 0, tl.where(finite, amax, 0.0), older)
            tl.store(hist_ptr + hoffs, shifted, mask=hoffs < H)
    else:
        tl.store(inv_ptr, _scale(amax, c))
        if TWO:
            tl.store(inv2_ptr, _scale(amax, c2))


@triton.jit
def _cast_kernel(
    x_ptr, M, K, sxm, sxk, MQ, KQ, MT,
    q_ptr, qt_ptr, inv_ptr, inv_t_ptr,
    hist_ptr, H, c, part_ptr, flag_ptr,
    ROW: tl.constexpr, TRANS: tl.constexpr, SAME: tl.constexpr,
    MAX_R: tl.constexpr, E5M2_R: tl.constexpr, MAX_T: tl.constexpr, E5M2_T: tl.constexpr,
    SOFT: tl.constexpr,
    DELAYED: tl.constexpr, MOST_RECENT: tl.constexpr, HP: tl.constexpr, GATED: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One (BM, BK) tile of the padded operand P (MT, KQ): x (M, K) with zeros after it.

    ``q`` (MQ, KQ) row-major: ``quantize(P[:MQ], inv)``; ``qt`` (KQ, MT) row-major: its
    transpose, quantized with ``inv_t`` (the same scale and format when ``SAME``) over the rows
    below MQ and zero bytes after them (rows a GEMM needs padded after the cast). ``DELAYED``:
    the scale is ``inverse_scale(history amax)`` and the tile's amax goes to ``part_ptr``.
    ``GATED``: nothing is read or written unless ``flag_ptr`` holds 1."""
    pid = tl.program_id(0)
    nk = tl.cdiv(KQ, BK)
    rows = (pid // nk) * BM + tl.arange(0, BM)
    cols = (pid % nk) * BK + tl.arange(0, BK)
    live = rows[:, None] < MT
    if GATED:
        live = live & (tl.load(flag_ptr) != 0)
    data = live & (rows[:, None] < M) & (cols[None, :] < K)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * sxm + cols[None, :].to(tl.int64) * sxk
    x = tl.load(ptrs, mask=data, other=0.0).to(tl.float32)
    if DELAYED:
        tl.store(part_ptr + pid, _nan_amax(x, data))
        s = _scale(_history_amax(hist_ptr, H, MOST_RECENT, HP), c)
    else:
        s = tl.load(inv_ptr)
    quantized = rows[:, None] < MQ
    q = _quantize(x, s, MAX_R, E5M2_R, SOFT)
    if ROW:
        q_mask = live & quantized & (cols[None, :] < KQ)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * KQ + cols[None, :], q, mask=q_mask)
    if TRANS:
        if SAME:
            qt = q
        else:
            qt = _quantize(x, tl.load(inv_t_ptr), MAX_T, E5M2_T, SOFT)
        qt = tl.where(quantized, qt, tl.zeros_like(qt))
        t_mask = live & (cols[None, :] < KQ)
        # Stored through the transposed tile so each program writes rows of qt contiguously.
        t_ptrs = qt_ptr + cols[:, None].to(tl.int64) * MT + rows[None, :]
        tl.store(t_ptrs, tl.trans(qt), mask=tl.trans(t_mask))


@triton.jit
def _rows_kernel(
    x_ptr, M, K, sxm, sxk, MQ, KQ, q_ptr, inv_ptr, amax_ptr, c,
    HAS_SCALE: tl.constexpr, MAXV: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, ITERS: tl.constexpr,
):
    """Rows [pid*BM, pid*BM + BM) of the padded operand (MQ, KQ): per-row amax and inverse
    scale (``inv`` (MQ, 1), ``amax`` (MQ,)), then ``quantize(P, inv)`` (an (M, 1) scale promotes
    a BF16 operand to FP32, so no BF16 rounding). ``HAS_SCALE``: ``inv`` is given, read not made."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_live = rows < MQ
    base = x_ptr + rows[:, None].to(tl.int64) * sxm
    offs = tl.arange(0, BK)
    if HAS_SCALE:
        inv = tl.load(inv_ptr + rows, mask=row_live, other=1.0)
    else:
        largest = tl.zeros([BM], tl.float32)
        seen_nan = tl.zeros([BM], tl.int32)
        for i in range(ITERS):
            cols = i * BK + offs
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(base + cols[None, :].to(tl.int64) * sxk, mask=mask, other=0.0).to(tl.float32)
            a = _nan_amax_rows(x, mask)
            seen_nan = tl.maximum(seen_nan, (a != a).to(tl.int32))
            largest = tl.maximum(largest, tl.where(a != a, 0.0, a))
        amax = tl.where(seen_nan > 0, float("nan"), largest)
        inv = _scale(amax, c)
        tl.store(inv_ptr + rows, inv, mask=row_live)
        tl.store(amax_ptr + rows, amax, mask=row_live)
    for i in range(ITERS):
        cols = i * BK + offs
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(base + cols[None, :].to(tl.int64) * sxk, mask=mask, other=0.0).to(tl.float32)
        q = _quantize(x, inv[:, None], MAXV, E5M2, SOFT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * KQ + cols[None, :], q, mask=row_live[:, None] & (cols[None, :] < KQ))


# ---------------------------------------------------------------------------------------------
# Launchers (Python: shapes, buffers, grids; no host sync).


def _finalize_iters(parts: int) -> int:
    """Loop count of the finalize over ``parts`` partials, rounded up to a power of two (the
    tail is masked): a compile-time count, so a few compiled variants serve every token count."""
    return triton.next_power_of_2(max(1, triton.cdiv(parts, _FINALIZE_BLOCK)))


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """FP32 partial amaxes of 2-D ``x``, one per 128x128 tile (NaN propagates): one kernel, one
    read of x. `finalize_scales` reduces them."""
    _check(x)
    m, k = x.shape
    grid = triton.cdiv(m, _TILE) * triton.cdiv(k, _TILE)
    parts = torch.empty(grid, device=x.device, dtype=torch.float32)
    _launch(_amax_kernel, grid, x, m, k, x.stride(0), x.stride(1), parts, BM=_TILE, BK=_TILE, num_warps=_TILE_WARPS)
    return parts


def finalize_scales(parts: torch.Tensor, fmt: Format, margin: int = 0, second: Optional[Format] = None):
    """``inverse_scale(amax, fmt, margin)`` (0-d FP32) from partial amaxes, and with ``second``
    the scale for that format too (a pair): one program, no host sync."""
    inv = torch.empty((), device=parts.device, dtype=torch.float32)
    inv2 = torch.empty((), device=parts.device, dtype=torch.float32) if second is not None else inv
    c2 = scale_constant(second) if second is not None else 0.0
    _launch(
        _finalize_kernel, 1, parts, parts.numel(), inv, scale_constant(fmt, margin), inv2, c2, parts, 0, parts,
        TWO=second is not None, DELAYED=False, MOST_RECENT=False, RECORD=False, HP=1,
        BLOCK=_FINALIZE_BLOCK, ITERS=_finalize_iters(parts.numel()), num_warps=4,
    )
    return (inv, inv2) if second is not None else inv


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Sizes of one cast: data (m, k), quantized rows ``mq``, columns ``kq``, transposed columns ``mt``."""

    m: int
    k: int
    mq: int
    kq: int
    mt: int

    @classmethod
    def of(cls, x: torch.Tensor, pad_rows: int, pad_cols: int, t_rows: int) -> "_Layout":
        m, k = x.shape
        mq, kq = m + (-m % pad_rows), k + (-k % pad_cols)
        return cls(m, k, mq, kq, mq + (-mq % t_rows))


def _outputs(x: torch.Tensor, layout: _Layout, row_fmt: Optional[Format], t_fmt: Optional[Format]):
    q = torch.empty((layout.mq, layout.kq), device=x.device, dtype=row_fmt.dtype) if row_fmt is not None else None
    qt = torch.empty((layout.kq, layout.mt), device=x.device, dtype=t_fmt.dtype) if t_fmt is not None else None
    return q, qt


def _cast_launch(x, layout, q, qt, inv, inv_t, row_fmt, t_fmt, *, delayed=None, gated=None):
    if q is None:
        inv = inv_t  # the kernel's one scale is the transposed copy's
    fmt_r = row_fmt or t_fmt
    fmt_t = t_fmt or row_fmt
    same = row_fmt is None or t_fmt is None or (row_fmt is t_fmt and inv_t is inv)
    grid = triton.cdiv(layout.mt, _TILE) * triton.cdiv(layout.kq, _TILE)
    dummy = inv
    hist, h, c, parts, most_recent, hp = dummy, 0, 0.0, dummy, False, 1
    if delayed is not None:
        hist, h, c, parts, most_recent = delayed
        hp = triton.next_power_of_2(max(h, 1))
    flag = gated if gated is not None else dummy
    _launch(
        _cast_kernel, grid, x, layout.m, layout.k, x.stride(0), x.stride(1), layout.mq, layout.kq, layout.mt,
        q.view(torch.uint8) if q is not None else dummy, qt.view(torch.uint8) if qt is not None else dummy,
        inv, inv_t if inv_t is not None else inv, hist, h, c, parts, flag,
        ROW=q is not None, TRANS=qt is not None, SAME=same,
        MAX_R=fmt_r.max, E5M2_R=fmt_r is Format.FP8_E5M2, MAX_T=fmt_t.max, E5M2_T=fmt_t is Format.FP8_E5M2,
        SOFT=_soft(x.device),
        DELAYED=delayed is not None, MOST_RECENT=most_recent, HP=hp, GATED=gated is not None,
        BM=_TILE, BK=_TILE, num_warps=_TILE_WARPS,
    )
    return grid


def cast(
    x: torch.Tensor, inv: torch.Tensor, row_fmt: Optional[Format], *,
    pad_rows: int = 1, pad_cols: int = 1, t_fmt: Optional[Format] = None, t_inv: Optional[torch.Tensor] = None, t_rows: int = 1,
):
    """``(q, qt)``: ``q = quantize(pad(x), inv, row_fmt)`` row-major (None without ``row_fmt``),
    ``x`` padded with zeros to multiples of ``pad_rows`` x ``pad_cols``; ``qt`` its transpose
    (``t_fmt`` with ``t_inv``, default the row's) row-major, its columns (the rows of q) padded
    further with zero bytes to a multiple of ``t_rows`` (None without ``t_fmt``).

    One kernel, one read of x, one write of each copy."""
    _check(x)
    layout = _Layout.of(x, pad_rows, pad_cols, t_rows)
    q, qt = _outputs(x, layout, row_fmt, t_fmt)
    _cast_launch(x, layout, q, qt, inv, t_inv if t_inv is not None else inv, row_fmt, t_fmt)
    return q, qt


def cast_delayed(
    x: torch.Tensor, history: torch.Tensor, fmt: Format, margin: int, most_recent: bool, record: bool,
    *, pad_cols: int = 1, transposed: bool = False, t_rows: int = 1,
):
    """``(inv, q, qt)`` of delayed scaling (`quantizers.TensorDelayedQuantizer`), bit for bit its
    ``inverse_scale(x, record)`` then `cast`; with ``record`` this step's amax enters ``history``
    in place. Three launches, no host sync: the cast from the history's scale writing tile amaxes,
    the one-program finalize (scale, flag, history), and the same cast gated by the flag, which
    re-casts only where the history could not give the scale (first step, non-finite x)."""
    _check(x)
    layout = _Layout.of(x, 1, pad_cols, t_rows)
    q, qt = _outputs(x, layout, fmt, fmt if transposed else None)
    inv = torch.empty((), device=x.device, dtype=torch.float32)
    flag = torch.empty((), device=x.device, dtype=torch.int32)
    grid = triton.cdiv(layout.mt, _TILE) * triton.cdiv(layout.kq, _TILE)
    parts = torch.empty(grid, device=x.device, dtype=torch.float32)
    h = history.numel()
    c = scale_constant(fmt, margin)
    _cast_launch(x, layout, q, qt, inv, inv, fmt, fmt if transposed else None, delayed=(history, h, c, parts, most_recent))
    hp = triton.next_power_of_2(max(h, 1))
    _launch(
        _finalize_kernel, 1, parts, grid, inv, c, inv, 0.0, history, h, flag,
        TWO=False, DELAYED=True, MOST_RECENT=most_recent, RECORD=record, HP=hp,
        BLOCK=_FINALIZE_BLOCK, ITERS=_finalize_iters(grid), num_warps=4,
    )
    _cast_launch(x, layout, q, qt, inv, inv, fmt, fmt if transposed else None, gated=flag)
    return inv, q, qt


def cast_rows(
    x: torch.Tensor, fmt: Format, margin: int = 0, *, pad_rows: int = 1, pad_cols: int = 1, inv: Optional[torch.Tensor] = None,
):
    """``(q, inv, amax)`` of row-wise scaling: ``inv = inverse_scale(amax(P, dim=1), fmt, margin)``
    (MQ, 1) and ``q = quantize(P, inv, fmt)`` (MQ, KQ) row-major for P = x zero-padded; ``amax``
    (MQ,) the row amaxes (`finalize_scales` turns them into the tensor's scale). ``inv`` given:
    cast with it (``amax`` is then None). One kernel: two reads of each row (the second from cache)."""
    _check(x)
    layout = _Layout.of(x, pad_rows, pad_cols, 1)
    q = torch.empty((layout.mq, layout.kq), device=x.device, dtype=fmt.dtype)
    has_scale = inv is not None
    if inv is None:
        inv = torch.empty((layout.mq, 1), device=x.device, dtype=torch.float32)
        amax = torch.empty(layout.mq, device=x.device, dtype=torch.float32)
    else:
        amax = None
    _launch(
        _rows_kernel, triton.cdiv(layout.mq, _ROWS_BLOCK), x, layout.m, layout.k, x.stride(0), x.stride(1), layout.mq, layout.kq,
        q.view(torch.uint8), inv, amax if amax is not None else inv, scale_constant(fmt, margin),
        HAS_SCALE=has_scale, MAXV=fmt.max, E5M2=fmt is Format.FP8_E5M2, SOFT=_soft(x.device),
        BM=_ROWS_BLOCK, BK=_ROWS_CHUNK, ITERS=triton.cdiv(layout.kq, _ROWS_CHUNK), num_warps=4,
    )
    return q, inv, amax


class FusedCasts:
    """The fused path's entry points for the quantizers, for one device (see the module
    docstring). ``takes(dtype)``: the operand dtypes it casts (FP32 and BF16); anything else
    keeps the PyTorch ops."""

    name = "fused Triton cast"

    def __init__(self, device: "torch.device | str"):
        self.device = torch.device(device)
        self._dtypes = frozenset({torch.float32, torch.bfloat16})

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in self._dtypes

    def tensor_scale(self, x: torch.Tensor, fmt: Format, margin: int = 0, second: Optional[Format] = None):
        """`finalize_scales` of `amax_partials`: two kernels (an empty x has amax 0)."""
        return finalize_scales(amax_partials(x), fmt, margin, second)

    def scale_from(self, amaxes: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
        """The tensor's inverse scale from amaxes of its parts (row amaxes): one kernel."""
        return finalize_scales(amaxes, fmt, margin)

    def cast(self, x, inv, row_fmt, **layout):
        return cast(x, inv, row_fmt, **layout)

    def cast_delayed(self, x, history, fmt, margin, most_recent, record, **layout):
        return cast_delayed(x, history, fmt, margin, most_recent, record, **layout)

    def cast_rows(self, x, fmt, margin=0, **layout):
        return cast_rows(x, fmt, margin, **layout)

    def tile_casts(self, x, margin=0, row=True, transposed=True, t_rows_to=1):
        """`triton_block_cast.tile_casts` (BF16 exact on every device: its scales are not 0-d)."""
        return tile_casts(x, margin, row=row, transposed=transposed, t_rows_to=t_rows_to)

    def block_casts(self, w, transposed=True):
        """`triton_block_cast.block_casts`."""
        return block_casts(w, transposed=transposed)
