"""Counting what a training step costs the host: aten ops, host syncs and graph breaks.

`OpCounter` is a ``TorchDispatchMode``: every op that reaches the Python dispatch key is counted
once by its overload name (``"aten.mm.default"``), forward and backward alike (autograd carries
the mode into backward). Composite ops (``linear``, ``item``) are counted as what they decompose
into, so the count is the number of kernels a step dispatches, not the number of Python calls.

A host sync is an op whose result the host must wait for on CUDA:

- ``aten._local_scalar_dense`` and the other ops tagged ``data_dependent_output`` (``.item()``,
  ``bool(t)``, ``float(t)``, ``torch.equal`` all reach one of them);
- ops whose output *shape* depends on the data (tagged ``dynamic_output_shape``: ``nonzero``,
  ``masked_select``, ``unique``...), because the allocator must learn the size first; indexing
  counts only with a boolean mask (integer indices have a known shape), and ``repeat_interleave``
  only without ``output_size``;
- a copy from a device to the CPU.

Data-dependent ops count whatever their tensors' device, so the counts are the same on CPU and
CUDA for the same code and CPU tests can hold the line on syncs that only cost time on a GPU (on
CUDA, such an op on a tensor kept on the host would not sync; a CPU run cannot tell).

Limit: an op defined outside ``aten`` / ``prims`` (a ``torch.library`` custom op) is counted as
one op under its own name; the ops inside its body are not seen.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import OpCountError

__all__ = [
    "OpCountError",
    "OpCounts",
    "OpCounter",
    "is_host_sync",
    "count_training_step",
    "training_step",
    "GraphBreaks",
    "graph_breaks",
    "max_abs_diff",
]


_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_MASK_DTYPES = (torch.bool, torch.uint8)  # uint8 indices are read as masks (deprecated, still a mask)


def _has_mask_index(args: tuple) -> bool:
    """``index`` / ``index_put`` with a boolean (or uint8) index: the mask's nonzero count sets the shape."""
    indices = args[1] if len(args) > 1 else ()
    return any(torch.is_tensor(i) and i.dtype in _MASK_DTYPES for i in indices)


def _copies_to_host(func, args: tuple, kwargs: dict, out: Any) -> bool:
    """A blocking copy from a device to the CPU (``.cpu()``, ``.to("cpu")``, ``cpu_t.copy_(dev_t)``)."""
    if func is torch.ops.aten._to_copy.default:
        src, dst, non_blocking = args[0], out, kwargs.get("non_blocking", False)
    elif func is torch.ops.aten.copy_.default:
        src, dst = args[1], args[0]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return False
    return not non_blocking and torch.is_tensor(src) and torch.is_tensor(dst) and src.device.type != "cpu" and dst.device.type == "cpu"


def _mask_put_syncs(args: tuple, kwargs: dict) -> bool:
    """``x[mask] = v`` runs nonzero on the mask, except that ATen turns one mask with a one-element
    value and no accumulation into ``masked_fill_(mask, v.item())``: a sync only when ``v`` is on
    a device (``_index_put_impl_`` in ATen's TensorAdvancedIndexing.cpp)."""
    if not _has_mask_index(args):
        return False
    values = args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    defined = [i for i in args[1] if i is not None]
    if not accumulate and len(defined) == 1 and values.numel() == 1:
        return values.device.type != "cpu"
    return True


# Ops whose sync depends on their arguments: indexing is tagged dynamic_output_shape whatever the
# index, index_put is untagged; repeat_interleave knows its size when given output_size.
_CONDITIONAL_SYNC = {
    torch.ops.aten.index.Tensor: lambda args, kwargs: _has_mask_index(args),
    torch.ops.aten.index_put.default: _mask_put_syncs,
    torch.ops.aten.index_put_.default: _mask_put_syncs,
    torch.ops.aten._index_put_impl_.default: _mask_put_syncs,
    torch.ops.aten.repeat_interleave.Tensor: lambda args, kwargs: kwargs.get("output_size") is None,
}


def is_host_sync(func, args: tuple, kwargs: dict, out: Any = None) -> bool:
    """Whether running ``func`` on these arguments makes the host wait for the device (see module doc)."""
    if func in _CONDITIONAL_SYNC:
        return _CONDITIONAL_SYNC[func](args, kwargs)
    if any(tag in func.tags for tag in _SYNC_TAGS):
        return True
    return _copies_to_host(func, args, kwargs, out)


@dataclasses.dataclass(frozen=True)
class OpCounts:
    """Ops and host syncs of one counted region, keyed by overload name (``"aten.mm.default"``)."""

    ops: Mapping[str, int]
    syncs: Mapping[str, int]

    @property
    def total(self) -> int:
        """All ops dispatched, host syncs included."""
        return sum(self.ops.values())

    @property
    def sync_total(self) -> int:
        return sum(self.syncs.values())

    def to_dict(self) -> dict:
        return {"total": self.total, "syncs": self.sync_total, "ops": dict(sorted(self.ops.items())), "sync_ops": dict(sorted(self.syncs.items()))}


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as counter: ...`` counts every op dispatched inside, and its host syncs.

    Cost: each op becomes one Python call plus a scan of its arguments for the sync rules; the
    ops themselves run unchanged (no extra kernels, no syncs). Re-entering adds to the counts.
    """

    def __init__(self):
        super().__init__()
        self._ops: collections.Counter = collections.Counter()
        self._syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        self._ops[name] += 1
        if is_host_sync(func, args, kwargs, out):
            self._syncs[name] += 1
        return out

    def counts(self) -> OpCounts:
        """A snapshot of the counts so far."""
        return OpCounts(dict(self._ops), dict(self._syncs))


def count_training_step(fn: Callable[[], Any], warmup: int = 1) -> OpCounts:
    """Run ``fn`` (one forward + loss + backward, no arguments) ``warmup`` times, then once counted.

    The warm-up calls let lazily built state settle (amax histories, calibration, caches) so the
    counted call is a steady-state step. Costs ``warmup + 1`` calls of ``fn``; the counted call
    is slower by a Python call per op (see `OpCounter`).
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise OpCountError(f"count_training_step: warmup must be a non-negative integer (0 counts the first call), got {warmup!r}")
    for _ in range(warmup):
        fn()
    with OpCounter() as counter:
        fn()
    return counter.counts()


def training_step(model: torch.nn.Module, forward: Callable[[], torch.Tensor], context: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], torch.Tensor]:
    """A step closure for `count_training_step`: ``model``'s grads set to None (no aten op, so
    every step starts alike and none accumulates), ``forward()`` (forward + loss) inside a fresh
    ``context()``, then backward outside it, as with ``torch.autocast``. The closure returns the loss."""

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with context():
            loss = forward()
        loss.backward()
        return loss

    return step


@dataclasses.dataclass(frozen=True)
class GraphBreaks:
    """What ``torch._dynamo.explain`` found: ``graphs`` captured, ``breaks`` between them and one
    reason per break. A function that compiles whole has ``graphs == 1`` and ``breaks == 0``;
    ``graphs == 0`` means Dynamo captured nothing (the whole call ran eagerly)."""

    graphs: int
    breaks: int
    reasons: tuple[str, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"reasons": list(self.reasons)}


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> GraphBreaks:
    """Trace ``fn(*args, **kwargs)`` with ``torch._dynamo.explain`` and count its graph breaks.

    Costs one Dynamo trace of ``fn`` (no backend compilation: the graphs run as captured) and
    resets Dynamo's caches before and after, so earlier ``torch.compile`` results are dropped.
    """
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = tuple(_reason_line(r) for r in explained.break_reasons)
    return GraphBreaks(explained.graph_count, max(explained.graph_break_count, 0), reasons)


def _reason_line(reason: Any) -> str:
    """``"reason (file:line)"`` of one break, the innermost user frame being where it happened."""
    text = " ".join(str(reason.reason).split())
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        frame = stack[-1]
        text += f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
    return text


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest ``|a - b|`` over matching tensor leaves of two pytrees (FP32 math; one sync per leaf)."""
    left, right = pytree.tree_leaves(a), pytree.tree_leaves(b)
    diffs = [(x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(left, right) if torch.is_tensor(x)]
    return max(diffs, default=0.0)
