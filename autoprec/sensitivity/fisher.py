"""`FisherEstimator` (the default estimator: forward term from the empirical Fisher at the layer's
caller, gradient term from the exact gradient error; its docstring gives the method) and
`estimate_sensitivity` / `sensitivity_steps`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Generator, Iterable, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .._generators import Pace, at_once, drain
from ..coverage import LayerInfo, ModuleFilter
from ..errors import SensitivityError
from ..formats import Format
from ..plan import LayerPrecision, ScalingMode
from ..runtime import apply_plan, removing
from ..runtime.model_index import ModelIndex
from ..scaling import DEFAULT_INIT_SCALE
from .problem import (
    CallRecorder, LossFn, RecordedCall, Sensitivity, SensitivityEstimator, SensitivityProblem, calibration_steps, eval_mode, float_leaves,
    layer_callers, layers_run_within, failing_formats, resolve_problem,
)
from .upstream import input_directions

__all__ = ["FisherEstimator", "adam_second_moment", "estimate_sensitivity", "sensitivity_steps"]

logger = logging.getLogger(__name__)
T = TypeVar("T")



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

    **Forward term.** The second-order Taylor expansion of the loss in a layer's output y, the
    Hessian replaced by the empirical Fisher (Gauss-Newton) matrix, gives the loss increase of
    perturbing y by ``δ = y_q − y`` as ``½ δᵀ F δ``: the score of HAWQ-V2 (arXiv:1911.03852, with
    the Hessian trace), Optimal Brain Compression (arXiv:2208.11580) and NVIDIA ModelOpt's
    ``auto_quantize`` (``Σ (dL/dy)² (y_q − y)²``, the diagonal). The first-order term is dropped:
    at a trained point the gradient averages to zero over the data. For a loss that is the mean
    over N terms, where a block B_i of the output feeds only term i, ``½ δᵀFδ = (N/2) Σ_i
    (dL/dy_{B_i} · δ_{B_i})²``, averaged over batches, in units of the mean loss. A block is one
    token for a language model, one sequence for a sentence-embedding loss; ``fisher="auto"``
    picks the leading dimensions whose count is nearest to N (`_fisher_blocks`). The diagonal
    form (``fisher="diagonal"``, ModelOpt's) drops the cross terms within a block, so it misses
    that a quantization error is correlated along a token (the weight's rounding error is shared
    by every token); it under-predicted the measured second-order increase 3-10x and ranked worse
    on both models (figures in tests/sensitivity/test_sensitivity.py). N comes from the loss: per-term losses
    (``reduction="none"``) give it as their count; a scalar loss takes ``loss_terms`` (an int or
    ``batch -> int``), else N = 1 (magnitudes too small by N).

    **Where δ is taken** (``site="parent"``, default). A lowered layer hands the region's half
    dtype to its caller, whose own ops then run on half tensors too (GELU after a lowered ``fc``,
    the attention products after a lowered ``qkv``). So the caller (found by one traced forward;
    the layer itself when the model calls it directly) is re-run on its recorded FP32 inputs with
    only that layer lowered, and δ and dL/dy are taken at its output. ``site="layer"``: the
    layer's own output (cheaper, blind to that). Runs are in eval mode.

    **Gradient term.** FP8 layers quantize the incoming gradient to E5M2, BF16/FP16 layers run
    backward in half precision, INT8 layers take the weight gradient from the INT8-saved
    activation. Per batch the gradient error ``e`` of every parameter is computed exactly, given
    the FP32 dL/dy at the site (times ``loss_scale``, then unscaled): the site's own parameters
    from a local backward under the plan, every upstream parameter by one vector-Jacobian product
    of the recorded FP32 graph (``upstream=False`` skips it; ``upstream="sampled"`` estimates the
    same quadratic form in the input-gradient error from ``probes`` random parameter directions
    per batch shared by every layer and format: `input_directions`, linear in the layers).
    Treating e as zero-mean gradient noise of covariance C, SGD with learning rate η settles
    where the expected excess loss is ``(η/4) tr(C)`` (Mandt, Hoffman & Blei, arXiv:1704.04289, eq. 11, whatever the curvature);
    with Adam's preconditioner ``P = 1/(√v + ε)`` it is ``(η/4) tr(P C)``. Hence ``grad = (lr/4)
    · Σ_i P_i · mean_b(e_i²)``: a steady-state estimate no forward-only measurement validates;
    rank plans by the total.

    **Costs**: two no-grad forwards (layers, callers); per batch one FP32 forward + backward that
    records; INT8 calibration ``min(Calibration.batches, batches)`` FP32 forwards, each INT8
    layer then replaying its inputs; Adam's v one forward + backward per batch (none when the
    problem carries the optimizer's, `adam_second_moment`); per (layer,
    format, batch) one run of the site with grad and its local backward (a delayed-scaling
    format: one more no-grad run), plus one partial backward of the model with ``upstream=True``.

    ``fisher``: "auto" (default), "token", "sample" or "diagonal"; ``site``: "parent" or "layer".
    ``grad_term=False`` skips the gradient part (it costs 2-5x the forward part);
    ``upstream=False`` keeps only the site's own parameters in it (skips one partial backward
    per layer, format and batch; with ``site="layer"`` a site scores only the parameters no
    other layer inside it owns, so an attention module whose projections are layers runs its
    formats without grad); ``upstream="sampled"`` keeps those parameters too and adds the
    upstream term's unbiased estimate (no partial backward: ``2 * probes`` no-grad forwards per
    batch, ``probes`` BF16 copies of the sites' inputs held while the batch's units run).
    ``optimizer`` is "adam" (v from the batches) or "sgd"; ``lr`` the learning rate the term
    assumes (torch's Adam default); ``eps`` Adam's. ``loss_scale`` multiplies dL/dy in the gradient pass as a loss scaler does (default: the loss scaler's
    initial dynamic scale); without it FP16 gradients of 1e-8 flush to zero, which no FP16 run allows.
    """

    grad_term: bool = True
    upstream: "bool | str" = True
    optimizer: str = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    loss_scale: float = DEFAULT_INIT_SCALE
    site: str = "parent"
    fisher: str = "auto"
    probes: int = 4

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
        if self.upstream not in (True, False, "sampled"):
            raise SensitivityError(f"FisherEstimator(upstream={self.upstream!r}): use True (exact), 'sampled' or False")
        if not (isinstance(self.probes, int) and self.probes > 0):
            raise SensitivityError(f"FisherEstimator(probes={self.probes!r}): use a positive int (directions per batch)")

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
        callers = layer_callers(problem.model, problem.loss_fn, problem.batches[0], problem.layers)
        return {fqn: callers.get(fqn) or fqn for fqn in problem.layers}

    def estimate(self, problem: SensitivityProblem) -> Sensitivity:
        return drain(self.estimate_steps(problem))

    def estimate_steps(self, problem: SensitivityProblem) -> Generator[str, None, Sensitivity]:
        """`estimate` in units, each at most one model forward + backward (INT8 calibration
        rounds, the Adam second moment, one recorded batch) or one (layer, format, call) re-run
        of the layer's site. The model stays in eval mode with the single-layer runtimes
        installed until the generator ends: give it a model nothing else runs meanwhile (the
        scheduler gives it a snapshot). ``metadata["seconds"]`` counts the units' own time."""
        busy = 0.0
        units = self._units(problem)
        while True:
            start = time.perf_counter()
            try:
                label = next(units)
            except StopIteration as done:
                forward, grad, input_grad, b, failed = done.value
                busy += time.perf_counter() - start
                break
            busy += time.perf_counter() - start
            yield label
        meta: dict = {"estimator": repr(self), "seconds": round(busy, 3)}
        if failed:  # layer -> format -> the error its run raised
            table: dict = {}
            for (fqn, f), why in failed.items():
                table.setdefault(fqn, {})[f.value] = why
            meta["failed"] = table
        return Sensitivity({"forward": forward, "grad": grad, "input_grad": input_grad}, total_of=("forward", "grad", "input_grad"),
                           method=self.name, batches=b, metadata=meta)

    def _units(self, problem: SensitivityProblem) -> Generator[str, None, tuple[dict, dict, dict, int, dict]]:
        model = problem.model
        lowered = {f: lp for f, lp in problem.candidates.items() if f is not Format.FP32}
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        grad_term = self.grad_term and bool(params)
        keys = [(fqn, fmt) for fqn in problem.layers for fmt in problem.candidates]
        forward = dict.fromkeys(keys, 0.0)
        grad = dict.fromkeys(keys, 0.0)
        input_grad = dict.fromkeys(keys, 0.0)
        failed: dict = {}  # (layer, format) -> the first line of what its run raised (`failing_formats`)
        # A delayed-scaling format gets separate runtimes for the no-grad forward (current
        # scaling, as in the measured run) and the gradient pass (which records amax histories,
        # as training does). Any other format runs one forward with grad for both terms.
        fwd_rt: dict = {}
        grad_rt: dict = {}
        shared = {f for f, lp in lowered.items() if not (grad_term and lp.scaling.mode is ScalingMode.DELAYED)}
        # Nothing here holds a grad-mode or autocast context across a yield (they are the
        # thread's, and the caller trains between units); eval mode and the runtimes are the model's.
        # removing() iterates at the block's end, so it takes off the runtimes made by then.
        with eval_mode(model), removing(rt for made in (fwd_rt, grad_rt) for rt in made.values()):
            # One walk over the model for every runtime and site below (each then costs its
            # own layers): the model's modules do not change while this runs.
            index = ModelIndex.of(model)
            sites = self.sites(problem)
            own = {site: self._own_parameters(problem, index, site) for site in set(sites.values())}
            yield "sites"
            # A layer's runtimes hold only the layers that run inside its site (where it is re-run,
            # and calibrated, alone): each costs those, not the model's layers.
            within = layers_run_within(model, problem.loss_fn, problem.batches[0], list(problem.base_plan.layers), set(sites.values()))
            yield "scopes"
            for fqn in problem.layers:  # one unit per layer
                # Not seen inside its site (its site did not run it on that batch): the whole plan.
                scope = within[sites[fqn]] if fqn in within[sites[fqn]] else None
                for f in lowered:
                    fwd_rt[(fqn, f)] = apply_plan(model, problem.plan_for(fqn, f, scope), validate=False, index=index)
                    if grad_term and f not in shared:
                        grad_rt[(fqn, f)] = apply_plan(model, problem.plan_for(fqn, f, scope), validate=False, index=index)
                yield "runtimes"
            yield from calibration_steps(problem, fwd_rt, problem.batches, failed)
            for key, rt in grad_rt.items():
                rt.load_state_dict(fwd_rt[key].state_dict())
            for key, rt in fwd_rt.items():
                if key[1] in shared and grad_term:
                    grad_rt[key] = rt
            weight: dict[int, torch.Tensor] = {}  # id(parameter) -> its preconditioner, made once (not per call)
            if grad_term and self.optimizer == "adam":
                weight = {id(p): w for p, w in zip(params, self._preconditioner(problem, named))}
                yield "second moment"
            for batch in problem.batches:
                recorder, n = yield from (problem.pace or at_once)(
                    lambda: _differentiated(lambda: _record(problem, model, list(dict.fromkeys(sites.values())), batch, grad_term and self.upstream is True)))
                yield "recorded batch"
                directions: dict = {}
                if grad_term and self.upstream == "sampled":
                    directions = yield from input_directions(recorder.modules, lambda: problem.loss(batch), recorder.calls, params, weight, self.probes)
                references = {}
                for fqn in problem.layers:
                    site = sites[fqn]
                    module = recorder.modules[site]
                    for i, call in enumerate(recorder.calls[site]):
                        if all(g is None for g in call.grads):
                            continue  # the loss does not depend on this call: zero sensitivity
                        # A site without parameters of its own (an attention module whose
                        # projections are layers of their own) has no gradient term without
                        # ``upstream``: one no-grad run per format gives its forward term.
                        with_grad = grad_term and (self.upstream or bool(own[site]))
                        if with_grad and (site, i) not in references:
                            references[(site, i)] = self._local_grads(module, call, None, own[site])[1]
                        for fmt in lowered:
                            key = (fqn, fmt)
                            if key in failed:
                                continue
                            with failing_formats(fqn, fmt, failed):
                                if with_grad and fmt in shared:
                                    out, local = self._local_grads(module, call, grad_rt[key], own[site])
                                else:
                                    out = self._rerun(module, call, fwd_rt[key])
                                    local = self._local_grads(module, call, grad_rt[key], own[site])[1] if with_grad else ([], [])
                                forward[key] += n / 2 * self._output_error(call, out, n)
                                if with_grad:
                                    own_error, upstream_error = self._grad_error(call, local, references[(site, i)], own[site], params, weight,
                                                                                 directions.get((site, i), ()))
                                    grad[key] += own_error
                                    input_grad[key] += upstream_error
                            yield fqn
                del recorder, references, directions
        b = len(problem.batches)
        # A (layer, format) whose code failed predicts an infinite loss: out of the search for that layer.
        forward = {k: math.inf if k in failed else v / b for k, v in forward.items()}
        grad, input_grad = ({k: math.inf if k in failed else self.lr / 4 * v / b for k, v in part.items()} for part in (grad, input_grad))
        return forward, grad, input_grad, b, failed

    def _own_parameters(self, problem: SensitivityProblem, index: ModelIndex, site: str) -> list[torch.nn.Parameter]:
        """The parameters whose gradient error a site's local backward scores: all of the site's
        (recursively) with ``upstream`` or ``site="parent"`` (a caller holds the layer it
        lowers); with ``site="layer"`` and no ``upstream``, only those no other layer inside the
        site owns (the attention products' module scores none of its projections' weights:
        they are upstream or downstream of its matrix products, as any other layer's are)."""
        module = index.modules[site]
        params = [p for p in module.parameters() if p.requires_grad]
        if self.upstream or self.site != "layer":
            return params
        inner = [m for name, m in module.named_modules() if name and f"{site}.{name}" in problem.base_plan.layers]
        others = {id(p) for m in inner for p in m.parameters()}
        return [p for p in params if id(p) not in others]

    def _preconditioner(self, problem: SensitivityProblem, named: list[tuple[str, torch.nn.Parameter]]) -> list[torch.Tensor]:
        """Adam's preconditioner ``1 / (√v + ε)``: v from ``problem.second_moment`` (the
        optimizer's own, bias-corrected) when it has every parameter, else mean_b g_b² of the
        FP32 parameter gradients over the batches (one forward + backward each)."""
        given = problem.second_moment
        if given is not None and all(name in given for name, _ in named):
            return [1.0 / (given[name].float().sqrt() + self.eps) for name, _ in named]
        params = [p for _, p in named]
        v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for batch in problem.batches:
            grads = _differentiated(lambda: torch.autograd.grad(problem.loss(batch)[0], params, allow_unused=True))
            for acc, g in zip(v, grads):
                if g is not None:
                    acc.add_(g.detach().float().square())
        b = len(problem.batches)
        return [1.0 / ((acc / b).sqrt() + self.eps) for acc in v]

    @staticmethod
    def _rerun(module, call: RecordedCall, runtime) -> Any:
        """The module's output re-run under ``runtime``, without grad."""
        args, kwargs = call.inputs()
        with torch.no_grad(), runtime:
            return module(*args, **kwargs)

    def _output_error(self, call: RecordedCall, out, n: int) -> float:
        """``Σ_blocks (dL/dy_B · (y_q − y)_B)²`` for one call (see `_fisher_blocks`), y_q its
        output ``out`` re-run under a runtime."""
        total = 0.0
        for y, y_q, g in zip(call.outputs, float_leaves(out), call.grads):
            if g is not None:
                products = _fisher_blocks(g * (y_q.detach().float() - y), n, self.fisher)
                total += float(products.square().sum(dtype=torch.float64))
        return total

    def _local_grads(self, module, call: RecordedCall, runtime, own: list) -> "tuple[Any, tuple[list, list]]":
        """The module re-run alone under ``runtime`` (None: plain FP32), with grad: its output,
        and the gradients of its inputs (only with ``upstream``, which needs them) and of its
        parameters ``own`` (`_own_parameters`) against the recorded dL/dy; backward after the
        context exits, as in training."""
        leaves, spec = pytree.tree_flatten(call.inputs())
        floats = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.is_floating_point()]
        inputs = []
        for i, needed in zip(floats, call.grad_mask):
            if needed and self.upstream:
                leaves[i] = leaves[i].detach().requires_grad_(True)
                inputs.append(leaves[i])
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        with torch.enable_grad(), (runtime if runtime is not None else contextlib.nullcontext()):
            out = module(*args, **kwargs)
        pairs = [(y, g) for y, g in zip(float_leaves(out), call.grads) if g is not None and y.requires_grad]
        if not pairs or not (inputs or own):
            return out, ([None] * len(inputs), [None] * len(own))
        scale = self.loss_scale
        raw = torch.autograd.grad([y for y, _ in pairs], inputs + own, [(g * scale).to(y.dtype) for y, g in pairs], allow_unused=True)
        grads = [None if g is None else g.float() / scale for g in raw]
        return out, (grads[: len(inputs)], grads[len(inputs) :])

    def _grad_error(self, call: RecordedCall, local, reference, own, params, weight: Mapping[int, torch.Tensor],
                    directions: Sequence[Sequence[torch.Tensor]] = ()) -> tuple[float, float]:
        """Σ_i P_i e_i² for one call, apart for the site's own parameters (from the local
        backward: ``local``, the runtime's; ``reference``, FP32's) and the parameters upstream,
        whose error is the input gradient's (one vector-Jacobian product of the FP32 graph,
        ``upstream=True``, or the mean of ``(e · u)²`` over the call's input ``directions``,
        ``"sampled"``: `input_directions`)."""
        dx_q, dw_q = local
        dx, dw = reference

        def weighted(p, e) -> float:
            e2 = e.float().square()
            if weight:
                e2 = e2 * weight[id(p)]
            return float(e2.sum(dtype=torch.float64))

        total = upstream = 0.0
        for p, a, b in zip(own, dw_q, dw):
            if a is not None or b is not None:
                total += weighted(p, (a if a is not None else 0.0) - (b if b is not None else torch.zeros_like(a)))
        if self.upstream == "sampled":
            differences = [None if a is None or b is None else a.float() - b.float() for a, b in zip(dx_q, dx)]
            products = [sum(float((e * u.float()).sum(dtype=torch.float64)) for e, u in zip(differences, probe) if e is not None)
                        for probe in directions]
            upstream = sum(x * x for x in products) / max(len(products), 1)
        elif self.upstream:
            errors = [(x, a.float() - b.float()) for x, a, b in zip(call.graph_inputs, dx_q, dx) if a is not None and b is not None]
            if errors:
                ups = torch.autograd.grad([x for x, _ in errors], params, [e.to(x.dtype) for x, e in errors], retain_graph=True, allow_unused=True)
                owned = {id(p) for p in own}
                for p, u in zip(params, ups):
                    if u is not None and id(p) not in owned:
                        upstream += weighted(p, u)
        return total, upstream


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

    The model is left as it was (training flag, ``.grad``, hooks); batches are kept in memory for
    the passes over them.

    Args:
        model: the model to estimate, on the device it trains on.
        batches: a few batches (an iterable, read once into memory), each as ``loss_fn`` takes it.
        loss_fn: ``loss_fn(model, batch)`` runs ``model`` on the batch and returns the mean
            loss, or per-term losses (then their mean is the loss and their count N scales the
            Fisher; see `FisherEstimator`, or pass ``loss_terms``).
        formats: candidates as names, `Format` or `LayerPrecision` (to set scaling/calibration),
            each format once.
        layers: fqns, a ``(module, fqn) -> bool`` filter, or None for every covered layer.
        example_inputs: the model's inputs to trace the layers from (None: those ``loss_fn``
            passes the model on the first batch, one more forward).
        estimator: the `SensitivityEstimator` (None: `FisherEstimator()`).
        loss_terms: for a scalar loss, the number of terms N it is the mean over: an int or
            ``batch -> int`` (None: 1, magnitudes too small by N).

    Returns:
        The `Sensitivity`: ``(fqn, Format) -> predicted increase of the mean loss`` (the loss's
        units), the sum of its parts, one per product of the layer: ``forward`` (the forward
        product's output error), ``grad`` (its own parameters' gradient error: the weight
        gradient's product) and ``input_grad`` (the input gradient's error on the parameters
        before it; 0 with ``upstream=False``).

    Raises:
        SensitivityError: no batches, an unknown or repeated format, no covered layer, an fqn
            that is not a layer, a filter that keeps none, a loss that is not a finite floating
            tensor, a ``loss_fn`` that never calls the model, a bad ``loss_terms`` or
            ``estimator``, or a runtime that cannot run one layer in one format.
        PlanError: the device cannot run a candidate format at all.
    """
    return _estimator(estimator).estimate(resolve_problem(model, batches, loss_fn, formats, layers, example_inputs, loss_terms))


def sensitivity_steps(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFn,
    formats: "Iterable[Format | str | LayerPrecision]",
    layers: "Iterable[str] | ModuleFilter | None" = None,
    example_inputs: Any = None,
    *,
    estimator: "SensitivityEstimator | None" = None,
    traced: "Mapping[str, LayerInfo] | None" = None,
    second_moment: "Mapping[str, torch.Tensor] | None" = None,
    pace: "Pace | None" = None,
) -> Generator[str, None, Sensitivity]:
    """`estimate_sensitivity` as a generator of units (`SensitivityEstimator.estimate_steps`):
    it yields a label between units and returns the `Sensitivity`. The model is the
    estimator's until the generator ends (eval mode, single-layer runtimes installed).
    ``traced``: the model's layers as `find_layers` gave them for ``example_inputs`` (saves a
    traced forward); ``second_moment``: Adam's, per parameter name (`adam_second_moment`;
    saves a forward + backward per batch); ``pace``: `SensitivityProblem.pace`."""
    estimator = _estimator(estimator)
    problem = resolve_problem(model, batches, loss_fn, formats, layers, example_inputs, None, traced=traced, second_moment=second_moment)
    problem = dataclasses.replace(problem, pace=pace)
    yield "layers"
    return (yield from estimator.estimate_steps(problem))


def adam_second_moment(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> "dict[str, torch.Tensor] | None":
    """Adam's bias-corrected second moment ``v / (1 - β₂^t)`` per parameter name of ``model``,
    read from the state of ``optimizers`` (torch's Adam / AdamW and any optimizer keeping
    ``exp_avg_sq`` and ``step`` with ``betas``); None when a trained parameter has no such state
    (another optimizer, or before its first step) or holds a shard of it (FSDP2). A new tensor per parameter (the parameters'
    size in FP32, as the estimate from the batches holds), no host sync."""
    state: dict[int, tuple[Any, float]] = {}
    for optimizer in optimizers:
        held, groups = getattr(optimizer, "state", None), getattr(optimizer, "param_groups", None)
        if not isinstance(held, Mapping) or groups is None:
            return None  # a wrapper that does not expose its optimizer's state
        for group in groups:
            betas = group.get("betas")
            for p in group["params"]:
                s = held.get(p, {})
                if betas is not None and "exp_avg_sq" in s and "step" in s:
                    state[id(p)] = (s, betas[1])
    moments = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) not in state:
            return None
        s, beta2 = state[id(p)]
        if hasattr(s["exp_avg_sq"], "placements"):
            return None  # a DTensor shard (FSDP2): only the estimate sees whole parameters
        step = s["step"]
        # A tensor step (capturable / fused Adam keep it on the device) stays a tensor: no sync.
        correction = 1 - beta2 ** (step.to(torch.float32) if torch.is_tensor(step) else float(step))
        moments[name] = s["exp_avg_sq"].detach().float() / correction
    return moments


def _estimator(estimator: "SensitivityEstimator | None") -> SensitivityEstimator:
    estimator = estimator if estimator is not None else FisherEstimator()
    if not isinstance(estimator, SensitivityEstimator):
        raise SensitivityError(f"estimator must be a SensitivityEstimator, got {type(estimator).__name__}")
    return estimator


def _differentiated(run: Callable[[], T]) -> T:
    """``run()``, a forward and backward of the model. A model that writes in place a tensor its
    forward saved (RWKV's recurrent state, whose cache eval mode turns on) fails the backward's
    version check: ``run`` again with each saved tensor copied as it is saved (what the backward
    would see without the write), at one more forward and the saved tensors' bytes again."""
    try:
        return run()
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            raise
    with torch.autograd.graph.saved_tensors_hooks(torch.clone, _unchanged):
        return run()


def _record(problem: SensitivityProblem, model: nn.Module, sites: list[str], batch: Any, keep_graph: bool) -> tuple[CallRecorder, int]:
    recorder = CallRecorder(model, sites)
    with recorder:
        loss, n = problem.loss(batch)
    recorder.take_grads(loss, keep_graph=keep_graph)
    return recorder, n


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t
