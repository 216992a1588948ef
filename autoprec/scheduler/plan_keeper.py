"""The plan in force for a scheduler's model: `PlanKeeper`.

It owns the plan (and the first searched one), the `PlanRuntime` that runs it (on a
``torch.distributed.pipelining`` stage the plan is the whole pipeline's, the same on every rank,
and the runtime runs the stage's part of it: `running`), the record of
promotions and demotions (`changes`) with the policy's memory between windows, this window's
per-layer non-finite counts and skipped steps, and the `LossScaler`, which is on only while some
layer has FP16 gradients (each install switches it) and checks each layer's output only after a
loss went non-finite (disarmed after a window without one: clean training does not pay it). It
changes them only through its verbs: `install` a plan, `step` the optimizers, `on_nonfinite`
after a step, `review_window` at a window's end (`policy`'s pure rules), `adopt` another rank's
`decision`, and `state_dict` / `load_state_dict`.

Costs: a step's are the scaler's (one host sync per optimizer) and, under ``torch.distributed``,
`RankAgreement.agree_on_step`'s; an install swaps the layer wrappers (keeping the amax histories
and calibration of unchanged layers) and replaces the scaler when its enablement changes;
`on_nonfinite` and `review_window` are Python over the layers, no device work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from ..changes import PrecisionChange
from ..coverage import layer_name
from ..device import format_support
from ..errors import RuntimeStateError
from ..formats import Format
from ..plan import LayerPrecision, Plan
from ..runtime import apply_plan
from ..scaling import LossScaler
from .binding import require_bound
from .policy import PolicyState, backward_triggers, demotions, promotions, window_triggers
from .promotion_bytes import paid_for, repredicted

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from ..monitoring import TrainingWriter
    from ..runtime import PlanRuntime
    from .config import SchedulerConfig

__all__ = ["PlanKeeper", "StepOutcome", "needs_loss_scaling", "window_format_for"]

logger = logging.getLogger(__name__)


def needs_loss_scaling(plan: "Plan | None") -> bool:
    """Whether ``plan`` needs a loss scale: some layer has FP16 gradients."""
    # Only FP16 gradients underflow without a scale. FP8 gradients are quantized with their own
    # per-tensor current scale (amax -> scale), which divides a power-of-two loss scale out exactly:
    # examples/measure_loss_scaling.py trains identically with the dynamic scale and with 1.
    # BF16 has FP32's range; INT8 layers run their backward in FP32.
    return plan is not None and any(lp.grad_format is Format.FP16 for lp in plan.layers.values())


def window_format_for(config: "SchedulerConfig", *, native_bf16: bool) -> Format:
    """The precision a profiling window (and training after a failed search) runs in: the
    configured ``window_format``; else BF16 where FP32 is out of bounds, or where the device
    computes BF16 natively (``native_bf16``: CUDA, compute capability 8.0 or newer) and BF16 is
    a candidate; else FP32. No statistic the window gathers needs FP32 (docs/scheduler.md says why), and
    on such a device an FP32 step costs several BF16 ones."""
    if isinstance(config.window_format, Format):
        return config.window_format
    if config.max_precision < 32 or (native_bf16 and Format.BF16 in config.candidates):
        return Format.BF16
    return Format.FP32


class StepOutcome(NamedTuple):
    """One optimizer step: ``skipped`` (non-finite gradients), the layers with non-finite
    gradients, the first layer whose output went non-finite (when the loss did), whether the loss
    was non-finite; under torch.distributed, every rank's, agreed."""

    skipped: bool
    nonfinite: Sequence[str]
    first_bad_output: Optional[str]
    loss_nonfinite: bool


class PlanKeeper:
    """The plan in force, its runtime, its changes and the loss scaler (module docstring).

    ``searched_plan``: a plan given to the scheduler (kept as the searched one). Until `bind`
    names the model, its layers, the TensorBoard ``writer`` and ``on_plan`` (called with each
    plan installed: the ranks' gradient communication format), only the scaler is of use.
    """

    def __init__(self, config: "SchedulerConfig", searched_plan: Optional[Plan] = None):
        self.config = config
        self.plan: Optional[Plan] = None
        self.searched_plan = searched_plan
        self.changes: list[PrecisionChange] = []
        self.scaler = self._new_scaler(enabled=False)
        self._runtime: "Optional[PlanRuntime]" = None
        self._policy = PolicyState()
        self._window_nonfinite: dict[str, int] = {}
        self._reusing = False  # inside reusing_weights(): the weights must not change
        self._window_skipped = 0  # optimizer steps skipped in this window: such a window is never quiet
        self._nonfinite_losses = 0  # this window's: the output checks stay armed while there are some
        self._model: Optional[nn.Module] = None
        self._layers: list[str] = []
        self._stage: Optional[nn.Module] = None  # the model runs as a pipeline stage: the runtime runs its part of the plan
        self.running: Optional[Plan] = None  # what the runtime runs: the plan, or a stage's part of it
        self._writer: "Optional[TrainingWriter]" = None
        self._on_plan: Optional[Callable[[Plan], None]] = None

    def bind(self, model: nn.Module, layers: Sequence[str], *, writer: "Optional[TrainingWriter]" = None,
             on_plan: Optional[Callable[[Plan], None]] = None, stage: bool = False) -> None:
        """The model the plans run on, its layers; the scaler watches them from now on.
        ``on_plan`` is called with each plan the runtime runs. ``stage``: `run_as_stage`."""
        self._model, self._layers, self._writer, self._on_plan = model, list(layers), writer, on_plan
        self.run_as_stage(stage)
        self.scaler.watch(model, list(self._layers))

    def run_as_stage(self, stage: bool) -> None:
        """Whether the bound model is a pipeline stage: its plans are then the whole pipeline's,
        of which the runtime runs the part the stage holds (`Plan.for_stage`)."""
        self._stage = self._bound() if stage else None

    @property
    def runtime(self) -> "Optional[PlanRuntime]":
        """The runtime of the plan in force (None while none is, or when it is all FP32 and
        recomputes no block)."""
        return self._runtime

    @property
    def safe_format(self) -> Format:
        """The precision of the profiling window and of a failed search (`window_format_for`)."""
        device = next(self._model.parameters()).device if self._model is not None else None
        native = device is not None and device.type == "cuda" and format_support(Format.BF16, device).runnable
        return window_format_for(self.config, native_bf16=native)

    def _bound(self) -> nn.Module:
        return require_bound(self._model)

    def _planned(self) -> Plan:
        if self.plan is None:
            raise RuntimeStateError("no plan is in force")
        return self.plan

    # -- installing plans -------------------------------------------------------------------------

    def install(self, plan: Plan, why: str, step: int, *, searched: bool = True, runtime: "Optional[PlanRuntime]" = None, log_memory: bool = False) -> None:
        """Put ``plan`` in force at ``step``: a new runtime (or ``runtime``, one already installed
        for it: a trial's) keeping the amax histories and calibration of layers whose precision did
        not change; the scaler switched on or off as the plan needs (on a pipeline stage ``plan``
        is the whole pipeline's: every stage scales alike). ``searched``: the first such plan is
        kept as `searched_plan`. ``log_memory``: its predicted and measured bytes to the writer."""
        running = plan.for_stage(self._stage) if self._stage is not None else plan
        old = self._runtime
        if old is not None:
            old.remove()  # its layer wrappers off the model before the new plan's go on
        if runtime is None:
            runtime = apply_plan(self._bound(), running, validate=False)
            if old is not None:
                kept = {fqn: s for fqn, s in old.state_dict()["layers"].items() if fqn in running.layers and old.plan.layers.get(fqn) == running.layers[fqn]}
                runtime.load_state_dict({"layers": kept})
        # An all-FP32 plan recomputing no block, on FP32 weights, runs the model as it is; one
        # recomputing blocks needs its runtime (their checkpointed forwards), FP32 layers or not,
        # as do FP32 layers on half-stored weights (`PlanRuntime.low_precision`).
        self._runtime = runtime if running.recompute or runtime.low_precision else None
        if self._runtime is None:
            runtime.remove()
        self.plan, self.running = plan, running
        if searched and self.searched_plan is None:
            self.searched_plan = plan
        if self._on_plan is not None:
            self._on_plan(running)
        if needs_loss_scaling(plan) != self.scaler.enabled:
            self._replace_scaler(needs_loss_scaling(plan), self.scaler.state_dict())
        if self._writer is not None:
            self._writer.log_plan(step, plan, name="plan")
        logger.info("autoprec: step %d: plan %s (%s)", step, plan.format_counts(), why)
        if log_memory and self._writer is not None:
            self._writer.log_memory(step, predicted_bytes=plan.predicted.get("bytes"), measured_bytes=plan.measured.get("saved_bytes"))

    def set_comm(self, plan: Plan, step: int) -> None:
        """Put ``plan`` in force where it differs from the plan in force only in ``comm`` (how
        its gradients travel): the runtime stays as it is, the ranks' communication follows."""
        if self.plan is None or plan.with_comm({}) != self.plan.with_comm({}).replace(metadata=plan.metadata):
            raise RuntimeStateError("set_comm takes the plan in force with another gradient communication; install() any other")
        self.plan, self.running = plan, plan.for_stage(self._stage) if self._stage is not None else plan
        if self._on_plan is not None:
            self._on_plan(self.running)
        if self._writer is not None:
            self._writer.log_plan(step, plan, name="plan")
        logger.info("autoprec: step %d: plan %s (its gradient communication chosen)", step, plan)

    def install_safe(self, step: int) -> None:
        """The profiling window's precision: its runtime on the model, while `plan` stays None
        (no plan has been searched). A pass-through when the safe format is FP32."""
        safe = Plan({fqn: LayerPrecision(self.safe_format, reason="safe precision while profiling") for fqn in self._layers})
        if self.safe_format is not Format.FP32:
            self.install(safe, "profiling", step, searched=False)
            self.plan = self.running = None
        elif self._on_plan is not None:  # the ranks communicate as for FP32 layers
            self._on_plan(safe)

    def enter_runtime(self, stack: contextlib.ExitStack) -> None:
        """Run the plan in force in ``stack``'s context (nothing to enter without a runtime)."""
        if self._runtime is not None:
            stack.enter_context(self._runtime)

    def drop_runtime(self) -> None:
        """Take the runtime's layer wrappers off the model."""
        if self._runtime is not None:
            self._runtime.remove()
            self._runtime = None

    @contextlib.contextmanager
    def reusing_weights(self):
        """`PlanRuntime.reusing_weights` of the runtime in force (a pass-through without one);
        `reusing` inside."""
        runtime = self._runtime
        self._reusing = True
        try:
            with runtime.reusing_weights() if runtime is not None else contextlib.nullcontext():
                yield
        finally:
            self._reusing = False

    @property
    def reusing(self) -> bool:
        """Inside `reusing_weights`: nothing may write the weights (no optimizer step)."""
        return self._reusing

    def recalibrate_int8(self) -> None:
        """Re-calibrate the INT8 layers' scales (at a planned window's end)."""
        if self._runtime is not None and self.running is not None:
            int8 = [fqn for fqn, lp in self.running.layers.items() if lp.format is Format.INT8]
            if int8:
                self._runtime.recalibrate(int8)

    def close(self) -> None:
        """The runtime off the model, the scaler's hooks removed, the writer no longer used."""
        self.drop_runtime()
        self.scaler.unwatch()
        self._writer = None

    # -- the scaler -------------------------------------------------------------------------------

    def _new_scaler(self, enabled: bool) -> LossScaler:
        return LossScaler(**dataclasses.asdict(self.config.loss_scaling), enabled=enabled)

    def _replace_scaler(self, enabled: bool, state: Mapping[str, Any]) -> None:
        """A scaler with ``enabled`` and ``state``, watching the layers in place of the current one."""
        armed = self.scaler.watching_outputs
        self.scaler.unwatch()  # its hooks would keep recording into a scaler nobody updates
        self.scaler = self._new_scaler(enabled=enabled)
        self.scaler.load_state_dict(state)
        self.scaler.watch(self._bound(), list(self._layers), outputs=armed)

    def step(self, optimizers: Sequence[torch.optim.Optimizer], *, loss: Optional[torch.Tensor], agreement: "Optional[RankAgreement]",
             max_grad_norm: Optional[float], step: int) -> StepOutcome:
        """Unscale, clip to ``max_grad_norm``, step each optimizer unless its gradients are
        non-finite, update the scale: optimizer step ``step``. Under torch.distributed
        (``agreement``) the ranks agree first. A non-finite ``loss`` arms the per-layer output
        checks, so the next one names the layer whose output went first."""
        scaler = self.scaler
        verdict = agreement.agree_on_step(scaler, optimizers, loss) if agreement is not None else None
        # A pipeline stage clips by the whole model's norm, as the unsharded model would.
        whole = agreement.whole_norm if agreement is not None and agreement.stage_replicas is not None else None
        for optimizer in optimizers:
            if max_grad_norm is not None:
                scaler.clip_grad_norm_(optimizer, max_grad_norm, whole=whole)
            scaler.step(optimizer)
        scaler.update()  # fills the attribution below, on an overflowing iteration only
        skipped = scaler.last_overflowed
        nonfinite: Sequence[str] = scaler.last_nonfinite_layers
        first_bad_output = scaler.first_nonfinite_output if scaler.last_loss_finite is False else None
        if verdict is not None and agreement is not None:  # every rank's flags, reduced: the same on all ranks
            nonfinite, first_bad_output = verdict.layers, verdict.first_output if verdict.loss_ranks else None
            if skipped:
                # Without loss scaling an inf is never the scale's doing: warn.
                logger.log(logging.INFO if scaler.enabled else logging.WARNING, "autoprec: step %d skipped on all %d ranks: %s", step, agreement.world, verdict.describe())
        loss_nonfinite = bool(verdict.loss_ranks) if verdict is not None else scaler.last_loss_finite is False
        self._window_skipped += int(skipped)
        if loss_nonfinite:  # on every rank alike: they arm and disarm the watch at the same steps
            self._nonfinite_losses += 1
            scaler.watch_outputs(True)
        return StepOutcome(skipped, nonfinite, first_bad_output, loss_nonfinite)

    # -- promotions and demotions ---------------------------------------------------------------

    def new_window(self, *, retry: bool = False) -> None:
        """A window starts: its non-finite counts and skipped steps from zero; the output checks
        disarmed after a window without a non-finite loss (``retry``: a fresh profiling window
        after a failed search, which leaves them as they are)."""
        self._window_nonfinite = {}
        self._window_skipped = 0
        if retry:
            return
        if not self._nonfinite_losses:
            self.scaler.watch_outputs(False)
        self._nonfinite_losses = 0

    def on_nonfinite(self, layers: Sequence[str], first_bad_output: Optional[str], step: int) -> None:
        """Count non-finite gradients per layer this window; promote at the threshold at once."""
        plan = self._planned()
        for fqn in layers:
            if fqn in plan.layers:
                self._window_nonfinite[fqn] = self._window_nonfinite.get(fqn, 0) + 1
        if first_bad_output is not None and first_bad_output in plan.layers:
            self._window_nonfinite[first_bad_output] = self._window_nonfinite.get(first_bad_output, 0) + 1
        due = [f for f, n in self._window_nonfinite.items() if n >= self.config.thresholds.nonfinite_steps and plan.layers[f].format is not Format.FP32]
        if due:
            self._promote(due, {f: f"non-finite gradients or outputs in {self._window_nonfinite[f]} steps of this window" for f in due}, step)
            for f in due:
                self._window_nonfinite[f] = 0

    def review_window(self, profile: Any, step: int, measured_bytes: Optional[int]) -> None:
        """Promote on thresholds, demote after quiet windows (hysteresis; a window with a skipped
        step is never quiet). ``profile``: the window's watch report (on a pipeline stage every
        stage's, joined: `WatchReport.joined`); ``measured_bytes``: the saved bytes metered on
        its last step, for the writer."""
        t = self.config.thresholds
        plan = self._planned()
        reviewed = list(plan.layers) if self._stage is not None else self._layers  # a stage reviews the whole pipeline's (every stage's reports)
        triggers, counts, self._policy = window_triggers(plan, reviewed, profile, self._window_nonfinite, self._policy, t)
        if self._writer is not None:
            self._writer.log_layer_counts(step, counts)
            if measured_bytes is not None:
                self._writer.log_memory(step, predicted_bytes=plan.predicted.get("bytes"), measured_bytes=measured_bytes)
        promote = [fqn for fqn in triggers if plan.layers[fqn].format is not Format.FP32]
        self._promote(promote, triggers, step, backward=backward_triggers(promote, profile, t))
        layers = self._planned().layers
        changes, self._policy = demotions(triggers, self._policy, step, t.stable_windows, {fqn: lp.format for fqn, lp in layers.items()},
                                          self._window_skipped, {fqn: lp.grad_format for fqn, lp in layers.items()})
        self._apply([(c, "demoted") for c in changes], "demotion", step)

    def act_on_checks(self, recalibrate: Mapping[str, str], promote: Mapping[str, str], step: int) -> None:
        """A planned check step's actions (`plan_checks`), fqn -> why, one log line per layer:
        for ``recalibrate`` (inputs grossly past their scales' range), every layer's INT8
        calibration and amax history start again from the next forward (a drift that saturates
        one layer reaches the layers after it, which its clamped outputs hid); ``promote`` at once."""
        if recalibrate and self._runtime is not None:
            for fqn, why in recalibrate.items():
                logger.warning("autoprec: step %d: layer %r (%s): %s; recalibrating every layer's scales", step, layer_name(fqn, self._bound()),
                               self._planned().layers[fqn].format.value, why)
            self._runtime.recalibrate()
        due = [fqn for fqn in promote if self._planned().layers[fqn].format is not Format.FP32]
        if due:
            self._promote(due, promote, step)

    def _ladder(self) -> list[Format]:
        """The formats a promotion may go to, narrowest first: BF16 and FP32 within the bounds,
        runnable on the model's device."""
        device = next(self._bound().parameters()).device
        return [f for f in (Format.BF16, Format.FP32) if f.bits <= self.config.max_precision and format_support(f, device).runnable]

    def _promote(self, fqns: Sequence[str], reasons: Mapping[str, str], step: int, backward: Collection[str] = ()) -> None:
        """Promote ``fqns`` one step up the ladder (those in ``backward``, whose gradients alone
        triggered, to a high-precision backward where they can take one: `policy.promotions`),
        and lower other layers to pay for the bytes they add where the plan would go over its
        memory budget (`promotion_bytes.paid_for`; a backward change saves what the format's
        own backward does, so it adds none); what cannot be paid for is promoted anyway, with a
        warning (a layer that overflows must not stay in its format for the budget's sake)."""
        plan = self._planned()
        changes, self._policy = promotions(plan, {f: reasons[f] for f in fqns}, self._policy, step, self._ladder(), backward)
        widened = {c.fqn: c.new for c in changes if not c.backward_only}
        lowered, over = paid_for(plan, widened, keep={f for f, stack in self._policy.history.items() if stack}, step=step) if widened else ([], 0.0)
        if over > 0:
            logger.warning("autoprec: step %d: the promotions of %s take the plan %s bytes over its memory budget (predicted), with no lowering "
                           "of other layers within the accuracy budget to pay for them", step, ", ".join(c.fqn for c in changes), f"{over:,.0f}")
        self._apply([*((c, "promoted") for c in changes), *((c, "lowered") for c in lowered)], "promotion", step)

    def _apply(self, changes: Sequence[tuple[PrecisionChange, str]], why: str, step: int) -> None:
        """Record ``changes`` (each with its verb for the layer's reason) and put them in force as
        one new plan, its predicted figures moved with them (`promotion_bytes.repredicted`)."""
        plan = self._planned()
        for change, _ in changes:
            change = dataclasses.replace(change, step=step, old=plan.layers[change.fqn].format)
            self.changes.append(change)
            logger.info("autoprec: step %d: %s %s (%s)", step, layer_name(change.fqn, self._bound()), change.describe(), change.reason)
            if self._writer is not None:
                self._writer.log_change(step, change.fqn, change.old, change.new, change.reason, change.old_grad, change.new_grad)
        if changes:
            # A layer lowered again runs its format as the search planned it for that layer (its
            # recipe: a plan searched offline may weigh several per format), else as the search
            # plans the format (`SchedulerConfig.scaling`); a backward change keeps the layer's
            # precision but its gradient format.
            precisions = self.config.planning.precisions()
            searched = self.searched_plan.layers if self.searched_plan is not None else {}

            def changed_precision(c: PrecisionChange) -> LayerPrecision:
                own = searched.get(c.fqn)
                if c.new_grad is not None:  # back to its planned gradients: its planned recipe (a split weight gradient too)
                    if own is not None and own.format is plan.layers[c.fqn].format and own.grad_format is c.new_grad:
                        return own
                    return dataclasses.replace(plan.layers[c.fqn], grad_format=c.new_grad)
                if own is not None and own.format is c.new:
                    return own
                return precisions.get(c.new, LayerPrecision(c.new))

            changed = plan.with_layers({c.fqn: dataclasses.replace(changed_precision(c), reason=f"{verb} at step {step}: {c.reason}") for c, verb in changes})
            self.install(changed.replace(predicted=repredicted(changed, plan)), why, step)

    # -- agreement and checkpoints ----------------------------------------------------------------

    def decision(self) -> dict:
        """What this rank decided at a window end, for the others (`RankAgreement.decide`)."""
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "searched_plan": None if self.searched_plan is None else self.searched_plan.to_dict(),
            "changes": [c.to_dict() for c in self.changes], "policy": self._policy.to_dict(),
        }

    def adopt(self, decision: Mapping[str, Any], step: int, runtime: "Optional[PlanRuntime]" = None) -> None:
        """Take rank 0's `decision` as this rank's own (``runtime``: this rank's of the trial
        that won, as rank 0 installs its own)."""
        self.changes = [PrecisionChange.from_dict(c) for c in decision["changes"]]
        self._policy = PolicyState.from_dict(decision["policy"])
        self.searched_plan = None if decision["searched_plan"] is None else Plan.from_dict(decision["searched_plan"])
        plan = None if decision["plan"] is None else Plan.from_dict(decision["plan"])
        if plan is not None and plan != self.plan:
            self.install(plan, "decided on rank 0", step, searched=False, runtime=runtime)
        elif runtime is not None:
            runtime.remove()

    def state_dict(self) -> dict:
        """The plans, changes, policy, window counts, scaler and runtime state (the scheduler's
        `state_dict` fields of these names)."""
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "searched_plan": None if self.searched_plan is None else self.searched_plan.to_dict(),
            "changes": [c.to_dict() for c in self.changes],
            **self._policy.to_dict(),
            "window_nonfinite": dict(self._window_nonfinite),
            "window_skipped": self._window_skipped,
            "scaler": self.scaler.state_dict(),
            "scaler_enabled": self.scaler.enabled,
            "runtime": None if self._runtime is None else self._runtime.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], step: int) -> None:
        """Restore `state_dict`'s fields (checked by `scheduler.state.check_state`) at ``step``."""
        self.searched_plan = None if state["searched_plan"] is None else Plan.from_dict(state["searched_plan"])
        self.changes = [PrecisionChange.from_dict(c) for c in state["changes"]]
        self._policy = PolicyState.from_dict(state)
        self._window_nonfinite = dict(state["window_nonfinite"])
        self._window_skipped = state.get("window_skipped", 0)  # absent from states saved before it was added
        plan = None if state["plan"] is None else Plan.from_dict(state["plan"])
        self.drop_runtime()
        if plan is not None:
            self.install(plan, "restored", step, searched=False)
            if self._runtime is not None and state["runtime"] is not None:
                self._runtime.load_state_dict(state["runtime"])
        else:
            self.plan = self.running = None
        self._replace_scaler(state["scaler_enabled"], state["scaler"])
