"""Plans under pipeline parallelism (issue 58): torchtitan's Llama split in stages
(`titan_llama.pipeline_stage`) over 2 gloo CPU ranks, trained by torch.distributed.pipelining's
GPipe and 1F1B schedules (2 stages, one per rank), interleaved 1F1B and the V schedules ZBV and
DualPipeV (4 stages, two per rank, each with its own runtime) with the plan applied to each
stage, against the same plan on the
unsharded model with the same micro-batches accumulated. Before: the stage's metadata inference
on the first ``schedule.step()`` (torch 2.13: a forward on the first micro-batch or on
uninitialised tensors, and a backward; 2.11: a forward on zeros) ran inside ``with runtime:`` and
fed the runtime's state: INT8 calibration observed it, delayed FP8 scaling recorded its amax
(2.13: the first micro-batch's loss 4.899609 against 4.899289, and two runs differed; 2.11: the
same first step, 5.039855 against 5.040692 at the second)."""

import contextlib
import copy
from unittest import mock

import pytest
import torch

import autoprec as ap
from support.gloo_ranks import run
from support.states import same
from support.torch_versions import TORCH
from support.titan_llama import mixed_plan, pipeline_stage, titan_llama, token_batch, token_loss

WORLD = 2
MICRO = 4  # micro-batches per step (2 rows each)
STEPS = 3

# One of each: INT8 calibrated over 6 forwards (frozen in the second step), FP8 with delayed and
# with current scaling, BF16, FP32; cycled over the layers, so each stage holds every kind.
KINDS = (
    ap.LayerPrecision("int8", calibration=ap.Calibration(batches=6)),
    ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(mode="delayed")),
    ap.LayerPrecision("fp8_e4m3"),
    ap.LayerPrecision("bf16"),
    ap.LayerPrecision("fp32"),
)


def trained(models, runtimes, rank, run_step):
    """``STEPS`` SGD steps of ``run_step(x, y)`` (the micro-batches' losses it returns, on the last
    rank) over ``models`` (a rank's stages: their fqns are the whole model's); then the losses, the
    runtimes' state and the parameters."""
    opt = torch.optim.SGD([p for model in models for p in model.parameters()], lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step)
        # Contiguous: torch 2.11's stage checks each micro-batch's strides against the first's.
        losses += run_step(x.contiguous(), y.contiguous())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": {"layers": {fqn: s for runtime in runtimes for fqn, s in runtime.state_dict()["layers"].items()}},
            "params": {n: p.detach().clone() for model in models for n, p in model.named_parameters()}}


def unsharded(plan, rank, backward_in_region):
    """The unsharded model, the micro-batches' gradients accumulated; each backward inside
    ``with runtime:``, where a schedule runs it, or after it, as the README's loop does."""
    model = titan_llama()
    runtime = ap.apply_plan(model, plan)

    def accumulated(x, y):
        losses = []
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with runtime:
                loss = token_loss(model(xm), ym)
                if backward_in_region:
                    (loss / MICRO).backward()
            if not backward_in_region:
                (loss / MICRO).backward()
            losses.append(loss.detach())
        return losses

    return trained([model], [runtime], rank, accumulated)


def pipelined(plan, rank, schedule_name):
    """The pipeline: one stage per rank (GPipe, 1F1B), or two: interleaved 1F1B (rank r holds
    stages r and r + WORLD of 2 * WORLD) or a V schedule (ZBV, DualPipeV: r and 2 * WORLD - 1 - r,
    so the first rank holds the first and the last stage; backwards split in an input and a
    weight pass, each running the stage's products' backward), the plan applied to each stage's
    module, every stage's runtime entered around ``schedule.step()``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleDualPipeV, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    looped = {"interleaved": lambda r: (r, r + WORLD), "zbv": lambda r: (r, 2 * WORLD - 1 - r), "dualpipev": lambda r: (r, 2 * WORLD - 1 - r)}
    total = 2 * WORLD if schedule_name in looped else WORLD
    ids = looped[schedule_name](rank) if schedule_name in looped else (rank,)
    models = [pipeline_stage(titan_llama(), i, total) for i in ids]
    runtimes = [ap.apply_plan(model, plan.for_stage(model)) for model in models]
    stages = [PipelineStage(model, i, total, torch.device("cpu")) for model, i in zip(models, ids)]
    if schedule_name in looped:
        schedule = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule_name](stages, n_microbatches=MICRO, loss_fn=token_loss)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stages[0], n_microbatches=MICRO, loss_fn=token_loss)
    first, last = 0 in ids, total - 1 in ids
    from torch.distributed.pipelining import stage as stage_module

    weight_passes = [0]  # the schedule's separate weight-gradient passes (`stage_backward_weight`)
    real_weight_pass = stage_module.stage_backward_weight

    def counted_weight_pass(*args, **kwargs):
        weight_passes[0] += 1
        return real_weight_pass(*args, **kwargs)

    def step(x, y):
        losses: list = []
        with contextlib.ExitStack() as active:
            for runtime in runtimes:
                active.enter_context(runtime)
            active.enter_context(mock.patch.object(stage_module, "stage_backward_weight", counted_weight_pass))
            schedule.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        return [loss.detach() for loss in losses]

    return {**trained(models, runtimes, rank, step), "weight_passes": weight_passes[0]}


# Torch 2.11's V schedules fail at their first step under gloo with or without a plan, inside
# torch's stage initialisation (`_initialize_stages`'s first batch of sends: "Pair is not
# connected", a plain ZBV of torchtitan's Llama on 2 ranks, torch 2.11.0 CPU); 2.13 runs them.
SCHEDULES = ["gpipe", "1f1b", "interleaved", *(["zbv", "dualpipev"] if TORCH >= (2, 13) else [])]


def scenario(rank):
    plan = mixed_plan(titan_llama(), KINDS)
    out = {"ref": unsharded(plan, rank, backward_in_region=True), "after": unsharded(plan, rank, backward_in_region=False)}
    for name in SCHEDULES:
        out[name] = [pipelined(plan, rank, name) for _ in range(2)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(scenario, tmp_path_factory.mktemp("pp"))


def with_loss(results, schedule):
    """The result of the rank holding the last stage (the last rank; the first under ZBV)."""
    return results[0] if schedule in ("zbv", "dualpipev") else results[-1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_planned_pipeline_trains_as_the_unsharded_model_bit_for_bit(results, schedule):
    # ZBV computes a stage's weight gradients per micro-batch in a pass of their own, after its
    # input gradients, so the products' backward runs in both; the first stage, whose input
    # (token ids) needs no gradient, runs its backward whole: rank 0 holds it and the last stage.
    # DualPipeV splits fewer of them (one a stage and step here).
    split = {"zbv": [MICRO * STEPS, 2 * MICRO * STEPS], "dualpipev": [STEPS, 2 * STEPS]}.get(schedule, [0, 0])
    assert [result[schedule][0]["weight_passes"] for result in results] == split
    last = with_loss(results, schedule)
    assert len(last[schedule][0]["losses"]) == STEPS * MICRO
    # Each micro-batch's loss, over 3 steps (steps 2 and 3 on the weights the pipeline updated).
    assert same(last[schedule][0]["losses"], last["ref"]["losses"]), (
        [float(v) for v in last[schedule][0]["losses"]], [float(v) for v in last["ref"]["losses"]])
    for result in results:
        params = result[schedule][0]["params"]
        assert same(params, {name: result["ref"]["params"][name] for name in params})


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_planned_pipeline_trains_as_the_readmes_loop_within_bf16_backward_rounding(results, schedule):
    # A schedule runs each backward inside `with runtime:`, in its autocast region (as a backward
    # inside torch.autocast), which casts the backward products that FP32 and INT8 layers compute
    # in FP32 after the block to BF16, and changes FP8 layers' gradients too (a BF16-only plan's
    # are the same): 3.6e-4 relative at most over 3 steps.
    last = with_loss(results, schedule)
    assert not same(last["ref"]["losses"], last["after"]["losses"])
    assert [float(v) for v in last[schedule][0]["losses"]] == pytest.approx([float(v) for v in last["after"]["losses"]], rel=1e-3)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_stage_metadata_inference_leaves_calibration_and_histories_as_unsharded(results, schedule):
    for result in results:
        state, ref = result[schedule][0]["state"]["layers"], result["ref"]["state"]["layers"]
        assert state.keys() < ref.keys()  # this stage's INT8 and delayed FP8 layers
        calibrators = [(fqn, key) for fqn in state for key in state[fqn]["calibrators"]]
        histories = [(fqn, key) for fqn in state for key, q in state[fqn]["inputs"].items() if q["history"] is not None]
        assert calibrators and histories
        for fqn in state:
            assert same(state[fqn], ref[fqn]), fqn


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_planned_pipeline_runs_are_identical(results, schedule):
    for result in results:
        first, second = result[schedule]
        assert same(first, second)


@pytest.mark.filterwarnings("ignore::autoprec.EmulationWarning")  # INT8 attention scores: emulated
def test_the_stage_watch_comes_with_the_runtime_and_leaves_with_it():
    import torch.distributed.pipelining  # noqa: F401  (no stage exists before it is imported)

    model = titan_llama(n_layers=2)
    runtime = ap.apply_plan(model, mixed_plan(model, KINDS))
    x = token_batch(0)[0]
    assert not model._forward_pre_hooks
    with runtime:
        model(x)
    assert len(model._forward_pre_hooks) == 1  # registered at the entry, kept between steps
    with torch.no_grad():
        copy.deepcopy(model)(x)  # the copy carries the hook, which leaves the copy's calls alone
    runtime.remove()
    assert not model._forward_pre_hooks
