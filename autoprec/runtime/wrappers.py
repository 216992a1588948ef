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
import functools
import types
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..formats import Format
from ..plan import Plan
from .layers import NEVER_AUTOCAST, RuntimeLayer, to_fp32, to_half
from .products import LayerMode, PerThread, Products, ThreadState
from .recompute import BlockHost, block_wrapper, user_checkpoint
from .wrapping import displaced, mark, previous_of

__all__ = ["LayerWrappers"]

# Ops autocast leaves uncast: they fail on mixed dtypes inside a half layer (CPU's), or run in the
# FP32 weights' dtype (`layers.NEVER_AUTOCAST`), so a layer that runs one gets the layer mode,
# which gives them the layer's dtype.
_AUTOCAST_UNCAST = {"cpu": frozenset({"mv", "addmv", "bilinear"})}
# The attribute through which a Hugging Face module checkpoints itself (`recompute.user_checkpoint`).
_HF_CHECKPOINT = "_gradient_checkpointing_func"


def _leaving(out: Any, caller_dtype: "torch.dtype | None", stored_dtype: "torch.dtype | None") -> Any:
    """A layer's outputs as its caller expects them: in the caller's half dtype (a half layer under
    the other half's autocast), or, for an FP32 layer of a model stored in BF16 / FP16, in the half
    dtype around it (the enclosing autocast's, else the weights': the next norm holds weights of
    that dtype)."""
    if caller_dtype is not None:
        return to_half(out, caller_dtype)
    if stored_dtype is not None:
        return pytree.tree_map(lambda t: t.to(stored_dtype) if torch.is_tensor(t) and t.dtype == torch.float32 else t, out)
    return out


class LayerWrappers:
    """The forwards ``owner`` (a `PlanRuntime`) installs on its layers and recomputed blocks of
    ``model``: built once here, put on by `install`, taken off by `remove`. ``region_dtype``: the
    half dtype the region's autocast runs in; ``low_precision``: whether any layer is not FP32
    (an all-FP32 plan installs nothing)."""

    def __init__(self, owner: Any, model: nn.Module, plan: Plan, layers: Mapping[str, RuntimeLayer], threads: PerThread,
                 products: Products, region_dtype: torch.dtype, low_precision: bool):
        self.owner, self.plan, self.layers, self.threads, self.products = owner, plan, layers, threads, products
        self.device_type = products.device_type
        self.region_dtype = region_dtype
        self.forwards = self._build() if low_precision else {}
        # Recomputed blocks: checkpointed while the plan is on (see `recompute`); installed after
        # the layers' wrappers, taken off with them.
        modules = dict(model.named_modules())
        host = BlockHost(owner, threads, self.installed, self.layer_mode, layers, self.forwards)
        self.blocks = {fqn: (modules[fqn], block_wrapper(host, fqn, modules[fqn])) for fqn in plan.recompute}
        # The user's own checkpointed modules (Hugging Face's gradient checkpointing): their
        # recomputation must run under the plan too (`recompute.user_checkpoint`). fqn -> (module,
        # the function installed); the user's own function is kept in `_user_checkpoints`.
        self._user_checkpoints: dict[str, Any] = {}
        self.checkpoints = {
            fqn: (m, user_checkpoint(host, fqn, functools.partial(self._user_checkpoints.get, fqn)))
            for fqn, m in modules.items() if low_precision and callable(m.__dict__.get(_HF_CHECKPOINT))
        }

    def _needs_mode(self, layer: RuntimeLayer, planned_below: bool) -> bool:
        if layer.format is Format.FP32:
            # Weights stored in a half dtype (a model loaded in BF16, a LoRA's frozen base): the
            # mode casts every operand of its products to FP32, the weight included.
            return planned_below or layer.stored_dtype is not None
        if layer.low_precision:
            # Only an unpatched nn.Linear forward is known to be exactly F.linear(x, weight, bias).
            plain_linear = type(layer.module).forward is nn.Linear.forward and "forward" not in layer.module.__dict__
            return not plain_linear or layer.kernel_reason is not None
        ops = set(self.plan.fingerprint[layer.fqn].ops) if layer.fqn in self.plan.fingerprint else set()
        return bool(ops & (_AUTOCAST_UNCAST.get(self.device_type, frozenset()) | NEVER_AUTOCAST)) or not ops

    def _build(self) -> dict[str, Any]:
        """fqn -> the forward to install for every layer that needs one (see the module docstring)."""
        fqns = list(self.layers)

        def ancestors(fqn):
            return [f for f in fqns if f != fqn and (f == "" or fqn.startswith(f + "."))]

        def descendants(fqn):
            return [f for f in fqns if f != fqn and (fqn == "" or f.startswith(fqn + "."))]

        wrappers: dict[str, Any] = {}
        with_mode: set[str] = set()
        for fqn in sorted(fqns, key=lambda f: (f.count(".") if f else -1)):  # parents first
            layer = self.layers[fqn]
            # Layers below that hand this one other dtypes: lowered ones, or FP32 ones on half-stored weights.
            below = any(self.layers[d].format is not Format.FP32 or self.layers[d].stored_dtype is not None for d in descendants(fqn))
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

    def _wrapper(self, layer: RuntimeLayer, mode: bool, stacked: bool):
        """The forward installed on ``layer.module``: the plan's in a thread that entered this
        runtime, the module's own everywhere else (other threads, outside the context, a copy).
        ``stacked``: the layer runs under the mode (its own or an ancestor's), which reads the
        running layer from the thread's stack; otherwise its forward changes no thread state."""
        module, fmt, device_type, threads, products = layer.module, layer.format, self.device_type, self.threads, self.products
        had_own, previous = displaced(module)
        direct_linear = layer.low_precision and not mode
        half_stored = layer.stored_dtype  # what the rest of a model loaded in BF16 expects between layers
        # Whether its forward changes thread state, which Dynamo cannot trace inside a recomputed
        # block (see recompute.compile_refusal).
        layer.keeps_thread_state = stacked
        layer.direct = direct_linear
        if direct_linear:
            layer.ops = {"linear": products.kernel_name(layer)}
        elif fmt in (Format.BF16, Format.FP16):
            layer.ops = {"*": f"torch.autocast({device_type!r}, {fmt.dtype})"}
        wrappers = self

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
                    return products.linear(layer, x, module.weight, module.bias)
                # An ancestor's mode runs: on the stack, this layer's own kernel ops (an INT8
                # layer's outlier addmm) pass through it rather than being routed as the ancestor's.
                outer = state.stack
                state.stack = outer + (layer,)
                try:
                    return products.linear(layer, x, module.weight, module.bias)
                finally:
                    state.stack = outer
            caller_dtype = None  # a half layer called under the other half dtype's autocast: that dtype
            stored_dtype = None  # an FP32 layer on half-stored weights: its outputs leave in their dtype
            if fmt is Format.FP32:
                if half_stored is not None:  # under a half region's autocast: its dtype, as its other layers return
                    stored_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else half_stored
                args, kwargs = pytree.tree_map(to_fp32, (args, kwargs))
                scope = torch.autocast(device_type, enabled=False)
            elif fmt in (Format.BF16, Format.FP16):
                scope = torch.autocast(device_type, dtype=fmt.dtype)
                # Boundary casts (a plan mixing FP16 and BF16 layers): autocast's promoting ops
                # (cat, stack, index_put, addcmul, ...) refuse a half dtype that is not the
                # region's, as a KV cache's cat would inside this layer. Inputs in the other half
                # dtype enter in this one; outputs leave in the caller's (under an FP32 layer,
                # autocast is off and mixed dtypes simply promote: outputs stay as they are).
                autocast_on = torch.is_autocast_enabled(device_type)
                if autocast_on and torch.get_autocast_dtype(device_type) != fmt.dtype:
                    caller_dtype = torch.get_autocast_dtype(device_type)
                if caller_dtype is not None or not autocast_on:
                    args, kwargs = to_half((args, kwargs), fmt.dtype)
            else:
                scope = contextlib.nullcontext()
            if not stacked:
                with scope:
                    out = own_forward(module, args, kwargs)
                return _leaving(out, caller_dtype, stored_dtype)
            enter_mode = mode and not state.mode_active
            outer = state.stack
            state.stack = outer + (layer,)
            try:
                with scope, (wrappers.layer_mode(state) if enter_mode else contextlib.nullcontext()):
                    out = own_forward(module, args, kwargs)
            finally:
                state.stack = outer
            # Once its forward has run every product: one warning for all the ops it emulated.
            # is_compiling first: Dynamo folds it, so a compiled forward reads no list (note records nothing there).
            if not torch.compiler.is_compiling() and layer.unwarned:
                layer.warn_emulated()
            return _leaving(out, caller_dtype, stored_dtype)

        mark(forward, self.owner, had_own, previous)
        # Bound, so that copy.deepcopy(model) re-binds it to the copy (see the check above).
        return types.MethodType(forward, module)

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
        """(module, forward) of every wrapper: layers, then recomputed blocks."""
        return [(self.layers[fqn].module, forward) for fqn, forward in self.forwards.items()] + list(self.blocks.values())

    def installed(self) -> bool:
        """Whether every wrapper is on its module (another runtime may have displaced them)."""
        return all(module.__dict__.get("forward") is forward for module, forward in self._all())

    def install(self) -> None:
        """Put this runtime's wrappers on its layers and recomputed blocks, displacing an inactive
        runtime's, and its checkpoint function on the user's checkpointed modules; they stay
        until `remove` (wrap once, flip on enter: entering then costs no module surgery, and a
        compiled step can enter the context without a graph break)."""
        for module, forward in self._all():
            module.forward = forward
        for fqn, (module, function) in self.checkpoints.items():
            current = module.__dict__.get(_HF_CHECKPOINT)
            if current is not function:
                # The user's, or an inactive runtime's: then the user's behind it.
                self._user_checkpoints[fqn] = current.autoprec_user() if hasattr(current, "autoprec_user") else current
                setattr(module, _HF_CHECKPOINT, function)

    def remove(self) -> None:
        """Take the wrappers off the model, restoring each module's ``__dict__`` as it was (a
        forward the user had set on an instance included, and the user's checkpoint function)."""
        for fqn, (module, function) in self.checkpoints.items():
            if module.__dict__.get(_HF_CHECKPOINT) is function:
                setattr(module, _HF_CHECKPOINT, self._user_checkpoints[fqn])
        for module, forward in self._all():
            if module.__dict__.get("forward") is not forward:
                continue  # displaced by another runtime, which restores on its own removal
            had_own, previous = previous_of(forward)
            if had_own:
                module.forward = previous
            else:
                del module.__dict__["forward"]
