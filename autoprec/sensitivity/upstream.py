"""The upstream gradient term at a cost linear in the layers (`FisherEstimator(upstream="sampled")`):
`input_directions`, random directions of the sites' inputs whose covariance is the one the exact
term's quadratic form needs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Generator

import torch
import torch.nn as nn

from .problem import RecordedCall, float_leaves

__all__ = ["input_directions"]

# The perturbation's size against the parameters' (norms over all of them): small enough for a
# central difference to be the derivative within the probes' own noise, large enough that FP32
# rounding of the sites' inputs (~1e-7 relative) stays 1e-4 of the difference.
_RELATIVE_STEP = 1e-3


def input_directions(modules: Mapping[str, nn.Module], run_loss: Callable[[], Any], calls: Mapping[str, Sequence[RecordedCall]],
                     params: Sequence[torch.nn.Parameter], weight: Mapping[int, torch.Tensor], probes: int,
                     seed: int = 0) -> Generator[str, None, dict[tuple[str, int], list[list[torch.Tensor]]]]:
    """``(site, call index) -> probes x [u per graph input]``, for the sites ``modules`` names
    (`CallRecorder.modules`): ``u = J δθ``, the derivative of the call's inputs (those that required grad in the recorded forward, in its order) along a random
    parameter direction ``δθ ~ N(0, P)``, P Adam's preconditioner (``weight``, by parameter id;
    empty: SGD's identity). Every call gets the same ``probes`` directions.

    Why: the exact upstream term of an input-gradient error e at a call is ``Σ_p P_p ‖J_pᵀ e‖² =
    eᵀ (J P Jᵀ) e`` (J: the call's inputs' Jacobian in the parameters), one partial backward per
    (layer, format, batch). ``E[(e · u)²] = eᵀ Cov(u) e`` is that same quadratic form, so the mean
    of ``(e · u)²`` over the probes estimates it without bias, for every layer and format from
    the same directions (relative spread ``√(2 / probes)`` per batch; formats of one layer are
    compared on the same directions).

    Cost: ``2 * probes`` no-grad forwards of ``run_loss`` (a central difference: the parameters
    moved in place by ``±h δθ``, ``h`` a 1e-3 relative step, or 8 ulps of the parameters'
    narrowest dtype if more, and restored bit for bit from a copy taken once: the parameters'
    bytes again); holds ``probes`` BF16 copies of the sites' inputs (2 bytes an element each)
    and, between a direction's two forwards, one FP32 copy: less than the recorded batch's
    backward held. Deterministic (``seed``): every rank draws the same directions. A generator
    of units, one forward each (``"upstream direction"``, weighed as the INT8 calibration's
    recorded forward: `search.units`); the parameters stay moved between them, so give it a
    model nothing else runs meanwhile, as `FisherEstimator.estimate_steps` is."""
    inputs = {(site, i): call.grad_mask for site, site_calls in calls.items() for i, call in enumerate(site_calls)}
    if not inputs or not params or probes <= 0:
        return {}
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    saved = [p.detach().clone() for p in params]
    scale = [weight[id(p)].sqrt() if weight else None for p in params]
    out: dict[tuple[str, int], list[list[torch.Tensor]]] = {key: [] for key in inputs}
    # No grad-mode context is held across a yield (it is the thread's, and the caller trains
    # between units): the tensors here need none, and each write and forward sets its own.
    param_norm = sum(float(s.float().square().sum()) for s in saved) ** 0.5
    # A half parameter moves by at least a few of its own ulps, else it rounds the step away.
    step = max([_RELATIVE_STEP] + [8 * torch.finfo(p.dtype).eps for p in params])
    try:
        for _ in range(probes):
            direction = []
            for p, s in zip(params, scale):
                z = torch.randn(p.shape, generator=generator(p.device), device=p.device, dtype=torch.float32)
                direction.append(z if s is None else z * s)
            h = step * param_norm / max(sum(float(d.square().sum()) for d in direction) ** 0.5, 1e-30)
            ahead: dict = {}  # the inputs at +h, FP32, until the -h forward reaches the same call

            def keep(key, xs):
                ahead[key] = [x.to(torch.float32, copy=True) for x in xs]

            def differentiate(key, xs):
                # BF16 suffices for a dot product whose probes already spread sqrt(2 / probes).
                out[key].append([((a - x.float()) / (2 * h)).to(torch.bfloat16) for a, x in zip(ahead.pop(key, []), xs)])

            for sign, take in ((1.0, keep), (-1.0, differentiate)):
                with torch.no_grad():
                    for p, base, d in zip(params, saved, direction):
                        p.copy_(base + (sign * h) * d.to(base.dtype))
                _each_site_input(modules, run_loss, inputs, take)
                yield "upstream direction"
    finally:
        with torch.no_grad():
            for p, base in zip(params, saved):
                p.copy_(base)
    return out


def _each_site_input(modules: Mapping[str, nn.Module], run_loss: Callable[[], Any], masks: Mapping[tuple[str, int], list],
                     take: Callable[[tuple[str, int], list], None]) -> None:
    """One no-grad forward of ``run_loss``, handing ``take`` each site call's floating inputs that
    ``masks`` marks (those that required grad in the recorded forward) as the call begins."""
    handles = []

    def hook(site: str):
        count = [0]

        def pre_hook(_module, args, kwargs):
            key = (site, count[0])
            count[0] += 1
            if key in masks:
                take(key, [t.detach() for t, m in zip(float_leaves((args, kwargs)), masks[key]) if m])

        return pre_hook

    try:
        for site, module in modules.items():
            handles.append(module.register_forward_pre_hook(hook(site), with_kwargs=True))
        with torch.no_grad():
            run_loss()
    finally:
        for handle in handles:
            handle.remove()
