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
- scaled formats (FP8, INT8): the scale maps the reference amax onto ``fmt.max`` (margin 0), so
  ``|x| / amax < fmt.min_subnormal / fmt.max`` underflows (flushed to zero or to the smallest
  subnormal: no relative precision left). With ``"current"`` scaling nothing overflows by
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




@dataclasses.dataclass(frozen=True)
class Histogram:
    """Counts of sampled magnitudes in the `NUM_BINS` fixed bins, stored from bin ``first`` on.

    Bin ``b`` (``1 <= b < 2040``) spans ``[edges[b], edges[b + 1])``, 1/8 of a power of two wide;
    bin 0 holds zeros (and magnitudes below ``2**-129``); bins 2040.. hold inf and NaN.
    """

    first: int
    counts: tuple[int, ...]

    @classmethod
    def from_full(cls, full: Sequence[int]) -> "Histogram":
        counts = np.asarray(full, dtype=np.int64)
        nonzero = np.flatnonzero(counts)
        if nonzero.size == 0:
            return cls(0, ())
        lo, hi = int(nonzero[0]), int(nonzero[-1]) + 1
        return cls(lo, tuple(counts[lo:hi].tolist()))

    def full(self) -> np.ndarray:
        out = np.zeros(NUM_BINS, dtype=np.int64)
        out[self.first : self.first + len(self.counts)] = self.counts
        return out

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @property
    def zeros(self) -> int:
        return int(self.full()[0])

    @property
    def nonfinite(self) -> int:
        return int(self.full()[_FIRST_NONFINITE:].sum())

    def count_below(self, threshold: float) -> tuple[float, int, int]:
        """Nonzero finite magnitudes below ``threshold``: (log-uniform estimate, lower, upper bound)."""
        below_end, _, cut, share, _ = _threshold_bins(float(threshold))
        return self._count(self._finite_sum(1, below_end), cut, share)

    def count_above(self, threshold: float) -> tuple[float, int, int]:
        """Finite magnitudes above ``threshold``: (log-uniform estimate, lower, upper bound)."""
        _, above_start, cut, _, share = _threshold_bins(float(threshold))
        return self._count(self._finite_sum(above_start, _FIRST_NONFINITE), cut, share)

    # Counted in Python over the occupied bins (tens), the bins a threshold splits found once per
    # threshold (`_threshold_bins`): the profile's summary asks a few thresholds per tensor and
    # format, and a handful of numpy calls each were most of the window's last step at depth.
    def _finite_sum(self, start: int, stop: int) -> int:
        lo, hi = max(start, self.first, 1), min(stop, self.first + len(self.counts), _FIRST_NONFINITE)
        return sum(self.counts[lo - self.first : hi - self.first]) if hi > lo else 0

    def _count(self, whole: int, cut: int, share: float) -> tuple[float, int, int]:
        part = self._finite_sum(cut, cut + 1) if cut >= 0 else 0
        return float(whole) + float(part) * share if part else float(whole), whole, whole + part

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
        return {"first": self.first, "counts": list(self.counts)}


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


def format_fractions(hists: Mapping[str, Histogram], sampled: int, fmt: Format) -> dict[str, FormatFractions]:
    """Under/overflow fractions of ``sampled`` values in ``fmt``, per scaling of ``fmt`` (`scalings_for`),
    read from one tensor's three histograms (keyed by `REFERENCES`); all 0 when nothing was sampled."""
    if sampled <= 0:
        zero = FormatFractions(0.0, 0.0, (0.0, 0.0), (0.0, 0.0))
        return {s: zero for s in scalings_for(fmt)}

    def frac(estimate):
        est, lo, hi = estimate
        return est / sampled, (lo / sampled, hi / sampled)

    out = {}
    if not fmt.needs_scale:
        (u, ur), (o, orng) = frac(hists["absolute"].count_below(fmt.min_subnormal)), frac(hists["absolute"].count_above(fmt.max))
        out["none"] = FormatFractions(u, o, ur, orng)
        return out
    ratio = fmt.min_subnormal / fmt.max  # |x| / amax below this underflows once amax maps to fmt.max
    u, ur = frac(hists["current"].count_below(ratio))
    out["current"] = FormatFractions(u, 0.0, ur, (0.0, 0.0))
    u, ur = frac(hists["delayed"].count_below(ratio))
    # |x| / ref > 1: 1.0 is a bin edge, so the count is exact (see LayerProfiler._record).
    o, orng = frac(hists["delayed"].count_above(1.0))
    out["delayed"] = FormatFractions(u, o, ur, orng)
    return out


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
