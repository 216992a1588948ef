"""The scheduler's search, spread over training steps: `TrainingSearch`.

Run at once at a window's end, a search would hold training for all of its work. Here no step
is held for long, and most of the work trains the model:

- **Probe steps** (training steps): up to three layers of each role (`LayerInfo.role`: the same projection in every
  block) cycle through their formats, staggered so each step mixes them, timed in place (`costs.inplace.StepTimer`); a
  (role, format)'s median serves every layer of the role, and later searches on this device (`known`).
- **Off-path units** on a snapshot of the weights, in slices after the training steps but the probe steps (`work`: a
  unit, at most one forward + backward, starts when its weight fits): the trace, the region and block bytes (forwards
  run in parts, `paced`), the sensitivity estimate on the last captured batch (`pipeline.search_estimator`, Adam's v
  from the training optimizer when it has one; one more per round of alternative recipes, `Planning.alternative_rounds`),
  then the exact solve (on a thread, beside ``SOLVE_STEPS`` training steps). A slice is counted, not timed: each unit
  weighs the model passes it runs (`unit_weight`), so the steps each unit runs in, and so every step's formats, are
  the same however loaded the machine is, and in a run resumed from a checkpoint.
- **Trial steps** (training steps): the ``CANDIDATES`` best plans, and all-BF16 when it meets the budgets, each run
  until their INT8 scales froze, then ``TIMED_TRIAL_STEPS`` timed steps (every eager one metered for bytes, the most
  counting); around a compiled model the timed steps run compiled, after one that compiles the candidate. A skipped
  step does not count; one that keeps skipping has the layer its overflow starts at promoted, or is dropped
  (`trials.Trial.skip`), as is one over the memory budget; the fastest kept one is adopted with its runtime, unless it
  beats the predicted fastest kept one by less than their own steps' spread (`noise.unseparated`: then that one
  stays). When every candidate measured over the memory budget (the bytes predicted at the budget's edge, measured a
  little over), the next round's are proposed under the budget divided by a margin learned from the measurements
  (`memory_margin`; under torch.distributed rank 0's, every rank beginning it at one step): at most `MEMORY_ROUNDS`
  rounds, so a plan is in force at most ``MEMORY_ROUNDS * (CANDIDATES + 1) * (INT8 calibration batches +
  TIMED_TRIAL_STEPS (+ 1 compiled))`` trial steps after the probes and the off-path work (54 at the defaults: 3 rounds
  of 3 candidates of 4 + 2 steps), or the search fails, naming the budget the measured margin would need; the
  scheduler's retry then starts from the margin its last round learned (``memory``).

A format the model's code cannot run is out for its role once seen (`failing`): a layer raising on a step runs it in FP32; a
model with its own autograd Function runs no probe steps and each candidate runs once on the snapshot first (`preflight`).

No step is lost or repeated: probe and trial steps differ from safe ones only by their formats' rounding (FP16
gradients run unscaled in those few steps). `timeline` holds each stage's seconds (off-path work, and what probe and
trial steps took beyond the median safe step); those, the probes' and the trials' step times are measured, and are
the only timings the result depends on.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Any, Callable, Generator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..blocks import find_blocks, layers_of_blocks
from ..costs import CostModel, RooflineTimeModel, calibration_steps, trace_model
from ..errors import AutoprecError, InfeasibleBudgetError, RuntimeStateError, SearchError
from ..formats import Format
from ..plan import Plan
from ..replica import is_sharded, plain_copy
from ..runtime import EmulationWarning, apply_plan
from ..sensitivity import Sensitivity, sensitivity_steps
from .background import BackgroundCall
from ..noise import unseparated
from .paced import Pacer
from .budgets import MIN_BUDGET_BYTES
from .pipeline import propose_from, search_estimator, space_steps, uniform_reference
from .planner import floor_settings, precision_of
from .memory_margin import MEMORY_ROUNDS, MemoryMargin
from .failing import failing_roles, mark_failed, without_failing
from .preflight import preflight_each
from .probes import PROBE_ROUNDS, PROBED_PER_ROLE, add_samples, probe_formats, probe_plans, probed_cost_model
from .tensor_parallel import noted, tensor_parallel_layers, unsharded_bytes
from .trials import Trial, restart
from .units import unit_weight, weighted

__all__ = ["TrainingSearch", "probe_formats", "MEMORY_ROUNDS", "PROBE_ROUNDS", "PROBED_PER_ROLE"]

CANDIDATES = 2  # plans tried on training steps: the optimum (to exact.MIP_GAP) and the next best
SOLVE_STEPS = 8  # steps the integer programs run beside (inside one, 11x it at 32 blocks), then taken
class TrainingSearch:
    """One search of the scheduler (module docstring). The scheduler asks `step_runtime` before
    each training step (None: the step runs the safe precision), reports each step with
    `record`, and gives it `work` after each step; it is over when `done` (then `result` or
    `error`), and `close` takes its runtimes off the model.

    ``known``: ``"role|format" -> seconds`` and ``"rest"`` measured by earlier searches on this
    device (updated in place with what the probes measure). ``lead``: this process runs the
    off-path work (False on ranks other than 0, which get the candidates with `set_candidates`);
    the lead copies ``model`` when made (remove hooks that must not run on the copy first).
    ``safe_bytes``: (the safe format, the saved bytes metered on a safe step), which anchors
    the measured bytes of the trials to the cost model's (module docstring).
    ``second_moment``: Adam's, per parameter name, as the search is made (`adam_second_moment`),
    for the sensitivity's gradient term (None: estimated on the snapshot, one more forward +
    backward). ``alone``: no other rank takes part (under torch.distributed each round's end waits for rank 0's word:
    `round_outcome`, `settle_round`). ``notes``: layer -> the sentence each candidate's reason for it ends with
    (`tensor_parallel.sharded_rules`: the formats left out of a sharded layer's). ``memory``: the `MemoryMargin` an earlier
    search's last round learned (its retry's first round is proposed under it; None: 1.0), kept as `memory`.
    """

    def __init__(self, model: nn.Module, example: Any, batches: Sequence[Any], loss_fn: Callable, profile: Any, *,
                 config: Any, baseline_loss: Optional[float], fingerprint: Mapping[str, Any], step: int,
                 known: dict, lead: bool = True, median_step: Optional[float] = None,
                 safe_bytes: "tuple[Format, int] | None" = None, restore: Optional[Mapping[str, Any]] = None,
                 second_moment: "Mapping[str, torch.Tensor] | None" = None, compiled: bool = False, alone: bool = True,
                 notes: Mapping[str, str] = {}, own_functions: Sequence[str] = (), memory: "MemoryMargin | None" = None):
        self.model, self.notes, self.own_functions = model, dict(notes), tuple(own_functions)
        self.tensor_parallel = bool(tensor_parallel_layers(model, list(fingerprint)))  # its trials measure a rank's share
        self.compiled = compiled  # the model runs compiled: its candidates are timed compiled
        self.example, self.batches, self.loss_fn, self.profile = example, list(batches), loss_fn, profile
        self.config, self.baseline_loss, self.fingerprint = config, baseline_loss, fingerprint
        self.started, self.known = step, known
        self.layers = list(fingerprint)
        self.roles = {fqn: info.role(fqn) for fqn, info in fingerprint.items()}
        # Recompute units the search may recompute (``recompute=``: None finds the blocks, patterns
        # name them, [] none), each with its layers: their bytes are measured off-path, their
        # forwards in probe steps.
        names = find_blocks(model, self.layers, config.recompute)
        self.blocks = layers_of_blocks(names, self.layers)
        device = next(model.parameters()).device
        self.formats = list(config.candidates)
        # measure_costs=False: roofline seconds, no probe and no trial steps (the optimum is adopted).
        self.measuring = bool(config.measure_costs)
        allowed = probe_formats(self.layers, self.formats, profile, device, config.rules, config.planning.precisions(), config.planning.limits)
        self._probes = probe_plans(self.layers, self.roles, self.blocks, allowed, config.planning.precisions(), known) if self.measuring and not self.own_functions else []
        self._probe_runtimes: dict[int, Any] = {}
        self._samples: dict[str, list[float]] = {}  # "role|format" -> seconds measured in probe steps
        self._failing: dict[tuple[str, str], str] = {}  # (role, format name) -> what its code raised (`failing`)
        self._rest: list[float] = []
        self.median_step = median_step  # seconds of a safe step, for the timeline's "extra"
        self.timeline: dict[str, float] = {}
        self.candidates: Optional[list[Plan]] = None
        self._trials: list[Trial] = []
        self.result: Optional[Plan] = None
        self.error: Optional[AutoprecError] = None
        self.steps = 0  # training steps since the search started
        self.longest_step = 0.0
        self._unit_cost: dict[str, float] = {}  # the last unit's weight, per stage (`unit_weight`)
        self._next_stage = ""
        self._starved = 0  # slices in a row that ran no unit
        self._credit = 0.0  # their passes, which the next slice adds to its own
        self._units = 0  # off-path units run so far (a resumed search runs as many again, at once)
        self._solve_from: Optional[int] = None  # the step the integer programs started beside
        self.shared = False  # under torch.distributed: the candidates (or error) reached every rank
        self._winner: Optional[Trial] = None
        self.grad_bytes: Optional[int] = None  # the FP32 gradient buffers' bytes (lead only)
        self.safe_bytes = safe_bytes
        self._second_moment = second_moment
        self._outside_bytes = 0  # saved bytes the meter sees beyond the cost model's forward
        # The safe plan's predicted bytes (lead only): where a trial's measured bytes, in the cost
        # model's terms, equal the predicted ones by construction (`MemoryMargin.learn`'s anchor).
        self._safe_total: "float | None" = None
        # The measured stage's rounds (`MEMORY_ROUNDS`): the space the lead proposes from (not
        # checkpointed: a search resumed mid-trials proposes no further round), the round, the
        # margin it proposed under, and the earlier rounds' trials (for the result's record).
        self.alone = alone  # no other rank takes part: a round ends here, else on rank 0's word (`round_outcome`)
        self._found: Any = None
        self._round = 0
        self.memory = memory or MemoryMargin()
        self._earlier: list[dict] = []
        # Under torch.distributed, between a round's end (`_choose`, at the same step on every
        # rank) and the scheduler sharing rank 0's outcome (`settle_round`): rank 0's next round,
        # proposed and not yet begun, as (plans, margin).
        self.round_pending = False
        self._proposed: "tuple[list[Plan], float] | None" = None
        if restore is not None:
            self._restore(restore)
        self._snapshot: Optional[nn.Module] = None
        # Under FSDP2 every rank takes part in gathering the snapshot's parameters (`plain_copy`),
        # whether or not its copy is kept: the ranks need not agree on whether the work is done.
        sharded = not alone and is_sharded(model)
        start = time.perf_counter()
        if (lead and self.candidates is None) or sharded:  # the weights as the search is made: the off-path work's, while training goes on
            self._snapshot = plain_copy(model, keep=lead and self.candidates is None)
        if self._snapshot is not None:
            if restore is not None and restore.get("snapshot") is not None:
                self._snapshot.load_state_dict(restore["snapshot"])  # the saved search's, not the resumed weights
            self._add("snapshot", time.perf_counter() - start)
        self._offpath = self._offpath_units() if lead and self.candidates is None else None
        if self._offpath is None:  # no estimate will run (resumed past it): do not hold Adam's copy
            self._second_moment = None
        elif restore is not None and restore.get("snapshot") is not None:
            self._replay(restore.get("units", 0))
        if restore is not None:
            self._remake_runtimes(restore)  # after the snapshot: the saved one held none of them

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The search's progress as plain data: its inputs (profile, baseline, budgets' anchors),
        the probe plans and samples so far, the candidates once solved, the probe and trial
        runtimes' states, and, until the candidates exist, the snapshot the off-path work runs
        on (its tensors, not copies: nothing writes them; a model's worth of bytes) with Adam's
        second moment and the count of units run. Resumed (``restore=``), the search goes on
        exactly as if never stopped: probes and trials where they were, with their runtimes'
        calibration, and the off-path units run so far run again at once on that snapshot
        (one long first step), so the later ones follow the same steps."""
        return {
            "started": self.started, "steps": self.steps, "median_step": self.median_step, "longest_step": self.longest_step,
            "profile": None if self.profile is None else self.profile.to_dict(), "baseline_loss": self.baseline_loss,
            "safe_bytes": None if self.safe_bytes is None else [self.safe_bytes[0].value, self.safe_bytes[1]],
            "probes": [p.to_dict() for p in self._probes], "samples": {k: list(v) for k, v in self._samples.items()}, "rest": list(self._rest),
            "failing": [[role, fmt, why] for (role, fmt), why in self._failing.items()], "own_functions": list(self.own_functions),
            "timeline": dict(self.timeline), "candidates": None if self.candidates is None else [p.to_dict() for p in self.candidates],
            "grad_bytes": self.grad_bytes, "outside_bytes": self._outside_bytes,
            # Where the counted slices stand, and what the off-path work ran on (the snapshot's
            # tensors themselves: nothing writes them while the search holds them).
            "units": self._units, "starved": self._starved, "credit": self._credit, "solve_from": self._solve_from, "next_stage": self._next_stage, "unit_cost": dict(self._unit_cost),
            "snapshot": None if self._snapshot is None else self._snapshot.state_dict(),
            "second_moment": None if self._second_moment is None else dict(self._second_moment),
            "probe_runtimes": {i: rt.state_dict() for i, rt in self._probe_runtimes.items()},
            "trials": [{"steps": t.steps, "skipped": t.skipped, "seconds": list(t.seconds), "saved_bytes": t.saved_bytes, "dropped": t.dropped,
                        "blamed": t.blamed, "promoted": list(t.promoted), "plan": t.plan.to_dict() if t.promoted else None,
                        "runtime": None if t.runtime is None else t.runtime.state_dict()} for t in self._trials],
            "round": self._round, "margin": self.memory.margin, "earlier": list(self._earlier),
        }

    def _restore(self, state: Mapping[str, Any]) -> None:
        self.started, self.steps, self.median_step, self.longest_step = state["started"], state["steps"], state["median_step"], state["longest_step"]
        self.safe_bytes = None if state["safe_bytes"] is None else (Format.parse(state["safe_bytes"][0]), state["safe_bytes"][1])
        self._probes = [Plan.from_dict(p) for p in state["probes"]]
        self._samples = {k: list(v) for k, v in state["samples"].items()}
        self._failing = {(role, fmt): why for role, fmt, why in state.get("failing", ())}
        self.own_functions = tuple(state.get("own_functions", ()))
        self._rest = list(state["rest"])
        self.timeline = dict(state["timeline"])
        self.grad_bytes, self._outside_bytes = state["grad_bytes"], state["outside_bytes"]
        # Saved since issue 40 (absent from older checkpoints, whose resumed searches restart
        # the off-path work on the weights at resume, their probes' calibration and their trials).
        self._units, self._starved, self._credit = state.get("units", 0), state.get("starved", 0), state.get("credit", 0.0)
        self._solve_from = state.get("solve_from")
        self._next_stage, self._unit_cost = state.get("next_stage", ""), dict(state.get("unit_cost", {}))
        if state.get("second_moment") is not None:
            self._second_moment = dict(state["second_moment"])
        self._round, self.memory, self._earlier = state.get("round", 0), MemoryMargin(state.get("margin", 1.0)), list(state.get("earlier", ()))
        if state["candidates"] is not None:
            self.set_candidates([Plan.from_dict(p) for p in state["candidates"]])
            self.shared = True
            for trial, saved in zip(self._trials, state.get("trials", ())):
                trial.steps, trial.seconds, trial.saved_bytes, trial.dropped = saved["steps"], list(saved["seconds"]), saved["saved_bytes"], saved["dropped"]
                # Absent in a checkpoint of an earlier version: no skips counted, nothing promoted.
                trial.skipped, trial.blamed, trial.promoted = saved.get("skipped", 0), saved.get("blamed"), tuple(saved.get("promoted", ()))
                if saved.get("plan") is not None:
                    trial.plan = Plan.from_dict(saved["plan"])

    def _remake_runtimes(self, state: Mapping[str, Any]) -> None:
        """The probe and trial runtimes the saved search had made, made again in the same order
        with their states (INT8 calibration, amax histories): runtimes installed on one model
        together run a layer alike only when the same ones are installed."""
        for i, saved in sorted((int(i), s) for i, s in state.get("probe_runtimes", {}).items()):
            self._probe_runtimes[i] = self._runtime(self._probes[i])
            self._probe_runtimes[i].load_state_dict(saved)
        for trial, saved in zip(self._trials, state.get("trials", ())):
            if saved["runtime"] is not None:
                trial.runtime = self._runtime(trial.plan)
                trial.runtime.load_state_dict(saved["runtime"])

    # -- on the training path -----------------------------------------------------------------

    @property
    def probe_steps(self) -> int:
        return PROBE_ROUNDS * len(self._probes)

    def step_runtime(self) -> "tuple[str, Any] | None":
        """What the next training step runs: ``("probe", runtime)`` (time it per layer),
        ``("trial", runtime)`` (time it whole; meter its bytes when `wants_bytes`) or None (the
        safe precision: the search waits on off-path work). The runtimes are the search's
        (`close` removes them); a probe plan's runtime serves each of its cycles."""
        if self.done:
            return None
        if self.steps < self.probe_steps:
            i = self.steps % len(self._probes)
            if i not in self._probe_runtimes:
                self._probe_runtimes[i] = self._runtime(self._probes[i])
            return "probe", self._probe_runtimes[i]
        trial = self._trial()
        if trial is not None:
            if trial.runtime is None:
                trial.runtime = self._runtime(trial.plan)
            return "trial", trial.runtime
        return None

    def _runtime(self, plan: Plan) -> Any:
        """A probe's or candidate's runtime: a layer raising in its format runs in FP32 on that step
        (`PlanRuntime.tolerate_failures`); not `alone`, the error stands (ranks would part plans)."""
        runtime = apply_plan(self.model, plan, validate=False)
        if self.alone:
            runtime.tolerate_failures()
        return runtime

    def runs_eager(self) -> bool:
        """Whether the next training step must run eagerly: all but a compiled candidate's steps
        after its calibration (probe steps are timed per layer by hooks; a candidate's calibrating ones are
        metered; steps waiting on off-path work run the safe precision)."""
        trial = self._trial() if not self.done and self.steps >= self.probe_steps else None
        return trial is None or not trial.compiled or trial.steps < trial.calibration

    def _trial(self) -> "Optional[Trial]":
        return next((t for t in self._trials if not t.over), None)

    def wants_bytes(self) -> bool:
        """Whether the next step is a candidate's step that runs eagerly (meter its saved bytes:
        every one, the most counts, since a model that drops layers at random, HuBERT's LayerDrop,
        saves a dropped layer's tensors on some steps only)."""
        return self.runs_eager() and self._trial() is not None and self.steps >= self.probe_steps

    def record(self, kind: Optional[str], seconds: float, *, layer_seconds: Optional[Mapping[str, float]] = None,
               forward_seconds: Optional[Mapping[str, float]] = None, block_seconds: Optional[Mapping[str, float]] = None,
               saved_bytes: Optional[int] = None, skipped: bool = False, first_bad_output: Optional[str] = None,
               nonfinite: Sequence[str] = ()) -> None:
        """Report the step just run: its kind from `step_runtime` (None: safe precision), its
        seconds (forward to the end of the optimizer step), a probe step's per-layer seconds
        (forward + backward; and, with `blocks`, each layer's forward and each block's whole
        forward: `costs.inplace.StepTimer`), a metered step's saved bytes, whether the
        optimizer step was skipped, the layer whose output went non-finite first (the scaler
        names it once a non-finite loss armed its output checks) and the layers (or parameters)
        whose gradients were non-finite."""
        extra = max(0.0, seconds - self.median_step) if self.median_step is not None else 0.0
        self.longest_step = max(self.longest_step, seconds)
        if kind == "probe":
            self._add("probe steps", extra)
            i = self.steps % len(self._probes)
            plan = self._probes[i]
            failed = self._probe_runtimes[i].take_failures()
            if failed:  # those layers ran in FP32 on this step: not sampled, their format out for their role
                self._failing.update(failing_roles(plan, failed, self.roles))
                for j, probe in enumerate(self._probes):
                    self._probes[j] = without_failing(probe, self._failing, self.roles)
                    if self._probes[j] is not probe and j in self._probe_runtimes:
                        self._probe_runtimes.pop(j).remove()
            elif layer_seconds is not None and not skipped and self.steps >= len(self._probes):  # the first cycle warms up
                add_samples(self._samples, self._rest, plan, self.roles, self.blocks, seconds, layer_seconds, forward_seconds, block_seconds)
            self.steps += 1
            if self.steps == self.probe_steps:
                self._settle_probes()
            return
        self.steps += 1
        if kind != "trial":
            return
        self._add("trial steps", extra)
        trial = self._trial()
        if trial is None:
            raise RuntimeStateError("TrainingSearch.record('trial', ...): no candidate is being tried; report the kind step_runtime() gave")
        failed = trial.runtime.take_failures() if trial.runtime is not None else {}
        if failed:  # ran in FP32 on this step, which does not count: those layers stay FP32, the candidate starts again
            self._failing.update(failing_roles(trial.plan, failed, self.roles))
            restart(trial, without_failing(trial.plan, self._failing, self.roles))
            return
        if saved_bytes is not None:  # the most of its metered steps, checked against the budget when choosing (rank 0 decides)
            trial.saved_bytes = max(saved_bytes, trial.saved_bytes or 0)
        if skipped:
            # Every rank skips the same steps and names the same layer (the scaler agrees), so the
            # ranks still agree on the trial.
            trial.skip(first_bad_output, nonfinite)
            if self._trial() is None:
                self._choose()
            return
        trial.steps += 1
        if trial.steps > trial.warmup and trial.dropped is None:
            trial.seconds.append(seconds)
        if self._trial() is None:
            self._choose()

    def _add(self, stage: str, seconds: float) -> None:
        self.timeline[stage] = self.timeline.get(stage, 0.0) + seconds

    def _settle_probes(self) -> None:
        """Fold the probe samples into ``known``: medians per (role, format) and of the rest."""
        self.known.update({key: statistics.median(values) for key, values in self._samples.items()})
        if self._rest:
            self.known["rest"] = max(0.0, statistics.median(self._rest))

    # -- off the training path ------------------------------------------------------------------

    def work(self, passes: float) -> None:
        """Run off-path units within ``passes`` model passes (`unit_weight`; a training step is
        `units.PASSES_PER_STEP`): a unit starts only when its expected weight (the last unit's of its
        stage) fits in what is left; a slice that ran nothing hands its passes to the next (a unit
        heavier than one slice runs once two add up to it), and after two slices that ran nothing,
        one runs whatever its weight (a unit heavier than every slice must not stall the search).
        None runs after a probe step (with slower formats, an emulating CPU's, it is 2-3x a step
        itself). Weights are counts, never timings: machine load does not move units between steps."""
        if self._offpath is None or self.done or (0 < self.steps <= self.probe_steps and math.isfinite(passes)):
            return
        left = passes + self._credit
        ran = 0
        while True:
            expected = self._unit_cost.get(self._next_stage, 0.0)
            if (expected > left or left <= 0) and not (ran == 0 and self._starved >= 2):
                self._starved = self._starved + 1 if ran == 0 else 0
                self._credit = left if ran == 0 and math.isfinite(left) else 0.0
                return
            start = time.perf_counter()
            unit = self._next_unit()
            if unit is None or unit[0] == "waiting":
                return
            stage, weight = unit
            self._add(stage, time.perf_counter() - start)  # the timeline's seconds: reported, never decided on
            # Units of a stage are alike (a layer's forward, a (layer, format) of the sensitivity);
            # the next one is expected to weigh what this one did.
            self._unit_cost[stage] = weight
            self._next_stage = stage
            left -= weight
            ran += 1
            self._units += 1
            self._starved, self._credit = 0, 0.0

    def _next_unit(self) -> "tuple[str, float] | None":
        """The next off-path unit run: (its stage, its weight), ``("waiting", 0)`` while the
        probes run; None when the work ended (its candidates set) or failed (`error` set)."""
        if self._offpath is None:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EmulationWarning)  # the plan names its emulated layers itself
                return next(self._offpath)
        except StopIteration:
            self._offpath = None
        except AutoprecError as exc:
            self.error, self._offpath = exc, None
        return None

    def _replay(self, units: int) -> None:
        """A resumed search: run the ``units`` off-path units the saved one had run, at once and on
        its snapshot, so the next ones run after the same steps as in the run never stopped. The
        restored slice state and timeline are kept (the saved run's)."""
        kept = dict(self.timeline)
        for _ in range(units):
            unit = self._next_unit()
            if unit is None or unit[0] == "waiting":
                break
        self.timeline = kept

    def _offpath_units(self) -> Generator[tuple[str, float], None, None]:
        c = self.config
        snapshot = self._snapshot
        if snapshot is None:
            raise RuntimeStateError("TrainingSearch: off-path work without a snapshot (made with lead=False)")
        n = len(self.layers)
        pace = Pacer(snapshot, self.layers)  # each whole-model forward in parts, each its share of the forward's weight
        trace = yield from pace.units(lambda: trace_model(snapshot, self.example, None, layers=self.layers), "trace", unit_weight("trace", n))
        yield from (("device peaks", unit_weight("peak", n)) for _ in calibration_steps(next(snapshot.parameters()).device))  # a CPU's, once
        costs = CostModel(trace, RooflineTimeModel(), formats=[Format.FP32])
        yield from (("region bytes", pace.part * unit_weight("region bytes", n)) for _ in costs.region_bytes_steps(snapshot, self.example, None, roles=self.roles, pace=pace))
        yield from (("block bytes", pace.part * unit_weight("block forward", n) if label in ("block forward", "part") else 0.0)
                    for label in costs.block_bytes_steps(snapshot, self.example, None, self.blocks, roles=self.roles, pace=pace))
        sensitivity = yield from self._sensitivity(snapshot, [f for f in self.formats if f is not Format.FP32], pace)
        alternatives = []  # the formats' other recipes, each with its estimate
        for recipes in [[lp for lp in r if lp.format in self.formats] for r in c.planning.alternative_rounds()]:
            estimate = yield from self._sensitivity(snapshot, recipes, pace)
            alternatives += [(lp, estimate) for lp in recipes]
        snapshot.zero_grad(set_to_none=True)
        while self.steps < self.probe_steps:
            yield "waiting", 0.0  # the probe steps are still running
        for estimate in [sensitivity, *(e for _, e in alternatives)] if self._failing else []:
            mark_failed(estimate.metadata.setdefault("failed", {}), self._failing, self.roles)
        costs = probed_cost_model(costs, trace, self.known if self.measuring and not self.own_functions else None, self.layers, self.roles, self.formats,
                                  self.config.planning.precisions(), bool(self.blocks))
        planning = dataclasses.replace(c.planning, k=CANDIDATES if self.measuring else 1)
        self._found = yield from weighted(space_steps(costs, sensitivity, self.profile, planning, alternatives), "solve", n)
        self._planning = planning
        start = time.perf_counter()
        fp32 = costs.plan_cost(costs.uniform_plan(Format.FP32))
        self.grad_bytes = fp32.bytes - fp32.saved_bytes
        if self.safe_bytes is not None:
            # The loss's saved tensors beyond the cost model's forward (the same in every plan), measured on the window's last but one step;
            # never negative: a step that skipped layers (LayerDrop) made it so and inflated every trial's bytes (UniSpeech-SAT: -566,592).
            safe, measured = self.safe_bytes
            safe_cost = costs.plan_cost(costs.uniform_plan(safe))
            self._outside_bytes = max(0, measured - safe_cost.saved_bytes)
            self._safe_total = safe_cost.bytes
        # The integer programs run beside the next SOLVE_STEPS training steps (`background`) and
        # are taken then, done or not: the step the candidates arrive at is a count, not the
        # clock's (a resumed search waits for the same step).
        solving = BackgroundCall(lambda: self._propose(self.memory.margin), "autoprec-solve")
        self._add("solve", time.perf_counter() - start)
        if self._solve_from is None:
            self._solve_from = self.steps
        while c.search_slice is not None and self.steps < self._solve_from + SOLVE_STEPS:
            yield "waiting", 0.0
        proposal = solving.result()
        self._add("solve", solving.seconds)
        candidates = self._candidates(proposal)
        if self.own_functions:  # the model's own backward code, which a format may break: each candidate runs once first
            candidates = yield from weighted(preflight_each(snapshot, self.batches[-1], self.loss_fn, candidates, self.roles, self._failing),
                                             "preflight", n)
        self.set_candidates(candidates)

    def _candidates(self, proposal: Any) -> list[Plan]:
        """A proposal's plans and, when it meets the budgets, all-BF16 beside them: the plan
        adopted is never slower than it, as measured on these steps and in the mode they run in."""
        reference = uniform_reference(proposal, Format.BF16, self._planning.rules, self.fingerprint) if self.measuring and Format.BF16 in self.formats else None
        return [noted(without_failing(p, self._failing, self.roles), self.notes) for p in (*proposal.plans, *([reference] if reference is not None else []))]

    def _propose(self, margin: float = 1.0) -> Any:
        """The best plans of the space found off-path, under the memory budget divided by
        ``margin`` (the plans record the budget as given, and the margin); an infeasible budget
        names both floors and the settings that reach them. Costs the integer programs."""
        planning = self._planning
        budgets = planning.budgets
        fp32_bytes = self._found.costs.fp32_bytes()
        limit = self._predicted_limit(fp32_bytes)
        if limit is not None and (margin != 1.0 or self._outside_bytes):
            planning = dataclasses.replace(planning, budgets=dataclasses.replace(budgets, memory=max(MIN_BUDGET_BYTES, int(limit / margin))))
        try:
            proposal = propose_from(self._found, planning, baseline_loss=self.baseline_loss, fingerprint=self.fingerprint,
                                    metadata={"step": self.started, "source": "DynamicPrecisionScheduler"})
        except InfeasibleBudgetError as exc:
            if margin != 1.0 and exc.fp32_bytes:
                # Stated as measured: the least bytes any plan reaches, as the trials measured plans.
                need_bytes = self.memory.as_measured(exc.min_bytes, margin)
                need = self._planning.budgets.setting_for(need_bytes, exc.fp32_bytes, self._outside())
                raise InfeasibleBudgetError(
                    f"no plan meets the memory budget as measured: every candidate measured over it (by up to {self.memory.worst_ratio - 1:.1%} more "
                    f"bytes than predicted, {self._round} rounds), and as the training steps measure plans the smallest one within the "
                    f"loss budget needs more: raise memory_budget to at least {need}",
                    need_bytes, exc.min_loss) from None
            raise exc.with_hint(floor_settings(exc, memory="memory_budget", recompute="recompute=[]", recompute_off=self.config.recompute == ())) from None
        if planning is self._planning:
            return proposal
        # The plans record the budget as given, and the limit their predicted bytes keep to.
        given = {**proposal.budgets, "memory": budgets.memory, "memory_bytes": limit}
        extra = {"memory_margin": margin} if margin != 1.0 else {}
        plans = tuple(p.replace(budgets=given, metadata={**p.metadata, **extra}) for p in proposal.plans)
        return dataclasses.replace(proposal, plans=plans, budgets=given)

    def _predicted_limit(self, fp32_bytes: float) -> "float | None":
        """The memory budget in the cost model's terms (`PlanCost.bytes`, `Budgets.memory_limit`),
        None without one. The meter also sees what the cost model's forward does not (the
        loss's saved tensors, `_outside_bytes`, the same in every plan); without them a plan at
        the budget's edge metered over it (Qwen2 and GTE at 0.607 of 0.6). A sharded model's are
        left out (`_outside`)."""
        budgets = self._planning.budgets
        return None if budgets.memory is None else budgets.memory_limit(fp32_bytes, self._outside())

    def _outside(self) -> int:
        """`_outside_bytes`, but none for a sharded model: there the meter also counts the gathered
        weights autograd saves, which FSDP2 frees after the forward (storage resized to nothing),
        memory no step holds; under tensor parallelism a trial's bytes are a rank's share
        (`tensor_parallel.unsharded_bytes`)."""
        return 0 if is_sharded(self.model) else self._outside_bytes

    def _sensitivity(self, snapshot: nn.Module, lowered: Sequence[Any], pace: Pacer) -> Generator[tuple[str, float], None, Any]:
        if not lowered:
            return Sensitivity({"forward": {}, "grad": {}, "input_grad": {}}, total_of=("forward", "grad", "input_grad"), method="none", batches=0)
        # The last captured batch, and the estimate every search plans on (`search_estimator`).
        candidates = [precision_of(self.config.planning.precisions(), f) for f in lowered]
        steps = sensitivity_steps(snapshot, self.batches[-1:], self.loss_fn, candidates, layers=self.layers, example_inputs=self.example,
                                  estimator=search_estimator(self.config.lr),
                                  traced=self.fingerprint, second_moment=self._second_moment, pace=pace)
        return (yield from weighted(steps, "sensitivity", len(self.layers), paced=("recorded batch", pace.part)))

    # -- candidates and the result --------------------------------------------------------------

    def set_candidates(self, plans: Sequence[Plan]) -> None:
        """The plans to try on training steps (rank 0's, on the other ranks)."""
        self.candidates = list(plans)
        self._snapshot, self._second_moment = None, None  # a checkpoint no longer needs what the work ran on
        if not self.measuring:  # nothing to try: the predicted optimum is the result
            self.result = self.candidates[0]
            return
        self._trials = [Trial(p, self.compiled) for p in plans]

    def fail(self, error: AutoprecError) -> None:
        self.error = error

    def _choose(self) -> None:
        """The fastest candidate of the round that kept to the budgets as measured; when every
        one measured over the memory budget, the next round (`MEMORY_ROUNDS`), else `error`."""
        self.round_pending = not self.alone
        limit = self._trials[0].plan.budgets.get("memory_bytes") if self._trials else None  # type: ignore[attr-defined]
        for t in self._trials:
            # Measured saved bytes plus the FP32 gradient buffers (the same in every plan).
            if t.dropped is None and limit is not None and t.saved_bytes is not None and self.grad_bytes is not None:
                saved = unsharded_bytes(t.saved_bytes, self.safe_bytes, self._outside_bytes) if self.tensor_parallel else t.saved_bytes - self._outside_bytes
                t.total_bytes = total = saved + self.grad_bytes
                if total > limit:
                    t.dropped = f"measured {total:,} bytes, over the memory budget of {int(limit):,}"
        kept = [t for t in self._trials if t.dropped is None and t.seconds]
        if not kept:
            if self._next_round(limit):
                return
            why = "; ".join(f"candidate {i + 1}: {t['dropped']}" for i, t in enumerate(self._records()))
            self.error = SearchError(f"every candidate plan failed on the training steps ({why}); training stays at the safe precision")
            return
        best = min(kept, key=lambda t: statistics.median(t.seconds))
        # The trials come in the search's predicted order: a measured win smaller than the two
        # candidates' own step spread is noise, and the predicted fastest kept one stays.
        tied = best is not kept[0] and unseparated(kept[0].seconds, best.seconds)
        if tied:
            best = kept[0]
        self._winner = best
        self.result = best.plan.replace(measured={
            "source": "training steps", "step_seconds": statistics.median(best.seconds), "saved_bytes": best.saved_bytes,
            "bytes_over_predicted": best.bytes_over_predicted,  # a promotion pays from there (`promotion_bytes`)
            "search_timeline": dict(self.timeline), "search_steps": self.steps, "rounds": self._round + 1,
            "candidates": self._records(), "compiled": self.compiled, "within_noise": tied,
        })

    def _records(self) -> list[dict]:
        """Every candidate tried so far, earlier rounds first: its round, measured figures and why it was dropped."""
        current = [{"round": self._round, "rank": i, "step_seconds": statistics.median(t.seconds) if t.seconds else None,
                    "saved_bytes": t.saved_bytes, "dropped": t.dropped, "reference": t.plan.metadata.get("reference")}
                   for i, t in enumerate(self._trials)]
        return self._earlier + current

    def _next_round(self, limit: "float | None") -> bool:
        """Propose the next round when every candidate of this one measured over the memory
        budget's ``limit`` (bytes): under the budget divided by the margin learned
        (`memory_margin.MemoryMargin`: the ratios of measured to predicted bytes, and the line
        through the safe step). False (the search then fails) after `MEMORY_ROUNDS`, when a
        candidate failed otherwise, or without the space (a resumed search, a rank but the lead).
        Alone, the round begins here; under torch.distributed it waits for `settle_round`, so
        every rank begins it at the same step with rank 0's plans. An infeasible margin sets
        `error`, final."""
        if self._found is None or not MemoryMargin.all_over(self._trials):
            return False
        margin = self.memory.learn(self._trials, limit, self._safe_total)
        if self._round + 1 >= MEMORY_ROUNDS:  # the last: a retry starts from what it learned (`memory`)
            self.memory.margin = margin
            return False
        start = time.perf_counter()
        try:
            proposal = self._propose(margin)
        except InfeasibleBudgetError as exc:
            self.error = exc
            return True
        finally:
            self._add("solve", time.perf_counter() - start)
        plans = self._candidates(proposal)
        if self.alone:
            self._begin_round(plans, margin)
        else:
            self._proposed = (plans, margin)
        return True

    def _begin_round(self, plans: Sequence[Plan], margin: float) -> None:
        """The next round's candidates ``plans``, proposed under ``margin``: this round's trials
        kept as records, their runtimes off the model."""
        self._earlier = self._records()
        for t in self._trials:
            if t.runtime is not None:
                t.runtime.remove()
        self._round += 1
        self.memory.margin = margin
        self.result, self.error, self._winner = None, None, None
        self.set_candidates(plans)

    def round_outcome(self) -> dict:
        """Under torch.distributed, at a round's end (`round_pending`), what rank 0 sends the
        others (`settle_round`): its next round's plans and margin, or ``{"plans": None}`` when
        the round was the last (each rank keeps its own result or error; the scheduler adopts
        rank 0's). Plain data."""
        if self._proposed is None:
            return {"plans": None}
        plans, margin = self._proposed
        return {"plans": [p.to_dict() for p in plans], "margin": margin}

    def settle_round(self, outcome: Mapping[str, Any]) -> None:
        """Rank 0's `round_outcome` on every rank, rank 0 included: its next round begins here
        (every rank's trials restart on the same plans), or the search is done."""
        self.round_pending, self._proposed = False, None
        if outcome["plans"] is not None:
            self._begin_round([Plan.from_dict(p) for p in outcome["plans"]], outcome["margin"])

    @property
    def winner_index(self) -> "int | None":
        """The result's place among the trials (None: no trial ran), which rank 0 sends the others."""
        return next((i for i, t in enumerate(self._trials) if t is self._winner), None)

    def take_runtime(self, trial: "int | None" = None) -> Any:
        """The runtime of the result (or of rank 0's `winner_index` ``trial``), INT8 scales calibrated
        on the trial steps (None: no trial ran); `close` leaves it installed. Every rank keeps its
        own: one made afresh would calibrate again where the others' scales are frozen."""
        chosen = self._winner if trial is None else self._trials[trial] if trial < len(self._trials) else None
        if chosen is None:
            return None
        runtime, chosen.runtime = chosen.runtime, None
        runtime.tolerate_failures(False)  # the plan in force: an error stands
        return runtime

    def close(self) -> None:
        """Remove the probe and trial runtimes from the model (all but a taken one), and end the
        off-path work (its runtimes off the snapshot, the snapshot dropped)."""
        if self._offpath is not None:
            self._offpath.close()
            self._offpath = None
        self._snapshot, self._second_moment = None, None
        for runtime in [*self._probe_runtimes.values(), *(t.runtime for t in self._trials)]:
            if runtime is not None:
                runtime.remove()
        self._probe_runtimes.clear()
        for t in self._trials:
            t.runtime = None

    @property
    def done(self) -> bool:
        return not self.round_pending and (self.result is not None or self.error is not None)

    def summary(self) -> str:
        """One line: the timeline's stages in seconds, and the longest step against the median."""
        parts = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in self.timeline.items())
        ratio = f"; longest step {self.longest_step / self.median_step:.1f}x the median safe step" if self.median_step else ""
        return f"search over {self.steps} training steps: {parts}{ratio}"
