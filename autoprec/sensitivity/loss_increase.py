"""`measure_sensitivity` (the real loss increase of lowering one layer, split into first- and
second-order parts) and the rank comparisons `spearman` and `rank_agreement`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..coverage import ModuleFilter
from ..errors import SensitivityError
from ..formats import Format
from ..plan import LayerPrecision
from ..runtime import apply_plan, removing
from .problem import LossFn, Sensitivity, calibrate_runtimes, eval_mode, failing_formats, float_leaves, resolve_problem

__all__ = ["measure_sensitivity", "spearman", "rank_agreement"]

logger = logging.getLogger(__name__)


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
    `calibrate_runtimes`). An FP32 candidate is exactly 0 (the runtime installs nothing). Costs one
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

    Args:
        model: the model to measure, on the device it trains on; left in its training
            mode when this returns.
        batches: a few batches (an iterable, read once into memory), each as ``loss_fn`` takes it.
        loss_fn: ``loss_fn(model, batch)`` runs ``model`` on the batch and returns the mean
            loss, or per-term losses (their mean is taken).
        formats: candidates as names, `Format` or `LayerPrecision` (to set scaling/calibration),
            each format once.
        layers: fqns, a ``(module, fqn) -> bool`` filter, or None for every covered layer.
        example_inputs: the model's inputs to trace the layers from (None: those ``loss_fn``
            passes the model on the first batch, one more forward).
        calibration_batches: the batches INT8 candidates calibrate on (None: ``batches``).

    Returns:
        The `Sensitivity`: ``(fqn, Format) -> increase`` of the mean loss (the loss's units),
        with the parts ``increase``, ``first_order`` and ``second_order``.

    Raises:
        SensitivityError: no batches, an unknown or repeated format, no covered layer, an fqn
            that is not a layer, a filter that keeps none, a loss that is not a finite floating
            tensor, a ``loss_fn`` that never calls the model, or a runtime that cannot run one
            layer in one format.
        PlanError: the device cannot run a candidate format at all.
    """
    calibration = tuple(calibration_batches) if calibration_batches is not None else None
    problem = resolve_problem(model, batches, loss_fn, formats, layers, example_inputs, None, None if calibration is None else len(calibration))
    calibration = calibration if calibration is not None else problem.batches
    start = time.perf_counter()
    increase: dict[tuple[str, Format], float] = {}
    first: dict[tuple[str, Format], float] = {}
    with eval_mode(model):
        reference = []  # per batch: (loss, model outputs, dL/d outputs)
        for batch in problem.batches:
            with _OutputTap(model, grad=True) as tap:
                loss, _ = problem.loss(batch)
            wanted = [z for z in tap.outputs if z.requires_grad]
            grads = torch.autograd.grad(loss, wanted, allow_unused=True) if wanted and loss.requires_grad else [None] * len(wanted)
            reference.append((float(loss.detach()), [z.detach() for z in tap.outputs], dict(zip(map(id, wanted), grads)), [id(z) for z in tap.outputs]))
        runtimes = {(fqn, fmt): apply_plan(model, problem.plan_for(fqn, fmt), validate=False) for fqn in problem.layers for fmt in problem.candidates if fmt is not Format.FP32}
        calibrate_runtimes(problem, runtimes, calibration)
        with torch.no_grad(), removing(runtimes.values()):
            for fqn in problem.layers:
                for fmt in problem.candidates:
                    if fmt is Format.FP32:
                        increase[(fqn, fmt)] = first[(fqn, fmt)] = 0.0
                        continue
                    runtime = runtimes[(fqn, fmt)]
                    inc = fo = 0.0
                    for batch, (base, z, g_of, ids) in zip(problem.batches, reference):
                        with _OutputTap(model, grad=False) as tap, failing_formats(fqn, fmt, None), runtime:
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
                self.outputs.extend(float_leaves(output))
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
