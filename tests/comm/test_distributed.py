"""DynamicPrecisionScheduler under torch.distributed: 2 gloo CPU ranks (torch.multiprocessing.spawn)
with DDP and FSDP2; one plan, one skip decision, promotions at one step, DCP resume, comm volume."""

import pathlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autoprec as ap
from autoprec.comm import CommMethod
from autoprec.coverage import find_layers
from autoprec.distributed import grad_comm_methods, plan_hash
from autoprec.scheduler import DynamicPrecisionScheduler
import autoprec.scheduler.search_steps as search_steps
import autoprec.scheduler.window_measures as window_measures
from support.graphs import graph_tensors
from support.titan_llama import titan_llama, token_batch
from support.data_parallel import SETTINGS, WINDOW, WORLD, batch, dcp_load, dcp_save, make_model, run, train, wrapped


# -- gradient communication precision (no process group needed) ---------------------------------


def test_grad_comm_auto_takes_the_plans_own_choice_and_a_named_method_every_layer():
    config = ap.SchedulerConfig(grad_comm="auto", accuracy_budget=0.05)
    half = ap.Plan.uniform(make_model(), ap.Format.BF16)
    chosen = half.with_comm({"0": "int8", "2": "bf16"})
    assert grad_comm_methods(config, half) == (CommMethod.FP32, {})  # not chosen yet: FP32
    assert grad_comm_methods(config, chosen) == (CommMethod.FP32, {"0": CommMethod.INT8, "2": CommMethod.BF16})
    assert grad_comm_methods(config, None) == (CommMethod.FP32, {})  # profiling: no plan yet
    assert grad_comm_methods(ap.SchedulerConfig(grad_comm="fp16"), chosen) == (CommMethod.FP16, {})  # the run's named method wins


def test_an_unknown_grad_comm_is_refused_naming_the_setting():
    with pytest.raises(ap.SettingsError, match=r"grad_comm='int4'.*'fp32', 'bf16', 'fp16', 'int8', 'powersgd', 'topk', 'auto'"):
        ap.SchedulerConfig(grad_comm="int4")


# -- DDP: one plan, one skip decision, promotions at one step, comm volume ---------------------------

INF_STEP = 9  # after the search (step 4): the plan is in force, so promotions can follow


def ddp_scenario(rank, world, tmp):
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(**SETTINGS)

    def fault(step, loss):  # an inf loss on rank 1 only
        return loss * float("inf") if step == INF_STEP and rank == 1 else loss

    counts = []
    steps = train(ddp, sch, opt, 14, rank, world, fault=fault, counts=counts)
    planned_graphs = graph_tensors()  # between planned steps, after a search and a promotion
    result = {
        "steps": steps, "counts": counts, "plan": sch.searched_plan.to_dict(), "hash": plan_hash(sch.plan),
        "changes": [c.to_dict() for c in sch.changes],
        "layers": sch.layers, "params": {k: v.detach() for k, v in model.named_parameters()},
    }
    sch.close()
    return {**result, "graph_tensors": (planned_graphs, graph_tensors())}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return run(ddp_scenario, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
def test_ddp_ranks_search_one_plan(ddp_run):
    r0, r1 = ddp_run
    assert r0["plan"] == r1["plan"] and r0["hash"] == r1["hash"]
    assert any(layer["format"] != "fp32" for layer in r0["plan"]["layers"].values()), "the search lowered nothing: nothing to agree on"


@pytest.mark.slow
def test_inf_on_rank_1_skips_the_step_on_both_ranks_and_names_it(ddp_run):
    for result in ddp_run:
        loss, stepped, unchanged, why = result["steps"][INF_STEP]
        assert not stepped and unchanged
        assert all(s[1] for i, s in enumerate(result["steps"]) if i != INF_STEP)
        assert why == ddp_run[0]["steps"][INF_STEP][3]  # one verdict, word for word, on both ranks
        assert "non-finite loss on rank 1" in why and "rank 0" not in why
        assert any(f"non-finite gradients in {fqn} on rank 1" in why for fqn in result["layers"])


@pytest.mark.slow
def test_promotions_happen_at_the_same_step_on_every_rank(ddp_run):
    r0, r1 = ddp_run
    promoted = [c for c in r0["changes"] if c["step"] == INF_STEP + 1]
    assert promoted, "the non-finite step promoted no layer"
    assert r0["changes"] == r1["changes"]
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name


@pytest.mark.slow
def test_no_rank_keeps_an_autograd_graph_after_the_search_or_close(ddp_run):
    assert [result["graph_tensors"] for result in ddp_run] == [(0, 0)] * WORLD


@pytest.mark.slow
def test_one_small_all_reduce_per_step_outside_window_ends(ddp_run):
    """The step's flags, one all-reduce; on a planned check step (`scheduler.plan_checks`: every
    ``sample_every``-th of a window) also the check's figures: the measured loss increase and
    reference loss (two FP32 values) and the saturation peaks (one FP32 value per layer at most)."""
    counts, layers = ddp_run[0]["counts"], ddp_run[0]["layers"]
    window_ends = {WINDOW * k - 1 for k in range(1, 5)}
    checks = 0
    for step, calls in enumerate(counts):
        if step not in window_ends:
            assert calls[0] == 8 * (1 + 2 + 2 * len(layers)), (step, calls)  # optimizer, loss, layers, outputs, lossy comm
            assert len(calls) <= 3 and all(c <= 4 * max(2, len(layers)) for c in calls[1:]), (step, calls)
            checks += len(calls) > 1
        else:
            assert len(calls) > 1, (step, calls)  # the window's statistics are reduced too
    assert checks  # the plan in force was checked


def comm_scenario(rank, world, tmp):
    """Per grad_comm: whether every all-reduced gradient is a BF16 value after one backward."""
    out = {}
    for comm in ("fp32", "bf16"):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        sch = DynamicPrecisionScheduler.from_plan(ddp, ap.Plan.uniform(make_model(), ap.Format.BF16), **{**SETTINGS, "grad_comm": comm})
        x, y = batch(0, rank, world)
        with sch.precision_context():
            loss = nn.functional.cross_entropy(ddp(x).float(), y)
        sch.backward(loss)
        out[comm] = all(torch.equal(p.grad, p.grad.bfloat16().float()) for p in model.parameters())
    return out


@pytest.mark.slow
def test_grad_comm_bf16_all_reduces_through_torchs_bf16_hook(tmp_path):
    for result in run(comm_scenario, tmp_path):
        assert result == {"fp32": False, "bf16": True}


# -- 2 ranks vs 1 rank on the same global batch ----------------------------------------------------


def curve_scenario(rank, world, tmp):
    model = make_model()
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(**SETTINGS)
    return [s[0] for s in train(net, sch, opt, 24, rank, world)]


@pytest.mark.slow
def test_two_ranks_track_one_rank_within_the_accuracy_budget(tmp_path):
    one = run(curve_scenario, tmp_path / "one", world=1)[0]
    two = run(curve_scenario, tmp_path / "two")
    global_two = [(a + b) / 2 for a, b in zip(*two)]  # the mean over equal halves of the global batch
    last_one, last_two = sum(one[-4:]) / 4, sum(global_two[-4:]) / 4
    assert last_two < global_two[0] * 0.95 and last_one < one[0] * 0.95  # both learned
    assert abs(last_two - last_one) / last_one <= SETTINGS["accuracy_budget"]


# -- DCP checkpoints -------------------------------------------------------------------------------


def resume_scenario(rank, world, tmp, kind="ddp", settings=SETTINGS):
    def fresh():
        model = make_model()
        ddp = wrapped(model, kind)
        return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-3), DynamicPrecisionScheduler(**settings)

    def whole(model):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.named_parameters()}

    model, ddp, opt, sch = fresh()
    straight = train(ddp, sch, opt, 12, rank, world)
    reference = whole(model)

    model, ddp, opt, sch = fresh()
    first = train(ddp, sch, opt, 6, rank, world)
    phase = sch.phase
    dcp_save(ddp, opt, sch, f"{tmp}/ckpt")
    model, ddp, opt, sch = fresh()
    dcp_load(ddp, opt, sch, f"{tmp}/ckpt")
    second = train(ddp, sch, opt, 6, rank, world, start=6)
    return {"straight": straight, "resumed": first + second, "reference": reference, "params": whole(model), "plan": sch.plan and sch.plan.to_dict(),
            "saved_in": phase}


def fsdp_resume_scenario(rank, world, tmp):
    return resume_scenario(rank, world, tmp, "fsdp2")


def fsdp_mid_search_resume_scenario(rank, world, tmp):
    """Saved while the search spreads its work over training steps: every rank gathers the snapshot again."""
    return resume_scenario(rank, world, tmp, "fsdp2", {**SETTINGS, "search_slice": 0.25})


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [resume_scenario, fsdp_resume_scenario, fsdp_mid_search_resume_scenario], ids=["ddp", "fsdp2", "fsdp2-mid-search"])
def test_dcp_resume_continues_bit_identically(tmp_path, scenario):
    results = run(scenario, tmp_path)
    if scenario is fsdp_mid_search_resume_scenario:
        assert results[0]["saved_in"] == "searching"
    for result in results:
        assert [s[0] for s in result["resumed"]] == [s[0] for s in result["straight"]]
        for name, value in result["reference"].items():
            assert torch.equal(result["params"][name], value), name


class SeenSaturation:
    """A runtime's `saturation` as a rank saw it: some layers only on some ranks."""

    def __init__(self, peaks):
        self.peaks = peaks

    def saturation(self, steps):
        return {fqn: torch.tensor(v) for fqn, v in self.peaks.items()}


def checks_scenario(rank, world, tmp):
    from autoprec.distributed import RankAgreement
    from autoprec.scheduler.plan_checks import PlanChecks

    model = make_model()
    plan = ap.Plan.uniform(model, ap.Format.BF16)
    config = ap.SchedulerConfig(**SETTINGS)
    agreement = RankAgreement.join(config, model, list(plan.layers))
    # Rank 0 has a frozen INT8 calibration's ratio for layer 0, rank 1 none yet (its layer not
    # run): before, rank 0 issued one all-reduce more than rank 1, and they paired up wrongly.
    seen = SeenSaturation({"0": 1.5, "2": 0.5} if rank == 0 else {"2": 0.75})
    first = PlanChecks(config).read(seen, plan, agreement).saturation
    dist.barrier()
    return first


@pytest.mark.slow
def test_ranks_that_saw_different_layers_saturate_reduce_the_checks_alike(tmp_path):
    r0, r1 = run(checks_scenario, tmp_path)
    assert r0 == r1 == {"0": 1.5, "2": 0.75}


# -- FSDP2 -----------------------------------------------------------------------------------------

FSDP_PLAN = {"0": ap.Format.BF16, "2": ap.Format.FP32, "4": ap.Format.BF16}
# FP8 and INT8 layers quantize the all-gathered weight, which FSDP2 copies into storage it frees
# and re-allocates each step with the version counter preserved: a copy kept across steps would
# train on the first step's weights (issue 20).
FSDP_LOW_PLAN = {"0": ap.Format.FP8_E4M3, "2": ap.Format.INT8, "4": ap.Format.BF16}


def fsdp_scenario(rank, world, tmp, formats=FSDP_PLAN):
    results = {}
    for kind in ("fsdp2", "ddp"):
        model = make_model()
        plan = ap.Plan({fqn: ap.LayerPrecision(fmt) for fqn, fmt in formats.items()})
        net = wrapped(model, kind)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
        sch = DynamicPrecisionScheduler.from_plan(net, plan, **SETTINGS)
        gathered = []  # bytes of every all-gather FSDP2 issues (torch 2.13: all_gather_single, 2.11: all_gather_into_tensor)
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        real = getattr(dist, name)
        setattr(dist, name, lambda out, inp, *a, **k: (gathered.append(inp.numel() * inp.element_size()), real(out, inp, *a, **k))[1])
        try:
            steps = train(net, sch, opt, 1, rank, world)
            gathered.clear()  # the plan is bound during the first forward: its FP8 gathers start after that step
            steps += train(net, sch, opt, 5, rank, world, start=1)
        finally:
            setattr(dist, name, real)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.named_parameters()}
        fp8 = sch.fp8_all_gather
        results[kind] = {"steps": steps, "params": full, "hash": plan_hash(sch.plan), "gathered": sorted(set(gathered)),
                         "fp8": None if fp8 is None else (fp8.enabled, dict(fp8.sent))}
        sch.close()
        if fp8 is not None:
            results[kind]["after_close"] = fp8.enabled
    return results


def fsdp_low_scenario(rank, world, tmp):
    return fsdp_scenario(rank, world, tmp, FSDP_LOW_PLAN)


@pytest.mark.slow
@pytest.mark.parametrize("scenario, world", [(fsdp_scenario, 2), (fsdp_low_scenario, 2), (fsdp_low_scenario, 1)], ids=["bf16-fp32", "fp8-int8", "fp8-int8-one-rank"])
def test_fsdp2_trains_a_plan_like_ddp(tmp_path, scenario, world):
    """Under the FP8 plan the FP8 layer's weight is all-gathered in FP8 (one scale agreed over
    the ranks, so the same E4M3 values as DDP's layer quantizing its whole weight): the same
    training, a quarter of that weight's bytes on the wire. One rank under ``fully_shard`` (the
    GPU session's case: one GPU, NCCL) gathers in FP8 too, with no amax all-reduce."""
    for result in run(scenario, tmp_path, world=world):
        fsdp, ddp = result["fsdp2"], result["ddp"]
        assert all(s[1] for s in fsdp["steps"])
        assert fsdp["steps"][-1][0] < fsdp["steps"][0][0]
        for name, value in ddp["params"].items():
            torch.testing.assert_close(fsdp["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
        enabled, sent = fsdp["fp8"]
        assert fsdp["after_close"] == 0  # close() gives FSDP2 back its own gathers
        # make_model's units: 32->64, 64->64, 64->8 linears, each gathered as its weight and
        # bias (FP32, 4 bytes a value; FP8, 1), this rank sending its share.
        fp32_units = [(32 * 64 + 64) * 4 // world, (64 * 64 + 64) * 4 // world, (64 * 8 + 8) * 4 // world]
        if scenario is fsdp_low_scenario:
            agreements = sent["fp8_values"] // (32 * 64 // world) if world > 1 else 0  # one per gather of the FP8 weight
            assert enabled == 1 and sent["fp8_values"] > 0 and sent.get("all_reduce", 0) == agreements
            # a quarter of layer 0's weight bytes; one rank copies its shard in, sending nothing
            assert fsdp["gathered"] == (sorted([(32 * 64 * 1 + 64 * 4) // world, *fp32_units[1:]]) if world > 1 else [])
        else:
            assert enabled == 0 and not sent
            assert fsdp["gathered"] == sorted(fp32_units)


def fsdp_dynamic_scenario(rank, world, tmp):
    model = make_model()
    net = wrapped(model, "fsdp2")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    plan = ap.Plan({fqn: ap.LayerPrecision(fmt) for fqn, fmt in FSDP_PLAN.items()})
    sch = DynamicPrecisionScheduler.from_plan(net, plan, dynamic=True, **SETTINGS)

    def fault(step, loss):
        return loss * float("inf") if step == 5 and rank == 1 else loss

    return {"steps": train(net, sch, opt, 8, rank, world, fault=fault), "changes": [c.to_dict() for c in sch.changes]}


@pytest.mark.slow
def test_fsdp2_skips_on_every_rank_and_promotes_at_one_step(tmp_path):
    r0, r1 = run(fsdp_dynamic_scenario, tmp_path)
    for result in (r0, r1):
        assert [s[1] for s in result["steps"]] == [i != 5 for i in range(8)]
        assert result["steps"][5][2] and "non-finite loss on rank 1" in result["steps"][5][3]
    assert r0["changes"] and r0["changes"] == r1["changes"]
    assert {c["step"] for c in r0["changes"]} == {6}


def fsdp_watch_scenario(rank, world, tmp):
    """A given plan re-planned under fully_shard, watched on every step of 4-step windows, the
    input of block 2's attention scaled 64-fold after the first window (an amax drift)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = titan_llama()
    for module in (*model.layers.values(), model):
        fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=None))
    plan = ap.Plan.uniform(titan_llama(), "bf16", (token_batch(0)[0],))
    sch = DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=4, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(9):
        if step == 4:
            with torch.no_grad():
                dict(model.named_parameters())["layers.2.attention_norm.weight"].mul_(64.0)
        x, y = token_batch(step, rank, world)
        with sch.precision_context():
            sch.backward(nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
    return {"steps": sch.step_count, "changes": [(c.step, c.fqn, c.old.value, c.new.value) for c in sch.changes]}


@pytest.mark.slow
def test_fsdp2_watches_a_given_plans_windows_and_promotes_on_every_rank(tmp_path):
    """The planned window's watch was made inside the first forward (a given plan binds there),
    while FSDP2 held the unsharded weights, and kept them: at the window's end it read a weight
    whose storage FSDP2 had freed, and both ranks died of a segmentation fault. Now it reads each
    module's weights when it samples them (the local shards between steps)."""
    r0, r1 = run(fsdp_watch_scenario, tmp_path)
    assert r0["steps"] == r1["steps"] == 9 and r0["changes"] == r1["changes"]
    drifted = {fqn for step, fqn, old, new in r0["changes"] if step == 8 and (old, new) == ("bf16", "fp32")}
    assert {"layers.2.attention.wq", "layers.2.attention.wk", "layers.2.attention.wv"} <= drifted


def fsdp_search_scenario(rank, world, tmp):
    """The seed's loop under fully_shard: a scheduler with no plan, an inf loss on rank 1 after the search."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    # The last layer stays in the root's unit, as GPT-2's embeddings and head do: FSDP2 registers
    # its unsharded parameters during the forward, so a profiler that kept the ones it saw at
    # bind read freed storage at the first step.
    for fqn in ("0", "2"):
        fully_shard(model.get_submodule(fqn))
    net = fully_shard(model)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(**SETTINGS)

    def fault(step, loss):
        return loss * float("inf") if step == INF_STEP and rank == 1 else loss

    steps = train(net, sch, opt, 14, rank, world, fault=fault)
    full = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    return {"steps": steps, "plan": sch.searched_plan.to_dict() if sch.searched_plan is not None else None, "hash": plan_hash(sch.plan),
            "phase": sch.phase, "params": full, "error": sch.last_search_error}


@pytest.mark.slow
def test_fsdp2_searches_one_plan_in_the_run_on_every_rank_and_skips_everywhere(tmp_path, ddp_run):
    r0, r1 = run(fsdp_search_scenario, tmp_path)
    assert r0["error"] is None and r0["phase"] == "planned", r0["error"]
    assert r0["plan"] == r1["plan"] and r0["hash"] == r1["hash"]
    assert any(layer["format"] != "fp32" for layer in r0["plan"]["layers"].values())
    # Which plan wins is the trial steps' timing (as under DDP): not compared with DDP's here.
    assert set(r0["plan"]["layers"]) == set(ddp_run[0]["plan"]["layers"])
    for result in (r0, r1):
        assert [s[1] for s in result["steps"]] == [i != INF_STEP for i in range(14)]
        assert result["steps"][INF_STEP][2] and "non-finite loss on rank 1" in result["steps"][INF_STEP][3]
        assert sum(s[0] for s in result["steps"][-3:]) < sum(s[0] for s in result["steps"][:3])
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name


def first_forward_error(model, plan, rank, world):
    """The `DistributedError` message binding ``plan`` on ``model`` raises, or None."""
    sch = DynamicPrecisionScheduler.from_plan(model, plan, **SETTINGS)
    try:
        with sch.precision_context():
            model(batch(0, rank, world)[0])
    except ap.DistributedError as exc:
        return str(exc)
    return None


def fsdp_policy_scenario(rank, world, tmp):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = fully_shard(make_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return first_forward_error(model, ap.Plan.uniform(make_model(), ap.Format.BF16), rank, world)


@pytest.mark.slow
def test_fsdp2_param_dtype_policy_is_refused_in_one_line(tmp_path):
    for message in run(fsdp_policy_scenario, tmp_path):
        assert message is not None and "\n" not in message
        assert "param_dtype=None" in message


def mismatch_scenario(rank, world, tmp):
    plan = ap.Plan.uniform(make_model(), ap.Format.BF16 if rank == 0 else ap.Format.FP32)
    return first_forward_error(nn.parallel.DistributedDataParallel(make_model()), plan, rank, world)


@pytest.mark.slow
def test_a_rank_with_another_plan_is_named_on_every_rank(tmp_path):
    for message in run(mismatch_scenario, tmp_path):
        assert message is not None and message.startswith("rank 1 holds another")


# -- recomputed blocks under DDP and FSDP2 -----------------------------------------------------


class _Block(nn.Module):
    runs = 0  # forwards of any block in this process, recomputations included

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(0.1)

    def forward(self, x):
        _Block.runs += 1
        return x + self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))


class _BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


RECOMPUTE_PLANS = {
    "bf16-fp32": {"fc1": ap.Format.BF16, "fc2": ap.Format.FP32},
    "fp8-int8": {"fc1": ap.Format.FP8_E4M3, "fc2": ap.Format.INT8},
}


def recompute_scenario(rank, world, tmp, formats):
    from torch.distributed.fsdp import fully_shard

    results = {}
    for kind in ("fsdp2", "ddp"):
        for recompute in (False, True):
            torch.manual_seed(0)
            model = _BlockNet()
            layers = {f"blocks.{i}.{name}": ap.LayerPrecision(fmt) for i in range(2) for name, fmt in formats.items()}
            plan = ap.Plan({**layers, "head": ap.LayerPrecision(ap.Format.BF16)})
            if recompute:
                plan = plan.with_recompute(["blocks.0", "blocks.1"])
            if kind == "fsdp2":
                for block in model.blocks:
                    fully_shard(block)
                net = fully_shard(model)
            else:
                net = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
            sch = DynamicPrecisionScheduler.from_plan(net, plan, **SETTINGS)
            torch.manual_seed(100 + rank)  # the same dropout masks with and without recomputation
            runs = _Block.runs
            steps = train(net, sch, opt, 4, rank, world)
            full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.named_parameters()}
            results[(kind, recompute)] = {"steps": steps, "params": full, "runs": _Block.runs - runs}
    return results


def recompute_bf16_scenario(rank, world, tmp):
    return recompute_scenario(rank, world, tmp, RECOMPUTE_PLANS["bf16-fp32"])


def recompute_low_scenario(rank, world, tmp):
    return recompute_scenario(rank, world, tmp, RECOMPUTE_PLANS["fp8-int8"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [recompute_bf16_scenario, recompute_low_scenario], ids=list(RECOMPUTE_PLANS))
def test_recomputed_blocks_train_bit_for_bit_like_stored_ones_under_ddp_and_fsdp2(tmp_path, scenario):
    # Checkpointed blocks under FSDP2 (each block sharded, its recomputation after the backward's
    # all-gather) and DDP: the same losses and, after 4 AdamW steps with dropout, the same weights
    # bit for bit as the blocks keeping their activations (the recomputation replays the forward's
    # RNG and its FP8 / INT8 scales).
    for result in run(scenario, tmp_path):
        for kind in ("fsdp2", "ddp"):
            kept, recomputed = result[(kind, False)], result[(kind, True)]
            assert all(s[1] for s in recomputed["steps"]), kind
            assert recomputed["runs"] == kept["runs"] + 2 * 4, kind  # each block once more per step: recomputed
            assert [s[0] for s in recomputed["steps"]] == [s[0] for s in kept["steps"]], kind
            for name, value in kept["params"].items():
                assert torch.equal(recomputed["params"][name], value), (kind, name)


# -- the seed's loop under FSDP2 with blocks and recomputation, 2 and 4 ranks (issue 58) ----------


def fsdp_blocks_search_scenario(rank, world, tmp):
    """The seed's loop as a new FSDP2 user writes it around a Llama laid out like torchtitan's
    (`titan_llama`): each block and the root under ``fully_shard`` with
    ``MixedPrecisionPolicy(param_dtype=None)``, recomputation on (the default), costs measured
    (the search's probe and trial steps run its candidates), until the plan has been in force for
    3 steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = titan_llama()
    policy = MixedPrecisionPolicy(param_dtype=None)
    for block in model.layers.values():
        fully_shard(block, mp_policy=policy)
    net = fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sch = DynamicPrecisionScheduler(monitor_window=WINDOW, monitor_steps=2, memory_budget=0.8, accuracy_budget=0.05, search_timeout_s=30.0)
    steps, planned = [], 0
    for step in range(160):  # the window, 6 probe steps, the off-path work after them, up to 3 rounds of candidates
        x, y = token_batch(step, rank, world)
        with sch.precision_context():
            loss = nn.functional.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
        sch.backward(loss)
        steps.append((loss.item(), sch.step(opt)))
        opt.zero_grad(set_to_none=True)
        planned += sch.phase == "planned"
        if planned == 3 or sch.last_search_error is not None:
            break
    full = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    return {"steps": steps, "plan": sch.plan.to_dict() if sch.plan is not None else None, "phase": sch.phase, "params": full,
            "error": sch.last_search_error, "planned": planned}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_blocks_with_recomputation_reach_one_plan_on_every_rank(tmp_path, world):
    results = run(fsdp_blocks_search_scenario, tmp_path, world=world)
    first = results[0]
    assert first["error"] is None and first["planned"] == 3, first["error"]
    # The blocks are searched for recomputation (torchtitan's ModuleDict: before, none was found,
    # so this test ran formats only); the budget is met by formats, recomputation or both.
    assert set(first["plan"]["blocks"]) == {f"layers.{i}" for i in range(4)}
    assert any(layer["format"] != "fp32" for layer in first["plan"]["layers"].values()) or any(first["plan"]["blocks"].values())
    for result in results[1:]:
        assert result["plan"] == first["plan"] and result["phase"] == "planned"
        assert [s[1] for s in result["steps"]] == [s[1] for s in first["steps"]]  # every skip agreed
        for name, value in first["params"].items():
            assert torch.equal(value, result["params"][name]), name


# -- the search's memory rounds under torch.distributed ---------------------------------------------


class MeterShared(search_steps.SavedTensorMeter):
    """A meter on which a share (``kept``) of what the FP32 step saves stays whatever the plan, as
    on a tensor-parallel rank whose replicated FP32 parts no plan lowers (docs/distributed.md): the
    safe step measures as predicted, every plan's bytes lie on one line through it, and the
    candidates proposed at the budget's edge measure over it."""

    LOWERED = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8}
    kept = 0.3
    fp32_bytes = 0  # the safe step's, metered first

    @property
    def total_bytes(self) -> int:
        saved = super().total_bytes
        if not any(s.dtype in self.LOWERED for s in self.saved):
            type(self).fp32_bytes = saved
            return saved
        return int(saved + self.kept * (self.fp32_bytes - saved))


def rounds_scenario(rank, world, tmp):
    search_steps.SavedTensorMeter = window_measures.SavedTensorMeter = MeterShared  # this spawned rank's modules
    kept = pathlib.Path(tmp) / "kept"
    MeterShared.kept = float(kept.read_text()) if kept.exists() else MeterShared.kept
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(**{**SETTINGS, "measure_costs": True, "memory_budget": 0.65, "formats": ("fp32", "bf16", "fp8_e4m3")})
    # The times of a device where BF16 runs in half FP32's time and FP8 between them: the first
    # round's candidates are the fastest plans, at the budget's edge, on every machine. Measured
    # here (FP8 emulated, BF16 arithmetic on some CPUs only) a smaller plan, with room under the
    # budget, was in the first round on some runs.
    known = {"rest": 1e-3}
    for role in {info.role(fqn) for fqn, info in find_layers(model, torch.zeros(256, 32)).items()}:
        for fmt, seconds in (("fp32", 2e-3), ("bf16", 1e-3), ("fp8_e4m3", 1.5e-3)):
            known[f"{role}|{fmt}"], known[f"forward|{role}|{fmt}"] = seconds, seconds / 3
    sch._searches.load_known_times(known)
    for step in range(60):
        # 256 rows a rank: activations outweigh the weights, so formats span the budget.
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(256, 32, generator=g), torch.randint(0, 8, (256,), generator=g)
        with sch.precision_context():
            loss = nn.functional.cross_entropy(ddp(x).float(), y)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        if sch.plan is not None or sch.last_search_error is not None:
            break
    plan = sch.plan
    result = {"plan": None if plan is None else plan.to_dict(), "error": sch.last_search_error, "step": sch.step_count,
              "params": {k: v.detach() for k, v in model.named_parameters()}}
    sch.close()
    return result


@pytest.mark.slow
def test_a_round_of_candidates_all_over_the_memory_budget_is_followed_by_rank_0s_next_round_on_every_rank(tmp_path):
    # Before: under torch.distributed the search stopped after one round ("every candidate plan
    # failed on the training steps"); alone it proposed the next round under the learned margin.
    r0, r1 = run(rounds_scenario, tmp_path)
    assert r0["error"] is None, r0["error"]
    measured = r0["plan"]["measured"]
    assert measured["rounds"] >= 2, measured["candidates"]
    assert all(c["dropped"].startswith("measured") for c in measured["candidates"] if c["round"] < measured["rounds"] - 1)
    assert r0["plan"]["metadata"]["memory_margin"] > 1.0
    assert r1["plan"] == r0["plan"] and r1["step"] == r0["step"]  # one plan, in force at one step on every rank
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name


@pytest.mark.slow
def test_a_margin_that_leaves_no_budget_refuses_with_the_measured_need(tmp_path):
    # Most of the FP32 step's bytes stay whatever the plan: the margin learned leaves the next
    # round less than the least budget in bytes. Before: "memory budget: expected ..., got 1 (1
    # bytes is no budget for a model ...)", a settings error of the scheduler's own making.
    (tmp_path / "kept").write_text("0.6")
    r0, r1 = run(rounds_scenario, tmp_path)
    assert r0["plan"] is None and r1["plan"] is None
    assert "no plan meets the memory budget as measured" in r0["error"], r0["error"]
    assert float(re.search(r"raise memory_budget to at least (\d\.\d+)", r0["error"]).group(1)) > 0.65  # above the budget it refused
    assert r1["error"] == r0["error"]
