"""Train one workload three ways side by side: plain FP32, uniform BF16 autocast, and under a
DynamicPrecisionScheduler; report validation loss (and accuracy), saved-activation bytes and
step time, as ratios to FP32.

    python examples/compare_training.py                        # byte LM "small", 600 steps
    python examples/compare_training.py --workload minilm      # MiniLM fine-tune (needs .[minilm])

The three runs step in turn (one step each per round), so machine noise hits all of them alike;
step times are medians. Saved-activation bytes are what autograd keeps for backward in one step
(`SavedTensorMeter`, parameters excluded), measured after training.
"""

import argparse
import statistics
import time

import torch

import autoprec as ap
from autoprec.saved_bytes import SavedTensorMeter
from autoprec.workload import TrainStep
from autoprec.workloads import default_workload


def workload(name: str):
    if name == "minilm":
        from autoprec.workloads.finetune import minilm_finetune_workload

        return minilm_finetune_workload()
    return default_workload(name, batch_size=16)


def metrics(wl, model, batches) -> dict:
    if hasattr(wl, "metrics"):
        return wl.metrics(model, batches)
    model.eval()
    with torch.no_grad():
        loss = statistics.fmean(float(wl.loss(model, b)) for b in batches)
    model.train()
    return {"loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small", help="a built-in LM preset (tiny, small) or minilm")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--window", type=int, default=100, help="the scheduler's monitor window")
    parser.add_argument("--memory-budget", type=float, default=0.6)
    parser.add_argument("--accuracy-budget", type=float, default=0.005)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    wl = workload(args.workload)
    val = wl.val_batches(8)
    # Each run trains as the workload trains (its optimizer, warmup and clipping) on the same batches.
    runs = {
        "fp32": TrainStep.for_workload(wl, wl.build_model(0)),
        "bf16_autocast": TrainStep.for_workload(wl, wl.build_model(0), context=lambda: torch.autocast("cpu", torch.bfloat16)),
        "scheduler": TrainStep.for_workload(wl, wl.build_model(0)),
    }
    sched = runs["scheduler"]
    scheduler = ap.DynamicPrecisionScheduler(
        monitor_window=args.window, memory_budget=args.memory_budget, accuracy_budget=args.accuracy_budget, lr=sched.lr,
        max_grad_norm=getattr(wl, "max_grad_norm", None), search_timeout_s=30,
    )
    batches = iter(wl.train_batches(0))
    times = {name: [] for name in runs}
    start = time.perf_counter()
    for step in range(args.steps):
        batch = next(batches)
        for name, trainer in runs.items():
            t0 = time.perf_counter()
            if name == "scheduler":
                # The scheduler owns backward and the step (loss scaling, clipping, skipping).
                with scheduler.precision_context():
                    loss = wl.loss(sched.model, batch)
                scheduler.backward(loss)
                scheduler.step(sched.optimizer)
                sched.schedule.step()
                sched.optimizer.zero_grad(set_to_none=True)
            else:
                trainer(batch)
            if step >= args.window + 10:  # time planned steps only
                times[name].append(time.perf_counter() - t0)
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}/{args.steps} ({time.perf_counter() - start:.0f} s) {scheduler}", flush=True)

    batch = tuple(val[0])
    rows = {}
    for name, trainer in runs.items():
        context = {"fp32": None, "bf16_autocast": lambda: torch.autocast("cpu", torch.bfloat16), "scheduler": scheduler.precision_context}[name]
        with SavedTensorMeter(list(trainer.model.parameters())) as meter:
            with context() if context else torch.enable_grad():
                wl.loss(trainer.model, batch)
        if name == "scheduler":
            with scheduler.precision_context():
                result = metrics(wl, trainer.model, val)
        else:
            with context() if context else torch.enable_grad():
                result = metrics(wl, trainer.model, val)
        rows[name] = {**result, "saved_bytes": meter.total_bytes, "step_s": statistics.median(times[name])}
    fp32 = rows["fp32"]
    print(f"\nworkload {args.workload}, {args.steps} steps, plan {scheduler.plan.format_counts() if scheduler.plan else None}, "
          f"{len(scheduler.changes)} changes, {scheduler.scaler.skipped_steps} skipped steps")
    print(f"{'variant':<14} {'val loss':>9} {'vs fp32':>8} {'acc':>6} {'saved MiB':>10} {'x fp32':>7} {'step ms':>8} {'x fp32':>7}")
    for name, r in rows.items():
        acc = f"{r['accuracy']:.3f}" if "accuracy" in r else "-"
        print(f"{name:<14} {r['loss']:9.4f} {r['loss'] / fp32['loss'] - 1:+8.2%} {acc:>6} {r['saved_bytes'] / 2**20:10.2f} "
              f"{r['saved_bytes'] / fp32['saved_bytes']:7.3f} {r['step_s'] * 1e3:8.1f} {r['step_s'] / fp32['step_s']:7.2f}")


if __name__ == "__main__":
    main()
