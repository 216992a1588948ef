"""The search in block-scaled FP8 (`Planning.scaling`): costs timed, sensitivity estimated and plans
made in the scaling the user chose, per format; and the settings that choose it, refused with one
line when wrong. A model with outlier input channels (benchmarks/block_fp8.py's, small)."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autoprec as ap
from autoprec.costs import CostModel, TimingSettings
from autoprec.costs.targets import load_target
from autoprec.errors import InfeasibleBudgetError, SearchError, SettingsError
from autoprec.formats import Format, Granularity
from autoprec.search.pipeline import Planning, measure_space, propose_from
from autoprec.search.budgets import Budgets
from autoprec.search.space import key_name

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


def _floor(problem, scaling, accuracy, baseline):
    """The least memory (bytes) a search in ``scaling`` reaches under a relative accuracy budget,
    its plan there, and its space."""
    model, data, loss_fn = problem
    planning = Planning((Format.BF16, E4M3), budgets=Budgets(memory=0.01, accuracy=accuracy), scaling=scaling, measure=False)
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    with pytest.raises(InfeasibleBudgetError) as info:
        propose_from(found, planning, baseline_loss=baseline)
    planning = dataclasses.replace(planning, budgets=Budgets(memory=int(info.value.min_bytes) + 1, accuracy=accuracy))
    return info.value.min_bytes, propose_from(found, planning, baseline_loss=baseline).plans[0], found


def test_weighed_per_layer_the_scalings_mix_and_reach_less_memory_than_any_one_at_the_same_accuracy(problem):
    model, data, loss_fn = problem
    with torch.no_grad():
        baseline = float(loss_fn(model, data[0]))
    # 1e-4 of the loss: the budget binds (per tensor, one layer fits in FP8; in blocks two).
    singles = {g: _floor(problem, {"fp8_e4m3": g}, 1e-4, baseline) for g in ("tensor", "row", "block")}
    least, plan, found = _floor(problem, {"fp8_e4m3": ["tensor", "row", "block"]}, 1e-4, baseline)
    recipes = {lp.recipe for lp in plan.layers.values() if lp.format is E4M3}
    assert len(recipes) > 1, recipes  # one search, scalings mixed per layer
    # Its space holds every single scaling's plans (same bytes and estimates per recipe), so it is
    # never worse; mixing makes it better than the best of them at the same accuracy budget.
    assert least < min(floor for floor, _, _ in singles.values())
    # Each layer's plan entry is its recipe, priced and estimated as that recipe's own search does.
    for fqn, lp in plan.layers.items():
        if lp.format is E4M3:
            single = singles[lp.scaling.granularity.value][2]
            assert found.costs.layer_cost(fqn, lp).bytes == single.costs.layer_cost(fqn, E4M3).bytes
            unit = next(u for u in found.space.units if u.name == fqn)
            key = E4M3 if lp.scaling.granularity is Granularity.TENSOR else ap.LayerPrecision(E4M3, scaling=lp.scaling)
            assert unit.choices[key].loss == pytest.approx(single.sensitivity[(fqn, E4M3)])
    # Promotions read each format's option: one per format, the layer's own recipe where it has that format.
    for fqn, row in plan.predicted["layers"].items():
        assert set(row["options"]) <= {"bf16", "fp8_e4m3"}


def test_a_high_precision_backward_is_a_choice_per_layer_estimated_as_its_own(problem):
    model, data, loss_fn = problem
    planning = Planning((Format.BF16, E4M3), scaling={"fp8_e4m3": ["tensor", "block"]}, grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp32"]}, measure=False)
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    high = ap.LayerPrecision(E4M3, grad_format="fp32")
    names = {key_name(k) for u in found.space.units for k in u.choices}
    # Every scaling with every gradient format given (block scaling's own E4M3 gradients not among them).
    assert names == {"bf16", "fp8_e4m3", "fp8_e4m3+fp32 backward", "fp8_e4m3/block+fp8_e5m2 backward", "fp8_e4m3/block+fp32 backward"}
    for unit in found.space.units:
        own, backward = unit.choices[E4M3], unit.choices[high]
        assert backward.bytes == own.bytes  # the same saved operands (docs/fp8_blocks.md)
    # The gradient term is the recipe's own: no E5M2 rounding of the gradients, so less predicted loss.
    assert all(u.choices[high].loss < u.choices[E4M3].loss for u in found.space.units)


def test_a_high_precision_weight_gradient_is_a_choice_per_gemm_priced_and_planned_as_its_own(problem):
    """``grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp8_e5m2/fp32", "fp32"]}``: the weight gradient's
    product alone in high precision is a recipe of its own: the same bytes; its seconds the
    format's times the roofline ratio of its backward;
    its loss its own parameters' gradient term without the output gradient's rounding (as the
    whole high backward's) plus the input gradient's rounding on the parameters upstream (the
    sampled upstream term: what the whole high backward has less of). Under an accuracy budget
    the default FP8 recipe misses on the outlier layers and a memory budget BF16 misses, the plan
    takes it there."""
    model, data, loss_fn = problem
    grads = {"fp8_e4m3": ["fp8_e5m2", "fp8_e5m2/fp32", "fp32"]}
    # Priced at an H100's datasheet rates without its launch cost (these layers are small enough
    # to be launch-bound there): the CPU's own calibrated peaks differ run to run.
    h100 = load_target("H100")
    target = dataclasses.replace(h100, peaks=dataclasses.replace(h100.peaks, overhead_s=0.0))
    planning = Planning((Format.BF16, E4M3), grad_formats=grads, measure=False, target=target)
    # (These layers are bound by memory: there the split's casts, not its GEMMs, set its price;
    # tests/costs/test_costs.py orders the three on a compute-bound GEMM.)
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    split, high = ap.LayerPrecision(E4M3, high_precision_weight_grad=True), ap.LayerPrecision(E4M3, grad_format="fp32")
    for unit in found.space.units:
        own, per_gemm, backward = unit.choices[E4M3], unit.choices[split], unit.choices[high]
        assert per_gemm.bytes == own.bytes == backward.bytes
        assert len({own.seconds, per_gemm.seconds, backward.seconds}) == 3  # each priced as its own
        assert backward.loss <= per_gemm.loss < own.loss
    # The split's E5M2 input gradient reaches the layers before it (none before the first).
    assert all(u.choices[high].loss < u.choices[split].loss for u in found.space.units[1:])
    outliers = [u for u in found.space.units if u.name.endswith(".2")]  # the second linear of each block: the outlier channels' input
    budget = sum(u.choices[split].loss for u in found.space.units) * 1.5
    assert sum(u.choices[E4M3].loss for u in outliers) > budget  # the default recipe cannot meet it there
    budgets = Budgets(memory=0.65, accuracy=budget, accuracy_relative=False)
    plan = propose_from(found, dataclasses.replace(planning, budgets=budgets), baseline_loss=None).plans[0]
    # Here (memory-bound) the whole high backward casts no gradient: cheaper and better than the
    # split, it is the plan's choice there; offered the split alone, the plan takes the split.
    assert all(u.choices[high].seconds < u.choices[split].seconds for u in outliers)
    assert {plan.layers[u.name].recipe for u in outliers} == {high.recipe} and plan.predicted["loss_increase"] <= budget
    planning = Planning((Format.BF16, E4M3), grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp8_e5m2/fp32"]}, measure=False, target=target, budgets=budgets)
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    plan = propose_from(found, planning, baseline_loss=None).plans[0]
    assert {plan.layers[u.name].recipe for u in outliers} == {"fp8_e4m3+fp32 wgrad"} and plan.predicted["loss_increase"] <= budget
