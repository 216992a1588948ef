"""A model call as people make it, captured once and replayed wherever the model is re-run.

``model(x)``, ``model(x, mask)`` and ``model(input_ids=x, labels=y)`` are all one `ModelCall`:
positional and keyword inputs together. Every site that re-runs a model from inputs it saw
(layer tracing, cost tracing, the sensitivity estimate, calibration, the scheduler's search)
replays a `ModelCall`, so keyword inputs are never dropped. `loss_of` and `prediction_of` read
a model's output whether it is a tensor, a dict / ``transformers`` ``ModelOutput`` with a
``loss`` field, or a tuple.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import ModelCallError

__all__ = ["ModelCall", "loss_of", "prediction_of"]


def _detached(value: Any, device: "torch.device | None") -> Any:
    def one(leaf):
        if not torch.is_tensor(leaf):
            return leaf
        leaf = leaf.detach()
        return leaf.to(device, copy=True) if device is not None else leaf.clone()

    return pytree.tree_map(one, value)


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
        when given), other values kept. One copy of each input tensor; no host sync on one device."""
        device = torch.device(device) if device is not None else None
        return cls(_detached(tuple(args), device), _detached(dict(kwargs or {}), device))

    @classmethod
    def first(cls, model: nn.Module, run: Callable[[], Any]) -> "ModelCall | None":
        """The first call of ``model`` while ``run()`` runs (e.g. ``workload.loss(model, batch)``),
        or None if it never calls the model. The inputs are the call's own tensors, not copies.
        ``run`` runs once under ``torch.no_grad`` in eval mode with the RNG forked, so dropout and
        BatchNorm statistics are as if it had not run; the training flags are restored."""
        seen: list = []

        def pre(module, args, kwargs):
            if not seen:
                seen.append(cls(args, kwargs))

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
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    def to_state(self) -> dict:
        """Plain containers for a checkpoint (``torch.save`` with ``weights_only=True`` loads them)."""
        return {"args": list(self.args), "kwargs": dict(self.kwargs)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "ModelCall":
        return cls(tuple(state["args"]), state["kwargs"])


def _loss_field(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself when it is a tensor, its ``loss`` field
    (a dict or a ``transformers`` ``ModelOutput``), or the first element of a tuple / list (as
    ``transformers`` returns with ``return_dict=False``)."""
    if torch.is_tensor(output):
        return output
    loss = _loss_field(output)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not torch.is_tensor(loss):
        raise ModelCallError(
            f"the model returned {type(output).__name__} with no loss tensor; call it with labels "
            "(a 'loss' field), or return the loss itself"
        )
    return loss


def prediction_of(output: Any) -> torch.Tensor:
    """The first floating tensor of a model's output that is not its loss: the logits of a
    ``ModelOutput`` / dict with a ``loss`` field, or of a tuple whose first element is a scalar loss."""
    if isinstance(output, Mapping):
        output = {k: v for k, v in output.items() if k != "loss"}
    leaves = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()]
    if len(leaves) > 1 and leaves[0].dim() == 0:
        leaves = leaves[1:]  # (loss, logits, ...): the loss is a scalar before the prediction
    if not leaves:
        raise ModelCallError(f"the model returned {type(output).__name__} with no floating-point tensor; autoprec needs the model's prediction")
    return leaves[0]
