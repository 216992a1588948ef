"""Dynamic loss scaling: a ``torch.amp.GradScaler`` with a floor, hysteresis and per-layer attribution.

`LossScaler` is a ``GradScaler`` (``isinstance`` holds) that implements each public method itself on
torch's two fused ops, overriding none of GradScaler's private ones (they change between releases):
``torch._amp_foreach_non_finite_check_and_unscale_`` (one pass per device and dtype) and
``torch._amp_update_scale_``. Fused / capturable optimizers get ``optimizer.grad_scale`` /
``optimizer.found_inf``, as GradScaler hands them. Which layers overflowed is `scaling.nonfinite`'s.
Usage::

    scaler = LossScaler().watch(model)        # defaults: 4096, x2.0 after 2000 clean steps, x0.5
    for x, y in loader:
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(optimizer)                # skipped when a gradient is inf/NaN
        scaler.update()                       # once per iteration, after every optimizer stepped
    scaler.last_nonfinite_layers              # ("blocks.3.mlp.fc2",) after an overflow, else ()

Host syncs: one ``.item()`` per optimizer (and device) in `step`, the skip decision, as GradScaler;
``scale``, ``unscale_`` and ``update`` never sync. With only fused optimizers nothing syncs: `update`
runs the rule on the device and keeps flags and gradient references until the next iteration
begins; the first read of a result brings them over in one transfer (unread for 1024 iterations,
`update` reads them itself). An overflow adds one inf-norm per gradient and one transfer.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn
from torch.amp.grad_scaler import OptState

from ..errors import RuntimeStateError, ScalingError
from .config import (DEFAULT_BACKOFF_FACTOR, DEFAULT_GROWTH_FACTOR, DEFAULT_GROWTH_INTERVAL, DEFAULT_HYSTERESIS,
                             DEFAULT_INIT_SCALE, DEFAULT_MIN_SCALE, FLOAT32_MAX, LossScaling, check_config, is_int, is_number)
from .nonfinite import Attribution, Layers, OutputWatch, check_and_unscale, resolve_layers, summed_flags
from .nonfinite import floating_tensors as _floating_tensors
from .nonfinite import nonfinite_gradients as _nonfinite_gradients
from .nonfinite import to_host as _to_host

__all__ = [
    "ScalingError", "LossScaler", "LossScaling", "OutputWatch", "DEFAULT_INIT_SCALE", "DEFAULT_GROWTH_FACTOR",
    "DEFAULT_BACKOFF_FACTOR", "DEFAULT_GROWTH_INTERVAL", "DEFAULT_MIN_SCALE", "DEFAULT_HYSTERESIS",
]

@dataclasses.dataclass
class _OptimizerState:
    """One optimizer's part of the iteration (GradScaler's ``OptState`` stages): its non-finite
    flags per device once checked (0-d float32, > 0: found), and whether it overflowed once the
    host knows (its skip decision)."""

    stage: OptState = OptState.READY
    found: dict[torch.device, torch.Tensor] = dataclasses.field(default_factory=dict)
    optimizer: Any = None  # set by LossScaler._begin
    overflowed: Optional[bool] = None


def _scaled(value: Any, scale: torch.Tensor) -> Any:
    """``value`` (a tensor or nested iterable of them) times ``scale``, as GradScaler's ``scale``."""
    if isinstance(value, torch.Tensor):
        return value * scale.to(device=value.device, non_blocking=True)
    if isinstance(value, Iterable):
        scaled = map(lambda v: _scaled(v, scale), value)
        return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
    raise ValueError("outputs must be a Tensor or an iterable of Tensors")


class _GradientTimesScale(torch.autograd.Function):
    """The loss as it is forward, its gradient times the scale backward: the gradient ``loss *
    scale`` would send, with the loss's own value left for the caller to report."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(scale)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        return (grad * scale.to(grad.device)).to(grad.dtype), None


def _result(name: str, doc: str, resolve: bool = True) -> property:
    """A read-only view of the `OverflowRecord` entry ``name`` (containers as copies)."""

    def get(self: "LossScaler") -> Any:
        if resolve:
            self._resolve()
        value = getattr(self._record, name)
        return tuple(value) if isinstance(value, collections.deque) else dict(value) if isinstance(value, dict) else value

    return property(get, doc=doc)


class LossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a floor, hysteresis, autoprec's defaults and per-layer
    attribution of overflows (costs: see the module docstring).

    The scale rule, once per iteration in `update`: a *clean* iteration is GradScaler's
    (``torch._amp_update_scale_``: x ``growth_factor`` after ``growth_interval`` clean ones in a
    row), and a growth restores the hysteresis budget. An *overflowing* one restarts the count and
    spends one unit of the budget (``hysteresis``); once spent, x ``backoff_factor``, never below
    ``min_scale``. So ``hysteresis - 1`` overflows per growth interval are tolerated (Megatron-LM's
    ``DynamicGradScaler``, DeepSpeed's ``consecutive_hysteresis=False``); with ``hysteresis=1`` and
    the floor out of reach this is GradScaler. Every overflowing optimizer step is skipped; with
    several optimizers each skips on its own gradients, and the scale backs off when any did.

    ``enabled=False`` is a pass-through (`scale` returns its input, `get_scale` is 1.0, fused
    optimizers get 1) that **still skips a non-finite step** (counted and attributed) through the
    same fused check; the scale state is kept and saved unchanged.

    Attribution, filled by `update`: after `watch`, per layer fqn; parameters no watched layer
    owns, under their fqn; of an unwatched model, as ``"<Optimizer>.param_groups[i][j]"``.

    Not supported (`RuntimeStateError`): ``optimizer.step(closure=...)`` (the closure recomputes
    the gradients after the check), and FP16 gradients when enabled (unscaled in place they flush
    to zero; keep FP32 master weights, as autoprec's runtime does).
    """

    def __init__(
        self,
        init_scale: float = DEFAULT_INIT_SCALE,
        growth_factor: float = DEFAULT_GROWTH_FACTOR,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        growth_interval: int = DEFAULT_GROWTH_INTERVAL,
        *,
        min_scale: float = DEFAULT_MIN_SCALE,
        hysteresis: int = DEFAULT_HYSTERESIS,
        enabled: bool = True,
        max_events: int = 100,
    ):
        check_config("LossScaler", init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis, max_events)
        if not isinstance(enabled, bool):
            raise ScalingError(f"LossScaler(enabled={enabled!r}): enabled must be True or False")
        # The base is disabled: every public method is implemented below, so a base method left
        # over (none is called) would be a pass-through rather than read state it does not have.
        super().__init__("cpu", enabled=False)
        self._scaling = enabled
        self._init_scale, self._init_growth_tracker = float(init_scale), 0
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._min_scale = float(min_scale)
        self._hysteresis = int(hysteresis)
        self._init_hysteresis_tracker = self._hysteresis
        # 0-d device tensors, None until made on the device of the first loss or gradient met
        # (`_lazy_init`, before any method that reads them): typed as the tensors they then are.
        self._scale: torch.Tensor = None  # type: ignore[assignment]  # float32
        self._growth_tracker: torch.Tensor = None  # type: ignore[assignment]  # int32: clean iterations in a row
        self._hysteresis_tracker: torch.Tensor = None  # type: ignore[assignment]  # int32: overflows left before a back-off
        self._unit: torch.Tensor = None  # type: ignore[assignment]  # 1.0 beside the scale: what a disabled scaler applies
        self._max_events = int(max_events)
        self._record = Attribution(self._max_events)

        # The iteration in progress.
        self._states: collections.defaultdict[int, _OptimizerState] = collections.defaultdict(_OptimizerState)

    # -- configuration (GradScaler's getters and setters) ------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._scaling

    def is_enabled(self) -> bool:
        return self._scaling

    @property
    def min_scale(self) -> float:
        return self._min_scale

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    # -- results (of the last completed iteration; read, they bring deferred flags to the host) --

    steps = _result("steps", "Iterations completed (`update` calls).", resolve=False)
    skipped_steps = _result("skipped_steps", "Iterations in which some gradient was non-finite (some optimizer step skipped).")
    nonfinite_counts = _result("nonfinite_counts", "Layer fqn -> iterations in which its gradients were non-finite (a copy).")
    last_overflowed = _result("last_overflowed", "Whether some gradient of the last iteration was inf/NaN (so some step was skipped).")
    last_nonfinite_layers = _result("last_nonfinite_layers", "Layers with non-finite gradients in the last iteration, in model order; () when clean.")
    last_loss_finite = _result(
        "last_loss_finite", "After an overflowing iteration, whether every tensor passed to `scale` was finite; None after a clean one."
    )
    first_nonfinite_output = _result(
        "first_nonfinite_output",
        "With ``watch(..., outputs=True)``, after an overflowing iteration: the first layer, in call order, whose "
        "forward output was non-finite (what made an inf/NaN loss), else None.",
    )
    events = _result("events", "The last ``max_events`` overflows as ``(iteration, layers)``; iteration counts from 0.")

    @property
    def output_watch(self) -> Optional[OutputWatch]:
        """The `OutputWatch` that ``watch(..., outputs=True)`` attached, if any."""
        return self._record.output_watch

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled). One sync (an ``.item()``) when enabled and the
        scale exists; `scale_tensor` reads it without one."""
        if not self._scaling:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    @property
    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The scale applied, a 0-d float32 device tensor (1.0 when disabled; None before the
        first `scale`), for logging without a sync. Do not modify it."""
        return None if self._scale is None else self._applied()

    def _applied(self) -> torch.Tensor:
        return self._scale if self._scaling else self._unit

    # -- attribution setup ------------------------------------------------------------------------

    def watch(self, model: nn.Module, layers: Layers = None, *, outputs: bool = False) -> "LossScaler":
        """Report gradients per layer of ``model``. Replaces a previous watch.

        Args:
            model: the model whose optimizers this scaler steps.
            layers: module fqns (a list, not one string; the root ``""`` only when named) or a
                ``(module, fqn) -> bool`` filter; None: every module that directly owns
                parameters. A parameter belongs to the innermost watched module holding it;
                others are reported under their parameter fqn.
            outputs: also attach an `OutputWatch` on the same layers (one reduction per layer
                call), read on overflowing iterations to fill `first_nonfinite_output`.

        Returns:
            This scaler.

        Raises:
            ScalingError: ``model`` is not an ``nn.Module``, ``layers`` is one string or names a
                module the model lacks.
        """
        if not isinstance(model, nn.Module):
            raise ScalingError(f"LossScaler.watch(model={type(model).__name__}): model must be an nn.Module")
        fqns = resolve_layers(model, layers, "LossScaler.watch")
        self._record.watch(model, fqns, outputs)
        return self

    def watch_outputs(self, on: bool) -> None:
        """Arm or disarm the per-layer output checks on the watched model (as
        ``watch(..., outputs=on)``, keeping the gradient attribution as it is). Armed, every
        layer call costs one reduction.

        Args:
            on: True arms the checks (does nothing before `watch`), False removes them.
        """
        self._record.watch_outputs(on)

    @property
    def watching_outputs(self) -> bool:
        return self._record.output_watch is not None

    def unwatch(self) -> None:
        """Forget the watched model and remove the output hooks, if any."""
        self._record.unwatch()

    # -- the training-loop calls --------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        def full(value, dtype):
            return torch.full((), value, dtype=dtype, device=device)

        self._scale, self._unit = full(self._init_scale, torch.float32), full(1.0, torch.float32)
        self._growth_tracker = full(self._init_growth_tracker, torch.int32)
        self._hysteresis_tracker = full(self._init_hysteresis_tracker, torch.int32)

    def _begin(self, optimizer: torch.optim.Optimizer, call: str) -> _OptimizerState:
        """``optimizer``'s state after the checks of a ``call`` to `unscale_` or `step`; creates
        the scale on its gradients' device when no `scale` call did."""
        state = self._states[id(optimizer)]
        if state.stage is OptState.STEPPED:
            raise RuntimeStateError(
                f"LossScaler.{call}(optimizer) after step(optimizer) in the same iteration; "
                "call update() once per iteration, after every optimizer stepped"
            )
        if call == "unscale_" and state.stage is OptState.UNSCALED:
            raise RuntimeStateError(
                "LossScaler.unscale_(optimizer) was already called for this optimizer since the last update(); "
                "call it once per optimizer per iteration, after the last backward pass"
            )
        self._record.release_held()
        if self._scale is None:
            grads = (p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            first = next(grads, None)
            self._lazy_init(first.device if first is not None else torch.device("cpu"))
        state.optimizer = optimizer
        return state

    def scale(self, outputs):
        """Multiply by the scale, as float32 (GradScaler's); unchanged when disabled. Keeps a
        reference to the tensors of a tensor, list or tuple, checked only if the iteration
        overflows. No sync. The first call creates the scale on its first tensor's device.

        Args:
            outputs (torch.Tensor | Iterable): the loss: a tensor or a nested list / tuple /
                iterable of tensors.

        Returns:
            scaled (torch.Tensor | Iterable): ``outputs`` times the scale, in the same structure
                (``outputs`` itself when disabled).

        Raises:
            ScalingError: ``outputs`` is neither a tensor nor an iterable.
        """
        if not isinstance(outputs, (torch.Tensor, Iterable)):
            raise ScalingError(f"LossScaler.scale({type(outputs).__name__}): expected a tensor or an iterable of tensors")
        self._note_losses(outputs)
        if not self._scaling:
            return outputs
        if self._scale is None:  # an iterable with no tensor yet seen: its first tensor's device
            first = next((t for t in _floating_tensors(list(outputs)) if isinstance(t, torch.Tensor)), None)
            self._lazy_init(first.device if first is not None else torch.device("cpu"))
        return _scaled(outputs, self._scale)

    def _note_losses(self, outputs: Any) -> None:
        """Keep the loss tensors (checked if the iteration overflows); the scale made on the first one's device."""
        self._record.release_held()
        tensors = [t.detach() for t in _floating_tensors(outputs)]
        self._record.losses.extend(tensors)
        if self._scale is None and tensors:
            self._lazy_init(tensors[0].device)

    def scale_gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss with its value unchanged and its gradient multiplied by the scale, for a
        caller that both reports the tensor it gets and backpropagates it (a
        ``torch.distributed.pipelining`` schedule's ``loss_fn``: its ``losses`` then hold the
        true losses). Recorded as `scale` records it; the gradients it sends are those of
        ``scale(loss)``. No sync; one scalar copy forward, one multiply backward.

        Args:
            loss: a floating-point tensor.

        Returns:
            ``loss``'s value in a new tensor whose gradient is scaled (``loss`` itself when
            disabled).

        Raises:
            ScalingError: ``loss`` is not a floating-point tensor.
        """
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise ScalingError(f"LossScaler.scale_gradient({type(loss).__name__}): expected a floating-point loss tensor")
        self._note_losses(loss)
        if not self._scaling or self._scale is None:
            return loss
        return _GradientTimesScale.apply(loss, self._scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide an optimizer's gradients by the scale in place and check them, in one fused
        pass per device and dtype (when disabled, the check alone). Optional: `step` does it;
        call it to clip or inspect the true gradients. No sync.

        Args:
            optimizer: an optimizer whose gradients came from a loss passed through `scale`;
                once per optimizer per iteration, after the last backward.

        Raises:
            RuntimeStateError: called twice for ``optimizer`` in one iteration or after its
                `step`, or (enabled) a gradient is FP16.
        """
        state = self._begin(optimizer, "unscale_")
        inv_scale = self._scale.double().reciprocal().float() if self._scaling else self._unit  # GradScaler's
        state.found = check_and_unscale(optimizer, inv_scale, refuse_fp16=self._scaling)
        state.stage = OptState.UNSCALED

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
                        whole: "Optional[Callable[[torch.Tensor, float], torch.Tensor]]" = None) -> torch.Tensor:
        """`unscale_` (unless done) and clip an optimizer's gradients to a total norm, as
        ``torch.nn.utils.clip_grad_norm_`` does. Unlike it, a non-finite norm leaves the
        gradients unchanged: its coefficient would be NaN and spread to every gradient, so
        attribution would name every layer (the step is skipped either way). Cost:
        clip_grad_norm_'s passes (one norm, one multiply per gradient) and one 0-d ``where``.

        Args:
            optimizer: the optimizer whose gradients to clip, before its `step`.
            max_norm: the largest total norm kept, a finite number > 0.
            norm_type: the p of the p-norm (``inf`` for the max norm).
            whole: the whole model's norm from these gradients' norm and ``norm_type``, where
                they are a part of the model's (a pipeline stage's: `RankAgreement.whole_norm`).

        Returns:
            The total norm of the unscaled gradients before clipping: a 0-d device tensor, not
            read (no sync).

        Raises:
            ScalingError: ``max_norm`` is not a finite number > 0.
            RuntimeStateError: as `unscale_`, when it runs here.
        """
        if not is_number(max_norm) or max_norm <= 0:
            raise ScalingError(f"LossScaler.clip_grad_norm_(max_norm={max_norm!r}): max_norm must be a finite number > 0")
        if self._states[id(optimizer)].stage is OptState.READY:
            self.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if whole is not None:
            total = whole(total, norm_type)
        # A zero norm makes the clip coefficient clamp to 1: the gradients stay as they are.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.where(total.isfinite(), total, 0.0))
        return total

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """`unscale_` (unless done) and whether an optimizer's gradients held an inf/NaN. No sync.
        For agreeing across ranks (`autoprec.distributed`) before `step` reads it.

        Args:
            optimizer: the optimizer to check (one holding no gradient found nothing).

        Returns:
            A 0-d float32 device tensor, > 0 when an inf/NaN was found (a copy).

        Raises:
            RuntimeStateError: as `unscale_`, when it runs here.
        """
        if self._states[id(optimizer)].stage is OptState.READY:
            self.unscale_(optimizer)
        flags = list(self._states[id(optimizer)].found.values())
        if not flags:  # no gradient: nothing non-finite, on the device its parameters live on
            device = next((p.device for group in optimizer.param_groups for p in group["params"]), torch.device("cpu"))
            return torch.zeros((), dtype=torch.float32, device=device)
        return summed_flags(flags, flags[0].device, copy=True)

    def set_found_inf(self, optimizer: torch.optim.Optimizer, found: bool) -> None:
        """Overwrite an optimizer's non-finite flag after `found_inf`: `step` then skips, and
        `update` backs off, exactly when ``found``.

        Args:
            optimizer: an optimizer `found_inf` checked this iteration (otherwise nothing changes).
            found: the decision, e.g. reduced across ranks.
        """
        for i, flag in enumerate(self._states[id(optimizer)].found.values()):
            flag.fill_(1.0 if found and i == 0 else 0.0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless `unscale_` did) and step the optimizer unless a gradient is inf/NaN.
        One sync per device (the skip decision), none for fused / capturable optimizers, which
        unscale and skip on the device.

        Args:
            optimizer: the optimizer to step, once per iteration.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step`` (not ``closure``).

        Returns:
            What ``optimizer.step`` returned, or None when skipped (a fused / capturable
            optimizer's step always runs and skips on the device).

        Raises:
            RuntimeStateError: a ``closure`` keyword, a second `step` of ``optimizer`` in one
                iteration, or (enabled) an FP16 gradient.
        """
        if "closure" in kwargs:
            raise RuntimeStateError(
                "LossScaler.step(optimizer, closure=...) is not supported: the closure would recompute the "
                "gradients after they were checked; run forward and backward before step()"
            )
        state = self._begin(optimizer, "step")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # GradScaler's contract with these optimizers: a check only (scale 1), then the scale
            # (None when already unscaled) and the flag as attributes for the step to read.
            unscaled = state.stage is OptState.UNSCALED
            if not unscaled:
                state.found = check_and_unscale(optimizer, self._unit, refuse_fp16=False)
            scale = self._applied()
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None) if unscaled else scale * getattr(optimizer, "grad_scale", 1)  # type: ignore[attr-defined]
            optimizer.found_inf = summed_flags(list(state.found.values()), scale.device)  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
            state.stage = OptState.STEPPED
            return retval
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        # The skip decision and its one sync per device; the answer is kept for update().
        found = bool(sum(v.item() for v in state.found.values()))
        state.overflowed = found
        if found:
            self._record.attribute(_nonfinite_gradients, optimizer)  # now, while the gradients surely exist
        retval = None if found else optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: Optional[float] = None) -> None:  # type: ignore[override]  # a tensor is refused
        """End the iteration: the scale rule (see the class doc), the counters, and on an
        overflowing iteration the attribution (see the module docstring for the syncs). Call once
        per iteration, after every optimizer stepped. With only fused / capturable optimizers no
        sync: the rule runs on the device and the results are read when first asked for.

        Args:
            new_scale: set the scale to this positive finite number instead of the rule (ignored
                when disabled); None: the rule.

        Raises:
            RuntimeStateError: no `step` or `unscale_` since the last update.
            ScalingError: ``new_scale`` is not a number in (0, float32 max] (a tensor is refused).
        """
        checked = [state for state in self._states.values() if state.found]
        if not checked:
            raise RuntimeStateError(
                "LossScaler.update() called with no step(optimizer) or unscale_(optimizer) since the last update(); "
                "call scaler.step(optimizer) first"
            )
        if new_scale is not None and (not is_number(new_scale) or not 0 < new_scale <= FLOAT32_MAX):
            raise ScalingError(f"LossScaler.update(new_scale={new_scale!r}): new_scale must be a finite number > 0, or None")
        # Fused optimizers skipped on the device, and optimizers unscaled but never stepped: the
        # host does not know whether they overflowed.
        unknown = [state for state in checked if state.overflowed is None]
        found = any(state.overflowed for state in checked)
        if found and unknown:
            # The iteration overflowed anyway: attribute the others too, read in the same transfer.
            for state in unknown:
                self._record.attribute(_nonfinite_gradients, state.optimizer)
            unknown = []
        # Summed over every optimizer: when the host knows none overflowed, the unknown ones decide.
        total = summed_flags([f for state in checked for f in state.found.values()], self._scale.device)
        if self._scaling and new_scale is not None:
            self._scale.fill_(float(new_scale))
        elif self._scaling:
            self._update_scale(total, None if unknown else found)
        self._states.clear()
        if unknown and self._record.defer(total, [state.optimizer for state in unknown]):
            self._resolve()
        elif not unknown:
            self._record.finish(found, _to_host, _nonfinite_gradients, self._applied(), self._floor())

    def _update_scale(self, found: torch.Tensor, overflow: Optional[bool]) -> None:
        """The scale rule on the device, ``found`` (> 0) choosing as ``torch._amp_update_scale_``
        chooses: grow after ``growth_interval`` clean iterations (a growth restores the hysteresis
        budget), or spend one unit of the budget and, once it is spent, back off, never below
        ``min_scale``. ``overflow`` False: the host knows the iteration was clean, which spares
        the ops of the other branch. A few 0-d device ops, no sync."""
        scale, tracker, budget = self._scale, self._growth_tracker, self._hysteresis_tracker
        before = scale.clone() if overflow is not False else scale  # read only on an overflow
        torch._amp_update_scale_(scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval)
        if overflow is False:
            budget.masked_fill_(tracker.eq(0), self._hysteresis)
            return
        bad = found > 0
        budget.sub_(bad.to(budget.dtype)).clamp_(min=0)
        floored = torch.where(bad, scale.clamp(min=self._min_scale), scale)
        torch.where(bad & (budget > 0), before, floored, out=scale)
        budget.masked_fill_(tracker.eq(0) & ~bad, self._hysteresis)

    def _floor(self) -> Optional[float]:
        return self._min_scale if self._scaling else None

    def _resolve(self) -> None:
        """Read the deferred iterations' results, if any (see `Attribution.resolve`)."""
        self._record.resolve(_to_host, _nonfinite_gradients, self._applied(), self._floor())

    # -- persistence --------------------------------------------------------------------------------

    _TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    _OWN_KEYS = ("min_scale", "hysteresis", "hysteresis_tracker", "max_events") + Attribution.KEYS

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's entries (so a ``GradScaler`` loads it) plus the floor, hysteresis,
        counters and events, as plain JSON-ready values. Three syncs (scale, growth and hysteresis
        trackers), and the read of deferred iterations, if any: call between iterations, after
        `update`. ``enabled`` is not state (the caller chooses it); a disabled scaler saves the
        scale it keeps."""
        self._resolve()

        def read(tensor: Optional[torch.Tensor], initial: Any) -> Any:
            return initial if tensor is None else tensor.item()

        return {
            "scale": float(read(self._scale, self._init_scale)),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(read(self._growth_tracker, self._init_growth_tracker)),
            "min_scale": self._min_scale,
            "hysteresis": self._hysteresis,
            "hysteresis_tracker": int(read(self._hysteresis_tracker, self._init_hysteresis_tracker)),
            "max_events": self._max_events,
            **self._record.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore everything `state_dict` saved, configuration included (not ``enabled``).

        Args:
            state_dict: what `state_dict` returned.

        Raises:
            ScalingError: naming missing or invalid entries.
            RuntimeStateError: called in the middle of an iteration (between a `step` or
                `unscale_` and `update`).
        """
        if self._states:
            raise RuntimeStateError("LossScaler.load_state_dict() called in the middle of an iteration; call it before the first step or right after update()")
        if not isinstance(state_dict, Mapping):
            raise ScalingError(f"LossScaler.load_state_dict({type(state_dict).__name__}): expected the mapping state_dict() returned")
        sd = state_dict
        missing = [k for k in self._TORCH_KEYS + self._OWN_KEYS if k not in sd]
        if missing:
            raise ScalingError(f"LossScaler.load_state_dict(): missing {', '.join(missing)}; pass a dict from LossScaler.state_dict()")
        scale, min_scale = sd["scale"], sd["min_scale"]
        if not is_number(scale) or not is_number(min_scale) or not 0 < min_scale <= scale <= FLOAT32_MAX:
            raise ScalingError(f"LossScaler.load_state_dict(): scale={scale!r} must be a finite number >= min_scale={min_scale!r} > 0")
        check_config("LossScaler.load_state_dict", scale, sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"],
                      sd["min_scale"], sd["hysteresis"], sd["max_events"])
        for key in ("_growth_tracker", "hysteresis_tracker"):
            if not is_int(sd[key]) or sd[key] < 0:
                raise ScalingError(f"LossScaler.load_state_dict(): {key}={sd[key]!r} must be an int >= 0")
        self._record.load_state_dict(sd, int(sd["max_events"]))
        self._init_scale, self._init_growth_tracker = float(sd["scale"]), int(sd["_growth_tracker"])
        self._growth_factor, self._backoff_factor = float(sd["growth_factor"]), float(sd["backoff_factor"])
        self._growth_interval = int(sd["growth_interval"])
        self._min_scale = float(sd["min_scale"])
        self._hysteresis = int(sd["hysteresis"])
        self._init_hysteresis_tracker = min(int(sd["hysteresis_tracker"]), self._hysteresis)
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        self._max_events = int(sd["max_events"])
