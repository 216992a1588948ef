"""The sensitivity estimate's upstream gradient term, sampled against exact, on a byte-level GPT.

An FP8 layer's input-gradient product rounds the gradient every layer before it then sees. The
exact term (`FisherEstimator(upstream=True)`) pushes that error back through the model, one
partial backward per (layer, recipe, batch): quadratic in the layers. The sampled term
(``upstream="sampled"``, the search's) estimates the same quadratic form from a few random
parameter directions per batch, shared by every layer and recipe: linear. Reported, per depth
and recipe (FP8 with E5M2 gradients, the same with the weight gradient's product high, and with
the whole backward high): the rank agreement (Spearman) of the two upstream parts
(``Sensitivity.input_grad``) over the layers and of the whole gradient terms (with the layers'
own, ``grad``), the mean, median and 10th / 90th percentile of their ratio over the layers,
and the seconds each estimate took (ratios in one run: with no upstream term, sampled, exact).

The GPT (d_model 128, context 64, batch 8) trains ``--steps`` steps in FP32 first; the estimates
run on 2 batches, one thread.

    PYTHONPATH=. python benchmarks/upstream_term.py --depths 4,16 --out benchmarks/results/upstream_term_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import autoprec as ap
from autoprec._io import atomic_write_text
from autoprec.sensitivity import FisherEstimator, estimate_sensitivity, spearman
from autoprec.workloads.bytelm import ByteLMWorkload, LMConfig, load_corpus, split_corpus

RECIPES = {
    "fp8": ap.LayerPrecision("fp8_e4m3"),
    "fp8+wgrad": ap.LayerPrecision("fp8_e4m3", high_precision_weight_grad=True),
    "fp8+backward": ap.LayerPrecision("fp8_e4m3", grad_format="fp32"),
}


def trained_gpt(depth: int, steps: int) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=256, context=64, d_model=128, n_heads=4, n_layers=depth, d_ff=512)
    train, val = split_corpus(load_corpus())
    workload = ByteLMWorkload("gpt", config, train, val, 8)
    model = workload.build_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = workload.train_batches(0)
    for _ in range(steps):
        loss = workload.loss(model, batches.next())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, [batches.next() for _ in range(2)]


def per_token_ce(model, batch):
    x, y = batch
    logits = model(x)
    logits = logits if torch.is_tensor(logits) else logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="none")


def compare(depth: int, steps: int, probes: int) -> dict:
    model, batches = trained_gpt(depth, steps)
    out: dict = {}
    for label, lp in RECIPES.items():
        estimates, seconds = {}, {}
        for upstream in (False, "sampled", True):
            start = time.perf_counter()
            estimates[upstream] = estimate_sensitivity(model, batches, per_token_ce, [lp],
                                                       estimator=FisherEstimator(site="layer", upstream=upstream, probes=probes))
            seconds[str(upstream)] = round(time.perf_counter() - start, 2)
        exact, sampled = estimates[True], estimates["sampled"]
        keys = [k for k in exact.input_grad if exact.input_grad[k] > 0]  # the first layers have nothing upstream
        ratios = sorted(sampled.input_grad[k] / exact.input_grad[k] for k in keys)
        deciles = statistics.quantiles(ratios, n=10)
        gradient_terms = [{k: e.grad[k] + e.input_grad[k] for k in e.grad} for e in (exact, sampled)]
        out[label] = {"layers": len(exact.grad), "spearman_upstream": round(spearman(exact.input_grad, sampled.input_grad), 3),
                      "spearman_grad_term": round(spearman(*gradient_terms), 3),
                      "ratio_mean": round(statistics.fmean(ratios), 3), "ratio_median": round(statistics.median(ratios), 3), "ratio_p10": round(deciles[0], 3), "ratio_p90": round(deciles[-1], 3),
                      "upstream_share_of_exact": round(sum(exact.input_grad.values()) / sum(gradient_terms[0].values()), 3),
                      "seconds": {"no upstream": seconds["False"], "sampled": seconds["sampled"], "exact": seconds["True"]}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--probes", type=int, default=FisherEstimator.probes)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # attention products emulated on CPU: named once per layer
    runs = {depth: compare(depth, args.steps, args.probes) for depth in (int(d) for d in args.depths.split(","))}
    print(f"{'depth':>5} {'recipe':<13} {'layers':>6} {'rho up':>7} {'rho grad':>8} {'ratio mean, p10/median/p90':>28}   seconds none/sampled/exact")
    for depth, run in runs.items():
        for label, r in run.items():
            s = r["seconds"]
            print(f"{depth:>5} {label:<13} {r['layers']:>6} {r['spearman_upstream']:>7.3f} {r['spearman_grad_term']:>8.3f} "
                  f"{r['ratio_mean']:>6.2f}, {r['ratio_p10']:>6.2f} {r['ratio_median']:>6.2f} {r['ratio_p90']:>6.2f}   {s['no upstream']:.1f} / {s['sampled']:.1f} / {s['exact']:.1f}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": commit,
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
