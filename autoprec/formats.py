"""Number formats and the arithmetic of scaled quantization.

A `Format` carries its own numbers (bits, largest finite value, smallest normal and subnormal,
bytes per element), so code reads `fmt.max` instead of branching on names.

Conventions (the same as Transformer Engine's): a *scale* multiplies a high-precision tensor
into the format's range, ``q = cast(x * scale)``, and dequantizing divides, ``x ≈ q / scale``.
``torch._scaled_mm`` takes the inverse (``1 / scale``) as its ``scale_a`` / ``scale_b``.

`quantize` saturates both FP8 formats to ±max (it clamps before the cast rather than trusting the
cast to); FP16 and BF16 overflow to ±inf; rounding is to nearest even everywhere. INT8 is
symmetric, [-127, 127], round half to even. `round_to_format` reproduces those casts with plain
FP32 arithmetic, bit for bit, for devices or dtypes without a native cast.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

import torch

from .errors import FormatError

__all__ = [
    "Format",
    "FormatSpec",
    "Granularity",
    "AmaxHistory",
    "amax",
    "scale_from_amax",
    "quantize",
    "dequantize",
    "fake_quantize",
    "round_to_format",
    "sqnr",
    "ACTIVATION_BLOCK",
    "WEIGHT_BLOCK",
]

# DeepSeek-V3 (arXiv:2412.19437, section 3.3.2): 1x128 tiles for activations, 128x128 blocks for
# weights.
ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)


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
    def bytes(self) -> int:
        return self.bits // 8


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

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | Format") -> "Format":
        """`Format` from a name, case-insensitively; a clear `FormatError` for anything else."""
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
    def bytes(self) -> int:
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
}


class Granularity(str, enum.Enum):
    """How many scales a tensor gets.

    TENSOR: one. ROW: one per row, the amax taken over the last dimension (per token for an
    activation ``(tokens, features)``, per output channel for a weight ``(out, in)``). BLOCK: one
    per tile of a 2-D tensor (`ACTIVATION_BLOCK` / `WEIGHT_BLOCK`).
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"

    def __str__(self) -> str:
        return self.value


def _check_block(x: torch.Tensor, block: Sequence[int]) -> tuple[int, int]:
    if x.dim() != 2:
        raise FormatError(f"block scaling needs a 2-D tensor, got shape {tuple(x.shape)}; reshape to (rows, cols) first")
    if len(block) != 2 or min(block) < 1:
        raise FormatError(f"block must be two positive sizes like (1, 128), got {tuple(block)}")
    return int(block[0]), int(block[1])


def _pad_to_blocks(x: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    rows, cols = x.shape
    pad_r, pad_c = -rows % bm, -cols % bk
    if pad_r or pad_c:
        # Zero padding never raises a block's amax.
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x


def amax(x: torch.Tensor, granularity: Granularity = Granularity.TENSOR, block: Sequence[int] = ACTIVATION_BLOCK) -> torch.Tensor:
    """Largest magnitude per scaling group, as FP32 on x's device (no host sync).

    Shapes: TENSOR → ``()``, ROW → ``x.shape[:-1] + (1,)``, BLOCK → ``(ceil(rows/bm), ceil(cols/bk))``.
    NaN propagates (``amax`` of a tensor holding NaN is NaN), so callers can detect it.
    """
    granularity = Granularity(granularity)
    ax = x.detach().abs().float()
    if granularity is Granularity.TENSOR:
        return ax.amax() if ax.numel() else ax.new_zeros(())
    if granularity is Granularity.ROW:
        return ax.amax(dim=-1, keepdim=True)
    bm, bk = _check_block(x, block)
    padded = _pad_to_blocks(ax, bm, bk)
    r, c = padded.shape
    return padded.reshape(r // bm, bm, c // bk, bk).amax(dim=(1, 3))


def scale_from_amax(amax: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
    """Scale that maps ``amax`` onto ``fmt.max / 2**margin``.

    Where amax is zero or not finite the scale is 1: an all-zero tensor needs none, and a
    non-finite amax means the step overflowed (the loss scaler skips it), so no scale derived from
    it may leak into later steps. Formats without a scale (FP32, BF16, FP16) always get 1.
    """
    fmt = Format.parse(fmt)
    amax = amax.float()
    if not fmt.needs_scale:
        return torch.ones_like(amax)
    target = fmt.max / 2.0**margin
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, target / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))
    # An amax so small that the scale overflows FP32 would turn x * scale into inf.
    return torch.clamp(scale, max=torch.finfo(torch.float32).max)


def _expand(scale: torch.Tensor, x: torch.Tensor, granularity: Granularity, block: Sequence[int]) -> torch.Tensor:
    """Broadcastable scale for x (BLOCK scales are repeated over their tiles)."""
    if Granularity(granularity) is not Granularity.BLOCK or scale.dim() == 0:
        return scale
    bm, bk = _check_block(x, block)
    rows, cols = x.shape
    return scale.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def quantize(
    x: torch.Tensor,
    fmt: Format,
    scale: "torch.Tensor | float" = 1.0,
    granularity: Granularity = Granularity.TENSOR,
    block: Sequence[int] = ACTIVATION_BLOCK,
) -> torch.Tensor:
    """``saturate(x * scale)`` in ``fmt.dtype``; one elementwise pass, no host sync.

    FP8 clamps to ±``fmt.max`` then casts (round to nearest even; NaN stays NaN, ±inf becomes
    ±max); INT8 rounds half to even and clamps to the symmetric range [-127, 127]. FP16 / BF16
    cast as torch does (overflow to inf).
    """
    fmt = Format.parse(fmt)
    if not torch.is_tensor(scale):
        scale = torch.tensor(float(scale), device=x.device)
    y = x.float() * _expand(scale, x, granularity, block)
    if fmt is Format.INT8:
        return torch.round(y).clamp_(-fmt.max, fmt.max).to(torch.int8)
    if fmt.is_fp8:
        # Never trust the cast to saturate (eager CUDA casts do not before torch 2.12; E5M2
        # overflows to inf everywhere): clamp in the same expression.
        y = y.clamp(-fmt.max, fmt.max)
    return y.to(fmt.dtype)


def dequantize(
    q: torch.Tensor,
    scale: "torch.Tensor | float" = 1.0,
    granularity: Granularity = Granularity.TENSOR,
    block: Sequence[int] = ACTIVATION_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q / scale`` in ``dtype``: the inverse of `quantize` up to the format's rounding."""
    if not torch.is_tensor(scale):
        scale = torch.tensor(float(scale), device=q.device)
    return (q.float() / _expand(scale, q, granularity, block)).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    fmt: Format,
    scale: "torch.Tensor | None" = None,
    granularity: Granularity = Granularity.TENSOR,
    block: Sequence[int] = ACTIVATION_BLOCK,
    margin: int = 0,
) -> torch.Tensor:
    """x rounded through ``fmt`` and back (quantize-dequantize), in x's dtype.

    With no scale given, the scale comes from x's own amax (current scaling). Used to measure the
    error a format adds; not differentiable on purpose (callers decide the gradient rule).
    """
    fmt = Format.parse(fmt)
    if fmt is Format.FP32:
        return x.clone()
    if scale is None:
        scale = scale_from_amax(amax(x, granularity, block), fmt, margin)
    return dequantize(quantize(x, fmt, scale, granularity, block), scale, granularity, block, dtype=x.dtype)


def round_to_format(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round FP32 values to the nearest value of ``fmt`` with plain FP32 arithmetic.

    Bit-identical to ``x.to(fmt.dtype).float()`` for every float format (round to nearest even,
    subnormals, E4M3 saturation, overflow to inf elsewhere) and to `quantize` for INT8 with scale 1.
    It needs no native dtype, so it also serves devices and builds that lack one.
    """
    fmt = Format.parse(fmt)
    x = x.float()
    spec = fmt.spec
    if fmt is Format.INT8:
        return torch.round(x).clamp(-spec.max, spec.max)
    if fmt is Format.FP32:
        return x.clone()
    # For |x| in [2^e, 2^(e+1)) the spacing of representable values is 2^(e - mantissa_bits);
    # below the smallest normal the spacing stays that of the smallest normal (subnormals).
    min_exp = round(math.log2(spec.min_normal))
    _, exp = torch.frexp(x)  # x = m * 2^exp with 0.5 <= |m| < 1, so floor(log2|x|) = exp - 1
    e = torch.clamp(exp - 1, min=min_exp)
    quantum = torch.ldexp(torch.ones_like(x), (e - spec.mantissa_bits).to(torch.int32))
    # Dividing by a power of two is exact, and torch.round rounds half to even.
    y = torch.round(x / quantum) * quantum
    too_big = y.abs() > spec.max
    if spec.saturates:
        y = torch.where(too_big | torch.isinf(x), torch.copysign(torch.full_like(x, spec.max), x), y)
    else:
        y = torch.where(too_big, torch.copysign(torch.full_like(x, math.inf), x), y)
    return torch.where(torch.isnan(x), x, y)


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20·log10(‖ref‖ / ‖ref − approx‖)``.

    Forces a host sync (returns a Python float); inf when the two are identical.
    """
    ref = reference.detach().double()
    noise = (ref - approximation.detach().double()).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))


class AmaxHistory:
    """A rolling window of per-tensor amax values for delayed scaling (state stays on device).

    Delayed scaling (Transformer Engine's default recipe): step t quantizes with a scale derived
    from the amaxes of steps before t, then records its own amax. No host sync per step.
    `reduction` is "max" (the window's largest amax; safe against spikes) or "most_recent".
    """

    REDUCTIONS = ("max", "most_recent")

    def __init__(self, length: int = 16, reduction: str = "max", device: "torch.device | str | None" = None):
        if length < 1:
            raise FormatError(f"amax history length must be >= 1, got {length}")
        if reduction not in self.REDUCTIONS:
            raise FormatError(f"amax reduction must be one of {self.REDUCTIONS}, got {reduction!r}")
        self.length = length
        self.reduction = reduction
        self.history = torch.zeros(length, device=device)
        self.recorded = 0  # number of amaxes recorded so far (host int: no sync to read it)

    def __repr__(self) -> str:
        return f"AmaxHistory(length={self.length}, reduction={self.reduction!r}, recorded={self.recorded})"

    def record(self, value: torch.Tensor) -> None:
        if self.history.device != value.device:
            self.history = self.history.to(value.device)
        value = value.detach().float().reshape(())
        # A non-finite amax belongs to an overflowed step that the loss scaler skips; recording it
        # would poison every later scale, so it counts as zero (ignored by the max reduction).
        self.history[self.recorded % self.length] = torch.where(torch.isfinite(value), value, torch.zeros_like(value))
        self.recorded += 1

    def reduced(self) -> torch.Tensor:
        """The amax the next scale comes from (zero while the history is empty)."""
        if self.recorded == 0:
            return self.history.new_zeros(())
        if self.reduction == "most_recent":
            return self.history[(self.recorded - 1) % self.length]
        return self.history[: min(self.recorded, self.length)].amax()

    def next_scale(self, current_amax: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
        """Scale for this step from the history, then record this step's amax.

        The first step has no history and uses its own amax (current scaling).
        """
        basis = current_amax if self.recorded == 0 else self.reduced()
        scale = scale_from_amax(basis, fmt, margin)
        self.record(current_amax)
        return scale

    def state_dict(self) -> dict:
        return {"length": self.length, "reduction": self.reduction, "history": self.history.clone(), "recorded": self.recorded}

    def load_state_dict(self, state: dict) -> None:
        if state["length"] != self.length:
            raise FormatError(f"amax history length {state['length']} in the state does not match {self.length}")
        self.reduction = state["reduction"]
        self.history = state["history"].clone().to(self.history.device)
        self.recorded = int(state["recorded"])
