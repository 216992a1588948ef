"""The fused FP8 casts (`autoprec.runtime.triton_cast`) against the PyTorch path, bit for bit.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported), with CUDA compiled on CUDA tensors: the same
tests, the device's own reference. References are `autoprec.formats` (``amax``,
``inverse_scale``, ``quantize``), the PyTorch path's quantizers and torch's own conversions. The
interpreter runs the FP8 / BF16 roundings as the integer code the kernels use off CUDA; the
hardware branch is compiled for sm_90 here (Triton needs no GPU for that). The path choice and the
report need no Triton.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoprec as ap
from autoprec.formats import Format, amax, inverse_scale, quantize
from autoprec.opcount import OpCounter, graph_breaks
from autoprec.plan import Scaling
from autoprec.runtime import casts as casts_module
from autoprec.runtime.casts import FUSED, PYTORCH, call_casts, cast_path, choose, fused_casts
from autoprec.runtime.quantizers import OperandRole, TensorDelayedQuantizer, quantizer
from support.cuda_rules import CudaRules
from support.triton_env import DEVICE, NO_KERNELS, NUMPY_WARNINGS, force_fused_casts, needs_kernels

ROOT = Path(__file__).resolve().parents[2]
pytestmark = NUMPY_WARNINGS
if NO_KERNELS is None:
    import triton
    import triton.language as tl

    from autoprec.runtime import triton_arith, triton_cast

    @triton.jit
    def _roundings(x_ptr, out_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
        """The integer roundings of `triton_arith` on FP32 values: E4M3 (1), E5M2 (2)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        out = triton_arith._fp8_bits_soft(y, WHICH == 2).to(tl.uint32)
        tl.store(out_ptr + offs, out, mask=offs < n)

FP8 = [Format.FP8_E4M3, Format.FP8_E5M2]
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(67, 131), (1, 5), (255, 257)]
ALIGN = 16


# -- the choice of path (no Triton needed) -------------------------------------------------------


def test_fused_path_is_chosen_exactly_on_cuda_with_triton():
    assert choose("cuda", None)[0] == FUSED
    assert choose("cuda", "No module named 'triton'") == (PYTORCH, "triton does not import: No module named 'triton'")
    for device_type in ("cpu", "mps", "xpu"):
        assert choose(device_type, None)[0] == PYTORCH


def test_cpu_never_takes_the_fused_path_and_never_imports_triton_for_it(monkeypatch):
    monkeypatch.setattr(casts_module, "_triton_error", lambda: pytest.fail("CPU asked whether triton imports"))
    assert cast_path("cpu")[0] == PYTORCH and fused_casts("cpu") is None


def test_cuda_without_triton_keeps_pytorch_ops(monkeypatch):
    monkeypatch.setattr(casts_module, "_triton_error", lambda: "No module named 'triton'")
    assert cast_path("cuda:0") == (PYTORCH, "triton does not import: No module named 'triton'")
    assert fused_casts("cuda:0") is None


def test_report_names_pytorch_ops_for_an_fp8_layer_on_cpu():
    layer = nn.Linear(32, 16)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    with runtime:
        layer(torch.randn(8, 32)).float().sum().backward()
    assert runtime.report()[""]["casts"] == PYTORCH


def test_layers_without_an_fp8_kernel_report_no_casts():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    runtime = ap.apply_plan(model, ap.Plan({"0": "bf16", "1": "int8"}))
    assert all("casts" not in entry for entry in runtime.report().values())


# -- the kernels (interpreted on CPU, compiled on CUDA) ------------------------------------------


@pytest.fixture(scope="module")
def tc():
    if NO_KERNELS is not None:
        pytest.skip(NO_KERNELS)
    return triton_cast


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same FP8 bytes, NaN where NaN (a NaN's sign bit is each device's own)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


def special_values(shape, dtype, seed=0) -> torch.Tensor:
    """Data spanning many binades, with zeros of both signs, values past the formats' max once
    scaled and tiny ones (subnormal or zero once scaled) at fixed places; on the test device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 1e6, -1e6, 1e-30, -1e-30, 3e38, -3e38])
    flat[: min(len(specials), flat.numel())] = specials[: flat.numel()]
    return x.to(dtype).to(DEVICE)


def pad_rows_bytes(q: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero bytes appended to q's rows up to a multiple (as `gemm._pad_rows_fp8`)."""
    return F.pad(q.view(torch.uint8), (0, 0, 0, -q.shape[0] % rows)).view(q.dtype)


def reference_copies(x, inv, fmt, pad_rows, pad_cols, t_rows, t_fmt=None, t_inv=None):
    """The PyTorch path: pad, quantize, the transposed copy with its rows padded by zero bytes."""
    xp = F.pad(x, (0, -x.shape[1] % pad_cols, 0, -x.shape[0] % pad_rows))
    q = quantize(xp, inv, fmt).contiguous()
    qt_src = q if t_fmt is None else quantize(xp, t_inv, t_fmt)
    return q, pad_rows_bytes(qt_src, t_rows).t().contiguous()


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_cast_and_transposed_copy_match_quantize(tc, shape, dtype, fmt):
    x = special_values(shape, dtype)
    # A scale from a quarter of the amax: the largest values saturate at +-max.
    inv = inverse_scale(amax(x) / 4, fmt)
    for pad_rows, t_rows in ((1, ALIGN), (ALIGN, 1)):  # an input's layout, then a weight's
        q, qt = tc.cast(x, inv, fmt, pad_rows=pad_rows, pad_cols=ALIGN, t_fmt=fmt, t_rows=t_rows)
        ref_q, ref_qt = reference_copies(x, inv, fmt, pad_rows, ALIGN, t_rows)
        assert bytes_equal(q, ref_q) and bytes_equal(qt, ref_qt)
        assert (q.float().abs() == fmt.max).any()  # saturated


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_formats_in_one_pass_and_either_copy_alone(tc, dtype):
    """The gradient's pair: E5M2 rows for the input gradient, E4M3 transposed for the weight's."""
    x = special_values((67, 131), dtype, seed=1)
    e5, e4 = inverse_scale(amax(x), Format.FP8_E5M2), inverse_scale(amax(x), Format.FP8_E4M3)
    q, qt = tc.cast(x, e5, Format.FP8_E5M2, pad_cols=ALIGN, t_fmt=Format.FP8_E4M3, t_inv=e4, t_rows=ALIGN)
    ref_q, ref_qt = reference_copies(x, e5, Format.FP8_E5M2, 1, ALIGN, ALIGN, Format.FP8_E4M3, e4)
    assert bytes_equal(q, ref_q) and bytes_equal(qt, ref_qt)
    only_t = tc.cast(x, e5, None, pad_cols=ALIGN, t_fmt=Format.FP8_E4M3, t_inv=e4, t_rows=ALIGN)
    only_q = tc.cast(x, e5, Format.FP8_E5M2, pad_cols=ALIGN)
    assert only_t[0] is None and bytes_equal(only_t[1], ref_qt)
    assert only_q[1] is None and bytes_equal(only_q[0], ref_q)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_non_finite_values_and_scales_propagate_as_the_reference(tc, dtype, poison):
    x = special_values((37, 45), dtype, seed=2)
    x[5, 7] = float(poison)
    x[30, 0] = -float("inf")
    for fmt in FP8:
        poisoned = inverse_scale(amax(x), fmt)  # NaN or inf: the padding quantizes to it too
        assert not torch.isfinite(poisoned)
        for inv in (poisoned, inverse_scale(amax(x[:, 8:20]), fmt)):
            q, qt = tc.cast(x, inv, fmt, pad_cols=ALIGN, t_fmt=fmt, t_rows=ALIGN)
            ref_q, ref_qt = reference_copies(x, inv, fmt, 1, ALIGN, ALIGN)
            assert bytes_equal(q, ref_q) and bytes_equal(qt, ref_qt)


def same_scale(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.shape == b.shape and bool(a.isnan().all()) and bool(b.isnan().all()))


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES + [(0, 8)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_amax_and_scales_match_inverse_scale(tc, shape, dtype):
    x = special_values(shape, dtype, seed=3)
    cases = {"data": x, "zeros": torch.zeros(shape, dtype=dtype, device=DEVICE)}
    if x.numel():
        cases["nan"], cases["inf"] = x.clone(), x.clone()
        cases["nan"][0, -1] = float("nan")
        cases["inf"][-1, 0] = -float("inf")
        cases["transposed view"] = x.t()
    for name, data in cases.items():
        parts = tc.amax_partials(data)
        for margin in (0, 2):
            e4, e5 = tc.finalize_scales(parts, Format.FP8_E4M3, margin, second=Format.FP8_E5M2)
            assert same_scale(e4, inverse_scale(amax(data), Format.FP8_E4M3, margin)), (name, margin)
            assert same_scale(e5, inverse_scale(amax(data), Format.FP8_E5M2)), name


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_row_wise_cast_matches_row_scales_and_quantize(tc, dtype, fmt):
    x = special_values((37, 600), dtype, seed=4)  # more columns than one loop step of the kernel
    x[3, 9] = float("nan")
    x[1] = 0.0
    xp = F.pad(x, (0, -x.shape[1] % ALIGN, 0, -x.shape[0] % ALIGN))
    for margin in (0, 1):
        q, inv, row_amax = tc.cast_rows(x, fmt, margin, pad_rows=ALIGN, pad_cols=ALIGN)
        ref_inv = inverse_scale(amax(xp, dim=-1), fmt, margin)
        assert torch.equal(inv.isnan(), ref_inv.isnan()) and torch.equal(inv[~inv.isnan()], ref_inv[~ref_inv.isnan()])
        assert bytes_equal(q, quantize(xp, ref_inv, fmt))
        again, _, none = tc.cast_rows(x, fmt, margin, pad_rows=ALIGN, pad_cols=ALIGN, inv=inv)
        assert none is None and bytes_equal(again, q)
        # The backward's per-tensor scale from the row amaxes: NaN, as amax(x) is.
        assert same_scale(tc.finalize_scales(row_amax, fmt), inverse_scale(amax(x), fmt))
    finite = x.nan_to_num()
    _, _, row_amax = tc.cast_rows(finite.t(), fmt)  # a transposed view: strided rows
    assert torch.equal(tc.finalize_scales(row_amax, fmt), inverse_scale(amax(finite), fmt))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_cast_matches_the_input_quantizer_step_by_step(tc, dtype, reduction):
    """Each step: the scale, both copies and the history equal `TensorDelayedQuantizer.inverse_scale`
    then `quantize`; the first step (no history), a zero tensor (recorded as "not seen"), an
    infinite value (NaN scale, recorded as 0), a step that does not record."""
    scaling = Scaling(mode="delayed", history_len=3, reduction=reduction, margin=1)
    reference = quantizer(OperandRole.INPUT, Format.FP8_E4M3, scaling)
    fused = quantizer(OperandRole.INPUT, Format.FP8_E4M3, scaling)
    assert isinstance(reference, TensorDelayedQuantizer) and isinstance(fused, TensorDelayedQuantizer)
    reference.history, fused.history = reference.history.to(DEVICE), fused.history.to(DEVICE)
    steps = [special_values((37, 45), dtype, seed=s) for s in range(3)]
    steps.insert(1, torch.zeros(37, 45, dtype=dtype, device=DEVICE))
    poisoned = steps[2].clone()
    poisoned[4, 4] = float("inf")
    steps += [poisoned, steps[0] * 8, steps[2] / 1000]
    for i, x in enumerate(steps):
        record = i != len(steps) - 2
        ref_inv = reference.inverse_scale(x, record=record)
        ref_q, ref_qt = reference_copies(x, ref_inv, Format.FP8_E4M3, 1, ALIGN, ALIGN)
        inv, q, qt = tc.cast_delayed(x, fused.history, Format.FP8_E4M3, scaling.margin, reduction == "most_recent", record,
                                     pad_cols=ALIGN, transposed=True, t_rows=ALIGN)
        assert same_scale(inv, ref_inv), i
        assert bytes_equal(q, ref_q) and bytes_equal(qt, ref_qt), i
        assert torch.equal(fused.history, reference.history), i


@needs_kernels
def test_a_bf16_operand_is_divided_in_fp32_by_the_fp32_scale(tc):
    """As `formats.quantize` divides: one rounding, to FP8. Eager PyTorch's own BF16-by-0-d
    division would round the quotient to BF16 first (and, on CUDA, the scale)."""
    x = special_values((67, 131), torch.bfloat16, seed=5)
    inv = torch.tensor(0.37123, device=DEVICE)
    q, _ = tc.cast(x, inv, Format.FP8_E4M3)
    assert bytes_equal(q, quantize(x, inv, Format.FP8_E4M3))
    assert bytes_equal(q, (x.float() / inv).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert not bytes_equal(q, (x / inv).clamp(-448, 448).to(torch.float8_e4m3fn))  # the double rounding differs here


def _run_roundings(y: torch.Tensor, which: int) -> torch.Tensor:
    y = y.to(DEVICE)
    out = torch.empty(y.numel(), dtype=torch.int32, device=DEVICE)
    block = 4096
    _roundings[(-(-y.numel() // block),)](y, out, y.numel(), WHICH=which, BLOCK=block)
    return out


@needs_kernels
def test_integer_roundings_match_torchs_conversions(tc):
    """The roundings the interpreter runs (both FP8 formats) on every BF16 value, random FP32 bit
    patterns, BF16 ties and the FP8 formats' own ties, against torch's casts on this device."""
    every_bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    random_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    random = random_bits.to(torch.int32).view(torch.float32)
    ties = ((random_bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)  # BF16 ties
    y = torch.cat([every_bf16, random, ties]).to(DEVICE)
    for which, fmt in ((1, Format.FP8_E4M3), (2, Format.FP8_E5M2)):
        codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
        grid = codes[codes.isfinite()].unique()
        midpoints = (grid[1:] + grid[:-1]) / 2  # exact in FP32: FP8 ties, half to each side of even
        values = torch.cat([y.clamp(-fmt.max, fmt.max), midpoints.to(DEVICE)])
        ours = _run_roundings(values, which).to(torch.uint8).view(fmt.dtype)
        assert bytes_equal(ours, values.to(fmt.dtype)), fmt


# -- the runtime on the fused path (CPU: the interpreted kernels, forced) ------------------------


@pytest.fixture
def fused_path(tc, monkeypatch):
    """Runtimes made inside take the fused casts (`triton_env.force_fused_casts`)."""
    return force_fused_casts(monkeypatch)


def _layer_steps(runtime, layer, x, grad, steps=2):
    outs = []
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with runtime:
            out = layer(xi)
        out.backward(grad.to(out.dtype))
        outs.append((out.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    return outs


LAYER_CASES = {
    "e4m3-current": (Format.FP8_E4M3, Scaling(), torch.float32),
    "e4m3-delayed-bf16in": (Format.FP8_E4M3, Scaling(mode="delayed"), torch.bfloat16),
    "e5m2-delayed": (Format.FP8_E5M2, Scaling(mode="delayed", reduction="most_recent"), torch.float32),
    "e5m2-current-bf16in": (Format.FP8_E5M2, Scaling(margin=1), torch.bfloat16),
}


@needs_kernels
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_fused_fp8_layer_forward_backward_equals_pytorch_ops_bit_for_bit(fused_path, case):
    fmt, scaling, in_dtype = LAYER_CASES[case]
    torch.manual_seed(0)
    base = nn.Linear(131, 67).to(DEVICE)
    x, grad = torch.randn(37, 131, device=DEVICE).to(in_dtype), torch.randn(37, 67, device=DEVICE)
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    ref_runtime = ap.apply_plan(plain, ap.Plan.uniform(plain, fmt, scaling=scaling))
    ref_runtime.use_fused_casts(False)
    fused_runtime = ap.apply_plan(fused, ap.Plan.uniform(fused, fmt, scaling=scaling))
    with CudaRules() as rules:  # the fused copies' layouts are what cuBLASLt takes
        ref = _layer_steps(ref_runtime, plain, x, grad)
        got = _layer_steps(fused_runtime, fused, x, grad)
    assert not rules.violations
    assert ref_runtime.report()[""]["casts"] == PYTORCH and fused_runtime.report()[""]["casts"] == FUSED
    for ref_step, got_step in zip(ref, got):
        for r, g in zip(ref_step, got_step):
            assert torch.equal(r, g)


def _stand_in_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, **_):
    """``_scaled_mm`` for any scale shape, computed from the FP8 operands (deterministic)."""
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    return (out if bias is None else out + bias.float()).to(out_dtype or torch.float32)


@needs_kernels
@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the real row-wise GEMM runs: tests/runtime/test_runtime_gpu.py's e4m3-row case")
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
def test_row_wise_fused_layer_equals_pytorch_ops_through_a_stand_in_gemm(fused_path, monkeypatch, in_dtype):
    """torch 2.11's CPU ``_scaled_mm`` refuses row-wise scales: a stand-in GEMM takes them, so the
    row-wise plumbing (row scales forward, the per-tensor transposed copy for the backward) runs."""
    monkeypatch.setattr("autoprec.runtime.layers.row_scale_form", lambda fmt, out_dtype, device: (True, "stand-in"))
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in_scaled_mm)
    torch.manual_seed(0)
    base = nn.Linear(131, 67)
    x, grad = torch.randn(37, 131).to(in_dtype), torch.randn(37, 67)
    results = []
    for fused in (False, True):
        layer = copy.deepcopy(base)
        runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3", scaling=Scaling(granularity="row")))
        runtime.use_fused_casts(fused)
        results.append(_layer_steps(runtime, layer, x, grad))
        assert runtime.report()[""] == {"format": "fp8_e4m3", "ops": {"linear": "kernel torch._scaled_mm"}, "casts": FUSED if fused else PYTORCH}
    for ref_step, got_step in zip(*results):
        for r, g in zip(ref_step, got_step):
            assert torch.equal(r, g)


@needs_kernels
def test_use_fused_casts_false_runs_pytorch_ops_and_says_so(fused_path, tc):
    layer = nn.Linear(32, 16).to(DEVICE)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    x, grad = torch.randn(8, 32, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    runtime.use_fused_casts(False)
    before = tc.launches.count
    _layer_steps(runtime, layer, x, grad, steps=1)
    assert tc.launches.count == before and runtime.report()[""]["casts"] == PYTORCH
    runtime.use_fused_casts(True)
    _layer_steps(runtime, layer, x, grad, steps=1)
    assert tc.launches.count > before and runtime.report()[""]["casts"] == FUSED


@needs_kernels
def test_an_operand_dtype_the_kernels_do_not_take_keeps_pytorch_ops(fused_path, tc):
    assert call_casts(fused_path, torch.float32, torch.bfloat16) is fused_path
    assert call_casts(fused_path, torch.float16) is None and call_casts(None, torch.float32) is None
    layer = nn.Linear(32, 16).to(DEVICE)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3"))
    before = tc.launches.count
    _layer_steps(runtime, layer, torch.randn(8, 32, device=DEVICE, dtype=torch.float16), torch.randn(8, 16, device=DEVICE), steps=1)
    # The FP32 weight and the region's BF16 gradient take three each; the FP16 input keeps the ops.
    assert tc.launches.count - before == 6
    assert runtime.report()[""]["casts"] == f"{FUSED} (weight, gradient); {PYTORCH} (input)"


# Allocation, view and metadata ops launch no kernel.
_NO_KERNEL = ("empty", "view", "t.", "transpose", "expand", "slice", "alias", "detach", "as_strided", "_unsafe_view", "unsqueeze", "squeeze", "reshape")


def _kernel_ops(counts) -> dict:
    return {op: n for op, n in counts.items() if not any(op.startswith(f"aten.{name}") for name in _NO_KERNEL)}


@needs_kernels
@pytest.mark.parametrize("mode", ["current", "delayed"])
def test_a_fused_step_launches_three_kernels_per_operand(fused_path, tc, mode):
    """Per training step of an FP8 linear: three launches each for the weight, the input and the
    output gradient, and no PyTorch op on the cast path: the three GEMMs, the bias's cast to the
    kernel's dtype and its gradient are the only aten kernels left."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32).to(DEVICE)
    runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3", scaling=Scaling(mode=mode)))
    x, grad = torch.randn(48, 64, device=DEVICE), torch.randn(48, 32, device=DEVICE)
    _layer_steps(runtime, layer, x, grad, steps=2)  # warm: delayed scaling has a history
    layer.zero_grad(set_to_none=True)
    xi, g = x.clone().requires_grad_(True), grad.to(torch.bfloat16)
    before = tc.launches.count
    with OpCounter() as counter:
        with runtime:
            out = layer(xi)
        out.backward(g)
    assert tc.launches.count - before == 9
    assert _kernel_ops(counter.counts().ops) == {"aten._scaled_mm.default": 3, "aten._to_copy.default": 1, "aten.sum.dim_IntList": 1}


@needs_kernels
def test_recomputed_blocks_cast_with_the_forwards_scales_and_record_once(fused_path):
    """A checkpointed block's backward replays its forward's delayed scales: the fused path casts
    with them (no second history entry) and the gradients equal the PyTorch path's without
    recomputation, bit for bit."""
    import warnings

    from autoprec.workloads.bytelm import ByteLM, LMConfig

    config = LMConfig(context=8, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (2, 8), generator=g).to(DEVICE), torch.randint(0, 256, (2, 8), generator=g).to(DEVICE)) for _ in range(2)]

    def train(fused, blocks):
        torch.manual_seed(0)
        model = ByteLM(config).to(DEVICE)
        plan = ap.Plan.uniform(model, "fp8_e4m3", scaling=Scaling(mode="delayed")).with_recompute(blocks)
        runtime = ap.apply_plan(model, plan)
        runtime.use_fused_casts(fused)
        grads = []
        for idx, tgt in batches:
            model.zero_grad(set_to_none=True)
            with runtime:
                loss = model(idx, tgt)[1]
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads, runtime

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        fused_grads, fused_runtime = train(True, ["blocks.0"])
        plain_grads, plain_runtime = train(False, [])
    assert fused_runtime.report()["blocks.0.mlp.fc"]["casts"] == FUSED
    for a, b in zip(fused_grads, plain_grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    history = fused_runtime.state_dict()["layers"]["blocks.0.mlp.fc"]["inputs"]["blocks.0.mlp.fc.weight"]["history"]
    assert int((history > 0).sum()) == len(batches)  # one amax per step, not two
    assert torch.equal(history, plain_runtime.state_dict()["layers"]["blocks.0.mlp.fc"]["inputs"]["blocks.0.mlp.fc.weight"]["history"])


@needs_kernels
def test_compiled_step_keeps_pytorch_ops_with_one_graph_and_no_break(fused_path, tc):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(DEVICE)
    runtime = ap.apply_plan(mlp, ap.Plan.uniform(mlp, "fp8_e4m3", scaling=Scaling(mode="delayed")))
    before = tc.launches.count
    with runtime:
        breaks = graph_breaks(lambda inp: mlp(inp).sum(), torch.randn(8, 32, device=DEVICE))
    assert (breaks.graphs, breaks.breaks) == (1, 0) and tc.launches.count == before


@needs_kernels
def test_hardware_branch_compiles_for_hopper():
    """Every kernel variant the runtime launches compiles for sm_90 (Triton needs no GPU for it),
    with IEEE division and the hardware's round-to-nearest-even FP8 and BF16 conversions, the
    block casts' (`triton_block_cast`) included."""
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok"] * 8, done.stdout


_COMPILE_CHECK = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from autoprec.runtime import triton_cast as tc

def ptx(fn, sig, const):
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

cast = dict(x_ptr="*bf16", M="i32", K="i32", sxm="i32", sxk="i32", MQ="i32", KQ="i32", MT="i32", q_ptr="*u8",
            qt_ptr="*u8", inv_ptr="*fp32", inv_t_ptr="*fp32", hist_ptr="*fp32", H="i32", c="fp32", part_ptr="*fp32",
            flag_ptr="*i32")
two = dict(ROW=True, TRANS=True, SAME=False, MAX_R=57344.0, E5M2_R=True, MAX_T=448.0, E5M2_T=False, SOFT=False,
           DELAYED=False, MOST_RECENT=False, HP=1, GATED=False, BM=tc._TILE, BK=tc._TILE)
text = ptx(tc._cast_kernel, cast, two)
need = ("div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32")
print("ok" if all(n in text for n in need) and "div.full" not in text else "cast " + str([n for n in need if n not in text]))
text = ptx(tc._cast_kernel, {**cast, "x_ptr": "*fp32"}, {**two, "SAME": True, "DELAYED": True, "HP": 16})
print("ok" if "div.rn.f32" in text else "delayed")
text = ptx(tc._cast_kernel, cast, {**two, "SAME": True, "GATED": True})
print("ok" if "div.rn.f32" in text else "gated")
ptx(tc._amax_kernel, dict(x_ptr="*bf16", M="i32", K="i32", sxm="i32", sxk="i32", part_ptr="*fp32"), dict(BM=tc._TILE, BK=tc._TILE))
print("ok")

from autoprec.runtime import triton_block_cast as tb
block_need = ("div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32")
tile = dict(x_ptr="*bf16", R="i32", C="i32", sxr="i32", sxc="i32", CQ="i32", CT="i32", RT="i32", NC="i32",
            q_ptr="*u8", inv_ptr="*fp32", qt_ptr="*u8", inv_t_ptr="*fp32", c="fp32")
text = ptx(tb._tile_kernel, tile, dict(ROW=True, TRANS=True, MAXV=448.0, SOFT=False, B=tb.TILE))
print("ok" if all(n in text for n in block_need) and "div.full" not in text else "tile")
block = dict(w_ptr="*fp32", N="i32", K="i32", swn="i32", swk="i32", NQ="i32", KQ="i32", q_ptr="*u8",
             grid_ptr="*fp32", qt_ptr="*u8", c="fp32")
text = ptx(tb._block_kernel, block, dict(TRANS=True, MAXV=448.0, SOFT=False, B=tb.TILE))
print("ok" if all(n in text for n in block_need) and "div.full" not in text else "block")
fin = dict(part_ptr="*fp32", n="i32", inv_ptr="*fp32", c="fp32", inv2_ptr="*fp32", c2="fp32", hist_ptr="*fp32", H="i32", flag_ptr="*i32")
text = ptx(tc._finalize_kernel, fin, dict(TWO=False, DELAYED=True, MOST_RECENT=False, RECORD=True, HP=16, BLOCK=1024, ITERS=2))
print("ok" if "bar.sync" in text else "no barrier before the history shift")
rows = dict(x_ptr="*fp32", M="i32", K="i32", sxm="i32", sxk="i32", MQ="i32", KQ="i32", q_ptr="*u8", inv_ptr="*fp32", amax_ptr="*fp32", c="fp32")
text = ptx(tc._rows_kernel, rows, dict(HAS_SCALE=False, MAXV=448.0, E5M2=False, SOFT=False, BM=8, BK=512, ITERS=3))
print("ok" if "cvt.rn.satfinite.e4m3x2.f32" in text else "rows")
"""
