"""The measured stage: candidate plans run for real, and the best one that meets the budgets.

The proxy stage ranks plans on additive per-layer predictions. Here each candidate runs on the
device the way training will run it (`apply_plan`), and three figures are measured:

- **bytes**: what autograd saves for backward in one training step (`SavedTensorMeter`, every
  op, not only the layers) plus every trainable parameter's gradient buffer: the quantity the cost model
  predicts (`CostModel.plan_cost(...).bytes`);
- **loss increase**: the mean held-out loss under the plan minus the FP32 model's on the same
  batches (INT8 layers calibrated first on training batches, as in training);
- **step seconds**: training steps (forward, backward, optimizer) of a copy of the model,
  interleaved one for one with FP32 steps of another copy, so the machine's drift cancels: the
  candidate's figure is its median ratio to FP32 times the FP32 median of the whole stage.

A `Candidate` is an autoprec plan, or a **reference** that is not one: plain ``torch.autocast``
in the half format of a uniform plan, measured in exactly the same way, so that the search can
never return a plan slower than what a user gets without autoprec. `MeasuredStage.run` measures
candidates as trials of an Optuna study (resumable, shared by workers, each candidate measured
once), pruning early what cannot win (`BudgetPruner`, ``slow_prune``); `fastest_meeting` picks
the winner. Costs per candidate: see `MeasuredStage`.
"""

from __future__ import annotations

import contextlib
import copy
import types
import dataclasses
import functools
import hashlib
import logging
import math
import os
import statistics
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence, cast

import optuna
import torch
import torch.nn as nn
from optuna.trial import TrialState
from torch.utils.checkpoint import checkpoint

from ..calls import loss_of
from ..formats import Format
from ..saved_bytes import SavedTensorMeter
from ..plan import LayerPrecision, Plan
from ..runtime import EmulationWarning, apply_plan, removing
from ..device_clock import rotated, timed
from ..workload import TrainStep
from ..noise import Verdict, median_interval, separate
from .study import mark_worker, recover_interrupted_trials

if TYPE_CHECKING:  # refine imports this module; the stage only duck-types its sampler
    from .refine import CorrectingSampler

__all__ = ["Measurement", "Candidate", "AutocastCheckpoint", "BudgetPruner", "MeasuredStage", "candidate_id", "formats_id", "enqueue", "fastest_meeting", "meeting_by_speed", "meets_budgets"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Measured figures of one variant: bytes (saved for backward + layer gradients), training
    step seconds, held-out loss and its increase over FP32 (None when not measured).
    ``seconds_interval``: (low, high) of the 90 % confidence interval of ``seconds`` from the
    variant's rounds (`noise.median_interval`: of its per-round ratio to FP32, scaled like
    ``seconds``); how far apart two variants must measure before the rounds tell them apart."""

    bytes: int
    seconds: "float | None" = None
    loss: "float | None" = None
    loss_increase: "float | None" = None
    seconds_interval: "tuple[float, float] | None" = None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan to measure, with its identity in the measured study.

    ``autocast``: run as plain ``torch.autocast`` in the plan's format (a uniform BF16 or FP16
    plan) instead of through `apply_plan`: the reference a user has without autoprec. A plan that
    recomputes blocks is measured like any other (the runtime checkpoints them); an autocast
    reference whose plan recomputes blocks runs them under plain non-reentrant
    ``torch.utils.checkpoint`` inside ``torch.autocast`` (`AutocastCheckpoint`; torchtitan's
    "full" activation checkpointing when every block is named).
    """

    name: str
    plan: Plan
    autocast: bool = False

    @property
    def id(self) -> str:
        return candidate_id(self.plan) + (":autocast" if self.autocast else "")

    @property
    def is_reference(self) -> bool:
        """A uniform plan or plain autocast: measured to compare against, not proposed by the search."""
        return self.autocast or len(self.plan.format_counts()) == 1

    def context(self, device: torch.device) -> Callable[[nn.Module], Any]:
        """``model -> context manager`` that runs a training step of this candidate."""
        if self.autocast:
            (fmt,) = {lp.format for lp in self.plan.layers.values()}
            blocks = self.plan.recompute
            if blocks:
                return lambda m: AutocastCheckpoint(m, device.type, fmt.dtype, blocks)
            return lambda m: torch.autocast(device.type, dtype=fmt.dtype)
        return _plan_context(self.plan)


class AutocastCheckpoint:
    """``torch.autocast(device_type, dtype)`` with the modules ``blocks`` of ``model`` run under
    non-reentrant ``torch.utils.checkpoint`` while gradients are on: what a user writes for
    activation checkpointing without autoprec (torchtitan's "full" mode). Re-entered every step;
    the blocks' own ``forward`` is restored on exit, also when the body raises. Costs one more
    forward of each block per backward."""

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype, blocks: Iterable[str]):
        modules = dict(model.named_modules())
        self.blocks = [modules[fqn] for fqn in blocks]
        self.autocast = torch.autocast(device_type, dtype=dtype)
        self._saved: list = []

    def __enter__(self) -> "AutocastCheckpoint":
        if self._saved:
            raise RuntimeError("AutocastCheckpoint is already entered; leave it before entering it again")
        for module in self.blocks:
            own = module.__dict__.get("forward")
            self._saved.append((module, own))

            def forward(m, *args, _own=own, **kwargs):
                run = _own if _own is not None else types.MethodType(type(m).forward, m)
                if not torch.is_grad_enabled():
                    return run(*args, **kwargs)
                return checkpoint(run, *args, use_reentrant=False, **kwargs)

            module.forward = types.MethodType(forward, module)
        self.autocast.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.autocast.__exit__(*exc)
        finally:
            for module, own in self._saved:
                if own is None:
                    del module.forward
                else:
                    module.forward = own
            self._saved = []


def candidate_id(plan: Plan) -> str:
    """A short stable id of a plan's recipes and recomputed blocks (same layers, recipes and
    recompute set, same id; a plan recomputing nothing keeps the id it had before blocks, one
    in the formats' default scalings the id it had before recipes)."""
    return formats_id(plan.layers, plan.recompute)


def formats_id(formats: "Mapping[str, Format | LayerPrecision]", recompute: Iterable[str] = ()) -> str:
    """`candidate_id` of a plan with these layer precisions (fqn -> `LayerPrecision`, named by
    its recipe, or a format in its default recipe) recomputing ``recompute``."""
    text = ";".join(f"{fqn}={lp.recipe if isinstance(lp, LayerPrecision) else Format.parse(lp).value}" for fqn, lp in sorted(formats.items()))
    recompute = sorted(recompute)
    if recompute:
        text += ";recompute=" + ",".join(recompute)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class BudgetPruner(optuna.pruners.BasePruner):
    """Prunes a trial whose reported running loss increase, after ``min_reports`` reports, is
    above ``loss_budget`` by more than ``slack`` (relative) plus twice its standard error.

    Intermediate values are the running mean increase; the trial sets the user attribute
    ``"stderr"`` with the running standard error before it reports. The error term keeps a
    noisy early estimate from pruning a plan whose true increase is within the budget.
    """

    def __init__(self, loss_budget: float, *, slack: float = 0.25, min_reports: int = 2):
        self.loss_budget = loss_budget
        self.slack = slack
        self.min_reports = min_reports

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if not math.isfinite(self.loss_budget) or len(trial.intermediate_values) < self.min_reports:
            return False
        value = trial.intermediate_values[max(trial.intermediate_values)]
        stderr = float(trial.user_attrs.get("stderr", 0.0))
        return value > self.loss_budget * (1 + self.slack) + 2 * stderr


class StepVariant:
    """One way to run a training step: a copy of the model, its `TrainStep`, and a context."""

    def __init__(self, model: nn.Module, train_step: Callable[[nn.Module], TrainStep], context: Callable[[nn.Module], Any]):
        self.model = copy.deepcopy(model)
        self.train_step = train_step(self.model)
        self.context = context(self.model)
        self.train_step.make_context = lambda: self.context  # re-entered every step, as in training

    def step(self, batch) -> None:
        self.train_step(batch)


class MeasuredStage:
    """Measures plans of one model on fixed batches: bytes, loss increase and step seconds as
    the module docstring defines them.

    ``model``: the trained model the plans are for (left unchanged); ``loss_fn(model, batch)``
    the training loss (or the model's output with a ``loss`` field, `calls.loss_of`); ``train_batches`` drive calibration and the timed steps;
    ``train_step(model_copy)`` makes the timed `TrainStep` (the workload's optimizer and
    clipping, `TrainStep.for_workload`; default plain AdamW at lr 1e-3);
    ``val_batches`` give the held-out loss.
    Costs per candidate: one metered step, up to ``len(val_batches)`` forwards (fewer when
    pruned) plus INT8 calibration forwards, and ``2 × (warmup + steps)`` training steps.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        train_batches: Sequence[Any],
        val_batches: Sequence[Any],
        *,
        train_step: Optional[Callable[[nn.Module], TrainStep]] = None,
        steps: int = 5,
        warmup: int = 2,
    ):
        if not train_batches or not val_batches:
            raise ValueError("MeasuredStage needs at least one training and one held-out batch")
        self.model = model
        self.loss_fn = loss_fn
        self.train_batches = list(train_batches)
        self.val_batches = list(val_batches)
        self.train_step = train_step or (lambda m: TrainStep(m, loss_fn, torch.optim.AdamW(m.parameters(), lr=1e-3)))
        self.steps = steps
        self.warmup = warmup
        first = next(model.parameters())
        self.device = first.device
        self.baseline_losses = self._val_losses()
        self.baseline_loss = statistics.fmean(self.baseline_losses)
        self._fp32 = StepVariant(model, self.train_step, lambda m: contextlib.nullcontext())
        self._fp32_times: list[float] = []
        self.refined: list[Candidate] = []  # what the learning sampler proposed, after `run`

    # -- the three figures ------------------------------------------------------------------

    def memory(self, plan: "Plan | None", context: "Callable[[nn.Module], Any] | None" = None) -> int:
        """Bytes saved for backward in one training step plus the gradient buffers' bytes."""
        variant = StepVariant(self.model, self.train_step, context or _plan_context(plan))
        params = list(variant.model.parameters())
        variant.train_step.optimizer.zero_grad(set_to_none=True)
        with SavedTensorMeter(params) as meter, variant.context:
            loss = loss_of(self.loss_fn(variant.model, self.train_batches[0]))
        loss.backward()
        return meter.total_bytes + sum(p.grad.nbytes for p in params if p.grad is not None)

    def loss_increases(self, candidate: Candidate):
        """Yields (running mean increase, its standard error) after each held-out batch."""
        runtime = None if candidate.autocast else apply_plan(self.model, candidate.plan, validate=False)
        context = candidate.context(self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), removing([runtime]):
                if runtime is not None:
                    self._calibrate(candidate.plan, runtime)
                diffs = []
                for batch, base in zip(self.val_batches, self.baseline_losses):
                    with runtime if runtime is not None else context(self.model):
                        diffs.append(float(loss_of(self.loss_fn(self.model, batch))) - base)
                    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
                    yield statistics.fmean(diffs), stderr
        finally:
            self.model.train(was_training)

    def step_seconds(self, context: Callable[[nn.Module], Any]) -> float:
        """Median training-step seconds of a variant, as its median ratio to interleaved FP32
        steps (`step_ratio`) times the FP32 median of every step this stage has timed."""
        return self.step_ratio(context) * self.fp32_seconds

    def step_ratio(self, context: Callable[[nn.Module], Any]) -> float:
        """Median ratio of a variant's training-step time to FP32's (`step_ratio_interval`)."""
        return self.step_ratio_interval(context)[1]

    def step_ratio_interval(self, context: Callable[[nn.Module], Any]) -> tuple[float, float, float]:
        """(low, median, high) of a variant's per-round ratio of training-step time to FP32's
        (`noise.median_interval`), steps interleaved one for one (``2 × (warmup + steps)``
        training steps); the FP32 times join `fp32_seconds`."""
        variant = StepVariant(self.model, self.train_step, context)
        ratios = []
        for i in range(self.warmup + self.steps):
            batch = self.train_batches[i % len(self.train_batches)]
            # One of each per round, the first alternating (`device_clock.rotated`), each synced wall time.
            t = {id(v): timed(functools.partial(v.step, batch), self.device)[1] for v in rotated((self._fp32, variant), i)}
            if i >= self.warmup:
                self._fp32_times.append(t[id(self._fp32)])
                ratios.append(t[id(variant)] / t[id(self._fp32)])
        return median_interval(ratios)

    def settle(self, contenders: Sequence[Candidate], control: "tuple[Candidate, Candidate] | None" = None,
               max_rounds: "int | None" = None) -> Verdict:
        """Which of ``contenders`` (already measured, each fastest against FP32 on its own) to take,
        from interleaved rounds that know their noise (`noise.separate`): each round runs every
        contender and the ``control`` pair (default: the first contender twice) once, the first
        rotated; after the warmup, ``steps`` rounds, then ``steps`` more while the control pair is
        off 1.0 or the fastest is not separated, up to ``max_rounds`` (default ``3 * steps``).
        Costs: one model copy per contender and per control member that is not one (`spare_copies`
        says how many fit), ``len(variants) × (warmup + rounds)`` training steps."""
        control = control or (contenders[0], contenders[0])
        variants = {c.name: StepVariant(self.model, self.train_step, c.context(self.device)) for c in contenders}
        pair: list[StepVariant] = []
        for c in control:  # a contender's own copy where it can serve (not twice)
            own = variants.get(c.name)
            pair.append(own if own is not None and own not in pair else StepVariant(self.model, self.train_step, c.context(self.device)))
        everyone = list(dict.fromkeys([*variants.values(), *pair]))
        times: dict[int, list[float]] = {id(v): [] for v in everyone}
        predicted = {c.name: c.plan.predicted.get("seconds", math.inf) for c in contenders}
        limit = max_rounds if max_rounds is not None else 3 * self.steps
        ran, warmup = 0, self.warmup
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)  # named in the plan's metadata, as in the trials
            while True:
                for i in range(ran, ran + warmup + self.steps):
                    batch = self.train_batches[i % len(self.train_batches)]
                    t = {id(v): timed(functools.partial(v.step, batch), self.device)[1] for v in rotated(everyone, i)}
                    if i >= self.warmup:
                        for key, seconds in t.items():
                            times[key].append(seconds)
                ran, warmup = ran + warmup + self.steps, 0
                verdict = separate({name: times[id(v)] for name, v in variants.items()}, predicted,
                                   (times[id(pair[0])], times[id(pair[1])]))
                if verdict.resolved or verdict.rounds + self.steps > limit:
                    return verdict

    def spare_copies(self) -> int:
        """How many more training copies of the model (parameters, gradients, two optimizer moments:
        four times its parameter bytes) fit in 80 % of the device's free memory now."""
        per_copy = max(1, 4 * sum(p.numel() * p.element_size() for p in self.model.parameters()))
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            try:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):  # no figure on this system: assume room
                return 1 << 20
        return int(0.8 * free) // per_copy

    @property
    def fp32_seconds(self) -> float:
        """Median FP32 step seconds over every interleaved step timed so far."""
        if not self._fp32_times:
            self.step_ratio(lambda m: contextlib.nullcontext())
        return statistics.median(self._fp32_times)

    # -- references and candidates ----------------------------------------------------------

    def fp32(self) -> Measurement:
        """Plain FP32 (no plan, no autocast): the baseline every ratio is taken against."""
        seconds = self.fp32_seconds  # times FP32 steps if none ran yet
        low, _, high = median_interval(self._fp32_times)
        return Measurement(self.memory(None), seconds, self.baseline_loss, 0.0, (low, high))

    def _val_losses(self) -> list[float]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return [float(loss_of(self.loss_fn(self.model, batch))) for batch in self.val_batches]
        finally:
            self.model.train(was_training)

    def _calibrate(self, plan: Plan, runtime) -> None:
        rounds = max((lp.calibration.batches for lp in plan.layers.values() if lp.format is Format.INT8), default=0)
        for i in range(rounds):
            with runtime:
                self.loss_fn(self.model, self.train_batches[i % len(self.train_batches)])

    def run(
        self,
        candidates: Sequence[Candidate],
        study: optuna.Study,
        memory_bytes: float,
        loss_budget: float,
        progress: "Callable[[int, int, str], None] | None" = None,
        slow_prune: float = 2.0,
        poll_s: float = 1.0,
        span: "Callable[[str], ContextManager[Any]] | None" = None,
    ) -> dict[str, "Measurement | str"]:
        """Measure every candidate not yet measured in ``study`` (trials keyed by the user
        attribute ``candidate``), in the order given; returns candidate id -> `Measurement`, or
        the reason it was pruned. ``memory_bytes`` / ``loss_budget`` are absolute (inf when
        open). ``slow_prune``: a candidate that is not a reference whose
        ``plan.predicted["seconds"]`` is over this times that of the fastest budget-meeting
        candidate measured so far is pruned unrun.

        Each candidate is a trial keyed by `candidate_id` (the hash of its layers' formats) in
        the user attribute ``candidate``: a crashed or interrupted job resumes with the
        candidates already measured kept, and never measures a candidate twice. Measuring stops
        early: ``slow_prune`` above (measure candidates fastest-predicted first; predicted is
        compared with predicted, so a cost model off by a constant factor prunes nothing
        wrongly); references are always run, since the returned plan must be no slower *as
        measured* than any of them that meets the budgets. Any candidate over the memory budget
        is pruned after one step, and `BudgetPruner` prunes one whose running loss increase is
        already clearly over the loss budget, before its step time is measured.

        Trials an interrupted run left RUNNING are failed and queued again first; a queued
        trial whose candidate is already measured, or is not one of ``candidates``, is pruned
        at once with the user attribute ``skipped`` saying why (no measurement).

        Many processes may run this on one study at once (`job.workers`): each takes the next
        candidate that no trial holds, a trial whose candidate an earlier-numbered live trial
        holds is skipped (so no candidate is measured twice, whatever the race), and a process
        with nothing left to take polls every ``poll_s`` seconds until the trials the others run
        finish, or fail and come back queued. The step seconds returned are each trial's
        ``fp32_ratio`` times this stage's FP32 median, so trials of several workers (each with
        its own FP32 timings) compare on one scale. ``span("trials")`` wraps each trial (the
        job's `cpu_load.ThreadGovernor`: the load over one sets the threads of the next)."""
        by_id = {c.id: c for c in candidates}
        initial = set(by_id)
        # The learning sampler (`search.refine`), when the study has one: it proposes plans after
        # the initial design (duck-typed: refine imports this module).
        refine = cast("CorrectingSampler", study.sampler) if hasattr(study.sampler, "next_plan") else None
        recover_interrupted_trials(study)

        def fastest_predicted() -> float:
            """Predicted seconds of the fastest budget-meeting candidate measured so far."""
            done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            met = [(t.value, t) for t in done
                   if t.value is not None and t.user_attrs["bytes"] <= memory_bytes and t.user_attrs["loss_increase"] <= loss_budget]
            return min(met, key=lambda p: p[0])[1].user_attrs.get("predicted", math.inf) if met else math.inf

        def finished() -> dict[str, optuna.trial.FrozenTrial]:
            # `objective` names every trial's candidate or marks it skipped before it can finish.
            trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            return {cid: t for t in trials if "skipped" not in t.user_attrs and (cid := t.user_attrs.get("candidate")) is not None}

        def objective(trial: optuna.Trial) -> float:
            mark_worker(trial)
            cid = trial.user_attrs.get("candidate")
            if cid is None and refine is not None:  # a trial of the learning sampler
                if not trial.relative_params:
                    trial.set_user_attr("skipped", "the learning sampler stopped")
                    raise optuna.TrialPruned("the learning sampler stopped")
                proposed = refine.assignment_named({u.name: trial.suggest_categorical(u.name, list(refine.choice_names(u))) for u in refine.space.units})
                candidate = refine.candidate(proposed, f"refined-{trial.number}")
                cid = candidate.id
                by_id.setdefault(cid, candidate)
                trial.set_user_attr("candidate", cid)
                trial.set_user_attr("name", candidate.name)
            if cid not in by_id and refine is not None and REFINED_ASSIGNMENT in trial.user_attrs.get(REFINED_ATTR, {}):
                # The sampler's plan, queued again after its worker died (or proposed by another
                # worker): measured from its recorded assignment, not skipped and proposed anew.
                proposed = refine.assignment_named(trial.user_attrs[REFINED_ATTR][REFINED_ASSIGNMENT])
                candidate = refine.candidate(proposed, trial.user_attrs.get("name", f"refined-{trial.number}"))
                if candidate.id == cid:
                    by_id[cid] = candidate
            earlier = _owner(study, cid, trial.number)
            if earlier is not None or cid not in by_id:
                why = f"measured by trial {earlier.number}" if earlier is not None else "not a candidate of this run"
                trial.set_user_attr("skipped", why)
                raise optuna.TrialPruned(why)
            candidate = by_id[cid]
            predicted, fastest = candidate.plan.predicted.get("seconds", 0.0), fastest_predicted()
            trial.set_user_attr("predicted", predicted)
            if not candidate.is_reference and cid in initial and predicted > slow_prune * fastest:
                trial.set_user_attr("pruned", f"predicted {predicted * 1e3:.1f} ms > {slow_prune:g}x the {fastest * 1e3:.1f} ms predicted for the fastest measured")
                raise optuna.TrialPruned(trial.user_attrs["pruned"])
            context = candidate.context(self.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EmulationWarning)  # named in the plan's metadata instead
                bytes_ = self.memory(None, context)
                trial.set_user_attr("bytes", bytes_)
                trial.set_constraint("memory", bytes_ - memory_bytes if math.isfinite(memory_bytes) else -1.0)
                if bytes_ > memory_bytes:
                    trial.set_user_attr("pruned", f"measured {bytes_:,} bytes > memory budget {memory_bytes:,.0f}")
                    raise optuna.TrialPruned(trial.user_attrs["pruned"])
                increase = math.nan
                for i, (increase, stderr) in enumerate(self.loss_increases(candidate)):
                    trial.set_user_attr("stderr", stderr)
                    trial.report(increase, i)
                    if trial.should_prune():
                        trial.set_user_attr("loss_increase", increase)
                        trial.set_user_attr("pruned", f"loss increase {increase:.4g} ± {stderr:.2g} after {i + 1} batches > budget {loss_budget:.4g}")
                        raise optuna.TrialPruned(trial.user_attrs["pruned"])
                trial.set_user_attr("loss_increase", increase)
                trial.set_constraint("loss", increase - loss_budget if math.isfinite(loss_budget) else -1.0)
                low, ratio, high = self.step_ratio_interval(context)
                seconds = ratio * self.fp32_seconds
            trial.set_user_attr("fp32_ratio", ratio)
            trial.set_user_attr("fp32_ratio_interval", [low, high])
            trial.set_user_attr("seconds", seconds)
            return seconds

        trial_span = span or (lambda name: contextlib.nullcontext())
        total = max(len(candidates), refine.max_trials if refine is not None else 0)
        while True:
            done = finished()
            todo = [c for c in candidates if c.id not in done]
            if progress is not None:
                progress(min(len(done), total), total, "measuring" if todo or refine is None else "measuring (learning sampler)")
            if not todo:
                if refine is None or refine.next_plan(study).assignment is None:
                    break
                with trial_span("trials"):
                    study.optimize(objective, n_trials=1, catch=(), gc_after_trial=False)
                continue
            held, waiting = _held(study)
            free = [c for c in todo if c.id not in held]
            if free:
                enqueue(study, free[:1])
            elif not waiting:
                # Every candidate left is being measured by another worker: wait for it to finish,
                # or to die and have its trial queued again (by the check at the top of the loop).
                time.sleep(poll_s)
                recover_interrupted_trials(study)
                continue
            with trial_span("trials"):
                study.optimize(objective, n_trials=1, catch=(), gc_after_trial=False)
        results: dict[str, Measurement | str] = {}
        self.refined = []
        for cid, trial in finished().items():
            if cid not in by_id and refine is not None and trial.params:  # another worker's proposal
                proposed = refine.assignment_named(trial.params)
                by_id[cid] = refine.candidate(proposed, trial.user_attrs.get("name", f"refined-{trial.number}"))
            if cid not in by_id:
                continue
            if cid not in initial:
                self.refined.append(by_id[cid])
            if trial.state is TrialState.PRUNED:
                results[cid] = trial.user_attrs.get("pruned", "pruned")
            else:
                a = trial.user_attrs
                seconds = float(a["fp32_ratio"]) * self.fp32_seconds if "fp32_ratio" in a else float(a["seconds"])
                # A trial's interval is on its own FP32 scale, like its ratio (a study of an older
                # autoprec has none).
                interval = tuple(float(r) * self.fp32_seconds for r in a["fp32_ratio_interval"]) if "fp32_ratio_interval" in a else None
                results[cid] = Measurement(int(a["bytes"]), seconds, self.baseline_loss + float(a["loss_increase"]), float(a["loss_increase"]),
                                           cast("tuple[float, float] | None", interval))
        return results


# A learning-sampler trial's user attribute (`search.refine`): its corrected prediction, and under
# "assignment" its plan's unit formats.
REFINED_ATTR = "refined"
REFINED_ASSIGNMENT = "assignment"
_LIVE = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)


def _owner(study: optuna.Study, cid: "str | None", number: int) -> "optuna.trial.FrozenTrial | None":
    """Another trial that holds candidate ``cid`` before trial ``number``: a finished one, or a
    queued or running one numbered lower (the tie-break that lets exactly one of two racing
    trials of a candidate run). Skipped trials hold nothing. One storage read."""
    rivals = [
        t for t in study.get_trials(deepcopy=False, states=_LIVE)
        if t.number != number and t.user_attrs.get("candidate") == cid and "skipped" not in t.user_attrs
        and (t.state in (TrialState.COMPLETE, TrialState.PRUNED) or t.number < number)
    ]
    return min(rivals, key=lambda t: t.number, default=None)


def _held(study: optuna.Study) -> tuple[set, bool]:
    """The candidate ids that a queued or running trial holds, and whether any trial is queued
    (one storage read)."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
    return {t.user_attrs.get("candidate") for t in trials}, any(t.state is TrialState.WAITING for t in trials)


def enqueue(study: optuna.Study, candidates: Sequence[Candidate]) -> None:
    """Queue one trial per candidate (one storage write each), in the order given."""
    for c in candidates:
        study.enqueue_trial({}, user_attrs={"candidate": c.id, "name": c.name})


def meets_budgets(m: "Measurement | str", memory_bytes: float, loss_budget: float) -> bool:
    """``m`` is a measurement (not a pruning reason) within both budgets as measured."""
    return isinstance(m, Measurement) and m.bytes <= memory_bytes and m.loss_increase is not None and m.loss_increase <= loss_budget


def meeting_by_speed(pairs: Sequence[tuple[Candidate, "Measurement | str"]], memory_bytes: float,
                     loss_budget: float) -> "list[tuple[Candidate, Measurement]]":
    """The timed candidates that met both budgets as measured (references included), fastest first."""
    met = [(c, m) for c, m in pairs if isinstance(m, Measurement) and m.seconds is not None and meets_budgets(m, memory_bytes, loss_budget)]
    return sorted(met, key=lambda p: cast(float, p[1].seconds))


def fastest_meeting(pairs: Sequence[tuple[Candidate, "Measurement | str"]], memory_bytes: float, loss_budget: float) -> "tuple[Candidate, Measurement] | None":
    """The candidate with the fastest measured step among those that met both budgets as
    measured (references included), or None."""
    met = meeting_by_speed(pairs, memory_bytes, loss_budget)
    return met[0] if met else None


def fastest_predicted_meeting(pairs: Sequence[tuple[Candidate, "Measurement | str"]], memory_bytes: float,
                              loss_budget: float) -> "tuple[Candidate, Measurement] | None":
    """The candidate with the fastest *predicted* step among those that met both budgets as
    measured, or None: for plans priced for a device the machine is not (`Planning.target`),
    whose measured step times are this machine's."""
    met = [(c, m) for c, m in pairs if isinstance(m, Measurement) and meets_budgets(m, memory_bytes, loss_budget)]
    return min(met, key=lambda p: p[0].plan.predicted["seconds"]) if met else None


def compared_on_target(chosen: Candidate, measured_seconds: float, pairs: Sequence[tuple[Candidate, "Measurement | str"]], memory_bytes: float,
                       loss_budget: float, target: str) -> list[str]:
    """The job's summary of a plan ``chosen`` by `fastest_predicted_meeting` for the device
    named ``target``: its predicted step there, and against the fastest other budget-meeting
    reference predicted there (``measured_seconds``: its step on this machine)."""
    seconds = chosen.plan.predicted["seconds"]
    lines = [f"returned {chosen.name}: {seconds * 1e3:.3g} ms predicted on {target}, the fastest predicted there of the candidates "
             f"that met the budgets as measured here ({measured_seconds * 1e3:.1f} ms a step on this machine)"]
    refs = [c for c, m in pairs if c.is_reference and c is not chosen and meets_budgets(m, memory_bytes, loss_budget)]
    if refs:
        ref = min(refs, key=lambda c: c.plan.predicted["seconds"])
        other = "other " if chosen.is_reference else ""
        lines.append(f"  = {seconds / ref.plan.predicted['seconds']:.2f}x the fastest {other}budget-meeting reference predicted there "
                     f"({ref.name}, {ref.plan.predicted['seconds'] * 1e3:.3g} ms)")
    return lines


def _plan_context(plan: "Plan | None") -> Callable[[nn.Module], Any]:
    if plan is None:
        return lambda m: contextlib.nullcontext()
    return lambda m: apply_plan(m, plan, validate=False)

