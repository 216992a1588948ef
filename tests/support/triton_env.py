"""Where the fused Triton casts' tests run, and the runtime forced onto those casts (shared by
tests/runtime/test_triton_cast.py and tests/runtime/test_triton_block_cast.py).

Without CUDA the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported), with CUDA compiled on CUDA tensors; `NO_KERNELS`
says why neither can, and `needs_kernels` skips with it.
"""

from __future__ import annotations

import os

import pytest
import torch

__all__ = ["DEVICE", "NO_KERNELS", "NUMPY_WARNINGS", "needs_kernels", "force_fused_casts"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
try:
    import triton  # noqa: F401
except ImportError as exc:
    NO_KERNELS: "str | None" = f"triton does not import ({exc}): the fused casts need it (torch's CUDA wheels ship it)"
else:
    NO_KERNELS = None
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        NO_KERNELS = "no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here"
needs_kernels = pytest.mark.skipif(NO_KERNELS is not None, reason=NO_KERNELS or "")

# The interpreter computes with NumPy, which warns where IEEE arithmetic gives inf or NaN (tested).
NUMPY_WARNINGS = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def force_fused_casts(monkeypatch):
    """Runtimes made after this take the fused casts (CUDA's own choice; on CPU forced: the
    interpreted kernels), and every launch runs outside dispatch modes: the interpreter's own host
    copies are not the step's ops (a compiled launch dispatches none). Returns the `FusedCasts`."""
    from torch.utils._python_dispatch import _disable_current_modes

    from autoprec.runtime import triton_arith, triton_block_cast, triton_cast
    from autoprec.runtime.casts import fused_casts

    launch = triton_arith._launch

    def outside_modes(*args, **kwargs):
        with _disable_current_modes():
            launch(*args, **kwargs)

    for module in (triton_cast, triton_block_cast):  # each launches through its own imported name
        monkeypatch.setattr(module, "_launch", outside_modes)
    if DEVICE == "cpu":
        made = triton_cast.FusedCasts("cpu")
        monkeypatch.setattr("autoprec.runtime.layers.fused_casts", lambda device: made)
        return made
    return fused_casts(DEVICE)
