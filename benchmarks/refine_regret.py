"""The regret figure of the measured search: k-best alone against k-best + the learning sampler.

On the built-in tiny byte LM (`autoprec.workloads.default_workload("tiny")`), four layers are
left free in FP32, BF16 and INT8 (the rest pinned to FP32: 3^4 = 81 plans), and a search job
with open budgets and ``measure_top = 81`` measures **every** plan once (`MeasuredStage`, the
job's own measured study). Then, for three budget settings (loose, medium, tight), each search
is replayed against that table (a plan's figures are its one measurement, so every search sees
the same numbers):

- ``proxy top-1`` / ``proxy top-3``: the k best plans of the proxy under the setting's predicted
  budgets, the fastest of them that meets the budgets as measured;
- ``k-best``: the k best plans plus the uniform plans that fit as predicted (today's initial
  design), k chosen so that it measures ``--trials`` plans;
- ``k-best + sampler``: 2 best plans plus the uniform plans, then `CorrectingSampler` up to
  ``--trials`` measured plans (it may stop sooner).

Regret = measured step time of the plan a search returns / that of the fastest plan of the 81
meeting the budgets as measured. Writes ``benchmarks/results/refine_regret_<device>_torch<v>.json``.

    PYTHONPATH=. python benchmarks/refine_regret.py            # ~10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import optuna
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.search.config import load_job
from autoprec.search.exact import k_best
from autoprec.search.job import run_job
from autoprec.search.refine import CorrectingSampler

JOB = """
[job]
name = "regret"
out = "out"
device = "cpu"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = {{ name = "tiny", batch_size = 8 }}

[search]
formats = ["fp32", "bf16", "int8"]
measure_top = 81
seed = {seed}

[rules]
pin = {{ "blocks.*.attn*" = "fp32", "blocks.1.mlp.proj" = "fp32" }}

[profile]
steps = 30
sensitivity_batches = 2

[measure]
val_batches = 4
steps = {steps}
"""

# (name, memory fraction of the measured FP32 bytes, relative loss increase allowed)
SETTINGS = (("loose", 1.0, 0.05), ("medium", 0.93, 0.01), ("tight", 0.88, 0.003))


def measure_all(seed: int, steps: int, folder: Path):
    """Every plan's measurement: a list of (assignment, plan, measured dict), the space, the FP32
    figures (measured and predicted) and the baseline loss."""
    path = folder / "job.toml"
    path.write_text(textwrap.dedent(JOB.format(seed=seed, steps=steps)), encoding="utf-8")
    result = run_job(load_job(path))
    space = result.proposal.found.space
    probe = CorrectingSampler(space, [], float("inf"), float("inf"), 1.0, 1)
    table = []
    for candidate, m in result.candidates:
        if candidate.autocast or isinstance(m, str):
            continue
        table.append((probe.assignment_of(candidate.plan), candidate.plan, {"seconds": m.seconds, "bytes": m.bytes, "loss": m.loss_increase}))
    fp32 = result.references["fp32"]
    skipped = [c.name for c, m in result.candidates if isinstance(m, str)]
    return table, space, fp32, result.predicted_fp32, result.proposal.budgets["baseline_loss"], skipped


def replay(space, table, design, memory, loss, trials, fp32_seconds, learn: bool):
    """Measured plans of one search (the design, then the sampler's proposals when ``learn``)."""
    by_id = {CorrectingSampler(space, [], 0, 0, 1.0, 1)._id(a): (a, m) for a, _, m in table}
    plans = [p for a, p, _ in table]
    sampler = CorrectingSampler(space, [p for p in plans if CorrectingSampler(space, [], 0, 0, 1.0, 1).assignment_of(p) in design],
                                memory, loss, fp32_seconds, trials)
    study = optuna.create_study(sampler=sampler)
    dists = {u.name: CategoricalDistribution([f.value for f in u.choices]) for u in space.units}

    def add(assignment, params):
        cid = sampler._id(assignment)
        m = by_id[cid][1]
        attrs = {"candidate": cid, "bytes": m["bytes"], "loss_increase": m["loss"], "fp32_ratio": m["seconds"] / fp32_seconds * sampler.fp32_seconds}
        study.add_trial(optuna.trial.create_trial(value=m["seconds"], params={k: v.value for k, v in assignment.items()} if params else {},
                                                  distributions=dists if params else {}, user_attrs=attrs))

    for a in design:
        add(a, False)
    while learn:
        nxt = sampler.next_plan(study)
        if nxt.assignment is None:
            break
        add(nxt.assignment, True)
    return [by_id[t.user_attrs["candidate"]][1] for t in study.trials]


def best_meeting(measured, memory, loss):
    met = [m for m in measured if m["bytes"] <= memory and m["loss"] <= loss]
    return min((m["seconds"] for m in met), default=None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--trials", type=int, default=10, help="measured-trial budget of each search")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per plan")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            table, space, fp32, predicted_fp32, baseline, skipped = measure_all(seed, args.steps, Path(tmp))
            seconds = time.perf_counter() - start
        print(f"seed {seed}: {len(table)} plans measured in {seconds:.0f} s ({len(skipped)} not measured: {skipped})", file=sys.stderr)
        # The proxy's FP32 step: what a trial's measured ratio is scaled by, as in the job.
        fp32_pred = predicted_fp32["seconds"]
        for name, fraction, relative in SETTINGS:
            memory, loss = fraction * fp32.bytes, relative * abs(baseline)
            predicted_memory = fraction * predicted_fp32["bytes"]
            optimum = best_meeting([m for _, _, m in table], memory, loss)
            if optimum is None:
                rows.append({"seed": seed, "setting": name, "feasible": 0})
                continue
            uniforms = [a for a in (space.uniform(f) for f in (Format.FP32, Format.BF16, Format.INT8)) if a is not None
                        and space.totals(a).bytes <= predicted_memory and space.totals(a).loss <= loss]
            row = {"seed": seed, "setting": name, "memory_fraction": fraction, "loss_relative": relative,
                   "feasible": sum(m["bytes"] <= memory and m["loss"] <= loss for _, _, m in table), "optimum_ms": optimum * 1e3}

            def searched(design, learn, label):
                design = list({str(sorted(a.items())): a for a in design}.values())
                measured = replay(space, table, design, memory, loss, args.trials, fp32_pred, learn)
                best = best_meeting(measured, memory, loss)
                row[label] = {"regret": None if best is None else best / optimum, "trials": len(measured)}

            for k, label in ((1, "proxy_top1"), (3, "proxy_top3")):
                searched([s.assignment for s in k_best(space, predicted_memory, loss, k)], False, label)
            k = max(1, args.trials - len(uniforms))
            searched([s.assignment for s in k_best(space, predicted_memory, loss, k)] + uniforms, False, "k_best")
            searched([s.assignment for s in k_best(space, predicted_memory, loss, 2)] + uniforms, True, "k_best_sampler")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    report = {
        "benchmark": "refine_regret", "device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "optuna": optuna.__version__, "trials_budget": args.trials, "steps": args.steps,
        "plans": 81, "settings": [dict(zip(("name", "memory_fraction", "loss_relative"), s)) for s in SETTINGS], "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"refine_regret_cpu_torch{torch.__version__.split('+')[0]}.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"{'seed':>4}  {'setting':8}  {'feasible':>8}  {'top-1':>6}  {'top-3':>6}  {'k-best':>12}  {'k-best+sampler':>14}")
    fmt = lambda r: "-" if r is None or r.get("regret") is None else f"{r['regret']:.3f} ({r['trials']})"  # noqa: E731
    for r in rows:
        print(f"{r['seed']:>4}  {r['setting']:8}  {r['feasible']:>8}  {fmt(r.get('proxy_top1')):>6}  {fmt(r.get('proxy_top3')):>6}  "
              f"{fmt(r.get('k_best')):>12}  {fmt(r.get('k_best_sampler')):>14}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
