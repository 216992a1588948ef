"""`drain`: a generator of units of work run to its end, for callers that do not spread it over
training steps (the offline search, the estimates outside a search). Shared by `sensitivity`,
`costs` and `search`, which yield their work in units (`search.units` weighs them)."""

from __future__ import annotations

from typing import Any, Generator, TypeVar

__all__ = ["drain"]

_T = TypeVar("_T")


def drain(steps: Generator[Any, None, _T]) -> _T:
    """Run ``steps`` to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
