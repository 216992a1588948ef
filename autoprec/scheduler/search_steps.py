"""A `TrainingSearch` driven over a scheduler's training steps: `SearchSteps`.

It owns the search in progress and what each step runs for it: the step's kind (probe, trial
or safe), its start time, a probe step's per-layer timer (`costs.inplace.StepTimer`) and a trial
step's metered saved bytes; the seconds of recent safe steps (a search's median step); and the
``"role|format" -> seconds`` measured by probe steps on this device, kept for a later search (a
retry does not probe again). The scheduler calls `enter_step` inside each step's context,
`before_backward`, and `end_step` after the optimizer; `end_step` and `advance` give the search
its slice of off-path work (``search_slice`` steps of it, counted in model passes: never timed)
and report when it is `done`, and the scheduler then `take`s it.

While a search runs, the objects alive at its start are out of CPython's full collections
(`search.frozen_heap`). Costs: a ``time.perf_counter`` per step; a probe step's autograd hooks
per layer and a trial step's saved-tensor meter; under ``torch.distributed`` one broadcast per
step until rank 0's candidates reach every rank (`RankAgreement.share`). The search's own are in
`search.in_run`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import statistics
import time
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from .._tracing import own_autograd_functions
from ..costs.inplace import StepTimer
from ..errors import RuntimeStateError, SearchError
from ..formats import Format
from ..saved_bytes import SavedTensorMeter
from ..plan import Plan
from ..runtime import EmulationWarning
from ..search.tensor_parallel import sharded_rules
from ..search.frozen_heap import FrozenHeap
from ..search.in_run import TrainingSearch
from ..search.units import PASSES_PER_STEP
from ..sensitivity import adam_second_moment
from ..sensitivity.capture import LinearisedLoss

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from ..monitoring import TrainingWriter
    from .config import SchedulerConfig

__all__ = ["SearchSteps"]

logger = logging.getLogger(__name__)


class SearchSteps:
    """The search over training steps of one scheduler (module docstring), made with its
    settings; it runs nothing until `start` (or a resume through it)."""

    def __init__(self, config: "SchedulerConfig"):
        self.config = config
        self._search: Optional[TrainingSearch] = None
        self._known_times: dict[str, float] = {}
        # What a failed search's last memory round learned (`memory_margin.MemoryMargin`): its
        # retry proposes its first round under it, not from 1.0, where the same plans would
        # measure over the budget again.
        self._memory: Any = None
        self._recent_steps: collections.deque = collections.deque(maxlen=64)  # seconds of safe-precision steps
        self._kind: Optional[str] = None
        self._started: Optional[float] = None
        self._timer: Optional[StepTimer] = None
        self._bytes: Optional[int] = None
        self._heap: Optional[FrozenHeap] = None  # while a search runs (`search.frozen_heap`)
        # A window's (profile, baseline loss), summed up at its last step, whose search starts at
        # the next (`defer`): each is linear in the layers, and together they made one step 4-5x.
        self._due: "tuple[Any, Optional[float]] | None" = None
        # The model's own autograd Functions, found on the first step's graph (`before_backward`).
        self._own_functions: "tuple[str, ...] | None" = None

    @property
    def search(self) -> Optional[TrainingSearch]:
        """The search in progress (None when none is)."""
        return self._search

    @property
    def known_times(self) -> Mapping[str, float]:
        """``"role|format" -> seconds`` and ``"rest"``, measured by probe steps on this device."""
        return self._known_times

    def load_known_times(self, times: Mapping[str, float]) -> None:
        """Take ``times`` (a checkpoint's) as `known_times`."""
        self._known_times = dict(times)

    @property
    def median_safe_step(self) -> Optional[float]:
        """The median seconds of the recent steps run without a plan (None before any)."""
        return statistics.median(self._recent_steps) if self._recent_steps else None

    def defer(self, profile: Any, baseline_loss: Optional[float]) -> None:
        """Keep a window's ``profile`` and ``baseline_loss`` for the search `take_due` starts."""
        self._due = (profile, baseline_loss)

    def take_due(self) -> "tuple[Any, Optional[float]] | None":
        """The deferred (profile, baseline loss), once (None when none is due)."""
        due, self._due = self._due, None
        return due

    def _running(self) -> TrainingSearch:
        if self._search is None:
            raise RuntimeStateError("no search is in progress")
        return self._search

    def start(self, model: nn.Module, example: Any, batches: Sequence[Any], profile: Any, baseline_loss: Optional[float], *,
              fingerprint: Mapping[str, Any], step: int, lead: bool, optimizers: Sequence[torch.optim.Optimizer],
              restore: Optional[Mapping[str, Any]] = None, safe_bytes: "tuple[Format, int] | None" = None, compiled: bool = False,
              alone: bool = True) -> TrainingSearch:
        """A new `TrainingSearch` at ``step`` of the window's ``profile`` and ``baseline_loss``
        (``restore``: one resumed from its `state_dict`, which holds both), using and adding to
        `known_times`, on the captured ``batches``; ``lead``: this rank runs the off-path work (it
        fails at once without ``batches`` to estimate on), with Adam's second moment from
        ``optimizers``.
        ``safe_bytes``, ``alone`` (no other rank takes part): `TrainingSearch`'s."""
        if restore is not None:
            from ..profiling import Profile

            profile = None if restore["profile"] is None else Profile.from_dict(restore["profile"])
            baseline_loss = restore["baseline_loss"]
        # Under tensor parallelism a sharded layer is searched only in the formats it can run
        # sharded (`search.tensor_parallel`); every rank derives the same rules from the model.
        config, refused = self.config, None
        notes: dict[str, str] = {}
        try:
            rules, notes = sharded_rules(model, list(fingerprint), config.planning)
            config = dataclasses.replace(config, rules=rules) if notes else config
        except SearchError as exc:
            refused = exc
        self.hold_heap()
        # The snapshot drops autoprec's hooks (the scaler's output checks among them, `plain_copy`).
        search = TrainingSearch(model, example, batches, LinearisedLoss(), profile, config=config, baseline_loss=baseline_loss,
                                fingerprint=fingerprint, step=step, known=self._known_times, lead=lead, restore=restore,
                                second_moment=adam_second_moment(model, optimizers) if lead else None,
                                median_step=self.median_safe_step, safe_bytes=safe_bytes, compiled=compiled, alone=alone, notes=notes,
                                own_functions=self._own_functions or (), memory=self._memory if restore is None else None)
        self._search = search
        if self._heap is not None:
            self._heap.refreeze()  # the window's summary and the search's snapshot, kept until its end
        if refused is not None:
            search.fail(refused)
        if lead and not batches and search.candidates is None:
            search.fail(SearchError("no output gradients were captured in the window's last steps; call scheduler.backward(loss) inside the loop"))
        if restore is None:
            logger.info("autoprec: step %d: searching over the next training steps (%d probe steps, then the candidates)", step, search.probe_steps)
        return search

    def enter_step(self, stack: contextlib.ExitStack, model: nn.Module, layers: Sequence[str]) -> bool:
        """Start timing the step run in ``stack``'s context; while the search wants the step (a
        probe or trial), enter its runtime there and return True (else the plan in force runs).

        Under gradient accumulation each micro-batch enters a context: the step is timed from the
        first one's start to the optimizer step, a probe step's timer (installed at the first)
        attributes every micro-batch's forward and backward, and only the first is metered."""
        first = self._started is None
        if first:
            self._started = time.perf_counter()
        entry = self._search.step_runtime() if self._search is not None else None
        if first:
            self._kind = entry[0] if entry is not None else None
        if entry is None:
            return False
        search = self._running()
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", EmulationWarning)  # the adopted plan names its emulated layers
        stack.enter_context(entry[1])
        if self._kind == "probe" and self._timer is None:
            self._timer = StepTimer(model, layers, tuple(search.blocks)).__enter__()
        if first and search.wants_bytes():
            meter = stack.enter_context(SavedTensorMeter(list(model.parameters())))
            stack.callback(lambda: setattr(self, "_bytes", meter.total_bytes))
        return True

    def runs_eager(self) -> bool:
        """Whether the next step must run eagerly (`TrainingSearch.runs_eager`; True without a search)."""
        return self._search is None or self._search.runs_eager()

    def before_backward(self, loss: torch.Tensor) -> None:
        """A probe step: hook the autograd nodes of each layer for its timer. The first step: find
        the model's own autograd Functions in its graph (`own_autograd_functions`, once a
        scheduler: the model's code does not change), which its searches check candidates for."""
        if self._own_functions is None:
            self._own_functions = own_autograd_functions(loss)
        if self._timer is not None:
            self._timer.before_backward(loss)

    def end_step(self, skipped: bool, *, safe: bool, agreement: "Optional[RankAgreement]" = None, first_bad_output: Optional[str] = None,
                 nonfinite: Sequence[str] = ()) -> bool:
        """Time the step just run (``safe``: it ran no plan, so it counts for the median safe
        step; ``first_bad_output``: the layer whose output went non-finite first, when named;
        ``nonfinite``: the layers whose gradients were);
        while searching, report it and give the search its slice (`advance`). Returns whether
        the search is done."""
        seconds = time.perf_counter() - self._started if self._started is not None else None
        self._started = None
        search = self._search
        if search is None:
            if seconds is not None and safe:
                self._recent_steps.append(seconds)
            return False
        timed: dict = {}
        if self._timer is not None:
            layer_seconds, forward_seconds = self._timer.finish()
            timed = {"layer_seconds": layer_seconds, "forward_seconds": forward_seconds, "block_seconds": self._timer.block_forward}
            self._drop_timer()
        search.record(self._kind, seconds if seconds is not None else 0.0, saved_bytes=self._bytes, skipped=skipped, first_bad_output=first_bad_output, nonfinite=nonfinite, **timed)
        self._kind, self._bytes = None, None
        if search.median_step is None and seconds is not None:
            search.median_step = seconds
        return self.advance(agreement)

    def advance(self, agreement: "Optional[RankAgreement]" = None) -> bool:
        """The search's slice of off-path work after a step; under torch.distributed
        (``agreement``) rank 0's candidates to the others. Returns whether the search is done."""
        search = self._running()
        slice_ = self.config.search_slice
        # Counted in model passes, not timed: the same units follow the same steps on a loaded
        # machine and in a resumed run, so training does not depend on the clock.
        search.work(math.inf if slice_ is None else slice_ * PASSES_PER_STEP)
        if self._heap is not None:
            self._heap.refreeze()  # what the search keeps, out of the next full collections
        if agreement is not None and not search.shared:
            # Rank 0's candidates (or its error) reach every rank at the same step: one broadcast
            # per step until they exist (every rank calls it: none knows before rank 0 is done).
            ready = search.candidates is not None or search.error is not None
            shared = agreement.share(None if not ready else
                                     {"plans": [p.to_dict() for p in search.candidates or []], "error": None if search.error is None else str(search.error)})
            if shared is not None:
                search.shared = True
                if agreement.rank != 0:
                    search.fail(SearchError(shared["error"])) if shared["error"] else search.set_candidates([Plan.from_dict(p) for p in shared["plans"]])
        if agreement is not None and search.round_pending:
            # A round of candidates ended on this step on every rank: rank 0 says whether a next
            # one begins (every candidate measured over the memory budget), one broadcast.
            search.settle_round(agreement.share(search.round_outcome() if agreement.rank == 0 else None))
        return search.done

    def _drop_timer(self) -> None:
        """A probe step's timer off the model (its autograd and forward hooks removed)."""
        if self._timer is not None:
            self._timer.__exit__(None, None, None)
            self._timer = None

    def take(self) -> TrainingSearch:
        """The search, done: the caller adopts its result (or error) and closes it."""
        search, self._search = self._running(), None
        self._release_heap()
        self._memory = search.memory if search.error is not None else None
        return search

    def hold_heap(self) -> None:
        """Freeze the heap (`search.frozen_heap`) until the search ends: its allocations, and those
        of the window's summary before it, would set off full collections of the whole heap."""
        if self._heap is None:
            self._heap = FrozenHeap()

    def _release_heap(self) -> None:
        if self._heap is not None:
            self._heap.release()
            self._heap = None

    @staticmethod
    def report(search: TrainingSearch, step: int, writer: "Optional[TrainingWriter]") -> None:
        """Log a finished search's timeline (and to TensorBoard with ``writer``)."""
        logger.info("autoprec: step %d: %s", step, search.summary())
        if writer is not None:
            writer.log_search(step, search.timeline, longest_step_ratio=search.longest_step / search.median_step if search.median_step else None)

    def close(self) -> None:
        """Drop a search in progress or due (its runtimes off the model, the step's timer removed)."""
        self._due = None
        self._drop_timer()
        self._release_heap()
        if self._search is not None:
            self._search.close()
            self._search = None

    def state_dict(self) -> dict:
        """The scheduler state's ``search`` (None when none is in progress), ``known_times`` and
        ``due_search`` (a window summed up whose search starts at the next step, else None)."""
        due = None if self._due is None else {"profile": None if self._due[0] is None else self._due[0].to_dict(), "baseline_loss": self._due[1]}
        return {"search": None if self._search is None else self._search.state_dict(), "known_times": dict(self._known_times), "due_search": due}

    def load_due(self, due: Optional[Mapping[str, Any]]) -> None:
        """Take a checkpoint's ``due_search`` (`state_dict`)."""
        from ..profiling import Profile

        self._due = None if due is None else (None if due["profile"] is None else Profile.from_dict(due["profile"]), due["baseline_loss"])
