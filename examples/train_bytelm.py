"""Train the built-in byte-level LM under a per-layer precision plan.

Adopting autoprec in an existing loop is three lines: make a plan, make a runtime, and run the
forward pass inside it. Backward and the optimizer step stay as they were.

    python examples/train_bytelm.py --format fp8_e4m3 --steps 300
"""

import argparse
import logging
import time

import torch

import autoprec as ap
from autoprec.workloads import default_workload, evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="fp8_e4m3", help="uniform format for every layer (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int8)")
    parser.add_argument("--plan", help="a plan JSON to load instead of a uniform plan")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    workload = default_workload("small")
    model = workload.build_model(seed=0)
    batches = workload.train_batches(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    example = workload.val_batches(1)[0][0]
    plan = ap.Plan.load(args.plan) if args.plan else ap.Plan.uniform(model, args.format, example)  # 1
    runtime = ap.apply_plan(model, plan)                                                             # 2
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batches.next()
        with runtime:                                                                                # 3
            loss = workload.loss(model, (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            logging.info("step %4d  train loss %.3f", step, loss.item())
    elapsed = time.perf_counter() - start
    logging.info("validation loss %.3f after %d steps (%.1f s) with %r", evaluate(model, workload.val_batches()), args.steps, elapsed, plan)
    for fqn, ops in runtime.emulated_layers().items():
        logging.info("emulated in %s: %s", fqn, ", ".join(ops))


if __name__ == "__main__":
    main()
