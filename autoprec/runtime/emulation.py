"""Emulation: a matrix product in a format no kernel serves, stored in that format, computed in FP32.

Convolutions, batched matmuls and attention in an FP8 / INT8 layer have no low-precision kernel in
torch: their inputs are rounded to the format and saved in it (so the memory saving is real), the
product is computed in FP32, and backward recomputes it from the saved inputs (one extra forward of
the op). The run report and an `EmulationWarning` name every layer that runs this way.

Weights (tensors derived from a Parameter) are never saved: backward re-rounds them from the FP32
master copy, which costs one elementwise pass instead of a weight-sized buffer.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch

from .quantizers import OperandRole

if TYPE_CHECKING:
    from .quantizers import Quantizer

__all__ = ["StoredInFormat"]


def _autocast_off(device_type: str):
    # The product runs in FP32 on purpose; autocast would lower it again.
    return torch.autocast(device_type, enabled=False)


def _rounded(grad: torch.Tensor, quantizer: "Quantizer | None") -> torch.Tensor:
    """An output gradient in FP32, rounded through ``quantizer`` (None: kept FP32)."""
    grad = grad.float()
    if quantizer is None:
        return grad
    inv = quantizer.inverse_scale(grad)
    return quantizer.dequantize(quantizer.quantize(grad, inv), inv, grad.shape)


class StoredInFormat(torch.autograd.Function):
    """Run ``fn(*inputs)`` in FP32 on inputs rounded through their quantizers, saving them quantized.

    ``quantizers[i]``: the `quantizers.Quantizer` of input i (None for inputs that are not
    rounded); one of role `OperandRole.WEIGHT` marks an input derived from parameters (rounded for
    the forward but re-derived from the FP32 master in backward, not saved). Backward rounds the
    incoming gradient through ``grad`` (the output gradient's; None keeps it FP32; with
    ``raw_weight_grads`` the weight inputs' gradients take it unrounded: a high-precision weight
    gradient, one more backward through ``fn``) and recomputes
    ``fn`` under autograd from the saved inputs (every output's gradient, for an ``fn`` that
    returns several); ``draws_random``: ``fn`` may draw random numbers
    (dropout inside attention), so the forward's RNG state is kept and restored for the
    recomputation (the same mask twice, as activation checkpointing does). Other ops skip it:
    reading the RNG state is a graph break under torch.compile. ``fn`` must be
    pure (no in-place on its inputs). A non-finite input gives a non-finite scale, so its rounded
    copy is NaN throughout and the overflow stays visible to the loss scaler.
    """

    @staticmethod
    def forward(ctx, fn: Callable, quantizers: tuple, grad: "Quantizer | None", raw_weight_grads: bool, draws_random: bool, *inputs):
        device_type = next(x.device.type for x in inputs if torch.is_tensor(x))
        saved: list = []
        codecs: list = []
        rounded: list = []
        for i, x in enumerate(inputs):
            quantizer = quantizers[i]
            if quantizer is None or not torch.is_tensor(x) or not x.is_floating_point():
                saved.append(x)
                codecs.append(None)
                rounded.append(x)
                continue
            inv = quantizer.inverse_scale(x)
            q = quantizer.quantize(x, inv)
            rounded.append(quantizer.dequantize(q, inv, x.shape))
            saved.append(x if quantizer.role is OperandRole.WEIGHT else q)
            codecs.append((quantizer, inv, x.shape))
        ctx.cpu_rng = torch.get_rng_state() if draws_random else None
        ctx.cuda_rng = torch.cuda.get_rng_state() if draws_random and device_type == "cuda" else None
        with torch.no_grad(), _autocast_off(device_type):
            out = fn(*rounded)
        ctx.fn, ctx.grad, ctx.codecs, ctx.device_type = fn, grad, codecs, device_type
        ctx.raw_weight_grads = raw_weight_grads and grad is not None
        ctx.tensor_index = [i for i, x in enumerate(saved) if torch.is_tensor(x)]
        ctx.others = [None if torch.is_tensor(x) else x for x in saved]
        ctx.save_for_backward(*[saved[i] for i in ctx.tensor_index])
        return out

    @staticmethod
    def backward(ctx, *grad_outs):
        values = list(ctx.others)
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            values[i] = t
        leaves = []
        for i, x in enumerate(values):
            codec = ctx.codecs[i]
            if codec is not None:
                quantizer, inv, shape = codec
                q = quantizer.quantize(x, inv) if quantizer.role is OperandRole.WEIGHT else x
                # requires_grad_ is a graph break in a traced backward on torch 2.11 (not 2.13);
                # torch.func.vjp, which avoids it, refuses the saved-tensor hooks a recomputed
                # block's backward runs under.
                x = quantizer.dequantize(q, inv, shape).requires_grad_(ctx.needs_input_grad[5 + i])
            values[i] = x
            leaves.append(x)
        devices = [torch.cuda.current_device()] if ctx.cuda_rng is not None else []
        rng = torch.random.fork_rng(devices=devices) if ctx.cpu_rng is not None else contextlib.nullcontext()
        with rng, torch.enable_grad(), _autocast_off(ctx.device_type):
            if ctx.cpu_rng is not None:
                torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            out = ctx.fn(*values)
        # One gradient per output (multi-head attention returns its weights beside its output),
        # each rounded through the output gradient's quantizer; an output without one is left out.
        outs = out if isinstance(out, (tuple, list)) else (out,)
        live = [(o, g) for o, g in zip(outs, grad_outs) if torch.is_tensor(o) and o.requires_grad and g is not None]
        wanted = [x for x in leaves if torch.is_tensor(x) and x.requires_grad]
        raw = set()
        if ctx.raw_weight_grads:
            raw = {id(x) for x, codec in zip(leaves, ctx.codecs) if codec is not None and codec[0].role is OperandRole.WEIGHT and x.requires_grad}
        found: dict[int, Any] = {}
        for unrounded in (False, True):  # the rounded gradient's leaves, then (if any) the weights' from the raw one
            targets = [x for x in wanted if (id(x) in raw) is unrounded]
            if targets and live:
                pairs = [(o, g if unrounded else _rounded(g, ctx.grad)) for o, g in live]
                grads = torch.autograd.grad([o for o, _ in pairs], targets, [g.to(o.dtype) for o, g in pairs], allow_unused=True,
                                            retain_graph=bool(raw) and not unrounded)
                found.update(zip(map(id, targets), grads))
        result = [found.get(id(x)) if torch.is_tensor(x) and x.requires_grad else None for x in leaves]
        return (None, None, None, None, None, *result)
