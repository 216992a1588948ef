"""Fine-grained FP8 (block scaling, MXFP8) against row-wise and per-tensor scaling on a model with outlier channels.

Trained LLMs carry a few activation channels about 100x the rest (LLM.int8(), arXiv:2208.07339);
one scale per tensor then spends E4M3's range on those channels and rounds the rest coarsely,
which 1x128 tiles (DeepSeek-V3) do not. The model here is a residual MLP stack whose hidden
features pass through a fixed per-channel gain with ``--outliers`` channels at ``--gain`` (the
shape a LayerNorm with a few large gammas gives); the task regresses a random teacher.

Reported (one JSON, ``--out``, and a table on stdout):

1. **SQNR per operand** (dB, higher is better) of E4M3 with per-tensor, row-wise, block and MX
   scaling, for every layer's input, weight and output gradient, captured from one FP32 step:
   per tensor one scale, row-wise one per row (activations and gradients; weights per output
   channel), block 1x128 tiles (activations, gradients) and 128x128 blocks (weights), MX one
   power-of-two scale per 32 elements of a row (the forward GEMM's tiling of each operand).
2. **The search under one accuracy budget**, with FP8 E4M3 in its default per-tensor scaling, per
   row, in block scaling and in MXFP8 (`Planning.scaling`), and with all four weighed per layer
   in one search ("per layer": `Planning.alternatives`), candidates BF16 and FP8 E4M3, the budget
   ``--accuracy`` relative to the FP32 loss, at the least memory that budget allows (FP8
   wherever the predicted loss lets it go): how many layers it puts in FP8, that memory, the
   predicted loss increase, and the loss after ``--steps`` training steps of the plan (on CPU
   every FP8 product is emulated: the same roundings, FP32 arithmetic), beside BF16 autocast
   and FP32 trained the same way.
3. **At equal memory**: at the least memory one scaling alone reaches, the plan of least
   predicted loss of that scaling's search and of the per-layer search, each trained as above.

Run: ``PYTHONPATH=. python benchmarks/block_fp8.py --out benchmarks/results/block_fp8_cpu.json``
(the per-layer comparison: ``--accuracy 0.001 --seed N``, seeds 0-2, `benchmarks/results/block_fp8_recipes_seed{N}.json`).
CPU seconds are not reported: on a CPU block-scaled and MX products are emulated.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import subprocess
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoprec as ap
from autoprec._io import atomic_write_text
from autoprec.formats import MX_BLOCK, Format, block_amax, dequantize, expand_blocks, inverse_scale, mx_inverse_scale, quantize, sqnr
from autoprec.errors import InfeasibleBudgetError
from autoprec.search.pipeline import Planning, measure_space, propose_from
from autoprec.search.budgets import Budgets

E4M3 = Format.FP8_E4M3
SCALINGS = ("tensor", "row", "block", "mx")


class OutlierMLP(nn.Module):
    """``depth`` residual blocks ``x + W2·gelu(W1·(g ⊙ x))`` with a fixed gain ``g``: ``outliers``
    channels at ``gain``, the rest at 1."""

    def __init__(self, width: int, hidden: int, depth: int, outliers: int, gain: float, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        g = torch.ones(width)
        g[torch.randperm(width, generator=generator)[:outliers]] = gain
        self.register_buffer("gain", g)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(depth))
        for block in self.blocks:
            nn.init.normal_(block[2].weight, std=0.02 / gain)  # keeps the residual stream's scale

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x * self.gain)
        return x


def _sqnr_tensor(x: torch.Tensor) -> float:
    inv = inverse_scale(x.abs().amax(), E4M3)
    return sqnr(x, dequantize(quantize(x, inv, E4M3), inv))


def _sqnr_rows(x: torch.Tensor) -> float:
    inv = inverse_scale(x.abs().amax(dim=1, keepdim=True), E4M3)
    return sqnr(x, dequantize(quantize(x, inv, E4M3), inv))


def _sqnr_blocks(x: torch.Tensor, block: tuple[int, int]) -> float:
    inv = expand_blocks(inverse_scale(block_amax(x, block), E4M3), x.shape, block)
    return sqnr(x, dequantize(quantize(x, inv, E4M3), inv))


def _sqnr_mx(x: torch.Tensor) -> float:
    inv = expand_blocks(mx_inverse_scale(block_amax(x, MX_BLOCK), E4M3), x.shape, MX_BLOCK)
    return sqnr(x, dequantize(quantize(x, inv, E4M3), inv))


def operand_sqnr(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per layer and operand: SQNR (dB) of E4M3 per tensor, per row and per block, captured from
    one FP32 step (the inputs and output gradients of every Linear)."""
    captured: dict[str, dict[str, torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            def forward_hook(mod, inputs, out, name=name):
                captured.setdefault(name, {})["input"] = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
                captured[name]["weight"] = mod.weight.detach()

            def backward_hook(mod, grad_in, grad_out, name=name):
                captured[name]["gradient"] = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1])

            hooks += [module.register_forward_hook(forward_hook), module.register_full_backward_hook(backward_hook)]
    F.mse_loss(model(x), y).backward()  # one FP32 step
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    table = {}
    for name, tensors in captured.items():
        table[name] = {}
        for operand, t in tensors.items():
            block = (128, 128) if operand == "weight" else (1, 128)
            table[name][operand] = {"tensor": _sqnr_tensor(t), "row": _sqnr_rows(t), "block": _sqnr_blocks(t, block), "mx": _sqnr_mx(t)}
    return table


def train(model: nn.Module, plan: "ap.Plan | None", data, steps: int, lr: float, autocast: bool = False) -> float:
    """Loss of the last ``steps // 4`` steps (mean) after training ``model`` under ``plan``."""
    runtime = ap.apply_plan(model, plan) if plan is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tail = []
    for step in range(steps):
        x, y = data[step % len(data)]
        with (runtime if runtime is not None else torch.autocast("cpu", torch.bfloat16, enabled=autocast)):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= steps - steps // 4:
            tail.append(float(loss.detach()))
    if runtime is not None:
        runtime.remove()
    return sum(tail) / len(tail)


def problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The outlier MLP's and its training's command-line settings (`problem`'s)."""
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--gain", type=float, default=100.0)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=None)


def problem(args: argparse.Namespace, seed: int) -> "tuple[OutlierMLP, list]":
    """The model of ``seed`` and 8 batches of (input, target): the targets a copy of the model
    with its weights perturbed by their own spread."""
    torch.manual_seed(seed)
    model = OutlierMLP(args.width, args.hidden, args.depth, args.outliers, args.gain, seed)
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * p.std().clamp_min(1e-3))
    data = []
    for _ in range(8):
        x = torch.randn(args.tokens, args.width)
        with torch.no_grad():
            data.append((x, teacher(x)))
    return model, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    problem_arguments(parser)
    parser.add_argument("--accuracy", type=float, default=0.02, help="the search's relative accuracy budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, data = problem(args, args.seed)
    x0, y0 = data[0]

    sqnr_table = operand_sqnr(model, x0, y0)

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]).float(), batch[1])

    with torch.no_grad():
        baseline = float(loss_fn(model, data[0]))
    searches, spaces = {}, {}
    for label, scaling in (("per-tensor", {}), ("row", {"fp8_e4m3": "row"}), ("block", {"fp8_e4m3": "block"}), ("mx", {"fp8_e4m3": "mx"}),
                           ("per layer", {"fp8_e4m3": list(SCALINGS)})):
        # The least memory the accuracy budget allows (FP8 wherever it may go: a CPU emulates
        # FP8, so the fastest plan under a loose memory budget would have none), then that plan.
        planning = Planning((Format.BF16, Format.FP8_E4M3), budgets=Budgets(memory=0.01, accuracy=args.accuracy), scaling=scaling)
        found = measure_space(copy.deepcopy(model), x0, data[:2], loss_fn, None, planning)
        spaces[label] = (planning, found)
        try:
            propose_from(found, planning, baseline_loss=baseline)
            raise SystemExit("memory budget 0.01 met: the model is too small for this figure")
        except InfeasibleBudgetError as exc:
            floor = exc.min_bytes
        planning = dataclasses.replace(planning, budgets=Budgets(memory=int(floor) + 1, accuracy=args.accuracy))
        plan = propose_from(found, planning, baseline_loss=baseline).plans[0]
        fp8 = sorted(fqn for fqn, lp in plan.layers.items() if lp.format is E4M3)
        loss = train(copy.deepcopy(model), plan, data, args.steps, args.lr)
        searches[label] = {"fp8_layers": len(fp8), "layers": len(plan.layers), "fp8": fp8, "memory_fraction": floor / found.costs.fp32_bytes(),
                           "predicted_loss_increase": plan.predicted["loss_increase"], "trained_loss": loss,
                           "recipes": {fqn: lp.recipe for fqn, lp in plan.layers.items()},
                           "sensitivity": {fqn: found.sensitivity[(fqn, E4M3)] for fqn in plan.layers}}
    # At equal memory: the least memory any one scaling reaches, and the plan of least predicted
    # loss within it from the per-layer search (whose space holds that scaling's plan) and from it.
    best = min((label for label in searches if label != "per layer"), key=lambda label: searches[label]["memory_fraction"])
    at_memory = {}
    for label in (best, "per layer"):
        planning, found = spaces[label]
        memory = int(searches[best]["memory_fraction"] * found.costs.fp32_bytes()) + 1
        try:
            propose_from(found, dataclasses.replace(planning, budgets=Budgets(memory=memory, accuracy=0.0, accuracy_relative=False)), baseline_loss=baseline)
            least = 0.0
        except InfeasibleBudgetError as exc:
            least = exc.min_loss
        plan = propose_from(found, dataclasses.replace(planning, budgets=Budgets(memory=memory, accuracy=least * (1 + 1e-6), accuracy_relative=False)),
                            baseline_loss=baseline).plans[0]
        at_memory[label] = {"predicted_loss_increase": plan.predicted["loss_increase"], "memory_fraction": plan.predicted["bytes"] / found.costs.fp32_bytes(),
                            "trained_loss": train(copy.deepcopy(model), plan, data, args.steps, args.lr),
                            "recipes": {fqn: lp.recipe for fqn, lp in plan.layers.items()}}
    references = {
        "fp32": train(copy.deepcopy(model), None, data, args.steps, args.lr),
        "bf16_autocast": train(copy.deepcopy(model), None, data, args.steps, args.lr, autocast=True),
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": commit, "args": {k: str(v) for k, v in vars(args).items()},
              "baseline_loss": baseline, "sqnr_db": sqnr_table, "search": searches, "at_equal_memory": at_memory, "trained_loss": references}

    print(f"SQNR of E4M3 (dB), {args.outliers} outlier channels at {args.gain:g}x; tensor / row / block / mx")
    for name, ops in sqnr_table.items():
        cells = "   ".join(f"{op} {v['tensor']:5.1f} / {v['row']:5.1f} / {v['block']:5.1f} / {v['mx']:5.1f}" for op, v in ops.items())
        print(f"  {name:<12} {cells}")
    print(f"search, candidates bf16 + fp8_e4m3, accuracy budget {args.accuracy:g} relative (FP32 loss {baseline:.4g})")
    for label, s in searches.items():
        print(f"  fp8 {label:<10} {s['fp8_layers']}/{s['layers']} layers in FP8 (memory {s['memory_fraction']:.3f} of FP32), "
              f"predicted +{s['predicted_loss_increase']:.3g}, loss after {args.steps} steps {s['trained_loss']:.4g}")
        if label == "per layer":
            print("    " + ", ".join(f"{fqn} {recipe}" for fqn, recipe in s["recipes"].items()))
    print(f"  references: FP32 {references['fp32']:.4g}, BF16 autocast {references['bf16_autocast']:.4g}")
    print(f"at the least memory one scaling reaches ({best}), the plan of least predicted loss:")
    for label, s in at_memory.items():
        print(f"  {label:<10} memory {s['memory_fraction']:.3f}, predicted +{s['predicted_loss_increase']:.3g}, loss after {args.steps} steps {s['trained_loss']:.4g}")
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
