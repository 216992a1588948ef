"""What the tested torch versions do differently on CPU, stated per version.

autoprec is tested on torch 2.11 (the GPU machines' version) and 2.13. A test that compares with
a torch behaviour reads the statement here instead of assuming one version's; `test_torch_versions`
checks every statement against the installed torch, so a statement that stops being true fails
there first. On a version not listed the behaviour is probed (and that test says so).
"""

from __future__ import annotations

import torch

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
TESTED = ((2, 11), (2, 13))


def _e4m3_cast_saturates() -> bool:
    return torch.tensor([1e6]).to(torch.float8_e4m3fn).float().item() == 448.0


def _row_scales_run() -> bool:
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a[:16].t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _scaled_mm_v2_runs() -> bool:
    a, one = torch.ones(16, 32).to(torch.float8_e4m3fn), torch.tensor(1.0)
    try:
        torch.ops.aten._scaled_mm_v2.default(a, a.t(), [one], [0], [], [one], [0], [], None, torch.float32)
    except (NotImplementedError, RuntimeError, AttributeError):
        return False
    return True


# torch's CPU cast to float8_e4m3fn of a finite value that rounds past 448, or of +-inf:
# 2.13 saturates to +-448; 2.11 gives NaN (the DESIGN's "clamp before every cast").
CPU_E4M3_CAST_SATURATES = {(2, 11): False, (2, 13): True}.get(TORCH)
# torch._scaled_mm on CPU with scales in row-wise shape ((M, 1) and (1, N)): 2.13 runs it (and
# fast); 2.11 refuses it: "INTERNAL ASSERT FAILED ... only supports per-tensor scaling for CPU".
CPU_SCALED_MM_ROW_SCALES = {(2, 11): False, (2, 13): True}.get(TORCH)
# aten._scaled_mm_v2 on CPU: 2.13 runs it; 2.11 has the op but no CPU kernel (NotImplementedError).
CPU_SCALED_MM_V2 = {(2, 11): False, (2, 13): True}.get(TORCH)

# torch.compile (aot_eager) of Int8Linear with outlier channels apart, the side product written
# torch.addmm(out, side, w_side) inside the autograd.Function's forward: 2.11's compiled backward
# gives every gradient of the step as zero, 2.13's matches eager. A two-line Function with the same
# addmm does not reproduce it, so it is not stated as a probe here; gemm.Int8Linear writes the
# product as ``out + side @ w_side`` under compile, and test_runtime_lean's compiled-vs-eager INT8
# case (outlier channels on, the default calibration) guards it on both versions.

if CPU_E4M3_CAST_SATURATES is None:  # an untested version: what it does, probed
    CPU_E4M3_CAST_SATURATES = _e4m3_cast_saturates()
    CPU_SCALED_MM_ROW_SCALES = _row_scales_run()
    CPU_SCALED_MM_V2 = _scaled_mm_v2_runs()


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's own cast of ``x`` to ``dtype``, saturating for float8_e4m3fn on every version: on a
    torch whose CPU cast gives NaN past the range (2.11) the input is clamped to +-448 first
    (NaN stays NaN), which equals the saturating cast bit for bit (448 plus less than half an ulp
    rounds to 448 either way)."""
    if dtype == torch.float8_e4m3fn and not CPU_E4M3_CAST_SATURATES:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)
