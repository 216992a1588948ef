"""The search in block-scaled FP8 (`Planning.scaling`): costs timed, sensitivity estimated and plans
made in the scaling the user chose, per format; and the settings that choose it, refused with one
line when wrong. A model with outlier input channels (benchmarks/block_fp8.py's, small)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autoprec as ap
from autoprec.costs import CostModel, TimingSettings
from autoprec.errors import SearchError, SettingsError
from autoprec.formats import Format, Granularity
from autoprec.search.pipeline import Planning, measure_space, propose_from
from autoprec.search.space import Budgets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from block_fp8 import OutlierMLP  # noqa: E402

E4M3 = Format.FP8_E4M3
BLOCK = {"fp8_e4m3": "block"}


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    model = OutlierMLP(128, 256, 2, outliers=2, gain=100.0, seed=0)
    data = [(torch.randn(256, 128), torch.randn(256, 128)) for _ in range(2)]  # activations outweigh the weights' FP8 copies

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]).float(), batch[1])

    return model, data, loss_fn


def _search(problem, scaling, memory):
    model, data, loss_fn = problem
    planning = Planning((Format.BF16, E4M3), budgets=Budgets(memory=memory), scaling=scaling, measure=False)
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    return found, propose_from(found, planning, baseline_loss=None).plans[0]


def test_a_block_scaled_search_plans_costs_and_estimates_fp8_in_block_scaling(problem):
    tensor_found, _ = _search(problem, {}, 1.0)
    found, plan = _search(problem, BLOCK, 0.7)  # 0.7 of the FP32 bytes (BF16's floor 0.75, block FP8's 0.61): FP8 somewhere
    fp8 = [lp for lp in plan.layers.values() if lp.format is E4M3]
    assert fp8, "a memory budget of 0.7 needs FP8 layers"
    assert all(lp.scaling.granularity is Granularity.BLOCK and lp.grad_format is E4M3 for lp in fp8)
    # Its own sensitivity: the same layers in block-scaled FP8 predict another loss increase
    # (tile scales round the non-outlier channels finer; E4M3 gradients instead of E5M2).
    layers = list(plan.layers)
    assert any(found.sensitivity[(f, E4M3)] != tensor_found.sensitivity[(f, E4M3)] for f in layers)
    assert found.costs.precision(E4M3).scaling.granularity is Granularity.BLOCK
    assert tensor_found.costs.precision(E4M3).scaling.granularity is Granularity.TENSOR


def test_times_measured_in_one_scaling_are_never_reused_for_another(problem, tmp_path):
    model, data, loss_fn = problem
    times = tmp_path / "times.json"
    settings = TimingSettings(times_file=times, warmup_steps=0, timed_steps=1)
    CostModel.build(copy.deepcopy(model), data[0][0], formats=(Format.FP32, E4M3), timing=settings)
    assert "scaling" not in json.loads(times.read_text())
    block = {E4M3: ap.LayerPrecision(E4M3, scaling=ap.Scaling(granularity="block"))}
    CostModel.build(copy.deepcopy(model), data[0][0], formats=(Format.FP32, E4M3), timing=settings, precisions=block)
    saved = json.loads(times.read_text())
    assert saved["scaling"] == {"fp8_e4m3": block[E4M3].to_dict()["scaling"]}  # timed afresh, keyed on it
    # A high-precision backward runs other products: timed afresh too, keyed on its gradient format.
    high = {E4M3: ap.LayerPrecision(E4M3, grad_format="fp32")}
    CostModel.build(copy.deepcopy(model), data[0][0], formats=(Format.FP32, E4M3), timing=settings, precisions=high)
    assert json.loads(times.read_text())["scaling"] == {"fp8_e4m3": {**high[E4M3].to_dict()["scaling"], "grad_format": "fp32"}}


@pytest.mark.parametrize("scaling, words", [
    ({"fp8_e4m3": "diagonal"}, "'tensor', 'row', 'block', 'mx' or a Scaling"),
    ({"bf16": "block"}, "bf16 takes no scale"),
    ({"fp9": "block"}, "expected a format name"),
    ("block", "a table of format = scaling"),
])
def test_a_wrong_scaling_is_refused_in_one_line_naming_it(scaling, words):
    with pytest.raises(SearchError, match=words) as planning_error:
        Planning((E4M3,), scaling=scaling)
    assert "\n" not in str(planning_error.value)
    with pytest.raises(SettingsError, match=r"DynamicPrecisionScheduler\(scaling="):
        ap.DynamicPrecisionScheduler(scaling=scaling)


def test_a_job_file_takes_the_scaling_and_names_a_wrong_one(tmp_path):
    from autoprec.job.config import load_job

    good = tmp_path / "good.toml"
    good.write_text('[job]\nname = "x"\n[workload]\nfactory = "autoprec.workloads:default_workload"\n[search]\nscaling = {fp8_e4m3 = "block"}\n')
    config = load_job(good)
    assert config.planning(1e-3).precisions()[E4M3].scaling.granularity is Granularity.BLOCK
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nname = "x"\n[workload]\nfactory = "autoprec.workloads:default_workload"\n[search]\nscaling = {fp8_e4m3 = "diagonal"}\n')
    with pytest.raises(SearchError, match=r"\[search\]\.scaling: expected a table of scaled format"):
        load_job(bad)


def test_a_job_file_takes_gradient_formats_and_names_a_wrong_one(tmp_path):
    """``[search] grad_formats``: NVFP4 forwards with a high-precision backward, as `Planning`
    checks them; a gradient format the format cannot take names the field."""
    from autoprec.job.config import load_job

    head = '[job]\nname = "x"\n[workload]\nfactory = "autoprec.workloads:default_workload"\n[search]\n'
    good = tmp_path / "good.toml"
    good.write_text(head + 'formats = ["bf16", "nvfp4"]\nmin_precision = 4\ngrad_formats = {nvfp4 = "fp32"}\n')
    assert load_job(good).planning(1e-3).precisions()[Format.NVFP4].grad_format is Format.FP32
    bad = tmp_path / "bad.toml"
    bad.write_text(head + 'grad_formats = {nvfp4 = "bf16"}\n')
    with pytest.raises(SearchError, match=r"\[search\]\.grad_formats: expected a table of format = its gradient format") as info:
        load_job(bad)
    assert "\n" not in str(info.value)
