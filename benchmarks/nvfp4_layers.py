"""Which layers stay in BF16 under NVFP4: NVIDIA's hand rule against autoprec's measured choice.

NVIDIA's NVFP4 pretraining recipe (arXiv:2509.25149) keeps the last blocks' linear layers in BF16
(about 16 % of them; torchtitan 0.3.0 ships it as ``nvfp4_bf16_tail_fqns``: the last
``ceil(0.15 * blocks)`` blocks) and notes that quantization-error metrics could choose them
instead. Here a byte-level decoder (`workloads.bytelm.ByteLM`, ``--blocks`` blocks) is trained on
the bundled text with NVFP4 numerics emulated exactly (`runtime.nvfp4`: E2M1 values, E4M3 scales
per 16 elements, 16x16 weight blocks, stochastic rounding and the Hadamard transform on the
gradients), five ways, every seed from the same start:

- (a) BF16: every layer under BF16 autocast;
- (b) NVFP4: every block linear layer in NVFP4;
- (c) the hand rule: NVFP4 but the last ``ceil(--tail * blocks)`` blocks' linear layers in BF16;
- (d) autoprec at (c)'s count: the same number of BF16 layers, the ones autoprec's sensitivity
  estimate (`sensitivity.FisherEstimator`, what the search ranks by) says lose the most in NVFP4;
- (e) autoprec under an accuracy budget: the search (`search.pipeline`) at the least memory whose
  predicted loss increase stays within (c)'s measured gap (that seed's), reporting how many block
  linear layers it leaves in NVFP4;
- (f) NVFP4 forward, high-precision backward: (b) with every NVFP4 layer's ``grad_format`` FP32
  (Transformer Engine's ``backward_override="dequantized"``): what the gradients' rounding costs.

The embeddings, the attention products and the LM head stay in BF16 in every run (NVIDIA's recipe
quantizes linear layers only; torchtitan keeps the head out). Every run starts from the same
``--warmup`` BF16 steps (autoprec's profiling window: the sensitivity is estimated on that
model), then trains ``--steps`` more on the same batches, the default generator seeded alike
(each run's stochastic rounding draws the same stream); the figure is the validation loss
(``--eval-batches`` fixed batches of held-out text, under the run's own plan) minus (a)'s, in
nats, mean and spread over ``--seeds``.

Run: ``PYTHONPATH=. python benchmarks/nvfp4_layers.py --out benchmarks/results/nvfp4_layers_cpu.json``
(``--seeds 0`` alone for one seed; ``--variants a_bf16 b_nvfp4 f_nvfp4_high_backward`` some of the
runs ((d) and (e) need the sensitivity, (e) also (a) and (c)); ``--merge A.json B.json`` joins runs
of different seeds).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

import autoprec as ap
from autoprec._io import atomic_write_text
from autoprec.errors import InfeasibleBudgetError
from autoprec.formats import Format
from autoprec.search.pipeline import Planning, measure_space, propose_from
from autoprec.search.budgets import Budgets
from autoprec.search.space import LayerRules
from autoprec.workloads.bytelm import BatchSampler, ByteLM, LMConfig, load_corpus, split_corpus

NVFP4, BF16 = Format.NVFP4, Format.BF16
LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # a ByteLM block's linear layers
VARIANTS = ("a_bf16", "b_nvfp4", "c_hand_rule", "d_autoprec_same_count", "e_autoprec_budget", "f_nvfp4_high_backward")


def _loss(model, batch):
    return model(batch[0], batch[1])[1]


def _token_losses(model, batch):
    """Per-token losses: the sensitivity estimate takes their count as the loss's N (a mean alone
    would give its Fisher term N times too small)."""
    logits = model(batch[0])[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[1].reshape(-1), reduction="none")


def _plan(base: ap.Plan, nvfp4: "set[str]", grad_format: "Format | None" = None) -> ap.Plan:
    return ap.Plan({fqn: ap.LayerPrecision(NVFP4, grad_format=grad_format) if fqn in nvfp4 else ap.LayerPrecision(lp.format) for fqn, lp in base.layers.items()})


def _train(model, optimizer, plan, sampler, steps):
    runtime = ap.apply_plan(model, plan)
    for _ in range(steps):
        with runtime:
            loss = _loss(model, sampler.next())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return runtime


@torch.no_grad()
def _evaluate(model, runtime, batches) -> float:
    with runtime:
        return sum(_loss(model, b).item() for b in batches) / len(batches)


def run_seed(args, seed: int) -> dict:
    config = LMConfig(context=args.context, d_model=args.d_model, n_heads=args.heads, n_layers=args.blocks, d_ff=args.d_ff)
    train_tokens, val_tokens = split_corpus(load_corpus())
    torch.manual_seed(seed)
    model = ByteLM(config)
    sampler = BatchSampler(train_tokens, args.batch, args.context, seed=seed)
    val = [b for _, b in zip(range(args.eval_batches), BatchSampler(val_tokens, args.batch, args.context, seed=10_000 + seed))]
    base = ap.Plan.uniform(model, BF16)
    candidates = [f"blocks.{i}.{name}" for i in range(args.blocks) for name in LINEARS]
    if not set(candidates) <= set(base.layers):
        raise SystemExit(f"ByteLM's layers changed: {sorted(set(candidates) - set(base.layers))} are not planned layers")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    _train(model, optimizer, base, sampler, args.warmup).remove()
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), sampler.state_dict())

    tail = math.ceil(args.tail * args.blocks)
    hand = {f for f in candidates if int(f.split(".")[1]) < args.blocks - tail}
    kept = len(candidates) - len(hand)
    searched = {"d_autoprec_same_count", "e_autoprec_budget"} & set(args.variants)
    cost: dict = {}
    search_cpu = 0.0
    if searched:
        # autoprec's sensitivity, on the warmed-up model, of each candidate in NVFP4 and BF16.
        batches = [sampler.next() for _ in range(args.sensitivity_batches)]
        sampler.load_state_dict(start[2])
        pinned = {fqn: BF16 for fqn in base.layers if fqn not in candidates}
        planning = Planning((BF16, NVFP4), rules=LayerRules(pin=pinned), min_precision=4, max_precision=16, lr=args.lr, measure=False)
        began = time.process_time()
        found = measure_space(copy.deepcopy(model), batches[0][0], batches, _token_losses, None, planning)
        search_cpu = time.process_time() - began
        cost = {fqn: found.sensitivity[(fqn, NVFP4)] - found.sensitivity[(fqn, BF16)] for fqn in candidates}
    by_autoprec = set(sorted(candidates, key=lambda f: cost[f])[: len(candidates) - kept]) if cost else set()
    chosen = {"a_bf16": set(), "b_nvfp4": set(candidates), "c_hand_rule": hand, "d_autoprec_same_count": by_autoprec,
              "f_nvfp4_high_backward": set(candidates)}
    results: dict = {}

    def run(name: str, nvfp4: "set[str]") -> None:
        model.load_state_dict(start[0])
        optimizer.load_state_dict(copy.deepcopy(start[1]))  # it adopts the tensors it is given: they would move on
        sampler.load_state_dict(start[2])
        # Every run draws the same stochastic-rounding noise stream, whichever runs went before it
        # (the sensitivity estimate and NVFP4 runs draw from the default generator).
        torch.manual_seed(seed)
        plan = _plan(base, nvfp4, Format.FP32 if name == "f_nvfp4_high_backward" else None)
        began = time.process_time()
        runtime = _train(model, optimizer, plan, sampler, args.steps)
        results[name] = {"val_loss": _evaluate(model, runtime, val), "nvfp4_layers": len(nvfp4), "bf16_layers": len(candidates) - len(nvfp4),
                         "bf16": sorted(set(candidates) - nvfp4), "cpu_s": time.process_time() - began}
        runtime.remove()
        print(f"seed {seed} {name}: val loss {results[name]['val_loss']:.4f}, {len(nvfp4)} of {len(candidates)} linear layers in NVFP4", flush=True)

    for name, nvfp4 in chosen.items():
        if name in args.variants:
            run(name, nvfp4)
    record = {"seed": seed, "runs": results, "sensitivity_nvfp4_minus_bf16": cost, "search_cpu_s": search_cpu}
    if "e_autoprec_budget" not in args.variants:
        return record
    gap_c = results["c_hand_rule"]["val_loss"] - results["a_bf16"]["val_loss"]
    # (e): the least memory whose predicted loss increase over (a)'s, all BF16, is within (c)'s gap
    # (the search's budgets are over FP32: (a)'s own predicted increase is added).
    bf16_increase = found.space.totals(found.space.uniform(BF16)).loss
    accuracy = (bf16_increase + max(gap_c, 0.0)) * (1 + 1e-6)  # (a) itself within it, past the sums' rounding
    try:
        propose_from(found, dataclasses.replace(planning, budgets=Budgets(memory=0.01, accuracy=accuracy, accuracy_relative=False)), baseline_loss=None)
        raise SystemExit("a memory budget of 1 % was met: the model is too small for this figure")
    except InfeasibleBudgetError as exc:
        floor = exc.min_bytes
    plan_e = propose_from(found, dataclasses.replace(planning, budgets=Budgets(memory=int(floor) + 1, accuracy=accuracy, accuracy_relative=False)),
                          baseline_loss=None).plans[0]
    run("e_autoprec_budget", {f for f in candidates if plan_e.layers[f].format is NVFP4})
    results["e_autoprec_budget"]["accuracy_budget_nats"] = accuracy - bf16_increase
    results["e_autoprec_budget"]["predicted_loss_increase"] = plan_e.predicted["loss_increase"] - bf16_increase
    return {**record, "overlap_d_with_c_bf16": len((set(candidates) - by_autoprec) & (set(candidates) - hand))}


def summarise(seeds: list[dict]) -> dict:
    summary = {}
    for name in (v for v in VARIANTS if all(v in s["runs"] for s in seeds)):
        gaps = [s["runs"][name]["val_loss"] - s["runs"]["a_bf16"]["val_loss"] for s in seeds]
        counts = [s["runs"][name]["nvfp4_layers"] for s in seeds]
        summary[name] = {"gap_nats_mean": statistics.fmean(gaps), "gap_nats_spread": (max(gaps) - min(gaps)) if len(gaps) > 1 else 0.0,
                         "gap_nats_stdev": statistics.stdev(gaps) if len(gaps) > 1 else 0.0, "gaps": gaps, "nvfp4_layers": counts}
    return summary


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100, help="BF16 steps every run starts from (the profiling window)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tail", type=float, default=0.15, help="the hand rule's fraction of blocks kept in BF16 (torchtitan's 0.15)")
    parser.add_argument("--sensitivity-batches", type=int, default=4)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the runs to make (default all; a_bf16 is every gap's reference)")
    parser.add_argument("--merge", nargs="*", help="join the JSON results of earlier runs (their seeds) instead of running")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    wanted = set(args.variants)
    if "a_bf16" not in wanted or ("e_autoprec_budget" in wanted and "c_hand_rule" not in wanted):
        parser.error("--variants: a_bf16 is every gap's reference, and e_autoprec_budget needs c_hand_rule's gap; add them")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", ap.EmulationWarning)
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        seeds = sorted((s for p in parts for s in p["seeds"]), key=lambda s: s["seed"])
        record = {**parts[0], "seeds": seeds, "summary": summarise(seeds)}
    else:
        seeds = [run_seed(args, int(s)) for s in args.seeds.split(",")]
        record = {"benchmark": "nvfp4_layers", "commit": _commit(), "torch": torch.__version__, "device": "cpu", "machine": platform.machine(),
                  "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("merge", "out")},
                  "numerics": "NVFP4 emulated exactly (runtime.nvfp4); GEMMs in FP32", "seeds": seeds, "summary": summarise(seeds)}
    atomic_write_text(args.out, json.dumps(record, indent=1) + "\n")
    for name, row in record["summary"].items():
        print(f"{name:24s} gap {row['gap_nats_mean']:+.4f} nats (spread {row['gap_nats_spread']:.4f}), NVFP4 layers {row['nvfp4_layers']}")


if __name__ == "__main__":
    main()
