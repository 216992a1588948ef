"""Which modules are layers: coverage by operation, not by module class.

A *layer* is any module whose own forward runs a matrix product (linear, matmul, mm, addmm, bmm,
baddbmm, einsum, convolution, attention), whatever its class. A projection that stores its weight
transposed and calls ``torch.addmm`` is a layer just like ``nn.Linear``; ``nn.MultiheadAttention``
is one layer (its ``out_proj`` child never runs as a module).

Two ways to find layers:
- from the module tree alone (`static_layers`): the classes known to run matrix products, and
  every other module holding a matrix (2-D) parameter whose own forward, run once on a 2-row
  input, runs one (GPT-2's ``Conv1D``: an (in, out) weight and ``torch.addmm``);
- by tracing one forward pass (`trace_layers`): a `TorchFunctionMode` records, for every matrix
  product, the innermost module running at that moment. This is the truth, and finds hand-written
  layers the tree cannot show. Costs one forward pass under ``torch.no_grad``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Container, Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._tracing import module_stack, side_effect_free
from .calls import ModelCall

__all__ = [
    "covered_layers",
    "changed_shapes",
    "MATMUL_OPS",
    "LayerInfo",
    "static_layers",
    "trace_layers",
    "find_layers",
    "ModuleFilter",
    "layer_name",
    "fqn_pattern",
    "enclosing_layer",
]

# Function object -> the op name recorded for it. Tensor methods and torch functions are distinct
# objects at the __torch_function__ level, so both are listed.
MATMUL_OPS: dict[Callable, str] = {
    F.linear: "linear",
    F.bilinear: "bilinear",
    torch.matmul: "matmul",
    torch.Tensor.matmul: "matmul",
    torch.Tensor.__matmul__: "matmul",
    torch.Tensor.__rmatmul__: "matmul",
    torch.mm: "mm",
    torch.Tensor.mm: "mm",
    torch.addmm: "addmm",
    torch.Tensor.addmm: "addmm",
    torch.bmm: "bmm",
    torch.Tensor.bmm: "bmm",
    torch.baddbmm: "baddbmm",
    torch.Tensor.baddbmm: "baddbmm",
    torch.addbmm: "addbmm",
    torch.Tensor.addbmm: "addbmm",
    torch.mv: "mv",
    torch.Tensor.mv: "mv",
    torch.addmv: "addmv",
    torch.Tensor.addmv: "addmv",
    torch.einsum: "einsum",
    torch.tensordot: "tensordot",
    F.conv1d: "conv1d",
    F.conv2d: "conv2d",
    F.conv3d: "conv3d",
    F.conv_transpose1d: "conv_transpose1d",
    F.conv_transpose2d: "conv_transpose2d",
    F.conv_transpose3d: "conv_transpose3d",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    F.multi_head_attention_forward: "multi_head_attention",
}
# Grouped GEMMs: one product per group of rows, each with its own weight (a mixture of experts'
# (experts, in, out) weights, as transformers' default experts implementation runs them). Torch
# 2.11 and 2.13 have both names; neither is autocast-enabled.
MATMUL_OPS.update({fn: "grouped_mm" for fn in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if fn is not None})

# Classes known to run matrix products in their own forward, with the op they run.
_KNOWN_CLASSES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.MultiheadAttention, "multi_head_attention"),
)

logger = logging.getLogger(__name__)

# Training calls a trace makes at most when layers come and go between draws (LayerDrop, p <= 0.1:
# a layer missed by 6 draws: 1e-6).
TRACE_DRAWS = 6

ModuleFilter = Callable[[nn.Module, str], bool]
"""``(module, fqn) -> bool``: False keeps a layer out of low precision (torchao's module_filter_fn)."""


def fqn_pattern(fqn: str) -> str:
    """``fqn`` with its numeric parts (block indices) as ``*``: what the same layer of every
    block shares, e.g. ``"blocks.*.mlp.fc"``."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def layer_name(fqn: str, root: "nn.Module | str") -> str:
    """A layer as people read it (logs, errors, review): its fqn, except the model's root (fqn
    ``""``, a model that is itself one layer such as a bare ``nn.Linear``), named by its class,
    e.g. ``"Linear"``. ``root``: the model (for the root, the layer's own module), or its class
    name (a fingerprint's ``module``). Data (plans, state dicts, reports) keep the fqn ``""``,
    the name ``named_modules()`` and torchao's ``module_filter_fn`` give the root."""
    if fqn:
        return fqn
    return root if isinstance(root, str) else type(root).__name__


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What a plan fingerprints about a layer: its class, the ops it runs, its own parameter
    shapes, and ``batched``: those of its ops a trace saw run on batched operands (a second
    operand that is not one matrix, as attention's ``q @ k.transpose(-2, -1)``), which no FP8 /
    INT8 kernel takes (`runtime.layers.as_gemm`), so a low-precision plan emulates them."""

    module: str
    ops: tuple[str, ...]
    params: Mapping[str, tuple[int, ...]]
    batched: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {"module": self.module, "ops": list(self.ops), "params": {k: list(v) for k, v in self.params.items()}}
        if self.batched:  # absent when empty: the fingerprints of other layers read as before
            out["batched"] = list(self.batched)
        return out

    def role(self, fqn: str) -> str:
        """What layers of one role share: the fqn with its numeric parts (block indices) as
        ``*``, the class, the ops and the parameter shapes. The layers of one role (the same
        projection in every block of a transformer) cost the same seconds and bytes, so one
        measurement serves them all (the scheduler's search)."""
        pattern = fqn_pattern(fqn)
        shapes = ",".join(f"{k}{list(v)}" for k, v in sorted(self.params.items()))
        return f"{pattern}|{self.module}|{','.join(self.ops)}|{shapes}"

    @classmethod
    def from_dict(cls, data: Mapping) -> "LayerInfo":
        """The entry a plan or profile file holds; `ValueError` naming the field that is wrong."""
        if not isinstance(data, Mapping) or not {"module", "ops", "params"} <= set(data):
            raise ValueError("must be an object with 'module', 'ops' and 'params'")
        if not isinstance(data["module"], str):
            raise ValueError(f".module: expected a class name, got {data['module']!r}")
        if not isinstance(data["ops"], (list, tuple)) or not all(isinstance(op, str) for op in data["ops"]):
            raise ValueError(f".ops: expected a list of op names, got {data['ops']!r}")
        if not isinstance(data["params"], Mapping):
            raise ValueError(f".params: expected an object mapping parameter names to shapes, got {data['params']!r}")
        for name, shape in data["params"].items():
            if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f".params[{name!r}]: expected a shape, a list of non-negative integers, got {shape!r}")
        weight = data["params"].get("weight")
        if data["module"] == "Linear" and weight is not None and len(weight) != 2:
            # nn.Linear's weight is (out_features, in_features); export and the cost model read it so.
            raise ValueError(f".params['weight']: a Linear's weight is a matrix [out_features, in_features], got {list(weight)!r}; fix the shape in the file")
        batched = data.get("batched", [])
        if not isinstance(batched, (list, tuple)) or not all(isinstance(op, str) and op in data["ops"] for op in batched):
            raise ValueError(f".batched: expected a list of names from .ops, got {batched!r}")
        return cls(
            module=data["module"],
            ops=tuple(data["ops"]),
            params={k: tuple(v) for k, v in data["params"].items()},
            batched=tuple(batched),
        )

    @classmethod
    def of(cls, module: nn.Module, ops: Iterable[str], batched: Iterable[str] = ()) -> "LayerInfo":
        params = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
        return cls(module=type(module).__name__, ops=tuple(sorted(set(ops))), params=params, batched=tuple(sorted(set(batched))))


# Modules with a matrix parameter that is a table, not a matrix-product operand.
_LOOKUP_CLASSES = (nn.Embedding, nn.EmbeddingBag)


def _probed_ops(module: nn.Module) -> set[str]:
    """The matrix-product ops ``module``'s own forward runs on a 2-row input of ones whose width
    is one of its 2-D parameters' dimensions (either weight layout); empty if none runs or the
    module does not take such an input."""
    for p in module.parameters(recurse=False):
        if p.dim() != 2 or not p.is_floating_point():
            continue
        for width in dict.fromkeys(p.shape):
            try:
                ops = trace_layers(module, torch.ones(2, width, dtype=p.dtype, device=p.device)).get("")
            except Exception as exc:  # a module that takes other inputs: not provable from the tree
                logger.debug("probing %s with width %d: %s", type(module).__name__, width, exc)
                continue
            if ops is not None:
                return set(ops.ops)
    return set()


def static_layers(model: nn.Module) -> dict[str, LayerInfo]:
    """Layers the module tree shows, in model order: the known classes, plus every other module
    with its own 2-D parameter whose forward runs a matrix product on a probe input.

    Costs one no-grad forward of each such module on a 2-row input (per weight dimension until
    one runs), with buffers and the RNG left as they were; known classes cost nothing. Misses
    modules that run a matrix product without a matrix parameter of their own (attention
    score products): trace an example input (`trace_layers`) for those.
    """
    layers: dict[str, LayerInfo] = {}
    inside_mha: list[str] = []
    for fqn, module in model.named_modules():
        # MultiheadAttention runs its projections functionally; its out_proj child never runs.
        # The root's fqn is "", so its children are "out_proj", not ".out_proj".
        if any(fqn.startswith(prefix + ".") if prefix else fqn != "" for prefix in inside_mha):
            continue
        known = next((op for cls, op in _KNOWN_CLASSES if isinstance(module, cls)), None)
        if known is not None:
            layers[fqn] = LayerInfo.of(module, [known])
            if isinstance(module, nn.MultiheadAttention):
                inside_mha.append(fqn)
        elif not isinstance(module, _LOOKUP_CLASSES):
            ops = _probed_ops(module)
            if ops:
                layers[fqn] = LayerInfo.of(module, ops)
    return layers


def _batched(op: str, func: Callable, args: tuple) -> bool:
    """Whether a ``matmul`` call multiplies batched operands: its second operand is not one
    matrix or its first not at least one (as in `runtime.layers.as_gemm`, which then finds no
    2-D GEMM); a grouped GEMM always. The other kernel ops (linear, mm, addmm) take matrices by
    definition."""
    if op == "grouped_mm":
        return True  # one weight per group: no single 2-D GEMM
    if op != "matmul" or len(args) < 2:
        return False
    x, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else (args[0], args[1])
    return not (torch.is_tensor(x) and torch.is_tensor(b) and x.dim() >= 2 and b.dim() == 2)


class _MatmulRecorder(TorchFunctionMode):
    """Records which module (innermost on the stack) runs which matrix-product op, and which
    ops it runs on batched operands (`_batched`)."""

    def __init__(self, stack: list[str], seen: dict[str, set[str]], batched: dict[str, set[str]]):
        super().__init__()
        self.stack = stack
        self.seen = seen
        self.batched = batched

    def __torch_function__(self, func, types, args=(), kwargs=None):
        op = MATMUL_OPS.get(func)
        if op is not None and self.stack:
            self.seen.setdefault(self.stack[-1], set()).add(op)
            if _batched(op, func, args):
                self.batched.setdefault(self.stack[-1], set()).add(op)
        return func(*args, **(kwargs or {}))


def trace_layers(model: nn.Module, example_inputs: Any) -> dict[str, LayerInfo]:
    """Layers found by running ``model(example_inputs)`` once under ``torch.no_grad``, in model order.

    ``example_inputs`` is one input, a tuple of positional inputs, a dict of keyword inputs or a
    `calls.ModelCall` (positional and keyword inputs together).
    A model in training mode is traced twice under two draws of the RNG; when the second sees
    other layers (LayerDrop skips layers at random in a training call), up to `TRACE_DRAWS`
    times, a layer being what runs in any. The model's modules, hooks, buffers (BatchNorm
    statistics) and the global RNG state are exactly as before when this returns, also if it raises.
    """
    call = ModelCall.of(example_inputs)
    seen: dict[str, set[str]] = {}
    batched: dict[str, set[str]] = {}
    # Tracing must not consume random numbers (dropout) that the real run would draw.
    with side_effect_free(model), module_stack(model) as stack, torch.no_grad(), _MatmulRecorder(stack, seen, batched):
        call(model)
        # Stochastic depth (LayerDrop: HF's speech and translation models skip a layer at random
        # while training) hides layers from one training call: a second draw (seeded, so every run
        # traces alike) that sees other layers shows it, and the calls go on to `TRACE_DRAWS`, a
        # layer being what runs in any of them. Not eval mode: a mode switch may itself write the
        # weights (RWKV rescales them).
        first = {fqn: set(ops) for fqn, ops in seen.items()} if model.training else None
        for draw in range(1, TRACE_DRAWS if model.training else 1):
            torch.manual_seed(draw)
            call(model)
            if draw == 1 and seen == first:
                break  # the same layers under another draw: none is skipped at random
    modules = dict(model.named_modules())
    return {fqn: LayerInfo.of(module, seen[fqn], batched.get(fqn, ())) for fqn, module in modules.items() if fqn in seen}


def find_layers(model: nn.Module, example_inputs: Any = None) -> dict[str, LayerInfo]:
    """Traced layers when an example input is given, else the module tree's layers."""
    if example_inputs is None:
        return static_layers(model)
    return trace_layers(model, example_inputs)



def covered_layers(model: nn.Module, example_inputs: Any, fingerprint: Mapping[str, LayerInfo]) -> dict[str, LayerInfo]:
    """The layers an artifact (plan, profile) made for ``model`` must cover: `find_layers`, and,
    without an example input, reconciled with the trace ``fingerprint`` remembers (one definition
    of a layer for the trace, this check and the plan). The layers only a trace finds (hand-written
    matmul modules, attention products) are added. A module-tree layer the fingerprint lacks is
    not demanded when the fingerprint is a trace's, which saw it not run as a layer: when one of
    the fingerprint's layers holds it (Mamba's mixer multiplies its ``conv1d`` and ``dt_proj``
    weights itself), or when the fingerprint holds layers the module tree cannot show, so a trace
    made it (a decoder-only model's cross-attention projections never run). Costs `find_layers`
    plus each layer's nesting depth."""
    covered = find_layers(model, example_inputs)
    if example_inputs is None and fingerprint:
        modules = dict(model.named_modules())
        traced = any(fqn in modules and fqn not in covered for fqn in fingerprint)
        for fqn in [f for f in covered if f not in fingerprint and (traced or enclosing_layer(f, fingerprint) is not None)]:
            del covered[fqn]
        for fqn, info in fingerprint.items():
            if fqn in modules:
                covered.setdefault(fqn, info)
    return covered


def enclosing_layer(fqn: str, layers: Container[str]) -> "str | None":
    """The innermost of ``layers`` holding module ``fqn`` (the root ``""`` too), or None. Walks
    ``fqn``'s dotted prefixes: costs its depth, not the number of layers."""
    if not fqn:
        return None
    parts = fqn.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return "" if "" in layers else None


def changed_shapes(model: nn.Module, fingerprint: Mapping[str, LayerInfo], layers: "Iterable[str] | None" = None):
    """``(fqn, shapes now, shapes fingerprinted)`` for each fingerprinted layer of ``model`` (of
    ``layers`` when given) whose own parameters' shapes differ: the artifact was made for
    another model."""
    modules = dict(model.named_modules())
    wanted = set(layers) if layers is not None else None
    for fqn, info in fingerprint.items():
        if fqn in modules and (wanted is None or fqn in wanted):
            actual = dict(LayerInfo.of(modules[fqn], info.ops).params)
            if actual != dict(info.params):
                yield fqn, actual, dict(info.params)
