"""A search job for a GPU the machine is not (``[search].target``): the plans priced there, the
budgets measured here, the fastest predicted there returned."""

import math

import pytest

from autoprec.job.config import load_job
from autoprec.job.run import run_job
from autoprec.plan import Plan
from autoprec.search.candidate_runs import Candidate, Measurement, fastest_meeting, fastest_predicted_meeting, meets_budgets
from support.jobs import write_job


@pytest.fixture(scope="module")
def targeted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    path = write_job(folder)
    text = path.read_text().replace('formats = ["fp32", "bf16", "fp8_e4m3", "int8"]',
                                    'formats = ["fp32", "bf16", "fp8_e4m3", "int8", "nvfp4"]\nmin_precision = 4\ntarget = "B200"')
    path.write_text(text)
    return run_job(load_job(path))


@pytest.mark.slow
def test_the_plan_returned_is_the_fastest_predicted_on_the_target_of_those_that_met_the_budgets_here(targeted):
    pairs = targeted.candidates
    # Every candidate is measured (its loss and bytes, which do not depend on the device): none
    # is pruned for a prediction slower than this machine's fastest; one over the memory budget
    # is pruned after its first step.
    assert all(isinstance(m, Measurement) or m.startswith("measured") for _, m in pairs)
    met = [(c, m) for c, m in pairs if meets_budgets(m, targeted.memory_budget, targeted.loss_budget)]
    fastest_there = min(met, key=lambda p: p[0].plan.predicted["seconds"])[0]
    assert targeted.chosen is fastest_there


def test_the_prediction_ranks_and_the_measurement_only_checks_the_budgets():
    def candidate(name, fmt, predicted):
        return Candidate(name, Plan({"a": fmt}).replace(predicted={"seconds": predicted}))

    def measured(seconds, bytes_=100, loss=0.0):
        return Measurement(seconds=seconds, bytes=bytes_, loss=1.0 + loss, loss_increase=loss)

    fast_here = candidate("exact", "fp32", 3e-4)
    fast_there = candidate("exact-2", "nvfp4", 1e-4)
    too_big = candidate("exact-3", "int8", 0.5e-4)
    pairs = [(fast_here, measured(0.01)), (fast_there, measured(0.2)), (too_big, measured(0.05, bytes_=200)), (candidate("u", "bf16", 1e-5), "pruned: loss")]
    assert fastest_predicted_meeting(pairs, 150, 0.01)[0] is fast_there
    assert fastest_meeting(pairs, 150, 0.01)[0] is fast_here  # what a job for this machine returns
    assert fastest_predicted_meeting(pairs, 150, -1.0) is None


@pytest.mark.slow
def test_the_plan_says_its_seconds_are_the_targets_predicted_and_its_budgets_this_machines_measured(targeted, capsys):
    plan = targeted.plan
    assert plan.metadata["target"]["name"] == "NVIDIA B200 (HGX)" and "nvfp4" in plan.metadata["target"]["kernels"]
    assert plan.predicted["seconds_for"].startswith("NVIDIA B200 (HGX): roofline at its NVIDIA HGX B200 datasheet (dense) rates, predicted, not measured")
    # Priced for a B200: an FP32 step of this model there against here (2 CPU cores) is a
    # small fraction; the rest of the step (norms, the loss) is not priced there.
    assert plan.predicted["fp32_seconds"] < 0.2 * plan.measured["fp32_seconds"]
    assert plan.measured["bytes"] <= targeted.memory_budget and plan.measured["loss_increase"] <= targeted.loss_budget
    table = targeted.format_table()
    assert f"returned {targeted.chosen.name}: {plan.predicted['seconds'] * 1e3:.3g} ms predicted on NVIDIA B200 (HGX), the fastest predicted there" in table
    assert not any("settled" in line for line in table.splitlines()) and targeted.verdict is None
    assert math.isfinite(plan.predicted["seconds"])
