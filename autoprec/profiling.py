"""Per-layer statistics over a monitor window: `LayerProfiler` gathers them, `Profile` keeps them.

The profiler watches every covered layer (the runtime's rule: `autoprec.coverage.find_layers`)
for ``window`` optimizer steps and records, per layer:

- **gradient mean, variance and noise-to-signal ratio** of the layer's own parameters, streamed
  over every step with Welford's algorithm per element (``mean``/``M2`` on the device):
  ``var`` is the mean over elements of the unbiased variance across steps, and
  ``nsr = E‖g − ḡ‖² / ‖ḡ‖²``. Times the batch size it estimates the "simple noise scale"
  ``tr(Σ)/|G|²`` of McCandlish et al. 2018 (arXiv:1812.06162), whose Σ is per example;
- for three **tensor kinds** — ``weight`` (the layer's own parameters of two or more dimensions,
  the operands its matrix product reads), ``activation`` (the layer's input: the first floating
  tensor among its arguments) and ``grad`` (the gradient of the layer's output, what an FP8
  layer quantizes to E5M2 in backward): the per-step amax history, histograms of ``|x|``, the
  fractions of values that would underflow / overflow each candidate format after that format's
  scaling, the mean and variance of the values, and non-finite counts.

Costs (the point of the design; `measure_overhead` measures them):

- **No host-device sync per step.** Every accumulator is a device tensor updated in place; step
  indices and counts are Python ints. `LayerProfiler.profile` syncs once, at the end.
- **Every step, exactly:** the amax of every tensor (one reduction over the full tensor) and the
  Welford update of the parameter gradients.
- **Subsampled in time:** histograms and moments are taken on every ``every``-th step of a layer
  (default 8), staggered across layers (layer ``i`` on steps where ``(step + i) % every == 0``)
  so that every step costs about the same. A window of 500 steps still pools 62 steps per tensor.
- **Subsampled in space:** those steps see a strided subsample of at most ``sample`` elements
  per tensor (default 8192; all of it when smaller). The stride is the smallest integer
  ``≥ numel / sample`` that is coprime with the tensor's last dimension, so the samples cycle
  through every channel instead of hitting the same few (an outlier channel is never skipped
  systematically). Error: a fraction ``p`` estimated from ``n`` sampled values has a standard
  error ``sqrt(p(1-p)/n) ≤ 0.5/sqrt(n)`` for values without structure at the stride's period
  (≤ 0.55 % for one call at ``sample = 8192``; a window pools its steps' samples, ~0.07 % for 62
  of them). ``tests/test_profiling.py`` checks subsampled fractions against the full tensor
  within 5 standard errors, on a tensor whose channels span 12 octaves.
- **Non-finite values**: ``nonfinite_steps`` is exact (the full-tensor amax is NaN or inf exactly
  when the tensor holds a non-finite value); ``nonfinite`` counts them in the subsample (exact for
  tensors of at most ``sample`` elements). An exact full count would cost ``isfinite`` + ``sum``
  over the full tensor, ~0.5 ms for 0.5 M elements on our 2 CPU cores: more than all the rest.
- **Measured** (``measure_overhead("small")``, batch 16, 2 CPU cores, medians of interleaved
  steps): +14 % per step inside the window (30.3 → 34.6 ms; +8 % with one thread), ~0 after it,
  when the profiler has removed its hooks itself.

Histograms: one bin per 1/8 of a power of two (the float32 exponent and its 3 leading mantissa
bits, read from the bits of ``|x|``: ``bits >> 20``), so 2048 bins cover every float32 magnitude
with no clamping; bin 0 holds zeros (and ``|x| < 2**-129``), bins 2040.. hold inf and NaN. Each
tensor gets three: of ``|x|`` (``absolute``), of ``|x| / amax`` with the call's own amax
(``current``) and of ``|x| / ref`` with the delayed-scaling reference ``ref``, the largest finite
amax of the previous ``history_len`` steps (``delayed``; Transformer Engine's delayed recipe, as
`autoprec.formats.AmaxHistory` with reduction "max"; the layer's first step uses its own amax).

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

Usage::

    profiler = LayerProfiler(model, example_inputs=x, window=500)
    with profiler:                            # attach hooks; exit removes them
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            profiler.step()                   # after backward, before clipping / optimizer.step
            optimizer.step(); optimizer.zero_grad()
    profile = profiler.profile()              # one sync
    profile.save("profile.json")

Statistics are gathered from forwards run with gradients enabled (training steps); forwards under
``torch.no_grad`` (evaluation) are ignored. Gradients are seen as autograd produces them: profile
without loss scaling (or divide by the scale yourself). The hooks never change numerics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from . import __version__
from ._io import atomic_write_text, check_schema_version
from .coverage import LayerInfo, ModuleFilter, find_layers
from .device import resolve_device
from .errors import ProfileError
from .formats import Format
from .plan import Scaling

__all__ = [
    "SCHEMA_VERSION",
    "KINDS",
    "REFERENCES",
    "NUM_BINS",
    "Histogram",
    "FormatFractions",
    "TensorStats",
    "GradStats",
    "LayerProfile",
    "Profile",
    "LayerProfiler",
    "train_window",
    "with_grad_formats",
    "profile_workload",
    "write_tensorboard",
    "measure_overhead",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

KINDS = ("weight", "activation", "grad")
REFERENCES = ("absolute", "current", "delayed")

# Bins: the float32 bit pattern of |x| shifted right by 23 - SUB_BITS keeps the 8 exponent bits
# and SUB_BITS leading mantissa bits; 3 bits give 8 bins per octave (12.5 % relative width).
SUB_BITS = 3
_SHIFT = 23 - SUB_BITS
NUM_BINS = 1 << (8 + SUB_BITS)
_FIRST_NONFINITE = 255 << SUB_BITS  # biased exponent 255: inf and NaN
_BIN_MASK = NUM_BINS - 1  # drops the sign bit of a NaN whose sign is set (inf * 0 on x86)


def _edges() -> np.ndarray:
    """Lower edges of bins 0..2040 in float64; bin b < 2040 spans ``[edges[b], edges[b + 1])``."""
    b = np.arange(_FIRST_NONFINITE + 1)
    exponent, sub = b >> SUB_BITS, b & ((1 << SUB_BITS) - 1)
    normal = np.ldexp(1.0 + sub / (1 << SUB_BITS), exponent - 127)
    subnormal = np.ldexp(sub / (1 << SUB_BITS), -126)
    return np.where(exponent > 0, normal, subnormal)


_EDGES = _edges()


# -- the artifact -------------------------------------------------------------------------------


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
        full = np.asarray(full, dtype=np.int64)
        nonzero = np.flatnonzero(full)
        if nonzero.size == 0:
            return cls(0, ())
        lo, hi = int(nonzero[0]), int(nonzero[-1]) + 1
        return cls(lo, tuple(int(c) for c in full[lo:hi]))

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

    def _finite_bins(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = self.full()[1:_FIRST_NONFINITE].astype(np.float64)
        return counts, _EDGES[1:_FIRST_NONFINITE], _EDGES[2 : _FIRST_NONFINITE + 1]

    def count_below(self, threshold: float) -> tuple[float, int, int]:
        """Nonzero finite magnitudes below ``threshold``: (log-uniform estimate, lower, upper bound)."""
        counts, lo, hi = self._finite_bins()
        whole = counts[hi <= threshold].sum()
        cut = (lo < threshold) & (threshold < hi)
        part = counts[cut]
        share = np.log(threshold / lo[cut]) / np.log(hi[cut] / lo[cut]) if part.size else np.zeros(0)
        return float(whole + (part * share).sum()), int(whole), int(whole + part.sum())

    def count_above(self, threshold: float) -> tuple[float, int, int]:
        """Finite magnitudes above ``threshold``: (log-uniform estimate, lower, upper bound)."""
        counts, lo, hi = self._finite_bins()
        whole = counts[lo >= threshold].sum()
        cut = (lo < threshold) & (threshold < hi)
        part = counts[cut]
        share = np.log(hi[cut] / threshold) / np.log(hi[cut] / lo[cut]) if part.size else np.zeros(0)
        return float(whole + (part * share).sum()), int(whole), int(whole + part.sum())

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


def _fractions(hists: Mapping[str, Histogram], sampled: int, fmt: Format) -> dict[str, FormatFractions]:
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
            "amax": [_enc(v) for v in self.amax],
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite": self.nonfinite,
            "zeros": self.zeros,
            "mean": _enc(self.mean),
            "var": _enc(self.var),
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
        return {k: _enc(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProfile:
    """One layer: ``steps`` in which it ran, its parameter-gradient statistics (None for a layer
    without parameters, e.g. an attention module that only multiplies activations) and
    ``tensors[kind]`` for the kinds it has (no ``weight`` without parameters, no ``grad`` when
    its output needs none)."""

    steps: int
    param_grad: Optional[GradStats]
    tensors: Mapping[str, TensorStats]

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "param_grad": None if self.param_grad is None else self.param_grad.to_dict(),
            "tensors": {kind: ts.to_dict() for kind, ts in self.tensors.items()},
        }


@dataclasses.dataclass(frozen=True, eq=False)
class Profile:
    """Per-layer statistics of one window, saved so the search can run offline.

    Versioned JSON (``schema_version``), written atomically; profiles compare equal by value and
    a JSON round trip gives an equal profile. ``fingerprint`` (fqn → module class, ops, parameter
    shapes) lets `check_model` refuse a profile made for another model.
    """

    fingerprint: Mapping[str, LayerInfo]
    layers: Mapping[str, LayerProfile]
    steps: int
    window: int
    sample: int
    every: int
    grad_sample: int
    history_len: int
    formats: tuple[Format, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _set = object.__setattr__
        _set(self, "fingerprint", types.MappingProxyType(dict(self.fingerprint)))
        _set(self, "layers", types.MappingProxyType(dict(self.layers)))
        _set(self, "formats", tuple(Format.parse(f) for f in self.formats))
        _set(self, "metadata", types.MappingProxyType(json.loads(json.dumps(dict(self.metadata)))))

    def __getitem__(self, fqn: str) -> LayerProfile:
        return self.layers[fqn]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __eq__(self, other) -> bool:
        # Through JSON text: NaN amaxes compare equal to themselves there.
        return isinstance(other, Profile) and json.dumps(self.to_dict(), sort_keys=True) == json.dumps(other.to_dict(), sort_keys=True)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Profile({len(self.layers)} layers, {self.steps} steps, formats={','.join(f.value for f in self.formats)})"

    # -- model check ----------------------------------------------------------------------------

    def check_model(self, model: nn.Module, example_inputs: Any = None) -> None:
        """Raise `ProfileError` naming every layer where ``model`` differs from the profiled one.

        Checks: profiled layers the model lacks; covered layers of the model the profile lacks
        (traced with ``example_inputs``, else from the module tree plus the fingerprint's traced
        layers); parameter shapes that changed. Costs one forward with ``example_inputs``.
        """
        modules = dict(model.named_modules())
        covered = find_layers(model, example_inputs)
        if example_inputs is None:
            # Layers only a trace finds (hand-written matmul modules) are known from the fingerprint.
            for fqn, info in self.fingerprint.items():
                if fqn in modules:
                    covered.setdefault(fqn, info)
        problems = []
        for fqn in self.fingerprint:
            if fqn not in modules:
                problems.append(f"{fqn!r}: profiled layer missing from the model")
        for fqn, info in covered.items():
            if fqn not in self.fingerprint:
                problems.append(f"{fqn!r}: a covered layer ({info.module}) the profile lacks")
        for fqn, info in self.fingerprint.items():
            if fqn in modules:
                actual = dict(LayerInfo.of(modules[fqn], info.ops).params)
                if actual != dict(info.params):
                    problems.append(f"{fqn!r}: parameter shapes {_shapes(actual)} differ from the profiled {_shapes(info.params)}")
        if problems:
            raise ProfileError(problems, f"The profile was made for another model than this {type(model).__name__}; profile this model again (autoprec profile / LayerProfiler).")

    # -- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "autoprec_version": __version__,
            "steps": self.steps,
            "config": {
                "window": self.window,
                "sample": self.sample,
                "every": self.every,
                "grad_sample": self.grad_sample,
                "history_len": self.history_len,
                "formats": [f.value for f in self.formats],
                "sub_bits": SUB_BITS,
            },
            "fingerprint": {fqn: info.to_dict() for fqn, info in self.fingerprint.items()},
            "metadata": dict(self.metadata),
            "layers": {fqn: lp.to_dict() for fqn, lp in self.layers.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> "Profile":
        """Build a profile from `to_dict` output; a `ProfileError` names every bad field."""
        return _Reader(source).profile(data)

    def save(self, path: "str | os.PathLike") -> Path:
        """Write the profile as JSON atomically (a temporary file renamed over the target)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: "str | os.PathLike", model: Optional[nn.Module] = None, example_inputs: Any = None) -> "Profile":
        """Read a profile saved by `save`; a `ProfileError` names the file and what is wrong.

        With ``model``, also `check_model` it: a profile made for another model is refused,
        naming every mismatching layer.
        """
        profile = cls._read(Path(path))
        if model is not None:
            try:
                profile.check_model(model, example_inputs)
            except ProfileError as exc:
                raise ProfileError([f"{path}: {p}" for p in exc.problems], str(exc).splitlines()[-1]) from None
        return profile

    @classmethod
    def _read(cls, path: Path) -> "Profile":
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile file; create one with 'autoprec profile --out {path}'") from None
        except IsADirectoryError:
            raise ProfileError(f"{path}: is a directory; give the profile's file name") from None
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ProfileError(f"{path}: not a UTF-8 text file (byte {exc.start}); is this a profile saved by Profile.save?") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); re-create it with 'autoprec profile'") from None
        return _Reader(str(path)).profile(data)

    # -- reading --------------------------------------------------------------------------------

    def format_table(self) -> str:
        """One line per layer: grad NSR, last amaxes, non-finite steps, FP8 underflow (delayed)."""
        header = f"{'layer':<24} {'steps':>5} {'grad nsr':>9} {'act amax':>9} {'grad amax':>9} {'nonfin':>6} {'act<e4m3':>9} {'grad<e5m2':>9}"
        lines = [header, "-" * len(header)]

        def last(ts):
            return f"{ts.amax[-1]:.3g}" if ts is not None and ts.amax else "-"

        def under(ts, fmt):
            if ts is None or fmt.value not in ts.fractions:
                return "-"
            return f"{ts.underflow(fmt):.2%}"

        for fqn, lp in self.layers.items():
            act, grad = lp.tensors.get("activation"), lp.tensors.get("grad")
            nsr = f"{lp.param_grad.nsr:.3g}" if lp.param_grad is not None else "-"
            nonfinite = sum(ts.nonfinite_steps for ts in lp.tensors.values())
            lines.append(
                f"{fqn[-24:]:<24} {lp.steps:>5} {nsr:>9} {last(act):>9} {last(grad):>9} {nonfinite:>6} "
                f"{under(act, Format.FP8_E4M3):>9} {under(grad, Format.FP8_E5M2):>9}"
            )
        return "\n".join(lines)


def _shapes(params: Mapping[str, Sequence[int]]) -> str:
    return "{" + ", ".join(f"{k}: {tuple(v)}" for k, v in params.items()) + "}"


def _enc(x: float):
    """JSON has no NaN / inf: they are written as the strings "nan", "inf", "-inf"."""
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _Reader:
    """Reads a profile's JSON, collecting every problem with the path of the field at fault."""

    HINT = "Re-create the file with 'autoprec profile' (or Profile.save); profiles are not meant to be edited by hand."

    def __init__(self, source: str):
        self.source = source
        self.problems: list[str] = []

    def bad(self, where: str, message: str) -> None:
        self.problems.append(f"{self.source}: {where}: {message}")

    def obj(self, data: Any, where: str) -> Mapping:
        if not isinstance(data, Mapping):
            self.bad(where, f"expected an object, got {type(data).__name__}")
            return None
        return data

    def field(self, data: Mapping, key: str, where: str, kind: str, default=...):
        path = f"{where}.{key}" if where else key
        if key not in data:
            if default is not ...:
                return default
            self.bad(path, f"missing; expected {kind}")
            return None
        value = data[key]
        ok = {
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "number": lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in _NONFINITE_NAMES,
            "number list": lambda v: isinstance(v, list) and all((isinstance(x, (int, float)) and not isinstance(x, bool)) or x in _NONFINITE_NAMES for x in v),
            "int list": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
            "object": lambda v: isinstance(v, Mapping),
            "object or null": lambda v: v is None or isinstance(v, Mapping),
            "pair": lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
        }[kind](value)
        if not ok:
            shown = json.dumps(value)[:60] if _jsonable(value) else repr(value)[:60]
            self.bad(path, f"expected {'a non-negative integer' if kind == 'int' else kind}, got {shown}")
            return None
        return value

    @staticmethod
    def num(v) -> float:
        return _NONFINITE_NAMES[v] if isinstance(v, str) else float(v)

    def histogram(self, data, where) -> Optional[Histogram]:
        if self.obj(data, where) is None:
            return None
        first = self.field(data, "first", where, "int")
        counts = self.field(data, "counts", where, "int list")
        if first is None or counts is None:
            return None
        if first + len(counts) > NUM_BINS:
            self.bad(where, f"bins {first}..{first + len(counts) - 1} exceed the {NUM_BINS} bins of a histogram")
            return None
        return Histogram(first, tuple(counts))

    def tensor(self, data, where, formats) -> Optional[TensorStats]:
        if self.obj(data, where) is None:
            return None
        before = len(self.problems)
        values = {key: self.field(data, key, where, kind) for key, kind in (
            ("calls", "int"), ("numel", "int"), ("sampled", "int"), ("amax", "number list"), ("nonfinite_steps", "int"),
            ("mean", "number"), ("var", "number"), ("histograms", "object"), ("fractions", "object"),
        )}
        hists = {}
        if values["histograms"] is not None:
            for ref in REFERENCES:
                if ref not in values["histograms"]:
                    self.bad(f"{where}.histograms", f"missing the {ref!r} histogram")
                else:
                    hists[ref] = self.histogram(values["histograms"][ref], f"{where}.histograms.{ref}")
        fractions = {}
        if values["fractions"] is not None:
            for fmt in formats:
                table = values["fractions"].get(fmt.value)
                fwhere = f"{where}.fractions.{fmt.value}"
                if self.obj(table, fwhere) is None:
                    continue
                fractions[fmt.value] = {}
                for scaling in scalings_for(fmt):
                    entry = table.get(scaling)
                    swhere = f"{fwhere}.{scaling}"
                    if self.obj(entry, swhere) is None:
                        continue
                    got = [self.field(entry, k, swhere, kind) for k, kind in (("underflow", "number"), ("overflow", "number"), ("underflow_range", "pair"), ("overflow_range", "pair"))]
                    if None not in got:
                        fractions[fmt.value][scaling] = FormatFractions(self.num(got[0]), self.num(got[1]), tuple(got[2]), tuple(got[3]))
        if values["amax"] is not None and values["nonfinite_steps"] is not None:
            self.amax(tuple(self.num(v) for v in values["amax"]), values["nonfinite_steps"], f"{where}.amax")
        if len(self.problems) > before:
            return None
        return TensorStats(
            calls=values["calls"], numel=values["numel"], sampled=values["sampled"],
            amax=tuple(self.num(v) for v in values["amax"]), nonfinite_steps=values["nonfinite_steps"],
            mean=self.num(values["mean"]), var=self.num(values["var"]), histograms=hists, fractions=fractions,
        )

    def amax(self, amax: Sequence[float], nonfinite_steps: int, where: str) -> None:
        """The profiler writes a NaN / inf amax exactly for the steps it counts in
        ``nonfinite_steps``; any other non-finite or negative amax was not written by it."""
        nonfinite = sum(1 for v in amax if not math.isfinite(v))
        if nonfinite != nonfinite_steps:
            self.bad(where, f"{nonfinite} NaN / inf value(s) but nonfinite_steps is {nonfinite_steps}; the amaxes were edited or damaged")
        if any(v < 0 for v in amax):
            self.bad(where, "holds a negative amax; an amax is an absolute maximum (>= 0)")

    def grad(self, data, where) -> Optional[GradStats]:
        if data is None:
            return None
        if self.obj(data, where) is None:
            return None
        got = {f.name: self.field(data, f.name, where, "int" if f.type in ("int", int) else "number") for f in dataclasses.fields(GradStats)}
        if None in got.values():
            return None
        return GradStats(**{k: (v if isinstance(v, int) and not isinstance(v, bool) and k in ("steps", "numel", "sampled") else self.num(v)) for k, v in got.items()})

    def profile(self, data: Any) -> Profile:
        if not isinstance(data, Mapping):
            raise ProfileError(f"{self.source}: expected a JSON object at the top level, got {type(data).__name__}; {self.HINT}")
        check_schema_version(data, self.source, "profile", SCHEMA_VERSION, ProfileError, "save profiles with Profile.save or 'autoprec profile'")
        allowed = {"schema_version", "autoprec_version", "steps", "config", "fingerprint", "metadata", "layers"}
        for key in sorted(set(data) - allowed):
            self.bad(key, f"unknown top-level key; expected some of {', '.join(sorted(allowed))}")
        steps = self.field(data, "steps", "", "int")
        config = self.field(data, "config", "", "object")
        formats: list[Format] = []
        cfg = {}
        if config is not None:
            for key in ("window", "sample", "every", "grad_sample", "history_len"):
                cfg[key] = self.field(config, key, "config", "int")
            names = config.get("formats")
            if not isinstance(names, list) or not names:
                self.bad("config.formats", f"expected a non-empty list of format names ({', '.join(f.value for f in Format)})")
            else:
                for name in names:
                    try:
                        formats.append(Format.parse(name))
                    except Exception as exc:  # FormatError: name the field
                        self.bad("config.formats", str(exc))
            sub_bits = config.get("sub_bits", SUB_BITS)
            if sub_bits != SUB_BITS:
                self.bad("config.sub_bits", f"histograms with {sub_bits!r} sub-bits cannot be read by this autoprec (it uses {SUB_BITS})")
        fingerprint = {}
        raw_fp = self.field(data, "fingerprint", "", "object")
        for fqn, info in (raw_fp or {}).items():
            try:
                fingerprint[fqn] = LayerInfo.from_dict(info)
            except (KeyError, TypeError, ValueError, AttributeError):
                self.bad(f"fingerprint[{fqn!r}]", "must be an object with 'module', 'ops' and 'params'")
        metadata = self.field(data, "metadata", "", "object", default={})
        layers = {}
        raw_layers = self.field(data, "layers", "", "object")
        if raw_layers is not None and not raw_layers:
            self.bad("layers", "is empty; a profile holds at least one layer")
        for fqn, entry in (raw_layers or {}).items():
            where = f"layers[{fqn!r}]"
            if self.obj(entry, where) is None:
                continue
            if raw_fp is not None and fqn not in raw_fp:
                self.bad(where, "has no fingerprint entry")
            lsteps = self.field(entry, "steps", where, "int")
            grad = self.grad(self.field(entry, "param_grad", where, "object or null"), f"{where}.param_grad")
            tensors = {}
            raw_tensors = self.field(entry, "tensors", where, "object")
            for kind, tdata in (raw_tensors or {}).items():
                if kind not in KINDS:
                    self.bad(f"{where}.tensors.{kind}", f"unknown tensor kind; expected one of {', '.join(KINDS)}")
                    continue
                tensors[kind] = self.tensor(tdata, f"{where}.tensors.{kind}", formats)
            layers[fqn] = LayerProfile(lsteps, grad, tensors)
        if raw_layers is not None:
            for fqn in fingerprint:
                if fqn not in raw_layers:
                    self.bad(f"layers[{fqn!r}]", "missing: the fingerprint lists this layer but the profile has no statistics for it")
        if self.problems:
            raise ProfileError(self.problems, self.HINT)
        return Profile(fingerprint, layers, steps, cfg["window"], cfg["sample"], cfg["every"], cfg["grad_sample"], cfg["history_len"], tuple(formats), metadata)


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- the profiler -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _stride(numel: int, last: int, sample: int) -> int:
    """Smallest stride ``≥ numel / sample`` coprime with the last dimension (see module doc)."""
    stride = -(-numel // sample)
    if stride <= 1:
        return 1
    while math.gcd(stride, last) != 1:
        stride += 1
    return stride


class _TensorState:
    """Device accumulators of one (layer, kind)."""

    __slots__ = ("hist", "amax", "moments", "calls", "numel", "sampled", "first_step")

    def __init__(self, window: int, device: torch.device):
        self.hist = torch.zeros(len(REFERENCES) * NUM_BINS, dtype=torch.int64, device=device)
        self.amax = torch.zeros(window, dtype=torch.float32, device=device)
        self.moments = torch.zeros(2, dtype=torch.float64, device=device)  # sum x, sum x^2 (sampled)
        self.calls = self.numel = self.sampled = 0
        self.first_step: Optional[int] = None


class _Welford:
    """Per-element running mean / M2 of one parameter's (strided) gradient."""

    __slots__ = ("param", "stride", "mean", "m2", "n")

    def __init__(self, param: nn.Parameter, grad_sample: int):
        self.param = param
        last = param.shape[-1] if param.dim() else 1
        self.stride = _stride(param.numel(), last, grad_sample)
        self.mean: Optional[torch.Tensor] = None
        self.m2: Optional[torch.Tensor] = None
        self.n = 0


class _LayerState:
    __slots__ = ("fqn", "module", "weights", "welford", "tensors", "steps", "last_step", "phase")

    def __init__(self, fqn: str, module: nn.Module, grad_sample: int, phase: int):
        self.fqn = fqn
        self.phase = phase
        self.module = module
        own = [p for _, p in module.named_parameters(recurse=False)]
        self.weights = [p for p in own if p.dim() >= 2]
        self.welford = [_Welford(p, grad_sample) for p in own if p.requires_grad]
        self.tensors: dict[str, _TensorState] = {}
        self.steps = 0
        self.last_step = -1


def _first_float(obj: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(obj):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        items: Iterable = obj
    elif isinstance(obj, Mapping):
        items = obj.values()
    else:
        return None
    for item in items:
        found = _first_float(item)
        if found is not None:
            return found
    return None


class LayerProfiler:
    """Gathers per-layer statistics over ``window`` optimizer steps (see the module doc).

    ``model``: the model to watch; ``example_inputs``: one input (or a tuple / dict of inputs) to
    find the layers by tracing, as the runtime does (without it, the module tree's layers: a
    hand-written matmul module is then missed). ``formats``: the candidate formats whose
    underflow / overflow fractions are computed. ``window``: steps to profile, after which the
    hooks remove themselves. ``sample``: elements histogrammed per tensor per call.
    ``grad_sample``: gradient elements per parameter tracked by the Welford accumulators (they
    hold two float32 copies of that many elements on the parameter's device).
    ``history_len``: the delayed-scaling amax history (`Scaling`'s default).
    ``module_filter(module, fqn) -> bool``: False leaves a layer unprofiled.
    ``enabled=False``: a pass-through (attach / step do nothing, no hooks).

    Costs, all on the device and without a host sync: per layer call and tensor kind 4 small
    kernels (the amax), plus ~15 on the layer's histogram steps; `step` adds the weights' and
    five `torch._foreach_*` kernels for all Welford updates. Memory: per (layer, kind) 48 KiB of
    histogram and ``4 * window`` bytes of amax history; the Welford state (see ``grad_sample``).
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any = None,
        *,
        formats: Iterable["Format | str"] = tuple(Format),
        window: int = 500,
        sample: int = 8192,
        every: int = 8,
        grad_sample: int = 1 << 20,
        history_len: int = Scaling().history_len,
        module_filter: Optional[ModuleFilter] = None,
        enabled: bool = True,
    ):
        for name, value in (("window", window), ("sample", sample), ("every", every), ("grad_sample", grad_sample), ("history_len", history_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"LayerProfiler({name}={value!r}): must be a positive integer")
        try:
            self.formats = tuple(dict.fromkeys(Format.parse(f) for f in formats))
        except Exception as exc:
            raise ProfileError(f"LayerProfiler(formats=...): {exc}") from None
        if not self.formats:
            raise ProfileError("LayerProfiler(formats=()): give at least one candidate format")
        self.model = model
        self.window = window
        self.sample = sample
        # A window shorter than `every` would leave some layers without a histogram step.
        self.every = min(every, window)
        self.grad_sample = grad_sample
        self.history_len = history_len
        self.enabled = enabled
        found = find_layers(model, example_inputs)
        modules = dict(model.named_modules())
        self.fingerprint = {fqn: info for fqn, info in found.items() if module_filter is None or module_filter(modules[fqn], fqn)}
        if enabled and not self.fingerprint:
            hint = "" if example_inputs is not None else "; pass example_inputs to find layers that call matmul themselves"
            raise ProfileError(f"{type(model).__name__} has no layers to profile (no module runs a matrix product){hint}")
        self._layers = {fqn: _LayerState(fqn, modules[fqn], grad_sample, i % self.every) for i, fqn in enumerate(self.fingerprint)}
        self._handles: list = []
        self._steps = 0
        self._attached = False
        self._buffers: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __repr__(self) -> str:
        state = "collecting" if self.collecting else ("done" if self._steps >= self.window else "detached")
        return f"LayerProfiler({len(self._layers)} layers, step {self._steps}/{self.window}, {state})"

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self._layers)

    @property
    def steps(self) -> int:
        """Steps completed (calls of `step` inside the window)."""
        return self._steps

    @property
    def collecting(self) -> bool:
        """True while hooks are attached and the window is not over."""
        return self._attached

    def attach(self) -> "LayerProfiler":
        """Register the forward hooks (one per layer). Refuses a second attach; a no-op once the
        window is over or when disabled."""
        if self._attached:
            raise ProfileError("this profiler is already attached; detach() it before attaching again")
        if not self.enabled or self._steps >= self.window:
            return self
        try:
            for fqn, state in self._layers.items():
                hook = functools.partial(self._forward_hook, state)
                self._handles.append(state.module.register_forward_hook(hook, with_kwargs=True))
        except BaseException:
            self._remove_hooks()
            raise
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the statistics so far stay readable with `profile`. Idempotent."""
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attached = False

    def __enter__(self) -> "LayerProfiler":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- hooks ----------------------------------------------------------------------------------

    def _forward_hook(self, state: _LayerState, module, args, kwargs, output) -> None:
        if not self._attached or not torch.is_grad_enabled():
            return
        if state.last_step != self._steps:
            state.last_step = self._steps
            state.steps += 1
        x = _first_float((args, kwargs))
        if x is not None:
            self._record(state, "activation", x)
        out = _first_float(output)
        if out is not None and out.requires_grad:
            out.register_hook(functools.partial(self._grad_hook, state))

    def _grad_hook(self, state: _LayerState, grad: torch.Tensor) -> None:
        # A backward that runs after detach() or after the window (graph built before) records nothing.
        if self._attached and grad is not None and grad.is_floating_point():
            self._record(state, "grad", grad)

    def _device_buffers(self, device: torch.device):
        bufs = self._buffers.get(device)
        if bufs is None:
            ones = torch.ones(len(REFERENCES) * self.sample, dtype=torch.int64, device=device)
            offsets = (torch.arange(len(REFERENCES), dtype=torch.int32, device=device) * NUM_BINS).unsqueeze(1)
            one = torch.ones((), dtype=torch.float32, device=device)
            factor = torch.tensor([1.0, 1.0 - 2.0**-22, 1.0 - 2.0**-22], device=device)
            bufs = self._buffers[device] = (ones, offsets, one, factor)
        return bufs

    def _record(self, layer: _LayerState, kind: str, x: torch.Tensor) -> None:
        """Fold one tensor into the (layer, kind) accumulators. No host sync: every branch below
        is on Python ints and shapes.

        Every call: the exact amax (3 kernels). On the layer's histogram steps (every ``every``-th
        step, staggered across layers so each step costs about the same): histograms and
        moments of a strided subsample (about 20 more kernels).
        """
        numel = x.numel()
        if numel == 0:
            return
        step = self._steps
        ts = layer.tensors.get(kind)
        if ts is None:
            ts = layer.tensors[kind] = _TensorState(self.window, x.device)
        x = x.detach()
        # Exact amax over the full tensor; NaN propagates, so a non-finite value always shows.
        low, high = torch.aminmax(x)
        amax = torch.maximum(high, low.neg()).float()
        slot = ts.amax[step]
        torch.maximum(slot, amax, out=slot)
        if ts.first_step is None:
            ts.first_step = step
        ts.calls += 1
        ts.numel += numel
        if (step + layer.phase) % self.every:
            return
        ones, offsets, one, factor = self._device_buffers(x.device)
        stride = _stride(numel, x.shape[-1] if x.dim() else 1, self.sample)
        flat = x.reshape(-1)
        sub = flat[::stride] if stride > 1 else flat
        # Current scaling uses this call's amax; delayed scaling the largest finite amax of the
        # previous history_len steps, as AmaxHistory with reduction "max" (a non-finite amax
        # belongs to a skipped step and counts as zero); the first step has no history and uses
        # its own amax.
        if ts.first_step == step:
            ref = amax
        else:
            past = ts.amax[max(0, step - self.history_len) : step]
            ref = torch.nan_to_num(past, nan=0.0, posinf=0.0, neginf=0.0).amax()
        # 1, 1/amax and 1/ref, the last two lowered by 2**-22 so that |x| == amax lands strictly
        # below 1.0 and the bins from 1.0 up count exactly |x| > ref (up to 2**-22, far below any
        # format's resolution). 0 where the amax is 0 or not finite (every value is then 0 or
        # flagged as non-finite).
        scales = torch.stack((one, amax, ref)).reciprocal_().nan_to_num_(0.0, 0.0, 0.0).mul_(factor)
        scaled = sub.float() * scales.unsqueeze(1)  # (3, m): x, x/amax, x/ref
        # The mask keeps the exponent and the leading mantissa bits and drops the sign: |x|'s bin.
        index = (scaled.view(torch.int32) >> _SHIFT).bitwise_and_(_BIN_MASK).add_(offsets)
        ts.hist.index_add_(0, index.view(-1), ones[: index.numel()])
        values = scaled[0]
        ts.moments.add_(torch.stack((values.sum(), torch.dot(values, values))))
        ts.sampled += values.numel()

    # -- per step -------------------------------------------------------------------------------

    def step(self) -> bool:
        """Close one optimizer step: record weights and parameter gradients, advance the window.

        Call it once per optimizer step, after ``backward()`` and before gradient clipping, the
        optimizer step and ``zero_grad``. When the window is complete the hooks are removed.
        Returns whether the profiler is still collecting. No host sync.
        """
        if not self._attached:
            return False
        grads, means, m2s, inv_n = [], [], [], []
        with torch.no_grad():
            for layer in self._layers.values():
                for w in layer.weights:
                    self._record(layer, "weight", w)
                for wf in layer.welford:
                    g = wf.param.grad
                    if g is None or g.is_sparse:
                        continue
                    g = g.detach().reshape(-1)
                    g = (g[:: wf.stride] if wf.stride > 1 else g).float()
                    if wf.mean is None:
                        wf.mean, wf.m2 = torch.zeros_like(g), torch.zeros_like(g)
                    wf.n += 1
                    grads.append(g)
                    means.append(wf.mean)
                    m2s.append(wf.m2)
                    inv_n.append(1.0 / wf.n)
            if grads:
                # Welford (1962): mean += (g - mean) / n; M2 += (g - mean_old) * (g - mean_new).
                delta = torch._foreach_sub(grads, means)
                torch._foreach_add_(means, torch._foreach_mul(delta, inv_n))
                torch._foreach_addcmul_(m2s, delta, torch._foreach_sub(grads, means))
        self._steps += 1
        if self._steps >= self.window:
            self._remove_hooks()
            logger.info("profiling window of %d steps complete; hooks removed", self.window)
        return self._attached

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The statistics gathered so far and the window position (tensors cloned, on their
        devices), so a resumed run's profile equals the uninterrupted run's. No host sync."""
        def tensors(ts: _TensorState) -> dict:
            return {slot: (v.clone() if torch.is_tensor(v) else v) for slot in _TensorState.__slots__ for v in [getattr(ts, slot)]}

        return {
            "steps": self._steps,
            "layers": {
                fqn: {
                    "steps": layer.steps,
                    "last_step": layer.last_step,
                    "welford": [(None if wf.mean is None else wf.mean.clone(), None if wf.m2 is None else wf.m2.clone(), wf.n) for wf in layer.welford],
                    "tensors": {kind: tensors(ts) for kind, ts in layer.tensors.items()},
                }
                for fqn, layer in self._layers.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a profiler made for the same model, window and settings."""
        if set(state["layers"]) != set(self._layers):
            raise ProfileError("profiler state names other layers than this profiler watches; make it for the same model")
        self._steps = int(state["steps"])
        for fqn, saved in state["layers"].items():
            layer = self._layers[fqn]
            layer.steps, layer.last_step = saved["steps"], saved["last_step"]
            for wf, (mean, m2, n) in zip(layer.welford, saved["welford"]):
                wf.mean, wf.m2, wf.n = (None if mean is None else mean.clone()), (None if m2 is None else m2.clone()), n
            layer.tensors = {}
            for kind, slots in saved["tensors"].items():
                ts = _TensorState.__new__(_TensorState)
                for slot, value in slots.items():
                    setattr(ts, slot, value.clone() if torch.is_tensor(value) else value)
                layer.tensors[kind] = ts
        if self._steps >= self.window:
            self._remove_hooks()

    # -- result ---------------------------------------------------------------------------------

    def profile(self, metadata: Optional[Mapping[str, Any]] = None) -> Profile:
        """The `Profile` of the steps so far. Forces a host-device sync (copies the accumulators)."""
        if self._steps == 0:
            why = "the profiler is disabled" if not self.enabled else "call step() once per optimizer step while attached"
            raise ProfileError(f"no steps were profiled: {why}")
        steps = self._steps
        layers = {}
        for fqn, layer in self._layers.items():
            tensors = {kind: self._tensor_stats(layer.tensors[kind], steps) for kind in KINDS if kind in layer.tensors}
            layers[fqn] = LayerProfile(layer.steps, self._grad_stats(layer), tensors)
        return Profile(
            self.fingerprint, layers, steps, self.window, self.sample, self.every, self.grad_sample,
            self.history_len, self.formats, dict(metadata or {}),
        )

    def _tensor_stats(self, ts: _TensorState, steps: int) -> TensorStats:
        hist = ts.hist.cpu().view(len(REFERENCES), NUM_BINS).numpy()
        hists = {ref: Histogram.from_full(hist[i]) for i, ref in enumerate(REFERENCES)}
        amax = ts.amax[:steps].cpu().tolist()
        s1, s2 = ts.moments.cpu().tolist()
        n = ts.sampled
        mean = s1 / n if n else math.nan
        var = (s2 - n * mean * mean) / (n - 1) if n > 1 else math.nan
        fractions = {f.value: _fractions(hists, n, f) for f in self.formats}
        return TensorStats(
            calls=ts.calls, numel=ts.numel, sampled=n, amax=tuple(amax),
            nonfinite_steps=sum(1 for v in amax if not math.isfinite(v)),
            mean=mean, var=max(var, 0.0) if math.isfinite(var) else var, histograms=hists,
            fractions=fractions,
        )

    @staticmethod
    def _grad_stats(layer: _LayerState) -> Optional[GradStats]:
        tracked = [wf for wf in layer.welford if wf.n > 0]
        if not tracked:
            return None
        numel = sampled = 0
        sum_mean = sum_var = sum_sq = 0.0
        steps = min(wf.n for wf in tracked)
        for wf in tracked:
            mean = wf.mean.double().cpu()
            m2 = wf.m2.double().cpu()
            scale = wf.param.numel() / mean.numel()
            numel += wf.param.numel()
            sampled += mean.numel()
            sum_mean += float(mean.sum()) * scale
            sum_sq += float((mean * mean).sum()) * scale
            sum_var += (float(m2.sum()) / (wf.n - 1) if wf.n > 1 else math.nan) * scale
        nsr = sum_var / sum_sq if sum_sq > 0 else (math.inf if sum_var > 0 else math.nan)
        return GradStats(steps, numel, sampled, sum_mean / numel, sum_var / numel, sum_sq / numel, nsr)


# -- the built-in workload, TensorBoard, overhead -----------------------------------------------


def _trainer(workload, seed: int, lr: float, device: torch.device):
    """The workload's model on ``device`` with its `Trainer` (the same step `workloads.train` runs)."""
    from .workloads import Trainer

    return Trainer(workload.build_model(seed).to(device), workload, lr=lr, seed=seed)


def _workload(name: str, batch_size: int):
    from .workloads import LMConfig, default_workload

    if name not in LMConfig.preset_names():
        raise ProfileError(f"unknown workload {name!r}; choose one of {', '.join(LMConfig.preset_names())}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ProfileError(f"batch size must be a positive integer, got {batch_size!r}")
    return default_workload(name, batch_size=batch_size)


def train_window(
    trainer,
    steps: int,
    profiler: "LayerProfiler | None" = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    phase: str = "profiling",
) -> tuple[float, float]:
    """Run ``steps`` steps of a `workloads.Trainer` with ``profiler`` attached for them (None:
    plain training); returns the first and last training loss (one host sync, at the end).
    ``progress(done, steps, phase)`` is called after every step."""
    losses = []
    with profiler if profiler is not None else contextlib.nullcontext():
        for i in range(steps):
            losses.append(trainer.step(profiler.step if profiler is not None else None))
            if progress is not None:
                progress(i + 1, steps, phase)
    first, last = (float(v) for v in torch.stack([losses[0], losses[-1]]).cpu())
    return first, last


def with_grad_formats(formats: Iterable["Format | str"]) -> tuple[Format, ...]:
    """``formats`` plus the gradient formats layers in them compute in (E5M2 for FP8), in
    `Format` order: what a profile needs to judge those formats' gradients too."""
    from .plan import LayerPrecision

    wanted = {Format.parse(f) for f in formats}
    wanted |= {LayerPrecision(f).grad_format for f in wanted}
    return tuple(f for f in Format if f in wanted)


def profile_workload(
    workload: str = "small",
    steps: int = 100,
    *,
    batch_size: int = 16,
    seed: int = 0,
    lr: float = 3e-3,
    device: "str | torch.device" = "auto",
    formats: Iterable["Format | str"] = tuple(Format),
    sample: int = 8192,
    every: int = 8,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> Profile:
    """Profile ``steps`` real training steps of the built-in LM (`default_workload(workload)`).

    The model trains as `autoprec.workloads.train` trains it; the profiler's window is ``steps``.
    ``progress(done, total, phase)`` is called after every step (no sync). Returns the `Profile`,
    with the workload, seed, first / last loss and wall time in its metadata.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ProfileError(f"steps must be a positive integer, got {steps!r}")
    wl = _workload(workload, batch_size)
    dev = resolve_device(device, ProfileError, "profiling")
    trainer = _trainer(wl, seed, lr, dev)
    example = wl.val_batches(1)[0][0].to(dev)
    profiler = LayerProfiler(trainer.model, example, formats=formats, window=steps, sample=sample, every=every)
    start = time.perf_counter()
    first, last = train_window(trainer, steps, profiler, progress, "profiling")
    seconds = time.perf_counter() - start
    meta = {
        "workload": workload, "batch_size": batch_size, "seed": seed, "lr": lr, "device": str(dev),
        "loss_first": _enc(first), "loss_last": _enc(last), "seconds": round(seconds, 3), "torch": torch.__version__,
    }
    return profiler.profile(meta)


def write_tensorboard(profile: Profile, logdir: "str | os.PathLike | Any", step: Optional[int] = None) -> None:
    """Write ``profile`` as TensorBoard events under ``logdir`` (or into a ``SummaryWriter``).

    Per layer and tensor kind: histograms of log2|x| (``absolute``) and of log2(|x|/amax)
    (``current``) from the on-device bins (`add_histogram_raw`, zeros and non-finite values left
    out, as they have no logarithm), the amax per step as a scalar, and the sampled zero and
    non-finite counts. Tags: ``<kind>/<layer>/...``, so TensorBoard groups by kind.
    """
    from torch.utils.tensorboard import SummaryWriter

    own = not hasattr(logdir, "add_histogram_raw")
    writer = SummaryWriter(log_dir=str(logdir)) if own else logdir
    global_step = profile.steps if step is None else step
    try:
        for fqn, lp in profile.layers.items():
            for kind, ts in lp.tensors.items():
                for ref, name in (("absolute", "log2_abs"), ("current", "log2_abs_over_amax")):
                    buckets = ts.histograms[ref].log2_buckets()
                    if buckets is None:
                        continue
                    lows, limits, counts = buckets
                    centres = (np.array(lows) + np.array(limits)) / 2
                    weights = np.array(counts, dtype=np.float64)
                    writer.add_histogram_raw(
                        f"{kind}/{fqn}/{name}",
                        min=lows[0], max=limits[-1], num=int(weights.sum()),
                        sum=float((centres * weights).sum()), sum_squares=float((centres**2 * weights).sum()),
                        bucket_limits=limits, bucket_counts=counts, global_step=global_step,
                    )
                for t, value in enumerate(ts.amax):
                    if math.isfinite(value):
                        writer.add_scalar(f"{kind}/{fqn}/amax", value, t)
                writer.add_scalar(f"{kind}/{fqn}/zero_fraction", ts.zeros / ts.sampled if ts.sampled else 0.0, global_step)
                writer.add_scalar(f"{kind}/{fqn}/nonfinite_steps", ts.nonfinite_steps, global_step)
            if lp.param_grad is not None and math.isfinite(lp.param_grad.nsr):
                writer.add_scalar(f"grad/{fqn}/noise_to_signal", lp.param_grad.nsr, global_step)
        writer.flush()
    finally:
        if own:
            writer.close()


def measure_overhead(
    workload_name: str = "small",
    steps: int = 30,
    *,
    warmup: int = 3,
    batch_size: int = 16,
    sample: int = 8192,
    every: int = 8,
    device: "str | torch.device" = "auto",
    seed: int = 0,
) -> dict:
    """Median training-step time with and without the profiler, interleaved in one process.

    Three identical models train side by side, one step of each per round (the order rotated
    every round): ``plain`` (no profiler), ``window`` (profiler attached, inside its window for
    every timed step) and ``after`` (profiler attached whose 1-step window ended in warmup: hooks
    gone, `step` still called). A step is zero_grad, forward + loss, backward, profiler step,
    clipping and AdamW; timings end with a device sync. Returns medians (ms) and the overheads
    ``window / plain - 1`` and ``after / plain - 1``.
    """
    wl = _workload(workload_name, batch_size)
    dev = resolve_device(device, ProfileError, "profiling")
    example = wl.val_batches(1)[0][0].to(dev)
    trainers = {name: _trainer(wl, seed, 3e-3, dev) for name in ("plain", "window", "after")}
    profilers = {
        "plain": None,
        "window": LayerProfiler(trainers["window"].model, example, window=warmup + steps + 1, sample=sample, every=every).attach(),
        "after": LayerProfiler(trainers["after"].model, example, window=1, sample=sample, every=every).attach(),
    }
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + steps):
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name in order:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            profiler = profilers[name]
            trainers[name].step(profiler.step if profiler is not None else None)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    for profiler in profilers.values():
        if profiler is not None:
            profiler.detach()
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    mean = {name: statistics.fmean(ts) * 1e3 for name, ts in times.items()}
    return {
        "workload": workload_name, "batch_size": batch_size, "steps": steps, "sample": sample, "every": every,
        "device": str(dev), "threads": torch.get_num_threads(),
        "median_ms": med,
        "mean_ms": mean,
        "overhead_window": med["window"] / med["plain"] - 1.0,
        "overhead_after": med["after"] / med["plain"] - 1.0,
        "overhead_window_mean": mean["window"] / mean["plain"] - 1.0,
        "after_hooks_removed": not profilers["after"].collecting,
    }
