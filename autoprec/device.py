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

__all__ = ["Support", "format_support", "has_scaled_mm", "scaled_mm_form", "block_scaled_form", "block_support", "has_int_mm", "resolve_device", "KERNEL_OPS", "MX_EMULATED", "NVFP4_EMULATED"]

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


def canonical_device(device: "torch.device | str | None") -> str:
    """``device`` (default CPU) as one string per device, which the kernel support checks take:
    ``"cuda:<index>"`` (the current device where none is given) or the type (``"cpu"``, ``"mps"``)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# What a kernel raises for a form it refuses: RuntimeError (TORCH_CHECK, or an INTERNAL ASSERT as
# torch 2.11's CPU kernel for row-shaped scales), ValueError (TORCH_CHECK_VALUE in newer torch),
# NotImplementedError (no kernel for the device), TypeError (an argument the build lacks).
_REFUSALS = (RuntimeError, NotImplementedError, ValueError, TypeError)


@functools.lru_cache(maxsize=None)
def scaled_mm_form(
    device: str, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, *, row_scales: bool = False, bias: bool = False,
) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` runs on ``device`` in exactly this form: operands ``a_dtype`` x
    ``b_dtype`` (the second column-major, as cuBLASLt wants), scales per tensor (0-d) or, with
    ``row_scales``, in row-wise shape ((M, 1) and (1, N)), an ``out_dtype`` output and, with
    ``bias``, a fused bias in ``out_dtype``. One tiny call on the installed torch, cached per form.

    Accepted forms differ between torch versions and devices (torch 2.11's CPU kernel refuses
    row-shaped scales that 2.13's runs; CUDA's row-wise path needs compute capability 9.0 and
    cuBLAS 12.9 for an FP16 output), so the runtime asks this before it makes a call.
    """
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8 dtypes or _scaled_mm"
    if device.startswith("cuda") and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return False, f"FP8 GEMMs need compute capability 8.9 (Ada/Hopper); {device} has {major}.{minor}"
    form = (
        f"{str(a_dtype).removeprefix('torch.')} x {str(b_dtype).removeprefix('torch.')} -> {str(out_dtype).removeprefix('torch.')}, "
        f"{'row-wise' if row_scales else 'per-tensor'} scales{', fused bias' if bias else ''}"
    )
    try:
        m, k, n = 16, 32, 16
        a = torch.ones(m, k, device=device).to(a_dtype)
        b = torch.ones(n, k, device=device).to(b_dtype).t()  # column-major
        scale_a = torch.ones(m, 1, device=device) if row_scales else torch.ones((), device=device)
        scale_b = torch.ones(1, n, device=device) if row_scales else torch.ones((), device=device)
        kernel_bias = torch.ones(n, device=device, dtype=out_dtype) if bias else None
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=kernel_bias, out_dtype=out_dtype, use_fast_accum=True)
        # A kernel that runs but computes something else is refused too: each entry is K (+ 1).
        expected = k + (1 if bias else 0)
        if out.dtype != out_dtype or not bool((out.float() == expected).all()):
            return False, f"torch._scaled_mm on {device} ({form}) returned a wrong result"
    except _REFUSALS as exc:
        return False, f"torch {torch.__version__} _scaled_mm does not run on {device} ({form}): {_first_line(exc)}"
    return True, f"torch._scaled_mm runs on {device} ({form})"


# The per-tensor forms every FP8 layer's three GEMMs make (runtime.gemm): forward E4M3 / E5M2
# input x E4M3 weight into the region's half dtype with a fused bias; input gradient (E4M3 /
# E5M2 gradient x E4M3 weight) into the input's dtype; weight gradient (E4M3 / E5M2 gradient x
# E4M3 / E5M2 input, never E5M2 x E5M2) into FP32.
_E4M3, _E5M2 = (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
_REQUIRED_FORMS = (
    (_E4M3, _E4M3, torch.float32, False),
    (_E5M2, _E4M3, torch.float32, False),
    (_E4M3, _E5M2, torch.float32, False),
    (_E4M3, _E4M3, torch.bfloat16, True),
    (_E5M2, _E4M3, torch.bfloat16, True),
    (_E4M3, _E4M3, torch.float16, True),
    (_E5M2, _E4M3, torch.float16, True),
)


@functools.lru_cache(maxsize=None)
def has_scaled_mm(device: str) -> tuple[bool, str]:
    """Probe ``torch._scaled_mm`` in the per-tensor forms every FP8 layer makes (`scaled_mm_form`
    for each: E4M3 x E4M3, E5M2 x E4M3 and E4M3 x E5M2 into FP32; E4M3 / E5M2 x E4M3 into BF16
    with a fused bias). Row-wise scales and FP16 outputs are probed where they are used."""
    for a_dtype, b_dtype, out_dtype, bias in _REQUIRED_FORMS:
        ok, reason = scaled_mm_form(device, a_dtype, b_dtype, out_dtype, bias=bias)
        if not ok:
            return False, reason
    return True, f"torch._scaled_mm runs on {device}"


# The block-scaled forms of an FP8 layer's three products (`runtime.block_gemm`): forward and input
# gradient (1x128 x 128x128) into the region's dtype, the forward with a fused bias in a half
# dtype; weight gradient (1x128 x 1x128) into FP32.
_BLOCK_FORMS = ((True, torch.bfloat16, True), (True, torch.float16, True), (True, torch.float32, False), (False, torch.float32, False))


@functools.lru_cache(maxsize=None)
def block_scaled_form(device: str) -> tuple[bool, str]:
    """Whether the installed torch runs every block-scaled FP8 GEMM form the runtime issues on
    ``device`` (``torch.nn.functional.scaled_mm`` with 1x128 / 128x128 scales: sm_90 with
    cuBLASLt >= 12.9; no CPU kernel in any torch): ``(ok, why)``. One tiny call per form with
    known scales, the result checked, cached per device (never in a forward)."""
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (block-scaled FP8 GEMMs)"
    m, k, n = 16, 256, 128
    for blocks_b, out_dtype, with_bias in _BLOCK_FORMS:
        name = f"{'1x128 x 128x128' if blocks_b else '1x128 x 1x128'} -> {str(out_dtype).removeprefix('torch.')}{' with bias' if with_bias else ''}"
        try:
            a = torch.ones(m, k, device=device).to(_E4M3)
            b = torch.ones(n, k, device=device).to(_E4M3).t()
            # Scales 1/2 and 1/4 laid out as the kernel takes them ("outer-dim-major"; a 128x128
            # operand's K-block count padded to 4): each entry K/8 (+ 1), exact in every dtype.
            scale_a = torch.full((k // 128, m), 0.5, device=device).t()
            if blocks_b:
                scale_b = torch.full((n // 128, 4), 0.25, device=device).t()
                recipe_b = F.ScalingType.BlockWise128x128
            else:
                scale_b = torch.full((k // 128, n), 0.25, device=device).t()
                recipe_b = F.ScalingType.BlockWise1x128
            bias = torch.ones(n, device=device, dtype=out_dtype) if with_bias else None
            out = F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b, bias=bias, output_dtype=out_dtype, use_fast_accum=False)
            if out.dtype != out_dtype or not bool((out.float() == k / 8 + (1.0 if with_bias else 0.0)).all()):
                return False, f"block-scaled FP8 GEMM ({name}) on {device} returned a wrong result"
        except _REFUSALS as exc:
            return False, f"torch {torch.__version__} has no block-scaled FP8 GEMM on {device} ({name}): {_first_line(exc)[:200]}"
    return True, f"torch.nn.functional.scaled_mm runs block-scaled FP8 on {device}"


# Why MXFP8 products are emulated on every device (`runtime.mx_gemm`).
MX_EMULATED = "no MXFP8 kernel is built: torch's MX-scaled GEMM runs on sm_100 only, not checked here"
NVFP4_EMULATED = "no NVFP4 kernel is built: torch's FP4 scaled GEMM runs on sm_100 only, not checked here"


def block_support(fmt: Format, grad_fmt: Format, device: "torch.device | str") -> "str | None":
    """Why a block-scaled layer in ``fmt`` with ``grad_fmt`` gradients cannot run its kernels on
    ``device``, or None. Torch's block-scaled GEMM takes E4M3 operands only (DeepSeek-V3's
    recipe: E4M3 gradients, which the fine scales make safe), and `block_scaled_form` must run."""
    off = [f"{kind} {f.value}" for kind, f in (("format", fmt), ("grad_format", grad_fmt)) if f is not Format.FP8_E4M3]
    if off:
        return f"block-scaled GEMMs take E4M3 operands only ({', '.join(off)}; set them to fp8_e4m3)"
    ok, why = block_scaled_form(canonical_device(device))
    return None if ok else why


@functools.lru_cache(maxsize=None)
def has_int_mm(device: str) -> tuple[bool, str]:
    """Probe ``torch._int_mm`` (INT8 × INT8 → INT32) with one tiny call."""
    if not hasattr(torch, "_int_mm"):
        return False, f"torch {torch.__version__} has no _int_mm"
    try:
        a = torch.zeros(32, 32, dtype=torch.int8, device=device)
        torch._int_mm(a, a.t())  # the runtime's layout: the weight (N, K) row-major, transposed
    except _REFUSALS as exc:
        return False, f"torch._int_mm does not run on {device}: {_first_line(exc)}"
    return True, f"torch._int_mm runs on {device}"


def format_support(fmt: Format, device: "torch.device | str | None" = None) -> Support:
    """Whether ``fmt`` runs on ``device`` (default CPU), and how."""
    fmt = Format.parse(fmt)
    key = canonical_device(device)
    if fmt is Format.FP32:
        return Support(True, True, "FP32 runs everywhere")
    if fmt in (Format.BF16, Format.FP16):
        if key.startswith("cuda") and fmt is Format.BF16 and not torch.cuda.is_bf16_supported():
            return Support(False, False, "BF16 needs compute capability 8.0 (Ampere or newer)")
        if not torch.amp.is_autocast_available(key.split(":")[0]):
            return Support(False, False, f"torch.autocast does not support device type {key!r}")
        return Support(True, True, f"torch.autocast({key.split(':')[0]!r}, {fmt.dtype})")
    if fmt is Format.NVFP4:
        return Support(True, False, NVFP4_EMULATED + "; emulated (NVFP4 storage, FP32 compute)")
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
