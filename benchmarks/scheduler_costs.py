"""What the scheduler itself costs a training loop: its steps against the same plan by hand.

Trains a GPT-style byte LM (`autoprec.workloads.bytelm.ByteLM`) with the README's loop under
`DynamicPrecisionScheduler` (no ``model=``, no plan: it profiles a window, searches, then trains
under its plan), and beside it, on copies of the model in the same process:

- **by hand**: the scheduler's plan through `autoprec.apply_plan` and a ``torch.amp.GradScaler``
  (on exactly when some layer has FP16 gradients), the adoption a user writes without the scheduler;
- **autocast**: plain ``torch.autocast`` (BF16) around the forward, no plan;
- **plain**: the profiling window's precision with nothing attached (FP32; BF16 autocast with
  ``--max-precision 16``), interleaved step by step with the window's steps.

Reported, as in-run ratios (medians of interleaved steps, order rotated every round):

- a planned step under the scheduler over the same plan by hand (its watch's cost), and both
  over plain autocast (tokens/s);
- a profiling-window step over a plain step of the window's precision;
- the search: its steps' extra time in median planned steps, and its slowest over the median;
- memory between planned steps (CUDA ``memory_allocated``; on a CPU the bytes of every live
  tensor's storage, each counted once), the scheduler's over the plan by hand's, and after
  ``scheduler.close()`` and ``del``: what is left over the memory before the scheduler existed;
  CUDA peaks per phase;
- tensors with a ``grad_fn`` alive between planned steps and after close (should be 0: a graph
  kept alive is the leak this benchmark was written for).
- the host's time to issue a step (median, before the sync): near the step's time, the step is
  bound by Python and launches, not by the device;
- ``--profile-steps N``: after the timed rounds, N steps of each variant under ``torch.profiler``
  (`autoprec.bench.step_profile`): kernels, launches, syncs, memcpys per step, device and host
  time per step, the costliest kernels (on a CPU, aten ops) - the profile a missed target needs.

``--compile``: every variant calls ``torch.compile(model)`` (Inductor, or ``--backend``): the
scheduler around the compiled model (its hooked steps run eagerly, its planned steps and its
candidates' timed steps compiled), the plan by hand around a compiled model, compiled autocast, and
a compiled plain step against the window's (eager) steps. Each variant's first steps compile; the
JSON gives their seconds and the graphs Dynamo compiled per phase. Dynamo's recompile limit is
raised (every candidate plan is a graph of its own).

``--plan PLAN.json`` (no scheduler): the plan of a search job trained by hand beside the all-FP8
plan (every linear FP8 E4M3, attention products BF16: `fp8_linears`) and BF16 autocast (or the
``--variants`` named), eager or ``--compile``-d, interleaved: tokens/s and their ratios to
autocast, memory between steps, peak, the training loss of the last round and the held-out loss.

Memory per variant (CUDA): its bytes between steps (the increase of ``memory_allocated`` when it
was added, after its first steps) and its peak as if it ran alone (those bytes plus the largest
rise of ``max_memory_allocated`` over ``memory_allocated`` within one of its timed steps).

Uses only the public API (and ``window_format_for``, where it exists), so it measures an older
autoprec too (``PYTHONPATH=<checkout>``).

    PYTHONPATH=. python benchmarks/scheduler_costs.py                    # CPU: ~3 minutes on 2 cores
    PYTHONPATH=. python benchmarks/scheduler_costs.py --device cuda --d-model 1536 --layers 8 \\
        --heads 12 --context 1024 --batch 8 [--compile] --out benchmarks/results/scheduler_costs_<device>.json
    PYTHONPATH=. python benchmarks/scheduler_costs.py --plan runs/gpt_gpu/plan.json --device cuda --d-model 2048 \\
        --layers 12 --heads 16 --context 1024 --batch 8 [--compile] --out plan_training.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

import autoprec as ap
from autoprec.workloads.bytelm import ByteLMWorkload, LMConfig, evaluate, load_corpus, split_corpus

try:
    from autoprec.bench.step_profile import profile_steps
except ImportError:  # an older autoprec: --profile-steps is refused
    profile_steps = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_tensors() -> int:
    """Tensors with a ``grad_fn`` that Python's collector still tracks (after a collection); the
    meta and fake tensors ``torch.compile`` leaves after tracing hold no memory and are left out
    (as in ``tests/support/graphs.py``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.grad_fn is not None and not isinstance(obj, FakeTensor) and not obj.is_meta:
                count += 1
    return count


def live_bytes(device: torch.device) -> int:
    """Bytes allocated on ``device``: CUDA's allocator, or on a CPU every storage a live tensor
    Python can reach holds, each counted once."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        return torch.cuda.memory_allocated(device)
    from torch._subclasses.fake_tensor import FakeTensor

    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta and not isinstance(obj, FakeTensor):
                try:
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses, functional tensors
                    continue
    return sum(storages.values())


def state_bytes(trainer: "Trainer") -> int:
    """The bytes of a trainer's parameters, gradients and optimizer state (each storage once):
    everything a plain autocast trainer holds between steps."""
    tensors = [p for p in trainer.model.parameters()] + [p.grad for p in trainer.model.parameters() if p.grad is not None]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def dynamo_graphs() -> int:
    """Graphs Dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def window_format(scheduler: "ap.DynamicPrecisionScheduler", device: torch.device) -> "ap.Format":
    """The precision the scheduler's profiling window trains in (BF16 on CUDA by default)."""
    try:
        from autoprec.scheduler.plan_keeper import window_format_for
    except ImportError:  # an autoprec before window_format: FP32 unless FP32 is out of bounds
        return ap.Format.FP32 if scheduler.config.max_precision == 32 else ap.Format.BF16
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    return window_format_for(scheduler.config, native_bf16=native)


class Trainer:
    """One model, its optimizer and how a step runs (``kind``: scheduler, hand, autocast, plain);
    ``backend``: call the model through ``torch.compile(model, backend=backend)``."""

    def __init__(self, kind: str, model, device: torch.device, *, scheduler=None, plan=None, dtype=torch.bfloat16, fused: bool,
                 backend: "str | None" = None, name: "str | None" = None):
        self.kind, self.name, self.model, self.device = kind, name or kind, model, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        self.scheduler = scheduler
        self.dtype = dtype
        self.runtime = ap.apply_plan(model, plan) if plan is not None else None
        self.call = torch.compile(model, backend=backend) if backend else model
        needs_scale = plan is not None and any(lp.grad_format is ap.Format.FP16 for lp in plan.layers.values())
        self.scaler = torch.amp.GradScaler(device.type, enabled=needs_scale) if kind == "hand" else None
        self.last_loss: "torch.Tensor | None" = None
        self.steps = 0

    def context(self):
        """What a (non-scheduler) step's forward runs inside."""
        if self.kind == "hand":
            return self.runtime
        if self.kind == "autocast" or self.dtype is not torch.float32:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def step(self, batch) -> torch.Tensor:
        x, y = batch
        call, optimizer = self.call, self.optimizer
        if self.kind == "scheduler":
            with self.scheduler.precision_context():
                loss = torch.nn.functional.cross_entropy(call(x)[0].float().flatten(0, 1), y.flatten())
            self.scheduler.backward(loss)
            self.scheduler.step(optimizer)
        else:
            with self.context():
                loss = torch.nn.functional.cross_entropy(call(x)[0].float().flatten(0, 1), y.flatten())
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                loss.backward()
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()
        self.steps += 1
        return self.last_loss


def timed_step(trainer: Trainer, batch) -> tuple[float, "int | None", "int | None", float]:
    """One step: its seconds, on CUDA the bytes allocated before it and its peak, and the host's
    seconds to issue it (until ``step`` returns, before the sync)."""
    device = trainer.device
    sync(device)
    before = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    trainer.step(batch)
    host = time.perf_counter() - start
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, before, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None, host


class Rounds:
    """Timed steps of several trainers interleaved, order rotated every round: per trainer its
    seconds, the host's seconds to issue each step, and its largest rise of the peak over the bytes
    allocated before a step."""

    def __init__(self, trainers: list[Trainer]):
        self.trainers = trainers
        self.times: dict[str, list[float]] = {t.name: [] for t in trainers}
        self.host: dict[str, list[float]] = {t.name: [] for t in trainers}
        self.rise: dict[str, int] = {}

    def run(self, rounds: int, batch) -> None:
        n = len(self.trainers)
        for round_ in range(rounds):
            b = batch()
            for trainer in self.trainers[round_ % n:] + self.trainers[:round_ % n]:
                seconds, before, top, host = timed_step(trainer, b)
                self.times[trainer.name].append(seconds)
                self.host[trainer.name].append(host)
                if before is not None and top is not None:
                    self.rise[trainer.name] = max(self.rise.get(trainer.name, 0), top - before)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(ts) for name, ts in self.times.items()}

    def host_medians(self) -> dict[str, float]:
        return {name: statistics.median(ts) for name, ts in self.host.items()}

    def profiles(self, steps: int, batch) -> dict[str, dict]:
        """Each trainer's next ``steps`` steps under the profiler (`profile_steps`): kernels,
        launches, syncs, host and device time per step, the costliest kernels (or CPU ops)."""
        if steps == 0:
            return {}
        b = batch()
        return {t.name: profile_steps(lambda t=t: t.step(b), steps, t.device) for t in self.trainers}

    def peaks(self, resident: dict[str, int]) -> dict[str, "int | None"]:
        """Each trainer's peak as if it ran alone: its bytes between steps plus its largest rise."""
        return {name: resident[name] + self.rise[name] if name in self.rise else None for name in self.times}


def environment(device: torch.device) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(ap.__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(ap.__file__).parent).stdout.strip()
    return {"commit": commit, "dirty": bool(dirty), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine()),
            "threads": torch.get_num_threads()}


def run_scheduler(args, device: torch.device, batch, build, backend: "str | None", save) -> dict:
    """The README loop (profiling window, search, planned steps) beside the same plan by hand and
    plain autocast; see the module docstring."""
    fused = device.type == "cuda"
    before = live_bytes(device)
    graphs_before = graph_tensors()
    compiled: dict[str, int] = {"start": dynamo_graphs()}

    # 1. The README loop: profiling window (interleaved with plain steps of its precision), search.
    optional = {name: value for name, value in (("sample_every", args.sample_every), ("monitor_steps", args.monitor_steps)) if value is not None}
    scheduler = ap.DynamicPrecisionScheduler(min_precision=8, max_precision=args.max_precision, monitor_window=args.window,
                                             memory_budget=args.memory_budget, accuracy_budget=args.accuracy_budget, **optional)
    sched = Trainer("scheduler", build(), device, scheduler=scheduler, fused=fused, backend=backend)
    window = window_format(scheduler, device)
    window_dtype = {ap.Format.FP32: torch.float32, ap.Format.BF16: torch.bfloat16, ap.Format.FP16: torch.float16}[window]
    plain = Trainer("plain", build(), device, dtype=window_dtype, fused=fused, backend=backend)
    seconds, phases, plain_seconds = [], [], []
    tops: dict[str, list[int]] = {"profiling": [], "searching": []}  # CUDA peaks of the scheduler's steps per phase
    for step in range(args.window + args.max_search_steps):
        b = batch()
        phase = scheduler.phase
        spent, _, top, _ = timed_step(sched, b)
        seconds.append(spent)
        phases.append(phase)
        if phase in tops and top is not None:
            tops[phase].append(top)
        if phase == "profiling" and step > 0:  # the window's steps against plain ones, one each
            plain_seconds.append(timed_step(plain, b)[0])
        if scheduler.phase in ("planned", "safe"):
            break
    if scheduler.plan is None:
        raise SystemExit(f"no plan after {len(seconds)} steps: {scheduler.last_search_error}")
    compiled["window_and_search"] = dynamo_graphs() - compiled["start"]
    plain_first = plain_seconds.pop(0)  # first touch; with --compile its compilation
    plain_bytes = state_bytes(plain)  # alive beside the scheduler's steps, no part of their peaks
    window_peaks = {("search" if phase == "searching" else phase): max(ts) - plain_bytes if ts else None for phase, ts in tops.items()}
    del plain
    plan = scheduler.plan
    profiling = [s for s, p in zip(seconds, phases) if p == "profiling"][1:]  # the first binds (unprofiled)
    search = [s for s, p in zip(seconds, phases) if p == "searching"]
    save({"window_format": window.value, "plan": plan.format_counts(), "profiling_steps": len(profiling), "search_steps": len(search),
          "peak_bytes": window_peaks, "search_step_s": [round(s, 4) for s in search], "dynamo_graphs": compiled,
          "median_step_s": {"profiling": statistics.median(profiling), "plain_window_precision": statistics.median(plain_seconds)}}, "searched")

    # 2. Memory between planned steps: the scheduler's, then the plan by hand's beside it.
    mark = dynamo_graphs()
    first = {"scheduler_planned": [round(timed_step(sched, batch())[0], 4) for _ in range(args.warmup)]}
    compiled["scheduler_planned"] = dynamo_graphs() - mark
    graphs_planned = graph_tensors()
    with_scheduler = live_bytes(device)
    mark = dynamo_graphs()
    hand = Trainer("hand", build(), device, plan=plan, fused=fused, backend=backend)
    first["hand"] = [round(timed_step(hand, batch())[0], 4) for _ in range(args.warmup)]
    compiled["hand"] = dynamo_graphs() - mark
    with_hand = live_bytes(device)
    resident = {"scheduler": with_scheduler - before, "hand": with_hand - with_scheduler}

    # 3. Planned steps interleaved: scheduler, by hand, plain autocast.
    mark = dynamo_graphs()
    autocast = Trainer("autocast", build(), device, fused=fused, backend=backend)
    first["autocast"] = [round(timed_step(autocast, batch())[0], 4) for _ in range(args.warmup)]
    compiled["autocast"] = dynamo_graphs() - mark
    resident["autocast"] = live_bytes(device) - with_hand
    rounds = Rounds([sched, hand, autocast])
    mark = dynamo_graphs()
    rounds.run(args.rounds, batch)
    compiled["rounds"] = dynamo_graphs() - mark
    median = rounds.medians()
    rounds_times = {name: list(times) for name, times in rounds.times.items()}
    losses = {t.name: {"loss": float(t.last_loss), "steps_trained": t.steps} for t in rounds.trainers}
    peaks = rounds.peaks(resident)
    host = rounds.host_medians()
    profiles = rounds.profiles(args.profile_steps, batch)

    # 4. After close() and del: what the scheduler leaves behind.
    del hand, autocast, rounds
    scheduler.close()
    del sched, scheduler
    graphs_closed = graph_tensors()
    left = live_bytes(device) - before

    tokens = args.batch * args.context
    planned_median = median["scheduler"]
    return {
        "window": args.window, "window_format": window.value, "settings": optional, "memory_budget": args.memory_budget,
        "accuracy_budget": args.accuracy_budget, "plan": plan.format_counts(),
        "planned_over_by_hand": planned_median / median["hand"],
        # Means too: a watch sampling one step in sample_every leaves the median on an unsampled step.
        "planned_over_by_hand_mean": statistics.fmean(rounds_times["scheduler"]) / statistics.fmean(rounds_times["hand"]),
        "tokens_per_s": {kind: tokens / m for kind, m in median.items()},
        "tokens_per_s_over_autocast": {kind: median["autocast"] / m for kind, m in median.items()},
        "profiling_over_plain": statistics.median(profiling) / statistics.median(plain_seconds),
        "profiling_steps": len(profiling),
        "search_steps": len(search),
        "search_extra_in_planned_steps": (sum(search) - len(search) * planned_median) / planned_median,
        "search_slowest_over_planned": max(search) / planned_median if search else None,
        "bytes_between_planned_steps": resident,
        "scheduler_over_hand_bytes": resident["scheduler"] / resident["hand"],
        "bytes_left_after_close": left,
        "graph_tensors": {"before": graphs_before, "planned": graphs_planned, "after_close": graphs_closed},
        "peak_bytes": {**window_peaks, **peaks},
        "loss_last_round": losses,
        "search_step_s": [round(s, 4) for s in search],
        "first_steps_s": {**first, "plain": round(plain_first, 4)},
        "dynamo_graphs": compiled,
        "median_step_s": {**median, "profiling": statistics.median(profiling), "plain_window_precision": statistics.median(plain_seconds)},
        "median_host_s": host,
        "profile": profiles,
    }


def fp8_linears(model, example) -> "ap.Plan":
    """Every linear FP8 E4M3 (tensorwise delayed scaling); every other layer BF16: the attention
    products are batched matmuls, which no FP8 kernel serves (FP8 there runs emulated, and under
    ``torch.compile`` breaks the graph at every call). Traces one forward."""
    plan = ap.Plan.uniform(model, ap.Format.FP8_E4M3, example)
    return plan.with_layers({fqn: ap.Format.BF16 for fqn, info in plan.fingerprint.items() if set(info.ops) != {"linear"}})


def run_plan(args, device: torch.device, batch, build, backend: "str | None", workload: ByteLMWorkload, save) -> dict:
    """A search job's plan by hand beside the all-FP8 plan and BF16 autocast; see the module docstring."""
    fused = device.type == "cuda"
    plan = ap.Plan.load(args.plan)
    example = batch()[0]
    compiled: dict[str, int] = {}
    first: dict[str, list[float]] = {}
    resident: dict[str, int] = {}
    trainers, plans = [], {}
    makers = {"plan": lambda model: plan, "fp8_all": lambda model: fp8_linears(model, example), "autocast": None}
    wanted = args.variants.split(",")
    if "autocast" not in wanted or set(wanted) - set(makers):
        raise SystemExit(f"--variants {args.variants}: expected names from {', '.join(makers)}, autocast among them (the ratios' reference)")
    for name in wanted:
        make = makers[name]
        mark, base = dynamo_graphs(), live_bytes(device)
        model = build()
        if make is not None:
            plans[name] = make(model)
        trainer = Trainer("hand" if make else "autocast", model, device, plan=plans.get(name), fused=fused, backend=backend, name=name)
        first[name] = [round(timed_step(trainer, batch())[0], 4) for _ in range(args.warmup)]
        compiled[name] = dynamo_graphs() - mark
        resident[name] = live_bytes(device) - base
        trainers.append(trainer)
        save({"variants": wanted, "plan": plan.format_counts(), "bytes_between_steps": resident, "first_steps_s": first, "dynamo_graphs": compiled},
             f"{name} warmed up")
    rounds = Rounds(trainers)
    mark = dynamo_graphs()
    rounds.run(args.rounds, batch)
    compiled["rounds"] = dynamo_graphs() - mark
    median = rounds.medians()
    profiles = rounds.profiles(args.profile_steps, batch)
    val = workload.val_batches(args.val_batches)
    held_out = {}
    for trainer in trainers:  # the eager model under its precision: no compilation for eval mode
        with trainer.context():
            held_out[trainer.name] = evaluate(trainer.model, [(x.to(device), y.to(device)) for x, y in val])
    tokens = args.batch * args.context
    peaks = rounds.peaks(resident)
    return {
        "plan_file": str(args.plan), "variants": wanted, "plan": plan.format_counts(),
        "fp8_all": plans["fp8_all"].format_counts() if "fp8_all" in plans else None,
        "plan_layers": {fqn: lp.format.value for fqn, lp in plan.layers.items()}, "plan_recompute": list(plan.recompute),
        "plan_predicted": dict(plan.predicted), "plan_measured_by_the_search": dict(plan.measured),
        "tokens_per_s": {name: tokens / m for name, m in median.items()},
        "tokens_per_s_over_autocast": {name: median["autocast"] / m for name, m in median.items()},
        "bytes_between_steps": resident,
        "peak_bytes": peaks,
        "peak_over_autocast": {name: p / peaks["autocast"] for name, p in peaks.items()} if all(peaks.values()) else None,
        "loss_last_round": {t.name: float(t.last_loss) for t in trainers},
        "held_out_loss": held_out,
        "held_out_loss_increase_over_autocast": {name: v / held_out["autocast"] - 1 for name, v in held_out.items()},
        "first_steps_s": first,
        "dynamo_graphs": compiled,
        "median_step_s": median,
        "median_host_s": rounds.host_medians(),
        "profile": profiles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=40, help="the scheduler's monitor_window")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds timed")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps of each variant added after the search (or with --plan)")
    parser.add_argument("--max-search-steps", type=int, default=400)
    parser.add_argument("--memory-budget", type=float, default=None)
    parser.add_argument("--accuracy-budget", type=float, default=0.02)
    parser.add_argument("--max-precision", type=int, default=32)
    parser.add_argument("--sample-every", type=int, default=None, help="the scheduler's sample_every (default: its own)")
    parser.add_argument("--monitor-steps", type=int, default=None, help="the scheduler's monitor_steps (default: its own)")
    parser.add_argument("--compile", action="store_true", help="every variant calls torch.compile(model)")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend with --compile (default inductor)")
    parser.add_argument("--plan", type=Path, default=None, help="train this plan beside all-FP8 and BF16 autocast (no scheduler)")
    parser.add_argument("--variants", default="plan,fp8_all,autocast", help="with --plan: which to train, in this order (autocast among them)")
    parser.add_argument("--val-batches", type=int, default=4, help="held-out batches with --plan")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed rounds, this many steps of each variant under torch.profiler: kernels, launches, syncs, "
                             "host and device time per step, the costliest kernels (JSON 'profile'; default 0: none)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.profile_steps < 0 or (args.profile_steps and profile_steps is None):
        parser.error(f"--profile-steps {args.profile_steps}: give a count >= 0; the autoprec imported needs autoprec.bench.step_profile for > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    backend = args.backend if args.compile else None
    if backend is not None:  # every candidate plan, and every variant's model, is a graph of its own
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    config = LMConfig(context=args.context, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, d_ff=4 * args.d_model)
    train, val = split_corpus(load_corpus())
    workload = ByteLMWorkload("gpt", config, train, val, args.batch)
    batches = workload.train_batches(0)
    initial = workload.build_model(0)  # once, on the CPU; every variant starts from a copy

    def batch():
        x, y = batches.next()
        return x.to(device), y.to(device)

    def build():
        return copy.deepcopy(initial).to(device)

    started = time.perf_counter()
    head = {
        "benchmark": "scheduler_costs" if args.plan is None else "plan_training", **environment(device),
        "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "context": args.context, "batch": args.batch},
        "compile": backend, "rounds": args.rounds,
    }

    def save(measured: dict, partial: "str | None" = None) -> dict:
        """Write what is measured so far (``partial``: the stage reached; a run stopped by a
        timeout leaves that file behind) or, without ``partial``, the result."""
        result = {**head, **({"partial": partial} if partial else {}), **measured, "elapsed_s": round(time.perf_counter() - started, 1)}
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    if args.plan is not None:
        measured = run_plan(args, device, batch, build, backend, workload, save)
    else:
        measured = run_scheduler(args, device, batch, build, backend, save)
    print(json.dumps(save(measured), indent=1))


if __name__ == "__main__":
    main()
