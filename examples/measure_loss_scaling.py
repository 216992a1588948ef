"""Does a plan need the global loss scale? Trains the built-in byte LM under uniform plans with
`LossScaler`'s dynamic scale and with a fixed scale of 1 (``enabled=False``: the non-finite check
stays), same seed and batches, and prints per run the loss at a few steps, the mean of the last
10 losses, the validation loss, the mean fraction of exactly-zero parameter-gradient elements
and the skipped steps.

    PYTHONPATH=. python examples/measure_loss_scaling.py --steps 100 --preset tiny --batch-size 8
"""

import argparse
import logging
import warnings

import torch

import autoprec
from autoprec.scaling import LossScaler
from autoprec.workloads import default_workload, evaluate


def run(wl, fmt: str, dynamic: bool, steps: int) -> dict:
    model = wl.build_model(0)
    example = wl.val_batches(1)[0][0]
    runtime = autoprec.apply_plan(model, autoprec.Plan.uniform(model, fmt, example)) if fmt != "fp32" else None
    opt = torch.optim.AdamW(model.parameters(), lr=wl.lr)
    scaler = LossScaler(enabled=dynamic)
    sampler = wl.train_batches(0)
    losses, zeros = [], []
    for _ in range(steps):
        batch = sampler.next()
        if runtime is not None:
            with runtime:
                loss = wl.loss(model, batch)
        else:
            loss = wl.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        zeros.append(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "zero": sum(zeros) / len(zeros), "skipped": scaler.skipped_steps,
            "val": evaluate(model, wl.val_batches(4)), "scale": scaler.get_scale()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--formats", default="fp32,bf16,fp16,fp8_e4m3")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # CPU emulation warnings
    logging.basicConfig(level=logging.WARNING)
    wl = default_workload(args.preset, batch_size=args.batch_size)
    marks = [0, args.steps // 4, args.steps // 2, args.steps - 1]
    print(f"{'plan':10} {'scale':8} " + " ".join(f"loss@{m:<4}" for m in marks) + "  last10   val     zero-grad  skipped  final-scale")
    for fmt in args.formats.split(","):
        for dynamic in (True, False):
            r = run(wl, fmt, dynamic, args.steps)
            last = sum(r["losses"][-10:]) / 10
            print(f"{fmt:10} {'dynamic' if dynamic else 'fixed 1':8} " + " ".join(f"{r['losses'][m]:9.4f}" for m in marks)
                  + f"  {last:.4f}  {r['val']:.4f}  {r['zero']:.5f}    {r['skipped']:3d}      {r['scale']:g}", flush=True)


if __name__ == "__main__":
    main()
