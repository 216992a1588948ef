"""The scheduler's search at depth (issue 57): a narrow Llama at several depths through the
README loop, beside the same model's plain FP32 steps in the same process.

The model is issue 57's: ``transformers.LlamaForCausalLM`` of hidden 32, intermediate 64, 2 heads,
vocabulary 256, context 32, batch 4, ``--blocks`` decoder layers (8 planned layers each, plus
the head); the scheduler ``min_precision=8, max_precision=32, monitor_window=12,
memory_budget=0.6, accuracy_budget=0.05``, defaults otherwise (measured costs, recomputation).
One thread. Per depth:

- the step at which a plan is in force (or none within ``--max-steps``) and its error if any;
- the slowest search step over the median plain step in wall time (the integer programs run on
  a thread beside the steps), the slowest of those that ran a probe or candidate plan (their
  formats' own cost on this device) and of the others (the safe precision and a slice of the
  search's off-path work), the slowest of the former over the median planned step (the adopted
  plan runs the same kernels), and the search's extra CPU seconds (its steps' process time less
  as many plain steps', the solving thread's included);
- the integer program's CPU seconds (`search.exact.k_best`, all its solves, on its thread);
- the process's RSS growth from the window's end to the step the plan is in force, and with
  ``--after-steps N`` over N planned steps after it.

Ratios are in-run (the plain step is timed in the same process); seconds are this machine's.

With ``--offline``: the offline job's proposal stage instead (`search.pipeline.propose_plans`, as
``autoprec search`` runs it: in-place costs, sensitivity, the 3 best plans, the default
candidate formats, memory 0.8, accuracy 0.05), its CPU seconds per stage.

    python benchmarks/depth.py --blocks 4,16,32 --out benchmarks/results/depth_cpu_torch2.13.json
    python benchmarks/depth.py --offline --blocks 16,64,128 --out benchmarks/results/depth_offline_cpu_torch2.13.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch


def rss_mib() -> float:
    """Current resident set size in MiB (Linux /proc), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llama(blocks: int):
    """Issue 57's narrow Llama at ``blocks`` decoder layers (seeded)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                                      num_hidden_layers=blocks, vocab_size=256, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def offline_depth(blocks: int) -> dict:
    """CPU seconds of `propose_plans` on the Llama at ``blocks``, per stage (its progress marks)."""
    from autoprec.search.pipeline import propose_plans
    from autoprec.search.planning import Planning
    from autoprec.search.budgets import Budgets
    from autoprec.search.space import DEFAULT_CANDIDATES

    model = llama(blocks)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    marks = {}
    start = time.process_time()
    proposal = propose_plans(model, ids, [ids], loss_fn, None, Planning(formats=DEFAULT_CANDIDATES, budgets=Budgets(memory=0.8, accuracy=0.05), k=3),
                             baseline_loss=5.5, cost_inputs=ids, cost_loss_fn=loss_fn, progress=lambda i, n, what: marks.setdefault(what, time.process_time()))
    end = time.process_time()
    return {"blocks": blocks, "planned_layers": len(proposal.plans[0].layers), "plans": len(proposal.plans), "propose_cpu_s": end - start,
            "costs_cpu_s": marks["estimating sensitivity"] - start, "sensitivity_and_solve_cpu_s": end - marks["estimating sensitivity"],
            "optimality_gap": proposal.plans[0].metadata.get("optimality_gap")}


def _runs_a_plan(stages: dict) -> bool:
    """Whether a search step ran a probe or candidate plan (its timeline grew in those stages)."""
    return "probe steps" in stages or "trial steps" in stages


def one_depth(blocks: int, max_steps: int, after_steps: int = 0) -> dict:
    import transformers

    from autoprec.scheduler import DynamicPrecisionScheduler
    from autoprec.search import exact

    model = llama(blocks)
    plain = transformers.LlamaForCausalLM(model.config)
    plain.load_state_dict(model.state_dict())
    sch = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=12, memory_budget=0.6, accuracy_budget=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    solver_seconds = [0.0]
    real_k_best = exact.k_best

    def timed_k_best(*args, **kwargs):
        start = time.thread_time()  # the solve runs on a thread of its own beside the steps
        try:
            return real_k_best(*args, **kwargs)
        finally:
            solver_seconds[0] += time.thread_time() - start

    exact.k_best = timed_k_best
    import autoprec.search.pipeline as pipeline

    pipeline.k_best = timed_k_best
    plain_steps, plain_walls, search_steps, search_walls, step_stages = [], [], [], [], []
    planned_at, rss_start, rss_planned, planned_steps, planned_walls = None, None, None, [], []
    try:
        for step in range(max_steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 256, (4, 32), generator=g)
            start, wall = time.process_time(), time.perf_counter()
            out = plain(input_ids=ids, labels=ids)
            out.loss.backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad(set_to_none=True)
            plain_steps.append(time.process_time() - start)
            plain_walls.append(time.perf_counter() - wall)
            phase = sch.phase
            search = sch._searches.search  # read only: which stages the step ran (its timeline's growth)
            before = dict(search.timeline) if search is not None else {}
            start, wall = time.process_time(), time.perf_counter()
            with sch.precision_context():
                out = model(input_ids=ids, labels=ids)
            sch.backward(out.loss)
            sch.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            seconds, wall = time.process_time() - start, time.perf_counter() - wall
            if phase == "searching" or sch.phase == "searching":
                search_steps.append(seconds)
                search_walls.append(wall)
                after = search.timeline if search is not None else {}
                ran = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 1e-4}
                step_stages.append((wall, step, ran))
                if rss_start is None:
                    rss_start = rss_mib()
            if planned_at is not None:
                planned_steps.append(seconds)
                planned_walls.append(wall)
            if sch.phase == "planned" and planned_at is None:
                planned_at, rss_planned = step + 1, rss_mib()
            if planned_at is not None and step + 1 >= planned_at + after_steps:
                break
    finally:
        exact.k_best = pipeline.k_best = real_k_best
    median_plain, median_plain_wall = statistics.median(plain_steps), statistics.median(plain_walls)
    row = {
        "blocks": blocks, "planned_layers": len(sch.plan.layers) if sch.plan is not None else None, "plan_in_force_at_step": planned_at,
        "search_steps": len(search_steps), "median_plain_step_s": median_plain,
        # Wall time: the search's integer programs run on a thread beside the steps, whose CPU
        # time a step's process time would count.
        "slowest_search_step_over_plain": max(search_walls) / median_plain_wall if search_walls else None,
        "search_extra_cpu_s": sum(search_steps) - median_plain * len(search_steps),
        "solver_cpu_s": solver_seconds[0],
        "rss_growth_mib": (rss_planned if rss_planned is not None else rss_mib()) - rss_start if rss_start is not None else None,
        # Once the plan is in force: the RSS growth over ``after_steps`` planned steps, and their
        # median over the plain step's.
        "rss_growth_after_plan_mib": rss_mib() - rss_planned if rss_planned is not None and planned_steps else None,
        "planned_steps": len(planned_steps),
        "median_planned_step_over_plain": statistics.median(planned_steps) / statistics.median(plain_steps) if planned_steps else None,
        "error": sch.last_search_error,
        # The three slowest search steps: (step, over a plain step, the stages' seconds in it).
        "slowest_steps": [(step, round(sec / median_plain_wall, 1), ran) for sec, step, ran in sorted(step_stages, key=lambda t: -t[0])[:3]],
        # Steps that run a probe or candidate plan (their formats' own cost on this device: on a
        # CPU without FP8 or BF16 arithmetic, emulated) apart from the rest, which run the safe
        # precision and a slice of off-path work (the search's own cost).
        "slowest_offpath_step_over_plain": max((sec for sec, _, ran in step_stages if not _runs_a_plan(ran)), default=0.0) / median_plain_wall,
        "slowest_plan_step_over_plain": max((sec for sec, _, ran in step_stages if _runs_a_plan(ran)), default=0.0) / median_plain_wall,
        # The same over the median planned step (wall): what a step running a probe or candidate
        # plan costs beyond a step of the plan the search adopted, which runs the same kernels.
        "slowest_plan_step_over_planned": (max((sec for sec, _, ran in step_stages if _runs_a_plan(ran)), default=0.0) / statistics.median(planned_walls)
                                           if planned_walls else None),
    }
    if sch.plan is not None:
        row["optimality_gap"] = sch.plan.metadata.get("optimality_gap")
        row["search_timeline"] = sch.plan.measured.get("search_timeline")
        # How far the cost model's step time is from the adopted plan's measured one (the
        # integer program's gap is only worth closing below this).
        predicted, measured = sch.plan.predicted.get("seconds"), sch.plan.measured.get("step_seconds")
        row["predicted_over_measured_step"] = predicted / measured if predicted and measured else None
    sch.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="4,16,32", help="comma-separated depths (decoder layers)")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--after-steps", type=int, default=0, help="planned steps to run once a plan is in force (RSS after the plan)")
    parser.add_argument("--offline", action="store_true", help="time the offline job's proposal stage instead of the README loop")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    if args.offline:
        print("| blocks | planned layers | propose_plans CPU s | costs | sensitivity + solve |")
        print("|---|---|---|---|---|")
        for blocks in map(int, args.blocks.split(",")):
            r = offline_depth(blocks)
            rows.append(r)
            print(f"| {r['blocks']} | {r['planned_layers']} | {r['propose_cpu_s']:.1f} | {r['costs_cpu_s']:.1f} | {r['sensitivity_and_solve_cpu_s']:.1f} |", flush=True)
        write(args.out, rows)
        return
    for blocks in map(int, args.blocks.split(",")):
        row = one_depth(blocks, args.max_steps, args.after_steps)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "search_timeline"}), flush=True)
    print("| blocks | planned layers | plan in force at step | slowest search step / plain step: off-path, probe or trial | "
          "search's extra CPU s | solver CPU s | RSS growth MiB | planned step / plain step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        slow = f"{r['slowest_offpath_step_over_plain']:.1f}x, {r['slowest_plan_step_over_plain']:.1f}x" if r["slowest_search_step_over_plain"] else "-"
        if r.get("slowest_plan_step_over_planned"):
            slow += f" ({r['slowest_plan_step_over_planned']:.1f}x a planned step)"
        rss = f"{r['rss_growth_mib']:.0f}" if r["rss_growth_mib"] is not None else "-"
        planned = f"{r['median_planned_step_over_plain']:.1f}" if r["median_planned_step_over_plain"] else "-"
        print(f"| {r['blocks']} | {r['planned_layers']} | {r['plan_in_force_at_step'] or 'none'} | {slow} | {r['search_extra_cpu_s']:.1f} | "
              f"{r['solver_cpu_s']:.1f} | {rss} | {planned} |")
    write(args.out, rows)


def write(out: "Path | None", rows: list) -> None:
    """``rows`` with the machine and commit, atomically to ``out`` (nothing when None)."""
    if out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        import transformers

        meta = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": 1, "torch": torch.__version__,
                "transformers": transformers.__version__, "python": sys.version.split()[0], "commit": commit}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        tmp.replace(out)


if __name__ == "__main__":
    main()
