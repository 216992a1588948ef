"""DeepSeek-V3's fine-grained FP8 (1x128 tiles, 128x128 weight blocks, E4M3 everywhere) through
the public API: a plan with ``Scaling(granularity="block")`` on real layers.

Where the installed torch has the block-scaled GEMM (sm_90, cuBLASLt >= 12.9) the runtime calls
it; on CPU no torch has one, so these tests register a CPU reference kernel for the same op
(tests/support/block_kernel.py) and check the three products against the recipe computed by hand in plain
PyTorch, every call against CUDA's rules (`CudaRules`), and the emulation the runtime falls back
to without the kernel. Shapes are unaligned on purpose (K=200, N=72, 130 tokens: partial tiles).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.runtime import EmulationWarning
from support.block_kernel import reference_block_kernel
from support.cuda_rules import CudaRules
from support.block_kernel import block_products_by_hand

BLOCK_SCALING = ap.Scaling(granularity="block")
M, K, N = 130, 200, 72


def _step(model, runtime, x, g, autocast=False):
    x = x.detach().clone().requires_grad_()
    with runtime, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(g.to(y.dtype))
    return y, x.grad, model.weight.grad, model.bias.grad if model.bias is not None else None


@pytest.mark.parametrize("layout", ["2d", "transposed", "3d"])
def test_the_block_scaled_products_are_the_recipe_by_hand_and_legal_on_cuda(layout):
    torch.manual_seed(0)
    model = nn.Linear(K, N)
    x = torch.randn(M, K)
    x[:, 3] *= 100  # an outlier channel: its tiles get their own scale
    g = torch.randn(M, N)
    with reference_block_kernel():
        runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x, scaling=BLOCK_SCALING))
        inputs = {"2d": x, "transposed": x.t().contiguous().t(), "3d": x.reshape(2, M // 2, K)}[layout]
        grads = g if layout != "3d" else g.reshape(2, M // 2, N)
        with CudaRules() as rules:
            y, dx, dw, db = _step(model, runtime, inputs, grads)
        report = runtime.report()
    assert rules.counts["_scaled_mm_v2"] == 3  # forward, input gradient, weight gradient
    assert rules.counts["_scaled_mm"] == 0
    assert "scaled_mm (1x128 tiles, 128x128 weight blocks)" in report[""]["ops"]["linear"]
    want = block_products_by_hand(x, model.weight.detach(), model.bias.detach(), g)
    for got, expected in zip((y.reshape(M, N), dx.reshape(M, K), dw, db), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_one_token_keeps_its_scales_outer_dim_major():
    """A (1, K) input's tile scales (1, K/128) need strides (1, 1): CUDA checks stride(0) == 1
    even for one row, where ``.t().contiguous().t()`` keeps (K/128, 1)."""
    torch.manual_seed(4)
    model = nn.Linear(384, N)
    x, g = torch.randn(1, 384), torch.randn(1, N)
    with reference_block_kernel():
        runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x, scaling=BLOCK_SCALING))
        with CudaRules() as rules:
            y, dx, dw, _ = _step(model, runtime, x, g)
    assert rules.counts["_scaled_mm_v2"] == 3
    want = block_products_by_hand(x, model.weight.detach(), model.bias.detach(), g)
    for got, expected in zip((y, dx, dw), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_under_autocast_the_bias_is_fused_and_the_output_is_the_region_dtype():
    torch.manual_seed(1)
    model = nn.Linear(K, N)
    x, g = torch.randn(M, K), torch.randn(M, N)
    with reference_block_kernel():
        runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x, scaling=BLOCK_SCALING))
        with CudaRules() as rules:
            y, dx, dw, _ = _step(model, runtime, x, g, autocast=True)
    assert rules.counts["_scaled_mm_v2"] == 3
    assert y.dtype == torch.bfloat16 and dw.dtype == torch.float32
    want_y, _, want_dw, _ = block_products_by_hand(x, model.weight.detach(), model.bias.detach(), g.bfloat16().float())
    torch.testing.assert_close(y.float(), want_y, rtol=2e-2, atol=5e-2)  # BF16 output rounding
    torch.testing.assert_close(dw, want_dw, rtol=1e-4, atol=1e-3)


def test_block_scaling_defaults_to_e4m3_gradients():
    lp = ap.LayerPrecision("fp8_e4m3", scaling=BLOCK_SCALING)
    assert lp.grad_format is ap.Format.FP8_E4M3
    assert ap.LayerPrecision("fp8_e4m3").grad_format is ap.Format.FP8_E5M2


def test_without_the_kernel_a_block_layer_runs_the_kernels_products_emulated_and_says_why():
    # Before: emulated as any other op (inputs rounded once, the product in FP32, the backward
    # from the forward's tilings), so the weight gradient took x tiled along K and g along N where
    # the kernels (and Transformer Engine) tile both along the tokens: 5 % off on a 128^3 layer.
    torch.manual_seed(2)
    model = nn.Linear(K, N)
    x, g = torch.randn(M, K), torch.randn(M, N)
    x[:, 3] *= 100
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x, scaling=BLOCK_SCALING))
    with pytest.warns(EmulationWarning, match="no block-scaled FP8 GEMM on cpu"):
        y, dx, dw, db = _step(model, runtime, x, g)
    assert runtime.report()[""]["ops"]["linear"].startswith("emulated") and "block kernels' tilings" in runtime.report()[""]["ops"]["linear"]
    want = block_products_by_hand(x, model.weight.detach(), model.bias.detach(), g)
    for got, expected in zip((y, dx, dw, db), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_an_e5m2_gradient_under_block_scaling_names_the_fix():
    model = nn.Linear(K, N)
    lp = ap.LayerPrecision("fp8_e4m3", grad_format="fp8_e5m2", scaling=BLOCK_SCALING)
    with reference_block_kernel():
        runtime = ap.apply_plan(model, ap.Plan({"": lp}))
        with pytest.warns(EmulationWarning, match="E4M3 operands only .*grad_format fp8_e5m2"):
            _step(model, runtime, torch.randn(M, K), torch.randn(M, N))


def test_a_compiled_block_scaled_model_makes_the_same_legal_calls():
    """The block-scaled GEMM is one opaque op to torch.compile (torch 2.13's Inductor would lower
    the v2 op to ``torch._scaled_mm``, whose scale layout for a 1x128 second operand differs):
    compiled and eager make the same three calls per layer, to the same result within the
    BF16 output's rounding."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(N, 40))
    x = torch.randn(M, K)
    with reference_block_kernel():
        runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x, scaling=BLOCK_SCALING))
        with runtime:
            eager = model(x)
        eager.float().sum().backward()
        eager_grad = model[0].weight.grad.clone()
        model.zero_grad()
        compiled = torch.compile(model)
        with CudaRules() as rules, runtime:
            out = compiled(x)
            out.float().sum().backward()
    assert rules.counts["_scaled_mm_v2"] == 5  # the first layer makes no input gradient (x needs none)
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(model[0].weight.grad, eager_grad, rtol=5e-2, atol=0.5)
