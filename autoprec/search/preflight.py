"""A candidate plan run once off the training path before a training step runs it (`preflight`).

A format can break a model's code where no per-layer estimate looks: YOSO's custom autograd
Function multiplies the FP32 incoming gradient by a value it saved in the value projection's
FP16, an op outside every layer, in its backward. Run first on a training step, such a candidate
raises inside the user's ``backward`` and ends training. Built-in ops' backward formulas take the
dtypes their forward did, so only a model's own autograd Functions can raise in a backward whose
forward ran: where the first step's graph holds one (`_tracing.own_autograd_functions`), the
search runs no probe steps (a probe plan would run unchecked) and runs each candidate here
first, one forward and backward on its snapshot; one that raises has the layer that makes it
raise found by bisection and that layer's role kept out of the format (every layer of the role
runs the same code), until it runs. A forward that raises on a training step is caught there instead (the
layer runs in FP32: `PlanRuntime.tolerate_failures`); a backward cannot be run again.
"""

from __future__ import annotations

import logging

from typing import Any, Callable, Generator, Mapping, Optional, Sequence

import torch.nn as nn

from .._tracing import side_effect_free
from ..errors import SearchError, first_line
from ..formats import Format
from ..plan import Plan
from ..runtime import apply_plan
from .failing import without_failing

__all__ = ["PREFLIGHT_ROLES", "preflight", "preflight_each"]

logger = logging.getLogger("autoprec")

# Roles a candidate may have kept out of a format before it is given up: each costs
# 1 + ceil(log2(lowered layers)) runs of a forward and backward.
PREFLIGHT_ROLES = 4


def preflight(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], plan: Plan, roles: Mapping[str, str],
              failing: dict[tuple[str, str], str]) -> Generator[str, None, Optional[Plan]]:
    """``plan`` as it runs a forward and backward of ``batch`` on ``model`` (the search's
    snapshot: its gradients are set to None after each run, its buffers and the RNG left as they
    were): unchanged when it runs; else the lowered layer whose run raises is found by bisection
    over the lowered layers in model order (the shortest prefix of them lowered that raises: its
    last layer), its (role, format) added to ``failing`` with the error's first line, and the
    plan run again without the failing pairs (`without_failing`), at most `PREFLIGHT_ROLES`
    times. None when it still raises then, or raises with every layer in FP32. A generator: it
    yields ``"preflight"`` after each run (one forward and backward under the plan's runtime)."""
    for _ in range(PREFLIGHT_ROLES + 1):
        plan = without_failing(plan, failing, roles)
        error = yield from _run(model, batch, loss_fn, plan)
        if error is None:
            return plan
        lowered = [fqn for fqn, lp in plan.layers.items() if lp.format is not Format.FP32]
        if not lowered:
            return None
        runs, raises = 0, len(lowered)  # a prefix of `runs` lowered layers ran (none lowered runs: the window's steps did)
        while raises - runs > 1:
            middle = (runs + raises) // 2
            prefix = plan.with_layers({fqn: Format.FP32 for fqn in lowered[middle:]})
            if (yield from _run(model, batch, loss_fn, prefix)) is None:
                runs = middle
            else:
                raises = middle
        culprit = lowered[raises - 1]
        fmt = plan.layers[culprit].format.value
        logger.info("autoprec: a candidate plan raised in a forward and backward off the training path with %r in %s (%s); "
                    "its role is kept out of that format", culprit, fmt, error)
        failing[(roles[culprit], fmt)] = error
    return None


def preflight_each(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], plans: Sequence[Plan], roles: Mapping[str, str],
                   failing: dict[tuple[str, str], str]) -> Generator[str, None, list[Plan]]:
    """Each of ``plans`` as `preflight` leaves it, those that run, in order (the pairs found
    failing in one kept out of the next before it runs).

    Raises:
        SearchError: none runs, naming each (role, format) and what it raised.
    """
    ran = []
    for plan in plans:
        checked = yield from preflight(model, batch, loss_fn, plan, roles, failing)
        ran += [checked] if checked is not None else []
    if not ran:
        why = "; ".join(f"{role} in {fmt}: {error}" for (role, fmt), error in failing.items()) or "with every layer in FP32"
        raise SearchError(f"every candidate plan raised in a forward and backward off the training path ({why}); training stays at the safe precision")
    return ran


def _run(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], plan: Plan) -> Generator[str, None, Optional[str]]:
    """The first line of what a forward and backward of ``batch`` under ``plan`` raised, or None."""
    runtime = apply_plan(model, plan, validate=False)
    error: Optional[str] = None
    try:
        with side_effect_free(model):
            try:
                with runtime:
                    loss = loss_fn(model, batch)  # a scalar, or per-term losses
                loss.float().mean().backward()
            except RuntimeError as exc:
                error = f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        runtime.remove()
        for p in model.parameters():
            p.grad = None
    yield "preflight"
    return error

