"""Measuring what autograd keeps for backward, with ``torch.autograd.graph.saved_tensors_hooks``.

This is the memory a precision plan changes: activations saved for backward (and copies such as
autocast's casted weights). Parameters themselves are excluded: they exist with or without a
backward pass. Each byte of a storage counts once, so views (q, k, v sliced from one qkv
output) are not counted three times.

What a saved tensor holds (`held_span`): a tensor made in this step's autograd graph (it needs
a gradient) keeps its whole storage alive until backward, so it counts the storage. A tensor
without autograd history (an input batch, a mask) counts only the bytes it spans: when it is a
view of a larger tensor (a batch sliced from a dataset tensor), the rest of that storage
outlives the step anyway and is not memory the step adds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["SavedTensor", "SavedTensorMeter", "HeldBytes", "held_span", "keep_for_backward", "plain_parts"]


def keep_for_backward(t: torch.Tensor) -> torch.Tensor:
    """What a measuring pack hook hands autograd to keep: ``t`` detached (same storage and version
    counter; unpacking re-attaches the node, as without hooks). Returning ``t`` itself would make the
    graph hold the tensor that holds the graph when ``t`` is the node's own output (``exp`` saves its
    result): a cycle through autograd that Python's collector cannot see, so a measured forward
    whose backward never runs would stay alive for good."""
    return t.detach()


def held_span(shape, stride, offset: int, storage_nbytes: int, itemsize: int, requires_grad: bool) -> tuple[int, int]:
    """``(start, end)`` bytes of its storage a saved tensor keeps (see the module docstring):
    the whole storage when it ``requires_grad``, else the bytes from its first to its last
    element (a strided view spans its gaps too; an expanded one only its distinct elements)."""
    if requires_grad:
        return 0, storage_nbytes
    if any(d == 0 for d in shape):
        return 0, 0
    last = offset + sum((d - 1) * abs(s) for d, s in zip(shape, stride))
    return offset * itemsize, min((last + 1) * itemsize, storage_nbytes)


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients), else ``x``: a DTensor
    wrapper has no storage of its own."""
    return x.to_local() if hasattr(x, "to_local") else x


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``t`` itself, or those a wrapper subclass wraps
    (``__tensor_flatten__``: a DTensor's local shard, an ``AsyncCollectiveTensor``'s result),
    unwrapped in turn. No data is read."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = (getattr(t, name) for name in names)
    return [part for x in inner if isinstance(x, torch.Tensor) for part in plain_parts(x)]  # a DTensor also names its mesh


class HeldBytes:
    """The bytes saved tensors hold, each byte of a storage counted once (intervals per storage).

    ``excluded``: tensors whose storages never count (a model's parameters). Pure bookkeeping on
    shapes and addresses: no pass over tensor data, no host-device sync.
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self._excluded = {part.untyped_storage().data_ptr() for t in excluded for part in plain_parts(t)}
        self._spans: dict[int, list[tuple[int, int]]] = {}

    def __contains__(self, storage_key: int) -> bool:
        """Whether some bytes of the storage at ``storage_key`` (its ``data_ptr``) were counted."""
        return storage_key in self._spans

    def add(self, t: torch.Tensor) -> int:
        """Count ``t`` as saved; returns the bytes it adds (0: excluded or already counted). A
        tensor subclass that wraps others (tensor parallelism saves DTensors, and collectives'
        ``AsyncCollectiveTensor``; the wrapper has no storage) counts the tensors it wraps, a
        DTensor this rank's shard: the bytes it holds."""
        if type(t) is torch.Tensor:  # no wrapper to look into: most saved tensors
            return self._add(t, t.requires_grad)
        return sum(self._add(part, t.requires_grad) for part in plain_parts(t))

    def _add(self, t: torch.Tensor, requires_grad: bool) -> int:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return 0
        start, end = held_span(t.shape, t.stride(), int(t.storage_offset()), storage.nbytes(), t.element_size(), requires_grad)
        spans = self._spans.setdefault(key, [])
        new = end - start
        for s, e in spans:
            new -= max(0, min(e, end) - max(s, start))
        if new > 0:
            merged = [(s, e) for s, e in spans if e < start or s > end]
            overlapping = [(s, e) for s, e in spans if not (e < start or s > end)]
            merged.append((min([start] + [s for s, _ in overlapping]), max([end] + [e for _, e in overlapping])))
            self._spans[key] = sorted(merged)
        return max(new, 0)


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes this tensor added: what it holds that no earlier saved tensor did


class SavedTensorMeter:
    """Context manager recording every tensor saved for backward inside it.

    ``parameters``: tensors never counted (a model's parameters). Costs a Python call per saved
    tensor during the forward pass; no host-device sync.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._held = HeldBytes(parameters)
        self.saved: list[SavedTensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = self._held.add(t)
        if nbytes:
            self.saved.append(SavedTensor(tuple(t.shape), t.dtype, nbytes))
        return keep_for_backward(t)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def bytes_by_dtype(self) -> dict[str, int]:
        counts: Counter = Counter()
        for s in self.saved:
            counts[str(s.dtype).replace("torch.", "")] += s.nbytes
        return dict(counts)
