"""FP8 all-gather under FSDP2: a layer the plan runs in FP8 E4M3 (per-tensor scaling) has its
weight shard quantized before FSDP2 all-gathers it, and the gathered FP8 bytes feed the layer's
GEMM as they arrive (`TensorCurrentQuantizer.get` takes them: no second amax or cast).

FSDP2's extension points are the engine: a sharded parameter whose local tensor has
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` sends what the first returns and builds the
unsharded parameter from the second. `Fp8AllGather.enable` sets them on the local tensor of each
chosen weight (a plain tensor: the methods are attributes of that tensor, so the optimizer, the
checkpoint and everything else keep seeing the FP32 shard) and resets that parameter's gather
buffers; `disable` takes them off. FSDP2 reads them at each all-gather, but keeps its buffers
and its unsharded parameter across steps and sets up extension data once, so both go through
`FSDPParam`'s private state (`_extensions_data`, ``all_gather_outputs``, ``_unsharded_param``):
torch 2.11 and 2.13 lay it out alike, and the tests run on both.

- **pre-all-gather**: the shard's amax, all-reduced (MAX) over the FSDP mesh, and under FSDP2 x
  TP over the weight's tensor-parallel mesh too, so every rank quantizes with the whole logical
  weight's inverse scale ``amax / 448`` (no all-reduce on a mesh of one rank); the padded shard
  cast to E4M3.
- **post-all-gather**: a `GatheredFp8` over the gathered bytes: it has the FP32 weight's dtype
  and shape (autograd, FSDP2's ``as_strided`` and ``nn.Parameter`` see a weight), holds the E4M3
  data and the agreed inverse scale, and any other op runs on its dequantized value.
- **gradients** reduce-scatter as before (FP32, or FSDP2's ``reduce_dtype``).

Costs per FP8 weight and all-gather (forward, and backward when FSDP2 re-gathers there): one amax
over the shard, one all-reduce of 4 bytes (two under FSDP2 x TP), one cast of the shard; the all-gather sends 1 byte per
value instead of 4 (FP32). The scale follows the weight every step (current scaling: a weight is
always scaled from its own amax, whatever the plan's mode, which applies to the layer's inputs), so
a delayed-scaled E4M3 layer gathers in FP8 too and trains as it does without FSDP2; a layer whose
plan says row or block granularity, E5M2 or INT8 is gathered as before (FP32). Eager only: the
subclass has no ``__tensor_flatten__`` for ``torch.compile``.

The scheduler owns one `Fp8AllGather` whenever its model holds an FSDP2 unit, at any world size:
one rank under ``fully_shard`` (a mesh of one) still all-gathers, and gathers in FP8 alike.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import DistributedError
from ..formats import Format, Granularity, inverse_scale, quantize

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["GatheredFp8", "Fp8AllGather", "is_fsdp2"]

logger = logging.getLogger("autoprec")

_aten = torch.ops.aten
# The ops FSDP2 applies to the unsharded parameter it builds: they act on the FP8 data.
_KEEP = {_aten.as_strided.default, _aten.view.default, _aten.detach.default, _aten.alias.default, _aten._unsafe_view.default}


class GatheredFp8(torch.Tensor):
    """A weight all-gathered in FP8 (module docstring): ``fp8`` the E4M3 data in the weight's
    shape, ``inv_scale`` its 0-d FP32 inverse scale; its dtype and shape are the weight's."""

    fp8: torch.Tensor
    inv_scale: torch.Tensor

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, fp8.shape, strides=fp8.stride(), storage_offset=fp8.storage_offset(),
                                                   dtype=dtype, device=fp8.device, requires_grad=False)

    def __init__(self, fp8: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype):
        self.fp8 = fp8
        self.inv_scale = inv_scale

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def dequantized(self) -> torch.Tensor:
        return self.fp8.to(self.dtype) * self.inv_scale.to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP and isinstance(args[0], GatheredFp8):
            own = args[0]
            return GatheredFp8(func(own.fp8, *args[1:], **kwargs), own.inv_scale, own.dtype)
        args, kwargs = pytree.tree_map_only(GatheredFp8, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"GatheredFp8(shape={tuple(self.shape)}, dtype={self.dtype}, inv_scale={self.inv_scale})"


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` holds a ``fully_shard`` unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _check_policy(model: nn.Module) -> None:
    """Refuse an FSDP2 ``param_dtype`` that would override the per-layer formats.

    ``MixedPrecisionPolicy(param_dtype=...)`` would cast every parameter to one dtype before
    autoprec's per-layer formats see them, so any ``param_dtype`` other than None / float32 is
    refused; ``reduce_dtype`` (the gradient reduce-scatter precision) is FSDP2's and allowed."""
    from torch.distributed.fsdp import FSDPModule

    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            dtype = module._get_fsdp_state()._mp_policy.param_dtype
            if dtype not in (None, torch.float32):
                raise DistributedError(
                    f"fully_shard({fqn or type(model).__name__}, mp_policy=MixedPrecisionPolicy(param_dtype={dtype})) casts every parameter, "
                    "overriding autoprec's per-layer formats; use MixedPrecisionPolicy(param_dtype=None) and let the plan choose"
                )


class Fp8AllGather:
    """Which of ``model``'s FSDP2 weights are all-gathered in FP8 (module docstring), and what
    was sent: ``sent`` counts ``all_reduce`` (the amax agreements) and ``fp8_values`` (weight
    values all-gathered in FP8 by this rank) since built."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._enabled: dict[int, Any] = {}  # id(FSDPParam) -> FSDPParam
        self.sent: collections.Counter = collections.Counter()

    @classmethod
    def join(cls, model: nn.Module) -> "Optional[Fp8AllGather]":
        """The gathers of ``model`` if it holds an FSDP2 unit (its ``param_dtype`` checked:
        `DistributedError` in one line when it would override the plan), else None."""
        if not (dist.is_available() and is_fsdp2(model)):
            return None
        _check_policy(model)
        return cls(model)

    def apply(self, plan: "Optional[Plan]") -> None:
        """All-gather in FP8 the weights of ``plan``'s FP8 E4M3, per-tensor scaled layers from
        the next all-gather; every other weight as FSDP2 does (all of them while ``plan`` is
        None). Call between steps, on every rank alike."""
        layers = {} if plan is None else {fqn: (lp.format, lp.scaling.granularity is Granularity.TENSOR) for fqn, lp in plan.layers.items()}
        before = self.enabled
        self.set(self.eligible(self._model, layers))
        if self.enabled != before:
            logger.info("autoprec: FSDP2 all-gathers %d weight(s) in FP8", self.enabled)

    @staticmethod
    def eligible(model: nn.Module, layers: "dict[str, tuple[Format, bool]]") -> "list[Any]":
        """The FSDPParams of the weights that can be gathered in FP8, among ``layers`` (fqn ->
        (format, per-tensor scaled)): an FP8 E4M3, per-tensor scaled layer's ``weight`` that
        FSDP2 shards on dim 0. None of them without FSDP2."""
        from torch.distributed.fsdp import FSDPModule

        modules = dict(model.named_modules())
        wanted = {id(modules[fqn]) for fqn, (fmt, tensor) in layers.items() if fmt is Format.FP8_E4M3 and tensor and fqn in modules}
        found = []
        for unit in model.modules():
            group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
            for p in group.fsdp_params if group is not None else ():
                info = p._module_info
                if id(info.module) in wanted and info.param_name == "weight" and p.fsdp_placement.dim == 0:
                    found.append(p)
        return found

    @property
    def enabled(self) -> int:
        return len(self._enabled)

    def set(self, params: Sequence[Any]) -> None:
        """Gather exactly ``params`` (FSDPParams) in FP8 from the next all-gather on. Call it
        while the model is sharded (between steps)."""
        wanted = {id(p): p for p in params}
        for key, p in list(self._enabled.items()):
            if key not in wanted:
                self._off(p)
        for key, p in wanted.items():
            if key not in self._enabled:
                self._on(p)

    def disable(self) -> None:
        self.set([])

    def _on(self, fsdp_param: Any) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ExtensionsData

        local = fsdp_param._sharded_local_tensor
        sent = self.sent
        tensor_parallel = _tensor_parallel_groups(fsdp_param)

        def fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
            padded = fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size)
            with torch.no_grad():
                amax = padded.abs().amax().float().reshape(1)
                # Over the mesh FSDP2 shards this weight over, then over its tensor-parallel
                # mesh (FSDP2 x TP): the scale of the whole logical weight, as unsharded.
                for group in ([mesh.get_group()] if mesh.size() > 1 else []) + tensor_parallel:
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
                    sent["all_reduce"] += 1
                inv = inverse_scale(amax[0], Format.FP8_E4M3)
                data = quantize(padded, inv, Format.FP8_E4M3)
            sent["fp8_values"] += data.numel()
            return (data,), (inv,)

        def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out: Optional[torch.Tensor] = None):
            (data,), (inv,) = outputs, metadata
            if out is not None:  # FSDP2 re-gathered into the same storage: only the scale is new
                # out: the parameter built at the first gather, the GatheredFp8 itself or, under
                # FSDP2 x TP, a DTensor over it, whose local tensor the layer reads the scale from.
                getattr(out, "_local_tensor", out).inv_scale = inv  # type: ignore[union-attr]  # a GatheredFp8
                return None
            return GatheredFp8(data, inv, param_dtype), (data,)

        local.fsdp_pre_all_gather = fsdp_pre_all_gather
        local.fsdp_post_all_gather = fsdp_post_all_gather
        fsdp_param._extensions_data = ExtensionsData()
        _reset(fsdp_param)
        self._enabled[id(fsdp_param)] = fsdp_param

    def _off(self, fsdp_param: Any) -> None:
        local = fsdp_param._sharded_local_tensor
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            if name in local.__dict__:
                delattr(local, name)
        _reset(fsdp_param)
        self._enabled.pop(id(fsdp_param), None)


def _tensor_parallel_groups(fsdp_param: Any) -> list:
    """The process groups of the mesh a weight is tensor-parallel over besides FSDP2's (FSDP2 x
    TP: the DTensor spec FSDP2 restores after the all-gather; one group per mesh dimension of
    more than one rank), empty without one. The spec is ``_tp_spec`` on torch 2.11,
    ``_unsharded_dtensor_spec`` on 2.13 (None there without TP)."""
    spec = getattr(fsdp_param, "_tp_spec", None) or getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    if spec is None:
        return []
    mesh = spec.mesh
    return [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]


def _reset(fsdp_param: Any) -> None:
    """Drop the gather buffers and unsharded parameter FSDP2 keeps across steps: the next
    all-gather makes them again in the new format."""
    fsdp_param.all_gather_outputs = []
    fsdp_param._unsharded_inner_tensors = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param
