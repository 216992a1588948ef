"""`DynamicPrecisionScheduler`: precision managed for a training loop, in three lines.

    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=500)
    for x, y in loader:
        with scheduler.precision_context():
            loss = loss_fn(model(x), y)
        scheduler.backward(loss)          # scaled backward
        scheduler.step(optimizer)         # unscale, attribute, clip, step or skip, update
        optimizer.zero_grad()

Binding (`binding`): the model is the outermost module with a matrix parameter called inside
the first `precision_context`, however it is called; without ``model=`` that first forward runs
at FP32, unprofiled. The phases (`lifecycle.WindowClock`): **profiling** the first window at a
safe precision (FP32, or BF16 when ``max_precision`` is 16); **searching** over the next training
steps (`scheduler.search_steps.SearchSteps` driving `search.in_run.TrainingSearch`); **planned**, where
each window's profile (`window_measures`) and the scaler's per-layer non-finite counts promote or
demote layers (`plan_keeper.PlanKeeper`: the plan in force, its runtime, `changes`, the
`LossScaler`, on only while some layer has FP16 gradients), and every ``sample_every``-th
planned step checks the plan at once (`plan_checks`: an input grossly past its scale's range, the
accuracy budget measured against the window's precision); or **safe** after a failed search
(retried, unless no plan meets the budgets). This class keeps the clock and composes those parts
(`step_checks` refuses bad steps). `state_dict` covers everything (`scheduler.state`: its
schema); under ``torch.distributed`` the ranks agree through `distributed`; on pipeline stages
the stages search one plan together, or run a given one (`pipeline_stage`).

A ``torch.compile``-d model is called as usual: the scheduler plans the module it compiles, and the
steps whose forward it hooks run eagerly through the wrapper (`stance.CompiledStance`); other
planned steps run the compiled code.

Costs per step: the runtime's, the scaler's fused non-finite check (one host sync per optimizer,
none for fused optimizers), and in the sampled steps of a window's monitored tail the watch's
(`profiling.watch`); a search's are in `search.in_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from ..calls import ModelCall, loss_of
from ..changes import PrecisionChange
from ..coverage import LayerInfo, layer_name, static_layers
from ..distributed import RankAgreement, grad_comm_methods
from ..errors import AutoprecError, InfeasibleBudgetError, RuntimeStateError, SettingsError
from ..monitoring import TrainingWriter
from ..plan import Plan
from ..runtime import pipelining
from ..runtime.fsdp_fp8 import Fp8AllGather
from ..scaling import LossScaler
from ..search.in_run import TrainingSearch
from . import lifecycle
from .binding import Binding, bindable_layers, check_layers, check_recompute, check_materialised, unbound_exit
from .config import SchedulerConfig, config_of
from .fp8_gathers import GatherSwitch
from .grad_comm import CommChoice, warn_without_effect
from .lifecycle import WindowClock
from .plan_checks import CheckFigures, PlanChecks
from .pipeline_stage import StagePlan
from .plan_keeper import PlanKeeper, StepOutcome
from .search_steps import SearchSteps
from .stance import CompiledStance
from .state import LATER_STATE, STATE_VERSION, check_state, check_state_fits
from .step_checks import StepChecks
from .window_measures import WindowMeasures

__all__ = ["DynamicPrecisionScheduler"]

logger = logging.getLogger(__name__)


class DynamicPrecisionScheduler:
    """Profiles, searches, applies and keeps re-planning per-layer precision for a training loop.

    ``model``: optional (see the module docstring). The settings are a `SchedulerConfig`, given
    as ``config=`` or as its fields by keyword (``memory_budget=0.6, monitor_window=200, ...``;
    each is documented there). ``plan``: start from this plan (with ``dynamic=False``: run it
    fixed; `from_plan` loads one from a file).

    Args:
        model: the model to train; None binds to the model called in the first
            `precision_context`.
        config: every setting at once (None: a `SchedulerConfig` of ``settings``).
        plan: a plan to start from instead of profiling and searching.
        **settings: fields of `SchedulerConfig` by keyword (``memory_budget=0.6``, ...).

    Raises:
        SettingsError: a setting that is not a `SchedulerConfig` field or out of its range,
            ``config`` and keywords both given, or ``dynamic=False`` without ``plan``.
    """

    # Every value `phase` takes, in lifecycle order: the one list that loggers number the phase
    # by (`integrations.scheduler_metrics`), so a phase added to the clock reaches them too.
    PHASES: tuple[str, ...] = ("unbound",) + lifecycle.PHASES

    def __init__(self, model: Optional[nn.Module] = None, *, config: "SchedulerConfig | None" = None, plan: "Plan | None" = None, **settings: Any):
        self.config = config = config_of(config, settings)
        if not config.dynamic and plan is None:
            raise SettingsError("DynamicPrecisionScheduler(dynamic=False) needs plan=...; use DynamicPrecisionScheduler.from_plan(model, path)")
        # The model, its DDP wrapper (the plan is the inner module's), its first call.
        self._binding = Binding(model, check_output=config.dynamic and plan is None)
        if self._binding.model is not None:  # recompute= checked now against the module tree, not a window later
            check_recompute(self._binding.model, tuple(static_layers(self._binding.model)), config)
        self._dist: Optional[RankAgreement] = None  # set on bind inside a process group
        self._comm: Optional[CommChoice] = None  # set on bind when the plan chooses the gradient communication
        self._gathers: Optional[GatherSwitch] = None  # set on bind when the model holds an FSDP2 unit
        self.layers: tuple[str, ...] = ()
        self._fingerprint: Mapping[str, LayerInfo] = {}  # the bound model's layers, saved in state_dict
        self.step_count = 0
        # The phase and the window (`lifecycle`): changed only through its transitions.
        self._clock = WindowClock(config.monitor_window, config.profiled_steps, phase="profiling" if plan is None else "planned")
        self._plans = PlanKeeper(config, searched_plan=plan)  # the plan in force, its runtime, the scaler
        self._searches = SearchSteps(config)  # the search in progress, spread over the steps after a window
        self._checks = StepChecks()
        self.last_search_error: Optional[str] = None
        self._fixed_plan = plan
        self._measures = WindowMeasures(config)  # the profiler, the loss baseline, metered bytes, captured steps
        self._plan_checks = PlanChecks(config)  # a planned step's checks: saturation, the accuracy budget measured
        self._check_due = False  # this step is a check step (set as its forward starts)
        self._last_loss: Optional[torch.Tensor] = None
        self._optimizers: tuple = ()  # the last step()'s
        self._context_stack: Optional[contextlib.ExitStack] = None
        self._backward_due = False  # a forward with autograd ran since the last backward
        self._stage: Optional[StagePlan] = None  # the bound model runs as a torch.distributed.pipelining stage: its plan and first-step check
        self._writer: Optional[TrainingWriter] = None  # opened on bind with log_dir, on one rank
        self._stance = CompiledStance(self._binding, self._plans, self._searches, self._measures, self._plan_checks)

    @classmethod
    def from_plan(cls, model: nn.Module, plan: "Plan | str", *, dynamic: bool = False, **kwargs: Any) -> "DynamicPrecisionScheduler":
        """Run a fixed plan from an offline search (``dynamic=True``: start from it, and keep
        watching and promoting / demoting as usual).

        Args:
            model: the model the plan was made for.
            plan: the plan, or the path of a plan file (``runs/bytelm/plan.json``).
            dynamic: keep watching and re-planning from this plan instead of running it fixed.
            **kwargs: other `SchedulerConfig` fields by keyword.

        Returns:
            The scheduler, its plan in force from the first step.

        Raises:
            PlanError: the plan file is missing or not a plan.
            SettingsError: a keyword that is not a `SchedulerConfig` field or out of its range.
        """
        if not isinstance(plan, Plan):
            plan = Plan.load(plan)
        return cls(model, plan=plan, dynamic=dynamic, **kwargs)

    # -- public state ---------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """One of `PHASES`, in order: "unbound" (before the first forward), "profiling" (the first
        window), "searching" (the steps after it, while the search runs: `search.in_run`),
        "planned", or "safe" (the search failed, see `last_search_error`: training stays at the
        safe precision). Loggers number it by its index in `PHASES` (`integrations.scheduler_metrics`)."""
        if self._binding.example is None:
            return "unbound"
        return self._clock.phase

    @property
    def window_start(self) -> int:
        """The step the current window started at (`lifecycle.WindowClock`)."""
        return self._clock.window_start

    @property
    def model(self) -> Optional[nn.Module]:
        """The model trained (None until bound unless given as ``model=``; settable before binding)."""
        return self._binding.model

    @model.setter
    def model(self, model: Optional[nn.Module]) -> None:
        self._binding.use_model(model)

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force (None while the first window profiles and the search runs); on a
        pipeline stage the whole pipeline's, of which the stage runs ``plan.for_stage(stage_module)``."""
        return self._plans.plan

    @property
    def searched_plan(self) -> Optional[Plan]:
        """The first plan searched (or given), before any promotion or demotion."""
        return self._plans.searched_plan

    @property
    def changes(self) -> list[PrecisionChange]:
        """The promotions and demotions so far, oldest first."""
        return self._plans.changes

    @property
    def scaler(self) -> LossScaler:
        """The loss scaler (on only while some layer has FP16 gradients)."""
        return self._plans.scaler

    @property
    def last_check(self) -> "Optional[CheckFigures]":
        """The figures of the last planned check step (`plan_checks`): the saturation per layer
        and the measured loss increase (mean since the plan last changed) against the allowed
        one; None before the first."""
        return self._plan_checks.last

    @property
    def distributed(self) -> Optional[RankAgreement]:
        """The `RankAgreement` with the other ranks (None outside a process group or before bind)."""
        return self._dist

    @property
    def fp8_all_gather(self) -> Optional[Fp8AllGather]:
        """Which weights FSDP2 all-gathers in FP8, and the bytes sent (None without FSDP2 or before bind)."""
        return None if self._gathers is None else self._gathers.gathers

    def __repr__(self) -> str:
        counts = self.plan.format_counts() if self.plan is not None else {}
        return f"DynamicPrecisionScheduler(phase={self.phase!r}, step={self.step_count}, plan={counts}, scale={self.scaler.get_scale():g})"

    # -- the loop -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def precision_context(self):
        """Forward passes inside run the plan in force (or the safe precision while profiling).

        One without autograd (``torch.no_grad``, ``inference_mode``: an evaluation between
        steps) runs that precision and nothing more: no training step's profiling, metering,
        capture or search trial happens in it.

        Not re-entrant. The first one binds the scheduler to its model (see the module doc). Each
        one refuses, with a `RuntimeStateError` before it runs, a call of a model other than the
        scheduler's (`binding`); the first one, ending without any model called (nothing to bind
        to), refuses that on exit.

        Raises:
            RuntimeStateError: entered again while active, another model called inside, or the
                first one ending with no model called.
        """
        if self._context_stack is not None:
            raise RuntimeStateError("precision_context() is already active; it is not re-entrant")
        stack = contextlib.ExitStack()
        self._context_stack = stack
        try:
            self._stance.enter(stack, self.phase, self.plan, self._checks_due())
            if self._binding.example is not None:
                self._enter_step(stack)
            stack.enter_context(self._binding.watch(bind=self._bind, resume=self.load_state_dict, enter=lambda: self._enter_step(stack),
                                                    observe=self._measures.observe))  # a captured step's call, when bound at its end
            self._backward_due = torch.is_grad_enabled()
            yield self
            if self._binding.example is None:
                raise RuntimeStateError(unbound_exit(self.model))
            if self._stage is not None:  # the schedule ran each micro-batch's backward inside
                self._backward_due = False
        finally:
            self._context_stack = None
            stack.close()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale, for a loop that calls ``.backward()`` itself:
        ``scheduler.scale(loss).backward()``. Records the loss (the first window's mean anchors a
        relative accuracy budget). ``loss`` may be the model's output with a ``loss`` field
        (`calls.loss_of`). No host sync.

        Args:
            loss: the loss tensor, or a model output with a ``loss`` field.

        Returns:
            The scaled loss, to call ``.backward()`` on.

        Raises:
            RuntimeStateError: no forward ran inside `precision_context` yet.
        """
        return self.scaler.scale(self._note_loss(loss))

    def pipeline_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` (``(output, target) -> loss``) for a ``torch.distributed.pipelining``
        schedule (`pipeline_stage`): each micro-batch's loss recorded as `scale` records it, its
        gradient times the loss scale every stage unscales by, its value unchanged (the schedule's
        ``losses`` are the true losses). No sync: ``ScheduleGPipe(stage, n, loss_fn=scheduler.pipeline_loss(loss_fn))``."""
        def loss_in_schedule(output: Any, target: Any) -> torch.Tensor:
            if pipelining.in_metadata_inference(sys._getframe()):  # torch 2.13's backward inference: no training loss
                return loss_fn(output, target)
            loss = self._note_loss(loss_fn(output, target))
            if self._stage is not None:
                self._stage.note_loss()
            return self.scaler.scale_gradient(loss)

        return loss_in_schedule

    def _note_loss(self, loss: Any) -> torch.Tensor:
        """Record a loss about to be backpropagated (`scale`): the step's loss, its backward due no
        more, a probe's or a check step's hooks; returns the loss tensor."""
        if self._binding.example is None:
            raise RuntimeStateError("backward() or scale() before any forward ran inside precision_context()")
        loss = loss_of(loss)
        detached = loss.detach().float()
        self._last_loss = detached
        self._backward_due = False
        self._searches.before_backward(loss)  # a probe step: hook the autograd nodes of each layer
        self._plan_checks.note_loss(detached)  # a check step: the loss its captured prediction's gradient is of
        if self.phase == "profiling":
            self._measures.record_loss(detached)
        return loss

    @contextlib.contextmanager
    def reusing_weights(self):
        """The micro-batches of one optimizer step (gradient accumulation) reuse each FP8 / INT8
        weight's quantized copy instead of quantizing it per forward (`PlanRuntime.reusing_weights`:
        one amax, cast and transpose per weight saved per micro-batch after the first). You promise
        that nothing writes the weights inside; `step` inside it is refused. A pass-through while
        no 8-bit plan is in force.

        ``with scheduler.reusing_weights(): for micro in micro_batches: ...forward, backward``
        then ``scheduler.step(optimizer)`` after the block.
        """
        with self._plans.reusing_weights():
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` on the scaled loss (call once per micro-batch). No host sync.

        Args:
            loss: the loss tensor, or a model output with a ``loss`` field.
            **kwargs: passed to ``Tensor.backward`` (``retain_graph=True``, ...).

        Raises:
            RuntimeStateError: no forward ran inside `precision_context` yet.
        """
        self.scale(loss).backward(**kwargs)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Unscale, clip (``max_grad_norm``), step each optimizer unless its gradients are
        non-finite, update the scale, and advance the lifecycle. Returns whether every optimizer
        stepped. One host sync per optimizer (the scaler's); in a process group also one all-reduce
        of ``8 * (optimizers + 2 + 2 * layers)`` bytes and one host transfer (`autoprec.distributed`).

        Args:
            *optimizers: every optimizer of the model, in the same order each step.

        Returns:
            Whether every optimizer stepped (False: the step was skipped on non-finite gradients).

        Raises:
            RuntimeStateError: no optimizer given, called inside `reusing_weights`, before any
                forward, after a forward whose backward has not run; on a pipeline stage, a first
                step where no stage's loss went through `pipeline_loss`.
            DistributedError: at a pipeline stage's first step, stages that do not make one
                pipeline (`pipeline_stage`: other plans, layers, several stages on a rank).
        """
        self._checks.refuse_step(optimizers, self._binding.model, forward_ran=self._binding.example is not None, reusing=self._plans.reusing,
                                 backward_due=self._backward_due)
        if self._stage is not None:
            self._stage.check_first_step(self._dist, self.config, self.layers)
        self._optimizers = optimizers  # a search starting this step reads their Adam state
        if self._gathers is not None:
            self._gathers.before_step()  # FSDP2: a plan installed mid-step gathers in FP8 from now
        self._measures.step()  # the profiler's, the watch's and the meter's share of the step
        if self._check_due:  # the reference forward, on the weights the planned forward ran with
            self._plan_checks.measure(self._plans.safe_format, self.scaler.scale_tensor if self.scaler.enabled else None)
        outcome = self._plans.step(optimizers, loss=self._last_loss, agreement=self._dist, max_grad_norm=self.config.max_grad_norm, step=self.step_count)
        self.step_count += 1
        self._report(outcome)
        self._replan(outcome)
        self._choose_comm(outcome.skipped)
        return not outcome.skipped

    def _report(self, outcome: StepOutcome) -> None:
        """Warn of steps skipped in a row; the step's loss, scale and skip to TensorBoard."""
        shown = [layer_name(f, self._binding.bound) for f in outcome.nonfinite]  # a one-layer model's root by its class
        self._checks.count_skips(outcome.skipped, shown, self.step_count, self.plan, self.scaler, self.config.loss_scaling.min_scale)
        if self._writer is not None:
            self._writer.log_step(self.step_count, loss=self._last_loss, loss_scale=self.scaler.scale_tensor, skipped=outcome.skipped)

    def _replan(self, outcome: StepOutcome) -> None:
        """Act on what the step found: promote layers with non-finite gradients, act on a check
        step's figures, end the search when its work is done, and advance the window clock."""
        if self.config.dynamic and self.plan is not None:  # on a pipeline stage the flags, so the counts, are every stage's
            self._plans.on_nonfinite(outcome.nonfinite, outcome.first_bad_output, self.step_count)
        if self._check_due and self.plan is not None:  # a check step's figures, acted on at once
            self._plans.act_on_checks(*self._plan_checks.actions(self._plans.runtime, self.plan, self._dist, self.step_count, self._writer), self.step_count)
        self._check_due = False
        if self._searches.end_step(outcome.skipped, safe=self.plan is None, agreement=self._dist, first_bad_output=outcome.first_bad_output,
                                   nonfinite=outcome.nonfinite):
            self._finish_search()
        self._advance()

    def _choose_comm(self, skipped: bool) -> None:
        """``grad_comm="auto"``: choose each layer's gradient communication when due (`CommChoice`)."""
        if self._comm is not None and not skipped and self.plan is not None and self._comm.due(self.plan, self.step_count):
            self._plans.set_comm(self._comm.choose(self.plan, self._binding.bound, self._optimizers, self._last_loss), self.step_count)

    # -- binding --------------------------------------------------------------------------------

    def _attach(self, model: nn.Module, example: ModelCall) -> None:
        """Take ``model`` and its example call: find the layers, join the other ranks, open the
        TensorBoard writer, give the plan keeper the model."""
        self._binding.attach(model, example)
        self._fingerprint = bindable_layers(model, example)
        self.layers = tuple(self._fingerprint)
        check_layers(model, self.layers, self.config)
        agreed = self._stage.agreed_layers(self.layers) if self._stage is not None else self.layers  # every stage's flags, one vector
        self._dist = dist = RankAgreement.join(self.config, model, agreed, self._binding.ddp, loss_scale=lambda: self._plans.scaler.scale_tensor)
        if dist is not None and self._stage is None:  # a stage's peers are in the schedule's recv: no collective here
            dist.check_bind(self.config, self._fixed_plan)
            dist.set_grad_comm(*grad_comm_methods(self.config, None))
        self._gathers = GatherSwitch.join(model)
        warn_without_effect(self.config, dist)
        self._comm = CommChoice.join(self.config, dist, next(model.parameters()).device)
        if self._writer is None and (dist is None or dist.rank == 0):  # one rank writes
            self._writer = None if self.config.log_dir is None else TrainingWriter(self.config.log_dir, flush_every=min(100, self.config.monitor_window))
        self._measures.bind(model, example, self.layers)
        self._plan_checks.bind(model, stage=self._stage is not None)
        self._plans.bind(model, self.layers, writer=self._writer, on_plan=None if dist is None and self._gathers is None else self._on_plan, stage=self._stage is not None)

    def _on_plan(self, plan: Plan) -> None:
        """Each plan put in force, under torch.distributed: how DDP sends the gradients, which
        weights FSDP2 all-gathers in FP8."""
        if self._dist is not None:
            self._dist.set_grad_comm(*grad_comm_methods(self.config, plan))
        if self._gathers is not None:
            self._gathers.on_plan(plan, mid_step=self._context_stack is not None or self._backward_due)

    def _bind(self, model: nn.Module, example: ModelCall, at_end: bool) -> None:
        """Bind afresh to ``model`` by its call ``example`` (``at_end``: that call ran unplanned)."""
        check_materialised(model)
        frame = sys._getframe()  # called by a pipeline schedule: a stage (`pipeline_stage`)
        self._stage = StagePlan.renew(self._stage, self._fixed_plan, model if pipelining.in_stage(frame) else None, pipelining.stage_index(frame))
        plan = self._fixed_plan if self._stage is None else self._stage.part
        if plan is not None:
            plan.validate(model, example)  # a plan for another model: PlanError naming each layer
        self._attach(model, example)
        if self._fixed_plan is not None:  # on a pipeline stage the whole plan, of which the runtime runs the stage's part
            self._plans.install(self._fixed_plan, "the given plan", self.step_count)
        else:  # the profiling window (a scheduler without a plan is dynamic): its precision, the plan None
            self._plans.install_safe(self.step_count)
            self._measures.start_profiler(self.config.monitor_window)
        self._maybe_start_monitor()
        logger.info("autoprec: bound to %s with %d layers", type(model).__name__, len(self.layers))
        if at_end:
            logger.info("autoprec: bound to %s at the end of its first call (a model's keyword inputs are seen only then): "
                        "that forward ran at FP32 and unprofiled; the scheduler's precision applies from the next forward on", type(model).__name__)

    def _enter_step(self, stack: contextlib.ExitStack) -> None:
        self._binding.check_first_output(stack)  # once: the first forward under the scheduler holds a prediction
        if not torch.is_grad_enabled():
            # An evaluation forward between steps (a validation loop): the precision in force, and
            # nothing of a training step's. Metered, it gave the window's saved bytes as 0, and
            # every candidate of the search that followed failed its memory check.
            self._plans.enter_runtime(stack)
            return
        if not self._searches.enter_step(stack, self._binding.bound, self.layers):  # a probe or trial step runs its own runtime
            self._plans.enter_runtime(stack)
        self._check_due = self._checks_due()
        if self._check_due:
            self._plan_checks.enter_step(stack, accuracy=self.plan is not None and self._plan_checks.wants_accuracy(self.plan))
        self._measures.enter_step(stack, capture=self.config.dynamic and self._clock.captures(self.step_count),
                                  sample=self._clock.samples(self.step_count, self.config.sample_every))

    # -- planned checks -------------------------------------------------------------------------

    def _checks_due(self) -> bool:
        """Whether this step checks the plan in force (`plan_checks`): a dynamic scheduler's
        planned step, every ``sample_every``-th of the window."""
        return self.phase == "planned" and self.plan is not None and self._plan_checks.due(self.step_count, self.window_start)

    # -- windows --------------------------------------------------------------------------------

    def _advance(self) -> None:
        if not self.config.dynamic:
            return
        due = self._searches.take_due()
        if due is not None:
            self._start_search(*due)
            return
        self._clock, tick = self._clock.after_step(self.step_count)
        if tick.retry:
            self._retry()
            return
        if tick.meter_next:
            self._measures.meter_next_step()  # measure the saved bytes of the window's last step but one
        if not tick.window_end:
            self._maybe_start_monitor()
            return
        if self.plan is None:
            self._searches.hold_heap()  # from the window's summary on (`SearchSteps.hold_heap`)
        # Every rank's statistics before rank 0 decides: every rank's profile is the same.
        profile = self._measures.end_window(self._dist if self._stage is None else None, with_loss=self.plan is None, writer=self._writer, step=self.step_count)
        profile = self._stage.joined_report(self._dist, profile) if self._stage is not None and self.plan is not None else profile  # each watched its own layers
        if self.plan is None:
            baseline = self._measures.baseline_loss(self.step_count)
            if self._stage is not None:  # each stage measures its own layers, its profile its own (`search.stages`)
                self._search_stages(self._stage, profile, baseline)
                return
            if self.config.search_slice is None:  # the whole search at once, here
                self._start_search(profile, baseline)
                return
            # Summing up the window and making the search are each linear in the layers (at 64
            # decoder layers of a narrow Llama, each took about a step): the search is made at
            # the next step, its first slice of off-path work runs after the one after.
            self._searches.defer(profile, baseline)
            self._clock = self._clock.searching()
            return
        self._plans.recalibrate_int8()  # on every rank, before the review
        checked = self._plan_checks.last
        if checked is not None and checked.increase is not None and checked.allowed is not None:
            logger.info("autoprec: step %d: the plan's measured loss increase is %.2f%% (mean of %d checks against the window's precision), allowed %.2f%%",
                        self.step_count, 100 * checked.increase, checked.checks, 100 * checked.allowed)
        self._decide_on_every_rank(lambda: self._plans.review_window(profile, self.step_count, self._measures.measured_bytes))
        self._next_window()

    def _next_window(self) -> None:
        self._clock = self._clock.next_window(self.step_count)
        self._plans.new_window()
        self._plan_checks.new_window()
        self._maybe_start_monitor()

    def _retry(self) -> None:
        """A failed search (other than budgets no plan meets) is retried: one NaN batch at the end
        of the first window must not pin the safe precision for the rest of training. The clock
        waited (`WindowClock.failed`); this profiles one fresh window, whose end searches again."""
        logger.info("autoprec: step %d: profiling again after a failed search (%d in a row): %s", self.step_count, self._clock.failures, self.last_search_error)
        self.last_search_error = None
        self._plans.new_window(retry=True)
        self._measures.restart(self.config.monitor_window)

    def _maybe_start_monitor(self) -> None:
        """Watch the last ``monitor_steps`` steps of each planned window."""
        if self.config.dynamic and self.plan is not None and not self._measures.profiling and self._clock.monitors(self.step_count):
            self._measures.start_watch(self.plan, self.config.profiled_steps)

    # -- the search -----------------------------------------------------------------------------

    def _start_search(self, profile, baseline_loss: Optional[float], restore: Optional[Mapping[str, Any]] = None) -> None:
        """The first window's search on its ``profile`` and ``baseline_loss`` (see the module doc;
        ``restore``: a checkpoint's, continued, which holds both), spread over the next training
        steps (`scheduler.search_steps`); rank 0 does its off-path work."""
        measured, lead = self._measures.measured_bytes, self._dist is None or self._dist.rank == 0
        self._searches.start(self._binding.bound, self._binding.example, self._measures.captured(), profile,
                             baseline_loss, fingerprint=self._fingerprint,
                             step=self.step_count, lead=lead, optimizers=self._optimizers, restore=restore,
                             safe_bytes=None if measured is None else (self._plans.safe_format, measured), compiled=self._binding.compiled,
                             alone=self._dist is None)
        self._clock = self._clock.searching()
        # This step made the search: its first slice of off-path work runs after the next step,
        # unless it all runs at once (search_slice=None: here).
        if restore is None and self.config.search_slice is None and self._searches.advance(self._dist):
            self._finish_search()

    def _search_stages(self, stage: StagePlan, profile, baseline_loss: Optional[float]) -> None:
        """The first window's end on a pipeline stage: the stages' joint plan (`StagePlan.search_window`), or a failed search."""
        try:
            whole = stage.search_window(self._dist, self._binding.bound, self._measures.captured(), profile, baseline_loss, self.config, self._fingerprint, self.step_count)
            self._put_in_force(whole, f"searched on the pipeline's stages after {self.step_count} steps")
        except AutoprecError as exc:
            self._search_failed(exc)
        self._measures.clear_captured()
        self._next_window()

    def _finish_search(self) -> None:
        """Adopt the search's result (on rank 0; the others adopt rank 0's decision), or keep the
        safe precision on failure; log its timeline."""
        search = self._searches.take()
        try:
            self._decide_on_every_rank(lambda: self._adopt_search(search), search)
        finally:
            search.close()
            self._measures.clear_captured()
        self._searches.report(search, self.step_count, self._writer)
        self._next_window()

    def _adopt_search(self, search: TrainingSearch) -> None:
        """Its plan in force; or on failure the safe precision, retried later unless no plan meets
        the budgets (module doc)."""
        if search.error is None and search.result is not None:
            self._put_in_force(search.result, f"searched after {search.started} steps, tried on {search.steps} training steps", runtime=search.take_runtime())
        else:
            self._search_failed(search.error)

    def _put_in_force(self, plan: Plan, why: str, **install: Any) -> None:
        """A searched ``plan`` in force from the next step (`PlanKeeper.install`'s ``install`` arguments)."""
        self._clock = self._clock.planned(self.step_count)
        self._plans.install(plan, why, self.step_count, log_memory=True, **install)

    def _search_failed(self, exc: Optional[BaseException]) -> None:
        """Training stays at the safe precision; searched again later unless no plan meets the budgets."""
        self.last_search_error = str(exc)
        final = isinstance(exc, InfeasibleBudgetError)  # the budgets do not change with the data
        self._clock = clock = self._clock.failed(self.step_count, final=final)
        again = "" if final else f" and searches again after {2 ** (clock.failures - 1)} window(s) (step {clock.retry_at})"
        logger.warning("autoprec: step %d: search failed, training stays at the safe precision%s: %s", self.step_count, again, exc)

    def _decide_on_every_rank(self, decide: Callable[[], None], search: "Optional[TrainingSearch]" = None) -> None:
        """``decide()`` here; under torch.distributed on rank 0, the others adopting its outcome
        (the plan keeper's `decision`, the search error and the clock; after a ``search``, which
        of its trials won, so each rank installs its own runtime of that trial, as rank 0 does)."""
        if self._dist is None:
            decide()
            return

        def decided() -> dict:
            decide()
            return {**self._plans.decision(), "last_search_error": self.last_search_error, "clock": dataclasses.asdict(self._clock),
                    "trial": search.winner_index if search is not None else None}

        self._dist.decide(decided, lambda decision: self._adopt(decision, search), lambda: self.plan)

    def _adopt(self, decision: Mapping[str, Any], search: "Optional[TrainingSearch]" = None) -> None:
        """Take rank 0's decision as this rank's own."""
        self.last_search_error = decision["last_search_error"]
        self._clock = WindowClock(**decision["clock"])  # every rank retries, and starts windows, at one step
        self._measures.clear_captured()  # rank 0's search consumed its own; these are spent too
        trial = decision.get("trial")
        runtime = search.take_runtime(trial) if search is not None and trial is not None else None
        self._plans.adopt(decision, self.step_count, runtime)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (tensors are cloned, on device;
        while a search runs its off-path work, also its snapshot of the weights, not cloned:
        see `TrainingSearch.state_dict`)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": {fqn: info.to_dict() for fqn, info in self._fingerprint.items()},
            "step": self.step_count,
            "window_start": self._clock.window_start,
            "example": None if self._binding.example is None else self._binding.example.to_state(),
            **self._plans.state_dict(),  # the plans, changes, policy, window counts, scaler, runtime
            "last_search_error": self.last_search_error,
            "search_failures": self._clock.failures,
            "retry_at": self._clock.retry_at,
            **self._measures.state_dict(),  # the loss baseline, captured steps, metering, profiler
            **self._searches.state_dict(),  # the search in progress, the known times
            "checks": self._plan_checks.state_dict(),
            "comm": self._dist.comm_state_dict() if self._dist is not None else None,  # error feedback, under DDP
            "pipeline_stage": self._stage is not None,  # resumed outside the schedule, where no forward says so
            "stage": None if self._stage is None else {"index": self._stage.index, "plan": None if self._fixed_plan is not None or self._stage.whole is None else self._stage.whole.to_dict()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a scheduler made with the same settings for the same model.
        Before the scheduler is bound to a model (no ``model=``, no forward yet) the state is kept
        and applied when the first forward binds it, so the run continues exactly the same.

        Args:
            state: what `state_dict` returned (from ``torch.load`` with any ``map_location``).

        Raises:
            RuntimeStateError: one line, before anything changes: a state of another version,
                one missing keys, one saved for a model whose layers have other names or shapes,
                or one whose plan runs a format this scheduler's settings exclude. Unbound, the
                checks against the model run at the first forward, which raises it then.
        """
        check_state(state, set(self.state_dict()))
        if self.model is None:
            self._binding.hold(state)
            return
        check_state_fits(state, self._binding.bound, self.config, self._fixed_plan)
        stage = state.get("stage") or {}
        whole = self._fixed_plan or (Plan.from_dict(stage["plan"]) if stage.get("plan") else None)  # a plan searched on the stages
        self._stage = StagePlan.renew(self._stage, whole, self._binding.bound if state.get("pipeline_stage") else None, stage.get("index"))
        if self._binding.example is None:
            self._attach(self._binding.bound, ModelCall.from_state(state["example"]))  # plan, scaler and profiler come from the state below
        self._plans.run_as_stage(self._stage is not None)
        self.step_count = state["step"]
        self.last_search_error = state["last_search_error"]
        later = {k: state.get(k, d) for k, d in LATER_STATE.items()}  # fields a state saved before them lacks
        failures, retry_at, search, known = later["search_failures"], later["retry_at"], later["search"], later["known_times"]
        checks, comm, due = later["checks"], later["comm"], later["due_search"]
        if self._dist is not None:
            self._dist.load_comm_state_dict(comm, next(self._binding.bound.parameters()).device)
        self._searches.load_known_times(known)
        self._plans.load_state_dict(state, self.step_count)
        self._measures.load_state_dict(state, self.plan)  # after the plan's runtime, as at bind
        self._plan_checks.load_state_dict(checks, self.plan)
        self._searches.close()
        searching = search is not None or due is not None
        phase = "planned" if self.plan is not None else "searching" if searching else "safe" if self.last_search_error is not None else "profiling"
        self._clock = WindowClock(self.config.monitor_window, self.config.profiled_steps, phase, state["window_start"], failures, retry_at)
        if search is not None:
            self._start_search(None, None, restore=search)
        elif due is not None:
            self._searches.hold_heap()
            self._searches.load_due(due)

    def close(self) -> None:
        """Remove hooks and the plan's layer wrappers, and flush the TensorBoard writer."""
        self._searches.close()
        self._plans.close()
        self._measures.close()
        self._stage = StagePlan.renew(self._stage, None, None)  # no longer a stage this process runs
        if self._gathers is not None:
            self._gathers.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
