"""The memory margin a search learns on its training steps: `MemoryMargin`.

The cost model predicts a plan's bytes; the training steps measure them. When every candidate of a
round measured over the memory budget, the next round is proposed under the budget divided by a
margin learned from those measurements (`search.in_run`, at most ``MEMORY_ROUNDS`` rounds):

- at least every measured-to-predicted ratio seen, and
- what the line through the safe step and the round's trials asks for. Bytes no plan lowers (FP32
  norms and residuals, the loss) are a constant c, so measured = c + s * predicted rather than
  r * predicted, and a plan proposed under budget / r comes out over again. That constant is large
  under tensor parallelism, where a rank keeps the replicated FP32 parts whole: 3 rounds of ratios
  ended 0.06 % over at ``memory_budget=0.8`` on the TP Llama of tests/runtime/test_tensor_parallel.py.
  The line passes through the safe plan (its measured bytes equal the predicted ones by
  construction) with the trials' least-squares slope; where it meets the limit gives the predicted
  bytes a plan may take.

Plain arithmetic on a few numbers per round.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from .trials import Trial

__all__ = ["MEMORY_ROUNDS", "MemoryMargin"]

# Rounds of candidates: when every candidate of a round measures over the memory budget, the next
# round's are proposed under the learned margin; after the last, the search fails for good.
MEMORY_ROUNDS = 3


class MemoryMargin:
    """What one search learned of its plans' measured bytes. ``margin``: the one the current
    round was proposed under (1.0 before any; a checkpoint keeps it)."""

    def __init__(self, margin: float = 1.0):
        self.margin = margin
        self.worst_ratio = 1.0  # the largest measured-to-predicted bytes ratio seen
        self.line: "tuple[float, float] | None" = None  # (anchor, slope) of the last `learn`

    @staticmethod
    def all_over(trials: Sequence[Trial]) -> bool:
        """Whether every trial was dropped for measuring over the memory budget (and has a prediction)."""
        return bool(trials) and all(t.total_bytes is not None and t.dropped is not None and t.dropped.startswith("measured")
                                    and t.plan.predicted.get("bytes") for t in trials)

    def learn(self, trials: Sequence[Trial], limit: Optional[float], anchor: Optional[float]) -> float:
        """The margin the next round is proposed under, from ``trials`` (a round's, all measured
        over: `all_over`), the budget's ``limit`` and the safe plan's predicted bytes ``anchor``
        (None: no metered safe step, ratios only); inf where the line says no plan can meet it."""
        points = [(float(t.plan.predicted["bytes"]), float(t.total_bytes or 0)) for t in trials]
        self.worst_ratio = max(self.worst_ratio, *(m / p for p, m in points))
        margin = max(self.margin, self.worst_ratio)
        self.line = None
        if limit is None or anchor is None or limit >= anchor:
            return margin
        spread = sum((p - anchor) ** 2 for p, _ in points)
        slope = sum((p - anchor) * (m - anchor) for p, m in points) / spread if spread > 0 else 0.0
        if slope <= 0:
            return margin
        self.line = (anchor, slope)
        reach = anchor + (limit - anchor) / slope  # predicted bytes whose measured bytes meet the limit, on the line
        return max(margin, limit / reach) if reach > 0 else math.inf

    def as_measured(self, predicted: float, margin: float) -> float:
        """``predicted`` bytes as the trials would measure them: on the learned line, and at
        least times the worst ratio; times ``margin`` (the one `learn` gave) without a line."""
        if self.line is None:
            return predicted * margin
        anchor, slope = self.line
        return max(predicted * self.worst_ratio, anchor + slope * (predicted - anchor))
