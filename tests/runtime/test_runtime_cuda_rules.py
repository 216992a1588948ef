"""The FP8 / INT8 runtime under `CudaRules`: every kernel call and FP8 cast it makes, forward and
backward, must be one an H100 (torch >= 2.11) accepts, with finite outputs and gradients.

Public API only. Token counts 1000, 24 and 4104 are multiples of 8 but not of 16 (the contracted
dimension K of a weight-gradient GEMM); inputs come contiguous, transposed and 3-D. Feature sizes
(64 in, 48 out) are multiples of 16, so the forward GEMM always has a legal kernel shape and must
run one.
"""

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from support.cuda_rules import CudaRules
from support.models import TransposedProjection
from support.models import ViewWeight
from support.torch_versions import CPU_SCALED_MM_ROW_SCALES

D_IN, D_OUT = 64, 48


MODULES = {
    "linear": lambda: nn.Linear(D_IN, D_OUT),
    "matmul_t": lambda: ViewWeight(D_IN, D_OUT),
    "addmm_transposed_weight": lambda: TransposedProjection(D_IN, D_OUT),
}

RECIPES = {
    "fp8_e4m3-tensor-delayed": ("fp8_e4m3", ap.Scaling(granularity="tensor", mode="delayed")),
    "fp8_e4m3-tensor-current": ("fp8_e4m3", ap.Scaling(granularity="tensor", mode="current")),
    "fp8_e4m3-row-current": ("fp8_e4m3", ap.Scaling(granularity="row", mode="current")),
    "fp8_e5m2-tensor-delayed": ("fp8_e5m2", ap.Scaling(granularity="tensor", mode="delayed")),
    "fp8_e5m2-tensor-current": ("fp8_e5m2", ap.Scaling(granularity="tensor", mode="current")),
    "fp8_e5m2-row-current": ("fp8_e5m2", ap.Scaling(granularity="row", mode="current")),
    "int8-tensor": ("int8", ap.Scaling(granularity="tensor", mode="current")),
    "int8-row": ("int8", ap.Scaling(granularity="row", mode="current")),
}

# One calibration batch: the frozen INT8 scale is in force from the first forward on.
CALIBRATION = ap.Calibration(batches=1)


def make_input(layout: str, tokens: int) -> torch.Tensor:
    if layout == "2d":
        return torch.randn(tokens, D_IN)
    if layout == "2d-transposed":
        return torch.randn(D_IN, tokens).t()
    return torch.randn(2, tokens // 2, D_IN)  # "3d"


def planned(module_name: str, recipe: str, example: torch.Tensor):
    torch.manual_seed(0)
    model = MODULES[module_name]()
    fmt, scaling = RECIPES[recipe]
    plan = ap.Plan.uniform(model, fmt, example, scaling=scaling, calibration=CALIBRATION)
    return model, ap.apply_plan(model, plan)


def step(model, runtime, x: torch.Tensor) -> None:
    """One forward and backward with a random output gradient; output and gradients finite."""
    x = x.detach().requires_grad_()
    with runtime:
        out = model(x)
    out.backward(torch.randn_like(out))
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in grads)


def assert_kernels_ran(rules: CudaRules, recipe: str, runtime) -> None:
    """M is free and K=64, N=48 are multiples of 16 (and M > 16 for INT8), so the forward GEMM
    has a legal kernel shape; for FP8 so has the input-gradient GEMM (K=48, N=64). INT8 layers
    run backward in FP32 by design. Row-wise FP8 where the installed torch's CPU kernel refuses
    row-wise scales (2.11; tests/support/torch_versions.py) is emulated, and reported so: its casts are
    checked here, its kernel calls on 2.13."""
    if recipe.startswith("int8"):
        assert rules.counts["_int_mm"] >= 1
    elif "-row-" in recipe and not CPU_SCALED_MM_ROW_SCALES:
        assert rules.counts["_scaled_mm"] == 0
        assert runtime.emulated_layers() and all("row-wise scales" in how for entry in runtime.report().values() for how in entry["ops"].values())
    else:
        assert rules.counts["_scaled_mm"] >= 2


# Every layout at 1000 and 24 tokens; 4104 (K past 4096, and the slowest: CPU FP8 GEMMs are
# reference kernels) contiguous only, as layouts do not interact with its size. torch.addmm takes
# 2-D inputs only, so the addmm module gets no 3-D input (plain PyTorch refuses it too).
SHAPES = [(tokens, layout) for tokens in (1000, 24) for layout in ("2d", "2d-transposed", "3d")] + [(4104, "2d")]
CASES = [(name, *shape) for name in MODULES for shape in SHAPES if not (name == "addmm_transposed_weight" and shape[1] == "3d")]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(("module_name", "tokens", "layout"), CASES)
def test_forward_and_backward_obey_cuda_rules(module_name, tokens, layout, recipe):
    torch.manual_seed(1)
    x = make_input(layout, tokens)
    model, runtime = planned(module_name, recipe, x)
    with CudaRules() as rules:
        step(model, runtime, x)
    assert_kernels_ran(rules, recipe, runtime)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("module_name", list(MODULES))
def test_delayed_scaling_spike_obeys_cuda_rules(module_name, fmt):
    """Four steps of unit-variance inputs build the amax history, then an input 8x larger comes:
    its delayed scale is 8x too large, and no value may reach the FP8 cast out of range. 256
    tokens: every GEMM shape is legal, so only the spike is under test."""
    torch.manual_seed(2)
    x = torch.randn(256, D_IN)
    model, runtime = planned(module_name, f"{fmt}-tensor-delayed", x)
    with CudaRules() as rules:
        for _ in range(4):
            step(model, runtime, torch.randn(256, D_IN))
        step(model, runtime, 8 * torch.randn(256, D_IN))
    assert rules.counts["_scaled_mm"] >= 2 * 5


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_IN, D_IN), nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("recipe", ["fp8_e4m3-tensor-current", "fp8_e4m3-tensor-delayed", "int8-tensor"])
def test_recomputed_blocks_rerun_their_kernels_within_cuda_rules(recipe):
    """Two checkpointed blocks of two layers: the recomputation in the backward runs each
    layer's kernel once more (4 calls), and every call, recomputed ones included, is one an H100
    accepts; 1000 tokens (K of the weight gradient not a multiple of 16)."""
    fmt, scaling = RECIPES[recipe]
    counts = {}
    for recompute in (False, True):
        torch.manual_seed(3)
        model = nn.Sequential(_Block(), _Block())
        x = torch.randn(1000, D_IN)
        plan = ap.Plan.uniform(model, fmt, x, scaling=scaling, calibration=CALIBRATION)
        if recompute:
            plan = plan.with_recompute(["0", "1"])
        runtime = ap.apply_plan(model, plan)
        step(model, runtime, x)  # the first step calibrates INT8 and fills the delayed history
        with CudaRules() as rules:
            step(model, runtime, torch.randn(1000, D_IN))
        counts[recompute] = rules.counts["_int_mm" if fmt == "int8" else "_scaled_mm"]
    assert counts[False] >= 4
    assert counts[True] == counts[False] + 4
