"""Which weights FSDP2 all-gathers in FP8, switched with the plan in force: `GatherSwitch`.

A plan put in force changes the gather format of its FP8 E4M3 per-tensor layers
(`runtime.fsdp_fp8.Fp8AllGather`). Never between a forward and its backward: FSDP2 re-gathers the
weights there into the buffers autograd saved, so a plan installed mid-step switches the gathers
at the next `step` call, after that backward.

Costs: the switch's (`Fp8AllGather.apply`: a scan of the model's FSDP2 parameters), once per
plan put in force; nothing per step otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch.nn as nn

from ..runtime.fsdp_fp8 import Fp8AllGather

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["GatherSwitch"]


class GatherSwitch:
    """The FP8 all-gathers of one FSDP2 model, switched between steps (module docstring)."""

    def __init__(self, gathers: Fp8AllGather):
        self.gathers = gathers
        self._due: "Optional[Plan]" = None  # a plan whose gathers start after this step's backward

    @classmethod
    def join(cls, model: nn.Module) -> "Optional[GatherSwitch]":
        """The switch for ``model`` if it holds an FSDP2 unit, else None (`Fp8AllGather.join`)."""
        gathers = Fp8AllGather.join(model)
        return None if gathers is None else cls(gathers)

    def on_plan(self, plan: "Plan", mid_step: bool) -> None:
        """``plan`` is in force; ``mid_step``: a forward ran (or runs) whose backward has not, so
        the switch waits for `before_step`."""
        if mid_step:
            self._due = plan
        else:
            self.gathers.apply(plan)

    def before_step(self) -> None:
        """Switch to the plan installed mid-step, if any: its backward has run."""
        if self._due is not None:
            self.gathers.apply(self._due)
            self._due = None

    def close(self) -> None:
        """FSDP2 gathers every weight as it did before."""
        self.gathers.apply(None)
