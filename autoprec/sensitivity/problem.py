"""The sensitivity problem: its result type (`Sensitivity`), what an estimator is given
(`SensitivityProblem`, `SensitivityEstimator`), and the recording and INT8 calibration helpers
both estimators and the measured check share (see the package docstring)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .._generators import Pace
from .._tracing import module_stack
from ..calls import ModelCall, fresh, isolated
from ..coverage import LayerInfo, find_layers
from ..device import format_support
from ..errors import FormatError, PlanError, SensitivityError, first_line
from ..formats import Format, Granularity
from ..plan import LayerPrecision, Plan

__all__ = ["Sensitivity", "SensitivityProblem", "SensitivityEstimator"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Key = tuple[str, Format]


# -- result ---------------------------------------------------------------------------------------


class Sensitivity(Mapping):
    """``(fqn, Format) -> loss increase`` (predicted or measured), in model and candidate order.

    The value is the sum of the ``total_of`` parts: for an estimate ``forward + grad +
    input_grad`` (`FisherEstimator`: one part per product of the layer), for a measurement the
    measured ``increase``. Every part is kept (`part`): a measurement also has ``first_order``
    and ``second_order`` (see `measure_sensitivity`). Keys may use format names:
    ``s["lm_head", "int8"]``. Read-only.
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
        """An estimate's gradient term of the layers' own parameters (their weight-gradient
        product), ``part("grad")``."""
        return self.part("grad")

    @property
    def input_grad(self) -> dict[Key, float]:
        """An estimate's gradient term of the parameters upstream (the input-gradient product's
        error, as the layers before see it), ``part("input_grad")``."""
        return self.part("input_grad")

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
    ``second_moment``: Adam's bias-corrected second moment per parameter name, from the
    optimizer that trains the model (`adam_second_moment`); None: estimated from the batches.
    ``pace``: how a recorded batch's forward and backward run (`_generators.Pace`: in parts
    between training steps, the scheduler's search); None: at once.
    """

    model: nn.Module
    batches: tuple
    loss_fn: LossFn
    candidates: Mapping[Format, LayerPrecision]
    layers: tuple[str, ...]
    base_plan: Plan
    loss_terms: "int | Callable[[Any], int] | None" = None
    second_moment: "Mapping[str, torch.Tensor] | None" = None
    pace: "Pace | None" = None

    def loss(self, batch) -> tuple[torch.Tensor, int]:
        """``(mean loss, N)`` for one batch; raises `SensitivityError` on a bad loss."""
        return _loss(self.loss_fn, self.model, batch, self.loss_terms)

    def plan_for(self, fqn: str, fmt: Format, within: "Sequence[str] | None" = None) -> Plan:
        """The base plan with ``fqn`` lowered to ``fmt``. ``within``: only these layers (those that
        run inside the module a layer is re-run in, `layers_run_within`), so the plan, and a
        runtime of it, costs O(those layers) instead of O(the model's), and that module runs alike."""
        if within is None:
            return self.base_plan.with_layers({fqn: self.candidates[fmt]})
        base, fingerprint = self.base_plan.layers, self.base_plan.fingerprint
        return Plan({name: self.candidates[fmt] if name == fqn else base[name] for name in within},
                    fingerprint={name: fingerprint[name] for name in within if name in fingerprint})



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

    def estimate_steps(self, problem: SensitivityProblem) -> Generator[str, None, Sensitivity]:
        """`estimate` as a generator that yields (a label) between units of work and returns the
        `Sensitivity`, so a caller can spread it over training steps (the scheduler's search).
        The default is one unit; an estimator that can stop between units overrides it."""
        return self.estimate(problem)
        yield  # pragma: no cover (makes this a generator)

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
def eval_mode(model: nn.Module):
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


def _at_most(lp: LayerPrecision, batches: int) -> LayerPrecision:
    if lp.calibration.batches <= batches:
        return lp
    return dataclasses.replace(lp, calibration=dataclasses.replace(lp.calibration, batches=batches))


def _example_from(model: nn.Module, loss_fn: LossFn, batch) -> ModelCall:
    """The model's first call in ``loss_fn(model, batch)`` (one forward, no grad)."""
    call = ModelCall.first(model, lambda: loss_fn(model, batch))
    if call is None:
        raise SensitivityError("loss_fn(model, batch) never called the model; it must run model(...) on the batch")
    return call


def resolve_problem(model, batches, loss_fn, formats, layers, example_inputs, loss_terms, calibration_batches: "int | None" = None,
             traced: "Mapping[str, LayerInfo] | None" = None, second_moment: "Mapping[str, torch.Tensor] | None" = None) -> SensitivityProblem:
    """The checked problem; INT8 candidates calibrate on at most ``calibration_batches``
    (default: the batches given). ``traced``: the model's layers as `find_layers` gave them for
    ``example_inputs`` (skips that trace, one forward)."""
    if not isinstance(model, nn.Module):
        raise SensitivityError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise SensitivityError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    batches = tuple(batches)
    if not batches:
        raise SensitivityError("batches is empty; pass a few batches (e.g. workload.val_batches(4))")
    # A layer calibrates on at most the batches it has: cycling them again to reach
    # ``calibration.batches`` repeats observations, which move no max and a percentile only by
    # its interpolation, at one model forward and a re-run per layer per extra round.
    limit = len(batches) if calibration_batches is None else calibration_batches
    candidates = {f: _at_most(lp, max(1, limit)) for f, lp in _candidates(formats).items()}
    if example_inputs is None:
        with eval_mode(model):
            example_inputs = _example_from(model, loss_fn, batches[0])
    found = dict(traced) if traced is not None else find_layers(model, example_inputs)
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
    problem = SensitivityProblem(model, batches, loss_fn, candidates, tuple(chosen), base, loss_terms, second_moment)
    # One validation up front, derived plans skip it: the layers against the model once (a walk of
    # the model: once per candidate format, it was the largest unit of a deep model's search), and
    # each candidate format against the device (naming those it cannot run).
    base.validate(model)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    unrunnable = [f"{fmt.value} cannot run on {device}: {support.reason}; choose another format"
                  for fmt in candidates if not (support := format_support(fmt, device)).runnable]
    if unrunnable:
        raise PlanError(unrunnable, "The sensitivity's candidate formats do not all run here.")
    return problem


def float_leaves(value) -> list[torch.Tensor]:
    """The floating-point tensors among the leaves of ``value`` (pytree order)."""
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point()]


@dataclasses.dataclass
class RecordedCall:
    """One call of a layer's module in the recorded FP32 forward."""

    args: tuple  # as the call began, isolated from the forward (`CallRecorder`)
    kwargs: dict
    grad_mask: list  # per floating input leaf (pytree order): did it require grad
    graph_inputs: list  # the floating inputs that require grad, as they sit in the autograd graph
    outputs: list  # floating outputs, detached FP32 copies
    out_tensors: list  # the same outputs in the graph (dropped once their grads are taken)
    grads: list  # dL/dy per output (None where the loss does not depend on it)

    def inputs(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for one re-run of the module (`calls.fresh`): a KV cache among them
        is this run's own copy, so no re-run sees or changes another's, nor the forward's."""
        return fresh((self.args, self.kwargs))


class CallRecorder:
    """Forward hooks that record, per layer, each call's inputs and outputs (``with`` scope).

    The inputs are taken as the call begins (a forward pre-hook) and isolated from the forward
    (`calls.isolated`): tensors detached, and every other object among them copied, its tensors
    detached. A decoder block's KV cache (a ``transformers`` ``Cache``, which the model makes
    itself when ``use_cache`` is on, its default) is such an object: the real forward appends to
    it and backpropagates through its tensors, so a re-run given that object would attend to the
    keys the call already appended, append again, and take gradients through a freed graph. The
    copy is of the cache as the layer saw it, so a re-run computes what the layer computed,
    also with a cache the user filled. Recording copies no tensor data (the detached tensors
    share the forward's storage, and keep that storage alive with the recorder); each re-run
    clones the cache's tensors (`RecordedCall.inputs`)."""

    def __init__(self, model: nn.Module, fqns: Sequence[str]):
        modules = dict(model.named_modules())
        self.modules = {fqn: modules[fqn] for fqn in fqns}
        self.calls: dict[str, list[RecordedCall]] = {fqn: [] for fqn in fqns}
        self._handles: list = []
        self._entered: dict[str, list] = {fqn: [] for fqn in fqns}  # a stack per module: calls may nest

    def __enter__(self):
        for fqn, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._hook(fqn), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for entered in self._entered.values():
            entered.clear()

    def _pre_hook(self, fqn):
        def pre_hook(module, args, kwargs):
            inputs = float_leaves((args, kwargs))
            args, kwargs = isolated((args, kwargs), torch.Tensor.detach)
            self._entered[fqn].append((args, kwargs, [t.requires_grad for t in inputs], [t for t in inputs if t.requires_grad]))

        return pre_hook

    def _hook(self, fqn):
        def hook(module, args, kwargs, output):
            args, kwargs, grad_mask, graph_inputs = self._entered[fqn].pop()
            outs = float_leaves(output)
            self.calls[fqn].append(RecordedCall(
                args=args,
                kwargs=kwargs,
                grad_mask=grad_mask,
                graph_inputs=graph_inputs,
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


def layer_callers(model: nn.Module, loss_fn: LossFn, batch, layers: Sequence[str]) -> dict[str, str]:
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


def layers_run_within(model: nn.Module, loss_fn: LossFn, batch, layers: Sequence[str], modules: Iterable[str]) -> dict[str, list[str]]:
    """``module fqn -> the layers that ran while it ran`` (itself first when a layer), whether or
    not the module tree holds them (a shared rotary embedding a block is handed); one forward
    under ``torch.no_grad``, O(layer calls x module nesting depth)."""
    wanted = set(layers)
    scopes: dict[str, dict[str, None]] = {m: {} for m in modules}

    def record(fqn: str, stack: list) -> None:
        if fqn in wanted:
            for m in (fqn, *stack):
                if m in scopes:
                    scopes[m][fqn] = None

    with module_stack(model, on_enter=record), torch.no_grad():
        loss_fn(model, batch)
    return {m: list(found) for m, found in scopes.items()}


def _calibrates(lp: LayerPrecision) -> bool:
    return lp.format is Format.INT8 and lp.scaling.granularity is Granularity.TENSOR


def calibrate_runtimes(problem: "SensitivityProblem", runtimes: Mapping, batches: Sequence) -> None:
    """`calibration_steps` run to its end."""
    for _ in calibration_steps(problem, runtimes, batches):
        pass


def calibration_steps(problem: "SensitivityProblem", runtimes: Mapping, batches: Sequence,
                      failed: "dict | None" = None) -> Iterator[str]:
    """Calibrate every INT8 single-layer runtime until its scale freezes, as in steady training;
    yields ``"recorded forward"`` after each round's forward (the whole model, recording every
    layer's inputs) and ``"calibration"`` after each layer's re-run.

    The layer alone is re-run under its runtime on the inputs it had in an FP32 forward: with
    only that layer lowered, everything before it is FP32, so these are exactly the inputs it
    sees in the measured run, at the cost of one model forward per batch for all layers together.
    ``batches`` are cycled until each layer has observed ``calibration.batches`` of them (more
    than there are only when the caller set it so: `resolve_problem` caps it at the batches).
    ``failed``: where a (layer, format) whose code raises is recorded (`failing_formats`) and
    skipped from then on; None: the error is raised, naming them.
    """
    keys = [key for key in runtimes if _calibrates(problem.candidates[key[1]])]
    if not keys or not batches:
        return
    rounds = max(problem.candidates[fmt].calibration.batches for _, fmt in keys)
    fqns = list(dict.fromkeys(fqn for fqn, _ in keys))
    for i in range(rounds):
        # No grad-mode context is held across a yield: grad mode is the caller's between units.
        with torch.no_grad():
            recorder = CallRecorder(problem.model, fqns)
            with recorder:
                problem.loss(batches[i % len(batches)])
        yield "recorded forward"
        for fqn, fmt in keys:
            if i < problem.candidates[fmt].calibration.batches and (failed is None or (fqn, fmt) not in failed):
                with torch.no_grad(), failing_formats(fqn, fmt, failed):
                    for call in recorder.calls[fqn]:
                        args, kwargs = call.inputs()
                        with runtimes[(fqn, fmt)]:
                            recorder.modules[fqn](*args, **kwargs)
                yield "calibration"


@contextlib.contextmanager
def failing_formats(fqn: str, fmt: Format, failed: "dict | None"):
    """A single-layer plan's run of layer ``fqn`` in ``fmt``: an error raised in it (the layer's
    own code failing in that format, as DeBERTa's attention fills its BF16 scores with FP32's
    minimum, or the runtime refusing it) recorded in ``failed`` as ``(fqn, fmt) -> its first
    line``, the estimate going on without that pair (the search then rules it out for that
    layer: `planner.space_steps`); with ``failed`` None, raised naming them."""
    try:
        yield
    except (RuntimeError, TypeError) as exc:
        line = first_line(exc)
        if failed is not None:
            failed[(fqn, fmt)] = line
            logger.warning("autoprec: sensitivity: layer %r fails in %s (%s); the search leaves it out of that format", fqn, fmt.value, line)
            return
        raise SensitivityError(
            f"the runtime cannot run {fqn!r} in {fmt.value} alone: {line}; "
            "leave this layer or format out (layers=..., formats=...)"
        ) from exc
