"""`PlanRuntime`: makes a `Plan` real in forward and backward, and holds the runtime state.

How a plan runs (``with runtime:``):

- Nothing changes for an all-FP32 plan: no wrapper, no mode, no autocast (zero overhead).
- Otherwise the whole region runs under ``torch.autocast`` in the plan's half dtype, so ops
  between layers behave exactly as under plain autocast (losses in FP32, residual adds promoted).
- Each layer's forward is wrapped to mark it as the innermost running layer and to scope its
  format: BF16 / FP16 layers get their own ``torch.autocast`` dtype; FP32 layers turn autocast off
  and see FP32 inputs; FP8 / INT8 layers have their matrix products replaced (see below).
- One `TorchFunctionMode` for the region routes the matrix products of FP8 / INT8 layers to
  `kernels` (real ``torch._scaled_mm`` / ``torch._int_mm`` where the device and shape allow,
  else emulated and reported), and keeps normalisations, softmax and losses in FP32 on every
  device (CPU autocast does not upcast them; CUDA autocast does).

Backward needs no context: the autograd functions hold what they need, so ``loss.backward()`` may
run after the ``with`` block, as with ``torch.autocast``.

Runtime state (amax histories, INT8 calibration) lives in the `PlanRuntime` and survives exits and
re-entries; ``state_dict()`` / ``load_state_dict()`` save and restore it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..coverage import MATMUL_OPS
from ..device import KERNEL_OPS, format_support
from ..errors import RuntimeStateError
from ..formats import ACTIVATION_BLOCK, WEIGHT_BLOCK, AmaxHistory, Format, Granularity, amax, scale_from_amax
from ..plan import LayerPrecision, Plan
from .calibration import Int8Calibrator
from .kernels import Fp8Gemm, GemmSlot, Int8Gemm, StoredInFormat, int_mm_shape_ok, scaled_mm_shape_ok

__all__ = ["PlanRuntime", "apply_plan", "EmulationWarning"]

logger = logging.getLogger(__name__)


class EmulationWarning(UserWarning):
    """A layer runs its planned format without a real kernel (FP8/INT8 storage, FP32 compute)."""


# Ops kept in FP32 inside the region: their floating inputs are upcast before they run.
_FP32_OPS = frozenset({
    F.softmax, torch.softmax, torch.Tensor.softmax,
    F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.rms_norm,
    F.cross_entropy, F.nll_loss, F.binary_cross_entropy_with_logits, F.mse_loss, F.kl_div,
})

_GEMM_KERNELS = {Format.FP8_E4M3: Fp8Gemm, Format.FP8_E5M2: Fp8Gemm, Format.INT8: Int8Gemm}
_SHAPE_OK = {Fp8Gemm: scaled_mm_shape_ok, Int8Gemm: int_mm_shape_ok}


def _is_weight(t: Any) -> bool:
    """A Parameter or a view of one (``w.t()``): re-derivable from the FP32 master in backward."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _to_fp32(value: Any) -> Any:
    if torch.is_tensor(value) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def _unify_dtypes(tree: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``tree`` cast to ``dtype`` when they do not already share one dtype."""
    floats = {t.dtype for t in pytree.tree_leaves(tree) if torch.is_tensor(t) and t.is_floating_point()}
    if len(floats) <= 1:
        return tree
    return pytree.tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tree)


class _Layer:
    """One planned layer while the runtime is alive: its precision, GEMM slots and report."""

    def __init__(self, fqn: str, precision: LayerPrecision, device_type: str):
        self.fqn = fqn
        self.precision = precision
        self.device_type = device_type
        self.slots: list[GemmSlot] = []
        self.calls_this_forward = 0
        self.ops: dict[str, str] = {}  # op -> how it ran ("kernel ...", "emulated: ...", "autocast ...")

    def next_slot(self) -> GemmSlot:
        index = self.calls_this_forward
        self.calls_this_forward += 1
        while len(self.slots) <= index:
            s = self.precision.scaling
            int8 = Int8Calibrator(self.precision.calibration, s.granularity) if self.precision.format is Format.INT8 else None
            self.slots.append(GemmSlot(AmaxHistory(s.history_len, s.reduction), AmaxHistory(s.history_len, s.reduction), int8))
        return self.slots[index]

    def note(self, op: str, how: str) -> None:
        if self.ops.get(op) == how:
            return
        if how.startswith("emulated") and not self.ops.get(op, "").startswith("emulated"):
            message = f"autoprec: layer {self.fqn!r} runs {op} in {self.precision.format.value} {how}"
            warnings.warn(message, EmulationWarning, stacklevel=4)
            logger.info(message)
        self.ops[op] = how


class _RegionMode(TorchFunctionMode):
    """Routes FP8 / INT8 matrix products to the kernels and keeps FP32 ops in FP32."""

    def __init__(self, runtime: "PlanRuntime"):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32_OPS:
            return func(*[_to_fp32(a) for a in args], **{k: _to_fp32(v) for k, v in kwargs.items()})
        op = MATMUL_OPS.get(func)
        if op is None:
            return func(*args, **kwargs)
        stack = self.runtime._stack
        if not stack:
            self.runtime._note_uncovered(op)
            return func(*args, **kwargs)
        layer = stack[-1]
        if layer.precision.format is Format.FP32:
            # A lowered child hands this FP32 layer half tensors; its own products stay FP32.
            return func(*pytree.tree_map(_to_fp32, args), **pytree.tree_map(_to_fp32, kwargs))
        if layer.precision.format not in _GEMM_KERNELS:
            half = layer.precision.format.autocast_dtype
            if half is not None:
                # Autocast does not cast every matrix product (CPU: mv, addmv, bilinear), and
                # those fail on mixed dtypes; give them the layer's dtype as autocast would.
                args, kwargs = _unify_dtypes((args, kwargs), half)
            return func(*args, **kwargs)
        return self.runtime._run_low_precision(layer, op, func, args, kwargs)


class PlanRuntime:
    """Applies ``plan`` to ``model`` inside ``with runtime:``; reusable, not re-entrant.

    Use `apply_plan` to make one. Entering wraps the planned layers' forwards; exiting restores
    the model exactly (also when the body raises). Parameters, their dtypes and ``state_dict()``
    are never touched: weights stay FP32 masters and receive FP32 gradients.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None):
        if validate:
            plan.validate(model, example_inputs)
        self.model = model
        self.plan = plan
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.device_type = self.device.type
        self._layers = {fqn: _Layer(fqn, lp, self.device_type) for fqn, lp in plan.layers.items()}
        formats = {lp.format for lp in plan.layers.values()}
        self.low_precision = formats != {Format.FP32}
        # Between layers, tensors carry autocast's half dtype: FP16 only for a plan whose half
        # layers are all FP16 (mixing FP16 activations into BF16 layers would lose range).
        self.region_dtype = torch.float16 if (Format.FP16 in formats and Format.BF16 not in formats) else torch.bfloat16
        self._stack: list[_Layer] = []
        self._active = False
        self._exit_stack: "contextlib.ExitStack | None" = None
        self._restore: list[tuple[nn.Module, bool, Any]] = []
        self._uncovered: set[str] = set()

    # -- context ------------------------------------------------------------------------------

    def __enter__(self) -> "PlanRuntime":
        if self._active:
            raise RuntimeStateError("this plan runtime is already active; exit it before entering again (it is not re-entrant)")
        modules = dict(self.model.named_modules())
        for fqn in self._layers:
            held = getattr(modules[fqn].__dict__.get("forward"), "__autoprec_runtime__", None)
            if held is not None:
                raise RuntimeStateError(f"layer {fqn!r} already runs under another active autoprec plan; exit that one first")
        stack = contextlib.ExitStack()
        try:
            if self.low_precision:
                stack.enter_context(torch.autocast(self.device_type, dtype=self.region_dtype))
                for fqn, layer in self._layers.items():
                    self._wrap(modules[fqn], layer)
                stack.enter_context(_RegionMode(self))
        except BaseException:
            stack.close()
            self._unwrap()
            raise
        self._exit_stack = stack
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._active:
            raise RuntimeStateError("this plan runtime is not active")
        try:
            self._exit_stack.close()
        finally:
            self._unwrap()
            self._stack.clear()
            self._exit_stack = None
            self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def _wrap(self, module: nn.Module, layer: _Layer) -> None:
        had_own = "forward" in module.__dict__
        original = module.forward
        self._restore.append((module, had_own, module.__dict__.get("forward")))
        fmt = layer.precision.format
        device_type = self.device_type
        stack = self._stack

        if fmt in (Format.BF16, Format.FP16):
            def scope():
                return torch.autocast(device_type, dtype=fmt.dtype)
            layer.ops = {"*": f"torch.autocast({device_type!r}, {fmt.dtype})"}
        elif fmt is Format.FP32:
            def scope():
                return torch.autocast(device_type, enabled=False)
        else:
            scope = contextlib.nullcontext

        @functools.wraps(original)
        def forward(*args, **kwargs):
            if fmt is Format.FP32:
                args, kwargs = pytree.tree_map(_to_fp32, (args, kwargs))
            layer.calls_this_forward = 0
            stack.append(layer)
            try:
                with scope():
                    return original(*args, **kwargs)
            finally:
                stack.pop()

        forward.__autoprec_runtime__ = self
        module.forward = forward

    def _unwrap(self) -> None:
        for module, had_own, previous in reversed(self._restore):
            if had_own:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._restore.clear()

    # -- low-precision matrix products --------------------------------------------------------

    def _out_dtype(self, reference: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(self.device_type):
            return torch.get_autocast_dtype(self.device_type)
        return reference.dtype

    def _run_low_precision(self, layer: _Layer, op: str, func, args, kwargs):
        gemm = self._as_gemm(op, func, args, kwargs)
        if gemm is None:
            return self._emulate(layer, op, func, args, kwargs, "no FP8/INT8 kernel for this op")
        a, b, bias, beta, alpha, out_shape = gemm
        kernel = _GEMM_KERNELS[layer.precision.format]
        support = format_support(layer.precision.format, a.device)
        m, k = a.shape
        n = b.shape[1]
        reason = None
        if not support.kernel:
            reason = support.reason
        elif layer.precision.scaling.granularity is Granularity.BLOCK:
            reason = "block scaling has no kernel"
        elif not _SHAPE_OK[kernel](a.device, m, k, n):
            reason = f"shape (M={m}, K={k}, N={n}) does not fit the kernel's alignment"
        if reason is not None:
            return self._emulate(layer, op, func, args, kwargs, reason)
        slot = layer.next_slot()
        slot.kernel_calls += 1
        layer.note(op, "kernel torch._scaled_mm" if kernel is Fp8Gemm else "kernel torch._int_mm")
        out = kernel.apply(a, b, bias if beta == 1 else None, layer.precision, slot, _is_weight(b), torch.is_grad_enabled())
        if alpha != 1:
            out = out * alpha
        if bias is not None and beta != 1:
            out = out + beta * bias
        return out.reshape(out_shape).to(self._out_dtype(a))

    @staticmethod
    def _as_gemm(op: str, func, args, kwargs):
        """(a (M,K), b (K,N), bias, beta, alpha, out_shape) when the op is one 2-D GEMM, else None."""
        if op not in KERNEL_OPS:
            return None
        beta, alpha, bias = 1, 1, None
        if op == "linear":
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            b = w.t()
        elif op == "addmm":
            bias, x, b = args[0], args[1], args[2]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            if bias.dim() > 1:
                return None
        else:  # matmul / mm, incl. Tensor.__rmatmul__(self, other) == other @ self
            x, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else (args[0], args[1])
            if kwargs:
                return None
        if not (torch.is_tensor(x) and torch.is_tensor(b)) or x.dim() < 2 or b.dim() != 2:
            return None
        if not (x.is_floating_point() and b.is_floating_point()):
            return None
        a = x.reshape(-1, x.shape[-1])
        return a, b, bias, beta, alpha, (*x.shape[:-1], b.shape[1])

    def _emulate(self, layer: _Layer, op: str, func, args, kwargs, reason: str):
        """Run the op in FP32 on inputs rounded to the layer's format, saving them in that format."""
        slot = layer.next_slot()
        slot.emulated_calls += 1
        layer.note(op, f"emulated ({reason}): {layer.precision.format.value} storage, FP32 compute, current {layer.precision.scaling.granularity.value} scaling")
        fmt, grad_fmt = layer.precision.format, layer.precision.grad_format
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
        tensors = [leaves[i] for i in tensor_at]
        weights = tuple(_is_weight(t) for t in tensors)
        out_dtype = self._out_dtype(next((t for t in tensors if t.is_floating_point()), tensors[0]))

        def fn(*values):
            filled = list(leaves)
            for i, v in zip(tensor_at, values):
                filled[i] = v
            call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
            return func(*call_args, **call_kwargs)

        granularity = layer.precision.scaling.granularity

        def scaler(i, x):
            """Weights: per output channel (dim 0) for INT8 and ROW, 128x128 tiles for BLOCK;
            activations: 1x128 tiles for BLOCK, per row for ROW; else one current scale."""
            if granularity is Granularity.BLOCK and x.dim() >= 2:
                block = WEIGHT_BLOCK if weights[i] else ACTIVATION_BLOCK
                flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
                return scale_from_amax(amax(flat, Granularity.BLOCK, block), fmt), Granularity.BLOCK, block
            if x.dim() >= 2 and (granularity is Granularity.ROW or (fmt is Format.INT8 and weights[i])):
                rows = x.reshape(x.shape[0], -1) if weights[i] else x
                per_row = scale_from_amax(amax(rows, Granularity.ROW), fmt)
                return (per_row.reshape(-1, *([1] * (x.dim() - 1))) if weights[i] else per_row), Granularity.TENSOR, ACTIVATION_BLOCK
            return scale_from_amax(amax(x), fmt), Granularity.TENSOR, ACTIVATION_BLOCK

        out = _StoredWithRng.apply(fn, fmt, grad_fmt, scaler, weights, *tensors)
        return out.to(out_dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    def _note_uncovered(self, op: str) -> None:
        if op not in self._uncovered:
            self._uncovered.add(op)
            message = f"autoprec: a {op} ran outside every planned layer; make the plan with an example input to cover it"
            warnings.warn(message, EmulationWarning, stacklevel=4)
            logger.info(message)

    # -- state and report ---------------------------------------------------------------------

    def report(self) -> dict[str, dict]:
        """Per layer: planned format, how each op ran (kernel / emulated and why), calibration."""
        out = {}
        for fqn, layer in self._layers.items():
            entry = {"format": layer.precision.format.value, "ops": dict(layer.ops)}
            calibration = [s.int8.report for s in layer.slots if s.int8 is not None and s.int8.report]
            if calibration:
                entry["calibration"] = calibration
            out[fqn] = entry
        if self._uncovered:
            out["<uncovered>"] = {"format": "unplanned", "ops": {op: "ran outside planned layers" for op in sorted(self._uncovered)}}
        return out

    def emulated_layers(self) -> dict[str, list[str]]:
        """``fqn -> [op, ...]`` for every layer that ran an op without a real kernel."""
        return {
            fqn: sorted(op for op, how in layer.ops.items() if how.startswith("emulated"))
            for fqn, layer in self._layers.items()
            if any(how.startswith("emulated") for how in layer.ops.values())
        }

    def recalibrate(self, fqns=None) -> None:
        """Drop frozen INT8 scales (and amax histories) of the named layers (default: all)."""
        for fqn in fqns if fqns is not None else self._layers:
            for slot in self._layers[fqn].slots:
                s = self._layers[fqn].precision.scaling
                slot.a_history = AmaxHistory(s.history_len, s.reduction)
                slot.b_history = AmaxHistory(s.history_len, s.reduction)
                if slot.int8 is not None:
                    slot.int8.recalibrate()

    def state_dict(self) -> dict:
        return {"layers": {fqn: [slot.state_dict() for slot in layer.slots] for fqn, layer in self._layers.items() if layer.slots}}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["layers"]) - set(self._layers))
        if unknown:
            raise RuntimeStateError(f"runtime state names layers this plan lacks: {unknown}")
        for fqn, slots in state["layers"].items():
            layer = self._layers[fqn]
            layer.calls_this_forward = 0
            for slot_state in slots:
                layer.next_slot().load_state_dict(slot_state)
            layer.calls_this_forward = 0


class _StoredWithRng(StoredInFormat):
    """`StoredInFormat` whose backward recompute sees the forward's RNG state (dropout inside
    attention draws the same mask twice), as activation checkpointing does."""

    @staticmethod
    def forward(ctx, fn, fmt, grad_fmt, scaler, is_weight, *inputs):
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return StoredInFormat.forward(ctx, fn, fmt, grad_fmt, scaler, is_weight, *inputs)

    @staticmethod
    def backward(ctx, grad_out):
        devices = [torch.cuda.current_device()] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            return StoredInFormat.backward(ctx, grad_out)


def apply_plan(model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None) -> PlanRuntime:
    """A `PlanRuntime` for ``model``: ``with apply_plan(model, plan): ...``.

    Keep the returned runtime and re-enter it every step so amax histories and INT8 calibration
    carry over; a fresh ``apply_plan`` starts them anew. Validation (``plan.validate``) runs once
    here and raises `PlanError` naming every problem.
    """
    return PlanRuntime(model, plan, validate=validate, example_inputs=example_inputs)
