"""`DynamicPrecisionScheduler`: precision managed for a training loop, in three lines.

    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=500)
    for x, y in loader:
        with scheduler.precision_context():
            loss = loss_fn(model(x), y)
        scheduler.backward(loss)          # scaled backward
        scheduler.step(optimizer)         # unscale, attribute, clip, step or skip, update
        optimizer.zero_grad()

Lifecycle (each step of it uses the part that owns it; nothing is re-implemented here):

1. **Bind.** Without ``model=`` the scheduler binds to the outermost module run inside the first
   `precision_context` (a one-shot global forward pre-hook), and its inputs are the example the
   layers are traced from (`coverage.find_layers`).
2. **Profile** the first ``monitor_window`` optimizer steps at a safe precision (FP32, or BF16
   when ``max_precision`` is 16) with a `LayerProfiler`, recording the training loss.
3. **Search** at the window's end, in-process and time-bounded: `CostModel` (bytes, seconds),
   `estimate_sensitivity` on the last steps' inputs with the loss linearised at the model's
   output (``Σ y·dL/dy``: the same first derivatives as the real loss, so the Fisher estimate
   is the real one's), `search.planner.build_space` (the profile rules out overflowing formats),
   `solve_exact` and a short Optuna study warm-started with it; then apply the plan.
4. **Watch** every window: a `LayerProfiler` over its last ``monitor_steps`` steps and the
   scaler's per-layer non-finite counts. A layer is **promoted** (FP8/INT8/FP16 → BF16 → FP32)
   when its overflow or underflow fraction, its amax drift against the last window, or its
   count of non-finite steps crosses a `Thresholds` value (non-finite gradients promote at
   once); a promoted layer is **demoted** back one step after ``stable_windows`` quiet windows,
   and that wait doubles each time a demotion has to be undone (hysteresis: no flapping). INT8
   scales are re-calibrated every window. Every change is kept in `changes` with its step and
   reason, and logged.

Loss scaling (`autoprec.scaling.LossScaler`) is on only while some layer is FP16 or FP8; a
non-finite gradient skips the step either way. `state_dict` covers everything (plan, scaler,
amax histories and calibration, profiler statistics, window position, step): a resumed run
continues exactly as the uninterrupted one.

Costs per step: the runtime's (see `runtime`), the scaler's one host sync per optimizer, and in
monitored steps the profiler's (~+10 % per step). A search costs the cost model's measurements
(cached on disk), two forward+backward passes per (layer, format) for sensitivity, and
``search_trials`` proxy trials, bounded by ``search_timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .coverage import find_layers
from .device import format_support
from .errors import AutoprecError, InfeasibleBudgetError, RuntimeStateError, SearchError
from .formats import Format
from .measure import SavedTensorMeter
from .plan import LayerPrecision, Plan
from .runtime import EmulationWarning, apply_plan
from .scaling import LossScaler, LossScaling
from .search.planner import cast_of
from .search.space import DEFAULT_CANDIDATES, Budgets, LayerRules, formats_for_precision

__all__ = ["DynamicPrecisionScheduler", "LossScaling", "Thresholds", "PrecisionChange"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_CAPTURED_STEPS = 2  # steps whose inputs and output gradients feed the sensitivity estimate


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a layer is promoted: more than ``overflow`` / ``underflow`` of a tensor's values out
    of its format's range (with the layer's scaling) in the monitored steps, an amax that moved
    by more than ``amax_drift`` times (either way) since the last window, or ``nonfinite_steps``
    steps with non-finite gradients in one window. Demoted after ``stable_windows`` quiet ones."""

    overflow: float = 1e-3
    underflow: float = 0.25
    amax_drift: float = 16.0
    nonfinite_steps: int = 3
    stable_windows: int = 2


@dataclasses.dataclass(frozen=True)
class PrecisionChange:
    """One layer's format change: at which optimizer step, from what to what, and why."""

    step: int
    fqn: str
    old: Format
    new: Format
    reason: str

    def to_dict(self) -> dict:
        return {"step": self.step, "fqn": self.fqn, "old": self.old.value, "new": self.new.value, "reason": self.reason}


def _needs_loss_scaling(plan: "Plan | None") -> bool:
    # FP16 and FP8 gradients underflow without a scale; BF16, FP32 and INT8 (FP32 backward) do not.
    return plan is not None and any(lp.grad_format in (Format.FP16, Format.FP8_E5M2, Format.FP8_E4M3) for lp in plan.layers.values())


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point()]


class _LinearisedLoss:
    """``loss_fn(model, batch)`` for the sensitivity estimate: per-row terms of ``y · dL/dy``
    at the model's first floating output, times the row count, whose mean is the real loss's
    linearisation (so its gradients, and the Fisher built from them, are the real loss's)."""

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, grad = batch
        out = _float_leaves(model(*inputs))[0]
        rows = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
        terms = (rows.float() * grad.reshape(rows.shape).float()).sum(-1)
        return terms * terms.numel()


class DynamicPrecisionScheduler:
    """Profiles, searches, applies and keeps re-planning per-layer precision for a training loop.

    ``model``: optional (see the module docstring). ``min_precision`` / ``max_precision``: bits
    (8, 16, 32) of the formats a layer may take. ``monitor_window``: optimizer steps per window.
    ``memory_budget``: a fraction of the FP32 bytes (<= 1) or bytes; ``accuracy_budget``: the
    allowed loss increase, relative to the first window's mean training loss (or absolute with
    ``accuracy_relative=False``); None leaves a budget open. ``formats``, ``rules``: the search's
    candidates and layer rules; ``search_trials`` / ``search_timeout_s`` bound the study;
    ``lr``: the learning rate the sensitivity's gradient term assumes. ``loss_scaling``,
    ``max_grad_norm`` (clip the unscaled gradients; None: no clipping), ``thresholds``,
    ``monitor_steps`` (profiled steps at the end of each window), ``log_dir`` (TensorBoard).
    ``measure_costs=False`` uses the roofline time model instead of timing layers on the device
    (deterministic; for tests). ``dynamic=False`` with ``plan=`` runs a fixed plan.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        *,
        min_precision: int = 8,
        max_precision: int = 32,
        monitor_window: int = 500,
        memory_budget: Optional[float] = None,
        accuracy_budget: Optional[float] = None,
        accuracy_relative: bool = True,
        formats: Iterable["Format | str"] = DEFAULT_CANDIDATES,
        rules: LayerRules = LayerRules(),
        search_trials: int = 100,
        search_timeout_s: float = 60.0,
        lr: float = 1e-3,
        loss_scaling: LossScaling = LossScaling(),
        max_grad_norm: Optional[float] = None,
        thresholds: Thresholds = Thresholds(),
        monitor_steps: int = 64,
        log_dir: "str | None" = None,
        measure_costs: bool = True,
        dynamic: bool = True,
        plan: "Plan | None" = None,
        seed: int = 0,
    ):
        for name, value in (("monitor_window", monitor_window), ("monitor_steps", monitor_steps), ("search_trials", search_trials)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SearchError(f"DynamicPrecisionScheduler({name}={value!r}): expected a positive integer")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise SearchError(f"DynamicPrecisionScheduler(max_grad_norm={max_grad_norm!r}): expected a positive number or None")
        if not dynamic and plan is None:
            raise SearchError("DynamicPrecisionScheduler(dynamic=False) needs plan=...; use DynamicPrecisionScheduler.from_plan(model, path)")
        self.formats = formats_for_precision(min_precision, max_precision, [Format.parse(f) for f in formats])
        self.min_precision, self.max_precision = min_precision, max_precision
        self.budgets = Budgets(memory_budget, accuracy_budget, accuracy_relative)
        self.rules = rules
        self.monitor_window = monitor_window
        self.monitor_steps = min(monitor_steps, monitor_window)
        self.search_trials, self.search_timeout_s, self.lr, self.seed = search_trials, search_timeout_s, lr, seed
        self.loss_scaling = loss_scaling
        self.max_grad_norm = max_grad_norm
        self.thresholds = thresholds
        self.measure_costs = measure_costs
        self.dynamic = dynamic
        self.log_dir = log_dir

        self.model: Optional[nn.Module] = model
        self.layers: tuple[str, ...] = ()
        self.step_count = 0
        self.window_start = 0
        self.plan: Optional[Plan] = None
        self.searched_plan: Optional[Plan] = plan
        self.changes: list[PrecisionChange] = []
        self.last_search_error: Optional[str] = None
        self._fixed_plan = plan
        self._example: Optional[tuple] = None
        self._runtime = None
        self._profiler = None
        self._previous_amax: dict[str, float] = {}
        self._history: dict[str, list[str]] = {}  # fqn -> formats it was promoted from (a stack)
        self._stable: dict[str, int] = {}
        self._wait: dict[str, int] = {}
        self._window_nonfinite: dict[str, int] = {}
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._last_loss: Optional[torch.Tensor] = None
        self._captured: list[tuple[tuple, torch.Tensor]] = []
        self._capture_handle = None
        self._bind_handle = None
        self._meter_bytes: Optional[int] = None
        self._meter_next = False
        self._context_stack: Optional[contextlib.ExitStack] = None
        self.scaler = self._new_scaler(enabled=False)
        self._writer = None

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
        """"unbound" (before the first forward), "profiling" (the first window), "planned", or
        "safe" (the search failed, see `last_search_error`: training stays at the safe precision)."""
        if self._example is None:
            return "unbound"
        if self.plan is None:
            return "safe" if self.last_search_error is not None else "profiling"
        return "planned"

    def __repr__(self) -> str:
        counts = self.plan.format_counts() if self.plan is not None else {}
        return f"DynamicPrecisionScheduler(phase={self.phase!r}, step={self.step_count}, plan={counts}, scale={self.scaler.get_scale():g})"

    # -- the loop -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def precision_context(self):
        """Forward passes inside run the plan in force (or the safe precision while profiling).

        Not re-entrant. The first one binds the scheduler to its model (see the module doc).
        """
        if self._context_stack is not None:
            raise RuntimeStateError("precision_context() is already active; it is not re-entrant")
        stack = contextlib.ExitStack()
        self._context_stack = stack
        try:
            if self._example is None:
                self._arm_binding()
            else:
                self._enter_step(stack)
            yield self
        finally:
            self._context_stack = None
            if self._bind_handle is not None:  # the body ran no module: stay unbound
                self._bind_handle.remove()
                self._bind_handle = None
            stack.close()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale, for a loop that calls ``.backward()`` itself:
        ``scheduler.scale(loss).backward()``. Records the loss (the first window's mean anchors a
        relative accuracy budget). No host sync."""
        if self._example is None:
            raise RuntimeStateError("backward() or scale() before any forward ran inside precision_context()")
        detached = loss.detach().float()
        self._last_loss = detached
        if self.plan is None:
            self._loss_sum = detached.clone() if self._loss_sum is None else self._loss_sum + detached
            self._loss_count += 1
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` on the scaled loss (call once per micro-batch). No host sync."""
        self.scale(loss).backward(**kwargs)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Unscale, clip (``max_grad_norm``), step each optimizer unless its gradients are
        non-finite, update the scale, and advance the lifecycle. Returns whether every optimizer
        stepped. One host sync per optimizer (the scaler's)."""
        if not optimizers:
            raise RuntimeStateError("step() needs the optimizer(s): scheduler.step(optimizer)")
        if self._example is None:
            raise RuntimeStateError("step() before any forward ran inside precision_context()")
        if self._profiler is not None and self._profiler.collecting:
            self._profiler.step()
        for optimizer in optimizers:
            if self.max_grad_norm is not None:
                self.scaler.clip_grad_norm_(optimizer, self.max_grad_norm)
            self.scaler.step(optimizer)
        self.scaler.update()  # fills the attribution below, on an overflowing iteration only
        skipped = self.scaler.last_overflowed
        nonfinite = self.scaler.last_nonfinite_layers
        first_bad_output = self.scaler.first_nonfinite_output if self.scaler.last_loss_finite is False else None
        self.step_count += 1
        if self._writer is not None:
            self._writer.log_step(self.step_count, loss=self._last_loss, loss_scale=self.scaler.scale_tensor, skipped=skipped)
        if self.dynamic and self.plan is not None:
            self._on_nonfinite(nonfinite, first_bad_output)
        self._advance()
        return not skipped

    # -- binding --------------------------------------------------------------------------------

    def _arm_binding(self) -> None:
        def bind(module, args, kwargs):
            if self._bind_handle is not None:
                self._bind_handle.remove()
                self._bind_handle = None
            self._bind(module, tuple(args) if args else (kwargs,))
            self._enter_step(self._context_stack)

        if self.model is not None:
            self._bind_handle = self.model.register_forward_pre_hook(bind, with_kwargs=True)
        else:
            self._bind_handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: bind(m, a, {}))

    @staticmethod
    def _inputs(example: tuple) -> Any:
        """The example as `find_layers` and the profiler take it: a tuple of positional inputs,
        or the keyword dict when the model was called with keywords only."""
        return example[0] if len(example) == 1 and isinstance(example[0], Mapping) else tuple(example)

    def _attach(self, model: nn.Module, example: tuple) -> None:
        """Take ``model`` and its example inputs: find the layers, open the TensorBoard writer."""
        self.model = model
        self._example = tuple(example)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmulationWarning)
            self.layers = tuple(find_layers(model, self._inputs(self._example)))
        if not self.layers:
            raise AutoprecError(f"{type(model).__name__} runs no matrix product: autoprec has no layer to manage")
        if self.log_dir is not None and self._writer is None:
            from .monitoring import TrainingWriter

            self._writer = TrainingWriter(self.log_dir, flush_every=min(100, self.monitor_window))

    def _bind(self, model: nn.Module, example: tuple) -> None:
        if self._fixed_plan is not None:
            self._fixed_plan.validate(model, self._inputs(example))  # a plan for another model: PlanError naming each layer
        self._attach(model, example)
        self.scaler.watch(model, list(self.layers), outputs=True)
        if self._fixed_plan is not None:
            self._set_plan(self._fixed_plan, "the given plan")
        else:
            safe = Format.FP32 if self.max_precision == 32 else Format.BF16
            if safe is not Format.FP32:
                self._set_plan(Plan({fqn: LayerPrecision(safe, reason="safe precision while profiling") for fqn in self.layers}), "profiling", searched=False)
                self.plan = None  # still profiling: the search has not run
        if self.dynamic and self._fixed_plan is None:
            self._start_profiler(self.monitor_window)
        self._maybe_start_monitor()
        logger.info("autoprec: bound to %s with %d layers", type(model).__name__, len(self.layers))

    def _enter_step(self, stack: contextlib.ExitStack) -> None:
        if self._runtime is not None:
            stack.enter_context(self._runtime)
        if self._meter_next:
            meter = stack.enter_context(SavedTensorMeter(list(self.model.parameters())))
            stack.callback(lambda: setattr(self, "_meter_bytes", meter.total_bytes))
            self._meter_next = False
        if self.phase == "profiling" and self.dynamic and self.step_count >= self.window_start + self.monitor_window - _CAPTURED_STEPS:
            self._capture_handle = self.model.register_forward_hook(self._capture)
            stack.callback(self._stop_capture)

    def _capture(self, module, args, output) -> None:
        leaves = [t for t in _float_leaves(output) if t.requires_grad]
        if not leaves:
            return
        inputs = tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args)
        entry: list = [inputs, None]
        self._captured = (self._captured + [entry])[-_CAPTURED_STEPS:]
        leaves[0].register_hook(lambda g: entry.__setitem__(1, g.detach().clone()))

    def _stop_capture(self) -> None:
        if self._capture_handle is not None:
            self._capture_handle.remove()
            self._capture_handle = None

    # -- plans ----------------------------------------------------------------------------------

    def _new_scaler(self, enabled: bool) -> LossScaler:
        return LossScaler(**dataclasses.asdict(self.loss_scaling), enabled=enabled)

    def _replace_scaler(self, enabled: bool, state: Mapping[str, Any]) -> None:
        """A scaler with ``enabled`` and ``state``, watching the layers in place of the current one."""
        self.scaler.unwatch()  # its hooks would keep recording into a scaler nobody updates
        self.scaler = self._new_scaler(enabled=enabled)
        self.scaler.load_state_dict(state)
        self.scaler.watch(self.model, list(self.layers), outputs=True)

    def _set_plan(self, plan: Plan, why: str, searched: bool = True) -> None:
        """Install ``plan``: a new runtime keeping the amax histories and calibration of layers
        whose precision did not change; the scaler switched on or off as the plan needs."""
        old = self._runtime
        runtime = apply_plan(self.model, plan, validate=False)
        if old is not None:
            kept = {fqn: s for fqn, s in old.state_dict()["layers"].items() if fqn in plan.layers and old.plan.layers.get(fqn) == plan.layers[fqn]}
            runtime.load_state_dict({"layers": kept})
        self._runtime = runtime if any(lp.format is not Format.FP32 for lp in plan.layers.values()) else None
        self.plan = plan
        if searched and self.searched_plan is None:
            self.searched_plan = plan
        if _needs_loss_scaling(plan) != self.scaler.enabled:
            self._replace_scaler(_needs_loss_scaling(plan), self.scaler.state_dict())
        if self._writer is not None:
            self._writer.log_plan(self.step_count, plan, name="plan")
        logger.info("autoprec: step %d: plan %s (%s)", self.step_count, plan.format_counts(), why)

    def _change(self, fqn: str, new: Format, reason: str) -> None:
        old = self.plan.layers[fqn].format
        self.changes.append(PrecisionChange(self.step_count, fqn, old, new, reason))
        logger.info("autoprec: step %d: %s %s -> %s (%s)", self.step_count, fqn, old.value, new.value, reason)
        if self._writer is not None:
            self._writer.log_change(self.step_count, fqn, old, new, reason)

    def _wider(self, fmt: Format) -> Optional[Format]:
        """The next format up: 8-bit and FP16 -> BF16 (FP32's range) -> FP32, within the bounds."""
        ladder = [f for f in (Format.BF16, Format.FP32) if f.bits <= self.max_precision and format_support(f, self._device()).runnable]
        if fmt is Format.FP16 or fmt.bits < 16:
            return next(iter(ladder), None)
        return Format.FP32 if fmt is Format.BF16 and Format.FP32 in ladder else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _promote(self, fqns: Sequence[str], reasons: Mapping[str, str]) -> None:
        changes = {}
        for fqn in fqns:
            current = self.plan.layers[fqn].format
            wider = self._wider(current)
            if wider is None:
                continue
            self._history.setdefault(fqn, []).append(current.value)
            self._stable[fqn] = 0
            changes[fqn] = LayerPrecision(wider, reason=f"promoted at step {self.step_count}: {reasons[fqn]}")
            self._change(fqn, wider, reasons[fqn])
        if changes:
            self._set_plan(self.plan.with_layers(changes), "promotion")

    def _on_nonfinite(self, layers: Sequence[str], first_bad_output: Optional[str]) -> None:
        """Count non-finite gradients per layer this window; promote at the threshold at once."""
        for fqn in layers:
            if fqn in self.plan.layers:
                self._window_nonfinite[fqn] = self._window_nonfinite.get(fqn, 0) + 1
        if first_bad_output is not None and first_bad_output in self.plan.layers:
            self._window_nonfinite[first_bad_output] = self._window_nonfinite.get(first_bad_output, 0) + 1
        due = [f for f, n in self._window_nonfinite.items() if n >= self.thresholds.nonfinite_steps and self.plan.layers[f].format is not Format.FP32]
        if due:
            self._promote(due, {f: f"non-finite gradients or outputs in {self._window_nonfinite[f]} steps of this window" for f in due})
            for f in due:
                self._window_nonfinite[f] = 0

    # -- windows --------------------------------------------------------------------------------

    def _start_profiler(self, window: int) -> None:
        from .profiling import LayerProfiler, with_grad_formats

        formats = with_grad_formats(self.formats)
        inputs = self._inputs(self._example)
        self._profiler = LayerProfiler(self.model, inputs, formats=formats, window=window)
        if set(self._profiler.layers) != set(self.layers):
            self._profiler = LayerProfiler(self.model, inputs, formats=formats, window=window, module_filter=lambda m, fqn: fqn in self.layers)
        self._profiler.attach()

    def _advance(self) -> None:
        if not self.dynamic or self.phase == "safe":
            return
        end = self.window_start + self.monitor_window
        if self.step_count == end - 1:
            self._meter_next = True  # measure the saved bytes of the window's last step
        if self.step_count < end:
            self._maybe_start_monitor()
            return
        if self._writer is not None:  # once per window: one sync for all layers' histograms
            modules = dict(self.model.named_modules())
            grads = {fqn: p.grad for fqn in self.layers for p in modules[fqn].parameters(recurse=False) if p.dim() >= 2 and p.grad is not None}
            self._writer.log_grad_histograms(self.step_count, grads)
        profile = self._profiler.profile() if self._profiler is not None and self._profiler.steps else None
        if self._profiler is not None:
            self._profiler.detach()
            self._profiler = None
        if self.plan is None:
            self._search(profile)
        else:
            self._review_window(profile)
        self.window_start = self.step_count
        self._window_nonfinite = {}
        self._maybe_start_monitor()

    def _maybe_start_monitor(self) -> None:
        """Profile the last ``monitor_steps`` steps of each planned window."""
        if self.dynamic and self.plan is not None and self._profiler is None and self.step_count >= self.window_start + self.monitor_window - self.monitor_steps:
            self._start_profiler(self.monitor_steps)

    def _search(self, profile) -> None:
        """The first window's search (see the module doc); on failure keep the safe precision."""
        from .costs import CostModel
        from .search import run_proxy_study, solve_exact
        from .search.planner import build_space, in_budget_terms, layer_reasons, plan_from_solution
        from .sensitivity import FisherEstimator, estimate_sensitivity

        loss = float(self._loss_sum / self._loss_count) if self._loss_count else None
        batches = [(inputs, grad) for inputs, grad in self._captured if grad is not None]
        self.scaler.unwatch()  # the search's own forwards are not training steps
        try:
            if not batches:
                raise SearchError("no output gradients were captured in the window's last steps; call scheduler.backward(loss) inside the loop")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EmulationWarning)
                costs = CostModel.build(self.model, self._example, formats=self.formats, measure=self.measure_costs)
                sensitivity = estimate_sensitivity(
                    self.model, batches, _LinearisedLoss(), [f for f in self.formats if f is not Format.FP32],
                    layers=list(costs.layers), example_inputs=self._example, estimator=FisherEstimator(lr=self.lr),
                )
            space, ruled_out = build_space(costs, sensitivity, profile, formats=self.formats, rules=self.rules,
                                           min_precision=self.min_precision, max_precision=self.max_precision)
            fp32_bytes = costs.fp32_bytes()
            memory = self.budgets.memory_bytes(fp32_bytes)
            loss_budget = self.budgets.loss_increase(loss)
            try:
                exact = solve_exact(space, memory, loss_budget)
            except InfeasibleBudgetError as exc:
                raise in_budget_terms(exc, fp32_bytes, loss if self.budgets.accuracy_relative else None, "") from None
            warm = [exact.assignment] + [a for a in (space.uniform(f) for f in self.formats) if a is not None]
            import optuna

            verbosity = optuna.logging.get_verbosity()
            optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per trial in the training log
            try:
                proxy = run_proxy_study(space, memory, loss_budget, n_trials=self.search_trials, seed=self.seed, warm_start=warm, timeout=self.search_timeout_s)
            finally:
                optuna.logging.set_verbosity(verbosity)
            best = proxy.best if proxy.best is not None else exact
            budgets = {"memory": self.budgets.memory, "memory_bytes": memory, "accuracy": self.budgets.accuracy,
                       "loss_increase": loss_budget, "baseline_loss": loss}
            plan = plan_from_solution(space, costs, best, layer_reasons(space, best.assignment, self.rules, ruled_out), budgets,
                                      {"step": self.step_count, "trials": proxy.trials, "source": "DynamicPrecisionScheduler"})
        except AutoprecError as exc:
            self.last_search_error = str(exc)
            logger.warning("autoprec: step %d: search failed, training stays at the safe precision: %s", self.step_count, exc)
            return
        finally:
            self._captured = []
            self.scaler.watch(self.model, list(self.layers), outputs=True)
        self._set_plan(plan, f"searched after {self.step_count} steps")
        if self._writer is not None and self._meter_bytes is not None:
            self._writer.log_memory(self.step_count, predicted_bytes=plan.predicted.get("bytes"), measured_bytes=self._meter_bytes)

    def _review_window(self, profile) -> None:
        """Re-calibrate, promote on thresholds, demote after quiet windows (hysteresis)."""
        t = self.thresholds
        counts: dict[str, dict[str, float]] = {}
        triggers: dict[str, str] = {}
        for fqn in self.layers:
            lp = self.plan.layers[fqn]
            stats = profile.layers.get(fqn) if profile is not None else None
            row = {"nonfinite": float(self._window_nonfinite.get(fqn, 0))}
            if stats is not None:
                for kind, ts in stats.tensors.items():
                    fmt, scaling = cast_of(lp, kind)
                    if fmt is Format.FP32 or fmt.value not in ts.fractions:
                        continue
                    over, under = ts.overflow(fmt, scaling), ts.underflow(fmt, scaling)
                    row[f"overflow_{kind}"], row[f"underflow_{kind}"] = over, under
                    if over > t.overflow:
                        triggers.setdefault(fqn, f"{over:.2%} of {kind} values overflow {fmt.value}")
                    elif under > t.underflow:
                        triggers.setdefault(fqn, f"{under:.2%} of {kind} values underflow {fmt.value}")
                act = stats.tensors.get("activation")
                finite = [a for a in (act.amax if act is not None else ()) if math.isfinite(a) and a > 0]
                if finite:
                    amax = max(finite)
                    before = self._previous_amax.get(fqn)
                    self._previous_amax[fqn] = amax
                    if before and lp.format is not Format.FP32 and max(amax / before, before / amax) > t.amax_drift:
                        triggers.setdefault(fqn, f"activation amax drifted {before:.3g} -> {amax:.3g}")
            counts[fqn] = row
        if self._writer is not None:
            self._writer.log_layer_counts(self.step_count, counts)
            if self._meter_bytes is not None:
                self._writer.log_memory(self.step_count, predicted_bytes=self.plan.predicted.get("bytes"), measured_bytes=self._meter_bytes)
        if self._runtime is not None:
            int8 = [fqn for fqn, lp in self.plan.layers.items() if lp.format is Format.INT8]
            if int8:
                self._runtime.recalibrate(int8)
        promote = [fqn for fqn in triggers if self.plan.layers[fqn].format is not Format.FP32]
        self._promote(promote, triggers)
        demote = {}
        for fqn, stack in self._history.items():
            if not stack or fqn in triggers:
                continue
            self._stable[fqn] = self._stable.get(fqn, 0) + 1
            if self._stable[fqn] >= self._wait.get(fqn, t.stable_windows):
                back = Format.parse(stack.pop())
                self._stable[fqn] = 0
                # If this layer was demoted before and promoted again, it waits twice as long.
                self._wait[fqn] = self._wait.get(fqn, t.stable_windows) * 2
                reason = f"stable for {self._wait[fqn] // 2} windows"
                self._change(fqn, back, reason)
                demote[fqn] = LayerPrecision(back, reason=f"demoted at step {self.step_count}: {reason}")
        if demote:
            self._set_plan(self.plan.with_layers(demote), "demotion")

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (tensors are cloned, on device)."""
        return {
            "version": _STATE_VERSION,
            "step": self.step_count,
            "window_start": self.window_start,
            "example": self._example,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "searched_plan": None if self.searched_plan is None else self.searched_plan.to_dict(),
            "changes": [c.to_dict() for c in self.changes],
            "last_search_error": self.last_search_error,
            "history": {k: list(v) for k, v in self._history.items()},
            "stable": dict(self._stable),
            "wait": dict(self._wait),
            "previous_amax": dict(self._previous_amax),
            "window_nonfinite": dict(self._window_nonfinite),
            "loss_sum": self._loss_sum,
            "loss_count": self._loss_count,
            "captured": [(inputs, grad) for inputs, grad in self._captured],
            "meter_next": self._meter_next,
            "scaler": self.scaler.state_dict(),
            "scaler_enabled": self.scaler.enabled,
            "runtime": None if self._runtime is None else self._runtime.state_dict(),
            "profiler": None if self._profiler is None else {"window": self._profiler.window, "state": self._profiler.state_dict()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a scheduler made with the same settings for the same model
        (pass ``model=`` or load after the first forward)."""
        if state.get("version") != _STATE_VERSION:
            raise RuntimeStateError(f"scheduler state version {state.get('version')!r} is not {_STATE_VERSION}; it was saved by another autoprec")
        if self.model is None:
            raise RuntimeStateError("load_state_dict() needs the model: pass model= to the scheduler before loading")
        if self._example is None:
            self._attach(self.model, state["example"])  # plan, scaler and profiler come from the state below
        self.step_count, self.window_start = state["step"], state["window_start"]
        self.searched_plan = None if state["searched_plan"] is None else Plan.from_dict(state["searched_plan"])
        self.last_search_error = state["last_search_error"]
        self.changes = [PrecisionChange(c["step"], c["fqn"], Format.parse(c["old"]), Format.parse(c["new"]), c["reason"]) for c in state["changes"]]
        self._history = {k: list(v) for k, v in state["history"].items()}
        self._stable, self._wait = dict(state["stable"]), dict(state["wait"])
        self._previous_amax, self._window_nonfinite = dict(state["previous_amax"]), dict(state["window_nonfinite"])
        self._loss_sum, self._loss_count = state["loss_sum"], state["loss_count"]
        self._captured = [[inputs, grad] for inputs, grad in state["captured"]]
        self._meter_next = state["meter_next"]
        plan = None if state["plan"] is None else Plan.from_dict(state["plan"])
        self._runtime = None
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
            self._profiler.load_state_dict(state["profiler"]["state"])

    def close(self) -> None:
        """Remove hooks and flush the TensorBoard writer (the plan runtime is only active inside
        `precision_context`)."""
        if self._profiler is not None:
            self._profiler.detach()
        self._stop_capture()
        self.scaler.unwatch()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
