"""Gradient communication per DDP bucket (`autoprec.comm`): each method against the exact FP32
average on the same gradients, error feedback that loses nothing over steps (also across loss
scale changes and skipped steps), and the methods under the scheduler with DDP on 2 gloo ranks:
training, a non-finite gradient on one rank, no_sync accumulation and a DCP resume."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autoprec as ap
from autoprec.comm import BucketCommunicator, CommMethod, CommSettings, ErrorFeedback, bytes_sent, dequantize_chunks, quantize_chunks
from autoprec.scheduler import DynamicPrecisionScheduler
from support.data_parallel import SETTINGS, batch, dcp_load, dcp_save, make_model, run, train
from support.grad_buckets import Bucket, SHAPES, rank_gradients


# -- no process group ------------------------------------------------------------------------------


def test_chunk_quantization_rounds_within_half_a_step_and_keeps_zero_chunks_exact():
    x = torch.cat([torch.randn(512) * 3, torch.zeros(256), torch.randn(256) * 1e-4])
    q, scales = quantize_chunks(x, 256)
    back = dequantize_chunks(q, scales, 256)
    err = (back - x).abs().view(-1, 256)
    assert torch.all(err.amax(1) <= scales / 2 + 1e-7)
    assert torch.equal(back[512:768], x[512:768])
    assert q.dtype is torch.int8 and scales.numel() == 4


def test_error_feedback_keeps_a_steps_residual_only_when_the_step_is_taken():
    fb = ErrorFeedback()
    fb.keep("a", torch.ones(3))
    fb.commit(True)
    fb.keep("a", torch.full((3,), float("inf")))
    fb.commit(False)  # skipped: the inf never becomes the residual
    assert torch.equal(fb.residual("a", torch.zeros(3)), torch.ones(3))
    assert fb.residual("a", torch.zeros(4)) is None  # another size: not this bucket's


def test_bytes_sent_per_method_follow_the_wire_formats():
    n, world = sum(math.prod(s) for s in SHAPES), 4
    fp32 = bytes_sent(CommMethod.FP32, SHAPES, world)
    assert fp32 == round(1.5 * 4 * n)
    assert bytes_sent(CommMethod.BF16, SHAPES, world) * 2 == fp32
    int8 = bytes_sent(CommMethod.INT8, SHAPES, world, CommSettings(chunk=256))
    assert 0.25 < int8 / fp32 < 0.3  # a byte per value and a scale per 256, each parameter padded to whole chunks
    assert bytes_sent(CommMethod.TOPK, SHAPES, world, CommSettings(topk_ratio=0.01)) == 3 * 8 * sum(math.ceil(0.01 * math.prod(s)) for s in SHAPES)
    # PowerSGD rank 2: the 64x48 and 10x64 matrices as factors, the bias whole.
    assert bytes_sent(CommMethod.POWERSGD, SHAPES, world) == round(1.5 * 4 * (2 * (64 + 48) + 2 * (10 + 64) + 64))


def test_bad_settings_name_the_field():
    with pytest.raises(ap.SettingsError, match=r"topk_ratio=0"):
        CommSettings(topk_ratio=0.0)
    with pytest.raises(ap.FormatError, match=r"grad_comm='int4'"):
        CommMethod.parse("int4")
    with pytest.raises(ap.SettingsError, match=r"grad_comm='int4'"):
        ap.SchedulerConfig(grad_comm="int4")
    with pytest.raises(ap.SettingsError, match=r"comm=0.1\): expected an autoprec.CommSettings"):
        ap.SchedulerConfig(comm=0.1)


@pytest.mark.parametrize("grad_comm", ["topk", "auto"])
def test_a_gradient_communication_on_one_process_says_once_that_it_has_no_effect(grad_comm):
    # Before: ignored without a word (issue 59).
    model = nn.Linear(4, 2)
    sch = DynamicPrecisionScheduler(model, grad_comm=grad_comm, monitor_window=50)
    with pytest.warns(UserWarning, match=rf"^DynamicPrecisionScheduler\(grad_comm='{grad_comm}'\) has no effect in this run: no process group") as record:
        for _ in range(3):
            with sch.precision_context():
                loss = model(torch.randn(3, 4)).square().mean()
            sch.backward(loss)
            sch.step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert sum("has no effect" in str(w.message) for w in record) == 1


# -- each method against the exact average, 2 ranks -------------------------------------------------


def hooks_scenario(rank, world, tmp):
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    out = {}
    for method in CommMethod:
        comm = BucketCommunicator(dist.group.WORLD, names, CommSettings(topk_ratio=0.1))
        grads = rank_gradients(rank)
        exact = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(exact)
        exact /= world
        if method is CommMethod.POWERSGD:  # torch's PowerSGD all-reduces its first steps uncompressed
            for _ in range(CommSettings().powersgd_start):
                comm.allreduce(Bucket(grads, params), method).wait()
                comm.commit(True)
            comm.sent.clear()
        first = comm.allreduce(Bucket(grads, params), method).wait().clone()
        comm.commit(True)
        # The same gradients for more steps: what error feedback sends in total.
        steps, total = 30, first.clone()
        for _ in range(steps - 1):
            total += comm.allreduce(Bucket(grads, params), method).wait()
            comm.commit(True)
        residuals = {k: v.clone() for k, v in comm.feedback.committed.items()}
        out[method.value] = {"first": first, "exact": exact, "total": total, "steps": steps, "residuals": residuals,
                             "amax": max(g.abs().max().item() for g in grads), "sent": dict(comm.sent)}
    return out


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    return run(hooks_scenario, tmp_path_factory.mktemp("hooks"))


@pytest.mark.slow
def test_each_method_against_the_exact_fp32_average(hooks):
    for r in hooks:
        err = {m: (v["first"] - v["exact"]).abs().max().item() for m, v in r.items()}
        scale = max(h["fp32"]["amax"] for h in hooks)
        assert err["fp32"] <= 1e-6 * scale
        assert err["bf16"] <= 2**-7 * scale and err["fp16"] <= 2**-10 * scale
        # INT8: a rank's rounding (half a step of its chunk) averaged, then the owner's rounding again.
        assert 0 < err["int8"] <= (scale + r["int8"]["exact"].abs().max().item()) / 254 * 1.01
        # Top-k (10 %) and PowerSGD (rank 2) send much less: their first step is far off, not wrong.
        for lossy in ("topk", "powersgd"):
            assert err[lossy] > err["int8"]
    assert torch.equal(hooks[0]["int8"]["first"], hooks[1]["int8"]["first"])  # both ranks hold one average
    assert torch.equal(hooks[0]["topk"]["first"], hooks[1]["topk"]["first"])


@pytest.mark.slow
def test_error_feedback_loses_nothing_over_steps(hooks):
    """Sent over T steps + what the ranks still hold = T x the exact average."""
    for method in ("int8", "topk"):
        total = hooks[0][method]["total"]
        steps, exact = hooks[0][method]["steps"], hooks[0][method]["exact"]
        # One residual per rank and parameter (a shard owner's rounding of the average included).
        held = sum(torch.cat([result[method]["residuals"][f"p{i}"].reshape(-1) for i in range(len(SHAPES))]) for result in hooks) / len(hooks)
        assert torch.allclose(total + held, steps * exact, atol=1e-4 * steps * exact.abs().max().item()), method
        # and the average sent converges on the exact one
        first_err = (hooks[0][method]["first"] - exact).abs().max()
        assert (total / steps - exact).abs().max() < 0.35 * first_err, method
    # PowerSGD keeps its own error feedback (torch's): its average converges too.
    p = hooks[0]["powersgd"]
    assert (p["total"] / p["steps"] - p["exact"]).abs().max() < 0.5 * (p["first"] - p["exact"]).abs().max()
    for method, result in hooks[0].items():  # the counted bytes are the formula's, per step
        assert result["sent"] == {method: result["steps"] * bytes_sent(CommMethod(method), SHAPES, 2, CommSettings(topk_ratio=0.1))}


def scaled_scenario(rank, world, tmp):
    """INT8 under a loss scale that changes: the residual is kept unscaled."""
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    scale = torch.tensor(1.0)
    comm = BucketCommunicator(dist.group.WORLD, names, CommSettings(), scale=lambda: scale)
    grads = rank_gradients(rank)
    total = torch.zeros(sum(g.numel() for g in grads))
    for step, s in enumerate([1.0, 1024.0, 1024.0, 2.0**-3, 65536.0]):
        scale.fill_(s)
        sent = comm.allreduce(Bucket([g * s for g in grads], params), CommMethod.INT8).wait() / s
        total += sent
        comm.commit(True)
    before = {k: v.clone() for k, v in comm.feedback.committed.items()}
    bad = [g.clone() for g in grads]
    bad[1][0] = float("inf") if rank == 1 else bad[1][0]
    comm.allreduce(Bucket(bad, params), CommMethod.INT8).wait()
    comm.commit(False)  # the ranks agreed to skip: nothing of that step stays
    after = comm.feedback.committed
    exact = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(exact)
    return {"total": total, "exact": exact / world, "kept": all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()}


@pytest.mark.slow
def test_error_feedback_survives_loss_scale_changes_and_skipped_steps(tmp_path):
    for r in run(scaled_scenario, tmp_path):
        # 5 steps of the same gradient at scales 1 .. 65536: the average sent is as close as at one scale.
        assert (r["total"] / 5 - r["exact"]).abs().max() <= r["exact"].abs().max() / 127
        assert r["kept"]


# -- under the scheduler with DDP -------------------------------------------------------------------

LOSSY = ("int8", "topk", "powersgd")


def ddp_comm_scenario(rank, world, tmp):
    def fresh(comm):
        model = make_model()
        # Buckets of a few KB: 4 of them, so the hooks of several buckets are in flight at once.
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        plan = ap.Plan.uniform(make_model(), ap.Format.FP32)
        sch = DynamicPrecisionScheduler.from_plan(ddp, plan, **{**SETTINGS, "grad_comm": comm, "comm": ap.CommSettings(topk_ratio=0.1)})
        return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-3), sch

    out = {}
    for comm in ("fp32", *LOSSY):
        model, ddp, opt, sch = fresh(comm)
        steps = train(ddp, sch, opt, 14, rank, world)
        full = [p.detach().clone() for p in model.parameters()]
        gathered = [None] * world
        dist.all_gather_object(gathered, [p.sum().item() for p in full])
        held = sch.state_dict()["comm"]
        out[comm] = {"steps": steps, "same_params": all(g == gathered[0] for g in gathered), "comm": held}

    # A non-finite gradient on rank 1 at step 3: skipped on both ranks, residuals untouched.
    model, ddp, opt, sch = fresh("int8")
    train(ddp, sch, opt, 3, rank, world)
    before = {k: v.clone() for k, v in sch.state_dict()["comm"]["residuals"].items()}
    poisoned = train(ddp, sch, opt, 1, rank, world, start=3, fault=lambda step, loss: loss * float("inf") if rank == 1 else loss)
    after = sch.state_dict()["comm"]["residuals"]
    out["skip"] = {"stepped": poisoned[0][1], "kept": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)}

    # no_sync accumulation: two micro-batches, one communication, as DDP users write it.
    model, ddp, opt, sch = fresh("int8")
    for step in range(4):
        x, y = batch(step, rank, world)
        with ddp.no_sync():
            with sch.precision_context():
                loss = nn.functional.cross_entropy(ddp(x[:4]).float(), y[:4]) / 2
            sch.backward(loss)
        with sch.precision_context():
            loss = nn.functional.cross_entropy(ddp(x[4:]).float(), y[4:]) / 2
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, [p.sum().item() for p in model.parameters()])
    out["no_sync"] = {"same_params": all(g == gathered[0] for g in gathered), "sent": sch.state_dict()["comm"]["sent"]}

    # DCP resume: 6 steps, save, 6 more; against 12 straight.
    model, ddp, opt, sch = fresh("int8")
    straight = train(ddp, sch, opt, 12, rank, world)
    reference = [p.detach().clone() for p in model.parameters()]
    model, ddp, opt, sch = fresh("int8")
    first = train(ddp, sch, opt, 6, rank, world)
    dcp_save(ddp, opt, sch, f"{tmp}/ckpt")
    model, ddp, opt, sch = fresh("int8")
    dcp_load(ddp, opt, sch, f"{tmp}/ckpt")
    second = train(ddp, sch, opt, 6, rank, world, start=6)
    out["resume"] = {"straight": [s[0] for s in straight], "resumed": [s[0] for s in first + second],
                     "same": all(torch.equal(a, b) for a, b in zip(reference, model.parameters()))}
    return out


@pytest.fixture(scope="module")
def ddp_comm(tmp_path_factory):
    return run(ddp_comm_scenario, tmp_path_factory.mktemp("ddp_comm"))


@pytest.mark.slow
def test_every_lossy_method_trains_and_the_ranks_stay_identical(ddp_comm):
    for result in ddp_comm:
        exact = [s[0] for s in result["fp32"]["steps"]]
        for comm in LOSSY:
            losses = [s[0] for s in result[comm]["steps"]]
            # Learns, and within 2 % of the same steps all-reduced in FP32 (top-k sending 10 %).
            assert sum(losses[-4:]) < sum(losses[:4]), (comm, losses)
            assert abs(sum(losses[-4:]) - sum(exact[-4:])) <= 0.02 * sum(exact[-4:]), (comm, losses, exact)
            assert result[comm]["same_params"], comm
        assert result["int8"]["comm"]["residuals"] and result["topk"]["comm"]["residuals"]
        assert result["powersgd"]["comm"]["powersgd"]["error_buckets"] >= 1  # torch's error feedback ran


@pytest.mark.slow
def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere_and_keeps_the_residuals(ddp_comm):
    for result in ddp_comm:
        assert result["skip"] == {"stepped": False, "kept": True}


@pytest.mark.slow
def test_no_sync_accumulation_communicates_once_per_step(ddp_comm):
    per_step = ddp_comm[0]["int8"]["comm"]["sent"]["int8"] / 14
    for result in ddp_comm:
        assert result["no_sync"]["same_params"]
        # 4 communications, not 8 (bucket padding differs between the first step's layout and the rebuilt one)
        assert result["no_sync"]["sent"]["int8"] == pytest.approx(4 * per_step, rel=0.05)


@pytest.mark.slow
def test_a_resumed_run_continues_bit_identically_with_its_residuals(ddp_comm):
    for result in ddp_comm:
        assert result["resume"]["resumed"] == result["resume"]["straight"]
        assert result["resume"]["same"]
