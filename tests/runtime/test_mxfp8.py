"""MXFP8 layers (``Scaling(granularity="mx")``, `runtime.mx_gemm`): the scales, the casts and the
three products against an MXFP8 written here in plain PyTorch from the spec (E4M3 codes, one
power-of-two scale per 32 elements along each GEMM's contracted dimension, the scale rounded up
so that no element saturates), the plan's rules, the memory model, and a model trained with it.
Transformer Engine's ``MXFP8Quantizer`` against the same runtime: tests/integrations/test_export_te.py."""

import math

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.costs.memory import layer_memory
from autoprec.costs.trace import saved_bytes_by_layer, trace_model
from autoprec.formats import Format, Granularity, mx_inverse_scale
from autoprec.runtime.mx_gemm import mx_cast
from support.models import first_lm_step_graphs, tiny_lm_under, tiny_lms_side_by_side

MX = ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(granularity="mx"))
E4M3_MAX = 448.0

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.EmulationWarning")  # every MXFP8 product is emulated here


def _scale(amax: float) -> float:
    """The spec's scale of one tile, in float64: the least power of two with amax / scale <= 448."""
    if amax == 0:
        return 2.0**-127
    return 2.0 ** math.ceil(math.log2(amax / E4M3_MAX))


def _reference(t: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """MXFP8 of 2-D ``t`` along its rows (columns zero-padded to a multiple of 32), dequantized."""
    m, n = t.shape
    t = nn.functional.pad(t.float(), (0, -n % 32))
    tiles = t.reshape(m, -1, 32)
    scales = torch.tensor([[_scale(v) for v in row] for row in tiles.abs().amax(-1).tolist()], dtype=torch.float32).unsqueeze(-1)
    limit = torch.finfo(dtype).max
    return ((tiles / scales).clamp(-limit, limit).to(dtype).float() * scales).reshape(m, -1)[:, :n]


def test_the_scale_is_the_least_power_of_two_that_keeps_the_tile_in_range():
    amax = torch.cat([torch.tensor([0.0, 448.0, 449.0, 1.0, 56.0, 3e38, 1e-30]), torch.rand(200) * 10.0 ** torch.randint(-20, 20, (200,))])
    got = mx_inverse_scale(amax, Format.FP8_E4M3)
    want = torch.tensor([_scale(v) for v in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    nonzero = amax > 0
    assert (amax[nonzero] / got[nonzero] <= E4M3_MAX).all() and (amax[nonzero] / (got[nonzero] / 2) > E4M3_MAX).all()
    assert torch.isinf(mx_inverse_scale(torch.tensor([float("inf")]), Format.FP8_E4M3)).all()


def test_a_cast_is_the_specs_tile_by_tile_and_pads_the_tiles_with_zeros():
    torch.manual_seed(0)
    x = torch.randn(5, 70) * torch.logspace(-3, 3, 70)  # tiles of very different ranges; 70 = 2 tiles and 6 elements
    q, inv = mx_cast(x)
    assert q.shape == (5, 96) and inv.shape == (5, 3) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(q[:, 70:].float(), torch.zeros(5, 26))
    dequantized = (q.float().reshape(5, 3, 32) * inv.unsqueeze(-1)).reshape(5, 96)[:, :70]
    assert torch.equal(dequantized, _reference(x))
    # A per-tensor scale loses the small tiles: the test can tell the two apart.
    per_tensor = (x / (x.abs().max() / E4M3_MAX)).to(torch.float8_e4m3fn).float() * (x.abs().max() / E4M3_MAX)
    assert not torch.equal(per_tensor, dequantized)


def _by_hand(x, w, b, g, grad_dtype=torch.float8_e4m3fn):
    """The three MXFP8 products from `_reference`: each operand tiled along the dimension its
    GEMM contracts, FP32 accumulation."""
    y = _reference(x) @ _reference(w).t() + b
    dx = _reference(g, grad_dtype) @ _reference(w.t()).t()
    dw = _reference(g.t(), grad_dtype) @ _reference(x.t()).t()
    return y, dx, dw


@pytest.mark.parametrize("grad_format", ["fp8_e4m3", "fp8_e5m2"])
def test_the_three_products_are_mxfp8_by_hand(grad_format):
    """Odd sizes (K = 40, N = 24, 13 tokens in a (13, 1) batch), a bias: the layer's output (in the
    plan's BF16 region) and both gradients equal the spec's by hand (up to FP32 summation order)."""
    torch.manual_seed(0)
    layer = nn.Linear(40, 24)
    with torch.no_grad():  # ranges that differ along K and along N, so the two tilings of the weight differ
        layer.weight.mul_(torch.logspace(-2, 2, 40) * torch.logspace(1, -1, 24)[:, None])
    x = torch.randn(13, 1, 40, requires_grad=True)
    plan = ap.Plan({"0": ap.LayerPrecision("fp8_e4m3", grad_format=grad_format, scaling=ap.Scaling(granularity="mx"))})
    model = nn.Sequential(layer)
    with ap.apply_plan(model, plan):
        y = model(x)
    assert y.dtype == torch.bfloat16
    g = torch.randn(y.shape).to(y.dtype)
    y.backward(g)
    g = g.float()
    dtype = torch.float8_e4m3fn if grad_format == "fp8_e4m3" else torch.float8_e5m2
    want_y, want_dx, want_dw = _by_hand(x.detach().reshape(13, 40), layer.weight.detach(), layer.bias.detach(), g.reshape(13, 24), dtype)
    torch.testing.assert_close(y.reshape(13, 24).float(), want_y.to(torch.bfloat16).float(), rtol=0, atol=1e-2)
    torch.testing.assert_close(x.grad.reshape(13, 40), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, want_dw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, g.reshape(13, 24).sum(0))
    # The weight tiled along K for the input gradient (the forward's copy, read transposed) is not MXFP8's.
    wrong_dx = _reference(g.reshape(13, 24), dtype) @ _reference(layer.weight.detach())
    assert not torch.allclose(wrong_dx, x.grad.reshape(13, 40), rtol=1e-5, atol=1e-5)


def test_a_high_precision_backward_multiplies_the_unrounded_gradient_by_the_forwards_operands():
    """``grad_format="fp32"`` (Transformer Engine's ``backward_override="dequantized"``): the same
    output, and both gradients the output gradient itself times the forward's MXFP8 operands
    (tiled along K), dequantized; it saves the forward's copies (M and N rows, K padded to 32)."""
    torch.manual_seed(0)
    layer = nn.Linear(40, 24)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-2, 2, 40) * torch.logspace(1, -1, 24)[:, None])
    high = ap.LayerPrecision("fp8_e4m3", grad_format="fp32", scaling=ap.Scaling(granularity="mx"))
    x = torch.randn(13, 1, 40, requires_grad=True)
    model = nn.Sequential(layer)
    with ap.apply_plan(model, ap.Plan({"0": high})):
        y = model(x)
    with torch.no_grad(), ap.apply_plan(model, ap.Plan({"0": MX})):
        assert torch.equal(y, model(x))  # the forward is MXFP8's either way
    g = torch.randn(y.shape).to(y.dtype)
    y.backward(g)
    g = g.float().reshape(13, 24)
    # Both GEMMs in the gradient's dtype (the BF16 region's): FP32 accumulation, one rounding to
    # BF16 (within one BF16 step: CPUs accumulate in their own order).
    bf16_step = dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(x.grad.reshape(13, 40), (g @ _reference(layer.weight.detach())).to(torch.bfloat16).float(), **bf16_step)
    torch.testing.assert_close(layer.weight.grad, (g.t() @ _reference(x.detach().reshape(13, 40))).to(torch.bfloat16).float(), **bf16_step)
    # The default MXFP8 backward rounds g: the two differ.
    x.grad = None
    with ap.apply_plan(model, ap.Plan({"0": MX})):
        model(x).backward(g.reshape(13, 1, 24).to(torch.bfloat16))
    assert not torch.allclose(x.grad.reshape(13, 40).float(), (g @ _reference(layer.weight.detach())), rtol=2**-6, atol=1e-3)


def test_under_bf16_autocast_the_output_is_bf16_and_the_product_is_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(16, 64)
    plan = ap.Plan({"0": MX, "2": ap.LayerPrecision("bf16")})
    with ap.apply_plan(model, plan) as runtime:
        h = model[0](x)
        out = model(x)
    assert h.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    want = (_reference(x) @ _reference(model[0].weight.detach()).t() + model[0].bias.detach()).to(torch.bfloat16)
    assert torch.equal(h, want)
    assert runtime.report()["0"]["ops"]["linear"].startswith("emulated (no MXFP8 kernel")


def test_the_plans_rules_name_the_field_and_the_fix():
    with pytest.raises(ap.PlanError, match=r"scaling.granularity: MXFP8 \('mx'\) is E4M3 with E4M3, E5M2 or high-precision.*format 'fp8_e5m2'; set format 'fp8_e4m3'") as info:
        ap.LayerPrecision("fp8_e5m2", scaling=ap.Scaling(granularity="mx"))
    assert "\n" not in str(info.value)
    with pytest.raises(ap.PlanError, match="an FP8 layer's gradients are fp8_e5m2, fp8_e4m3 or fp32, got 'bf16'"):
        ap.LayerPrecision("fp8_e4m3", grad_format="bf16", scaling=ap.Scaling(granularity="mx"))
    with pytest.raises(ap.PlanError, match="'mx' is MXFP8, for fp8_e4m3 layers"):
        ap.LayerPrecision("int8", scaling=ap.Scaling(granularity="mx"))
    with pytest.raises(ap.PlanError, match="delayed scaling keeps one amax per tensor"):
        ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(granularity="mx", mode="delayed"))
    assert MX.grad_format is Format.FP8_E4M3  # Transformer Engine's MXFP8 default


def test_a_plan_with_mxfp8_round_trips_and_the_strict_check_says_emulated(tmp_path):
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    plan = ap.Plan.uniform(model, "fp8_e4m3", (x,), scaling=ap.Scaling(granularity="mx"))
    again = ap.Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.layers == plan.layers and again.layers["0"].scaling.granularity is Granularity.MX
    with pytest.raises(ap.PlanError, match="MXFP8 has no kernel here"):
        again.validate(model, (x,), allow_emulation=False)


@pytest.mark.parametrize("grad_format", ["fp8_e4m3", "fp32"])
def test_the_memory_model_predicts_the_bytes_an_mxfp8_layer_saves(grad_format):
    """The input tiled along M and the weight tiled along N, a byte per element and one per tile
    (a high-precision backward: the forward's copies, tiled along K); a layer whose input needs no
    gradient keeps no copy of its weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 72), nn.GELU(), nn.Linear(72, 24))
    x = torch.randn(8, 5, 40)
    precision = ap.LayerPrecision("fp8_e4m3", grad_format=grad_format, scaling=ap.Scaling(granularity="mx"))
    plan = ap.Plan({"0": precision, "2": precision})
    traced = trace_model(model, x)
    runtime = ap.apply_plan(model, plan)
    measured, _ = saved_bytes_by_layer(model, x, ["0", "2"], lambda: runtime)
    for fqn in ("0", "2"):
        cost = layer_memory(traced.layers[fqn], precision, "cpu")
        assert cost.weight_copy_bytes + cost.activation_bytes == measured[fqn], fqn
    # The first layer: its input needs no gradient, so only the input's copy: K rows of M = 40
    # tokens padded to 64, or (high-precision backward) 40 rows of K = 40 padded to 64.
    assert measured["0"] == 40 * 64 + 40 * 2


def test_a_model_trains_in_mxfp8_close_to_fp32_and_compiles_in_one_graph():
    models, runtimes, losses, g = tiny_lms_side_by_side([MX, None])
    mx, fp32 = (sum(v[-5:]) / 5 for v in losses)
    assert mx < losses[0][0] - 1.0  # it learns
    assert abs(mx - fp32) < 0.05 * fp32  # as FP32 does, within MXFP8's rounding
    _, _, breaks = first_lm_step_graphs(models, runtimes, g)
    assert (breaks.graphs, breaks.breaks) == (1, 0), "\n".join(breaks.reasons)


def test_the_scheduler_searches_with_fp8_in_mxfp8_and_trains_under_its_plan():
    from autoprec.scheduler import DynamicPrecisionScheduler

    # FP32 and FP8 only, no recomputation, and a memory budget only FP8 layers meet.
    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=3, memory_budget=0.8, accuracy_budget=0.5,
                                          formats=["fp32", "fp8_e4m3"], scaling={"fp8_e4m3": "mx"}, recompute=[], measure_costs=False,
                                          search_slice=None)
    loss = tiny_lm_under(scheduler, 5)
    assert scheduler.last_search_error is None and scheduler.phase == "planned"
    fp8 = [lp for lp in scheduler.plan.layers.values() if lp.format.is_fp8]
    assert fp8 and all(lp.scaling.granularity is Granularity.MX for lp in fp8)
    assert torch.isfinite(loss)
