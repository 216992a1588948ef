"""A precision search for a person, in TensorBoard: the plans measured for real, their Pareto front
(step time, memory, loss increase), and each candidate plan.

Layout (one TensorBoard run per folder)::

    LOGDIR/search/                  scalars search/trial/{seconds,bytes,loss_increase,feasible}
                                            (step = trial number; ``*_vs_fp32`` with ``fp32=``)
                                    scalar  search/best_feasible_seconds   best feasible so far
                                    scalars refine/{predicted,corrected,measured}_seconds, ...
                                            per trial of the learning sampler (`refine_points`)
                                    image   search/pareto    step time (y) against memory and against
                                                             loss increase, all trials, the (time,
                                                             memory, loss) front ringed, the budgets
                                                             dashed, the returned plan starred
                                    image   search/progress  step time by trial, best feasible so far
                                    text    search/summary   counts, best trial, the front's table
    LOGDIR/candidates/<name>/       image   plan/precision_map, text plan/summary
                                    scalars plan/predicted_bytes, plan/measured_seconds, ...,
                                            plan/{predicted,measured}_within_{bytes,loss_increase,budgets}
                                    hparams session: counts per format, budgets, rank

The candidates' metric tags are `plan_scalars`' (the ones ``autoprec review`` writes), so their
HParams columns line up with reviewed plans in the same logdir. The trials are read from the
search job's measured study (`autoprec.search.candidate_runs.MeasuredStage`: one trial per plan run
for real, user attributes ``bytes``, ``seconds``, ``loss_increase`` and ``name``); a trial is
feasible when its constraints ``memory`` and ``loss`` are all <= 0. The Pareto front is Optuna's
multi-objective view of those trials (`pareto_front`).
Writing is host-only work (no device): one TensorBoard event per trial and two matplotlib figures.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import MonitoringError
from ..plan import Plan
from .figures import (
    OKABE_ITO,
    RGB,
    Drawing,
    Label,
    Unit,
    bytes_unit,
    declutter_ticks,
    mpl_colour,
    new_figure,
    pixel,
    place_labels,
    seconds_unit,
    settle,
    use_scale,
)
from .plans import (
    MISSING,
    budget_scalars,
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
)
from .writer import EVENT_FILE_PREFIX, add_figure, add_scalars, add_text, ensure_writable_dir, run_name

if TYPE_CHECKING:  # optuna is imported lazily: `autoprec.monitoring` loads without it
    import optuna

__all__ = [
    "SEARCH_RUN",
    "CANDIDATES_DIR",
    "PARETO_COLOUR",
    "FEASIBLE_COLOUR",
    "INFEASIBLE_COLOUR",
    "MEASURED_COLOUR",
    "CHOSEN_COLOUR",
    "BUDGET_COLOUR",
    "TrialPoint",
    "RefinePoint",
    "ParetoFigure",
    "search_points",
    "study_budgets",
    "refine_points",
    "refine_scalars",
    "pareto_front",
    "best_so_far",
    "search_summary_markdown",
    "render_pareto",
    "render_progress",
    "write_search",
    "write_candidates",
]

logger = logging.getLogger(__name__)

SEARCH_RUN = "search"
CANDIDATES_DIR = "candidates"

# Colour-blind-safe (Okabe & Ito), and each kind of point has a shape of its own as well.
FEASIBLE_COLOUR: RGB = OKABE_ITO["blue"]
INFEASIBLE_COLOUR: RGB = (175, 175, 175)
PARETO_COLOUR: RGB = OKABE_ITO["vermillion"]  # the front's rings and the best-so-far line
MEASURED_COLOUR: RGB = OKABE_ITO["orange"]
CHOSEN_COLOUR: RGB = OKABE_ITO["black"]  # the returned plan's star
BUDGET_COLOUR: RGB = OKABE_ITO["reddish purple"]  # the budgets' dashed lines


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

    from ..search.candidate_runs import REFINED_ATTR

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


def search_summary_markdown(points: Sequence[TrialPoint], fp32: Optional[Mapping[str, Any]] = None, chosen: Optional[str] = None) -> str:
    """How many trials, how many feasible, the best feasible one, the returned plan (``chosen``)
    and the Pareto front's table (with each total as a fraction of FP32 where ``fp32`` has it):
    every point the Pareto figure may leave unlabelled."""
    reference = _fp32_reference(fp32)

    def shown(key: str, value: float) -> str:
        text = format_bytes(value) if key == "bytes" else format_seconds(value)
        return text + (f" ({100 * value / reference[key]:.1f} % of FP32)" if key in reference else "")

    feasible = [p for p in points if p.feasible]
    parts = [f"**search**: {len(points)} complete trials, {len(feasible)} feasible"]
    if chosen is not None:
        parts.append(f"returned plan: `{chosen}`")
    if feasible:
        best = min(feasible, key=lambda p: (p.seconds, p.number))
        parts.append(
            f"best feasible: trial {best.number}: {best.name + ', ' if best.name else ''}step time {shown('seconds', best.seconds)}, "
            f"memory {shown('bytes', best.bytes)}, loss increase {format_number(best.loss_increase)}"
        )
        header = ["trial", "plan", "memory", "step time", "loss increase"] + (["returned"] if chosen is not None else [])
        rows = [[str(p.number), p.name or MISSING, shown("bytes", p.bytes), shown("seconds", p.seconds), format_number(p.loss_increase)]
                + (["yes" if p.name == chosen else MISSING] if chosen is not None else []) for p in pareto_front(points)]
        parts.append("Pareto front (step time, memory, loss increase):\n\n" + markdown_table(header, rows))
    else:
        parts.append("best feasible: " + MISSING + " (no trial met both budgets)")
    return "\n\n".join(parts)


# -- the figures -------------------------------------------------------------------------------


def study_budgets(study: "optuna.Study | Any") -> dict[str, float]:
    """The budgets a measured study's trials were held to, read back from their constraints
    (``memory`` = bytes - budget, ``loss`` = loss increase - budget): ``{"memory_bytes": ...,
    "loss_increase": ...}`` for each that every constrained trial agrees on (an unlimited
    budget, stored as -1, agrees on none)."""
    from optuna.trial import TrialState

    found: dict[str, list[float]] = {"memory_bytes": [], "loss_increase": []}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        for name, attr, key in (("memory", "bytes", "memory_bytes"), ("loss", "loss_increase", "loss_increase")):
            value, constraint = finite_number(trial.user_attrs.get(attr)), finite_number(trial.constraints.get(name))
            if value is not None and constraint is not None:
                found[key].append(value - constraint)
    return {key: float(np.median(v)) for key, v in found.items() if v and max(v) - min(v) <= 1e-9 * max(1.0, abs(max(v)))}


@dataclasses.dataclass(frozen=True)
class ParetoFigure(Drawing):
    """A drawn search: ``axes`` memory (x) against step time (y), ``loss_axes`` loss increase
    against the same step time; values are plotted in ``x_unit`` / ``y_unit``. ``labels`` are
    the texts written at points, ``left_out`` those that found no free place."""

    axes: Any
    loss_axes: Any
    points: tuple[TrialPoint, ...]
    front: tuple[int, ...]  # trial numbers on the front, by ascending memory
    chosen: Optional[int]  # the returned plan's trial number, when it is a trial
    x_unit: Unit
    y_unit: Unit
    labels: tuple[str, ...]
    left_out: tuple[str, ...]

    def xy(self, bytes_: float, seconds: float) -> tuple[int, int]:
        """The pixel of a (memory, step time) point in the memory panel."""
        return pixel(self.figure, self.axes, bytes_ / self.x_unit.factor, seconds / self.y_unit.factor)

    def point_xy(self, number: int) -> tuple[int, int]:
        """The pixel at the centre of trial ``number``'s dot in the memory panel."""
        point = next(p for p in self.points if p.number == number)
        return self.xy(point.bytes, point.seconds)


@dataclasses.dataclass(frozen=True)
class _Measured:
    name: str
    predicted: Optional[tuple[float, float, Optional[float]]]  # bytes, seconds, loss increase
    measured: tuple[float, float, Optional[float]]


def _measured_points(measured: Sequence[tuple[str, Plan]]) -> list[_Measured]:
    """Each plan whose measured totals have bytes and seconds, with its predicted totals where
    the plan has both."""
    out = []
    for name, plan in measured:
        figures = plan_figures(plan)
        m, p = figures["measured"], figures["predicted"]
        if m.bytes is None or m.seconds is None:
            logger.debug("plan %r has no measured bytes and seconds; not drawn", name)
            continue
        predicted = (p.bytes, p.seconds, p.loss_increase) if p.bytes is not None and p.seconds is not None else None
        out.append(_Measured(str(name), predicted, (m.bytes, m.seconds, m.loss_increase)))
    return out


def _marker_box(ax, x: float, y: float, px: float = 6.0):
    """The display box a marker of about ``px`` radius covers, which labels keep clear of."""
    from matplotlib.transforms import Bbox

    cx, cy = ax.transData.transform((x, y))
    return Bbox.from_extents(cx - px, cy - px, cx + px, cy + px)


def _point_label(p: TrialPoint) -> str:
    return _clip_name(p.name) if p.name else f"#{p.number}"


def _clip_name(name: str) -> str:
    return name if len(name) <= 18 else name[:16] + ".."


def render_pareto(
    points: Sequence[TrialPoint],
    *,
    title: str = "search",
    memory_bytes: Optional[float] = None,
    loss_increase: Optional[float] = None,
    chosen: Optional[str] = None,
    measured: Sequence[tuple[str, Plan]] = (),
    size: tuple[int, int] = (880, 480),
) -> ParetoFigure:
    """Every complete trial in two panels sharing the step-time axis: memory (left) and loss
    increase (right). Feasible trials are blue dots, infeasible ones grey; the Pareto front
    (`pareto_front`: time, memory and loss) is ringed in `PARETO_COLOUR` and named; the budgets
    (``memory_bytes``, ``loss_increase``) are dashed lines; the returned plan (``chosen``, a
    trial's or a ``measured`` plan's name) is a black star; each ``measured`` plan with measured
    totals is an orange square joined to its predicted point. An axis spanning more than a decade
    is logarithmic. Labels that find no free place are left out (`search_summary_markdown`'s
    table lists the whole front).

    Host-only: one scatter per kind of point, so the drawing grows with the trials only in the
    points it plots; a label costs a text extent per place tried.
    """
    width, height = size
    if width < 400 or height < 300:
        raise MonitoringError(f"a Pareto figure of {width}x{height} px leaves no room to plot; use at least 400x300")
    feasible = [p for p in points if p.feasible]
    front = pareto_front(points)
    on_front = {p.number for p in front}
    extra = _measured_points(measured)
    chosen_point = next((p for p in points if chosen is not None and p.name == chosen), None)
    chosen_measured = next((m for m in extra if chosen is not None and m.name == chosen), None) if chosen_point is None else None
    memory_budget = memory_bytes if memory_bytes is not None and math.isfinite(memory_bytes) else None
    loss_budget = loss_increase if loss_increase is not None and math.isfinite(loss_increase) else None

    xs = [p.bytes for p in points] + [v for m in extra for v in (m.measured[0], *(m.predicted[:1] if m.predicted else ()))]
    ys = [p.seconds for p in points] + [v for m in extra for v in (m.measured[1], *(m.predicted[1:2] if m.predicted else ()))]
    losses = [p.loss_increase for p in points] + [v for m in extra for v in (m.measured[2], m.predicted[2] if m.predicted else None) if v is not None]
    x_unit, y_unit = bytes_unit(xs + ([memory_budget] if memory_budget is not None else [])), seconds_unit(ys)

    def build(figure):
        ax = figure.add_subplot(1, 2, 1)
        loss_ax = figure.add_subplot(1, 2, 2, sharey=ax)
        use_scale(ax, "x", [v / x_unit.factor for v in xs + ([memory_budget] if memory_budget is not None else [])])
        use_scale(ax, "y", [v / y_unit.factor for v in ys])
        use_scale(loss_ax, "x", losses + ([loss_budget] if loss_budget is not None else []))
        ax.set_xlabel(f"memory per step ({x_unit.name})")
        ax.set_ylabel(f"step time ({y_unit.name})")
        loss_ax.set_xlabel("loss increase")
        loss_ax.tick_params(labelleft=False)
        for a in (ax, loss_ax):
            a.grid(True, color="#e4e4e4", linewidth=0.8)
            a.set_axisbelow(True)
        panels = ((ax, lambda p: p.bytes / x_unit.factor), (loss_ax, lambda p: p.loss_increase))
        for a, x_of in panels:
            groups = (([p for p in points if not p.feasible], INFEASIBLE_COLOUR, 14, 1), ([p for p in feasible if p.number not in on_front], FEASIBLE_COLOUR, 18, 2), (front, FEASIBLE_COLOUR, 22, 3))
            for group, colour, area, z in groups:
                if group:
                    a.scatter([x_of(p) for p in group], [p.seconds / y_unit.factor for p in group], s=area, color=mpl_colour(colour), linewidths=0, zorder=z)
            if front:
                a.scatter([x_of(p) for p in front], [p.seconds / y_unit.factor for p in front], s=90, facecolors="none",
                          edgecolors=mpl_colour(PARETO_COLOUR), linewidths=1.6, zorder=4)
            if chosen_point is not None:
                a.scatter([x_of(chosen_point)], [chosen_point.seconds / y_unit.factor], s=170, marker="*", color=mpl_colour(CHOSEN_COLOUR), zorder=6)
        for m in extra:
            mx, my, ml = m.measured[0] / x_unit.factor, m.measured[1] / y_unit.factor, m.measured[2]
            for a, x, px in ((ax, mx, m.predicted[0] / x_unit.factor if m.predicted else None), (loss_ax, ml, m.predicted[2] if m.predicted else None)):
                if x is None:
                    continue
                if px is not None and m.predicted is not None:
                    a.plot([px, x], [m.predicted[1] / y_unit.factor, my], color=mpl_colour(MEASURED_COLOUR), linewidth=1, linestyle=":", zorder=4)
                a.scatter([x], [my], s=40, marker="s", color=mpl_colour(MEASURED_COLOUR), zorder=5)
                if m is chosen_measured:
                    a.scatter([x], [my], s=170, marker="*", color=mpl_colour(CHOSEN_COLOUR), zorder=6)
        for a, budget in ((ax, memory_budget / x_unit.factor if memory_budget is not None else None), (loss_ax, loss_budget)):
            if budget is not None and points:
                a.axvline(budget, color=mpl_colour(BUDGET_COLOUR), linestyle="--", linewidth=1.2, zorder=1)
        if not points:
            ax.text(0.5, 0.5, "no complete trials yet", transform=ax.transAxes, ha="center", va="center")
        figure.suptitle(f"{title}: {len(points)} trials, {len(feasible)} feasible, {len(front)} on the front")
        figure.legend(handles=_legend(bool(front), chosen_point is not None or chosen_measured is not None, bool(extra), memory_budget is not None or loss_budget is not None),
                      loc="outside lower center", ncols=6, frameon=False)
        return ax, loss_ax

    figure, (ax, loss_ax) = new_figure(width, height, build)
    renderer = settle(figure)
    declutter_ticks(figure, renderer)
    # Labels clear of the marked points (front, returned plan, measured squares) and of each other.
    taken = [_marker_box(ax, p.bytes / x_unit.factor, p.seconds / y_unit.factor) for p in front]
    taken += [_marker_box(ax, m.measured[0] / x_unit.factor, m.measured[1] / y_unit.factor) for m in extra]
    loss_taken = [_marker_box(loss_ax, p.loss_increase, p.seconds / y_unit.factor) for p in front]
    labels: list[Label] = []
    loss_labels: list[Label] = []
    if chosen_point is not None or chosen_measured is not None:
        where = (chosen_point.bytes, chosen_point.seconds) if chosen_point is not None else chosen_measured.measured[:2]  # type: ignore[union-attr]
        labels.append(Label(where[0] / x_unit.factor, where[1] / y_unit.factor, f"returned: {_clip_name(str(chosen))}", CHOSEN_COLOUR, bold=True))
    top = ax.get_ylim()[1]
    if memory_budget is not None and points:
        labels.append(Label(memory_budget / x_unit.factor, top, "memory budget", BUDGET_COLOUR))
    if loss_budget is not None and points:
        loss_labels.append(Label(loss_budget, top, "loss budget", BUDGET_COLOUR))
    labels += [Label(m.measured[0] / x_unit.factor, m.measured[1] / y_unit.factor, _clip_name(m.name), MEASURED_COLOUR) for m in extra if m is not chosen_measured]
    labels += [Label(p.bytes / x_unit.factor, p.seconds / y_unit.factor, _point_label(p), PARETO_COLOUR)
               for p in sorted(front, key=lambda p: (p.seconds, p.number)) if p is not chosen_point]
    placed, left_out = place_labels(ax, renderer, labels, taken)
    loss_placed, loss_left_out = place_labels(loss_ax, renderer, loss_labels, loss_taken)
    return ParetoFigure(
        figure, ax, loss_ax, tuple(points), tuple(p.number for p in front), chosen_point.number if chosen_point is not None else None,
        x_unit, y_unit, tuple(label.text for label in placed + loss_placed), tuple(label.text for label in left_out + loss_left_out),
    )


def _legend(front: bool, chosen: bool, measured: bool, budgets: bool) -> list:
    from matplotlib.lines import Line2D

    def dot(colour, label, marker="o", size=6, hollow=False):
        face = "none" if hollow else mpl_colour(colour)
        return Line2D([], [], linestyle="none", marker=marker, markersize=size, markerfacecolor=face, markeredgecolor=mpl_colour(colour), label=label)

    handles = [dot(FEASIBLE_COLOUR, "feasible"), dot(INFEASIBLE_COLOUR, "infeasible")]
    if front:
        handles.append(dot(PARETO_COLOUR, "Pareto front", size=9, hollow=True))
    if chosen:
        handles.append(dot(CHOSEN_COLOUR, "returned plan", marker="*", size=11))
    if measured:
        handles.append(dot(MEASURED_COLOUR, "measured plan", marker="s"))
    if budgets:
        handles.append(Line2D([], [], color=mpl_colour(BUDGET_COLOUR), linestyle="--", label="budget"))
    return handles


def render_progress(
    points: Sequence[TrialPoint],
    *,
    title: str = "search",
    fp32_seconds: Optional[float] = None,
    chosen: Optional[str] = None,
    size: tuple[int, int] = (720, 400),
) -> Drawing:
    """The search as it went: each complete trial's step time by trial number (feasible blue,
    infeasible grey), the best feasible step time so far as a vermillion step line, the all-FP32
    step time dashed, the returned plan (``chosen``) a black star. Logarithmic step time when the
    trials span more than a decade. Host-only, one scatter per kind of point."""
    best = best_so_far(points)
    feasible = [p for p in points if p.feasible]
    reference = fp32_seconds if fp32_seconds is not None and math.isfinite(fp32_seconds) and fp32_seconds > 0 else None
    unit = seconds_unit([p.seconds for p in points] + ([reference] if reference else []))
    chosen_point = next((p for p in points if chosen is not None and p.name == chosen), None)

    def build(figure):
        ax = figure.add_subplot()
        use_scale(ax, "y", [p.seconds / unit.factor for p in points] + ([reference / unit.factor] if reference else []))
        ax.grid(True, color="#e4e4e4", linewidth=0.8)
        ax.set_axisbelow(True)
        for group, colour, label in (([p for p in points if not p.feasible], INFEASIBLE_COLOUR, "infeasible"), (feasible, FEASIBLE_COLOUR, "feasible")):
            if group:
                ax.scatter([p.number for p in group], [p.seconds / unit.factor for p in group], s=16, color=mpl_colour(colour), linewidths=0, label=label, zorder=2)
        if best:
            steps = [n for n, _ in best] + ([points[-1].number] if points[-1].number > best[-1][0] else [])
            values = [v / unit.factor for _, v in best] + ([best[-1][1] / unit.factor] if len(steps) > len(best) else [])
            ax.step(steps, values, where="post", color=mpl_colour(PARETO_COLOUR), linewidth=1.6, label="best feasible so far", zorder=3)
        if reference is not None and points:
            ax.axhline(reference / unit.factor, color=mpl_colour(BUDGET_COLOUR), linestyle="--", linewidth=1.2, label="all FP32", zorder=1)
        if chosen_point is not None:
            ax.scatter([chosen_point.number], [chosen_point.seconds / unit.factor], s=170, marker="*", color=mpl_colour(CHOSEN_COLOUR), label="returned plan", zorder=4)
        if not points:
            ax.text(0.5, 0.5, "no complete trials yet", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"step time ({unit.name})")
        headline = f"best feasible {format_seconds(best[-1][1])}" if best else "no feasible trial yet"
        figure.suptitle(f"{title}: {len(points)} trials, {headline}")
        if ax.get_legend_handles_labels()[0]:
            figure.legend(loc="outside lower center", ncols=5, frameon=False)
        return ax

    figure, _ax = new_figure(*size, build)
    declutter_ticks(figure, settle(figure))
    return Drawing(figure)


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
    loss_increase: Optional[float] = None,
    chosen: Optional[str] = None,
    measured: Sequence[tuple[str, Plan]] = (),
    replace: bool = True,
) -> Path:
    """Write a search's measured study (one trial per plan run for real) as the run ``logdir/run``.

    Per complete trial (step = trial number): ``search/trial/seconds``, ``bytes``,
    ``loss_increase`` and ``feasible`` (1 or 0), and ``*_vs_fp32`` fractions where ``fp32`` (a
    mapping with ``bytes`` and/or ``seconds`` of the all-FP32 plan) has them; from the first
    feasible trial on, ``search/best_feasible_seconds``. Per trial the learning sampler proposed
    (complete or pruned), in the same event: the `refine_scalars` (predicted, corrected and
    measured step seconds, the correction's factors then). At the last trial's step: the figures
    ``search/pareto`` (`render_pareto`: the budgets ``memory_bytes`` and ``loss_increase``,
    read from the trials' constraints where not given (`study_budgets`), the returned plan
    ``chosen`` by name, the ``measured`` plans' measured totals) and ``search/progress``
    (`render_progress`), and the text ``search/summary``.

    ``replace`` (default) removes the run's earlier event files, so writing a study again (say
    from an Optuna callback as it runs) shows it once. Returns the run's folder. Raises
    `MonitoringError` for an unwritable ``logdir`` or a study whose trials lack those figures.
    Host-only work, no device, linear in the trials and redone for all of them each call (so from
    a callback, write every few dozen trials rather than after each).
    """
    reference = _fp32_reference(fp32)
    points = search_points(study)
    budgets = study_budgets(getattr(study, "study", study))
    memory_bytes = budgets.get("memory_bytes") if memory_bytes is None else memory_bytes
    loss_increase = budgets.get("loss_increase") if loss_increase is None else loss_increase
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
        pareto = render_pareto(points, title=name, memory_bytes=memory_bytes, loss_increase=loss_increase, chosen=chosen, measured=measured)
        add_figure(writer, "search/pareto", pareto, step)
        add_figure(writer, "search/progress", render_progress(points, title=name, fp32_seconds=reference.get("seconds"), chosen=chosen), step)
        add_text(writer, "search/summary", search_summary_markdown(points, fp32, chosen=chosen), step)
        writer.flush()
    finally:
        writer.close()
    logger.info("wrote %d trials to %s", len(points), logdir / run)
    return logdir / run


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
            add_figure(writer, "plan/precision_map", render_precision_map(plan, name), step)
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
