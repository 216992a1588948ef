"""Per-tensor statistics of a profile: log2 histograms of ``|x|`` read from float32 bits, the
under/overflow fractions each candidate format would see after its scaling, and gradient moments.

Histograms: one bin per 1/8 of a power of two (the float32 exponent and its 3 leading mantissa
bits, read from the bits of ``|x|``: ``bits >> 20``), so 2048 bins cover every float32 magnitude
with no clamping; bin 0 holds zeros (and ``|x| < 2**-129``), bins 2040.. hold inf and NaN. Each
tensor gets three: of ``|x|`` (``absolute``), of ``|x| / amax`` with the call's own amax
(``current``) and of ``|x| / ref`` with the delayed-scaling reference ``ref``, the largest finite
amax of the previous ``history_len`` steps (``delayed``; Transformer Engine's delayed recipe, as
the runtime's `TensorDelayedQuantizer` with reduction "max"; the layer's first step uses its own amax).

Underflow / overflow, per candidate format (numbers from `Format`, never hard-coded):

- unscaled formats (FP32, BF16, FP16; scaling ``"none"``): ``|x| < fmt.min_subnormal`` underflows,
  ``|x| > fmt.max`` overflows (read from the ``absolute`` histogram);
- scaled formats (FP8, INT8, NVFP4): the scale maps the reference amax onto ``fmt.max`` (margin
  0), so ``|x| / amax < fmt.scaled_floor`` (``min_subnormal / max``; NVFP4's block scales reach
  further) underflows (flushed to zero or to the smallest subnormal: no relative precision left). With ``"current"`` scaling nothing overflows by
  construction; with ``"delayed"`` scaling values above ``ref`` overflow (inf for E5M2, saturated
  for E4M3 / INT8) and are counted exactly in the subsample.

A threshold falls inside one bin; its count is split log-uniformly, and ``*_range`` gives the
exact lower and upper bounds (the bin wholly excluded or included).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence

import numpy as np

from ..errors import ProfileError
from ..formats import Format


SCHEMA_VERSION = 1

KINDS = ("weight", "activation", "grad")
REFERENCES = ("absolute", "current", "delayed")

# Bins: the float32 bit pattern of |x| shifted right by 23 - SUB_BITS keeps the 8 exponent bits
# and SUB_BITS leading mantissa bits; 3 bits give 8 bins per octave (12.5 % relative width).
SUB_BITS = 3
BIN_SHIFT = 23 - SUB_BITS
NUM_BINS = 1 << (8 + SUB_BITS)
_FIRST_NONFINITE = 255 << SUB_BITS  # biased exponent 255: inf and NaN
BIN_MASK = NUM_BINS - 1  # drops the sign bit of a NaN whose sign is set (inf * 0 on x86)


def _edges() -> np.ndarray:
    """Lower edges of bins 0..2040 in float64; bin b < 2040 spans ``[edges[b], edges[b + 1])``."""
    b = np.arange(_FIRST_NONFINITE + 1)
    exponent, sub = b >> SUB_BITS, b & ((1 << SUB_BITS) - 1)
    normal = np.ldexp(1.0 + sub / (1 << SUB_BITS), exponent - 127)
    subnormal = np.ldexp(sub / (1 << SUB_BITS), -126)
    return np.where(exponent > 0, normal, subnormal)


_EDGES = _edges()


@functools.lru_cache(maxsize=256)
def _threshold_bins(threshold: float) -> tuple[int, int, int, float, float]:
    """Where ``threshold`` falls among the finite nonzero bins: (the bins below end at, the bins
    above start at, the bin it splits (-1: none, it is an edge or outside them), the log-uniform
    part of that bin below it, the part above). The same for every histogram (fixed bins)."""
    b = int(np.searchsorted(_EDGES, threshold, side="right")) - 1  # edges[b] <= threshold < edges[b + 1]
    if b < 0:
        return 0, 1, -1, 0.0, 0.0
    if 1 <= b < _FIRST_NONFINITE and _EDGES[b] < threshold:
        lo, hi = _EDGES[b : b + 1], _EDGES[b + 1 : b + 2]
        below = float((np.log(threshold / lo) / np.log(hi / lo))[0])
        above = float((np.log(hi / threshold) / np.log(hi / lo))[0])
        return b, b + 1, b, below, above
    return b, b if _EDGES[b] == threshold else b + 1, -1, 0.0, 0.0




@dataclasses.dataclass(frozen=True, eq=False)
class Histogram:
    """Counts of sampled magnitudes in the `NUM_BINS` fixed bins, stored from bin ``first`` on
    (``counts``: a read-only int64 array, any sequence of ints given; 8 bytes a bin where a
    tuple of Python ints took about 36, and no conversion per bin when a profile is summed up).

    Bin ``b`` (``1 <= b < 2040``) spans ``[edges[b], edges[b + 1])``, 1/8 of a power of two wide;
    bin 0 holds zeros (and magnitudes below ``2**-129``); bins 2040.. hold inf and NaN.
    """

    first: int
    counts: np.ndarray

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64).view()
        counts.flags.writeable = False
        object.__setattr__(self, "counts", counts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Histogram):
            return NotImplemented
        return self.first == other.first and np.array_equal(self.counts, other.counts)

    def __hash__(self) -> int:
        return hash((self.first, self.counts.tobytes()))

    @classmethod
    def from_full(cls, full: Sequence[int]) -> "Histogram":
        return cls.from_rows(np.asarray(full, dtype=np.int64)[None])[0]

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> "list[Histogram]":
        """One histogram per row of ``rows`` ((n, NUM_BINS) counts), each cut to its occupied
        bins: the first and last occupied bin of every row found in two numpy calls."""
        occupied = rows != 0
        first = occupied.argmax(axis=1)
        end = np.where(occupied[np.arange(len(rows)), first], rows.shape[1] - occupied[:, ::-1].argmax(axis=1), first)
        # Every row's occupied bins copied into one array at once, each histogram a view of it.
        lengths = end - first
        starts = np.concatenate(([0], np.cumsum(lengths)))
        owner = np.repeat(np.arange(len(rows)), lengths)  # the row each copied bin comes from
        flat = rows[owner, np.arange(starts[-1]) - starts[:-1][owner] + first[owner]]  # and its bin there
        return [cls(lo if b > a else 0, flat[a:b]) for lo, a, b in zip(first.tolist(), starts[:-1].tolist(), starts[1:].tolist())]

    def full(self) -> np.ndarray:
        out = np.zeros(NUM_BINS, dtype=np.int64)
        out[self.first : self.first + len(self.counts)] = self.counts
        return out

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def zeros(self) -> int:
        return int(self.full()[0])

    @property
    def nonfinite(self) -> int:
        return int(self.full()[_FIRST_NONFINITE:].sum())

    def count_below(self, threshold: float) -> tuple[float, int, int]:
        """Nonzero finite magnitudes below ``threshold``: (log-uniform estimate, lower, upper bound)."""
        estimate, lower, upper = BinCounts(self.full()[None]).below(threshold)
        return float(estimate[0]), int(lower[0]), int(upper[0])

    def count_above(self, threshold: float) -> tuple[float, int, int]:
        """Finite magnitudes above ``threshold``: (log-uniform estimate, lower, upper bound)."""
        estimate, lower, upper = BinCounts(self.full()[None]).above(threshold)
        return float(estimate[0]), int(lower[0]), int(upper[0])

    def log2_buckets(self) -> "tuple[list[float], list[float], list[int]] | None":
        """Lower and upper bucket edges in log2 units and counts of the finite nonzero bins, from
        the first to the last occupied one (for TensorBoard); None when there are none."""
        counts = self.full()
        nonzero = np.flatnonzero(counts[1:_FIRST_NONFINITE]) + 1
        if nonzero.size == 0:
            return None
        lo, hi = int(nonzero[0]), int(nonzero[-1]) + 1
        logs = np.log2(_EDGES[lo : hi + 1])
        return [float(v) for v in logs[:-1]], [float(v) for v in logs[1:]], [int(c) for c in counts[lo:hi]]

    def to_dict(self) -> dict:
        return {"first": self.first, "counts": self.counts.tolist()}


class BinCounts:
    """Many histograms at once ((n, NUM_BINS) counts, kept as given) and the running sums of their
    bins, so the finite nonzero counts below and above one threshold are read for every row in a
    few numpy calls (the bins a threshold splits are found once, `_threshold_bins`). Costs one
    int64 array of the rows' shape."""

    def __init__(self, rows: np.ndarray):
        self._rows = rows
        self._sums = np.zeros((rows.shape[0], _FIRST_NONFINITE + 1), dtype=np.int64)  # [:, b]: bins 0..b-1
        np.cumsum(rows[:, :_FIRST_NONFINITE], axis=1, out=self._sums[:, 1:])

    def below(self, threshold: float) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
        """Per row, nonzero finite magnitudes below ``threshold``: (log-uniform estimate, lower,
        upper bound)."""
        below_end, _, cut, share, _ = _threshold_bins(float(threshold))
        return self._count(self._finite(1, below_end), cut, share)

    def above(self, threshold: float) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
        """Per row, finite magnitudes above ``threshold``: (log-uniform estimate, lower, upper bound)."""
        _, above_start, cut, _, share = _threshold_bins(float(threshold))
        return self._count(self._finite(above_start, _FIRST_NONFINITE), cut, share)

    def _finite(self, start: int, stop: int) -> np.ndarray:
        """Per row, the counts of the finite nonzero bins in [start, stop)."""
        start, stop = max(start, 1), min(stop, _FIRST_NONFINITE)  # bin 0 holds zeros
        return self._sums[:, stop] - self._sums[:, start] if stop > start else np.zeros(self._rows.shape[0], dtype=np.int64)

    def _count(self, whole: np.ndarray, cut: int, share: float) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
        part = self._rows[:, cut] if cut >= 0 else np.zeros_like(whole)
        return whole + part * share, whole, whole + part


@dataclasses.dataclass(frozen=True)
class FormatFractions:
    """Fractions of the sampled values (zeros and non-finite included in the denominator) that
    would underflow / overflow one format under one scaling; ``*_range`` bound the estimate."""

    underflow: float
    overflow: float
    underflow_range: tuple[float, float]
    overflow_range: tuple[float, float]

    def to_dict(self) -> dict:
        return {
            "underflow": self.underflow,
            "overflow": self.overflow,
            "underflow_range": list(self.underflow_range),
            "overflow_range": list(self.overflow_range),
        }


def scalings_for(fmt: Format) -> tuple[str, ...]:
    """``("none",)`` for formats that run unscaled, ``("current", "delayed")`` for FP8 / INT8."""
    return ("current", "delayed") if Format.parse(fmt).needs_scale else ("none",)


def format_fractions(counts: Mapping[str, BinCounts], sampled: Sequence[int], fmt: Format) -> "list[dict[str, FormatFractions]]":
    """Under/overflow fractions in ``fmt`` of each tensor's ``sampled[i]`` values, per scaling of
    ``fmt`` (`scalings_for`), read from its histograms (row ``i`` of ``counts``, one `BinCounts`
    per `REFERENCES` entry); all 0 for a tensor of which nothing was sampled. Vectorized over the
    tensors: a few numpy calls per threshold; equal fractions share one (frozen) object, so a
    format most tensors fit costs a dict per tensor."""
    n = np.asarray(sampled, dtype=np.float64)
    some = n > 0
    per_value = np.where(some, n, 1.0)

    def frac(ref: str, threshold: float, above: bool = False) -> "list[tuple[float, float, float]]":
        """Per tensor: (estimate, lower bound, upper bound) as fractions of its sampled values."""
        found = (counts[ref].above if above else counts[ref].below)(threshold)
        return list(zip(*(np.where(some, count / per_value, 0.0).tolist() for count in found)))

    made: dict[tuple, FormatFractions] = {}

    def fractions(under: "tuple[float, float, float]", over: "tuple[float, float, float]") -> FormatFractions:
        key = under + over
        if key not in made:
            made[key] = FormatFractions(under[0], over[0], under[1:], over[1:])
        return made[key]

    if not fmt.needs_scale:
        return [{"none": fractions(u, o)} for u, o in zip(frac("absolute", fmt.min_subnormal), frac("absolute", fmt.max, above=True))]
    ratio = fmt.scaled_floor  # |x| / amax below this underflows once amax maps to fmt.max
    # |x| / ref > 1: 1.0 is a bin edge, so the count is exact (see LayerProfiler._record).
    current, delayed, over = frac("current", ratio), frac("delayed", ratio), frac("delayed", 1.0, above=True)
    nothing = (0.0, 0.0, 0.0)
    return [{"current": fractions(c, nothing), "delayed": fractions(d, o)} for c, d, o in zip(current, delayed, over)]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorStats:
    """Statistics of one tensor kind of one layer over the window.

    ``amax[t]`` is the exact amax of step ``t`` (the largest over the step's calls; 0 for a step in
    which the layer did not run; NaN / inf when the tensor held a non-finite value).
    ``numel`` counts every element seen, ``sampled`` those histogrammed; ``mean`` / ``var`` are of
    the sampled values (NaN once a non-finite value was sampled). ``fractions[fmt][scaling]``.
    """

    calls: int
    numel: int
    sampled: int
    amax: tuple[float, ...]
    nonfinite_steps: int
    mean: float
    var: float
    histograms: Mapping[str, Histogram]
    fractions: Mapping[str, Mapping[str, FormatFractions]]

    @property
    def zeros(self) -> int:
        """Sampled values that are zero (or below ``2**-129``)."""
        return self.histograms["absolute"].zeros

    @property
    def nonfinite(self) -> int:
        """Sampled values that are inf or NaN (exact for tensors of at most ``sample`` elements)."""
        return self.histograms["absolute"].nonfinite

    def _get(self, fmt, scaling) -> FormatFractions:
        fmt = Format.parse(fmt)
        if fmt.value not in self.fractions:
            raise ProfileError(f"format {fmt.value!r} was not profiled; profiled: {', '.join(self.fractions)}")
        scaling = scaling or ("delayed" if fmt.needs_scale else "none")
        table = self.fractions[fmt.value]
        if scaling not in table:
            raise ProfileError(f"{fmt.value} has no {scaling!r} scaling here; use one of {', '.join(table)}")
        return table[scaling]

    def underflow(self, fmt: "Format | str", scaling: Optional[str] = None) -> float:
        """Fraction that underflows ``fmt``; ``scaling`` defaults to "delayed" (FP8 / INT8) or "none"."""
        return self._get(fmt, scaling).underflow

    def overflow(self, fmt: "Format | str", scaling: Optional[str] = None) -> float:
        """Fraction that overflows (or saturates) ``fmt``; ``scaling`` as for `underflow`."""
        return self._get(fmt, scaling).overflow

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "numel": self.numel,
            "sampled": self.sampled,
            "amax": [json_float(v) for v in self.amax],
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite": self.nonfinite,
            "zeros": self.zeros,
            "mean": json_float(self.mean),
            "var": json_float(self.var),
            "histograms": {ref: h.to_dict() for ref, h in self.histograms.items()},
            "fractions": {f: {s: ff.to_dict() for s, ff in t.items()} for f, t in self.fractions.items()},
        }


@dataclasses.dataclass(frozen=True)
class GradStats:
    """Streaming statistics of a layer's parameter gradients over ``steps`` steps.

    ``mean``: mean over elements of the per-element mean gradient ``ḡ``; ``var``: mean over
    elements of the per-element unbiased variance across steps; ``signal``: mean of ``ḡ²``;
    ``nsr = var / signal = E‖g − ḡ‖² / ‖ḡ‖²`` (NaN with fewer than 2 steps, inf when ``ḡ = 0``).
    ``sampled`` of the ``numel`` elements were tracked (strided, at most ``grad_sample`` per
    parameter); sums are scaled up by ``numel / sampled``.
    """

    steps: int
    numel: int
    sampled: int
    mean: float
    var: float
    signal: float
    nsr: float

    def to_dict(self) -> dict:
        return {k: json_float(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}

def json_float(x: float):
    """JSON has no NaN / inf: they are written as the strings "nan", "inf", "-inf"."""
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
