"""A plan on a ``torch.distributed.pipelining`` stage, given or searched on the stages: `StagePlan`.

A schedule runs each stage's forwards and backwards inside ``schedule.step()``, and only the last
stage computes the loss. The scheduler runs a given plan there
(``DynamicPrecisionScheduler.from_plan(stage_module, plan)``, the whole model's plan on every
stage) this way:

- each stage runs its part of the plan (`Plan.for_stage`), while the scheduler's plan is the
  whole plan, the same on every rank: loss scaling is on or off by it (an FP16 layer on any
  stage), so every stage unscales by the same scale;
- the schedule's loss function goes through ``DynamicPrecisionScheduler.pipeline_loss``, which
  gives the backward the scaled gradient and the schedule's ``losses`` the true loss;
- ``scheduler.step(optimizer)`` follows ``schedule.step()`` on every stage, and its one all-reduce
  of the step's flags (`distributed.RankAgreement`) spans the whole plan's layers in its order, so
  a non-finite gradient on any stage skips the step on all of them and their scales stay equal;
- nothing collective runs inside a forward (a stage binds inside the schedule, while its peers
  wait in a receive): at the first ``step()`` (`check_first_step`) the ranks compare their
  settings and whole plans, whether some stage's loss went through ``pipeline_loss``, which of the
  plan's layers each stage holds (every layer on some stage; two ranks hold the same layers or
  none in common, as data-parallel replicas of one stage do: a split that renumbers a
  ``ModuleList`` would run other layers' precisions), and how many stages each rank runs under a
  scheduler (one: with two, each scheduler would agree with one peer stage only);
- ``max_grad_norm`` clips by the whole model's gradient norm, summed over the stages
  (`RankAgreement.whole_norm`: one 8-byte all-reduce per optimizer and step), as the unsharded
  model's clip would.

**The seed's loop on the stages** (``DynamicPrecisionScheduler(stage_module, ...)``, no plan):
the same first-step check, after which every rank knows every stage's layers in stage order
(the schedule's ``stage_index``) and the step flags cover them all. The first window profiles
each stage at the safe precision; at its end every stage measures its own layers and rank 0
plans for all of them (`search`, `search.stages`): one plan, in force on every stage from the
next step. The in-run search's probe and trial steps do not run: the plan is the integer
program's optimum on the stages' measurements, not tried on training steps.

**Promotions and demotions** (a searched plan, or ``from_plan(..., dynamic=True)``) act on the
whole plan, the same way on every rank: the step flags name every stage's layers with
non-finite gradients, so each rank counts them and promotes alike; at a planned window's end
each stage's watch report (its own layers) is gathered and joined (`joined_report`), rank 0
reviews the whole plan on it and sends its decision (`RankAgreement.decide`), and each stage
runs its part of the new plan. A promotion is paid for by lowerings on its own stage (each
stage's memory budget: `promotion_bytes`). The planned steps' checks run on every stage
(`plan_checks`): saturation per layer, maxed over the ranks, and the accuracy budget measured as
the stages' terms of the linearised loss change, summed across the ranks with the last stage's
loss.

Costs: at the first step one ``all_gather_object`` of a hash, a
flag, a count, the stage's index and its layer names; per step nothing beyond the agreement's
all-reduce, one entry per layer of the whole pipeline; at a searching stage's window end its
measurement (`search.stages.measure_stage`), one gather of the tables and one broadcast of the
plan; at a planned window's end one gather of the watch reports, the decision's broadcast and
the plan hashes' gather.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..distributed import settings_hash
from ..errors import AutoprecError, DistributedError, InfeasibleBudgetError, RuntimeStateError, SearchError
from ..plan import Plan
from ..profiling.watch import WatchReport
from ..replica import is_sharded, plain_copy
from ..search.stages import StageTable, joint_plan, measure_stage
from ..sensitivity.capture import LinearisedLoss

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from .config import SchedulerConfig

__all__ = ["LOSS_REFUSAL", "StagePlan"]

# The last stage's loss must be scaled inside the schedule (its backward runs there), and the
# other stages unscale by the same scale: a loss function around the scheduler does both.
LOSS_REFUSAL = ("step(): no pipeline stage's loss went through the scheduler, so the gradients carry no loss scale and no stage saw the loss; "
                "build the schedule with loss_fn=scheduler.pipeline_loss(loss_fn) on the last stage's rank")

# The stages of this process bound under a scheduler and not closed (weakly: a dropped scheduler
# leaves once collected).
_LIVE: "weakref.WeakSet[StagePlan]" = weakref.WeakSet()


class StagePlan:
    """A stage's scheduler's pipeline: the whole plan (given, or searched on the stages: None
    until then), the stage's part of it, and the first step's check (module docstring)."""

    def __init__(self, whole: Optional[Plan], stage: nn.Module, index: Optional[int] = None):
        self.stage = stage
        self.index = index  # the schedule's stage_index (None: not seen; the rank orders the stages)
        self.whole: Optional[Plan] = None  # the plan given, or searched on the stages (None until then)
        self.part: Optional[Plan] = None  # this stage's part of it
        self.layers: tuple[str, ...] = ()  # a searching stage's: every stage's layers in stage order, from its first step
        self.measures = True  # a searching stage's: this rank is the first holding its stage (the others' tables would repeat it)
        # The stage's outputs' dtypes, as its first forward sent them (`_keep_wire`).
        self._wire: tuple = ()
        self._wire_hook: Any = stage.register_forward_hook(self._note_wire)
        if whole is not None:
            self.adopt(whole)
        self._losses = 0  # losses noted through pipeline_loss before the first step
        self._checked = False
        _LIVE.add(self)

    @classmethod
    def renew(cls, previous: "Optional[StagePlan]", whole: Optional[Plan], stage: Optional[nn.Module], index: Optional[int] = None) -> "Optional[StagePlan]":
        """A scheduler's stage afresh: ``previous`` released, and ``stage`` running ``whole``
        (None: its plan is searched on the stages), or None when the model is no stage."""
        if previous is not None:
            previous.release()
        return cls(whole, stage, index) if stage is not None else None

    @property
    def searching(self) -> bool:
        """No plan yet: the stages search one together (`search.stages`)."""
        return self.whole is None

    def adopt(self, whole: Plan) -> None:
        """``whole`` (the whole pipeline's plan, searched on the stages) is the stage's plan."""
        self.whole, self.part = whole, whole.for_stage(self.stage)

    def _note_wire(self, module: nn.Module, args: Any, output: Any) -> None:
        """The stage's first forward: the dtypes of its floating outputs; `_keep_wire` from then on."""
        self._wire = tuple(t.dtype if torch.is_tensor(t) and t.is_floating_point() else None for t in _outputs(output))
        self._wire_hook.remove()
        self._wire_hook = self.stage.register_forward_hook(self._keep_wire)

    def _keep_wire(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Each floating output cast back to the dtype the stage's first forward sent (a plan
        searched after the window, or a promotion or demotion, may end the stage in BF16 where
        the first steps ended it in FP32). The pipeline took its buffers' dtypes from the first
        step (shape inference): torch 2.11 refuses the other dtype ("dtype mismatch"), and the
        next stage receives into those buffers. A cast kernel per output that differs, per
        forward; nothing where the dtypes agree."""
        outputs = _outputs(output)
        if len(outputs) != len(self._wire) or all(t is None or not torch.is_tensor(t) or t.dtype == d for t, d in zip(outputs, self._wire)):
            return None
        cast = [t.to(d) if d is not None and torch.is_tensor(t) and t.dtype != d else t for t, d in zip(outputs, self._wire)]
        return cast[0] if torch.is_tensor(output) else type(output)(cast)

    def agreed_layers(self, own: Sequence[str]) -> tuple[str, ...]:
        """The layers every rank's step flags cover, in one order: the whole plan's; a searching
        stage's own ``own`` layers until its first step has gathered every stage's."""
        return tuple(self.whole.layers) if self.whole is not None else self.layers or tuple(own)

    def note_loss(self) -> None:
        """A loss went through the scheduler on this stage."""
        self._losses += 1

    def release(self) -> None:
        """The scheduler closed: this stage no longer counts as one this process runs, its hooks removed."""
        _LIVE.discard(self)
        if self._wire_hook is not None:
            self._wire_hook.remove()
            self._wire_hook = None

    def check_first_step(self, agreement: "Optional[RankAgreement]", config: "SchedulerConfig", own: Sequence[str]) -> None:
        """At the first ``step()``, on every stage, the same answer on every rank (module
        docstring): `DistributedError` naming the ranks for other settings or plans, layers
        held by no stage or by stages that overlap, or a rank running several stages;
        `RuntimeStateError` (`LOSS_REFUSAL`) when no stage's loss was noted. A searching stage
        (``own``: its layers in model order) learns every stage's layers, in stage order, and
        the agreement's step flags cover them from this step on. Nothing after the first step."""
        if self._checked:
            return
        # Stages before their first step: a looped schedule's stages on this rank all are (the
        # earlier runs' schedulers, stepped, are not, however long the garbage collector keeps them).
        starting = sum(1 for stage in _LIVE if not stage._checked)
        names = list(self.part.layers) if self.part is not None else list(own)
        mine = (settings_hash(config, self.whole), self._losses > 0, starting, names, self.index)
        ranks: list[Any] = agreement.gather(mine) if agreement is not None else [mine]
        _check_stages(ranks, self.whole)
        if not any(noted for _, noted, *_ in ranks):
            raise RuntimeStateError(LOSS_REFUSAL)
        if self.whole is None:
            order = sorted(range(len(ranks)), key=lambda r: (r if ranks[r][4] is None else ranks[r][4], r))
            self.layers = tuple(dict.fromkeys(fqn for r in order for fqn in ranks[r][3]))
            if agreement is not None:
                agreement.hold_layers(self.stage, self.layers)
                self.measures = agreement.rank == min(r for r in range(len(ranks)) if set(ranks[r][3]) == set(names))
        if agreement is not None:  # data-parallel copies of a stage hold its layers alike
            agreement.set_stages(len(ranks) // len({frozenset(names) for _, _, _, names, _ in ranks}))
        self._checked = True

    def search_window(self, agreement: "Optional[RankAgreement]", model: nn.Module, captured: list, profile: Any, baseline_loss: Optional[float],
                      config: "SchedulerConfig", fingerprint: Mapping[str, Any], step: int) -> Plan:
        """`search` at a searching stage's first window's end: ``model`` (the stage) measured on
        its last ``captured`` call and output gradient (`measure_stage`, ``profile``: the
        stage's own window; ``baseline_loss``: its window's mean loss, None on a stage without
        the loss), the plan made by `joint_plan` under ``config``'s budgets."""
        planning = config.planning

        def measure() -> "Optional[StageTable]":
            # A sharded stage (FSDP2, tensor parallel) is measured whole, on a copy every rank
            # holding it gathers, by the first of them; its data-parallel copies measure nothing.
            measured = plain_copy(model, keep=self.measures) if is_sharded(model) else model if self.measures else None
            if measured is None:
                return None
            if not captured:
                raise SearchError("no gradient reached the stage's output in the window's captured steps")
            return measure_stage(measured, captured[-1][0], captured, LinearisedLoss(), profile, planning, index=self.index or 0,
                                 fingerprint=fingerprint, recompute=config.recompute)

        def plan_of(tables: "list[StageTable]", baseline: Optional[float]) -> Plan:
            return joint_plan(tables, planning, baseline_loss=baseline, device=next(model.parameters()).device, source="scheduler: ",
                              metadata={"source": "scheduler", "step": step})

        return self.search(agreement, measure, baseline_loss, plan_of)

    def joined_report(self, agreement: "Optional[RankAgreement]", report: Any) -> Any:
        """At a planned window's end: every stage's watch ``report`` (each watched its own
        layers), joined (`WatchReport.joined`) for the review, which rank 0 makes of the whole
        plan and sends (`RankAgreement.decide`). One ``all_gather_object`` of the reports (a
        few hundred bytes per watched layer)."""
        return WatchReport.joined(agreement.gather(report)) if agreement is not None else report

    def search(self, agreement: "Optional[RankAgreement]", measure: "Callable[[], Optional[StageTable]]", loss: Optional[float],
               plan_of: "Callable[[list[StageTable], Optional[float]], Plan]") -> Plan:
        """The stages' joint plan, adopted (`search.stages`): every rank ``measure`` s its stage
        (None: a rank whose stage another rank measures), the tables are gathered with each
        rank's window ``loss`` (None on a stage without it), rank 0 makes the plan of them and
        the losses' mean (``plan_of``) and sends it; every rank raises the same error when a
        stage's measurement or the plan fails (an `InfeasibleBudgetError` stays one). Returns
        the whole plan, adopted. One ``all_gather_object`` of the tables (a few KiB per layer)
        and one ``broadcast_object_list`` of the plan's JSON."""
        try:
            mine: "tuple[Optional[StageTable], Optional[str], Optional[float]]" = (measure(), None, loss)
        except Exception as exc:  # sent, not raised: the other stages wait in the gather (a model's own error too)
            mine = (None, f"pipeline stage {self.index}: {_said(exc)}", loss)
        gathered = agreement.gather(mine) if agreement is not None else [mine]
        failed = [error for _, error, _ in gathered if error is not None]
        losses = [value for _, _, value in gathered if value is not None]
        outcome: Any = {"error": failed[0], "floors": None} if failed else None
        if outcome is None and (agreement is None or agreement.rank == 0):
            try:
                outcome = plan_of([table for table, _, _ in gathered if table is not None], sum(losses) / len(losses) if losses else None).to_dict()
            except InfeasibleBudgetError as exc:  # the budgets no plan meets: not searched again
                outcome = {"error": str(exc), "floors": (exc.min_bytes, exc.min_loss)}
            except Exception as exc:  # sent, not raised: the other ranks wait for the plan
                outcome = {"error": _said(exc), "floors": None}
        if agreement is not None and not failed:
            outcome = agreement.share(outcome)
        if "error" in outcome:
            if outcome["floors"] is not None:
                raise InfeasibleBudgetError(outcome["error"], *outcome["floors"])
            raise SearchError(outcome["error"])
        whole = Plan.from_dict(outcome)
        self.adopt(whole)
        return whole


def _said(exc: Exception) -> str:
    """An error in one line's words: autoprec's own message, another's with its type."""
    return str(exc) if isinstance(exc, AutoprecError) else f"{type(exc).__name__}: {exc}"


def _outputs(output: Any) -> tuple:
    """A stage's outputs as the pipeline sends them: a tensor alone, or a tuple or list of them."""
    return (output,) if torch.is_tensor(output) else tuple(output) if isinstance(output, (tuple, list)) else ()


def _check_stages(ranks: list, whole: Optional[Plan]) -> None:
    """`DistributedError` for the first thing wrong in ``ranks`` (each rank's hash, loss noted,
    stages run, layer names and stage index), in one line; ``whole``: the plan every layer
    must be held of (None: a searched plan's stages)."""
    other = [r for r, (h, *_) in enumerate(ranks) if h != ranks[0][0]]
    if other:
        raise DistributedError(f"pipeline rank {', '.join(map(str, other))} holds other scheduler settings or another plan than rank 0; "
                               "give every stage the same settings and the whole model's plan (each stage runs its own layers' part)")
    several = [r for r, (_, _, stages, *_) in enumerate(ranks) if stages > 1]
    if several:
        raise DistributedError(f"pipeline rank {several[0]} runs {ranks[several[0]][2]} stages under schedulers, whose skip decisions and loss scales "
                               "would each agree with one peer stage only; run one stage per rank (GPipe, 1F1B), or apply_plan to each stage of a looped schedule")
    stages: dict[frozenset, int] = {}  # each distinct stage -> the first rank holding it (pairs over stages, not ranks)
    for r, (_, _, _, names, _) in enumerate(ranks):
        stages.setdefault(frozenset(names), r)
    for names, r in stages.items():
        for other_names, q in stages.items():
            if q < r and names & other_names:
                fqn = sorted(names & other_names)[0]
                raise DistributedError(f"pipeline ranks {q} and {r} hold different stages that both name a layer {fqn!r}: the stages' modules are not named as "
                                       "in the whole model (a split that renumbers a ModuleList); keep the whole model's names (an nn.ModuleDict of blocks, as torchtitan's Llama)")
    missing = sorted(set(whole.layers) - set().union(*stages)) if whole is not None else []
    if missing:
        raise DistributedError(f"no pipeline stage holds the plan's layer {missing[0]!r} ({len(missing)} such); give each stage's scheduler its module as the pipeline split made it, "
                               "and every rank of the pipeline the scheduler")
