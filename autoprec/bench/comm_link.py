"""DDP training over a real bandwidth-limited link: what each gradient communication method buys.

`run_comm_link` builds a `link.Link` per rate (two network namespaces, a veth pair, a token
bucket at the rate), starts one rank in each namespace (``python -m autoprec.bench.comm_link
--worker``: gloo over TCP between the two addresses), and trains the same model the same number of
steps with the scheduler's ``grad_comm`` set to each method, or to ``"auto"``: the plan's own
choice per layer, from the link it measures at bind and an ``accuracy_budget`` (`comm.choice`).
Per (rate, method): the median wall
time of a training step after the warmup, the bytes rank 0 sent per step as the kernel counted
them on its interface and as `comm.bytes_sent` counts the payload, and the final loss (mean of
the last steps) against FP32's. The model is an MLP of ``layers`` square ``width`` layers on a
fixed linear teacher's classes; each rank trains on its half of the same global batches.

Costs: per (rate, method) two Python processes (a few seconds to start) and ``steps`` training
steps; one thread per rank.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

__all__ = ["LinkRun", "run_comm_link", "format_link_table"]


@dataclasses.dataclass(frozen=True)
class LinkRun:
    """One training over one link: ``rate_mbit`` (None: unlimited), ``method``, median step
    seconds after the warmup, bytes rank 0 sent per step (``wire``: the interface counter over
    the timed steps, headers and the scheduler's own small all-reduces included; ``payload``:
    `comm.bytes_sent`), the final loss and every step's loss; ``chosen``: under ``"auto"``, how
    many layers the plan sends by each method."""

    rate_mbit: Optional[float]
    method: str
    step_s: float
    wire_bytes_per_step: float
    payload_bytes_per_step: float
    final_loss: float
    losses: tuple[float, ...]
    chosen: Optional[dict] = None


def _model(width: int, layers: int, classes: int):
    import torch.nn as nn

    blocks: list = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def _batch(step: int, rank: int, world: int, width: int, classes: int, global_batch: int):
    import torch

    teacher = torch.randn(width, classes, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, width, generator=g)
    return x[rank::world], (x @ teacher).argmax(-1)[rank::world]


def worker(args: argparse.Namespace) -> None:
    """One rank: train, time each step, write the figures to ``args.out`` (rank 0)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import autoprec as ap
    from autoprec.scheduler import DynamicPrecisionScheduler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = _model(args.width, args.layers, args.classes)
        ddp = nn.parallel.DistributedDataParallel(model)
        plan = ap.Plan.uniform(_model(args.width, args.layers, args.classes), ap.Format.FP32)
        sch = DynamicPrecisionScheduler.from_plan(ddp, plan, grad_comm=args.method, comm=ap.CommSettings(topk_ratio=args.topk_ratio),
                                                  monitor_window=10**6, measure_costs=False, accuracy_budget=args.accuracy_budget)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        device = f"/sys/class/net/{args.device}/statistics/tx_bytes"
        seconds, losses, wire = [], [], []
        for step in range(args.steps):
            x, y = _batch(step, args.rank, 2, args.width, args.classes, args.global_batch)
            sent_before = int(open(device).read())
            start = time.perf_counter()
            with sch.precision_context():
                loss = nn.functional.cross_entropy(ddp(x), y)
            sch.backward(loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
            wire.append(int(open(device).read()) - sent_before)
            losses.append(float(loss))
        communicator = sch.distributed.comm_hook.communicator if sch.distributed is not None and sch.distributed.comm_hook is not None else None
        payload = sum(communicator.sent.values()) / args.steps if communicator is not None else 0.0
        timed = slice(args.warmup, None)
        if args.rank == 0:
            with open(args.out, "w", encoding="utf-8") as f:
                chosen = collections.Counter(m.value for m in sch.plan.comm.values()) if args.method == "auto" and sch.plan is not None else None
                json.dump({"step_s": statistics.median(seconds[timed]), "wire": statistics.fmean(wire[timed]), "payload": payload,
                           "losses": losses, "chosen": chosen}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_comm_link(rates: Sequence[Optional[float]], methods: Sequence[str], *, width: int = 1024, layers: int = 4, classes: int = 16,
                  steps: int = 30, warmup: int = 5, global_batch: int = 64, lr: float = 1e-3, topk_ratio: float = 0.01,
                  accuracy_budget: float = 0.01, timeout_s: float = 600.0, progress=print) -> list[LinkRun]:
    """Train once per (rate, method) over a `link.Link` of that rate (module docstring);
    ``accuracy_budget`` (relative to the loss) is what ``"auto"`` may spend."""
    from .link import Link

    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for rate in rates:
            with Link(rate_mbit=rate) as link:
                for i, method in enumerate(methods):
                    out = os.path.join(folder, f"{rate}-{method}.json")
                    port = 29600 + i
                    logs = [open(os.path.join(folder, f"{rate}-{method}-{rank}.log"), "w+", encoding="utf-8") for rank in range(2)]
                    # gloo picks its interface from the hostname, which no namespace knows: name the veth.
                    procs = [link.popen(side, [sys.executable, "-m", "autoprec.bench.comm_link", "--worker", "--rank", str(rank),
                                               "--addr", link.addresses["a"], "--port", str(port), "--method", method,
                                               "--device", link.devices[side], "--out", out, "--width", str(width), "--layers", str(layers),
                                               "--classes", str(classes), "--steps", str(steps), "--warmup", str(warmup),
                                               "--global-batch", str(global_batch), "--lr", str(lr), "--topk-ratio", str(topk_ratio),
                                               "--accuracy-budget", str(accuracy_budget)],
                                         stdout=subprocess.DEVNULL, stderr=logs[rank], env={**os.environ, "GLOO_SOCKET_IFNAME": link.devices[side]})
                             for rank, side in enumerate(("a", "b"))]
                    deadline = time.monotonic() + timeout_s
                    try:
                        for p in procs:
                            p.wait(timeout=max(1.0, deadline - time.monotonic()))
                    finally:
                        for p in procs:  # a timeout or Ctrl-C: no rank outlives its link
                            if p.poll() is None:
                                p.kill()
                                p.wait()
                    if any(p.returncode for p in procs):
                        tails = []
                        for log in logs:
                            log.seek(0)
                            tails.append(log.read()[-800:])
                        raise RuntimeError(f"a rank failed over the {_rate(rate)} link with grad_comm={method}: {tails[0] or tails[1]}")
                    for log in logs:
                        log.close()
                    with open(out, encoding="utf-8") as f:
                        r = json.load(f)
                    losses = tuple(r["losses"])
                    runs.append(LinkRun(rate, method, r["step_s"], r["wire"], r["payload"], statistics.fmean(losses[-5:]), losses, r["chosen"]))
                    chose = f" (chose {_chosen(r['chosen'])})" if r["chosen"] else ""
                    progress(f"{_rate(rate)}, {method}{chose}: {r['step_s'] * 1e3:.0f} ms/step, {r['wire'] / 2**20:.2f} MiB sent/step, loss {runs[-1].final_loss:.4f}")
    return runs


def _chosen(chosen: Optional[dict]) -> str:
    return ", ".join(f"{n} {m}" for m, n in sorted(chosen.items())) if chosen else ""


def _rate(rate: Optional[float]) -> str:
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


def format_link_table(runs: Sequence[LinkRun]) -> str:
    """Markdown: per rate and method, step ms (x FP32's on that link), MiB sent per step, final loss."""
    fp32 = {r.rate_mbit: r for r in runs if r.method == "fp32"}
    lines = ["| link | grad_comm | step ms | x fp32 | MiB sent / step (wire) | final loss (fp32's) |", "|---|---|---|---|---|---|"]
    for r in runs:
        ref = fp32.get(r.rate_mbit)
        ratio = f"{r.step_s / ref.step_s:.2f}" if ref is not None else "-"
        base = f" ({ref.final_loss:.4f})" if ref is not None and r is not ref else ""
        method = f"auto: {_chosen(r.chosen)}" if r.chosen else r.method
        lines.append(f"| {_rate(r.rate_mbit)} | {method} | {r.step_s * 1e3:.0f} | {ratio} | {r.wire_bytes_per_step / 2**20:.2f} | {r.final_loss:.4f}{base} |")
    return "\n".join(lines)


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one rank of autoprec.bench.comm_link (run_comm_link starts them)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--out", required=True)
    for name, kind in (("width", int), ("layers", int), ("classes", int), ("steps", int), ("warmup", int), ("global-batch", int),
                       ("lr", float), ("topk-ratio", float), ("accuracy-budget", float)):
        parser.add_argument(f"--{name}", type=kind, required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    worker(_parse())
