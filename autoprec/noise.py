"""Deciding between measured step times that know their own noise.

A measured step time is only as good as the machine was quiet. Each comparison here is *paired*:
variants run interleaved in rounds (`device_clock.rotated`: each round runs every variant once, the
first rotated), and a variant is compared with another through its per-round ratios, so what
the machine did to a whole round cancels. The noise is read off two things:

- a **control pair** whose answer is known (a uniform BF16 plan and plain BF16 autocast, which
  run the same ops, or the same plan twice): its per-round ratios should centre on 1.0, and how far
  their median and confidence interval stray from it is what this machine's measurement cannot
  tell apart;
- each comparison's own per-round ratios: their median's confidence interval
  (`median_interval`, distribution-free: order statistics of the rounds).

`separate` ranks contenders with both: a contender is *separated* from the fastest when its
ratio to it lies above 1 by more than the noise; those that are not cannot be told apart from it,
and among them the one the cost model predicts fastest is taken (the measurement and the model
agree it is among the fastest). Pure functions, no torch: the callers time, this decides.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Mapping, Optional, Sequence

__all__ = ["CONTROL_TOLERANCE", "Verdict", "median_interval", "paired_ratios", "separate", "unseparated"]

# How far from 1.0 the control pair may measure before the measurement is called unreliable
# (issue 49: "the control pair within 10 % of 1.0 ... or the job says it is not").
CONTROL_TOLERANCE = 0.10


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-round ratios ``a[i] / b[i]`` of two variants timed in the same rounds."""
    return [x / y for x, y in zip(a, b) if y > 0]


def median_interval(values: Sequence[float], level: float = 0.9) -> tuple[float, float, float]:
    """``(low, median, high)``: the median of ``values`` and a distribution-free confidence
    interval for it at ``level`` (order statistics: the interval between the j-th smallest and
    j-th largest value, j the largest with P(Binomial(n, 1/2) < j) <= (1 - level) / 2). With
    too few values for that level (n < 5 at 0.9) the interval is the whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval of no values")
    median = statistics.median(xs)
    alpha = (1.0 - level) / 2
    cumulative, j = 0.0, 0
    for k in range(n // 2 + 1):
        cumulative += math.comb(n, k) / 2**n
        if cumulative > alpha:
            break
        j = k + 1
    j = max(1, j)
    return xs[j - 1], median, xs[n - j]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the rounds decided. ``choice``: the contender taken; ``fastest``: the one whose
    median time was lowest; ``tied``: the contenders that could not be told apart from it
    (``fastest`` included); ``ratios``: per contender, (low, median, high) of its per-round ratio
    to ``fastest``; ``control``: (low, median, high) of the control pair's ratio (None without
    one); ``noise``: the relative difference below which nothing is separated; ``rounds``;
    ``times``: per contender, its seconds in each round (what the decision read), and ``level``
    the confidence level of the intervals."""

    choice: str
    fastest: str
    tied: tuple[str, ...]
    ratios: Mapping[str, tuple[float, float, float]]
    control: Optional[tuple[float, float, float]]
    noise: float
    rounds: int
    times: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    level: float = 0.9

    def seconds(self, name: str) -> "float | None":
        """``name``'s median seconds over these rounds; None when it was not timed in them."""
        return statistics.median(self.times[name]) if self.times.get(name) else None

    def ratio(self, name: str, other: str) -> "tuple[float, float, float] | None":
        """(low, median, high) of ``name``'s per-round ratio to ``other`` in these rounds, paired
        as the decision pairs them; None when either was not timed in them."""
        if not (self.times.get(name) and self.times.get(other)):
            return None
        return median_interval(paired_ratios(self.times[name], self.times[other]), self.level)

    @property
    def control_sound(self) -> bool:
        """The control pair measured within `CONTROL_TOLERANCE` of 1.0 (True without one)."""
        if self.control is None:
            return True
        low, median, high = self.control
        return abs(median - 1.0) <= CONTROL_TOLERANCE and low >= 1.0 - CONTROL_TOLERANCE and high <= 1.0 + CONTROL_TOLERANCE

    @property
    def resolved(self) -> bool:
        """The control pair is sound and nothing but the fastest is within the noise of it."""
        return self.control_sound and len(self.tied) == 1

    def summary(self) -> str:
        """One line: the rounds, the control pair, the noise, and what could not be separated."""
        control = ""
        if self.control is not None:
            low, median, high = self.control
            control = f"control pair {median:.2f}x ({low:.2f}-{high:.2f}){'' if self.control_sound else ', off 1.0 by more than the noise allows'}, "
        tied = (f"cannot separate {', '.join(self.tied)} (within {self.noise:.0%}): took {self.choice}, the fastest predicted of them"
                if len(self.tied) > 1 else f"{self.fastest} separated from the rest")
        return f"{self.rounds} interleaved rounds: {control}noise {self.noise:.1%}; {tied}"

    def to_dict(self) -> dict:
        return {"choice": self.choice, "fastest": self.fastest, "tied": list(self.tied), "rounds": self.rounds, "noise": self.noise,
                "ratios": {k: list(v) for k, v in self.ratios.items()}, "control": list(self.control) if self.control else None,
                "control_sound": self.control_sound, "seconds": {k: self.seconds(k) for k in self.times}}


def separate(times: Mapping[str, Sequence[float]], predicted: Mapping[str, float],
             control: Optional[tuple[Sequence[float], Sequence[float]]] = None, level: float = 0.9) -> Verdict:
    """The contender to take from ``times`` (name -> seconds per round, all timed in the same
    rounds), ``predicted`` (name -> the cost model's seconds) and the ``control`` pair's times.

    The fastest is the lowest median; a contender is tied with it when its ratio to the fastest
    is within the noise (median at most 1 + noise) or not surely above 1 (its interval reaches
    down to 1); the noise is the control pair's distance from 1.0 (the farther end of its
    interval), zero without a control. Among the tied, the fastest predicted is taken."""
    if not times:
        raise ValueError("separate() needs at least one contender")
    rounds = min(len(v) for v in times.values())
    fastest = min(times, key=lambda k: statistics.median(times[k]))
    control_interval = None
    noise = 0.0
    if control is not None:
        control_interval = median_interval(paired_ratios(*control), level)
        noise = max(abs(control_interval[0] - 1.0), abs(control_interval[2] - 1.0))
    ratios = {name: median_interval(paired_ratios(t, times[fastest]), level) for name, t in times.items()}
    tied = tuple(name for name, (low, median, _) in ratios.items() if name == fastest or low <= 1.0 or median <= 1.0 + noise)
    choice = min(tied, key=lambda k: (predicted.get(k, math.inf), statistics.median(times[k])))
    return Verdict(choice, fastest, tied, ratios, control_interval, noise, rounds, {k: tuple(v) for k, v in times.items()}, level)


def unseparated(first: Sequence[float], faster: Sequence[float]) -> bool:
    """Whether ``faster`` (seconds of steps measured apart from ``first``'s, in other steps) is
    faster than ``first`` by less than their own spread: the larger relative range of the two
    (max - min over the median). With no round to pair them in, that spread is all the noise
    there is to go on."""
    def spread(xs: Sequence[float]) -> float:
        return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0

    noise = max(spread(first), spread(faster))
    return statistics.median(first) <= statistics.median(faster) * (1 + noise)
