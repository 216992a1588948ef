"""Counting the autograd graphs a test leaves alive (`tests/runtime/test_no_graph_kept.py` says why)."""

import gc
import warnings

import torch


def graph_tensors() -> int:
    """Tensors with a ``grad_fn`` that Python's collector still tracks, after a collection.

    Meta and fake tensors are left out: ``torch.compile`` traces custom autograd Functions with
    FakeTensors, and a few of those stay alive after tracing (torch's, not the code under test's:
    they hold no memory and leave with the process)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        return sum(1 for obj in gc.get_objects()
                   if isinstance(obj, torch.Tensor) and obj.grad_fn is not None and not isinstance(obj, FakeTensor) and not obj.is_meta)
