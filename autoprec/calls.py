"""A model call as people make it, captured once and replayed wherever the model is re-run.

``model(x)``, ``model(x, mask)`` and ``model(input_ids=x, labels=y)`` are all one `ModelCall`:
positional and keyword inputs together. Every site that re-runs a model from inputs it saw
(layer tracing, cost tracing, the sensitivity estimate, calibration, the scheduler's search)
replays a `ModelCall`, so keyword inputs are never dropped. `loss_of` and `prediction_of` read
a model's output whether it is a tensor, a dict / ``transformers`` ``ModelOutput`` with a
``loss`` field, or a tuple.

A recorded call is isolated from the run it came from, and every replay from the others
(`isolated`, `fresh`): an argument is not only tensors in tuples, lists and dicts but may be an
object that holds tensors and that the call changes, a ``transformers`` ``Cache`` above all (a
decoder layer appends its keys and values to it). Replaying a call with the object the real
forward used would read tensors of that forward's graph (a backward through them fails once its
graph is freed) and keys it appended itself, and would append again. So such an object (any
list, dict or object with a ``__dict__``: an empty cache holds no tensor yet) is copied, its
tensors detached, as the call begins, and copied again, tensors cloned, for each replay.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import ModelCallError

__all__ = ["ModelCall", "loss_field", "loss_of", "prediction_of", "predictions_of", "isolated", "fresh", "changeable"]


_SHARED = (nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, enum.Enum,
           str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def changeable(value: Any) -> bool:
    """Whether a call may change ``value`` in place: an object that `isolated` copies (a KV
    cache, a list, a dict), not a tensor nor one of the values it keeps as they are."""
    return not torch.is_tensor(value) and not isinstance(value, _SHARED)


def isolated(value: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor], memo: "dict | None" = None) -> Any:
    """A copy of ``value`` that a run can change without touching ``value``: ``copy_tensor``
    applied to every tensor in it, however deep, and every list, dict and other object with a
    ``__dict__`` in it copied (``copy.copy``, then its contents isolated) whether or not it
    holds a tensor yet, since a call may fill it (a ``transformers`` ``Cache`` holds no tensor
    until its first layer runs). Tuples are rebuilt only around what changed. Kept as they are:
    modules, classes, functions, enums, scalars, strings, and objects without a ``__dict__``
    (``__slots__`` only). ``memo`` keeps an object reached twice one copy, a cycle included.

    Cost: one Python visit per object reached (about a microsecond; a KV cache of L layers is
    about 5 L objects), plus what ``copy_tensor`` costs. An object of a class that copies the
    default way (no ``__copy__``, ``__reduce__``, ``__getstate__`` or slots of its own: a
    ``transformers`` cache layer) is copied without ``copy.copy``'s generic path, to the same
    result."""
    return _isolate(value, copy_tensor, {} if memo is None else memo)


# Exact types kept as they are, tested before anything else: most of what a cache holds.
_KEPT_TYPES = frozenset({str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device})


def _isolate(value: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor], memo: dict) -> Any:
    if type(value) in _KEPT_TYPES:
        return value
    key = id(value)
    out = memo.get(key, memo)  # the memo itself: not seen yet
    if out is not memo:
        return out
    if isinstance(value, torch.Tensor):
        out = copy_tensor(value)
    elif isinstance(value, _SHARED):
        out = value
    else:
        out = _isolated_contents(value, key, copy_tensor, memo)
    memo[key] = out
    return out


def _isolated_contents(value: Any, key: int, copy_tensor, memo: dict) -> Any:
    kind: Any = type(value)
    if isinstance(value, tuple):
        items = [_isolate(v, copy_tensor, memo) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if kind is list or kind is dict or _copies_plainly(kind):
        # The copy goes into the memo before its contents, so that a cycle back here finds it.
        out: Any = [] if kind is list else {} if kind is dict else kind.__new__(kind)
        memo[key] = out
        kept = _KEPT_TYPES  # tested inline: most attributes are flags, sizes and devices
        if kind is list:
            out.extend([v if type(v) in kept else _isolate(v, copy_tensor, memo) for v in value])
        elif kind is dict:
            out.update({k: v if type(v) in kept else _isolate(v, copy_tensor, memo) for k, v in value.items()})
        else:
            out.__dict__.update({k: v if type(v) in kept else _isolate(v, copy_tensor, memo) for k, v in value.__dict__.items()})
        return out
    memo[key] = value  # a cycle back here sees the object itself
    if isinstance(value, list):
        return _copied_with(value, items=[_isolate(v, copy_tensor, memo) for v in value])
    if isinstance(value, dict):
        return _copied_with(value, items={k: _isolate(v, copy_tensor, memo) for k, v in value.items()})
    state = getattr(value, "__dict__", None)
    if not isinstance(state, dict):
        return value
    return _copied_with(value, attrs={k: _isolate(v, copy_tensor, memo) for k, v in state.items()})


_PLAIN_COPY: dict = {}  # class -> whether copy.copy of its instances is __new__ plus their __dict__
_OBJECT_GETSTATE = getattr(object, "__getstate__", None)  # Python 3.11+


def _copies_plainly(kind: type) -> bool:
    """Whether ``copy.copy`` of a ``kind`` instance is ``kind.__new__(kind)`` holding a copy of
    its ``__dict__``: the default reduction (``copyreg.__newobj__`` and the instance dict), no
    hook of the class's own, no slots holding state. Decided once per class."""
    plain = _PLAIN_COPY.get(kind)
    if plain is None:
        plain = (
            kind.__reduce_ex__ is object.__reduce_ex__
            and kind.__reduce__ is object.__reduce__
            and getattr(kind, "__getstate__", None) is _OBJECT_GETSTATE
            and not hasattr(kind, "__setstate__")
            and not hasattr(kind, "__copy__")
            and not any(vars(c).get("__slots__") for c in kind.__mro__)  # abc.ABC's empty slots hold nothing
            and not issubclass(kind, type)
            and "__dict__" in dir(kind)
        )
        _PLAIN_COPY[kind] = plain
    return plain


def _copied_with(value: Any, items: Any = None, attrs: "dict | None" = None) -> Any:
    """A shallow copy of ``value`` holding ``items`` (list elements / dict values) and ``attrs``."""
    try:
        out = copy.copy(value)
    except Exception as exc:
        raise ModelCallError(
            f"a model or layer call has an argument of type {type(value).__name__} that cannot be copied "
            f"({type(exc).__name__}: {exc}); autoprec re-runs calls on copies of their arguments, so make it copyable (copy.copy)"
        ) from exc
    if isinstance(items, list):
        out[:] = items
    elif isinstance(items, dict):
        for k, v in items.items():
            out[k] = v
    if attrs is not None:
        vars(out).update(attrs)
    return out


def fresh(value: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.clone, memo: "dict | None" = None) -> Any:
    """``value`` for one more run of a recorded call: tensors in tuples, lists and dicts as they
    are, other objects (a KV cache, which the run changes) copied by `isolated` with
    ``copy_tensor`` applied to their tensors (default: cloned, so that no run sees what another
    wrote, even a cache that writes its tensors in place); ``memo`` as `isolated`'s. Costs one
    copy of those objects' tensors per run; nothing when the call has only tensors and scalars."""
    memo = {} if memo is None else memo
    return pytree.tree_map(lambda leaf: leaf if torch.is_tensor(leaf) else isolated(leaf, copy_tensor, memo), value)


def _detached(value: Any, device: "torch.device | None") -> Any:
    def one(leaf):
        leaf = leaf.detach()
        return leaf.to(device, copy=True) if device is not None else leaf.clone()

    return isolated(value, one)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: comparing tensors has no single truth value
class ModelCall:
    """The positional ``args`` and keyword ``kwargs`` of one model call; ``call(model)`` replays it."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", types.MappingProxyType(dict(self.kwargs)))

    @classmethod
    def of(cls, example: Any) -> "ModelCall":
        """``example_inputs`` as autoprec's functions take them: a `ModelCall`, a dict of keyword
        inputs, a tuple of positional inputs, or one input."""
        if isinstance(example, ModelCall):
            return example
        if isinstance(example, Mapping):
            bad = [k for k in example if not isinstance(k, str)]
            if bad:
                raise ModelCallError(f"example_inputs: a dict is keyword inputs, so its keys must be strings, got {bad[0]!r}; pass a tuple for positional inputs")
            return cls((), example)
        if isinstance(example, tuple):
            return cls(example)
        return cls((example,))

    @classmethod
    def capture(cls, args: tuple, kwargs: "Mapping[str, Any] | None" = None, device: "torch.device | str | None" = None) -> "ModelCall":
        """A copy of a call that outlives it: every tensor detached and cloned (onto ``device``
        when given), also those inside other objects (`isolated`), other values kept. One copy
        of each input tensor; no host sync on one device."""
        device = torch.device(device) if device is not None else None
        return cls(_detached(tuple(args), device), _detached(dict(kwargs or {}), device))

    @classmethod
    def first(cls, model: nn.Module, run: Callable[[], Any]) -> "ModelCall | None":
        """The first call of ``model`` while ``run()`` runs (e.g. ``workload.loss(model, batch)``),
        or None if it never calls the model. The inputs are the call's own tensors, not copies,
        but another object (a KV cache) is copied as it was when the call began, its tensors
        detached, since the call goes on to change it (`fresh`). ``run`` runs once under
        ``torch.no_grad`` in eval mode with the RNG forked, so dropout and BatchNorm statistics
        are as if it had not run; the training flags are restored."""
        seen: list = []

        def pre(module, args, kwargs):
            if not seen:
                seen.append(cls(*fresh((args, kwargs), torch.Tensor.detach)))

        training = {m: m.training for m in model.modules()}
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        handle = model.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            model.eval()
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                run()
        finally:
            handle.remove()
            for m, flag in training.items():
                m.training = flag
        return seen[0] if seen else None

    def __call__(self, model: nn.Module) -> Any:
        """``model(*args, **kwargs)``, objects other than tensors and scalars (a KV cache)
        copied for this run (`fresh`), so that replays neither share nor change them."""
        args, kwargs = fresh((self.args, dict(self.kwargs)))
        return model(*args, **kwargs)

    def to_state(self) -> dict:
        """Plain containers for a checkpoint (``torch.save`` with ``weights_only=True`` loads them)."""
        return {"args": list(self.args), "kwargs": dict(self.kwargs)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "ModelCall":
        return cls(tuple(state["args"]), state["kwargs"])


def loss_field(output: Any) -> Any:
    """A model output's ``loss`` field (a dict's or a ``ModelOutput``'s), or None."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself when it is a tensor, its ``loss`` field
    (a dict or a ``transformers`` ``ModelOutput``), or the first element of a tuple / list (as
    ``transformers`` returns with ``return_dict=False``)."""
    if torch.is_tensor(output):
        return output
    loss = loss_field(output)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not torch.is_tensor(loss):
        raise ModelCallError(
            f"the model returned {type(output).__name__} with no loss tensor; call it with labels "
            "(a 'loss' field), or return the loss itself"
        )
    return loss


def predictions_of(output: Any) -> list[torch.Tensor]:
    """Every floating tensor of a model's output but its loss, in output order: the fields of a
    ``ModelOutput`` / dict but ``loss``, or a tuple's tensors after a leading scalar loss."""
    if isinstance(output, Mapping):
        output = {k: v for k, v in output.items() if k != "loss"}
    leaves = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()]
    if len(leaves) > 1 and leaves[0].dim() == 0:
        leaves = leaves[1:]  # (loss, logits, ...): the loss is a scalar before the prediction
    if not leaves:
        raise ModelCallError(f"the model returned {type(output).__name__} with no floating-point tensor; autoprec needs the model's prediction")
    return leaves


def prediction_of(output: Any) -> torch.Tensor:
    """The first of `predictions_of`: the logits of a model that returns its loss beside them."""
    return predictions_of(output)[0]
