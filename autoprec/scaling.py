"""Dynamic loss scaling on ``torch.amp.GradScaler``, naming the layers whose gradients overflowed.

`LossScaler` *is* a ``torch.amp.GradScaler``: scaling, the fused unscale-and-check
(``torch._amp_foreach_non_finite_check_and_unscale_``, one pass over the gradients), the skip,
the fast path of fused / capturable optimizers (``_step_supports_amp_scaling``) and the growth
rule (``torch._amp_update_scale_``) are torch's. On top it adds a floor (``min_scale``),
hysteresis (back off only when ``hysteresis`` overflowing iterations spent the budget, as
Megatron-LM and DeepSpeed do), autoprec's defaults (`LossScaling`), a pass-through that still
skips non-finite steps (``enabled=False``), and, **only on an iteration that overflowed**, which
layers' gradients were inf/NaN. `OutputWatch` names the first layer, in execution order, whose
forward output went non-finite, for when the loss itself is inf/NaN (then every gradient is, and
gradient attribution says nothing).

Usage::

    scaler = LossScaler().watch(model)        # defaults: 4096, x2.0 after 2000 clean steps, x0.5
    for x, y in loader:
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(optimizer, 1.0)  # optional: unscale_, then clip (keeps attribution)
        scaler.step(optimizer)                # skipped when a gradient is inf/NaN
        scaler.update()                       # once per iteration, after every optimizer stepped
        optimizer.zero_grad()
    scaler.last_nonfinite_layers              # ("blocks.3.mlp.fc2",) after an overflow, else ()

Units: the scale is a plain multiplier held, as GradScaler holds it, in a 0-d float32 tensor on
the device of the first loss (or gradient) it meets. Step counts are iterations (`update` calls).

Host syncs per iteration (each a ``.item()``, i.e. ``aten._local_scalar_dense``):

- **clean iteration**: GradScaler's one ``.item()`` per optimizer in `step` (per device holding
  its gradients), the skip decision. ``scale``, ``unscale_`` and ``update`` never sync;
  `get_scale` does (GradScaler's), `scale_tensor` does not.
- **fused / capturable optimizers** (``_step_supports_amp_scaling``: ``AdamW(fused=True)``...)
  skip on the device, and when every optimizer of the iteration is one, nothing syncs, as with
  GradScaler: `update` runs the scale rule (hysteresis and floor included) on the device from
  their non-finite flags, and keeps the flags (0-d tensors GradScaler made anyway) and
  references to the gradients, losses and output flags. The first read of a result (`skipped_steps`,
  `last_overflowed`, `events`..., `state_dict`) brings every kept flag and the scale to the
  host in one transfer; when the last iteration overflowed, its attribution pass and one more
  transfer follow. The references are dropped when the next iteration begins (its first `scale`,
  `unscale_` or `step`), so read the results before that to have the layers named (after
  ``zero_grad(set_to_none=True)`` is fine: the gradients are still held; ``set_to_none=False``
  zeroes them, and no layer is named); an overflow read later is counted with no layers. Unread
  for 1024 iterations, `update` reads them itself (one sync).
- **overflowing iteration**, in addition: the attribution pass (one inf-norm per gradient of the
  overflowing optimizers, and per loss passed to `scale`) and one ``.tolist()`` in `update` (or
  at the deferred read) bringing those flags, the `OutputWatch` flags and the new scale to the
  host in one transfer.
- an attached `OutputWatch` costs one reduction per watched layer call on every iteration (its
  flags are only read on an overflowing one).

Why one module of ~1000 lines: `LossScaler` is one ``GradScaler`` subclass whose overrides
(``scale``, ``unscale_``, ``step``, ``update``, state) share one per-iteration sync budget, and
`OutputWatch` shares its non-finite flags and the single host transfer of ``update``; split,
that budget would be spread over modules that each look sync-free.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.amp.grad_scaler import OptState

from .coverage import ModuleFilter
from .errors import RuntimeStateError, ScalingError
from .measure import local_shard

__all__ = [
    "ScalingError",
    "LossScaler",
    "LossScaling",
    "OutputWatch",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_FACTOR",
    "DEFAULT_BACKOFF_FACTOR",
    "DEFAULT_GROWTH_INTERVAL",
    "DEFAULT_MIN_SCALE",
    "DEFAULT_HYSTERESIS",
]

logger = logging.getLogger(__name__)

# The defaults asked for in DESIGN.md ("Numbers worth knowing"); torch's GradScaler starts at 65536
# with the same factors and interval. Stated here once: `LossScaling` and `LossScaler` use them.
DEFAULT_INIT_SCALE = 4096.0
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000
# Megatron-LM's DynamicGradScaler floor: below 1 the scale no longer protects small gradients and
# persistent overflows mean the model, not the scale, is wrong.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_HYSTERESIS = 1  # back off on every overflow, as GradScaler does

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

Layers = Union[Sequence[str], ModuleFilter, None]


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss-scaling settings: `LossScaler`'s arguments (``LossScaler(**asdict(cfg))``)."""

    init_scale: float = DEFAULT_INIT_SCALE
    growth_factor: float = DEFAULT_GROWTH_FACTOR
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    min_scale: float = DEFAULT_MIN_SCALE
    hysteresis: int = DEFAULT_HYSTERESIS


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


def _to_host(parts: list[torch.Tensor]) -> list[float]:
    """``parts`` (bool or float tensors, any shape, any device) as one host list of floats (a flag
    is 1.0 or 0.0): one device-to-host transfer."""
    if not parts:
        return []
    device = parts[0].device
    return torch.cat([p.reshape(-1).to(device=device, dtype=torch.float32) for p in parts]).tolist()


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

NameOf = Callable[[torch.Tensor, torch.optim.Optimizer, int, int], str]


Grads = list  # per param group, the gradients (or None) in param order: what `_held_gradients` keeps


def _held_gradients(optimizer: torch.optim.Optimizer) -> Grads:
    """References to ``optimizer``'s gradients (no copy, no device op)."""
    return [[p.grad for p in group["params"]] for group in optimizer.param_groups]


def _nonfinite_gradients(optimizer: torch.optim.Optimizer, name_of: NameOf, grads: Optional[Grads] = None) -> tuple[list[str], list[torch.Tensor]]:
    """The attribution pass, run only on an overflowing iteration: the names of ``optimizer``'s
    gradients (``grads``, as `_held_gradients` kept them, else the current ones) and, per
    (device, dtype) group, a 1-D bool device tensor (True: holds an inf or NaN). One inf-norm per
    gradient (one read, no temporary of its size; NaN propagates through max). No sync."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[str]]] = {}
    for i, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            grad = param.grad if grads is None else grads[i][j]
            if grad is None:
                continue
            values = grad._values() if grad.is_sparse else local_shard(grad)  # FSDP2: this rank's shard
            if values.numel() == 0:
                continue  # trivially finite, and the inf-norm of nothing is undefined
            tensors, names = groups.setdefault((values.device, values.dtype), ([], []))
            tensors.append(values)
            names.append(name_of(param, optimizer, i, j))
    names: list[str] = []
    flags: list[torch.Tensor] = []
    with torch.no_grad():
        for tensors, group_names in groups.values():
            flags.append(~torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite())
            names.extend(group_names)
    return names, flags


@dataclasses.dataclass
class _Deferred:
    """An iteration whose overflow only the device knows yet (every optimizer fused / capturable
    and clean as far as the host saw). ``found``: 0-d float32 device tensor, > 0 when some
    gradient was inf/NaN. The rest is what attribution needs, kept by reference (no copies) only
    until the next iteration begins, when the gradients are no longer this iteration's."""

    iteration: int
    found: torch.Tensor
    grads: Optional[list[tuple[torch.optim.Optimizer, Grads]]]
    losses: list[torch.Tensor]
    outputs: tuple[list[str], list[torch.Tensor]]

    def release(self) -> None:
        self.grads, self.losses, self.outputs = None, [], ([], [])


# Deferred iterations kept before `update` reads their flags itself: one sync per this many
# iterations when nothing reads a result (each entry is one 0-d tensor GradScaler made anyway).
_MAX_DEFERRED = 1024


class LossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a floor, hysteresis, autoprec's defaults and per-layer
    attribution of overflows (costs: see the module docstring).

    Scale update, once per iteration in `update`:

    - an iteration is *clean* when no optimizer saw an inf/NaN gradient: GradScaler's rule
      (``torch._amp_update_scale_``: after ``growth_interval`` consecutive clean iterations the
      scale is multiplied by ``growth_factor`` unless that overflows float32). A growth also
      restores the hysteresis budget;
    - an *overflowing* iteration restarts the clean count and spends one unit of the hysteresis
      budget (``hysteresis`` at the start). When the budget is spent, GradScaler's back-off
      (``x backoff_factor``), never below ``min_scale``. Only a growth restores the budget, so the
      scale tolerates ``hysteresis - 1`` overflowing iterations per growth interval, then backs
      off on each further one (Megatron-LM's ``DynamicGradScaler``, DeepSpeed's default
      ``consecutive_hysteresis=False``): sporadic overflows cannot keep a too-large scale alive.
      With ``hysteresis=1`` and the floor out of reach this is exactly GradScaler.

    Every overflowing optimizer step is skipped, tolerated by hysteresis or not (GradScaler's
    skip: parameters and optimizer state stay untouched). With several optimizers each skips only
    when its own gradients were non-finite; the scale backs off when any did.

    ``enabled=False`` is a pass-through for plans that need no scale: `scale` returns its input,
    `get_scale` is 1.0 and never grows, fused optimizers get a scale of 1. **A non-finite gradient
    still skips the optimizer step** (and is counted and attributed) through the same fused check,
    so training never takes a NaN step. The scale state is kept (and saved) unchanged, so a scaler
    re-created with ``enabled=True`` from its state dict resumes where it stood.

    Attribution, filled by `update`: after `watch`, gradients are reported per layer fqn;
    parameters no watched layer owns, under their parameter fqn; parameters of an unwatched model,
    as ``"<Optimizer>.param_groups[i][j]"``.

    Not supported: ``optimizer.step(closure=...)`` (the closure recomputes gradients after the
    check), and FP16 gradients when enabled (GradScaler refuses to unscale them in place; keep
    FP32 master weights, as autoprec's runtime does). Both raise `RuntimeStateError`.
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
        _check_config("LossScaler", init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis, max_events)
        if not isinstance(enabled, bool):
            raise ScalingError(f"LossScaler(enabled={enabled!r}): enabled must be True or False")
        # GradScaler stays enabled when scaling is off: its fused check is what skips a NaN step.
        # Its ``device`` only serves a CUDA-availability warning and a tensor ``new_scale`` (not
        # accepted here); the scale is created on the device of the first loss or gradient.
        super().__init__("cpu", float(init_scale), float(growth_factor), float(backoff_factor), int(growth_interval), enabled=True)
        self._scaling = enabled
        self._min_scale = float(min_scale)
        self._hysteresis = int(hysteresis)
        self._init_hysteresis_tracker = self._hysteresis
        self._hysteresis_tracker: Optional[torch.Tensor] = None  # overflows left before a back-off
        self._unit: Optional[torch.Tensor] = None  # 1.0 beside the scale: what a disabled scaler applies
        self._max_events = int(max_events)

        self._steps = 0
        self._skipped_steps = 0
        self._nonfinite_counts: dict[str, int] = {}
        self._events: collections.deque = collections.deque(maxlen=self._max_events)
        self._last_overflowed = False
        self._last_nonfinite_layers: tuple[str, ...] = ()
        self._last_loss_finite: Optional[bool] = None
        self._first_nonfinite_output: Optional[str] = None
        self._warned_at_floor = False

        # Attribution: id(param) -> reported name; name -> model-order rank.
        self._param_names: dict[int, str] = {}
        self._watched_params: list[torch.Tensor] = []  # keeps the ids above valid
        self._rank: dict[str, int] = {}
        self._output_watch: Optional[OutputWatch] = None

        # The iteration in progress.
        self._optimizers: dict[int, torch.optim.Optimizer] = {}  # unscaled or stepped ones
        self._found: dict[int, bool] = {}  # id(optimizer) -> overflowed, once known on the host
        self._losses: list[torch.Tensor] = []  # what `scale` was given (references, no copies)
        self._pending_names: list[str] = []
        self._pending_flags: list[torch.Tensor] = []
        # Completed iterations not yet known on the host (fused / capturable optimizers), oldest first.
        self._deferred: list[_Deferred] = []

    # -- configuration (a new configuration is a new scaler or load_state_dict) -----------------

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

    # -- results (of the last completed iteration) ------------------------------------------------

    @property
    def steps(self) -> int:
        """Iterations completed (`update` calls)."""
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Iterations in which some gradient was non-finite (at least one optimizer step skipped)."""
        self._resolve()
        return self._skipped_steps

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """Layer fqn -> iterations in which its gradients were non-finite (a copy)."""
        self._resolve()
        return dict(self._nonfinite_counts)

    @property
    def last_overflowed(self) -> bool:
        """Whether some gradient of the last iteration was inf/NaN (so some step was skipped)."""
        self._resolve()
        return self._last_overflowed

    @property
    def last_nonfinite_layers(self) -> tuple[str, ...]:
        """Layers with non-finite gradients in the last iteration, in model order; ``()`` when clean."""
        self._resolve()
        return self._last_nonfinite_layers

    @property
    def last_loss_finite(self) -> Optional[bool]:
        """After an overflowing iteration, whether every tensor passed to `scale` was finite; None
        after a clean one (not checked: the check would cost a sync)."""
        self._resolve()
        return self._last_loss_finite

    @property
    def first_nonfinite_output(self) -> Optional[str]:
        """With ``watch(..., outputs=True)``, after an overflowing iteration: the first layer, in
        call order, whose forward output was non-finite (what made an inf/NaN loss), else None."""
        self._resolve()
        return self._first_nonfinite_output

    @property
    def events(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """The last ``max_events`` overflows as ``(iteration, layers)``; iteration counts from 0."""
        self._resolve()
        return tuple(self._events)

    @property
    def output_watch(self) -> Optional[OutputWatch]:
        """The `OutputWatch` that ``watch(..., outputs=True)`` attached, if any."""
        return self._output_watch

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled). One sync (GradScaler's ``.item()``) when enabled
        and the scale exists; `scale_tensor` reads it without one."""
        return super().get_scale() if self._scaling else 1.0

    @property
    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The scale applied, as GradScaler's 0-d float32 device tensor (1.0 when disabled; None
        before the first `scale`), for logging without a sync. Do not modify it."""
        return self._get_scale_async()

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        # GradScaler hands this to fused optimizers as their ``grad_scale``: 1 when disabled.
        return self._scale if self._scaling else self._unit

    # -- attribution setup ------------------------------------------------------------------------

    def watch(self, model: nn.Module, layers: Layers = None, *, outputs: bool = False) -> "LossScaler":
        """Report gradients per layer of ``model``; returns self.

        ``layers``: module fqns or a ``(module, fqn) -> bool`` filter; default: every module that
        directly owns parameters. A parameter belongs to the innermost watched module holding it;
        others are reported under their parameter fqn. ``outputs=True`` also attaches an
        `OutputWatch` on the same layers (one reduction per layer call), read on overflowing
        iterations to fill `first_nonfinite_output`. Replaces a previous watch.
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

    def _name_of(self, param: torch.Tensor, optimizer: torch.optim.Optimizer, i: int, j: int) -> str:
        name = self._param_names.get(id(param))
        return name if name is not None else f"{type(optimizer).__name__}.param_groups[{i}][{j}]"

    # -- the training-loop calls --------------------------------------------------------------------

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._unit = torch.ones((), dtype=torch.float32, device=dev)

    def _begin(self, optimizer: torch.optim.Optimizer, call: str) -> dict[str, Any]:
        """GradScaler's state for ``optimizer`` after the checks of a ``call`` to `unscale_` or
        `step`; creates the scale on its gradients' device when no `scale` call did."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeStateError(
                f"LossScaler.{call}(optimizer) after step(optimizer) in the same iteration; "
                "call update() once per iteration, after every optimizer stepped"
            )
        if call == "unscale_" and state["stage"] is OptState.UNSCALED:
            raise RuntimeStateError(
                "LossScaler.unscale_(optimizer) was already called for this optimizer since the last update(); "
                "call it once per optimizer per iteration, after the last backward pass"
            )
        self._release_held()
        if self._scale is None:
            grads = (p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            first = next(grads, None)
            self._lazy_init_scale_growth_tracker(first.device if first is not None else torch.device("cpu"))
        self._optimizers[id(optimizer)] = optimizer
        return state

    def scale(self, outputs):
        """``outputs`` (a tensor or a nested list / tuple / iterable of tensors) times the scale,
        as float32 (GradScaler's); unchanged when disabled. Keeps a reference to the tensors of a
        tensor, list or tuple, checked only if the iteration overflows. No sync."""
        if not isinstance(outputs, (torch.Tensor, Iterable)):
            raise ScalingError(f"LossScaler.scale({type(outputs).__name__}): expected a tensor or an iterable of tensors")
        self._release_held()
        tensors = [t.detach() for t in _floating_tensors(outputs)]
        self._losses.extend(tensors)
        if self._scale is None and tensors:
            self._lazy_init_scale_growth_tracker(tensors[0].device)
        return super().scale(outputs) if self._scaling else outputs

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler's ``unscale_``: divide ``optimizer``'s gradients by the scale in place and
        check them, in one fused pass (when disabled, the check alone). Optional: `step` does it;
        call it to clip or inspect the true gradients. Once per optimizer per iteration. No sync."""
        state = self._begin(optimizer, "unscale_")
        if not self._scaling:
            self._check_inf_per_device(optimizer)  # the same fused pass, multiplying by 1
            state["stage"] = OptState.UNSCALED
            return
        try:
            super().unscale_(optimizer)
        except ValueError as exc:  # GradScaler's refusal of FP16 gradients
            raise RuntimeStateError(
                f"LossScaler.unscale_(optimizer): {exc} Unscaling FP16 gradients in place flushes small values "
                "to zero; keep FP32 master weights (autoprec's runtime does) or disable the scaler"
            ) from exc

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`unscale_` (unless done) and clip ``optimizer``'s gradients to a total ``norm_type``-norm
        of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does; returns the total norm (a
        device tensor, no sync). Unlike it, a non-finite norm leaves the gradients unchanged: its
        coefficient would be NaN and spread to every gradient, so attribution would name every
        layer (the step is skipped either way). Cost: clip_grad_norm_'s passes (one norm, one
        multiply per gradient) and one 0-d ``where``."""
        if not _is_number(max_norm) or max_norm <= 0:
            raise ScalingError(f"LossScaler.clip_grad_norm_(max_norm={max_norm!r}): max_norm must be a finite number > 0")
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        # A zero norm makes the clip coefficient clamp to 1: the gradients stay as they are.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.where(total.isfinite(), total, 0.0))
        return total

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """`unscale_` (unless done) and return whether ``optimizer``'s gradients held an inf/NaN,
        as a 0-d float32 device tensor (> 0: found). No sync. For agreeing across ranks
        (`autoprec.distributed`) before `step` reads it."""
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)
        flags = list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        return torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).sum()

    def set_found_inf(self, optimizer: torch.optim.Optimizer, found: bool) -> None:
        """Overwrite ``optimizer``'s non-finite flag after `found_inf` (a decision reduced across
        ranks): `step` then skips, and `update` backs off, exactly when ``found``."""
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for i, flag in enumerate(flags.values()):
            flag.fill_(1.0 if found and i == 0 else 0.0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """GradScaler's ``step``: unscale (unless `unscale_` did) and call
        ``optimizer.step(*args, **kwargs)`` unless a gradient is inf/NaN; return its value, or
        None when skipped. One sync (the skip decision), none for fused / capturable optimizers."""
        if "closure" in kwargs:
            raise RuntimeStateError(
                "LossScaler.step(optimizer, closure=...) is not supported: the closure would recompute the "
                "gradients after they were checked; run forward and backward before step()"
            )
        self._begin(optimizer, "step")
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # GradScaler's skip decision and its one sync; the answer is kept for update().
        found = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._found[id(optimizer)] = found
        if found:
            self._attribute(optimizer)  # now, while the gradients surely exist
            return None
        return optimizer.step(*args, **kwargs)

    def _attribute(self, optimizer: torch.optim.Optimizer, grads: Optional[Grads] = None) -> None:
        names, flags = _nonfinite_gradients(optimizer, self._name_of, grads)
        self._pending_names.extend(names)
        self._pending_flags.extend(flags)

    def update(self, new_scale: Optional[float] = None) -> None:
        """End the iteration: the scale rule (see the class doc; or set the scale to ``new_scale``,
        a positive number, ignored when disabled), the counters, and on an overflowing iteration
        the attribution (see the module docstring for the syncs). Call once per iteration, after
        every optimizer stepped. With only fused / capturable optimizers no sync: the rule runs on
        the device and the results are read when first asked for."""
        states = self._per_optimizer_states
        checked = [key for key, state in states.items() if state["found_inf_per_device"]]
        if not checked:
            raise RuntimeStateError(
                "LossScaler.update() called with no step(optimizer) or unscale_(optimizer) since the last update(); "
                "call scaler.step(optimizer) first"
            )
        if new_scale is not None and (not _is_number(new_scale) or not 0 < new_scale <= _FLOAT32_MAX):
            raise ScalingError(f"LossScaler.update(new_scale={new_scale!r}): new_scale must be a finite number > 0, or None")
        # Fused optimizers skipped on the device, and optimizers unscaled but never stepped: the
        # host does not know whether they overflowed.
        unknown = [key for key in checked if key not in self._found]
        found = any(self._found.values())
        if found and unknown:
            # The iteration overflowed anyway: attribute the others too, read in the same transfer.
            for key in unknown:
                self._attribute(self._optimizers[key])
            unknown = []
        found_on_device = self._found_on_device([states[key] for key in unknown]) if unknown else None
        if self._scaling and new_scale is not None:
            super().update(float(new_scale))
        elif self._scaling and found_on_device is not None:
            self._update_on_device(found_on_device)
        elif self._scaling and found:
            self._back_off()
        elif self._scaling:
            super().update()
            # The interval was reached (the tracker restarted): a growth restores the budget.
            self._hysteresis_tracker.masked_fill_(self._growth_tracker == 0, self._hysteresis)
        self._per_optimizer_states.clear()
        if found_on_device is not None:
            self._defer(found_on_device, [self._optimizers[key] for key in unknown])
        else:
            self._finish_iteration(found)

    def _found_on_device(self, states: list[dict[str, Any]]) -> torch.Tensor:
        """The optimizers' non-finite flags summed on the scale's device (> 0: found). No sync;
        no op at all for one optimizer on one device."""
        flags = [f for state in states for f in state["found_inf_per_device"].values()]
        if len(flags) == 1 and flags[0].device == self._scale.device:
            return flags[0]
        return torch.stack([f.reshape(()).to(self._scale.device) for f in flags]).sum()

    def _back_off(self) -> None:
        """An overflowing iteration: spend one unit of the hysteresis budget; GradScaler's back-off,
        floored at ``min_scale``, once it is spent. A few 0-d device ops, no sync."""
        budget = self._hysteresis_tracker
        budget.sub_(1).clamp_(min=0)
        before = self._scale.clone()
        super().update()  # torch._amp_update_scale_: scale x backoff_factor, clean count 0
        torch.where(budget > 0, before, self._scale.clamp(min=self._min_scale), out=self._scale)

    def _update_on_device(self, found: torch.Tensor) -> None:
        """The scale rule when only the device knows whether the iteration overflowed: `_back_off`
        and the clean-iteration rule of `update` in one, chosen by ``found`` on the device (as
        ``torch._amp_update_scale_`` chooses). Nine 0-d device ops, no sync."""
        overflow = found > 0
        budget = self._hysteresis_tracker
        budget.sub_(overflow.to(budget.dtype)).clamp_(min=0)
        before = self._scale.clone()
        super().update()  # grows, or backs off and restarts the clean count, on `found`
        floored = torch.where(overflow, self._scale.clamp(min=self._min_scale), self._scale)
        torch.where(overflow & (budget > 0), before, floored, out=self._scale)
        budget.masked_fill_((self._growth_tracker == 0) & ~overflow, self._hysteresis)

    def _defer(self, found: torch.Tensor, optimizers: list[torch.optim.Optimizer]) -> None:
        """Close an iteration whose overflow the host does not know, keeping what attribution would
        need (references, until the next iteration begins)."""
        self._release_held()
        watch = self._output_watch
        outputs = (list(watch._names), list(watch._flags)) if watch is not None else ([], [])
        held = [(opt, _held_gradients(opt)) for opt in optimizers]
        self._deferred.append(_Deferred(self._steps, found, held, list(self._losses), outputs))
        self._steps += 1
        self._clear_iteration()
        if len(self._deferred) >= _MAX_DEFERRED:
            self._resolve()

    def _release_held(self) -> None:
        """A new iteration begins: the last deferred one's gradients, losses and outputs are no
        longer its own; drop the references (the memory is the optimizer's again to free)."""
        if self._deferred and self._deferred[-1].grads is not None:
            self._deferred[-1].release()

    def _resolve(self) -> None:
        """Bring the deferred iterations' flags to the host (one sync; a second transfer when the
        last one overflowed and its gradients are still held) and fill the results in order. An
        overflow found after its gradients were released is counted without layers."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        *host, scale = _to_host([d.found.reshape(()) for d in deferred] + [self._get_scale_async()])
        for d, flag in zip(deferred, host):
            found = flag > 0
            names: list[str] = []
            flags: list[torch.Tensor] = []
            if found and d.grads is not None:
                for opt, grads in d.grads:
                    more_names, more_flags = _nonfinite_gradients(opt, self._name_of, grads)
                    names.extend(more_names)
                    flags.extend(more_flags)
            self._conclude(d.iteration, found, (names, flags), d.losses, d.outputs, scale)
            d.release()

    def _finish_iteration(self, found: bool) -> None:
        self._resolve()  # earlier iterations first: the events stay in order
        iteration = self._steps
        self._steps += 1
        watch = self._output_watch
        outputs = (watch._names, watch._flags) if watch is not None else ([], [])
        self._conclude(iteration, found, (self._pending_names, self._pending_flags), self._losses, outputs)
        self._clear_iteration()

    def _conclude(
        self, iteration: int, found: bool, gradients: tuple[list[str], list[torch.Tensor]], losses: list[torch.Tensor],
        outputs: tuple[list[str], list[torch.Tensor]], scale: Optional[float] = None,
    ) -> None:
        """Fill the results of ``iteration``; on an overflow, from the attribution pass's
        ``gradients`` (names, flags), the ``losses`` and the output flags (names, 0-d flags), in
        one transfer (none when there is nothing to read and the ``scale`` to log is given)."""
        layers: tuple[str, ...] = ()
        loss_finite: Optional[bool] = None
        first_output: Optional[str] = None
        if found:
            # The iteration's one transfer: gradient flags, loss and output flags, the new scale.
            loss_flags = [_finite_flag(t) for t in losses]
            out_names, out_flags = outputs
            stacked = [torch.stack([f.to(out_flags[0].device) for f in out_flags])] if out_flags else []
            grad_names, grad_flags = gradients
            parts = grad_flags + loss_flags + stacked
            host = _to_host(parts + [self._get_scale_async()]) if parts or scale is None else [scale]
            n_grads, n_loss = len(grad_names), len(loss_flags)
            layers = self._ordered({name for name, bad in zip(grad_names, host[:n_grads]) if bad})
            loss_finite = all(host[n_grads : n_grads + n_loss]) if n_loss else None
            first_output = _first_false(out_names, host[n_grads + n_loss : -1])
            self._record_overflow(iteration, layers, host[-1], first_output)
        self._last_overflowed = found
        self._last_nonfinite_layers = layers
        self._last_loss_finite = loss_finite
        self._first_nonfinite_output = first_output

    def _clear_iteration(self) -> None:
        self._optimizers.clear()
        self._found.clear()
        self._losses.clear()
        self._pending_names.clear()
        self._pending_flags.clear()
        if self._output_watch is not None:
            self._output_watch.reset()

    def _record_overflow(self, iteration: int, layers: tuple[str, ...], scale: float, first_output: Optional[str]) -> None:
        self._skipped_steps += 1
        for name in layers:
            self._nonfinite_counts[name] = self._nonfinite_counts.get(name, 0) + 1
        self._events.append((iteration, layers))
        logger.info(
            "iteration %d: non-finite gradients in %s; optimizer step skipped; loss scale now %g%s",
            iteration, ", ".join(layers) or "(no watched gradient)", scale,
            f"; first non-finite output: {first_output}" if first_output else "",
        )
        at_floor = self._scaling and scale <= self._min_scale
        if at_floor and not self._warned_at_floor:
            # Once until an overflow finds the scale above the floor again: a stuck model would flood the log.
            logger.warning(
                "loss scale is at its floor min_scale=%g and gradients still overflow: the model, not the scale, "
                "makes inf/NaN (see last_nonfinite_layers / first_nonfinite_output)",
                self._min_scale,
            )
        self._warned_at_floor = at_floor

    # -- persistence --------------------------------------------------------------------------------

    _TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    _OWN_KEYS = (
        "min_scale", "hysteresis", "hysteresis_tracker", "max_events", "steps", "skipped_steps", "nonfinite_counts",
        "events", "last_overflowed", "last_nonfinite_layers", "last_loss_finite", "first_nonfinite_output",
    )

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's entries (so a ``GradScaler`` loads it) plus the floor, hysteresis,
        counters and events, as plain JSON-ready values. Three syncs (scale, growth and hysteresis
        trackers), and the read of deferred iterations, if any (see the module docstring): call between iterations, after `update`. ``enabled`` is not state (the caller
        chooses it); a disabled scaler saves the scale it keeps."""
        self._resolve()
        sd = super().state_dict()
        sd["scale"] = self._init_scale if self._scale is None else float(self._scale.item())
        sd.update(
            min_scale=self._min_scale,
            hysteresis=self._hysteresis,
            hysteresis_tracker=self._init_hysteresis_tracker if self._hysteresis_tracker is None else int(self._hysteresis_tracker.item()),
            max_events=self._max_events,
            steps=self._steps,
            skipped_steps=self._skipped_steps,
            nonfinite_counts=dict(self._nonfinite_counts),
            events=[[step, list(layers)] for step, layers in self._events],
            last_overflowed=self._last_overflowed,
            last_nonfinite_layers=list(self._last_nonfinite_layers),
            last_loss_finite=self._last_loss_finite,
            first_nonfinite_output=self._first_nonfinite_output,
        )
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore everything `state_dict` saved, configuration included. Raises `ScalingError`
        naming missing or invalid entries, `RuntimeStateError` in the middle of an iteration."""
        if self._optimizers:
            raise RuntimeStateError("LossScaler.load_state_dict() called in the middle of an iteration; call it before the first step or right after update()")
        if not isinstance(state_dict, Mapping):
            raise ScalingError(f"LossScaler.load_state_dict({type(state_dict).__name__}): expected the mapping state_dict() returned")
        sd = state_dict
        missing = [k for k in self._TORCH_KEYS + self._OWN_KEYS if k not in sd]
        if missing:
            raise ScalingError(f"LossScaler.load_state_dict(): missing {', '.join(missing)}; pass a dict from LossScaler.state_dict()")
        scale, min_scale = sd["scale"], sd["min_scale"]
        if not _is_number(scale) or not _is_number(min_scale) or not 0 < min_scale <= scale <= _FLOAT32_MAX:
            raise ScalingError(f"LossScaler.load_state_dict(): scale={scale!r} must be a finite number >= min_scale={min_scale!r} > 0")
        _check_config("LossScaler.load_state_dict", scale, sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"],
                      sd["min_scale"], sd["hysteresis"], sd["max_events"])
        for key in ("_growth_tracker", "hysteresis_tracker", "steps", "skipped_steps"):
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
        super().load_state_dict({k: sd[k] for k in self._TORCH_KEYS})
        self._deferred.clear()  # the loaded counters replace what they would have added to
        self._min_scale = float(sd["min_scale"])
        self._hysteresis = int(sd["hysteresis"])
        self._init_hysteresis_tracker = min(int(sd["hysteresis_tracker"]), self._hysteresis)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        self._max_events = int(sd["max_events"])
        self._steps = int(sd["steps"])
        self._skipped_steps = int(sd["skipped_steps"])
        self._nonfinite_counts = counts
        self._events = collections.deque(events, maxlen=self._max_events)
        self._last_overflowed = bool(sd["last_overflowed"])
        self._last_nonfinite_layers = last_layers
        self._last_loss_finite = sd["last_loss_finite"]
        self._first_nonfinite_output = sd["first_nonfinite_output"]
