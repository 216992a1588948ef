"""A layer whose own code cannot run in its planned format (DeBERTa fills BF16 attention scores
with FP32's lowest value): under `PlanRuntime.tolerate_failures` (a search's probe and trial
runtimes) it runs as the plain model does and is named; otherwise the error stands."""

import pytest
import torch
import torch.nn as nn

from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Plan
from autoprec.runtime import apply_plan


class FillsFP32Lowest(nn.Module):
    """DeBERTa's pattern: masked scores filled with ``finfo(float32).min`` whatever their dtype
    (its ``q + q_bias`` is FP32 there), which a BF16 tensor cannot hold."""

    def __init__(self, d: int):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill(mask, torch.finfo(torch.float32).min), dim=-1) @ x


class Net(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.attn = FillsFP32Lowest(d)
        self.down = nn.Linear(d, d)

    def forward(self, x):
        return self.down(self.attn(torch.relu(self.up(x))))


def plan_for(model: nn.Module, attn: Format, inner: Format = Format.BF16) -> Plan:
    return Plan({"up": LayerPrecision(Format.BF16), "attn": LayerPrecision(attn), "attn.q": LayerPrecision(inner),
                 "attn.k": LayerPrecision(inner), "down": LayerPrecision(Format.BF16)})


def test_a_layer_raising_in_its_format_runs_as_the_plain_model_under_a_tolerant_runtime_and_is_named():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 5, 16)
    plan = plan_for(model, Format.BF16)
    with pytest.raises(RuntimeError, match="without overflow"), apply_plan(model, plan):
        model(x)  # the plan alone: the error stands
    runtime = apply_plan(model, plan)
    runtime.tolerate_failures()
    with runtime:
        out = model(x)
        out.float().sum().backward()
    assert set(runtime.take_failures()) == {"attn"}
    assert runtime.take_failures() == {}  # taken once
    # The attention ran as the plain model's (FP32, its own products too); the layers around it
    # kept their BF16: the same output as a plan with the attention in FP32.
    reference = apply_plan(model, plan_for(model, Format.FP32, Format.FP32))
    with torch.no_grad(), reference:
        expected = model(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    runtime.tolerate_failures(False)
    with pytest.raises(RuntimeError, match="without overflow"), runtime:
        model(x)


def test_a_layer_that_runs_in_its_format_is_not_named_and_runs_its_format():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 5, 16)
    plan = plan_for(model, Format.FP32)  # the attention in FP32, its projections in BF16: nothing raises
    runtime = apply_plan(model, plan)
    runtime.tolerate_failures()
    with torch.no_grad(), runtime:
        out = model(x)
    assert runtime.take_failures() == {}
    with torch.no_grad(), apply_plan(model, plan):
        again = model(x)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    with torch.no_grad():
        plain = model(x)
    assert not torch.equal(out, plain)  # the projections did run in BF16
