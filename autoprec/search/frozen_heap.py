"""The process's heap held out of CPython's full collections while a search runs: `FrozenHeap`.

A search allocates many small objects (plans, runtimes, their wrappers and hooks), and so sets
off CPython's full (generation 2) collections, each of which walks every object the process
holds: with torch and transformers imported a few hundred thousand, 0.2-0.3 s on issue 57's
narrow Llama at 16 blocks (2 CPU cores), a stall of 10x a training step in whichever step it
falls. `gc.freeze` moves the objects alive at the search's start to the permanent generation,
which collections skip: the search's full collections walk what it made (about 0.01 s there).
Garbage among the frozen objects waits for the search's end (`release`, `gc.unfreeze`), when
they return to the oldest generation. A process that froze objects itself is left as it is.
"""

from __future__ import annotations

import gc

__all__ = ["FrozenHeap"]


class FrozenHeap:
    """Freezes the heap when made (unless the collector is off or objects are frozen already);
    `release` unfreezes it, once. O(1) each: the generations' lists are moved whole."""

    def __init__(self) -> None:
        self.frozen = gc.isenabled() and gc.get_freeze_count() == 0
        if self.frozen:
            gc.freeze()

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
