"""Quantizing one operand: amax → inverse scale → saturating cast, as pure tensor functions.

Each function is a handful of elementwise ops and at most one reduction, with no host sync and no
Python branching on tensor values, so ``torch.compile`` fuses a whole quantization into one or
two kernels and eager mode issues few of them.

Conventions: the runtime carries the *inverse* scale (``x ≈ q * inv_scale``), which is what
``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b`` and what dequantizing multiplies by.

Overflow stays visible. A cast is never trusted to saturate: values are clamped to the format's
finite range in the same expression as the cast (eager FP8 casts on CUDA do not saturate before
torch 2.12, and E5M2 overflows to inf everywhere). A non-finite amax gives a non-finite inverse
scale, so a tensor holding inf or NaN quantizes to NaN and the loss scaler skips the step instead
of training on a silently clamped value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import Format

__all__ = ["amax", "inverse_scale", "to_fp8", "to_int8", "pad_to_multiple"]

# Smallest amax a scale is taken from (torchao uses the same floor): keeps fmt.max / amax finite
# for an all-zero tensor while leaving every real tensor's scale exact.
_AMAX_FLOOR = 1e-12


def amax(x: torch.Tensor, dim: "int | None" = None) -> torch.Tensor:
    """Largest magnitude in FP32: over the whole tensor (``()``), or along ``dim`` (kept as size 1).

    One reduction kernel (``linalg.vector_norm`` with ord=inf), no temporary of x's size; NaN and
    inf propagate.
    """
    if dim is None:
        return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)


def inverse_scale(amax: torch.Tensor, fmt: Format, margin: int = 0) -> torch.Tensor:
    """``amax / (fmt.max / 2**margin)``: the factor that maps the format's range back onto x's.

    inf or NaN amax gives inf / NaN (the step is poisoned, as it should be); zero gives a tiny
    finite factor. Two scalar ops.
    """
    # A multiply by a constant, not a divide: torch.compile rewrites division by a constant into
    # this multiply, and eager must round the scale identically for compiled and eager runs to
    # quantize to the same bits.
    return amax.clamp_min(_AMAX_FLOOR) * (2.0**margin / fmt.max)


def to_fp8(x: torch.Tensor, inv_scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``saturate(x / inv_scale)`` in ``fmt.dtype``: one fused pass under compile (div, clamp, cast)."""
    return (x / inv_scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def to_int8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 ``clamp(round(x / inv_scale), -127, 127)``, round half to even."""
    return torch.round(x / inv_scale).clamp(-127, 127).to(torch.int8)


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
