"""The matrix-product mode: how a planned layer's products run in its format.

`ThreadState` is what one thread has entered (the running planned layers, innermost last);
`LayerMode`, a ``TorchFunctionMode`` entered only inside the forward of layers that need it,
routes the products of the innermost running planned layer by its format; `Products` runs them:
FP8 / INT8 linear products through the kernels (`gemm.Fp8Linear` / `gemm.Int8Linear`, their
operands made by the quantizers of `quantizers`, eager FP8 on CUDA with fused Triton casts:
`casts`), and products no kernel takes through emulation (`emulation.StoredInFormat`). Costs per
FP8 / INT8 product: one amax and one cast per input, weight and output gradient, three GEMMs, no
host sync.
"""

from __future__ import annotations

import threading
from typing import Mapping, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._tracing import is_weight
from ..coverage import MATMUL_OPS
from ..formats import Format, Granularity
from .block_gemm import Fp8BlockLinear, Fp8BlockSpec
from .mx_gemm import Fp8MxLinear, MxSpec
from .nvfp4 import Nvfp4Linear, Nvfp4Spec
from .calibration import Int8Calibrator
from .casts import call_casts, describe
from .emulation import StoredInFormat
from .gemm import FP8_ALIGN, Fp8Linear, Fp8Spec, Int8Linear, Int8Spec
from .layers import NEVER_AUTOCAST, RuntimeLayer, as_gemm, map_leaves, to_dtype, to_fp32, unify_dtypes
from .pipelining import inferring
from .quantizers import OperandRole, QuantizedOperand
from .recompute import recorded_scale, training_forward
from .tensor_parallel import is_sharded, sharded_linear

__all__ = ["ThreadState", "PerThread", "LayerMode", "Products"]


class ThreadState:
    """What one thread has entered. Plain attributes, not a ``threading.local``'s own: Dynamo
    replays mutations of an ordinary object inside a compiled region, while a write to a
    ``threading.local`` inside one is not seen by later reads of the same trace (torch 2.13)."""

    __slots__ = ("active", "stack", "mode_active", "training")

    def __init__(self):
        self.active = False
        # Whether gradients were on when the thread entered the runtime: a training forward, in
        # which a forward under torch.no_grad is a reentrant checkpoint's (`recompute.users_record`).
        self.training = False
        # The planned layers whose forward is running, innermost last. A tuple replaced on entry and
        # restored on exit, never mutated: Dynamo refuses a list mutation inside a checkpointed
        # (recomputed) block's traced body, an attribute set and reset it accepts.
        self.stack: tuple = ()
        self.mode_active = False


class PerThread(threading.local):
    """One `ThreadState` per thread, made on the thread's first read (like autocast's state)."""

    def __init__(self):
        self.state = ThreadState()


class LayerMode(TorchFunctionMode):
    """Routes the matrix products of the innermost running planned layer by its format.

    Entered only inside the forward of layers that need it (not for the whole region): FP8 / INT8
    layers that are not plain ``nn.Linear``, FP32 layers holding lowered layers, and half layers
    that run products CPU autocast leaves uncast.
    """

    def __init__(self, threads: PerThread, products: "Products"):
        super().__init__()
        self.threads, self.products = threads, products

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = MATMUL_OPS.get(func)
        stack = self.threads.state.stack
        if op is None or not stack:
            return func(*args, **kwargs)
        layer = stack[-1]
        if layer.direct:  # a layer whose product is a kernel call: its own ops are the runtime's
            return func(*args, **kwargs)
        if layer.format is Format.FP32:
            # A lowered child hands this FP32 layer half tensors; its own products stay FP32.
            return func(*map_leaves(to_fp32, args), **map_leaves(to_fp32, kwargs))
        if not layer.low_precision:
            args, kwargs = (to_dtype if op in NEVER_AUTOCAST else unify_dtypes)((args, kwargs), layer.format.dtype)
            return func(*args, **kwargs)
        return self.products.run_low_precision(layer, op, func, args, kwargs)


class Products:
    """Runs a planned layer's products in its format (module docstring), for one runtime on one
    device. ``param_names``: the model's parameters by ``id``, which name their quantizers.
    ``reuse_weights``: inside `PlanRuntime.reusing_weights`, a parameter's quantized copy is
    reused (the runtime sets it)."""

    def __init__(self, device_type: str, backward_dtype: torch.dtype, param_names: Mapping[int, str]):
        self.device_type = device_type
        self.backward_dtype = backward_dtype
        self.param_names = param_names
        self.reuse_weights = False

    @staticmethod
    def kernel_name(layer: RuntimeLayer) -> str:
        if layer.nvfp4:
            return f"emulated ({layer.kernel_reason}): NVFP4 operands (1x16 blocks along K, 16x16 weight blocks, E4M3 and FP32 scales), FP32 GEMMs"
        if layer.mx:
            return f"emulated ({layer.kernel_reason}): MXFP8 operands (1x32 tiles along K, power-of-two scales), FP32 GEMMs"
        if layer.block_gemms_emulated:
            return f"emulated ({layer.kernel_reason}): fp8_e4m3 operands in the block kernels' tilings and scales, FP32 GEMMs"
        if layer.blocks:
            return "kernel torch.nn.functional.scaled_mm (1x128 tiles, 128x128 weight blocks)"
        return "kernel torch._int_mm" if layer.format is Format.INT8 else "kernel torch._scaled_mm"

    def out_dtype(self, reference: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(self.device_type):
            return torch.get_autocast_dtype(self.device_type)
        return reference.dtype if reference.dtype in (torch.float16, torch.bfloat16) else torch.float32

    def linear(self, layer: RuntimeLayer, x: torch.Tensor, weight: torch.Tensor, bias, weight_key: "str | None" = None, is_param: bool = True):
        """``x @ weight.T + bias`` in the layer's format; ``weight`` is (N, K), x is (..., K).
        ``is_param``: ``weight`` is a parameter (or a view of one), not an activation; only a
        parameter's quantized copy may be reused, inside `reusing_weights`."""
        if is_sharded(weight):
            key = weight_key or self.param_names.get(id(weight), "weight")
            return sharded_linear(layer, lambda xl, wl, bl: self.linear(layer, xl, wl, bl, key, is_param), x, weight, bias)
        if x.numel() == 0 or weight.numel() == 0:
            return self.empty(torch.nn.functional.linear, (x, weight, bias), {}, self.out_dtype(x))
        if layer.kernel_reason is not None and not layer.tiled_gemms_emulated:
            return self.emulate(layer, "linear", torch.nn.functional.linear, (x, weight, bias), {})
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        n, k = weight.shape
        out_dtype = self.out_dtype(x)
        if layer.mx or layer.nvfp4:  # quantize their weights themselves, for each GEMM: no kept copy
            precision = layer.precision
            out = (Nvfp4Linear.apply(x2, weight, bias, Nvfp4Spec(out_dtype, precision.grad_format is Format.FP32, precision.high_precision_weight_grad))
                   if layer.nvfp4 else
                   Fp8MxLinear.apply(x2, weight, bias, MxSpec(out_dtype, precision.scaling.margin, precision.grad_format, precision.high_precision_weight_grad)))
            return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        key = weight_key or self.param_names.get(id(weight), "weight")
        quantizer = layer.weight_quantizer((key, weight.stride()))
        # The fused casts per operand whose dtype they take (never while compiling: Inductor fuses).
        casts = None if torch.compiler.is_compiling() else layer.casts
        w_casts = call_casts(casts, weight.dtype)
        wq = quantizer.get(weight, need_transposed=grad, reuse=is_param and self.reuse_weights, casts=w_casts)
        if layer.format is Format.INT8:
            out = self.int8(layer, key, x2, weight, bias, wq, out_dtype, k, n)
        elif layer.blocks:
            block_spec = Fp8BlockSpec(out_dtype, layer.precision.scaling.margin, k, n, casts, layer.block_gemms_emulated,
                                      layer.precision.high_precision_weight_grad)
            if casts is not None:
                layer.casts_ran = describe(weight=w_casts is not None, input=casts.takes(x2.dtype), gradient=casts.takes(out_dtype))
            out = Fp8BlockLinear.apply(x2, weight, bias, wq, block_spec)
        else:
            rowwise = layer.precision.scaling.granularity is Granularity.ROW
            # Row-shaped scales: the kernel writes the region's half dtype where the installed torch
            # takes it (torch 2.11 on sm_90 with cuBLAS >= 12.9 runs FP16 in cuBLASLt), else BF16,
            # cast after the kernel (one more kernel, BF16 rounding); FP32 out is never row-shaped.
            row_scaled = layer.row_scaled_outs
            kernel_dtype = (out_dtype if out_dtype in row_scaled else torch.bfloat16) if row_scaled else out_dtype
            # _scaled_mm fuses no bias into an FP32 output: there it is added after the kernel.
            fused = bias is not None and kernel_dtype != torch.float32
            record = training_forward()
            x_casts, g_casts = call_casts(casts, x2.dtype), call_casts(casts, kernel_dtype)
            with torch.no_grad():
                # A recomputed block's backward reads back the scale its forward chose: asking the
                # quantizer again would record this batch's amax into its history twice.
                x_q = self.input_operand(layer, key, x2, record, x_casts, grad)
            if casts is not None:
                layer.casts_ran = describe(weight=w_casts is not None, input=x_casts is not None, gradient=g_casts is not None)
            spec = Fp8Spec(layer.format, layer.grad, rowwise, kernel_dtype, bool(row_scaled), k, n, g_casts, layer.shard_group if layer.rows_split else None,
                           layer.precision.high_precision_weight_grad)
            out = Fp8Linear.apply(x2, weight, bias if fused else None, x_q, wq, spec)
            if out.dtype != out_dtype:
                out = out.to(out_dtype)
            if bias is not None and not fused:
                out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)

    @staticmethod
    def input_operand(layer: RuntimeLayer, key: str, x2: torch.Tensor, record: bool, casts, transposed: bool) -> QuantizedOperand:
        """The input's `QuantizedOperand`: its scale (recorded for, or replayed by, a recomputed
        block) and, with ``casts``, the input cast by the fused kernels (in the same pass as the
        scale where they can: `quantizers.Quantizer.fused_cast`), else no data (`gemm.Fp8Linear`
        casts it)."""
        quantizer = layer.input_quantizer(key)
        if casts is None:
            return QuantizedOperand(None, recorded_scale(layer.fqn, key, lambda: quantizer.inverse_scale(x2, record=record)))
        made = []

        def scale():
            made.append(quantizer.fused_cast(x2, casts, transposed, pad_cols=FP8_ALIGN, t_rows=FP8_ALIGN, record=record))
            return made[0].inv_scale

        x_inv = recorded_scale(layer.fqn, key, scale)
        if not made:  # a recomputation replayed the forward's scale: cast with it
            made.append(quantizer.fused_cast(x2, casts, transposed, pad_cols=FP8_ALIGN, t_rows=FP8_ALIGN, inv=x_inv))
        return made[0]

    def int8(self, layer, key, x2, weight, bias, wq, out_dtype, k, n):
        keep = index = valid = None
        if layer.precision.scaling.granularity is Granularity.ROW:
            with torch.no_grad():
                x_inv = layer.input_quantizer(key).inverse_scale(x2)
        else:
            def calibrated():
                if inferring():  # a pipeline stage's metadata inference: the scale, nothing observed
                    return Int8Calibrator.peek(layer.calibrators.get(key), x2), None, None, None
                calibrator = layer.calibrator(key, k)
                calibrator.to(x2.device)
                inv = calibrator.observe(x2)
                if calibrator.has_outliers:
                    return inv, calibrator.keep, calibrator.outlier_index, calibrator.outlier_valid
                return inv, None, None, None

            # A recomputed block's backward reads back what its forward used: observing again would
            # count the batch twice towards calibration (and could freeze it in between).
            x_inv, keep, index, valid = recorded_scale(layer.fqn, key, calibrated)
        spec = Int8Spec(out_dtype, self.backward_dtype, k, n)
        return Int8Linear.apply(x2, weight, bias, x_inv, wq.data, wq.inv_scale, keep, index, valid, spec)

    def run_low_precision(self, layer: RuntimeLayer, op: str, func, args, kwargs):
        gemm = as_gemm(op, func, args, kwargs)
        if gemm is None:
            return self.emulate(layer, op, func, args, kwargs, "no FP8/INT8 kernel for this op")
        if layer.kernel_reason is not None and not layer.tiled_gemms_emulated:
            return self.emulate(layer, op, func, args, kwargs)
        a, b, bias, beta, alpha, out_shape = gemm
        layer.note(op, self.kernel_name(layer))
        is_param = is_weight(b)
        weight_key: Optional[str]
        if is_param:
            base = b if isinstance(b, nn.Parameter) else b._base
            # The layer's own parameters by identity first: Dynamo cannot take the id() of a view's
            # base (it has no source), and torch 2.11 then fails after the graph break.
            own = next((name for name, p in layer.module.named_parameters(recurse=False) if p is base), None)
            if own is not None:
                weight_key = f"{layer.fqn}.{own}" if layer.fqn else own
            else:  # another module's parameter (a tied weight)
                weight_key = self.param_names.get(id(base))
        else:
            weight_key = f"activation:{op}"  # its scaling state only: an activation is never kept
        out = self.linear(layer, a, b.t(), bias if beta == 1 else None, weight_key=weight_key, is_param=is_param)
        if alpha != 1:
            out = out * alpha
        if bias is not None and beta != 1:
            out = out + beta * bias
        return out.reshape(out_shape)

    def empty(self, func, args, kwargs, out_dtype: torch.dtype):
        """A product with an empty operand (an expert routed no tokens, a (B, 0, K) input): plain
        PyTorch's result (its shape; zeros, or the bias; zero gradients) in ``out_dtype``, the
        dtype the format gives a non-empty input. No quantizer runs, so an empty batch changes no
        calibration, amax history or scale (a delayed history would take its amax, 0, as a step),
        and no kernel is called (``_scaled_mm`` refuses row-wise scales of 0 rows)."""
        with torch.autocast(self.device_type, enabled=False):
            out = func(*map_leaves(to_fp32, args), **map_leaves(to_fp32, kwargs))
        return out.to(out_dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    def emulate(self, layer: RuntimeLayer, op: str, func, args, kwargs, reason: "str | None" = None):
        """Run the op in FP32 on inputs rounded to the layer's format, saving them in that format."""
        reason = reason or layer.kernel_reason
        scaled = "NVFP4 blocks" if layer.nvfp4 else f"current {layer.precision.scaling.granularity.value} scaling"
        layer.note(op, f"emulated ({reason}): {layer.format.value} storage, FP32 compute, {scaled}")
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
        tensors = [leaves[i] for i in tensor_at]
        out_dtype = self.out_dtype(next((t for t in tensors if t.is_floating_point()), tensors[0]))
        if any(t.numel() == 0 for t in tensors):
            return self.empty(func, args, kwargs, out_dtype)

        def fn(*values):
            filled = list(leaves)
            for i, v in zip(tensor_at, values):
                filled[i] = v
            call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
            return func(*call_args, **call_kwargs)

        # Weights: per output channel (dim 0) for INT8 and ROW, 128x128 tiles for BLOCK;
        # activations: 1x128 tiles for BLOCK, per row for ROW; else one scale (see the quantizers).
        by_role = layer.emulation_quantizers()
        quantizers = tuple(by_role[OperandRole.WEIGHT if is_weight(t) else OperandRole.INPUT] for t in tensors)
        # Attention draws its dropout masks inside the op; the other products draw nothing.
        draws_random = op in ("scaled_dot_product_attention", "multi_head_attention")
        out = StoredInFormat.apply(fn, quantizers, layer.grad, layer.precision.high_precision_weight_grad, draws_random, *tensors)
        return out.to(out_dtype) if torch.is_tensor(out) and out.is_floating_point() else out
