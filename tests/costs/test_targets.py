"""Pricing a plan for a GPU the machine is not (`autoprec.costs.targets`): its rates, its kernel
paths, a device profile read from JSON, and the search planning under it."""

import json

import pytest
import torch
import torch.nn as nn

from autoprec.costs import TARGETS, CostModel, RooflineTimeModel, call_path, layer_memory, load_target, trace_model
from autoprec.costs.targets import KERNEL_ROUTES, kernel_route
from autoprec.errors import CostModelError, SearchError
from autoprec.formats import Format
from autoprec.layer_precision import LayerPrecision, Scaling
from autoprec.search.planning import Planning

CPU = torch.device("cpu")


def _precision(fmt, granularity=None):
    if granularity is None:
        return LayerPrecision(fmt)
    grad = Format.FP8_E4M3 if granularity == "block" else None
    return LayerPrecision(fmt, scaling=Scaling(granularity=granularity), **({"grad_format": grad} if grad else {}))


@pytest.fixture(scope="module")
def large_gemm():
    """A linear layer of 8192 x 4096 x 4096 (the GPU run's large shape) inside a model (its input
    needs a gradient), traced on the meta device: the roofline and the bytes are arithmetic on
    the shapes, so nothing of that size runs here."""
    x = torch.empty(8192, 4096, device="meta", requires_grad=True)
    trace = trace_model(nn.Linear(4096, 4096, bias=False, device="meta"), x)
    (layer,) = trace.layers.values()
    return layer


def test_each_product_names_the_kernel_it_needs():
    assert kernel_route(LayerPrecision(Format.BF16)) is None and kernel_route(LayerPrecision(Format.FP32)) is None
    assert kernel_route(_precision(Format.FP8_E4M3)) == "fp8"
    assert kernel_route(_precision(Format.FP8_E4M3, "row")) == "fp8"
    assert kernel_route(_precision(Format.FP8_E4M3, "block")) == "fp8_block"
    assert kernel_route(_precision(Format.FP8_E4M3, "mx")) == "mxfp8"
    assert kernel_route(LayerPrecision(Format.NVFP4)) == "nvfp4"
    assert kernel_route(LayerPrecision(Format.INT8)) == "int8"
    assert set(TARGETS["B200"].kernels) == set(KERNEL_ROUTES)
    assert not TARGETS["H100"].runs(LayerPrecision(Format.NVFP4)) and not TARGETS["H100"].runs(_precision(Format.FP8_E4M3, "mx"))
    assert TARGETS["H100"].runs(_precision(Format.FP8_E4M3, "block")) and not TARGETS["A100"].runs(_precision(Format.FP8_E4M3))


def test_the_path_and_the_saved_bytes_follow_the_targets_kernels_not_the_machines(large_gemm):
    call = large_gemm.calls[0]
    fp8 = _precision(Format.FP8_E4M3)
    # torch 2.13's CPU build has an FP8 kernel (2.11's: per tensor as well); an A100 has none.
    assert call_path(call, fp8, CPU, TARGETS["A100"])[0] == "emulated"
    assert call_path(call, fp8, CPU, TARGETS["H100"]) == ("kernel", (8192, 4096, 4096))
    assert call_path(call, LayerPrecision(Format.NVFP4), CPU, TARGETS["B200"])[0] == "nvfp4"
    # A kernel saves the FP8 weight copy for the input's gradient; an emulation does not.
    on_h100, on_a100 = layer_memory(large_gemm, fp8, CPU, TARGETS["H100"]), layer_memory(large_gemm, fp8, CPU, TARGETS["A100"])
    assert (on_h100.weight_copy_bytes, on_a100.weight_copy_bytes) == (4096 * 4096, 0)


def test_a_b200_prices_nvfp4_under_mxfp8_under_bf16_and_a_hopper_emulates_what_it_lacks(large_gemm):
    call = large_gemm.calls[0]
    kinds = {"fp32": (Format.FP32, None), "bf16": (Format.BF16, None), "fp8": (Format.FP8_E4M3, None), "mxfp8": (Format.FP8_E4M3, "mx"),
             "nvfp4": (Format.NVFP4, None)}

    def seconds(target):
        out = {}
        for name, (fmt, granularity) in kinds.items():
            model = RooflineTimeModel(target=target, precisions={fmt: _precision(fmt, granularity)})
            out[name] = model.seconds(call, fmt, CPU)
        return out

    b200, h100 = seconds(TARGETS["B200"]), seconds(TARGETS["H100"])
    assert b200["nvfp4"] < b200["mxfp8"] < b200["bf16"] < b200["fp32"]
    assert b200["fp8"] < b200["bf16"]
    # Compute-bound at this shape: the ratio is the datasheet's (9000 / 2250 TFLOPS), less the
    # quantization passes (TE reports 2.03x on a B300's GEMMs).
    assert b200["nvfp4"] < b200["mxfp8"] < b200["fp8"]
    assert 1.5 < b200["bf16"] / b200["nvfp4"] <= 4.0
    # An H100 runs FP8 per tensor on a kernel, but MXFP8 and NVFP4 only emulated (FP32 GEMMs).
    assert h100["fp8"] < h100["bf16"] < h100["mxfp8"] and h100["bf16"] < h100["nvfp4"]
    assert h100["mxfp8"] > h100["fp32"]
    # The same device's rates for what both run natively; the B200 faster by its rates.
    assert h100["bf16"] / b200["bf16"] == pytest.approx(2250 / 989, rel=0.05)


def test_a_high_precision_backward_is_priced_at_the_bf16_rate_on_the_targets_that_run_the_forward_natively(large_gemm):
    """FP8 (H100), MXFP8 and NVFP4 (B200) layers with ``grad_format="fp32"``: one GEMM in the
    format and two in BF16, so between the format's own and BF16's at this compute-bound shape."""
    call = large_gemm.calls[0]
    for target, fmt, granularity in (("H100", Format.FP8_E4M3, None), ("B200", Format.FP8_E4M3, "mx"), ("B200", Format.NVFP4, None)):
        low = _precision(fmt, granularity)
        high = LayerPrecision(fmt, grad_format=Format.FP32, scaling=low.scaling)
        seconds = {name: RooflineTimeModel(target=TARGETS[target], precisions={fmt: p}).seconds(call, fmt, CPU) for name, p in (("low", low), ("high", high))}
        bf16 = RooflineTimeModel(target=TARGETS[target]).seconds(call, Format.BF16, CPU)
        assert seconds["low"] < seconds["high"] < bf16, (target, fmt, granularity, seconds, bf16)


def test_a_cost_model_built_for_a_target_times_nothing_here_and_says_where_its_seconds_come_from():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    costs = CostModel.build(model, x, formats=[Format.FP32, Format.BF16, Format.NVFP4], target=TARGETS["B200"])
    assert costs.in_place == {} and costs.rest_seconds == 0.0
    cost = costs.layer_cost("0", Format.NVFP4)
    assert cost.time_source == "roofline, NVIDIA B200 (HGX)"
    assert cost.seconds == pytest.approx(RooflineTimeModel(target=TARGETS["B200"]).seconds(costs.trace.layers["0"].calls[0], Format.NVFP4, CPU))


def test_a_device_profile_is_read_from_json(tmp_path):
    path = tmp_path / "mygpu.json"
    path.write_text(json.dumps({"name": "My GPU", "source": "measured", "tflops": {"fp32": 50, "bf16": 500, "fp8_e4m3": 1000},
                                "bandwidth_tb_s": 2, "kernels": ["fp8"]}))
    target = load_target("mygpu.json", base=tmp_path)
    assert target.name == "My GPU" and target.kernels == {"fp8"}
    assert target.peaks.peak(Format.FP8_E4M3) == 1000e12 and target.peaks.peak(Format.INT8) == 50e12  # missing: the FP32 rate
    assert target.peaks.bandwidth == 2e12 and target.peaks.overhead_s == pytest.approx(5e-6)
    assert load_target("b200") is TARGETS["B200"]  # names in any case


@pytest.mark.parametrize("profile, field", [
    ({"name": "x", "tflops": {"bf16": 1}, "bandwidth_tb_s": 1, "kernels": []}, "tflops"),
    ({"name": "x", "tflops": {"fp32": 1, "fp6": 2}, "bandwidth_tb_s": 1, "kernels": []}, "tflops.fp6"),
    ({"name": "x", "tflops": {"fp32": -1}, "bandwidth_tb_s": 1, "kernels": []}, "tflops.fp32"),
    ({"name": "x", "tflops": {"fp32": 1}, "bandwidth_tb_s": 0, "kernels": []}, "bandwidth_tb_s"),
    ({"name": "x", "tflops": {"fp32": 1}, "bandwidth_tb_s": 1, "kernels": ["fp4"]}, "kernels"),
    ({"name": "x", "tflops": {"fp32": 1}, "bandwidth_tb_s": 1}, "kernels"),
    ({"name": "x", "tflops": {"fp32": 1}, "bandwidth_tb_s": 1, "kernels": [], "tdp": 700}, "tdp"),
    ({"tflops": {"fp32": 1}, "bandwidth_tb_s": 1, "kernels": []}, "name"),
])
def test_a_bad_profile_is_one_line_naming_the_field(tmp_path, profile, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(CostModelError) as info:
        load_target(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}: {field}: " in message


def test_an_unknown_name_a_missing_file_and_a_non_json_file_are_one_line_each(tmp_path):
    with pytest.raises(CostModelError, match=r"^target 'B300': not a known device \(H100, H200, A100, B200\)"):
        load_target("B300")
    with pytest.raises(CostModelError, match=r"cannot read the profile .*; check the path$"):
        load_target(tmp_path / "gone.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CostModelError, match=r"not JSON \(line 1"):
        load_target(tmp_path / "broken.json")
    with pytest.raises(SearchError, match=r"^Planning\(target='B200'\): expected a TargetDevice"):
        Planning((Format.FP32,), target="B200")
