"""NVFP4: E2M1 values in 16-element blocks with E4M3 block scales and one FP32 tensor scale, and
the three products of a linear layer in it (NVIDIA's NVFP4 training recipe, arXiv:2509.25149;
Transformer Engine's ``NVFP4BlockScaling``).

**The format** (`nvfp4_cast`). A tensor's *global* encode scale maps its amax onto the largest
block scale times the largest value, ``g = (448 * 6) / amax`` (FP32, at most FP32's max); each
block of 16 consecutive elements along the row (1-D) or each 16x16 block (2-D, weights) gets a
decode scale ``s = e4m3((amax_b / 6) * g)`` stored in E4M3 (round to nearest even, at most 448),
and its elements are ``e2m1(clamp(x * (1 / (s * (1 / g))), -6, 6))``: E2M1 takes 0, 0.5, 1, 1.5,
2, 3, 4, 6 and their negatives, rounded to nearest with ties to the even code (`round_e2m1`), or
stochastically (round up with probability equal to the distance from the lower neighbour over the
gap). ``x ≈ e2m1 * s / g``. The arithmetic, its order and the FP32 roundings are Transformer
Engine's reference quantizer's, so the bytes are a real kernel's; what this project adds: a
non-finite amax makes every value NaN (the loss scaler then skips the step), where the
reference would clamp it to a finite tensor.

**The products** (`Nvfp4Linear`), ``y = x @ W.T (+ bias)``, x (M, K), W (N, K):

- forward ``y = x @ W.T``: x in 1x16 blocks along K, W in 16x16 blocks (round to nearest);
- input gradient ``dx = g @ W``: g in 1x16 blocks along N, stochastically rounded; W the
  forward's copy (its 16x16 blocks serve both directions: the same numbers either way);
- weight gradient ``dW = g.T @ x``: both operands along M, each 16 elements of M multiplied by
  the same random Hadamard matrix first (``H16 diag(signs) / 4``, orthogonal, so the product is
  unchanged in exact arithmetic while outliers spread over their block), g stochastically rounded.

With a **high-precision backward** (``grad_format="fp32"``, Transformer Engine's
``backward_override="dequantized"``) the forward is the same, and both gradients multiply the unrounded output gradient, in its dtype, by
the forward's operands dequantized: ``dx = g @ Ŵ``, ``dW = g.T @ x̂`` (x̂ the forward's copy, along
K; no transform, no stochastic rounding). It saves the same bytes (the forward's x copy in place
of the transformed one).

Operands are padded with zeros to multiples of 16 along their blocked dimensions (zeros change no
product). **Emulated everywhere**: FP4 GEMMs (``scaled_mm`` with E4M3 block scales on FP4 data)
run on sm_100 only, which no machine this project checks on has; each product dequantizes its two
operands and multiplies them in FP32, so the numbers are NVFP4's up to the FP32 accumulation
order and the time is not. Saved for the backward: the weight's and the transformed input's
codes, two per byte, with one E4M3 byte per block and an FP32 scale each.

Costs per training step: an amax per tensor and per block, a cast and a pack for x (twice), W and
g (twice), two 16x16 transforms (M x (K + N) x 16 multiply-adds), three FP32 GEMMs on dequantized
copies, one uniform draw per gradient element (the default generator: a seeded run repeats).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..formats import Format
from .gemm import grad_input_dtype, high_precision_grads, pad_to_multiple

__all__ = ["NVFP4_TILE", "Nvfp4Tensor", "Nvfp4Linear", "Nvfp4Spec", "round_e2m1", "nvfp4_cast", "rows_and_columns", "padded", "block_scales", "decode_scales",
           "encoded", "decoded", "hadamard_blocks"]

NVFP4_TILE = 16
_E2M1_MAX = Format.NVFP4.max  # 6
_E4M3_MAX = Format.FP8_E4M3.max  # 448
_FP32_MAX = torch.finfo(torch.float32).max
# E2M1's magnitudes by code (bit 3 is the sign): exact in FP32.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_e2m1(v: torch.Tensor, noise: "torch.Tensor | None" = None) -> torch.Tensor:
    """FP32 ``v`` on E2M1's grid (±0, 0.5, 1, 1.5, 2, 3, 4, 6), saturated at ±6: to nearest with
    ties to the even code without ``noise``; with ``noise`` (uniform in [0, 1), v's shape), up to
    the next level when ``noise`` is below the distance to the lower one over the gap. The grid's
    step is 0.5 below 2, 1 below 4, then 2, so both roundings are one exact division and one
    round or floor (an even number of steps is an even code). NaN stays NaN. A few elementwise
    ops."""
    a = v.abs().clamp(max=_E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    units = a / step
    if noise is None:
        levels = torch.round(units)  # half to even
    else:
        low = torch.floor(units)
        levels = low + (noise < units - low).to(low.dtype)
    return torch.copysign(levels * step, v)


def _codes(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0-15) of values already on the grid: the magnitude's index in
    `_MAGNITUDES` (2q below 2, q + 2 below 4, q / 2 + 4 above), bit 3 the sign (a NaN takes
    some code: it is rebuilt from the scale, which is NaN whenever a value is)."""
    q = values.abs()
    index = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q * 0.5 + 4)).nan_to_num(0.0).to(torch.uint8)
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes, C even, as (R, C/2) bytes: element 2j in the low nibble, 2j+1 in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """FP32 values of (R, C/2) packed codes, (R, C)."""
    table = _value_table(packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return table[codes.long()]


@functools.lru_cache(maxsize=None)
def _value_table(device: torch.device) -> torch.Tensor:
    """FP32 value of each code 0-15 on ``device`` (made once per device)."""
    return torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES), device=device)


@dataclasses.dataclass
class Nvfp4Tensor:
    """A 2-D tensor in NVFP4: ``packed`` (R', C'/2) uint8, the padded shape's codes two per byte;
    ``scales`` E4M3 decode scales, one per block, (R', C'/16) for 1x16 blocks or (R'/16, C'/16)
    for 16x16 ones; ``global_decode`` FP32 ``()`` (1 / the global encode scale)."""

    packed: torch.Tensor
    scales: torch.Tensor
    global_decode: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """FP32 (R', C') padded values ``e2m1 * (s * global_decode)``; its padding is zeros."""
        return decoded(self.packed, decode_scales(self.scales, self.global_decode, self.packed.shape[0]))


def nvfp4_cast(x: torch.Tensor, square: bool = False, stochastic: bool = False) -> Nvfp4Tensor:
    """2-D ``x`` (R, C), any float dtype, in NVFP4 (module docstring): 1x16 blocks along each row,
    or 16x16 blocks with ``square``; to nearest, or ``stochastic`` (one uniform draw per element
    from the default generator). Rows (``square``) and columns are padded with zeros to 16. A
    non-finite element makes every value NaN. One amax over x and one per block, a few
    elementwise passes, one pack."""
    xp = padded(x, square)
    scales, global_decode = block_scales(xp, square)
    packed = encoded(xp, decode_scales(scales, global_decode, xp.shape[0]), stochastic)
    return Nvfp4Tensor(packed, scales, global_decode)


def rows_and_columns(shape) -> tuple[int, int]:
    """The 2-D view an NVFP4 round trip takes of a tensor of ``shape``: (rows, last dimension);
    a tensor of rank < 2 is one row."""
    cols = shape[-1] if len(shape) >= 2 else math.prod(shape)
    return (math.prod(shape) // cols if cols else 0), cols


def padded(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """2-D ``x`` in FP32, its columns (and with ``square`` its rows) zero-padded to 16."""
    return pad_to_multiple(x.float(), NVFP4_TILE if square else 1, NVFP4_TILE)


def block_scales(xp: torch.Tensor, square: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded 2-D FP32 tensor's E4M3 block decode scales ((R', C'/16), or (R'/16, C'/16) for
    16x16 blocks) and its FP32 global decode scale ``()`` (module docstring: the reference's
    arithmetic in its order)."""
    r, c = xp.shape
    if square:
        block_amax = xp.reshape(r // NVFP4_TILE, NVFP4_TILE, c // NVFP4_TILE, NVFP4_TILE).abs().amax(dim=(1, 3))
    else:
        block_amax = xp.reshape(r, c // NVFP4_TILE, NVFP4_TILE).abs().amax(dim=-1)
    amax = xp.abs().amax() if xp.numel() else xp.new_zeros(())
    # (448 * 6) / amax at most FP32's max (an all-zero tensor: every scale 0, every value 0);
    # NaN for a non-finite amax, which the clamps below would otherwise make finite: every scale
    # is then NaN, so every value is (the codes cannot carry it).
    global_encode = torch.where(torch.isfinite(amax), (_E4M3_MAX * _E2M1_MAX / amax).clamp(max=_FP32_MAX), torch.nan)
    scales = ((block_amax / _E2M1_MAX) * global_encode).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return scales, 1.0 / global_encode


def decode_scales(scales: torch.Tensor, global_decode: torch.Tensor, rows: int) -> torch.Tensor:
    """Each 1x16 block's FP32 decode scale ``s * global_decode``, (R', C'/16) for ``rows`` R'."""
    decode = scales.float() * global_decode
    return decode if decode.shape[0] == rows else decode.repeat_interleave(NVFP4_TILE, dim=0)


def encoded(xp: torch.Tensor, decode: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """A padded 2-D FP32 tensor's packed codes (R', C'/2) under its per-block ``decode`` scales
    (`decode_scales`): ``e2m1(clamp(x * (1 / decode), -6, 6))``, the encode scale at most FP32's
    max (a zero block's elements stay 0)."""
    r, c = xp.shape
    encode = (1.0 / decode).clamp(max=_FP32_MAX)
    scaled = (xp.reshape(r, c // NVFP4_TILE, NVFP4_TILE) * encode.unsqueeze(-1)).reshape(r, c).clamp(-_E2M1_MAX, _E2M1_MAX)
    noise = torch.rand(scaled.shape, device=scaled.device) if stochastic else None
    return _pack(_codes(round_e2m1(scaled, noise)))


def decoded(packed: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """FP32 (R', C') values of packed codes under their per-block ``decode`` scales."""
    values = _unpack(packed)
    rows, cols = values.shape
    return (values.reshape(rows, cols // NVFP4_TILE, NVFP4_TILE) * decode.unsqueeze(-1)).reshape(rows, cols)


_HADAMARD_SEED = 2509_25149  # the signs are a fixed draw: the same transform in every process
# Drawn at import, not in `hadamard_blocks`: torch.compile traces through its cache into the
# graph, where making a Generator breaks the graph (once per layer and product).
_HADAMARD_SIGNS = torch.randint(0, 2, (NVFP4_TILE,), generator=torch.Generator().manual_seed(_HADAMARD_SEED)).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def hadamard_blocks(device: torch.device) -> torch.Tensor:
    """The 16x16 random Hadamard matrix ``diag(signs) @ H16 / 4`` (Sylvester's H16, signs drawn
    once from a fixed seed): orthogonal, so ``(a T)(b T).T == a b.T`` in exact arithmetic. Made once per device."""
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_TILE:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (_HADAMARD_SIGNS.unsqueeze(1) * h / NVFP4_TILE**0.5).to(device)


def _transformed(x: torch.Tensor) -> torch.Tensor:
    """(R, C) ``x`` in FP32, C padded to 16, each 16 consecutive elements of a row times
    `hadamard_blocks`: (R, C')."""
    xp = padded(x)
    r, c = xp.shape
    with torch.autocast(x.device.type, enabled=False):
        return (xp.reshape(r, c // NVFP4_TILE, NVFP4_TILE) @ hadamard_blocks(x.device)).reshape(r, c)


def _mm(a: Nvfp4Tensor, b: Nvfp4Tensor) -> torch.Tensor:
    """``a @ b.T`` of two NVFP4 operands blocked along their (padded, equal) last dimension, in
    FP32 with autocast off, (R_a', R_b') padded."""
    with torch.autocast(a.packed.device.type, enabled=False):
        return a.dequantize() @ b.dequantize().t()


@dataclasses.dataclass(frozen=True)
class Nvfp4Spec:
    """What one NVFP4 linear computes: its output dtype (the region's), and whether its backward
    runs in high precision (``grad_format="fp32"``: module docstring)."""

    out_dtype: torch.dtype
    high_precision_backward: bool = False
    # The weight gradient's GEMM alone in high precision, from the forward's input copy
    # (`LayerPrecision.high_precision_weight_grad`); the input gradient's stays NVFP4.
    high_precision_weight_grad: bool = False

    @property
    def high_weight_grad(self) -> bool:
        """Whether the weight gradient's GEMM runs in high precision (alone or with the whole backward)."""
        return self.high_precision_backward or self.high_precision_weight_grad


class Nvfp4Linear(torch.autograd.Function):
    """``x @ W.T + bias`` through three NVFP4 products (module docstring). Inputs: ``x`` (M, K)
    any float dtype, ``weight`` (N, K), ``bias`` (N,) or None, the `Nvfp4Spec`. Returns (M, N) in
    ``spec.out_dtype``; the gradients of x (its dtype), the weight and the bias (FP32)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: Nvfp4Spec):
        m, k = x.shape
        n = weight.shape[0]
        xq = nvfp4_cast(x)
        wq = nvfp4_cast(weight, square=True)
        out = _mm(xq, wq)[:m, :n]
        if bias is not None:
            out = out + bias.float()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The weight gradient's input operand: x along M, transformed, from the high-precision
        # values; a high-precision weight gradient takes the forward's copy (along K) as it is.
        x_t = (xq if spec.high_weight_grad else nvfp4_cast(_transformed(x.t()))) if need_w else None
        ctx.spec, ctx.x_dtype, ctx.has_bias, ctx.shapes = spec, x.dtype, bias is not None, (m, k, n)
        ctx.kept = (need_x, x_t is not None)  # the weight's copy, the input's
        kept = [q for q in (wq if need_x else None, x_t) if q is not None]
        ctx.save_for_backward(*(t for q in kept for t in (q.packed, q.scales, q.global_decode)))
        return out.to(spec.out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        wq, x_t = (Nvfp4Tensor(next(saved), next(saved), next(saved)) if keep else None for keep in ctx.kept)
        m, k, n = ctx.shapes
        grad_x = grad_w = grad_bias = None
        out_dtype = grad_input_dtype(ctx.x_dtype, ctx.spec.out_dtype)
        spec: Nvfp4Spec = ctx.spec
        if ctx.needs_input_grad[0] and spec.high_precision_backward:  # the forward's operands, dequantized
            grad_x = high_precision_grads(grad_out, wq.dequantize()[:n, :k], None)[0].to(out_dtype)
        elif ctx.needs_input_grad[0]:
            g = nvfp4_cast(grad_out, stochastic=True)  # (M, N') along N
            with torch.autocast(grad_out.device.type, enabled=False):
                dx = g.dequantize() @ wq.dequantize()  # (M, N') @ (N', K')
            grad_x = dx[:m, :k].to(out_dtype)
        if ctx.needs_input_grad[1] and spec.high_weight_grad:
            grad_w = high_precision_grads(grad_out, None, x_t.dequantize()[:m, :k])[1]
        elif ctx.needs_input_grad[1]:
            g_t = nvfp4_cast(_transformed(grad_out.t()), stochastic=True)  # (N, M') along M
            grad_w = _mm(g_t, x_t)[:n, :k]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_bias, None
