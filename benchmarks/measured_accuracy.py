"""The accuracy budget measured once a plan is in force (`autoprec.scheduler.plan_checks`), shown
on a ViT-like case: a Hugging Face ViT (4 layers, d64) learns scikit-learn's 8x8 digits in FP32,
then trains on under a plan of INT8 layers, attention products included (emulated on CPU: INT8
storage, FP32 compute), with a tight accuracy budget.

Three runs from the same weights on the same batches: FP32; the INT8 plan fixed
(``DynamicPrecisionScheduler.from_plan(..., dynamic=False)``: no check); the INT8 plan dynamic,
whose checks measure its loss against FP32 on the check steps' batches and promote layers while
the measured increase is over the budget. Printed: each check's measured increase, the
promotions, and the test accuracy and loss of each run.

    python benchmarks/measured_accuracy.py            # ~1 min on 2 CPU cores
    python benchmarks/measured_accuracy.py --budget 0.005 --steps 120
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import subprocess
import warnings
from pathlib import Path

import torch
import transformers

import autoprec as ap
from autoprec._io import atomic_write_text
from autoprec.runtime import EmulationWarning


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return (x[order[:1400]], y[order[:1400]]), (x[order[1400:]], y[order[1400:]])


def vit():
    cfg = transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)


def batches(train, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = train
    for _ in range(steps):
        i = torch.randint(0, len(x), (64,), generator=gen)
        yield {"pixel_values": x[i], "labels": y[i]}


def evaluate(model, test, context):
    model.eval()
    with torch.no_grad(), context:
        out = model(pixel_values=test[0], labels=test[1])
    model.train()
    return (out.logits.argmax(-1) == test[1]).float().mean().item(), out.loss.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain", type=int, default=300, help="FP32 steps before the plan")
    parser.add_argument("--steps", type=int, default=80, help="steps under each run")
    parser.add_argument("--budget", type=float, default=0.002, help="accuracy budget: relative loss increase")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train, test = digits()
    base = vit()
    opt = torch.optim.AdamW(base.parameters(), lr=2e-3)
    for batch in batches(train, args.pretrain, 1):
        base(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    example = next(batches(train, 1, 2))
    plan = ap.Plan.uniform(base, "int8", example)
    attention = sorted(fqn for fqn, info in plan.fingerprint.items() if "scaled_dot_product_attention" in info.ops or "matmul" in info.ops)
    results = {}
    for run in ("fp32", "int8 fixed", "int8 checked"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
        sch = None if run == "fp32" else ap.DynamicPrecisionScheduler.from_plan(
            model, plan, dynamic=run == "int8 checked", monitor_window=1000, sample_every=4, accuracy_budget=args.budget)
        checks = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)
            for step, batch in enumerate(batches(train, args.steps, 3)):
                with sch.precision_context() if sch else torch.enable_grad():
                    loss = model(**batch).loss
                if sch:
                    sch.backward(loss)
                    sch.step(opt)
                    last = sch.last_check
                    if last is not None and last.increase is not None and (not checks or checks[-1][1:3] != (last.increase, last.checks)):
                        checks.append((sch.step_count, last.increase, last.checks, sch.plan.format_counts()))
                else:
                    loss.backward()
                    opt.step()
                opt.zero_grad()
            accuracy, test_loss = evaluate(model, test, sch.precision_context() if sch else torch.no_grad())
        results[run] = {"test_accuracy": accuracy, "test_loss": test_loss, "plan": sch.plan.format_counts() if sch else None,
                        "promotions": [f"step {c.step}: {c.fqn} {c.old.value} -> {c.new.value} ({c.reason})" for c in sch.changes] if sch else [],
                        "checks": [{"step": s, "measured_increase": inc, "checks_averaged": n, "plan": p} for s, inc, n, p in checks]}
        if sch:
            sch.close()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    report = {"device": "cpu", "torch": torch.__version__, "commit": commit, "threads": 1, "args": vars(args), "attention_products": attention, "runs": results}
    out = Path(__file__).parent / "results" / f"measured_accuracy_cpu_torch{torch.__version__.split('+')[0]}.json"
    atomic_write_text(out, json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
