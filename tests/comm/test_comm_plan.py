"""The plan's gradient communication per layer (`Plan.comm`, `autoprec.comm.choice`): the plan
section saved, loaded, refused in one line per bad entry, and reviewed; each method's delivered
gradient against plain PyTorch; the loss a compression is scored with against its formula
computed by hand; the choice by time saved under the accuracy allowance; and, on 2 gloo ranks, a bucket
mixing methods delivering each parameter exactly as its method alone would, and the scheduler
choosing per layer with ``grad_comm="auto"`` (every rank the same plan, training as FP32 does)."""

import json
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autoprec as ap
from autoprec.comm import BucketCommunicator, CommMethod, CommSettings
from autoprec.comm.choice import LayerComm, LinkCost, choose, comm_loss_increase, compressed
from autoprec.scheduler import DynamicPrecisionScheduler
from support.grad_buckets import SHAPES, Bucket, rank_gradients
from support.data_parallel import batch, make_model, run

# -- the plan section ----------------------------------------------------------------------------


@pytest.fixture
def plan():
    return ap.Plan.uniform(make_model(), ap.Format.BF16)


def test_a_plans_comm_round_trips_and_survives_a_layer_change(plan, tmp_path):
    chosen = plan.with_comm({"0": "int8", "2": CommMethod.TOPK, "4": "fp32"})
    assert chosen.comm == {"0": CommMethod.INT8, "2": CommMethod.TOPK, "4": CommMethod.FP32}
    assert chosen != plan and chosen.with_comm({}) == plan
    loaded = ap.Plan.load(chosen.save(tmp_path / "plan.json"))
    assert loaded == chosen and json.loads((tmp_path / "plan.json").read_text())["comm"] == {"0": "int8", "2": "topk", "4": "fp32"}
    assert pickle.loads(pickle.dumps(chosen)) == chosen
    assert chosen.with_layers({"2": "fp32"}).comm == chosen.comm  # a promotion keeps how gradients travel
    assert "gradients sent in int8=1, topk=1" in repr(chosen)


def test_a_bad_comm_entry_is_named_with_its_fix(plan, tmp_path):
    with pytest.raises(ap.PlanError) as caught:
        plan.with_comm({"0": "powersgd", "9": "int8", "2": "int4"})
    problems = caught.value.problems
    assert any("comm['0']: 'powersgd'" in p and "grad_comm='powersgd'" in p for p in problems)
    assert any("comm['9']: not a layer of this plan" in p for p in problems)
    assert any("comm['2']: 'int4' is not one of fp32, bf16, fp16, int8, topk" in p for p in problems)
    data = plan.to_dict()
    data["schema_version"] = 2  # written before the section existed: no comm key allowed, none chosen
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "comm"}))
    assert ap.Plan.load(path).comm == {}
    path.write_text(json.dumps(data))
    with pytest.raises(ap.PlanError, match="unknown top-level key 'comm'"):
        ap.Plan.load(path)


def test_the_review_shows_each_layers_method_with_the_figures_it_was_chosen_by(plan):
    from autoprec.monitoring.plans import format_plan_line, plan_layers_markdown, plan_summary_markdown

    figures = {"link": {"bytes_per_s": 12.5e6}, "allowed_loss_increase": 0.02,
               "layers": {"0": {"method": "int8", "seconds": {"fp32": 0.0125, "int8": 0.004}, "loss_increase": {"fp32": 0.0, "int8": 3e-4}}}}
    chosen = plan.with_comm({"0": "int8", "2": "fp32", "4": "fp32"})
    chosen = chosen.replace(metadata={**chosen.metadata, "comm": figures})
    summary = plan_summary_markdown(chosen, "plan")
    assert "gradients sent: fp32 2 · int8 1; link measured at 100 Mbit/s" in summary
    assert "| `0` | int8 | 12.5 ms | 4 ms | 0.0003 |" in summary and "'link'" not in summary  # not dumped as metadata
    assert "| gradients sent |" in plan_layers_markdown(chosen) and "| int8 |" in plan_layers_markdown(chosen)
    assert "gradients sent in int8 1" in format_plan_line(chosen, "plan")
    assert "gradients sent" not in plan_layers_markdown(plan) + format_plan_line(plan, "plan")


# -- what each method delivers, and the loss it is scored with ------------------------------------


def test_each_method_delivers_what_plain_pytorch_computes():
    g = torch.randn(300, 7, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 7)
    assert torch.equal(compressed(CommMethod.BF16, g), g.to(torch.bfloat16).float())
    assert torch.equal(compressed(CommMethod.FP16, g), g.half().float())
    settings = CommSettings(chunk=64, topk_ratio=0.05)
    int8 = compressed(CommMethod.INT8, g, settings)
    flat, got = g.reshape(-1), int8.reshape(-1)
    for start in range(0, flat.numel(), 64):  # each chunk within half a step of its own amax / 127
        chunk = flat[start:start + 64]
        assert (got[start:start + 64] - chunk).abs().max() <= chunk.abs().max() / 254 * 1.0001
    top = compressed(CommMethod.TOPK, g, settings)
    k = math.ceil(0.05 * g.numel())
    kept = top.reshape(-1) != 0
    assert kept.sum() == k and torch.equal(top.reshape(-1)[kept], flat[kept])
    assert flat[~kept].abs().max() <= flat[kept].abs().min()


def test_a_compressions_loss_is_lr_over_4_times_the_preconditioned_error_per_rounding():
    grads = [torch.randn(64, 32, generator=torch.Generator().manual_seed(1)), torch.randn(64, generator=torch.Generator().manual_seed(2))]
    v = [torch.rand(64, 32, generator=torch.Generator().manual_seed(3)) * 1e-4, torch.rand(64, generator=torch.Generator().manual_seed(4)) * 1e-4]
    p = [1 / (x.sqrt() + 1e-8) for x in v]
    for method, roundings in ((CommMethod.BF16, 2), (CommMethod.INT8, 2), (CommMethod.TOPK, 1)):
        noise = sum(float(((compressed(method, g) - g) ** 2 * q).double().sum()) for g, q in zip(grads, p))
        descent = abs(sum(float(((compressed(method, g) - g) * g * q).double().sum()) for g, q in zip(grads, p)))
        assert comm_loss_increase(method, grads, p, 3e-4) == pytest.approx(3e-4 / 4 * roundings * noise + 3e-4 * descent, rel=1e-6)  # float32 products in another order
        if method is not CommMethod.TOPK:  # a rounding's error is not the gradient's: little descent lost
            assert descent < 0.05 * sum(float((g * g * q).double().sum()) for g, q in zip(grads, p))
    sgd = comm_loss_increase(CommMethod.BF16, grads, [None, None], 0.1)
    errors = [compressed(CommMethod.BF16, g) - g for g in grads]
    assert sgd == pytest.approx(0.1 / 4 * 2 * sum(float((e ** 2).double().sum()) for e in errors)
                                + 0.1 * abs(sum(float((e * g).double().sum()) for e, g in zip(errors, grads))))
    # The ordering a choice relies on: top-k 1 % loses far more than INT8, INT8 more than BF16.
    losses = [comm_loss_increase(m, grads, p, 1e-3) for m in (CommMethod.BF16, CommMethod.INT8, CommMethod.TOPK)]
    assert losses[0] < losses[1] < losses[2]


# -- the choice ------------------------------------------------------------------------------------


def layer_figures(link: LinkCost, shapes, loss):
    methods = (CommMethod.FP32, CommMethod.BF16, CommMethod.INT8, CommMethod.TOPK)
    return LayerComm({m: link.seconds(m, shapes) for m in methods}, {m: 0.0 if m is CommMethod.FP32 else loss[m] for m in methods})


LOSS = {CommMethod.BF16: 1e-5, CommMethod.INT8: 1e-4, CommMethod.TOPK: 1e-1}
ARITHMETIC = {"bf16": 1e-9, "int8": 2e-8, "topk": 5e-8}  # seconds per value, a CPU's order


def test_a_slow_link_compresses_a_fast_one_does_not_and_the_allowance_decides_how_far():
    shapes = {"big": [torch.Size([1024, 1024])], "small": [torch.Size([16])]}
    slow = LinkCost(1e-3, 100e6 / 8, ARITHMETIC, 2)  # 100 Mbit/s
    fast = LinkCost(1e-5, 50e9, ARITHMETIC, 2)  # NVLink's order
    figures = {name: {fqn: layer_figures(link, s, LOSS) for fqn, s in shapes.items()} for name, link in (("slow", slow), ("fast", fast))}
    # Open budget on a slow link: top-k saves the most for the big layer; the small one too (no latency in a layer's figure).
    assert choose(figures['slow'], math.inf)["big"] is CommMethod.TOPK
    # An allowance that holds INT8 but not top-k: INT8, but for the 16-value layer, whose one
    # INT8 chunk (256 values and a scale) would send more bytes than its FP32 does: BF16.
    assert choose(figures['slow'], 1e-3) == {"big": CommMethod.INT8, "small": CommMethod.BF16}
    assert choose(figures['slow'], 5e-5)["big"] is CommMethod.BF16  # only BF16's error fits
    assert choose(figures['slow'], 0.0) == {"big": CommMethod.FP32, "small": CommMethod.FP32}  # no budget: nothing lossy
    # On a fast link the arithmetic costs more than the bytes saved: FP32 (BF16's cast still pays its way or not by the figures).
    fast_choice = choose(figures['fast'], math.inf)
    assert fast_choice["big"] in (CommMethod.FP32, CommMethod.BF16)
    assert fast_choice["big"] is (CommMethod.BF16 if figures['fast']["big"].seconds[CommMethod.BF16] < figures['fast']["big"].seconds[CommMethod.FP32] else CommMethod.FP32)


def test_the_allowance_goes_to_the_layers_that_save_most_per_loss():
    link = LinkCost(0.0, 100e6 / 8, {"bf16": 0.0, "int8": 0.0, "topk": 0.0}, 2)
    a = layer_figures(link, [torch.Size([4096, 256])], {CommMethod.BF16: 1e-6, CommMethod.INT8: 1e-5, CommMethod.TOPK: 1.0})
    b = layer_figures(link, [torch.Size([4096, 256])], {CommMethod.BF16: 1e-5, CommMethod.INT8: 1e-4, CommMethod.TOPK: 1.0})
    chosen = choose({"a": a, "b": b}, 2e-5)  # room for a's INT8 (1e-5) and b's BF16 (1e-5), not b's INT8
    assert chosen == {"a": CommMethod.INT8, "b": CommMethod.BF16}
    spent = a.loss[chosen["a"]] + b.loss[chosen["b"]]
    assert spent <= 2e-5


def test_a_method_whose_layers_save_less_than_its_collectives_cost_is_struck_out():
    link = LinkCost(2e-3, 100e6 / 8, {"bf16": 0.0, "int8": 0.0, "topk": 0.0}, 2)
    big = layer_figures(link, [torch.Size([1024, 1024])], {CommMethod.BF16: 1e-6, CommMethod.INT8: 1e-5, CommMethod.TOPK: 1.0})
    head = layer_figures(link, [torch.Size([16, 16])], {CommMethod.BF16: 1e-9, CommMethod.INT8: 1e-8, CommMethod.TOPK: 1e-7})
    figures = {"big": big, "head": head}
    free = choose(figures, 1e-3)
    assert free == {"big": CommMethod.INT8, "head": CommMethod.TOPK}  # no collective costs counted
    fixed = {m: n * link.latency_s for m, n in ((CommMethod.BF16, 1), (CommMethod.INT8, 2), (CommMethod.TOPK, 1))}
    # The head's top-k saves 0.08 ms: less than the 2 ms its own all-gather costs; INT8 pays for its two.
    assert head.seconds[CommMethod.FP32] - head.seconds[CommMethod.TOPK] < fixed[CommMethod.TOPK]
    assert choose(figures, 1e-3, fixed) == {"big": CommMethod.INT8, "head": CommMethod.INT8}


class OneRank:
    """The part of a `RankAgreement` the choice uses, for rank 0 of one."""

    rank = 0

    @staticmethod
    def share(value):
        return value


def test_a_choice_that_fails_on_rank_0_still_answers_the_other_ranks_with_fp32(plan, monkeypatch):
    from autoprec.scheduler.grad_comm import CommChoice

    choice = CommChoice(ap.SchedulerConfig(grad_comm="auto"), OneRank(), LinkCost(1e-3, 12.5e6, ARITHMETIC, 2))

    def broken(*args):
        raise RuntimeError("an optimizer state it could not read")

    monkeypatch.setattr(choice, "_decide", broken)
    chosen = choice.choose(plan, make_model(), [], None)
    assert chosen.comm == {fqn: CommMethod.FP32 for fqn in plan.layers}
    assert chosen.metadata["comm"] == {"error": "RuntimeError: an optimizer state it could not read"}


# -- two ranks ---------------------------------------------------------------------------------------


def mixed_scenario(rank, world, tmp):
    """One bucket, three parameters by three methods, against each method alone on the same gradients."""
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    methods = {id(params[0]): CommMethod.INT8, id(params[1]): CommMethod.BF16, id(params[2]): CommMethod.TOPK}
    settings = CommSettings(topk_ratio=0.1)
    alone = {}
    for method in (CommMethod.INT8, CommMethod.BF16, CommMethod.TOPK):  # one order on every rank
        comm = BucketCommunicator(dist.group.WORLD, names, settings)
        alone[method] = comm.allreduce(Bucket(rank_gradients(rank), params), method).wait().clone()
    comm = BucketCommunicator(dist.group.WORLD, names, settings)
    mixed = comm.allreduce(Bucket(rank_gradients(rank), params), lambda p: methods[id(p)]).wait().clone()
    return {"alone": alone, "mixed": mixed, "sent": dict(comm.sent), "residuals": sorted(comm.feedback.pending)}


@pytest.mark.slow
def test_a_bucket_mixing_methods_delivers_each_parameter_as_its_method_alone(tmp_path):
    results = run(mixed_scenario, tmp_path)
    sizes = [math.prod(s) for s in SHAPES]
    for r in results:
        pieces = r["mixed"].split(sizes)
        for i, method in enumerate((CommMethod.INT8, CommMethod.BF16, CommMethod.TOPK)):
            assert torch.equal(pieces[i], r["alone"][method].split(sizes)[i]), method
        assert r["sent"] == {"int8": ap.comm.bytes_sent(CommMethod.INT8, SHAPES[:1], 2),
                             "bf16": ap.comm.bytes_sent(CommMethod.BF16, SHAPES[1:2], 2),
                             "topk": ap.comm.bytes_sent(CommMethod.TOPK, SHAPES[2:], 2, CommSettings(topk_ratio=0.1))}
        assert r["residuals"] == ["p0", "p2"]  # error feedback for the lossy ones only
    assert torch.equal(results[0]["mixed"], results[1]["mixed"])


def auto_scenario(rank, world, tmp):
    """The scheduler with grad_comm="auto" on loopback, and FP32 on the same batches."""
    out = {}
    for comm in ("auto", "fp32"):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        sch = DynamicPrecisionScheduler.from_plan(ddp, ap.Plan.uniform(make_model(), ap.Format.FP32), grad_comm=comm,
                                                  accuracy_budget=0.05, monitor_window=10**6, measure_costs=False)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        losses = []
        for step in range(25):
            x, y = batch(step, rank, world)
            with sch.precision_context():
                loss = nn.functional.cross_entropy(ddp(x), y)
            sch.backward(loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0:
                out[f"{comm}_comm_after_first_step"] = dict(sch.plan.comm)
        out[comm] = {"losses": losses, "plan": sch.plan.to_dict(), "params": {k: v.detach().clone() for k, v in model.named_parameters()},
                     "hook": (sch.distributed.comm_hook.default, {sch.distributed.layers[i]: m for i, m in sch.distributed.comm_hook.per_layer.items()})}
    return out


@pytest.mark.slow
def test_grad_comm_auto_chooses_per_layer_on_every_rank_alike_and_trains_as_fp32(tmp_path):
    results = run(auto_scenario, tmp_path)
    first, second = results
    plan = ap.Plan.from_dict(first["auto"]["plan"])
    assert first["auto"]["plan"] == second["auto"]["plan"]  # one choice, broadcast
    assert set(plan.comm) == set(plan.layers)  # every layer named, so it is chosen once
    figures = plan.metadata["comm"]
    assert figures["link"]["bytes_per_s"] > 0 and figures["scored"] == "measured"
    for fqn, row in figures["layers"].items():  # the chosen method saves time by the figures, and fits
        method = row["method"]
        assert method == "fp32" or row["seconds"][method] < row["seconds"]["fp32"]
    used = sum(row["loss_increase"][row["method"]] for row in figures["layers"].values())
    assert used <= figures["allowed_loss_increase"] * (1 + 1e-9)
    assert figures["allowed_loss_increase"] == pytest.approx(0.05 * first["auto"]["losses"][0], rel=1e-6)
    # Chosen after the first optimizer step: the hook follows the plan.
    assert first["auto_comm_after_first_step"] == plan.comm
    default, per_layer = first["auto"]["hook"]
    assert default is CommMethod.FP32
    assert per_layer == {fqn: m for fqn, m in plan.comm.items() if m is not CommMethod.FP32}
    for k, v in first["auto"]["params"].items():
        assert torch.equal(v, second["auto"]["params"][k]), k
    auto, fp32 = first["auto"]["losses"], first["fp32"]["losses"]
    assert sum(auto[-5:]) < 0.95 * sum(auto[:5])
    assert abs(sum(auto[-5:]) - sum(fp32[-5:])) <= 0.02 * sum(fp32[-5:])
