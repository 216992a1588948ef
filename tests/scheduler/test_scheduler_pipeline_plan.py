"""A fixed plan through the scheduler on pipeline stages (issue 58, item 2): the scheduler's loss
scaling, skip decision and step under ``torch.distributed.pipelining`` schedules. Each of 2 gloo
ranks runs one stage of torchtitan's Llama (`titan_llama.pipeline_stage`) under
``DynamicPrecisionScheduler.from_plan(stage, plan)`` with the whole model's plan, the schedule's
loss function through ``scheduler.pipeline_loss``; compared with the same scheduler and plan on the
unsharded model, the same micro-batches accumulated (each backward inside the precision context,
where the schedule runs it, and the sum divided by their count after the last, as the schedule
does: dividing each loss instead rounds FP16 gradients near the bottom of their range otherwise). The plan mixes FP16 (so the loss is scaled: only the last stage sees
it, and the first stage unscales its gradients by the same scale), INT8 calibrating, FP8 delayed
and current, BF16 and FP32. At the second step a gradient on the first stage only is made
non-finite: every stage must skip that step, its weights untouched, and back off the scale alike.
A run checkpointed after that step (weights and scheduler state) resumes on fresh stages exactly;
with ``max_grad_norm`` every stage clips by the whole model's norm (before: its own stage's).
Before: ``step()`` on a stage was refused (the search and the skip decision need the loss, which
only the last stage sees), and a plan applied with ``apply_plan`` had no loss scaling at all."""

import datetime
import io

import pytest
import torch

import autoprec as ap
from support.gloo_ranks import run
from support.titan_llama import pipeline_stage, titan_llama, token_batch, token_loss

WORLD = 2
MICRO = 4  # micro-batches per step (2 rows each)
STEPS = 4
POISONED = 1  # the step whose first-stage gradient is made non-finite
CLIP = 0.1  # max_grad_norm, under the gradients' norm at every step
KINDS = (
    ap.LayerPrecision("fp16"),
    ap.LayerPrecision("int8", calibration=ap.Calibration(batches=6)),
    ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(mode="delayed")),
    ap.LayerPrecision("fp8_e4m3"),
    ap.LayerPrecision("bf16"),
    ap.LayerPrecision("fp32"),
)


def whole_plan(first_stage_fp16: bool = False):
    """`KINDS` cycled over the layers; or FP16 on the first stage's layers and BF16 on the rest
    (``first_stage_fp16``: the last stage, which scales the loss, holds no FP16 layer)."""
    model = titan_llama()
    plan = ap.Plan.uniform(model, "bf16", (token_batch(0)[0],))
    if first_stage_fp16:
        first = dict(pipeline_stage(model, 0, WORLD).named_modules())
        return plan.with_layers({fqn: "fp16" for fqn in plan.layers if fqn in first})
    return plan.with_layers({fqn: KINDS[i % len(KINDS)] for i, fqn in enumerate(plan.layers)})


def poison(model, step_of):
    """Make the first block's first weight gradient non-finite at step `POISONED` (``step_of()``)."""
    weight = next(p for n, p in model.named_parameters() if n.startswith("layers.0."))
    weight.register_hook(lambda g: g * float("inf") if step_of() == POISONED else g)


def trained(model, scheduler, run_step, steps=range(STEPS)):
    """SGD (no state of its own) over ``steps`` of ``run_step(x, y)`` (the losses it returns)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, scales, stepped = [], [], []
    for step in steps:
        x, y = token_batch(step)
        losses += run_step(x.contiguous(), y.contiguous())
        stepped.append(scheduler.step(opt))
        scales.append(scheduler.scaler.get_scale())
        opt.zero_grad(set_to_none=True)
    sent = {kind: dict(counts) for kind, counts in scheduler.distributed.sent.items()} if scheduler.distributed is not None else {}
    return {"losses": [float(v) for v in losses], "scales": scales, "stepped": stepped, "sent": sent,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def unsharded(plan, **settings):
    model = titan_llama()
    scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan, **settings)
    poison(model, lambda: scheduler.step_count)

    def accumulated(x, y):
        losses = []
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with scheduler.precision_context():
                loss = token_loss(model(xm), ym)
                scheduler.backward(loss)
            losses.append(loss.detach())
        for param in model.parameters():  # as the schedule does after its last backward (`scale_grads`)
            param.grad.div_(MICRO)
        return losses

    return trained(model, scheduler, accumulated)


def stage_run(rank, plan, schedule_name, saved=None, **settings):
    """This rank's stage under the scheduler (``settings``) and a schedule: (model, scheduler,
    step function); ``saved``: the (weights, scheduler state) of an earlier run to resume from."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model = pipeline_stage(titan_llama(), rank, WORLD)
    scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan, **settings)
    if saved is not None:
        model.load_state_dict(saved[0])
        scheduler.load_state_dict(saved[1])
    if rank == 0:
        poison(model, lambda: scheduler.step_count)
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(PipelineStage(model, rank, WORLD, torch.device("cpu")), n_microbatches=MICRO, loss_fn=scheduler.pipeline_loss(token_loss))

    def step(x, y):
        losses: list = []
        with scheduler.precision_context():
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        return [loss.detach() for loss in losses]

    return model, scheduler, step


def pipelined(rank, plan, schedule_name, **settings):
    return trained(*stage_run(rank, plan, schedule_name, **settings))


def resumed(rank, plan, at=POISONED + 1):
    """GPipe for ``at`` steps, its weights and scheduler state saved (through bytes, as a
    checkpoint), then a fresh stage and scheduler loading them for the other steps."""
    model, scheduler, step = stage_run(rank, plan, "gpipe")
    before = trained(model, scheduler, step, range(at))
    buffer = io.BytesIO()
    torch.save((model.state_dict(), scheduler.state_dict()), buffer)
    buffer.seek(0)
    after = trained(*stage_run(rank, plan, "gpipe", torch.load(buffer, weights_only=False)), range(at, STEPS))
    sent = {kind: {k: before["sent"][kind][k] + after["sent"][kind][k] for k in before["sent"][kind]} for kind in before["sent"]}
    return {**after, **{k: before[k] + after[k] for k in ("losses", "scales", "stepped")}, "sent": sent}


def scenario(rank):
    plan, fp16_first = whole_plan(), whole_plan(first_stage_fp16=True)
    return {"ref": unsharded(plan), "gpipe": pipelined(rank, plan, "gpipe"), "1f1b": pipelined(rank, plan, "1f1b"), "resumed": resumed(rank, plan),
            "fp16 first: ref": unsharded(fp16_first), "fp16 first: gpipe": pipelined(rank, fp16_first, "gpipe"),
            "clipped: ref": unsharded(plan, max_grad_norm=CLIP), "clipped: gpipe": pipelined(rank, plan, "gpipe", max_grad_norm=CLIP)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(scenario, tmp_path_factory.mktemp("pp_sched"), timeout=datetime.timedelta(seconds=300))


@pytest.mark.parametrize("case", ["gpipe", "1f1b", "fp16 first: gpipe", "resumed"])
def test_a_fixed_plan_on_pipeline_stages_trains_as_on_the_unsharded_model_bit_for_bit(results, case):
    ref = results[0]["fp16 first: ref" if case.startswith("fp16 first") else "ref"]
    first, last = results[0][case], results[1][case]
    # The poisoned step skipped everywhere and the scale backed off alike: the loss scale on
    # (an FP16 layer), the first stage's non-finite gradient seen by the last stage.
    assert ref["stepped"] == [i != POISONED for i in range(STEPS)]
    assert first["stepped"] == last["stepped"] == ref["stepped"]
    assert first["scales"] == last["scales"] == ref["scales"] and ref["scales"][POISONED] == ref["scales"][0] / 2
    # The schedule's losses are the true losses, every micro-batch's, as the unsharded model's.
    assert last["losses"] == ref["losses"] and len(ref["losses"]) == STEPS * MICRO
    for part in (first, last):
        for name, param in part["params"].items():
            assert torch.equal(param, ref["params"][name]), name
    assert set(first["params"]).isdisjoint(last["params"]) and set(first["params"]) | set(last["params"]) == set(ref["params"])
    # The scheduler's own collectives: one all-reduce of the step's flags per step, one gather of
    # the stages at the first (resumed: once more, at the first step after loading).
    for part in (first, last):
        assert part["sent"]["all_reduce"]["calls"] == STEPS
        assert part["sent"]["all_gather_object"]["calls"] == (2 if case == "resumed" else 1)


def test_the_plan_at_the_pipeline_stage_is_its_part_of_the_whole_plan():
    plan = whole_plan()
    stages = [pipeline_stage(titan_llama(), rank, WORLD) for rank in range(WORLD)]
    parts = [plan.for_stage(stage) for stage in stages]
    assert sorted(f for part in parts for f in part.layers) == sorted(plan.layers)
    for part, stage in zip(parts, stages):
        names = dict(stage.named_modules())
        assert part.layers and all(f in names and part.layers[f] == plan.layers[f] for f in part.layers)
    with pytest.raises(ap.PlanError, match="holds none of the plan's"):
        plan.for_stage(torch.nn.Linear(2, 2))


def test_a_pipeline_stage_clips_by_the_whole_models_gradient_norm(results):
    """``max_grad_norm`` on a stage: the norm summed over the stages, as the unsharded model's clip
    takes it (each stage's own norm would scale its gradients by another factor)."""
    ref, unclipped = results[0]["clipped: ref"], results[0]["ref"]
    assert ref["stepped"] == results[0]["clipped: gpipe"]["stepped"] == results[1]["clipped: gpipe"]["stepped"]
    clipped_by = max(float((ref["params"][n] - unclipped["params"][n]).abs().max()) for n in ref["params"])
    assert clipped_by > 1e-3  # the clip acted
    for part in (results[0]["clipped: gpipe"], results[1]["clipped: gpipe"]):
        assert part["sent"]["all_reduce"]["calls"] == 2 * STEPS  # and one for the norm
        for name, param in part["params"].items():
            # The norm summed in another order: rounding, a ten-thousandth of what the clip moved.
            assert float((param - ref["params"][name]).abs().max()) < clipped_by * 1e-4, name
