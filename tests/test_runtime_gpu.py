"""GPU checks of the runtime: real cuBLASLt FP8 and INT8 kernels against plain PyTorch.

Skipped with the capability reason where no CUDA device (or no FP8 / INT8 kernel) exists.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.device import has_int_mm, has_scaled_mm
from autoprec.formats import sqnr
from autoprec.measure import SavedTensorMeter
from autoprec.workloads import LMConfig, TransformerBlock

CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device: GPU kernels cannot be checked on this machine"
FP8_OK, FP8_REASON = has_scaled_mm("cuda:0") if CUDA else (False, NO_CUDA)
INT8_OK, INT8_REASON = has_int_mm("cuda:0") if CUDA else (False, NO_CUDA)

pytestmark = pytest.mark.gpu


def _linear(d_in=256, d_out=512, tokens=128):
    torch.manual_seed(0)
    layer = nn.Linear(d_in, d_out).cuda()
    return layer, torch.randn(tokens, d_in, device="cuda"), torch.randn(tokens, d_out, device="cuda")


@pytest.mark.skipif(not FP8_OK, reason=FP8_REASON)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_linear_runs_scaled_mm_on_gpu_and_tracks_fp32(granularity):
    layer, x, grad = _linear()
    ref = layer(x)
    mode = "current" if granularity == "row" else "delayed"
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3", scaling=ap.Scaling(granularity=granularity, mode=mode)))
    xq = x.clone().requires_grad_(True)
    with runtime:
        out = layer(xq)
    out.backward(grad.to(out.dtype))
    assert runtime.report()[""]["ops"] == {"linear": "kernel torch._scaled_mm"}
    assert sqnr(ref, out.float()) > 26
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.skipif(not FP8_OK, reason=FP8_REASON)
@pytest.mark.parametrize("tokens", [24, 1000, 4104])
def test_fp8_unaligned_shapes_run_the_kernel_padded_and_stay_finite(tokens):
    """K, N and the token count off the 16-multiple: operands are padded, never emulated."""
    layer, x, grad = _linear(d_in=100, d_out=60, tokens=tokens)
    ref = layer(x)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e5m2", scaling=ap.Scaling(mode="delayed")))
    xq = x.clone().requires_grad_(True)
    with runtime:
        out = layer(xq)
    out.backward(grad.to(out.dtype))
    assert runtime.emulated_layers() == {}
    assert torch.isfinite(out).all() and torch.isfinite(xq.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert sqnr(ref, out.float()) > 20


@pytest.mark.skipif(not FP8_OK, reason=FP8_REASON)
def test_runtime_state_loaded_on_cpu_follows_the_data_to_the_gpu():
    layer, x, _ = _linear()
    plan = ap.Plan.uniform(layer, "fp8_e4m3", scaling=ap.Scaling(mode="delayed"))
    runtime = ap.apply_plan(layer, plan)
    with runtime:
        layer(x).float().sum().backward()
    state = torch.load(_roundtrip(runtime.state_dict()), map_location="cpu")
    fresh = ap.apply_plan(layer, plan)
    fresh.load_state_dict(state)
    with torch.no_grad(), fresh:
        out = fresh.model(x)
    assert torch.isfinite(out).all()


def _roundtrip(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.skipif(not INT8_OK, reason=INT8_REASON)
def test_int8_linear_runs_int_mm_on_gpu_and_tracks_fp32():
    layer, x, _ = _linear()
    ref = layer(x)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "int8", calibration=ap.Calibration(batches=1)))
    with torch.no_grad(), runtime:
        out = layer(x)
    assert runtime.report()[""]["ops"] == {"linear": "kernel torch._int_mm"}
    assert sqnr(ref, out.float()) > 30


@pytest.mark.skipif(not FP8_OK, reason=FP8_REASON)
def test_fp8_block_saves_at_most_three_quarters_of_autocast_on_gpu():
    torch.manual_seed(0)
    block = TransformerBlock(LMConfig(d_model=256, n_heads=4, d_ff=1024)).cuda()
    x = torch.randn(8, 64, 256, device="cuda")

    def saved(context):
        with SavedTensorMeter(block.parameters()) as meter, context:
            out = block(x)
        out.float().sum().backward()
        return meter.total_bytes

    autocast = saved(torch.autocast("cuda", torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        fp8 = saved(ap.apply_plan(block, ap.Plan.uniform(block, "fp8_e4m3", x)))
    assert fp8 <= 0.75 * autocast
