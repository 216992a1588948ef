"""The fused fine-grained E4M3 casts (`autoprec.runtime.triton_block_cast`) against
`block_gemm.tile_cast` / `block_gemm.block_cast`, bit for bit.

As in test_triton_cast.py: without CUDA the kernels run on CPU tensors under Triton's interpreter
(tests/conftest.py sets ``TRITON_INTERPRET=1`` before triton is imported), with CUDA compiled on
CUDA tensors, each against its own device's reference; the module skips where Triton cannot run.
The hardware branch is compiled for sm_90 by test_triton_cast.py's check, with the other kernels.
Shapes stay small: the interpreter runs NumPy per program.
"""

from __future__ import annotations


import pytest
import torch

from autoprec.runtime import block_gemm
from support.triton_env import DEVICE, NO_KERNELS, NUMPY_WARNINGS, force_fused_casts, needs_kernels

pytestmark = [*NUMPY_WARNINGS, pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
if NO_KERNELS is None:
    from autoprec.runtime import triton_block_cast, triton_cast

DTYPES = [torch.float32, torch.bfloat16]
# Aligned, then unaligned in rows, columns or both (a single row, a partial tile on each side).
SHAPES = [(256, 256), (130, 200), (1, 300), (257, 129), (5, 17)]


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype, same E4M3 bytes, NaN where NaN (a NaN's sign bit is each device's own)."""
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_contiguous():
        return False
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


def same_scales(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same FP32 scales (NaN where NaN) with the same shape and strides."""
    if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def operand(shape, dtype, transposed=False, seed=0) -> torch.Tensor:
    """(R, C) data spanning many binades (some quantize to E4M3 subnormals or zero against their
    tile's amax), zeros of both signs; ``transposed``: the (R, C) view of a contiguous (C, R)."""
    g = torch.Generator().manual_seed(seed)
    r, c = shape
    full = (c, r) if transposed else (r, c)
    x = torch.randn(*full, generator=g) * torch.exp2(torch.randint(-12, 12, full, generator=g).float())
    flat = x.view(-1)
    flat[:2] = torch.tensor([0.0, -0.0])[: flat.numel()]
    x = x.to(dtype).to(DEVICE)
    return x.t() if transposed else x


def check_tiles(x: torch.Tensor, margin: int = 0, t_rows_to: int = 1, row: bool = True, transposed: bool = True):
    """One `tile_casts` call (one launch) against the reference's two `tile_cast` calls."""
    before = triton_cast.launches.count
    q, inv, q_t, inv_t = triton_block_cast.tile_casts(x, margin, row=row, transposed=transposed, t_rows_to=t_rows_to)
    assert triton_cast.launches.count - before == 1
    if row:
        assert q is not None and inv is not None
        ref_q, ref_inv = block_gemm.tile_cast(x, margin)
        assert bytes_equal(q, ref_q) and same_scales(inv, ref_inv)
    else:
        assert q is None and inv is None
    if transposed:
        assert q_t is not None and inv_t is not None
        ref_qt, ref_inv_t = block_gemm.tile_cast(x.t(), margin, rows_to=t_rows_to)
        assert bytes_equal(q_t, ref_qt) and same_scales(inv_t, ref_inv_t)
    else:
        assert q_t is None and inv_t is None
    return q, inv, q_t, inv_t


def check_blocks(w: torch.Tensor, transposed: bool = True):
    """One `block_casts` call (one launch) against `block_cast` and its transposed contiguous copy."""
    before = triton_cast.launches.count
    q, grid, q_t = triton_block_cast.block_casts(w, transposed=transposed)
    assert triton_cast.launches.count - before == 1
    ref_q, ref_grid = block_gemm.block_cast(w)
    assert bytes_equal(q, ref_q) and same_scales(grid, ref_grid)
    if transposed:
        assert q_t is not None and bytes_equal(q_t, ref_q.t().contiguous())
    else:
        assert q_t is None
    return q, grid, q_t


@needs_kernels
@pytest.mark.parametrize("transposed_input", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_both_copies_and_blocks_match_the_reference(shape, dtype, transposed_input):
    x = operand(shape, dtype, transposed_input)
    assert x.is_contiguous() != transposed_input or 1 in shape
    for margin, t_rows_to in ((0, 1), (2, 128)):  # an output gradient's layout, then an input's
        check_tiles(x, margin, t_rows_to)
    check_blocks(x)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transposed_padding_rows_past_a_tile_have_the_zero_tiles_scale(dtype):
    """C'' above C' (``t_rows_to`` 256 on 17 columns): the programs past the row copy's columns
    write the transposed copy's zero rows and their all-zero-tile scale (1e-12 * 2**m / 448)."""
    x = operand((5, 17), dtype, seed=1)
    _, _, q_t, inv_t = check_tiles(x, 1, t_rows_to=256)
    assert q_t is not None and inv_t is not None and q_t.shape == (256, 128)
    assert not q_t[17:].view(torch.uint8).any()
    assert torch.equal(inv_t[17:], torch.full_like(inv_t[17:], 1e-12) * (2.0 / 448.0))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outlier_channels_scale_only_their_own_tiles(dtype):
    """A few columns 100x the rest: the row copy's tiles holding them are coarse, while in the
    transposed copy only those columns' rows are (each column of x has its own scales there)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(130, 260, generator=g)
    x[:, [3, 140, 259]] *= 100.0
    x = x.to(dtype).to(DEVICE)
    _, inv, _, inv_t = check_tiles(x, 0, t_rows_to=128)
    check_blocks(x)
    assert inv is not None and inv_t is not None
    assert bool(inv_t[[3, 140, 259]].min() > 20 * inv_t[[4, 141, 258]].max())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zero_operand(dtype):
    x = torch.zeros(130, 140, dtype=dtype, device=DEVICE)
    x[7, 9] = -0.0
    q, inv, q_t, inv_t = check_tiles(x, 0, t_rows_to=128)
    q_b, grid, _ = check_blocks(x)
    floor = torch.tensor(1e-12) * (1 / 448.0)
    for s in (inv, inv_t, grid):
        assert s is not None and bool((s.cpu() == floor).all())


@needs_kernels
@pytest.mark.parametrize("transposed_input", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inf_and_nan_tiles_propagate_as_the_reference(dtype, transposed_input):
    """NaN gives its row / column / block a NaN scale (``vector_norm(ord=inf)`` propagates it) and
    every byte made with it NaN, padding included; inf gives an inf scale: zeros, NaN at the inf."""
    x = operand((140, 200), dtype, transposed_input, seed=3)
    x[5, 7] = float("nan")
    x[6, 150] = float("inf")
    x[135, 3] = -float("inf")
    x[139, 199] = float("nan")  # in the partial tiles: NaN spreads into the padding
    q, inv, q_t, inv_t = check_tiles(x, 0, t_rows_to=128)
    check_blocks(x)
    assert inv is not None and bool(inv[5, 0].isnan()) and bool(inv[6, 1].isinf())
    assert q is not None and bool(q[139, 255].float().isnan())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_either_copy_alone_and_weights_without_the_transposed_copy(dtype):
    x = operand((130, 200), dtype, True, seed=4)
    check_tiles(x, 2, row=True, transposed=False)
    check_tiles(x, 2, t_rows_to=128, row=False, transposed=True)
    check_blocks(x, transposed=False)
    before = triton_cast.launches.count
    assert triton_block_cast.tile_casts(x, row=False, transposed=False) == (None, None, None, None)
    assert triton_cast.launches.count == before


@needs_kernels
def test_empty_operands_launch_nothing_and_have_the_references_shapes():
    before = triton_cast.launches.count
    for shape in ((0, 8), (8, 0)):
        x = torch.zeros(shape, device=DEVICE)
        q, inv, q_t, inv_t = triton_block_cast.tile_casts(x, t_rows_to=128)
        ref = block_gemm.tile_cast(x) + block_gemm.tile_cast(x.t(), rows_to=128)
        assert [t.shape for t in (q, inv, q_t, inv_t)] == [t.shape for t in ref]
        q_b, grid, _ = triton_block_cast.block_casts(x)
        assert [q_b.shape, grid.shape] == [t.shape for t in block_gemm.block_cast(x)]
    assert triton_cast.launches.count == before


@needs_kernels
def test_fused_casts_entry_points_delegate():
    fused = triton_cast.FusedCasts(DEVICE)
    x = operand((5, 17), torch.bfloat16, seed=5)
    q, inv, q_t, inv_t = fused.tile_casts(x, 1, transposed=True, t_rows_to=128)
    ref_q, ref_inv = block_gemm.tile_cast(x, 1)
    ref_qt, ref_inv_t = block_gemm.tile_cast(x.t(), 1, rows_to=128)
    assert bytes_equal(q, ref_q) and same_scales(inv, ref_inv) and bytes_equal(q_t, ref_qt) and same_scales(inv_t, ref_inv_t)
    q_b, grid, q_bt = fused.block_casts(x, transposed=False)
    ref_qb, ref_grid = block_gemm.block_cast(x)
    assert bytes_equal(q_b, ref_qb) and same_scales(grid, ref_grid) and q_bt is None


@needs_kernels
def test_wrong_operands_are_refused():
    with pytest.raises(ValueError):
        triton_block_cast.tile_casts(torch.zeros(4, 4, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError):
        triton_block_cast.block_casts(torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError):
        triton_block_cast.tile_casts(torch.zeros(4, 4, device=DEVICE), t_rows_to=0)


# -- the block-scaled layer on the fused path (CPU: interpreted kernels and the reference GEMM) ---


@needs_kernels
@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the real block-scaled GEMM runs (tests/runtime/test_runtime_gpu.py)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_block_scaled_layer_on_fused_casts_equals_pytorch_ops_bit_for_bit(monkeypatch, dtype):
    """Forward, input and weight gradient of an unaligned block-scaled layer, twice each way: the
    fused casts (one launch per operand: x, g, W) give the same bits as the PyTorch ops, and every
    call is legal on CUDA."""
    import copy

    import torch.nn as nn

    import autoprec as ap
    from autoprec.device import block_scaled_form
    from autoprec.runtime.casts import FUSED, PYTORCH
    from support.block_kernel import reference_block_kernel
    from support.cuda_rules import CudaRules

    force_fused_casts(monkeypatch)
    torch.manual_seed(0)
    base = nn.Linear(200, 72)
    x, grad = torch.randn(130, 200).to(dtype), torch.randn(130, 72)
    results, launched = [], []
    with reference_block_kernel():
        assert block_scaled_form("cpu")[0]  # probed here, outside the rules' count
        with CudaRules() as rules:
            for fused in (False, True):
                layer = copy.deepcopy(base)
                runtime = ap.apply_plan(layer, ap.Plan.uniform(layer, "fp8_e4m3", scaling=ap.Scaling(granularity="block")))
                runtime.use_fused_casts(fused)
                before = triton_cast.launches.count
                steps = []
                for _ in range(2):
                    layer.zero_grad(set_to_none=True)
                    xi = x.clone().requires_grad_(True)
                    with runtime:
                        out = layer(xi)
                    out.backward(grad.to(out.dtype))
                    steps.append((out.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
                launched.append(triton_cast.launches.count - before)
                results.append(steps)
                assert runtime.report()[""]["casts"] == (FUSED if fused else PYTORCH)
    assert rules.counts["_scaled_mm_v2"] == 12 and not rules.violations
    assert launched == [0, 6]  # per step: x (both tilings), W (blocks and transposed copy), g (both)
    for ref_step, got_step in zip(*results):
        for r, g in zip(ref_step, got_step):
            assert torch.equal(r, g)
