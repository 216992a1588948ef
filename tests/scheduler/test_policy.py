"""The precision policy's rules as pure functions: no model, no training run."""

from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.profiling import TensorWatch, WatchReport
from autoprec.changes import PrecisionChange
from autoprec.scheduler.policy import PolicyState, accuracy_promotions, demotions, promotions, saturation_actions, wider_format, window_triggers
from autoprec.scheduler.config import Thresholds

LADDER = [Format.BF16, Format.FP32]
T = Thresholds(overflow=1e-3, underflow=0.25, amax_drift=16.0, stable_windows=2)


def stats(overflow=0.0, underflow=0.0, amax=(1.0,), fmt="int8"):
    """One tensor's window statistics as the watch reports them."""
    return TensorWatch(Format.parse(fmt), "current", 1000, overflow, underflow, tuple(amax), 0)


def report(**layers):
    return WatchReport(1, {fqn: {"activation": s} for fqn, s in layers.items()})


def test_the_ladder_goes_through_bf16_to_fp32_within_the_bounds():
    assert [wider_format(f, LADDER) for f in (Format.INT8, Format.FP8_E4M3, Format.FP16, Format.BF16, Format.FP32)] == [
        Format.BF16, Format.BF16, Format.BF16, Format.FP32, None,
    ]
    assert wider_format(Format.BF16, [Format.BF16]) is None  # max_precision=16: BF16 is the top
    assert wider_format(Format.INT8, [Format.FP32]) is Format.FP32  # no BF16 on this device


def test_a_promotion_remembers_where_the_layer_came_from():
    plan = Plan({"a": "int8", "b": "fp32"})
    changes, state = promotions(plan, {"a": "overflow", "b": "overflow"}, PolicyState(), step=7, ladder=LADDER)
    assert changes == [PrecisionChange(7, "a", Format.INT8, Format.BF16, "overflow")]  # b is at the top already
    assert state.history == {"a": ("int8",)} and state.stable == {"a": 0}


def test_overflow_and_underflow_beyond_the_thresholds_trigger_with_their_reason():
    plan = Plan({"over": "int8", "under": "int8", "fine": "int8"})
    window = report(over=stats(overflow=0.01), under=stats(underflow=0.5), fine=stats(overflow=1e-4, underflow=0.1))
    triggers, counts, _ = window_triggers(plan, ["over", "under", "fine"], window, {"fine": 2}, PolicyState(), T)
    assert triggers == {"over": "1.00% of activation values overflow int8", "under": "50.00% of activation values underflow int8"}
    assert counts["fine"] == {"nonfinite": 2.0, "overflow_activation": 1e-4, "underflow_activation": 0.1}


def test_an_amax_drift_beyond_the_factor_triggers_from_the_second_window_and_never_for_fp32():
    plan = Plan({"a": "int8", "b": "fp32", "c": "int8"})
    first, _, state = window_triggers(plan, ["a", "b", "c"], report(a=stats(amax=(1.0,)), b=stats(amax=(1.0,), fmt="fp32"), c=stats(amax=(1.0,))), {}, PolicyState(), T)
    assert first == {} and state.previous_amax == {"a": 1.0, "b": 1.0, "c": 1.0}
    second, _, state = window_triggers(plan, ["a", "b", "c"], report(a=stats(amax=(20.0,)), b=stats(amax=(20.0,), fmt="fp32"), c=stats(amax=(15.0,))), {}, state, T)
    assert second == {"a": "activation amax drifted 1 -> 20"}  # c moved 15x < 16x; b is FP32
    assert state.previous_amax == {"a": 20.0, "b": 20.0, "c": 15.0}


def test_no_report_means_no_trigger_and_counts_keep_the_nonfinite_steps():
    plan = Plan({"a": "int8"})
    triggers, counts, state = window_triggers(plan, ["a"], None, {"a": 1}, PolicyState(), T)
    assert triggers == {} and counts == {"a": {"nonfinite": 1.0}} and state == PolicyState()


def test_a_quiet_layer_comes_back_after_its_wait_and_the_wait_doubles_each_time():
    plan = Plan({"a": "int8"})
    _, state = promotions(plan, {"a": "overflow"}, PolicyState(), 0, LADDER)
    now = {"a": Format.BF16}
    demoted = []
    for window in range(1, 12):
        changes, state = demotions([], state, window, T.stable_windows, now)
        demoted += changes
        for _ in changes:  # it flaps: promoted again at once
            _, state = promotions(Plan({"a": "int8"}), {"a": "overflow again"}, state, window, LADDER)
    # Waited 2 quiet windows, then 4 (then 8: past the loop).
    assert demoted == [
        PrecisionChange(2, "a", Format.BF16, Format.INT8, "stable for 2 windows"),
        PrecisionChange(6, "a", Format.BF16, Format.INT8, "stable for 4 windows"),
    ]
    assert state.wait == {"a": 8}


def test_a_triggered_window_does_not_count_as_quiet():
    _, state = promotions(Plan({"a": "int8"}), {"a": "overflow"}, PolicyState(), 0, LADDER)
    changes, state = demotions(["a"], state, 1, T.stable_windows, {"a": Format.BF16})
    assert changes == [] and state.stable == {"a": 0}
    changes, state = demotions([], state, 2, T.stable_windows, {"a": Format.BF16})
    assert changes == [] and state.stable == {"a": 1}


def test_policy_state_round_trips_through_its_checkpoint_form():
    _, state = promotions(Plan({"a": "int8"}), {"a": "x"}, PolicyState(previous_amax={"a": 3.0}), 0, LADDER)
    assert PolicyState.from_dict(state.to_dict()) == state


def predicted_plan(losses):
    """A plan whose layers carry the search's predicted loss increase (fqn -> (format, loss))."""
    return Plan({fqn: fmt for fqn, (fmt, _) in losses.items()},
                predicted={"layers": {fqn: {"loss": loss} for fqn, (_, loss) in losses.items()}})


def test_a_measured_increase_over_the_budget_promotes_the_largest_predicted_losses_carrying_the_excess():
    plan = predicted_plan({"a": ("int8", 0.004), "b": ("fp8_e4m3", 0.001), "c": ("bf16", 0.0005), "d": ("fp32", 0.0), "e": ("int8", 0.002)})
    assert accuracy_promotions(plan, increase=0.01, allowed=0.02) == {}  # within the budget
    # Over by 10 %: the excess's share of the predicted total (0.0075) is carried by "a" alone.
    assert list(accuracy_promotions(plan, increase=0.022, allowed=0.02)) == ["a"]
    # Over fourfold: 75 % of the predicted total, "a" then "e"; FP32 never.
    promoted = accuracy_promotions(plan, increase=0.08, allowed=0.02)
    assert list(promoted) == ["a", "e"] and promoted["a"].startswith("measured loss increase 8.00% over the allowed 2.00%")


def test_without_predictions_the_excess_share_of_the_layers_is_promoted_narrowest_first():
    plan = Plan({"a": "bf16", "b": "int8", "c": "fp32", "d": "fp16", "e": "int8"})
    assert list(accuracy_promotions(plan, increase=0.11, allowed=0.1)) == ["b"]  # 9 % over: one of four
    assert list(accuracy_promotions(plan, increase=0.4, allowed=0.1)) == ["b", "e", "a"]  # 75 % over: three


def test_saturation_recalibrates_first_and_promotes_a_layer_saturating_again():
    saturation = {"a": 100.0, "b": 3.9, "c": float("inf"), "d": 6.0}
    recalibrate, promote = saturation_actions(saturation, 4.0, recalibrated=())
    assert set(recalibrate) == {"a", "d"} and not promote  # an inf input is the loss scaler's, 3.9x is within
    assert recalibrate["a"] == "input amax 100x the range its scale covers"
    recalibrate, promote = saturation_actions(saturation, 4.0, recalibrated={"a"})
    assert set(recalibrate) == {"d"} and set(promote) == {"a"}


def test_gradients_alone_out_of_range_take_a_high_precision_backward_where_the_layer_can():
    """A layer whose gradients alone are beyond a threshold keeps its format with FP32 gradients
    (FP8 per tensor, MXFP8, NVFP4); block-scaled FP8 (its kernels take E4M3 gradients only), a
    layer whose forward is out of range too, and one without low-precision gradients go up the ladder."""
    from autoprec.plan import LayerPrecision, Scaling
    from autoprec.scheduler.policy import backward_triggers, takes_high_backward

    plan = Plan({"fp8": "fp8_e4m3", "mx": LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="mx")), "nvfp4": "nvfp4",
                 "block": LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="block")), "both": "fp8_e4m3", "int8": "int8"})
    grad_only = {"grad": stats(underflow=0.9, fmt="fp8_e5m2")}
    window = WatchReport(1, {"fp8": grad_only, "mx": grad_only, "nvfp4": grad_only, "block": grad_only, "int8": {"activation": stats(overflow=0.1)},
                             "both": {"grad": stats(overflow=0.1, fmt="fp8_e5m2"), "activation": stats(overflow=0.1, fmt="fp8_e4m3")}})
    triggers, _, _ = window_triggers(plan, list(plan.layers), window, {}, PolicyState(), T)
    assert set(triggers) == set(plan.layers)
    backward = backward_triggers(triggers, window, T)
    assert backward == {"fp8", "mx", "nvfp4", "block"}
    assert [takes_high_backward(plan.layers[f]) for f in ("fp8", "mx", "nvfp4", "block", "int8")] == [True, True, True, False, False]
    changes, state = promotions(plan, triggers, PolicyState(), step=3, ladder=LADDER, backward=backward)
    by_layer = {c.fqn: c for c in changes}
    for fqn in ("fp8", "mx", "nvfp4"):
        c = by_layer[fqn]
        assert (c.old, c.new, c.old_grad, c.new_grad, c.direction) == (plan.layers[fqn].format, plan.layers[fqn].format, plan.layers[fqn].grad_format,
                                                                         Format.FP32, "promotion"), fqn
        assert state.history[fqn] == (f"grad:{plan.layers[fqn].grad_format.value}",)
    for fqn in ("block", "both", "int8"):
        assert (by_layer[fqn].new, by_layer[fqn].new_grad) == (Format.BF16, None), fqn
    # Quiet, each goes back: the backward to its gradient format, the others to their format.
    current = {fqn: c.new for fqn, c in by_layer.items()}
    grads = {fqn: Format.FP32 if c.backward_only else plan.layers[fqn].grad_format for fqn, c in by_layer.items()}
    back, state = demotions([], state, step=9, stable_windows=1, current=current, grads=grads)
    by_layer_back = {c.fqn: c for c in back}
    assert (by_layer_back["fp8"].old_grad, by_layer_back["fp8"].new_grad, by_layer_back["fp8"].direction) == (Format.FP32, Format.FP8_E5M2, "demotion")
    assert by_layer_back["block"].new is Format.FP8_E4M3 and by_layer_back["block"].new_grad is None
    assert all(not stack for stack in state.history.values())
    assert [PrecisionChange.from_dict(c.to_dict()) for c in changes + back] == changes + back
