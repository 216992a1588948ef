"""Dynamic loss scaling that names the layers whose gradients or outputs went non-finite.

`LossScaler` gives the guarantees of ``torch.amp.GradScaler`` (same call sequence, same scale
trajectory, same parameters: ``tests/test_scaling.py`` checks them step by step against it) and
adds, per optimizer step, *which* layers had inf/NaN gradients. `OutputWatch` names the first
layer, in execution order, whose forward output went non-finite, for when the loss itself is
inf/NaN (then every gradient is, and gradient attribution says nothing).

Usage::

    scaler = LossScaler().watch(model)        # defaults: 4096, x2.0 after 2000 clean steps, x0.5
    for x, y in loader:
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)            # optional: only to clip or inspect true gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                # skipped when a gradient is inf/NaN
        scaler.update()                       # once per iteration, after every optimizer stepped
        optimizer.zero_grad()
    scaler.last_nonfinite_layers              # ("blocks.3.mlp.fc2",) after an overflow, else ()

Units: the scale is a plain multiplier (a power of two with the default factors), kept as a
float32-representable Python float as GradScaler keeps it in a float32 tensor. Step counts are
iterations, i.e. `LossScaler.update` calls.

Costs:

- **One host-device sync per optimizer per iteration**, in `LossScaler.step` (or in `update` for
  an optimizer that was unscaled but never stepped): the decision whether to skip needs the
  flags on the host. The per-parameter finite flags (``torch._foreach_norm`` with ``ord=inf``:
  one read of every gradient, no temporary of its size; NaN propagates through max) are computed
  on the device in `unscale_` and cross in one transfer, together with the flags of the losses
  passed to `scale` and of the outputs recorded by an attached `OutputWatch`.
- ``scale``, ``unscale_``, ``update`` and ``get_scale`` never sync: the scale lives on the host
  because the skip decision already brought the overflow flag there (GradScaler keeps it on the
  device and syncs in ``get_scale`` instead).
- `OutputWatch`: one reduction over each watched output per call, no sync until
  `OutputWatch.first_nonfinite`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import struct
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from .coverage import ModuleFilter
from .errors import RuntimeStateError, ScalingError

__all__ = [
    "ScalingError",
    "LossScaler",
    "OutputWatch",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_FACTOR",
    "DEFAULT_BACKOFF_FACTOR",
    "DEFAULT_GROWTH_INTERVAL",
    "DEFAULT_MIN_SCALE",
]

logger = logging.getLogger(__name__)

# The defaults asked for in DESIGN.md ("Numbers worth knowing"); torch's GradScaler starts at 65536
# with the same factors and interval.
DEFAULT_INIT_SCALE = 4096.0
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000
# Megatron-LM's DynamicGradScaler floor: below 1 the scale no longer protects small gradients and
# persistent overflows mean the model, not the scale, is wrong.
DEFAULT_MIN_SCALE = 1.0

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

Layers = Union[Sequence[str], ModuleFilter, None]


def _float32(x: float) -> float:
    """``x`` rounded to float32 (GradScaler's scale is a float32 tensor)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_config(where: str, init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis, max_events) -> None:
    def bad(name: str, value: Any, expected: str) -> ScalingError:
        return ScalingError(f"{where}({name}={value!r}): {name} must be {expected}")

    if not _is_number(init_scale) or not 0 < init_scale <= _FLOAT32_MAX:
        raise bad("init_scale", init_scale, "a finite number > 0 (the first loss scale, e.g. 4096.0)")
    if not _is_number(growth_factor) or growth_factor <= 1:
        raise bad("growth_factor", growth_factor, "a finite number > 1 (the scale is multiplied by it after growth_interval clean steps)")
    if not _is_number(backoff_factor) or not 0 < backoff_factor < 1:
        raise bad("backoff_factor", backoff_factor, "a number in (0, 1) (the scale is multiplied by it on overflow)")
    if not _is_int(growth_interval) or growth_interval < 1:
        raise bad("growth_interval", growth_interval, "an int >= 1 (consecutive clean steps before the scale grows)")
    if not _is_number(min_scale) or min_scale <= 0:
        raise bad("min_scale", min_scale, "a finite number > 0 (the floor the scale never goes below)")
    if min_scale > init_scale:
        raise ScalingError(f"{where}(init_scale={init_scale!r}, min_scale={min_scale!r}): min_scale must be <= init_scale")
    if not _is_int(hysteresis) or hysteresis < 1:
        raise bad("hysteresis", hysteresis, "an int >= 1 (overflowing steps per growth interval before the scale backs off; 1 backs off at once)")
    if not _is_int(max_events) or max_events < 0:
        raise bad("max_events", max_events, "an int >= 0 (how many overflow events to keep)")


def _resolve_layers(model: nn.Module, layers: Layers, where: str) -> list[str]:
    """Layer fqns in model order: those named, those the filter accepts, or by default every
    module that directly owns parameters. The root module is never a layer: parameters it owns
    directly are reported under their own fqn."""
    modules = dict(model.named_modules())
    if layers is None:
        return [fqn for fqn, m in modules.items() if fqn and next(m.parameters(recurse=False), None) is not None]
    if callable(layers):
        return [fqn for fqn, m in modules.items() if fqn and layers(m, fqn)]
    if isinstance(layers, str):
        raise ScalingError(f"{where}(layers={layers!r}): layers must be a sequence of module fqns such as ['0', 'head'], not one string")
    wanted = list(layers)
    unknown = [f for f in wanted if not isinstance(f, str) or f not in modules or not f]
    if unknown:
        sample = ", ".join(repr(f) for f in list(modules)[1:6])
        raise ScalingError(
            f"{where}(layers=...): unknown layer fqn(s) {', '.join(repr(f) for f in unknown)}; "
            f"use names from model.named_modules() (the root '' is not a layer), e.g. {sample}"
        )
    chosen = set(wanted)
    return [fqn for fqn in modules if fqn in chosen]


def _finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-d bool device tensor: every element of ``t`` is finite. No sync; no temporary the size of
    ``t`` for the usual float dtypes (an inf-norm is a max of |x|, and NaN propagates through it)."""
    t = t.detach()
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        # _foreach_norm rather than linalg.vector_norm: autocast may cast the latter's input to
        # float32, a copy of the whole output.
        return torch.isfinite(torch._foreach_norm([t], math.inf)[0])
    return torch.isfinite(t).all()


def _floating_tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floating_tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _floating_tensors(v)


def _to_host(parts: list[torch.Tensor]) -> list[bool]:
    """The flags of ``parts`` (bool tensors, any shape) as one host list: one device-to-host copy,
    the only sync a step pays."""
    if not parts:
        return []
    device = parts[0].device
    return torch.cat([p.reshape(-1).to(device) for p in parts]).tolist()


# -- output watch -------------------------------------------------------------------------------


class OutputWatch:
    """Forward hooks recording, per call and without a host sync, whether a layer's output was
    finite; `first_nonfinite` names the first layer, in call order, whose output was not.

    ``layers``: module fqns, or a ``(module, fqn) -> bool`` filter; default: every module that
    directly owns parameters. A module that finishes inside another finishes first, so the
    innermost watched layer that produced the first inf/NaN is named.

    Cost per watched call: one reduction over the output (an inf-norm: a max of ``|x|``, no
    temporary of the output's size) and a list append. Forwards run under ``torch.no_grad``
    (evaluation) are ignored unless ``include_no_grad``. Records accumulate until `reset` (on
    entering the context; `LossScaler.update` resets the watch it owns).

    Usage::

        with OutputWatch(model) as watch:
            loss = loss_fn(model(x), y)
        if not torch.isfinite(loss):
            layer = watch.first_nonfinite()       # one sync
    """

    def __init__(self, model: nn.Module, layers: Layers = None, *, include_no_grad: bool = False):
        if not isinstance(model, nn.Module):
            raise ScalingError(f"OutputWatch(model={type(model).__name__}): model must be an nn.Module")
        self._model = model
        self._layers = tuple(_resolve_layers(model, layers, "OutputWatch"))
        self._include_no_grad = bool(include_no_grad)
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._flags: list[torch.Tensor] = []

    @property
    def layers(self) -> tuple[str, ...]:
        """The watched module fqns, in model order."""
        return self._layers

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @property
    def calls(self) -> int:
        """Watched calls recorded since the last `reset`."""
        return len(self._flags)

    def attach(self) -> "OutputWatch":
        """Register the hooks. Raises `RuntimeStateError` when already attached."""
        if self._handles:
            raise RuntimeStateError("OutputWatch is already attached; call detach() (or leave its `with` block) first")
        modules = dict(self._model.named_modules())
        try:
            for fqn in self._layers:
                self._handles.append(modules[fqn].register_forward_hook(self._hook_for(fqn)))
        except BaseException:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Remove the hooks; the records stay readable. Safe to call when not attached."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def reset(self) -> None:
        """Forget the recorded calls."""
        self._names.clear()
        self._flags.clear()

    def __enter__(self) -> "OutputWatch":
        self.attach()
        self.reset()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _hook_for(self, fqn: str):
        def hook(module, args, output):
            if not self._include_no_grad and not torch.is_grad_enabled():
                return
            flags = [_finite_flag(t) for t in _floating_tensors(output)]
            if not flags:
                return
            self._names.append(fqn)
            self._flags.append(flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).all())

        return hook

    def _pending(self) -> tuple[list[str], Optional[torch.Tensor]]:
        """(names, 1-D bool device tensor of finite flags) of the recorded calls; no sync."""
        if not self._flags:
            return [], None
        device = self._flags[0].device
        return list(self._names), torch.stack([f.to(device) for f in self._flags])

    def first_nonfinite(self) -> Optional[str]:
        """The fqn of the first recorded call whose output held an inf or NaN, or None. One sync."""
        names, flags = self._pending()
        return _first_false(names, _to_host([flags]) if flags is not None else [])


def _first_false(names: Sequence[str], finite: Sequence[bool]) -> Optional[str]:
    for name, ok in zip(names, finite):
        if not ok:
            return name
    return None


# -- loss scaler --------------------------------------------------------------------------------


class _Stage(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    names: list[str] = dataclasses.field(default_factory=list)  # one per checked gradient
    flags: list[torch.Tensor] = dataclasses.field(default_factory=list)  # 1-D bool, finite per gradient
    bad: Optional[tuple[str, ...]] = None  # None until the flags reached the host


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s guarantees and per-layer attribution.

    Scale update, once per iteration in `update` (``torch._amp_update_scale_``'s rule, plus a
    floor and hysteresis):

    - an iteration is *clean* when no optimizer saw an inf/NaN gradient. After ``growth_interval``
      consecutive clean iterations the scale is multiplied by ``growth_factor`` (unless that
      overflows float32) and the clean count restarts;
    - an *overflowing* iteration restarts the clean count and spends one unit of the hysteresis
      budget; when the budget is spent the scale is multiplied by ``backoff_factor``, never going
      below ``min_scale``. The budget starts at ``hysteresis`` and is restored only by a growth,
      not by clean iterations: the scale tolerates ``hysteresis - 1`` overflowing iterations per
      growth interval, then backs off on every further overflow until it grows again (Megatron-LM's
      ``DynamicGradScaler``; DeepSpeed's default ``consecutive_hysteresis=False``). With the
      default ``hysteresis=1`` every overflow backs off, exactly as GradScaler does.

    Every overflowing optimizer step is skipped, tolerated by hysteresis or not: ``optimizer.step``
    is not called, so parameters and optimizer state (Adam's moments and step count) stay
    untouched. With several optimizers, each skips only when its own gradients were non-finite;
    the scale backs off when any did.

    ``enabled=False`` is a pass-through for BF16 / FP32 plans, which need no scaling: `scale`
    returns its input, `get_scale` is 1.0 and never grows. **A non-finite gradient still skips the
    optimizer step** (and is counted and attributed), so training never takes a NaN step; this
    costs the same one sync per optimizer step. The scale state is kept (and saved) unchanged, so
    a scaler re-created with ``enabled=True`` from its state dict resumes where it stood.

    Attribution: after `watch`, gradients are reported per layer fqn; parameters no watched layer
    owns, under their parameter fqn; parameters of an unwatched model, as
    ``"<Optimizer>.param_groups[i][j]"``.

    Not supported: ``optimizer.step(closure=...)`` (the closure recomputes gradients after the
    check), and FP16 gradients when enabled (unscaling them in place would flush small values to
    zero; keep FP32 master weights, as autoprec's runtime does). Both raise `RuntimeStateError`.
    """

    def __init__(
        self,
        init_scale: float = DEFAULT_INIT_SCALE,
        growth_factor: float = DEFAULT_GROWTH_FACTOR,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        growth_interval: int = DEFAULT_GROWTH_INTERVAL,
        *,
        min_scale: float = DEFAULT_MIN_SCALE,
        hysteresis: int = 1,
        enabled: bool = True,
        max_events: int = 100,
    ):
        _check_config("LossScaler", init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis, max_events)
        if not isinstance(enabled, bool):
            raise ScalingError(f"LossScaler(enabled={enabled!r}): enabled must be True or False")
        self._init_scale = _float32(float(init_scale))
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._min_scale = _float32(float(min_scale))  # the scale is float32: so is its floor
        self._hysteresis = int(hysteresis)
        self._enabled = enabled
        self._max_events = int(max_events)

        self._scale = self._init_scale
        self._growth_tracker = 0
        self._hysteresis_tracker = self._hysteresis
        self._steps = 0
        self._skipped_steps = 0
        self._nonfinite_counts: dict[str, int] = {}
        self._events: collections.deque = collections.deque(maxlen=self._max_events)
        self._last_nonfinite_layers: tuple[str, ...] = ()
        self._last_loss_finite: Optional[bool] = None
        self._first_nonfinite_output: Optional[str] = None
        self._warned_at_floor = False

        # Attribution: id(param) -> reported name; name -> model-order rank.
        self._param_names: dict[int, str] = {}
        self._watched_params: list[torch.Tensor] = []  # keeps the ids above valid
        self._rank: dict[str, int] = {}
        self._output_watch: Optional[OutputWatch] = None

        self._scale_tensors: dict[torch.device, torch.Tensor] = {}
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._optimizers: dict[int, _OptimizerState] = {}
        self._loss_flags: list[torch.Tensor] = []
        self._iteration_bad: set[str] = set()
        self._iteration_loss_finite: Optional[bool] = None
        self._iteration_output: Optional[str] = None
        if self._output_watch is not None:
            self._output_watch.reset()

    # -- configuration (read-only; a new configuration is a new scaler or load_state_dict) -----

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def init_scale(self) -> float:
        return self._init_scale

    @property
    def growth_factor(self) -> float:
        return self._growth_factor

    @property
    def backoff_factor(self) -> float:
        return self._backoff_factor

    @property
    def growth_interval(self) -> int:
        return self._growth_interval

    @property
    def min_scale(self) -> float:
        return self._min_scale

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    # -- results --------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Iterations completed (`update` calls)."""
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Iterations in which some gradient was non-finite (at least one optimizer step skipped)."""
        return self._skipped_steps

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """Layer fqn -> iterations in which its gradients were non-finite (a copy)."""
        return dict(self._nonfinite_counts)

    @property
    def last_nonfinite_layers(self) -> tuple[str, ...]:
        """Layers with non-finite gradients in the current iteration's steps so far, else in the
        last completed iteration, in model order; ``()`` when clean."""
        if self._optimizers:
            return self._ordered(self._iteration_bad)
        return self._last_nonfinite_layers

    @property
    def last_loss_finite(self) -> Optional[bool]:
        """Whether every tensor passed to `scale` in the last iteration was finite (None: no call)."""
        if self._iteration_loss_finite is not None:
            return self._iteration_loss_finite
        return self._last_loss_finite

    @property
    def first_nonfinite_output(self) -> Optional[str]:
        """With ``watch(..., outputs=True)``: the first layer, in call order, whose forward output
        was non-finite in the last iteration (what made an inf/NaN loss), else None."""
        if self._optimizers:
            return self._iteration_output
        return self._first_nonfinite_output

    @property
    def events(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """The last ``max_events`` overflows as ``(iteration, layers)``; iteration counts from 0."""
        return tuple(self._events)

    @property
    def output_watch(self) -> Optional[OutputWatch]:
        """The `OutputWatch` that ``watch(..., outputs=True)`` attached, if any."""
        return self._output_watch

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled). No sync."""
        return self._scale if self._enabled else 1.0

    # -- attribution setup ------------------------------------------------------------------------

    def watch(self, model: nn.Module, layers: Layers = None, *, outputs: bool = False) -> "LossScaler":
        """Report gradients per layer of ``model``; returns self.

        ``layers``: module fqns or a ``(module, fqn) -> bool`` filter; default: every module that
        directly owns parameters. A parameter belongs to the innermost watched module holding it;
        others are reported under their parameter fqn. ``outputs=True`` also attaches an
        `OutputWatch` on the same layers (one reduction per layer call), whose flags travel with
        the step's one transfer, to fill `first_nonfinite_output`. Replaces a previous watch.
        """
        if not isinstance(model, nn.Module):
            raise ScalingError(f"LossScaler.watch(model={type(model).__name__}): model must be an nn.Module")
        fqns = _resolve_layers(model, layers, "LossScaler.watch")
        self.unwatch()
        watched = set(fqns)
        for pname, param in model.named_parameters():
            owner, parts = pname, pname.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                prefix = ".".join(parts[:cut])
                if prefix in watched:
                    owner = prefix
                    break
            self._param_names[id(param)] = owner
            self._watched_params.append(param)
            self._rank.setdefault(owner, len(self._rank))
        if outputs:
            self._output_watch = OutputWatch(model, fqns).attach()
        return self

    def unwatch(self) -> None:
        """Forget the watched model and remove the output hooks, if any."""
        if self._output_watch is not None:
            self._output_watch.detach()
            self._output_watch = None
        self._param_names.clear()
        self._watched_params.clear()
        self._rank.clear()

    def _ordered(self, names: Iterable[str]) -> tuple[str, ...]:
        # Unwatched names follow the watched ones, in the order first met.
        for name in names:
            self._rank.setdefault(name, len(self._rank))
        return tuple(sorted(names, key=self._rank.__getitem__))

    # -- the training-loop calls --------------------------------------------------------------------

    def scale(self, outputs):
        """``outputs`` (a tensor or a nested list / tuple / iterable of tensors) times the scale, as
        float32 like GradScaler (an FP16 loss times 4096 would overflow FP16). Unchanged when
        disabled. Also records, on the device, whether they were finite. No sync."""

        def apply(value):
            if isinstance(value, torch.Tensor):
                self._loss_flags.append(_finite_flag(value))
                if not self._enabled:
                    return value
                return value * self._scale_on(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise ScalingError(f"LossScaler.scale({type(value).__name__}): expected a tensor or an iterable of tensors")

        return apply(outputs)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        scale = self._scale_tensors.get(device)
        if scale is None:
            # torch.full fills on the device: no host-to-device copy to wait for.
            scale = torch.full((), self._scale, dtype=torch.float32, device=device)
            self._scale_tensors[device] = scale
        return scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place (not when disabled) and compute
        their finite flags on the device. Optional: `step` does it when not done; call it to clip or inspect the true
        gradients. Once per optimizer per iteration, after all backward passes; a second call before
        `update` raises `RuntimeStateError`. No sync."""
        state = self._optimizers.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.UNSCALED:
            raise RuntimeStateError(
                "LossScaler.unscale_(optimizer) was already called for this optimizer since the last update(); "
                "call it once per optimizer per iteration, after the last backward pass"
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeStateError(
                "LossScaler.unscale_(optimizer) called after step(optimizer) in the same iteration; "
                "unscale before stepping, and call update() to start the next iteration"
            )
        self._check_gradients(optimizer, state)
        state.stage = _Stage.UNSCALED

    def _check_gradients(self, optimizer: torch.optim.Optimizer, state: _OptimizerState) -> None:
        unscale = self._enabled and self._scale != 1.0
        # FP32 division is inexact under some compile options; GradScaler takes the reciprocal in
        # FP64 and rounds it to FP32, and so do we, so the unscaled gradients match it bit for bit.
        inv_scale = _float32(1.0 / self._scale)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[str]]] = {}
        opt_name = type(optimizer).__name__
        for i, group in enumerate(optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if self._enabled and grad.dtype == torch.float16:
                    raise RuntimeStateError(
                        f"LossScaler cannot unscale the FP16 gradient of {self._name_of(param, opt_name, i, j)} in place "
                        "without flushing small values to zero; keep FP32 master weights (autoprec's runtime does) "
                        "or disable the scaler"
                    )
                values = grad._values() if grad.is_sparse else grad
                if values.numel() == 0:
                    continue  # trivially finite, and the inf-norm of nothing is undefined
                tensors, names = groups.setdefault((values.device, values.dtype), ([], []))
                tensors.append(values)
                names.append(self._name_of(param, opt_name, i, j))
        state.names, state.flags, state.bad = [], [], None
        with torch.no_grad():
            for tensors, names in groups.values():
                if unscale:
                    torch._foreach_mul_(tensors, inv_scale)
                # After unscaling, so that a finite value pushed past the range by a scale below 1
                # is caught too; inf and NaN stay non-finite through the multiplication.
                state.flags.append(torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite())
                state.names.extend(names)

    def _name_of(self, param: torch.Tensor, opt_name: str, i: int, j: int) -> str:
        name = self._param_names.get(id(param))
        return name if name is not None else f"{opt_name}.param_groups[{i}][{j}]"

    def _resolve(self, state: _OptimizerState) -> None:
        """Bring this optimizer's flags (and the iteration's pending loss and output flags) to the
        host in one transfer: the one sync of the step."""
        parts = list(state.flags)
        n_grads = sum(int(f.numel()) for f in parts)
        n_loss = len(self._loss_flags)
        if n_loss:
            parts.append(torch.stack([f.to(self._loss_flags[0].device) for f in self._loss_flags]))
        out_names, out_flags = self._output_watch._pending() if self._output_watch is not None else ([], None)
        if out_flags is not None:
            parts.append(out_flags)
        host = _to_host(parts)
        state.bad = tuple(name for name, ok in zip(state.names, host[:n_grads]) if not ok)
        if n_loss:
            finite = all(host[n_grads : n_grads + n_loss])
            self._iteration_loss_finite = finite and self._iteration_loss_finite is not False
            self._loss_flags = []
        if out_flags is not None:
            first = _first_false(out_names, host[n_grads + n_loss :])
            if first is not None and self._iteration_output is None:
                self._iteration_output = first
            if self._output_watch is not None:
                self._output_watch.reset()
        self._iteration_bad.update(state.bad)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale ``optimizer``'s gradients (unless `unscale_` did) and call
        ``optimizer.step(*args, **kwargs)`` when they are all finite; return its value, or None when
        skipped. One sync (the skip decision). Once per optimizer per iteration."""
        if "closure" in kwargs:
            raise RuntimeStateError(
                "LossScaler.step(optimizer, closure=...) is not supported: the closure would recompute the "
                "gradients after they were checked; run forward and backward before step()"
            )
        state = self._optimizers.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.STEPPED:
            raise RuntimeStateError(
                "LossScaler.step(optimizer) was already called for this optimizer since the last update(); "
                "call update() once per iteration, after every optimizer stepped"
            )
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if state.bad is None:
            self._resolve(state)
        state.stage = _Stage.STEPPED
        if state.bad:
            logger.debug("skipped %s.step(): non-finite gradients in %s", type(optimizer).__name__, ", ".join(self._ordered(state.bad)))
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """End the iteration: update the scale (or set it to ``new_scale``, a positive float) and
        the counters. Call once per iteration, after every optimizer stepped. No sync, except one
        transfer for an optimizer that was unscaled but not stepped, or for `scale` calls and
        watched forwards made after the last step. ``new_scale`` is ignored when disabled."""
        if not self._optimizers:
            raise RuntimeStateError(
                "LossScaler.update() called with no step(optimizer) or unscale_(optimizer) since the last update(); "
                "call scaler.step(optimizer) first"
            )
        if new_scale is not None and (not _is_number(new_scale) or not 0 < new_scale <= _FLOAT32_MAX):
            raise ScalingError(f"LossScaler.update(new_scale={new_scale!r}): new_scale must be a finite number > 0, or None")
        for state in self._optimizers.values():
            if state.bad is None:
                self._resolve(state)
        if self._loss_flags or (self._output_watch is not None and self._output_watch.calls):
            # scale() or a forward after the last step of the iteration: one more transfer.
            self._resolve(_OptimizerState())
        found = bool(self._iteration_bad)
        old = self.get_scale()
        if self._enabled:
            if new_scale is not None:
                self._set_scale(_float32(float(new_scale)))
            else:
                self._update_scale(found)

        iteration = self._steps
        self._steps += 1
        layers = self._ordered(self._iteration_bad)
        if found:
            self._skipped_steps += 1
            for name in layers:
                self._nonfinite_counts[name] = self._nonfinite_counts.get(name, 0) + 1
            self._events.append((iteration, layers))
            logger.info(
                "iteration %d: non-finite gradients in %s; optimizer step skipped; loss scale %g -> %g%s",
                iteration, ", ".join(layers), old, self.get_scale(),
                f"; first non-finite output: {self._iteration_output}" if self._iteration_output else "",
            )
        self._last_nonfinite_layers = layers
        self._last_loss_finite = self._iteration_loss_finite
        self._first_nonfinite_output = self._iteration_output
        self._reset_iteration()

    def _update_scale(self, found: bool) -> None:
        if found:
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker == 0:
                if self._scale <= self._min_scale and not self._warned_at_floor:
                    # Once until the scale grows again: a model stuck at the floor would flood the log.
                    self._warned_at_floor = True
                    logger.warning(
                        "loss scale is at its floor min_scale=%g and gradients still overflow: the model, not "
                        "the scale, makes inf/NaN (see last_nonfinite_layers / first_nonfinite_output)",
                        self._min_scale,
                    )
                self._set_scale(max(_float32(self._scale * self._backoff_factor), self._min_scale))
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self._growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self._hysteresis
            grown = self._scale * self._growth_factor
            # GradScaler keeps the old scale when the grown one is not finite in float32.
            if grown <= _FLOAT32_MAX:
                self._set_scale(_float32(grown))
                self._warned_at_floor = False

    def _set_scale(self, scale: float) -> None:
        if scale != self._scale:
            self._scale = scale
            self._scale_tensors.clear()

    # -- persistence --------------------------------------------------------------------------------

    _CONFIG_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis", "max_events")
    _STATE_KEYS = (
        "scale", "growth_tracker", "hysteresis_tracker", "steps", "skipped_steps", "nonfinite_counts",
        "events", "last_nonfinite_layers", "last_loss_finite", "first_nonfinite_output",
    )

    def state_dict(self) -> dict[str, Any]:
        """Configuration, scale, trackers, counters and events, as plain JSON-ready values. Call
        between iterations: what the current iteration recorded before `update` is not saved.
        ``enabled`` is not state (the caller chooses it); a disabled scaler saves its unused scale."""
        return {
            "init_scale": self._init_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "min_scale": self._min_scale,
            "hysteresis": self._hysteresis,
            "max_events": self._max_events,
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "nonfinite_counts": dict(self._nonfinite_counts),
            "events": [[step, list(layers)] for step, layers in self._events],
            "last_nonfinite_layers": list(self._last_nonfinite_layers),
            "last_loss_finite": self._last_loss_finite,
            "first_nonfinite_output": self._first_nonfinite_output,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore everything `state_dict` saved, configuration included. Raises `ScalingError`
        naming missing or invalid entries, `RuntimeStateError` in the middle of an iteration."""
        if self._optimizers:
            raise RuntimeStateError("LossScaler.load_state_dict() called in the middle of an iteration; call it before the first step or right after update()")
        if not isinstance(state_dict, Mapping):
            raise ScalingError(f"LossScaler.load_state_dict({type(state_dict).__name__}): expected the mapping state_dict() returned")
        missing = [k for k in self._CONFIG_KEYS + self._STATE_KEYS if k not in state_dict]
        if missing:
            raise ScalingError(f"LossScaler.load_state_dict(): missing {', '.join(missing)}; pass a dict from LossScaler.state_dict()")
        sd = state_dict
        _check_config("LossScaler.load_state_dict", *(sd[k] for k in self._CONFIG_KEYS))
        scale = sd["scale"]
        if not _is_number(scale) or not sd["min_scale"] <= scale <= _FLOAT32_MAX:
            raise ScalingError(f"LossScaler.load_state_dict(): scale={scale!r} must be a finite number >= min_scale")
        for key in ("growth_tracker", "hysteresis_tracker", "steps", "skipped_steps"):
            if not _is_int(sd[key]) or sd[key] < 0:
                raise ScalingError(f"LossScaler.load_state_dict(): {key}={sd[key]!r} must be an int >= 0")
        try:
            counts = {str(k): int(v) for k, v in dict(sd["nonfinite_counts"]).items()}
            events = [(int(step), tuple(str(n) for n in layers)) for step, layers in sd["events"]]
            last_layers = tuple(str(n) for n in sd["last_nonfinite_layers"])
        except (TypeError, ValueError) as exc:
            raise ScalingError(
                f"LossScaler.load_state_dict(): nonfinite_counts, events or last_nonfinite_layers is malformed ({exc}); "
                "pass a dict from LossScaler.state_dict()"
            ) from exc
        self._init_scale = _float32(float(sd["init_scale"]))
        self._growth_factor = float(sd["growth_factor"])
        self._backoff_factor = float(sd["backoff_factor"])
        self._growth_interval = int(sd["growth_interval"])
        self._min_scale = _float32(float(sd["min_scale"]))
        self._hysteresis = int(sd["hysteresis"])
        self._max_events = int(sd["max_events"])
        self._set_scale(_float32(float(scale)))
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = min(int(sd["hysteresis_tracker"]), self._hysteresis)
        self._steps = int(sd["steps"])
        self._skipped_steps = int(sd["skipped_steps"])
        self._nonfinite_counts = counts
        self._events = collections.deque(events, maxlen=self._max_events)
        self._last_nonfinite_layers = last_layers
        self._last_loss_finite = sd["last_loss_finite"]
        self._first_nonfinite_output = sd["first_nonfinite_output"]
