"""Work the in-run search runs beside training: `BackgroundCall`, one function on a worker thread.

The integer programs (`exact.k_best`: HiGHS through scipy) release the GIL while they solve, so
on a machine with a core to spare they run beside the training steps instead of inside one; the
search takes the result a fixed number of steps later (`TrainingSearch`), waiting there only for
what is left of it. The Python parts of the call (building the plans) hold the GIL in CPython's
switch intervals: they slow the training thread while they run, but stall no step.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import RuntimeStateError

__all__ = ["BackgroundCall"]


class BackgroundCall:
    """``fn()`` started on a daemon thread at construction; `result` waits for it and returns its
    value or raises its exception; `seconds` is its own wall time once done. A call nobody waits
    for (a search closed meanwhile) runs to its end and is dropped."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.seconds = 0.0
        self._outcome: "tuple[bool, Any] | None" = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            self._outcome = (True, fn())
        except BaseException as exc:  # handed to the thread that waits (`result`)
            self._outcome = (False, exc)
        self.seconds = time.perf_counter() - start

    def result(self) -> Any:
        """The call's value, waiting for it if it still runs; its exception raised here."""
        self._thread.join()
        if self._outcome is None:  # _run sets it before its thread ends, whatever fn did
            raise RuntimeStateError("BackgroundCall: its thread ended without an outcome")
        ok, value = self._outcome
        if not ok:
            raise value
        return value
