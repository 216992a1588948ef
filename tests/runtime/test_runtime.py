"""The per-layer runtime: numerics against plain PyTorch, memory per format, restoration, reports."""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autoprec as ap
from autoprec.formats import Format, sqnr
from autoprec.saved_bytes import SavedTensorMeter
from autoprec.runtime.installed import owner_of
from autoprec.workloads import LMConfig, TransformerBlock, default_workload
from support.models import TransposedProjection
from support.torch_versions import CPU_SCALED_MM_ROW_SCALES

LOW = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]

# SQNR floors (dB) against an FP32 reference for one Linear(256 -> 128) on randn inputs. Measured
# on CPU (torch 2.13): output bf16 51, fp16 69, e4m3 29, e5m2 23, int8 39; input gradient bf16 51,
# fp16 69, e4m3 25 (E5M2 gradients), e5m2 23, int8 56 (FP32 backward); weight gradient bf16 51,
# fp16 69, e4m3 24, e5m2 22, int8 39. Floors sit ~3 dB below.
FLOORS = {
    "bf16": (48, 48, 48),
    "fp16": (65, 65, 65),
    "fp8_e4m3": (26, 21, 21),
    "fp8_e5m2": (20, 20, 19),
    "int8": (36, 50, 36),
}


def _linear_case(seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(256, 128)
    x = torch.randn(64, 256)
    grad = torch.randn(64, 128)
    return layer, x, grad


def _run(layer, x, grad, runtime=None):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if runtime is None:
        out = layer(x)
    else:
        with runtime:
            out = layer(x)
    out.backward(grad.to(out.dtype))
    return out.float(), x.grad, layer.weight.grad


@pytest.mark.parametrize("fmt", LOW)
def test_linear_matches_fp32_reference_within_sqnr_floor(fmt):
    layer, x, grad = _linear_case()
    ref_out, ref_dx, ref_dw = _run(layer, x, grad)
    out, dx, dw = _run(layer, x, grad, ap.apply_plan(layer, ap.Plan.uniform(layer, fmt)))
    floors = FLOORS[fmt]
    assert sqnr(ref_out, out) >= floors[0]
    assert sqnr(ref_dx, dx) >= floors[1]
    assert sqnr(ref_dw, dw) >= floors[2]


@pytest.mark.parametrize("fmt", LOW)
def test_gradients_reach_fp32_master_weights(fmt):
    layer, x, grad = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, fmt))
    _run(layer, x, grad, runtime)
    assert layer.weight.dtype == torch.float32
    assert layer.weight.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32


def test_fp8_forward_equals_plain_torch_scaled_product():
    layer, x, _ = _linear_case()
    fmt = Format.FP8_E4M3
    plan = ap.Plan.uniform(layer, fmt, scaling=ap.Scaling(mode="current"))
    with torch.no_grad(), ap.apply_plan(layer, plan):
        out = layer(x)
    # Reference with plain torch: per-tensor scales from amax, torch's own casts, FP32 matmul.
    sx = fmt.max / x.abs().max()
    sw = fmt.max / layer.weight.abs().max()
    xq = (x * sx).to(torch.float8_e4m3fn).float() / sx
    wq = (layer.weight * sw).to(torch.float8_e4m3fn).float() / sw
    expected = xq @ wq.t() + layer.bias
    # The layer emits BF16 (the region's dtype): agreement to BF16 rounding (8 mantissa bits).
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)


def test_int8_forward_equals_plain_torch_integer_product():
    layer, x, _ = _linear_case()
    plan = ap.Plan.uniform(layer, "int8", calibration=ap.Calibration(method="max", outlier_ratio=None, batches=1))
    with torch.no_grad(), ap.apply_plan(layer, plan):
        out = layer(x)
    sx = 127 / x.abs().max()
    sw = 127 / layer.weight.abs().amax(dim=1)  # one scale per output channel
    xq = torch.round(x * sx).clamp(-127, 127)
    wq = torch.round(layer.weight * sw[:, None]).clamp(-127, 127)
    expected = ((xq @ wq.t()) / sx / sw + layer.bias).to(out.dtype)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("granularity", ["row", "block"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_finer_granularities_track_the_reference(fmt, granularity):
    layer, x, grad = _linear_case()
    ref_out, ref_dx, ref_dw = _run(layer, x, grad)
    plan = ap.Plan.uniform(layer, fmt, scaling=ap.Scaling(granularity=granularity, mode="current"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        out, dx, dw = _run(layer, x, grad, ap.apply_plan(layer, plan))
    floors = FLOORS[fmt]
    assert sqnr(ref_out, out) >= floors[0]
    assert sqnr(ref_dw, dw) >= floors[2] - 3


def test_row_scaling_beats_tensor_scaling_on_outlier_tokens():
    layer, x, _ = _linear_case()
    x = x.clone()
    x[::8] *= 1e4  # a few tokens far larger than the rest
    ref = layer(x)
    errors = {}
    for granularity in ("tensor", "row"):
        plan = ap.Plan.uniform(layer, "int8", scaling=ap.Scaling(granularity=granularity, mode="current"),
                               calibration=ap.Calibration(outlier_ratio=None, batches=1))
        with torch.no_grad(), ap.apply_plan(layer, plan):
            out = layer(x).float()
        small = torch.ones(x.shape[0], dtype=torch.bool)
        small[::8] = False
        errors[granularity] = sqnr(ref[small], out[small])
    assert errors["row"] > errors["tensor"] + 10


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_transposed_addmm_projection_is_covered_by_a_real_kernel(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), TransposedProjection(64, 48))
    x = torch.randn(20, 32)
    plan = ap.Plan.uniform(model, fmt, x)
    assert "2" in plan.layers
    runtime = ap.apply_plan(model, plan)
    ref = model(x)
    with torch.no_grad(), runtime:
        out = model(x)
    kernel = "torch._scaled_mm" if fmt.startswith("fp8") else "torch._int_mm"
    assert runtime.report()["2"]["ops"] == {"addmm": f"kernel {kernel}"}
    assert sqnr(ref, out.float()) > 20


def test_transposed_addmm_projection_gradients_match_reference():
    torch.manual_seed(0)
    proj = TransposedProjection(64, 48)
    x = torch.randn(32, 64)
    grad = torch.randn(32, 48)
    xr = x.clone().requires_grad_(True)
    proj(xr).backward(grad)
    ref_dx, ref_dw = xr.grad, proj.weight_t.grad.clone()
    proj.zero_grad(set_to_none=True)
    plan = ap.Plan.uniform(proj, "fp8_e4m3", x)
    xq = x.clone().requires_grad_(True)
    with ap.apply_plan(proj, plan):
        out = proj(xq)
    out.backward(grad.to(out.dtype))
    assert proj.weight_t.grad.shape == (64, 48)
    assert sqnr(ref_dx, xq.grad) > FLOORS["fp8_e4m3"][1]
    assert sqnr(ref_dw, proj.weight_t.grad) > FLOORS["fp8_e4m3"][2]


# -- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_saved_matmul_input_takes_exactly_the_format_bytes(fmt):
    layer, x, _ = _linear_case()
    x = x.requires_grad_(True)
    fmt = Format(fmt)
    with SavedTensorMeter(layer.parameters()) as meter, ap.apply_plan(layer, ap.Plan.uniform(layer, fmt)):
        layer(x)
    inputs = [s for s in meter.saved if s.shape == tuple(x.shape)]
    assert len(inputs) == 1
    assert inputs[0].nbytes == x.numel() * fmt.bytes


def test_fp8_plan_saves_at_most_three_quarters_of_autocast_on_a_transformer_block():
    torch.manual_seed(0)
    block = TransformerBlock(LMConfig())
    x = torch.randn(8, 64, 128)

    def saved(context):
        with SavedTensorMeter(block.parameters()) as meter, context:
            out = block(x)
        out.float().sum().backward()
        return meter.total_bytes

    autocast = saved(torch.autocast("cpu", torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        fp8 = saved(ap.apply_plan(block, ap.Plan.uniform(block, "fp8_e4m3", x)))
    bf16 = saved(ap.apply_plan(block, ap.Plan.uniform(block, "bf16", x)))
    assert fp8 <= 0.75 * autocast
    assert bf16 <= autocast


# -- what stays FP32 ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_ops_between_layers_follow_plain_autocast(fmt):
    """Norms, softmax and losses get exactly the dtypes plain autocast gives them (the region is
    plain autocast; autoprec adds no op policy of its own)."""
    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x, seen):
            h = self.norm(self.proj(x))
            seen["norm"] = h.dtype
            p = torch.softmax(h @ h.transpose(-1, -2), dim=-1)
            seen["softmax"] = p.dtype
            return p

    model = Head()
    x = torch.randn(16, 16)

    def dtypes(context):
        seen = {}
        with context:
            out = model(x, seen)
            seen["loss"] = F.cross_entropy(out, torch.zeros(16, dtype=torch.long)).dtype
        return seen

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        planned = dtypes(ap.apply_plan(model, ap.Plan.uniform(model, fmt)))
    assert planned == dtypes(torch.autocast("cpu", torch.bfloat16))
    assert planned["loss"] == torch.float32


def test_matrix_products_autocast_does_not_cast_run_in_a_half_layer():
    class MatVec(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.v = nn.Parameter(torch.randn(8))

        def forward(self, x):
            return torch.mv(self.proj(x), self.v)  # proj's output is BF16, v is FP32

    torch.manual_seed(0)
    model = MatVec()
    x = torch.randn(4, 8)
    with ap.apply_plan(model, ap.Plan.uniform(model, "bf16", x)):
        out = model(x)
    assert out.dtype == torch.bfloat16
    assert sqnr(MatVec.forward(model, x), out.float()) > 30


def test_fp32_layer_keeps_its_own_products_fp32_when_a_child_is_lowered():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))

    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 5, 16)
    plan = ap.Plan.uniform(model, "fp32", x).with_layers({"q": "bf16"})
    with torch.no_grad(), ap.apply_plan(model, plan):
        out = model(x)
    assert out.dtype == torch.float32
    assert sqnr(Attention.forward(model, x), out) > 35


def test_int8_layers_differentiate_in_fp32():
    layer, _, _ = _linear_case()
    assert ap.Plan.uniform(layer, "int8").layers[""].grad_format is Format.FP32


def test_fp32_layer_in_a_mixed_plan_runs_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    plan = ap.Plan.uniform(model, "bf16").with_layers({"1": "fp32"})
    ref = model(x)
    with torch.no_grad(), ap.apply_plan(model, plan):
        out = model(x)
    assert out.dtype == torch.float32
    assert not torch.equal(out, ref)  # layer 0 did run in BF16
    assert sqnr(ref, out) > 40


def test_all_fp32_plan_leaves_the_model_untouched_while_active():
    layer, x, _ = _linear_case()
    with ap.apply_plan(layer, ap.Plan.uniform(layer, "fp32")):
        assert "forward" not in layer.__dict__
        assert not torch.is_autocast_enabled("cpu")
        out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


# -- restoration ----------------------------------------------------------------------------------


def _snapshot(model):
    return (
        {name: t.clone() for name, t in model.state_dict().items()},
        [dict(m.__dict__) for m in model.modules()],
    )


def _assert_restored(model, snapshot):
    state, dicts = snapshot
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], state[k]) for k in state)
    for module, before in zip(model.modules(), dicts):
        assert module.__dict__.keys() == before.keys()
        assert "forward" not in module.__dict__ or module.__dict__["forward"] is before.get("forward")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.overrides._get_current_function_mode_stack() == []


def _plain_loss_and_grads(wl, model, batch):
    model.zero_grad()
    loss = wl.loss(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fmt", LOW)
def test_exit_leaves_the_plain_model_and_remove_restores_it_exactly(fmt):
    wl = default_workload("tiny", batch_size=2)
    model = wl.build_model()
    batch = wl.val_batches(1)[0]
    snapshot = _snapshot(model)
    plain_loss, plain_grads = _plain_loss_and_grads(wl, model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        runtime = ap.apply_plan(model, ap.Plan.uniform(model, fmt, batch[0]))
        with runtime:
            planned = wl.loss(model, batch)
    assert not torch.equal(planned.detach(), plain_loss)  # the plan did run
    # Outside the context installed wrappers pass through: bit-identical results.
    loss, grads = _plain_loss_and_grads(wl, model, batch)
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    model.zero_grad(set_to_none=True)
    runtime.remove()
    _assert_restored(model, snapshot)


def test_exit_restores_the_model_when_the_body_raises():
    wl = default_workload("tiny", batch_size=2)
    model = wl.build_model()
    batch = wl.val_batches(1)[0]
    snapshot = _snapshot(model)
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", batch[0]))
    with pytest.raises(ZeroDivisionError):
        with runtime:
            wl.loss(model, batch)
            1 / 0
    assert not runtime.active
    runtime.remove()
    _assert_restored(model, snapshot)


def test_remove_restores_a_forward_the_user_had_patched():
    layer, x, _ = _linear_case()
    patched = lambda inp: F.linear(inp, layer.weight, layer.bias) * 2  # noqa: E731
    layer.forward = patched
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    with runtime:
        assert layer.forward is not patched
        out = layer(x)
    assert sqnr(patched(x), out.float()) > 20  # the wrapper ran the user's forward, not Linear's
    assert torch.equal(layer(x), patched(x))  # outside the context: the user's forward
    runtime.remove()
    assert layer.forward is patched


def test_a_deep_copy_of_a_planned_model_runs_its_own_weights():
    layer, x, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    with runtime:
        layer(x)
    copy = __import__("copy").deepcopy(layer)  # e.g. an EMA model made while the plan is installed
    with torch.no_grad():
        copy.weight.mul_(-1)
        assert torch.equal(copy(x), F.linear(x, copy.weight, copy.bias))
        with runtime:  # the plan belongs to the original: the copy stays plain inside it too
            assert torch.equal(copy(x), F.linear(x, copy.weight, copy.bias))


def test_a_second_runtime_displaces_an_inactive_one_and_each_runs_its_own_plan():
    layer, x, _ = _linear_case()
    fp8 = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    int8 = ap.apply_plan(layer, ap.Plan.uniform(layer, "int8"))
    with torch.no_grad():
        for runtime, kernel in [(fp8, "_scaled_mm"), (int8, "_int_mm"), (fp8, "_scaled_mm")]:
            with runtime:
                layer(x)
            assert kernel in runtime.report()[""]["ops"]["linear"]
            assert owner_of(layer.forward) is runtime


def test_re_entering_an_active_runtime_raises():
    layer, _, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "bf16"))
    with runtime:
        with pytest.raises(ap.RuntimeStateError, match="already active"):
            runtime.__enter__()


def test_two_runtimes_on_one_model_cannot_be_active_together():
    layer, _, _ = _linear_case()
    first = ap.apply_plan(layer, ap.Plan.uniform(layer, "bf16"))
    second = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp16"))
    with first:
        with pytest.raises(ap.RuntimeStateError, match="another active autoprec plan"):
            second.__enter__()


def test_runtime_can_be_re_entered_after_exit():
    layer, x, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "bf16"))
    for _ in range(2):
        with runtime:
            assert layer(x).dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32


def test_apply_plan_validates_the_plan():
    layer, _, _ = _linear_case()
    other = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ap.PlanError, match="lacks"):
        ap.apply_plan(layer, ap.Plan.uniform(other, "bf16"))


# -- reports and state ----------------------------------------------------------------------------


def test_emulated_layer_is_named_in_a_warning_and_the_report():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(2, 3, 8, 8)
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x))
    with pytest.warns(ap.EmulationWarning, match="'0' runs conv2d"):
        with runtime:
            out = model(x)
    out.float().sum().backward()
    assert runtime.emulated_layers() == {"0": ["conv2d"]}
    assert runtime.report()["2"]["ops"] == {"linear": "kernel torch._scaled_mm"}
    assert model[0].weight.grad is not None


class _TwoProducts(nn.Module):
    """One layer whose forward runs two products with no FP8 kernel (a bmm and an einsum)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        y = torch.bmm(x, self.w.expand(x.shape[0], 8, 8))
        return torch.einsum("bij,jk->bik", y, self.w)


def test_emulated_layer_warns_once_naming_every_op_and_logs_nothing(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(_TwoProducts())
    x = torch.randn(2, 4, 8)
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x))
    with caplog.at_level("DEBUG", logger="autoprec"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-location filter off: the runtime's count alone
        for _ in range(3):
            with runtime:
                model(x).float().sum().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, ap.EmulationWarning)]
    assert len(said) == 1 and "layer '0' runs bmm, einsum in fp8_e4m3 emulated" in said[0]
    assert runtime.emulated_layers() == {"0": ["bmm", "einsum"]}
    assert [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()] == []


def test_emulation_warning_can_be_filtered_away_entirely(caplog):
    model = nn.Sequential(_TwoProducts())
    x = torch.randn(2, 4, 8)
    with caplog.at_level("DEBUG", logger="autoprec"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ap.EmulationWarning)
        with ap.apply_plan(model, ap.Plan.uniform(model, "fp8_e4m3", x)):
            model(x)
    assert caught == [] and [r for r in caplog.records if "emulated" in r.getMessage()] == []


def test_emulated_conv_gradients_track_the_reference():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 8, 8)
    grad = torch.randn(2, 8, 6, 6)
    xr = x.clone().requires_grad_(True)
    conv(xr).backward(grad)
    ref_dx, ref_dw = xr.grad, conv.weight.grad.clone()
    conv.zero_grad(set_to_none=True)
    xq = x.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        with ap.apply_plan(conv, ap.Plan.uniform(conv, "fp8_e4m3")):
            out = conv(xq)
    out.backward(grad.to(out.dtype))
    assert sqnr(ref_dx, xq.grad) > 18
    assert sqnr(ref_dw, conv.weight.grad) > 18


@pytest.mark.parametrize("use_weights", [True, False], ids=["output-and-weights", "output-only"])
def test_an_emulated_product_with_two_outputs_takes_both_gradients(use_weights):
    # Before: multi-head attention returns its output and its attention weights, and the
    # emulation's backward took one gradient: "backward() takes 2 positional arguments but 3
    # were given" (WavLM's attention in FP8, the architecture sweep).
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16)
    grads = []
    for plan in (None, ap.Plan.uniform(attention, "fp8_e4m3", (x, x, x))):
        attention.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ap.EmulationWarning)
            with ap.apply_plan(attention, plan) if plan is not None else contextlib.nullcontext():
                out, weights = attention(xs, xs, xs)
        loss = out.float().square().sum() + (weights.float().log().sum() if use_weights else 0.0)
        loss.backward()
        grads.append((xs.grad, attention.in_proj_weight.grad.clone()))
    (ref_dx, ref_dw), (dx, dw) = grads
    assert sqnr(ref_dx, dx) > 18 and sqnr(ref_dw, dw) > 18


class _DropoutAttention(nn.Module):
    """No parameters: its one product, attention with dropout, runs emulated in FP8."""

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x * 0.5, x * 2.0, dropout_p=0.5)


def test_emulated_attention_draws_the_same_dropout_mask_in_its_backward():
    """An emulated product recomputes in its backward: attention restores the forward's RNG
    state there, so its dropout mask is the forward's and the gradients track plain FP32 attention
    drawn from the same seed (a second mask would leave them uncorrelated). Products that draw
    nothing keep no RNG state (reading it breaks torch.compile's graph)."""
    attention = _DropoutAttention()
    x = torch.randn(2, 2, 8, 16)
    grads = []
    for plan in (None, ap.Plan.uniform(attention, "fp8_e4m3", x)):
        xs = x.clone().requires_grad_(True)
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ap.EmulationWarning)
            with ap.apply_plan(attention, plan) if plan is not None else contextlib.nullcontext():
                out = attention(xs)
        out.float().square().sum().backward()
        grads.append(xs.grad)
    assert sqnr(grads[0], grads[1]) > 18


def test_delayed_scaling_history_persists_across_steps_and_state_dict():
    layer, x, _ = _linear_case()
    plan = ap.Plan.uniform(layer, "fp8_e4m3", scaling=ap.Scaling(mode="delayed"))
    runtime = ap.apply_plan(layer, plan)
    for step in range(3):
        with runtime:
            layer(x * (step + 1)).float().sum().backward()
    state = runtime.state_dict()
    (history,) = [q["history"] for q in state["layers"][""]["inputs"].values()]
    # Newest first; the rest of the window not seen yet (zero).
    assert torch.allclose(history[:3], x.abs().max() * torch.tensor([3.0, 2.0, 1.0]))
    assert not history[3:].any()
    fresh = ap.apply_plan(layer, plan)
    fresh.load_state_dict(state)
    with torch.no_grad():
        with runtime:
            expected = layer(x)
        with fresh:
            got = layer(x)
    assert torch.equal(expected, got)


def test_delayed_scaling_spike_saturates_instead_of_overflowing():
    """An input 8x larger than its history is clamped to the format's range, not cast to inf/NaN."""
    layer, x, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e5m2", scaling=ap.Scaling(mode="delayed")))
    for _ in range(3):
        with runtime:
            layer(x).float().sum().backward()
    spike = (x * 8).requires_grad_(True)
    with runtime:
        out = layer(spike)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(spike.grad).all()


def test_non_finite_input_stays_non_finite_under_delayed_scaling():
    """The saturating cast must not hide an overflow from the loss scaler."""
    layer, x, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3", scaling=ap.Scaling(mode="delayed")))
    with runtime:
        layer(x)
    bad = x.clone()
    bad[3, 7] = float("inf")
    with torch.no_grad(), runtime:
        out = layer(bad)
    assert not torch.isfinite(out).all()


def test_int8_calibration_freezes_and_reports_error_on_real_activations():
    """On the workload's own activations, calibrated scales beat naive max scaling."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model()
    wl_batches = wl.val_batches(4)
    plan = ap.Plan.uniform(model, "int8", wl_batches[0][0], calibration=ap.Calibration(method="mse", batches=3))
    runtime = ap.apply_plan(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        with torch.no_grad():
            for batch in wl_batches:
                with runtime:
                    wl.loss(model, batch)
    reports = [r for entry in runtime.report().values() for r in entry.get("calibration", [])]
    assert len(reports) == 9  # qkv, proj, fc, proj in each of the 2 blocks, and lm_head
    naive = sum(r["naive_max_rel_error"] for r in reports) / len(reports)
    calibrated = sum(r["calibrated_rel_error"] for r in reports) / len(reports)
    assert calibrated < naive


def test_a_row_wise_tensor_parallel_calibration_state_keeps_the_whole_layers_outlier_slots():
    # A rank of a row-wise layer (`Int8Calibrator.split_over`) keeps the whole layer's outlier
    # slots: its saved state says the whole width, so it loads back; without it, as many slots
    # are another layer's and refused.
    from autoprec.runtime.calibration import Int8Calibrator, outlier_slots

    cal = ap.Calibration(batches=1)
    rank = Int8Calibrator(cal, 256)
    rank.observe(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))  # frozen: 2 slots of its own
    whole = 1024  # a quarter of the layer's input channels: the whole layer's 8 slots
    state = {**rank.state_dict(), "whole_channels": whole, "outlier_index": torch.zeros(outlier_slots(whole), dtype=torch.long),
             "outlier_valid": torch.zeros(outlier_slots(whole))}
    assert Int8Calibrator.state_problem(state, cal, [256]) is None
    loaded = Int8Calibrator(cal, 256)
    loaded.load_state_dict(state)
    assert (loaded.slots, loaded.whole_channels) == (8, whole) and torch.equal(loaded.frozen_inv, rank.frozen_inv)
    assert Int8Calibrator.state_problem({**state, "whole_channels": 256}, cal, [256]) == "['outlier_index'] has shape (8,), expected (2,)"
    narrower = {**rank.state_dict(), "whole_channels": 100}
    assert Int8Calibrator.state_problem(narrower, cal, [256]) == "['whole_channels'] = 100 is not a channel count of at least 256"
    assert Int8Calibrator.state_problem(rank.state_dict(), cal, [256]) is None


def test_recalibrate_unfreezes_int8_scales():
    layer, x, _ = _linear_case()
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "int8", calibration=ap.Calibration(batches=1)))
    with torch.no_grad(), runtime:
        layer(x)

    def frozen():
        (calibrator,) = runtime.state_dict()["layers"][""]["calibrators"].values()
        return calibrator["frozen_inv"]

    assert frozen() is not None
    runtime.recalibrate()
    assert frozen() is None


# -- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int8"])
def test_training_under_a_uniform_plan_tracks_fp32(fmt):
    wl = default_workload("tiny", batch_size=16)
    steps = 120
    ref_model = wl.build_model(seed=0)
    ap_model = wl.build_model(seed=0)
    from autoprec.workloads import evaluate, train

    train(ref_model, wl, steps)
    runtime = ap.apply_plan(ap_model, ap.Plan.uniform(ap_model, fmt, wl.val_batches(1)[0][0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        train(ap_model, wl, steps, context=lambda: runtime)
    val = wl.val_batches(4)
    ref_loss, ap_loss = evaluate(ref_model, val), evaluate(ap_model, val)
    assert ap_loss < 3.2  # it learned (starts at ~5.5)
    assert abs(ap_loss - ref_loss) / ref_loss < 0.05


@pytest.mark.skipif(not CPU_SCALED_MM_ROW_SCALES, reason=f"torch {torch.__version__}'s CPU _scaled_mm refuses row-wise scales (row-wise layers are emulated)")
def test_rowwise_layer_in_an_fp16_region_writes_fp16_from_the_kernel():
    """An FP16 region: the row-wise kernel writes FP16 itself (the installed torch takes it: 2.13 on
    CPU; 2.11 on sm_90 with cuBLAS >= 12.9), not BF16 cast to FP16 (BF16 rounding, one more kernel,
    the bias fused in BF16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    x = torch.randn(32, 64)
    plan = ap.Plan.uniform(model, "fp16").with_layers({"1": ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(granularity="row", mode="current"))})
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._scaled_mm.default:
                calls.append(out.dtype)
            return out

    with torch.no_grad(), ap.apply_plan(model, plan), Record():
        h = model[0](x)
        out = model(x)
    assert calls and set(calls) == {torch.float16}
    # Plain-torch reference from the same FP16 input: per-row inverse scales amax / 448, torch's
    # casts, FP32 product, bias, one rounding to FP16. A BF16 kernel output is off by up to 2**-9
    # relative; FP16 by 2**-11.
    fmt, w = Format.FP8_E4M3, model[1].weight
    inv_x = h.float().abs().amax(dim=1, keepdim=True) * (1 / fmt.max)
    inv_w = w.abs().amax(dim=1, keepdim=True) * (1 / fmt.max)
    xq = (h.float() / inv_x).to(torch.float8_e4m3fn).float() * inv_x
    wq = (w / inv_w).to(torch.float8_e4m3fn).float() * inv_w
    expected = (xq @ wq.t() + model[1].bias).to(torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-10, atol=1e-3)


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 123457])
@pytest.mark.parametrize("ties", [False, True])
def test_calibration_percentile_equals_torch_quantile_bitwise(n, ties):
    # The INT8 percentile clip is computed from a topk of the shorter side (torch 2.11's quantile
    # syncs once); both sides are reached (q below and above one half), with and without ties.
    from autoprec.runtime.calibration import _quantile

    g = torch.Generator().manual_seed(n)
    values = torch.randint(0, 7, (n,), generator=g).float() if ties else torch.randn(n, generator=g).abs()
    for q in (0.0, 0.001, 0.25, 0.5, 0.75, 0.999, 0.9999, 1.0):
        assert torch.equal(_quantile(values, q), torch.quantile(values, q)), q


def test_an_int8_attention_routes_only_its_own_products_not_its_int8_projections_kernel_ops():
    """The attention layer's mode (its own q @ k products, emulated in INT8) runs around its INT8
    projections, whose kernels call torch ops of their own (the outlier channels' addmm, the
    output's addcmul): those pass through it. Routed as the attention's, a projection's output was
    quantized a second time."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    x, y = wl.train_batches(0).next()
    plan = ap.Plan.uniform(model, "int8", x, calibration=ap.Calibration(batches=1, outlier_ratio=2.0))
    runtime = ap.apply_plan(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        for _ in range(2):
            with runtime:
                wl.loss(model, (x, y)).backward()
    report = runtime.report()
    assert set(report["blocks.0.attn"]["ops"]) == {"matmul"}  # q @ k and attention @ v, nothing of its projections
    assert any(c["outlier_channels"] > 0 for fqn in ("blocks.0.attn.qkv", "blocks.0.attn.proj") for c in report[fqn]["calibration"])
    runtime.remove()


def test_an_fp8_layer_runs_a_one_row_input_as_the_first_row_of_a_batch():
    """A one-token decoding step (HF generate with the KV cache): the expanded per-tensor input
    scale of one row was a (1, 1) view with stride 0, which _scaled_mm refused."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    plan = ap.Plan.uniform(layer, "fp8_e4m3")
    x = torch.randn(4, 64)
    runtime = ap.apply_plan(layer, plan)
    try:
        with torch.no_grad(), runtime:
            one = layer(x[:1])
            reference = layer(x[:1].expand(4, 64).contiguous())  # the same row four times: the same scale
    finally:
        runtime.remove()
    assert one.shape == (1, 32) and torch.isfinite(one).all()
    torch.testing.assert_close(one, reference[:1])
