"""A precision change: one layer moved from one format to another at a step, and why (or, a
backward change, its gradient format alone: a high-precision backward taken or given back).

Records made by the scheduler's policy (`scheduler.policy`: promotions and demotions) and drawn
by the review (`monitoring.training_writer`); plain data, saved in checkpoints as dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from .formats import Format

__all__ = ["PrecisionChange"]


@dataclasses.dataclass(frozen=True)
class PrecisionChange:
    """Layer ``fqn`` moved from format ``old`` to ``new`` at optimizer step ``step``, and why.
    A backward change (``old_grad`` and ``new_grad`` set, ``old`` is ``new``) keeps the layer's
    format and moves its gradient format only."""

    step: int
    fqn: str
    old: Format
    new: Format
    reason: str = ""
    old_grad: Optional[Format] = None
    new_grad: Optional[Format] = None

    @property
    def backward_only(self) -> bool:
        return self.new_grad is not None

    @property
    def direction(self) -> str:
        """``"promotion"`` to more bits, ``"demotion"`` to fewer, ``"lateral"`` for the same
        width (fp8_e4m3 → fp8_e5m2, fp16 → bf16); a backward change by its gradient formats."""
        old, new = (self.old_grad, self.new_grad) if self.old_grad is not None and self.new_grad is not None else (self.old, self.new)
        if new.bits == old.bits:
            return "lateral"
        return "promotion" if new.bits > old.bits else "demotion"

    def describe(self) -> str:
        """``old -> new`` as a log line says it (a backward change: the gradient formats)."""
        if self.old_grad is not None and self.new_grad is not None:
            return f"{self.old.value} backward {self.old_grad.value} -> {self.new_grad.value}"
        return f"{self.old.value} -> {self.new.value}"

    def to_dict(self) -> dict:
        grads = {"old_grad": self.old_grad.value, "new_grad": self.new_grad.value} if self.old_grad is not None and self.new_grad is not None else {}
        return {"step": self.step, "fqn": self.fqn, "old": self.old.value, "new": self.new.value, "reason": self.reason, **grads}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PrecisionChange":
        grads = (Format.parse(data["old_grad"]), Format.parse(data["new_grad"])) if data.get("new_grad") is not None else (None, None)
        return cls(data["step"], data["fqn"], Format.parse(data["old"]), Format.parse(data["new"]), data["reason"], *grads)
