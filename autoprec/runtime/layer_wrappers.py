"""The layer wrappers: the forward a runtime installs on each planned layer that needs one.

A layer gets a wrapper only where the region's autocast is not already what it needs: FP32
layers (autocast off, FP32 inputs), half layers in the other half dtype, FP8 / INT8 layers, and
every planned layer below a wrapped one (so the innermost planned layer always decides).
Wrappers are built once per runtime (one ``forward`` attribute per layer) and stay until
`LayerWrappers.remove`; entering the runtime only flips a flag of the calling thread, so a
compiled step can enter it with no graph break. Outside the runtime, in any other thread and in
a deep copy of the model, a wrapper calls the module's own forward: the plain model's ops exactly.
FP8 / INT8 ``nn.Linear`` layers call the kernels directly; other FP8 / INT8 layers (a
projection calling ``addmm`` on a transposed weight, ``x @ w.t()``, convolutions, attention) run
their forward under the `products.LayerMode`.

Costs: per wrapped layer and forward, a few Python attribute reads; a layer under a mode pushes
itself on the thread's stack (a tuple replaced, never mutated).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..coverage import enclosing_layer
from ..errors import first_line
from ..formats import Format
from ..plan import Plan
from . import pipelining
from .layers import NEVER_AUTOCAST, RuntimeLayer, map_leaves, to_fp32, to_half
from .model_index import ModelIndex
from .products import LayerMode, PerThread, Products, ThreadState
from .recompute import BlockHost, Recording, block_wrapper, users_record
from .installed import displaced, mark, previous_of

# How many times any runtime installed or removed wrappers in this process (`installed`).
_wrapper_changes = [0]

__all__ = ["LayerWrappers"]

# Ops autocast leaves uncast: they fail on mixed dtypes inside a half layer (CPU's), or run in the
# FP32 weights' dtype (`layers.NEVER_AUTOCAST`), so a layer that runs one gets the layer mode,
# which gives them the layer's dtype.
_AUTOCAST_UNCAST = {"cpu": frozenset({"mv", "addmv", "bilinear"})}


_HALVES = frozenset({torch.float16, torch.bfloat16})


def _leaving(out: Any, to: "torch.dtype | None", sources: frozenset) -> Any:
    """A layer's outputs as its caller computes with them: its floating tensors of a dtype in
    ``sources`` cast to ``to`` (nothing when ``to`` is None). One cast kernel per such tensor."""
    if to is None or not sources:
        return out
    return map_leaves(lambda t: t.to(to) if torch.is_tensor(t) and t.dtype in sources and t.dtype != to else t, out)


def _own_forward(module: nn.Module, had_own: bool, previous: Any, m: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``m``'s forward without the plan: the user's instance forward (``previous``), if ``module``
    had one and ``m`` is it, else its class's. ``type(m).forward(m, ...)``, not a method bound
    with ``__get__``: torch 2.11's Dynamo cannot trace ``function.__get__`` (a graph break)."""
    if had_own and m is module:
        return previous(*args, **kwargs)
    return type(m).forward(m, *args, **kwargs)


def _entering(fmt: Format, device_type: str, half_stored: "torch.dtype | None", caller: "torch.dtype | None", to_caller: frozenset,
              args: tuple, kwargs: dict) -> tuple:
    """``(scope, args, kwargs, leave_to, leaving)``: the autocast scope a layer of ``fmt`` (not a
    direct kernel call) runs its own forward in, its inputs as they enter it, and the dtype and
    source dtypes `_leaving` casts its outputs with. At most one cast kernel per input tensor."""
    leave_to, leaving = caller, to_caller
    if fmt is Format.FP32:
        if half_stored is not None and caller is None:
            leave_to = half_stored  # autocast off around it: the dtype the layers around it hand on
        args, kwargs = map_leaves(to_fp32, (args, kwargs))
        return torch.autocast(device_type, enabled=False), args, kwargs, leave_to, leaving
    if fmt in (Format.BF16, Format.FP16):
        # Under the other half dtype's autocast its inputs enter in this one, and its outputs
        # leave in the caller's; under no autocast (an FP32 parent), inputs enter in this dtype
        # and mixed dtypes simply promote there: outputs stay as they are.
        autocast_on = torch.is_autocast_enabled(device_type)
        outer_dtype = torch.get_autocast_dtype(device_type) if autocast_on else None
        if outer_dtype is not None and outer_dtype != fmt.dtype:
            leave_to, leaving = outer_dtype, _HALVES
        if leave_to is not None or not autocast_on:
            args, kwargs = to_half((args, kwargs), fmt.dtype)
        return torch.autocast(device_type, dtype=fmt.dtype), args, kwargs, leave_to, leaving
    return contextlib.nullcontext(), args, kwargs, leave_to, leaving


class LayerWrappers:
    """The forwards ``owner`` (a `PlanRuntime`) installs on its layers and recomputed blocks of the
    model ``index`` describes: built once here, put on by `install`, taken off by `remove`. ``region_dtype``: the
    half dtype the region's autocast runs in; ``low_precision``: whether any layer is not FP32
    (an all-FP32 plan installs nothing)."""

    def __init__(self, owner: Any, index: ModelIndex, plan: Plan, layers: Mapping[str, RuntimeLayer], threads: PerThread,
                 products: Products, region_dtype: torch.dtype, low_precision: bool):
        self.owner, self.plan, self.layers, self.threads, self.products = owner, plan, layers, threads, products
        self.device_type = products.device_type
        self.region_dtype = region_dtype
        # Whether the plan hands on two half dtypes (FP16 and BF16 layers, or half-stored weights of
        # the other half dtype than the region's): only then must outputs be cast on leaving.
        handed_on = {layer.format.dtype for layer in layers.values() if layer.format in (Format.BF16, Format.FP16)}
        handed_on |= {layer.stored_dtype for layer in layers.values() if layer.stored_dtype is not None}
        if low_precision:
            handed_on.add(region_dtype)
        self.mixed_halves = len(handed_on) > 1
        # What recomputation needs of this runtime: its planned blocks and the user's own
        # checkpoints (`recompute`) recompute under the plan.
        self.forwards: dict[str, Any] = {}
        host = BlockHost(owner, threads, self.installed, self.layer_mode, layers, self.forwards)
        if low_precision:
            self.forwards.update(self._build(host))
        # Recomputed blocks: checkpointed while the plan is on; installed after the layers'
        # wrappers, taken off with them.
        modules = index.modules
        self.blocks = {fqn: (modules[fqn], block_wrapper(host, fqn, modules[fqn])) for fqn in plan.recompute}
        # The model's pre-hook telling a pipelining stage's metadata inference from training
        # (`pipelining`): registered once torch.distributed.pipelining is imported (`watch_stages`).
        self.root = modules[""]
        self.stage_hook: "RemovableHandle | None" = None
        self._checked_at = -1  # the `_wrapper_changes` count when `installed` last found every wrapper on
        # fqn -> the first line of what its forward raised in its format, once `rerun_in_fp32` ran it
        # in FP32 instead; None: a raising layer raises (`PlanRuntime.tolerate_failures`).
        self.failures: "dict[str, str] | None" = None

    def _needs_mode(self, layer: RuntimeLayer, planned_below: bool) -> bool:
        if layer.format is Format.FP32:
            # Weights stored in a half dtype (a model loaded in BF16, a LoRA's frozen base): the
            # mode casts every operand of its products to FP32, the weight included.
            return planned_below or layer.stored_dtype is not None
        if layer.low_precision:
            # Only an unpatched nn.Linear forward is known to be exactly F.linear(x, weight, bias).
            # Another runtime's wrapper is looked through: which runtimes a model holds must not
            # change how a layer runs (a plan adopted on rank 0 with its trial's runtime, and made
            # afresh on the others over the trials' wrappers, took two paths, and under FSDP2 x TP
            # two different collectives: the weight's amax all-reduce on one, none on the other).
            plain_linear = type(layer.module).forward is nn.Linear.forward and not displaced(layer.module)[0]
            return not plain_linear or layer.kernel_reason is not None
        ops = set(self.plan.fingerprint[layer.fqn].ops) if layer.fqn in self.plan.fingerprint else set()
        return bool(ops & (_AUTOCAST_UNCAST.get(self.device_type, frozenset()) | NEVER_AUTOCAST)) or not ops

    def _build(self, host: BlockHost) -> dict[str, Any]:
        """fqn -> the forward to install for every layer that needs one (see the module docstring).

        Linear in the number of layers (times their nesting depth): each layer's planned parent
        is found by its dotted prefixes, and what lies below or above it is carried along that
        parent chain, never by scanning every other layer."""
        layers = self.layers
        parent = {fqn: enclosing_layer(fqn, layers) for fqn in layers}
        # Layers with a planned layer below that hands them other dtypes: a lowered one, or an FP32
        # one on half-stored weights. Marked up each such layer's parent chain, once per layer.
        lowered_below: set[str] = set()
        for fqn, layer in layers.items():
            if layer.format is not Format.FP32 or layer.stored_dtype is not None:
                up = parent[fqn]
                while up is not None and up not in lowered_below:
                    lowered_below.add(up)
                    up = parent[up]
        wrappers: dict[str, Any] = {}
        wrapped_above: dict[str, bool] = {}  # a planned ancestor has a wrapper
        mode_above: dict[str, bool] = {}  # a planned ancestor runs under the mode
        with_mode: set[str] = set()
        for fqn in sorted(layers, key=lambda f: (f.count(".") if f else -1)):  # parents first
            layer, up = layers[fqn], parent[fqn]
            wrapped_above[fqn] = up is not None and (up in wrappers or wrapped_above[up])
            mode_above[fqn] = up is not None and (up in with_mode or mode_above[up])
            mode = self._needs_mode(layer, fqn in lowered_below)
            if mode:
                with_mode.add(fqn)
            own_scope = mode or layer.format is Format.FP32 or layer.low_precision or layer.format.dtype != self.region_dtype or wrapped_above[fqn]
            if own_scope:
                # The layer stack is read only by the mode: a layer under no mode need not push itself.
                parent_format = layers[up].format if up is not None else None
                wrappers[fqn] = self._wrapper(host, layer, mode, stacked=mode or mode_above[fqn], parent_format=parent_format)
        return wrappers

    def _wrapper(self, host: BlockHost, layer: RuntimeLayer, mode: bool, stacked: bool, parent_format: "Format | None"):
        """The forward installed on ``layer.module``: the plan's in a thread that entered this
        runtime, the module's own everywhere else (other threads, outside the context, a copy).
        ``stacked``: the layer runs under the mode (its own or an ancestor's), which reads the
        running layer from the thread's stack; otherwise its forward changes no thread state.
        ``parent_format``: the format of the planned layer holding this one (None: the region).
        Outputs leave in the dtype their caller computes in (`_caller_dtypes`)."""
        module, fmt, device_type, threads, products, fqn = layer.module, layer.format, self.device_type, self.threads, self.products, layer.fqn
        had_own, previous = displaced(module)

        def own(*a, **k):  # the module's own forward on this module, as `rerun_in_fp32` runs it
            return _own_forward(module, had_own, previous, module, a, k)

        direct_linear = layer.low_precision and not mode
        half_stored = layer.stored_dtype  # what the rest of a model loaded in BF16 expects between layers
        to_caller = self._caller_dtypes(layer, parent_format)
        # Whether its forward changes thread state, which Dynamo cannot trace inside a recomputed
        # block (see recompute.compile_refusal).
        layer.keeps_thread_state = stacked
        layer.direct = direct_linear
        if direct_linear:
            layer.ops = {"linear": products.kernel_name(layer)}
        elif fmt in (Format.BF16, Format.FP16):
            layer.ops = {"*": f"torch.autocast({device_type!r}, {fmt.dtype})"}
        wrappers = self

        def forward(self_module, *args, **kwargs):
            state = threads.state
            if not state.active or self_module is not module:
                # A deep copy of the model carries this method re-bound to the copy: it runs the
                # copy's own forward, never this module's weights.
                return _own_forward(module, had_own, previous, self_module, args, kwargs)
            users = users_record(host, fqn)
            if users is not None:
                # Inside the user's own torch.utils.checkpoint: record the scales for its
                # recomputation (which then finds a record set, and comes back here no more).
                with Recording(users):
                    return forward(self_module, *args, **kwargs)
            caller = torch.get_autocast_dtype(device_type) if to_caller and torch.is_autocast_enabled(device_type) else None
            if direct_linear:
                x = args[0] if args else kwargs["input"]
                if not state.mode_active:
                    return _leaving(products.linear(layer, x, module.weight, module.bias), caller, to_caller)
                # An ancestor's mode runs: on the stack, this layer's own kernel ops (an INT8
                # layer's outlier addmm) pass through it rather than being routed as the ancestor's.
                outer = state.stack
                state.stack = outer + (layer,)
                try:
                    return _leaving(products.linear(layer, x, module.weight, module.bias), caller, to_caller)
                finally:
                    state.stack = outer
            given = (args, kwargs)
            scope, args, kwargs, leave_to, leaving = _entering(fmt, device_type, half_stored, caller, to_caller, args, kwargs)
            if not stacked:
                try:
                    with scope:
                        out = _own_forward(module, had_own, previous, module, args, kwargs)
                except RuntimeError as error:
                    return wrappers.rerun_in_fp32(error, layer, state, own, given, caller, parent_format)
                return _leaving(out, leave_to, leaving)
            enter_mode = mode and not state.mode_active
            outer = state.stack
            state.stack = outer + (layer,)
            try:
                with scope, (wrappers.layer_mode(state) if enter_mode else contextlib.nullcontext()):
                    out = _own_forward(module, had_own, previous, module, args, kwargs)
            except RuntimeError as error:
                return wrappers.rerun_in_fp32(error, layer, state, own, given, caller, parent_format)
            finally:
                state.stack = outer
            # Once its forward has run every product: one warning for all the ops it emulated.
            # is_compiling first: Dynamo folds it, so a compiled forward reads no list (note records nothing there).
            if not torch.compiler.is_compiling() and layer.unwarned:
                layer.warn_emulated()
            return _leaving(out, leave_to, leaving)

        mark(forward, self.owner, had_own, previous)
        # Bound, so that copy.deepcopy(model) re-binds it to the copy (see the check above).
        return types.MethodType(forward, module)

    def rerun_in_fp32(self, error: RuntimeError, layer: RuntimeLayer, state: ThreadState, own_forward: Any,
                      given: tuple, caller: "torch.dtype | None", parent_format: "Format | None") -> Any:
        """A lowered layer's forward raised (code that cannot run in its format: DeBERTa fills
        BF16 scores with FP32's lowest value): under `failures` (a search's probe and trial
        runtimes) the layer runs again as the plain model does (FP32, autocast off, the runtime
        off for the layers inside it) and the failure is recorded for the search to rule the
        format out; otherwise, or for an FP32 layer, the error stands. Costs nothing until a
        forward raises; then one more forward of the layer."""
        if self.failures is None or layer.format is Format.FP32 or torch.compiler.is_compiling():
            raise error
        self.failures.setdefault(layer.fqn, f"{type(error).__name__}: {first_line(error)}")
        active, stack = state.active, state.stack
        state.active, state.stack = False, ()
        try:
            with torch.autocast(self.device_type, enabled=False):
                args, kwargs = map_leaves(to_fp32, given)
                out = own_forward(*args, **kwargs)
        finally:
            state.active, state.stack = active, stack
        to_caller = self._caller_dtypes(layer, parent_format, Format.FP32)
        _, _, _, leave_to, leaving = _entering(Format.FP32, self.device_type, layer.stored_dtype, caller, to_caller, (), {})
        return _leaving(out, leave_to, leaving)

    def _caller_dtypes(self, layer: RuntimeLayer, parent_format: "Format | None", fmt: "Format | None" = None) -> frozenset:
        """The dtypes of ``layer``'s outputs cast to its caller's half autocast dtype on leaving
        (one rule for every format); none where the plan hands on one half dtype only and the
        layer's FP32 outputs stay.

        Under a half autocast (the region's or a half parent's), a tensor of the other half dtype
        is cast to it (autocast's promoting ops, ``cat``, ``roll``, ``index_put``, ..., refuse to
        mix the two); an FP32 layer's outputs are cast to it too when its parent is a lowered
        layer (that parent computes in the half dtype, and code reading ``finfo(q.dtype)`` to fill
        its half scores must read that dtype) or its weights are stored in a half dtype (the
        layers around it hand on that dtype). An FP32 layer in the region keeps its FP32 outputs:
        the ops between layers (norms, residual adds, the loss) take FP32 under autocast.
        ``fmt``: the format it runs in (None: its plan's)."""
        others = _HALVES if self.mixed_halves else frozenset()
        fp32_joins = (fmt or layer.format) is Format.FP32 and (
            layer.stored_dtype is not None or (parent_format is not None and parent_format is not Format.FP32)
        )
        return others | ({torch.float32} if fp32_joins else frozenset())

    @contextlib.contextmanager
    def layer_mode(self, state: ThreadState):
        """The `LayerMode` on for the thread whose ``state`` this is."""
        state.mode_active = True
        try:
            with LayerMode(self.threads, self.products):
                yield
        finally:
            state.mode_active = False

    def _all(self) -> list:
        """(module, forward) of every wrapper on the model: layers, then recomputed blocks (a block
        that is a layer too holds its block wrapper, which runs the layer's: `recompute.block_wrapper`)."""
        return [(self.layers[fqn].module, forward) for fqn, forward in self.forwards.items() if fqn not in self.blocks] + list(self.blocks.values())

    def installed(self) -> bool:
        """Whether every wrapper is on its module (another runtime may have displaced them).
        Checked once per wrapper after any runtime installed or removed wrappers, then one
        comparison until the next such change: each recomputed block asks again in the backward,
        and walking every wrapper there made a step's cost grow with the square of the depth."""
        if self._checked_at == _wrapper_changes[0]:
            return True
        on = all(module.__dict__.get("forward") is forward for module, forward in self._all())
        if on:
            self._checked_at = _wrapper_changes[0]
        return on

    def watch_stages(self) -> None:
        """At the runtime's entry: once ``torch.distributed.pipelining`` is imported, the model's
        forwards look for a stage's metadata inference (`pipelining.watch`); a plan without layer
        wrappers keeps no state to protect. A dict lookup until then; nothing after."""
        if self.stage_hook is None and self.forwards and pipelining.loaded():
            threads = self.threads
            self.stage_hook = pipelining.watch(self.root, lambda: threads.state.active)
            # Entered inside the model's forward (a scheduler binding at its first call, after the
            # model's pre-hooks ran): that forward's look-up, made here.
            pipelining.look_up(sys._getframe())

    def install(self) -> None:
        """Put this runtime's wrappers on its layers and recomputed blocks, displacing an inactive
        runtime's; they stay until `remove` (wrap once, flip on enter: entering then costs no
        module surgery, and a compiled step can enter the context without a graph break)."""
        for module, forward in self._all():
            module.forward = forward
        _wrapper_changes[0] += 1
        self._checked_at = _wrapper_changes[0]

    def remove(self) -> None:
        """Take the wrappers off the model, restoring each module's ``__dict__`` as it was (a
        forward the user had set on an instance included), and the stage watch's hook."""
        if self.stage_hook is not None:
            self.stage_hook.remove()
            self.stage_hook = None
        _wrapper_changes[0] += 1
        for module, forward in self._all():
            if module.__dict__.get("forward") is not forward:
                continue  # displaced by another runtime, which restores on its own removal
            had_own, previous = previous_of(forward)
            if had_own:
                module.forward = previous
            else:
                del module.__dict__["forward"]
