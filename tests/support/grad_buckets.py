"""DDP gradient buckets by hand (torch's ``GradBucket`` interface) and per-rank gradients for them."""

import math

import torch

SHAPES = [torch.Size([64, 48]), torch.Size([64]), torch.Size([10, 64])]


class Bucket:
    """What DDP hands a communication hook (torch's ``GradBucket``): a flat buffer, the
    gradients as views of it, their parameters, its index."""

    def __init__(self, tensors, params, index=0):
        self._buffer = torch.cat([t.reshape(-1) for t in tensors]).clone()
        self._shapes = [t.shape for t in tensors]
        self._params = params
        self._index = index

    def buffer(self):
        return self._buffer

    def set_buffer(self, buffer):
        self._buffer = buffer

    def gradients(self):
        return [v.view(s) for v, s in zip(self._buffer.split([math.prod(s) for s in self._shapes]), self._shapes)]

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return True


def rank_gradients(rank, step=0):
    g = torch.Generator().manual_seed(100 * rank + step)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    out[0][3, :] *= 40.0  # an outlier row: chunks with very different scales
    return out
