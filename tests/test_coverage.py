"""Tests for layer discovery (autoprec/coverage.py): coverage by operation, not by module class."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.coverage import LayerInfo, find_layers, static_layers, trace_layers
from autoprec.workloads import ByteLM, LMConfig
from support.models import WithProjection

TINY = LMConfig.from_name("tiny")


# --- models -----------------------------------------------------------------------------------


class Bmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch.bmm(x, self.weight)


class Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.einsum("bij,jk->bik", x, self.weight)


class FunctionalConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 2, 1, 1))

    def forward(self, x):
        # (2, 3, 4) viewed as a (N=1, C=2, H=3, W=4) image.
        return F.conv2d(x.unsqueeze(0), self.weight).squeeze(0)


class FunctionalOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.bmm = Bmm()
        self.einsum = Einsum()
        self.conv = FunctionalConv()

    def forward(self, x):  # x: (2, 3, 4)
        return self.conv(self.einsum(self.bmm(x)))


class AttentionInSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 8))

    def forward(self, x):
        y, _ = self.layers[0](x, x, x)
        return self.layers[1](y)


class NoMatmulAround(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, idx):
        return self.head(self.act(self.norm(self.emb(idx))))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        self.bn(self.fc(x))
        raise ValueError("boom")


class KeywordInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, *, use_b: bool = False):
        return self.b(x) if use_b else self.a(x)


def bytelm(dropout: float = 0.0) -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(dataclasses.replace(TINY, dropout=dropout))


def byte_input() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def all_hooks(model: nn.Module) -> list:
    hooks = []
    for module in model.modules():
        hooks += list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return hooks


# --- ByteLM -----------------------------------------------------------------------------------


def expected_bytelm_linears(n_layers: int) -> list[str]:
    names = []
    for i in range(n_layers):
        names += [f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj"]
    return names + ["lm_head"]


def test_static_layers_of_bytelm_are_its_linears_in_model_order():
    assert list(static_layers(bytelm())) == expected_bytelm_linears(TINY.n_layers)


def test_traced_layers_of_bytelm_add_each_attention_module_in_model_order():
    # Each attention module runs q @ k^T and att @ v itself, so it is a layer of its own,
    # listed (model order) before its children qkv and proj.
    expected = []
    for i in range(TINY.n_layers):
        expected += [f"blocks.{i}.attn", f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj"]
    expected.append("lm_head")
    assert list(trace_layers(bytelm(), byte_input())) == expected


def test_traced_bytelm_attention_runs_matmul_and_owns_no_parameters():
    info = trace_layers(bytelm(), byte_input())["blocks.0.attn"]
    # Batched: q @ k^T and att @ v multiply (batch, head, ...) activations, which no 2-D kernel takes.
    assert info == LayerInfo(module="CausalSelfAttention", ops=("matmul",), params={}, batched=("matmul",))


def test_traced_bytelm_linear_records_linear_op_and_shapes():
    info = trace_layers(bytelm(), byte_input())["blocks.0.attn.qkv"]
    d = TINY.d_model
    assert info == LayerInfo(module="Linear", ops=("linear",), params={"weight": (3 * d, d), "bias": (3 * d,)})


def test_bytelm_lm_head_without_bias_has_only_a_weight_shape():
    info = trace_layers(bytelm(), byte_input())["lm_head"]
    assert dict(info.params) == {"weight": (TINY.vocab_size, TINY.d_model)}


# --- hand-written and functional matrix products ------------------------------------------------


def test_static_layers_find_the_handwritten_addmm_projection_by_running_it():
    assert static_layers(WithProjection())["proj"].ops == ("addmm",)


def test_tracing_finds_the_handwritten_addmm_projection():
    assert list(trace_layers(WithProjection(), torch.randn(5, 8))) == ["fc", "proj"]


def test_traced_addmm_projection_records_addmm_and_transposed_weight_shape():
    info = trace_layers(WithProjection(), torch.randn(5, 8))["proj"]
    assert info == LayerInfo(module="AddmmProjection", ops=("addmm",), params={"weight": (6, 3), "bias": (3,)})


@pytest.mark.parametrize("fqn, op", [("bmm", "bmm"), ("einsum", "einsum"), ("conv", "conv2d")])
def test_tracing_finds_functional_matrix_products(fqn, op):
    found = trace_layers(FunctionalOps(), torch.randn(2, 3, 4))
    assert found[fqn].ops == (op,)


def test_tracing_functional_ops_finds_exactly_the_three_modules():
    assert list(trace_layers(FunctionalOps(), torch.randn(2, 3, 4))) == ["bmm", "einsum", "conv"]


def test_static_layers_miss_functional_matrix_products():
    assert static_layers(FunctionalOps()) == {}


def test_matmul_in_the_root_forward_makes_the_root_a_layer():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.w

    assert list(trace_layers(Root(), torch.randn(2, 4))) == [""]


# --- MultiheadAttention -----------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_traced_multihead_attention_in_sequential_is_one_layer(training):
    model = AttentionInSequential().train(training)
    # eval mode matters: there nn.MultiheadAttention may take its fused fast path.
    assert list(trace_layers(model, torch.randn(2, 3, 8))) == ["layers.0", "layers.1"]


def test_traced_multihead_attention_records_its_own_op_and_in_proj_shapes():
    info = trace_layers(AttentionInSequential(), torch.randn(2, 3, 8))["layers.0"]
    assert info == LayerInfo(
        module="MultiheadAttention", ops=("multi_head_attention",), params={"in_proj_weight": (24, 8), "in_proj_bias": (24,)}
    )


def test_static_multihead_attention_in_sequential_excludes_out_proj():
    assert list(static_layers(AttentionInSequential())) == ["layers.0", "layers.1"]


def test_static_multihead_attention_as_the_root_excludes_out_proj():
    assert list(static_layers(nn.MultiheadAttention(8, 2))) == [""]


# --- what is not a layer ------------------------------------------------------------------------


def test_traced_norm_embedding_and_activation_are_not_layers():
    assert list(trace_layers(NoMatmulAround(), torch.tensor([[1, 2, 3]]))) == ["head"]


def test_static_norm_embedding_and_activation_are_not_layers():
    assert list(static_layers(NoMatmulAround())) == ["head"]


def test_module_never_called_is_not_a_traced_layer():
    assert list(trace_layers(WithUnused(), torch.randn(2, 4))) == ["used"]


def test_module_never_called_is_still_a_static_layer():
    assert list(static_layers(WithUnused())) == ["used", "unused"]


# --- find_layers and inputs ---------------------------------------------------------------------


def test_find_layers_without_input_is_the_static_view():
    model = WithProjection()
    assert find_layers(model) == static_layers(model)


def test_find_layers_with_input_traces():
    model = WithProjection()
    x = torch.randn(5, 8)
    assert find_layers(model, x) == trace_layers(model, x)


def test_dict_example_inputs_are_keyword_arguments():
    assert list(trace_layers(KeywordInputs(), {"x": torch.randn(2, 4), "use_b": True})) == ["b"]


def test_tuple_example_inputs_are_positional_arguments():
    x = torch.randn(2, 3, 8)
    assert list(trace_layers(nn.MultiheadAttention(8, 2, batch_first=True), (x, x, x))) == [""]


def test_layer_info_round_trips_through_dict():
    info = trace_layers(WithProjection(), torch.randn(5, 8))["proj"]
    assert LayerInfo.from_dict(info.to_dict()) == info


# --- tracing leaves the model as it was ----------------------------------------------------------


def test_tracing_leaves_no_hooks():
    model = bytelm()
    trace_layers(model, byte_input())
    assert all_hooks(model) == []


def test_tracing_keeps_the_users_own_hooks():
    model = WithUnused()
    hook = lambda module, args, output: None  # noqa: E731
    model.used.register_forward_hook(hook)
    trace_layers(model, torch.randn(2, 4))
    assert all_hooks(model) == [hook]


def test_tracing_keeps_batchnorm_running_stats():
    model = WithBatchNorm().train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    trace_layers(model, torch.randn(4, 3, 6, 6) * 5 + 3)
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


def test_a_real_forward_would_change_batchnorm_stats():
    # Guards the test above: the input really moves the running statistics.
    model = WithBatchNorm().train()
    before = model.bn.running_mean.clone()
    model(torch.randn(4, 3, 6, 6) * 5 + 3)
    assert not torch.equal(model.bn.running_mean, before)


def test_tracing_keeps_the_global_rng_state_with_dropout():
    model = bytelm(dropout=0.1).train()
    before = torch.get_rng_state()
    trace_layers(model, byte_input())
    assert torch.equal(torch.get_rng_state(), before)


def test_a_real_forward_with_dropout_draws_random_numbers():
    # Guards the test above: the model really consumes the global RNG.
    model = bytelm(dropout=0.1).train()
    before = torch.get_rng_state()
    model(byte_input())
    assert not torch.equal(torch.get_rng_state(), before)


def test_tracing_leaves_no_gradients():
    model = WithProjection()
    trace_layers(model, torch.randn(5, 8))
    assert all(p.grad is None for p in model.parameters())


def test_tracing_propagates_an_error_from_forward():
    with pytest.raises(ValueError, match="boom"):
        trace_layers(Raises(), torch.randn(3, 4))


def test_tracing_removes_hooks_when_forward_raises():
    model = Raises()
    with pytest.raises(ValueError):
        trace_layers(model, torch.randn(3, 4))
    assert all_hooks(model) == []


def test_tracing_restores_batchnorm_stats_when_forward_raises():
    model = Raises().train()
    before = model.bn.running_mean.clone()
    with pytest.raises(ValueError):
        trace_layers(model, torch.randn(3, 4) * 5 + 3)
    assert torch.equal(model.bn.running_mean, before)


class CatchesChildError(nn.Module):
    """Calls a child that raises, swallows the error, then runs a matmul of its own."""

    def __init__(self):
        super().__init__()
        self.child = Raises()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        try:
            self.child(x)
        except ValueError:
            pass
        return x @ self.w


def test_matmul_after_a_child_raised_is_attributed_to_the_caller():
    # The module stack must pop a module whose forward raised, or later products go to it.
    found = trace_layers(CatchesChildError(), torch.randn(3, 4))
    assert (found["child.fc"].ops, found[""].ops) == (("linear",), ("matmul",))


class _LayerDrop(nn.Module):
    """HF's LayerDrop: in training each layer is skipped with probability ``p`` (a fresh draw per call)."""

    def __init__(self, p: float, n: int = 6):
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = x + layer(x)
        return x


@pytest.mark.parametrize("seed", range(8))
def test_a_trace_in_training_mode_sees_every_layer_layerdrop_skips(seed):
    """The binding trace made the plan's layers: a layer LayerDrop skipped there was missing from
    the plan, and the search's cost model then failed on it (M2M-100, NLLB-MoE, HuBERT)."""
    torch.manual_seed(seed)
    model = _LayerDrop(p=0.1).train()  # as HF's LayerDrop defaults (0.05 to 0.1)
    traced = trace_layers(model, torch.randn(2, 8))
    assert list(traced) == [f"layers.{i}" for i in range(6)]
    assert model.training and all(m.training for m in model.modules())  # the modes restored


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_trace_draws_again_until_it_sees_the_layers_it_must(seed):
    from autoprec.costs.trace import trace_model

    torch.manual_seed(seed)
    model = _LayerDrop(p=0.1, n=4).train()  # as HF's LayerDrop defaults (0.05 to 0.1)
    wanted = [f"layers.{i}" for i in range(4)]
    x = torch.randn(2, 8)
    state = torch.get_rng_state()
    trace = trace_model(model, x, layers=wanted)
    assert list(trace.layers) == wanted
    assert torch.equal(torch.get_rng_state(), state)  # the real run draws as it would have
