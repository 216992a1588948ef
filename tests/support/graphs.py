"""Counting the autograd graphs a test leaves alive (`tests/runtime/test_no_graph_kept.py` says why)."""

import gc
import warnings
import weakref

import torch


def graph_tensors(since: "dict[int, weakref.ref] | None" = None) -> int:
    """Tensors with a ``grad_fn`` that Python's collector still tracks, after a collection;
    with ``since`` (a `graph_snapshot`), only those that were not alive then. A baseline taken
    as a count instead would read negative when a graph an earlier test left (held until some
    later collection: a traceback pytest keeps, a cache) goes during the test.

    Meta and fake tensors are left out: ``torch.compile`` traces custom autograd Functions with
    FakeTensors, and a few of those stay alive after tracing (torch's, not the code under test's:
    they hold no memory and leave with the process)."""
    return sum(1 for t in _graph_tensors() if since is None or not _was_alive(t, since))


def graph_snapshot() -> "dict[int, weakref.ref]":
    """The graph tensors alive now (`graph_tensors`), held weakly, by identity (a ``WeakSet``
    would compare tensors with ``==``, elementwise)."""
    return {id(t): weakref.ref(t) for t in _graph_tensors()}


def _was_alive(t: torch.Tensor, snapshot: "dict[int, weakref.ref]") -> bool:
    ref = snapshot.get(id(t))
    return ref is not None and ref() is t


def _graph_tensors() -> list:
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        return [obj for obj in gc.get_objects()
                if isinstance(obj, torch.Tensor) and obj.grad_fn is not None and not isinstance(obj, FakeTensor) and not obj.is_meta]
