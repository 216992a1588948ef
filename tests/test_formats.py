"""Tests for autoprec.formats: format numbers, amax, inverse scales, the saturating cast, SQNR.

References are plain PyTorch (torch's own dtype casts, loops over rows and blocks) or Python's
own arithmetic, never values copied from autoprec's output. SQNR floors sit a little below the
figures measured on this machine (noted next to each floor); the data are seeded, so a drop below
a floor means the numerics changed.
"""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.errors import AutoprecError, FormatError
from autoprec.formats import (
    ACTIVATION_BLOCK,
    WEIGHT_BLOCK,
    Format,
    amax,
    block_amax,
    dequantize,
    expand_blocks,
    inverse_scale,
    quantize,
    sqnr,
)
from support.torch_versions import saturating_cast

FLOAT_FORMATS = [Format.FP32, Format.BF16, Format.FP16, Format.FP8_E4M3, Format.FP8_E5M2]
FP8_FORMATS = [Format.FP8_E4M3, Format.FP8_E5M2]
SCALED_FORMATS = [Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8]
UNSCALED_FORMATS = [Format.FP32, Format.BF16, Format.FP16]
ONE = torch.tensor(1.0)  # an inverse scale that leaves values as they are


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """FP32 tensors equal bit for bit (so -0 != +0), except that any NaN matches any NaN."""
    assert actual.dtype == torch.float32 and expected.dtype == torch.float32
    assert actual.shape == expected.shape
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    same_bits = actual.view(torch.int32) == expected.view(torch.int32)
    bad = ~(same_bits | both_nan)
    if bad.any():
        idx = bad.nonzero()[:5].flatten()
        raise AssertionError(
            f"{int(bad.sum())} mismatches; first inputs' results {actual.flatten()[idx].tolist()} "
            f"vs expected {expected.flatten()[idx].tolist()}"
        )


def all_values(fmt: Format) -> torch.Tensor:
    """Every bit pattern of a 8- or 16-bit float dtype, decoded to FP32 (NaNs and infs included)."""
    if fmt.bits == 8:
        patterns = torch.arange(256, dtype=torch.uint8)
    else:
        patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return patterns.view(fmt.dtype).float()


def finite_values(fmt: Format) -> torch.Tensor:
    """Sorted distinct finite values of the format, in FP64."""
    v = all_values(fmt).double()
    return torch.unique(v[torch.isfinite(v)])  # unique sorts; -0 and +0 merge


def nextafter32(x: torch.Tensor, direction: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, direction))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_saturating_cast(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """torch's own cast, then every value beyond ±max (inf included) replaced by ±max: the
    saturation applied after the fact, where `quantize` clamps before casting."""
    cast = saturating_cast(x, fmt.dtype).float()
    return torch.where(x.abs() > fmt.max, torch.copysign(torch.full_like(x, fmt.max), x), cast)


# ---------------------------------------------------------------------------------------------
# 1. format numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_float_format_max_matches_finfo(fmt):
    assert fmt.max == float(torch.finfo(fmt.dtype).max)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_float_format_min_normal_matches_finfo(fmt):
    assert fmt.min_normal == float(torch.finfo(fmt.dtype).smallest_normal)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS + [Format.INT8], ids=str)
def test_bits_and_bytes_match_dtype(fmt):
    itemsize = torch.empty((), dtype=fmt.dtype).element_size()
    assert (fmt.bits, fmt.bytes) == (8 * itemsize, itemsize)


@pytest.mark.parametrize(
    "fmt, expected",
    [
        (Format.FP8_E4M3, 448.0),
        (Format.FP8_E5M2, 57344.0),
        (Format.FP16, 65504.0),
        (Format.BF16, (2 - 2**-7) * 2.0**127),
        (Format.INT8, 127.0),
    ],
    ids=str,
)
def test_known_max_constants(fmt, expected):
    assert fmt.max == expected


def test_int8_max_is_symmetric_iinfo_max():
    assert Format.INT8.max == torch.iinfo(torch.int8).max == -(torch.iinfo(torch.int8).min + 1)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_min_subnormal_is_the_smallest_positive_bit_pattern(fmt):
    # Bit pattern 0...01 is the smallest positive value of any IEEE-like float dtype.
    int_dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[fmt.bits]
    smallest = torch.ones(1, dtype=int_dtype).view(fmt.dtype)
    assert fmt.min_subnormal == smallest.double().item()


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_min_subnormal_survives_a_cast(fmt):
    x = torch.tensor([fmt.min_subnormal, -fmt.min_subnormal], dtype=torch.float64)
    assert x.to(fmt.dtype).double().tolist() == x.tolist()


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=str)
def test_half_min_subnormal_ties_to_zero_and_just_above_rounds_up(fmt):
    # Halfway between 0 and min_subnormal: round to nearest even picks 0 (even mantissa). The
    # source is FP32 (FP64 for FP32 itself) so it holds both the tie and the value just above.
    src = torch.float64 if fmt is Format.FP32 else torch.float32
    half = torch.tensor(fmt.min_subnormal / 2, dtype=src)
    above = torch.nextafter(half, torch.tensor(1.0, dtype=src))
    assert (half.to(fmt.dtype).item(), above.to(fmt.dtype).item()) == (0.0, fmt.min_subnormal)


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_fp8_and_int8_need_a_scale(fmt):
    assert fmt.needs_scale


@pytest.mark.parametrize("fmt", UNSCALED_FORMATS, ids=str)
def test_wide_formats_need_no_scale(fmt):
    assert not fmt.needs_scale


@pytest.mark.parametrize(
    "text, expected",
    [("FP8_E4M3", Format.FP8_E4M3), ("Bf16", Format.BF16), ("  fp16 ", Format.FP16), ("INT8", Format.INT8)],
)
def test_parse_is_case_insensitive(text, expected):
    assert Format.parse(text) is expected


def test_parse_passes_a_format_through():
    assert Format.parse(Format.FP8_E5M2) is Format.FP8_E5M2


@pytest.mark.parametrize("junk", ["fp7", "", "e4m3", 8, None])
def test_parse_junk_raises_format_error_listing_valid_names(junk):
    with pytest.raises(FormatError) as excinfo:
        Format.parse(junk)
    message = str(excinfo.value)
    assert repr(junk) in message
    assert all(f.value in message for f in Format)


def test_format_error_is_a_value_error_and_an_autoprec_error():
    with pytest.raises(FormatError) as excinfo:
        Format.parse("nope")
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, AutoprecError)


@pytest.mark.parametrize("fmt", list(Format), ids=str)
def test_format_compares_equal_to_its_string(fmt):
    assert fmt == fmt.value and str(fmt) == fmt.value and {fmt.value: 1}[fmt] == 1


# ---------------------------------------------------------------------------------------------
# 2. the saturating FP8 cast against torch's own casts
# ---------------------------------------------------------------------------------------------
# The reference is torch's cast, saturating for E4M3: torch 2.13's CPU cast saturates, 2.11's
# gives NaN past 448 and is given a clamped input instead (tests/support/torch_versions.py).


@pytest.fixture(scope="module")
def random_bit_patterns() -> torch.Tensor:
    # 2**20 uniformly random FP32 bit patterns: every exponent, subnormals, infs and NaNs.
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32)
    return bits.view(torch.float32)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_quantize_matches_the_saturated_cast_on_random_bit_patterns(fmt, random_bit_patterns):
    x = random_bit_patterns
    assert_bitwise_equal(quantize(x, ONE, fmt).float(), reference_saturating_cast(x, fmt))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_quantize_matches_the_cast_on_exact_ties_and_their_neighbours(fmt):
    v = finite_values(fmt)  # includes subnormals and both signs
    mid64 = (v[:-1] + v[1:]) / 2
    mid = mid64.float()
    assert torch.equal(mid.double(), mid64)  # the halfway points are exact in FP32
    x = torch.cat([mid, nextafter32(mid, math.inf), nextafter32(mid, -math.inf)])
    assert_bitwise_equal(quantize(x, ONE, fmt).float(), reference_saturating_cast(x, fmt))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_quantize_is_identity_on_every_finite_value(fmt):
    v = all_values(fmt)
    v = v[torch.isfinite(v)]
    assert_bitwise_equal(quantize(v, ONE, fmt).float(), v)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_quantize_fp8_divides_by_the_inverse_scale_bitwise(fmt):
    x = randn(64, 96) * 30
    inv = torch.tensor(0.27)
    expected = saturating_cast(x / inv, fmt.dtype)
    assert torch.equal(quantize(x, inv, fmt).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fmt", [*FP8_FORMATS, Format.INT8], ids=str)
def test_a_half_tensor_is_divided_in_fp32_not_rounded_to_half_first(fmt):
    # A BF16 tensor over a 0-d FP32 scale stays BF16 under type promotion: rounded to BF16, then to
    # the format, about 1 in 40 values near a tie moved (a BF16 gradient in E4M3). The fused kernels
    # and Transformer Engine divide in FP32.
    x = (randn(256, 256) * 3).bfloat16()
    inv = x.float().abs().amax() * (1.0 / fmt.max)
    got, expected = quantize(x, inv, fmt), quantize(x.float(), inv, fmt)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    twice = (x / inv).clamp(-fmt.max, fmt.max)  # what the old code computed: a BF16 quotient
    twice = torch.round(twice).to(torch.int8) if fmt is Format.INT8 else twice.to(fmt.dtype)
    assert not torch.equal(twice.view(torch.uint8), expected.view(torch.uint8))  # the case is one that tells


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_quantize_fp8_with_row_scales_is_the_scaled_cast_bitwise(fmt):
    x = randn(64, 96) * 30
    inv = torch.rand(64, 1, generator=torch.Generator().manual_seed(3)) + 0.1
    expected = saturating_cast(x / inv, fmt.dtype)
    got = quantize(x, inv, fmt)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_quantize_e4m3_saturates_to_448():
    x = torch.tensor([448.0, 465.0, 1e6, math.inf, -500.0, -math.inf])
    assert quantize(x, ONE, Format.FP8_E4M3).float().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]


def test_quantize_e4m3_keeps_nan():
    assert torch.isnan(quantize(torch.tensor([math.nan]), ONE, Format.FP8_E4M3).float()).all()


def test_quantize_e5m2_saturates_instead_of_overflowing_to_inf():
    # 61440 is halfway between 57344 (odd mantissa) and 65536: a plain cast rounds it to inf.
    x = torch.tensor([61440.0, 1e6, math.inf, -61440.0, -math.inf])
    assert x.to(torch.float8_e5m2).float().isinf().all()
    q = quantize(x, ONE, Format.FP8_E5M2).float()
    assert q.tolist() == [57344.0, 57344.0, 57344.0, -57344.0, -57344.0]


def test_quantize_e5m2_below_the_overflow_tie_stays_at_max():
    x = torch.tensor([57344.0, 61439.0, -61439.0])
    assert quantize(x, ONE, Format.FP8_E5M2).float().tolist() == [57344.0, 57344.0, -57344.0]


# ---------------------------------------------------------------------------------------------
# 3. INT8
# ---------------------------------------------------------------------------------------------


def test_int8_rounds_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5])
    assert quantize(x, ONE, Format.INT8).tolist() == [0, 2, 2, 4, 0, -2, -2, -4]


def test_int8_half_to_even_matches_python_round_on_all_halves():
    halves = [k + 0.5 for k in range(-128, 128)]
    expected = [max(-127, min(127, round(h))) for h in halves]  # Python's round is half to even
    assert quantize(torch.tensor(halves), ONE, Format.INT8).tolist() == expected


def test_int8_clamps_to_symmetric_range():
    x = torch.tensor([126.5, 127.4, 127.5, 128.0, 1e9, math.inf, -127.4, -127.5, -128.0, -128.6, -1e9, -math.inf])
    expected = [126, 127, 127, 127, 127, 127, -127, -127, -127, -127, -127, -127]
    assert quantize(x, ONE, Format.INT8).tolist() == expected


def test_int8_never_produces_minus_128():
    x = randn(4096) * 1000
    assert quantize(x, ONE, Format.INT8).min().item() == -127


def test_int8_per_row_scales_match_plain_torch():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    inv = x.abs().amax(dim=1, keepdim=True) / 127
    expected = torch.clamp(torch.round(x / inv), -127, 127).to(torch.int8)
    assert torch.equal(quantize(x, inv, Format.INT8), expected)


def test_int8_per_row_scales_put_each_row_amax_at_127():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    inv = inverse_scale(amax(x, dim=-1), Format.INT8)
    q = quantize(x, inv, Format.INT8)
    assert q.abs().amax(dim=1).tolist() == [127] * 8


def test_int8_per_row_round_trip_error_is_at_most_half_a_step():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    inv = inverse_scale(amax(x, dim=-1), Format.INT8)
    y = dequantize(quantize(x, inv, Format.INT8), inv)
    assert ((y - x).abs() <= 0.5 * inv * (1 + 1e-5)).all()


def test_dequantize_multiplies_by_the_inverse_scale_into_the_asked_dtype():
    q = torch.tensor([[-127, 3, 64]], dtype=torch.int8)
    inv = torch.tensor([[0.5]])
    assert dequantize(q, inv).tolist() == [[-63.5, 1.5, 32.0]]
    assert dequantize(q, inv, torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# 4. SQNR
# ---------------------------------------------------------------------------------------------


def test_sqnr_matches_manual_formula():
    ref = randn(1000, seed=1)
    approx = ref + 0.01 * randn(1000, seed=2)
    signal = sum(r * r for r in ref.double().tolist())
    noise = sum((r - a) ** 2 for r, a in zip(ref.double().tolist(), approx.double().tolist()))
    assert sqnr(ref, approx) == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)


def test_sqnr_of_ten_percent_relative_error_is_20_db():
    ref = randn(1000)
    assert sqnr(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-4)


def test_sqnr_of_identical_tensors_is_inf():
    x = randn(10)
    assert sqnr(x, x.clone()) == math.inf


def test_sqnr_returns_a_python_float():
    assert isinstance(sqnr(randn(10), randn(10, seed=1)), float)


# ---------------------------------------------------------------------------------------------
# 5. amax: per tensor, per row, per tile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block, expected", [
    ((130, 300), WEIGHT_BLOCK, (2, 3)),
    ((130, 300), ACTIVATION_BLOCK, (130, 3)),
    ((256, 256), WEIGHT_BLOCK, (2, 2)),
    ((1, 1), WEIGHT_BLOCK, (1, 1)),
])
def test_block_amax_shape(shape, block, expected):
    x = randn(*shape)
    assert tuple(block_amax(x, block).shape) == expected


@pytest.mark.parametrize("block", [WEIGHT_BLOCK, ACTIVATION_BLOCK, (7, 50)])
def test_block_amax_matches_loop_over_blocks(block):
    x = randn(130, 300) * torch.logspace(-3, 3, 300)
    bm, bk = block
    expected = torch.tensor([
        [x[i : i + bm, j : j + bk].abs().max().item() for j in range(0, 300, bk)]
        for i in range(0, 130, bm)
    ])
    assert torch.equal(block_amax(x, block), expected)


def test_expand_blocks_gives_each_element_its_tile_scale():
    scales = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    full = expand_blocks(scales, (130, 300), WEIGHT_BLOCK)
    expected = torch.tensor([[scales[i // 128, j // 128].item() for j in range(300)] for i in range(130)])
    assert torch.equal(full, expected)


def test_row_amax_matches_loop_and_keeps_dims():
    x = randn(4, 5, 6)
    expected = torch.tensor([[[max(abs(v) for v in x[i, j].tolist())] for j in range(5)] for i in range(4)])
    assert torch.equal(amax(x, dim=-1), expected)


def test_tensor_amax_is_a_scalar_fp32():
    x = randn(3, 7).to(torch.bfloat16)
    a = amax(x)
    assert a.shape == () and a.dtype == torch.float32 and a.item() == x.float().abs().max().item()


def test_tensor_amax_of_empty_tensor_is_zero():
    assert amax(torch.empty(0, 4)).item() == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_amax_propagates_non_finite_values(bad):
    x = randn(4, 4)
    x[1, 2] = bad
    assert not torch.isfinite(amax(x)) and not torch.isfinite(amax(x, dim=-1)[1])


def test_block_amax_rejects_3d_tensor():
    x = randn(2, 3, 4)
    with pytest.raises(FormatError, match="2-D"):
        block_amax(x, WEIGHT_BLOCK)


@pytest.mark.parametrize("block", [(0, 128), (128,), (1, 2, 3)])
def test_block_amax_rejects_bad_block(block):
    x = randn(4, 4)
    with pytest.raises(FormatError, match="block"):
        block_amax(x, block)


# ---------------------------------------------------------------------------------------------
# 6. inverse_scale: the one amax -> scale rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_inverse_scale_maps_amax_onto_max(fmt):
    # One row per amax, holding +amax and -amax; per-row scales.
    a = torch.tensor([[0.3], [1.0], [3.0], [7.77], [1e4], [1e-3]])
    x = torch.cat([a, -a], dim=1)
    q = quantize(x, inverse_scale(a, fmt), fmt).float()
    assert q.tolist() == [[fmt.max, -fmt.max]] * 6


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_inverse_scale_with_margin_targets_max_over_power_of_two(fmt, margin):
    a = torch.tensor([0.3, 1.0, 7.77, 1e4])
    inv = inverse_scale(a, fmt, margin)
    target = torch.full_like(a, fmt.max / 2**margin, dtype=torch.float64)
    assert torch.allclose((a / inv).double(), target, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_zero_amax_gives_a_finite_scale_and_a_zero_tensor_stays_zero(fmt):
    x = torch.zeros(4, 8)
    inv = inverse_scale(amax(x), fmt)
    assert torch.isfinite(inv) and inv > 0
    assert torch.equal(dequantize(quantize(x, inv, fmt), inv), x)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_non_finite_amax_poisons_the_whole_tensor(fmt, bad):
    # The loss scaler must see the overflow: no element may come back as a clamped finite value.
    x = randn(4, 8)
    x[2, 5] = bad
    inv = inverse_scale(amax(x), fmt)
    assert not torch.isfinite(inv)
    assert not torch.isfinite(dequantize(quantize(x, inv, fmt), inv)).any()


def test_inverse_scale_from_tiny_amax_is_finite_and_positive():
    a = torch.tensor([1e-45])  # smallest FP32 subnormal: 448 / a overflows FP32
    inv = inverse_scale(a, Format.FP8_E4M3)
    assert torch.isfinite(inv).all() and (inv > 0).all()
    assert torch.isfinite(quantize(a, inv, Format.FP8_E4M3).float()).all()
