"""The GPU suite (`autoprec bench --suite gpu`) at the GPU session's sizes: its first two per-layer
shapes (8192x4096x4096 and 8192x768x3072; the third, 4104x768x768, is launch-bound and was
measured in the first run) and a short end-to-end part, to fit one device call beside the rest of
`gpu_session.sh all`. Everything else is the full preset (`autoprec.bench.gpu.GpuBenchConfig`):
the probe, every variant eager and compiled, torchao when it imports, the end-to-end model's own
shapes, the JSON (device, torch, CUDA, commit) and the table.

    PYTHONPATH=. python benchmarks/gpu_suite.py --json gpu_suite.json [--e2e-steps 20] [--smoke --device cpu]

Exits 1 when a correctness row failed (a row of the probe, a variant or an end-to-end run that
raised or went non-finite); the targets are figures to report, not failures of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from autoprec.bench.gpu import GpuBenchConfig, run_gpu_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--shapes", type=int, default=2, help="the preset's first N per-layer shapes (default 2)")
    parser.add_argument("--e2e-steps", type=int, default=20, help="end-to-end steps per plan, the first 5 untimed (default 20)")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset's sizes (a CPU dry run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = GpuBenchConfig.from_preset("smoke" if args.smoke else "full")
    e2e = config.e2e if args.smoke else dataclasses.replace(config.e2e, steps=args.e2e_steps)
    config = dataclasses.replace(config, layer_shapes=config.layer_shapes[:args.shapes], e2e=e2e)
    result = run_gpu_bench(config, args.device, progress=lambda done, total, phase: logging.info("gpu suite: %s %d/%d", phase, done, total))
    result.save(args.json)
    print(result.format_table(), flush=True)
    failed = [row.name for row in result.rows if row.ok is False]
    if failed:
        print(f"gpu suite: {len(failed)} rows failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
