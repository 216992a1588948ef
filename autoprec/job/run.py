"""The offline search job behind ``autoprec search searches/<job>.toml``.

`run_job` takes a `JobConfig` (the TOML file, `job.config`) and returns a `JobResult`. One
run trains the workload's model for a window with the `LayerProfiler` attached; builds a
`CostModel` and the Fisher sensitivity per (layer, format); proposes the k best plans of that
additive proxy (`pipeline.propose_plans`, `exact.k_best`); measures them for real beside the
references (uniform plans, plain ``torch.autocast``, FP32) in an Optuna study
(`MeasuredStage`, optionally with `job.workers` and the learning sampler `search.refine`);
and writes ``plan.json`` (the fastest plan that meets the budgets *as measured*), the profile,
the study and TensorBoard logs under ``[job].out``. `run_job`'s docstring says each step.

Workload factories (``[workload].factory``) return an `autoprec.workload.Workload`; profiled and
measured steps both train with its own optimizer, schedule and clipping (`TrainStep.for_workload`).
Batches are whatever its ``loss`` takes (tuples, dicts of keyword inputs): the model's inputs are
captured from the loss's own call of the model. `autoprec.workloads.default_workload` and
`autoprec.workloads.finetune.minilm_finetune_workload` are two.

Costs: the profiled training window, the cost model's timings on this device (cached), one
integer program per proposed plan, and per measured plan ``2 × (warmup + steps)`` interleaved
training steps and its held-out losses (`MeasuredStage`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
import torch

from ..calls import ModelCall
from ..blocks import find_blocks
from ..coverage import find_layers, layer_name
from ..cpu_load import CpuLoad, ThreadGovernor, measuring_threads, sample_load
from ..device import format_support, resolve_device
from ..errors import InfeasibleBudgetError, SearchError
from ..formats import Format
from ..plan import Plan
from ..runtime import EmulationWarning, apply_plan, removing
from ..workload import TrainStep, to_device
from ..search.solution import Solution
from ..search.candidate_runs import (BudgetPruner, Candidate, MeasuredStage, Measurement, candidate_id, compared_on_target, fastest_meeting,
                                     fastest_predicted_meeting, meeting_by_speed, meets_budgets)
from ..noise import Verdict
from ..search.pipeline import Proposal, propose_plans
from ..search.planner import floor_settings, layer_reasons, measured_reasons, plan_from_solution
from ..search.refine import CorrectingSampler
from ..search.space import SearchSpace, key_name
from ..search.study import open_storage, quiet_interrupts
from .config import JobConfig, load_job_workload
from .workers import WorkerPayload, adopt_candidates, check_workers, run_workers

__all__ = ["JobResult", "run_job"]

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]

_SEARCH_ATTR = "autoprec_search"  # the study's user attribute holding `_signature`
_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a search job found. ``plan`` is None when no candidate met the budgets as measured."""

    config: JobConfig
    plan: "Plan | None"
    plan_path: "Path | None"
    references: Mapping[str, Measurement]
    candidates: Sequence[tuple[Candidate, "Measurement | str"]]
    proposal: Proposal  # the k best plans on the predictions (the first is the optimum, to exact.MIP_GAP)
    memory_budget: float  # measured bytes allowed
    loss_budget: float  # absolute loss increase allowed
    predicted_memory_budget: float  # predicted bytes allowed (the integer program's budget)
    predicted_fp32: Mapping[str, float]  # the all-FP32 plan's predicted bytes and seconds
    seconds: float
    chosen: "Candidate | None" = None  # the candidate the plan came from (a reference, maybe)
    # On a CPU: the intra-op threads measured with and the load by other processes (`cpu_load`).
    measurement: "Mapping[str, Any] | None" = None
    verdict: "Verdict | None" = None  # the fastest candidates' interleaved rounds (`MeasuredStage.settle`)

    @property
    def met_budgets(self) -> bool:
        return self.plan is not None

    @property
    def exact(self) -> Solution:
        """The optimum of the predictions (to exact.MIP_GAP)."""
        return self.proposal.optimum.exact

    def format_table(self) -> str:
        """Measured step ms, bytes and loss increase of the references and every candidate."""
        fp32 = self.references["fp32"]
        rows = [("variant", "formats", "step ms", "90% ms", "x fp32", "MiB", "x fp32", "loss +", "predicted ms / MiB / loss +", "budgets")]

        def row(name, formats, m: Measurement, predicted, verdict):
            # A figure not measured (None: only a hand-made Measurement lacks one) shows as "-".
            ratio = m.seconds / fp32.seconds if m.seconds is not None and fp32.seconds is not None else None
            interval = "-" if m.seconds_interval is None else "-".join(format(v * 1e3, ".1f") for v in m.seconds_interval)
            rows.append((
                name, formats, _shown(m.seconds, ".1f", 1e3), interval, _shown(ratio, ".2f"),
                f"{m.bytes / 2**20:.2f}", f"{m.bytes / fp32.bytes:.3f}", _shown(m.loss_increase, "+.4f"), predicted, verdict,
            ))

        for name, ref in self.references.items():
            predicted = f"{self.predicted_fp32['seconds'] * 1e3:.1f} / {self.predicted_fp32['bytes'] / 2**20:.2f} / 0" if name == "fp32" else "-"
            row(name, "-", ref, predicted, "reference")
        chosen = self.chosen.id if self.chosen is not None else None
        for candidate, m in self.candidates:
            counts = ",".join(f"{n} {recipe}" for recipe, n in Counter(lp.recipe for lp in candidate.plan.layers.values()).items())
            counts = f"torch.autocast {counts.split()[-1]}" if candidate.autocast else counts
            if candidate.plan.recompute:
                counts += f", {len(candidate.plan.recompute)} blocks recomputed"
            p = candidate.plan.predicted
            predicted = f"{p['seconds'] * 1e3:.1f} / {p['bytes'] / 2**20:.2f} / {p['loss_increase']:+.4f}"
            if isinstance(m, str):
                rows.append((candidate.name, counts, "-", "-", "-", "-", "-", "-", predicted, f"pruned: {m}"))
                continue
            ok = meets_budgets(m, self.memory_budget, self.loss_budget)
            row(candidate.name + (" *" if candidate.id == chosen else ""), counts, m, predicted, "met" if ok else "missed")
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        budget = f"budgets: memory <= {self.memory_budget / 2**20:.2f} MiB, loss increase <= {self.loss_budget:.4g}"
        gap = self.proposal.summary()
        verdict = f"plan: {self.plan_path}" if self.plan_path else "no candidate met the budgets as measured"
        load = self.measurement
        during = "".join(f", {busy:.1f} during the {span}" for span, busy in load.get("during", {}).items()) if load else ""
        threads = ([f"measured with {load['threads']} intra-op thread(s) of {load['cores']} cores; cores busy with other processes: "
                    f"{load['busy_elsewhere']:.1f} at the start ({load['source']}){during}"
                    + (f"; threads by span: {_runs(load['threads_by_span'])}" if "threads_by_span" in load else ""),
                    *([load["changed"]] if "changed" in load else [])] if load else [])
        settled = [f"settled in {self.verdict.summary()}"] if self.verdict is not None else []
        return "\n".join(lines + [budget, gap] + self._comparison() + settled + threads + [verdict])

    def _comparison(self) -> list[str]:
        """The returned plan against the fastest budget-meeting reference, and its predicted step:
        in the settling rounds' figures when both were timed there (the figures the decision
        used, paired round by round), else in their trials'."""
        if self.plan is None or self.chosen is None:  # a plan always comes from a chosen candidate
            return []
        m, chosen, verdict = self.plan.measured, self.chosen, self.verdict
        predicted = f"{self.plan.predicted['seconds'] * 1e3:.1f} ms predicted"
        other = "other " if chosen.is_reference else ""
        if self.config.target is not None:  # chosen by the prediction there, among those that met the budgets here
            return compared_on_target(chosen, m["seconds"], self.candidates, self.memory_budget, self.loss_budget, self.config.target.name)
        # The chosen candidate may be a reference itself (a uniform plan): compared with the others.
        refs = meeting_by_speed([p for p in self.candidates if p[0].is_reference and p[0] is not chosen], self.memory_budget, self.loss_budget)
        rounds = {name: verdict.seconds(name) for name in verdict.times} if verdict is not None else {}
        settled = [p for p in refs if rounds.get(p[0].name) is not None]
        if verdict is not None and rounds.get(chosen.name) is not None and settled:
            ref, trial = min(settled, key=lambda p: rounds[p[0].name] or math.inf)
            low, median, high = verdict.ratio(chosen.name, ref.name) or (math.nan,) * 3
            return [
                f"returned {chosen.name}: {(rounds[chosen.name] or math.nan) * 1e3:.1f} ms in the {verdict.rounds} settling rounds, {predicted}",
                f"  = {median:.2f}x ({low:.2f}-{high:.2f}) the fastest {other}budget-meeting reference ({ref.name}, "
                f"{(rounds[ref.name] or math.nan) * 1e3:.1f} ms in the same rounds)",
                f"  (their trials measured {m['seconds'] * 1e3:.1f} and {(trial.seconds or math.nan) * 1e3:.1f} ms, timed apart and noisier "
                "than the rounds' paired figures, which the decision used)",
            ]
        lines = [f"returned {chosen.name}: {m['seconds'] * 1e3:.1f} ms measured, {predicted}"]
        if refs:  # meeting_by_speed keeps only timed ones
            ref, seconds = refs[0][0], refs[0][1].seconds or math.nan
            lines.append(f"  = {m['seconds'] / seconds:.2f}x the fastest {other}budget-meeting reference ({ref.name}, {seconds * 1e3:.1f} ms)")
        return lines


def _runs(spans: Sequence[Sequence[Any]]) -> str:
    """``[[name, threads], ...]`` as runs: "2 trials at 2, 9 trials at 1, settling at 1"."""
    runs: list[list[Any]] = []
    for name, threads in spans:
        if runs and runs[-1][0] == name and runs[-1][2] == threads:
            runs[-1][1] += 1
        else:
            runs.append([name, 1, threads])
    return ", ".join(f"{count} {name} at {threads}" for name, count, threads in runs)


def _shown(value: "float | None", spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


@contextlib.contextmanager
def _naming(config: JobConfig, key: str, fix: str = ""):
    """A `SearchError` raised inside, restated as one line naming the job file and ``key``."""
    try:
        yield
    except SearchError as exc:
        raise SearchError(f"{config.source}: {key}: {exc}{fix}") from None


# errno values of a full disk or an exhausted quota, and the words SQLite reports them in.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_WORDS = ("disk is full", "no space left", "disk quota")


def _chain(exc: "BaseException | None"):
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or what it wraps (Optuna's StorageInternalError wraps SQLAlchemy's error)
    says the disk is full."""
    return any(
        (isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS) or any(w in str(e).lower() for w in _DISK_FULL_WORDS)
        for e in _chain(exc)
    )


@contextlib.contextmanager
def _storage_failures(config: JobConfig, workers: int):
    """A full disk or a failing Optuna storage while searching, restated as one `SearchError`
    line: what happened, that the trials the storage committed are kept, and how to resume.

    Looks through the exception's context: when the write of a trial's result fails, Optuna 4.x
    (``study/_optimize.py``, ``_run_trial``) finds the trial still running and raises
    ``AssertionError("Should not reach.")`` from its ``finally``, with the storage's error as
    the context."""
    try:
        yield
    except Exception as exc:
        storage_error = next((e for e in _chain(exc) if isinstance(e, optuna.exceptions.StorageInternalError)), None)
        full = _disk_full(exc)
        if full:
            what = "the disk is full"
        elif storage_error is not None:
            what = f"the study's storage failed ({_one_line(storage_error)})"
        else:
            raise
        fix = "free some space" if full else "fix the storage"
        again = f"autoprec search {config.source}" + (f" --workers {workers}" if workers > 1 else "")
        raise SearchError(
            f"{config.source}: {what} while searching; the trials already committed to {config.storage_url} are kept: "
            f"{fix} and run the same command ({again}) to resume"
        ) from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _make_out(config: JobConfig) -> None:
    """Create ``[job].out``; `SearchError` naming the key when it cannot hold the artifacts."""
    try:
        config.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SearchError(f"{config.source}: [job].out: cannot create {config.out} ({exc.strerror}); set it to a writable folder") from None
    if not os.access(config.out, os.W_OK | os.X_OK):
        raise SearchError(f"{config.source}: [job].out: {config.out} is not writable; set it to a writable folder")


def _train_and_profile(config, workload, step, example_inputs, progress):
    """Train ``[profile].steps`` steps (the profiler attached unless a profile is loaded)."""
    from ..profiling import LayerProfiler, Profile, train_window, with_grad_formats

    model = step.model
    profiler = None
    if config.profile_path is None:
        profiler = LayerProfiler(model, example_inputs, formats=with_grad_formats(config.formats), window=config.profile_steps)
    phase = "training + profiling" if profiler is not None else "training"
    first, last = train_window(step, iter(workload.train_batches(config.seed)), config.profile_steps, profiler, progress, phase)
    if profiler is None:
        profile = Profile.load(config.profile_path, model, example_inputs)
    else:
        profile = profiler.profile({"job": config.name, "lr": step.lr, "seed": config.seed, "loss_first": first, "loss_last": last})
        profile.save(config.out / "profile.json")
    return profile, (first, last)


def _signature(space: SearchSpace, memory: float, loss: float) -> str:
    """What a study's trials depend on: the units, their formats and the budgets."""
    # An open budget is inf: JSON writes it as Infinity, round() cannot take it.
    budgets = [round(memory) if math.isfinite(memory) else memory, float(f"{loss:.6g}")]
    signature = {"units": {u.name: [key_name(f) for f in u.formats] for u in space.units}, "budgets": budgets}
    if space.blocks:  # only then: a study of a search without blocks keeps its digest
        signature["blocks"] = [b.name for b in space.blocks]
    return hashlib.sha1(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def _measured_name(config: JobConfig) -> str:
    return f"{config.study_name}:measured"


def _check_study(storage, config: JobConfig, digest: str) -> None:
    """Refuse to resume a measured study made for another search (other layers, formats or
    budgets), finished or interrupted (the search's digest is set before the study's first trial)."""
    try:
        study = optuna.load_study(study_name=_measured_name(config), storage=storage)
    except KeyError:
        return
    held = study.user_attrs.get(_SEARCH_ATTR)
    if held != digest and (held is not None or study.get_trials(deepcopy=False)):
        raise SearchError(
            f"study {_measured_name(config)!r} in {config.storage_url} holds trials of another search (layers, formats or budgets "
            "changed); set [search].study_name to a new name or delete the study to start over"
        )


def _with_references(proposed, space, costs, config, ruled_out, memory, loss_budget, budgets_meta, meta, device, fingerprint) -> list[Candidate]:
    """``proposed`` plus the references: each uniform plan of the space that fits the budgets as
    predicted, and plain autocast in each half format the device runs and the space allows; with
    recompute blocks also every block recomputed in FP32 and under plain BF16 autocast
    (torchtitan's "full" activation checkpointing); all distinct, fastest predicted first (so
    `MeasuredStage.run` can prune far slower ones unrun)."""
    out = {c.id: c for c in proposed}
    everything = frozenset(b.name for b in space.blocks)
    for fmt, autocast in ((Format.FP32, False), (Format.BF16, True)) if everything else ():
        assignment = space.uniform(fmt)
        if assignment is None or (autocast and not format_support(fmt, device).runnable):
            continue
        order = [b.name for b in space.blocks]
        solution = Solution(assignment, space.totals(assignment, order), everything)
        plan = plan_from_solution(space, costs, solution, layer_reasons(space, assignment, config.rules, ruled_out), budgets_meta, meta, fingerprint)
        reference = Candidate(f"recompute-all-{'autocast-' if autocast else ''}{fmt.value}", plan, autocast=autocast)
        out[reference.id] = reference
    for fmt in config.formats:
        assignment = space.uniform(fmt)
        if assignment is None:
            continue
        total = space.totals(assignment)
        reasons = layer_reasons(space, assignment, config.rules, ruled_out)
        plan = plan_from_solution(space, costs, Solution(assignment, total), reasons, budgets_meta, meta, fingerprint)
        uniform = Candidate(f"uniform-{fmt.value}", plan)
        if total.bytes <= memory and total.loss <= loss_budget:
            out.setdefault(uniform.id, uniform)
        if fmt in (Format.BF16, Format.FP16) and format_support(fmt, device).runnable:
            reference = Candidate(f"autocast-{fmt.value}", plan, autocast=True)
            out[reference.id] = reference
    return sorted(out.values(), key=lambda c: c.plan.predicted["seconds"])


def run_job(config: JobConfig, progress: "Progress | None" = None, workers: int = 1) -> JobResult:
    """Run the search job ``config``; returns what it found.

    One run, in order (each step's figures end up in the plan's ``predicted`` / ``measured`` /
    ``metadata`` and in the summary table):

    1. **Train and profile**: ``[profile].steps`` training steps of the workload's model (the model
       the plan is for), the `LayerProfiler` attached for that window, unless ``[profile].path``
       names a saved profile (then it is loaded and checked against the model). A format whose
       weights, activations or gradients the profile saw overflow or underflow past what the
       scheduler promotes a layer for (`planner.range_reason`, with that format's scaling) is
       taken out of the layer's choices, with that reason.
    2. **Costs and sensitivity**: a `CostModel` (bytes from the traced shapes, seconds measured on
       this device and cached) and the Fisher sensitivity estimate (predicted loss increase) per
       (layer, format), at the workload's learning rate; per recompute block (`find_blocks`, or
       ``[rules].recompute``; ``[]`` for none) the bytes recomputing it frees and its extra forward.
    3. **The k best plans** (`pipeline.propose_plans`): the additive table as a `SearchSpace`, and
       its ``[search].measure_top`` fastest predicted plans that meet the budgets, distinct in
       formats or recomputed blocks (chosen together), from the integer program (`exact.k_best`: the optimum to `exact.MIP_GAP`, then the next best
       under no-good cuts; an infeasible budget stops here with the smallest reachable;
       ``[search].timeout_s`` bounds the solves).
    4. **Measured stage**: those plans run for real (`MeasuredStage`, an Optuna study in the job's
       storage, resumed on a re-run), and beside them the references: every uniform plan that fits the
       budgets as predicted, and plain ``torch.autocast`` in BF16 (and FP16) where the device runs
       it and the rules allow that format, and with blocks every block recomputed in FP32 and under
       plain BF16 autocast (``--workers N``: N processes measure them, `job.workers`;
       this process then collects the study). The plan returned is the fastest of all of them that
       meets both budgets *as measured* (with ``[search].measured_trials``, after those the
       learning sampler's plans too, `search.refine`); when plain autocast wins, that is the uniform half plan,
       its metadata saying it runs as plain autocast. Plain FP32 is measured as the baseline.
    5. **Artifacts** under ``[job].out``: ``plan.json`` (only when a plan met the budgets),
       ``profile.json``, the measured study (``<study_name>:measured`` in ``study.db`` unless
       ``[search].storage`` says otherwise) and TensorBoard logs in ``logs/``: the measured plans
       and their Pareto front (time, memory, loss increase), each candidate, the chosen plan.

    Args:
        config: the job, as `load_job` read it.
        progress: ``progress(done, total, label)``, called as the stages advance (None: silent).
        workers: processes measuring the candidates; > 1 on the job's storage (a journal file
            or a server database, `job.workers`). Everything before the measured stage runs
            once, here.

    Returns:
        The `JobResult`: the plan (None when no candidate met the budgets as measured), its
        path, every candidate's and reference's measurement, and the budgets.

    Raises:
        SearchError: a bad workload, device, output folder or storage, a study of another
            search, or a storage that cannot take several workers.
        InfeasibleBudgetError: no plan can meet the budgets even on the predictions; it states
            the smallest memory and loss increase reachable and the settings that reach them.
        ProfileError: ``[profile].path`` names a profile that cannot be read or was made for
            another model.
        WorkloadError: a workload method returned what it must not (a non-scalar loss, a
            training iterator that ran out, ...).
        UserCodeError: the workload's own code raised.
    """
    start = time.perf_counter()
    check_workers(config.source, config.storage_url, workers)
    # Checked before anything is written, so a bad device or folder leaves no empty study behind.
    with _naming(config, "[job].device"):
        device = resolve_device(config.device, SearchError, "the search", fix='set [job].device = "cpu" (or "auto")')
    _make_out(config)
    with _naming(config, "[search].storage", "; fix the path or URL"):
        storage = open_storage(config.storage_url)  # an unreachable storage fails before any work
    with _storage_failures(config, workers), _measuring_threads(device) as load:
        return _search(config, progress, workers, device, storage, start, load)


@contextlib.contextmanager
def _measuring_threads(device):
    """On a CPU, the job (training, timing, the measured stage) runs with the intra-op threads
    the machine can give (`cpu_load`: the cores other processes leave free), restored after;
    yields the `CpuLoad` sampled (None on another device)."""
    if device.type != "cpu":
        yield None
        return
    load = sample_load()
    before = torch.get_num_threads()
    threads = measuring_threads(load, before)
    logger.info("autoprec: measuring with %s", load.describe(threads))
    torch.set_num_threads(threads)
    try:
        yield load
    finally:
        torch.set_num_threads(before)


def _search(config: JobConfig, progress, workers: int, device, storage, start: float, load: "CpuLoad | None") -> JobResult:
    workload = load_job_workload(config)
    model = workload.build_model(config.seed).to(device)
    step = TrainStep.for_workload(workload, model)
    lr = step.lr
    val = [to_device(b, device) for b in workload.val_batches(config.val_batches)]
    # The model's inputs as the workload's loss calls it: tuples or dicts of keyword inputs.
    example_inputs = ModelCall.first(model, lambda: workload.loss(model, val[0]))
    if example_inputs is None:
        raise SearchError(f"{config.source}: [workload].factory: {config.factory}'s loss(model, batch) never called the model; it must run model(...) on the batch")

    # The recompute units the search chooses among, found before any training: a pattern that names
    # no block is a config error. The layers from the module tree (no forward, so the run's RNG is
    # untouched); ``[rules].recompute = []`` searches formats only.
    try:
        blocks = find_blocks(model, find_layers(model), config.rules.recompute)
    except SearchError as exc:
        raise SearchError(f"{config.source}: [rules].recompute: {exc}") from None
    profile, (loss_first, loss_last) = _train_and_profile(config, workload, step, example_inputs, progress)
    batches = iter(workload.train_batches(config.seed + 1))
    train = [to_device(next(batches), device) for _ in range(max(config.sensitivity_batches, 4))]

    fingerprint = find_layers(model, example_inputs)  # the plan refuses another model of the same layer names
    # The measured steps train as the profiled ones did: the workload's optimizer and clipping.
    stage = MeasuredStage(model, workload.loss, train, val, train_step=lambda m: TrainStep.for_workload(workload, m), steps=config.measure_steps)
    measurement = load.to_dict(torch.get_num_threads()) if load is not None else None
    meta = {
        "job": config.name, "source": str(config.source), "device": str(device), "torch": torch.__version__,
        **({"measurement": measurement} if measurement is not None else {}),
        "study": _measured_name(config), "storage": config.storage_url, "lr": lr,
        "train_loss_first": loss_first, "train_loss_last": loss_last, "profile_steps": config.profile_steps, "sensitivity": "fisher",
    }
    # The in-place times are kept in the out folder: a re-run predicts exactly what this run did,
    # so the same candidates come out and the measured study gets no new trial.
    try:
        proposal = propose_plans(
            model, example_inputs, train[: config.sensitivity_batches], workload.loss, profile, config.planning(lr),
            baseline_loss=stage.baseline_loss, metadata=meta, fingerprint=fingerprint, source=f"{config.source}: ",
            cost_inputs=train[0], cost_loss_fn=workload.loss, times_file=config.out / "costs.json", progress=progress, blocks=blocks,
        )
    except InfeasibleBudgetError as exc:
        raise exc.with_hint(floor_settings(exc, memory="[budgets].memory", recompute="[rules].recompute = []",
                                           recompute_off=config.rules.recompute == ())) from None
    found, optimum = proposal.found, proposal.optimum
    costs, space, ruled_out = found.costs, found.space, found.ruled_out
    memory, loss_budget, exact = optimum.memory, optimum.loss_budget, optimum.exact
    fp32_cost = costs.plan_cost(costs.uniform_plan(Format.FP32))

    signature = _signature(space, memory, loss_budget)
    _check_study(storage, config, signature)
    proposed = [Candidate("exact" if rank == 0 else f"exact-{rank + 1}", plan) for rank, plan in enumerate(proposal.plans)]
    candidates = _with_references(
        proposed, space, costs, config, ruled_out, memory, loss_budget, proposal.budgets, {**meta, "exact_seconds": exact.total.seconds},
        device, fingerprint,
    )

    measured_study = optuna.create_study(
        study_name=_measured_name(config), storage=storage, direction="minimize",
        pruner=BudgetPruner(loss_budget), load_if_exists=True,
    )
    measured_study.set_user_attr(_SEARCH_ATTR, signature)  # before its first trial: what a resume checks
    measured_memory = config.budgets.memory_bytes(stage.memory(None))
    candidates = adopt_candidates(measured_study, candidates)  # several machines: the first one's list
    sampler = None
    if config.measured_trials > 0:
        # After the initial design, the learning sampler proposes plans (`search.refine`): formats
        # around the recompute set of the proxy's optimum, which it keeps.
        sampler = CorrectingSampler(space.fixing_recompute(sorted(exact.recompute)), [c.plan for c in candidates if not c.autocast],
                                    measured_memory, loss_budget, fp32_cost.step_seconds, config.measured_trials, recompute=sorted(exact.recompute),
                                    precisions=costs.precisions)
        measured_study.sampler = sampler
    # On a CPU: each trial's load sets the next one's threads (the workers are reaped inside a
    # span: their time is this job's own).
    governor = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads) if load is not None else None
    span = governor.span if governor is not None else (lambda name: contextlib.nullcontext())
    if workers > 1:
        payload = WorkerPayload(
            config, device, {k: v.cpu() for k, v in model.state_dict().items()}, [to_device(b, "cpu") for b in train],
            [to_device(b, "cpu") for b in val], candidates, measured_memory, loss_budget,
            _measured_name(config), config.storage_url, sampler,
        )
        threads = measuring_threads(load, None, workers) if load is not None else torch.get_num_threads()
        with span("trials"):
            run_workers(config, payload, candidates, measured_study, workers, progress, threads)
    # With workers, this collects what they measured (and measures what a dead one left).
    with quiet_interrupts():
        # Priced for another device: every plan is measured (its loss and bytes), none pruned for its prediction.
        results = stage.run(candidates, measured_study, measured_memory, loss_budget, progress, span=span,
                            slow_prune=math.inf if config.target is not None else 2.0)
    references = {"fp32": stage.fp32()}
    if stage.refined:  # the learning sampler's plans, made whole: reasons and predicted figures
        numbers = {t.user_attrs.get("candidate"): t.number for t in measured_study.get_trials(deepcopy=False, states=_FINISHED)
                   if "skipped" not in t.user_attrs}
        exact_id = candidate_id(proposal.plans[0])  # the proxy's optimum
        baseline = (numbers.get(exact_id), results.get(exact_id), proposal.optimum.exact.total.seconds)
        candidates = candidates + [
            _refined(c, sampler, space, costs, config, ruled_out, proposal, {**meta, "exact_seconds": exact.total.seconds}, fingerprint,
                     _evidence(numbers.get(c.id), results.get(c.id), c.plan.predicted["seconds"], baseline))
            for c in stage.refined
        ]

    pairs = [(c, results.get(c.id, "not measured")) for c in candidates]
    if config.target is not None:
        # The budgets as measured here (loss and bytes do not depend on the device), the speed as
        # predicted there: this machine's step times would rank its own kernels.
        winner, verdict = fastest_predicted_meeting(pairs, measured_memory, loss_budget), None
    else:
        winner = fastest_meeting(pairs, measured_memory, loss_budget)
        with span("settling"):
            verdict = _settle(stage, pairs, measured_memory, loss_budget) if winner is not None else None
    if measurement is not None and governor is not None and load is not None:
        measurement = {**measurement, **_load_during(load, governor)}
    if verdict is not None:
        winner = next((c, m) for c, m in pairs if c.name == verdict.choice and isinstance(m, Measurement))
        if not verdict.resolved:
            logger.warning("autoprec: the measurement cannot rank every candidate: %s", verdict.summary())
    plan = plan_path = None
    if winner is not None:
        candidate, m = winner
        emulated = {} if candidate.autocast else _emulated(model, candidate.plan, example_inputs)
        fp32 = references["fp32"]
        measured = {
            **m.to_dict(), "baseline_loss": stage.baseline_loss, "fp32_bytes": fp32.bytes, "fp32_seconds": fp32.seconds,
            **({"settled": verdict.to_dict()} if verdict is not None else {}),
            "references": {"fp32": fp32.to_dict(), **{c.name: r.to_dict() if isinstance(r, Measurement) else {"pruned": r} for c, r in pairs if c.is_reference}},
        }
        metadata = {
            **candidate.plan.metadata, "candidate": candidate.name,
            "k_best": {"plans": len(proposal.plans), "kth_vs_optimum": proposal.kth_gap},
            "emulated_layers": emulated, "seconds": round(time.perf_counter() - start, 1),
            **({"measurement": measurement} if measurement is not None else {}),
        }
        if candidate.autocast:
            half = Format.parse(next(iter(candidate.plan.format_counts())))
            metadata["runs_as"] = f"plain torch.autocast({device.type!r}, dtype={half.dtype})" + (
                f" with {len(candidate.plan.recompute)} blocks under torch.utils.checkpoint" if candidate.plan.recompute else "")
            fastest = f"the fastest predicted on {config.target.name}" if config.target is not None else "the fastest"
            metadata["reason"] = f"plain autocast was {fastest} candidate that met the budgets as measured; this uniform plan runs as {metadata['runs_as']}"
        plan = candidate.plan.replace(measured=measured, metadata=metadata)
        plan_path = plan.save(config.out / "plan.json")
        if emulated:
            logger.warning("%d layer(s) of the plan run emulated (no kernel on %s): %s", len(emulated), device, ", ".join(layer_name(f, model) for f in emulated))
    result = JobResult(
        config=config, plan=plan, plan_path=plan_path, references=references, candidates=pairs,
        proposal=proposal, memory_budget=measured_memory, loss_budget=loss_budget, predicted_memory_budget=memory,
        predicted_fp32={"bytes": fp32_cost.bytes, "seconds": fp32_cost.step_seconds}, seconds=time.perf_counter() - start,
        chosen=winner[0] if winner is not None else None, measurement=measurement, verdict=verdict,
    )
    _write_logs(config, result, measured_study)
    return result


def _load_during(start: CpuLoad, governor: ThreadGovernor) -> dict:
    """What the other processes' load did while the job measured (`ThreadGovernor`): per kind of
    span the most cores they kept busy (``during``), the threads each span after the first
    change ran with (``threads_by_span``), and ``changed``: a line when some spans contended
    with another process (their load left fewer free cores than their threads), logged too."""
    out: dict = {"during": {}}
    for name, load, _ in governor.spans:
        out["during"][name] = round(max(out["during"].get(name, 0.0), load.busy_elsewhere), 3)
    if any(threads != governor.ceiling for _, _, threads in governor.spans) or governor.threads != governor.ceiling:
        out["threads_by_span"] = [[name, threads] for name, _, threads in governor.spans]
    contended = governor.contended()
    if contended:
        worst = max(load.busy_elsewhere for _, load, _ in contended)
        kinds = sorted({name for name, _, _ in contended})
        counts = ", ".join(f"{sum(n == k for n, _, _ in contended)} of {sum(n == k for n, _, _ in governor.spans)} {k} span(s)" for k in kinds)
        out["changed"] = (f"the load rose while measuring: up to {worst:.1f} cores busy elsewhere ({start.busy_elsewhere:.1f} at the start) in {counts}, "
                          "which ran with more threads than cores left free; the next spans took fewer threads, but those figures may be slower than on a quiet machine")
        logger.warning("autoprec: %s", out["changed"])
    return out


SETTLED = 3  # at most this many candidates that met the budgets are timed again in interleaved rounds


def _settle(stage: MeasuredStage, pairs, memory: float, loss_budget: float) -> "Verdict | None":
    """The fastest candidates that met the budgets as measured, timed again in interleaved rounds
    beside a control pair (`MeasuredStage.settle`): the uniform BF16 plan and plain BF16 autocast
    when both were candidates (they run the same ops), else the fastest twice.

    Contenders: the fastest and those its trials could not tell from it (a trial's interval
    reaching below the fastest's upper bound, `Measurement.seconds_interval`), or the runner-up
    when the trials separated all, so the control pair is always measured beside a comparison; at
    most `SETTLED`, and no more than the model copies the device's free memory holds
    (`MeasuredStage.spare_copies`). None when only one candidate met the budgets or no two copies fit."""
    room = stage.spare_copies() - 2  # the control pair's copies, at most
    met = meeting_by_speed(pairs, memory, loss_budget)
    if len(met) < 2 or room < 2:
        if len(met) >= 2:
            logger.info("autoprec: no room for the final interleaved rounds (%d model copies fit); the fastest as measured is returned", room + 2)
        return None
    fastest = met[0][1]
    high = fastest.seconds_interval[1] if fastest.seconds_interval is not None else math.inf
    close = [p for p in met[1:] if p[1].seconds_interval is None or p[1].seconds_interval[0] <= high]
    contenders = [met[0], *(close or met[1:2])]
    if len(contenders) > min(SETTLED, room):
        logger.info("autoprec: %d candidates measured within the fastest's interval; the %d fastest of them are timed again", len(contenders), min(SETTLED, room))
    by_name = {c.name: c for c, _ in pairs}
    control = (by_name["uniform-bf16"], by_name["autocast-bf16"]) if {"uniform-bf16", "autocast-bf16"} <= set(by_name) else None
    return stage.settle([c for c, _ in contenders[:min(SETTLED, room)]], control)


def _refined(candidate: Candidate, sampler, space, costs, config, ruled_out, proposal, meta, fingerprint, evidence: str) -> Candidate:
    """A plan the learning sampler proposed, as a full plan: each layer whose format differs from
    the proxy's optimum says a measurement decided it, with ``evidence`` (`_evidence`)."""
    assignment = sampler.assignment_of(candidate.plan)
    recompute = frozenset(sampler.recompute)
    formats = space.layer_formats(assignment)
    reasons = measured_reasons(layer_reasons(space, assignment, config.rules, ruled_out), formats,
                               space.layer_formats(proposal.optimum.exact.assignment), evidence)
    plan = plan_from_solution(space, costs, Solution(assignment, space.totals(assignment, sorted(recompute)), recompute), reasons, proposal.budgets,
                              {**meta, "proposed_by": "learning sampler"}, fingerprint)
    return Candidate(candidate.name, plan)


def _evidence(number: "int | None", measured: "Measurement | str | None", predicted: float,
              optimum: "tuple[int | None, Measurement | str | None, float]") -> str:
    """What measuring the learning sampler's trial ``number`` showed against the proxy's optimum
    (``optimum``: its trial number, measurement or why it was pruned, and predicted seconds)."""
    trial = f"trial {number}" if number is not None else "its trial"
    opt_number, opt_measured, opt_predicted = optimum
    opt_trial = f"trial {opt_number}" if opt_number is not None else "not measured"
    if not isinstance(measured, Measurement) or measured.seconds is None:
        return f"{trial} was proposed on the measured trials' correction ({measured or 'not measured'})"
    proxy = f"the proxy predicted it {abs(predicted / opt_predicted - 1):.1%} {'slower' if predicted >= opt_predicted else 'faster'}"
    if not isinstance(opt_measured, Measurement) or opt_measured.seconds is None:
        return (f"measured: {trial} ran in {measured.seconds * 1e3:.3g} ms, the proxy's optimum ({opt_trial}) has no measured step "
                f"({opt_measured or 'not measured'}); {proxy}")
    gain = 1 - measured.seconds / opt_measured.seconds
    return (f"measured: {trial} ran {abs(gain):.1%} {'faster' if gain >= 0 else 'slower'} than the proxy's optimum ({opt_trial}, "
            f"{opt_measured.seconds * 1e3:.3g} ms as measured); {proxy}")


def _emulated(model, plan: Plan, example_inputs) -> dict[str, list[str]]:
    """Layers of ``plan`` whose products have no kernel here (one forward under the plan)."""
    runtime = apply_plan(model, plan, validate=False)
    with warnings.catch_warnings(), torch.no_grad(), removing([runtime]):
        warnings.simplefilter("ignore", EmulationWarning)
        with runtime:
            example_inputs(model)
    return runtime.emulated_layers()


def _write_logs(config: JobConfig, result: JobResult, study: optuna.Study) -> None:
    """Under ``out/logs``: the measured study (one point per plan run for real, the Pareto front
    in step time, memory and loss increase, against measured FP32 and the measured budgets, the
    returned plan starred), every candidate as an HParams session, and the chosen plan as its own run."""
    from ..monitoring import PlanWriter, write_candidates, write_search

    logdir = config.out / "logs"
    fp32 = result.references["fp32"]
    measured = []
    for candidate, m in result.candidates:
        extra = m.to_dict() if isinstance(m, Measurement) else {"pruned": m}
        measured.append((candidate.name, candidate.plan.replace(measured={**extra, "fp32_bytes": fp32.bytes, "fp32_seconds": fp32.seconds})))
    write_search(study, logdir, fp32={"bytes": fp32.bytes, "seconds": fp32.seconds}, memory_bytes=result.memory_budget,
                 loss_increase=result.loss_budget, chosen=result.chosen.name if result.chosen is not None else None,
                 measured=[(n, p) for n, p in measured if "bytes" in p.measured])
    write_candidates(measured, logdir)
    if result.plan is not None:
        with PlanWriter(logdir, replace=True) as writer:
            writer.write_plan(result.plan, "searched")
