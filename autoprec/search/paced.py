"""A whole-model call run in parts between training steps: `paced`.

The search's whole-model calls off the training path (the trace, the region and block bytes
under a runtime and the saved-tensor meter, the sensitivity's recorded forward and backward) are
each one unit; no slice of off-path work could split one, so on issue 57's narrow Llama such a
unit made its step 3.5-5x a plain one. Here
the call runs on a worker thread that stops at the forward pre-hook of each of a few layers
until the next part is asked for: the parts follow the training steps like any other units,
and the call's result is the one it returns run at once.

Only one thread runs at a time: the training thread waits while a part runs, and the worker
waits between parts. What the call's code reads from thread-local state (grad mode, autocast, the
runtime's per-thread state, saved-tensor hooks) is its own thread's, as it sets it; the worker
takes the process's intra-op thread count (a new thread's own would be every core). The global
RNG is swapped at each hand-over: each part continues the call's own draws, and the training
steps between parts see theirs untouched, so a paced call draws what it would run at once and
training draws what it would without it. A part never stops inside a backward (a checkpointed
block re-running its forward): on a GPU the backward runs on the device's autograd thread,
which the training step's backward needs too.

Costs: a thread per call; two semaphore hand-overs and a save and load of the RNG state (CPU, and
the current CUDA device's once CUDA is initialised) per part.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generator, Sequence, TypeVar

import torch
import torch.nn as nn

__all__ = ["FORWARD_PARTS", "Pacer", "paced", "pause_layers"]

T = TypeVar("T")

# Parts of a whole-model call off the training path: weighed 5-6 passes (`units`), a part weighs
# under one, so a step's slice (3 passes) holds a few and never a whole call.
FORWARD_PARTS = 8


def pause_layers(layers: Sequence[str], parts: int) -> tuple[str, ...]:
    """Up to ``parts - 1`` of ``layers`` (fqns in model order), evenly spaced, at which a paced
    call stops: its parts then hold about as many layers each."""
    if parts < 2 or len(layers) < 2:
        return ()
    stride = max(1, len(layers) // parts)
    return tuple(layers[i] for i in range(stride, len(layers), stride))[: parts - 1]


class _Stopped(BaseException):
    """Raised inside the worker's call when the search drops it between parts."""


def _rng_state() -> "tuple[torch.Tensor, torch.Tensor | None]":
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: "tuple[torch.Tensor, torch.Tensor | None]") -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class _Worker:
    """``call()`` on a thread of its own, stopped at each forward pre-hook of ``stops``."""

    def __init__(self, call: Callable[[], Any], stops: Sequence[nn.Module]):
        self._call, self._stops = call, stops
        self._resume, self._paused = threading.Semaphore(0), threading.Semaphore(0)
        self._thread: "threading.Thread | None" = None
        self._outcome: "tuple[bool, Any] | None" = None
        self._stopping = False
        self._rng: "tuple[torch.Tensor, torch.Tensor | None] | None" = None
        self._threads = torch.get_num_threads()

    def _pause(self, module: nn.Module, args: Any) -> None:
        # Inside a backward (a checkpoint's recomputed forward) the call runs on.
        if threading.current_thread() is not self._thread or torch._C._current_graph_task_id() != -1:
            return
        self._paused.release()
        self._resume.acquire()
        if self._stopping:
            raise _Stopped

    def _run(self) -> None:
        # A new thread's OpenMP / MKL teams take every core, not the process's setting: its sums
        # would round otherwise than the training thread's, and its idle team spin beside it.
        torch.set_num_threads(self._threads)
        handles = [m.register_forward_pre_hook(self._pause) for m in self._stops]
        try:
            self._outcome = (True, self._call())
        except BaseException as exc:  # handed to the training thread (`part`)
            self._outcome = (False, exc)
        finally:
            for handle in handles:
                handle.remove()
            self._paused.release()

    def part(self) -> bool:
        """Run the call to its next stop (or its end), the RNG swapped around it; True once it ended."""
        training = _rng_state()
        if self._rng is not None:
            _set_rng_state(self._rng)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autoprec-paced", daemon=True)
            self._thread.start()
        else:
            self._resume.release()
        self._paused.acquire()
        self._rng = _rng_state()
        _set_rng_state(training)
        return self._outcome is not None

    def stop(self) -> None:
        """End a call stopped between parts (its ``finally`` clauses run, on its thread)."""
        if self._thread is not None and self._outcome is None:
            self._stopping = True
            self.part()

    def result(self) -> Any:
        ok, value = self._outcome  # type: ignore[misc]
        if not ok:
            raise value
        return value


def paced(call: Callable[[], T], model: nn.Module, stops: Sequence[str], label: str) -> Generator[str, None, T]:
    """``call()`` run in parts: ``label`` yielded after each part but the last, its return value
    returned (its exception raised). ``stops``: fqns of ``model``'s modules at whose forward
    (each call of one) a part ends; none: the call runs at once. Closing the generator between
    parts ends the call there (its context managers exit)."""
    if not stops:
        return call()
    worker = _Worker(call, [model.get_submodule(fqn) for fqn in stops])
    try:
        while not worker.part():
            yield label
    finally:
        worker.stop()
    return worker.result()



class Pacer:
    """Whole-model calls of ``model`` in parts (`paced`), stopped at up to ``parts - 1`` of its
    ``layers`` (`pause_layers`): a `_generators.Pace` when called, its parts labelled ``"part"``."""

    def __init__(self, model: nn.Module, layers: Sequence[str], parts: int = FORWARD_PARTS):
        self.model, self.stops = model, pause_layers(layers, parts)
        self.part = 1 / (len(self.stops) + 1)  # a part's share of its call (when each stop is called once)

    def __call__(self, call: Callable[[], T]) -> Generator[str, None, T]:
        return paced(call, self.model, self.stops, "part")

    def units(self, call: Callable[[], T], stage: str, weight: float) -> Generator[tuple[str, float], None, T]:
        """The call as off-path units: ``(stage, its part of weight)`` after each part, the last
        included; its return value."""
        steps = self(call)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                yield stage, self.part * weight
                return done.value
            yield stage, self.part * weight
