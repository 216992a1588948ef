"""A precision change: one layer moved from one format to another at a step, and why.

Records made by the scheduler's policy (`scheduler.policy`: promotions and demotions) and drawn
by the review (`monitoring.training_writer`); plain data, saved in checkpoints as dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .formats import Format

__all__ = ["PrecisionChange"]


@dataclasses.dataclass(frozen=True)
class PrecisionChange:
    """Layer ``fqn`` moved from format ``old`` to ``new`` at optimizer step ``step``, and why."""

    step: int
    fqn: str
    old: Format
    new: Format
    reason: str = ""

    @property
    def direction(self) -> str:
        """``"promotion"`` to more bits, ``"demotion"`` to fewer, ``"lateral"`` for the same
        width (fp8_e4m3 → fp8_e5m2, fp16 → bf16)."""
        if self.new.bits == self.old.bits:
            return "lateral"
        return "promotion" if self.new.bits > self.old.bits else "demotion"

    def to_dict(self) -> dict:
        return {"step": self.step, "fqn": self.fqn, "old": self.old.value, "new": self.new.value, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PrecisionChange":
        return cls(data["step"], data["fqn"], Format.parse(data["old"]), Format.parse(data["new"]), data["reason"])
