"""`PlanRuntime`: makes a `Plan` real in forward and backward, and holds the runtime state.

How a plan runs (``with runtime:``), cheapest first:

- An all-FP32 plan changes nothing: no wrapper, no mode, no autocast (the plain model's ops).
- Otherwise the region runs under ``torch.autocast`` in the plan's half dtype, so everything
  between layers behaves exactly as under plain autocast (same ops, same FP32 policy). A uniform
  BF16 plan of ordinary layers is exactly ``torch.autocast(dtype=torch.bfloat16)``: no per-layer
  machinery at all.
- A layer gets a forward wrapper only where the region's autocast is not already what it needs:
  FP32 layers (autocast off, FP32 inputs), half layers in the other half dtype, FP8 / INT8 layers,
  and every planned layer below a wrapped one (so the innermost planned layer always decides).
  Wrappers are built and installed once per runtime (one ``forward`` attribute per layer) and
  stay until `PlanRuntime.remove`; entering the context only flips a flag of the calling
  thread, so a compiled step can enter it (`PlanRuntime.region`) with no graph break. Outside
  the context, in any other thread and in a deep copy of the model, a wrapper calls the
  module's own forward: the plain model's ops exactly.
- FP8 / INT8 ``nn.Linear`` layers call the kernels directly (`gemm.Fp8Linear` / `gemm.Int8Linear`).
  Other FP8 / INT8 layers (a projection calling ``addmm`` on a transposed weight, ``x @ w.t()``,
  convolutions, attention) run under a `TorchFunctionMode` entered only inside their own forward,
  which routes their matrix products to the same kernels or, where none exists, to emulation.

Backward needs no context (``loss.backward()`` may run after the ``with`` block). Costs per step
of an FP8 / INT8 linear layer: one amax and one cast per input, weight and output gradient, three
GEMMs (`gemm`, `quantizers`), no host sync; eager FP8 on CUDA with Triton runs the casts as fused
kernels, three launches per operand (`casts`, `triton_cast`). Runtime state (amax histories,
INT8 calibration) survives exits and re-entries; ``state_dict()`` / ``load_state_dict()`` save
and restore it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._tracing import is_weight
from ..coverage import MATMUL_OPS, layer_name
from ..device import KERNEL_OPS, canonical_device, format_support, scaled_mm_form
from ..errors import RuntimeStateError
from ..formats import Format, Granularity
from ..plan import LayerPrecision, Plan, ScalingMode
from .calibration import Int8Calibrator
from .casts import FUSED, PYTORCH, call_casts, describe, fused_casts
from .emulation import StoredInFormat
from .gemm import FP8_ALIGN, INT8_ALIGN, Fp8Linear, Fp8Spec, Int8Linear, Int8Spec, pad_to_multiple
from .quantizers import GradQuantizer, InputQuantizer, WeightQuantizer
from .recompute import BlockHost, block_wrapper, recorded_scale
from .wrapping import displaced, mark, previous_of

__all__ = ["PlanRuntime", "apply_plan", "removing", "EmulationWarning", "kernel_reason", "as_gemm"]

logger = logging.getLogger(__name__)

# Ops CPU autocast leaves uncast: they fail on mixed dtypes inside a half layer, so a layer that
# runs one gets the layer mode, which gives them the layer's dtype.
_AUTOCAST_UNCAST = {"cpu": frozenset({"mv", "addmv", "bilinear"})}


# Set in a planned module's __dict__ while a runtime is active on it (eager entries), so a second
# runtime on the same layers is refused: two plans on one layer would fight over its dtypes. A weak
# reference, so that a deep copy of the model made meanwhile copies no runtime, and its stale
# mark counts only while that runtime stays active.
_ACTIVE_MARK = "_autoprec_active_runtime"


def _active_runtime(module: nn.Module) -> "PlanRuntime | None":
    mark = module.__dict__.get(_ACTIVE_MARK)
    runtime = mark() if mark is not None else None
    return runtime if runtime is not None and runtime._active else None


class _ThreadState:
    """What one thread has entered. Plain attributes, not a ``threading.local``'s own: Dynamo
    replays mutations of an ordinary object inside a compiled region, while a write to a
    ``threading.local`` inside one is not seen by later reads of the same trace (torch 2.13)."""

    __slots__ = ("active", "stack", "mode_active")

    def __init__(self):
        self.active = False
        # The planned layers whose forward is running, innermost last. A tuple replaced on entry and
        # restored on exit, never mutated: Dynamo refuses a list mutation inside a checkpointed
        # (recomputed) block's traced body, an attribute set and reset it accepts.
        self.stack: tuple = ()
        self.mode_active = False


class _PerThread(threading.local):
    """One `_ThreadState` per thread, made on the thread's first read (like autocast's state)."""

    def __init__(self):
        self.state = _ThreadState()


class EmulationWarning(UserWarning):
    """A layer runs its planned format without a real kernel (low-precision storage, FP32 compute)."""


def kernel_reason(precision: LayerPrecision, device: "torch.device | str") -> "str | None":
    """Why the 2-D products of a layer in ``precision`` cannot use a real kernel on ``device``;
    None when they can. The one place that decides kernel or emulation (the cost model asks it too).

    Shapes never force emulation: operands are padded to the kernels' alignment.
    """
    fmt = precision.format
    support = format_support(fmt, device)
    if not support.kernel:
        return support.reason
    granularity = precision.scaling.granularity
    if granularity is Granularity.BLOCK:
        return "block scaling has no kernel"
    if granularity is Granularity.ROW and fmt.is_fp8:
        # Row-wise scales are a form of their own (torch 2.11's CPU kernel refuses them): the
        # forward's exact call, BF16 out (the form every torch with row-wise scaling takes).
        ok, reason = _row_scale_form(fmt, torch.bfloat16, device)
        if not ok:
            return reason
    return None


def _row_scale_form(fmt: Format, out_dtype: torch.dtype, device: "torch.device | str") -> tuple[bool, str]:
    """Whether the installed torch runs an FP8 forward with row-wise-shaped scales on ``device``:
    ``fmt`` input x E4M3 weight, fused bias, ``out_dtype`` out (probed once, cached)."""
    return scaled_mm_form(canonical_device(device), fmt.dtype, Format.FP8_E4M3.dtype, out_dtype, row_scales=True, bias=True)


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


def as_gemm(op: str, func, args, kwargs):
    """``(a (M,K), b (K,N), bias, beta, alpha, out_shape)`` when the op is one 2-D GEMM, else None."""
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
    return x.reshape(-1, x.shape[-1]), b, bias, beta, alpha, (*x.shape[:-1], b.shape[1])


class _Layer:
    """One planned layer while the runtime lives: its precision, quantizers and run report."""

    def __init__(self, fqn: str, module: nn.Module, precision: LayerPrecision, device: torch.device):
        self.fqn = fqn
        self.module = module
        self.precision = precision
        self.format = precision.format
        self.low_precision = self.format in (Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8)
        self.device = device
        self.kernel_reason = kernel_reason(precision, device) if self.low_precision else None
        # The half dtypes the installed torch's _scaled_mm writes with row-wise-shaped scales for
        # this layer's forward (empty where it refuses them, e.g. torch 2.11 on CPU): probed here
        # once, never in a forward (which may be traced by torch.compile).
        self.row_scale_outs: frozenset = frozenset()
        if self.format.is_fp8 and self.kernel_reason is None:
            self.row_scale_outs = frozenset(
                d for d in (torch.bfloat16, torch.float16) if _row_scale_form(self.format, d, device)[0]
            )
        # How its FP8 kernel calls quantize: the device's fused Triton casts (chosen once per
        # device, `casts.cast_path`) or None for PyTorch ops; `casts_ran`: what its last eager call used.
        self.casts = fused_casts(device) if self.format.is_fp8 and self.kernel_reason is None else None
        self.casts_ran = FUSED if self.casts is not None else PYTORCH
        self.keeps_thread_state = False  # set by its wrapper (PlanRuntime._wrapper), when it has one
        self.direct = False  # its product is one kernel call, routed by its wrapper (set there)
        self.inputs: dict[str, InputQuantizer] = {}
        self.calibrators: dict[str, Int8Calibrator] = {}
        self.weights: dict[tuple, WeightQuantizer] = {}
        # The output gradient's quantizer (stateless, shared by every product of the layer); None
        # where the backward stays in high precision (FP32 gradients, INT8 layers).
        grad_fmt = precision.grad_format
        self.grad: "GradQuantizer | None" = None
        if self.format.is_fp8 and grad_fmt.is_fp8:
            self.grad = GradQuantizer.for_layer(self.format, grad_fmt)
        self._emulation: "tuple[InputQuantizer, WeightQuantizer] | None" = None
        self.ops: dict[str, str] = {}  # op -> how it ran ("kernel ...", "emulated (...)", "autocast ...")
        self.unwarned: list[str] = []  # ops emulated since the layer's last EmulationWarning

    def input_quantizer(self, key: str) -> InputQuantizer:
        quantizer = self.inputs.get(key)
        if quantizer is None:
            quantizer = self.inputs[key] = InputQuantizer(self.format, self.precision.scaling)
        return quantizer

    def calibrator(self, key: str, channels: int) -> Int8Calibrator:
        calibrator = self.calibrators.get(key)
        if calibrator is None:
            calibrator = self.calibrators[key] = Int8Calibrator(self.precision.calibration, channels)
        return calibrator

    @staticmethod
    def kernel_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``bias`` in ``dtype``, padded to the FP8 kernel's N: one cast (and a pad) of N
        elements per call, never kept (a kept copy would go stale as the weights do)."""
        with torch.no_grad():
            padded = bias.to(dtype)
            if bias.shape[0] % FP8_ALIGN:
                padded = pad_to_multiple(padded.unsqueeze(0), 1, FP8_ALIGN).squeeze(0)
        return padded

    def weight_quantizer(self, key: tuple) -> WeightQuantizer:
        quantizer = self.weights.get(key)
        if quantizer is None:
            rowwise = self.precision.scaling.granularity is Granularity.ROW
            fmt = Format.INT8 if self.format is Format.INT8 else Format.FP8_E4M3
            # Per-tensor scales in row-wise shape only on CPU and only where the installed torch
            # takes that form (2.13 does, 2.11 refuses it): see gemm.Fp8Spec.expand_scales.
            row_scales = self.device.type == "cpu" and self.format is Format.FP8_E4M3 and torch.bfloat16 in self.row_scale_outs
            granularity = Granularity.ROW if rowwise else Granularity.TENSOR
            quantizer = self.weights[key] = WeightQuantizer(fmt, granularity, INT8_ALIGN if fmt is Format.INT8 else FP8_ALIGN, row_scales)
        return quantizer

    def emulation_quantizers(self) -> "tuple[InputQuantizer, WeightQuantizer]":
        """The input and weight quantizers of emulated products: the layer's format and
        granularity (BLOCK included), current scaling (no state, so no history to share with the
        kernels' quantizers); the gradient's is `grad`. Made once."""
        if self._emulation is None:
            scaling = dataclasses.replace(self.precision.scaling, mode=ScalingMode.CURRENT)
            self._emulation = (InputQuantizer(self.format, scaling), WeightQuantizer(self.format, scaling.granularity))
        return self._emulation

    def note(self, op: str, how: str) -> None:
        if torch.compiler.is_compiling() or self.ops.get(op) == how:
            return
        if how.startswith("emulated") and not self.ops.get(op, "").startswith("emulated"):
            self.unwarned.append(op)  # said once the layer's forward ends (`warn_emulated`), with its other ops
        self.ops[op] = how

    def warn_emulated(self) -> None:
        """One `EmulationWarning` naming every op this layer emulated since its last one (all of
        them, the first time its forward ends), grouped by why. The only channel: nothing is
        logged, so a user filtering the warning sees it nowhere."""
        ops, self.unwarned = self.unwarned, []
        by_how: dict[str, list[str]] = {}
        for op in ops:
            by_how.setdefault(self.ops[op], []).append(op)
        ways = "; ".join(f"{', '.join(names)} in {self.format.value} {how}" for how, names in by_how.items())
        # stacklevel 5: the line that called the layer (past its forward and Module.__call__'s two frames).
        warnings.warn(f"autoprec: layer {layer_name(self.fqn, self.module)!r} runs {ways}", EmulationWarning, stacklevel=5)


class _LayerMode(TorchFunctionMode):
    """Routes the matrix products of the innermost running planned layer by its format.

    Entered only inside the forward of layers that need it (not for the whole region): FP8 / INT8
    layers that are not plain ``nn.Linear``, FP32 layers holding lowered layers, and half layers
    that run products CPU autocast leaves uncast.
    """

    def __init__(self, runtime: "PlanRuntime"):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = MATMUL_OPS.get(func)
        stack = self.runtime._threads.state.stack
        if op is None or not stack:
            return func(*args, **kwargs)
        layer = stack[-1]
        if layer.direct:  # a layer whose product is a kernel call: its own ops are the runtime's
            return func(*args, **kwargs)
        if layer.format is Format.FP32:
            # A lowered child hands this FP32 layer half tensors; its own products stay FP32.
            return func(*pytree.tree_map(_to_fp32, args), **pytree.tree_map(_to_fp32, kwargs))
        if not layer.low_precision:
            args, kwargs = _unify_dtypes((args, kwargs), layer.format.dtype)
            return func(*args, **kwargs)
        return self.runtime._run_low_precision(layer, op, func, args, kwargs)


class PlanRuntime:
    """Applies ``plan`` to ``model`` inside ``with runtime:``; reusable, not re-entrant.

    Use `apply_plan` to make one. Parameters, their dtypes and ``state_dict()`` are never touched:
    weights stay FP32 masters and receive FP32 gradients. The plan is thread-local, as
    ``torch.autocast`` is: it applies to the thread that entered the context only. Any write to
    a weight is seen by the next forward (weights are quantized per forward, see
    `reusing_weights`). The layer wrappers stay on the model between steps: `remove` them before
    ``torch.save(model)`` (a wrapper does not pickle; ``copy.deepcopy`` works).
    """

    def __init__(self, model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None):
        _check_arguments(model, plan)
        if validate:
            plan.validate(model, example_inputs)
        self.model = model
        self.plan = plan
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.device_type = self.device.type
        modules = dict(model.named_modules())
        self._layers = {fqn: _Layer(fqn, modules[fqn], lp, self.device) for fqn, lp in plan.layers.items()}
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        formats = {lp.format for lp in plan.layers.values()}
        self.low_precision = formats != {Format.FP32}
        # Between layers, tensors carry autocast's half dtype: FP16 only for a plan whose half
        # layers are all FP16 (mixing FP16 activations into BF16 layers would lose range).
        self.region_dtype = torch.float16 if (Format.FP16 in formats and Format.BF16 not in formats) else torch.bfloat16
        # INT8 (and FP8 FP32-gradient) backward runs in BF16 on CUDA and FP32 on CPU, where BF16
        # matrix units are not a given.
        self.backward_dtype = torch.bfloat16 if self.device_type == "cuda" else torch.float32
        self._threads = _PerThread()
        self._active = False  # entered by some thread (a runtime is not re-entrant)
        self._entered: "contextlib.AbstractContextManager[PlanRuntime] | None" = None  # the region() ``with runtime:`` entered
        self._reuse_weights = False
        self._wrappers = self._build_wrappers() if self.low_precision else {}
        # Recomputed blocks: checkpointed while the plan is on (see `recompute`); installed after
        # the layers' wrappers, taken off with them.
        host = BlockHost(self, self._threads, self._installed, self._layer_mode, self._layers, self._wrappers)
        self._block_wrappers = {fqn: (modules[fqn], block_wrapper(host, fqn, modules[fqn])) for fqn in plan.recompute}
        if not any(_active_runtime(layer.module) is not None for layer in self._layers.values()):
            self._install()  # else on entry, once the active runtime has left

    # -- installation (once per runtime) ------------------------------------------------------

    def _needs_mode(self, layer: _Layer, planned_below: bool) -> bool:
        if layer.format is Format.FP32:
            return planned_below
        if layer.low_precision:
            # Only an unpatched nn.Linear forward is known to be exactly F.linear(x, weight, bias).
            plain_linear = type(layer.module).forward is nn.Linear.forward and "forward" not in layer.module.__dict__
            return not plain_linear or layer.kernel_reason is not None
        ops = set(self.plan.fingerprint[layer.fqn].ops) if layer.fqn in self.plan.fingerprint else set()
        return bool(ops & _AUTOCAST_UNCAST.get(self.device_type, frozenset())) or not ops

    def _build_wrappers(self) -> dict[str, Any]:
        """fqn -> the forward to install for every layer that needs one (see the module docstring)."""
        fqns = list(self._layers)

        def ancestors(fqn):
            return [f for f in fqns if f != fqn and (f == "" or fqn.startswith(f + "."))]

        def descendants(fqn):
            return [f for f in fqns if f != fqn and (fqn == "" or f.startswith(fqn + "."))]

        wrappers: dict[str, Any] = {}
        with_mode: set[str] = set()
        for fqn in sorted(fqns, key=lambda f: (f.count(".") if f else -1)):  # parents first
            layer = self._layers[fqn]
            below = any(self._layers[d].format is not Format.FP32 for d in descendants(fqn))
            mode = self._needs_mode(layer, below)
            if mode:
                with_mode.add(fqn)
            own_scope = (
                mode
                or layer.format is Format.FP32
                or layer.low_precision
                or layer.format.dtype != self.region_dtype
                or any(a in wrappers for a in ancestors(fqn))
            )
            if own_scope:
                # The layer stack is read only by the mode: a layer under no mode need not push itself.
                wrappers[fqn] = self._wrapper(layer, mode, stacked=mode or any(a in with_mode for a in ancestors(fqn)))
        return wrappers

    def _wrapper(self, layer: _Layer, mode: bool, stacked: bool):
        """The forward installed on ``layer.module``: the plan's in a thread that entered this
        runtime, the module's own everywhere else (other threads, outside the context, a copy).
        ``stacked``: the layer runs under the mode (its own or an ancestor's), which reads the
        running layer from the thread's stack; otherwise its forward changes no thread state."""
        module, fmt, device_type, threads = layer.module, layer.format, self.device_type, self._threads
        had_own, previous = displaced(module)
        direct_linear = layer.low_precision and not mode
        # Whether its forward changes thread state, which Dynamo cannot trace inside a recomputed
        # block (see recompute.compile_refusal).
        layer.keeps_thread_state = stacked
        layer.direct = direct_linear
        if direct_linear:
            layer.ops = {"linear": self._kernel_name(layer)}
        elif fmt in (Format.BF16, Format.FP16):
            layer.ops = {"*": f"torch.autocast({device_type!r}, {fmt.dtype})"}
        runtime = self

        def own_forward(m, args, kwargs):
            """``m``'s forward without the plan: the user's instance forward, if this module had
            one, else its class's. ``type(m).forward(m, ...)``, not a method bound with
            ``__get__``: torch 2.11's Dynamo cannot trace ``function.__get__`` (a graph break)."""
            if had_own and m is module:
                return previous(*args, **kwargs)
            return type(m).forward(m, *args, **kwargs)

        def forward(self_module, *args, **kwargs):
            state = threads.state
            if not state.active or self_module is not module:
                # A deep copy of the model carries this method re-bound to the copy: it runs the
                # copy's own forward, never this module's weights.
                return own_forward(self_module, args, kwargs)
            if direct_linear:
                x = args[0] if args else kwargs["input"]
                if not state.mode_active:
                    return runtime._linear(layer, x, module.weight, module.bias)
                # An ancestor's mode runs: on the stack, this layer's own kernel ops (an INT8
                # layer's outlier addmm) pass through it rather than being routed as the ancestor's.
                outer = state.stack
                state.stack = outer + (layer,)
                try:
                    return runtime._linear(layer, x, module.weight, module.bias)
                finally:
                    state.stack = outer
            if fmt is Format.FP32:
                args, kwargs = pytree.tree_map(_to_fp32, (args, kwargs))
                scope = torch.autocast(device_type, enabled=False)
            elif fmt in (Format.BF16, Format.FP16):
                scope = torch.autocast(device_type, dtype=fmt.dtype)
            else:
                scope = contextlib.nullcontext()
            if not stacked:
                with scope:
                    return own_forward(module, args, kwargs)
            enter_mode = mode and not state.mode_active
            outer = state.stack
            state.stack = outer + (layer,)
            try:
                with scope, (runtime._layer_mode(state) if enter_mode else contextlib.nullcontext()):
                    out = own_forward(module, args, kwargs)
            finally:
                state.stack = outer
            # Once its forward has run every product: one warning for all the ops it emulated.
            # is_compiling first: Dynamo folds it, so a compiled forward reads no list (note records nothing there).
            if not torch.compiler.is_compiling() and layer.unwarned:
                layer.warn_emulated()
            return out

        mark(forward, self, had_own, previous)
        # Bound, so that copy.deepcopy(model) re-binds it to the copy (see the check above).
        return types.MethodType(forward, module)

    @contextlib.contextmanager
    def _layer_mode(self, state: _ThreadState):
        state.mode_active = True
        try:
            with _LayerMode(self):
                yield
        finally:
            state.mode_active = False

    @staticmethod
    def _kernel_name(layer: _Layer) -> str:
        return "kernel torch._int_mm" if layer.format is Format.INT8 else "kernel torch._scaled_mm"

    # -- installation and context -------------------------------------------------------------

    def _installed_wrappers(self) -> list:
        """(module, forward) of every wrapper this runtime installs: layers, then recomputed blocks."""
        return [(self._layers[fqn].module, forward) for fqn, forward in self._wrappers.items()] + list(self._block_wrappers.values())

    def _installed(self) -> bool:
        return all(module.__dict__.get("forward") is forward for module, forward in self._installed_wrappers())

    def _install(self) -> None:
        """Put this runtime's wrappers on its layers and recomputed blocks, displacing an inactive
        runtime's; they stay until `remove` (wrap once, flip on enter: entering then costs no
        module surgery, and a compiled step can enter the context without a graph break)."""
        for module, forward in self._installed_wrappers():
            module.forward = forward

    def remove(self) -> None:
        """Take this runtime's wrappers off the model, restoring each module's ``__dict__`` as it
        was (a forward the user had set on an instance included). Call it before pickling the
        model (``torch.save(model)``); entering the runtime again re-installs them."""
        if self._active:
            raise RuntimeStateError("exit this plan runtime before removing it")
        for module, forward in self._installed_wrappers():
            if module.__dict__.get("forward") is not forward:
                continue  # displaced by another runtime, which restores on its own removal
            had_own, previous = previous_of(forward)
            if had_own:
                module.forward = previous
            else:
                del module.__dict__["forward"]

    def __enter__(self) -> "PlanRuntime":
        """Turns the plan on for the calling thread only (like ``torch.autocast``): the same model
        run by another thread meanwhile runs unplanned. Costs no module surgery.

        Inside a function compiled whole, use ``with runtime.region():`` instead: Dynamo (torch
        2.11 to 2.13) cannot enter a context-manager object made outside the compiled function
        and breaks the graph at ``with runtime:``.
        """
        region = self.region()
        entered = region.__enter__()
        self._entered = region
        return entered

    def __exit__(self, exc_type, exc, tb) -> None:
        region, self._entered = self._entered, None
        if region is None:
            raise RuntimeStateError("this plan runtime is not active")
        region.__exit__(exc_type, exc, tb)

    @contextlib.contextmanager
    def region(self):
        """``with runtime:`` as a generator context manager, which ``torch.compile`` traces
        with no graph break: ``with runtime.region():`` inside a compiled training step."""
        if self._active:
            raise RuntimeStateError("this plan runtime is already active; exit it before entering again (it is not re-entrant)")
        if not torch.compiler.is_compiling():
            for fqn, layer in self._layers.items():
                if _active_runtime(layer.module) is not None:
                    raise RuntimeStateError(f"layer {layer_name(fqn, layer.module)!r} already runs under another active autoprec plan; exit that one first")
            mark = weakref.ref(self)
            for layer in self._layers.values():
                layer.module.__dict__[_ACTIVE_MARK] = mark
        if not self._installed():
            self._install()  # another runtime displaced this one's wrappers since
        state = self._threads.state
        state.active = True
        self._active = True
        try:
            if self.low_precision:
                with torch.autocast(self.device_type, dtype=self.region_dtype):
                    yield self
            else:
                yield self
        finally:
            state.active = False
            state.stack = ()
            self._active = False
            if not torch.compiler.is_compiling():
                for layer in self._layers.values():
                    layer.module.__dict__.pop(_ACTIVE_MARK, None)

    @property
    def active(self) -> bool:
        return self._active

    @contextlib.contextmanager
    def reusing_weights(self):
        """Inside, each weight is quantized once and its low-precision copy reused by later
        forwards: for the micro-batches of one optimizer step under gradient accumulation.

        The caller promises that nothing writes a planned weight inside the scope (no optimizer
        step, ``.data`` update, ``load_state_dict`` or FSDP2 reshard between the forwards):
        autoprec cannot see such writes, and a copy made before one would be stale. Leaving the
        scope drops the copies. Saves, per micro-batch after the first, one amax, one cast and
        one transposed copy per FP8 / INT8 weight; holds one to two bytes per weight element.
        """
        if self._reuse_weights:
            raise RuntimeStateError("reusing_weights() is already open on this runtime; it does not nest")
        self._reuse_weights = True
        try:
            yield self
        finally:
            self._reuse_weights = False
            for layer in self._layers.values():
                for quantizer in layer.weights.values():
                    quantizer.clear()

    # -- low-precision matrix products --------------------------------------------------------

    def _out_dtype(self, reference: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(self.device_type):
            return torch.get_autocast_dtype(self.device_type)
        return reference.dtype if reference.dtype in (torch.float16, torch.bfloat16) else torch.float32

    def _linear(self, layer: _Layer, x: torch.Tensor, weight: torch.Tensor, bias, weight_key: "str | None" = None, is_param: bool = True):
        """``x @ weight.T + bias`` in the layer's format; ``weight`` is (N, K), x is (..., K).
        ``is_param``: ``weight`` is a parameter (or a view of one), not an activation; only a
        parameter's quantized copy may be reused, inside `reusing_weights`."""
        if layer.kernel_reason is not None:
            return self._emulate(layer, "linear", torch.nn.functional.linear, (x, weight, bias), {})
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        n, k = weight.shape
        out_dtype = self._out_dtype(x)
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        key = weight_key or self._param_names.get(id(weight), "weight")
        quantizer = layer.weight_quantizer((key, weight.stride()))
        # The fused casts per operand whose dtype they take (never while compiling: Inductor fuses).
        casts = None if torch.compiler.is_compiling() else layer.casts
        w_casts = call_casts(casts, weight.dtype)
        wq = quantizer.get(weight, need_transposed=grad, reuse=is_param and self._reuse_weights, casts=w_casts)
        if layer.format is Format.INT8:
            out = self._int8(layer, key, x2, weight, bias, wq, out_dtype, k, n)
        else:
            rowwise = layer.precision.scaling.granularity is Granularity.ROW
            expand = quantizer.row_scales
            # Row-wise scales: the kernel writes the region's half dtype where the installed torch
            # takes it (torch 2.11 on sm_90 with cuBLAS >= 12.9 runs FP16 in cuBLASLt), else BF16,
            # cast after the kernel (one more kernel, BF16 rounding); FP32 out is never row-wise.
            if rowwise or expand:
                kernel_dtype = out_dtype if out_dtype in layer.row_scale_outs else torch.bfloat16
            else:
                kernel_dtype = out_dtype
            # _scaled_mm fuses no bias into an FP32 output: there it is added after the kernel.
            fused = bias is not None and kernel_dtype != torch.float32
            kernel_bias = layer.kernel_bias(bias, kernel_dtype) if fused else None
            record = torch.is_grad_enabled()
            x_casts, g_casts = call_casts(casts, x2.dtype), call_casts(casts, kernel_dtype)
            with torch.no_grad():
                # A recomputed block's backward reads back the scale its forward chose: asking the
                # quantizer again would record this batch's amax into its history twice.
                x_inv, x_cast = self._input_scale(layer, key, x2, record, x_casts, grad)
            if casts is not None:
                layer.casts_ran = describe(weight=w_casts is not None, input=x_casts is not None, gradient=g_casts is not None)
            spec = Fp8Spec(layer.format, layer.grad, rowwise, kernel_dtype, expand, k, n, g_casts)
            out = Fp8Linear.apply(
                x2, weight, bias if fused else None, kernel_bias, x_inv,
                wq.data, wq.inv_scale, wq.transposed, wq.backward_inv_scale, spec, x_cast,
            )
            if out.dtype != out_dtype:
                out = out.to(out_dtype)
            if bias is not None and not fused:
                out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)

    @staticmethod
    def _input_scale(layer: _Layer, key: str, x2: torch.Tensor, record: bool, casts, transposed: bool):
        """``(x_inv, x_cast)``: the input's scale (recorded for, or replayed by, a recomputed
        block) and, with ``casts``, the input already cast by the fused kernels (in the same pass
        as the scale where they can: `InputQuantizer.fused_cast`), else None."""
        quantizer = layer.input_quantizer(key)
        if casts is None:
            return recorded_scale(layer.fqn, key, lambda: quantizer.inverse_scale(x2, record=record)), None
        made = []

        def scale():
            inv, cast = quantizer.fused_cast(x2, casts, FP8_ALIGN, record=record, transposed=transposed)
            made.append(cast)
            return inv

        x_inv = recorded_scale(layer.fqn, key, scale)
        if not made:  # a recomputation replayed the forward's scale: cast with it
            made.append(quantizer.fused_cast(x2, casts, FP8_ALIGN, transposed=transposed, inv=x_inv)[1])
        return x_inv, made[0]

    def _int8(self, layer, key, x2, weight, bias, wq, out_dtype, k, n):
        keep = index = valid = None
        if layer.precision.scaling.granularity is Granularity.ROW:
            with torch.no_grad():
                x_inv = layer.input_quantizer(key).inverse_scale(x2)
        else:
            def calibrated():
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

    def _run_low_precision(self, layer: _Layer, op: str, func, args, kwargs):
        gemm = as_gemm(op, func, args, kwargs)
        if gemm is None:
            return self._emulate(layer, op, func, args, kwargs, "no FP8/INT8 kernel for this op")
        if layer.kernel_reason is not None:
            return self._emulate(layer, op, func, args, kwargs)
        a, b, bias, beta, alpha, out_shape = gemm
        layer.note(op, self._kernel_name(layer))
        is_param = is_weight(b)
        if is_param:
            base = b if isinstance(b, nn.Parameter) else b._base
            # The layer's own parameters by identity first: Dynamo cannot take the id() of a view's
            # base (it has no source), and torch 2.11 then fails after the graph break.
            own = next((name for name, p in layer.module.named_parameters(recurse=False) if p is base), None)
            if own is not None:
                weight_key = f"{layer.fqn}.{own}" if layer.fqn else own
            else:  # another module's parameter (a tied weight)
                weight_key = self._param_names.get(id(base))
        else:
            weight_key = f"activation:{op}"  # its scaling state only: an activation is never kept
        out = self._linear(layer, a, b.t(), bias if beta == 1 else None, weight_key=weight_key, is_param=is_param)
        if alpha != 1:
            out = out * alpha
        if bias is not None and beta != 1:
            out = out + beta * bias
        return out.reshape(out_shape)

    def _emulate(self, layer: _Layer, op: str, func, args, kwargs, reason: "str | None" = None):
        """Run the op in FP32 on inputs rounded to the layer's format, saving them in that format."""
        reason = reason or layer.kernel_reason
        granularity = layer.precision.scaling.granularity
        layer.note(op, f"emulated ({reason}): {layer.format.value} storage, FP32 compute, current {granularity.value} scaling")
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
        tensors = [leaves[i] for i in tensor_at]
        weights = tuple(is_weight(t) for t in tensors)
        out_dtype = self._out_dtype(next((t for t in tensors if t.is_floating_point()), tensors[0]))

        def fn(*values):
            filled = list(leaves)
            for i, v in zip(tensor_at, values):
                filled[i] = v
            call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
            return func(*call_args, **call_kwargs)

        # Weights: per output channel (dim 0) for INT8 and ROW, 128x128 tiles for BLOCK;
        # activations: 1x128 tiles for BLOCK, per row for ROW; else one scale (see the quantizers).
        inputs, weight = layer.emulation_quantizers()
        quantizers = tuple(weight if w else inputs for w in weights)
        out = StoredInFormat.apply(fn, quantizers, layer.grad, weights, *tensors)
        return out.to(out_dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    # -- state and report ---------------------------------------------------------------------

    def report(self) -> dict[str, dict]:
        """Per layer: planned format, how each op ran (kernel / emulated and why), calibration;
        for FP8 kernel layers ``"casts"``: what their last eager call quantized with, "fused
        Triton cast", "PyTorch ops" or which operands took which (`casts.describe`; compiled calls
        run PyTorch ops, which Inductor fuses).

        Reading INT8 calibration figures syncs once per calibrated input.
        """
        out = {}
        for fqn, layer in self._layers.items():
            entry: dict[str, Any] = {"format": layer.format.value, "ops": dict(layer.ops)}
            if layer.format.is_fp8 and layer.kernel_reason is None:
                entry["casts"] = layer.casts_ran
            calibration = [c.report for c in layer.calibrators.values() if c.report]
            if calibration:
                entry["calibration"] = calibration
            out[fqn] = entry
        return out

    def use_fused_casts(self, enabled: bool = True) -> None:
        """Whether FP8 kernel layers quantize with the fused Triton kernels where the device has
        them (the default) or with PyTorch ops (``False``: the same bytes, more kernels; for
        comparisons and debugging). Takes effect from the next forward."""
        for layer in self._layers.values():
            if layer.format.is_fp8 and layer.kernel_reason is None:
                layer.casts = fused_casts(layer.device) if enabled else None
                layer.casts_ran = FUSED if layer.casts is not None else PYTORCH

    def emulated_layers(self) -> dict[str, list[str]]:
        """``fqn -> [op, ...]`` for every layer that ran an op without a real kernel."""
        return {
            fqn: sorted(op for op, how in layer.ops.items() if how.startswith("emulated"))
            for fqn, layer in self._layers.items()
            if any(how.startswith("emulated") for how in layer.ops.values())
        }

    def recalibrate(self, fqns=None) -> None:
        """Forget INT8 calibration, amax histories and kept weight copies of the named layers (default: all)."""
        for fqn in fqns if fqns is not None else self._layers:
            layer = self._layers[fqn]
            for calibrator in layer.calibrators.values():
                calibrator.recalibrate()
            for input_quantizer in layer.inputs.values():
                input_quantizer.reset()
            for weight_quantizer in layer.weights.values():
                weight_quantizer.clear()

    def state_dict(self) -> dict:
        """Per layer, the input quantizers' histories and INT8 calibrations, keyed by weight name."""
        layers = {}
        for fqn, layer in self._layers.items():
            if layer.inputs or layer.calibrators:
                layers[fqn] = {
                    "inputs": {key: q.state_dict() for key, q in layer.inputs.items()},
                    "calibrators": {key: c.state_dict() for key, c in layer.calibrators.items()},
                }
        return {"layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`; tensors move to the data's device on first use (any map_location).

        Refused with one `RuntimeStateError` line naming the field: before anything changes, a
        state that is not the dict `state_dict` returned (empty, a path, ``layers`` not a dict of
        layers each with ``inputs`` and ``calibrators`` dicts), one naming a layer this plan
        lacks, or one holding a tensor whose shape does not fit its layer (an amax history of
        another ``history_len``, an INT8 calibration of another input-channel count or outlier
        slots), named with the saved and the expected shape. Reads shapes only: no host sync."""
        _check_runtime_state(state)
        unknown = sorted(set(state["layers"]) - set(self._layers))
        if unknown:
            raise RuntimeStateError(f"runtime state names layers this plan lacks: {unknown}")
        # Every tensor checked against its layer before anything is restored: a refused state
        # leaves the runtime as it was.
        params = dict(self.model.named_parameters())
        channels: dict[tuple[str, str], int] = {}
        for fqn, saved in state["layers"].items():
            layer = self._layers[fqn]
            for key, q_state in saved["inputs"].items():
                quantizer = layer.inputs.get(key) or InputQuantizer(layer.format, layer.precision.scaling)
                self._refuse_state(layer, "inputs", key, quantizer.state_problem(q_state))
            for key, c_state in saved["calibrators"].items():
                allowed = self._calibrator_channels(layer, key, params)
                self._refuse_state(layer, "calibrators", key, Int8Calibrator.state_problem(c_state, layer.precision.calibration, allowed))
                shown = [c_state[n] for n in ("channel_amax", "keep") if c_state[n] is not None] + list(c_state["samples"])
                if shown or key in layer.calibrators:  # else nothing observed: the next forward makes it
                    channels[fqn, key] = shown[0].shape[-1] if shown else layer.calibrators[key].channels
        for fqn, saved in state["layers"].items():
            layer = self._layers[fqn]
            for key, q_state in saved["inputs"].items():
                layer.input_quantizer(key).load_state_dict(q_state)
            for key, c_state in saved["calibrators"].items():
                if (fqn, key) in channels:
                    layer.calibrator(key, channels[fqn, key]).load_state_dict(c_state)

    def _calibrator_channels(self, layer: _Layer, key: str, params: Mapping[str, torch.Tensor]) -> "tuple[int, ...] | None":
        """The input channels (K) an INT8 calibrator ``key`` of ``layer`` may count: its own when it
        exists; for a parameter's product (``key`` names it) the parameter's K, by the op the layer
        runs it with (F.linear takes (N, K), matmul / mm / addmm (K, N)); None for an activation's
        product before a forward showed its K."""
        existing = layer.calibrators.get(key)
        if existing is not None:
            return (existing.channels,)
        param = params.get(key)
        if param is None or param.dim() != 2:
            return None
        info = self.plan.fingerprint.get(layer.fqn)
        ops = set(info.ops) if info is not None else ({"linear"} if isinstance(layer.module, nn.Linear) else {"linear", "matmul"})
        allowed = ({param.shape[1]} if "linear" in ops else set()) | ({param.shape[0]} if ops & {"matmul", "mm", "addmm"} else set())
        return tuple(sorted(allowed)) or None

    @staticmethod
    def _refuse_state(layer: _Layer, field: str, key: str, problem: "str | None") -> None:
        if problem is not None:
            fqn = layer.fqn
            raise RuntimeStateError(
                f"PlanRuntime.load_state_dict(): layer {layer_name(fqn, layer.module)!r} does not match this plan: "
                f"state['layers'][{fqn!r}][{field!r}][{key!r}]{problem}; "
                f"{_STATE_FIX} for this plan and model"
            )


def _check_arguments(model: Any, plan: Any) -> None:
    """`RuntimeStateError` naming the argument when ``model`` is not a module or ``plan`` not a
    `Plan` (a path, a dict, None), with the call that makes the right object."""
    if not isinstance(model, nn.Module):
        fix = " (load the model first: torch.load, or build it)" if isinstance(model, (str, os.PathLike)) else ""
        shown = repr(model) if model is None or isinstance(model, (str, os.PathLike)) else type(model).__name__
        raise RuntimeStateError(f"apply_plan(model={shown}): expected the torch.nn.Module to run the plan on{fix}")
    if not isinstance(plan, Plan):
        if isinstance(plan, (str, os.PathLike)):
            fix = f"load the file first: apply_plan(model, Plan.load({str(plan)!r}))"
        elif isinstance(plan, dict):
            fix = "make one from the dict with Plan.from_dict(...)"
        else:
            fix = "make one with Plan.uniform(model, 'bf16'), Plan.load(path) or autoprec.search"
        raise RuntimeStateError(f"apply_plan(plan={type(plan).__name__}): expected an autoprec.Plan; {fix}")
    if any(p.is_meta for p in model.parameters()):
        # The runtime's device (autocast, kernels, state) is the parameters': meta has none.
        raise RuntimeStateError(
            f"apply_plan(model={type(model).__name__}): its parameters are on the meta device; materialise it first "
            "(model.to_empty(device=...) and initialise the weights), then apply the plan"
        )


_STATE_FIX = "pass the dict PlanRuntime.state_dict() returned"


def _check_runtime_state(state: Any) -> None:
    """`RuntimeStateError` naming the field when ``state`` does not have `state_dict`'s shape."""
    if not isinstance(state, Mapping):
        raise RuntimeStateError(f"PlanRuntime.load_state_dict({type(state).__name__}): expected a dict; {_STATE_FIX} (torch.load a saved one first)")
    if not isinstance(state.get("layers"), Mapping):
        what = "lacks 'layers'" if "layers" not in state else f"has 'layers' of type {type(state['layers']).__name__}, not a dict"
        raise RuntimeStateError(f"PlanRuntime.load_state_dict(): the state {what}; {_STATE_FIX}")
    for fqn, saved in state["layers"].items():
        for field in ("inputs", "calibrators"):
            if not isinstance(saved, Mapping) or not isinstance(saved.get(field), Mapping):
                raise RuntimeStateError(f"PlanRuntime.load_state_dict(): state['layers'][{fqn!r}] needs {field!r} as a dict; {_STATE_FIX}")
            for key, entry in saved[field].items():
                if not isinstance(entry, Mapping):
                    raise RuntimeStateError(f"PlanRuntime.load_state_dict(): state['layers'][{fqn!r}][{field!r}][{key!r}] is a {type(entry).__name__}, not a dict; {_STATE_FIX}")


@contextlib.contextmanager
def removing(runtimes):
    """Takes the wrappers of ``runtimes`` (an iterable of `PlanRuntime`, None entries skipped)
    off their model when the block ends: for runtimes made for one measurement, so the user's
    model is left as it was."""
    try:
        yield
    finally:
        for runtime in runtimes:
            if runtime is not None:
                runtime.remove()


def apply_plan(model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None) -> PlanRuntime:
    """A `PlanRuntime` for ``model``: ``with apply_plan(model, plan): ...``.

    Keep the returned runtime and re-enter it every step so amax histories and INT8 calibration
    carry over; a fresh ``apply_plan`` starts them anew (and displaces this one's layer wrappers
    until this one is entered again; `PlanRuntime.remove` takes them off). Validation
    (``plan.validate``) runs once here and raises `PlanError` naming every problem.
    """
    return PlanRuntime(model, plan, validate=validate, example_inputs=example_inputs)
