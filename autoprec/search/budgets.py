"""What a plan may spend: the memory and accuracy budgets (`Budgets`), and the spellings a
memory budget takes (`memory_budget`: a fraction of the FP32 bytes, or bytes)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from ..errors import SearchError

__all__ = ["Budgets", "MEMORY_SPELLINGS", "MIN_BUDGET_BYTES", "memory_budget", "finite_number"]


def finite_number(value) -> bool:
    """Whether ``value`` is an int or float (not a bool) and finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Budgets:
    """What a plan may spend.

    ``memory``, two spellings: a float in (0, 1] is a fraction of the all-FP32 bytes; an integer,
    or a size string such as ``"6GiB"`` or ``"512MB"``, is bytes (`memory_budget`: stored as the
    float fraction or the int bytes). ``accuracy``: the allowed loss increase, relative to
    ``baseline_loss`` when ``accuracy_relative`` (0.01 = 1 %), else absolute. ``None`` leaves a
    budget open.
    """

    memory: "float | int | str | None" = None
    accuracy: "float | None" = None
    accuracy_relative: bool = True

    def __post_init__(self):
        try:
            object.__setattr__(self, "memory", memory_budget(self.memory))
        except ValueError as exc:
            raise SearchError(f"memory budget: expected {MEMORY_SPELLINGS}, got {self.memory!r} ({exc})") from None
        if self.accuracy is not None and not (finite_number(self.accuracy) and self.accuracy >= 0):
            raise SearchError(f"accuracy budget must be a finite number >= 0 or None, got {self.accuracy!r}")

    def memory_bytes(self, fp32_bytes: float) -> float:
        """The memory budget in bytes.

        Args:
            fp32_bytes: the all-FP32 plan's bytes, which a fractional budget is a fraction of.

        Returns:
            Bytes a plan may hold per step; ``inf`` when the budget is open.
        """
        if self.memory is None:
            return float("inf")
        return float(self.memory) if isinstance(self.memory, int) else float(self.memory) * fp32_bytes  # a str was parsed to bytes

    def memory_limit(self, fp32_bytes: float, outside: float = 0) -> float:
        """The memory budget as a limit on a plan's predicted bytes, when the step that the
        budget is measured on also holds ``outside`` bytes the prediction leaves out (the
        loss's saved tensors, the same in every plan): predicted bytes P meet a fraction b of
        the FP32 step when P + o <= b (F + o), so the limit is b (F + o) - o (an absolute
        budget M: M - o); ``inf`` when the budget is open."""
        return self.memory_bytes(fp32_bytes + outside) - outside

    def setting_for(self, predicted: float, fp32_bytes: float, outside: float = 0) -> str:
        """The least ``memory_budget``, spelled as this one was (a fraction to 3 places, or
        bytes), whose `memory_limit` holds ``predicted`` bytes."""
        if isinstance(self.memory, int):
            return str(math.ceil(predicted + outside))
        return f"{math.ceil(1000 * (predicted + outside) / (fp32_bytes + outside)) / 1000:.3f}"

    def loss_increase(self, baseline_loss: "float | None") -> float:
        """The accuracy budget as an absolute loss increase.

        Args:
            baseline_loss: the FP32 loss a relative budget is a fraction of (its magnitude is
                used); unused by an absolute or open budget.

        Returns:
            The loss increase a plan may add, in the loss's units; ``inf`` when the budget is open.

        Raises:
            SearchError: a relative budget with ``baseline_loss`` None.
        """
        if self.accuracy is None:
            return float("inf")
        if not self.accuracy_relative:
            return float(self.accuracy)
        if baseline_loss is None:
            raise SearchError("a relative accuracy budget needs the baseline (FP32) loss; pass baseline_loss or set accuracy_relative=False")
        return self.accuracy * abs(baseline_loss)


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_UNIT_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_BUDGET_BYTES = 1024  # the least memory budget in bytes: below it an integer is a mistaken fraction
MEMORY_SPELLINGS = "a fraction of the FP32 bytes as a float in (0, 1], or bytes as an integer or a size string such as '6GiB'"


def memory_budget(value: "float | int | str | None") -> "float | int | None":
    """A memory budget as a user spells it (`Budgets`): the fraction as a float, the bytes as an
    int, or None. Raises ValueError saying what is wrong with it (callers add `MEMORY_SPELLINGS`):
    ``1.5`` is neither a fraction nor bytes (it used to mean 1.5 bytes)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise ValueError(f"a {type(value).__name__}")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            raise ValueError(f"{value!r} is not a size (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        size = float(match.group(1)) * _UNIT_BYTES[(match.group(2) or "b").lower()]
        if not 1 <= size < 2**63:
            raise ValueError(f"{value!r} is not a positive number of bytes")
        return int(size)
    if isinstance(value, numbers.Integral):
        if value < MIN_BUDGET_BYTES:  # 1 means 1.0 far more often than one byte
            raise ValueError(f"{value} bytes is no budget for a model; a fraction is a float such as 1.0")
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{value} is not finite")
    if not 0 < value <= 1:
        raise ValueError(f"{value} is a float outside (0, 1], so no fraction; bytes are an integer")
    return value
