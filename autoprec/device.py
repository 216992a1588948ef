"""What a device can run: a format through a real kernel, through emulation, or not at all.

Capabilities are probed by running the kernel once on tiny tensors (cached per device), not read
from a table of compute capabilities, so a torch build or driver that lacks a kernel is seen as it
is. Every answer carries its reason, for errors, run reports and test skip markers alike.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .formats import Format

__all__ = ["Support", "format_support", "has_scaled_mm", "has_int_mm", "resolve_device", "KERNEL_OPS"]

# Ops that a 2-D FP8 / INT8 GEMM kernel serves; every other matrix product (convolution, batched
# matmul, attention) in an FP8 or INT8 layer is emulated: stored in the format, computed in FP32.
KERNEL_OPS = frozenset({"linear", "matmul", "mm", "addmm"})


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether a format runs on a device: ``runnable`` at all, with a real ``kernel`` or emulated."""

    runnable: bool
    kernel: bool
    reason: str

    def __bool__(self) -> bool:
        return self.runnable


def _device_key(device: "torch.device | str | None") -> str:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type


@functools.lru_cache(maxsize=None)
def has_scaled_mm(device: str) -> tuple[bool, str]:
    """Probe ``torch._scaled_mm`` in the forms the runtime calls it: E4M3 × E4M3 and E5M2 × E4M3
    operands, FP32 and BF16 outputs, a fused bias (one tiny call each)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8 dtypes or _scaled_mm"
    if device.startswith("cuda") and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return False, f"FP8 GEMMs need compute capability 8.9 (Ada/Hopper); {device} has {major}.{minor}"
    try:
        one = torch.ones((), device=device)
        a = torch.zeros(16, 32, device=device)
        b = torch.zeros(32, 16, device=device).t().contiguous().t()  # column-major, as cuBLASLt wants
        torch._scaled_mm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), scale_a=one, scale_b=one, out_dtype=torch.float32)
        torch._scaled_mm(a.to(torch.float8_e5m2), b.to(torch.float8_e4m3fn), scale_a=one, scale_b=one, out_dtype=torch.float32)
        # The runtime's forward form: BF16 output, fused BF16 bias, fast accumulation.
        bias = torch.zeros(16, device=device, dtype=torch.bfloat16)
        torch._scaled_mm(
            a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), scale_a=one, scale_b=one,
            bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True,
        )
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        # Newer torch raises ValueError (TORCH_CHECK_VALUE) for unsupported devices or dtypes.
        return False, f"torch._scaled_mm does not run on {device}: {str(exc).splitlines()[0]}"
    return True, f"torch._scaled_mm runs on {device}"


@functools.lru_cache(maxsize=None)
def has_int_mm(device: str) -> tuple[bool, str]:
    """Probe ``torch._int_mm`` (INT8 × INT8 → INT32) with one tiny call."""
    if not hasattr(torch, "_int_mm"):
        return False, f"torch {torch.__version__} has no _int_mm"
    try:
        a = torch.zeros(32, 32, dtype=torch.int8, device=device)
        torch._int_mm(a, a.t())  # the runtime's layout: the weight (N, K) row-major, transposed
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        return False, f"torch._int_mm does not run on {device}: {str(exc).splitlines()[0]}"
    return True, f"torch._int_mm runs on {device}"


def format_support(fmt: Format, device: "torch.device | str | None" = None) -> Support:
    """Whether ``fmt`` runs on ``device`` (default CPU), and how."""
    fmt = Format.parse(fmt)
    key = _device_key(device)
    if fmt is Format.FP32:
        return Support(True, True, "FP32 runs everywhere")
    if fmt in (Format.BF16, Format.FP16):
        if key.startswith("cuda") and fmt is Format.BF16 and not torch.cuda.is_bf16_supported():
            return Support(False, False, "BF16 needs compute capability 8.0 (Ampere or newer)")
        if not torch.amp.is_autocast_available(key.split(":")[0]):
            return Support(False, False, f"torch.autocast does not support device type {key!r}")
        return Support(True, True, f"torch.autocast({key.split(':')[0]!r}, {fmt.dtype})")
    if fmt.is_fp8:
        if not hasattr(torch, "float8_e4m3fn"):
            return Support(False, False, f"torch {torch.__version__} has no float8 dtypes; upgrade to torch>=2.1")
        ok, reason = has_scaled_mm(key)
        return Support(True, ok, reason if ok else reason + "; emulated (FP8 storage, FP32 compute)")
    ok, reason = has_int_mm(key)
    return Support(True, ok, reason if ok else reason + "; emulated (INT8 storage, FP32 compute)")


def resolve_device(name: "str | torch.device", error: type, job: str, fix: str = "use --device cpu") -> torch.device:
    """The device a job runs on: ``"auto"`` is CUDA when available, else CPU.

    Raises ``error`` (an autoprec error class) with one line naming the device and the fix for a
    name torch does not know, a CUDA device this machine lacks, or a type other than cpu / cuda.
    ``fix`` says how this job's user picks another device (a flag, a config key).
    """
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise error(f"device {name!r} is not a torch device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise error(f"device {name!r}: CUDA is not available in this torch build or machine; {fix}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise error(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif device.type != "cpu":
        raise error(f"device {name!r}: {job} runs on 'cpu' or 'cuda' only")
    return device
