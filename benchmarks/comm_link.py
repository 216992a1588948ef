"""DDP training over a real bandwidth-limited link, per gradient communication method.

Two network namespaces joined by a veth pair with a token-bucket rate limit (`autoprec.bench.link`),
one gloo rank in each; the same training (a 4-layer d1024 MLP, 4.2 M parameters, 30 steps) with the
scheduler's ``grad_comm`` set to each method, at 100 Mbit/s, 1 Gbit/s and unlimited
(`autoprec.bench.comm_link`). Needs root and iproute2.

Run: ``PYTHONPATH=. python benchmarks/comm_link.py --out benchmarks/results/comm_link_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
from pathlib import Path

import torch

from autoprec._io import atomic_write_text
from autoprec.bench.comm_link import format_link_table, run_comm_link

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,1000,none", help="Mbit/s, comma-separated; none: unlimited")
    parser.add_argument("--methods", default="fp32,bf16,powersgd,int8,topk")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rates = [None if r.strip().lower() == "none" else float(r) for r in args.rates.split(",")]
    runs = run_comm_link(rates, args.methods.split(","), width=args.width, steps=args.steps)
    print(format_link_table(runs))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if args.out is not None:
        result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": commit,
                  "width": args.width, "steps": args.steps, "runs": [dataclasses.asdict(r) for r in runs]}
        atomic_write_text(args.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
