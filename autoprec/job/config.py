"""Search job files (``searches/<job>.toml``): parsed, checked, and frozen.

Every problem is one line naming the key and what is expected, e.g.
``searches/x.toml: [search].measure_top: expected an integer >= 1, got "many"``. Unknown keys
are errors (a typo must not silently fall back to a default), and so are retired keys
(``[search].trials``, ``[search].multi_objective``: the proxy study they set is gone), each with
the fix.

Layout::

    [job]        name, out, device               # out: folder for plan, study, profile, logs
    [workload]   factory = "module:function", kwargs = {...}
    [budgets]    memory, accuracy, accuracy_relative
    [search]     min_precision, max_precision, formats, scaling, grad_formats, recipes, storage, study_name, seed,
                 measure_top (the k best plans measured), timeout_s (for finding them),
                 measured_trials (the most plans measured in all; above the k best and the
                 references, the learning sampler proposes the rest: `search.refine`; 0 = off),
                 target (a GPU the plan is for that this machine is not: a name of
                 `costs.targets.TARGETS` or a device profile's .json path; the plans are then
                 priced for it and the fastest *predicted* there that meets the budgets as
                 measured here is chosen)
    [rules]      pin = {pattern = format}, forbid = {pattern = [formats]}, groups = [[patterns]],
                 recompute = [patterns]         # recompute units (blocks) the search chooses among; [] = none
    [profile]    path (a saved profile to load instead of profiling), steps, sensitivity_batches
    [measure]    val_batches, steps               # the measured stage (`search.candidate_runs`)
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import workload
from .._checks import integer, number
from ..costs.targets import TARGETS, TargetDevice, load_target
from ..errors import CostModelError, FormatError, SearchError
from ..formats import Format
from ..layer_precision import PRESETS
from ..search.study import JOURNAL_SCHEME, JOURNAL_SUFFIXES
from ..search.planning import Planning
from ..search.budgets import MEMORY_SPELLINGS, Budgets, memory_budget
from ..search.space import DEFAULT_CANDIDATES, LayerRules, formats_for_precision

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["JobConfig", "load_job", "load_job_workload", "resolve_factory"]


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A checked search job. Paths are absolute (relative ones resolve against the job file's folder)."""

    source: Path
    name: str
    out: Path
    factory: str
    factory_kwargs: Mapping[str, Any]
    budgets: Budgets
    min_precision: int = 8
    max_precision: int = 32
    formats: tuple[Format, ...] = DEFAULT_CANDIDATES
    scaling: Mapping[Format, Any] = dataclasses.field(default_factory=dict)  # `Planning.scaling`
    grad_formats: Mapping[Format, Any] = dataclasses.field(default_factory=dict)  # `Planning.grad_formats`
    recipes: tuple = ()  # `Planning.recipes`: named recipes weighed per layer
    storage: str = "study.db"
    study_name: str = ""
    seed: int = 0
    measure_top: int = 4
    measured_trials: int = 0
    timeout_s: "float | None" = None
    target: "TargetDevice | None" = None
    rules: LayerRules = LayerRules()
    profile_path: "Path | None" = None
    profile_steps: int = 50
    sensitivity_batches: int = 2
    device: str = "auto"
    val_batches: int = 8
    # A plan's step time is the median of this many steps interleaved with FP32 ones. On a CPU
    # the median of 5 varied by 3.4-7.5 % (benchmarks/refine_regret.py's tables): more than the
    # gaps between the best plans, so that at 7.5 % even measuring every plan once kept one over
    # 3 % slower in half the replays; 10 steps halve that noise (docs/results.md, regret).
    measure_steps: int = 10

    def planning(self, lr: float) -> Planning:
        """The search's settings as one `Planning`: ``measure_top`` plans, the integer programs
        bounded by ``timeout_s``; ``lr``: the workload's learning rate (the sensitivity's)."""
        return Planning(self.formats, self.rules, self.budgets, self.min_precision, self.max_precision, lr,
                        k=self.measure_top, time_limit=self.timeout_s, scaling=self.scaling, grad_formats=self.grad_formats, recipes=self.recipes,
                        target=self.target)

    @property
    def storage_url(self) -> str:
        """An Optuna storage URL; a relative path (bare or ``journal://``) is under ``out``: a
        path ending in ``.journal`` / ``.log`` is a journal file (``journal:///abs/path``), any
        other bare path a SQLite file."""
        if "://" in self.storage and not self.storage.startswith(JOURNAL_SCHEME):
            return self.storage
        path = Path(self.storage.removeprefix(JOURNAL_SCHEME))
        path = path if path.is_absolute() else self.out / path
        journal = self.storage.startswith(JOURNAL_SCHEME) or path.suffix in JOURNAL_SUFFIXES
        return f"{JOURNAL_SCHEME}{path}" if journal else f"sqlite:///{path}"


# An upper bound that keeps a typo (an extra 000) from asking for gigabytes: every held-out
# batch is kept on the device for the whole measured stage.
MAX_VAL_BATCHES = 1024
# Each of the measure_top plans is trained and timed for real, and the exact k-best enumeration
# grows with k: beyond a few hundred a job neither enumerates nor measures in reasonable time.
MAX_MEASURE_TOP = 256

# Keys a job file may no longer hold: (table, key) -> why, and what to do instead.
_RETIRED = {
    ("search", "trials"): "no longer used: the candidates are the [search].measure_top best plans of the exact integer "
                          "program, not trials of a proxy study; delete the key (measure_top sets how many plans are measured)",
    ("search", "multi_objective"): "no longer used: the logs always show the Pareto front (step time, memory, loss increase) "
                                   "of the measured plans; delete the key",
}


# key -> (checker, what is expected) per table; checkers return the converted value or raise.
# Counts and numbers are checked as every setting is (`autoprec._checks`).
_int = integer


def _memory(v):
    return memory_budget(v)  # its ValueError becomes the key's one-line error


_positive = number(above=0)
_non_negative = number(0)


def _name(v):
    """A job name, used as a folder under runs/: no path separators, not '.' or '..'."""
    if not isinstance(v, str) or not v.strip() or v in (".", "..") or any(c in v for c in "/\\\0") or not v.isprintable():
        raise ValueError
    return v


def _str(v):
    if not isinstance(v, str) or not v:
        raise ValueError
    return v


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError
    return v


def _table(v):
    if not isinstance(v, dict):
        raise ValueError
    return v


def _format_list(v):
    if not isinstance(v, list) or not v:
        raise ValueError
    return tuple(Format.parse(x) for x in v)


def _per_format(field: str) -> Callable:
    """The parser of a table of format = name, or a list of names weighed per layer
    (`Planning`'s ``scaling``: "tensor" | "row" | "block" | "mx"; ``grad_formats``: a gradient
    format), checked as `Planning` checks it."""
    def parse(v):
        table = {_str(k): [_str(x) for x in g] if isinstance(g, list) else _str(g) for k, g in _table(v).items()}
        try:
            return getattr(Planning((), **{field: table}), field)
        except SearchError:
            raise ValueError from None
    return parse


def _recipes(v):
    if not isinstance(v, list):
        raise ValueError
    try:
        return Planning((), recipes=[_str(x) for x in v]).recipes
    except SearchError:
        raise ValueError from None


def _pin(v):
    return {_str(k): Format.parse(f) for k, f in _table(v).items()}


def _forbid(v):
    return {_str(k): _format_list(f) for k, f in _table(v).items()}


def _groups(v):
    if not isinstance(v, list) or not all(isinstance(g, list) and g and all(isinstance(p, str) for p in g) for g in v):
        raise ValueError
    return tuple(tuple(g) for g in v)


def _recompute(v):
    if not isinstance(v, list) or not all(isinstance(p, str) and p.strip() for p in v):
        raise ValueError
    return tuple(v)


FORMATS = ", ".join(f.value for f in Format)
_SCHEMA: dict[str, dict[str, tuple[Callable, str]]] = {
    "job": {"name": (_name, "a name for the runs/ folder, without '/', '\\' or '..'; set [job].out to write elsewhere"), "out": (_str, "a folder path"), "device": (_str, "auto, cpu, cuda or cuda:N")},
    "workload": {"factory": (_str, 'a "module:function" string'), "kwargs": (_table, "a table of keyword arguments")},
    "budgets": {
        "memory": (_memory, f"{MEMORY_SPELLINGS}; leave it out for no memory budget"),
        "accuracy": (_non_negative, "an allowed loss increase >= 0, finite; leave it out for no accuracy budget"),
        "accuracy_relative": (_bool, "true or false"),
    },
    "search": {
        "min_precision": (_int(4), "4, 8, 16 or 32"),
        "max_precision": (_int(4), "4, 8, 16 or 32"),
        "formats": (_format_list, f"a non-empty list of formats ({FORMATS})"),
        "scaling": (_per_format("scaling"), 'a table of scaled format = "tensor", "row", "block" or "mx", or a list of them the search '
                    'weighs per layer, e.g. {fp8_e4m3 = "block"} or {fp8_e4m3 = ["tensor", "block"]}'),
        "grad_formats": (_per_format("grad_formats"), 'a table of format = its gradient format, e.g. {nvfp4 = "fp32"} (nvfp4 forwards, high-precision backwards), '
                         'or a list of them the search weighs per layer, e.g. {fp8_e4m3 = ["fp8_e5m2", "fp8_e5m2/fp32", "fp32"]} '
                         '("fp8_e5m2/fp32": per GEMM, the input gradient in fp8_e5m2, the weight gradient in high precision)'),
        "recipes": (_recipes, f"a list of named recipes the search weighs per layer ({', '.join(PRESETS)}), "
                    'e.g. ["te_mxfp8", "torchao_rowwise_with_gw_hp"], each of a format among the formats'),
        "storage": (_str, "a file path (.journal / .log: a journal file, else SQLite) or an Optuna storage URL"),
        "study_name": (_str, "a non-empty string"),
        "seed": (_int(0), "an integer >= 0"),
        "measure_top": (_int(1, MAX_MEASURE_TOP), f"an integer from 1 to {MAX_MEASURE_TOP} (each plan is trained and timed; more do not finish)"),
        "measured_trials": (_int(0), "an integer >= 0 (0: no learning sampler)"),
        "timeout_s": (_positive, "a number of seconds > 0, finite"),
        "target": (_str, f"a device's name ({', '.join(TARGETS)}) or the path of a device profile (.json)"),
    },
    "rules": {
        "pin": (_pin, f"a table of layer pattern = format ({FORMATS})"),
        "forbid": (_forbid, "a table of layer pattern = [formats]"),
        "groups": (_groups, "a list of lists of layer patterns"),
        "recompute": (_recompute, 'a list of module name patterns of blocks, e.g. ["blocks.*"]'),
    },
    "profile": {
        "path": (_str, "a saved profile's path"),
        "steps": (_int(1), "an integer >= 1"),
        "sensitivity_batches": (_int(1), "an integer >= 1"),
    },
    "measure": {"val_batches": (_int(2, MAX_VAL_BATCHES), f"an integer from 2 to {MAX_VAL_BATCHES}"), "steps": (_int(1), "an integer >= 1")},
}
_REQUIRED = {("job", "name"), ("workload", "factory")}


def _key(name: str) -> str:
    """A table or key name as TOML writes it: bare when it can be, else quoted with escapes (a
    name holding a newline or a quote stays on the error's one line)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def load_job(path: "str | Path") -> JobConfig:
    """Read and check a job file, and import its workload factory (not called yet).

    Args:
        path: the job's TOML file; a relative ``[job].out`` or ``[profile].path`` in it is
            taken from the file's folder, a relative ``[search].storage`` from ``[job].out``.

    Returns:
        The `JobConfig`.

    Raises:
        SearchError: one line for the first problem found (a missing or unreadable file,
            invalid TOML, an unknown table or key, a bad or missing value, a factory that
            cannot be imported), naming the file and the key.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SearchError(f"{path}: no such job file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SearchError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SearchError(f"{path}: not valid TOML: {exc}") from None

    values: dict[tuple[str, str], Any] = {}
    for table, entries in raw.items():
        if table not in _SCHEMA:
            raise SearchError(f"{path}: unknown table [{_key(table)}]; expected one of {', '.join(f'[{t}]' for t in _SCHEMA)}")
        if not isinstance(entries, dict):
            raise SearchError(f"{path}: {_key(table)} must be a table, written [{_key(table)}]")
        for key, value in entries.items():
            if (table, key) in _RETIRED:
                raise SearchError(f"{path}: [{table}].{key}: {_RETIRED[(table, key)]}")
            if key not in _SCHEMA[table]:
                raise SearchError(f"{path}: [{table}].{_key(key)}: unknown key; expected one of {', '.join(_SCHEMA[table])}")
            check, expected = _SCHEMA[table][key]
            try:
                values[(table, key)] = check(value)
            except FormatError as exc:
                raise SearchError(f"{path}: [{table}].{key}: {exc}") from None
            except (ValueError, TypeError, AttributeError):
                raise SearchError(f"{path}: [{table}].{key}: expected {expected}, got {value!r}") from None
    for table, key in sorted(_REQUIRED - set(values)):
        raise SearchError(f"{path}: [{table}].{key} is missing; expected {_SCHEMA[table][key][1]}")

    def get(table, key, default=None):
        return values.get((table, key), default)

    base = path.resolve().parent
    min_p, max_p = get("search", "min_precision", 8), get("search", "max_precision", 32)
    try:
        formats_for_precision(min_p, max_p)
    except SearchError as exc:
        raise SearchError(f"{path}: [search]: {exc}") from None
    name = get("job", "name")
    out = Path(get("job", "out", f"runs/{name}"))
    profile = get("profile", "path")
    try:
        budgets = Budgets(get("budgets", "memory"), get("budgets", "accuracy"), get("budgets", "accuracy_relative", True))
    except SearchError as exc:
        raise SearchError(f"{path}: [budgets]: {exc}") from None
    target = None
    if get("search", "target") is not None:
        try:
            target = load_target(get("search", "target"), base)
        except CostModelError as exc:
            raise SearchError(f"{path}: [search].target: {exc}") from None
        if get("search", "measured_trials", 0):
            # The learning sampler corrects the predictions with this machine's step times.
            raise SearchError(f"{path}: [search].measured_trials: the learning sampler learns from this machine's step times, "
                              "not the target's; with [search].target set, leave it out or set 0")
    config = JobConfig(
        source=path.resolve(),
        name=name,
        out=out if out.is_absolute() else (base / out).resolve(),
        factory=get("workload", "factory"),
        factory_kwargs=dict(get("workload", "kwargs", {})),
        budgets=budgets,
        min_precision=min_p,
        max_precision=max_p,
        formats=get("search", "formats", DEFAULT_CANDIDATES),
        scaling=get("search", "scaling", {}),
        grad_formats=get("search", "grad_formats", {}),
        recipes=get("search", "recipes", ()),
        storage=get("search", "storage", "study.db"),
        study_name=get("search", "study_name", name),
        seed=get("search", "seed", 0),
        measure_top=get("search", "measure_top", 4),
        measured_trials=get("search", "measured_trials", 0),
        timeout_s=get("search", "timeout_s"),
        target=target,
        rules=LayerRules(get("rules", "pin", {}), get("rules", "forbid", {}), get("rules", "groups", ()), get("rules", "recompute")),
        profile_path=(base / profile) if profile and not Path(profile).is_absolute() else (Path(profile) if profile else None),
        profile_steps=get("profile", "steps", 50),
        sensitivity_batches=get("profile", "sensitivity_batches", 2),
        device=get("job", "device", "auto"),
        val_batches=get("measure", "val_batches", 8),
        measure_steps=get("measure", "steps", JobConfig.measure_steps),
    )
    try:  # each named recipe's format among the candidates
        Planning(formats_for_precision(min_p, max_p, config.formats), recipes=config.recipes)
    except SearchError as exc:
        raise SearchError(f"{path}: [search].recipes: {str(exc).split(': ', 1)[-1]}") from None
    resolve_factory(config)  # a missing factory is a config error, found before any work
    return config


def resolve_factory(config: JobConfig) -> Callable:
    """Import ``[workload].factory`` ("module:function"); `SearchError` naming the key otherwise."""
    try:
        return workload.resolve_factory(config.factory, factory_dirs(config))
    except workload.WorkloadError as exc:
        raise SearchError(f"{config.source}: [workload].factory: {exc}") from None


def factory_dirs(config: JobConfig) -> "tuple[Path, Path]":
    """Where ``[workload].factory``'s module is looked for when it is not installed: the job
    file's folder (which its relative paths already start from), then the working directory."""
    return (config.source.parent, Path.cwd())


def load_job_workload(config: JobConfig):
    """The job's workload (``[workload]``), a `WorkloadError` restated as a `SearchError` naming the job file and key."""
    try:
        return workload.load_workload(config.factory, config.factory_kwargs, factory_dirs(config))
    except workload.WorkloadError as exc:
        key = "[workload].kwargs" if "rejected" in str(exc) else "[workload].factory"
        raise SearchError(f"{config.source}: {key}: {exc}") from None
