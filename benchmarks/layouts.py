"""One plan under each parallel layout (issue 58): bytes per rank and step time, side by side.

torchtitan's Llama as `tests/support/titan_llama.py` builds it (4 blocks, d32, 4 heads, 2 KV
heads, vocabulary 128, context 32), a global batch of 8 sequences, trained with SGD under
``apply_plan`` in each layout on gloo CPU ranks:

- ``single``: one process, the whole model;
- ``ddp``: 2 ranks, ``DistributedDataParallel``, 4 sequences each;
- ``fsdp2``: 2 ranks, ``fully_shard`` per block and root (``param_dtype=None``), 4 sequences each;
- ``tp`` / ``tp-sp``: 2 ranks, torchtitan's tensor-parallel plan (and sequence parallel), every
  rank the whole batch;
- ``fsdp2xtp``: 4 ranks on a 2 x 2 mesh, TP over "tp", FSDP2 over "dp";
- ``pp``: 2 pipeline stages (2 blocks each), GPipe over 4 micro-batches.

Plans: ``fp32``; ``bf16`` (every layer); ``fp8`` (the block projections and the head in FP8 E4M3
with per-tensor current scaling, what runs on a tensor-parallel weight, the rest BF16). Per
layout, plan and rank: the bytes one step saves for backward (`SavedTensorMeter` over the step's
forward; under FSDP2 it also counts the gathered weights autograd saves), the parameter bytes
the rank holds, and the median step over ``--steps`` steps after 2 warm-up ones. Ratios are
in-run (each layout's plans against its own FP32 run); seconds are this machine's, and with 4
ranks on 2 cores the 4-rank layout's times are inflated.

Run: ``PYTHONPATH=. python benchmarks/layouts.py --out benchmarks/results/layouts_cpu_torch2.13.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

LAYOUTS = {"single": 1, "ddp": 2, "fsdp2": 2, "tp": 2, "tp-sp": 2, "fsdp2xtp": 4, "pp": 2}
PLANS = ("fp32", "bf16", "fp8")
BATCH, MICRO = 8, 4
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def plan_of(name: str, model: nn.Module, x: torch.Tensor):
    import autoprec as ap

    plan = ap.Plan.uniform(model, "fp32" if name == "fp32" else "bf16", (x,))
    if name != "fp8":
        return plan
    lowered = {fqn: ap.LayerPrecision("fp8_e4m3") for fqn in plan.layers if fqn == "output" or fqn.rsplit(".", 1)[-1] in PROJECTIONS}
    return plan.with_layers(lowered)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def build(layout: str, rank: int, world: int):
    """The model this rank trains in ``layout``, and ``step(x, y, meter)`` running one step's
    forward and backward (inside ``meter`` for the forward) and returning the loss (None on a
    pipeline stage that has none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from support.titan_llama import parallelize, pipeline_stage, titan_llama

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    policy = MixedPrecisionPolicy(param_dtype=None)
    model = titan_llama()
    rows = (0, 1)  # (this rank's start, stride) among the batch's sequences
    if layout == "ddp":
        model, rows = nn.parallel.DistributedDataParallel(model), (rank, world)
    elif layout == "fsdp2":
        for module in (*model.layers.values(), model):
            fully_shard(module, mp_policy=policy)
        rows = (rank, world)
    elif layout in ("tp", "tp-sp"):
        model = parallelize(model, init_device_mesh("cpu", (world,)), sequence_parallel=layout == "tp-sp")
    elif layout == "fsdp2xtp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        model = parallelize(model, mesh["tp"])
        for module in (*model.layers.values(), model):
            fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
        rows = (mesh["dp"].get_local_rank(), 2)
    elif layout == "pp":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        model = pipeline_stage(model, rank, world)
        schedule = ScheduleGPipe(PipelineStage(model, rank, world, torch.device("cpu")), n_microbatches=MICRO, loss_fn=loss_fn)

        def pipelined(x, y, context, meter):
            losses: list = []
            with context, meter:
                if rank == 0:
                    schedule.step(x.contiguous())
                else:
                    schedule.step(target=y.contiguous(), losses=losses)
            return float(sum(loss.detach() for loss in losses) / MICRO) if losses else None

        return model, rows, pipelined

    def step(x, y, context, meter):
        with context, meter:
            loss = loss_fn(model(x), y)
        loss.backward()
        return loss.item()

    return model, rows, step


def worker(rank: int, world: int, store: str, layout: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        import autoprec as ap
        from autoprec.saved_bytes import SavedTensorMeter
        from support.titan_llama import titan_llama, token_batch

        warnings.simplefilter("ignore")
        rows = []
        for plan_name in PLANS:
            model, (start, stride), step = build(layout, rank, world)
            inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
            plan = plan_of(plan_name, titan_llama(), token_batch(0)[0])
            plan = plan.for_stage(inner) if layout == "pp" else plan  # a stage runs its part of the plan
            runtime = ap.apply_plan(inner, plan)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            seconds, saved, losses = [], None, []
            for i in range(steps + 2):
                x, y = token_batch(i, start, stride, batch=BATCH)
                meter = SavedTensorMeter(list(model.parameters()))
                begin = time.perf_counter()
                losses.append(step(x, y, runtime, meter))
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= 2:
                    seconds.append(time.perf_counter() - begin)
                saved = meter.total_bytes if saved is None else saved
            runtime.remove()
            rows.append({"layout": layout, "plan": plan_name, "rank": rank, "world": world, "saved_bytes": saved,
                         "param_bytes": sum(_local_bytes(p) for p in model.parameters()),
                         "step_s": statistics.median(seconds), "last_loss": losses[-1]})
            if world > 1:
                dist.barrier()
        Path(out, f"{layout}-{rank}.json").write_text(json.dumps(rows), encoding="utf-8")
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_layout(layout: str, steps: int) -> list[dict]:
    world = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        if world == 1:
            worker(0, 1, store, layout, steps, tmp)
        else:
            mp.start_processes(worker, args=(world, store, layout, steps, tmp), nprocs=world, join=True, start_method="spawn")
        return [row for rank in range(world) for row in json.loads(Path(tmp, f"{layout}-{rank}.json").read_text(encoding="utf-8"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for layout in args.layouts.split(","):
        rows += run_layout(layout, args.steps)
    print(f"{'layout':10} {'plan':5} {'ranks':>5} {'saved KiB/rank (max)':>21} {'vs fp32':>8} {'params KiB/rank':>16} {'step ms (rank 0)':>17} {'vs fp32':>8}")
    for layout in dict.fromkeys(r["layout"] for r in rows):
        fp32 = [r for r in rows if r["layout"] == layout and r["plan"] == "fp32"]
        for plan in PLANS:
            mine = [r for r in rows if r["layout"] == layout and r["plan"] == plan]
            saved, base = max(r["saved_bytes"] for r in mine), max(r["saved_bytes"] for r in fp32)
            step, base_step = mine[0]["step_s"], fp32[0]["step_s"]
            print(f"{layout:10} {plan:5} {len(mine):5d} {saved / 1024:21.1f} {saved / base:8.3f} {mine[0]['param_bytes'] / 1024:16.1f} "
                  f"{step * 1e3:17.1f} {step / base_step:8.3f}")
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
        meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "python": platform.python_version(),
                "commit": commit, "threads_per_rank": 1, "steps": args.steps}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
