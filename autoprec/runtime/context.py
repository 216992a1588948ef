"""`PlanRuntime`: makes a `Plan` real in forward and backward, holds the runtime state, reports.

How a plan runs (``with runtime:``), cheapest first:

- An all-FP32 plan changes nothing: no wrapper, no mode, no autocast (the plain model's ops).
- Otherwise the region runs under ``torch.autocast`` in the plan's half dtype, so everything
  between layers behaves exactly as under plain autocast (same ops, same FP32 policy). A uniform
  BF16 plan of ordinary layers is exactly ``torch.autocast(dtype=torch.bfloat16)``: no per-layer
  machinery at all.
- Layers that need more get a forward wrapper (`layer_wrappers`), installed once per runtime; entering
  the context only flips a flag of the calling thread, so a compiled step can enter it
  (`PlanRuntime.region`) with no graph break.
- FP8 / INT8 products run through the kernels or, where none exists, emulation (`products`); a
  planned layer's state is `layers.RuntimeLayer`.

Backward needs no context (``loss.backward()`` may run after the ``with`` block). Costs per step
of an FP8 / INT8 linear layer: one amax and one cast per input, weight and output gradient, three
GEMMs (`gemm`, `quantizers`), no host sync; eager FP8 on CUDA with Triton runs the casts as fused
kernels, three launches per operand (`casts`, `triton_cast`). Runtime state (amax histories,
INT8 calibration) survives exits and re-entries; ``state_dict()`` / ``load_state_dict()`` save
and restore it.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from ..coverage import layer_name
from ..errors import RuntimeStateError
from ..formats import Format
from ..plan import Plan
from . import pipelining
from .calibration import Int8Calibrator
from .layers import EmulationWarning, RuntimeLayer, as_gemm, kernel_reason
from .model_index import ModelIndex
from .products import PerThread, Products
from .quantizers import OperandRole, quantizer
from .layer_wrappers import LayerWrappers

__all__ = ["PlanRuntime", "apply_plan", "removing", "EmulationWarning", "kernel_reason", "as_gemm"]


# Set in a planned module's __dict__ while a runtime is active on it (eager entries), so a second
# runtime on the same layers is refused: two plans on one layer would fight over its dtypes. A weak
# reference, so that a deep copy of the model made meanwhile copies no runtime, and its stale
# mark counts only while that runtime stays active.
_ACTIVE_MARK = "_autoprec_active_runtime"


def _active_runtime(module: nn.Module) -> "PlanRuntime | None":
    mark = module.__dict__.get(_ACTIVE_MARK)
    runtime = mark() if mark is not None else None
    return runtime if runtime is not None and runtime._active else None


class PlanRuntime:
    """Applies ``plan`` to ``model`` inside ``with runtime:``; reusable, not re-entrant.

    Use `apply_plan` to make one. Parameters, their dtypes and ``state_dict()`` are never touched:
    weights stay FP32 masters and receive FP32 gradients. The plan is thread-local, as
    ``torch.autocast`` is: it applies to the thread that entered the context only. Any write to
    a weight is seen by the next forward (weights are quantized per forward, see
    `reusing_weights`). The layer wrappers stay on the model between steps: `remove` them before
    ``torch.save(model)`` (a wrapper does not pickle; ``copy.deepcopy`` works).
    """

    def __init__(self, model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None, index: "ModelIndex | None" = None):
        _check_arguments(model, plan)
        index = index if index is not None else ModelIndex.of(model)
        _check_materialised(model, index)
        if validate:
            plan.validate(model, example_inputs)
        self.model = model
        self.plan = plan
        self.device = index.device
        self.device_type = self.device.type
        self._layers = {fqn: RuntimeLayer(fqn, index.modules[fqn], lp, self.device) for fqn, lp in plan.layers.items()}
        # A pipeline stage's part of a plan runs the model's own ops as the whole plan does.
        formats = set(plan.whole_formats)
        # Whether the plan needs the runtime's forwards: a format other than FP32, or FP32 layers
        # whose weights are stored in a half dtype (they compute in FP32, the weight cast up).
        self.low_precision = formats != {Format.FP32} or any(layer.stored_dtype is not None for layer in self._layers.values())
        self.region_dtype = _region_dtype(formats, {layer.stored_dtype for layer in self._layers.values()} - {None})
        # INT8 (and FP8 FP32-gradient) backward runs in BF16 on CUDA and FP32 on CPU, where BF16
        # matrix units are not a given.
        self.backward_dtype = torch.bfloat16 if self.device_type == "cuda" else torch.float32
        self._threads = PerThread()
        self._active = False  # entered by some thread (a runtime is not re-entrant)
        self._entered: "contextlib.AbstractContextManager[PlanRuntime] | None" = None  # the region() ``with runtime:`` entered
        # How its layers' products run, and the forwards that route them (installed once).
        self._products = Products(self.device_type, self.backward_dtype, index.param_names)
        self._wrappers = LayerWrappers(self, index, plan, self._layers, self._threads, self._products, self.region_dtype, self.low_precision)
        if not any(_active_runtime(layer.module) is not None for layer in self._layers.values()):
            self._wrappers.install()  # else on entry, once the active runtime has left

    # -- installation and context -------------------------------------------------------------

    def remove(self) -> None:
        """Take this runtime's wrappers off the model, restoring each module's ``__dict__`` as it
        was (a forward the user had set on an instance included). Call it before pickling the
        model (``torch.save(model)``); entering the runtime again re-installs them."""
        if self._active:
            raise RuntimeStateError("exit this plan runtime before removing it")
        self._wrappers.remove()

    def tolerate_failures(self, on: bool = True) -> None:
        """Whether a lowered layer whose forward raises runs again in FP32 instead (recorded for
        `take_failures`), so the step goes on: for a search's probe and trial runtimes, which
        run formats on a training step before anything showed that the model's code runs in
        them. Off by default (the error stands); turning it off forgets the records."""
        self._wrappers.failures = {} if on else None

    def take_failures(self) -> dict[str, str]:
        """fqn -> the first line of what its forward raised, for each layer run again in FP32
        since the last call (`tolerate_failures`); empty when none was."""
        failures = self._wrappers.failures
        if not failures:
            return {}
        self._wrappers.failures = {}
        return failures

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
        if not self._wrappers.installed():
            self._wrappers.install()  # another runtime displaced this one's wrappers since
        if not torch.compiler.is_compiling():
            self._wrappers.watch_stages()  # a pipeline stage's metadata inference changes no state
        state = self._threads.state
        state.active, state.training = True, torch.is_grad_enabled()
        self._active = True
        try:
            if self.low_precision:
                with torch.autocast(self.device_type, dtype=self.region_dtype):
                    yield self
            else:
                yield self
        finally:
            state.active = state.training = False
            state.stack = ()
            self._active = False
            if not torch.compiler.is_compiling():
                pipelining.leave()
                for layer in self._layers.values():
                    layer.module.__dict__.pop(_ACTIVE_MARK, None)

    @property
    def active(self) -> bool:
        return self._active

    @property
    def calibrating(self) -> bool:
        """Whether an INT8 layer is still calibrating (its first `Calibration.batches` forwards,
        each quantized with its own range, then frozen); a layer before its first forward has no
        calibrator yet and does not count. Host state only: no sync."""
        return any(c.calibrating for layer in self._layers.values() for c in layer.calibrators.values())

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
        if self._products.reuse_weights:
            raise RuntimeStateError("reusing_weights() is already open on this runtime; it does not nest")
        self._products.reuse_weights = True
        try:
            yield self
        finally:
            self._products.reuse_weights = False
            for layer in self._layers.values():
                for quantizer in layer.weights.values():
                    quantizer.clear()

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
        them (the default) or with PyTorch ops. Takes effect from the next forward.

        Args:
            enabled: True: the fused kernels where the device has them; False: PyTorch ops (the
                same bytes, more kernels; for comparisons and debugging). Layers that are not
                FP8 kernel layers have no casts to switch.
        """
        for layer in self._layers.values():
            layer.use_fused_casts(enabled)

    def emulated_layers(self) -> dict[str, list[str]]:
        """``fqn -> [op, ...]`` for every layer that ran an op without a real kernel."""
        return {
            fqn: sorted(op for op, how in layer.ops.items() if how.startswith("emulated"))
            for fqn, layer in self._layers.items()
            if any(how.startswith("emulated") for how in layer.ops.values())
        }

    def saturation(self, steps: int = 1) -> dict[str, torch.Tensor]:
        """Per layer whose inputs are scaled from the past, how far past that scale's range they
        went: the ratio of an input's amax to the amax its scale covers (a 0-d tensor; inf / NaN
        after a non-finite input): a frozen INT8 calibration's last input, delayed FP8 scaling's
        largest over the last ``steps`` recorded forwards (its history holds them). Layers scaled
        from the current tensor never saturate and are absent, as are those not run yet.
        Costs nothing in the forwards (the amaxes are the quantizers' own); here a few small
        kernels per layer, no host sync.

        Args:
            steps: how many of the last recorded forwards delayed scaling's ratio covers (at
                least 1; capped by the amax history's length). INT8 calibration always reports
                its last input.

        Returns:
            ``fqn -> ratio``: a 0-d tensor on the layer's device, above 1 when an input went past
            its scale's range; for a layer with several scaled inputs, the largest.
        """
        out = {}
        for fqn, layer in self._layers.items():
            ratios = [r for r in (*(c.saturation() for c in layer.calibrators.values()), *(q.saturation(steps) for q in layer.inputs.values()))
                      if r is not None]
            if ratios:
                out[fqn] = torch.stack(ratios).amax() if len(ratios) > 1 else ratios[0]
        return out

    def recalibrate(self, fqns: "Iterable[str] | str | None" = None) -> None:
        """Forget INT8 calibration, amax histories and kept weight copies of the named layers:
        each calibrates again, and its histories refill, from its next forwards.

        Args:
            fqns: layer fqns of this plan, or one fqn; None: every layer.

        Raises:
            RuntimeStateError: an fqn this plan does not hold (nothing is forgotten then).
        """
        names = (fqns,) if isinstance(fqns, str) else tuple(self._layers if fqns is None else fqns)
        unknown = [fqn for fqn in names if fqn not in self._layers]
        if unknown:
            raise RuntimeStateError(f"recalibrate({unknown[0]!r}): not a layer of this runtime's plan ({len(self._layers)} layers, "
                                    f"e.g. {next(iter(self._layers), '')!r}); name layers by their fqn in the plan")
        for fqn in names:
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
        Reads shapes only: no host sync.

        Args:
            state: what `state_dict` returned (from ``torch.load`` with any ``map_location``),
                for a runtime of this plan and model.

        Raises:
            RuntimeStateError: one line naming the field, before anything changes: a state that
                is not the dict `state_dict` returned (empty, a path, ``layers`` not a dict of
                layers each with ``inputs`` and ``calibrators`` dicts), one naming a layer this
                plan lacks, or one holding a tensor whose shape does not fit its layer (an amax
                history of another ``history_len``, an INT8 calibration of another
                input-channel count or outlier slots), named with the saved and the expected
                shape.
        """
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
                made = layer.inputs.get(key) or quantizer(OperandRole.INPUT, layer.format, layer.precision.scaling)
                self._refuse_state(layer, "inputs", key, made.state_problem(q_state))
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

    def _calibrator_channels(self, layer: RuntimeLayer, key: str, params: Mapping[str, torch.Tensor]) -> "tuple[int, ...] | None":
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
    def _refuse_state(layer: RuntimeLayer, field: str, key: str, problem: "str | None") -> None:
        if problem is not None:
            fqn = layer.fqn
            raise RuntimeStateError(
                f"PlanRuntime.load_state_dict(): layer {layer_name(fqn, layer.module)!r} does not match this plan: "
                f"state['layers'][{fqn!r}][{field!r}][{key!r}]{problem}; "
                f"{_STATE_FIX} for this plan and model"
            )


def _region_dtype(formats: set, stored: set) -> torch.dtype:
    """The half dtype tensors carry between layers (the region's autocast), from the plan's
    formats and the half dtypes its layers' weights are stored in (``stored``).

    Weights stored in one half dtype (``model.half()``, a model loaded with
    ``torch_dtype=torch.bfloat16``) set it, whatever the plan's formats: the model's own ops
    between planned layers (a norm whose weight is FP16 refuses a BF16 input on CPU) and its
    outputs keep that dtype, as the plain model's do; a half layer of the other dtype computes
    in its own and hands the region's on (`layer_wrappers`). Otherwise FP16 only for a plan whose half
    layers are all FP16 (mixing FP16 activations into BF16 layers would lose range), else BF16."""
    if len(stored) == 1:
        return next(iter(stored))
    return torch.float16 if (Format.FP16 in formats and Format.BF16 not in formats) else torch.bfloat16


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


def _check_materialised(model: nn.Module, index: ModelIndex) -> None:
    if index.on_meta:
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


def apply_plan(model: nn.Module, plan: Plan, *, validate: bool = True, example_inputs: Any = None, index: "ModelIndex | None" = None) -> PlanRuntime:
    """A `PlanRuntime` for ``model``: ``with apply_plan(model, plan): ...``.

    Keep the returned runtime and re-enter it every step so amax histories and INT8 calibration
    carry over; a fresh ``apply_plan`` starts them anew (and displaces this one's layer wrappers
    until this one is entered again; `PlanRuntime.remove` takes them off). Validation
    (``plan.validate``) runs once here and raises `PlanError` naming every problem.
    ``index``: the model's `ModelIndex`, for many runtimes on one unchanged model (each then
    costs O(its plan's layers), not a walk over the model); made here when None.

    Args:
        model: the model to run the plan on (materialised, not on the meta device).
        plan: the plan; its layers are the model's fully qualified module names.
        validate: check the plan against the model and its device first (``plan.validate``).
        example_inputs: one forward's inputs, for the validation to trace (None: checked against
            the module tree and the plan's fingerprint).
        index: the model's `ModelIndex` (None: walked here).

    Returns:
        The runtime; enter it around each forward (``with runtime:``).

    Raises:
        PlanError: the plan does not fit the model or the device, naming every problem.
        RuntimeStateError: ``model`` is not a module or is on the meta device, or ``plan`` is
            not a `Plan` (a path, a dict).
    """
    return PlanRuntime(model, plan, validate=validate, example_inputs=example_inputs, index=index)
