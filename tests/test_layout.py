"""What the package layout promises: artifacts saved before the layout changed still load and
resume (the files in tests/data/before_layout were written by the code of before; see
tests/data/before_layout/README.md)."""

from pathlib import Path

import pytest
import torch

import autoprec as ap
from autoprec.workloads import default_workload

BEFORE = Path(__file__).parent / "data" / "before_layout"
SETTINGS = dict(monitor_window=6, monitor_steps=6, sample_every=2, memory_budget=0.85, accuracy_budget=0.05,
                formats=("fp32", "bf16", "int8"), measure_costs=False)


@pytest.mark.parametrize("saved", ["scheduler_searching.pt", "scheduler_planned.pt"])
def test_a_scheduler_state_saved_before_resumes_and_trains(saved):
    checkpoint = torch.load(BEFORE / saved, weights_only=True)
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(1)
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = ap.DynamicPrecisionScheduler(model, **SETTINGS)
    scheduler.load_state_dict(checkpoint["scheduler"])
    sampler = wl.train_batches(5)
    for _ in range(12):
        with scheduler.precision_context():
            loss = wl.loss(model, sampler.next())
        scheduler.backward(loss)
        assert scheduler.step(opt)
        opt.zero_grad(set_to_none=True)
    assert scheduler.phase == "planned" and torch.isfinite(loss)
    assert scheduler.step_count == checkpoint["scheduler"]["step"] + 12


def test_a_plan_and_a_profile_saved_before_load_equal_to_themselves_resaved(tmp_path):
    plan = ap.Plan.load(BEFORE / "plan.json")
    plan.save(tmp_path / "plan.json")
    assert ap.Plan.load(tmp_path / "plan.json") == plan
    assert plan.format_counts() and all(lp.reason for lp in plan.layers.values())
    from autoprec.profiling import Profile

    profile = Profile.load(BEFORE / "profile.json")
    assert set(profile.layers) == set(plan.layers) and profile.steps == 2
