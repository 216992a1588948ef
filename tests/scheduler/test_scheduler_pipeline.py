"""The scheduler on a pipeline stage (issue 58): refused in one line on every stage, never a
deadlock. A schedule of ``torch.distributed.pipelining`` calls each stage's module; the scheduler
bound inside stage 0's first forward and checked the ranks' settings there with an
``all_gather_object`` over the default group, while stage 1 waited in the schedule's receive for
stage 0's activations: both waited until the process group's timeout. Now the bind sees the
schedule on the stack, issues no collective, and ``step()`` refuses on every stage, each arriving
there after its schedule step."""

import datetime

import pytest
import torch
import torch.distributed as dist

import autoprec as ap
from autoprec.scheduler.step_checks import PIPELINE_REFUSAL
from support.gloo_ranks import run
from support.titan_llama import pipeline_stage, titan_llama, token_batch, token_loss

WORLD = 2
MICRO = 2


def refused(rank, kind):
    """The seed's loop (``kind`` "search") or a fixed plan (``from_plan``) on this rank's stage,
    the default group spanning both stages: what ``step()`` raises, and whether the ranks can
    still meet in a collective afterwards (nothing left one of them waiting)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    # A hang would show as this test's failure, not CI's timeout.
    dist.barrier()
    model = pipeline_stage(titan_llama(), rank, WORLD)
    if kind == "search":
        scheduler = ap.DynamicPrecisionScheduler(model, monitor_window=4, measure_costs=False)
    else:
        full = titan_llama()
        plan = ap.Plan.uniform(full, "bf16", (token_batch(0)[0],))
        names = dict(model.named_modules())
        plan = plan.replace(layers={f: lp for f, lp in plan.layers.items() if f in names},
                            fingerprint={f: info for f, info in plan.fingerprint.items() if f in names})
        scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan)
    schedule = ScheduleGPipe(PipelineStage(model, rank, WORLD, torch.device("cpu")), n_microbatches=MICRO, loss_fn=token_loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
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
    return {"error": error, "met": float(flag)}


@pytest.mark.parametrize("kind", ["search", "from_plan"])
def test_the_scheduler_on_a_pipeline_stage_is_refused_in_one_line_on_every_stage(tmp_path, kind):
    results = run(refused, tmp_path, kind, timeout=datetime.timedelta(seconds=120))
    for result in results:
        assert result["error"] == ("RuntimeStateError", PIPELINE_REFUSAL)
        assert result["met"] == WORLD
    assert "\n" not in PIPELINE_REFUSAL and "apply_plan" in PIPELINE_REFUSAL
