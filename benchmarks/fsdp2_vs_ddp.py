"""The seed's loop under DDP and under FSDP2, side by side on 2 gloo ranks (CPU).

A GPT-2 (transformers' own class, a small config built locally: 4 blocks, d256, vocabulary 2048)
trains on a fixed token stream, its batches split over the ranks, in four runs:

- ``ddp search`` / ``fsdp2 search``: ``DynamicPrecisionScheduler(monitor_window=20,
  memory_budget=0.8)`` with no plan, wrapped in ``DistributedDataParallel`` or ``fully_shard``
  per block and root (``MixedPrecisionPolicy(param_dtype=None)``): the plan each finds in the
  run, the steps until it is in force, the search's extra time in planned steps, the slowest
  search step against a planned one;
- ``fsdp2 fp8 plan`` / ``fsdp2 bf16 plan``: ``from_plan`` with every layer in FP8 E4M3 (per
  tensor) or BF16: what FSDP2 all-gathers when the plan's FP8 weights travel in FP8.

Per run and rank 0: the bytes every collective of a planned step sends (``all_reduce``,
all-gathers, ``reduce_scatter_tensor``, ...: the tensors handed to ``torch.distributed``, DDP's
buckets through the scheduler's hook), the median planned step, the final loss (mean of the last
5 steps), the process's peak resident memory (``ru_maxrss``: the interpreter and torch
included, so only the differences between runs speak) and on CUDA the peak allocated memory.

``--device cuda`` runs each rank on its own GPU over NCCL (``--world 1``: the GPU session's case,
one GPU, where FSDP2 copies its shard in without a collective and the FP8 weights are still
gathered, and kept unsharded, in FP8), ``--size gpu`` a GPT-2 of 8 blocks, d1024, vocabulary 32k.

Run: ``PYTHONPATH=. python benchmarks/fsdp2_vs_ddp.py --out benchmarks/results/fsdp2_vs_ddp_cpu.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
RUNS = (("ddp", "search"), ("fsdp2", "search"), ("fsdp2", "fp8_e4m3"), ("fsdp2", "bf16"))
# GPT-2 sizes: blocks, width, heads, vocabulary, sequence, batch (over all ranks).
SIZES = {"cpu": (4, 256, 4, 2048, 64, 8), "gpu": (8, 1024, 16, 32768, 512, 16)}
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


def _counting(sent: collections.Counter) -> dict:
    """Wrap the tensor collectives so each counts its input bytes into ``sent``; returns the originals."""
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            tensor = args[1] if name.startswith(("all_gather", "reduce_scatter", "all_to_all")) else args[0]
            sent[name] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counted

    for name, fn in real.items():
        setattr(dist, name, wrap(name, fn))
    return real


def worker(rank: int, world: int, store: str, kind: str, how: str, steps: int, out: str, device: str, size: str) -> None:
    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import GPT2Config, GPT2LMHeadModel

        import autoprec as ap

        blocks, width, heads, vocabulary, sequence, batch = SIZES[size]
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=blocks, n_embd=width, n_head=heads, vocab_size=vocabulary, n_positions=sequence)).to(device)
        data = torch.randint(0, 256, (steps * batch + batch, sequence), generator=torch.Generator().manual_seed(1)).to(device)
        # traced on a batch: the attention products, modules without a weight of their own, are layers too
        plan = None if how == "search" else ap.Plan.uniform(model, how, {"input_ids": data[:4]})
        if kind == "fsdp2":
            policy = MixedPrecisionPolicy(param_dtype=None)
            for block in model.transformer.h:
                fully_shard(block, mp_policy=policy)
            net = fully_shard(model, mp_policy=policy)
        else:
            net = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        settings = dict(monitor_window=20, memory_budget=0.8)
        sch = ap.DynamicPrecisionScheduler(**settings) if plan is None else ap.DynamicPrecisionScheduler.from_plan(net, plan, **settings)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        sent: collections.Counter = collections.Counter()
        _counting(sent)
        rows = []
        for step in range(steps):
            ids = data[step * batch:(step + 1) * batch][rank::world]
            before = sum(sent.values())
            start = time.perf_counter()
            with sch.precision_context():
                loss = net(input_ids=ids, labels=ids).loss
            sch.backward(loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            rows.append({"seconds": time.perf_counter() - start, "phase": sch.phase, "loss": loss.item(), "bytes": sum(sent.values()) - before})
        if rank == 0:
            planned = [r for r in rows[2:] if r["phase"] == "planned"]
            search = [r for r in rows if r["phase"] == "searching"]
            median = statistics.median(r["seconds"] for r in planned) if planned else None
            fp8 = sch.fp8_all_gather
            result = {
                "kind": kind, "how": how, "plan": dict(sch.plan.format_counts()) if sch.plan is not None else None,
                "error": sch.last_search_error, "first_planned_step": next((i for i, r in enumerate(rows) if r["phase"] == "planned"), None),
                "planned_step_s": median, "bytes_per_planned_step": statistics.median(r["bytes"] for r in planned) if planned else None,
                "search_steps": len(search),
                "search_extra_planned_steps": (sum(r["seconds"] for r in search) - median * len(search)) / median if search and median else None,
                "slowest_search_step_x_planned": max(r["seconds"] for r in search) / median if search and median else None,
                "final_loss": statistics.fmean(r["loss"] for r in rows[-5:]), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                "fp8_gathered_weights": None if fp8 is None else fp8.enabled,
            }
            with open(out, "w", encoding="utf-8") as f:
                json.dump(result, f)
        sch.close()
    finally:
        dist.destroy_process_group()


def table(results: list) -> str:
    lines = ["| run | plan found | planned from step | bytes sent / planned step (rank 0) | planned step ms | search: extra, in planned steps / slowest x | final loss | peak RSS MiB | peak CUDA MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        plan = ", ".join(f"{n} {f}" for f, n in sorted((r["plan"] or {}).items()))
        search = f"{r['search_extra_planned_steps']:.0f} / {r['slowest_search_step_x_planned']:.1f}x" if r["search_extra_planned_steps"] is not None else "-"
        step_ms = f"{1e3 * r['planned_step_s']:.0f}" if r["planned_step_s"] is not None else "-"
        sent = f"{r['bytes_per_planned_step'] / 2**20:.2f} MiB" if r["bytes_per_planned_step"] is not None else "-"
        lines.append(f"| {r['kind']} {r['how']} | {plan} | {r['first_planned_step']} | {sent} | {step_ms} | {search} | {r['final_loss']:.4f} | {r['peak_rss_mib']:.0f} | {r['peak_cuda_mib'] or 0:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--runs", default=",".join(f"{k}:{h}" for k, h in RUNS), help="kind:how, comma-separated (kind ddp or fsdp2; how search, or a format for every layer)")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes; on CUDA one GPU each)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, rank r on GPU r; cpu: gloo")
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for kind, how in (run.split(":") for run in args.runs.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "result.json")
            steps = args.steps if how == "search" else max(20, args.steps // 4)
            mp.spawn(worker, args=(args.world, os.path.join(folder, "store"), kind, how, steps, out, args.device, args.size), nprocs=args.world, join=True)
            with open(out, encoding="utf-8") as f:
                results.append(json.load(f))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))
    if args.out is not None:
        from autoprec._io import atomic_write_text

        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        atomic_write_text(args.out, json.dumps({"device": device, "torch": torch.__version__, "cuda": torch.version.cuda if args.device == "cuda" else None,
                                                "commit": commit, "world": args.world, "size": args.size, "steps": args.steps, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
