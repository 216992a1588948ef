"""Recomputation searched together with the formats (issue 24): a tight and a loose memory budget.

**Models.** The built-in byte LM (``default_workload("tiny")``, or ``--preset small``) and a Hugging
Face ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (no download: vocabulary 256, 4
decoder layers, width 64, grouped-query attention), trained on the same byte corpus with the same
loss, optimizer and clipping (`llama_workload`). Both have two or more repeated blocks that
`autoprec.blocks.find_blocks` finds (``blocks.N``, ``model.layers.N``).

**Budgets.** The accuracy budget is ``--accuracy`` (relative loss increase, default 1 %). The
*tight* memory budget is ``--tight-factor`` (0.85) times the least memory any plan without
recomputation reaches within that accuracy budget, on the predictions: the search job run with
``[rules].recompute = []`` and an unreachable budget says it (its infeasible-budget error), so by
construction no plan without recomputation meets the tight budget (not even on the predictions,
which err toward more memory). The *loose* budget is ``--loose`` (0.9 of the FP32 bytes), which
plans without recomputation meet.

**Runs per model.** Search jobs (`autoprec.job.run_job`, CPU): (1) without blocks at an
unreachable budget: the floor above; (2) with blocks at the tight budget: the returned plan; (3)
without blocks at the tight budget: its error (no plan, the smallest reachable named); (4) with
blocks and (5) without blocks at the loose budget: the returned plan and (a), the best plan without
recomputation. Then one **head-to-head** measured stage (`MeasuredStage`, the job's own
measurement: saved-tensor bytes plus layer gradients, held-out loss increase over FP32, training
steps interleaved one for one with FP32 steps) on the model trained as the jobs trained it
(``[profile].steps`` steps of the workload from its seed), with no budget, so nothing is pruned,
measuring: both returned plans, (a), (b) every block recomputed under plain BF16 autocast
(torchtitan's "full" activation checkpointing) and (c) plain BF16 autocast. Every figure is a
ratio within that one stage: bytes / FP32 bytes, step seconds / FP32 step seconds, loss increase /
FP32 loss.

**Targets** (issue 24): at the tight budget a plan is found whose loss increase is at most (c)'s
plus 0.2 % of the FP32 loss; at the loose budget the returned plan is no slower than (a). On a
shared 2-core CPU the step ratios of two plans within ~10 % of each other are noise
(``--steps`` timed steps each); the JSON keeps every figure.

    PYTHONPATH=. python benchmarks/recompute.py                  # both models, ~1.5 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/recompute.py --models bytelm  # the built-in LM only

Writes ``benchmarks/results/recompute_<device>_torch<v>.json`` (device, torch version, commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.calls import ModelCall
from autoprec.errors import InfeasibleBudgetError
from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.runtime import EmulationWarning
from autoprec.job.config import JobConfig, load_job
from autoprec.job.run import run_job
from autoprec.search.candidate_runs import Candidate, MeasuredStage, Measurement
from autoprec.workload import TrainStep, load_workload
from autoprec.workloads import default_workload
from autoprec.workloads.bytelm import GRAD_CLIP, adamw_with_warmup

RESULTS = Path(__file__).parent / "results"
FACTORIES = {"bytelm": "autoprec.workloads:default_workload", "llama": "benchmarks.recompute:llama_workload"}


@dataclasses.dataclass(frozen=True, eq=False)
class LlamaBytes:
    """A Hugging Face Llama built from its config, trained on the built-in byte corpus: the byte
    LM workload's batches, loss (next-byte cross-entropy in float32), optimizer and clipping."""

    data: object  # the ByteLMWorkload whose batches it trains on
    config: object  # transformers.LlamaConfig
    lr: float = 3e-3
    max_grad_norm: float = GRAD_CLIP

    def build_model(self, seed: int = 0) -> nn.Module:
        import transformers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.LlamaForCausalLM(self.config)
        return model.train()

    def train_batches(self, seed: int = 0):
        return self.data.train_batches(seed)

    def val_batches(self, n: int = 8, seed: int = 1234):
        return self.data.val_batches(n, seed)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def make_optimizer(self, model: nn.Module):
        return adamw_with_warmup(model, self.lr)


def llama_workload(preset: str = "tiny", batch_size: int = 8, layers: int = 4, width: int = 64) -> LlamaBytes:
    """`LlamaBytes` on ``default_workload(preset)``'s data: ``layers`` decoder layers of ``width``."""
    import transformers

    data = default_workload(preset, batch_size=batch_size)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=width * 8 // 3 // 4 * 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=data.config.context, use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaBytes(data, config)


JOB = """
[job]
name = "{name}"
out = "out-{name}"
device = "cpu"

[workload]
factory = "{factory}"
kwargs = {kwargs}

[budgets]
memory = {memory}
accuracy = {accuracy}

[search]
formats = ["fp32", "bf16", "fp8_e4m3", "int8"]
measure_top = {top}

[rules]
{rules}

[profile]
steps = {profile_steps}
sensitivity_batches = 2

[measure]
val_batches = {val}
steps = {job_steps}
"""


def job(folder: Path, name: str, model: str, args, memory: float, blocks: bool):
    """A search job file for ``model`` at ``memory`` (a fraction of the FP32 bytes)."""
    kwargs = {"name": args.preset, "batch_size": args.batch} if model == "bytelm" else {"preset": args.preset, "batch_size": args.batch}
    text = JOB.format(
        name=name, factory=FACTORIES[model], kwargs="{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in kwargs.items()) + " }",
        memory=memory, accuracy=args.accuracy, top=args.top, rules="" if blocks else "recompute = []",
        profile_steps=args.profile_steps, val=args.val, job_steps=args.job_steps,
    )
    path = folder / f"{name}.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return load_job(path)


def floor_without_blocks(folder: Path, model: str, args) -> tuple[float, str]:
    """The least memory (fraction of the FP32 bytes, predicted) any plan without recomputation
    reaches within the accuracy budget: the infeasible-budget error of a job asking for 1 %,
    which states it as a fraction ("as budgets: memory 0.646 of the FP32 bytes")."""
    try:
        run_job(job(folder, f"{model}-floor", model, args, 0.01, blocks=False))
    except InfeasibleBudgetError as exc:
        return float(str(exc).split("as budgets: memory ")[1].split(" of the FP32 bytes")[0]), str(exc)
    raise SystemExit(f"{model}: a plan without recomputation met 1 % of the FP32 bytes; nothing to compare")


def searched(folder: Path, name: str, model: str, args, memory: float, blocks: bool) -> dict:
    start = time.perf_counter()
    try:
        result = run_job(job(folder, name, model, args, memory, blocks))
    except InfeasibleBudgetError as exc:
        return {"memory": memory, "blocks": blocks, "plan": None, "error": str(exc), "seconds": time.perf_counter() - start}
    plan = result.plan
    return {
        "memory": memory, "blocks": blocks, "plan": plan, "candidate": result.chosen.name if result.chosen else None,
        "seconds": time.perf_counter() - start, "candidates": len(result.candidates),
    }


def trained(model_name: str, args):
    """The workload and its model trained as the jobs trained it (seed 0, ``--profile-steps``)."""
    workload = load_workload(FACTORIES[model_name], {"name": args.preset, "batch_size": args.batch} if model_name == "bytelm"
                             else {"preset": args.preset, "batch_size": args.batch})
    model = workload.build_model(0)
    step = TrainStep.for_workload(workload, model)
    batches = iter(workload.train_batches(0))
    for _ in range(args.profile_steps):
        step(next(batches))
    return workload, model


def head_to_head(model_name: str, args, plans: dict[str, "Plan | None"]) -> dict:
    """Every plan of ``plans`` and the two autocast references measured in one stage, no budget."""
    workload, model = trained(model_name, args)
    val = workload.val_batches(args.val)
    batches = iter(workload.train_batches(1))
    train = [next(batches) for _ in range(4)]
    example = ModelCall.first(model, lambda: workload.loss(model, val[0]))
    stage = MeasuredStage(model, workload.loss, train, val, train_step=lambda m: TrainStep.for_workload(workload, m),
                          steps=args.steps, warmup=2)
    uniform = Plan.uniform(model, Format.BF16, example)
    blocks = next((p.blocks for p in plans.values() if p is not None and p.blocks), {})
    candidates = [Candidate(name, plan) for name, plan in plans.items() if plan is not None and not plan.metadata.get("runs_as")]
    for name, plan in plans.items():  # a returned plan that is an autocast reference runs as one
        if plan is not None and plan.metadata.get("runs_as"):
            candidates.append(Candidate(name, plan, autocast=True))
    candidates.append(Candidate("(b) recompute-all-autocast-bf16", uniform.with_recompute(list(blocks)), autocast=True))
    candidates.append(Candidate("(c) autocast-bf16", uniform, autocast=True))
    unique = {}
    for c in candidates:  # two names for one plan (the tight and loose plans may coincide): measured once
        unique.setdefault(c.id, []).append(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        results = stage.run([cs[0] for cs in unique.values()], optuna.create_study(), float("inf"), float("inf"), slow_prune=float("inf"))
        fp32 = stage.fp32()
    out = {"fp32": {"bytes": fp32.bytes, "seconds": fp32.seconds, "loss": fp32.loss}}
    for cid, cs in unique.items():
        m = results[cid]
        for c in cs:
            if not isinstance(m, Measurement):
                out[c.name] = {"error": m}
                continue
            out[c.name] = {
                "bytes_vs_fp32": m.bytes / fp32.bytes, "step_vs_fp32": m.seconds / fp32.seconds,
                "loss_increase_rel": m.loss_increase / fp32.loss, "bytes": m.bytes, "seconds": m.seconds,
                "formats": c.plan.format_counts(), "recompute": list(c.plan.recompute), "autocast": c.autocast,
            }
    return out


def run_model(model_name: str, args, folder: Path) -> dict:
    floor, floor_error = floor_without_blocks(folder, model_name, args)
    tight = round(args.tight_factor * floor, 4)
    runs = {
        "tight": searched(folder, f"{model_name}-tight", model_name, args, tight, blocks=True),
        "tight_without_blocks": searched(folder, f"{model_name}-tight-noblocks", model_name, args, tight, blocks=False),
        "loose": searched(folder, f"{model_name}-loose", model_name, args, args.loose, blocks=True),
        "loose_without_blocks": searched(folder, f"{model_name}-loose-noblocks", model_name, args, args.loose, blocks=False),
    }
    plans = {
        "tight: returned": runs["tight"]["plan"], "loose: returned": runs["loose"]["plan"],
        "loose: (a) best without recomputation": runs["loose_without_blocks"]["plan"],
    }
    measured = head_to_head(model_name, args, plans)
    autocast = measured.get("(c) autocast-bf16", {})
    report = {
        "floor_without_recompute": floor, "floor_error": floor_error, "tight_budget": tight, "loose_budget": args.loose,
        "runs": {k: {**{kk: vv for kk, vv in v.items() if kk != "plan"},
                     "returned": None if v["plan"] is None else {
                         "formats": v["plan"].format_counts(), "recompute": list(v["plan"].recompute),
                         "job_measured": {k2: v["plan"].measured[k2] for k2 in ("bytes", "seconds", "loss_increase", "fp32_bytes", "fp32_seconds")},
                     }} for k, v in runs.items()},
        "head_to_head": measured,
    }
    tight_m, loose_m = measured.get("tight: returned", {}), measured.get("loose: returned", {})
    base_m = measured.get("loose: (a) best without recomputation", {})
    report["targets"] = {
        "tight_plan_found": runs["tight"]["plan"] is not None,
        "tight_without_blocks_infeasible": runs["tight_without_blocks"]["plan"] is None,
        "tight_meets_budget_in_head_to_head": "bytes_vs_fp32" in tight_m and tight_m["bytes_vs_fp32"] <= tight,
        "tight_loss_within_autocast_plus_0.2pct": ("loss_increase_rel" in tight_m and "loss_increase_rel" in autocast
                                                   and tight_m["loss_increase_rel"] <= autocast["loss_increase_rel"] + 0.002),
        "loose_no_slower_than_a": "step_vs_fp32" in loose_m and "step_vs_fp32" in base_m and loose_m["step_vs_fp32"] <= base_m["step_vs_fp32"],
        "loose_step_over_a": loose_m.get("step_vs_fp32", float("nan")) / base_m.get("step_vs_fp32", float("nan")) if base_m.get("step_vs_fp32") else None,
    }
    return report


def table(name: str, report: dict) -> str:
    rows = [("variant", "bytes/fp32", "step/fp32", "loss +% of fp32", "formats", "recomputed")]
    for variant, m in report["head_to_head"].items():
        if variant == "fp32" or "bytes_vs_fp32" not in m:
            continue
        formats = ",".join(f"{n} {f}" for f, n in m["formats"].items()) + (" (autocast)" if m["autocast"] else "")
        rows.append((variant, f"{m['bytes_vs_fp32']:.3f}", f"{m['step_vs_fp32']:.2f}", f"{100 * m['loss_increase_rel']:+.3f}", formats, str(len(m["recompute"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"{name}: floor without recomputation {report['floor_without_recompute']:.3f}, tight budget {report['tight_budget']:.3f}, "
             f"loose {report['loose_budget']:.2f} (fractions of the FP32 bytes)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("targets: " + ", ".join(f"{k}={v if not isinstance(v, float) else round(v, 3)}" for k, v in report["targets"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bytelm", "llama"], choices=sorted(FACTORIES))
    parser.add_argument("--preset", default="tiny", help="the byte LM preset (and the Llama's data): tiny or small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accuracy", type=float, default=0.01, help="relative loss increase allowed")
    parser.add_argument("--tight-factor", type=float, default=0.85)
    parser.add_argument("--loose", type=float, default=0.9)
    parser.add_argument("--top", type=int, default=3, help="[search].measure_top of the jobs")
    parser.add_argument("--profile-steps", type=int, default=60)
    parser.add_argument("--val", type=int, default=6)
    parser.add_argument("--job-steps", type=int, default=JobConfig.measure_steps, help="[measure].steps of the jobs (default: a job's)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant in the head-to-head stage")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    start = time.perf_counter()
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            reports[name] = run_model(name, args, Path(tmp))
            print(table(name, reports[name]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
    result = {
        "benchmark": "recompute", "commit": commit, "dirty": dirty, "torch": torch.__version__, "device": "cpu",
        "cpu": platform.processor() or platform.machine(), "threads": args.threads, "python": sys.version.split()[0],
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "elapsed_s": round(time.perf_counter() - start, 1),
        "models": reports,
    }
    out = args.out or RESULTS / f"recompute_cpu_torch{'.'.join(torch.__version__.split('+')[0].split('.')[:2])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
