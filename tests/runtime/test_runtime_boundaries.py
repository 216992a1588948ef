"""What a layer hands its caller, for every mix of formats (the failure classes the architecture
sweep found, each on a model built for it): outputs leave in the dtype their caller computes in.

- **Two half dtypes meeting**: an FP32 layer holding an FP16 child, in a region that runs BF16,
  whose output reaches ``torch.roll`` and ``cat`` (Swin's cyclic shift, a KV cache's append):
  autocast refuses to mix FP16 into a BF16 region ("Unexpected floating ScalarType in
  at::autocast::prioritize").
- **A constant read from an FP32 layer's dtype**: a half attention layer whose query comes from an
  FP32 child and which fills its scores with ``finfo(q.dtype).min`` (DeBERTa-v2): the FP32 minimum
  does not fit a BF16 tensor.
- **Weights stored in a half dtype** (``model.half()``, issue 59): an all-FP32 plan ran the region
  in BF16 and returned BF16 from an FP16 model (relative error 0.003 where the plain FP16 model
  has 0.0005), and every plan but an all-FP16 one handed an FP16 ``LayerNorm`` a BF16 input,
  which CPU refuses (``mixed dtype (CPU): expect parameter to have scalar type of Float``).
"""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec import Plan, apply_plan

WIDTH = 16


class _ShiftedBlock(nn.Module):
    """Swin's shape: attention (a layer of its own, the score product) with an output projection
    child, the result rolled back and joined with the residual."""

    def __init__(self):
        super().__init__()
        self.attn = _Attention()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        shifted = torch.roll(x, shifts=1, dims=1)
        y = torch.roll(self.attn(shifted), shifts=-1, dims=1)
        joined = torch.cat([x + y, self.fc(x)], dim=-1)
        return joined[..., :WIDTH] + joined[..., WIDTH:]


class _Attention(nn.Module):
    """DeBERTa's shape: projections as children, the score product in its own forward, padding
    filled with the minimum of the query's dtype."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-1, -2)
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, torch.finfo(q.dtype).min)
        return self.o(torch.softmax(scores.float(), dim=-1).to(x.dtype) @ x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ShiftedBlock(), _ShiftedBlock()])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


LAYERS = ["blocks.0.attn", "blocks.0.attn.q", "blocks.0.attn.o", "blocks.0.fc", "blocks.1.attn", "blocks.1.attn.q", "blocks.1.fc"]
FORMATS = ["fp32", "bf16", "fp16"]


def _model_and_input():
    torch.manual_seed(0)
    return _Model(), torch.randn(2, 6, WIDTH)


def _run(model, x, changes):
    plan = Plan.uniform(model, "fp32", x).with_layers(changes)
    with apply_plan(model, plan):
        out = model(x)
    out.float().square().mean().backward()
    return out


def test_an_fp16_layer_inside_an_fp32_one_hands_the_bf16_region_bf16():
    model, x = _model_and_input()
    # The FP16 output projection's result leaves its FP32 attention parent into the BF16 region.
    out = _run(model, x, {"blocks.0.attn.o": "fp16", "blocks.1.fc": "bf16"})
    reference = _model_and_input()[0](x)
    assert torch.isfinite(out).all()
    assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_an_fp32_query_inside_a_bf16_attention_fills_its_scores_in_bf16():
    model, x = _model_and_input()
    out = _run(model, x, {"blocks.0.attn": "bf16", "blocks.1.attn": "bf16"})  # their q, k, o stay FP32
    reference = _model_and_input()[0](x)
    assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_an_fp32_layer_in_the_region_keeps_its_fp32_outputs():
    model, x = _model_and_input()
    seen = {}
    model.head.register_forward_hook(lambda m, args, out: seen.update(head=out.dtype))
    _run(model, x, {"blocks.0.fc": "bf16"})
    assert seen["head"] == torch.float32  # the loss reads the head's FP32 logits, as under plain autocast


@pytest.mark.parametrize("seed", range(6))
def test_any_mix_of_half_and_fp32_layers_runs_forward_and_backward(seed):
    """Random plans over the layers that hand each other outputs (parents, children, siblings)."""
    gen = torch.Generator().manual_seed(seed)
    model, x = _model_and_input()
    for _ in range(4):
        changes = {fqn: FORMATS[int(torch.randint(0, 3, (1,), generator=gen))] for fqn in LAYERS}
        out = _run(model, x, changes)
        assert torch.isfinite(out).all(), changes
        model.zero_grad(set_to_none=True)


def test_every_pair_of_half_dtypes_across_parent_and_child():
    for parent, child in itertools.product(FORMATS, FORMATS):
        model, x = _model_and_input()
        out = _run(model, x, {"blocks.0.attn": parent, "blocks.0.attn.o": child, "blocks.1.fc": "bf16" if child != "bf16" else "fp16"})
        assert torch.isfinite(out).all(), (parent, child)


class _ReadsChildWeights(nn.Module):
    """Mamba's mixer: children hold weights the parent's own forward multiplies with
    (``F.conv1d(x, self.conv.weight)``, ``self.proj.weight @ x``); the children never run."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1, groups=WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)
        h = F.conv1d(h, self.conv.weight, self.conv.bias, padding=1, groups=WIDTH)
        return (self.proj.weight @ h).transpose(1, 2)


def test_a_traced_plan_validates_without_an_example_when_a_parent_reads_its_childrens_weights():
    torch.manual_seed(0)
    model, x = nn.Sequential(_ReadsChildWeights(), nn.Linear(WIDTH, 4)), torch.randn(2, 5, WIDTH)
    plan = Plan.uniform(model, "bf16", x)
    assert set(plan.layers) == {"0", "0.inp", "1"}  # the trace: conv and proj never run as modules
    plan.validate(model)  # the module tree alone lists them; the plan's trace says they are not layers
    plan.validate(model, x)
    with apply_plan(model, plan):
        model(x).sum().backward()


class _CrossAttentionDecoder(nn.Module):
    """A decoder-only use of an encoder-decoder layer: its cross-attention projections never run
    without encoder states (PLBart's, ProphetNet's causal-LM heads)."""

    def __init__(self):
        super().__init__()
        self.attn = _Attention()
        self.cross_q = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x, encoder_states=None):
        x = x + self.attn(x)
        if encoder_states is not None:
            x = x + self.cross_q(encoder_states)
        return self.head(x)


def test_a_traced_plan_validates_without_an_example_when_a_module_never_runs():
    torch.manual_seed(0)
    model, x = _CrossAttentionDecoder(), torch.randn(2, 5, WIDTH)
    plan = Plan.uniform(model, "bf16", x)
    assert "cross_q" not in plan.layers and "attn" in plan.layers  # the trace: an attention product, no cross-attention
    plan.validate(model)
    static = Plan.uniform(model, "bf16")  # the module tree alone: every Linear, the cross-attention's too
    assert "cross_q" in static.layers
    static.validate(model)


class _KeywordProducts(nn.Module):
    """Products called with keyword operands: I-BERT's ``F.linear(x, weight=w, bias=b)``, and
    ``torch.matmul(input=..., other=...)`` / ``torch.addmm(input=, mat1=, mat2=)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH) / 10)
        self.other = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        y = F.linear(x, weight=self.weight, bias=self.bias)
        y = torch.matmul(input=y, other=self.other)
        return torch.addmm(input=self.bias, mat1=y.reshape(-1, WIDTH), mat2=self.other).reshape(y.shape)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_products_called_with_keyword_operands_run_in_the_layers_format(fmt):
    torch.manual_seed(0)
    model, x = _KeywordProducts(), torch.randn(2, 6, WIDTH)
    reference = model(x)
    plan = Plan.uniform(model, fmt, x)
    runtime = apply_plan(model, plan)
    with runtime:
        out = model(x)
    out.sum().backward()
    ops = runtime.report()[""]["ops"]
    assert set(ops) == {"linear", "matmul", "addmm"}
    assert not any(how.startswith("emulated") for how in ops.values())  # the kernels, not emulation
    error = (out.float() - reference).norm() / reference.norm()
    assert error < 0.1, error


class _Normed(nn.Module):
    """Linear layers with norms between them: the norms are no planned layer and run in the
    dtype the model was stored in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm1 = nn.Linear(64, 64), nn.LayerNorm(64)
        self.fc2, self.norm2 = nn.Linear(64, 64), nn.LayerNorm(64)
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(self.norm2(self.fc2(self.norm1(F.gelu(self.fc1(x))))))


def _relative_error(out, reference):
    return ((out.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_an_all_fp32_plan_on_half_stored_weights_returns_their_dtype_and_error(stored):
    model = _Normed()
    x = torch.randn(16, 64)
    with torch.no_grad():
        exact = model(x)
        model.to(stored)
        plain = model(x.to(stored))
        with apply_plan(model, Plan.uniform(model, "fp32")):
            out = model(x.to(stored))
    assert out.dtype == plain.dtype
    # FP32 products on the stored weights: no worse than the plain half model (BF16 in between
    # had 6x its error on an FP16 model).
    assert _relative_error(out, exact) <= 1.1 * _relative_error(plain, exact)


@pytest.mark.parametrize("formats", [
    ("fp32",) * 3, ("bf16",) * 3, ("fp16",) * 3, ("fp8_e4m3",) * 3, ("int8",) * 3, ("bf16", "fp32", "fp16"), ("fp8_e4m3", "bf16", "fp32"),
], ids="-".join)
@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16], ids=str)
def test_half_stored_weights_keep_their_dtype_between_layers_under_any_plan(stored, formats):
    """Half layers of the other dtype compute in theirs and hand the stored dtype on."""
    model = _Normed().to(stored)
    seen = {}
    for name in ("norm1", "norm2"):
        getattr(model, name).register_forward_hook(lambda m, args, out, name=name: seen.update({name: args[0].dtype}))
    x = torch.randn(16, 64, dtype=stored, requires_grad=True)
    with torch.no_grad():
        plain = model(x)
    plan = Plan.uniform(model, "fp32").with_layers(dict(zip(("fc1", "fc2", "head"), formats)))
    with apply_plan(model, plan):
        out = model(x)
    out.float().square().mean().backward()
    assert seen == {"norm1": stored, "norm2": stored}
    assert out.dtype == plain.dtype and x.grad.dtype == stored
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())
