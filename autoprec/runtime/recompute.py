"""Block recomputation: a plan's recomputed blocks run under ``torch.utils.checkpoint``.

A block the plan marks for recomputation (`autoprec.Plan.with_recompute`) keeps no activations of
its own for the backward: it runs under non-reentrant ``torch.utils.checkpoint.checkpoint``
(``use_reentrant=False``), which saves only the block's inputs and runs its forward once more in
the backward when the saved activations are needed. Cost: one extra forward of the block per
backward, with the block's layers in their planned formats; memory: the block's activations
beyond its inputs are freed after the forward.

What the recomputation must reproduce, and how (eager):

- **RNG**: checkpoint's ``preserve_rng_state`` (on) restores the forward's CPU and device RNG, so
  dropout draws the same masks; checkpoint also restores the forward's autocast state.
- **The plan**: the backward runs outside ``with runtime:``, so the recompute context re-enters the
  runtime for the calling thread as the forward saw it (active, the planned layers running around
  the block, their matrix-product mode) and leaves it as it was after.
- **Scales, not state**: state updated in a forward is updated once. The forward of a checkpointed
  block records every scale its layers chose (delayed-scaling inverse scales, INT8 calibrated
  scales and outlier channels) in a `ScaleRecord`; the recomputation reads them back in the same
  order per layer and operand instead of asking the quantizers and calibrators again, so no amax
  history or calibration observes the batch twice and the recomputed activations are bit for bit
  the forward's. Forward hooks of autoprec's profiler and output watch skip while `recomputing`.

Under ``torch.compile``: Dynamo's checkpoint operator; delayed scaling keeps its history reads (a
selective checkpoint policy); `compile_refusal` says what cannot run.

**The user's own checkpointing** (``torch.utils.checkpoint.checkpoint`` called by the model's own
forward, reentrant or not, directly, through torch's ``checkpoint_wrapper`` as torchtitan does, or
through Hugging Face's ``gradient_checkpointing_enable()``) recomputes in the backward too, where the
runtime is off: the recomputed layers would run in FP32 against a forward that ran in the plan's
formats (non-reentrant checkpoint refuses the different saved tensors, reentrant checkpoint silently
takes the gradients of another model). So the first planned layer that runs inside such a call's
forward (`users_record`) finds the call (`_users_checkpoint`), gives it a `ScaleRecord` and wraps
the function the call will recompute with (`_CheckpointFrame.recompute_fn`, or the reentrant
context's ``run_function``) in the same replay context as a planned block's: the recomputation runs
under the plan with the forward's scales, and the gradients equal those of the same plan without
checkpointing. A planned block inside (or around) the user's checkpoint is not checkpointed a
second time: one recomputation serves both.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import types
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction, CheckpointPolicy, _CheckpointFrame, checkpoint, create_selective_checkpoint_contexts

from ..calls import changeable, fresh, isolated
from ..errors import RuntimeStateError
from ..formats import Granularity
from ..plan import ScalingMode
from .pipelining import inferring
from .installed import displaced, mark

__all__ = ["recomputing", "recorded_scale", "ScaleRecord", "BlockHost", "block_wrapper", "users_record", "Recording", "training_forward"]


class _RecomputeState(threading.local):
    """The calling thread's place in a checkpointed block: ``record`` while its forward runs,
    ``replay`` while its recomputation runs (the backward's thread: on CUDA not the caller's)."""

    def __init__(self):
        self.record: "ScaleRecord | None" = None
        self.replay: "ScaleRecord | None" = None


_state = _RecomputeState()


def recomputing() -> bool:
    """True while the calling thread re-runs a recomputed block's forward inside a backward.

    Forward hooks that accumulate state (statistics, finiteness records) return early then: the
    forward already counted this call. Always False under ``torch.compile``, whose compiled
    backward runs no Python.
    """
    return _state.replay is not None


def training_forward(look_up: bool = False) -> bool:
    """Whether the running forward is one of training, whose state (a delayed scaling's amax
    history, the profiler's statistics) it updates: gradients on, or the forward of a reentrant
    checkpoint, which runs under ``torch.no_grad`` while its recomputation gives the gradients;
    never a pipeline stage's metadata inference (`pipelining.inferring`), gradients on or not.
    Inside a planned layer a reentrant checkpoint's forward has its record set (`users_record`);
    ``look_up``: also look for one on the stack (forward hooks, which run after the layer's
    wrapper returned). Costs two flag reads with gradients on; with ``look_up`` under
    ``torch.no_grad``, `_users_checkpoint`'s walk up the stack."""
    if torch.is_grad_enabled():
        return not inferring()
    if torch.compiler.is_compiling() or inferring():
        return False
    return _state.record is not None or (look_up and _users_checkpoint(reentrant=True) is not None)


class ScaleRecord:
    """The scales one checkpointed forward chose, per ``(layer fqn, operand)`` in call order, for
    its recomputation to read back; ``what``: the checkpointed code, for messages ("block
    'blocks.0'"). Holds references to small tensors (one scalar, or an INT8 operand's scale and
    outlier masks), no activations."""

    __slots__ = ("what", "values", "taken")

    def __init__(self, what: str):
        self.what = what
        self.values: dict[tuple, list] = {}
        self.taken: dict[tuple, int] = {}

    def put(self, key: tuple, value: Any) -> None:
        self.values.setdefault(key, []).append(value)

    def take(self, key: tuple) -> Any:
        index = self.taken.get(key, 0)
        values = self.values.get(key, ())
        if index >= len(values):
            raise RuntimeStateError(
                f"recomputing {self.what}: layer {key[0]!r} asked for a scale its forward did not "
                f"use ({key[1]!r}, call {index + 1}); the block's forward must call its layers the same way "
                "when it runs again (no data-dependent branches on values that differ in the backward)"
            )
        self.taken[key] = index + 1
        return values[index]


def recorded_scale(layer: str, operand: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, the scale of ``layer``'s ``operand`` for this call, except while a
    recomputation replays: then the value its forward computed, without calling ``compute`` (which
    would update the quantizer's or calibrator's state a second time). Inside a checkpointed
    forward the value is recorded. Costs a dict lookup; nothing under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return compute()
    state = _state
    if state.replay is not None:
        return state.replay.take((layer, operand))
    value = compute()
    if state.record is not None:
        state.record.put((layer, operand), value)
    return value


class Recording:
    """The forward context of one checkpoint call: scales go into ``record``."""

    def __init__(self, record: ScaleRecord):
        self.record = record

    def __enter__(self):
        self.previous = _state.record
        _state.record = self.record

    def __exit__(self, *exc):
        _state.record = self.previous


@dataclasses.dataclass(frozen=True)
class BlockHost:
    """What a recomputed block's wrapper needs from the `PlanRuntime` installing it, handed over
    at installation (this module reads none of the runtime's attributes)."""

    runtime: Any  # the wrapper is marked as this runtime's (`installed.mark`)
    threads: Any  # per-thread state: ``threads.state`` has ``active``, ``stack``, ``mode_active``
    installed: Callable[[], bool]  # the runtime's wrappers are on the model
    layer_mode: Callable[[Any], Any]  # the mode routing a layer's own products, for a thread state
    layers: Mapping[str, Any]  # fqn -> the runtime's layer
    wrapped: Mapping[str, Any]  # fqn -> the forward of each layer with a wrapper of its own

    def layers_in(self, block: str) -> list:
        return [(fqn, layer) for fqn, layer in self.layers.items() if block == "" or fqn.startswith(block + ".")]


class _Replaying:
    """The recompute context of one checkpoint call, entered once per backward that recomputes
    (``retain_graph=True`` backwards recompute again): the runtime active for this thread as the
    forward saw it, and ``record`` read back from its start."""

    def __init__(self, host: BlockHost, record: ScaleRecord, stack: tuple, mode_active: bool):
        self.host, self.record, self.stack, self.mode_active = host, record, stack, mode_active
        self.saved: list = []

    def __enter__(self):
        host = self.host
        if not host.installed():
            raise RuntimeStateError(
                f"backward through recomputed {self.record.what} after its plan runtime was removed or displaced; "
                "run loss.backward() before runtime.remove() or applying another plan to the model"
            )
        thread = host.threads.state
        self.saved.append((thread.active, thread.stack, thread.mode_active, _state.record, _state.replay))
        self.record.taken = {}
        thread.active, thread.stack = True, self.stack
        _state.record, _state.replay = None, self.record
        self.mode = host.layer_mode(thread) if self.mode_active and not thread.mode_active else None
        if self.mode is not None:
            self.mode.__enter__()

    def __exit__(self, *exc):
        try:
            if self.mode is not None:
                self.mode.__exit__(*exc)
        finally:
            thread = self.host.threads.state
            thread.active, thread.stack, thread.mode_active, _state.record, _state.replay = self.saved.pop()


def compile_refusal(host: BlockHost, block: str) -> "str | None":
    """Why ``block`` cannot run recomputed inside a compiled step now, or None.

    Dynamo refuses Python state changed inside a checkpointed body unless told not to replay it
    in the recomputation (``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``).
    autoprec changes such state in three cases: a layer whose own products the runtime's mode
    routes (the layer stack, pushed and popped within its call), a layer's first forward (its
    quantizers made) and INT8 calibration (observed once). The compiled recomputation needs none
    of it replayed: it recomputes from the forward's values (delayed scaling's history reads kept,
    `_keep_history_reads`), so with that flag nothing is refused
    (``tests/runtime/test_runtime_recompute.py``: gradients and runtime state bit for bit).
    """
    if torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint:
        return None
    for fqn, layer in host.layers_in(block):
        if fqn in host.wrapped and layer.keeps_thread_state:
            what, eager = f"({layer.format.value}) routes its own matrix products through the runtime's mode (its layer stack)", "the step"
        elif not layer.low_precision:
            continue
        elif layer.kernel_reason is None and not (layer.weights or any(how.startswith("emulated") for how in layer.ops.values())):
            what, eager = "has not run yet (its first forward makes its quantizers)", "one training step"
        elif any(c.calibrating for c in layer.calibrators.values()):
            what, eager = "is still calibrating INT8", f"the first {layer.precision.calibration.batches} steps"
        else:
            continue
        return (f"recomputed block {block!r} under torch.compile: layer {fqn!r} {what}, Python state Dynamo refuses to change "
                "inside a recomputed block; set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True (the "
                f"compiled recomputation reuses the forward's values, so gradients are unchanged), run {eager} eagerly, "
                "or stop recomputing the block")
    return None


def _delayed(layer) -> bool:
    scaling = layer.precision.scaling
    return layer.format.is_fp8 and scaling.mode is ScalingMode.DELAYED and scaling.granularity is Granularity.TENSOR


def _keep_history_reads(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy of a compiled recomputed block with delayed scaling: every
    ``amax`` output saved (the history reads: `TensorDelayedQuantizer.inverse_scale` reads the history by
    reductions only), the rest recomputed. The forward updates the history in place, so a
    recomputation reading it again would scale by the next step's amax; the saved reads give it
    the forward's scale, as `ScaleRecord` does eagerly. Costs the saved reductions' bytes (a
    scalar per layer and operand) and one torch warning per compile about in-place ops (the
    history update, applied once by the forward)."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.amax.default else CheckpointPolicy.PREFER_RECOMPUTE


_HISTORY_READS_KEPT = functools.partial(create_selective_checkpoint_contexts, _keep_history_reads)


def traced(run: Callable, block: str) -> Callable:
    """``run`` for a checkpoint chosen while Dynamo traced: if Dynamo fails to trace the
    checkpoint and runs it eagerly instead, the recomputation would run outside the plan (no
    recompute context was given): refused, rather than gradients silently of another model."""

    def body(*tensors):
        if not torch.compiler.is_compiling():
            raise RuntimeStateError(
                f"recomputed block {block!r}: torch.compile could not trace its checkpoint and ran it eagerly, where its "
                "recomputation would run without the plan; compile with fullgraph=True to see why, or stop recomputing the block"
            )
        return run(*tensors)

    return body


class _ObjectsAsFound(dict):
    """A recomputed block's changeable arguments (`calls.changeable`: a KV cache) as its forward
    found them: position in the call's leaves -> a copy of the object's structure (`isolated`)
    sharing its tensors, and each tensor's version counter then. The recomputation's copy holds
    them detached, as before.

    A recomputation runs on a copy of that copy, so that a second one (``retain_graph``) finds
    it unchanged. A tensor is cloned into that copy only if something wrote it in place since
    the forward found it (its version moved: a static cache's ``index_copy_``), since the
    recomputation would write it again; a cache that replaces its tensors (``DynamicCache``'s
    concatenation) is not copied at all, where cloning every layer's keys and values at every
    block made a step's copies grow with the square of the depth.

    A ``transformers`` ``Cache`` (and the caches an ``EncoderDecoderCache`` holds) is copied around
    the layers the block updates only: a decoder layer updates the cache layer of its attention's
    ``layer_idx`` (`cache_layers_of`), so the copy shares every other layer as it is, where walking
    all L layers at each of L blocks made a step's walks grow with the square of the depth. Any
    other object is walked whole.

    Cost: two Python walks per block and step (the forward's and the recomputation's) of the
    objects the block may change (a ``transformers`` cache: its own attributes and the block's
    layers, plus a C-level copy of its list of L layer references; another object: all of it), a
    version read and a ``detach`` per tensor walked, no tensor copy unless written in place.

    The clone is of the tensor as the forward left it: a block that reads a tensor it then
    changes in place from its own old value (a running count) recomputes from the changed value,
    as it did before and as ``torch.utils.checkpoint`` does for an input changed in place. Only a
    copy taken before each block's forward would serve it, which for a cache that every block
    extends is a copy of every layer's keys and values held per block until the backward."""

    def __init__(self, cache_layers: "frozenset[int]"):
        super().__init__()
        self.versions: "dict[int, int | None]" = {}  # id(tensor) -> its version when the forward found it
        self.cache_layers = cache_layers

    @classmethod
    def of(cls, leaves: list, cache_layers: "frozenset[int]") -> "_ObjectsAsFound":
        """``cache_layers``: the indices of a ``transformers`` cache's layers the block updates
        (`cache_layers_of`); empty: every cache is walked whole."""
        found = cls(cache_layers)
        for i, v in enumerate(leaves):
            if changeable(v):
                found[i] = isolated(v, found._versioned, _only_cache_layers(v, cache_layers, found._versioned))
        return found

    def _versioned(self, tensor: torch.Tensor) -> torch.Tensor:
        self.versions[id(tensor)] = _version(tensor)
        return tensor

    def for_recomputation(self) -> dict:
        versions = self.versions

        def unwritten_or_cloned(tensor: torch.Tensor) -> torch.Tensor:
            version = _version(tensor)
            # Detached either way: the recomputation must not reach into the forward's graph.
            return tensor.detach() if version is not None and versions.get(id(tensor)) == version else tensor.detach().clone()

        memo: dict = {}
        for v in self.values():
            _only_cache_layers(v, self.cache_layers, unwritten_or_cloned, memo)
        return fresh(dict(self), unwritten_or_cloned, memo)


def cache_layers_of(block: nn.Module) -> "frozenset[int]":
    """The layers of a ``transformers`` cache that ``block`` updates: the ``layer_idx`` of its
    modules (a decoder layer's attention updates ``cache.layers[layer_idx]`` and no other). One
    walk of the block's modules, at installation."""
    indices = (getattr(m, "layer_idx", None) for m in block.modules())
    return frozenset(i for i in indices if type(i) is int)


def _only_cache_layers(value: Any, indices: "frozenset[int]", copy_tensor: Callable, memo: "dict | None" = None) -> dict:
    """A memo for `calls.isolated` that copies a ``transformers`` cache ``value`` (or the caches of
    an ``EncoderDecoderCache``) around its layers at ``indices`` only: each cache's list of layers
    maps to a new list sharing the other layers (a C-level copy of the references) and holding
    isolated copies of those (``copy_tensor`` on their tensors). Empty for anything else, or
    with no indices. ``memo``: the memo the copies join (objects reached twice copied once)."""
    memo = {} if memo is None else memo
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if not indices or cache_type is None or not isinstance(value, cache_type):
        return memo
    for cache in (value, *(v for v in vars(value).values() if isinstance(v, cache_type))):
        layers = getattr(cache, "layers", None)
        if type(layers) is list and id(layers) not in memo:
            copied = list(layers)
            memo[id(layers)] = copied
            for i in indices:
                if i < len(layers):
                    copied[i] = isolated(layers[i], copy_tensor, memo)
    return memo


def _version(tensor: torch.Tensor) -> "int | None":
    """The tensor's version counter, or None where it has none (an inference-mode tensor)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def block_wrapper(host: BlockHost, fqn: str, module: nn.Module):
    """The ``forward`` installed on a recomputed block: checkpointed in a thread that entered
    ``host``'s runtime with gradients on, the module's own forward everywhere else (other threads,
    outside the context, ``torch.no_grad``, a deep copy); marked as the layer wrappers are
    (`installed`)."""
    threads = host.threads
    had_own, previous = displaced(module)
    # A block that is a layer too (a diffusers Attention: its own forward runs the attention product
    # and its projections are children): the block's wrapper is the one on the module, and it runs
    # the layer's wrapper inside, so that one forward is both checkpointed and planned.
    as_layer = host.wrapped.get(fqn)
    cache_layers = cache_layers_of(module)

    def own_forward(m, args, kwargs):
        if m is module and as_layer is not None:
            return as_layer(*args, **kwargs)
        if had_own and m is module:
            return previous(*args, **kwargs)
        return type(m).forward(m, *args, **kwargs)

    def forward(self_module, *args, **kwargs):
        thread = threads.state
        if not thread.active or self_module is not module:
            return own_forward(self_module, args, kwargs)
        if _state.record is not None or _state.replay is not None:
            # Inside a checkpoint already recording or recomputing (the user's, around this
            # block): its recomputation recomputes this block too.
            return own_forward(self_module, args, kwargs)
        users = users_record(host, fqn)
        if users is not None:
            with Recording(users):
                return own_forward(self_module, args, kwargs)
        if not torch.is_grad_enabled():
            return own_forward(self_module, args, kwargs)
        # Every tensor goes to checkpoint positionally, keyword ones included: checkpoint finds the
        # device whose RNG it preserves from its positional arguments only.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
        # Objects the block changes (a KV cache: its attention appends keys, a cross-attention
        # marks its keys computed) as the forward found them, for the recomputation: run on the
        # changed object it would take other paths (T5's decoder skips its cross-attention
        # projections) or attend to its own keys twice. Not while compiling: the compiled
        # recomputation replays no Python, it reuses the forward's.
        objects = {} if torch.compiler.is_compiling() else _ObjectsAsFound.of(leaves, cache_layers)

        def run(*tensors):
            filled = list(leaves)
            if objects and recomputing():
                for i, v in objects.for_recomputation().items():
                    filled[i] = v
            for i, t in zip(at, tensors):
                filled[i] = t
            call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
            return own_forward(module, call_args, call_kwargs)

        tensors = [leaves[i] for i in at]
        if torch.compiler.is_compiling():
            refusal = compile_refusal(host, fqn)
            if refusal is not None:
                raise RuntimeStateError(refusal)
            if any(_delayed(layer) for _, layer in host.layers_in(fqn)):
                return checkpoint(traced(run, fqn), *tensors, use_reentrant=False, context_fn=_HISTORY_READS_KEPT)
            return checkpoint(traced(run, fqn), *tensors, use_reentrant=False)
        record = ScaleRecord(f"block {fqn!r}")
        stack, mode_active = thread.stack, thread.mode_active

        def contexts():
            return Recording(record), _Replaying(host, record, stack, mode_active)

        return checkpoint(run, *tensors, use_reentrant=False, context_fn=contexts)

    mark(forward, host.runtime, had_own, previous)
    # Bound, so that copy.deepcopy(model) re-binds it to the copy (which then runs its own forward).
    return types.MethodType(forward, module)


def _users_checkpoint(reentrant: bool) -> Any:
    """The ``torch.utils.checkpoint`` call whose forward the calling code runs in, as the object
    holding the function its recomputation calls: a non-reentrant call's `_CheckpointFrame` (its
    forward runs under the saved-tensor hooks the call pushes, whose pack function holds the
    frame), with ``reentrant`` a reentrant call's autograd context (its forward runs under
    ``torch.no_grad`` inside ``CheckpointFunction.forward``, found on the Python stack); None
    elsewhere.

    Reads torch internals, the same in 2.11 and 2.13 (`tests/runtime/test_user_checkpointing.py` runs
    both kinds on both). Costs one C call; with ``reentrant`` under ``torch.no_grad`` also a walk
    up the Python stack (about 0.15 us a frame in CPython 3.11, tens of frames)."""
    hooks = _top_saved_tensors_hooks(True)
    if hooks is not None:
        for cell in getattr(hooks[0], "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, _CheckpointFrame):
                return value
        return None
    if not reentrant or torch.is_grad_enabled():
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


_REENTRANT_FORWARD = CheckpointFunction.forward.__code__
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_RECORD = "autoprec_record"  # the attribute holding a user's checkpoint call's ScaleRecord


def users_record(host: BlockHost, fqn: str) -> "ScaleRecord | None":
    """The `ScaleRecord` of the user's checkpoint call whose forward the planned layer or block
    ``fqn`` of ``host``'s runtime runs in (module docstring), or None: outside one, inside a
    checkpoint already recording or replaying, and under ``torch.compile`` (whose recomputation
    replays no Python: it reuses the forward's values). The first call inside a checkpoint call
    makes the record and wraps the call's recomputation function to replay it under the plan, as
    the forward's thread ran it (the runtime active, its layer stack). Costs a few thread-local
    reads and `_users_checkpoint`, which walks the stack only for a forward under
    ``torch.no_grad`` in a runtime entered with gradients on (evaluation pays nothing)."""
    if torch.compiler.is_compiling() or _state.record is not None or _state.replay is not None:
        return None
    thread = host.threads.state
    call = _users_checkpoint(reentrant=thread.training)
    if call is None:
        return None
    record = getattr(call, _RECORD, None)
    if record is None:
        record = ScaleRecord(f"the checkpoint holding layer {fqn!r}")
        replaying = _Replaying(host, record, thread.stack, thread.mode_active)
        # A non-reentrant call recomputes with its frame's recompute_fn; a reentrant one with its
        # context's run_function.
        attribute = "recompute_fn" if isinstance(call, _CheckpointFrame) else "run_function"
        recompute = getattr(call, attribute)

        @functools.wraps(recompute)
        def replayed(*args, **kwargs):
            with replaying:
                return recompute(*args, **kwargs)

        setattr(call, attribute, replayed)
        setattr(call, _RECORD, record)
    return record
