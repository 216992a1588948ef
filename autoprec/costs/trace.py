"""One traced forward pass: every matrix product each layer runs, and what autograd saves.

`trace_model` runs the model once in FP32 with autograd recording (no backward) and keeps, per
layer (the innermost module running a matrix product, as `coverage.trace_layers` defines it):

- every matrix-product call (`coverage.MATMUL_OPS`): the function, the layout of each tensor
  argument (shape, strides, dtype, whether it is a weight, whether it requires grad) and its
  non-tensor arguments, enough to replay the call on random tensors (`product_times`) and to cost it;
- the bytes autograd saved inside each call, and the bytes the layer's other ops saved (the
  softmax output of an attention layer), through ``torch.autograd.graph.saved_tensors_hooks``;
- the bytes saved outside every layer (norms, activations functions, the loss).

`saved_bytes_by_layer` measures the same attribution under any plan: it is the reference the
memory model is checked against, and how the cost model measures what non-layer ops save in a
low-precision region. Both count each saved byte once, what a saved tensor holds
(`saved_bytes.held_span`: a view of an input counts its own bytes, not the whole storage), and leave
parameters out, as `saved_bytes.SavedTensorMeter` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Collection, Mapping, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._tracing import is_weight, module_stack, side_effect_free
from ..calls import ModelCall
from ..coverage import MATMUL_OPS, fqn_pattern
from ..errors import CostModelError
from ..saved_bytes import HeldBytes, held_span, keep_for_backward

__all__ = ["TensorSpec", "MatmulCall", "LayerTrace", "ModelTrace", "trace_model", "trace_roles", "saved_bytes_by_layer"]

# Positions of the bias / added input among the positional tensor arguments of each op: it is not
# a matrix operand (never saved for backward, not quantized by a GEMM kernel).
_BIAS_POSITION = {
    "linear": 2, "conv1d": 2, "conv2d": 2, "conv3d": 2,
    "conv_transpose1d": 2, "conv_transpose2d": 2, "conv_transpose3d": 2, "bilinear": 3,
    "addmm": 0, "baddbmm": 0, "addbmm": 0, "addmv": 0,
}


def _bias_of(op: str, args: tuple, kwargs: dict) -> Any:
    """The bias / added-input tensor of a call, or None."""
    at = _BIAS_POSITION.get(op)
    if at is None:
        return None
    if len(args) > at:
        return args[at]
    return kwargs.get("input" if at == 0 else "bias")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Layout of one tensor argument of a recorded call.

    ``storage_numel`` / ``offset``: elements of the underlying storage and where the tensor starts
    in it, so a view (``q`` sliced from a fused ``qkv`` output, ``w.t()``) is replayed as a view.
    ``weight``: a Parameter or a view of one. ``param``: the Parameter itself (a leaf).
    ``operand``: a matrix operand (False for a bias / added input).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_numel: int
    dtype: torch.dtype
    requires_grad: bool
    weight: bool
    param: bool
    operand: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def held_bytes(self) -> int:
        """Bytes this tensor keeps when saved for backward (`saved_bytes.held_span`)."""
        itemsize = self.dtype.itemsize
        start, end = held_span(self.shape, self.stride, self.offset, self.storage_numel * itemsize, itemsize, self.requires_grad)
        return end - start

    @property
    def key(self) -> str:
        flags = ("g" if self.requires_grad else "") + ("p" if self.param else "w" if self.weight else "") + ("" if self.operand else "b")
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}{list(self.shape)}{list(self.stride)}{flags}"

    @classmethod
    def of(cls, t: torch.Tensor, operand: bool) -> "TensorSpec":
        return cls(
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            offset=int(t.storage_offset()),
            storage_numel=t.untyped_storage().nbytes() // max(t.element_size(), 1),
            dtype=t.dtype,
            requires_grad=t.requires_grad,
            weight=is_weight(t),
            param=isinstance(t, nn.Parameter),
            operand=operand and t.is_floating_point(),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class MatmulCall:
    """One matrix-product call of a layer's forward, as recorded in FP32.

    ``leaves`` / ``spec``: the flattened ``(args, kwargs)`` with ``None`` where ``tensors`` go.
    ``saved``: what autograd saved inside this call in the FP32 trace (parameters left out), one
    ``(i, nbytes)`` per storage: ``i`` the first tensor argument whose storage it is (saved as
    is), or -1 for a tensor the op made itself (the contiguous copy ``matmul`` makes of a
    strided batch operand). ``already_saved[i]``: tensor i's storage had been saved before this
    call ran. ``alias[i]``: the first tensor argument sharing tensor i's storage.
    ``saved_elsewhere``: the call ran under another saved-tensor hook than the trace's (the
    user's gradient checkpointing, ``torch.utils.checkpoint``; ``save_on_cpu``), which keeps what
    it saves off the step's activations in every format.
    """

    op: str
    func: Callable
    tensors: tuple[TensorSpec, ...]
    tensor_at: tuple[int, ...]
    leaves: tuple
    spec: Any
    saved: tuple[tuple[int, int], ...]
    already_saved: tuple[bool, ...]
    alias: tuple[int, ...]
    saved_elsewhere: bool = False

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saved inside this call in the FP32 trace."""
        return sum(nbytes for _, nbytes in self.saved)

    @property
    def key(self) -> str:
        """Identifies the call's work independently of the model: op, function, layouts, scalars."""
        parts = []
        tensors = iter(self.tensors)
        at = set(self.tensor_at)
        for i, leaf in enumerate(self.leaves):
            parts.append(next(tensors).key if i in at else repr(leaf))
        name = getattr(self.func, "__qualname__", None) or repr(self.func)
        return f"{self.op}:{name}({','.join(parts)})"

    def arguments(self, tensors) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the call with ``tensors`` in place of the recorded ones."""
        filled = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors):
            filled[i] = t
        return pytree.tree_unflatten(filled, self.spec)


@dataclasses.dataclass(frozen=True)
class LayerTrace:
    """What one layer ran in the FP32 trace: its calls, the bytes its non-matmul ops saved
    (``other_saved_bytes``), and its own parameters (``param_bytes``: their numel times their
    element size, i.e. the FP32 master gradient buffer)."""

    fqn: str
    module: str
    calls: tuple[MatmulCall, ...]
    other_saved_bytes: int
    param_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelTrace:
    """Layers in model order, the bytes saved outside every layer in the FP32 trace, and the
    gradient buffers of the trainable parameters no layer owns (``rest_grad_bytes``: embeddings,
    norms, positional tables; the same in every plan). ``run_order``: the layers in the order
    their first matrix product ran (an attention's own products after its input projection,
    which model order lists after it); empty: model order."""

    layers: Mapping[str, LayerTrace]
    rest_saved_bytes: int
    device: torch.device
    rest_grad_bytes: int = 0
    run_order: tuple[str, ...] = ()

    def ran_before(self) -> dict[str, str]:
        """fqn -> the layer whose first matrix product ran last before its own (most often the
        one its input comes from); the first layer to run has none."""
        order = list(self.run_order or self.layers)
        return dict(zip(order[1:], order[:-1]))


class _Attribution:
    """Module-stack hooks + a saved-tensor hook: bytes saved while each module is innermost.

    Packs are attributed later to the innermost module of the stack that is a layer, so a
    dropout inside an attention layer counts for the layer. Each storage counts once; parameters
    never count; a saved tensor counts what it holds (`saved_bytes.held_span`). Hooks are removed on exit, also when the body raises.
    ``layers``: the only modules the stack keeps, when known beforehand (a layer's saved bytes
    need no other; the trace's matrix products name the innermost module of any kind).
    """

    def __init__(self, model: nn.Module, layers: "Optional[Collection[str]]" = None):
        self.model, self._stacked = model, layers
        self.layer_names = [fqn for fqn, _ in model.named_modules()]
        self.seen = HeldBytes(model.parameters())
        self.stack: list[str] = []
        self.packs: list[tuple[tuple[str, ...], int, Any]] = []  # (stack, nbytes, call record or None)
        self.current: Any = None
        self._probing = self._probed = False
        self._exit = contextlib.ExitStack()

    def hooks_on_top(self) -> bool:
        """Whether a tensor saved now reaches this meter's pack hook (no other saved-tensor hook
        entered inside it, as a checkpoint's). Costs one scalar multiplication."""
        self._probing, self._probed = True, False
        try:
            probe = torch.zeros((), requires_grad=True)
            _ = probe * probe  # saves its operands, through the innermost pack hook
        finally:
            self._probing = False
        return self._probed

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._probing:
            self._probed = True
            return t
        nbytes = self.seen.add(t)
        if nbytes:
            self.packs.append((tuple(self.stack), nbytes, self.current))
            if self.current is not None:
                key = t.untyped_storage().data_ptr()
                ptrs = self.current["ptrs"]
                self.current["saved"].append((ptrs.index(key) if key in ptrs else -1, nbytes))
        return keep_for_backward(t)

    def __enter__(self) -> "_Attribution":
        try:
            self.stack = self._exit.enter_context(module_stack(self.model, only=self._stacked))
            self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def split(self, layers) -> tuple[dict[str, int], int]:
        """(bytes per layer, bytes outside every layer) for packs made outside recorded calls."""
        per = {fqn: 0 for fqn in layers}
        rest = 0
        for stack, nbytes, call in self.packs:
            if call is not None:
                continue
            owner = next((fqn for fqn in reversed(stack) if fqn in per), None)
            if owner is None:
                rest += nbytes
            else:
                per[owner] += nbytes
        return per, rest


class _CallRecorder(TorchFunctionMode):
    """Records every matrix product with the innermost running module and its argument layouts."""

    def __init__(self, meter: _Attribution):
        super().__init__()
        self.meter = meter
        self.calls: list[tuple[str, dict]] = []  # (module fqn, record)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = MATMUL_OPS.get(func)
        if op is None or not self.meter.stack or self.meter.current is not None:
            return func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        bias = _bias_of(op, args, kwargs)
        tensor_at, specs, ptrs = [], [], []
        for i, leaf in enumerate(leaves):
            if torch.is_tensor(leaf):
                tensor_at.append(i)
                specs.append(TensorSpec.of(leaf, operand=leaf is not bias))
                ptrs.append(leaf.untyped_storage().data_ptr())
        record = {
            "op": op, "func": func, "tensors": tuple(specs), "tensor_at": tuple(tensor_at),
            "leaves": tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves)),
            "spec": spec, "already_saved": tuple(p in self.meter.seen for p in ptrs),
            "alias": tuple(ptrs.index(p) for p in ptrs), "saved": [], "ptrs": ptrs,
            "saved_elsewhere": torch.is_grad_enabled() and not self.meter.hooks_on_top(),
        }
        self.calls.append((self.meter.stack[-1], record))
        self.meter.current = record
        try:
            return func(*args, **kwargs)
        finally:
            self.meter.current = None


def forward_or_loss(model: nn.Module, example_inputs: Any, loss_fn: Optional[Callable]) -> Any:
    """``loss_fn(model, example_inputs)`` when given, else the model called on ``example_inputs`` (`ModelCall.of`)."""
    return loss_fn(model, example_inputs) if loss_fn is not None else ModelCall.of(example_inputs)(model)


TRACE_RETRIES = 4


def trace_roles(trace: ModelTrace) -> dict[str, str]:
    """fqn -> its role in ``trace``: its `coverage.fqn_pattern`, the class, each call's work
    (`MatmulCall.key`) and bytes saved, and the layer's own saved and parameter bytes. Layers of one role (the same projection in every block, on the same shapes)
    save the same bytes, so one measurement serves them all (`CostModel.build`'s bytes per role,
    as `LayerInfo.role` does for the scheduler's search). O(layers)."""
    roles = {}
    for fqn, layer in trace.layers.items():
        calls = ";".join(f"{call.key}/{call.saved_bytes}" for call in layer.calls)
        roles[fqn] = f"{fqn_pattern(fqn)}|{layer.module}|{calls}|{layer.other_saved_bytes}|{layer.param_bytes}"
    return roles


def trace_model(model: nn.Module, example_inputs: Any, loss_fn: Optional[Callable] = None, layers: Optional[Collection[str]] = None) -> ModelTrace:
    """Record the layers of ``model`` from one FP32 forward with autograd on (no backward).

    ``example_inputs``: one input, a tuple of positional inputs, a dict of keyword inputs or a
    `calls.ModelCall` (as `coverage.trace_layers`). ``loss_fn(model, example_inputs) -> loss``, when given, is run
    instead of the bare forward, so what the loss saves counts too. ``layers``: those the trace
    must see; a training-mode forward that skipped one (LayerDrop: HF's speech and translation
    models skip a layer at random while training) is traced again under another draw of the RNG
    (seeded 1, 2, ...: the same trace every run), at most `TRACE_RETRIES` times. Costs one forward
    pass (rarely a few) and its saved activations (freed on return). The model, its buffers and
    the RNG are unchanged.
    """
    for attempt in range(TRACE_RETRIES + 1):
        meter = _Attribution(model)
        recorder = _CallRecorder(meter)
        with side_effect_free(model), torch.enable_grad(), meter, recorder:
            if attempt:
                torch.manual_seed(attempt)
            output = forward_or_loss(model, example_inputs, loss_fn)
        del output
        if layers is None or {fqn for fqn, _ in recorder.calls}.issuperset(layers):
            break
    if not recorder.calls:
        raise CostModelError(
            f"{type(model).__name__} ran no matrix product in its forward on the example input, so it has "
            "no layers to cost; pass the input the model trains on"
        )
    calls: dict[str, list[MatmulCall]] = {}
    for fqn, record in recorder.calls:
        del record["ptrs"]  # addresses mean nothing once the trace's tensors are freed
        record["saved"] = tuple(record["saved"])
        calls.setdefault(fqn, []).append(MatmulCall(**record))
    other, rest = meter.split(calls)
    modules = dict(model.named_modules())
    order = [fqn for fqn in modules if fqn in calls]  # model order, as trace_layers gives
    layers = {
        fqn: LayerTrace(
            fqn=fqn,
            module=type(modules[fqn]).__name__,
            calls=tuple(calls[fqn]),
            other_saved_bytes=other[fqn],
            param_bytes=sum(p.numel() * p.element_size() for p in modules[fqn].parameters(recurse=False)),
        )
        for fqn in order
    }
    owned = {id(p) for fqn in layers for p in modules[fqn].parameters(recurse=False)}
    rest_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in owned)
    first = next(model.parameters(), None)
    run_order = tuple(dict.fromkeys(fqn for fqn, _ in recorder.calls))
    return ModelTrace(layers, rest, first.device if first is not None else torch.device("cpu"), rest_grads, run_order)


def saved_bytes_by_layer(
    model: nn.Module,
    example_inputs: Any,
    layers,
    context: Optional[Callable[[], Any]] = None,
    loss_fn: Optional[Callable] = None,
) -> tuple[dict[str, int], int]:
    """Bytes autograd saves in one forward, per layer (innermost running layer) and outside layers.

    ``layers``: the fqns that count as layers. ``context()``: entered around the forward (a
    `PlanRuntime`, ``torch.autocast``); ``None`` runs plain. The reference measurement the memory
    model is checked against. Costs one forward with autograd on (no backward).
    """
    meter = _Attribution(model, layers=set(layers))
    unknown = sorted(set(layers) - set(meter.layer_names))
    if unknown:
        raise CostModelError(f"saved_bytes_by_layer: {unknown} are not modules of {type(model).__name__}")
    with side_effect_free(model), torch.enable_grad():
        with meter, (context() if context is not None else contextlib.nullcontext()):
            output = forward_or_loss(model, example_inputs, loss_fn)
        per, rest = meter.split(layers)
        del output
    return per, rest
