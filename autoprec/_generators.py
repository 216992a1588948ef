"""`drain`: a generator of units of work run to its end, for callers that do not spread it over
training steps (the offline search, the estimates outside a search); `Pace`: how a whole-model
call inside such a generator runs (`at_once`, or in parts: `search.paced.Pacer`). Shared by
`sensitivity`, `costs` and `search`, which yield their work in units (`search.units` weighs them)."""

from __future__ import annotations

from typing import Any, Callable, Generator, TypeVar

__all__ = ["Pace", "at_once", "drain"]

_T = TypeVar("_T")

# Runs a whole-model call, yielding labels between its parts; returns what the call returns.
Pace = Callable[[Callable[[], Any]], Generator[str, None, Any]]


def drain(steps: Generator[Any, None, _T]) -> _T:
    """Run ``steps`` to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def at_once(call: Callable[[], _T]) -> Generator[str, None, _T]:
    """The `Pace` that runs ``call()`` in one part (yielding nothing)."""
    yield from ()
    return call()
