"""Measuring what autograd keeps for backward, with ``torch.autograd.graph.saved_tensors_hooks``.

This is the memory a precision plan changes: activations saved for backward (and copies such as
autocast's casted weights). Parameters themselves are excluded: they exist with or without a
backward pass. Tensors are counted once per storage, so views (q, k, v sliced from one qkv
output) are not counted three times.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable

import torch

__all__ = ["SavedTensor", "SavedTensorMeter"]


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of the underlying storage, counted once per storage


class SavedTensorMeter:
    """Context manager recording every tensor saved for backward inside it.

    ``parameters``: tensors never counted (a model's parameters). Costs a Python call per saved
    tensor during the forward pass; no host-device sync.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._seen: set[int] = set()
        self.saved: list[SavedTensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.saved.append(SavedTensor(tuple(t.shape), t.dtype, storage.nbytes()))
        return t

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
