"""Which layers went non-finite: the overflow attribution beside `scaling.LossScaler`.

- `OutputWatch`: forward hooks recording, with no host sync, whether each watched layer's output
  was finite; names the first layer, in call order, whose output was not (what made a loss inf/NaN).
- `LayerNames`: parameter -> owning layer fqn, and model order, for naming gradients.
- `Attribution`: the counts, events and last iteration's attribution the scaler reports.
- `check_and_unscale`: GradScaler's fused unscale-and-check, one pass per device and dtype.
- `nonfinite_gradients`: the attribution pass (one inf-norm per gradient, grouped by device and
  dtype), run only on an overflowing iteration.

Nothing here syncs except `OutputWatch.first_nonfinite` and `to_host` (one transfer each).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..coverage import ModuleFilter, layer_name
from ..errors import RuntimeStateError, ScalingError
from ..saved_bytes import local_shard
from ..runtime.recompute import recomputing, training_forward

__all__ = ["OutputWatch", "LayerNames", "Attribution", "Layers", "check_and_unscale", "nonfinite_gradients", "summed_flags"]

# Deferred iterations kept before the scaler reads their flags itself: one sync per this many
# iterations when nothing reads a result (each entry is one 0-d tensor made anyway).
_MAX_DEFERRED = 1024

Layers = Union[Sequence[str], ModuleFilter, None]


def resolve_layers(model: nn.Module, layers: Layers, where: str) -> list[str]:
    """Layer fqns in model order: those named, those the filter accepts, or by default every
    module that directly owns parameters. The root module is a layer only when named (a model
    that is itself one layer); otherwise parameters it owns directly are reported under their own
    fqn."""
    modules = dict(model.named_modules())
    if layers is None:
        return [fqn for fqn, m in modules.items() if fqn and next(m.parameters(recurse=False), None) is not None]
    if callable(layers):
        return [fqn for fqn, m in modules.items() if fqn and layers(m, fqn)]
    if isinstance(layers, str):
        raise ScalingError(f"{where}(layers={layers!r}): layers must be a sequence of module fqns such as ['0', 'head'], not one string")
    wanted = list(layers)
    # The root '' only when named: a model that is itself one layer (a bare nn.Linear).
    unknown = [f for f in wanted if not isinstance(f, str) or f not in modules]
    if unknown:
        sample = ", ".join(repr(f) for f in list(modules)[1:6])
        raise ScalingError(
            f"{where}(layers=...): unknown layer fqn(s) {', '.join(repr(f) for f in unknown)}; "
            f"use names from model.named_modules(), e.g. {sample}"
        )
    chosen = set(wanted)
    return [fqn for fqn in modules if fqn in chosen]


def finite_flag(t: torch.Tensor) -> torch.Tensor:
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


def floating_tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from floating_tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from floating_tensors(v)


def to_host(parts: list[torch.Tensor]) -> list[float]:
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
        self._layers = tuple(resolve_layers(model, layers, "OutputWatch"))
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
            if not self._include_no_grad and not training_forward(look_up=True):
                return
            if recomputing():
                return  # a recomputed block's forward again in the backward: this call was recorded
            flags = [finite_flag(t) for t in floating_tensors(output)]
            if not flags:
                return
            self._names.append(fqn)
            self._flags.append(flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).all())

        return hook

    def records(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, 0-d bool finite flags) of the recorded calls, as copies of the lists; no sync."""
        return list(self._names), list(self._flags)

    def pending(self) -> tuple[list[str], Optional[torch.Tensor]]:
        """(names, 1-D bool device tensor of finite flags) of the recorded calls; no sync."""
        if not self._flags:
            return [], None
        device = self._flags[0].device
        return list(self._names), torch.stack([f.to(device) for f in self._flags])

    def first_nonfinite(self) -> Optional[str]:
        """The fqn of the first recorded call whose output held an inf or NaN, or None. One sync."""
        names, flags = self.pending()
        return first_false(names, to_host([flags]) if flags is not None else [])


def first_false(names: Sequence[str], finite: Sequence[float]) -> Optional[str]:
    for name, ok in zip(names, finite):
        if not ok:
            return name
    return None


NameOf = Callable[[torch.Tensor, torch.optim.Optimizer, int, int], str]


Grads = list  # per param group, the gradients (or None) in param order: what `held_gradients` keeps


def held_gradients(optimizer: torch.optim.Optimizer) -> Grads:
    """References to ``optimizer``'s gradients (no copy, no device op)."""
    return [[p.grad for p in group["params"]] for group in optimizer.param_groups]


def nonfinite_gradients(optimizer: torch.optim.Optimizer, name_of: NameOf, grads: Optional[Grads] = None) -> tuple[list[str], list[torch.Tensor]]:
    """The attribution pass, run only on an overflowing iteration: the names of ``optimizer``'s
    gradients (``grads``, as `held_gradients` kept them, else the current ones) and, per
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
            tensors, group_names = groups.setdefault((values.device, values.dtype), ([], []))
            tensors.append(values)
            group_names.append(name_of(param, optimizer, i, j))
    names: list[str] = []
    flags: list[torch.Tensor] = []
    with torch.no_grad():
        for tensors, group_names in groups.values():
            flags.append(~torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite())
            names.extend(group_names)
    return names, flags


def check_and_unscale(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, refuse_fp16: bool) -> dict[torch.device, torch.Tensor]:
    """Multiply ``optimizer``'s gradients by ``inv_scale`` and flag inf/NaN, in one fused pass per
    (device, dtype) (``torch._amp_foreach_non_finite_check_and_unscale_``, as GradScaler runs it);
    returns the 0-d float32 flags per device (> 0: found). No sync. ``refuse_fp16``: raise
    `RuntimeStateError` on an FP16 gradient (unscaled in place, small values flush to zero).
    A DTensor gradient (FSDP2, tensor parallelism) is unscaled and checked on this rank's shard
    (its local tensor is its storage): DTensor refuses one fused call mixing DTensors with plain
    tensors (a tensor-parallel model's unsharded norms), so the flag is this rank's, and the
    ranks' flags are summed by `distributed.RankAgreement.agree_on_step`."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if refuse_fp16 and grad.dtype == torch.float16:
                raise RuntimeStateError(
                    "LossScaler.unscale_(optimizer): Attempting to unscale FP16 gradients. Unscaling FP16 gradients "
                    "in place flushes small values to zero; keep FP32 master weights (autoprec's runtime does) "
                    "or disable the scaler"
                )
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            grad = local_shard(grad)
            groups[(grad.device, grad.dtype)].append(grad)
    found: dict[torch.device, torch.Tensor] = {}
    inv: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), grads in groups.items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv[device] = inv_scale.to(device, non_blocking=True)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv[device])
    return found


def summed_flags(flags: list[torch.Tensor], device: torch.device, copy: bool = False) -> torch.Tensor:
    """Non-finite flags summed on ``device`` (> 0: found); no op for one flag already there
    unless ``copy``. No sync."""
    if len(flags) == 1 and flags[0].device == device and not copy:
        return flags[0]
    return torch.stack([f.reshape(()).to(device, non_blocking=True) for f in flags]).sum()


@dataclasses.dataclass
class Deferred:
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


class LayerNames:
    """Gradients named per layer of a watched model: a parameter belongs to the innermost watched
    module holding it, else to its own fqn; unwatched models' parameters are named
    ``"<Optimizer>.param_groups[i][j]"``. Names sort in model order (unwatched ones after, in the
    order first met)."""

    def __init__(self) -> None:
        self._param_names: dict[int, str] = {}  # id(param) -> reported name
        self._params: list[torch.Tensor] = []  # keeps the ids above valid
        self._rank: dict[str, int] = {}  # name -> model-order rank

    def watch(self, model: nn.Module, fqns: Sequence[str]) -> None:
        self.clear()
        watched = set(fqns)
        for pname, param in model.named_parameters():
            owner, parts = pname, pname.split(".")
            for cut in range(len(parts) - 1, -1, -1):  # down to the root '', watched in a one-layer model
                prefix = ".".join(parts[:cut])
                if prefix in watched:
                    owner = prefix
                    break
            self._param_names[id(param)] = owner
            self._params.append(param)
            self._rank.setdefault(owner, len(self._rank))

    def clear(self) -> None:
        self._param_names.clear()
        self._params.clear()
        self._rank.clear()

    def name_of(self, param: torch.Tensor, optimizer: torch.optim.Optimizer, i: int, j: int) -> str:
        name = self._param_names.get(id(param))
        return name if name is not None else f"{type(optimizer).__name__}.param_groups[{i}][{j}]"

    def ordered(self, names: Iterable[str]) -> tuple[str, ...]:
        for name in names:
            self._rank.setdefault(name, len(self._rank))
        return tuple(sorted(names, key=self._rank.__getitem__))


# The overflow log keeps the scaler's logger name: users filter on it.
_log = logging.getLogger("autoprec.scaling")

Read = Callable[[list[torch.Tensor]], list[float]]  # the scaler's one device-to-host transfer
Attribute = Callable[[torch.optim.Optimizer, NameOf, Optional[Grads]], tuple[list[str], list[torch.Tensor]]]


class Attribution:
    """Everything `scaling.LossScaler` reports about overflows, kept beside it: the watched model
    (`LayerNames`, an optional `OutputWatch`), the iteration's losses and attribution-pass flags,
    the counts and last ``max_events`` events, the last iteration's attribution, and the
    iterations only the device knows about yet (fused optimizers), kept as `Deferred` until read.
    Device flags reach the host only through the ``read`` the scaler hands in (its one transfer
    per iteration); the attribution pass is the ``attribute`` it hands in."""

    KEYS = ("steps", "skipped_steps", "nonfinite_counts", "events", "last_overflowed", "last_nonfinite_layers",
            "last_loss_finite", "first_nonfinite_output")  # what `state_dict` saves

    def __init__(self, max_events: int) -> None:
        self.names = LayerNames()
        self.output_watch: Optional[OutputWatch] = None
        self._watched: "tuple[nn.Module, list[str]] | None" = None  # the model and layers `watch` was given
        self.steps = 0
        self.skipped_steps = 0
        self.nonfinite_counts: dict[str, int] = {}
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.last_overflowed = False
        self.last_nonfinite_layers: tuple[str, ...] = ()
        self.last_loss_finite: Optional[bool] = None
        self.first_nonfinite_output: Optional[str] = None
        self.deferred: list[Deferred] = []
        self._warned_at_floor = False
        # The iteration in progress: what `scale` was given (references), the attribution pass's flags.
        self.losses: list[torch.Tensor] = []
        self._pending: tuple[list[str], list[torch.Tensor]] = ([], [])

    def watch(self, model: nn.Module, fqns: Sequence[str], outputs: bool) -> None:
        self.unwatch()
        self.names.watch(model, fqns)
        self._watched = (model, list(fqns))
        self.watch_outputs(outputs)

    def watch_outputs(self, on: bool) -> None:
        """Attach (``on``) or detach the `OutputWatch` on the watched model's layers."""
        if on and self.output_watch is None and self._watched is not None:
            self.output_watch = OutputWatch(*self._watched).attach()
        elif not on and self.output_watch is not None:
            self.output_watch.detach()
            self.output_watch = None

    def unwatch(self) -> None:
        self.watch_outputs(False)
        self._watched = None
        self.names.clear()

    def _shown(self, names: Sequence[str]) -> list[str]:
        """``names`` as logged: the watched root '' by its class (`coverage.layer_name`)."""
        root = self._watched[0] if self._watched is not None else "the model"
        return [layer_name(n, root) for n in names]

    def _outputs(self) -> tuple[list[str], list[torch.Tensor]]:
        return self.output_watch.records() if self.output_watch is not None else ([], [])

    def attribute(self, attribute: Attribute, optimizer: torch.optim.Optimizer) -> None:
        """Run the attribution pass over ``optimizer``'s current gradients (no sync)."""
        names, flags = attribute(optimizer, self.names.name_of, None)
        self._pending[0].extend(names)
        self._pending[1].extend(flags)

    def clear_iteration(self) -> None:
        self.losses.clear()
        self._pending = ([], [])
        if self.output_watch is not None:
            self.output_watch.reset()

    def finish(self, found: bool, read: Read, attribute: Attribute, scale: torch.Tensor, floor: Optional[float]) -> None:
        """Close an iteration whose overflow the host knows: earlier deferred ones first (the
        events stay in order), then this one's results."""
        self.resolve(read, attribute, scale, floor)
        self.steps += 1
        self.conclude(self.steps - 1, found, self._pending, self.losses, self._outputs(), read, scale, floor)
        self.clear_iteration()

    def defer(self, found: torch.Tensor, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Close an iteration whose overflow the host does not know, keeping what attribution would
        need (references, until the next iteration begins). True when enough are kept that the
        scaler should read them now."""
        self.release_held()
        held = [(opt, held_gradients(opt)) for opt in optimizers]
        self.deferred.append(Deferred(self.steps, found, held, list(self.losses), self._outputs()))
        self.steps += 1
        self.clear_iteration()
        return len(self.deferred) >= _MAX_DEFERRED

    def release_held(self) -> None:
        """A new iteration begins: the last deferred one's gradients, losses and outputs are no
        longer its own; drop the references (the memory is the optimizer's again to free)."""
        if self.deferred and self.deferred[-1].grads is not None:
            self.deferred[-1].release()

    def resolve(self, read: Read, attribute: Attribute, scale: torch.Tensor, floor: Optional[float]) -> None:
        """Bring the deferred iterations' flags to the host (one ``read``; a second when the last
        one overflowed and its gradients are still held) and fill the results in order. An
        overflow found after its gradients were released is counted without layers."""
        if not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        *host, scale_now = read([d.found.reshape(()) for d in deferred] + [scale])
        for d, flag in zip(deferred, host):
            found = flag > 0
            names: list[str] = []
            flags: list[torch.Tensor] = []
            if found and d.grads is not None:
                for opt, grads in d.grads:
                    more_names, more_flags = attribute(opt, self.names.name_of, grads)
                    names.extend(more_names)
                    flags.extend(more_flags)
            self.conclude(d.iteration, found, (names, flags), d.losses, d.outputs, read, scale, floor, scale_now)
            d.release()

    def conclude(
        self, iteration: int, found: bool, gradients: tuple[list[str], list[torch.Tensor]], losses: list[torch.Tensor],
        outputs: tuple[list[str], list[torch.Tensor]], read: Read, scale: torch.Tensor, floor: Optional[float],
        scale_now: Optional[float] = None,
    ) -> None:
        """Fill the results of ``iteration``; on an overflow, from the attribution pass's
        ``gradients`` (names, flags), the ``losses`` and the output flags (names, 0-d flags), in
        one ``read`` with the ``scale`` (none when there is nothing to read and ``scale_now`` is
        known). ``floor``: ``min_scale`` while scaling is on, else None."""
        layers: tuple[str, ...] = ()
        loss_finite: Optional[bool] = None
        first_output: Optional[str] = None
        if found:
            loss_flags = [finite_flag(t) for t in losses]
            out_names, out_flags = outputs
            stacked = [torch.stack([f.to(out_flags[0].device) for f in out_flags])] if out_flags else []
            grad_names, grad_flags = gradients
            parts = grad_flags + loss_flags + stacked
            host = read(parts + [scale]) if parts or scale_now is None else [scale_now]
            n_grads, n_loss = len(grad_names), len(loss_flags)
            layers = self.names.ordered({name for name, bad in zip(grad_names, host[:n_grads]) if bad})
            loss_finite = all(host[n_grads : n_grads + n_loss]) if n_loss else None
            first_output = first_false(out_names, host[n_grads + n_loss : -1])
            self._record(iteration, layers, host[-1], first_output, floor)
        self.last_overflowed = found
        self.last_nonfinite_layers = layers
        self.last_loss_finite = loss_finite
        self.first_nonfinite_output = first_output

    def _record(self, iteration: int, layers: tuple[str, ...], scale: float, first_output: Optional[str], floor: Optional[float]) -> None:
        self.skipped_steps += 1
        for name in layers:
            self.nonfinite_counts[name] = self.nonfinite_counts.get(name, 0) + 1
        self.events.append((iteration, layers))
        _log.info(
            "iteration %d: non-finite gradients in %s; optimizer step skipped; loss scale now %g%s",
            iteration, ", ".join(self._shown(layers)) or "(no watched gradient)", scale,
            f"; first non-finite output: {self._shown([first_output])[0]}" if first_output is not None else "",
        )
        at_floor = floor is not None and scale <= floor
        if at_floor and not self._warned_at_floor:
            # Once until an overflow finds the scale above the floor again: a stuck model would flood the log.
            _log.warning(
                "loss scale is at its floor min_scale=%g and gradients still overflow: the model, not the scale, "
                "makes inf/NaN (see last_nonfinite_layers / first_nonfinite_output)",
                floor,
            )
        self._warned_at_floor = at_floor

    def state_dict(self) -> dict[str, Any]:
        """The counters and events as plain JSON-ready values (call after `resolve`)."""
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "nonfinite_counts": dict(self.nonfinite_counts),
            "events": [[step, list(layers)] for step, layers in self.events],
            "last_overflowed": self.last_overflowed,
            "last_nonfinite_layers": list(self.last_nonfinite_layers),
            "last_loss_finite": self.last_loss_finite,
            "first_nonfinite_output": self.first_nonfinite_output,
        }

    def load_state_dict(self, sd: Mapping[str, Any], max_events: int) -> None:
        """Restore what `state_dict` saved; raises `ScalingError` naming a malformed entry."""
        for key in ("steps", "skipped_steps"):
            if not isinstance(sd[key], int) or isinstance(sd[key], bool) or sd[key] < 0:
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
        self.deferred.clear()  # the loaded counters replace what they would have added to
        self.steps, self.skipped_steps = int(sd["steps"]), int(sd["skipped_steps"])
        self.nonfinite_counts = counts
        self.events = collections.deque(events, maxlen=max_events)
        self.last_overflowed = bool(sd["last_overflowed"])
        self.last_nonfinite_layers = last_layers
        self.last_loss_finite = sd["last_loss_finite"]
        self.first_nonfinite_output = sd["first_nonfinite_output"]
