"""Sensitivity: per (layer, format), the loss increase of running only that layer in that format.

Two ways to get it, with one result type (`Sensitivity`, a mapping ``(fqn, Format) -> float``):

`estimate_sensitivity` -- the prediction the search uses. Default estimator: `FisherEstimator`.

* **Forward term** (``forward``). The second-order Taylor expansion of the loss in a layer's
  output y, with the Hessian replaced by the empirical Fisher (Gauss-Newton) matrix, gives the
  loss increase of perturbing y by ``δ = y_q − y`` as ``½ δᵀ F δ`` -- the score of HAWQ-V2
  (arXiv:1911.03852, with the Hessian trace), Optimal Brain Compression (arXiv:2208.11580, layer
  by layer) and NVIDIA ModelOpt's ``auto_quantize`` (``Σ (dL/dy)² (y_q − y)²``, the diagonal). The
  first-order term is dropped: at a trained point the gradient averages to zero over the data.

  Scaling and blocks. For a loss that is the mean over N terms, ``L = (1/N) Σ_i ℓ_i``, the
  empirical Fisher is ``(1/N) Σ_i ∇ℓ_i ∇ℓ_iᵀ``; where a block B_i of the output feeds only term
  i, ``∇ℓ_i = N · dL/dy_{B_i}``, so ``½ δᵀFδ = (N/2) Σ_i (dL/dy_{B_i} · δ_{B_i})²``, averaged over
  batches, in units of the mean loss. A block is one token (a row of the last dimension) for a
  language model, one sequence for a sentence-embedding loss; ``fisher="auto"`` (default) picks
  the leading dimensions whose count is nearest to N (`_fisher_blocks`). The diagonal form
  ``(N/2) Σ (dL/dy)² δ²`` (``fisher="diagonal"``, ModelOpt's) drops the cross terms within a
  block, and so misses that a quantization error is correlated along a token (and along a
  sequence: the weight's rounding error is shared by every token); it under-predicted the
  measured second-order increase 3-10x and ranked worse on both models (figures in
  tests/test_sensitivity.py). N comes from the loss: a ``loss_fn`` returning per-term losses
  (``reduction="none"``) gives it as their count (their mean is the loss); a scalar loss takes
  ``loss_terms`` (an int or ``batch -> int``), else N = 1 (magnitudes too small by N).

  Where δ is taken (``site="parent"``, the default). A lowered layer hands the region's half
  dtype to the module that called it, whose own ops then run on half tensors too (GELU after a
  lowered ``fc``, the attention products of a module whose ``qkv`` is lowered). So the layer's
  caller (found by one traced forward; the layer itself when the model calls it directly) is
  re-run on its recorded FP32 inputs under `apply_plan` with a model-level plan in which only that
  layer is lowered and every other layer -- its children too -- stays FP32, and δ and dL/dy are
  taken at the caller's output. y_q therefore comes from the real runtime path: FP8 scaling,
  INT8 calibration (frozen first on the same batches, `_calibrate`), the BF16 output cast,
  emulation.
  Forward passes run in eval mode under ``torch.no_grad``, as the measured check does.

* **Gradient term** (``grad``). A format also changes the gradients: FP8 layers quantize the
  incoming gradient to E5M2, BF16/FP16 layers run backward in half precision, INT8 layers take the
  weight gradient from the INT8-saved activation (and, where emulated, the incoming gradient in
  INT8). Per batch, the gradient error ``e`` of every parameter is computed exactly, given the
  FP32 dL/dy at the site (times ``loss_scale``, as a loss scaler runs backward, then unscaled):
  the site's own (recursive) parameters from a local backward under the plan, every upstream
  parameter by pushing the input-gradient error back through the recorded
  FP32 graph (one vector-Jacobian product). Parameters downstream see changed gradients only
  through the forward error, which the forward term covers. Treating e as extra zero-mean
  gradient noise of covariance ``C = E[e eᵀ]``, SGD with learning rate η settles (quadratic
  model, small η) where the expected excess loss is ``(η/4) tr(C)``: the stationary covariance S
  solves ``HS + SH = ηC`` (Mandt, Hoffman & Blei, arXiv:1704.04289, eq. 11), so ``½ tr(HS) =
  (η/4) tr(C)`` whatever the curvature. With a diagonal preconditioner P (Adam: ``P = 1/(√v + ε)``,
  v the gradient second moment from the same batches) the same argument in ``P^{-1/2} θ`` gives
  ``(η/4) tr(P C)``; momentum leaves it unchanged to first order. Hence ``grad = (lr/4) · Σ_i P_i
  · mean_b(e_i²)``, for ``optimizer`` "adam" (default) or "sgd" and the given ``lr``. It is a
  steady-state estimate that no forward-only measurement validates; rank plans by the total.

`measure_sensitivity` -- the check: the real mean loss on held-out batches with only that layer
lowered (the runtime's own path), minus the FP32 loss, split into the first-order part at the
model's output (label noise: it dominates a few-batch measurement) and the second-order rest
(for a cross-entropy on logits exactly ``KL(p_fp32 ‖ p_q)``), which the forward term predicts.

`spearman` and `rank_agreement` compare the two.

Costs of `estimate_sensitivity`: three no-grad forwards to find layers and their callers; per
batch one FP32 forward + backward that records; per (layer, format, batch) one no-grad run of
the layer's caller. INT8 calibration adds ``Calibration.batches`` FP32 forwards (each INT8 layer
then replays its own inputs); the gradient term one forward + backward per batch (Adam's v)
and, per (layer, format, batch), a local backward and one partial backward of the model.
`measure_sensitivity`: one model forward per (layer, format, batch). On CPU, INT8 is the slow
format: ``torch._int_mm`` there ran ~40x slower than the FP32 matmul of the same shape
(1024x1536 @ 1536x384, one thread: 0.64 s against 0.015 s). Batches are kept in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ._tracing import module_stack
from .calls import ModelCall
from .coverage import ModuleFilter, find_layers
from .errors import FormatError, SensitivityError
from .formats import Format, Granularity
from .plan import LayerPrecision, Plan
from .runtime import apply_plan

__all__ = [
    "Sensitivity",
    "SensitivityProblem",
    "SensitivityEstimator",
    "FisherEstimator",
    "estimate_sensitivity",
    "measure_sensitivity",
    "spearman",
    "rank_agreement",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Key = tuple[str, Format]


# -- result ---------------------------------------------------------------------------------------


class Sensitivity(Mapping):
    """``(fqn, Format) -> loss increase`` (predicted or measured), in model and candidate order.

    The value is the sum of the ``total_of`` parts: for an estimate ``forward + grad``, for a
    measurement the measured ``increase``. Every part is kept (`part`): an estimate has
    ``forward`` and ``grad``; a measurement ``increase``, ``first_order`` and ``second_order``
    (see `measure_sensitivity`). Keys may use format names: ``s["lm_head", "int8"]``. Read-only.
    """

    def __init__(self, parts: Mapping[str, Mapping[Key, float]], *, total_of: Sequence[str], method: str, batches: int, metadata: "Mapping[str, Any] | None" = None):
        if not parts or any(name not in parts for name in total_of):
            raise SensitivityError(f"Sensitivity needs the parts it sums ({list(total_of)}), got {list(parts)}")
        first = next(iter(parts.values()))
        keys = [(fqn, Format.parse(fmt)) for fqn, fmt in first]
        self._parts = {}
        for name, values in parts.items():
            values = {(fqn, Format.parse(fmt)): float(v) for (fqn, fmt), v in values.items()}
            if set(values) != set(keys):
                raise SensitivityError(f"Sensitivity part {name!r} covers other (layer, format) pairs than {next(iter(parts))!r}")
            self._parts[name] = {k: values[k] for k in keys}
        self._total_of = tuple(total_of)
        self._total = {k: sum(self._parts[name][k] for name in self._total_of) for k in keys}
        self.method = method
        self.batches = int(batches)
        self.metadata = dict(metadata or {})

    @staticmethod
    def _key(key) -> Key:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise KeyError(f"Sensitivity keys are (fqn, format) pairs, got {key!r}")
        try:
            return key[0], Format.parse(key[1])
        except FormatError:
            raise KeyError(key) from None

    def __getitem__(self, key) -> float:
        return self._total[self._key(key)]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._total)

    def __len__(self) -> int:
        return len(self._total)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def part(self, name: str) -> dict[Key, float]:
        """One part as ``{(fqn, Format): value}``; ``"total"`` is the value itself."""
        if name == "total":
            return dict(self._total)
        if name not in self._parts:
            raise SensitivityError(f"part {name!r}: this {self.method} result has {', '.join(('total',) + self.parts)}")
        return dict(self._parts[name])

    @property
    def forward(self) -> dict[Key, float]:
        """An estimate's forward term, ``part("forward")``."""
        return self.part("forward")

    @property
    def grad(self) -> dict[Key, float]:
        """An estimate's gradient term, ``part("grad")``."""
        return self.part("grad")

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(fqn for fqn, _ in self._total))

    @property
    def formats(self) -> tuple[Format, ...]:
        return tuple(dict.fromkeys(fmt for _, fmt in self._total))

    def of_format(self, fmt: "Format | str", part: str = "total") -> dict[str, float]:
        """``fqn -> value`` of one part (default the total) for one format."""
        fmt = Format.parse(fmt)
        return {fqn: v for (fqn, f), v in self.part(part).items() if f is fmt}

    def to_dict(self) -> dict:
        """JSON-ready: ``{"method", "batches", "total_of", "metadata", "layers": {fqn: {fmt: {part: value, "total": value}}}}``."""
        layers: dict[str, dict] = {}
        for key, total in self._total.items():
            entry = {name: values[key] for name, values in self._parts.items()}
            entry["total"] = total
            layers.setdefault(key[0], {})[key[1].value] = entry
        return {"method": self.method, "batches": self.batches, "total_of": list(self._total_of), "metadata": dict(self.metadata), "layers": layers}

    def __repr__(self) -> str:
        return f"Sensitivity({self.method}, {len(self.layers)} layers x {len(self.formats)} formats, {self.batches} batches)"


# -- the problem an estimator solves --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SensitivityProblem:
    """Everything an estimator needs, resolved and checked by `estimate_sensitivity`.

    ``candidates``: format -> the `LayerPrecision` a lowered layer gets. ``layers``: the fqns to
    score, in model order. ``base_plan``: every covered layer FP32 (lowering one layer is
    ``base_plan.with_layers({fqn: precision})``). ``loss_terms``: see the module docstring.
    """

    model: nn.Module
    batches: tuple
    loss_fn: LossFn
    candidates: Mapping[Format, LayerPrecision]
    layers: tuple[str, ...]
    base_plan: Plan
    loss_terms: "int | Callable[[Any], int] | None" = None

    def loss(self, batch) -> tuple[torch.Tensor, int]:
        """``(mean loss, N)`` for one batch; raises `SensitivityError` on a bad loss."""
        return _loss(self.loss_fn, self.model, batch, self.loss_terms)

    def plan_for(self, fqn: str, fmt: Format) -> Plan:
        return self.base_plan.with_layers({fqn: self.candidates[fmt]})


class SensitivityEstimator:
    """Base class of sensitivity estimators (the extension point, like Optuna's samplers).

    A subclass implements `estimate`, which returns a `Sensitivity` with one entry per
    ``(fqn, format)`` of ``problem.layers x problem.candidates``: the predicted increase of the
    mean loss when only that layer runs in that format, split into a ``forward`` part (what a
    forward-only measurement sees) and a ``grad`` part (the effect of the format on training
    through gradient error). It must leave the model as it found it (parameters, gradients,
    training flag, hooks).
    """

    name = "estimator"

    def estimate(self, problem: SensitivityProblem) -> Sensitivity:
        raise NotImplementedError(f"{type(self).__name__} must implement estimate(problem) -> Sensitivity")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# -- helpers --------------------------------------------------------------------------------------


def _loss(loss_fn: LossFn, model: nn.Module, batch, loss_terms) -> tuple[torch.Tensor, int]:
    loss = loss_fn(model, batch)
    if not torch.is_tensor(loss) or not loss.is_floating_point() or loss.numel() == 0:
        raise SensitivityError(
            f"loss_fn(model, batch) returned {type(loss).__name__ if not torch.is_tensor(loss) else f'a {loss.dtype} tensor of shape {tuple(loss.shape)}'}; "
            "it must return a floating scalar loss or a tensor of per-term losses"
        )
    if loss.numel() > 1:
        n = loss.numel()
        # In float64: a measured increase of 1e-7 is below the rounding of a float32 mean near 2.
        loss = loss.double().mean()
    else:
        loss = loss.double().reshape(())
        n = loss_terms(batch) if callable(loss_terms) else (loss_terms if loss_terms is not None else 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SensitivityError(f"loss_terms gave {n!r}; it must be a positive int (the number of terms the mean loss is over)")
    if not bool(torch.isfinite(loss)):
        raise SensitivityError(f"loss_fn(model, batch) returned a non-finite loss ({float(loss.detach())}); check the model and the batch")
    return loss, n


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode (no dropout: deterministic, as a measurement must be); restores every flag."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _candidates(formats) -> dict[Format, LayerPrecision]:
    if isinstance(formats, (str, Format, LayerPrecision)):
        formats = [formats]
    out: dict[Format, LayerPrecision] = {}
    for item in formats:
        try:
            lp = item if isinstance(item, LayerPrecision) else LayerPrecision(Format.parse(item))
        except FormatError as exc:
            raise SensitivityError(f"formats: {exc}") from None
        if lp.format in out:
            raise SensitivityError(f"formats: {lp.format.value} is listed twice; give each format once")
        out[lp.format] = lp
    if not out:
        raise SensitivityError("formats is empty; pass candidates like ['fp8_e4m3', 'int8']")
    return out


def _example_from(model: nn.Module, loss_fn: LossFn, batch) -> ModelCall:
    """The model's first call in ``loss_fn(model, batch)`` (one forward, no grad)."""
    call = ModelCall.first(model, lambda: loss_fn(model, batch))
    if call is None:
        raise SensitivityError("loss_fn(model, batch) never called the model; it must run model(...) on the batch")
    return call


def _resolve(model, batches, loss_fn, formats, layers, example_inputs, loss_terms) -> SensitivityProblem:
    if not isinstance(model, nn.Module):
        raise SensitivityError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise SensitivityError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    batches = tuple(batches)
    if not batches:
        raise SensitivityError("batches is empty; pass a few batches (e.g. workload.val_batches(4))")
    candidates = _candidates(formats)
    if example_inputs is None:
        with _eval_mode(model):
            example_inputs = _example_from(model, loss_fn, batches[0])
    found = find_layers(model, example_inputs)
    if not found:
        raise SensitivityError(f"{type(model).__name__} has no layer (no module runs a matrix product); nothing to estimate")
    modules = dict(model.named_modules())
    if layers is None:
        chosen = list(found)
    elif callable(layers):
        chosen = [fqn for fqn in found if layers(modules[fqn], fqn)]
    else:
        wanted = [layers] if isinstance(layers, str) else list(layers)
        unknown = [fqn for fqn in wanted if fqn not in found]
        if unknown:
            raise SensitivityError(f"layers {unknown} are not layers of {type(model).__name__}; use names from autoprec.coverage.find_layers(model, example), e.g. {list(found)[:3]}")
        chosen = [fqn for fqn in found if fqn in set(wanted)]
    if not chosen:
        raise SensitivityError("no layer selected; the layers filter rejected every covered layer")
    base = Plan({fqn: LayerPrecision(Format.FP32) for fqn in found}, fingerprint=found)
    problem = SensitivityProblem(model, batches, loss_fn, candidates, tuple(chosen), base, loss_terms)
    # One validation up front (names the formats the device cannot run); derived plans skip it.
    for fmt in candidates:
        problem.plan_for(chosen[0], fmt).validate(model)
    return problem


def _float_leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point()]


@dataclasses.dataclass
class _Call:
    """One call of a layer's module in the recorded FP32 forward."""

    args: tuple
    kwargs: dict
    grad_mask: list  # per floating input leaf (pytree order): did it require grad
    graph_inputs: list  # the floating inputs that require grad, as they sit in the autograd graph
    outputs: list  # floating outputs, detached FP32 copies
    out_tensors: list  # the same outputs in the graph (dropped once their grads are taken)
    grads: list  # dL/dy per output (None where the loss does not depend on it)


class _Recorder:
    """Forward hooks that record, per layer, each call's inputs and outputs (``with`` scope)."""

    def __init__(self, model: nn.Module, fqns: Sequence[str]):
        modules = dict(model.named_modules())
        self.modules = {fqn: modules[fqn] for fqn in fqns}
        self.calls: dict[str, list[_Call]] = {fqn: [] for fqn in fqns}
        self._handles: list = []

    def __enter__(self):
        for fqn, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(fqn), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, fqn):
        def hook(module, args, kwargs, output):
            def detach(t):
                return t.detach() if torch.is_tensor(t) else t

            outs = _float_leaves(output)
            inputs = _float_leaves((args, kwargs))
            self.calls[fqn].append(_Call(
                args=pytree.tree_map(detach, args),
                kwargs=pytree.tree_map(detach, kwargs),
                grad_mask=[t.requires_grad for t in inputs],
                graph_inputs=[t for t in inputs if t.requires_grad],
                # A copy: an in-place op after the layer (ReLU(inplace=True)) must not change it.
                outputs=[t.detach().float().clone() for t in outs],
                out_tensors=list(outs),
                grads=[None] * len(outs),
            ))

        return hook

    def take_grads(self, loss: torch.Tensor, keep_graph: bool) -> None:
        """dL/dy for every recorded output, by one backward that touches no ``.grad``."""
        slots = [(call, i, t) for calls in self.calls.values() for call in calls for i, t in enumerate(call.out_tensors) if t.requires_grad]
        if slots:
            grads = torch.autograd.grad(loss, [t for _, _, t in slots], allow_unused=True, retain_graph=keep_graph)
            for (call, i, _), g in zip(slots, grads):
                call.grads[i] = None if g is None else g.detach().float()
        for calls in self.calls.values():
            for call in calls:
                call.out_tensors = []


def _callers(model: nn.Module, loss_fn: LossFn, batch, layers: Sequence[str]) -> dict[str, str]:
    """``layer -> fqn of the module running when the layer is first called`` (not the root);
    one forward under ``torch.no_grad``."""
    wanted = set(layers)
    callers: dict[str, str] = {}

    def record(fqn: str, stack: list) -> None:
        if fqn in wanted and fqn not in callers and stack and stack[-1] != "":
            callers[fqn] = stack[-1]

    with module_stack(model, on_enter=record), torch.no_grad():
        loss_fn(model, batch)
    return callers


def _calibrates(lp: LayerPrecision) -> bool:
    return lp.format is Format.INT8 and lp.scaling.granularity is Granularity.TENSOR


def _calibrate(problem: "SensitivityProblem", runtimes: Mapping, batches: Sequence) -> None:
    """Calibrate every INT8 single-layer runtime until its scale freezes, as in steady training.

    The layer alone is re-run under its runtime on the inputs it had in an FP32 forward: with
    only that layer lowered, everything before it is FP32, so these are exactly the inputs it
    sees in the measured run, at the cost of one model forward per batch for all layers together.
    ``batches`` are cycled until each layer has observed ``calibration.batches`` of them.
    """
    keys = [key for key in runtimes if _calibrates(problem.candidates[key[1]])]
    if not keys or not batches:
        return
    rounds = max(problem.candidates[fmt].calibration.batches for _, fmt in keys)
    fqns = list(dict.fromkeys(fqn for fqn, _ in keys))
    with torch.no_grad():
        for i in range(rounds):
            recorder = _Recorder(problem.model, fqns)
            with recorder:
                problem.loss(batches[i % len(batches)])
            for fqn, fmt in keys:
                if i < problem.candidates[fmt].calibration.batches:
                    for call in recorder.calls[fqn]:
                        with _runtime_errors(fqn, fmt), runtimes[(fqn, fmt)]:
                            recorder.modules[fqn](*call.args, **call.kwargs)


# -- the default estimator ------------------------------------------------------------------------

_FISHER_BLOCKS = ("auto", "token", "sample", "diagonal")


def _fisher_blocks(products: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """Sum ``dL/dy · δ`` within each Fisher block of an output (one value per block).

    A block is the part of the output one loss term sees: "token" = a row of the last dimension
    (a language model's loss has one term per token), "sample" = everything of one index of the
    first dimension (a sentence-embedding loss has one term per sentence pair), "diagonal" = one
    element (no cross terms). "auto" takes the leading dimensions whose count is nearest, by
    ratio, to the N terms of the loss (ties: the finer), so it picks "token" for the LM
    (16 x 64 positions, N = 1024) and "sample" for MiniLM (32 sequences, N = 16 pairs).
    """
    if mode == "diagonal" or products.dim() < 2 or products.numel() == 0:
        return products
    shape = products.shape
    if mode == "token":
        k = products.dim() - 1
    elif mode == "sample":
        k = 1
    else:
        sizes = [math.prod(shape[:k]) for k in range(1, products.dim())]
        k = 1 + min(range(len(sizes)), key=lambda i: (abs(math.log(sizes[i] / n)), -i))
    return products.reshape(math.prod(shape[:k]), -1).sum(-1)



@dataclasses.dataclass(frozen=True)
class FisherEstimator(SensitivityEstimator):
    """Fisher-weighted output error (forward) plus steady-state gradient-noise loss (grad).

    See the module docstring for both formulas and their sources. ``fisher``: "token" (default)
    or "diagonal"; ``site``: "parent" (default: the layer's caller's output) or "layer".
    ``grad_term=False`` skips the gradient part (it costs 2-5x the forward part);
    ``upstream=False`` keeps only the site's own parameters in it (skips one partial backward
    per layer, format and batch). ``optimizer`` is "adam" (v from the batches) or "sgd"; ``lr``
    the learning rate the term assumes (torch's Adam default); ``eps`` Adam's. ``loss_scale``
    multiplies dL/dy in the gradient pass as a loss scaler does (4096: DESIGN.md's initial
    dynamic scale); without it FP16 gradients of 1e-8 flush to zero, which no FP16 run allows.
    """

    grad_term: bool = True
    upstream: bool = True
    optimizer: str = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    loss_scale: float = 4096.0
    site: str = "parent"
    fisher: str = "auto"

    name = "fisher"

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise SensitivityError(f"FisherEstimator(optimizer={self.optimizer!r}): use 'adam' or 'sgd'")
        if not self.lr > 0:
            raise SensitivityError(f"FisherEstimator(lr={self.lr!r}): the learning rate must be positive")
        if not self.loss_scale > 0:
            raise SensitivityError(f"FisherEstimator(loss_scale={self.loss_scale!r}): must be positive (1.0 for none)")
        if self.fisher not in _FISHER_BLOCKS:
            raise SensitivityError(f"FisherEstimator(fisher={self.fisher!r}): use one of {', '.join(_FISHER_BLOCKS)}")
        if self.site not in ("layer", "parent"):
            raise SensitivityError(f"FisherEstimator(site={self.site!r}): use 'parent' or 'layer'")

    def sites(self, problem: SensitivityProblem) -> dict[str, str]:
        """``layer fqn -> fqn of the module whose output error is scored``.

        ``site="parent"``: the module that calls the layer (found by one traced forward), unless
        that is the model itself. A lowered layer emits the region's half dtype, and its caller's
        own ops after it (GELU, the attention products of a module whose projections are lowered)
        then run on those half tensors too -- in the measured run as here -- until the caller's
        output. ``site="layer"``: the layer's own output (cheaper, blind to that).
        """
        if self.site == "layer":
            return {fqn: fqn for fqn in problem.layers}
        callers = _callers(problem.model, problem.loss_fn, problem.batches[0], problem.layers)
        return {fqn: callers.get(fqn) or fqn for fqn in problem.layers}

    def estimate(self, problem: SensitivityProblem) -> Sensitivity:
        start = time.perf_counter()
        model = problem.model
        lowered = {f: lp for f, lp in problem.candidates.items() if f is not Format.FP32}
        params = [p for p in model.parameters() if p.requires_grad]
        grad_term = self.grad_term and bool(params)
        keys = [(fqn, fmt) for fqn in problem.layers for fmt in problem.candidates]
        forward = dict.fromkeys(keys, 0.0)
        grad = dict.fromkeys(keys, 0.0)
        # Separate runtimes for the no-grad forward (current FP8 scaling, as in the measured run)
        # and the gradient pass (which records delayed-scaling histories, as training does).
        fwd_rt = {(fqn, f): apply_plan(model, problem.plan_for(fqn, f), validate=False) for fqn in problem.layers for f in lowered}
        grad_rt = {key: apply_plan(model, problem.plan_for(*key), validate=False) for key in fwd_rt} if grad_term else {}
        with _eval_mode(model):
            sites = self.sites(problem)
            _calibrate(problem, fwd_rt, problem.batches)
            for key, rt in grad_rt.items():
                rt.load_state_dict(fwd_rt[key].state_dict())
            weight = self._second_moment(problem, params) if grad_term and self.optimizer == "adam" else None
            for batch in problem.batches:
                recorder = _Recorder(model, list(dict.fromkeys(sites.values())))
                with recorder:
                    loss, n = problem.loss(batch)
                recorder.take_grads(loss, keep_graph=grad_term and self.upstream)
                del loss
                references = {}
                for fqn in problem.layers:
                    site = sites[fqn]
                    module = recorder.modules[site]
                    for i, call in enumerate(recorder.calls[site]):
                        if all(g is None for g in call.grads):
                            continue  # the loss does not depend on this call: zero sensitivity
                        if grad_term and (site, i) not in references:
                            references[(site, i)] = self._local_grads(module, call, None)
                        for fmt in lowered:
                            with _runtime_errors(fqn, fmt):
                                forward[(fqn, fmt)] += n / 2 * self._output_error(module, call, fwd_rt[(fqn, fmt)], n)
                                if grad_term:
                                    grad[(fqn, fmt)] += self._grad_error(module, call, grad_rt[(fqn, fmt)], references[(site, i)], params, weight)
                del recorder, references
        b = len(problem.batches)
        forward = {k: v / b for k, v in forward.items()}
        grad = {k: self.lr / 4 * v / b for k, v in grad.items()}
        meta = {"estimator": repr(self), "seconds": round(time.perf_counter() - start, 3)}
        return Sensitivity({"forward": forward, "grad": grad}, total_of=("forward", "grad"), method=self.name, batches=b, metadata=meta)

    def _second_moment(self, problem, params) -> list[torch.Tensor]:
        """Adam's preconditioner ``1 / (√v + ε)``, v = mean_b g_b² of the FP32 parameter
        gradients over the batches (one forward + backward each)."""
        v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for batch in problem.batches:
            loss, _ = problem.loss(batch)
            for acc, g in zip(v, torch.autograd.grad(loss, params, allow_unused=True)):
                if g is not None:
                    acc.add_(g.detach().float().square())
        b = len(problem.batches)
        return [1.0 / ((acc / b).sqrt() + self.eps) for acc in v]

    def _output_error(self, module, call: _Call, runtime, n: int) -> float:
        """``Σ_blocks (dL/dy_B · (y_q − y)_B)²`` for one call (see `_fisher_blocks`), y_q from the
        module re-run under the runtime."""
        with torch.no_grad(), runtime:
            out = module(*call.args, **call.kwargs)
        total = 0.0
        for y, y_q, g in zip(call.outputs, _float_leaves(out), call.grads):
            if g is not None:
                products = _fisher_blocks(g * (y_q.float() - y), n, self.fisher)
                total += float(products.square().sum(dtype=torch.float64))
        return total

    def _local_grads(self, module, call: _Call, runtime) -> tuple[list, list]:
        """Gradients of the module's inputs and (recursive) parameters against the recorded dL/dy,
        the module re-run alone under ``runtime`` (None: plain FP32); backward after the context
        exits, as in training."""
        leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
        floats = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.is_floating_point()]
        inputs = []
        for i, needed in zip(floats, call.grad_mask):
            if needed:
                leaves[i] = leaves[i].detach().requires_grad_(True)
                inputs.append(leaves[i])
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        own = [p for p in module.parameters() if p.requires_grad]
        with torch.enable_grad(), (runtime if runtime is not None else contextlib.nullcontext()):
            out = module(*args, **kwargs)
        pairs = [(y, g) for y, g in zip(_float_leaves(out), call.grads) if g is not None and y.requires_grad]
        if not pairs or not (inputs or own):
            return [None] * len(inputs), [None] * len(own)
        scale = self.loss_scale
        grads = torch.autograd.grad([y for y, _ in pairs], inputs + own, [(g * scale).to(y.dtype) for y, g in pairs], allow_unused=True)
        grads = [None if g is None else g.float() / scale for g in grads]
        return grads[: len(inputs)], grads[len(inputs) :]

    def _grad_error(self, module, call: _Call, runtime, reference, params, weight) -> float:
        """Σ_i P_i e_i² over all parameters for one call: own parameters from the local backward,
        upstream ones through one vector-Jacobian product of the FP32 graph."""
        dx_q, dw_q = self._local_grads(module, call, runtime)
        dx, dw = reference
        w_of = {id(p): w for p, w in zip(params, weight)} if weight is not None else {}

        def weighted(p, e) -> float:
            e2 = e.float().square()
            if w_of:
                e2 = e2 * w_of[id(p)]
            return float(e2.sum(dtype=torch.float64))

        total = 0.0
        own = [p for p in module.parameters() if p.requires_grad]
        for p, a, b in zip(own, dw_q, dw):
            if a is not None or b is not None:
                total += weighted(p, (a if a is not None else 0.0) - (b if b is not None else torch.zeros_like(a)))
        if self.upstream:
            errors = [(x, a.float() - b.float()) for x, a, b in zip(call.graph_inputs, dx_q, dx) if a is not None and b is not None]
            if errors:
                ups = torch.autograd.grad([x for x, _ in errors], params, [e.to(x.dtype) for x, e in errors], retain_graph=True, allow_unused=True)
                owned = {id(p) for p in own}
                for p, u in zip(params, ups):
                    if u is not None and id(p) not in owned:
                        total += weighted(p, u)
        return total


# -- public functions -----------------------------------------------------------------------------


def estimate_sensitivity(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFn,
    formats: "Iterable[Format | str | LayerPrecision]",
    layers: "Iterable[str] | ModuleFilter | None" = None,
    example_inputs: Any = None,
    *,
    estimator: "SensitivityEstimator | None" = None,
    loss_terms: "int | Callable[[Any], int] | None" = None,
) -> Sensitivity:
    """Predicted loss increase per (layer, format) when only that layer runs in that format.

    ``loss_fn(model, batch)`` returns the mean loss, or per-term losses (then their mean is the
    loss and their count N scales the Fisher; see the module docstring, or pass ``loss_terms``).
    ``formats``: candidates as names, `Format` or `LayerPrecision` (to set scaling/calibration).
    ``layers``: fqns, a ``(module, fqn) -> bool`` filter, or None for every covered layer; layers
    are traced from the model's inputs in the first batch unless ``example_inputs`` is given.
    ``estimator`` defaults to `FisherEstimator()`. The model is left as it was (training flag,
    ``.grad``, hooks); batches are kept in memory for the passes over them.
    """
    problem = _resolve(model, batches, loss_fn, formats, layers, example_inputs, loss_terms)
    estimator = estimator if estimator is not None else FisherEstimator()
    if not isinstance(estimator, SensitivityEstimator):
        raise SensitivityError(f"estimator must be a SensitivityEstimator, got {type(estimator).__name__}")
    return estimator.estimate(problem)


def measure_sensitivity(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFn,
    formats: "Iterable[Format | str | LayerPrecision]",
    layers: "Iterable[str] | ModuleFilter | None" = None,
    example_inputs: Any = None,
    *,
    calibration_batches: "Iterable | None" = None,
) -> Sensitivity:
    """The real increase of the mean loss on ``batches`` with only one layer lowered at a time.

    Runs ``apply_plan(model, <all FP32, that layer in fmt>)`` in eval mode under
    ``torch.no_grad``: the measured path is the runtime's own. INT8 layers are calibrated first,
    until their scale freezes, on ``calibration_batches`` (default: ``batches``; see
    `_calibrate`). An FP32 candidate is exactly 0 (the runtime installs nothing). Costs one
    forward per (layer, format, batch), one FP32 forward per batch with a backward through the
    loss only, and ``Calibration.batches`` forwards for INT8 calibration.

    Parts (mean over batches): ``increase`` = ``L_q − L``, the value; ``first_order`` =
    ``Σ dL/dz · (z_q − z)`` with z the model's output (what ``loss_fn`` computes the loss from);
    ``second_order`` = ``increase − first_order``. The first-order part is the noise of a
    held-out measurement: it depends on the labels, averages to zero at a trained point, and on
    a few batches it swamps the effect of the format (a 16-pair MiniLM batch: ~1e-3 either way,
    against increases of 1e-5 to 1e-3). The second-order part is what is left: label-free for a
    cross-entropy on logits, where it is exactly ``KL(p_fp32 ‖ p_q)`` (the expected increase
    with targets drawn from the model), and what the Fisher forward term predicts.
    """
    problem = _resolve(model, batches, loss_fn, formats, layers, example_inputs, None)
    calibration = tuple(calibration_batches) if calibration_batches is not None else problem.batches
    start = time.perf_counter()
    increase, first = {}, {}
    with _eval_mode(model):
        reference = []  # per batch: (loss, model outputs, dL/d outputs)
        for batch in problem.batches:
            with _OutputTap(model, grad=True) as tap:
                loss, _ = problem.loss(batch)
            wanted = [z for z in tap.outputs if z.requires_grad]
            grads = torch.autograd.grad(loss, wanted, allow_unused=True) if wanted and loss.requires_grad else [None] * len(wanted)
            reference.append((float(loss.detach()), [z.detach() for z in tap.outputs], dict(zip(map(id, wanted), grads)), [id(z) for z in tap.outputs]))
        runtimes = {(fqn, fmt): apply_plan(model, problem.plan_for(fqn, fmt), validate=False) for fqn in problem.layers for fmt in problem.candidates if fmt is not Format.FP32}
        _calibrate(problem, runtimes, calibration)
        with torch.no_grad():
            for fqn in problem.layers:
                for fmt in problem.candidates:
                    if fmt is Format.FP32:
                        increase[(fqn, fmt)] = first[(fqn, fmt)] = 0.0
                        continue
                    runtime = runtimes[(fqn, fmt)]
                    inc = fo = 0.0
                    for batch, (base, z, g_of, ids) in zip(problem.batches, reference):
                        with _OutputTap(model, grad=False) as tap, _runtime_errors(fqn, fmt), runtime:
                            loss_q, _ = problem.loss(batch)
                        inc += float(loss_q) - base
                        for z_ref, z_q, i in zip(z, tap.outputs, ids):
                            g = g_of.get(i)
                            if g is not None:
                                fo += float((g.float() * (z_q.float() - z_ref.float())).sum(dtype=torch.float64))
                    increase[(fqn, fmt)] = inc / len(reference)
                    first[(fqn, fmt)] = fo / len(reference)
    second = {k: increase[k] - first[k] for k in increase}
    meta = {"base_loss": sum(r[0] for r in reference) / len(reference), "seconds": round(time.perf_counter() - start, 3)}
    return Sensitivity(
        {"increase": increase, "first_order": first, "second_order": second},
        total_of=("increase",), method="measured", batches=len(reference), metadata=meta,
    )


class _OutputTap:
    """Records the model's floating outputs (every call, in order). With ``grad=True`` the model
    itself runs without autograd and its outputs come back as fresh leaves that require grad,
    so dL/dz costs a backward through the loss only."""

    def __init__(self, model: nn.Module, grad: bool):
        self.model = model
        self.grad = grad
        self.outputs: list[torch.Tensor] = []
        self._handles: list = []
        self._modes: list[bool] = []

    def __enter__(self):
        def pre(module, args):
            self._modes.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)

        def post(module, args, output):
            if not self.grad:
                self.outputs.extend(_float_leaves(output))
                return None
            torch.set_grad_enabled(self._modes.pop())

            def leaf(t):
                if torch.is_tensor(t) and t.is_floating_point():
                    t = t.detach().requires_grad_(True)
                    self.outputs.append(t)
                return t

            return pytree.tree_map(leaf, output)

        if self.grad:
            self._handles.append(self.model.register_forward_pre_hook(pre))
            self._handles.append(self.model.register_forward_hook(post, always_call=True))
        else:
            self._handles.append(self.model.register_forward_hook(post))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def _runtime_errors(fqn: str, fmt: Format):
    """Name the (layer, format) when the runtime cannot run a single-layer plan."""
    try:
        yield
    except (RuntimeError, TypeError) as exc:
        raise SensitivityError(
            f"the runtime cannot run {fqn!r} in {fmt.value} alone: {str(exc).splitlines()[0]}; "
            "leave this layer or format out (layers=..., formats=...)"
        ) from exc


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their average rank (Spearman's convention)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    values, inverse = np.unique(x, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    return (sums / counts)[inverse]


def spearman(a: "Sequence[float] | Mapping", b: "Sequence[float] | Mapping") -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks (ties averaged).

    Two sequences of equal length, or two mappings (compared on their common keys; they must
    have the same keys). NaN when either side is constant (no ranking to agree with).
    """
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            raise SensitivityError("spearman: pass two sequences or two mappings, not one of each")
        if set(a) != set(b):
            missing = sorted(map(str, set(a) ^ set(b)))[:5]
            raise SensitivityError(f"spearman: the mappings have different keys (e.g. {missing}); compare results for the same layers and formats")
        keys = list(a)
        a, b = [a[k] for k in keys], [b[k] for k in keys]
    try:
        x = np.asarray(a, dtype=np.float64).reshape(-1)
        y = np.asarray(b, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise SensitivityError("spearman: values must be numbers") from None
    if x.shape != y.shape:
        raise SensitivityError(f"spearman: lengths differ ({x.size} vs {y.size}); pass paired values")
    if x.size < 2:
        raise SensitivityError(f"spearman: needs at least 2 pairs, got {x.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise SensitivityError("spearman: values must be finite (got NaN or inf)")
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    if denom == 0:
        return math.nan
    return float((rx * ry).sum() / denom)


def rank_agreement(predicted: Sensitivity, measured: Sensitivity, predicted_part: str = "forward", measured_part: str = "second_order") -> dict[str, float]:
    """Spearman between a prediction and a measurement: per format across layers, and ``"all"``
    across every (layer, format) pair. Defaults compare like with like: the forward term with
    the label-free second-order part of the measurement (``measured_part="increase"`` for the
    raw increase, ``predicted_part="total"`` for the ranking the search uses)."""
    if set(predicted) != set(measured):
        raise SensitivityError("rank_agreement: the two results cover different (layer, format) pairs; estimate and measure the same layers and formats")
    pred, meas = predicted.part(predicted_part), measured.part(measured_part)
    out = {}
    for fmt in predicted.formats:
        keys = [k for k in pred if k[1] is fmt]
        if len(keys) >= 2:
            out[fmt.value] = spearman([pred[k] for k in keys], [meas[k] for k in keys])
    keys = list(pred)
    out["all"] = spearman([pred[k] for k in keys], [meas[k] for k in keys])
    return out
