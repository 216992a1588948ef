"""Property tests (issue 25, Hypothesis): any valid plan or profile survives a save and a load
unchanged, whatever its layer names; any TOML-shaped job file is either accepted or refused with
one `SearchError` line, never a traceback type."""

import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoprec.coverage import LayerInfo
from autoprec.errors import PlanError, SearchError, SettingsError
from autoprec.formats import Format, Granularity
from autoprec.plan import MAX_HISTORY_LEN, Calibration, CalibrationMethod, LayerPrecision, Plan, Scaling, ScalingMode
from autoprec.profiling.artifact import LayerProfile, Profile
from autoprec.profiling.stats import NUM_BINS, REFERENCES, FormatFractions, GradStats, Histogram, TensorStats, scalings_for
from autoprec.job.config import load_job

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Module names as users write them, and any text at all: dots, unicode, quotes, newlines, JSON
# keywords.
names = st.one_of(
    st.text(min_size=1, max_size=12),
    st.lists(st.sampled_from(["null", "true", "false", "None", "0", "h", "proj", "ü", "层", "'", '"', "\\", "\n"]), min_size=1, max_size=4).map(".".join),
)
finite = st.floats(allow_nan=False, allow_infinity=False)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), finite, st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
infos = st.builds(
    LayerInfo,
    module=st.text(max_size=10),
    ops=st.lists(st.text(max_size=8), max_size=3).map(tuple),
    params=st.dictionaries(st.text(max_size=8), st.lists(st.integers(0, 4096), max_size=3).map(tuple), max_size=2),
)


@st.composite
def layer_precisions(draw):
    fmt = draw(st.sampled_from(list(Format)))
    grad = draw(st.sampled_from([None, Format.FP8_E5M2, Format.FP8_E4M3, Format.FP32])) if fmt.is_fp8 else None
    scaled = [f for f in (fmt, grad or fmt) if f.needs_scale] or [f for f in Format if f.needs_scale]
    max_margin = min(math.floor(math.log2(f.max)) for f in scaled)
    mode = draw(st.sampled_from(list(ScalingMode)))
    # MXFP8 is for E4M3 layers with FP8 gradients (`check_layer`).
    mx = fmt is Format.FP8_E4M3 and grad in (None, Format.FP8_E4M3, Format.FP8_E5M2)
    granularities = [g for g in Granularity if g is not Granularity.MX or mx]
    granularity = Granularity.TENSOR if mode is ScalingMode.DELAYED and fmt.is_fp8 else draw(st.sampled_from(granularities))
    scaling = Scaling(granularity, mode, draw(st.integers(1, MAX_HISTORY_LEN)), draw(st.sampled_from(["max", "most_recent"])), draw(st.integers(0, max_margin)))
    if not (fmt.needs_scale or (grad is not None and grad.needs_scale)) or fmt is Format.NVFP4:
        scaling = Scaling()  # a format that takes no scale holds none, NVFP4 its own (`check_layer`)
    calibration = Calibration(
        draw(st.sampled_from(list(CalibrationMethod))),
        draw(st.floats(0, 100, exclude_min=True)),
        draw(st.integers(1, 10**6)),
        draw(st.one_of(st.none(), st.floats(1, 1e6, exclude_min=True))),
    )
    return LayerPrecision(fmt, grad, scaling, calibration, draw(st.text(max_size=20)))


figure_names = st.sampled_from(["bytes", "step_seconds", "loss", "loss_increase", "memory_fraction", "activation_bytes"])


@st.composite
def plans(draw):
    layers = draw(st.dictionaries(names, layer_precisions(), min_size=1, max_size=5))
    fingerprint = draw(st.dictionaries(st.sampled_from(sorted(layers)), infos, max_size=len(layers)))
    figures = st.dictionaries(figure_names, st.floats(0, 1e15))
    predicted = draw(figures)
    if draw(st.booleans()):
        predicted["layers"] = draw(st.dictionaries(st.sampled_from(sorted(layers)), figures, max_size=len(layers)))
    budgets = draw(st.dictionaries(st.sampled_from(["memory", "accuracy"]), st.one_of(st.floats(0, 1e12), st.just(math.inf))))
    metadata = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3))
    return Plan(layers, fingerprint, budgets, predicted, draw(figures), metadata)


@FAST
@given(plan=plans())
def test_any_plan_saves_and_loads_to_an_equal_plan(tmp_path, plan):
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    assert list(loaded.layers) == list(plan.layers)


# Any value a user might pass for a field, of any type (issue 59): counts as ints, numpy integers,
# integral and other floats, bools and strings; numbers as numpy floats, NaN and infinities.
any_value = st.one_of(
    st.integers(-3, 5000), st.integers(-3, 5000).map(np.int64), st.integers(0, 20).map(np.int32), st.integers(0, 20).map(float),
    st.floats(-1, 200), st.floats(-1, 200).map(np.float32), st.floats(-1, 200).map(np.float64),
    st.sampled_from([math.nan, math.inf, True, False, None, "8", "0.5", "max", "most_recent", "tensor", "block", "delayed", "mse"]),
)
ANY_FIELDS = {Scaling: ("granularity", "mode", "history_len", "reduction", "margin"), Calibration: ("method", "percentile", "batches", "outlier_ratio")}


@st.composite
def accepted_precisions(draw):
    """A `LayerPrecision` of fields drawn from `any_value`, or None when a constructor refused them."""
    made = {}
    for cls, fields in ANY_FIELDS.items():
        kwargs = draw(st.dictionaries(st.sampled_from(fields), any_value, max_size=len(fields)))
        try:
            made[cls] = cls(**kwargs)
        except SettingsError as exc:
            assert str(exc).startswith(f"{cls.__name__}(") and "\n" not in str(exc)  # one line naming the field
            return None
    try:
        return LayerPrecision(draw(st.sampled_from(list(Format))), None, made[Scaling], made[Calibration])
    except PlanError as exc:
        assert str(exc).startswith("LayerPrecision(")
        return None


@settings(FAST, max_examples=300)
@given(lp=accepted_precisions())
def test_whatever_the_constructors_accept_saves_and_loads_to_an_equal_plan(tmp_path, lp):
    if lp is None:
        return
    plan = Plan({"fc": lp})
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan
    # Counts are held as ints (a numpy integer converted), numbers as floats.
    assert {type(lp.scaling.history_len), type(lp.scaling.margin), type(lp.calibration.batches)} == {int}
    assert type(lp.calibration.percentile) is float


# -- profiles -----------------------------------------------------------------------------------

fraction = st.floats(0, 1)


@st.composite
def fraction_pairs(draw):
    a, b = draw(fraction), draw(fraction)
    return (min(a, b), max(a, b))


@st.composite
def histograms(draw):
    first = draw(st.integers(0, NUM_BINS - 1))
    counts = draw(st.lists(st.integers(0, 2**40), max_size=min(8, NUM_BINS - first)))
    return Histogram(first, np.asarray(counts, dtype=np.int64))


@st.composite
def tensor_stats(draw, formats, steps):
    amax = draw(st.lists(st.one_of(st.floats(0, 1e30), st.sampled_from([math.nan, math.inf])), min_size=steps, max_size=steps))
    fractions = {
        fmt.value: {s: FormatFractions(draw(fraction), draw(fraction), draw(fraction_pairs()), draw(fraction_pairs())) for s in scalings_for(fmt)}
        for fmt in formats
    }
    stat = st.one_of(st.floats(allow_infinity=False), st.just(math.nan))
    return TensorStats(
        calls=draw(st.integers(0, 2**40)), numel=draw(st.integers(0, 2**40)), sampled=draw(st.integers(0, 2**40)),
        amax=tuple(amax), nonfinite_steps=sum(not math.isfinite(a) for a in amax),
        mean=draw(stat), var=draw(st.one_of(st.floats(0, 1e30), st.just(math.nan))),
        histograms={ref: draw(histograms()) for ref in REFERENCES}, fractions=fractions,
    )


@st.composite
def grad_stats(draw, nonfinite):
    steps = draw(st.integers(0, 1000))
    # The profiler writes NaN over 2+ steps only after a non-finite step (the reader checks it).
    nan_ok = nonfinite or steps < 2
    stat = st.one_of(st.floats(0, 1e30), st.just(math.nan)) if nan_ok else st.floats(0, 1e30)
    return GradStats(
        steps, draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40)),
        draw(st.one_of(st.floats(-1e30, 1e30), st.just(math.nan)) if nan_ok else st.floats(-1e30, 1e30)),
        draw(stat), draw(stat), draw(st.one_of(st.floats(0, 1e30), st.just(math.inf), st.just(math.nan))),
    )


@st.composite
def profiles(draw):
    formats = tuple(draw(st.lists(st.sampled_from(list(Format)), min_size=1, max_size=6, unique=True)))
    steps = draw(st.integers(0, 6))
    fingerprint = draw(st.dictionaries(names, infos, min_size=1, max_size=4))
    layers = {}
    for fqn in fingerprint:
        kinds = draw(st.lists(st.sampled_from(["weight", "activation", "grad"]), unique=True))
        tensors = {kind: draw(tensor_stats(formats, steps)) for kind in kinds}
        nonfinite = any(ts.nonfinite_steps for ts in tensors.values())
        layers[fqn] = LayerProfile(draw(st.integers(0, 10**6)), draw(st.one_of(st.none(), grad_stats(nonfinite))), tensors)
    return Profile(
        fingerprint, layers, steps, *draw(st.lists(st.integers(0, 10**6), min_size=5, max_size=5)), formats,
        draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
    )


@FAST
@given(profile=profiles())
def test_any_profile_saves_and_loads_to_an_equal_profile(tmp_path, profile):
    loaded = Profile.load(profile.save(tmp_path / "profile.json"))
    assert loaded == profile
    assert list(loaded.layers) == list(profile.layers)


# -- job files ----------------------------------------------------------------------------------

TABLES = ["job", "workload", "budgets", "search", "rules", "profile", "measure"]
KEYS = ["name", "out", "device", "factory", "kwargs", "memory", "accuracy", "accuracy_relative", "min_precision", "max_precision",
        "formats", "storage", "study_name", "seed", "measure_top", "measured_trials", "timeout_s", "pin", "forbid", "groups",
        "path", "steps", "sensitivity_batches", "val_batches", "trials", "bogus"]


def toml_string(s: str) -> str:
    return json.dumps(s)  # a JSON string with \uXXXX escapes is a TOML basic string, bar surrogates


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


safe_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=10)
toml_scalars = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), safe_text,
    st.sampled_from(["fp8_e4m3", "int8", "fp32", "bf16", "autoprec.workloads:default_workload", "x:y", "study.journal", "cpu"]),
    st.sampled_from([8, 16, 32, 0, 1, 2, 256, 257]),
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.one_of(safe_text, st.sampled_from(KEYS)), inner, max_size=3)),
    max_leaves=6,
)
job_dicts = st.dictionaries(
    st.one_of(st.sampled_from(TABLES), safe_text),
    st.one_of(st.dictionaries(st.one_of(st.sampled_from(KEYS), safe_text), toml_values, max_size=4), toml_scalars),
    max_size=5,
)
VALID = {"job": {"name": "tiny"}, "workload": {"factory": "autoprec.workloads:default_workload"}}


@FAST
@given(raw=job_dicts, base=st.booleans())
def test_any_job_file_loads_or_is_refused_with_one_search_error_line(tmp_path, raw, base):
    data = {**VALID, **raw} if base else raw
    lines = []
    for table, value in data.items():
        if not isinstance(value, dict):
            lines.insert(0, f"{toml_string(table)} = {toml_value(value)}")
            continue
        lines.append(f"[{toml_string(table)}]")
        lines.extend(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items())
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        load_job(path)
    except SearchError as exc:
        assert str(exc).count("\n") == 0, str(exc)
