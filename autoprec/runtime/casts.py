"""Which casts an FP8 kernel layer quantizes with on a device: fused Triton kernels or PyTorch ops.

Chosen once per device (`cast_path`), named in `PlanRuntime.report` (``"casts"``): the fused
kernels (`triton_cast`) where the device is CUDA and ``import triton`` works, the PyTorch ops of
`autoprec.formats` everywhere else (CPU, other accelerators, a torch without Triton). Both give
the same bytes. Under ``torch.compile`` the PyTorch ops run on every device: Inductor fuses them
itself (into one kernel per operand), and an opaque Triton launch would break the graph.

Per call the fused path also needs operands it takes (FP32 or BF16; an FP16 region keeps the
PyTorch ops: `call_casts`).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Optional

import torch

from ..device import canonical_device

if TYPE_CHECKING:
    from .triton_cast import FusedCasts

__all__ = ["FUSED", "PYTORCH", "choose", "cast_path", "fused_casts", "call_casts", "describe"]

FUSED = "fused Triton cast"
PYTORCH = "PyTorch ops"


def choose(device_type: str, triton_error: Optional[str]) -> tuple[str, str]:
    """``(path, reason)`` for a device of ``device_type`` when importing Triton failed with
    ``triton_error`` (None: it imports): the fused path exactly on CUDA with Triton."""
    if device_type != "cuda":
        return PYTORCH, f"fused casts run on CUDA only ({device_type} device)"
    if triton_error is not None:
        return PYTORCH, f"triton does not import: {triton_error}"
    return FUSED, "CUDA device with triton"


@functools.lru_cache(maxsize=None)
def _triton_error() -> Optional[str]:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as exc:  # noqa: BLE001 -- any failure to import means "no Triton"
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


def cast_path(device: "torch.device | str") -> tuple[str, str]:
    """`choose` for ``device``; Triton is imported (once) only for a CUDA device."""
    device_type = torch.device(device).type
    return choose(device_type, _triton_error() if device_type == "cuda" else None)


@functools.lru_cache(maxsize=None)
def _fused(device: str) -> "FusedCasts":
    from .triton_cast import FusedCasts

    return FusedCasts(device)


def fused_casts(device: "torch.device | str") -> "FusedCasts | None":
    """The device's `triton_cast.FusedCasts` (made once per device: its one probe syncs once)
    where `cast_path` chooses the fused path, else None."""
    if cast_path(device)[0] != FUSED:
        return None
    return _fused(canonical_device(device))


def describe(**fused: bool) -> str:
    """What one call quantized with, from which operands took the fused kernels:
    ``describe(weight=True, input=False, gradient=True)`` ->
    ``"fused Triton cast (weight, gradient); PyTorch ops (input)"``."""
    on = [name for name, used in fused.items() if used]
    if len(on) == len(fused):
        return FUSED
    if not on:
        return PYTORCH
    off = [name for name, used in fused.items() if not used]
    return f"{FUSED} ({', '.join(on)}); {PYTORCH} ({', '.join(off)})"


def call_casts(casts: "FusedCasts | None", *dtypes: torch.dtype) -> "FusedCasts | None":
    """``casts`` for one eager call whose operands have ``dtypes``, or None: the PyTorch ops
    (compiling, or an operand dtype the fused kernels do not take)."""
    if casts is None or torch.compiler.is_compiling():
        return None
    return casts if all(casts.takes(d) for d in dtypes) else None
