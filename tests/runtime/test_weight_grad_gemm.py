"""Precision per GEMM: a layer's weight-gradient product in high precision while its input
gradient's stays low (`LayerPrecision.high_precision_weight_grad`, torchao's
``rowwise_with_gw_hp``), in every product that runs it: FP8 per tensor and per row (`gemm.Fp8Linear`),
block-scaled FP8 (`block_gemm.Fp8BlockLinear`), MXFP8, NVFP4 and the emulated products
(`emulation.StoredInFormat`). Each against the recipes it splits: the forward and the input
gradient are the low-precision backward's, bit for bit; the weight gradient is the unrounded
output gradient times the forward's input operand dequantized (plain PyTorch for per-tensor FP8 and
block tiles; the ``grad_format="fp32"`` recipe's, itself checked against references in
test_fp8_linear_numerics / test_mxfp8 / test_nvfp4, for the others)."""

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.errors import PlanError
from autoprec.formats import Format
from autoprec.monitoring.plans import plan_layers_markdown
from autoprec.plan import LayerPrecision, Plan, Scaling

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.EmulationWarning")

BLOCK_E5M2 = dict(scaling=Scaling(granularity="block"), grad_format="fp8_e5m2")  # no block kernel takes E5M2: emulated products
RECIPES = {
    "tensor": ("fp8_e4m3", {}),
    "row": ("fp8_e4m3", dict(scaling=Scaling(granularity="row"))),
    "block": ("fp8_e4m3", dict(scaling=Scaling(granularity="block"))),
    "mx": ("fp8_e4m3", dict(scaling=Scaling(granularity="mx"))),
    "nvfp4": ("nvfp4", {}),
    "emulated": ("fp8_e4m3", BLOCK_E5M2),
}


def _run(precision: LayerPrecision, seed: int = 0):
    """A Linear(72, 40) (K and N off every kernel's tiles) between two FP32 layers, 37 tokens,
    in the plan's BF16 region: its output, the gradients of its input, weight and bias, its input
    and the output gradient it was given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 72), nn.Linear(72, 40), nn.Tanh(), nn.Linear(40, 8))
    with torch.no_grad():  # ranges that differ per channel, so that roundings tell recipes apart
        model[1].weight.mul_(torch.logspace(-1, 1, 72) * torch.logspace(0.5, -0.5, 40)[:, None])
    x = torch.randn(37, 24)
    kept = {}

    def keep(module, args, out):
        kept.update(x=args[0], y=out)
        args[0].retain_grad()
        out.retain_grad()

    model[1].register_forward_hook(keep)
    fp32 = LayerPrecision("fp32")
    with ap.apply_plan(model, Plan({"0": fp32, "1": precision, "3": fp32})):
        loss = model(x).float().square().sum()
    torch.manual_seed(seed)  # NVFP4 rounds gradients stochastically: the same draws for every recipe
    loss.backward()
    return kept["y"].detach(), kept["x"].grad, model[1].weight.grad, model[1].bias.grad, kept["x"].detach(), kept["y"].grad


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_weight_gradient_alone_runs_in_high_precision(recipe):
    fmt, settings = RECIPES[recipe]
    low = _run(LayerPrecision(fmt, **settings))
    split = _run(LayerPrecision(fmt, high_precision_weight_grad=True, **settings))
    high = _run(LayerPrecision(fmt, **{**settings, "grad_format": "fp32"}))
    y, dx, dw, db = split[:4]
    assert torch.equal(y, low[0])  # the forward is the format's
    assert torch.equal(dx, low[1])  # the input gradient's product is the low-precision one
    assert not torch.equal(dx, high[1])
    if recipe != "block":  # (block-scaled FP8 with FP32 gradients runs the emulated products, another forward)
        # The same forward and saved operand as the high-precision backward: the same product,
        # and the bias's gradient from the unrounded g (the emulated low recipe's takes it rounded).
        assert torch.equal(y, high[0]) and torch.equal(dw, high[2]) and torch.equal(db, high[3])
    assert not torch.allclose(dw, low[2], rtol=1e-3, atol=0)  # the low-precision weight gradient rounds g: it differs


def test_per_tensor_the_weight_gradient_is_g_times_the_dequantized_input_by_hand():
    """Plain PyTorch: x in E4M3 with one scale (448 / amax), dequantized; g unrounded, in the BF16
    region's dtype; their product accumulated in FP32, rounded to BF16 once. The low-precision
    recipe (g in E5M2) is off by more than that rounding."""
    _, _, dw, _, x, g = _run(LayerPrecision("fp8_e4m3", high_precision_weight_grad=True))
    g = g.float()
    scale = 448.0 / x.float().abs().max()
    x_hat = (x.float() * scale).to(torch.float8_e4m3fn).float() / scale
    want = (g.t() @ x_hat.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    torch.testing.assert_close(dw, want, rtol=2**-7, atol=1e-5)
    low = _run(LayerPrecision("fp8_e4m3"))[2]
    assert not torch.allclose(low, want, rtol=2**-7, atol=1e-5)


def test_block_scaled_the_weight_gradient_is_g_times_the_forwards_input_tiles_by_hand():
    """The block recipe's forward input: 1x128 tiles along K (each token's 72 channels one tile,
    E4M3, one scale per tile), dequantized by hand, times the unrounded g."""
    _, _, dw, _, x, g = _run(LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="block"), high_precision_weight_grad=True))
    g = g.float()
    scale = 448.0 / x.float().abs().amax(1, keepdim=True)
    x_hat = (x.float() * scale).to(torch.float8_e4m3fn).float() / scale
    want = (g.t() @ x_hat.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    torch.testing.assert_close(dw, want, rtol=2**-7, atol=1e-5)


def test_the_plan_names_writes_and_reads_it_and_refuses_it_where_it_means_nothing(tmp_path):
    split = LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="row"), high_precision_weight_grad=True)
    assert split.recipe == "fp8_e4m3/row+fp32 wgrad" and split.weight_grad_format is Format.FP32
    assert split.grad_format is Format.FP8_E5M2
    plan = Plan({"fc": split, "out": LayerPrecision("bf16")})
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    assert text.count('"weight_grad_format"') == 1  # written only where set
    assert Plan.load(path).layers["fc"] == split
    assert "`fp8_e4m3 (grad fp8_e5m2, wgrad fp32)`" in plan_layers_markdown(plan)  # the review's format column
    # ... also where the gradients are the format's own (NVFP4's NVFP4 gradients).
    assert "`nvfp4 (wgrad fp32)`" in plan_layers_markdown(Plan({"fc": LayerPrecision("nvfp4", high_precision_weight_grad=True)}))
    # A whole high-precision backward implies it: one recipe, held once.
    assert LayerPrecision("fp8_e4m3", grad_format="fp32", high_precision_weight_grad=True) == LayerPrecision("fp8_e4m3", grad_format="fp32")
    with pytest.raises(PlanError, match=r"LayerPrecision\('bf16'\): a high-precision weight gradient .* leave it out"):
        LayerPrecision("bf16", high_precision_weight_grad=True)
    with pytest.raises(PlanError, match=r"layers\['fc'\]\.weight_grad_format: .* takes the gradients' format \('fp8_e5m2'\) or 'fp32'"):
        Plan.from_dict({"schema_version": 4, "layers": {"fc": {"format": "fp8_e4m3", "weight_grad_format": "bf16"}}})

