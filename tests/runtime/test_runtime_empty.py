"""Products with an empty operand (issue 59): an expert a mixture-of-experts router sends no
tokens, a (B, 0, K) input. Plain PyTorch returns an empty output and zero weight and bias
gradients; every planned format must too (INT8 failed in calibration, ``linalg.vector_norm
cannot compute the inf norm``; row-scaled FP8 in the kernel, ``expected scale_a.stride(1) to be
1, but got 0``), and the empty batch must change no scaling state (a delayed history took its
amax, 0, as a step)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.runtime.layers import kernel_reason
from support.states import same
from support.triton_env import DEVICE, NUMPY_WARNINGS, force_fused_casts, needs_kernels

WIDTH = 32

# Every format with every scaling the runtime runs it with (INT8 calibrates over two batches, so
# an empty batch counted as one would show in its state).
FORMATS = {
    **{
        f"{fmt}-{granularity}-{mode}": (fmt, {"scaling": ap.Scaling(granularity=granularity, mode=mode)})
        for fmt in ("fp8_e4m3", "fp8_e5m2")
        for granularity, mode in (("tensor", "current"), ("tensor", "delayed"), ("row", "current"), ("block", "current"))
    },
    "int8-tensor": ("int8", {"calibration": ap.Calibration(batches=2, outlier_ratio=None)}),
    "int8-tensor-outliers": ("int8", {"calibration": ap.Calibration(batches=2, outlier_ratio=2.0)}),
    "int8-row": ("int8", {"scaling": ap.Scaling(granularity="row")}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "fp32": ("fp32", {}),
}


class MatmulExpert(nn.Module):
    """An expert whose product is a matmul of its own weight (routed by the layer mode)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH) / 10)

    def forward(self, x):
        return x @ self.weight.t() + self.bias


class EinsumExpert(MatmulExpert):
    """An expert whose product no kernel takes (FP8 / INT8 emulate it)."""

    def forward(self, x):
        return torch.einsum("tk,nk->tn", x, self.weight) + self.bias


class Experts(nn.Module):
    """Top-1 routing by a given choice per token: an expert no token chose runs on 0 tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH), MatmulExpert(), EinsumExpert(), nn.Linear(WIDTH, WIDTH)])
        self.outputs: dict[int, torch.Tensor] = {}

    def forward(self, x, choice):
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(1)
            y = expert(x[rows])
            self.outputs[i] = y
            out = out.index_add(0, rows, y.to(out.dtype))
        return out


EMPTY = (1, 2)  # the experts the empty batches route no token to: one kernel, one emulated product


def batch(tokens=40, empty=EMPTY, device="cpu"):
    torch.manual_seed(1)
    experts = [i for i in range(4) if i not in empty]
    return torch.randn(tokens, WIDTH, device=device), torch.tensor(experts * (tokens // len(experts)), device=device)


def step(model, x, choice, runtime=None):
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    if runtime is None:
        out = model(x, choice)
    else:
        with runtime:
            out = model(x, choice)
    out.float().square().mean().backward()
    return out


def planned(fmt, device="cpu"):
    name, kwargs = FORMATS[fmt]
    model = Experts().to(device)
    return model, ap.apply_plan(model, ap.Plan.uniform(model, name, **kwargs))


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        yield


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_expert_routed_no_tokens_returns_and_differentiates_as_plain_pytorch(fmt):
    model, runtime = planned(fmt)
    plain = copy.deepcopy(model)
    x, choice = batch()
    step(plain, x, choice)
    step(model, x, choice, runtime)
    for i in EMPTY:
        got, expected = model.experts[i], plain.experts[i]
        assert model.outputs[i].shape == plain.outputs[i].shape == (0, WIDTH)
        for name, param in got.named_parameters():
            reference = dict(expected.named_parameters())[name].grad
            assert param.grad.dtype == reference.dtype and torch.equal(param.grad, reference), (i, name)
    # The empty product's output dtype is the one the format gives the same expert a token.
    empty_dtypes = {i: model.outputs[i].dtype for i in EMPTY}
    step(model, *batch(empty=()), runtime)
    assert empty_dtypes == {i: model.outputs[i].dtype for i in EMPTY}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_three_d_input_with_no_tokens_returns_plain_pytorchs_shape_in_the_formats_dtype(fmt):
    name, kwargs = FORMATS[fmt]
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, 48)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, name, **kwargs))
    empty = torch.randn(2, 0, WIDTH, requires_grad=True)
    with runtime:
        full_dtype = layer(torch.randn(2, 3, WIDTH)).dtype
        out = layer(empty)
    out.float().sum().backward()
    plain = layer.weight.detach().clone().requires_grad_(True)
    plain_bias = layer.bias.detach().clone().requires_grad_(True)
    reference = torch.nn.functional.linear(empty.detach(), plain, plain_bias)
    reference.sum().backward()
    assert out.shape == reference.shape and out.dtype == full_dtype
    assert torch.equal(layer.weight.grad, plain.grad) and torch.equal(layer.bias.grad, plain_bias.grad)
    assert empty.grad.shape == empty.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_batch_changes_no_calibration_amax_history_or_scale(fmt):
    (model, runtime), (unseen, unseen_runtime) = planned(fmt), planned(fmt)
    for m, r in ((model, runtime), (unseen, unseen_runtime)):
        step(m, *batch(empty=()), r)  # every expert sees a batch: its state exists
    before = copy.deepcopy(runtime.state_dict())
    step(model, *batch(), runtime)
    fqns = {f"experts.{i}" for i in EMPTY}
    after = runtime.state_dict()
    assert same({k: v for k, v in before["layers"].items() if k in fqns}, {k: v for k, v in after["layers"].items() if k in fqns})
    # The next batch with tokens runs as in a runtime that never saw the empty one.
    for m, r in ((model, runtime), (unseen, unseen_runtime)):
        with torch.no_grad(), r:
            m(*batch(empty=()))
    assert all(torch.equal(model.outputs[i], unseen.outputs[i]) for i in EMPTY)


FP8 = [name for name in FORMATS if name.startswith("fp8")]


@needs_kernels
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.filterwarnings(*(m.args[0] for m in NUMPY_WARNINGS))
def test_an_expert_routed_no_tokens_runs_and_keeps_its_state_under_the_fused_casts(fmt, monkeypatch):
    force_fused_casts(monkeypatch)  # without CUDA on CPU tensors, in Triton's interpreter
    model, runtime = planned(fmt, DEVICE)
    plain = copy.deepcopy(model)
    step(model, *batch(empty=(), device=DEVICE), runtime)
    fused = runtime.report()["experts.0"].get("casts")
    before = copy.deepcopy(runtime.state_dict())
    x, choice = batch(device=DEVICE)
    step(plain, x, choice)
    step(model, x, choice, runtime)
    for i in EMPTY:
        assert model.outputs[i].shape == plain.outputs[i].shape
        assert torch.equal(model.experts[i].weight.grad, plain.experts[i].weight.grad)
    fqns = {f"experts.{i}" for i in EMPTY}
    after = runtime.state_dict()
    assert same({k: v for k, v in before["layers"].items() if k in fqns}, {k: v for k, v in after["layers"].items() if k in fqns})
    # Where the layer has a kernel on this device, its batches with tokens took the fused casts.
    assert fused == (None if kernel_reason(runtime.plan.layers["experts.0"], DEVICE) else "fused Triton cast")
