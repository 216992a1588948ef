"""What the scheduler itself costs a training loop: its steps against the same plan by hand.

Trains a GPT-style byte LM (`autoprec.workloads.bytelm.ByteLM`) with the README's loop under
`DynamicPrecisionScheduler` (no ``model=``, no plan: it profiles a window, searches, then trains
under its plan), and beside it, on copies of the model in the same process:

- **by hand**: the scheduler's plan through `autoprec.apply_plan` and a ``torch.amp.GradScaler``
  (on exactly when some layer has FP16 gradients), the adoption a user writes without the scheduler;
- **autocast**: plain ``torch.autocast`` (BF16) around the forward, no plan;
- **plain**: the profiling window's precision with nothing attached (FP32; BF16 autocast with
  ``--max-precision 16``), interleaved step by step with the window's steps.

Reported, as in-run ratios (medians of interleaved steps, order rotated every round):

- a planned step under the scheduler over the same plan by hand (its watch's cost), and both
  over plain autocast (tokens/s);
- a profiling-window step over a plain step of the window's precision;
- the search: its steps' extra time in median planned steps, and its slowest over the median;
- memory between planned steps (CUDA ``memory_allocated``; on a CPU the bytes of every live
  tensor's storage, each counted once), the scheduler's over the plan by hand's, and after
  ``scheduler.close()`` and ``del``: what is left over the memory before the scheduler existed;
  CUDA peaks per phase;
- tensors with a ``grad_fn`` alive between planned steps and after close (should be 0: a graph
  kept alive is the leak this benchmark was written for).

Uses only the public API, so it measures an older autoprec too (``PYTHONPATH=<checkout>``).

    PYTHONPATH=. python benchmarks/scheduler_costs.py                    # CPU: ~3 minutes on 2 cores
    PYTHONPATH=. python benchmarks/scheduler_costs.py --device cuda --d-model 1536 --layers 8 \\
        --heads 12 --context 1024 --batch 8 --out benchmarks/results/scheduler_costs_<device>.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

import autoprec as ap
from autoprec.workloads.bytelm import ByteLMWorkload, LMConfig, load_corpus, split_corpus


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_tensors() -> int:
    """Tensors with a ``grad_fn`` that Python's collector still tracks (after a collection)."""
    gc.collect()
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
                count += 1
    return count


def live_bytes(device: torch.device) -> int:
    """Bytes allocated on ``device``: CUDA's allocator, or on a CPU every storage a live tensor
    Python can reach holds, each counted once."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        return torch.cuda.memory_allocated(device)
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                try:
                    storage = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses
                    continue
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


class Trainer:
    """One model, its optimizer and how a step runs (``kind``: scheduler, hand, autocast, plain)."""

    def __init__(self, kind: str, model, device: torch.device, *, scheduler=None, plan=None, dtype=torch.bfloat16, fused: bool):
        self.kind, self.model, self.device = kind, model, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        self.scheduler = scheduler
        self.dtype = dtype
        self.runtime = ap.apply_plan(model, plan) if plan is not None else None
        needs_scale = plan is not None and any(lp.grad_format is ap.Format.FP16 for lp in plan.layers.values())
        self.scaler = torch.amp.GradScaler(device.type, enabled=needs_scale) if kind == "hand" else None

    def step(self, batch) -> torch.Tensor:
        x, y = batch
        model, optimizer = self.model, self.optimizer
        if self.kind == "scheduler":
            with self.scheduler.precision_context():
                loss = torch.nn.functional.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
            self.scheduler.backward(loss)
            self.scheduler.step(optimizer)
        else:
            if self.kind == "hand":
                context = self.runtime
            elif self.kind == "autocast" or self.dtype is not torch.float32:
                context = torch.autocast(self.device.type, dtype=self.dtype)
            else:
                context = contextlib.nullcontext()
            with context:
                loss = torch.nn.functional.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                loss.backward()
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def timed_step(trainer: Trainer, batch) -> float:
    sync(trainer.device)
    start = time.perf_counter()
    trainer.step(batch)
    sync(trainer.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=40, help="the scheduler's monitor_window")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved planned rounds timed")
    parser.add_argument("--max-search-steps", type=int, default=400)
    parser.add_argument("--memory-budget", type=float, default=None)
    parser.add_argument("--accuracy-budget", type=float, default=0.02)
    parser.add_argument("--max-precision", type=int, default=32)
    parser.add_argument("--sample-every", type=int, default=None, help="the scheduler's sample_every (default: its own)")
    parser.add_argument("--monitor-steps", type=int, default=None, help="the scheduler's monitor_steps (default: its own)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    fused = device.type == "cuda"
    config = LMConfig(context=args.context, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, d_ff=4 * args.d_model)
    train, val = split_corpus(load_corpus())
    workload = ByteLMWorkload("gpt", config, train, val, args.batch)
    batches = workload.train_batches(0)

    def batch():
        x, y = batches.next()
        return x.to(device), y.to(device)

    def build():
        return workload.build_model(0).to(device)

    window_dtype = torch.float32 if args.max_precision == 32 else torch.bfloat16
    before = live_bytes(device)
    graphs_before = graph_tensors()

    # 1. The README loop: profiling window (interleaved with plain steps of its precision), search.
    optional = {name: value for name, value in (("sample_every", args.sample_every), ("monitor_steps", args.monitor_steps)) if value is not None}
    scheduler = ap.DynamicPrecisionScheduler(min_precision=8, max_precision=args.max_precision, monitor_window=args.window,
                                             memory_budget=args.memory_budget, accuracy_budget=args.accuracy_budget, **optional)
    sched = Trainer("scheduler", build(), device, scheduler=scheduler, fused=fused)
    plain = Trainer("plain", build(), device, dtype=window_dtype, fused=fused)
    seconds, phases, plain_seconds = [], [], []
    peak_reset(device)
    for step in range(args.window + args.max_search_steps):
        b = batch()
        phase = scheduler.phase
        seconds.append(timed_step(sched, b))
        phases.append(phase)
        if phase == "profiling" and step > 0:  # the window's steps against plain ones, one each
            plain_seconds.append(timed_step(plain, b))
        if scheduler.phase in ("planned", "safe"):
            break
    if scheduler.plan is None:
        raise SystemExit(f"no plan after {len(seconds)} steps: {scheduler.last_search_error}")
    search_peak = peak(device)
    del plain
    plan = scheduler.plan
    profiling = [s for s, p in zip(seconds, phases) if p == "profiling"][1:]  # the first binds (FP32, unprofiled)
    search = [s for s, p in zip(seconds, phases) if p == "searching"]

    # 2. Memory between planned steps: the scheduler's, then the plan by hand's beside it.
    for _ in range(3):
        sched.step(batch())
    graphs_planned = graph_tensors()
    with_scheduler = live_bytes(device)
    hand = Trainer("hand", build(), device, plan=plan, fused=fused)
    for _ in range(3):
        hand.step(batch())
    with_hand = live_bytes(device)
    scheduler_bytes, hand_bytes = with_scheduler - before, with_hand - with_scheduler

    # 3. Planned steps interleaved: scheduler, by hand, plain autocast.
    autocast = Trainer("autocast", build(), device, fused=fused)
    autocast.step(batch())
    trainers = [sched, hand, autocast]
    times: dict[str, list[float]] = {t.kind: [] for t in trainers}
    peaks: dict[str, list] = {t.kind: [] for t in trainers}
    for round_ in range(args.rounds):
        b = batch()
        for trainer in trainers[round_ % 3:] + trainers[:round_ % 3]:
            peak_reset(device)
            times[trainer.kind].append(timed_step(trainer, b))
            peaks[trainer.kind].append(peak(device))
    median = {kind: statistics.median(ts) for kind, ts in times.items()}

    # 4. After close() and del: what the scheduler leaves behind.
    del hand, autocast, trainers, trainer
    scheduler.close()
    del sched, scheduler
    graphs_closed = graph_tensors()
    left = live_bytes(device) - before

    tokens = args.batch * args.context
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    planned_median = median["scheduler"]
    result = {
        "benchmark": "scheduler_costs", "commit": commit, "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
        "threads": torch.get_num_threads(), "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                                                      "context": args.context, "batch": args.batch},
        "window": args.window, "settings": optional, "memory_budget": args.memory_budget, "accuracy_budget": args.accuracy_budget,
        "plan": plan.format_counts(),
        "planned_over_by_hand": planned_median / median["hand"],
        # Means too: a watch sampling one step in sample_every leaves the median on an unsampled step.
        "planned_over_by_hand_mean": statistics.fmean(times["scheduler"]) / statistics.fmean(times["hand"]),
        "tokens_per_s": {kind: tokens / m for kind, m in median.items()},
        "tokens_per_s_over_autocast": {kind: median["autocast"] / m for kind, m in median.items()},
        "profiling_over_plain": statistics.median(profiling) / statistics.median(plain_seconds),
        "profiling_steps": len(profiling),
        "search_steps": len(search),
        "search_extra_in_planned_steps": (sum(search) - len(search) * planned_median) / planned_median,
        "search_slowest_over_planned": max(search) / planned_median if search else None,
        "bytes_between_planned_steps": {"scheduler": scheduler_bytes, "hand": hand_bytes},
        "scheduler_over_hand_bytes": scheduler_bytes / hand_bytes,
        "bytes_left_after_close": left,
        "graph_tensors": {"before": graphs_before, "planned": graphs_planned, "after_close": graphs_closed},
        "peak_bytes": {"search": search_peak, **{kind: max(p) if p and p[0] is not None else None for kind, p in peaks.items()}},
        "search_step_s": [round(s, 4) for s in search],
        "median_step_s": {**median, "profiling": statistics.median(profiling), "plain_window_precision": statistics.median(plain_seconds)},
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
