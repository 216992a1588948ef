"""The seed's loop on pipeline stages (issue 58, items 2-3): ``DynamicPrecisionScheduler(stage)``
with no plan on each of 2 gloo ranks, one stage of torchtitan's Llama each
(`titan_llama.pipeline_stage`), the schedule's loss through ``scheduler.pipeline_loss``. The first
window profiles each stage; at its end every stage measures its own layers (its captured call and
the gradient the schedule brought to its output) and rank 0 plans for both: one plan, the same on
every rank, in force on both stages from the next step.

What could be wrong and is checked here: the ranks holding different plans, a plan missing a
stage's layers, a plan over its memory budget, the sensitivity a stage estimates differing from
the one the whole model gives for the same micro-batch (the stage sees only the gradient at its
output, not the loss), the planned steps training otherwise than the unsharded model under the
same plan, a checkpoint of a planned stage not resuming its plan, and a budget no plan meets
leaving the ranks apart. Before: ``step()`` on a stage without a plan was refused (the search
needed the loss and every layer on one rank)."""

import datetime
import io

import pytest
import torch

import autoprec as ap
from autoprec.calls import ModelCall
from autoprec.formats import Format
from autoprec.search.pipeline import search_estimator
from autoprec.sensitivity import estimate_sensitivity
from autoprec.sensitivity.capture import LinearisedLoss
from support.gloo_ranks import run
from support.titan_llama import pipeline_stage, titan_llama, token_batch, token_loss, two_stage_step

WORLD = 2
MICRO = 4  # micro-batches per step (2 rows each)
WINDOW = 4  # the profiling window: the plan is in force from step WINDOW on
STEPS = 7
SAVED_AT = WINDOW + 1  # the resumed run's checkpoint
LR = 0.1
# Formats alone (recomputing the blocks is cheaper than any format on this CPU's roofline): the
# "recompute" case below searches the blocks too.
SETTINGS = {"monitor_window": WINDOW, "memory_budget": 0.75, "measure_costs": False, "formats": ("fp32", "bf16", "fp8_e4m3", "int8"), "recompute": []}


def stage_run(rank, schedule_name, saved=None, **settings):
    """This rank's stage under a searching scheduler and a schedule; ``saved``: (weights,
    scheduler state, optimizer state) to resume from."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model = pipeline_stage(titan_llama(), rank, WORLD)
    scheduler = ap.DynamicPrecisionScheduler(model, **{**SETTINGS, **settings})
    if saved is not None:
        model.load_state_dict(saved[0])
        scheduler.load_state_dict(saved[1])
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(PipelineStage(model, rank, WORLD, torch.device("cpu")), n_microbatches=MICRO, loss_fn=scheduler.pipeline_loss(token_loss))
    return model, scheduler, schedule


def trained(rank, model, scheduler, schedule, steps, lr=LR, nonfinite_at=None):
    """``nonfinite_at``: a step after the plan at which the lowered linear layer of stage 1 whose
    promotion adds the most predicted bytes gets an inf gradient (the promoted case)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, phases, hook = [], [], None
    for step in steps:
        if step == nonfinite_at and rank == 1:
            lowered = [f for f, lp in scheduler.plan.for_stage(model).layers.items() if lp.format is not Format.FP32 and hasattr(model.get_submodule(f), "weight")]
            fqn = max(lowered, key=lambda f: promotion_bytes(scheduler.plan, f))
            hook = model.get_submodule(fqn).weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        losses.append(two_stage_step(scheduler, schedule, rank, step))
        if hook is not None:
            hook = hook.remove()
        scheduler.step(opt)
        opt.zero_grad(set_to_none=True)
        phases.append(scheduler.phase)
    whole = scheduler.searched_plan
    return {"losses": losses, "phases": phases, "whole": None if whole is None else whole.to_dict(),
            "plan": None if scheduler.plan is None else scheduler.plan.to_dict(),
            "part": None if scheduler.plan is None else sorted(scheduler.plan.for_stage(model).layers), "error": scheduler.last_search_error,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "changes": [(c.step, c.fqn, c.old.value, c.new.value, c.reason) for c in scheduler.changes]}


def promotion_bytes(plan, fqn):
    """The predicted bytes ``fqn`` adds to its stage when promoted one step (8-bit to BF16, BF16 to FP32)."""
    options, fmt = plan.predicted["layers"][fqn]["options"], plan.layers[fqn].format
    return options["bf16" if fmt.bits < 16 else "fp32"]["bytes"] - options[fmt.value]["bytes"]


def resumed(rank):
    """GPipe to `SAVED_AT`, weights and scheduler state through bytes, then fresh ones to the end."""
    model, scheduler, schedule = stage_run(rank, "gpipe")
    before = trained(rank, model, scheduler, schedule, range(SAVED_AT))
    buffer = io.BytesIO()
    torch.save((model.state_dict(), scheduler.state_dict()), buffer)
    buffer.seek(0)
    after = trained(rank, *stage_run(rank, "gpipe", torch.load(buffer, weights_only=False)), range(SAVED_AT, STEPS))
    return {**after, "losses": before["losses"] + after["losses"], "phases": before["phases"] + after["phases"]}


def scenario(rank):
    return {"gpipe": trained(rank, *stage_run(rank, "gpipe"), range(STEPS)), "1f1b": trained(rank, *stage_run(rank, "1f1b"), range(STEPS)),
            "frozen": trained(rank, *stage_run(rank, "gpipe"), range(WINDOW), lr=0.0), "resumed": resumed(rank),
            "recompute": trained(rank, *stage_run(rank, "gpipe", recompute=None, memory_budget=0.5), range(STEPS)), "infeasible": trained(rank, *stage_run(rank, "gpipe", memory_budget=0.05), range(WINDOW + 1)),
            "promoted": trained(rank, *stage_run(rank, "gpipe", thresholds=ap.Thresholds(nonfinite_steps=1)), range(WINDOW + 2),
                                nonfinite_at=WINDOW)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(scenario, tmp_path_factory.mktemp("pp_search"), timeout=datetime.timedelta(seconds=300))


def micro_batches(step):
    x, y = token_batch(step)
    return zip(x.chunk(MICRO), y.chunk(MICRO))


def unsharded(plan, steps=range(STEPS)):
    """The whole model trained as the pipeline trains it: FP32 through the window (micro-batches
    accumulated, the sum divided by their count), ``plan`` under `from_plan` after it. Returns the
    losses per step, the weights, and the window's last micro-batch (its call and the gradient
    at the logits) as the stages captured it."""
    model = titan_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler, losses, kept = None, [], {}
    for step in steps:
        if step == WINDOW:
            scheduler = ap.DynamicPrecisionScheduler.from_plan(model, plan)
        per_step = []
        for xm, ym in micro_batches(step):
            if scheduler is None:
                logits = model(xm)
                if step == WINDOW - 1:
                    kept["call"] = ModelCall.capture((xm,), {})
                    logits.register_hook(lambda g: kept.__setitem__("grad", g.detach().clone()))
                loss = token_loss(logits, ym)
                loss.backward()
            else:
                with scheduler.precision_context():
                    loss = token_loss(model(xm), ym)
                    scheduler.backward(loss)
            per_step.append(float(loss))
        for param in model.parameters():
            param.grad.div_(MICRO)
        if scheduler is None:
            opt.step()
        else:
            scheduler.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(per_step)
        if step == WINDOW - 1:
            kept["model"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, kept


@pytest.mark.parametrize("case", ["gpipe", "1f1b", "resumed"])
def test_the_stages_search_one_plan_in_force_on_every_stage_from_the_windows_end(results, case):
    first, last = results[0][case], results[1][case]
    assert first["error"] is None and last["error"] is None
    assert first["phases"] == last["phases"] == ["profiling"] * (WINDOW - 1) + ["planned"] * (STEPS - WINDOW + 1)
    assert first["whole"] is not None and first["whole"] == last["whole"]
    whole = ap.Plan.from_dict(first["whole"])
    # The plan in force is the searched one, the whole pipeline's on both ranks (each stage runs
    # its part of it: the losses below); every layer is on one stage.
    assert first["plan"] == last["plan"] == first["whole"]
    assert set(first["part"]) | set(last["part"]) == set(whole.layers) and not set(first["part"]) & set(last["part"])
    assert set(whole.layers) == set(ap.Plan.uniform(titan_llama(), "fp32", (token_batch(0)[0],)).layers)
    # Within the memory budget on each stage's device, 0.75 of that stage's FP32 bytes, and
    # lowered to meet it.
    held, allowed = whole.predicted["bytes_per_stage"], whole.budgets["memory_bytes_per_stage"]
    assert set(held) == set(allowed) == {"stage 0", "stage 1"}
    for stage in held:
        assert held[stage] <= allowed[stage]
    assert sum(held.values()) == pytest.approx(whole.predicted["bytes"]) and sum(allowed.values()) == whole.budgets["memory_bytes"]
    assert whole.budgets["memory_bytes"] == pytest.approx(0.75 * whole.predicted["fp32_bytes"])
    assert len(whole.format_counts()) > 1 and whole.format_counts().get("fp32", 0) < len(whole.layers)
    assert whole.metadata["pipeline_stages"] == WORLD
    # The baseline loss is the last stage's window, which stage 0 never saw.
    window_losses = [v for step in last["losses"][:WINDOW] for v in step]
    assert whole.budgets["baseline_loss"] == pytest.approx(sum(window_losses) / len(window_losses), rel=1e-6)


def test_a_stages_sensitivity_is_the_whole_models_for_the_same_micro_batch(results):
    """Stage 0 sees no loss, only the gradient stage 1 sends back: its layers' predicted loss
    increases must still be those the whole model gives on the window's last micro-batch. Run with
    the weights unchanged (learning rate 0): a stage measures its layers after the window's last
    update on the call and gradient captured before it, where the whole model would recompute
    the stage's input and the gradient after it, which moves BF16's and FP8's rounding errors by
    a few percent (at lr 1e-5: up to 15 %) and is no error of the stage's."""
    whole = ap.Plan.from_dict(results[0]["frozen"]["whole"])
    model = titan_llama()
    call, kept = None, {}
    for xm, _ in micro_batches(WINDOW - 1):
        call = ModelCall.capture((xm,), {})
    logits = model(call.args[0])
    logits.register_hook(lambda g: kept.__setitem__("grad", g.detach().clone()))
    token_loss(logits, list(micro_batches(WINDOW - 1))[-1][1]).backward()
    model.zero_grad(set_to_none=True)
    lowered = [Format.parse(f) for f in SETTINGS["formats"] if f != "fp32"]
    estimate = estimate_sensitivity(model, [(call, [(0, kept["grad"])])], LinearisedLoss(), lowered, layers=list(whole.layers),
                                    example_inputs=call, estimator=search_estimator(1e-3, upstream=False))
    first_stage, compared = set(results[0]["frozen"]["part"]), {True: 0, False: 0}
    for fqn, figures in whole.predicted["layers"].items():
        for name, option in figures["options"].items():
            if name != "fp32":
                assert option["loss"] == pytest.approx(max(0.0, float(estimate[(fqn, Format.parse(name))])), rel=1e-4, abs=1e-15), (fqn, name)
                compared[fqn in first_stage] += 1
    assert compared[True] >= 2 * len(first_stage) and compared[False] >= 2 * (len(whole.layers) - len(first_stage))


def test_the_stages_search_recomputes_blocks_on_each_stage_with_the_formats(results):
    """torchtitan's blocks (a ModuleDict, so a split keeps their names) searched for recomputation
    with the formats, per stage, under a tighter budget."""
    first, last = results[0]["recompute"], results[1]["recompute"]
    assert first["error"] is None and first["whole"] == last["whole"]
    whole = ap.Plan.from_dict(first["whole"])
    assert set(whole.blocks) == {f"layers.{i}" for i in range(4)}
    assert any(on for name, on in whole.blocks.items() if name in ("layers.0", "layers.1"))  # stage 0
    assert any(on for name, on in whole.blocks.items() if name in ("layers.2", "layers.3"))  # stage 1
    held, allowed = whole.predicted["bytes_per_stage"], whole.budgets["memory_bytes_per_stage"]
    assert all(held[s] <= allowed[s] for s in held)


@pytest.mark.parametrize("case", ["gpipe", "1f1b", "resumed", "recompute"])
def test_the_planned_pipeline_trains_as_the_unsharded_model_under_its_plan(results, case):
    whole = ap.Plan.from_dict(results[0][case]["whole"])
    losses, _ = unsharded(whole)
    # Bit for bit, the window at FP32 and the plan after it; and the plan is in force: FP32 on
    # would give other losses.
    assert results[1][case]["losses"] == losses
    if whole.format_counts() != {"fp32": len(whole.layers)}:
        fp32_on, _ = unsharded(ap.Plan.uniform(titan_llama(), "fp32", (token_batch(0)[0],)))
        assert fp32_on[:WINDOW] == losses[:WINDOW] and all(a != b for a, b in zip(fp32_on[WINDOW:], losses[WINDOW:]))


def four_ranks(rank):
    """On 4 ranks: 4 stages, one block each (GPipe); then 2 stages, each fully sharded (FSDP2) over
    2 data-parallel ranks as torchtitan composes them (1F1B, the ``("pp", "dp")`` mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    out = {}
    for case, stages, dp_size in (("4 stages", 4, 1), ("2 stages x FSDP2 2", 2, 2)):
        mesh = init_device_mesh("cpu", (stages, dp_size), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        model = pipeline_stage(titan_llama(), pp, stages)
        if dp_size > 1:
            for module in (*model.layers.values(), model):
                fully_shard(module, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=None))
        scheduler = ap.DynamicPrecisionScheduler(model, **SETTINGS)
        schedule_cls = ScheduleGPipe if dp_size == 1 else Schedule1F1B
        schedule = schedule_cls(PipelineStage(model, pp, stages, torch.device("cpu"), group=mesh["pp"].get_group()), n_microbatches=MICRO,
                                loss_fn=scheduler.pipeline_loss(token_loss))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, phases = [], []
        for step in range(STEPS):
            x, y = token_batch(step, dp, dp_size)
            got: list = []
            with scheduler.precision_context():
                if pp == 0:
                    schedule.step(x.contiguous())
                elif pp == stages - 1:
                    schedule.step(target=y.contiguous(), losses=got)
                else:
                    schedule.step()
            scheduler.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append([float(v) for v in got])
            phases.append(scheduler.phase)
        out[case] = {"losses": losses, "phases": phases, "whole": scheduler.searched_plan.to_dict(), "part": sorted(scheduler.plan.for_stage(model).layers),
                     "last": pp == stages - 1}
        scheduler.close()
    return out


@pytest.fixture(scope="module")
def on_four(tmp_path_factory):
    return run(four_ranks, tmp_path_factory.mktemp("pp_search_4"), world=4, timeout=datetime.timedelta(seconds=300))


@pytest.mark.parametrize("case", ["4 stages", "2 stages x FSDP2 2"])
def test_on_four_ranks_every_stage_and_data_parallel_copy_holds_one_plan(on_four, case):
    ranks = [r[case] for r in on_four]
    whole = ap.Plan.from_dict(ranks[0]["whole"])
    assert all(r["whole"] == ranks[0]["whole"] for r in ranks)
    assert all(r["phases"] == ["profiling"] * (WINDOW - 1) + ["planned"] * (STEPS - WINDOW + 1) for r in ranks)
    assert set().union(*(r["part"] for r in ranks)) == set(whole.layers) and len(whole.format_counts()) > 1
    held, allowed = whole.predicted["bytes_per_stage"], whole.budgets["memory_bytes_per_stage"]
    assert len(held) == (4 if case == "4 stages" else 2) and all(held[s] <= allowed[s] for s in held)
    # The baseline: every micro-batch loss of the window, on every data-parallel copy of the last stage.
    window = [v for r in ranks if r["last"] for step in r["losses"][:WINDOW] for v in step]
    assert len(window) == WINDOW * MICRO * (1 if case == "4 stages" else 2)
    assert whole.budgets["baseline_loss"] == pytest.approx(sum(window) / len(window), rel=1e-6)
    if case == "4 stages":  # bit for bit the unsharded model under the plan, as on 2 stages
        assert ranks[-1]["losses"] == unsharded(whole)[0]


def test_a_budget_no_plan_meets_is_one_error_on_every_stage_which_keep_training_safe(results):
    first, last = results[0]["infeasible"], results[1]["infeasible"]
    assert first["error"] == last["error"] and "no plan meets the budgets: stage " in first["error"] and "over its memory budget" in first["error"]
    assert first["phases"][-1] == last["phases"][-1] == "safe" and first["whole"] is None
    assert all(len(step) == MICRO for step in last["losses"])


def test_a_searched_plan_is_promoted_on_every_stage_and_paid_for_on_its_own(results):
    """An inf gradient in a lowered layer of stage 1 at the first planned step: the step flags name
    it on both ranks, which promote it alike at once. Its bytes are paid for by lowering stage-1
    layers exactly when they take stage 1 over its own cap (each stage's device holds its own
    budget: one budget over the pipeline would take them unpaid while stage 0 has room), and each
    stage stays within its cap. (Whether the searched plan leaves stage 1 that room varies with the
    solver's time limit under load: both ways are checked.)"""
    first, last = results[0]["promoted"], results[1]["promoted"]
    assert first["changes"] == last["changes"] and first["plan"] == last["plan"]
    whole, now = ap.Plan.from_dict(first["whole"]), ap.Plan.from_dict(first["plan"])
    promoted = [(fqn, old, new) for step, fqn, old, new, why in first["changes"] if "non-finite" in why]
    assert len(promoted) == 1 and promoted[0][0] in last["part"] and whole.layers[promoted[0][0]].format.value == promoted[0][1]
    assert now.layers[promoted[0][0]].format.bits > whole.layers[promoted[0][0]].format.bits
    stage_of = {fqn: row["stage"] for fqn, row in whole.predicted["layers"].items()}
    paying = [fqn for step, fqn, old, new, why in first["changes"] if "pays for the promotion" in why]
    assert all(stage_of[fqn] == "stage 1" for fqn in paying)
    over = whole.predicted["bytes_per_stage"]["stage 1"] + promotion_bytes(whole, promoted[0][0]) > whole.budgets["memory_bytes_per_stage"]["stage 1"]
    assert bool(paying) == over
    held, caps = now.predicted["bytes_per_stage"], now.budgets["memory_bytes_per_stage"]
    assert held["stage 0"] == whole.predicted["bytes_per_stage"]["stage 0"] and all(held[s] <= caps[s] for s in caps)
