"""What an installed autoprec ``forward`` carries: the runtime that installed it, and what it displaced.

A layer's wrapper (`context.PlanRuntime`) and a recomputed block's (`recompute.block_wrapper`)
are instance ``forward`` functions. Each is marked with its runtime and with ``(the module had its
own forward, that forward)``, so that a runtime installing over another's wrapper keeps the user's
forward, and removal restores the module's ``__dict__`` exactly. Plain function attributes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

__all__ = ["displaced", "mark", "owner_of", "previous_of"]

_OWNER = "_autoprec_runtime"
_PREVIOUS = "_autoprec_previous"


def mark(forward: Callable, runtime: Any, had_own: bool, previous: Any) -> None:
    """Mark ``forward`` as ``runtime``'s wrapper, displacing ``(had_own, previous)``."""
    setattr(forward, _OWNER, runtime)
    setattr(forward, _PREVIOUS, (had_own, previous))


def owner_of(forward: Any) -> Any:
    """The runtime whose wrapper ``forward`` (a function or a bound method) is, or None."""
    return getattr(getattr(forward, "__func__", forward), _OWNER, None)


def previous_of(forward: Any) -> tuple[bool, Any]:
    """``(had its own forward, that forward)`` that the wrapper ``forward`` displaced."""
    return getattr(getattr(forward, "__func__", forward), _PREVIOUS)


def displaced(module: nn.Module) -> tuple[bool, Any]:
    """``(had its own forward, that forward)`` of ``module`` as its user left it: an autoprec
    wrapper installed there (another runtime's) is looked through to the forward it displaced."""
    if "forward" not in module.__dict__:
        return False, None
    previous = module.__dict__["forward"]
    if owner_of(previous) is not None:
        return previous_of(previous)
    return True, previous
