"""Precision per GEMM: FP8 layers with the weight gradient's product alone in high precision,
against the same layers with a low and with a whole high-precision backward.

The model is `block_fp8.OutlierMLP` (a residual MLP stack with outlier channels, regressing a
perturbed copy of itself). Every linear layer runs one recipe (`LayerPrecision.preset` names in
parentheses):

- ``fp8``: E4M3 forward, E5M2 gradients, per tensor (``torchao_tensorwise``);
- ``fp8+wgrad``: the same, the weight gradient's GEMM in high precision;
- ``fp8+backward``: the same forward, both backward GEMMs in high precision (``fp8_forward_only``);
- ``row`` / ``row+wgrad``: row-wise E4M3 throughout (``torchao_rowwise`` /
  ``torchao_rowwise_with_gw_hp``);

beside FP32 and BF16 autocast. Reported per recipe: the relative error, against FP32, of every
layer's weight gradient and of the input's gradient after one step from the same weights (mean
over the layers), and the training loss (mean of the last quarter) after ``--steps`` steps, per
seed. On a CPU the per-tensor products run torch's ``_scaled_mm`` (the row-wise ones where the
installed torch has the row-scaled form, else emulated); times are not reported.

Run: ``PYTHONPATH=. python benchmarks/weight_grad_split.py --seeds 0,1,2 --out benchmarks/results/weight_grad_split_cpu.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from block_fp8 import problem, problem_arguments, train  # noqa: E402

import autoprec as ap  # noqa: E402
from autoprec._io import atomic_write_text  # noqa: E402

ROW = ap.Scaling(granularity="row")
RECIPES = {
    "fp8": ap.LayerPrecision("fp8_e4m3"),
    "fp8+wgrad": ap.LayerPrecision("fp8_e4m3", high_precision_weight_grad=True),
    "fp8+backward": ap.LayerPrecision("fp8_e4m3", grad_format="fp32"),
    "row": ap.LayerPrecision.preset("torchao_rowwise"),
    "row+wgrad": ap.LayerPrecision.preset("torchao_rowwise_with_gw_hp"),
}


def gradient_errors(model: nn.Module, plan: "ap.Plan | None", x: torch.Tensor, y: torch.Tensor, reference: dict) -> "tuple[dict, dict]":
    """One step's gradients under ``plan`` (None: FP32), and their relative errors against
    ``reference`` (empty: none)."""
    model = copy.deepcopy(model)
    xg = x.clone().requires_grad_(True)
    runtime = ap.apply_plan(model, plan) if plan is not None else None
    with runtime if runtime is not None else torch.autocast("cpu", enabled=False):
        loss = F.mse_loss(model(xg).float(), y)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if name.endswith("weight")}
    grads["input"] = xg.grad.detach().clone()
    if runtime is not None:
        runtime.remove()
    errors = {k: float((g - reference[k]).norm() / reference[k].norm()) for k, g in grads.items()} if reference else {}
    return grads, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    problem_arguments(parser)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        model, data = problem(args, seed)
        layers = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        reference, _ = gradient_errors(model, None, *data[0], {})
        run = {"fp32": {"trained_loss": train(copy.deepcopy(model), None, data, args.steps, args.lr)},
               "bf16_autocast": {"trained_loss": train(copy.deepcopy(model), None, data, args.steps, args.lr, autocast=True)}}
        for label, lp in RECIPES.items():
            plan = ap.Plan({fqn: lp for fqn in layers})
            _, errors = gradient_errors(model, plan, *data[0], reference)
            weights = [v for k, v in errors.items() if k != "input"]
            run[label] = {"recipe": lp.recipe, "weight_grad_error": sum(weights) / len(weights), "input_grad_error": errors["input"],
                          "trained_loss": train(copy.deepcopy(model), plan, data, args.steps, args.lr)}
        runs[seed] = run
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": commit,
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    print(f"{'recipe':<14} {'weight-grad err':>16} {'input-grad err':>15}   loss after {args.steps} steps per seed")
    for label in ("fp32", "bf16_autocast", *RECIPES):
        rows = [runs[s][label] for s in runs]
        errors = f"{sum(r['weight_grad_error'] for r in rows) / len(rows):16.4f} {sum(r['input_grad_error'] for r in rows) / len(rows):15.4f}" \
            if label in RECIPES else f"{'':16} {'':15}"
        print(f"{label:<14} {errors}   " + "  ".join(f"{r['trained_loss']:.4f}" for r in rows))
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
