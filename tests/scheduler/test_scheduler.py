"""DynamicPrecisionScheduler end to end on the built-in LM ("tiny"): lifecycle, loss scaling,
fault injection, promotion / demotion, checkpoints, logging."""

import contextlib
import copy
import dataclasses

import pytest
import torch

from autoprec.errors import RuntimeStateError, SettingsError
from autoprec.formats import Format
from autoprec.changes import PrecisionChange
from autoprec.plan import LayerPrecision, Plan, Scaling
from autoprec.scheduler import DynamicPrecisionScheduler, Thresholds
from autoprec.workloads import default_workload, evaluate
from support.tb_events import accumulator, text_of

WINDOW = 10


def scheduler(**kwargs):
    settings = dict(monitor_window=WINDOW, monitor_steps=5, memory_budget=0.8, accuracy_budget=0.05, measure_costs=False, search_slice=None, max_grad_norm=1.0)
    settings.update(kwargs)
    return DynamicPrecisionScheduler(**settings)


def setup(seed=0):
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(seed)
    return wl, model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(wl, model, opt, sch, steps, sampler=None, fault=None):
    """``steps`` scheduler steps; ``fault(step, model)`` may poison gradients after backward."""
    sampler = sampler if sampler is not None else wl.train_batches(0)
    losses = []
    for _ in range(steps):
        batch = sampler.next()
        with sch.precision_context():
            loss = wl.loss(model, batch)
        sch.backward(loss)
        if fault is not None:
            fault(sch.step_count, model)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def planned():
    wl, model, opt = setup()
    sch = scheduler()
    losses = train(wl, model, opt, sch, WINDOW + 3)
    return wl, model, opt, sch, losses


def test_binds_to_the_outermost_module_and_profiles_first():
    wl, model, opt = setup()
    sch = scheduler()
    assert sch.phase == "unbound"
    train(wl, model, opt, sch, 1)
    assert sch.model is model and sch.phase == "profiling" and sch.plan is None
    assert "blocks.0.attn.qkv" in sch.layers and "blocks.0.attn" in sch.layers  # traced, by operation
    assert not sch.scaler.enabled and sch.scaler.get_scale() == 1.0  # FP32 needs no loss scaling


def test_window_end_searches_a_plan_within_the_memory_budget(planned):
    _, _, _, sch, _ = planned
    assert sch.phase == "planned" and sch.last_search_error is None
    plan = sch.plan
    assert set(plan.layers) == set(sch.layers)
    assert plan.predicted["bytes"] <= 0.8 * plan.predicted["fp32_bytes"]
    assert any(lp.format is not Format.FP32 for lp in plan.layers.values())
    assert all(lp.reason for lp in plan.layers.values())


def test_loss_scaling_follows_the_plan(planned):
    _, _, _, sch, _ = planned
    needs = any(lp.grad_format is Format.FP16 for lp in sch.plan.layers.values())
    assert sch.scaler.enabled == needs
    if needs:
        assert sch.scaler.get_scale() == 4096.0


def test_switching_the_scaler_leaves_no_stale_watch(planned):
    _, model, _, sch, _ = planned
    # An old scaler's hooks would record every forward into a scaler nobody updates (a leak);
    # clean training has no output watch at all (it is armed by a non-finite loss).
    assert all(not dict(model.named_modules())[fqn]._forward_hooks for fqn in sch.layers)


def test_a_nonfinite_loss_arms_the_output_watch_which_names_the_layer_then_a_clean_window_disarms_it():
    wl, model, opt = setup()
    sch = scheduler()
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, WINDOW, sampler)
    modules = dict(model.named_modules())
    other = next(fqn for fqn in sch.layers if fqn != "lm_head")
    bad = {WINDOW, WINDOW + 1}  # step_count during the forward of steps WINDOW + 1 and WINDOW + 2

    def poison_output(module, args, output):
        return output * float("inf") if sch.step_count in bad else output

    modules["lm_head"].register_forward_hook(poison_output)  # before the watch's, so the watch sees it
    train(wl, model, opt, sch, 1, sampler)
    assert sch.scaler.last_loss_finite is False and sch.scaler.first_nonfinite_output is None  # not armed yet
    assert len(modules[other]._forward_hooks) == 1  # armed
    train(wl, model, opt, sch, 1, sampler)
    assert sch.scaler.last_loss_finite is False and sch.scaler.first_nonfinite_output == "lm_head"
    train(wl, model, opt, sch, 2 * WINDOW - 2, sampler)  # the rest of this window, then a clean one
    assert not modules[other]._forward_hooks  # disarmed


def test_planned_steps_run_the_plan(planned):
    wl, model, opt, sch, _ = planned
    lowered = next(fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32)
    module = dict(model.named_modules())[lowered]
    batch = wl.val_batches(1)[0]
    plain = copy.deepcopy(model)  # the copy's wrappers pass through: the plain model
    with torch.no_grad():
        with sch.precision_context():
            assert "_autoprec_active_runtime" in module.__dict__
            planned_loss = wl.loss(model, batch)
        assert "_autoprec_active_runtime" not in module.__dict__
        assert not torch.equal(planned_loss, wl.loss(plain, batch))
        assert torch.equal(wl.loss(model, batch), wl.loss(plain, batch))  # outside: the plain model


def test_the_window_runs_in_bf16_where_the_device_computes_it_natively():
    from autoprec.scheduler.plan_keeper import window_format_for
    from autoprec.scheduler.config import SchedulerConfig

    assert window_format_for(SchedulerConfig(), native_bf16=True) is Format.BF16  # an Ampere-or-newer GPU
    assert window_format_for(SchedulerConfig(), native_bf16=False) is Format.FP32  # a CPU
    assert window_format_for(SchedulerConfig(max_precision=16), native_bf16=False) is Format.BF16  # FP32 out of bounds
    assert window_format_for(SchedulerConfig(formats=("fp32", "fp16", "int8")), native_bf16=True) is Format.FP32  # no BF16 candidate
    assert window_format_for(SchedulerConfig(window_format="fp32"), native_bf16=True) is Format.FP32  # as configured
    with pytest.raises(SettingsError, match=r"window_format='int8'"):
        SchedulerConfig(window_format="int8")


def test_a_bf16_window_is_profiled_sampled_and_searched():
    """The window's layers run BF16; its profiler's hooks are on the model only in every
    ``sample_every``-th step; the search that follows finds a plan."""
    wl, model, opt = setup()
    sch = scheduler(window_format="bf16", sample_every=3)
    module = model.blocks[0].mlp.fc
    seen = {}  # step -> (output dtype, hooks on the layer) of its training forward (binding traces come first)
    module.register_forward_hook(lambda m, args, out: seen.__setitem__(sch.step_count, (out.dtype, len(m._forward_hooks))))
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, WINDOW, sampler)
    assert {seen[step][0] for step in range(1, WINDOW)} == {torch.bfloat16}  # step 0 binds, at FP32
    hooks = [seen[step][1] for step in range(1, WINDOW)]
    assert [step for step, n in enumerate(hooks, 1) if n > min(hooks)] == [3, 6, 9]  # of the window that started at step 0
    while sch.phase == "searching":
        train(wl, model, opt, sch, 1, sampler)
    assert sch.phase == "planned" and sch.plan is not None


def poison(layer, steps):
    def fault(step, model):
        if step in steps:
            dict(model.named_modules())[layer].weight.grad[0, 0] = float("nan")
    return fault


def test_nonfinite_gradient_skips_the_step_and_names_the_layer(planned):
    wl, model, opt, sch, _ = planned
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict()["state"])
    skipped = sch.scaler.skipped_steps
    train(wl, model, opt, sch, 1, fault=poison("lm_head", {sch.step_count}))
    assert sch.scaler.skipped_steps == skipped + 1
    assert sch.scaler.last_nonfinite_layers == ("lm_head",)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state[i]["exp_avg"], s["exp_avg"]) for i, s in opt.state_dict()["state"].items())


def test_fault_injection_skips_names_promotes_then_demotes_and_training_converges():
    wl, model, opt = setup()
    sch = scheduler(thresholds=Thresholds(nonfinite_steps=2, stable_windows=1))
    sampler = wl.train_batches(0)
    first = train(wl, model, opt, sch, WINDOW, sampler)
    target = next(fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32 and fqn != "blocks.0.attn")
    planned = sch.plan.layers[target].format
    bad = {WINDOW + 2, WINDOW + 4}
    skipped = sch.scaler.skipped_steps
    losses = train(wl, model, opt, sch, 3 * WINDOW, sampler, fault=poison(target, bad))
    assert sch.scaler.skipped_steps == skipped + len(bad)
    assert sch.scaler.nonfinite_counts[target] == len(bad)
    promotion, demotion = [c for c in sch.changes if c.fqn == target][:2]
    assert promotion.step == WINDOW + 5 and promotion.old is planned and promotion.new.bits > planned.bits
    assert "non-finite" in promotion.reason
    assert demotion.new is planned and "stable" in demotion.reason  # back after a quiet window
    assert sum(losses[-5:]) / 5 < sum(first[:5]) / 5 - 0.3  # training still converges


def test_a_layer_lowered_again_gets_its_planned_recipe_back_not_its_formats_default():
    # A plan searched offline may give one FP8 layer blocks and another one scale per tensor
    # (`Planning.alternatives`); the scheduler's own FP8 recipe is per tensor. Before, a layer
    # demoted back after a promotion came back per tensor, whatever its plan said.
    wl, model, opt = setup()
    example = wl.train_batches(1).next()[0]
    block = LayerPrecision("fp8_e4m3", scaling=Scaling(granularity="block"))
    target = "blocks.0.mlp.fc"
    plan = Plan.uniform(model, "bf16", example).with_layers({target: block, "blocks.1.mlp.fc": "fp8_e4m3"})
    sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=WINDOW, thresholds=Thresholds(nonfinite_steps=2, stable_windows=1))
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, 3 * WINDOW, sampler, fault=poison(target, {2, 4}))
    promotion, demotion = [c for c in sch.changes if c.fqn == target][:2]
    assert promotion.new.bits > 8 and demotion.new is Format.FP8_E4M3
    assert sch.plan.layers[target].scaling == block.scaling and sch.plan.layers[target].grad_format is Format.FP8_E4M3
    assert sch.plan.layers["blocks.1.mlp.fc"].scaling.granularity.value == "tensor"


def test_amax_drift_promotes_the_layer():
    wl, model, opt = setup()
    sch = scheduler(thresholds=Thresholds(amax_drift=8.0))
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, 2 * WINDOW, sampler)
    # A layer outside every recomputed block: inside one, recomputation frees what it saves in
    # either format, so its promotion would hold no more and need no paying for.
    recomputed = [block for block, on in (sch.plan.blocks or {}).items() if on]
    target = next(fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32 and fqn.endswith("mlp.fc")
                  and not any(fqn.startswith(block + ".") for block in recomputed))
    module = dict(model.named_modules())[target]
    module.register_forward_pre_hook(lambda m, args: (args[0] * 100.0,))
    train(wl, model, opt, sch, WINDOW, sampler)
    reasons = [c.reason for c in sch.changes if c.fqn == target]
    assert reasons and "drifted" in reasons[0]


@pytest.mark.parametrize("budget", [0.8, 0.6])
def test_a_promotion_is_paid_for_within_the_memory_budget(budget):
    # Before: the promoted layers' wider formats took the plan over the budget it was searched
    # under (0.866 of the FP32 bytes at 0.8, 0.637 at 0.6); a tiny Doge of the architecture sweep
    # went from 0.600 to 0.610 when an INT8 layer was promoted for its activations' underflow.
    from support.conformance import saved_bytes

    wl, model, opt = setup()
    sch = scheduler(thresholds=Thresholds(amax_drift=8.0), memory_budget=budget)
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, 2 * WINDOW, sampler)
    batch, loss_fn = wl.train_batches(5).next(), wl.loss
    # A layer outside every recomputed block: inside one, recomputation frees what it saves in
    # either format, so its promotion would hold no more and need no paying for.
    recomputed = [block for block, on in (sch.plan.blocks or {}).items() if on]
    target = next(fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32 and fqn.endswith("mlp.fc")
                  and not any(fqn.startswith(block + ".") for block in recomputed))
    searched = sch.plan
    hook = dict(model.named_modules())[target].register_forward_pre_hook(lambda m, args: (args[0] * 100.0,))
    train(wl, model, opt, sch, WINDOW, sampler)
    hook.remove()
    promoted = {c.fqn for c in sch.changes if c.direction == "promotion"}
    lowered = [c for c in sch.changes if "pays for the promotion" in c.reason]
    assert target in promoted and lowered
    assert all(c.fqn not in promoted and c.new.bits < c.old.bits for c in lowered)
    # The plan's own figures moved with its layers, and stay within the budget it was searched under.
    options = {f: searched.predicted["layers"][f]["options"] for f in promoted}
    assert sch.plan.predicted["bytes"] <= searched.budgets["memory_bytes"] < searched.predicted["bytes"] + sum(
        options[f][sch.plan.layers[f].format.value]["bytes"] - options[f][searched.layers[f].format.value]["bytes"] for f in promoted)
    assert sch.plan.predicted["loss_increase"] <= searched.budgets["loss_increase"]
    planned = saved_bytes(model, batch, sch, loss_fn)
    sch.close()
    assert planned / saved_bytes(model, batch, None, loss_fn) <= budget  # as metered


def test_an_underflow_that_starts_on_an_unsampled_step_is_caught_by_the_next_sampled_one():
    wl, model, opt = setup()
    example = wl.train_batches(1).next()[0]
    plan = Plan.uniform(model, "bf16", example).with_layers({"blocks.0.mlp.fc": "fp16"})
    # Planned from step 0: the watch covers steps 5..9 of each window and samples 5 and 9.
    sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=WINDOW, monitor_steps=5, sample_every=4)
    module = model.blocks[0].mlp.fc
    module.register_forward_pre_hook(lambda m, args: (args[0] * 1e-12,) if sch.step_count >= 6 else None)  # under FP16's subnormals from step 6
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, 9, sampler)
    assert sch.changes == []  # steps 6, 7, 8 underflow unseen
    train(wl, model, opt, sch, 1, sampler)  # step 9, sampled; the window's end reviews it
    change = next(c for c in sch.changes if c.fqn == "blocks.0.mlp.fc")
    assert change.step == WINDOW and change.old is Format.FP16 and "activation values underflow fp16" in change.reason


class _GradientsMostlyTiny(torch.autograd.Function):
    """Identity forward; the backward keeps the first output channel's gradient and scales the
    rest by 1e-9, so a per-tensor FP8 cast of it underflows almost everywhere."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        scale = torch.full_like(g, 1e-9)
        scale[..., 0] = 1.0
        return g * scale


@pytest.mark.parametrize("split", [False, True], ids=["fp8", "fp8-wgrad-fp32"])
def test_gradients_alone_out_of_range_give_the_layer_a_high_precision_backward_then_it_comes_back(split):
    """An FP8 layer whose output gradients underflow E4M3 while its inputs and weights do not:
    the review keeps its FP8 forward and gives it an FP32-gradient backward (no bytes added, no
    other layer lowered); once quiet it takes its E4M3 gradients back, in its planned recipe (with
    ``split``, its weight gradient's product in high precision again)."""
    wl, model, opt = setup()
    example = wl.train_batches(1).next()[0]
    target = "blocks.0.mlp.fc"
    fp8 = LayerPrecision("fp8_e4m3", grad_format="fp8_e4m3", high_precision_weight_grad=split)
    plan = Plan.uniform(model, "bf16", example).with_layers({target: fp8})
    sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=WINDOW, monitor_steps=5,
                                              thresholds=Thresholds(stable_windows=1))
    # On the next layer's input: the gradient reaching the target's output (where the watch reads it) is the tiny one.
    hook = model.blocks[0].mlp.proj.register_forward_pre_hook(lambda m, args: (_GradientsMostlyTiny.apply(args[0]),))
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, WINDOW, sampler)
    [change] = sch.changes
    assert (change.fqn, change.old, change.new, change.old_grad, change.new_grad) == (target, Format.FP8_E4M3, Format.FP8_E4M3, Format.FP8_E4M3, Format.FP32)
    assert change.direction == "promotion" and "grad values underflow fp8_e4m3" in change.reason
    now = sch.plan.layers[target]
    assert (now.format, now.grad_format, now.scaling) == (Format.FP8_E4M3, Format.FP32, fp8.scaling)
    assert {fqn: lp.format for fqn, lp in sch.plan.layers.items()} == {fqn: lp.format for fqn, lp in plan.layers.items()}
    hook.remove()
    train(wl, model, opt, sch, 2 * WINDOW, sampler)
    back = sch.changes[1]
    assert (back.old_grad, back.new_grad, back.direction) == (Format.FP32, Format.FP8_E4M3, "demotion") and "stable" in back.reason
    assert dataclasses.replace(sch.plan.layers[target], reason="") == fp8
    assert PrecisionChange.from_dict(change.to_dict()) == change


def run_with_checkpoint(stop, total):
    """Losses of a run of ``total`` steps, saved and resumed into fresh objects after ``stop``."""
    wl, model, opt = setup()
    sch = scheduler()
    sampler = wl.train_batches(0)
    losses = train(wl, model, opt, sch, stop, sampler)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sch": sch.state_dict()})
    sch.close()
    _, model, opt = setup(seed=1)  # other weights: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sch = scheduler(model=model)
    sch.load_state_dict(saved["sch"])
    return losses + train(wl, model, opt, sch, total - stop, sampler), sch


@pytest.mark.slow
@pytest.mark.parametrize("stop", [WINDOW // 2, WINDOW + WINDOW // 2 + 3])
def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(stop):
    wl, model, opt = setup()
    sch = scheduler()
    reference = train(wl, model, opt, sch, 2 * WINDOW + 4)
    resumed, restored = run_with_checkpoint(stop, 2 * WINDOW + 4)
    assert resumed == reference
    assert restored.plan == sch.plan and restored.scaler.get_scale() == sch.scaler.get_scale()


def test_fixed_plan_runs_unchanged(tmp_path):
    wl, model, opt = setup()
    plan = Plan.uniform(model, Format.FP8_E4M3, wl.val_batches(1)[0][0])
    path = plan.save(tmp_path / "plan.json")
    sch = DynamicPrecisionScheduler.from_plan(model, path, monitor_window=WINDOW)
    losses = train(wl, model, opt, sch, 2 * WINDOW)
    assert sch.plan == plan and not sch.changes
    assert not sch.scaler.enabled and sch.scaler.get_scale() == 1.0  # E5M2 gradients carry their own scale
    assert losses[-1] < losses[0]


def test_plan_for_another_model_is_refused_on_the_first_forward():
    from autoprec.errors import PlanError

    wl, model, opt = setup()
    other = Plan({"encoder.dense": "bf16"})
    sch = DynamicPrecisionScheduler.from_plan(model, other)
    with pytest.raises(PlanError, match="encoder.dense"):
        train(wl, model, opt, sch, 1)
    assert sch.phase == "unbound" and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_two_optimizers_and_gradient_accumulation():
    wl, model, _ = setup()
    head = list(model.lm_head.parameters())
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    opts = [torch.optim.AdamW(rest, lr=3e-3), torch.optim.SGD(head, lr=0.1)]
    sch = scheduler()
    sampler = wl.train_batches(0)
    for _ in range(WINDOW + 2):
        for _ in range(2):  # two micro-batches per step, each a plain .backward() of the scaled loss
            with sch.precision_context():
                loss = wl.loss(model, sampler.next()) / 2
            sch.scale(loss).backward()
        assert sch.step(*opts)
        for o in opts:
            o.zero_grad()
    assert sch.step_count == WINDOW + 2 and sch.plan is not None
    assert evaluate(model, wl.val_batches(2)) < 5.0


def test_training_run_is_logged_for_tensorboard(tmp_path):
    wl, model, opt = setup()
    sch = scheduler(log_dir=str(tmp_path), thresholds=Thresholds(nonfinite_steps=1))
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, WINDOW, sampler)
    target = next(fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32 and not fqn.endswith(".attn"))
    train(wl, model, opt, sch, WINDOW, sampler, fault=poison(target, {WINDOW + 1}))
    sch.close()
    acc = accumulator(tmp_path / "train")
    assert len(acc.Scalars("train/loss_scale")) == 2 * WINDOW
    assert f"format/{target}" in acc.Tags()["scalars"]
    assert target in text_of(acc, "precision/timeline")
    assert "memory/measured_bytes" in acc.Tags()["scalars"]
    assert f"grad/{target}" in acc.Tags()["histograms"]
    assert any(tag.startswith("nonfinite/") for tag in acc.Tags()["scalars"])
    assert acc.Images("train/timeline")[-1].step == acc.Scalars("train/loss_scale")[-1].step  # the figure of the whole run


def test_infeasible_budget_keeps_the_safe_precision_and_says_the_smallest(caplog):
    wl, model, opt = setup()
    sch = scheduler(memory_budget=0.1)
    losses = train(wl, model, opt, sch, 2 * WINDOW + 2)
    assert sch.plan is None and sch.phase == "safe"
    assert sum("search failed" in r.message for r in caplog.records) == 1  # not retried every window
    assert "smallest reachable" in sch.last_search_error and "of the FP32 bytes" in sch.last_search_error
    assert losses[-1] < losses[0]


def test_bad_settings_name_the_argument():
    with pytest.raises(SettingsError, match="monitor_window"):
        DynamicPrecisionScheduler(monitor_window=0)
    with pytest.raises(SettingsError, match="4, 8, 16 or 32"):
        DynamicPrecisionScheduler(min_precision=12)


def test_step_before_any_forward_is_refused():
    _, _, opt = setup()
    with pytest.raises(RuntimeStateError, match="precision_context"):
        scheduler().step(opt)


def test_micro_batches_reusing_weights_give_the_same_gradients_and_step_is_refused_inside():
    wl, model, _ = setup()
    batches = [wl.train_batches(0).next() for _ in range(3)]
    plan = Plan.uniform(model, Format.FP8_E4M3, batches[0][0])
    grads = {}
    for reuse in (False, True):
        trained = copy.deepcopy(model)
        sch = DynamicPrecisionScheduler.from_plan(trained, plan, measure_costs=False, search_slice=None)
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        with torch.no_grad(), sch.precision_context():  # binds: the plan's runtime exists from here
            wl.loss(trained, batches[0])
        with sch.reusing_weights() if reuse else contextlib.nullcontext():
            for batch in batches:
                with sch.precision_context():
                    loss = wl.loss(trained, batch) / len(batches)
                sch.backward(loss)
            kept = [q._kept for layer in sch._plans.runtime._layers.values() for q in layer.weights.values()]
            assert bool(kept) and all(k is not None for k in kept) == reuse
            if reuse:
                with pytest.raises(RuntimeStateError, match="inside reusing_weights"):
                    sch.step(opt)
        grads[reuse] = [p.grad.clone() for p in trained.parameters()]
        assert sch.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_an_evaluation_between_steps_leaves_the_window_and_the_search_alone():
    """A no-grad forward under `precision_context` after every step (a validation loop) is not a
    training step: the window's metered bytes and the spread search (measured candidates, whose
    memory check the metered bytes anchor) come out as without it."""
    runs = {}
    for evaluating in (False, True):
        wl, model, opt = setup()
        sch = scheduler(monitor_window=4, monitor_steps=2, measure_costs=True, search_slice=1.0)
        sampler, held = wl.train_batches(0), wl.val_batches(1)[0]
        phases = []
        while sch.phase in ("unbound", "profiling", "searching") and sch.step_count < 100:
            train(wl, model, opt, sch, 1, sampler)
            phases.append(sch.phase)
            if evaluating:
                with torch.no_grad(), sch.precision_context():
                    wl.loss(model, held)
        runs[evaluating] = (sch.phase, sch.last_search_error, sch._measures.measured_bytes, phases.count("searching") > 1)
    # The search ran over several steps, each followed by an evaluation; the number of its trial
    # steps follows measured times, so it is not compared.
    assert runs[True] == runs[False] == ("planned", None, runs[False][2], True)


def test_an_all_fp32_plan_recomputing_blocks_runs_them_recomputed():
    """A plan of FP32 layers whose blocks are recomputed (what the search returns when
    recomputation alone meets the memory budget) needs its runtime: it used to be dropped as
    "all FP32", and the blocks kept every activation."""
    wl, model, opt = setup()
    plan = Plan.uniform(model, Format.FP32, wl.train_batches(0).next()[0]).with_recompute(["blocks.0"])
    sch = DynamicPrecisionScheduler.from_plan(model, plan)
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, 1, sampler)  # binds: its forward runs at FP32, traced
    calls = {"blocks.0": 0, "blocks.1": 0}
    modules = dict(model.named_modules())
    hooks = [modules[f"{fqn}.mlp"].register_forward_pre_hook(lambda m, a, fqn=fqn: calls.__setitem__(fqn, calls[fqn] + 1)) for fqn in calls]
    train(wl, model, opt, sch, 1, sampler)
    for h in hooks:
        h.remove()
    sch.close()
    assert calls == {"blocks.0": 2, "blocks.1": 1}  # the recomputed block's forward ran again in the backward
