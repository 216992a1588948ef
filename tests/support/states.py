"""`same`: nested state (a runtime's ``state_dict``, results of a run) compared exactly."""

import torch


def same(a, b) -> bool:
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) equal, tensors bit for bit in the
    same dtype and shape."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b
