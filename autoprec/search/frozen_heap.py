"""The process's heap held out of CPython's full collections while a search runs: `FrozenHeap`.

A search allocates many small objects (plans, runtimes, their wrappers and hooks), and so sets
off CPython's full (generation 2) collections, each of which walks every object the process
holds: with torch and transformers imported a few hundred thousand, 0.2-0.3 s on issue 57's
narrow Llama at 16 blocks (2 CPU cores), a stall of 10x a training step in whichever step it
falls. `gc.freeze` moves the objects alive at the search's start to the permanent generation,
which collections skip. What the search itself keeps (its model snapshot, runtimes, the
profile: tens of thousands of objects at depth) is frozen too, after each of its steps
(`refreeze`): left in the oldest generation, it was walked by a full collection every one to
four steps (0.03-0.2 s each at 64 blocks, set off by the allocations of the recomputed blocks'
cache copies), so a full collection walks only what the current step made. Garbage among the
frozen objects (reference cycles; most objects are freed by their counts, frozen or not) waits
for the search's end (`release`, `gc.unfreeze`), when they return to the oldest generation. A
process that froze objects itself is left as it is.
"""

from __future__ import annotations

import gc

__all__ = ["FrozenHeap"]


class FrozenHeap:
    """Freezes the heap when made (unless the collector is off or objects are frozen already),
    again at each `refreeze`; `release` unfreezes it, once. O(1) each: the generations' lists are
    moved whole."""

    def __init__(self) -> None:
        self.frozen = gc.isenabled() and gc.get_freeze_count() == 0
        if self.frozen:
            gc.freeze()

    def refreeze(self) -> None:
        """Freeze what was made since: a search's step calls it after its slice of work."""
        if self.frozen:
            gc.freeze()

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
