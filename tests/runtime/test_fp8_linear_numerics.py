"""An FP8 linear layer's three GEMMs against plain PyTorch, bit for bit: per-tensor scales,
FP32 accumulation, the output rounded once to the autocast dtype, on a CPU under autocast too."""

import pytest
import torch
from torch import nn

from autoprec import Format, LayerPrecision, Plan, apply_plan


def _per_tensor(t, fmt):
    """``t`` rounded through ``fmt`` with one scale (autoprec's: amax times 1/max), in FP32."""
    t = t.float()
    inv = t.abs().amax() * (1.0 / fmt.max)
    return (t / inv).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * inv


def _run(grad_format):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128, bias=False))
    x = torch.randn(64, 128, requires_grad=True)
    plan = Plan({"0": LayerPrecision(Format.FP8_E4M3, grad_format=grad_format)}, fingerprint=Plan.uniform(model, Format.FP32, (x,)).fingerprint)
    runtime = apply_plan(model, plan)
    with runtime:
        y = model(x)
    g = torch.randn(y.shape).to(y.dtype)
    y.backward(g)
    runtime.remove()
    return x, model[0].weight, y, g


@pytest.mark.parametrize("grad_format", [Format.FP8_E5M2, Format.FP8_E4M3], ids=str)
def test_the_three_gemms_are_plain_products_of_the_rounded_operands(grad_format):
    x, w, y, g = _run(grad_format)
    xq, wq, gq = _per_tensor(x.detach(), Format.FP8_E4M3), _per_tensor(w.detach(), Format.FP8_E4M3), _per_tensor(g, grad_format)
    # torch 2.11-2.13's CPU _scaled_mm runs an mm that a CPU autocast region would lower to BF16
    # (about 0.3 % off): the runtime calls it outside the region (`gemm.kernel_region`).
    assert y.dtype == torch.bfloat16 and torch.equal(y, (xq @ wq.t()).bfloat16())
    assert torch.equal(x.grad, gq @ wq)
    assert torch.equal(w.grad, gq.t() @ xq)


def test_fp32_gradients_multiply_the_operands_dequantized_in_fp32_then_cast():
    x, w, y, g = _run(Format.FP32)
    xq, wq = _per_tensor(x.detach(), Format.FP8_E4M3), _per_tensor(w.detach(), Format.FP8_E4M3)
    # The high-precision backward runs in the gradient's dtype (BF16) on the dequantized operands;
    # a scale cast to BF16 before the multiply would bias every value by its rounding.
    assert torch.equal(x.grad, (g @ wq.bfloat16()).float())
    assert torch.equal(w.grad, (g.t() @ xq.bfloat16()).float())
