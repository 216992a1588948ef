"""What the training-time search costs the training loop: the longest step and the total extra.

Trains a 6-block byte-level GPT (d_model 256, context 128, batch 16: 4.9M parameters, 31 matmul
layers) under ``DynamicPrecisionScheduler`` (the seed's API, no ``model=``), its first search
at the end of a ``--window``-step profiling window, and times every step (forward to the end of
``scheduler.step``). Reports, as in-run ratios:

- the longest step from the window's end until a plan is in force, over the median planned step;
- the extra time the search added: the time of those steps minus as many median planned steps,
  in planned steps (and minus as many median FP32 steps, in seconds);
- the plan's formats, measured saved bytes over the FP32 step's, and the held-out loss after
  ``--steps`` steps over that of the same run in FP32 (the plan's quality).

Uses only the public API, so the same script measures an older autoprec (``PYTHONPATH=<checkout>``).

    PYTHONPATH=. python benchmarks/search_stall.py                       # ~5 minutes on 2 CPU cores
    PYTHONPATH=. python benchmarks/search_stall.py --out benchmarks/results/search_stall_<tag>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import autoprec as ap
from autoprec.saved_bytes import SavedTensorMeter
from autoprec.workloads.bytelm import ByteLMWorkload, LMConfig, evaluate, load_corpus, split_corpus


def workload() -> ByteLMWorkload:
    config = LMConfig(vocab_size=256, context=128, d_model=256, n_heads=8, n_layers=6, d_ff=1024)
    train, val = split_corpus(load_corpus())
    return ByteLMWorkload("gpt6", config, train, val, 16)


def run(wl: ByteLMWorkload, steps: int, scheduler) -> dict:
    """Train ``steps`` steps (under ``scheduler``, or plain FP32 when None); per-step seconds and phases."""
    model = wl.build_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = wl.train_batches(0)
    seconds, phases = [], []
    for _ in range(steps):
        x, y = batches.next()
        start = time.perf_counter()
        if scheduler is None:
            loss = wl.loss(model, (x, y))
            loss.backward()
            optimizer.step()
        else:
            with scheduler.precision_context():
                loss = wl.loss(model, (x, y))
            scheduler.backward(loss)
            scheduler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        phases.append("fp32" if scheduler is None else scheduler.phase)
    x, y = wl.train_batches(7).next()
    with SavedTensorMeter(list(model.parameters())) as meter:
        with scheduler.precision_context() if scheduler is not None else torch.enable_grad():
            loss = wl.loss(model, (x, y))
    (scheduler.scale(loss) if scheduler is not None else loss).backward()
    return {"seconds": seconds, "phases": phases, "val_loss": evaluate(model, wl.val_batches(8)), "saved_bytes": meter.total_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--memory-budget", type=float, default=0.65)
    parser.add_argument("--accuracy-budget", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wl = workload()
    fp32 = run(wl, args.steps, None)
    scheduler = ap.DynamicPrecisionScheduler(memory_budget=args.memory_budget, accuracy_budget=args.accuracy_budget,
                                             monitor_window=args.window, monitor_steps=args.window)
    tried = run(wl, args.steps, scheduler)
    if scheduler.plan is None:
        raise SystemExit(f"no plan after {args.steps} steps: {scheduler.last_search_error}")
    # The window ends at the step whose scheduler.step() starts the search; the search's steps
    # run until the first step after which a plan is in force (the old search: that one step).
    first_planned = tried["phases"].index("planned")
    search = tried["seconds"][args.window - 1:first_planned + 1]
    planned = tried["seconds"][first_planned + 1:]
    median_planned = statistics.median(planned)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(ap.__file__).parent).stdout.strip()
    result = {
        "benchmark": "search_stall", "commit": commit, "torch": torch.__version__, "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "threads": args.threads, "steps": args.steps, "window": args.window, "memory_budget": args.memory_budget, "accuracy_budget": args.accuracy_budget,
        "plan": scheduler.plan.format_counts(),
        "plan_layers": {fqn: lp.format.value for fqn, lp in scheduler.plan.layers.items()},
        "search_timeline_s": dict(scheduler.plan.measured.get("search_timeline", {})),  # per stage (the spread search)
        "search_steps": len(search),
        "median_planned_step_s": median_planned,
        "longest_search_step_s": max(search),
        "longest_over_median_planned": max(search) / median_planned,
        "extra_seconds": sum(search) - len(search) * median_planned,
        "extra_in_planned_steps": (sum(search) - len(search) * median_planned) / median_planned,
        # The same against FP32 steps (the safe precision): on a CPU the plan's steps can be the slower.
        "extra_over_fp32_seconds": sum(search) - len(search) * statistics.median(fp32["seconds"][1:]),
        "val_loss_over_fp32": tried["val_loss"] / fp32["val_loss"],
        "saved_bytes_over_fp32": tried["saved_bytes"] / fp32["saved_bytes"],
        "median_fp32_step_s": statistics.median(fp32["seconds"][1:]),
        "val_loss": tried["val_loss"], "fp32_val_loss": fp32["val_loss"],
        "search_step_seconds": [round(t, 4) for t in search],
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
