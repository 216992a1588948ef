"""The regret figure of the measured search: k-best, k-best + the learning sampler, TPE and GP.

**The table.** On the built-in tiny byte LM (`autoprec.workloads.default_workload("tiny")`), six
layers are left free in FP32, BF16 and INT8 (the attention qkv, MLP fc and MLP proj of both
blocks; the rest pinned to FP32): 3^6 = 729 plans. A search job (``measure_top = 1``) gives the
proxy (its `SearchSpace`) and its measured stage; that stage then measures every plan's bytes
and held-out loss increase (`MeasuredStage.memory`, `MeasuredStage.loss_increases`: what a job
measures). Step times are taken more carefully than a job can afford: in random blocks of
``--block`` plans, one copy of the model per plan and one in FP32, two warm-up steps each, then
``--rounds`` rounds in which every copy runs one timed training step, in a fresh random order
per round (the machine's drift and a neighbour's load fall on all plans alike). A plan's samples
are its step times over its block's FP32 median, times the median of the blocks' FP32 medians;
its step time the median of its samples. (One block of all 729 copies ran about 0.2 s a step
against 12 ms in blocks of 81, on a loaded machine; not diagnosed.) Torch runs one thread
(``--threads``): two OpenMP threads on a 2-core machine shared with other jobs stalled. The
table is cached as JSON (``--table``): replays read it and measure nothing.

**The replays.** For three budget settings (loose, medium, tight) and each seed, every search
is replayed against the table. A plan a search "measures" gets the median of ``--job-steps``
(default: a job's ``[measure].steps``) of its ``--rounds`` timed rounds drawn at random (seeded),
as a job's measured stage sees it; the regret is judged on the table's medians:

- ``proxy top-1`` / ``proxy top-3``: the k best plans of the proxy under the setting's
  predicted budgets, the fastest of them that meets the budgets as measured;
- ``k-best``: the k best plans plus the uniform plans that fit as predicted (the job's initial
  design without the sampler), k chosen so that it measures ``--trials`` plans;
- ``sampler``: the ``--design`` best plans plus the uniform plans, then `CorrectingSampler`
  up to ``--trials`` measured plans (it may stop sooner);
- ``tpe``: the same initial design enqueued, then Optuna's ``TPESampler`` (seeded, with the
  measured memory and loss as the trials' constraints, ``Trial.set_constraint``) up to
  ``--trials`` distinct plans (a plan it proposes again is not measured again, as in the job);
- ``gp``: the same with Optuna's ``GPSampler``.

Regret = the table's step time of the plan a search returns / that of the fastest plan of the
table meeting the budgets as measured.

    PYTHONPATH=. python benchmarks/refine_regret.py                # ~2 min on 2 CPU cores (GP most of it)
    PYTHONPATH=. python benchmarks/refine_regret.py --remeasure    # the table again first: ~8 min more

Writes ``benchmarks/results/refine_regret_<device>_torch<v>.json`` (and the table beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import platform
import statistics
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import optuna
import torch
from optuna.distributions import CategoricalDistribution

import autoprec.job.run as job_module
from autoprec.formats import Format
from autoprec.job.config import JobConfig, load_job
from autoprec.search.exact import k_best
from autoprec.job.run import run_job
from autoprec.search.candidate_runs import MeasuredStage, StepVariant, formats_id
from autoprec.runtime import EmulationWarning
from autoprec.search.refine import CorrectingSampler
from autoprec.search.space import Choice, SearchSpace
from autoprec.device_clock import timed

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
measure_top = 1
seed = {seed}

[rules]
pin = {{ "blocks.*.attn" = "fp32", "blocks.*.attn.proj" = "fp32", "lm_head" = "fp32" }}

[profile]
steps = 30
sensitivity_batches = 2

[measure]
val_batches = 4
steps = 1
"""

# (name, memory fraction of the measured FP32 bytes, relative loss increase allowed). All-FP32 is
# the fastest plan here (as the proxy says too), so every setting puts it over the memory budget.
SETTINGS = (("loose", 0.95, 1e-4), ("medium", 0.88, 3e-5), ("tight", 0.80, 1e-5))
RESULTS = Path(__file__).parent / "results"
TAG = f"cpu_torch{torch.__version__.split('+')[0]}"


class _KeptStage(MeasuredStage):
    """The job's measured stage, kept for the careful timing after the job (the job builds it)."""

    last: "MeasuredStage | None" = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _KeptStage.last = self


def time_rounds(stage: MeasuredStage, contexts: dict, rounds: int, seed: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of ``rounds`` training steps of each context (id -> model -> context manager),
    one step of every copy per round in a fresh random order."""
    variants = {key: StepVariant(stage.model, stage.train_step, context) for key, context in contexts.items()}
    for v in variants.values():
        for i in range(warmup):
            v.step(stage.train_batches[i % len(stage.train_batches)])
    rng = np.random.default_rng(seed)
    keys = list(variants)
    times = {key: [] for key in keys}
    for r in range(rounds):
        batch = stage.train_batches[r % len(stage.train_batches)]
        for i in rng.permutation(len(keys)):
            times[keys[i]].append(timed(functools.partial(variants[keys[i]].step, batch), stage.device)[1])
    for v in variants.values():  # the copies' plan wrappers off (a live runtime per copy slowed steps down)
        getattr(v.context, "remove", lambda: None)()
    return times


def time_blocks(stage: MeasuredStage, contexts: dict, rounds: int, block: int, seed: int) -> tuple[dict[str, list[float]], list[float]]:
    """`time_rounds` over random blocks of ``block`` plans, each with an FP32 copy; a plan's
    samples are its seconds divided by its block's FP32 median, times the median of the blocks'
    FP32 medians (blocks run minutes apart). Returns the samples and the blocks' FP32 medians."""
    rng = np.random.default_rng(seed)
    keys = list(contexts)
    ratios, fp32 = {}, []
    start = time.perf_counter()
    blocks = np.array_split(rng.permutation(len(keys)), max(1, -(-len(keys) // block)))
    for n, members in enumerate(blocks):
        times = time_rounds(stage, {"fp32": lambda m: contextlib.nullcontext(), **{keys[i]: contexts[keys[i]] for i in members}}, rounds, seed + n)
        base = statistics.median(times.pop("fp32"))
        fp32.append(base)
        ratios.update({key: [t / base for t in samples] for key, samples in times.items()})
        print(f"  block {n + 1}/{len(blocks)}: {len(members)} plans x {rounds} rounds ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    scale = statistics.median(fp32)
    return {key: [r * scale for r in rs] for key, rs in ratios.items()}, fp32


def measure_table(seed: int, rounds: int, block: int) -> dict:
    """Every plan of the space: its unit formats, measured bytes and loss increase (the job's
    measured stage) and step seconds (`time_rounds`); with the proxy and the FP32 figures."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.toml"
        path.write_text(textwrap.dedent(JOB.format(seed=seed)), encoding="utf-8")
        job_module.MeasuredStage = _KeptStage  # the job builds its stage; the table reuses it
        try:
            start = time.perf_counter()
            result = run_job(load_job(path))
        finally:
            job_module.MeasuredStage = MeasuredStage
    stage, space = _KeptStage.last, result.proposal.found.space
    probe = CorrectingSampler(space, [], float("inf"), float("inf"), 1.0, 1)
    free = [u for u in space.units if len(u.choices) > 1]
    plans, contexts = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        for formats in itertools.product(*[list(u.choices) for u in free]):
            assignment = {**space.extreme("seconds"), **{u.name: f for u, f in zip(free, formats)}}
            candidate = probe.candidate(assignment)
            *_, (increase, _) = stage.loss_increases(candidate)
            contexts[candidate.id] = candidate.context(stage.device)
            plans[candidate.id] = {"assignment": {k: f.value for k, f in assignment.items()}, "bytes": stage.memory(None, contexts[candidate.id]), "loss": increase}
            if len(plans) % 100 == 0:
                print(f"  {len(plans)} plans' bytes and loss ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    job_seconds = time.perf_counter() - start
    print(f"job and {len(plans)} plans' bytes and loss in {job_seconds:.0f} s; timing {rounds} rounds", file=sys.stderr)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        times, fp32_times = time_blocks(stage, contexts, rounds, block, seed)
    timing_seconds = time.perf_counter() - start
    for cid, p in plans.items():
        p["samples"] = times[cid]
        p["seconds"] = statistics.median(times[cid])
    fp32_pred = result.predicted_fp32
    return {
        "seed": seed, "rounds": rounds, "block": block, "job_seconds": job_seconds, "timing_seconds": timing_seconds,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "space": {"units": {u.name: {f.value: [c.bytes, c.seconds, c.loss] for f, c in u.choices.items()} for u in space.units},
                  "fixed": list(dataclass_values(space.fixed_total))},
        "fp32": {"bytes": result.references["fp32"].bytes, "seconds": statistics.median(fp32_times), "block_medians": fp32_times,
                 "predicted_bytes": fp32_pred["bytes"], "predicted_seconds": fp32_pred["seconds"]},
        "baseline_loss": stage.baseline_loss, "plans": plans,
    }


def dataclass_values(c: Choice) -> tuple[float, float, float]:
    return c.bytes, c.seconds, c.loss


def load_space(table: dict) -> SearchSpace:
    units = {name: {Format.parse(f): Choice(*v) for f, v in choices.items()} for name, choices in table["space"]["units"].items()}
    return SearchSpace(units, fixed={"rest": Choice(*table["space"]["fixed"])})


class Replay:
    """One search's view of the table: each plan measured once (the median of ``steps`` of its
    timed rounds, drawn with ``rng``: a job's noise), no plan twice, the figures as
    `MeasuredStage.run` leaves them in a trial."""

    def __init__(self, space: SearchSpace, table: dict, memory: float, loss: float, steps: int, rng: np.random.Generator):
        self.space, self.table, self.memory, self.loss, self.steps, self.rng = space, table, memory, loss, steps, rng
        self.dists = {u.name: CategoricalDistribution([f.value for f in u.choices]) for u in space.units}
        self.seen: dict[str, float] = {}  # candidate id -> seconds as measured, in order

    def attrs(self, assignment) -> dict:
        """The trial's user attributes for ``assignment``; measures it when not yet measured."""
        cid = formats_id(self.space.layer_formats(assignment))
        p = self.table["plans"][cid]
        if cid not in self.seen:
            self.seen[cid] = float(np.median(self.rng.choice(p["samples"], size=self.steps, replace=False)))
        seconds = self.seen[cid]
        return {"candidate": cid, "bytes": p["bytes"], "loss_increase": p["loss"], "seconds": seconds,
                "fp32_ratio": seconds / self.table["fp32"]["seconds"], "constraints": [p["bytes"] - self.memory, p["loss"] - self.loss]}

    def record(self, study: optuna.Study, assignment) -> None:
        attrs = self.attrs(assignment)
        study.add_trial(optuna.trial.create_trial(value=attrs["seconds"], params={k: Format.parse(v).value for k, v in assignment.items()},
                                                  distributions=self.dists, user_attrs=attrs))

    def returned(self) -> "float | None":
        """Table seconds of the plan the search returns: the fastest measured (as it saw them)
        meeting the budgets (bytes and loss increase are the table's, as a job measures them)."""
        plans = self.table["plans"]
        met = [cid for cid in self.seen if plans[cid]["bytes"] <= self.memory and plans[cid]["loss"] <= self.loss]
        return None if not met else plans[min(met, key=self.seen.get)]["seconds"]


def run_sampler(replay: Replay, design, trials: int, fp32_pred: float) -> None:
    sampler = CorrectingSampler(replay.space, [], replay.memory, replay.loss, fp32_pred, trials)
    study = optuna.create_study(sampler=sampler)
    for a in design:
        replay.record(study, a)
    while (nxt := sampler.next_plan(study)).assignment is not None:
        replay.record(study, nxt.assignment)


def run_offshelf(replay: Replay, design, trials: int, sampler: optuna.samplers.BaseSampler) -> None:
    """The design enqueued, then ``sampler``'s plans until ``trials`` distinct plans are
    measured; a plan proposed again is told its first measurement (not measured twice)."""
    study = optuna.create_study(sampler=sampler)
    for a in design:
        study.enqueue_trial({k: f.value for k, f in a.items()})
    for _ in range(50 * trials):
        if len(replay.seen) >= trials:
            break
        trial = study.ask(replay.dists)
        attrs = replay.attrs({k: Format.parse(v) for k, v in trial.params.items()})
        for key, value in zip(("memory", "loss"), attrs.pop("constraints")):
            trial.set_constraint(key, value)  # as the measured stage sets them
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        study.tell(trial, attrs["seconds"])


# Seeded, modelling from the first trial after the design. The constraints are the trials' own
# (`Trial.set_constraint`, which Optuna 5 reads in place of the deprecated ``constraints_func``).
OFFSHELF = {
    "tpe": lambda n, seed: optuna.samplers.TPESampler(seed=seed, n_startup_trials=n),
    "gp": lambda n, seed: optuna.samplers.GPSampler(seed=seed, n_startup_trials=n),
}


def replay_all(table: dict, args) -> int:
    space = load_space(table)
    fp32 = table["fp32"]
    fp32_pred = fp32["predicted_seconds"]
    plans = table["plans"].values()
    rows = []
    for seed in args.seeds:
        for name, fraction, relative in SETTINGS:
            memory, loss = fraction * fp32["bytes"], relative * abs(table["baseline_loss"])
            predicted_memory = fraction * fp32["predicted_bytes"]
            met = [p["seconds"] for p in plans if p["bytes"] <= memory and p["loss"] <= loss]
            row = {"seed": seed, "setting": name, "memory_fraction": fraction, "loss_relative": relative, "feasible": len(met)}
            rows.append(row)
            if not met:
                continue
            optimum = row["optimum_ms"] = min(met) * 1e3
            uniforms = [a for a in (space.uniform(f) for f in (Format.FP32, Format.BF16, Format.INT8)) if a is not None
                        and space.totals(a).bytes <= predicted_memory and space.totals(a).loss <= loss]
            proxy = [s.assignment for s in k_best(space, predicted_memory, loss, max(args.trials, 3))]
            design = _distinct(proxy[: args.design] + uniforms)

            def searched(label, run, design):
                replay = Replay(space, table, memory, loss, args.job_steps, np.random.default_rng([seed, len(label)]))
                start = time.perf_counter()
                run(replay, _distinct(design))
                best = replay.returned()
                row[label] = {"regret": None if best is None else best * 1e3 / optimum, "trials": len(replay.seen),
                              "seconds": round(time.perf_counter() - start, 2)}

            record_all = lambda replay, design: [replay.attrs(a) for a in design]  # noqa: E731
            searched("proxy_top1", record_all, proxy[:1])
            searched("proxy_top3", record_all, proxy[:3])
            searched("k_best", record_all, proxy[: max(1, args.trials - len(uniforms))] + uniforms)
            searched("sampler", lambda r, d: run_sampler(r, d, args.trials, fp32_pred), design)
            for label in args.offshelf:
                searched(label, lambda r, d: run_offshelf(r, d, args.trials, OFFSHELF[label](len(d), seed)), design)
            print(json.dumps(row), file=sys.stderr)
    report = {
        "benchmark": "refine_regret", "device": "cpu", "cpu": table["cpu"], "threads": table["threads"], "torch": table["torch"],
        "optuna": optuna.__version__, "plans": len(table["plans"]), "table": args.table.name, "table_rounds": table["rounds"],
        "trials_budget": args.trials, "design_k": args.design, "job_steps": args.job_steps,
        "settings": [dict(zip(("name", "memory_fraction", "loss_relative"), s)) for s in SETTINGS], "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"refine_regret_{TAG}.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    methods = ["proxy_top1", "proxy_top3", "k_best", "sampler", *args.offshelf]
    print(f"{'seed':>4}  {'setting':8}  {'feasible':>8}  " + "  ".join(f"{m:>14}" for m in methods))
    cell = lambda r: "-" if r is None or r.get("regret") is None else f"{r['regret']:.3f} ({r['trials']})"  # noqa: E731
    for r in rows:
        print(f"{r['seed']:>4}  {r['setting']:8}  {r['feasible']:>8}  " + "  ".join(f"{cell(r.get(m)):>14}" for m in methods))
    print(f"wrote {path}")
    return 0


def _distinct(assignments):
    return list({formats_id(a): a for a in assignments}.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the replays (drawn step times, TPE)")
    parser.add_argument("--trials", type=int, default=20, help="measured-trial budget of each search")
    parser.add_argument("--design", type=int, default=2, help="k best plans in the initial design of the sampler and TPE")
    parser.add_argument("--job-steps", type=int, default=JobConfig.measure_steps,
                        help="timed rounds a replayed measurement takes the median of (default: a job's [measure].steps)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per plan when measuring the table (well above --job-steps: "
                        "a measurement drawing most of a plan's rounds would nearly be its table median)")
    parser.add_argument("--offshelf", nargs="*", default=["tpe", "gp"], choices=sorted(OFFSHELF), help="off-the-shelf Optuna samplers compared")
    parser.add_argument("--block", type=int, default=81, help="plans timed together (interleaved) when measuring the table")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a neighbour's load on a shared machine does not stall OpenMP)")
    parser.add_argument("--table", type=Path, default=RESULTS / f"refine_regret_table_{TAG}.json")
    parser.add_argument("--remeasure", action="store_true", help="measure the table even when --table exists")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.remeasure or not args.table.exists():
        torch.set_num_threads(args.threads)
        table = measure_table(0, args.rounds, args.block)
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.table}", file=sys.stderr)
    table = json.loads(args.table.read_text(encoding="utf-8"))
    return replay_all(table, args)


if __name__ == "__main__":
    raise SystemExit(main())
