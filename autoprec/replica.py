"""A plain copy of a model: `plain_copy`, what the search's off-path work runs on.

A model sharded by FSDP2 (``fully_shard``) holds each parameter as a DTensor shard and runs
collectives in its forward (all-gathers) and backward (reduce-scatters), so a forward on one rank
alone waits forever for the others; and FSDP2 refuses ``copy.deepcopy``. `plain_copy` gathers
each sharded parameter whole (``DTensor.full_tensor``: an all-gather every rank of its mesh must
call, in the same order: parameters in ``named_parameters`` order) and, on the rank that keeps
it, builds the same module tree with FSDP2's wrapping removed: each module of its own class again
(FSDP2 swaps in a subclass), without FSDP2's state and hooks (nor autoprec's: the scheduler's
own must not run on its copy), holding the whole parameters. A
model with no DTensor parameter is copied the same way, its parameters as they are (no
collective): module by module, each one's own attributes deep-copied and its hooks kept by
reference, not through ``copy.deepcopy`` of the whole model, which at 64 decoder layers took 2-3x
as long in a training run (each module's hook dictionaries rebuilt through its pickling protocol).

A model under tensor parallelism (``parallelize_module``: ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``...) is copied the same way: its
weights (and any DTensor buffer) gathered whole, and the styles' hooks dropped (they turn inputs
and outputs into DTensors over the mesh), so the copy is the unsharded model, computing on one
rank what the ranks compute together. A forward that makes DTensors itself (``from_local`` in
the user's code) is not undone.

Costs: the model's FP32 parameters once more on the keeping rank (on its device), and per sharded
parameter one all-gather of it on every rank.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

__all__ = ["plain_copy", "is_sharded"]

# What FSDP2 adds to a module's __dict__ (besides its class and hooks): its state and flags.
_FSDP_KEYS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
_STATE_PREFIX = "__composable_api_state_key"


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def is_sharded(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (FSDP2, tensor parallelism)."""
    return any(_is_dtensor(p) for p in model.parameters())


def plain_copy(model: nn.Module, keep: bool = True) -> Optional[nn.Module]:
    """A copy of ``model`` with every parameter whole and FSDP2's wrapping removed (module
    docstring), or None where ``keep`` is False (a rank that only takes part in the gathers).
    Gradients are not copied; ``requires_grad`` and the training mode are."""
    memo: dict[int, Any] = {}
    if not is_sharded(model):
        if not keep:
            return None
        with torch.no_grad():
            for _, p in model.named_parameters():
                copy.deepcopy(p, memo)  # its class kept (a subclass too), not its gradient
        return _copy_module(model, memo)
    whole = {}
    with torch.no_grad():
        for _, p in model.named_parameters():  # the same order on every rank
            if id(p) not in whole:
                whole[id(p)] = p.full_tensor() if _is_dtensor(p) else p.detach()  # type: ignore[attr-defined]
        # A DTensor buffer too (a parallel style may distribute one): whole, in the same order.
        buffers = {id(b): b.full_tensor() for _, b in model.named_buffers() if _is_dtensor(b)}  # type: ignore[attr-defined]
    if not keep:
        return None
    for _, p in model.named_parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(whole[id(p)].clone(), requires_grad=p.requires_grad)
    memo.update(buffers)  # copy.deepcopy takes a memo entry as the copy
    return _copy_module(model, memo)


def _plain_class(cls: type) -> type:
    """The module class FSDP2 subclassed (``FSDPLinear`` -> ``Linear``), or ``cls``."""
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__mro__[1:] if issubclass(base, nn.Module) and not issubclass(base, FSDPModule))
    return cls


def _dropped_hook(hook: Any) -> bool:
    """FSDP2's hooks (its state's methods), tensor parallelism's (``distribute_module``'s and the
    parallel styles' lambdas, which turn inputs and outputs into DTensors over the mesh and
    redistribute them: on whole weights they would mix DTensors with plain tensors), and
    autoprec's own (the scheduler's binding and watches): none may run on the copy."""
    hook = getattr(hook, "func", hook)  # a functools.partial: the function it calls
    owner = getattr(hook, "__self__", None)
    module = type(owner).__module__ if owner is not None else getattr(hook, "__module__", "") or ""
    return module.startswith(("torch.distributed.fsdp", "torch.distributed.tensor", "autoprec."))


def _copy_module(module: nn.Module, memo: dict) -> nn.Module:
    if id(module) in memo:  # a module reached twice (shared submodules) stays shared
        return memo[id(module)]
    cls = _plain_class(type(module))
    new: nn.Module = object.__new__(cls)
    memo[id(module)] = new
    # The module's state as it pickles (a LightningModule's leaves out its trainer), not its
    # __dict__ as it is: what copy.deepcopy of the model copied. A parametrized module (HuBERT's
    # weight norm) refuses pickling, and copy.deepcopy copies its __dict__ (`parametrize`'s own
    # __deepcopy__): so here.
    state = module.__dict__ if parametrize.is_parametrized(module) else module.__getstate__()
    for key, value in state.items():
        if key.startswith(_STATE_PREFIX) or key in _FSDP_KEYS:
            continue
        if key == "_parameters":
            new.__dict__[key] = {name: None if p is None else memo[id(p)] for name, p in value.items()}
        elif key == "_modules":
            new.__dict__[key] = {name: None if m is None else _copy_module(m, memo) for name, m in value.items()}
        elif key.endswith("_hooks") and isinstance(value, dict):
            # Other hooks (the user's) are kept as they are, not copied: a hook is code, and a
            # copy of the object it is bound to would be a second one of something the user owns.
            new.__dict__[key] = collections.OrderedDict((k, h) for k, h in value.items() if not _dropped_hook(h))
        else:
            new.__dict__[key] = copy.deepcopy(value, memo)
    return new
