"""Counting the autograd graphs a test leaves alive (`tests/test_no_graph_kept.py` says why)."""

import gc
import warnings

import torch


def graph_tensors() -> int:
    """Tensors with a ``grad_fn`` that Python's collector still tracks, after a collection."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)
