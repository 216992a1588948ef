"""Train the built-in byte-level LM with DDP under DynamicPrecisionScheduler (gloo, CPU).

The scheduler needs no new call under torch.distributed: every rank gets the same plan, skips the
same steps and promotes at the same step (see `autoprec.distributed`). Each rank trains on its
rows of one global batch, so any world size sees the same data.

    torchrun --nproc-per-node 2 examples/train_ddp.py
    torchrun --nproc-per-node 2 examples/train_ddp.py --grad-comm bf16   # all-reduce gradients in BF16
    torchrun --nproc-per-node 1 examples/train_ddp.py                    # the same global batch on one rank
"""

import argparse
import json
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autoprec as ap
from autoprec.scheduler.config import GRAD_COMM
from autoprec.workloads import default_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="built-in workload preset (tiny, small)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=20, help="monitor_window: steps per profiling / re-planning window")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    parser.add_argument("--grad-comm", default="fp32", choices=GRAD_COMM, help="how DDP communicates gradients (autoprec.comm)")
    parser.add_argument("--json", help="write the figures (losses, bytes) to this file (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s")
    if args.global_batch % world:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of the world size {world}")

    torch.set_num_threads(1)
    workload = default_workload(args.preset, batch_size=args.global_batch)
    model = DistributedDataParallel(workload.build_model(seed=0))  # the same weights on every rank
    batches = workload.train_batches(seed=0)  # the same global batches on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    scheduler = ap.DynamicPrecisionScheduler(monitor_window=args.window, monitor_steps=5, memory_budget=0.8, accuracy_budget=0.05,
                                             measure_costs=False, max_grad_norm=1.0, grad_comm=args.grad_comm)
    losses, step_bytes = [], []
    for step in range(args.steps):
        x, y = (t[rank::world] for t in batches.next())  # this rank's rows of the global batch
        with scheduler.precision_context():
            loss = workload.loss(model, (x, y))
        scheduler.backward(loss)
        before = scheduler.distributed.sent["all_reduce"]["bytes"] if scheduler.distributed is not None else 0
        scheduler.step(optimizer)
        step_bytes.append((scheduler.distributed.sent["all_reduce"]["bytes"] if scheduler.distributed is not None else 0) - before)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss, for the log only
        losses.append(mean.item() / world)
        if step % 10 == 0 or step == args.steps - 1:
            logging.info("step %3d  loss %.4f  %r", step, losses[-1], scheduler)

    sent = scheduler.distributed.sent["all_reduce"] if scheduler.distributed is not None else {}
    steady = sorted(step_bytes)[len(step_bytes) // 2]  # window ends (a few steps) add the statistics' reduction
    figures = {
        "world": world, "grad_comm": args.grad_comm, "steps": args.steps, "losses": losses,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]), "scheduler_all_reduce_calls": sent.get("calls", 0),
        "scheduler_all_reduce_bytes_per_step": steady, "scheduler_all_reduce_bytes_at_window_end": max(step_bytes),
        "scheduler_all_reduce_bytes_mean": sent.get("bytes", 0) / args.steps,
        "plan": scheduler.plan.format_counts() if scheduler.plan is not None else None, "changes": len(scheduler.changes),
    }
    logging.info("final loss (mean of the last 10 steps) %.4f; the scheduler all-reduced %d bytes per step (%d at a window end), %d calls in all",
                 figures["final_loss"], steady, max(step_bytes), figures["scheduler_all_reduce_calls"])
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
