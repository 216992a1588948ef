"""A small MLP trained under DDP / FSDP2 on gloo ranks: its model, batches, training loop and DCP
checkpoints (the distributed, communication and search tests)."""

import torch
import torch.distributed as dist
import torch.nn as nn

from autoprec.distributed import SchedulerCheckpoint
from autoprec.scheduler import Thresholds
from support import gloo_ranks

WINDOW = 4
WORLD = 2
GLOBAL_BATCH = 16
TEACHER = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
SETTINGS = dict(monitor_window=WINDOW, monitor_steps=2, memory_budget=0.9, accuracy_budget=0.05, measure_costs=False, search_slice=None,
                thresholds=Thresholds(nonfinite_steps=1), search_timeout_s=20.0)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def batch(step, rank, world):
    """This rank's rows of the global batch of ``step`` (the same global batch for any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    y = (x @ TEACHER).argmax(-1)  # learnable labels: a fixed linear teacher's classes
    return x[rank::world], y[rank::world]


def wrapped(model, kind):
    """``model`` under DDP, or under FSDP2 with each linear its own unit and the root another."""
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for fqn in ("0", "2", "4"):
        fully_shard(model.get_submodule(fqn))
    return fully_shard(model)


def run(scenario, tmp_path, world=WORLD):
    """Spawn ``world`` ranks running ``scenario(rank, world, tmp_path)``; return each rank's result."""
    return gloo_ranks.run(scenario, tmp_path, world, str(tmp_path), world=world)


def train(model, sch, opt, steps, rank, world, start=0, fault=None, counts=None):
    """``steps`` steps from global step ``start``; per step (loss, stepped, parameters unchanged,
    the agreed reason of a skip)."""
    out = []
    for step in range(start, start + steps):
        x, y = batch(step, rank, world)
        with sch.precision_context():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if fault is not None:
            loss = fault(step, loss)
        sch.backward(loss)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        calls = []
        if counts is not None:  # every dist.all_reduce the scheduler's step issues, with its bytes
            real = dist.all_reduce
            dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel() * t.element_size()), real(t, *a, **k))[1]
        try:
            stepped = sch.step(opt)
        finally:
            if counts is not None:
                dist.all_reduce = real
                counts.append(calls)
        opt.zero_grad(set_to_none=True)
        unchanged = all(torch.equal(before[k], v) for k, v in model.named_parameters())
        why = sch.distributed.last_verdict.describe() if not stepped and sch.distributed is not None else None
        out.append((loss.item(), stepped, unchanged, why))
    return out


def dcp_save(ddp, opt, sch, path):
    """Model, optimizer and scheduler into one DCP checkpoint, as the README shows."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ddp, opt)
    dcp.save({"model": msd, "optim": osd, "autoprec": SchedulerCheckpoint(sch)}, checkpoint_id=path)


def dcp_load(ddp, opt, sch, path):
    """`dcp_save`'s checkpoint back into a fresh model, optimizer and scheduler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(ddp, opt)
    state = {"model": msd, "optim": osd, "autoprec": SchedulerCheckpoint(sch)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
