"""The conformance matrix's figures: each model of the matrix (tests/support/hf_models.py: Hugging Face
GPT-2, Llama, BERT, ViT, T5, ResNet, tiny) trained through the README loop under the scheduler at
memory budgets 0.5 and 0.75 (tests/support/conformance.py's run), against the same model trained in plain
FP32 and under plain BF16 autocast from the same weights on the same batches.

Per model and budget: the plan (formats, recomputed blocks), the training loss at the end (mean
of the last quarter of steps) and the held-out loss, each against FP32's; a planned step's saved
bytes plus gradient buffers against an FP32 step's (metered, as the matrix's test does); and the
step time under the scheduler against FP32, beside the same plan applied by hand and BF16
autocast, as ratios measured in one run: after training, rounds of one step each of the four
(the order rotated every round), medians. The
planned steps include the scheduler's own work (its checks every 8th step, at the default pace).

    python benchmarks/conformance.py                  # ~6 min on 2 CPU cores
    python benchmarks/conformance.py --models gpt2,t5 --steps 60 --rounds 30
    python benchmarks/conformance.py --device cuda --models gpt2,llama --budgets 0.5   # the GPU session's cases

Writes benchmarks/results/conformance_<device>_torch<version>.json and prints the table of docs/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the matrix's models and runs

import autoprec as ap  # noqa: E402
from autoprec.device_clock import rotated, timed  # noqa: E402
from support import conformance  # noqa: E402
from support import hf_models  # noqa: E402
from autoprec._io import atomic_write_text  # noqa: E402
from autoprec.runtime import EmulationWarning  # noqa: E402


def plain_losses(model, rows, steps, autocast, device):
    """The README loop without a scheduler: ``steps`` steps of AdamW in FP32 or BF16 autocast."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=conformance.LR)
    losses = []
    for step in range(steps):
        batch = hf_models.stack(rows[step * conformance.MICRO_BATCH:(step + 1) * conformance.MICRO_BATCH], device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def held_out_loss(model, batch, context):
    model.eval()
    with torch.no_grad(), context:
        loss = model(**batch).loss.item()
    model.train()
    return loss


def step_times(variants, batch, rounds, device):
    """Median seconds of one training step of each variant (name -> (model, context factory,
    backward, step)), timed in rounds of one step each, the order rotated every round
    (`autoprec.device_clock`: wall time from a synced device to the step's work done)."""
    seconds = {name: [] for name in variants}
    for r in range(rounds):
        for name in rotated(list(variants), r):
            model, context, backward, step = variants[name]

            def one():
                with context():
                    loss = model(**batch).loss
                backward(loss)
                step()

            seconds[name].append(timed(one, device)[1])
    return {name: statistics.median(values[2:]) for name, values in seconds.items()}  # the first rounds warm up


def one(name, memory, accuracy, steps, rounds, device):
    torch.manual_seed(0)
    model, _ = hf_models.MODELS[name](0)
    model.to(device)
    start_weights = copy.deepcopy(model.state_dict())
    rows = hf_models.data(name, steps * conformance.MICRO_BATCH, 0)
    held_out = hf_models.stack(hf_models.data(name, 2 * conformance.MICRO_BATCH, 1), device)
    # The matrix's settings, but the planned checks at their default pace (every 8th step, not 2nd).
    settings = {**conformance.settings(memory, accuracy), "sample_every": 8}
    sch, losses, _ = conformance.run_loop(model, settings, rows, hf_models.data(name, 8, 1), steps)
    reference = {}
    for label, autocast in (("fp32", False), ("bf16_autocast", True)):
        torch.manual_seed(0)
        m, _ = hf_models.MODELS[name](0)
        m.to(device).load_state_dict(start_weights)
        plain = plain_losses(m, rows, steps, autocast, device)
        ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
        reference[label] = (m, plain, held_out_loss(m, held_out, ctx()), ctx)
    quarter = max(1, steps // 4)
    batch = hf_models.stack(rows[:conformance.MICRO_BATCH], device)
    planned_bytes = conformance.saved_bytes(model, batch, sch)
    fp32_bytes = conformance.saved_bytes(reference["fp32"][0], batch, None)
    held_planned = held_out_loss(model, held_out, sch.precision_context())
    optimizers = {label: torch.optim.AdamW(m.parameters(), lr=conformance.LR) for label, (m, *_rest) in reference.items()}
    sch_opt = torch.optim.AdamW(model.parameters(), lr=conformance.LR)

    def plain_step(opt):
        def step():
            opt.step()
            opt.zero_grad()
        return step

    def planned_step():
        sch.step(sch_opt)
        sch_opt.zero_grad()

    # The same plan applied by hand (no scheduler): what the plan itself costs.
    by_hand = copy.deepcopy(model)
    runtime = ap.apply_plan(by_hand, sch.plan, validate=False)
    optimizers["by_hand"] = torch.optim.AdamW(by_hand.parameters(), lr=conformance.LR)
    variants = {
        "plan": (model, sch.precision_context, sch.backward, planned_step),
        "by_hand": (by_hand, runtime.region, lambda loss: loss.backward(), plain_step(optimizers["by_hand"])),
        **{label: (m, ctx, lambda loss: loss.backward(), plain_step(optimizers[label])) for label, (m, _, _, ctx) in reference.items()},
    }
    times = step_times(variants, batch, rounds, device)
    runtime.remove()
    row = {
        "model": name, "memory_budget": memory, "accuracy_budget": accuracy, "steps": steps, "phase": sch.phase, "error": sch.last_search_error,
        "formats": sch.plan.format_counts() if sch.plan else {}, "recompute": list(sch.plan.recompute) if sch.plan else [],
        "train_loss": statistics.mean(losses[-quarter:]), "train_loss_fp32": statistics.mean(reference["fp32"][1][-quarter:]),
        "train_loss_bf16_autocast": statistics.mean(reference["bf16_autocast"][1][-quarter:]),
        "held_out_loss": held_planned, "held_out_loss_fp32": reference["fp32"][2], "held_out_loss_bf16_autocast": reference["bf16_autocast"][2],
        "saved_vs_fp32": planned_bytes / fp32_bytes, "step_vs_fp32": times["plan"] / times["fp32"], "by_hand_step_vs_fp32": times["by_hand"] / times["fp32"],
        "bf16_autocast_step_vs_fp32": times["bf16_autocast"] / times["fp32"],
        "step_seconds": times, "measured_loss_increase": sch.last_check.increase if sch.last_check else None,
    }
    sch.close()
    return row


def table(rows) -> str:
    lines = ["| model | budget | plan | saved bytes vs FP32 | train loss (FP32, autocast) | held-out loss (FP32, autocast) | step vs FP32 (plan by hand, autocast) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = ", ".join(f"{n} {f}" for f, n in sorted(r["formats"].items(), key=lambda kv: -kv[1])) + (f"; {len(r['recompute'])} blocks recomputed" if r["recompute"] else "")
        lines.append(f"| {r['model']} | {r['memory_budget']} | {plan or r['phase']} | {r['saved_vs_fp32']:.2f} | {r['train_loss']:.3f} ({r['train_loss_fp32']:.3f}, "
                     f"{r['train_loss_bf16_autocast']:.3f}) | {r['held_out_loss']:.3f} ({r['held_out_loss_fp32']:.3f}, {r['held_out_loss_bf16_autocast']:.3f}) | "
                     f"{r['step_vs_fp32']:.2f} ({r['by_hand_step_vs_fp32']:.2f}, {r['bf16_autocast_step_vs_fp32']:.2f}) |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(hf_models.MODELS))
    parser.add_argument("--budgets", default="0.5,0.75")
    parser.add_argument("--accuracy", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the tests: small models, a shared machine
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        for name in args.models.split(","):
            for memory in (float(b) for b in args.budgets.split(",")):
                rows.append(one(name, memory, args.accuracy, args.steps, args.rounds, device))
                print(json.dumps({k: rows[-1][k] for k in ("model", "memory_budget", "phase", "formats", "saved_vs_fp32", "step_vs_fp32")}), flush=True)
    out = Path(args.out) if args.out else HERE / "results" / f"conformance_{device.type}_torch{torch.__version__.split('+')[0]}.json"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    atomic_write_text(out, json.dumps({"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit,
                                       "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}, indent=1))
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
