"""`DynamicPrecisionScheduler`: precision managed for a training loop, in three lines.

    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=500)
    for x, y in loader:
        with scheduler.precision_context():
            loss = loss_fn(model(x), y)
        scheduler.backward(loss)          # scaled backward
        scheduler.step(optimizer)         # unscale, attribute, clip, step or skip, update
        optimizer.zero_grad()

Binding (`_binding`): the model is the outermost module with a matrix parameter called inside
the first `precision_context`, however it is called; without ``model=`` that first forward runs
at FP32, unprofiled. The phases (`lifecycle.WindowClock`): **profiling** the first window at a
safe precision (FP32, or BF16 when ``max_precision`` is 16); **searching** over the next training
steps (`search.training.TrainingSearch`); **planned**, where each window's profile and the
scaler's per-layer non-finite counts promote or demote layers (`policy`, kept in `changes`) and
INT8 scales are re-calibrated; or **safe** after a failed search (retried, unless no plan meets
the budgets). Loss scaling (`scaling.LossScaler`) is on only while some layer has FP16
gradients. `state_dict` covers everything (a resumed run continues exactly); under
``torch.distributed`` the ranks agree through `distributed`.

Costs per step: the runtime's, the scaler's one host sync per optimizer, and in monitored steps
the profiler's (`autoprec.bench.measure_overhead`); a search's are in `search.training`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import statistics
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ._binding import ModelWatch
from .blocks import find_blocks
from .calls import ModelCall, loss_of, prediction_of
from .costs.inplace import StepTimer
from .coverage import LayerInfo, find_layers
from .device import format_support
from .distributed import RankAgreement, grad_comm_format, unwrap_ddp
from .errors import AutoprecError, InfeasibleBudgetError, ModelCallError, RuntimeStateError, SearchError, SettingsError
from .formats import Format
from .measure import SavedTensorMeter
from .plan import LayerPrecision, Plan
from .policy import PolicyState, PrecisionChange, demotions, promotions, window_triggers
from .runtime import EmulationWarning, apply_plan
from .scaling import LossScaler, LossScaling
from .scheduler_config import SchedulerConfig, Thresholds
from .scheduler_state import LATER_STATE, STATE_VERSION, check_state, check_state_fits
from .lifecycle import CAPTURED_STEPS, WindowClock
from .search.training import TrainingSearch
from .sensitivity import adam_second_moment
from .sensitivity.capture import GradientCapture, LinearisedLoss

if TYPE_CHECKING:
    from .monitoring import TrainingWriter
    from .profiling import LayerProfiler

__all__ = ["DynamicPrecisionScheduler", "SchedulerConfig", "LossScaling", "Thresholds", "PrecisionChange"]

logger = logging.getLogger(__name__)

# Steps skipped in a row before a warning (then again at each doubling): a few skips are loss
# scaling doing its job, ten in a row mean the model diverges at this precision.
_SKIPS_BEFORE_WARNING = 10


def _needs_loss_scaling(plan: "Plan | None") -> bool:
    # Only FP16 gradients underflow without a scale. FP8 gradients are quantized with their own
    # per-tensor current scale (amax -> scale), which divides a power-of-two loss scale out exactly:
    # examples/measure_loss_scaling.py trains identically with the dynamic scale and with 1.
    # BF16 has FP32's range; INT8 layers run their backward in FP32.
    return plan is not None and any(lp.grad_format is Format.FP16 for lp in plan.layers.values())


class DynamicPrecisionScheduler:
    """Profiles, searches, applies and keeps re-planning per-layer precision for a training loop.

    ``model``: optional (see the module docstring). The settings are a `SchedulerConfig`, given
    as ``config=`` or as its fields by keyword (``memory_budget=0.6, monitor_window=200, ...``;
    each is documented there). ``plan``: start from this plan (with ``dynamic=False``: run it
    fixed; `from_plan` loads one from a file).
    """

    def __init__(self, model: Optional[nn.Module] = None, *, config: "SchedulerConfig | None" = None, plan: "Plan | None" = None, **settings: Any):
        if config is not None and settings:
            raise SettingsError(f"DynamicPrecisionScheduler(config=..., {', '.join(sorted(settings))}=...): give the settings in the config or as keywords, not both (dataclasses.replace(config, ...) derives one)")
        if "search_trials" in settings:  # the scheduler's search has no trials since it is exact
            raise SettingsError("DynamicPrecisionScheduler(search_trials=...): removed: the search is the exact optimum of the integer program, bounded by search_timeout_s; delete the argument")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(SchedulerConfig)})
        if unknown:
            raise SettingsError(f"DynamicPrecisionScheduler({unknown[0]}=...): unknown setting; expected one of SchedulerConfig's fields: {', '.join(f.name for f in dataclasses.fields(SchedulerConfig))}")
        self.config = config = config if config is not None else SchedulerConfig(**settings)
        if not config.dynamic and plan is None:
            raise SettingsError("DynamicPrecisionScheduler(dynamic=False) needs plan=...; use DynamicPrecisionScheduler.from_plan(model, path)")

        if model is not None and not isinstance(model, nn.Module):
            raise SettingsError(f"DynamicPrecisionScheduler(model={model!r}): expected the torch.nn.Module being trained, or None to bind to the model run in the first precision_context()")
        # Under DDP the plan is the inner module's (its fqns); the wrapper carries the comm hook.
        self.model, self._ddp = unwrap_ddp(model)
        self._dist: Optional[RankAgreement] = None  # set on bind inside a process group
        self.layers: tuple[str, ...] = ()
        self._fingerprint: Mapping[str, LayerInfo] = {}  # the bound model's layers, saved in state_dict
        self.step_count = 0
        # The phase and the window (`lifecycle`): changed only through its transitions.
        self._clock = WindowClock(config.monitor_window, config.profiled_steps, phase="profiling" if plan is None else "planned")
        self.plan: Optional[Plan] = None
        self.searched_plan: Optional[Plan] = plan
        self.changes: list[PrecisionChange] = []
        self.last_search_error: Optional[str] = None
        self._fixed_plan = plan
        self._example: Optional[ModelCall] = None
        self._pending_state: Optional[Mapping[str, Any]] = None  # loaded before binding: applied on bind
        self._runtime = None
        self._reusing_weights = False  # inside reusing_weights(): step() is refused
        self._profiler: "Optional[LayerProfiler]" = None
        self._policy = PolicyState()
        self._window_nonfinite: dict[str, int] = {}
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._last_loss: Optional[torch.Tensor] = None
        self._capture = GradientCapture(keep=CAPTURED_STEPS)  # the sensitivity estimate's batches
        self._meter_bytes: Optional[int] = None
        self._meter_next = False
        self._window_skipped = 0  # optimizer steps skipped in this window: such a window is never quiet
        self._optimizers_seen: set[int] = set()  # ids of optimizers whose parameters step() checked
        self._optimizers: tuple = ()  # the last step()'s
        self._output_checked = False  # the first forward's output holds a prediction (dynamic only)
        self._context_stack: Optional[contextlib.ExitStack] = None
        self._backward_due = False  # a forward with autograd ran since the last backward
        self._skips_in_row = 0
        # Per-layer output checks (`LossScaler.watch_outputs`: one reduction per layer call) are
        # armed only after a loss went non-finite, and disarmed after a window without one: clean
        # training does not pay them.
        self._nonfinite_losses = 0  # this window's
        # The search in progress (`search.training`), spread over the steps after the window,
        # and what each step ran for it: its kind, its start, its per-layer timer, its bytes.
        self._searching: Optional[TrainingSearch] = None
        self._step_kind: Optional[str] = None
        self._step_started: Optional[float] = None
        self._step_timer: Optional[StepTimer] = None
        self._step_bytes: Optional[int] = None
        self._last_step_seconds: Optional[float] = None
        self._recent_steps: collections.deque = collections.deque(maxlen=64)  # seconds of safe-precision steps
        # "role|format" -> seconds and "rest", measured by probe steps on this device: a later
        # search (a retry) does not probe again.
        self._known_times: dict[str, float] = {}
        self.scaler = self._new_scaler(enabled=False)
        self._writer: "Optional[TrainingWriter]" = None

    @classmethod
    def from_plan(cls, model: nn.Module, plan: "Plan | str", *, dynamic: bool = False, **kwargs) -> "DynamicPrecisionScheduler":
        """Run a fixed plan from an offline search (``dynamic=True``: start from it, and keep
        watching and promoting / demoting as usual)."""
        if not isinstance(plan, Plan):
            plan = Plan.load(plan)
        return cls(model, plan=plan, dynamic=dynamic, **kwargs)

    # -- public state ---------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """"unbound" (before the first forward), "profiling" (the first window), "searching" (the
        steps after it, while the search runs: `search.training`), "planned", or "safe" (the search
        failed, see `last_search_error`: training stays at the safe precision)."""
        if self._example is None:
            return "unbound"
        return self._clock.phase

    @property
    def window_start(self) -> int:
        """The step the current window started at (`lifecycle.WindowClock`)."""
        return self._clock.window_start

    @property
    def _bound(self) -> nn.Module:
        """The bound model: what every step after the first forward runs."""
        if self.model is None:
            raise RuntimeStateError("the scheduler is not bound to a model yet: run the model inside precision_context() first")
        return self.model

    @property
    def _planned(self) -> Plan:
        """The plan in force (the planned phase's window reviews and promotions)."""
        if self.plan is None:
            raise RuntimeStateError(f"no plan is in force (phase {self.phase!r})")
        return self.plan

    @property
    def _search(self) -> TrainingSearch:
        """The search in progress (the searching phase's steps)."""
        if self._searching is None:
            raise RuntimeStateError(f"no search is in progress (phase {self.phase!r})")
        return self._searching

    @property
    def _stack(self) -> contextlib.ExitStack:
        """The running precision_context's exit stack (binding happens inside it)."""
        if self._context_stack is None:
            raise RuntimeStateError("precision_context() is not active")
        return self._context_stack

    @property
    def distributed(self) -> Optional[RankAgreement]:
        """The `RankAgreement` with the other ranks (None outside a process group or before bind)."""
        return self._dist

    def __repr__(self) -> str:
        counts = self.plan.format_counts() if self.plan is not None else {}
        return f"DynamicPrecisionScheduler(phase={self.phase!r}, step={self.step_count}, plan={counts}, scale={self.scaler.get_scale():g})"

    # -- the loop -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def precision_context(self):
        """Forward passes inside run the plan in force (or the safe precision while profiling).

        Not re-entrant. The first one binds the scheduler to its model (see the module doc). Each
        one refuses, with a `RuntimeStateError` before it runs, a call of a model other than the
        scheduler's (`_binding`); the first one, ending without any model called (nothing to bind
        to), refuses that on exit.
        """
        if self._context_stack is not None:
            raise RuntimeStateError("precision_context() is already active; it is not re-entrant")
        stack = contextlib.ExitStack()
        self._context_stack = stack
        try:
            if self._example is not None:
                self._enter_step(stack)
            stack.enter_context(self._model_watch())
            self._backward_due = torch.is_grad_enabled()
            yield self
            if self._example is None:
                raise RuntimeStateError(self._unbound_exit())
        finally:
            self._context_stack = None
            stack.close()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale, for a loop that calls ``.backward()`` itself:
        ``scheduler.scale(loss).backward()``. Records the loss (the first window's mean anchors a
        relative accuracy budget). ``loss`` may be the model's output with a ``loss`` field
        (`calls.loss_of`). No host sync."""
        if self._example is None:
            raise RuntimeStateError("backward() or scale() before any forward ran inside precision_context()")
        loss = loss_of(loss)
        detached = loss.detach().float()
        self._last_loss = detached
        self._backward_due = False
        if self._step_timer is not None:  # a probe step: hook the autograd nodes of each layer
            self._step_timer.before_backward(loss)
        if self.phase == "profiling":
            # (sum of the finite losses, how many were finite): a NaN batch must not make the
            # baseline NaN (it would switch the accuracy budget off). No host sync.
            finite = torch.isfinite(detached)
            entry = torch.stack([torch.where(finite, detached, torch.zeros_like(detached)), finite.float()])
            self._loss_sum = entry if self._loss_sum is None else self._loss_sum + entry
            self._loss_count += 1
        return self.scaler.scale(loss)

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
        runtime = self._runtime
        self._reusing_weights = True
        try:
            with runtime.reusing_weights() if runtime is not None else contextlib.nullcontext():
                yield
        finally:
            self._reusing_weights = False

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` on the scaled loss (call once per micro-batch). No host sync."""
        self.scale(loss).backward(**kwargs)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Unscale, clip (``max_grad_norm``), step each optimizer unless its gradients are
        non-finite, update the scale, and advance the lifecycle. Returns whether every optimizer
        stepped. One host sync per optimizer (the scaler's); in a process group also one all-reduce
        of ``8 * (optimizers + 1 + 2 * layers)`` bytes and one host transfer (`autoprec.distributed`)."""
        if not optimizers:
            raise RuntimeStateError("step() needs the optimizer(s): scheduler.step(optimizer)")
        if self._reusing_weights:
            raise RuntimeStateError("step() inside reusing_weights(): the optimizer writes the weights; end that block before scheduler.step(optimizer)")
        if self._example is None:
            raise RuntimeStateError("step() before any forward ran inside precision_context()")
        if self._backward_due:
            raise RuntimeStateError("step() after a forward but before its backward: call scheduler.backward(loss) (or scheduler.scale(loss).backward()) before scheduler.step(optimizer)")
        for i, optimizer in enumerate(optimizers):
            self._check_optimizer(i, optimizer)
        self._optimizers = optimizers  # a search starting this step reads their Adam state
        if self._profiler is not None and self._profiler.collecting:
            self._profiler.step()
        verdict = self._dist.agree_on_step(self.scaler, optimizers, self._last_loss) if self._dist is not None else None
        for optimizer in optimizers:
            if self.config.max_grad_norm is not None:
                self.scaler.clip_grad_norm_(optimizer, self.config.max_grad_norm)
            self.scaler.step(optimizer)
        self.scaler.update()  # fills the attribution below, on an overflowing iteration only
        skipped = self.scaler.last_overflowed
        nonfinite = self.scaler.last_nonfinite_layers
        first_bad_output = self.scaler.first_nonfinite_output if self.scaler.last_loss_finite is False else None
        if verdict is not None:  # every rank's flags, reduced: the same on all ranks
            nonfinite, first_bad_output = verdict.layers, verdict.first_output if verdict.loss_ranks else None
            if skipped:
                # Without loss scaling an inf is never the scale's doing: warn.
                logger.log(logging.INFO if self.scaler.enabled else logging.WARNING, "autoprec: step %d skipped on all %d ranks: %s", self.step_count, self._dist.world if self._dist is not None else 1, verdict.describe())
        loss_nonfinite = bool(verdict.loss_ranks) if verdict is not None else self.scaler.last_loss_finite is False
        self.step_count += 1
        self._window_skipped += int(skipped)
        self._count_skips(skipped, nonfinite)
        if loss_nonfinite:  # on every rank alike: they arm and disarm the watch at the same steps
            self._nonfinite_losses += 1
            self.scaler.watch_outputs(True)  # the next non-finite loss names the layer whose output went first
        if self._writer is not None:
            self._writer.log_step(self.step_count, loss=self._last_loss, loss_scale=self.scaler.scale_tensor, skipped=skipped)
        if self.config.dynamic and self.plan is not None:
            self._on_nonfinite(nonfinite, first_bad_output)
        self._end_step(skipped)
        self._advance()
        return not skipped

    def _check_optimizer(self, i: int, optimizer: Any) -> None:
        """`RuntimeStateError` for an optimizer holding none of the bound model's parameters
        (checked once per optimizer) or none with a gradient (each step: it stops at the first
        gradient found, so it costs one look on a normal step)."""
        where = f"step({type(optimizer).__name__}, optimizer #{i + 1})"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise RuntimeStateError(f"step({type(optimizer).__name__}): expected a torch.optim.Optimizer over the model's parameters")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if id(optimizer) not in self._optimizers_seen:
            own = {id(p) for p in self._bound.parameters()}
            if not any(id(p) in own for p in params):
                raise RuntimeStateError(
                    f"{where}: the optimizer holds none of {type(self.model).__name__}'s parameters (the model the scheduler is bound to); "
                    "pass the optimizer made from this model's parameters"
                )
            self._optimizers_seen.add(id(optimizer))
        if not any(p.grad is not None for p in params):
            raise RuntimeStateError(
                f"{where}: no parameter has a gradient; call scheduler.backward(loss) on a loss computed from the model's output "
                "before step() (a loss detached from the model, or zero_grad(set_to_none=True) after backward, leaves none)"
            )

    def _count_skips(self, skipped: bool, layers: Sequence[str]) -> None:
        """Warn when steps are skipped many times in a row (at 10, 20, 40, ... skips)."""
        self._skips_in_row = self._skips_in_row + 1 if skipped else 0
        n = self._skips_in_row
        times, rest = divmod(n, _SKIPS_BEFORE_WARNING)
        if rest == 0 and times > 0 and times & (times - 1) == 0:  # times is a power of two
            where = f"non-finite gradients in {', '.join(layers)}" if layers else "a non-finite loss"
            plan = self.plan.format_counts() if self.plan is not None else "the safe precision"
            logger.warning(
                "autoprec: step %d: %d optimizer steps in a row skipped (%s) under plan %s; %s; training is not progressing: "
                "lower the learning rate, set max_grad_norm, or raise min_precision", self.step_count, n, where, plan, self._scaling_note(),
            )

    def _scaling_note(self) -> str:
        """The loss scale and its floor, or why scaling is off (the scale then reads 1.0 whatever
        ``LossScaling(min_scale=...)`` says: the floor holds only while scaling is on)."""
        if self.scaler.enabled:
            return f"loss scale {self.scaler.get_scale():g} (floor min_scale={self.scaler.min_scale:g})"
        return ("loss scaling is off: no FP16 layer runs (BF16 and FP32 have FP32's range, so no scale helps), "
                f"the scale reads 1.0 and min_scale={self.config.loss_scaling.min_scale:g} applies once an FP16 layer runs")

    # -- binding --------------------------------------------------------------------------------

    def _model_watch(self) -> ModelWatch:
        """This context's `ModelWatch`, with the binding for the case at hand (module doc, step 1)."""
        if self._example is not None:
            return ModelWatch(self._ddp if self._ddp is not None else self.model, bound_before=True)
        if self.model is not None:  # model=: its own pre-hook sees the keyword inputs before it runs
            return ModelWatch(self._ddp if self._ddp is not None else self.model, at_start=self._bind_at_start)
        if self._pending_state is not None:  # the saved example call: bind before the first forward
            return ModelWatch(at_start=self._bind_resumed)
        return ModelWatch(at_end=self._bind_at_end)

    def _bind_at_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._bind(self._bound, ModelCall.capture(args, kwargs))
        self._enter_step(self._stack)

    def _bind_resumed(self, module: nn.Module, args: tuple, kwargs: None) -> None:
        state, self._pending_state = self._pending_state, None
        if state is None:
            raise RuntimeStateError("no saved state to bind with")  # installed only while one is pending
        self.model, self._ddp = unwrap_ddp(module)
        try:
            self.load_state_dict(state)
        except BaseException:  # a state for another model: stay unbound, as before the call
            self.model, self._ddp, self._pending_state = None, None, state
            raise
        self._enter_step(self._stack)

    def _bind_at_end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        model, self._ddp = unwrap_ddp(module)
        self._bind(model if model is not None else module, ModelCall.capture(args, kwargs))
        logger.info("autoprec: bound to %s at the end of its first call (a model's keyword inputs are seen only then): "
                    "that forward ran at FP32 and unprofiled; the scheduler's precision applies from the next forward on", type(model).__name__)
        self._enter_step(self._stack)
        self._check_output(module, args, kwargs, output)
        if self._capture.armed:  # this call is one of the window's captured steps
            self._capture.observe(module, args, kwargs, output)

    def _unbound_exit(self) -> str:
        if self.model is not None:
            return (f"precision_context(): the scheduler's model ({type(self.model).__name__}, model=) was not called inside it; "
                    "call it inside the context as model(...), not model.forward(...)")
        return ("precision_context(): no model was called inside it, so the scheduler has nothing to bind to; call the model "
                "inside the context as model(...), not model.forward(...) or a function of its weights, or pass DynamicPrecisionScheduler(model=...)")

    def _attach(self, model: nn.Module, example: ModelCall) -> None:
        """Take ``model`` and its example call: find the layers, open the TensorBoard writer."""
        self.model = model
        self._example = example
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)
            self._fingerprint = find_layers(model, self._example)
        self.layers = tuple(self._fingerprint)
        if not self.layers:
            raise AutoprecError(f"{type(model).__name__} runs no matrix product: autoprec has no layer to manage")
        if self.config.recompute is not None:
            try:
                find_blocks(model, self.layers, self.config.recompute)
            except SearchError as exc:
                raise SettingsError(f"DynamicPrecisionScheduler(recompute={list(self.config.recompute)!r}): {exc}") from None
        self._dist = RankAgreement.join(self.config, model, self.layers, self._ddp)
        if self._dist is not None:
            self._dist.check_bind(self.config, self._fixed_plan)
            self._dist.set_grad_comm(grad_comm_format(self.config, None))
        if self.config.log_dir is not None and self._writer is None and (self._dist is None or self._dist.rank == 0):
            from .monitoring import TrainingWriter

            self._writer = TrainingWriter(self.config.log_dir, flush_every=min(100, self.config.monitor_window))

    def _bind(self, model: nn.Module, example: ModelCall) -> None:
        if any(p.is_meta for p in model.parameters()):
            raise RuntimeStateError(
                f"{type(model).__name__} ran on the meta device inside precision_context(); materialise it first "
                "(model.to_empty(device=...) and initialise the weights), then train it under the scheduler"
            )
        if self._fixed_plan is not None:
            self._fixed_plan.validate(model, example)  # a plan for another model: PlanError naming each layer
        self._attach(model, example)
        self._watch()
        if self._fixed_plan is not None:
            self._set_plan(self._fixed_plan, "the given plan")
        else:
            safe = self._safe_format()
            if safe is not Format.FP32:
                self._set_plan(Plan({fqn: LayerPrecision(safe, reason="safe precision while profiling") for fqn in self.layers}), "profiling", searched=False)
                self.plan = None  # still profiling: the search has not run
        if self.config.dynamic and self._fixed_plan is None:
            self._start_profiler(self.config.monitor_window)
        self._maybe_start_monitor()
        logger.info("autoprec: bound to %s with %d layers", type(model).__name__, len(self.layers))

    def _enter_step(self, stack: contextlib.ExitStack) -> None:
        if not self._output_checked:  # once: the first forward under the scheduler
            handle = self._bound.register_forward_hook(self._check_output, with_kwargs=True)
            stack.callback(handle.remove)
        self._step_started = time.perf_counter()
        entry = self._searching.step_runtime() if self._searching is not None else None
        self._step_kind = entry[0] if entry is not None else None
        if entry is not None:  # a probe or trial step of the search: its runtime instead of the safe one
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore", EmulationWarning)  # the adopted plan names its emulated layers
            stack.enter_context(entry[1])
            if self._step_kind == "probe":
                self._step_timer = StepTimer(self._bound, self.layers, tuple(self._search.blocks)).__enter__()
            if self._search.wants_bytes():
                meter = stack.enter_context(SavedTensorMeter(list(self._bound.parameters())))
                stack.callback(lambda: setattr(self, "_step_bytes", meter.total_bytes))
        elif self._runtime is not None:
            stack.enter_context(self._runtime)
        if self._meter_next:
            metered = stack.enter_context(SavedTensorMeter(list(self._bound.parameters())))
            stack.callback(lambda: setattr(self, "_meter_bytes", metered.total_bytes))
            self._meter_next = False
        if self.config.dynamic and self._clock.captures(self.step_count):
            self._capture.arm(self._bound)
            stack.callback(self._capture.disarm)

    def _check_output(self, module, args, kwargs, output) -> None:
        """`ModelCallError` when a dynamic scheduler's model returns no floating-point tensor
        (None, say): the search linearises the loss at the model's prediction, so it needs one."""
        if self._output_checked:
            return
        self._output_checked = True
        if not self.config.dynamic or self._fixed_plan is not None:
            return
        try:
            prediction_of(output)
        except ModelCallError:
            raise ModelCallError(
                f"DynamicPrecisionScheduler: {type(module).__name__}'s forward returned {type(output).__name__} with no floating-point tensor; "
                "the scheduler estimates each layer's sensitivity at the model's prediction: return the output (a tensor, or a tuple, dict "
                "or ModelOutput holding one), or run a fixed plan (DynamicPrecisionScheduler.from_plan)"
            ) from None

    # -- plans ----------------------------------------------------------------------------------

    def _new_scaler(self, enabled: bool) -> LossScaler:
        return LossScaler(**dataclasses.asdict(self.config.loss_scaling), enabled=enabled)

    def _watch(self, outputs: bool = False) -> None:
        """Attribute non-finite gradients to the layers (and check their outputs with ``outputs``)."""
        self.scaler.watch(self._bound, list(self.layers), outputs=outputs)

    def _replace_scaler(self, enabled: bool, state: Mapping[str, Any]) -> None:
        """A scaler with ``enabled`` and ``state``, watching the layers in place of the current one."""
        armed = self.scaler.watching_outputs
        self.scaler.unwatch()  # its hooks would keep recording into a scaler nobody updates
        self.scaler = self._new_scaler(enabled=enabled)
        self.scaler.load_state_dict(state)
        self._watch(outputs=armed)

    def _drop_runtime(self) -> None:
        if self._runtime is not None:
            self._runtime.remove()
            self._runtime = None

    def _set_plan(self, plan: Plan, why: str, searched: bool = True, runtime: Any = None) -> None:
        """Install ``plan``: a new runtime (or ``runtime``, one already installed for it: a trial's)
        keeping the amax histories and calibration of layers whose precision did not change; the
        scaler switched on or off as the plan needs."""
        old = self._runtime
        if old is not None:
            old.remove()  # its layer wrappers off the model before the new plan's go on
        if runtime is None:
            runtime = apply_plan(self._bound, plan, validate=False)
            if old is not None:
                kept = {fqn: s for fqn, s in old.state_dict()["layers"].items() if fqn in plan.layers and old.plan.layers.get(fqn) == plan.layers[fqn]}
                runtime.load_state_dict({"layers": kept})
        self._runtime = runtime if any(lp.format is not Format.FP32 for lp in plan.layers.values()) else None
        if self._runtime is None:
            runtime.remove()  # an all-FP32 plan runs the model as it is
        self.plan = plan
        if searched and self.searched_plan is None:
            self.searched_plan = plan
        if self._dist is not None:
            self._dist.set_grad_comm(grad_comm_format(self.config, plan))
        if _needs_loss_scaling(plan) != self.scaler.enabled:
            self._replace_scaler(_needs_loss_scaling(plan), self.scaler.state_dict())
        if self._writer is not None:
            self._writer.log_plan(self.step_count, plan, name="plan")
        logger.info("autoprec: step %d: plan %s (%s)", self.step_count, plan.format_counts(), why)

    def _change(self, fqn: str, new: Format, reason: str) -> None:
        old = self._planned.layers[fqn].format
        self.changes.append(PrecisionChange(self.step_count, fqn, old, new, reason))
        logger.info("autoprec: step %d: %s %s -> %s (%s)", self.step_count, fqn, old.value, new.value, reason)
        if self._writer is not None:
            self._writer.log_change(self.step_count, fqn, old, new, reason)

    def _safe_format(self) -> Format:
        """The precision of the profiling window and of a failed search."""
        return Format.FP32 if self.config.max_precision == 32 else Format.BF16

    def _ladder(self) -> list[Format]:
        """The formats a promotion may go to, narrowest first: BF16 and FP32 within the bounds,
        runnable on the model's device."""
        return [f for f in (Format.BF16, Format.FP32) if f.bits <= self.config.max_precision and format_support(f, self._device()).runnable]

    def _device(self) -> torch.device:
        return next(self._bound.parameters()).device

    def _promote(self, fqns: Sequence[str], reasons: Mapping[str, str]) -> None:
        changes, self._policy = promotions(self._planned, {f: reasons[f] for f in fqns}, self._policy, self.step_count, self._ladder())
        self._apply(changes, "promoted", "promotion")

    def _apply(self, changes: Sequence[PrecisionChange], verb: str, why: str) -> None:
        """Record ``changes`` and put them in force as one new plan."""
        for change in changes:
            self._change(change.fqn, change.new, change.reason)
        if changes:
            self._set_plan(self._planned.with_layers({c.fqn: LayerPrecision(c.new, reason=f"{verb} at step {self.step_count}: {c.reason}") for c in changes}), why)

    def _on_nonfinite(self, layers: Sequence[str], first_bad_output: Optional[str]) -> None:
        """Count non-finite gradients per layer this window; promote at the threshold at once."""
        plan = self._planned
        for fqn in layers:
            if fqn in plan.layers:
                self._window_nonfinite[fqn] = self._window_nonfinite.get(fqn, 0) + 1
        if first_bad_output is not None and first_bad_output in plan.layers:
            self._window_nonfinite[first_bad_output] = self._window_nonfinite.get(first_bad_output, 0) + 1
        due = [f for f, n in self._window_nonfinite.items() if n >= self.config.thresholds.nonfinite_steps and plan.layers[f].format is not Format.FP32]
        if due:
            self._promote(due, {f: f"non-finite gradients or outputs in {self._window_nonfinite[f]} steps of this window" for f in due})
            for f in due:
                self._window_nonfinite[f] = 0

    # -- windows --------------------------------------------------------------------------------

    def _start_profiler(self, window: int) -> None:
        from .profiling import LayerProfiler, with_grad_formats

        formats = with_grad_formats(self.config.candidates)
        profiler = LayerProfiler(self._bound, self._example, formats=formats, window=window)
        if set(profiler.layers) != set(self.layers):
            profiler = LayerProfiler(self._bound, self._example, formats=formats, window=window, module_filter=lambda m, fqn: fqn in self.layers)
        profiler.attach()
        self._profiler = profiler

    def _advance(self) -> None:
        if not self.config.dynamic:
            return
        self._clock, tick = self._clock.after_step(self.step_count)
        if tick.retry:
            self._retry()
            return
        if tick.meter_next:
            self._meter_next = True  # measure the saved bytes of the window's last step
        if not tick.window_end:
            self._maybe_start_monitor()
            return
        if self._writer is not None:  # once per window: one sync for all layers' histograms
            modules = dict(self._bound.named_modules())
            grads = {fqn: p.grad for fqn in self.layers for p in modules[fqn].parameters(recurse=False) if p.dim() >= 2 and p.grad is not None}
            self._writer.log_grad_histograms(self.step_count, grads)
        if self._dist is not None:  # every rank's statistics before rank 0 decides
            reduced = self._dist.reduce_window(self._profiler, self._loss_sum if self.plan is None else None)
            if self.plan is None and reduced is not None:
                self._loss_sum, self._loss_count = reduced, self._loss_count * self._dist.world
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.detach()
        # On every rank: the accumulators were reduced, so every rank's profile is the same.
        profile = profiler.profile() if profiler is not None and profiler.steps else None
        if self.plan is None:
            self._start_search(profile)
            return
        if self._runtime is not None:  # on every rank, before the review
            int8 = [fqn for fqn, lp in self.plan.layers.items() if lp.format is Format.INT8]
            if int8:
                self._runtime.recalibrate(int8)
        self._decide_on_every_rank(lambda: self._review_window(profile))
        self._next_window()

    def _next_window(self) -> None:
        self._clock = self._clock.next_window(self.step_count)
        self._window_nonfinite = {}
        self._window_skipped = 0
        if not self._nonfinite_losses:
            self.scaler.watch_outputs(False)
        self._nonfinite_losses = 0
        self._maybe_start_monitor()

    def _retry(self) -> None:
        """A failed search (other than budgets no plan meets) is retried: one NaN batch at the end
        of the first window must not pin the safe precision for the rest of training. The clock
        waited (`WindowClock.failed`); this profiles one fresh window, whose end searches again."""
        logger.info("autoprec: step %d: profiling again after a failed search (%d in a row): %s", self.step_count, self._clock.failures, self.last_search_error)
        self.last_search_error = None
        self._window_nonfinite, self._window_skipped = {}, 0
        self._loss_sum, self._loss_count = None, 0
        self._capture.clear()
        self._start_profiler(self.config.monitor_window)

    def _maybe_start_monitor(self) -> None:
        """Profile the last ``monitor_steps`` steps of each planned window."""
        if self.config.dynamic and self._profiler is None and self._clock.monitors(self.step_count):
            self._start_profiler(self.config.profiled_steps)

    def _start_search(self, profile) -> None:
        """The first window's search (see the module doc), spread over the next training steps
        (`search.training.TrainingSearch`); rank 0 does its off-path work."""
        loss = None
        if self._loss_count and self._loss_sum is not None:
            total, finite = (float(v) for v in self._loss_sum)  # one host sync per search
            if finite < self._loss_count:
                logger.warning("autoprec: step %d: %d of the window's %d losses were NaN / inf; the baseline loss is the mean of the other %d",
                               self.step_count, self._loss_count - int(finite), self._loss_count, int(finite))
            loss = total / finite if finite else None
        self._new_search(profile, loss, median_step=statistics.median(self._recent_steps) if self._recent_steps else None,
                         safe_bytes=None if self._meter_bytes is None else (self._safe_format(), self._meter_bytes))
        logger.info("autoprec: step %d: searching over the next training steps (%d probe steps, then the candidates)", self.step_count, self._search.probe_steps)
        self._advance_search()  # its first slice in this step

    def _new_search(self, profile, baseline_loss: Optional[float], restore: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        batches = self._capture.batches()
        lead = self._dist is None or self._dist.rank == 0
        armed = self.scaler.watching_outputs
        self.scaler.watch_outputs(False)  # its hooks must not be copied into the search's snapshot
        try:
            self._searching = TrainingSearch(
                self._bound, self._example, batches, LinearisedLoss(), profile, config=self.config, baseline_loss=baseline_loss,
                fingerprint=self._fingerprint, step=self.step_count, known=self._known_times, lead=lead, restore=restore,
                second_moment=adam_second_moment(self._bound, self._optimizers) if lead else None, **kwargs,
            )
        finally:
            self.scaler.watch_outputs(armed)
        self._clock = self._clock.searching()
        if lead and not batches and self._searching.candidates is None:
            self._searching.fail(SearchError("no output gradients were captured in the window's last steps; call scheduler.backward(loss) inside the loop"))

    def _resume_search(self, state: Mapping[str, Any]) -> None:
        """The search a checkpoint was taken in, continued (`TrainingSearch.state_dict`)."""
        from .profiling import Profile

        profile = None if state["profile"] is None else Profile.from_dict(state["profile"])
        self._new_search(profile, state["baseline_loss"], restore=state)

    def _close_search(self) -> None:
        """Drop a search in progress (its runtimes off the model, the step's timer removed)."""
        if self._step_timer is not None:
            self._step_timer.__exit__(None, None, None)
            self._step_timer = None
        if self._searching is not None:
            self._searching.close()
            self._searching = None

    def _end_step(self, skipped: bool) -> None:
        """Time the step just run; while searching, report it and give the search its slice."""
        seconds = time.perf_counter() - self._step_started if self._step_started is not None else None
        self._step_started, self._last_step_seconds = None, seconds
        search = self._searching
        if search is None:
            if seconds is not None and self.plan is None:
                self._recent_steps.append(seconds)
            return
        timed: dict = {}
        if self._step_timer is not None:
            layer_seconds, forward_seconds = self._step_timer.finish()
            timed = {"layer_seconds": layer_seconds, "forward_seconds": forward_seconds, "block_seconds": self._step_timer.block_forward}
            self._step_timer.__exit__(None, None, None)
            self._step_timer = None
        search.record(self._step_kind, seconds if seconds is not None else 0.0, saved_bytes=self._step_bytes, skipped=skipped, **timed)
        self._step_kind, self._step_bytes = None, None
        if search.median_step is None and seconds is not None:
            search.median_step = seconds
        self._advance_search()

    def _advance_search(self) -> None:
        """The search's slice of off-path work after a step; rank 0's candidates to the others;
        the result in force once the search is done."""
        search = self._search
        slice_ = self.config.search_slice
        if slice_ is None or search.median_step is None:
            search.work(math.inf)
        else:  # the step and its slice together: about (1 + search_slice) median steps
            search.work((1 + slice_) * search.median_step - (self._last_step_seconds or 0.0))
        if self._dist is not None and not search.shared:
            # Rank 0's candidates (or its error) reach every rank at the same step: one broadcast
            # per step until they exist (every rank calls it: none knows before rank 0 is done).
            ready = search.candidates is not None or search.error is not None
            shared = self._dist.share(None if not ready else
                                      {"plans": [p.to_dict() for p in search.candidates or []], "error": None if search.error is None else str(search.error)})
            if shared is not None:
                search.shared = True
                if self._dist.rank != 0:
                    search.fail(SearchError(shared["error"])) if shared["error"] else search.set_candidates([Plan.from_dict(p) for p in shared["plans"]])
        if search.done:
            self._finish_search()

    def _finish_search(self) -> None:
        """Adopt the search's result (on rank 0; the others adopt rank 0's decision), or keep the
        safe precision on failure; log its timeline."""
        search, self._searching = self._search, None

        def decide():
            if search.error is not None:
                self._search_failed(search.error)
            else:
                self._clock = self._clock.planned(self.step_count)
                self._set_plan(search.result, f"searched after {search.started} steps, tried on {search.steps} training steps", runtime=search.take_runtime())
                if self._writer is not None:
                    self._writer.log_memory(self.step_count, predicted_bytes=search.result.predicted.get("bytes"), measured_bytes=search.result.measured.get("saved_bytes"))

        try:
            self._decide_on_every_rank(decide)
        finally:
            search.close()
            self._capture.clear()
        logger.info("autoprec: step %d: %s", self.step_count, search.summary())
        if self._writer is not None:
            self._writer.log_search(self.step_count, search.timeline, longest_step_ratio=search.longest_step / search.median_step if search.median_step else None)
        self._next_window()

    def _search_failed(self, exc: AutoprecError) -> None:
        """Keep the safe precision; retry later unless no plan meets the budgets (module doc)."""
        self.last_search_error = str(exc)
        final = isinstance(exc, InfeasibleBudgetError)  # the budgets do not change with the data
        self._clock = self._clock.failed(self.step_count, final=final)
        if final:
            logger.warning("autoprec: step %d: search failed, training stays at the safe precision: %s", self.step_count, exc)
            return
        logger.warning("autoprec: step %d: search failed, training stays at the safe precision and searches again after %d window(s) (step %d): %s",
                       self.step_count, 2 ** (self._clock.failures - 1), self._clock.retry_at, exc)

    def _review_window(self, profile) -> None:
        """Re-calibrate, promote on thresholds, demote after quiet windows (hysteresis)."""
        t = self.config.thresholds
        plan = self._planned
        triggers, counts, self._policy = window_triggers(plan, self.layers, profile, self._window_nonfinite, self._policy, t)
        if self._writer is not None:
            self._writer.log_layer_counts(self.step_count, counts)
            if self._meter_bytes is not None:
                self._writer.log_memory(self.step_count, predicted_bytes=plan.predicted.get("bytes"), measured_bytes=self._meter_bytes)
        promote = [fqn for fqn in triggers if plan.layers[fqn].format is not Format.FP32]
        self._promote(promote, triggers)
        current = {fqn: lp.format for fqn, lp in self._planned.layers.items()}
        changes, self._policy = demotions(triggers, self._policy, self.step_count, t.stable_windows, current, self._window_skipped)
        self._apply(changes, "demoted", "demotion")

    def _decide_on_every_rank(self, decide: Callable[[], None]) -> None:
        """``decide()`` here; under torch.distributed on rank 0, the others adopting its outcome."""
        if self._dist is None:
            decide()
            return

        def decided() -> dict:
            decide()
            return self._decision()

        self._dist.decide(decided, self._adopt, lambda: self.plan)

    def _decision(self) -> dict:
        """What this rank decided at a window end, for the others (`RankAgreement.decide`)."""
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "searched_plan": None if self.searched_plan is None else self.searched_plan.to_dict(),
            "changes": [c.to_dict() for c in self.changes], "policy": self._policy.to_dict(), "last_search_error": self.last_search_error,
            "clock": dataclasses.asdict(self._clock),
        }

    def _adopt(self, decision: Mapping[str, Any]) -> None:
        """Take rank 0's `_decision` as this rank's own."""
        self.changes = [PrecisionChange.from_dict(c) for c in decision["changes"]]
        self._policy = PolicyState.from_dict(decision["policy"])
        self.last_search_error = decision["last_search_error"]
        self._clock = WindowClock(**decision["clock"])  # every rank retries, and starts windows, at one step
        self.searched_plan = None if decision["searched_plan"] is None else Plan.from_dict(decision["searched_plan"])
        self._capture.clear()  # rank 0's search consumed its own; these are spent too
        plan = None if decision["plan"] is None else Plan.from_dict(decision["plan"])
        if plan is not None and plan != self.plan:
            self._set_plan(plan, "decided on rank 0", searched=False)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (tensors are cloned, on device)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": {fqn: info.to_dict() for fqn, info in self._fingerprint.items()},
            "step": self.step_count,
            "window_start": self._clock.window_start,
            "example": None if self._example is None else self._example.to_state(),
            "plan": None if self.plan is None else self.plan.to_dict(),
            "searched_plan": None if self.searched_plan is None else self.searched_plan.to_dict(),
            "changes": [c.to_dict() for c in self.changes],
            "last_search_error": self.last_search_error,
            **self._policy.to_dict(),
            "window_nonfinite": dict(self._window_nonfinite),
            "window_skipped": self._window_skipped,
            "search_failures": self._clock.failures,
            "retry_at": self._clock.retry_at,
            "loss_sum": self._loss_sum,
            "loss_count": self._loss_count,
            "captured": self._capture.state_dict(),
            "meter_next": self._meter_next,
            "scaler": self.scaler.state_dict(),
            "scaler_enabled": self.scaler.enabled,
            "runtime": None if self._runtime is None else self._runtime.state_dict(),
            "profiler": None if self._profiler is None else {"window": self._profiler.window, "state": self._profiler.state_dict()},
            "search": None if self._searching is None else self._searching.state_dict(),
            "known_times": dict(self._known_times),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a scheduler made with the same settings for the same model.
        Before the scheduler is bound to a model (no ``model=``, no forward yet) the state is kept
        and applied when the first forward binds it, so the run continues exactly the same.

        Refused with one `RuntimeStateError` line, before anything changes: a state of another
        version, one missing keys, one saved for a model whose layers have other names or
        shapes, or one whose plan runs a format this scheduler's settings exclude."""
        check_state(state, set(self.state_dict()))
        if self.model is None:
            self._pending_state = state
            return
        check_state_fits(state, self._bound, self.config, self._fixed_plan)
        if self._example is None:
            self._attach(self.model, ModelCall.from_state(state["example"]))  # plan, scaler and profiler come from the state below
        self.step_count = state["step"]
        self.searched_plan = None if state["searched_plan"] is None else Plan.from_dict(state["searched_plan"])
        self.last_search_error = state["last_search_error"]
        self.changes = [PrecisionChange.from_dict(c) for c in state["changes"]]
        self._policy = PolicyState.from_dict(state)
        self._window_nonfinite = dict(state["window_nonfinite"])
        self._window_skipped, failures, retry_at, search, known = (state.get(k, d) for k, d in LATER_STATE.items())
        self._known_times = dict(known)
        self._loss_sum, self._loss_count = state["loss_sum"], state["loss_count"]
        self._capture.load_state_dict(state["captured"])
        self._meter_next = state["meter_next"]
        plan = None if state["plan"] is None else Plan.from_dict(state["plan"])
        self._drop_runtime()
        if plan is not None:
            self._set_plan(plan, "restored", searched=False)
            if self._runtime is not None and state["runtime"] is not None:
                self._runtime.load_state_dict(state["runtime"])
        else:
            self.plan = None
        self._replace_scaler(state["scaler_enabled"], state["scaler"])
        if self._profiler is not None:
            self._profiler.detach()
            self._profiler = None
        if state["profiler"] is not None:
            self._start_profiler(state["profiler"]["window"])
            if self._profiler is not None:
                self._profiler.load_state_dict(state["profiler"]["state"])
        self._close_search()
        phase = "planned" if plan is not None else "searching" if search is not None else "safe" if self.last_search_error is not None else "profiling"
        self._clock = WindowClock(self.config.monitor_window, self.config.profiled_steps, phase, state["window_start"], failures, retry_at)
        if search is not None:
            self._resume_search(search)

    def close(self) -> None:
        """Remove hooks and the plan's layer wrappers, and flush the TensorBoard writer."""
        self._close_search()
        self._drop_runtime()
        if self._profiler is not None:
            self._profiler.detach()
        self._capture.disarm()
        self.scaler.unwatch()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
