"""What reusing quantized weights saves (issue 20): aten ops and time per optimizer step.

A 4-layer MLP (d=1024, 4·d hidden) under an all-FP8 and an all-INT8 plan, one optimizer step made
of ``--accumulate`` micro-batches, two ways: every forward quantizes the weights (the default
since issue 20), or the micro-batches run inside ``runtime.reusing_weights()`` (quantized once per
step). Eager, and compiled with the plan entered around the compiled model (under compile the
quantization is traced into the graph and nothing is reused). Times are medians of steps
interleaved variant by variant in one process, reported as ratios to the default; op counts are
per optimizer step (``autoprec.opcount``).

    python benchmarks/weight_reuse.py [--accumulate 4] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
import warnings

import torch
import torch.nn as nn

import autoprec as ap
from autoprec.opcount import count_training_step


def _model(d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.GELU(), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def _step(model, runtime, call, batches, opt, reuse: bool):
    def step():
        scope = runtime.reusing_weights() if reuse else contextlib.nullcontext()
        with scope:
            for x in batches:
                with runtime:
                    loss = call(x).float().pow(2).mean()
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore", ap.EmulationWarning)
    batches = [torch.randn(args.tokens, args.d, generator=torch.Generator().manual_seed(i)) for i in range(args.accumulate)]
    rows = []
    for fmt in ("fp8_e4m3", "int8"):
        for compiled in (False, True):
            model = _model(args.d)
            runtime = ap.apply_plan(model, ap.Plan.uniform(model, fmt, calibration=ap.Calibration(batches=1)))
            call = torch.compile(model) if compiled else model
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            steps = {reuse: _step(model, runtime, call, batches, opt, reuse) for reuse in (False, True)}
            for step in steps.values():
                step()  # warm-up: calibration, compilation
            ops = {} if compiled else {reuse: count_training_step(step, warmup=0).total for reuse, step in steps.items()}
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.steps):
                for reuse, step in steps.items():
                    start = time.perf_counter()
                    step()
                    times[reuse].append(time.perf_counter() - start)
            ratio = statistics.median(times[True]) / statistics.median(times[False])
            row = {"format": fmt, "compiled": compiled, "accumulate": args.accumulate, "time_ratio_reuse_to_default": round(ratio, 3)}
            if ops:
                row |= {"ops_per_step_default": ops[False], "ops_per_step_reuse": ops[True]}
            rows.append(row)
            print(json.dumps(row))
    result = {
        "benchmark": "weight_reuse",
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "config": vars(args),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
