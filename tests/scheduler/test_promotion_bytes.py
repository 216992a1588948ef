"""Paying for a promotion within the plan's memory budget (`promotion_bytes`): pure functions of a
plan's figures, no model."""

import pytest

from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.scheduler.promotion_bytes import paid_for, repredicted

# Per layer and format: (predicted bytes, predicted loss), as the search's options give them.
OPTIONS = {
    "a": {"int8": (100, 0.010), "bf16": (200, 0.001), "fp32": (400, 0.0)},
    "b": {"int8": (50, 0.004), "bf16": (100, 0.002), "fp32": (200, 0.0)},  # 0.02 loss per byte down to int8
    "c": {"bf16": (100, 0.001), "fp32": (200, 0.0)},  # 1e-5 per byte down to bf16: the cheapest
    "d": {"int8": (300, 0.001), "bf16": (600, 0.0)},  # 3.3e-6 per byte, but promoted before
}
FORMATS = {"a": "int8", "b": "bf16", "c": "fp32", "d": "bf16"}


def plan(memory_bytes=1300.0, loss_budget=1.0, margin=None, options=True):
    layers = {}
    for fqn, fmt in FORMATS.items():
        nbytes, loss = OPTIONS[fqn][fmt]
        row = {"bytes": nbytes, "seconds": 1.0, "loss": loss}
        if options:
            row["options"] = {f: {"bytes": b, "loss": lo} for f, (b, lo) in OPTIONS[fqn].items()}
        layers[fqn] = row
    predicted = {"bytes": sum(r["bytes"] for r in layers.values()), "loss_increase": sum(r["loss"] for r in layers.values()), "layers": layers}
    metadata = {"memory_margin": margin} if margin else {}
    return Plan(dict(FORMATS), budgets={"memory_bytes": memory_bytes, "loss_increase": loss_budget}, predicted=predicted, metadata=metadata)


def test_the_least_loss_per_byte_pays_for_a_promotion_and_a_layer_promoted_before_never_does():
    p = plan()  # 100 + 100 + 200 + 600 = 1000 bytes; a to bf16 adds 100, within 1300
    assert paid_for(p, {"a": Format.BF16}, keep={"d"}, step=7) == ([], 0.0)
    p = plan(memory_bytes=1050.0)  # 50 bytes to pay: c to bf16 frees 100 at 1e-5 per byte
    changes, over = paid_for(p, {"a": Format.BF16}, keep={"d"}, step=7)
    assert [(c.fqn, c.old, c.new, c.step) for c in changes] == [("c", Format.FP32, Format.BF16, 7)] and over == 0.0
    assert "pays for the promotion of a" in changes[0].reason
    changes, _ = paid_for(p, {"a": Format.BF16}, keep=set(), step=7)
    assert [c.fqn for c in changes] == ["d"]  # cheaper still, when the policy did not promote it


def test_the_lowerings_stop_at_the_accuracy_budget_and_the_excess_is_returned():
    p = plan(memory_bytes=950.0)  # a to bf16: 1100 bytes, 150 over
    changes, over = paid_for(p, {"a": Format.BF16}, keep={"d"}, step=0)
    assert [(c.fqn, c.new) for c in changes] == [("c", Format.BF16), ("b", Format.INT8)] and over == 0.0
    # The plan's loss 0.012 - 0.009 (a's promotion) + 0.001 (c) = 0.004: b's +0.002 is over 0.0055.
    changes, over = paid_for(plan(memory_bytes=950.0, loss_budget=0.0055), {"a": Format.BF16}, keep={"d"}, step=0)
    assert [c.fqn for c in changes] == ["c"] and over == pytest.approx(50.0)


def test_the_budget_is_the_one_searched_under_its_learned_margin_included():
    changes, _ = paid_for(plan(memory_bytes=1300.0, margin=1.25), {"a": Format.BF16}, keep={"d"}, step=0)  # 1300 / 1.25 = 1040
    assert [c.fqn for c in changes] == ["c"]


def test_bytes_the_trials_measured_beyond_the_prediction_count_against_the_budget():
    """A plan adopted measured at more bytes than predicted, within its limit: a promotion its
    prediction leaves room for takes it over the limit as measured, so the promotion is paid for.
    Measured at fewer bytes, the prediction alone counts (no room taken from a conservative one)."""
    p = plan(memory_bytes=1150.0)  # a to bf16: 1100 predicted, within 1150
    assert paid_for(p, {"a": Format.BF16}, keep={"d"}, step=0) == ([], 0.0)
    measured = p.replace(measured={"bytes_over_predicted": 120.0})  # adopted at 1120 of 1150 as measured
    changes, over = paid_for(measured, {"a": Format.BF16}, keep={"d"}, step=0)  # 1220 as measured: 70 to pay
    assert [(c.fqn, c.new) for c in changes] == [("c", Format.BF16)] and over == 0.0
    fewer = p.replace(measured={"bytes_over_predicted": -300.0})
    assert paid_for(fewer, {"a": Format.BF16}, keep={"d"}, step=0) == ([], 0.0)
    assert paid_for(plan(memory_bytes=1050.0).replace(measured={"bytes_over_predicted": -300.0}), {"a": Format.BF16}, keep={"d"}, step=0)[0]


def test_a_plan_without_the_searchs_options_is_left_as_promoted_with_its_excess_estimated():
    # a's bytes scaled by the widths: 100 -> 200, so 1100 of 900.
    assert paid_for(plan(memory_bytes=900.0, options=False), {"a": Format.BF16}, keep=set(), step=0) == ([], 200.0)
    assert paid_for(Plan(dict(FORMATS)), {"a": Format.BF16}, keep=set(), step=0) == ([], 0.0)


def test_the_changed_plans_figures_move_with_its_layers():
    old = plan()
    new = old.with_layers({"a": "bf16", "c": "bf16"})
    predicted = repredicted(new, old)
    assert predicted["bytes"] == 1000 + 100 - 100
    assert predicted["loss_increase"] == pytest.approx(0.012 - 0.009 + 0.001)
    assert predicted["layers"]["a"]["bytes"] == 200 and predicted["layers"]["c"]["loss"] == 0.001
    assert old.predicted["bytes"] == 1000  # unchanged


def staged(stage_caps):
    """`plan` as searched on two pipeline stages (`search.stages.joint_plan`'s figures): a and c on
    "stage 0" (100 + 200 bytes), b and d on "stage 1" (100 + 600), one memory budget each."""
    p = plan()
    stage_of = {"a": "stage 0", "c": "stage 0", "b": "stage 1", "d": "stage 1"}
    rows = {fqn: {**row, "stage": stage_of[fqn]} for fqn, row in p.predicted["layers"].items()}
    held = {"stage 0": 300.0, "stage 1": 700.0}
    return p.replace(predicted={**p.predicted, "layers": rows, "bytes_per_stage": held},
                     budgets={**p.budgets, "memory_bytes": sum(stage_caps.values()), "memory_bytes_per_stage": stage_caps})


def test_on_pipeline_stages_a_promotion_is_paid_for_on_its_own_stage():
    """a (stage 0) to bf16 adds 100 bytes on stage 0's device: c, the cheapest per byte and on stage
    0, pays when stage 0 is over its own cap, even with the whole pipeline within the caps' sum;
    with stage 0 within its cap nothing moves, however full stage 1 is. d (stage 1, cheaper per
    byte than b, not promoted before) pays for b on stage 1, never c."""
    changes, over = paid_for(staged({"stage 0": 350.0, "stage 1": 1000.0}), {"a": Format.BF16}, keep=set(), step=3)
    assert [(c.fqn, c.new) for c in changes] == [("c", Format.BF16)] and over == 0.0  # the sum, 1350, would hold all 1100
    assert paid_for(staged({"stage 0": 400.0, "stage 1": 700.0}), {"a": Format.BF16}, keep=set(), step=3) == ([], 0.0)
    changes, _ = paid_for(staged({"stage 0": 300.0, "stage 1": 700.0}), {"b": Format.FP32}, keep=set(), step=3)
    assert [c.fqn for c in changes] == ["d"]
    changes, over = paid_for(staged({"stage 0": 300.0, "stage 1": 700.0}), {"b": Format.FP32}, keep={"d"}, step=3)
    assert changes == [] and over == 100.0  # stage 1 has nothing else to lower; stage 0's c does not pay for it
    repriced = repredicted(staged({"stage 0": 350.0, "stage 1": 1000.0}).with_layers({"a": "bf16"}), staged({"stage 0": 350.0, "stage 1": 1000.0}))
    assert repriced["bytes_per_stage"] == {"stage 0": 400.0, "stage 1": 700.0}
