"""The scheduler on a pipeline stage used wrongly (issue 58): refused in one line on every stage,
never a deadlock. A schedule of ``torch.distributed.pipelining`` calls each stage's module; the
scheduler bound inside stage 0's first forward and checked the ranks' settings there with an
``all_gather_object`` over the default group, while stage 1 waited in the schedule's receive for
stage 0's activations: both waited until the process group's timeout. Now the bind sees the
schedule on the stack and issues no collective; ``step()``, where every stage arrives after its
schedule step, refuses what does not run there (what does: a fixed plan,
`test_scheduler_pipeline_plan.py`; a plan searched on the stages, `test_scheduler_pipeline_search.py`;
promotions and demotions, `test_scheduler_pipeline_review.py`): a schedule whose loss function bypasses the scheduler (no loss scale, no loss seen; given a plan
or searching one), stages given different plans, stages whose modules are not named
as in the whole model (a split that renumbers its blocks: each would run another layer's
precision), two stages on one rank under two schedulers (each would agree with one peer stage
only), and a stage under no scheduler (its gradients never unscaled)."""

import datetime

import pytest
import torch
import torch.distributed as dist

import autoprec as ap
from autoprec.scheduler.pipeline_stage import LOSS_REFUSAL
from support.gloo_ranks import run
from support.titan_llama import pipeline_stage, titan_llama, token_batch, token_loss

WORLD = 2
MICRO = 2


def refused(rank, kind):
    """One schedule step and ``step()`` on this rank's stage, the default group spanning both
    stages, the scheduler as ``kind`` says: what ``step()`` raises, and whether the ranks can still
    meet in a collective afterwards (nothing left one of them waiting)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    # A hang would show as this test's failure, not CI's timeout.
    dist.barrier()
    plan = ap.Plan.uniform(titan_llama(), "fp16", (token_batch(0)[0],))
    if kind in ("two stages per rank", "a stage without a scheduler"):  # interleaved 1F1B: stages r and r + WORLD of 2 * WORLD
        return looped(rank, plan, schedulers=2 if kind == "two stages per rank" else 1)
    model = pipeline_stage(titan_llama(), rank, WORLD)
    if kind == "renumbered" and rank == 1:  # as a split rebuilding a ModuleList names its blocks
        model.layers = torch.nn.ModuleDict({str(i): block for i, block in enumerate(model.layers.values())})
    if kind == "search, bare loss":
        scheduler = ap.DynamicPrecisionScheduler(model, monitor_window=4, measure_costs=False)
    elif kind == "stage parts":  # each stage its own part, so the ranks' plans differ
        scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan.for_stage(model))
    else:  # "bare loss": the whole plan, the schedule's loss function not through the scheduler
        scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan)
    loss_fn = scheduler.pipeline_loss(token_loss) if kind == "stage parts" else token_loss
    schedule = ScheduleGPipe(PipelineStage(model, rank, WORLD, torch.device("cpu")), n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = token_batch(0)
    with scheduler.precision_context():
        if rank == 0:
            schedule.step(x.contiguous())
        else:
            schedule.step(target=y.contiguous(), losses=[])
    try:
        scheduler.step(opt)
        error = None
    except ap.AutoprecError as exc:
        error = (type(exc).__name__, str(exc))
    flag = torch.ones(1)
    dist.all_reduce(flag)  # both ranks are here: nothing waits on the other
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"error": error, "met": float(flag), "untouched": untouched}


def looped(rank, plan, schedulers):
    """`refused` for two stages on each rank (interleaved 1F1B), the first ``schedulers`` of them
    under a scheduler each (one: the other stage runs the model as it is, unscaled)."""
    import contextlib

    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    ids = (rank, rank + WORLD)
    models = [pipeline_stage(titan_llama(), i, 2 * WORLD) for i in ids]
    models_under = models[:schedulers]
    schedulers = [ap.DynamicPrecisionScheduler.from_plan(model, plan) for model in models_under]
    stages = [PipelineStage(model, i, 2 * WORLD, torch.device("cpu")) for model, i in zip(models, ids)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=schedulers[0].pipeline_loss(token_loss))
    before = [{n: p.detach().clone() for n, p in model.named_parameters()} for model in models]
    x, y = token_batch(0)
    with contextlib.ExitStack() as active:
        for scheduler in schedulers:
            active.enter_context(scheduler.precision_context())
        schedule.step(*([x.contiguous()] if rank == 0 else []), **({"target": y.contiguous(), "losses": []} if rank == WORLD - 1 else {}))
    errors = []
    for scheduler, model in zip(schedulers, models_under):
        try:
            scheduler.step(torch.optim.SGD(model.parameters(), lr=0.1))
            errors.append(None)
        except ap.AutoprecError as exc:
            errors.append((type(exc).__name__, str(exc)))
    flag = torch.ones(1)
    dist.all_reduce(flag)
    untouched = all(torch.equal(p, kept[n]) for model, kept in zip(models, before) for n, p in model.named_parameters())
    return {"error": errors[0], "second stage's error": errors[-1], "met": float(flag), "untouched": untouched}


@pytest.mark.parametrize("kind", ["search, bare loss", "bare loss", "stage parts", "renumbered", "two stages per rank", "a stage without a scheduler"])
def test_what_does_not_run_on_a_pipeline_stage_is_refused_in_one_line_on_every_stage(tmp_path, kind):
    results = run(refused, tmp_path, kind, timeout=datetime.timedelta(seconds=120))
    expected = {"search, bare loss": ("RuntimeStateError", LOSS_REFUSAL), "bare loss": ("RuntimeStateError", LOSS_REFUSAL)}
    for result in results:
        assert result["met"] == WORLD and result["untouched"]
        assert result.get("second stage's error", result["error"]) == result["error"]
        if kind in ("stage parts", "renumbered", "two stages per rank", "a stage without a scheduler"):
            name, message = result["error"]
            said = {"stage parts": "whole model's plan", "renumbered": "both name a layer 'layers.0.", "two stages per rank": "runs 2 stages",
                    "a stage without a scheduler": "no pipeline stage holds the plan's layer"}[kind]
            assert name == "DistributedError" and said in message and "\n" not in message, message
        else:
            assert result["error"] == expected[kind]
    assert "\n" not in LOSS_REFUSAL and "pipeline_loss" in LOSS_REFUSAL
