"""The README's main job quiet and under a synthetic load: does the search still decide the same?

Runs ``searches/bytelm.toml`` (each run in a fresh output folder, so nothing is resumed) first on
a quiet machine, then with ``--spinners`` processes spinning on a core each (``while True:
pass``), started before the job and killed after it (also when interrupted), then with the
spinners started ``--late`` seconds into the job (once it has chosen its threads on a quiet
machine). Per run: the returned plan's format counts, its measured step against the fastest
reference, the control pair (``uniform-bf16``, which is exactly plain autocast, over
``autocast-bf16``: 1.0 when the measurement is sound), the job's wall time, the intra-op threads
it measured with and the load by other processes at its start and while it measured (the
``measurement`` the plan records, `autoprec.cpu_load`), and what the job said about it.

Run: ``PYTHONPATH=. python benchmarks/loaded_search.py --out benchmarks/results/loaded_search_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from autoprec._io import atomic_write_text
from autoprec.job.config import load_job
from autoprec.job.run import run_job

ROOT = Path(__file__).resolve().parents[1]


def one_run(spinners: int, late_s: float = 0.0) -> dict:
    """The job once, with ``spinners`` busy processes beside it from ``late_s`` seconds in."""
    procs: list[subprocess.Popen] = []

    def spin() -> None:
        procs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners))

    timer = threading.Timer(late_s, spin)
    if late_s > 0:
        timer.start()
    else:
        spin()
    try:
        with tempfile.TemporaryDirectory() as out:
            config = load_job(ROOT / "searches" / "bytelm.toml")
            config = dataclasses.replace(config, out=Path(out))
            start = time.perf_counter()
            result = run_job(config)
            wall = time.perf_counter() - start
    finally:
        if late_s > 0:
            timer.cancel()
            timer.join()
        for p in procs:
            p.kill()
            p.wait()
    ms = {c.name: m.seconds * 1e3 for c, m in result.candidates if not isinstance(m, str) and m.seconds is not None}
    refs = {name: v for name, v in ms.items() if name.startswith(("autocast", "uniform"))}
    plan = result.plan
    return {
        "spinners": spinners, "from_s": late_s, "wall_s": round(wall, 1), "threads": result.measurement,
        "plan": dict(plan.format_counts()) if plan is not None else None, "candidate": result.chosen.name if result.chosen else None,
        "plan_ms": plan.measured["seconds"] * 1e3 if plan is not None else None,
        "fastest_reference_ms": min(refs.values()) if refs else None,
        "control_ratio": ms["uniform-bf16"] / ms["autocast-bf16"] if "uniform-bf16" in ms and "autocast-bf16" in ms else None,
        # The final interleaved rounds' control pair (low, median, high) and noise: what decided.
        "settled_control": list(result.verdict.control) if result.verdict is not None and result.verdict.control is not None else None,
        "settled_noise": result.verdict.noise if result.verdict is not None else None,
        "measured_ms": ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spinners", type=int, default=1)
    parser.add_argument("--late", type=float, default=45.0, help="seconds into the third run its spinners start (0: no third run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs = [one_run(0), one_run(args.spinners)] + ([one_run(args.spinners, args.late)] if args.late > 0 else [])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": commit, "runs": runs}
    for r in runs:
        print(f"{r['spinners']} spinner(s) from {r['from_s']:.0f} s: {r['wall_s']:.0f} s, plan {r['plan']} ({r['candidate']}), {r['plan_ms']:.1f} ms vs fastest "
              f"reference {r['fastest_reference_ms']:.1f} ms, control pair {r['control_ratio']:.2f} in the trials, "
              f"{r['settled_control']} in the final rounds, threads {r['threads']}")
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
