"""A precision search for a person, in TensorBoard: the plans measured for real, their Pareto front
(step time, memory, loss increase), and each candidate plan.

Layout (one TensorBoard run per folder)::

    LOGDIR/search/                  scalars search/trial/{seconds,bytes,loss_increase,feasible}
                                            (step = trial number; ``*_vs_fp32`` with ``fp32=``)
                                    scalar  search/best_feasible_seconds   best feasible so far
                                    scalars refine/{predicted,corrected,measured}_seconds, ...
                                            per trial of the learning sampler (`refine_points`)
                                    image   search/pareto    memory (x) vs step time (y), all trials,
                                                             the (time, memory, loss) front ringed
                                    text    search/summary   counts, best trial, the front's table
    LOGDIR/candidates/<name>/       image   plan/precision_map, text plan/summary
                                    scalars plan/predicted_bytes, plan/measured_seconds, ...,
                                            plan/{predicted,measured}_within_{bytes,loss_increase,budgets}
                                    hparams session: counts per format, budgets, rank

The candidates' metric tags are `plan_scalars`' (the ones ``autoprec review`` writes), so their
HParams columns line up with reviewed plans in the same logdir. The trials are read from the
search job's measured study (`autoprec.search.measured.MeasuredStage`: one trial per plan run
for real, user attributes ``bytes``, ``seconds``, ``loss_increase`` and ``name``); a trial is
feasible when its constraints ``memory`` and ``loss`` are all <= 0. The Pareto front is Optuna's
multi-objective view of those trials (`pareto_front`).
Writing is host-only work (no device): one TensorBoard event per trial and one image.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import MonitoringError
from ..plan import Plan
from .plans import (
    MISSING,
    RGB,
    bitmap_font,
    budget_checks,
    finite_number,
    format_bytes,
    format_number,
    format_seconds,
    markdown_table,
    plan_figures,
    plan_hparams,
    plan_scalars,
    plan_summary_markdown,
    render_precision_map,
    to_latin1,
)
from .writer import EVENT_FILE_PREFIX, add_png, add_scalars, add_text, ensure_writable_dir, run_name

if TYPE_CHECKING:  # optuna is imported lazily: `autoprec.monitoring` loads without it
    import optuna

__all__ = [
    "SEARCH_RUN",
    "CANDIDATES_DIR",
    "PARETO_COLOUR",
    "INFEASIBLE_COLOUR",
    "MEASURED_COLOUR",
    "LOSS_COLOURS",
    "TrialPoint",
    "RefinePoint",
    "ParetoFigure",
    "search_points",
    "refine_points",
    "refine_scalars",
    "pareto_front",
    "best_so_far",
    "search_summary_markdown",
    "render_pareto",
    "budget_scalars",
    "write_search",
    "write_candidates",
]

logger = logging.getLogger(__name__)

SEARCH_RUN = "search"
CANDIDATES_DIR = "candidates"

# Feasible trials take one of eight steps of viridis (matplotlib's `_cm_listed._viridis_data`,
# sampled at 0, 1/7, ..., 1) by their loss increase, low (purple) to high (yellow). Eight, not a
# continuous ramp: the image is a palette image (fast PNG) and the steps read as a legend.
LOSS_COLOURS: tuple[RGB, ...] = (
    (68, 1, 84), (70, 50, 126), (54, 92, 141), (39, 127, 142),
    (31, 161, 135), (74, 193, 109), (160, 218, 57), (253, 231, 37),
)
PARETO_COLOUR: RGB = (200, 30, 30)  # the front's line and rings: no viridis step is red
INFEASIBLE_COLOUR: RGB = (175, 175, 175)
MEASURED_COLOUR: RGB = (230, 159, 0)  # Okabe & Ito orange
_INK, _AXIS, _GRID, _BACKGROUND = (40, 40, 40), (90, 90, 90), (228, 228, 228), (255, 255, 255)
_PAD, _LINE, _RADIUS = 4, 14, 3


# -- trials --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrialPoint:
    """One complete trial's totals (as the measured stage stored them), whether it met
    both budgets, and the name of its plan when the trial has one."""

    number: int
    bytes: float
    seconds: float
    loss_increase: float
    feasible: bool
    name: str = ""


def search_points(study: "optuna.Study") -> list[TrialPoint]:
    """The complete trials of a measured study in trial-number order.

    Running, failed and pruned trials are left out. Raises `MonitoringError` for a complete trial
    without the ``bytes`` / ``seconds`` / ``loss_increase`` user attributes the measured stage
    sets.
    """
    from optuna.trial import TrialState

    from ..search.study import feasible

    points = []
    for trial in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
        attrs = trial.user_attrs
        bytes_, seconds, loss = (finite_number(attrs.get(key)) for key in ("bytes", "seconds", "loss_increase"))
        if bytes_ is None or seconds is None or loss is None:
            raise MonitoringError(
                f"trial {trial.number} of study {study.study_name!r} has no finite user attributes "
                f"bytes/seconds/loss_increase; write_search reads the search job's measured study"
            )
        points.append(TrialPoint(trial.number, bytes_, seconds, loss, feasible(trial), str(attrs.get("name", ""))))
    return points


@dataclasses.dataclass(frozen=True)
class RefinePoint:
    """One trial the learning sampler (`autoprec.search.refine`) proposed: the proxy's predicted
    step seconds, the corrected prediction it was proposed on, what was measured (None when the
    trial was pruned before its step was timed), and the correction fitted before it
    (`Correction.to_dict`: factors per format and for the fixed cost, per unit deviations)."""

    number: int
    predicted_seconds: "float | None"
    corrected_seconds: float
    measured_seconds: "float | None"
    measured_on_proxy_scale: "float | None"  # fp32 ratio x the proxy's FP32 step: what the fit targets
    correction: Mapping[str, Any]


def refine_points(study: "optuna.Study") -> list[RefinePoint]:
    """The learning sampler's finished trials of a measured study (user attribute ``refined``),
    by trial number; trials skipped unmeasured (another worker took the plan) are left out."""
    from optuna.trial import TrialState

    from ..search.measured import REFINED_ATTR

    points = []
    for trial in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)), key=lambda t: t.number):
        attrs = trial.user_attrs
        refined = attrs.get(REFINED_ATTR)
        if not isinstance(refined, Mapping) or "skipped" in attrs:
            continue
        ratio, scale = finite_number(attrs.get("fp32_ratio")), finite_number(refined.get("fp32_seconds"))
        points.append(RefinePoint(
            trial.number, finite_number(attrs.get("predicted")), float(refined["predicted"]["seconds"]),
            finite_number(attrs.get("seconds")) if trial.state is TrialState.COMPLETE else None,
            ratio * scale if ratio is not None and scale is not None else None, refined.get("correction", {}),
        ))
    return points


def refine_scalars(point: RefinePoint) -> dict[str, float]:
    """A learning-sampler trial as ``refine/`` scalars: ``predicted_seconds`` (the proxy),
    ``corrected_seconds`` (the corrected proxy it was proposed on), ``measured_seconds`` and
    ``corrected_error`` (corrected / measured on the proxy's FP32 scale - 1) once measured,
    ``fitted_trials``, and the correction then: ``factor/<format or fixed>/<seconds, bytes,
    loss>`` and ``unit_deviation_rms/<field>`` (the per-layer deviations' root mean square)."""
    scalars = {"refine/corrected_seconds": point.corrected_seconds}
    if point.predicted_seconds is not None:
        scalars["refine/predicted_seconds"] = point.predicted_seconds
    if point.measured_seconds is not None:
        scalars["refine/measured_seconds"] = point.measured_seconds
        if point.measured_on_proxy_scale:
            scalars["refine/corrected_error"] = point.corrected_seconds / point.measured_on_proxy_scale - 1
    correction = dict(point.correction)
    if "trials" in correction:
        scalars["refine/fitted_trials"] = correction.pop("trials")
    units = correction.pop("units", {}) or {}
    for name, factors in correction.items():
        scalars.update({f"refine/factor/{name}/{field}": value for field, value in factors.items() if finite_number(value) is not None})
    for field in ("seconds", "bytes", "loss"):
        values = [d[field] for d in units.values() if finite_number(d.get(field)) is not None]
        if values:
            scalars[f"refine/unit_deviation_rms/{field}"] = math.sqrt(sum(v * v for v in values) / len(values))
    return scalars


def pareto_front(points: Sequence[TrialPoint]) -> list[TrialPoint]:
    """The feasible trials no other feasible trial beats on all three of step time, memory and
    loss increase, by ascending memory. Of trials with equal totals the first is kept.

    Optuna's multi-objective view: the points become the trials of an in-memory study with the
    three objectives minimised and the budgets as constraints, and the front is its
    ``best_trials``. Host-only; one in-memory Optuna trial per point.
    """
    import optuna

    good: dict[tuple[float, float, float], TrialPoint] = {}
    for p in sorted((p for p in points if p.feasible), key=lambda p: p.number):
        good.setdefault((p.seconds, p.bytes, p.loss_increase), p)  # equal totals: the first
    if not good:
        return []
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created" line per call
    try:
        view = optuna.create_study(directions=["minimize"] * 3)
    finally:
        optuna.logging.set_verbosity(verbosity)
    view.add_trials([optuna.trial.create_trial(values=list(key), user_attrs={"point": i}) for i, key in enumerate(good)])
    chosen = list(good.values())
    front = [chosen[t.user_attrs["point"]] for t in view.best_trials]
    return sorted(front, key=lambda p: (p.bytes, p.seconds, p.number))


def best_so_far(points: Sequence[TrialPoint]) -> list[tuple[int, float]]:
    """``(trial number, least feasible seconds up to it)`` from the first feasible trial on."""
    series, best = [], math.inf
    for p in sorted(points, key=lambda p: p.number):
        if p.feasible:
            best = min(best, p.seconds)
        if best < math.inf:
            series.append((p.number, best))
    return series


def _fp32_reference(fp32: Optional[Mapping[str, Any]]) -> dict[str, float]:
    if fp32 is None:
        return {}
    if not isinstance(fp32, Mapping):
        raise MonitoringError(f"fp32 must be a mapping like {{'bytes': ..., 'seconds': ...}}, got {type(fp32).__name__}")
    reference = {}
    for key in ("bytes", "seconds"):
        value = finite_number(fp32.get(key))
        if fp32.get(key) is not None and (value is None or value <= 0):
            raise MonitoringError(f"fp32[{key!r}] must be a positive number, got {fp32.get(key)!r}")
        if value is not None:
            reference[key] = value
    return reference


def search_summary_markdown(points: Sequence[TrialPoint], fp32: Optional[Mapping[str, Any]] = None) -> str:
    """How many trials, how many feasible, the best feasible one and the Pareto front's table
    (with each total as a fraction of FP32 where ``fp32`` has it)."""
    reference = _fp32_reference(fp32)

    def shown(key: str, value: float) -> str:
        text = format_bytes(value) if key == "bytes" else format_seconds(value)
        return text + (f" ({100 * value / reference[key]:.1f} % of FP32)" if key in reference else "")

    feasible = [p for p in points if p.feasible]
    parts = [f"**search**: {len(points)} complete trials, {len(feasible)} feasible"]
    if feasible:
        best = min(feasible, key=lambda p: (p.seconds, p.number))
        parts.append(
            f"best feasible: trial {best.number}: {best.name + ', ' if best.name else ''}step time {shown('seconds', best.seconds)}, "
            f"memory {shown('bytes', best.bytes)}, loss increase {format_number(best.loss_increase)}"
        )
        rows = [[str(p.number), p.name or MISSING, shown("bytes", p.bytes), shown("seconds", p.seconds), format_number(p.loss_increase)] for p in pareto_front(points)]
        parts.append("Pareto front (step time, memory, loss increase):\n\n" + markdown_table(["trial", "plan", "memory", "step time", "loss increase"], rows))
    else:
        parts.append("best feasible: " + MISSING + " (no trial met both budgets)")
    return "\n\n".join(parts)


# -- the Pareto image ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParetoFigure:
    """A rendered search: ``image`` is a PIL palette image; ``plot`` the plot area's
    ``(left, top, right, bottom)`` pixels, ``x_range`` bytes and ``y_range`` seconds at its edges."""

    image: Any  # PIL.Image.Image, mode "P"
    points: tuple[TrialPoint, ...]
    front: tuple[int, ...]  # trial numbers on the front, by ascending memory
    plot: tuple[int, int, int, int]
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size

    def xy(self, bytes_: float, seconds: float) -> tuple[int, int]:
        """The pixel of a (memory, step time) point."""
        left, top, right, bottom = self.plot
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        return (round(left + (bytes_ - x0) / (x1 - x0) * (right - left)), round(bottom - (seconds - y0) / (y1 - y0) * (bottom - top)))

    def point_xy(self, number: int) -> tuple[int, int]:
        """The pixel at the centre of trial ``number``'s dot."""
        point = next(p for p in self.points if p.number == number)
        return self.xy(point.bytes, point.seconds)

    def to_array(self) -> np.ndarray:
        """``(height, width, 3)`` uint8 RGB (HWC)."""
        return np.asarray(self.image.convert("RGB"), dtype=np.uint8)

    def to_png(self) -> bytes:
        buffer = io.BytesIO()
        self.image.save(buffer, format="PNG", compress_level=1)  # level 1: see PrecisionMap.to_png
        return buffer.getvalue()


def _padded(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or (abs(hi) * 0.05 or 1.0)
    return lo - pad, hi + pad


def _loss_colour(loss: float, lo: float, hi: float) -> RGB:
    if hi <= lo:
        return LOSS_COLOURS[0]
    step = int((loss - lo) / (hi - lo) * len(LOSS_COLOURS))
    return LOSS_COLOURS[min(max(step, 0), len(LOSS_COLOURS) - 1)]


def _measured_points(measured: Sequence[tuple[str, Plan]]) -> list[tuple[str, Optional[tuple[float, float]], tuple[float, float]]]:
    """``(name, predicted (bytes, seconds) or None, measured (bytes, seconds))`` for each plan
    whose measured totals have both figures."""
    out = []
    for name, plan in measured:
        figures = plan_figures(plan)
        m, p = figures["measured"], figures["predicted"]
        if m.bytes is None or m.seconds is None:
            logger.debug("plan %r has no measured bytes and seconds; not drawn", name)
            continue
        out.append((str(name), (p.bytes, p.seconds) if p.bytes is not None and p.seconds is not None else None, (m.bytes, m.seconds)))
    return out


def render_pareto(
    points: Sequence[TrialPoint],
    *,
    title: str = "search",
    memory_bytes: Optional[float] = None,
    measured: Sequence[tuple[str, Plan]] = (),
    size: tuple[int, int] = (640, 480),
) -> ParetoFigure:
    """Every complete trial as a dot at (memory, step time): feasible ones coloured by their loss
    increase (`LOSS_COLOURS`, low to high), infeasible ones grey; the Pareto front
    (`pareto_front`: time, memory and loss) joined by a line and ringed in `PARETO_COLOUR`. A dashed
    vertical line marks ``memory_bytes`` (the memory budget) when given; each ``measured`` plan
    with measured totals is an orange square joined to its predicted point.

    Host-only: one PIL marker per trial plus the axes and legend, drawn once per call.
    """
    from PIL import Image, ImageDraw

    width, height = size
    font = bitmap_font()
    char_w = font.getbbox("M")[2]
    feasible = [p for p in points if p.feasible]
    front = pareto_front(points)
    on_front = {p.number for p in front}
    extra = _measured_points(measured)

    xs = [p.bytes for p in points] + [b for _, pred, meas in extra for b in ([meas[0]] + ([pred[0]] if pred else []))]
    ys = [p.seconds for p in points] + [s for _, pred, meas in extra for s in ([meas[1]] + ([pred[1]] if pred else []))]
    if memory_bytes is not None and math.isfinite(memory_bytes) and xs:
        xs.append(memory_bytes)
    x_range, y_range = (_padded(xs), _padded(ys)) if xs else ((0.0, 1.0), (0.0, 1.0))
    plot = (_PAD + 11 * char_w, _PAD + 4 * _LINE, width - 2 * _PAD - 4 * char_w, height - _PAD - 2 * _LINE - 4)
    left, top, right, bottom = plot
    if right - left < 50 or bottom - top < 50:
        raise MonitoringError(f"a Pareto image of {width}x{height} px leaves no room to plot; use at least 240x200")

    img = Image.new("P", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    figure = ParetoFigure(img, tuple(points), tuple(p.number for p in front), plot, x_range, y_range)

    draw.text((_PAD, _PAD), to_latin1(f"{title}: {len(points)} trials, {len(feasible)} feasible, {len(front)} on the front"), fill=_INK, font=font)
    # The legend: the loss ramp, then grey, red and (when drawn) orange.
    x, y = _PAD, _PAD + _LINE
    if feasible:
        lo, hi = min(p.loss_increase for p in feasible), max(p.loss_increase for p in feasible)
        for colour in LOSS_COLOURS:
            draw.rectangle([x, y + 1, x + 6, y + 9], fill=colour)
            x += 7
        label = f" feasible: loss increase {lo:.3g} .. {hi:.3g}"
        draw.text((x, y), to_latin1(label), fill=_INK, font=font)
        x += char_w * len(label) + 3 * _PAD
    else:
        lo = hi = 0.0
    for colour, label in ((INFEASIBLE_COLOUR, "infeasible"), (PARETO_COLOUR, "Pareto front"), *([(MEASURED_COLOUR, "measured")] if extra else [])):
        if x + 12 + char_w * len(label) > width:
            x, y = _PAD, y + _LINE
        draw.rectangle([x, y + 1, x + 8, y + 9], fill=colour)
        draw.text((x + 12, y), label, fill=_INK, font=font)
        x += 12 + char_w * len(label) + 3 * _PAD

    # Axes: five evenly spaced ticks with grid lines, labelled in the figures' own units.
    for i in range(5):
        fx = x_range[0] + (x_range[1] - x_range[0]) * (i + 0.5) / 5
        fy = y_range[0] + (y_range[1] - y_range[0]) * (i + 0.5) / 5
        px, _ = figure.xy(fx, y_range[0])
        _, py = figure.xy(x_range[0], fy)
        draw.line([px, top, px, bottom], fill=_GRID)
        draw.line([left, py, right, py], fill=_GRID)
        xlabel, ylabel = to_latin1(format_bytes(fx)), to_latin1(format_seconds(fy))
        draw.text((px - char_w * len(xlabel) // 2, bottom + 3), xlabel, fill=_INK, font=font)
        draw.text((left - 3 - char_w * len(ylabel), py - 6), ylabel, fill=_INK, font=font)
    draw.rectangle([left, top, right, bottom], outline=_AXIS)
    xaxis = "memory per step (bytes)"
    draw.text(((left + right - char_w * len(xaxis)) // 2, height - _PAD - _LINE + 2), xaxis, fill=_INK, font=font)
    draw.text((_PAD, top - _LINE), "step time (s)", fill=_INK, font=font)
    if not points:
        message = "no complete trials yet"
        draw.text(((left + right - char_w * len(message)) // 2, (top + bottom) // 2), message, fill=_INK, font=font)

    if memory_bytes is not None and math.isfinite(memory_bytes) and points:
        bx, _ = figure.xy(memory_bytes, y_range[0])
        for y0 in range(top + 1, bottom, 8):
            draw.line([bx, y0, bx, min(y0 + 4, bottom - 1)], fill=PARETO_COLOUR)
        draw.text((bx + 3, top + 2), "memory budget", fill=PARETO_COLOUR, font=font)

    r = _RADIUS
    for p in points:  # infeasible first, so the feasible dots lie on top
        if not p.feasible:
            cx, cy = figure.xy(p.bytes, p.seconds)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=INFEASIBLE_COLOUR)
    for p in feasible:
        if p.number not in on_front:
            cx, cy = figure.xy(p.bytes, p.seconds)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=_loss_colour(p.loss_increase, lo, hi))
    if len(front) > 1:
        draw.line([figure.xy(p.bytes, p.seconds) for p in front], fill=PARETO_COLOUR, width=2)
    for p in front:  # every ring first, so no ring covers a neighbour's dot
        cx, cy = figure.xy(p.bytes, p.seconds)
        draw.ellipse([cx - r - 3, cy - r - 3, cx + r + 3, cy + r + 3], fill=PARETO_COLOUR)
    for p in front:
        cx, cy = figure.xy(p.bytes, p.seconds)
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=_loss_colour(p.loss_increase, lo, hi))
    if front:
        best = min(front, key=lambda p: p.seconds)
        cx, cy = figure.xy(best.bytes, best.seconds)
        label = f"best #{best.number}"
        draw.text((min(cx + 8, right - char_w * len(label) - 2), max(cy - 14, top + 1)), label, fill=PARETO_COLOUR, font=font)

    for name, pred, meas in extra:
        mx, my = figure.xy(*meas)
        if pred is not None:
            draw.line([figure.xy(*pred), (mx, my)], fill=MEASURED_COLOUR, width=1)
        draw.rectangle([mx - 4, my - 4, mx + 4, my + 4], fill=MEASURED_COLOUR)
        draw.text((min(mx + 7, right - char_w * min(len(name), 16) - 2), my + 3), to_latin1(name[:16]), fill=_INK, font=font)
    return figure


# -- event files ---------------------------------------------------------------------------------


def _open(logdir: Path, run: str, replace: bool):
    """A `SummaryWriter` on ``logdir/run``; with ``replace`` the event files already there go."""
    from torch.utils.tensorboard import SummaryWriter  # lazy: loads TensorBoard's protobufs

    path = logdir / run
    ensure_writable_dir(path, logdir)
    if replace:
        for old in path.glob(EVENT_FILE_PREFIX + "*"):
            old.unlink()
    return SummaryWriter(log_dir=str(path))


def write_search(
    study: "optuna.Study | Any",
    logdir: "str | os.PathLike",
    run: str = SEARCH_RUN,
    *,
    fp32: Optional[Mapping[str, Any]] = None,
    memory_bytes: Optional[float] = None,
    measured: Sequence[tuple[str, Plan]] = (),
    replace: bool = True,
) -> Path:
    """Write a search's measured study (one trial per plan run for real) as the run ``logdir/run``.

    Per complete trial (step = trial number): ``search/trial/seconds``, ``bytes``,
    ``loss_increase`` and ``feasible`` (1 or 0), and ``*_vs_fp32`` fractions where ``fp32`` (a
    mapping with ``bytes`` and/or ``seconds`` of the all-FP32 plan) has them; from the first
    feasible trial on, ``search/best_feasible_seconds``. Per trial the learning sampler proposed
    (complete or pruned), in the same event: the `refine_scalars` (predicted, corrected and
    measured step seconds, the correction's factors then). At the last trial's step: the Pareto image
    ``search/pareto`` (`render_pareto`, with ``memory_bytes`` as the budget line and the
    ``measured`` plans' measured totals) and the text ``search/summary``.

    ``replace`` (default) removes the run's earlier event files, so writing a study again (say
    from an Optuna callback as it runs) shows it once. Returns the run's folder. Raises
    `MonitoringError` for an unwritable ``logdir`` or a study whose trials lack those figures.
    Host-only work, no device, linear in the trials and redone for all of them each call (so from
    a callback, write every few dozen trials rather than after each).
    """
    reference = _fp32_reference(fp32)
    points = search_points(study)
    logdir = Path(logdir)
    run = "/".join(run_name(part) for part in str(run).split("/"))
    best_seconds = dict(best_so_far(points))
    events: dict[int, dict[str, float]] = {p.number: refine_scalars(p) for p in refine_points(study)}
    writer = _open(logdir, run, replace)
    try:
        for p in points:
            values = {"seconds": p.seconds, "bytes": p.bytes, "loss_increase": p.loss_increase, "feasible": float(p.feasible)}
            values.update({f"{key}_vs_fp32": getattr(p, key) / reference[key] for key in ("bytes", "seconds") if key in reference})
            scalars = {f"search/trial/{key}": value for key, value in values.items()}
            best = best_seconds.get(p.number)
            if best is not None:
                scalars["search/best_feasible_seconds"] = best
                if "seconds" in reference:
                    scalars["search/best_feasible_seconds_vs_fp32"] = best / reference["seconds"]
            events[p.number] = {**scalars, **events.get(p.number, {})}
        for number in sorted(events):
            add_scalars(writer, events[number], number)
        step = points[-1].number if points else 0
        name = getattr(getattr(study, "study", study), "study_name", run)
        add_png(writer, "search/pareto", render_pareto(points, title=name, memory_bytes=memory_bytes, measured=measured), step)
        add_text(writer, "search/summary", search_summary_markdown(points, fp32), step)
        writer.flush()
    finally:
        writer.close()
    logger.info("wrote %d trials to %s", len(points), logdir / run)
    return logdir / run


def budget_scalars(plan: Plan) -> dict[str, float]:
    """Whether the plan's figures meet its budgets, as 1.0 / 0.0 per source and budget:
    ``plan/{predicted,measured}_within_{bytes,loss_increase}`` for each budget that has a limit
    and a figure to check, and ``plan/<source>_within_budgets`` over those (all met)."""
    scalars: dict[str, float] = {}
    checks = [(c.figure, c.bound) for c in budget_checks(plan) if c.bound is not None and c.figure is not None]
    for source, figures in plan_figures(plan).items():
        verdicts = []
        for figure, bound in checks:
            value = figures.total(figure)
            if value is not None:
                verdicts.append(value <= bound)
                scalars[f"plan/{source}_within_{figure}"] = float(verdicts[-1])
        if verdicts:
            scalars[f"plan/{source}_within_budgets"] = float(all(verdicts))
    return scalars


def write_candidates(
    plans: Sequence[tuple[str, Plan]],
    logdir: "str | os.PathLike",
    run_prefix: str = CANDIDATES_DIR,
    *,
    step: int = 0,
    replace: bool = True,
) -> dict[str, Path]:
    """Write each compared plan as the run ``<run_prefix>/<name>``: its precision map and summary,
    the `plan_scalars` and `budget_scalars` (predicted and measured bytes, seconds, loss increase,
    budgets met), and an HParams session: `plan_hparams` (format counts, budgets) and ``rank``
    (its place in ``plans``, 0 first).

    The metrics are the scalars present in any session (no experiment summary is written, as in
    `autoprec.monitoring.writer`), so every session shares the same columns and a session
    lacking a figure shows an empty cell. Returns ``{run: folder}``. Raises `MonitoringError` for
    no plans, two names giving one run, or an unwritable ``logdir``. Host-only, linear in the layers of each plan.
    """
    from torch.utils.tensorboard.summary import hparams

    plans = tuple((str(name), plan) for name, plan in plans)
    if not plans:
        raise MonitoringError("no candidate plans to write; pass [(name, plan), ...]")
    prefix = "/".join(run_name(part) for part in str(run_prefix).split("/"))
    runs: dict[str, str] = {}
    for name, _ in plans:
        run = f"{prefix}/{run_name(name)}"
        if run in runs:
            raise MonitoringError(f"candidates {runs[run]!r} and {name!r} would share the run {run!r}; give them different names")
        runs[run] = name
    logdir = Path(logdir)
    written = {}
    for rank, ((name, plan), run) in enumerate(zip(plans, runs)):
        writer = _open(logdir, run, replace)
        try:
            add_png(writer, "plan/precision_map", render_precision_map(plan, name), step)
            add_text(writer, "plan/summary", plan_summary_markdown(plan, name), step)
            add_scalars(writer, {**plan_scalars(plan), **budget_scalars(plan)}, step)
            # Session start and end only; see PlanWriter.write_plan for why not the experiment.
            _experiment, session_start, session_end = hparams({**plan_hparams(plan, name), "rank": rank}, {})
            writer.file_writer.add_summary(session_start, step)
            writer.file_writer.add_summary(session_end, step)
            writer.flush()
        finally:
            writer.close()
        written[run] = logdir / run
    logger.info("wrote %d candidate plans under %s", len(written), logdir)
    return written
