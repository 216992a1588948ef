"""The `Profile` artifact: per-layer statistics of one window, saved as versioned JSON (written
atomically) and loaded with every problem named, checked against the model it is used for."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch.nn as nn

from .._version import __version__
from .._io import atomic_write_text, check_schema_version
from ..coverage import LayerInfo, changed_shapes, covered_layers, layer_name
from ..errors import ProfileError
from ..formats import Format
from .stats import KINDS, NUM_BINS, REFERENCES, SCHEMA_VERSION, SUB_BITS, FormatFractions, GradStats, Histogram, TensorStats, scalings_for


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

    # Unhashable: defining __eq__ sets __hash__ to None (and eq=False keeps dataclasses from adding one).

    def __repr__(self) -> str:
        return f"Profile({len(self.layers)} layers, {self.steps} steps, formats={','.join(f.value for f in self.formats)})"

    # -- model check ----------------------------------------------------------------------------

    def check_model(self, model: nn.Module, example_inputs: Any = None) -> None:
        """Raise `ProfileError` naming every layer where ``model`` differs from the profiled one.

        Checks: profiled layers the model lacks; covered layers of the model the profile lacks
        (traced with ``example_inputs``, else from the module tree plus the fingerprint's traced
        layers); parameter shapes that changed. With ``example_inputs`` it costs one forward
        under ``torch.no_grad`` (a few for a model in training mode, `coverage.trace_layers`);
        without, a walk of the module tree.

        Args:
            model: the model the profile is to be used for (a search, a plan).
            example_inputs: one forward's inputs (one input, a tuple, a dict of keyword inputs
                or a `calls.ModelCall`) to find the layers by tracing; None: from the module tree
                and the fingerprint.

        Raises:
            ProfileError: every mismatching layer, one per line.
            ModelCallError: ``example_inputs`` is a dict with a key that is not a string.
        """
        modules = dict(model.named_modules())
        covered = covered_layers(model, example_inputs, self.fingerprint)
        problems = []
        for fqn in self.fingerprint:
            if fqn not in modules:
                problems.append(f"{fqn!r}: profiled layer missing from the model")
        for fqn, info in covered.items():
            if fqn not in self.fingerprint:
                problems.append(f"{layer_name(fqn, model)!r}: a covered layer ({info.module}) the profile lacks")
        for fqn, actual, profiled in changed_shapes(model, self.fingerprint):
            problems.append(f"{layer_name(fqn, model)!r}: parameter shapes {_shapes(actual)} differ from the profiled {_shapes(profiled)}")
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
        """Build a profile from `to_dict` output; a `ProfileError` names every bad field.

        Args:
            data: the parsed JSON object (`to_dict`'s form, a schema version this autoprec reads).
            source: where ``data`` came from (a file path), to begin each problem with.

        Returns:
            The profile.

        Raises:
            ProfileError: every bad field, or a missing or later schema version.
        """
        return _Reader(source).profile(data)

    def save(self, path: "str | os.PathLike") -> Path:
        """Write the profile as JSON atomically (a temporary file renamed over the target).

        Args:
            path: the file to write; missing parent folders are created.

        Returns:
            The path written.
        """
        return atomic_write_text(path, json.dumps(self.to_dict(), allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: "str | os.PathLike", model: Optional[nn.Module] = None, example_inputs: Any = None) -> "Profile":
        """Read a profile saved by `save`; a `ProfileError` names the file and what is wrong.

        Args:
            path: a JSON file written by `save`.
            model: when given, the profile is also checked against it (`check_model`): one made
                for another model is refused, naming every mismatching layer.
            example_inputs: passed to `check_model` with ``model`` (tracing costs a forward).

        Returns:
            The profile.

        Raises:
            ProfileError: the file is missing, unreadable, not a profile, of a later schema
                version, or (with ``model``) made for another model.
            ModelCallError: ``example_inputs`` is a dict with a key that is not a string.
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
        except RecursionError:
            raise ProfileError(f"{path}: JSON nested too deeply to be a profile; re-create it with 'autoprec profile'") from None
        return _Reader(str(path)).profile(data)

    # -- reading --------------------------------------------------------------------------------

    def layer_name(self, fqn: str) -> str:
        """A layer's name as shown (tables, logs); the profile's key stays as it is.

        Args:
            fqn: a layer's key in this profile.

        Returns:
            ``fqn`` itself, except a one-layer model's root ``""``: its class from the
            fingerprint, e.g. ``"Linear"`` (``"the model"`` when the fingerprint lacks it;
            `coverage.layer_name`).
        """
        info = self.fingerprint.get(fqn)
        return layer_name(fqn, info.module if info is not None else "the model")

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
            name = self.layer_name(fqn)
            act, grad = lp.tensors.get("activation"), lp.tensors.get("grad")
            nsr = f"{lp.param_grad.nsr:.3g}" if lp.param_grad is not None else "-"
            nonfinite = sum(ts.nonfinite_steps for ts in lp.tensors.values())
            lines.append(
                f"{name[-24:]:<24} {lp.steps:>5} {nsr:>9} {last(act):>9} {last(grad):>9} {nonfinite:>6} "
                f"{under(act, Format.FP8_E4M3):>9} {under(grad, Format.FP8_E5M2):>9}"
            )
        return "\n".join(lines)


def _shapes(params: Mapping[str, Sequence[int]]) -> str:
    return "{" + ", ".join(f"{k}: {tuple(v)}" for k, v in params.items()) + "}"



_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _Reader:
    """Reads a profile's JSON, collecting every problem with the path of the field at fault."""

    HINT = "Re-create the file with 'autoprec profile' (or Profile.save); profiles are not meant to be edited by hand."

    def __init__(self, source: str):
        self.source = source
        self.problems: list[str] = []

    def bad(self, where: str, message: str) -> None:
        self.problems.append(f"{self.source}: {where}: {message}")

    def obj(self, data: Any, where: str) -> Optional[Mapping]:
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
            "fraction": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
            "fraction pair": lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in v) and v[0] <= v[1],
        }[kind](value)
        if not ok:
            shown = json.dumps(value)[:60] if _jsonable(value) else repr(value)[:60]
            expected = {"int": "a non-negative integer", "fraction": "a fraction in [0, 1]", "fraction pair": "a range [low, high] within [0, 1]"}.get(kind, kind)
            self.bad(path, f"expected {expected}, got {shown}")
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
        return Histogram(first, np.asarray(counts, dtype=np.int64))

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
                    # None only with a problem noted, which makes this tensor None below.
                    hist = self.histogram(values["histograms"][ref], f"{where}.histograms.{ref}")
                    if hist is not None:
                        hists[ref] = hist
        fractions: dict[str, dict[str, FormatFractions]] = {}
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
                    got = [self.field(entry, k, swhere, kind) for k, kind in (("underflow", "fraction"), ("overflow", "fraction"), ("underflow_range", "fraction pair"), ("overflow_range", "fraction pair"))]
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
        values = {k: self.num(v) for k, v in got.items() if k in ("mean", "var", "signal", "nsr")}
        for k in ("var", "signal", "nsr"):
            if values[k] < 0:
                self.bad(f"{where}.{k}", f"must be >= 0 (a variance or a ratio of them), got {values[k]}")
        # steps, numel and sampled passed the "int" check above, the rest are numbers.
        return GradStats(
            steps=got["steps"], numel=got["numel"], sampled=got["sampled"],
            mean=values["mean"], var=values["var"], signal=values["signal"], nsr=values["nsr"],
        )

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
            except ValueError as exc:
                field, _, message = str(exc).partition(": ") if str(exc).startswith(".") else ("", "", str(exc))
                self.bad(f"fingerprint[{fqn!r}]{field}", message)
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
                stats = self.tensor(tdata, f"{where}.tensors.{kind}", formats)
                if stats is not None:  # else a problem is noted and no profile is made
                    tensors[kind] = stats
            nonfinite = any(ts.nonfinite_steps for ts in tensors.values())
            nan = [k for k in ("mean", "var", "signal") if grad is not None and grad.steps >= 2 and math.isnan(getattr(grad, k))]
            if grad is not None and nan and not nonfinite:
                # The profiler writes a NaN gradient statistic over 2+ steps only when a step was
                # non-finite, which it counts in the tensors' nonfinite_steps.
                self.bad(f"{where}.param_grad.{nan[0]}", f"NaN over {grad.steps} steps although no tensor of the layer had a non-finite step; the file was edited or damaged")
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
