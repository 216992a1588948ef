"""Number formats and the one arithmetic of scaled quantization.

A `Format` carries its own numbers (bits, largest finite value, smallest normal and subnormal,
bytes per element), so code reads `fmt.max` instead of branching on names.

Convention (the kernels'): a tensor's *inverse scale* ``s = amax / (fmt.max / 2**margin)`` maps
the format's range back onto the tensor's, ``q = saturate(x / s)`` and ``x ≈ q * s``; it is what
``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b`` (Transformer Engine's ``scale_inv``).
`inverse_scale` is the only place an amax becomes a scale, with one rule: an amax of zero is
floored at 1e-12 (a zero tensor quantizes to zeros), and a non-finite amax gives a non-finite
scale, so a tensor holding inf or NaN quantizes to NaN everywhere and the loss scaler skips the
step instead of training on silently clamped values.

`quantize` never trusts a cast to saturate: FP8 is clamped to ±max in the same expression (eager
CUDA casts do not saturate before torch 2.12, E5M2 overflows to inf everywhere); INT8 is symmetric,
[-127, 127], round half to even. Each function is a few elementwise ops and at most one reduction,
with no host sync and no branching on tensor values, so ``torch.compile`` fuses them. The objects
that own scaling per operand role (input, weight, output gradient) are `autoprec.runtime.quantizers`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

import torch

from .errors import FormatError

__all__ = [
    "CommMethod",
    "PER_LAYER_COMM",
    "Format",
    "FormatSpec",
    "Granularity",
    "amax",
    "block_amax",
    "inverse_scale",
    "quantize",
    "dequantize",
    "expand_blocks",
    "sqnr",
    "ACTIVATION_BLOCK",
    "WEIGHT_BLOCK",
    "MX_BLOCK",
    "mx_inverse_scale",
]

# DeepSeek-V3 (arXiv:2412.19437, section 3.3.2): 1x128 tiles for activations, 128x128 blocks for
# weights.
ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)
# OCP Microscaling (MX v1.0): 32 consecutive elements along the contracted dimension share one
# E8M0 (power-of-two) scale, for every operand, weights included.
MX_BLOCK = (1, 32)


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """The numbers of one format. `max`, `min_normal` and `min_subnormal` are magnitudes."""

    dtype: torch.dtype  # storage dtype of a quantized tensor
    bits: int
    exponent_bits: int  # 0 for integers
    mantissa_bits: int  # explicit mantissa bits; 0 for integers
    max: float
    min_normal: float
    min_subnormal: float
    needs_scale: bool  # True when a scale is needed to fit real tensors into the range
    saturates: bool  # True when casting clamps to ±max instead of overflowing to inf

    @property
    def bytes(self) -> float:
        """Bytes per element: whole for 8 bits and more, 0.5 for a 4-bit format."""
        return self.bits // 8 if self.bits % 8 == 0 else self.bits / 8


def _float_spec(dtype: torch.dtype, exponent_bits: int, mantissa_bits: int, needs_scale: bool, saturates: bool = False) -> FormatSpec:
    info = torch.finfo(dtype)
    return FormatSpec(
        dtype=dtype,
        bits=info.bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=float(info.max),
        min_normal=float(info.smallest_normal),
        # The smallest subnormal is one unit in the last place of the smallest normal.
        min_subnormal=float(info.smallest_normal) * 2.0**-mantissa_bits,
        needs_scale=needs_scale,
        saturates=saturates,
    )


class Format(str, enum.Enum):
    """A training number format. Compares equal to its string value (``Format.BF16 == "bf16"``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    # E2M1 values in 16-element blocks with E4M3 block scales and an FP32 tensor scale
    # (`runtime.nvfp4`): its scaling is part of the format.
    NVFP4 = "nvfp4"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | Format") -> "Format":
        """`Format` from a name, case-insensitively; a clear `FormatError` for anything else.

        Args:
            value: a `Format` (returned as is) or its name, e.g. ``"fp8_e4m3"``; surrounding
                whitespace and case are ignored.

        Returns:
            The named `Format`.

        Raises:
            FormatError: ``value`` names no format (or is neither a string nor a `Format`); the
                message lists the valid names.
        """
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        names = ", ".join(f.value for f in cls)
        raise FormatError(f"unknown format {value!r}; use one of: {names}")

    @property
    def spec(self) -> FormatSpec:
        return _SPECS[self]

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def bytes(self) -> float:
        return self.spec.bytes

    @property
    def max(self) -> float:
        return self.spec.max

    @property
    def min_normal(self) -> float:
        return self.spec.min_normal

    @property
    def min_subnormal(self) -> float:
        return self.spec.min_subnormal

    @property
    def needs_scale(self) -> bool:
        return self.spec.needs_scale

    @property
    def scaled_floor(self) -> float:
        """The smallest ``|x| / amax`` that stays nonzero once a scale maps a tensor's amax onto
        the format's max: ``min_subnormal / max``; NVFP4's E4M3 block scales reach further down,
        to (E4M3's smallest subnormal x 0.5) / (448 x 6), 3.6e-7 (`runtime.nvfp4`). What the
        profile and the planned windows count as underflow under a current scale."""
        if self is Format.NVFP4:
            e4m3 = Format.FP8_E4M3
            return (e4m3.min_subnormal * self.min_subnormal) / (e4m3.max * self.max)
        return self.min_subnormal / self.max

    @property
    def is_float(self) -> bool:
        return self.spec.exponent_bits > 0

    @property
    def is_fp8(self) -> bool:
        return self in (Format.FP8_E4M3, Format.FP8_E5M2)

    @property
    def autocast_dtype(self) -> "torch.dtype | None":
        """The dtype `torch.autocast` runs this format in, or None when autocast does not apply."""
        return self.spec.dtype if self in (Format.BF16, Format.FP16) else None


_SPECS = {
    Format.FP32: _float_spec(torch.float32, 8, 23, needs_scale=False),
    Format.BF16: _float_spec(torch.bfloat16, 8, 7, needs_scale=False),
    # FP16's range (max 65504) is why training in it needs loss scaling, not a per-tensor scale.
    Format.FP16: _float_spec(torch.float16, 5, 10, needs_scale=False),
    Format.FP8_E4M3: _float_spec(torch.float8_e4m3fn, 4, 3, needs_scale=True, saturates=True),
    Format.FP8_E5M2: _float_spec(torch.float8_e5m2, 5, 2, needs_scale=True),
    Format.INT8: FormatSpec(
        dtype=torch.int8, bits=8, exponent_bits=0, mantissa_bits=0, max=127.0,
        min_normal=1.0, min_subnormal=1.0, needs_scale=True, saturates=True,
    ),
    # E2M1 (OCP MX v1.0, section 5.3.3): max 6, smallest normal 1, one subnormal 0.5; stored as
    # codes two per byte (`runtime.nvfp4`).
    Format.NVFP4: FormatSpec(
        dtype=torch.uint8, bits=4, exponent_bits=2, mantissa_bits=1, max=6.0,
        min_normal=1.0, min_subnormal=0.5, needs_scale=True, saturates=True,
    ),
}


class Granularity(str, enum.Enum):
    """How many scales a tensor gets.

    TENSOR: one. ROW: one per row, the amax taken over the last dimension (per token for an
    activation ``(tokens, features)``, per output channel for a weight ``(out, in)``). BLOCK: one
    per tile of a 2-D tensor (`ACTIVATION_BLOCK` / `WEIGHT_BLOCK`). MX: MXFP8, one power-of-two
    scale per 32 consecutive elements along the contracted dimension of every operand
    (`MX_BLOCK`, `mx_inverse_scale`; E4M3 operands).
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"
    MX = "mx"

    def __str__(self) -> str:
        return self.value


class CommMethod(str, enum.Enum):
    """How a gradient travels between ranks (`autoprec.comm` runs each): an all-reduce in FP32,
    BF16 or FP16; INT8 with a scale per chunk; top-k sparsification; torch's PowerSGD."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    POWERSGD = "powersgd"
    TOPK = "topk"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | CommMethod", where: str = "grad_comm") -> "CommMethod":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise FormatError(f"{where}={value!r}: expected one of {', '.join(repr(m.value) for m in cls)}") from None

    @property
    def lossy(self) -> bool:
        """Whether it may not carry an inf through (a rank's inf can round to a finite value)."""
        return self in (CommMethod.INT8, CommMethod.TOPK, CommMethod.POWERSGD)


# The methods a plan may give one layer: PowerSGD factors whole bucket matrices (torch's hook
# keeps its state per bucket), so it is a run's choice (``grad_comm="powersgd"``), not a layer's.
PER_LAYER_COMM = (CommMethod.FP32, CommMethod.BF16, CommMethod.FP16, CommMethod.INT8, CommMethod.TOPK)


# Smallest amax a scale is taken from (torchao uses the same floor): keeps fmt.max / amax finite
# for an all-zero tensor while leaving every real tensor's scale exact.
_AMAX_FLOOR = 1e-12


def _check_block(x: torch.Tensor, block: Sequence[int]) -> tuple[int, int]:
    if x.dim() != 2:
        raise FormatError(f"block scaling needs a 2-D tensor, got shape {tuple(x.shape)}; reshape to (rows, cols) first")
    if len(block) != 2 or min(block) < 1:
        raise FormatError(f"block must be two positive sizes like (1, 128), got {tuple(block)}")
    return int(block[0]), int(block[1])


def amax(x: torch.Tensor, dim: "int | None" = None) -> torch.Tensor:
    """Largest magnitude in FP32: over the whole tensor (``()``; 0 for an empty one), or along
    ``dim`` (kept as size 1). One reduction kernel (``linalg.vector_norm`` with ord=inf), no
    temporary of x's size, no host sync; NaN and inf propagate."""
    if dim is None:
        if x.numel() == 0:  # the inf norm has no identity: torch refuses an empty tensor
            return x.new_zeros((), dtype=torch.float32)
        return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)


def block_amax(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """Largest magnitude per ``block`` tile of 2-D ``x``, FP32 ``(ceil(rows/bm), ceil(cols/bk))``;
    partial tiles at the edges count their own elements. A pad (when x is not a multiple of the
    tile) and one reduction."""
    bm, bk = _check_block(x, block)
    rows, cols = x.shape
    pad_r, pad_c = -rows % bm, -cols % bk
    if pad_r or pad_c:
        # Zero padding never raises a tile's amax.
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    r, c = x.shape
    return torch.linalg.vector_norm(x.reshape(r // bm, bm, c // bk, bk), float("inf"), dim=(1, 3), dtype=torch.float32)


def expand_blocks(inv_scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """Per-tile scales ``(ceil(rows/bm), ceil(cols/bk))`` repeated over their tiles to ``shape``
    (rows, cols): one scale per element, a temporary of x's size."""
    bm, bk = int(block[0]), int(block[1])
    rows, cols = shape
    return inv_scale.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def inverse_scale(amax: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
    """``amax / (fmt.max / 2**margin)`` in FP32, amax's shape: the factor that maps the format's
    range back onto x's. Zero amax gives a tiny finite factor (the 1e-12 floor), inf or NaN gives
    inf / NaN (the step is poisoned, as it should be). Two scalar ops per element of amax.
    """
    # A multiply by a constant, not a divide: torch.compile rewrites division by a constant into
    # this multiply, and eager must round the scale identically for compiled and eager runs to
    # quantize to the same bits.
    return amax.clamp_min(_AMAX_FLOOR) * (2.0**margin / fmt.max)


# E8M0's exponent range: 2**-127 to 2**127 (255 is its NaN).
_E8M0_EXPONENTS = (-127, 127)


def mx_inverse_scale(amax: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
    """The power of two at or above ``amax / (fmt.max / 2**margin)``, in FP32, amax's shape: an
    E8M0 scale rounded up, so a tile's largest value maps onto at most the format's max and none
    saturates (Transformer Engine's MXFP8 quantizer rounds up as well; OCP MX v1.0's rule,
    ``2**(floor(log2 amax) - 8)`` for E4M3, can map a tile's largest values past 448, where they
    clip). A zero tile gets 2**-127; inf or NaN propagates. ``frexp`` gives the exponent exactly
    (no ``log2`` rounding); a few elementwise ops per element of amax."""
    target = amax * (2.0**margin / fmt.max)
    mantissa, exponent = torch.frexp(target)  # target = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    low, high = _E8M0_EXPONENTS
    exponent = torch.where(target == 0, low, exponent)  # frexp(0) has exponent 0
    scale = torch.ldexp(torch.ones_like(target), exponent.clamp(low, high))
    return torch.where(torch.isfinite(target), scale, target)


def quantize(x: torch.Tensor, inv_scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``saturate(x / inv_scale)`` in ``fmt.dtype`` for FP8 and INT8: one fused pass under compile.

    ``inv_scale`` broadcasts against x (``()``, ``(M, 1)``, ...). FP8 clamps to ±``fmt.max`` then
    casts (round to nearest even; NaN stays NaN); INT8 rounds half to even and clamps to
    [-127, 127]. The division runs in FP32 whatever x's dtype, as a fused cast kernel (and
    torch.compile, and Transformer Engine) computes it: a half x divided by a 0-d FP32 scale would
    stay half (type promotion) and round twice, half then FP8, which moves values near a rounding
    tie (about 1 in 40 of a BF16 gradient's elements in E4M3).
    """
    x = x.float()
    if fmt is Format.INT8:
        return torch.round(x / inv_scale).clamp(-fmt.max, fmt.max).to(torch.int8)
    return (x / inv_scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize(q: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * inv_scale`` in ``dtype``: the inverse of `quantize` up to the format's rounding."""
    x = q.float() * inv_scale
    return x if dtype == torch.float32 else x.to(dtype)


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20·log10(‖ref‖ / ‖ref − approx‖)``.

    Forces a host sync (returns a Python float); inf when the two are identical.
    """
    ref = reference.detach().double()
    noise = (ref - approximation.detach().double()).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))
