"""The arithmetic and launching the fused Triton casts share (`triton_cast`, `triton_block_cast`).

Element-wise Triton functions that reproduce `autoprec.formats` exactly (see `triton_cast`'s
docstring: NaN-keeping amaxes, the inverse scale, the IEEE-rounded division, the saturating FP8
byte with round to nearest even, and the integer roundings the interpreter needs off CUDA), the
one launcher (`_launch`, which counts launches in `launches`) and the operand check. Importing
this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import Format

__all__ = ["launches", "scale_constant"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16)

class _Launches:
    """How many kernels this module launched (tests count them per step; an int add per launch)."""

    count = 0


launches = _Launches()




@triton.jit
def _nan_amax(x, mask):
    """Largest |x| over the masked tile in FP32, NaN when any masked element is NaN (torch's
    ``amax`` propagates NaN; Triton's ``max`` drops it, so NaN is counted apart)."""
    a = tl.where(mask, tl.abs(x), 0.0)
    isnan = a != a
    largest = tl.max(tl.where(isnan, 0.0, a))
    return tl.where(tl.max(isnan.to(tl.int32)) > 0, float("nan"), largest)


@triton.jit
def _nan_amax_rows(x, mask):
    """`_nan_amax` per row of a (rows, cols) tile: (rows,)."""
    a = tl.where(mask, tl.abs(x), 0.0)
    isnan = a != a
    largest = tl.max(tl.where(isnan, 0.0, a), axis=1)
    return tl.where(tl.max(isnan.to(tl.int32), axis=1) > 0, float("nan"), largest)


@triton.jit
def _scale(amax, c):
    """``formats.inverse_scale``: ``amax.clamp_min(1e-12) * c`` (NaN stays NaN; 1e-12 is
    ``formats._AMAX_FLOOR``, rounded to FP32 by both)."""
    return tl.where(amax < 1e-12, 1e-12, amax) * c


@triton.jit
def _fp8_bits_soft(y, E5M2: tl.constexpr):
    """The FP8 byte of FP32 ``y`` (|y| <= the format's max, or NaN) as c10's conversion makes it:
    round to nearest even, subnormals through one FP32 add that rounds onto their grid, NaN
    0x7F with y's sign."""
    u = y.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    a = u ^ sign
    magnitude = a.to(tl.float32, bitcast=True)
    if E5M2:
        # Subnormals below 2**-14 (exponent 113), on a grid of 2**-16: adding 2**7 rounds onto it.
        sub = (magnitude + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)
        normal = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
        code = tl.where(a < (113 << 23), sub, normal)
    else:
        # Subnormals below 2**-6 (exponent 121), on a grid of 2**-9: adding 2**14 rounds onto it.
        sub = (magnitude + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
        normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
        code = tl.where(a < (121 << 23), sub, normal)
    code = tl.where(y != y, 0x7F, code)
    return (code | (sign >> 24)).to(tl.uint8)


@triton.jit
def _fp8_bits(y, E5M2: tl.constexpr, SOFT: tl.constexpr):
    if SOFT:
        return _fp8_bits_soft(y, E5M2)
    if E5M2:
        return y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _quantize(x, s, MAXV: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """``formats.quantize(x, s, fmt)`` of an FP32 tile (``x`` exact from the operand's dtype):
    the IEEE quotient in FP32 (a BF16 operand's too, as `formats.quantize` divides), the clamp to
    +-max that keeps NaN, the FP8 byte."""
    y = tl.math.div_rn(x, tl.broadcast_to(s, x.shape))
    y = tl.where(y > MAXV, MAXV, tl.where(y < -MAXV, -MAXV, y))
    return _fp8_bits(y, E5M2, SOFT)


def _soft(device: torch.device) -> bool:
    # CPU tensors run only under the interpreter, whose float conversions are not torch's.
    return device.type != "cuda"


def scale_constant(fmt: Format, margin: int = 0) -> float:
    """``2**margin / fmt.max``: the factor `formats.inverse_scale` multiplies by (an FP32 constant
    in both: torch rounds the Python scalar to FP32, Triton passes the argument as FP32)."""
    return 2.0**margin / fmt.max


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"fused casts take a 2-D FP32 or BF16 tensor, got {x.dtype} of shape {tuple(x.shape)}")


def _launch(kernel, grid: int, *args, **meta) -> None:
    """``kernel`` over ``grid`` programs on the device of ``args[0]`` (Triton launches on the
    current CUDA device and stream: a tensor on another device is launched under its own)."""
    if grid == 0:  # an empty operand: nothing to read or write (its outputs are empty too)
        return
    launches.count += 1
    device = args[0].device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[(grid,)](*args, **meta)
        return
    kernel[(grid,)](*args, **meta)
