"""Tensor-parallel layers: a planned linear product whose weight is a DTensor sharded over a 1-D
mesh, as torch's ``ColwiseParallel`` / ``RowwiseParallel`` leave it (torchtitan's plan, sequence
parallel included: its all-gather runs in the layer's input hook, before the product).

DTensor has no sharding rule for ``_int_mm`` and gathers a ``_scaled_mm`` operand whose scale it
cannot shard, so the product runs on each rank's local shards with the plan's own kernels, and
comes back as the DTensor the plain layer would return:

- **column-wise** (weight ``Shard(0)``, input ``Replicate``): ``x @ w_local.T + b_local`` is the
  output's ``Shard(-1)``; the input's gradient from each rank is a partial sum (``to_local`` with
  a ``Partial`` gradient placement, summed by DTensor in the backward);
- **row-wise** (weight ``Shard(1)``, input ``Shard(-1)``): ``x_local @ w_local.T`` is a
  ``Partial`` sum, the bias (replicated) added once by DTensor after the reduction the layer's
  output hook asks for.

A per-tensor scale is one value for the whole logical tensor: the layer's input, weight and
output-gradient amaxes are max-reduced over the mesh's group (`RuntimeLayer.shard_over`), so
every rank quantizes with the scale the unsharded layer would use. Cost per layer and step: three
all-reduces of 4 bytes (two in the forward, one in the backward), beside the layer's own
collectives. Row-scaled FP8 and INT8 per row run on both splits: column-wise a row's and an
output channel's scales are whole on each rank (no collective of their own); row-wise each row's
and channel's amax is max-reduced over the group ((M, 1) and (N, 1) values per forward, and the
backward copies' per-tensor amaxes). INT8 with a calibrated input scale runs on both:
column-wise every rank calibrates on the whole input, row-wise on its slice, each batch scaled by
the whole input's amax and the freeze gathering every rank's channel amaxes and samples
(`calibration.Int8Calibrator.split_over`), so every rank freezes the unsharded layer's scale and
outlier channels. E4M3 block-scaled FP8 runs on both with no collective of its own (each rank
tiles its shard). What cannot run sharded yet (other emulated products) is refused at the first
forward in one line (`sharded_reason`). Eager only (`torch.compile` of a TP layer
under a plan is not covered).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..errors import RuntimeStateError
from ..formats import Format, Granularity
from ..layer_precision import LayerPrecision

__all__ = ["amax_over", "is_sharded", "sharded_linear", "sharded_reason"]


def sharded_reason(precision: LayerPrecision, kernel: "str | None") -> "str | None":
    """Why a layer in ``precision`` cannot run on a tensor-parallel (DTensor) weight yet; None
    when it can: FP32, BF16, FP16, FP8 with per-tensor or per-row scaling and INT8 (a calibrated
    input scale or per row), on a real kernel, and E4M3 block scaling (its kernels, or their
    emulated GEMMs: `block_gemm.emulated_block_mm`), on either split. Other emulated products
    are refused, and NVFP4. ``kernel``: `layers.kernel_reason` of the layer on its device (None: a kernel).
    The one rule behind the runtime's refusal at the first forward (`RuntimeLayer.shard_over`)
    and the search's candidates for a sharded layer (`search.tensor_parallel`). No device work.

    Block scaling needs no collective: each rank tiles its own shard (1x128 tiles of its input
    rows and output gradient, 128x128 blocks of its weight), the unsharded layer's tiles wherever
    the shards split at multiples of 128 (elsewhere a shard's last tiles end at its edge)."""
    fmt = precision.format
    if fmt is Format.NVFP4:
        # Each shard would take its own tensor scale (the unsharded layer's is one over the whole tensor).
        return "nvfp4 on a tensor-parallel (DTensor) weight is not supported yet"
    if fmt is not Format.INT8 and not fmt.is_fp8:
        return None
    blocks = precision.scaling.granularity is Granularity.BLOCK
    if kernel is None or (blocks and fmt is Format.FP8_E4M3 and precision.grad_format is Format.FP8_E4M3):
        return None
    return f"{fmt.value} emulated ({kernel}) on a tensor-parallel (DTensor) weight is not supported yet"


def amax_over(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` (an amax, or amaxes of rows) max-reduced in place over ``group``, a
    tensor-parallel layer's ranks: the whole logical tensor's (or rows'). Unchanged for None.
    One all-reduce of ``value``'s bytes."""
    if group is not None:
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return value


def is_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a DTensor (a tensor-parallel layer's, or FSDP2 x TP's gathered one)."""
    return isinstance(weight, DTensor)


def sharded_linear(layer: Any, run: Callable, x: torch.Tensor, weight: torch.Tensor, bias: "torch.Tensor | None") -> torch.Tensor:
    """``x @ weight.T + bias`` of tensor-parallel ``layer`` (module docstring): ``run(x_local,
    w_local, b_local)`` the planned product on local tensors; ``weight`` a DTensor (`is_sharded`);
    returns the DTensor the plain layer returns. Costs, beside ``run``: the amax all-reduces (`RuntimeLayer.shard_over`)."""
    if not isinstance(weight, DTensor):
        raise RuntimeStateError(f"layer {layer.fqn!r}: sharded_linear takes a DTensor weight (see is_sharded), not {type(weight).__name__}")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise RuntimeStateError(f"layer {layer.fqn!r}: a weight sharded over a {mesh.ndim}-D mesh; tensor parallelism is supported on one mesh dimension")
    placement = weight.placements[0]
    layer.shard_over(mesh.get_group(), column_wise=placement == Shard(0), in_features=weight.shape[1])
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    if placement == Shard(0) and x.placements[0].is_replicate():
        local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
        out = run(x.to_local(grad_placements=[Partial()]), weight.to_local(), local_bias)
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
    if placement == Shard(1) and x.placements[0] == Shard(x.dim() - 1):
        out = DTensor.from_local(run(x.to_local(), weight.to_local(), None), mesh, [Partial()], run_check=False)
        # In the output's dtype, as the unsharded kernel adds it (autocast leaves a sum uncast).
        return out if bias is None else out + bias.to(out.dtype)
    raise RuntimeStateError(
        f"layer {layer.fqn!r}: weight placed {placement} with input placed {x.placements[0]}; a planned tensor-parallel layer "
        "is column-wise (weight Shard(0), input Replicate) or row-wise (weight Shard(1), input Shard(-1))"
    )
