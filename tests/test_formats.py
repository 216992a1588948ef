"""Tests for autoprec.formats: format numbers, bit-exact rounding, scaled quantization, SQNR.

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
    AmaxHistory,
    Format,
    Granularity,
    amax,
    dequantize,
    fake_quantize,
    quantize,
    round_to_format,
    scale_from_amax,
    sqnr,
)
from tests.torch_versions import saturating_cast

FLOAT_FORMATS = [Format.FP32, Format.BF16, Format.FP16, Format.FP8_E4M3, Format.FP8_E5M2]
ROUNDED_FLOAT_FORMATS = [Format.FP8_E4M3, Format.FP8_E5M2, Format.FP16, Format.BF16]
SCALED_FORMATS = [Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8]
UNSCALED_FORMATS = [Format.FP32, Format.BF16, Format.FP16]

# (id, granularity, block) for every way a tensor can be scaled.
GRANULARITIES = [
    ("tensor", Granularity.TENSOR, ACTIVATION_BLOCK),
    ("row", Granularity.ROW, ACTIVATION_BLOCK),
    ("block1x128", Granularity.BLOCK, ACTIVATION_BLOCK),
    ("block128x128", Granularity.BLOCK, WEIGHT_BLOCK),
]
GRANULARITY_BY_ID = {name: (g, b) for name, g, b in GRANULARITIES}


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


OUTLIER_ROWS = [3, 70, 200]


def data_randn() -> torch.Tensor:
    return randn(256, 512)


def data_outlier_rows(factor: float = 1000.0) -> torch.Tensor:
    x = randn(256, 512)
    x[OUTLIER_ROWS] *= factor
    return x


def data_outlier_block() -> torch.Tensor:
    # One 128x128 weight block 1000x larger than the rest.
    x = randn(256, 512)
    x[128:, :128] *= 1000.0
    return x


DATASETS = {"randn": data_randn, "outlier_rows": data_outlier_rows, "outlier_block": data_outlier_block}


def reference_group_amax(x: torch.Tensor, granularity: str, block=ACTIVATION_BLOCK) -> torch.Tensor:
    """Per-element amax of the element's scaling group, by explicit loops (x is 2-D)."""
    out = torch.empty_like(x)
    rows, cols = x.shape
    if granularity == "tensor":
        out.fill_(x.abs().max())
    elif granularity == "row":
        for i in range(rows):
            out[i] = x[i].abs().max()
    else:
        bm, bk = block
        for i in range(0, rows, bm):
            for j in range(0, cols, bk):
                out[i : i + bm, j : j + bk] = x[i : i + bm, j : j + bk].abs().max()
    return out


def reference_fake_quantize(x: torch.Tensor, fmt: Format, granularity: str, block=ACTIVATION_BLOCK) -> torch.Tensor:
    """Current-scaling quantize-dequantize with plain torch ops: s = max / amax, q = cast(x*s), q / s."""
    group_amax = reference_group_amax(x, granularity, block)
    scale = torch.where(group_amax > 0, fmt.max / group_amax, torch.ones_like(group_amax))
    y = x * scale
    if fmt is Format.INT8:
        q = torch.clamp(torch.round(y), -127, 127)
    else:
        q = y.to(fmt.dtype).float()
    return q / scale


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
# 2. bit exactness of round_to_format against torch's own casts
# ---------------------------------------------------------------------------------------------
# The reference is torch's cast, saturating for E4M3: torch 2.13's CPU cast saturates, 2.11's
# gives NaN past 448 and is given a clamped input instead (tests/torch_versions.py).


@pytest.fixture(scope="module")
def random_bit_patterns() -> torch.Tensor:
    # 2**20 uniformly random FP32 bit patterns: every exponent, subnormals, infs and NaNs.
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32)
    return bits.view(torch.float32)


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_matches_cast_on_random_bit_patterns(fmt, random_bit_patterns):
    x = random_bit_patterns
    assert_bitwise_equal(round_to_format(x, fmt), saturating_cast(x, fmt.dtype).float())


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_matches_cast_in_the_format_range(fmt):
    # Random bit patterns are mostly far outside an 8/16-bit range; these are inside it.
    g = torch.Generator().manual_seed(5)
    n = 1 << 18
    exponent = torch.randint(-30, 18, (n,), generator=g).float()
    x = torch.randn(n, generator=g) * torch.exp2(exponent)
    assert_bitwise_equal(round_to_format(x, fmt), saturating_cast(x, fmt.dtype).float())


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_matches_cast_on_special_values(fmt):
    f32 = torch.finfo(torch.float32)
    x = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, f32.max, -f32.max, f32.tiny, -f32.tiny,
         f32.tiny * 2**-23, -f32.tiny * 2**-23, 1.0, -1.0],
        dtype=torch.float32,
    )
    assert_bitwise_equal(round_to_format(x, fmt), saturating_cast(x, fmt.dtype).float())


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_is_identity_on_every_representable_value(fmt):
    v = all_values(fmt)
    assert_bitwise_equal(round_to_format(v, fmt), v)


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_matches_cast_on_exact_ties_and_their_neighbours(fmt):
    v = finite_values(fmt)  # includes subnormals and both signs
    mid64 = (v[:-1] + v[1:]) / 2
    mid = mid64.float()
    assert torch.equal(mid.double(), mid64)  # the halfway points are exact in FP32
    x = torch.cat([mid, nextafter32(mid, math.inf), nextafter32(mid, -math.inf)])
    assert_bitwise_equal(round_to_format(x, fmt), saturating_cast(x, fmt.dtype).float())


@pytest.mark.parametrize("fmt", ROUNDED_FLOAT_FORMATS, ids=str)
def test_round_to_format_matches_cast_beyond_max(fmt):
    v = finite_values(fmt)
    top, below_top = v[-1].item(), v[-2].item()
    ulp = top - below_top  # spacing at the top binade
    tie = torch.tensor([top + ulp / 2], dtype=torch.float32)  # exact in FP32
    pos = torch.cat([
        tie, nextafter32(tie, math.inf), nextafter32(tie, -math.inf),
        torch.tensor([top + ulp, 2 * top, 1e30 if top < 1e30 else top * 1.0001], dtype=torch.float32),
    ])
    x = torch.cat([pos, -pos])
    assert_bitwise_equal(round_to_format(x, fmt), saturating_cast(x, fmt.dtype).float())


@pytest.mark.parametrize("fmt", [Format.FP8_E4M3, Format.FP8_E5M2], ids=str)
def test_quantize_fp8_is_the_scaled_cast_bitwise(fmt):
    x = randn(64, 96) * 30
    scale = torch.tensor(3.7)
    expected = saturating_cast(x * scale, fmt.dtype)
    assert torch.equal(quantize(x, fmt, scale).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fmt", [Format.FP8_E4M3, Format.FP8_E5M2], ids=str)
def test_quantize_fp8_with_row_scales_is_the_scaled_cast_bitwise(fmt):
    x = randn(64, 96) * 30
    scale = torch.rand(64, 1, generator=torch.Generator().manual_seed(3)) * 10 + 0.1
    expected = saturating_cast(x * scale, fmt.dtype)
    got = quantize(x, fmt, scale, Granularity.ROW)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_quantize_e4m3_saturates_to_448():
    x = torch.tensor([448.0, 465.0, 1e6, math.inf, -500.0, -math.inf])
    assert quantize(x, Format.FP8_E4M3).float().tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]


def test_round_to_format_e4m3_saturates_to_448():
    x = torch.tensor([465.0, 1e6, math.inf, -500.0, -math.inf])
    assert round_to_format(x, Format.FP8_E4M3).tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]


def test_quantize_e4m3_keeps_nan():
    assert torch.isnan(quantize(torch.tensor([math.nan]), Format.FP8_E4M3).float()).all()


def test_quantize_e5m2_saturates_instead_of_overflowing_to_inf():
    # 61440 is halfway between 57344 (odd mantissa) and 65536: a plain cast rounds it to inf.
    x = torch.tensor([61440.0, 1e6, math.inf, -61440.0, -math.inf])
    assert x.to(torch.float8_e5m2).float().isinf().all()
    q = quantize(x, Format.FP8_E5M2).float()
    assert q.tolist() == [57344.0, 57344.0, 57344.0, -57344.0, -57344.0]


def test_quantize_e5m2_below_the_overflow_tie_stays_at_max():
    x = torch.tensor([57344.0, 61439.0, -61439.0])
    assert quantize(x, Format.FP8_E5M2).float().tolist() == [57344.0, 57344.0, -57344.0]


# ---------------------------------------------------------------------------------------------
# 3. INT8
# ---------------------------------------------------------------------------------------------


def test_int8_rounds_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5])
    assert quantize(x, Format.INT8).tolist() == [0, 2, 2, 4, 0, -2, -2, -4]


def test_int8_half_to_even_matches_python_round_on_all_halves():
    halves = [k + 0.5 for k in range(-128, 128)]
    expected = [max(-127, min(127, round(h))) for h in halves]  # Python's round is half to even
    assert quantize(torch.tensor(halves), Format.INT8).tolist() == expected


def test_round_to_format_int8_minus_half_is_negative_zero():
    y = round_to_format(torch.tensor([-0.5, 0.5]), Format.INT8)
    assert y.tolist() == [0.0, 0.0] and torch.signbit(y).tolist() == [True, False]


def test_int8_clamps_to_symmetric_range():
    x = torch.tensor([126.5, 127.4, 127.5, 128.0, 1e9, math.inf, -127.4, -127.5, -128.0, -128.6, -1e9, -math.inf])
    expected = [126, 127, 127, 127, 127, 127, -127, -127, -127, -127, -127, -127]
    assert quantize(x, Format.INT8).tolist() == expected


def test_int8_never_produces_minus_128():
    x = randn(4096) * 1000
    assert quantize(x, Format.INT8).min().item() == -127


def test_round_to_format_int8_matches_quantize_with_scale_one():
    x = randn(10000) * 100
    assert torch.equal(round_to_format(x, Format.INT8), quantize(x, Format.INT8).float())


def test_int8_per_row_scales_match_plain_torch():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    scale = 127 / x.abs().amax(dim=1, keepdim=True)
    expected = torch.clamp(torch.round(x * scale), -127, 127).to(torch.int8)
    assert torch.equal(quantize(x, Format.INT8, scale, Granularity.ROW), expected)


def test_int8_per_row_scales_put_each_row_amax_at_127():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    scale = scale_from_amax(amax(x, Granularity.ROW), Format.INT8)
    q = quantize(x, Format.INT8, scale, Granularity.ROW)
    assert q.abs().amax(dim=1).tolist() == [127] * 8


def test_int8_per_row_round_trip_error_is_at_most_half_a_step():
    x = randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
    scale = scale_from_amax(amax(x, Granularity.ROW), Format.INT8)
    y = dequantize(quantize(x, Format.INT8, scale, Granularity.ROW), scale, Granularity.ROW)
    step = 1 / scale
    assert ((y - x).abs() <= 0.5 * step * (1 + 1e-5)).all()


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


# Floors in dB for fake_quantize with current scaling, over the whole 256x512 tensor.
# Measured on torch 2.13 CPU (seed 0); each floor sits ~0.5-1 dB below the measurement.
#                                               measured: randn  outlier_rows  outlier_block
SQNR_FLOORS = {
    (Format.FP8_E4M3, "tensor"): {"randn": 31.0, "outlier_rows": 31.0, "outlier_block": 31.0},  # 31.53 31.56 31.59
    (Format.FP8_E4M3, "row"): {"randn": 31.0, "outlier_rows": 31.0, "outlier_block": 31.0},  # 31.59 31.61 31.80
    (Format.FP8_E4M3, "block1x128"): {"randn": 31.0, "outlier_rows": 31.0, "outlier_block": 31.0},  # 31.82 31.67 31.80
    (Format.FP8_E4M3, "block128x128"): {"randn": 31.0, "outlier_rows": 31.0, "outlier_block": 31.0},  # 31.55 31.64 31.59
    (Format.FP8_E5M2, "tensor"): {"randn": 25.0, "outlier_rows": 25.0, "outlier_block": 25.0},  # 25.62 25.74 25.64
    (Format.FP8_E5M2, "row"): {"randn": 25.0, "outlier_rows": 25.0, "outlier_block": 25.0},  # 25.62 25.71 25.84
    (Format.FP8_E5M2, "block1x128"): {"randn": 25.0, "outlier_rows": 25.0, "outlier_block": 25.0},  # 25.81 25.75 25.84
    (Format.FP8_E5M2, "block128x128"): {"randn": 25.0, "outlier_rows": 25.0, "outlier_block": 25.0},  # 25.61 25.91 25.64
    (Format.INT8, "tensor"): {"randn": 39.0, "outlier_rows": 38.0, "outlier_block": 39.0},  # 39.67 38.71 39.71
    (Format.INT8, "row"): {"randn": 42.0, "outlier_rows": 42.5, "outlier_block": 43.0},  # 42.55 43.11 43.47
    (Format.INT8, "block1x128"): {"randn": 43.0, "outlier_rows": 43.5, "outlier_block": 43.0},  # 43.76 44.06 43.76
    (Format.INT8, "block128x128"): {"randn": 39.5, "outlier_rows": 38.5, "outlier_block": 39.5},  # 40.34 39.07 40.00
}


@pytest.mark.parametrize("data", list(DATASETS))
@pytest.mark.parametrize("gran", [name for name, _, _ in GRANULARITIES])
@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_fake_quantize_sqnr_floor(fmt, gran, data):
    x = DATASETS[data]()
    granularity, block = GRANULARITY_BY_ID[gran]
    y = fake_quantize(x, fmt, granularity=granularity, block=block)
    assert sqnr(x, y) >= SQNR_FLOORS[(fmt, gran)][data]


@pytest.mark.parametrize("fmt, floor", [(Format.BF16, 55.0), (Format.FP16, 73.0)], ids=str)
def test_fake_quantize_wide_format_sqnr_floor(fmt, floor):
    # Measured 55.59 dB (BF16, 8 significant bits) and 73.67 dB (FP16, 11) on randn.
    x = data_randn()
    assert sqnr(x, fake_quantize(x, fmt)) >= floor


@pytest.mark.parametrize("gran", [name for name, _, _ in GRANULARITIES])
@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_fake_quantize_matches_plain_torch_reference(fmt, gran):
    # Non-divisible shape so partial rows/blocks are exercised; outlier rows so groups differ.
    x = randn(130, 300) * torch.logspace(-2, 2, 130).unsqueeze(1)
    granularity, block = GRANULARITY_BY_ID[gran]
    got = fake_quantize(x, fmt, granularity=granularity, block=block)
    assert torch.equal(got, reference_fake_quantize(x, fmt, gran, block))


def test_fake_quantize_fp32_is_an_exact_copy():
    x = randn(16, 16)
    y = fake_quantize(x, Format.FP32)
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_fake_quantize_keeps_the_input_dtype():
    x = randn(16, 128).to(torch.bfloat16)
    assert fake_quantize(x, Format.FP8_E4M3).dtype == torch.bfloat16


def _normal_rows_sqnr(x: torch.Tensor, fmt: Format, gran: str) -> float:
    granularity, block = GRANULARITY_BY_ID[gran]
    y = fake_quantize(x, fmt, granularity=granularity, block=block)
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[OUTLIER_ROWS] = False
    return sqnr(x[keep], y[keep])


# Outlier rows: the whole-tensor SQNR is dominated by the outliers' energy, so the effect of
# granularity shows in the SQNR of the ordinary rows. Factor per format: INT8's uniform grid
# collapses at 1000x; FP8's exponent absorbs 1000x (E4M3 spans ~2^18, E5M2 ~2^32), so larger
# factors are needed to push the ordinary rows into the subnormals and below.
# Measured on the ordinary rows (seed 0), tensor / row / block1x128:
#   INT8 @1e3:      0.00 / 42.54 / 43.76
#   FP8_E4M3 @1e5:  7.85 / 31.59 / 31.82
#   FP8_E5M2 @1e9: 12.14 / 25.62 / 25.81
@pytest.mark.parametrize("gran, fmt, factor, gain", [
    ("row", Format.INT8, 1e3, 30.0),
    ("block1x128", Format.INT8, 1e3, 30.0),
    ("row", Format.FP8_E4M3, 1e5, 15.0),
    ("block1x128", Format.FP8_E4M3, 1e5, 15.0),
    ("row", Format.FP8_E5M2, 1e9, 8.0),
    ("block1x128", Format.FP8_E5M2, 1e9, 8.0),
])
def test_finer_granularity_beats_per_tensor_on_outlier_rows(gran, fmt, factor, gain):
    x = data_outlier_rows(factor)
    assert _normal_rows_sqnr(x, fmt, gran) >= _normal_rows_sqnr(x, fmt, "tensor") + gain


@pytest.mark.parametrize("gran", ["row", "block1x128"])
def test_finer_granularity_beats_per_tensor_on_int8_outlier_rows_whole_tensor(gran):
    # Whole tensor: tensor 38.71 dB vs row 43.11, block1x128 44.06 (measured).
    x = data_outlier_rows(1000.0)
    granularity, block = GRANULARITY_BY_ID[gran]
    fine = sqnr(x, fake_quantize(x, Format.INT8, granularity=granularity, block=block))
    assert fine >= sqnr(x, fake_quantize(x, Format.INT8)) + 3.0


def test_e4m3_per_tensor_absorbs_1000x_outlier_rows():
    # 1000x is ~2^10, inside E4M3's ~2^18 dynamic range: ordinary rows keep 31.49 dB (measured).
    assert _normal_rows_sqnr(data_outlier_rows(1000.0), Format.FP8_E4M3, "tensor") >= 30.5


@pytest.mark.parametrize("gran", ["block128x128", "block1x128"])
def test_block_scaling_isolates_an_outlier_block_for_int8(gran):
    # Outside the outlier block, measured: tensor 0.00 dB, row 3.66, block128x128 40.39, block1x128 43.76.
    x = data_outlier_block()
    granularity, block = GRANULARITY_BY_ID[gran]
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[128:, :128] = False
    fine = fake_quantize(x, Format.INT8, granularity=granularity, block=block)
    coarse = fake_quantize(x, Format.INT8)
    assert sqnr(x[keep], fine[keep]) >= sqnr(x[keep], coarse[keep]) + 30.0


# ---------------------------------------------------------------------------------------------
# 5. block scaling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block, expected", [
    ((130, 300), WEIGHT_BLOCK, (2, 3)),
    ((130, 300), ACTIVATION_BLOCK, (130, 3)),
    ((256, 256), WEIGHT_BLOCK, (2, 2)),
    ((1, 1), WEIGHT_BLOCK, (1, 1)),
])
def test_block_amax_shape(shape, block, expected):
    x = randn(*shape)
    assert tuple(amax(x, Granularity.BLOCK, block).shape) == expected


@pytest.mark.parametrize("block", [WEIGHT_BLOCK, ACTIVATION_BLOCK, (7, 50)])
def test_block_amax_matches_loop_over_blocks(block):
    x = randn(130, 300) * torch.logspace(-3, 3, 300)
    bm, bk = block
    expected = torch.tensor([
        [x[i : i + bm, j : j + bk].abs().max().item() for j in range(0, 300, bk)]
        for i in range(0, 130, bm)
    ])
    assert torch.equal(amax(x, Granularity.BLOCK, block), expected)


def test_row_amax_matches_loop_and_keeps_dims():
    x = randn(4, 5, 6)
    expected = torch.tensor([[[max(abs(v) for v in x[i, j].tolist())] for j in range(5)] for i in range(4)])
    assert torch.equal(amax(x, Granularity.ROW), expected)


def test_tensor_amax_is_a_scalar_fp32():
    x = randn(3, 7).to(torch.bfloat16)
    a = amax(x)
    assert a.shape == () and a.dtype == torch.float32 and a.item() == x.float().abs().max().item()


def test_tensor_amax_of_empty_tensor_is_zero():
    assert amax(torch.empty(0, 4)).item() == 0.0


def test_amax_propagates_nan():
    x = randn(4, 4)
    x[1, 2] = math.nan
    assert torch.isnan(amax(x))


def test_block_amax_rejects_3d_tensor():
    x = randn(2, 3, 4)
    with pytest.raises(FormatError, match="2-D"):
        amax(x, Granularity.BLOCK, WEIGHT_BLOCK)


@pytest.mark.parametrize("block", [(0, 128), (128,), (1, 2, 3)])
def test_block_amax_rejects_bad_block(block):
    x = randn(4, 4)
    with pytest.raises(FormatError, match="block"):
        amax(x, Granularity.BLOCK, block)


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
@pytest.mark.parametrize("block", [WEIGHT_BLOCK, ACTIVATION_BLOCK], ids=["128x128", "1x128"])
def test_block_quantize_dequantize_round_trip_matches_reference(fmt, block):
    x = randn(130, 300) * torch.logspace(-2, 2, 300)
    scale = scale_from_amax(amax(x, Granularity.BLOCK, block), fmt)
    bm, bk = block
    # Plain-torch per-element scale: element (i, j) uses its block's scale.
    full = torch.empty_like(x)
    for i in range(x.shape[0]):
        for jb in range(scale.shape[1]):
            full[i, jb * bk : (jb + 1) * bk] = scale[i // bm, jb]
    y = x * full
    q_ref = torch.clamp(torch.round(y), -127, 127) if fmt is Format.INT8 else y.to(fmt.dtype).float()
    q = quantize(x, fmt, scale, Granularity.BLOCK, block)
    back = dequantize(q, scale, Granularity.BLOCK, block)
    assert q.dtype == fmt.dtype and torch.equal(back, q_ref / full)


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_block_quantize_puts_each_block_amax_at_max(fmt):
    x = randn(130, 300) * torch.logspace(-2, 2, 300)
    scale = scale_from_amax(amax(x, Granularity.BLOCK, WEIGHT_BLOCK), fmt)
    q = quantize(x, fmt, scale, Granularity.BLOCK, WEIGHT_BLOCK).float().abs()
    block_max = [q[i : i + 128, j : j + 128].max().item() for i in range(0, 130, 128) for j in range(0, 300, 128)]
    assert block_max == [fmt.max] * 6


def test_block_round_trip_sqnr_on_non_divisible_shape():
    # Measured 31.48 dB for E4M3 with 128x128 blocks over columns spanning 4 decades.
    x = randn(130, 300) * torch.logspace(-2, 2, 300)
    y = fake_quantize(x, Format.FP8_E4M3, granularity=Granularity.BLOCK, block=WEIGHT_BLOCK)
    assert y.shape == x.shape and sqnr(x, y) >= 30.0


# ---------------------------------------------------------------------------------------------
# 6. scale_from_amax
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_scale_maps_amax_exactly_onto_max(fmt):
    # One row per amax, holding +amax and -amax; per-row scales.
    a = torch.tensor([[0.3], [1.0], [3.0], [7.77], [1e4], [1e-3]])
    scale = scale_from_amax(a, fmt)
    x = torch.cat([a, -a], dim=1)
    q = quantize(x, fmt, scale, Granularity.ROW).float()
    assert q.tolist() == [[fmt.max, -fmt.max]] * 6


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_scale_with_margin_targets_max_over_power_of_two(fmt, margin):
    a = torch.tensor([0.3, 1.0, 7.77, 1e4])
    scale = scale_from_amax(a, fmt, margin)
    target = torch.full_like(a, fmt.max / 2**margin, dtype=torch.float64)
    assert torch.allclose((a * scale).double(), target, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", SCALED_FORMATS, ids=str)
def test_scale_is_one_for_zero_or_non_finite_amax(fmt):
    a = torch.tensor([0.0, math.inf, -math.inf, math.nan])
    assert scale_from_amax(a, fmt).tolist() == [1.0] * 4


@pytest.mark.parametrize("fmt", UNSCALED_FORMATS, ids=str)
def test_scale_is_one_for_formats_without_scale(fmt):
    a = torch.tensor([[0.5], [1e6], [0.0]])
    scale = scale_from_amax(a, fmt)
    assert scale.shape == a.shape and scale.tolist() == [[1.0]] * 3


def test_scale_keeps_the_amax_shape_and_is_fp32():
    a = amax(randn(6, 10), Granularity.ROW).to(torch.float16)
    scale = scale_from_amax(a, Format.FP8_E4M3)
    assert scale.shape == (6, 1) and scale.dtype == torch.float32


def test_scale_from_tiny_amax_stays_finite():
    a = torch.tensor([1e-45])  # smallest FP32 subnormal: 448 / a overflows FP32
    assert torch.isfinite(scale_from_amax(a, Format.FP8_E4M3)).all()


def test_scale_from_amax_accepts_format_names():
    a = torch.tensor(2.0)
    assert scale_from_amax(a, "FP8_E4M3").item() == 224.0


# ---------------------------------------------------------------------------------------------
# 7. AmaxHistory
# ---------------------------------------------------------------------------------------------


def _expected_scales(amaxes, length, reduction, fmt=Format.FP8_E4M3):
    """Delayed scaling in plain Python: the basis is the current amax on the first step, then the
    reduction over the previous `length` recorded amaxes (non-finite ones recorded as 0)."""
    recorded, out = [], []
    for a in amaxes:
        if not recorded:
            basis = a
        elif reduction == "max":
            basis = max(recorded[-length:])
        else:
            basis = recorded[-1]
        out.append(scale_from_amax(torch.tensor(basis), fmt).item())
        recorded.append(a if math.isfinite(a) else 0.0)
    return out


def test_history_first_step_uses_current_amax():
    h = AmaxHistory(length=4)
    assert h.next_scale(torch.tensor(2.0), Format.FP8_E4M3).item() == 448.0 / 2.0


def test_history_second_step_uses_previous_amax_not_current():
    h = AmaxHistory(length=4)
    h.next_scale(torch.tensor(2.0), Format.FP8_E4M3)
    assert h.next_scale(torch.tensor(8.0), Format.FP8_E4M3).item() == 448.0 / 2.0


def test_history_max_reduction_uses_largest_previous_amax():
    h = AmaxHistory(length=4, reduction="max")
    scales = [h.next_scale(torch.tensor(a), Format.FP8_E4M3).item() for a in [2.0, 8.0, 1.0, 4.0]]
    assert scales == [448 / 2, 448 / 2, 448 / 8, 448 / 8]


def test_history_most_recent_reduction_uses_previous_step():
    h = AmaxHistory(length=4, reduction="most_recent")
    scales = [h.next_scale(torch.tensor(a), Format.FP8_E4M3).item() for a in [2.0, 8.0, 1.0, 4.0]]
    assert scales == [448 / 2, 448 / 2, 448 / 8, 448 / 1]


def test_history_window_rolls_after_length_records():
    h = AmaxHistory(length=3)
    for a in [100.0, 1.0, 2.0, 4.0]:
        h.record(torch.tensor(a))
    assert h.reduced().item() == 4.0  # 100 fell out of the 3-long window


@pytest.mark.parametrize("reduction", AmaxHistory.REDUCTIONS)
@pytest.mark.parametrize("length", [1, 3, 16])
def test_history_matches_python_simulation(length, reduction):
    g = torch.Generator().manual_seed(length)
    amaxes = (torch.rand(40, generator=g) * 100 + 0.01).tolist()
    amaxes[7] = math.inf
    amaxes[19] = math.nan
    h = AmaxHistory(length=length, reduction=reduction)
    got = [h.next_scale(torch.tensor(a), Format.FP8_E4M3).item() for a in amaxes]
    assert got == _expected_scales(amaxes, length, reduction)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_history_records_non_finite_amax_as_zero(bad):
    h = AmaxHistory(length=4, reduction="most_recent")
    h.record(torch.tensor(5.0))
    h.record(torch.tensor(bad))
    assert h.reduced().item() == 0.0


def test_history_max_ignores_a_non_finite_step():
    h = AmaxHistory(length=4)
    for a in [5.0, math.inf, 3.0]:
        h.record(torch.tensor(a))
    assert h.reduced().item() == 5.0


def test_history_empty_reduces_to_zero():
    assert AmaxHistory(length=4).reduced().item() == 0.0


def test_history_counts_records_and_keeps_only_the_window():
    h = AmaxHistory(length=2)
    for a in [1.0, 2.0, 3.0]:
        h.record(torch.tensor(a))
    assert h.recorded == 3 and sorted(h.history.tolist()) == [2.0, 3.0]


def test_history_state_dict_round_trip_continues_identically():
    a = AmaxHistory(length=4, reduction="max")
    for v in [3.0, 9.0, 1.0, 2.0, 5.0]:
        a.next_scale(torch.tensor(v), Format.FP8_E4M3)
    b = AmaxHistory(length=4, reduction="most_recent")
    b.load_state_dict(a.state_dict())
    later = [7.0, 0.5, 11.0, 0.25, 0.1]
    scales_a = [a.next_scale(torch.tensor(v), Format.FP8_E4M3).item() for v in later]
    scales_b = [b.next_scale(torch.tensor(v), Format.FP8_E4M3).item() for v in later]
    assert scales_a == scales_b and b.reduction == "max" and b.recorded == a.recorded


def test_history_state_dict_is_a_snapshot():
    h = AmaxHistory(length=2)
    h.record(torch.tensor(1.0))
    state = h.state_dict()
    h.record(torch.tensor(50.0))
    assert state["history"].tolist() == [1.0, 0.0] and state["recorded"] == 1


def test_history_load_rejects_mismatched_length():
    state = AmaxHistory(length=4).state_dict()
    h = AmaxHistory(length=8)
    with pytest.raises(FormatError, match="length"):
        h.load_state_dict(state)


@pytest.mark.parametrize("length", [0, -1])
def test_history_rejects_bad_length(length):
    with pytest.raises(FormatError, match="length"):
        AmaxHistory(length=length)


@pytest.mark.parametrize("reduction", ["mean", "MAX", ""])
def test_history_rejects_bad_reduction(reduction):
    with pytest.raises(FormatError, match="reduction"):
        AmaxHistory(length=4, reduction=reduction)
