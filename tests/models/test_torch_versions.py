"""Each statement of `tests/support/torch_versions.py` holds for the installed torch.

A test here failing means the installed torch behaves unlike its statement: fix the statement (and
the code path that depends on it), not this test.
"""

import math

import pytest
import torch

from autoprec.device import scaled_mm_form
from support import torch_versions as tv

E4M3 = torch.float8_e4m3fn
tested = pytest.mark.skipif(tv.TORCH not in tv.TESTED, reason=f"torch {torch.__version__} is not a tested version (2.11, 2.13)")


@tested
def test_cpu_e4m3_cast_past_the_range_per_version():
    got = torch.tensor([1e6, -500.0, math.inf, -math.inf]).to(E4M3).float()
    if tv.CPU_E4M3_CAST_SATURATES:  # 2.13
        assert got.tolist() == [448.0, -448.0, 448.0, -448.0]
    else:  # 2.11
        assert got.isnan().all()


def test_cpu_e4m3_cast_below_the_rounding_limit_gives_max_on_every_version():
    # 448 + 16 is the tie that rounds to even (448); no saturation is needed up to it.
    assert torch.tensor([463.9, 464.0, -464.0]).to(E4M3).float().tolist() == [448.0, 448.0, -448.0]


def test_saturating_cast_clamps_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, 447.0, math.nan])
    got = tv.saturating_cast(x, E4M3).float()
    assert got[:3].tolist() == [448.0, -448.0, 448.0] and got[3].isnan()


@tested
def test_cpu_scaled_mm_row_scales_per_version():
    a = torch.ones(16, 32).to(E4M3)

    def call():
        return torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)

    if tv.CPU_SCALED_MM_ROW_SCALES:  # 2.13
        assert call().float().eq(32).all()
    else:  # 2.11
        with pytest.raises(RuntimeError, match="per-tensor scaling for CPU"):
            call()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_device_probe_agrees_with_the_version_statement(out_dtype):
    ok, reason = scaled_mm_form("cpu", E4M3, E4M3, out_dtype, row_scales=True, bias=out_dtype != torch.float32)
    assert ok is tv.CPU_SCALED_MM_ROW_SCALES, reason
    # Per-tensor scales run on every tested version.
    assert scaled_mm_form("cpu", E4M3, E4M3, out_dtype)[0]


@tested
def test_cpu_scaled_mm_v2_per_version():
    a, one = torch.ones(16, 32).to(E4M3), torch.tensor(1.0)

    def call():
        return torch.ops.aten._scaled_mm_v2.default(a, a.t(), [one], [0], [], [one], [0], [], None, torch.float32)

    if tv.CPU_SCALED_MM_V2:  # 2.13
        assert call().eq(32).all()
    else:  # 2.11
        with pytest.raises(NotImplementedError):
            call()
