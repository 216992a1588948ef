"""A fixed plan on a ``torch.distributed.pipelining`` stage: `StagePlan`.

A schedule runs each stage's forwards and backwards inside ``schedule.step()``, and only the last
stage computes the loss. The scheduler runs a given plan there
(``DynamicPrecisionScheduler.from_plan(stage_module, plan)``, the whole model's plan on every
stage) this way:

- each stage runs its part of the plan (`Plan.for_stage`), while loss scaling is on or off by the
  whole plan (an FP16 layer on any stage): every stage unscales by the same scale;
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

The in-run search and re-planning need the loss and every layer on one rank: refused on a stage
(`step_checks.PIPELINE_REFUSAL`). Costs: at the first step one ``all_gather_object`` of a hash, a
flag, a count and the stage's layer names; per step nothing beyond the agreement's all-reduce, one
entry per layer of the whole plan.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch.nn as nn

from ..distributed import settings_hash
from ..errors import DistributedError, RuntimeStateError
from ..plan import Plan
from .plan_keeper import needs_loss_scaling

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
    """The whole plan given to a stage's scheduler, the stage's part of it, and the first step's
    check (module docstring)."""

    def __init__(self, whole: Plan, stage: nn.Module):
        self.whole = whole
        self.part = whole.for_stage(stage)
        self.loss_scaling = needs_loss_scaling(whole)  # by the whole plan: the same on every stage
        self._losses = 0  # losses noted through pipeline_loss before the first step
        self._checked = False
        _LIVE.add(self)

    @classmethod
    def renew(cls, previous: "Optional[StagePlan]", whole: Optional[Plan], stage: Optional[nn.Module]) -> "Optional[StagePlan]":
        """A scheduler's stage afresh: ``previous`` released, and the stage of ``whole`` on
        ``stage`` (None without a plan or a stage: the scheduler runs no fixed plan on one)."""
        if previous is not None:
            previous.release()
        return cls(whole, stage) if whole is not None and stage is not None else None

    def note_loss(self) -> None:
        """A loss went through the scheduler on this stage."""
        self._losses += 1

    def release(self) -> None:
        """The scheduler closed: this stage no longer counts as one this process runs."""
        _LIVE.discard(self)

    def check_first_step(self, agreement: "Optional[RankAgreement]", config: "SchedulerConfig") -> None:
        """At the first ``step()``, on every stage, the same answer on every rank (module
        docstring): `DistributedError` naming the ranks for other settings or plans, layers
        held by no stage or by stages that overlap, or a rank running several stages;
        `RuntimeStateError` (`LOSS_REFUSAL`) when no stage's loss was noted. Nothing after the
        first step."""
        if self._checked:
            return
        # Stages before their first step: a looped schedule's stages on this rank all are (the
        # earlier runs' schedulers, stepped, are not, however long the garbage collector keeps them).
        starting = sum(1 for stage in _LIVE if not stage._checked)
        mine = (settings_hash(config, self.whole), self._losses > 0, starting, sorted(self.part.layers))
        ranks: list[Any] = agreement.gather(mine) if agreement is not None else [mine]
        _check_stages(ranks, self.whole)
        if not any(noted for _, noted, _, _ in ranks):
            raise RuntimeStateError(LOSS_REFUSAL)
        if agreement is not None:  # data-parallel copies of a stage hold its layers alike
            agreement.set_stages(len(ranks) // len({frozenset(names) for *_, names in ranks}))
        self._checked = True


def _check_stages(ranks: list, whole: Plan) -> None:
    """`DistributedError` for the first thing wrong in ``ranks`` (each rank's hash, loss noted,
    stages run and layer names), in one line."""
    other = [r for r, (h, *_) in enumerate(ranks) if h != ranks[0][0]]
    if other:
        raise DistributedError(f"pipeline rank {', '.join(map(str, other))} holds other scheduler settings or another plan than rank 0; "
                               "give every stage the same settings and the whole model's plan (each stage runs its own layers' part)")
    several = [r for r, (_, _, stages, _) in enumerate(ranks) if stages > 1]
    if several:
        raise DistributedError(f"pipeline rank {several[0]} runs {ranks[several[0]][2]} stages under schedulers, whose skip decisions and loss scales "
                               "would each agree with one peer stage only; run one stage per rank (GPipe, 1F1B), or apply_plan to each stage of a looped schedule")
    stages: dict[frozenset, int] = {}  # each distinct stage -> the first rank holding it (pairs over stages, not ranks)
    for r, (*_, names) in enumerate(ranks):
        stages.setdefault(frozenset(names), r)
    for names, r in stages.items():
        for other_names, q in stages.items():
            if q < r and names & other_names:
                fqn = sorted(names & other_names)[0]
                raise DistributedError(f"pipeline ranks {q} and {r} hold different stages that both name a layer {fqn!r}: the stages' modules are not named as "
                                       "in the whole model (a split that renumbers a ModuleList); keep the whole model's names (an nn.ModuleDict of blocks, as torchtitan's Llama)")
    missing = sorted(set(whole.layers) - set().union(*stages))
    if missing:
        raise DistributedError(f"no pipeline stage holds the plan's layer {missing[0]!r} ({len(missing)} such); give each stage's scheduler its module as the pipeline split made it, "
                               "and every rank of the pipeline the scheduler")
