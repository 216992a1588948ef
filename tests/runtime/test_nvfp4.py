"""NVFP4 layers (``LayerPrecision("nvfp4")``, `runtime.nvfp4`): the rounding, the two-level
scales and the casts against an NVFP4 written here block by block from the published definition
(arXiv:2509.25149, section 2 and appendix: E2M1 values, E4M3 scales per 16 elements, an FP32
global scale mapping the tensor's amax onto 448 x 6; ties to even; stochastic rounding unbiased),
in NumPy float32 scalars, one block at a time; the three products of a linear layer, the plan's
rules, the memory model, and a model trained and searched with it."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.costs.memory import layer_memory
from autoprec.costs.trace import saved_bytes_by_layer, trace_model
from autoprec.formats import Format
from autoprec.runtime.nvfp4 import Nvfp4Linear, Nvfp4Spec, hadamard_blocks, nvfp4_cast, round_e2m1
from autoprec.runtime.quantizers import OperandRole, quantizer
from support.models import first_lm_step_graphs, tiny_lm_under, tiny_lms_side_by_side

NV = ap.LayerPrecision("nvfp4")
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1's magnitudes, in code order

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.EmulationWarning")  # every NVFP4 product is emulated here


def _e2m1(v: float, u: "float | None" = None) -> float:
    """One value on E2M1's grid, saturated at 6: nearest, a tie to the even code (the neighbour
    whose index in GRID is even); with a uniform ``u``, up with probability (v - lo) / (hi - lo)."""
    a = min(abs(v), 6.0)
    lo = max(g for g in GRID if g <= a)
    hi = min(g for g in GRID if g >= a)
    if lo == hi:
        q = lo
    elif u is not None:
        q = hi if u < (a - lo) / (hi - lo) else lo
    elif a - lo != hi - a:
        q = lo if a - lo < hi - a else hi
    else:
        q = lo if GRID.index(lo) % 2 == 0 else hi
    return math.copysign(q, v)


def _e4m3(v: np.float32) -> np.float32:
    return np.float32(torch.tensor(float(v)).to(torch.float8_e4m3fn).float().item())


def _reference(x: torch.Tensor, square: bool = False, noise: "torch.Tensor | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of 2-D ``x`` (columns, and with ``square`` rows, zero-padded to 16) one block at a
    time in float32 scalars: (dequantized padded values, the E4M3 block scales as float32)."""
    f32 = np.float32
    x = nn.functional.pad(x.float(), (0, -x.shape[1] % 16, 0, (-x.shape[0] % 16) if square else 0))
    rows, cols = x.shape
    a = x.numpy()
    amax = f32(np.abs(a).max())
    g_enc = min(f32(448.0 * 6.0) / amax, f32(np.finfo(np.float32).max)) if amax > 0 else f32(np.finfo(np.float32).max)
    g_dec = f32(1.0) / g_enc
    out = np.zeros_like(a)
    height = 16 if square else 1
    scales = np.zeros((rows // height, cols // 16), dtype=np.float32)
    u = None if noise is None else noise.numpy()
    for bi in range(rows // height):
        for bj in range(cols // 16):
            block = a[bi * height:(bi + 1) * height, bj * 16:(bj + 1) * 16]
            s = _e4m3(min((f32(np.abs(block).max()) / f32(6.0)) * g_enc, f32(448.0)))
            scales[bi, bj] = s
            decode = f32(s * g_dec)
            encode = min(f32(1.0) / decode, f32(np.finfo(np.float32).max)) if decode > 0 else f32(np.finfo(np.float32).max)
            for i in range(block.shape[0]):
                for j in range(16):
                    r, c = bi * height + i, bj * 16 + j
                    scaled = min(max(f32(a[r, c] * encode), f32(-6.0)), f32(6.0))
                    out[r, c] = f32(_e2m1(float(scaled), None if u is None else float(u[r, c]))) * decode
    return torch.from_numpy(out), torch.from_numpy(scales)


def test_e2m1_rounds_ties_to_the_even_code_and_saturates_at_six():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(ties).tolist() == [_e2m1(v) for v in ties.tolist()] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    v = torch.cat([torch.linspace(-8, 8, 4097), torch.randn(2000) * 3])
    assert round_e2m1(v).tolist() == [_e2m1(x) for x in v.tolist()]
    assert torch.isnan(round_e2m1(torch.tensor([float("nan")]))).all()


def test_stochastic_rounding_is_the_definitions_given_the_noise_and_unbiased():
    torch.manual_seed(0)
    v = torch.rand(3000) * 12 - 6
    noise = torch.rand(3000)
    assert round_e2m1(v, noise).tolist() == [_e2m1(x, u) for x, u in zip(v.tolist(), noise.tolist())]
    # Each value's mean over many draws is the value itself (nearest rounding is not).
    values = torch.tensor([0.3, 1.2, 2.6, 4.9, -3.3])
    draws = torch.stack([round_e2m1(values, torch.rand(5)) for _ in range(20000)])
    assert torch.allclose(draws.mean(0), values, atol=0.03)
    assert not torch.allclose(round_e2m1(values), values, atol=0.03)


@pytest.mark.parametrize("square", [False, True], ids=["1x16", "16x16"])
def test_a_cast_is_the_definitions_block_by_block_on_both_scales(square):
    torch.manual_seed(0)
    # 21 x 70: blocks of very different ranges, partial blocks padded with zeros; one zero block.
    x = torch.randn(21, 70) * torch.logspace(-4, 3, 70)
    x[:, 16:32] = 0
    q = nvfp4_cast(x, square=square)
    want, scales = _reference(x, square)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (32 if square else 21, 40)  # two codes per byte
    assert torch.equal(q.scales.float(), scales)
    assert torch.equal(q.dequantize(), want)
    # One FP32 scale for the whole tensor loses the small blocks: the test can tell the two apart.
    per_tensor = round_e2m1(x / (x.abs().max() / 6)) * (x.abs().max() / 6)
    assert not torch.equal(per_tensor, want[: x.shape[0], : x.shape[1]])


def test_a_stochastic_cast_is_the_definitions_with_the_same_draws():
    torch.manual_seed(0)
    x = torch.randn(5, 48) * 3
    state = torch.get_rng_state()
    q = nvfp4_cast(x, stochastic=True)
    torch.set_rng_state(state)
    want, _ = _reference(x, noise=torch.rand(5, 48))
    assert torch.equal(q.dequantize(), want)


def test_an_all_zero_tensor_casts_to_zeros_and_a_non_finite_one_to_nan():
    assert torch.equal(nvfp4_cast(torch.zeros(3, 20)).dequantize(), torch.zeros(3, 32))
    x = torch.randn(3, 20)
    x[1, 2] = float("inf")
    assert torch.isnan(nvfp4_cast(x).dequantize()).all()


def test_the_hadamard_transform_is_orthogonal_and_has_signs():
    t = hadamard_blocks(torch.device("cpu"))
    assert torch.allclose(t @ t.t(), torch.eye(16), atol=1e-6)
    plain = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    for _ in range(3):
        plain = torch.cat((torch.cat((plain, plain), 1), torch.cat((plain, -plain), 1)), 0)
    assert not torch.allclose(t, plain / 4)  # a random sign per row, not Sylvester's matrix alone
    assert torch.allclose((t.abs() * 4), torch.ones(16, 16))


def _by_hand(x, w, b, g, noise_dx, noise_dw):
    """The three NVFP4 products from `_reference`: the forward x (1x16 along K) by W (16x16); the
    input gradient g (1x16 along N, stochastic) by the same W; the weight gradient g.T and x.T,
    both along M after the blocks' Hadamard transform, g stochastic."""
    m, k = x.shape
    n = w.shape[0]
    xq, _ = _reference(x)
    wq, _ = _reference(w, square=True)
    y = (xq[:, :k] @ wq[:n, :k].t()) + b
    gq, _ = _reference(g, noise=noise_dx)
    dx = gq[:, :n] @ wq[:n, :k]
    t = hadamard_blocks(torch.device("cpu"))

    def transformed(a):
        a = nn.functional.pad(a, (0, -a.shape[1] % 16))
        return (a.reshape(a.shape[0], -1, 16) @ t).reshape(a.shape[0], -1)

    g_t, _ = _reference(transformed(g.t()), noise=noise_dw)
    x_t, _ = _reference(transformed(x.t()))
    dw = g_t @ x_t.t()
    return y, dx, dw


def test_the_three_products_are_nvfp4_by_hand():
    """Odd sizes (K = 40, N = 24, M = 13), a bias: the output and both gradients equal the
    definition's by hand, the stochastic draws replayed (up to FP32 summation order)."""
    torch.manual_seed(0)
    x = torch.randn(13, 40, requires_grad=True)
    w = (torch.randn(24, 40) * torch.logspace(-2, 2, 40)).requires_grad_()
    b = torch.randn(24, requires_grad=True)
    y = Nvfp4Linear.apply(x, w, b, Nvfp4Spec(torch.float32))
    g = torch.randn(13, 24)
    state = torch.get_rng_state()
    y.backward(g)
    torch.set_rng_state(state)
    noise_dx = torch.rand(13, 32)  # the input gradient's draws (N padded to 32), then the weight gradient's
    noise_dw = torch.rand(24, 16)
    want_y, want_dx, want_dw = _by_hand(x.detach(), w.detach(), b.detach(), g, noise_dx, noise_dw)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, want_dx[:, :40], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want_dw[:, :40], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, g.sum(0))


def test_the_gradients_are_unbiased_over_draws():
    """Stochastic rounding makes each gradient an unbiased estimate of the one on NVFP4 operands
    rounded to nearest; the weight gradient's transform changes nothing in expectation."""
    torch.manual_seed(0)
    x = torch.randn(32, 48)
    w = torch.randn(16, 48)
    g = torch.randn(32, 16)
    sums = [torch.zeros(32, 48), torch.zeros(16, 48)]
    draws = 400
    for _ in range(draws):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        Nvfp4Linear.apply(xi, wi, None, Nvfp4Spec(torch.float32)).backward(g)
        sums[0] += xi.grad
        sums[1] += wi.grad
    t = hadamard_blocks(torch.device("cpu"))
    wq = _reference(w, square=True)[0][:16, :48]
    x_t = _reference((x.t().reshape(48, 2, 16) @ t).reshape(48, 32))[0]  # x along M, transformed, to nearest
    exact_dx = g @ wq  # g itself, unrounded, times the forward's weight
    exact_dw = (g.t().reshape(16, 2, 16) @ t).reshape(16, 32) @ x_t.t()  # g transformed, unrounded
    one_draw = [xi.grad, wi.grad]
    for mean, exact, single in ((sums[0] / draws, exact_dx, one_draw[0]), (sums[1] / draws, exact_dw, one_draw[1])):
        error = (mean - exact).norm() / exact.norm()
        assert error < 0.02 and error < (single - exact).norm() / exact.norm() / 4


def test_a_high_precision_backward_multiplies_the_unrounded_gradient_by_the_forwards_operands():
    """``grad_format="fp32"`` (Transformer Engine's ``backward_override="dequantized"``): the
    forward's output unchanged; the input gradient g @ W and the weight gradient g.T @ x with g
    itself and W, x the forward's NVFP4 copies (16x16 and 1x16 blocks, by hand); no Hadamard
    transform and no stochastic rounding (the generator is not drawn from)."""
    torch.manual_seed(0)
    x = torch.randn(13, 40, requires_grad=True)
    w = (torch.randn(24, 40) * torch.logspace(-2, 2, 40)).requires_grad_()
    b = torch.randn(24, requires_grad=True)
    y = Nvfp4Linear.apply(x, w, b, Nvfp4Spec(torch.float32, high_precision_backward=True))
    assert torch.equal(y, Nvfp4Linear.apply(x.detach(), w.detach(), b.detach(), Nvfp4Spec(torch.float32)))
    g = torch.randn(13, 24)
    state = torch.get_rng_state()
    y.backward(g)
    assert torch.equal(torch.get_rng_state(), state)
    xq, wq = _reference(x.detach())[0][:, :40], _reference(w.detach(), square=True)[0][:24, :40]
    torch.testing.assert_close(y, xq @ wq.t() + b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, g @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, g.t() @ xq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, g.sum(0))


@pytest.mark.parametrize("high_precision_backward", [False, True])
def test_a_plan_layers_gradients_are_its_products(high_precision_backward):
    """Through `apply_plan`: an NVFP4 layer (``grad_format`` nvfp4 or fp32) runs the products
    `Nvfp4Linear` computes with that backward, on the same draws."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24))
    x = torch.randn(13, 40, requires_grad=True)
    precision = ap.LayerPrecision("nvfp4", grad_format="fp32" if high_precision_backward else None)
    g = torch.randn(13, 24).to(torch.bfloat16)
    state = torch.get_rng_state()
    with ap.apply_plan(model, ap.Plan({"0": precision})):
        y = model(x)
    assert y.dtype == torch.bfloat16  # the plan's region: the backward's products in BF16 too
    y.backward(g)
    w = model[0].weight.detach().clone().requires_grad_()
    xi = x.detach().clone().requires_grad_()
    torch.set_rng_state(state)
    Nvfp4Linear.apply(xi, w, model[0].bias.detach(), Nvfp4Spec(y.dtype, high_precision_backward)).backward(g)
    assert torch.equal(x.grad, xi.grad) and torch.equal(model[0].weight.grad, w.grad)


def test_the_plans_rules_name_the_field_and_the_fix():
    with pytest.raises(ap.PlanError, match=r"scaling: nvfp4 scales itself .*leave scaling out") as info:
        ap.LayerPrecision("nvfp4", scaling=ap.Scaling(granularity="row"))
    assert "\n" not in str(info.value)
    with pytest.raises(ap.PlanError, match=r"grad_format: an NVFP4 layer's gradients are nvfp4 or fp32 \(a high-precision backward\), got 'bf16'"):
        ap.LayerPrecision("nvfp4", grad_format="bf16")
    assert NV.grad_format is Format.NVFP4
    assert ap.LayerPrecision("nvfp4", grad_format="fp32").grad_format is Format.FP32


def test_a_layer_in_a_plan_runs_the_products_and_says_emulated(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.GELU(), nn.Linear(24, 8))
    x = torch.randn(13, 1, 40)
    plan = ap.Plan({"0": NV, "2": ap.LayerPrecision("fp32")})
    with ap.apply_plan(model, plan) as runtime:
        h = model[0](x)
    assert h.dtype == torch.bfloat16
    want = Nvfp4Linear.apply(x.reshape(13, 40), model[0].weight.detach(), model[0].bias.detach(), Nvfp4Spec(torch.bfloat16))
    assert torch.equal(h.reshape(13, 24), want)
    assert runtime.report()["0"]["ops"]["linear"].startswith("emulated (no NVFP4 kernel")
    again = ap.Plan.load(ap.Plan.uniform(model, "nvfp4", (x,)).save(tmp_path / "plan.json"))
    assert all(lp.format is Format.NVFP4 for lp in again.layers.values())
    with pytest.raises(ap.PlanError, match="nvfp4 has no kernel on cpu"):
        again.validate(model, (x,), allow_emulation=False)


def test_other_products_in_an_nvfp4_layer_are_rounded_through_its_blocks():
    """An attention product (a batched matmul) in an NVFP4 layer runs on NVFP4-rounded operands:
    the emulation quantizer's round trip is the cast's."""
    torch.manual_seed(0)
    x = torch.randn(6, 40) * torch.logspace(-2, 2, 40)
    q = quantizer(OperandRole.INPUT, Format.NVFP4, ap.Scaling())
    inv = q.inverse_scale(x)
    assert q.quantize(x, inv).dtype == torch.uint8
    assert torch.equal(q.dequantize(q.quantize(x, inv), inv, x.shape), nvfp4_cast(x).dequantize()[:6, :40])


@pytest.mark.parametrize("grad_format", ["nvfp4", "fp32"])
def test_the_memory_model_predicts_the_bytes_an_nvfp4_layer_saves(grad_format):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 72), nn.GELU(), nn.Linear(72, 24))
    x = torch.randn(8, 5, 40)
    precision = ap.LayerPrecision("nvfp4", grad_format=grad_format)
    plan = ap.Plan({"0": precision, "2": precision})
    traced = trace_model(model, x)
    runtime = ap.apply_plan(model, plan)
    measured, _ = saved_bytes_by_layer(model, x, ["0", "2"], lambda: runtime)
    for fqn in ("0", "2"):
        cost = layer_memory(traced.layers[fqn], precision, "cpu")
        assert cost.weight_copy_bytes + cost.activation_bytes == measured[fqn], fqn
    # The first layer's input needs no gradient: only x along M (40 rows of 40 tokens padded to
    # 48; a high-precision backward: the forward's copy, 40 tokens of K = 40 padded to 48), half
    # a byte each, an E4M3 byte per 16 and one FP32 scale.
    assert measured["0"] == 40 * 48 // 2 + 40 * 3 + 4


def test_a_model_trains_in_nvfp4_near_bf16_and_compiles_in_one_graph():
    models, runtimes, losses, g = tiny_lms_side_by_side([NV, ap.LayerPrecision("bf16")])
    nvfp4, bf16 = (sum(v[-5:]) / 5 for v in losses)
    assert nvfp4 < losses[0][0] - 1.0  # it learns
    assert abs(nvfp4 - bf16) < 0.1 * bf16  # near BF16, within FP4's rounding
    # Before: the Hadamard signs' Generator, made inside the traced cast, broke the graph 35 times.
    step, idx, breaks = first_lm_step_graphs(models, runtimes, g)
    assert (breaks.graphs, breaks.breaks) == (1, 0), "\n".join(breaks.reasons)
    models[0].eval()
    with torch.no_grad():
        eager, compiled, fp32 = step(idx), torch.compile(step)(idx), models[0](idx, idx)[1]
    # The compiled graph's own FP32 roundings move a few activations across an E2M1 rounding
    # boundary; the loss moves far less than NVFP4's own rounding moves it from FP32.
    assert abs(compiled - eager) < 0.25 * abs(eager - fp32)


@pytest.mark.parametrize("grad_formats", [{}, {"nvfp4": "fp32"}], ids=["nvfp4-backward", "high-precision-backward"])
def test_the_scheduler_searches_with_nvfp4_and_trains_under_its_plan(grad_formats):
    """NVFP4 as a candidate (min_precision=4) under a memory budget BF16 alone cannot meet: the
    search plans NVFP4 layers, and the planned windows do not promote them for "underflow" a
    per-tensor view would see (NVFP4's block scales keep small values). With ``grad_formats``
    the plan's NVFP4 layers take a high-precision backward (it saves the same bytes)."""
    from autoprec.scheduler import DynamicPrecisionScheduler

    scheduler = DynamicPrecisionScheduler(min_precision=4, max_precision=16, monitor_window=3, memory_budget=0.765, accuracy_budget=0.5,
                                          formats=["bf16", "nvfp4"], grad_formats=grad_formats, recompute=[], measure_costs=False, search_slice=None)
    loss = tiny_lm_under(scheduler, 20)
    assert scheduler.last_search_error is None and scheduler.phase == "planned"
    nvfp4 = [lp for lp in scheduler.plan.layers.values() if lp.format is Format.NVFP4]
    assert nvfp4 and {lp.grad_format for lp in nvfp4} == {Format.FP32 if grad_formats else Format.NVFP4}
    assert not [c for c in scheduler.changes if "underflow" in c.reason]
    assert torch.isfinite(loss)


def test_a_tensor_parallel_layer_refuses_nvfp4_with_the_reason():
    """Each shard would scale by its own amax where the unsharded layer has one scale per tensor:
    refused (at the first sharded forward, and as a candidate of the search's sharded layers)."""
    from autoprec.runtime.tensor_parallel import sharded_reason

    assert sharded_reason(NV, None) == "nvfp4 on a tensor-parallel (DTensor) weight is not supported yet"
    assert sharded_reason(ap.LayerPrecision("bf16"), None) is None
