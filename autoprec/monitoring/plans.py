"""What a plan shows a person: the precision map (a matplotlib figure), the per-layer table,
totals against FP32 and the budgets, and the layer-by-layer differences between two plans.

Pure functions of `Plan` objects (no files, no TensorBoard); `autoprec.monitoring.writer` writes
their output as event files.

Figures a plan may carry (every key optional; a missing one is shown as "–")::

    plan.predicted / plan.measured = {"bytes": int, "seconds": float, "loss_increase": float,
                                      "fp32_bytes": int, "fp32_seconds": float,
                                      "layers": {fqn: {"bytes": ..., "seconds": ..., "loss": ...}}}
    plan.budgets = {"memory": fraction_of_fp32_or_bytes, "memory_bytes": ...,
                    "accuracy": relative_loss_increase, "loss_increase": absolute}
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..formats import Format
from ..plan import CalibrationMethod, LayerPrecision, Plan, ScalingMode
from .figures import FONT, OKABE_ITO, RGB, Drawing, mpl_colour, new_figure, pixel, settle

__all__ = [
    "budget_scalars",
    "FORMAT_COLOURS",
    "Figures",
    "BudgetCheck",
    "PrecisionMap",
    "LayerDiff",
    "PlanDiff",
    "plan_figures",
    "budget_checks",
    "plan_scalars",
    "plan_hparams",
    "plan_summary_markdown",
    "plan_layers_markdown",
    "format_plan_line",
    "recomputed_layers",
    "recompute_markdown",
    "comm_markdown",
    "describe_scaling",
    "render_precision_map",
    "diff_plans",
]

MISSING = "–"

# Okabe & Ito's colour-blind-safe palette (`figures.OKABE_ITO`): the wide formats in blues and
# green, the 8-bit ones in warm colours, so "how much is 8-bit" reads at a glance.
FORMAT_COLOURS: Mapping[Format, RGB] = types.MappingProxyType({
    Format.FP32: OKABE_ITO["blue"],
    Format.BF16: OKABE_ITO["sky blue"],
    Format.FP16: OKABE_ITO["bluish green"],
    Format.FP8_E4M3: OKABE_ITO["orange"],
    Format.FP8_E5M2: OKABE_ITO["vermillion"],
    Format.INT8: OKABE_ITO["reddish purple"],
    Format.NVFP4: OKABE_ITO["yellow"],
})
_CHANGED = OKABE_ITO["black"]  # a changed row's cell in a diff map's "changed" column
_RECOMPUTED = (120, 120, 120)  # a layer inside a block the plan recomputes
RECOMPUTE_COLUMN = "recompute"
CHANGED_COLUMN = "changed"
_STRIPE, _BACKGROUND, _CHANGED_ROW = (243, 243, 243), (255, 255, 255), (255, 236, 200)

ROW_HEIGHT = 14  # px per layer while the grid fits in _GRID_PX; thinner rows (down to 1 px) past that
_GRID_PX = 1200  # the grid's height for more than _GRID_PX / ROW_HEIGHT layers
_LABEL_PX = 13  # px a layer name needs: every k-th layer is named when rows are thinner
_COLUMN_PX = 64
_NAME_CHARS = 48  # longer layer names keep their tail (the informative part) behind ".."
_COLUMN_CHARS = 16

_TOTAL_KEYS = ("bytes", "seconds", "loss_increase", "fp32_bytes", "fp32_seconds")
_SOURCES = ("predicted", "measured")


def finite_number(value: Any) -> Optional[float]:
    """A finite int/float as float; anything else (absent, bool, text, NaN) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _sign(x: float, signed: bool) -> str:
    return "-" if x < 0 else ("+" if signed and x > 0 else "")


def format_bytes(n: float, signed: bool = False) -> str:
    """``n`` bytes in B / KiB / MiB / GiB (``signed``: a ``+`` on positive values, for differences)."""
    value, unit = abs(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return _sign(n, signed) + (f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}")


def format_seconds(s: float, signed: bool = False) -> str:
    """``s`` seconds in s / ms / µs / ns, 3 significant digits (``signed`` as `format_bytes`)."""
    value = abs(s)
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if value >= scale:
            break
    return _sign(s, signed) + (f"{value / scale:.3g} {unit}" if value else "0 s")


def format_number(x: float, signed: bool = False) -> str:
    """``x`` with 3 significant digits, no unit (``signed`` as `format_bytes`)."""
    return f"{x:+.3g}" if signed and x else f"{x:.3g}"


# How each figure is written, keyed by the figure's name (per-layer "loss" is a loss increase).
_UNITS: Mapping[str, Callable[..., str]] = {
    "bytes": format_bytes, "fp32_bytes": format_bytes, "seconds": format_seconds, "fp32_seconds": format_seconds,
    "loss_increase": format_number, "loss": format_number,
}


def _show(key: str, value: Optional[float], signed: bool = False) -> str:
    return MISSING if value is None else _UNITS[key](value, signed)


# -- figures ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Figures:
    """One set of a plan's figures ("predicted" or "measured"); every value None when absent."""

    bytes: Optional[float] = None
    seconds: Optional[float] = None
    loss_increase: Optional[float] = None
    fp32_bytes: Optional[float] = None
    fp32_seconds: Optional[float] = None
    layers: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> "Figures":
        raw_layers = data.get("layers")
        layers = {}
        if isinstance(raw_layers, Mapping):
            for fqn, values in raw_layers.items():
                if isinstance(values, Mapping):
                    layers[fqn] = {k: v for k, v in ((k, finite_number(v)) for k, v in values.items()) if v is not None}
        return cls(**{key: finite_number(data.get(key)) for key in _TOTAL_KEYS}, layers=layers)

    def total(self, key: str) -> Optional[float]:
        return getattr(self, key)

    def layer(self, fqn: str, key: str) -> Optional[float]:
        return self.layers.get(fqn, {}).get(key)

    def vs_fp32(self, key: str) -> Optional[float]:
        """``bytes`` or ``seconds`` as a fraction of the all-FP32 figure, None without both."""
        value, reference = self.total(key), self.total(f"fp32_{key}")
        return value / reference if value is not None and reference else None


def plan_figures(plan: Plan) -> dict[str, Figures]:
    """``{"predicted": Figures, "measured": Figures}`` read from the plan (empty where absent)."""
    return {source: Figures.of(getattr(plan, source)) for source in _SOURCES}


@dataclasses.dataclass(frozen=True)
class BudgetCheck:
    """One budget: its limit as text, the limit as a number comparable with ``figure`` (the
    plan's total of that name) when it can be worked out, and the figures to check."""

    name: str
    limit: str
    bound: Optional[float]
    figure: Optional[str]  # "bytes" / "loss_increase", or None for a budget nothing is checked against

    def verdict(self, figures: Figures) -> str:
        value = figures.total(self.figure) if self.figure else None
        if value is None or not self.figure:
            return MISSING
        shown = _show(self.figure, value)
        if self.bound is None:
            return shown
        return f"{shown} ✓" if value <= self.bound else f"{shown} ✗ over"


def budget_checks(plan: Plan) -> list[BudgetCheck]:
    """The plan's budgets, each with its limit worked out where the plan's figures allow.

    ``memory`` is a fraction of the FP32 bytes when ``<= 1``, else bytes (`autoprec.search.Budgets`
    stores a fraction as a float in (0, 1] and bytes as an int of at least 1 KiB); ``memory_bytes`` is the absolute limit and wins when both are
    given. ``loss_increase`` is the absolute loss budget; ``accuracy`` (relative to the FP32
    loss) is shown beside it and checked only through ``loss_increase``.
    """
    budgets = dict(plan.budgets)
    figures = plan_figures(plan)
    checks = []
    memory, memory_bytes = finite_number(budgets.pop("memory", None)), finite_number(budgets.pop("memory_bytes", None))
    if memory is not None or memory_bytes is not None:
        fp32 = figures["predicted"].fp32_bytes or figures["measured"].fp32_bytes
        bound = memory_bytes
        if bound is None and memory is not None:
            bound = memory if memory > 1 else (memory * fp32 if fp32 else None)
        parts = []
        if memory is not None and memory <= 1:
            parts.append(f"{100 * memory:.3g} % of FP32")
        if bound is not None:
            parts.append(format_bytes(bound))
        checks.append(BudgetCheck("memory", " = ".join(parts), bound, "bytes"))
    accuracy, loss = finite_number(budgets.pop("accuracy", None)), finite_number(budgets.pop("loss_increase", None))
    if accuracy is not None or loss is not None:
        parts = ([f"{100 * accuracy:.3g} % of the FP32 loss"] if accuracy is not None else []) + ([format_number(loss)] if loss is not None else [])
        checks.append(BudgetCheck("loss increase", " = ".join(parts), loss, "loss_increase"))
    for key, value in sorted(budgets.items()):
        checks.append(BudgetCheck(key, str(value), None, None))
    return checks


def plan_scalars(plan: Plan) -> dict[str, float]:
    """The totals as scalars (``plan/predicted_bytes``, ``plan/measured_seconds_vs_fp32``, ...);
    only those the plan has. These are the metrics of the HParams view."""
    scalars: dict[str, float] = {}
    for source, figures in plan_figures(plan).items():
        for key in _TOTAL_KEYS:
            if (total := figures.total(key)) is not None:
                scalars[f"plan/{source}_{key}"] = total
        for key in ("bytes", "seconds"):
            if (ratio := figures.vs_fp32(key)) is not None:
                scalars[f"plan/{source}_{key}_vs_fp32"] = ratio
    return scalars


def plan_hparams(plan: Plan, name: str) -> dict[str, "float | str"]:
    """What the HParams view sorts and filters plans by: the name, the layer count per format
    (every format, zeros included, so "int8 > 0" filters), and every numeric budget."""
    counts = plan.format_counts()
    hparams: dict[str, "float | str"] = {"plan": name, "layers": len(plan)}
    hparams.update({f"count/{fmt.value}": counts.get(fmt.value, 0) for fmt in Format})
    hparams.update({f"budget/{k}": v for k, v in ((k, finite_number(v)) for k, v in plan.budgets.items()) if v is not None})
    source = plan.metadata.get("source")
    if isinstance(source, str):
        hparams["source"] = source
    return hparams


# -- text --------------------------------------------------------------------------------------


def describe_scaling(lp: LayerPrecision) -> str:
    """How a layer's tensors are scaled, in a few words; "–" for formats that need no scale.

    Float formats that need a scale (FP8) use the scaling mode; integer ones (INT8) a calibrated
    activation range (see `autoprec.plan.Scaling` and `Calibration`).
    """
    if not lp.format.needs_scale:
        return MISSING
    s, c = lp.scaling, lp.calibration
    if lp.format.is_float:
        parts = [f"per {s.granularity.value}", s.mode.value + (f" (history {s.history_len}, {s.reduction})" if s.mode is ScalingMode.DELAYED else "")]
    else:
        # INT8 weights always get one scale per output channel; the granularity is the activations'.
        method = f"{c.method.value} {c.percentile:g}" if c.method is CalibrationMethod.PERCENTILE else c.method.value
        parts = [f"activations per {s.granularity.value}", f"calibrated {method} over {c.batches} batches"]
    if s.margin:
        parts.append(f"margin {s.margin}")
    return ", ".join(parts)


def _format_cell(lp: LayerPrecision) -> str:
    grads = [f"grad {lp.grad_format.value}"] if lp.grad_format is not lp.format else []
    if lp.high_precision_weight_grad:
        grads.append("wgrad fp32")
    return f"{lp.format.value} ({', '.join(grads)})" if grads else lp.format.value


def _pair(key: str, figures: Mapping[str, Figures], fqn: Optional[str]) -> str:
    values = [f.layer(fqn, key) if fqn is not None else f.total(key) for f in figures.values()]
    return " / ".join(_show(key, v) for v in values)


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") or MISSING


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; row cells are escaped (``|``, ``\\``, newlines) and an empty one shows `MISSING`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _counts_text(counts: Mapping[str, int], sep: str = " · ") -> str:
    return sep.join(f"{fmt.value} {counts[fmt.value]}" for fmt in Format if counts.get(fmt.value))


def plan_layers_markdown(plan: Plan) -> str:
    """One row per layer in model order: format, scaling, bytes, time and predicted loss
    increase (sensitivity), each as predicted / measured, and the reason for the choice."""
    figures = plan_figures(plan)
    header = ["#", "layer", "format", "scaling", "bytes (pred / meas)", "time (pred / meas)", "sensitivity: loss Δ (pred / meas)", "reason"]
    rows = [
        [str(i), f"`{plan.layer_name(fqn)}`", f"`{_format_cell(lp)}`", describe_scaling(lp),
         _pair("bytes", figures, fqn), _pair("seconds", figures, fqn), _pair("loss", figures, fqn), lp.reason or MISSING]
        for i, (fqn, lp) in enumerate(plan.layers.items())
    ]
    if plan.comm:  # how each layer's gradients travel between ranks
        header.insert(4, "gradients sent")
        for row, fqn in zip(rows, plan.layers):
            row.insert(4, plan.comm[fqn].value if fqn in plan.comm else MISSING)
    return markdown_table(header, rows)


def comm_markdown(plan: Plan) -> str:
    """The plan's gradient communication (`Plan.comm`): per layer its method, the seconds per
    step FP32 and it were predicted to take on the link measured, the loss it adds, and the link;
    "" for a plan that chose none."""
    if not plan.comm:
        return ""
    figures: Mapping[str, Any] = plan.metadata["comm"] if isinstance(plan.metadata.get("comm"), Mapping) else {}
    layers: Mapping[str, Any] = figures["layers"] if isinstance(figures.get("layers"), Mapping) else {}
    rows = []
    for fqn, method in plan.comm.items():
        row = layers.get(fqn, {})
        seconds, loss = row.get("seconds", {}), row.get("loss_increase", {})
        rows.append([f"`{plan.layer_name(fqn)}`", method.value, _show("seconds", finite_number(seconds.get("fp32"))),
                     _show("seconds", finite_number(seconds.get(method.value))), format_number(loss.get(method.value, 0.0))])
    parts = [f"gradients sent: {_counts_text(dict(Counter(m.value for m in plan.comm.values())))}"]
    link: Optional[Mapping[str, Any]] = figures["link"] if isinstance(figures.get("link"), Mapping) else None
    if link is not None:
        parts[0] += (f"; link measured at {format_number(8 * link.get('bytes_per_s', 0.0) / 1e6)} Mbit/s, "
                     f"loss increase allowed {format_number(figures.get('allowed_loss_increase', float('nan')))}")
    parts.append(markdown_table(["layer", "method", "send, FP32 (pred)", "send, method (pred)", "loss Δ (pred)"], rows))
    return "\n\n".join(parts)


def plan_summary_markdown(plan: Plan, name: str) -> str:
    """Counts per format, totals against FP32, the budgets, and where the plan came from."""
    figures = plan_figures(plan)
    parts = [f"**{_md_cell(name)}**: {len(plan)} layers: {_counts_text(plan.format_counts())}"]
    rows = []
    for key, label in (("bytes", "memory"), ("seconds", "step time")):
        row = [label]
        for f in figures.values():
            ratio = f.vs_fp32(key)
            row.append(_show(key, f.total(key)) + (f" ({100 * ratio:.1f} % of FP32)" if ratio is not None else ""))
        row.append(_pair(f"fp32_{key}", figures, None))
        rows.append(row)
    rows.append(["loss increase", *(_show("loss_increase", f.loss_increase) for f in figures.values()), MISSING])
    parts.append(markdown_table(["total", "predicted", "measured", "FP32 (pred / meas)"], rows))
    checks = budget_checks(plan)
    if checks:
        parts.append(markdown_table(["budget", "limit", "predicted", "measured"], [[c.name, c.limit, *(c.verdict(f) for f in figures.values())] for c in checks]))
    else:
        parts.append("budgets: " + MISSING)
    if plan.blocks:
        parts.append(f"recomputed blocks: {len(plan.recompute)} of {len(plan.blocks)} (forward run again in the backward)")
        parts.append(recompute_markdown(plan))
    if plan.comm:
        parts.append(comm_markdown(plan))
    shown = {k: v for k, v in plan.metadata.items() if not (k == "comm" and plan.comm)}  # the comm figures: their own table
    if shown:
        parts.append(markdown_table(["metadata", "value"], [[k, str(v)] for k, v in shown.items()]))
    return "\n\n".join(parts)


def format_plan_line(plan: Plan, name: str) -> str:
    """One line for a terminal: layers per format and the predicted / measured totals present."""
    text = f"{name}: {len(plan)} layers ({_counts_text(plan.format_counts(), ', ')})"
    if plan.recompute:
        text += f", {len(plan.recompute)} blocks recomputed"
    sent = Counter(m.value for m in plan.comm.values() if m.value != "fp32")
    if sent:
        text += f", gradients sent in {_counts_text(dict(sent), ', ')}"
    for source, f in plan_figures(plan).items():
        shown = []
        for key in ("bytes", "seconds"):
            if f.total(key) is not None:
                ratio = f.vs_fp32(key)
                shown.append(_show(key, f.total(key)) + (f" ({100 * ratio:.0f} % of FP32)" if ratio is not None else ""))
        if f.loss_increase is not None:
            shown.append(f"loss Δ {format_number(f.loss_increase)}")
        if shown:
            text += f"; {source} " + ", ".join(shown)
    return text


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain columns two spaces apart; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in [header, *rows]
    ).rstrip()


# -- the precision map -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecisionMap(Drawing):
    """A drawn map: the ``figure``'s ``axes`` hold one row per layer in model order (``layers``)
    and one column per label in ``columns``; ``named`` are the layers whose names are written at
    the left (every one while rows are tall enough, else every k-th)."""

    axes: Any
    layers: tuple[str, ...]
    columns: tuple[str, ...]
    named: tuple[str, ...]

    def cell_center(self, layer: str, column: str) -> tuple[int, int]:
        """``(x, y)`` pixel at the centre of a layer's cell in a column (the first call draws
        the figure once, to lay it out)."""
        settle(self.figure)
        return pixel(self.figure, self.axes, self.columns.index(column), self.layers.index(layer))


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else ".." + text[-(chars - 2):]


def _render_grid(
    title: str,
    layers: Sequence[str],
    columns: Sequence[str],
    cells: Sequence[Sequence[Optional[RGB]]],
    legend: Sequence[tuple[RGB, str]],
    marked: Optional[Sequence[bool]] = None,
) -> PrecisionMap:
    """Layers (rows) x ``columns``, each cell filled in its colour or left blank (striped rows;
    ``marked`` rows tinted), the legend above. One image of the cells (``imshow``), so the cost
    does not grow with artists per layer; the names are tick labels, every k-th when rows are
    thinner than a line of text (the per-layer table beside the map names them all). Nothing is
    drawn here: the figure is laid out by its first draw (the one that writes it)."""
    from matplotlib.patches import Patch

    n, c = len(layers), len(columns)
    row_px = ROW_HEIGHT if n * ROW_HEIGHT <= _GRID_PX else max(_GRID_PX / n, 1.0)
    stride = max(1, math.ceil(_LABEL_PX / row_px))
    named = list(range(0, n, stride))
    names = [f"{i}  {_clip(layers[i], _NAME_CHARS)}" for i in named]
    # Wide enough for the names, the column labels (~6 px a character at FONT - 1) and the title:
    # nothing is cut at the edge and no two labels meet, so the map needs no draw to check it.
    column_px = max([_COLUMN_PX] + [6 * len(_clip(col, _COLUMN_CHARS)) + 16 for col in columns])
    width = max(480, 6 * max((len(t) for t in names), default=8) + 24 + column_px * c + 24, 7 * len(title) + 40)
    legend_cols = max(1, (width - 20) // 140)
    legend_rows = math.ceil(len(legend) / legend_cols)
    height = round(34 + 20 * legend_rows + 22 + row_px * max(n, 1) + (28 if stride > 1 else 8))

    image = np.empty((max(n, 1), c, 3), dtype=np.uint8)
    for i in range(max(n, 1)):
        # Stripes guide the eye along rows tall enough to read; on thinner rows they would be noise.
        striped = i % 2 and row_px >= 6
        image[i] = _CHANGED_ROW if marked is not None and i < n and marked[i] else (_STRIPE if striped else _BACKGROUND)
        for j, cell in enumerate(cells[i] if i < n else ()):
            if cell is not None:
                image[i, j] = cell

    def build(figure):
        ax = figure.add_subplot()
        ax.imshow(image, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(c), [_clip(col, _COLUMN_CHARS) for col in columns])
        ax.xaxis.tick_top()
        ax.set_yticks(named, names)
        ax.tick_params(length=0)
        for j in range(1, c):
            ax.axvline(j - 0.5, color="white", linewidth=2)
        for spine in ax.spines.values():  # the cells are the frame; a spine would half-cover the edge rows
            spine.set_visible(False)
        if stride > 1:  # under the whole figure: the grid alone may be narrower than the note
            figure.supxlabel(f"every {stride}th of {n} layers named (all in the layers table)", fontsize=FONT - 1)
        # The title heads the legend: one block above the grid, which constrained layout keeps clear.
        handles = [Patch(facecolor=mpl_colour(colour), edgecolor="none", label=label) for colour, label in legend]
        figure.legend(handles=handles, title=title, loc="outside upper center", ncols=legend_cols, frameon=False, handlelength=1.2)
        return ax

    figure, ax = new_figure(width, height, build)
    return PrecisionMap(figure, ax, tuple(layers), tuple(columns), tuple(layers[i] for i in named))


def render_precision_map(plan: Plan, name: str = "plan") -> PrecisionMap:
    """Layers in model order (rows) × formats (columns), the chosen format's cell filled in its
    colour (`FORMAT_COLOURS`), layer names at the left, a legend with the count per format.

    Host-only, one matplotlib figure: `ROW_HEIGHT` px per layer up to ~85 layers, then a grid
    1200 px tall with every k-th layer named; ~500 px wide (more for long layer names). Drawing
    it (when written) costs ~0.1 s for a few layers to ~0.5 s from ~90 layers on, most of it the
    names' text (one slow shared core).
    """
    formats = list(Format)
    counts = plan.format_counts()
    cells = [[FORMAT_COLOURS[f] if f is lp.format else None for f in formats] for lp in plan.layers.values()]
    legend = [(FORMAT_COLOURS[f], f"{f.value} {counts.get(f.value, 0)}") for f in formats]
    columns = [f.value for f in formats]
    title = f"{name}: {len(plan)} layers"
    if plan.recompute:
        # One more column: the layers whose block runs recomputed (its forward again in the backward).
        inside = recomputed_layers(plan)
        for row, fqn in zip(cells, plan.layers):
            row.append(_RECOMPUTED if fqn in inside else None)
        columns.append(RECOMPUTE_COLUMN)
        legend.append((_RECOMPUTED, f"recomputed: {len(plan.recompute)} of {len(plan.blocks)} blocks"))
        title += f", {len(plan.recompute)} blocks recomputed"
    return _render_grid(title, [plan.layer_name(fqn) for fqn in plan.layers], columns, cells, legend)


def recomputed_layers(plan: Plan) -> dict[str, str]:
    """``layer fqn -> the recomputed block holding it`` for the plan's recomputed blocks."""
    out = {}
    for block in plan.recompute:
        for fqn in plan.layers:
            if block == "" or fqn.startswith(block + "."):
                out[fqn] = block
    return out


def recompute_markdown(plan: Plan) -> str:
    """The plan's blocks and whether each runs recomputed, with the search's reason for each when
    it has them (``metadata["recompute_reasons"]``); "" for a plan without blocks."""
    if not plan.blocks:
        return ""
    inside = recomputed_layers(plan)
    rows = [[f"`{fqn}`", "yes" if on else "no", str(sum(1 for b in inside.values() if b == fqn)) if on else MISSING] for fqn, on in plan.blocks.items()]
    reasons = plan.metadata.get("recompute_reasons")
    if isinstance(reasons, dict) and reasons:  # a searched plan: why each block is recomputed or kept
        return markdown_table(["block", "recomputed", "layers recomputed", "why"], [row + [str(reasons.get(fqn, MISSING))] for row, fqn in zip(rows, plan.blocks)])
    return markdown_table(["block", "recomputed", "layers recomputed"], rows)


# -- differences -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerDiff:
    """One layer that differs between two plans.

    ``before`` / ``after`` are its formats (None where a plan lacks the layer); ``changes`` names
    every other setting that differs (``"scaling.mode: delayed → current"``); the deltas are the
    later plan's predicted per-layer figures minus the earlier one's, None unless both have them;
    ``reason`` is why the later plan chose what it chose.
    """

    layer: str
    before: Optional[Format]
    after: Optional[Format]
    changes: tuple[str, ...] = ()
    reason: str = ""
    bytes_delta: Optional[float] = None
    seconds_delta: Optional[float] = None
    loss_delta: Optional[float] = None

    @property
    def format_changed(self) -> bool:
        return self.before is not self.after


def _settings(lp: LayerPrecision) -> dict[str, Any]:
    """Everything but format and reason, flattened (``scaling.mode``); the gradient format only
    where it is not the one its format implies, so bf16 → fp8_e4m3 is one change, not two."""
    flat = {}
    for key, value in lp.to_dict().items():
        if isinstance(value, Mapping):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif key == "grad_format" and lp.grad_format is not LayerPrecision(lp.format, scaling=lp.scaling).grad_format:
            flat[key] = value
        elif key == "weight_grad_format":  # written only where set
            flat[key] = value
    return flat


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """The layers that differ from plan ``a`` to plan ``b``, in model order (a's, then layers
    only ``b`` has). Iterating yields the `LayerDiff` rows; ``len`` counts them."""

    name_a: str
    a: Plan
    name_b: str
    b: Plan
    layers: tuple[LayerDiff, ...]

    def __iter__(self) -> Iterator[LayerDiff]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def order(self) -> list[str]:
        """Every layer of either plan, in model order."""
        return list(self.a.layers) + [fqn for fqn in self.b.layers if fqn not in self.a.layers]

    def summary(self) -> str:
        """One line: how many layers differ, and the counts per format before → after."""
        if not self.layers:
            return f"{self.name_a} → {self.name_b}: identical ({len(self.order)} layers)"
        counts = f"{_counts_text(self.a.format_counts(), ', ')} → {_counts_text(self.b.format_counts(), ', ')}"
        return f"{self.name_a} → {self.name_b}: {len(self.layers)} of {len(self.order)} layers differ ({counts})"

    def _name(self, fqn: str) -> str:
        return (self.b if fqn in self.b.layers else self.a).layer_name(fqn)

    def _rows(self) -> list[list[str]]:
        return [
            [self._name(d.layer), d.before.value if d.before else "(absent)", d.after.value if d.after else "(absent)",
             "; ".join(d.changes) or MISSING, _show("bytes", d.bytes_delta, True), _show("seconds", d.seconds_delta, True),
             _show("loss", d.loss_delta, True), d.reason or MISSING]
            for d in self.layers
        ]

    def _header(self) -> list[str]:
        return ["layer", self.name_a, self.name_b, "other changes", "Δ bytes (pred)", "Δ time (pred)", "Δ loss (pred)", f"reason ({self.name_b})"]

    def format_table(self) -> str:
        """The summary line and, when layers differ, an aligned plain-text table of them."""
        if not self.layers:
            return self.summary()
        return self.summary() + "\n" + _aligned(self._header(), self._rows())

    def markdown(self) -> str:
        if not self.layers:
            return _md_cell(self.summary())
        rows = [[f"`{r[0]}`", f"`{r[1]}`", f"`{r[2]}`", *r[3:]] for r in self._rows()]
        return _md_cell(self.summary()) + "\n\n" + markdown_table(self._header(), rows)

    def render(self) -> PrecisionMap:
        """Every layer (rows) × the two plans (columns), each cell in its format's colour; rows
        that differ are tinted and filled in a third column, ``changed``."""
        changed = {d.layer for d in self.layers}
        order = self.order
        cells = [[*(FORMAT_COLOURS[p.layers[fqn].format] if fqn in p.layers else None for p in (self.a, self.b)), _CHANGED if fqn in changed else None] for fqn in order]
        legend = [(FORMAT_COLOURS[f], f.value) for f in Format] + [(_CHANGED, f"changed {len(changed)}")]
        title = f"{self.name_a} → {self.name_b}: {len(changed)} of {len(order)} layers differ"
        return _render_grid(title, [self._name(fqn) for fqn in order], [self.name_a, self.name_b, CHANGED_COLUMN], cells, legend, [fqn in changed for fqn in order])


def diff_plans(a: Plan, b: Plan, names: tuple[str, str] = ("a", "b")) -> PlanDiff:
    """The layers whose precision differs from ``a`` to ``b``: format, gradient format, scaling or
    calibration (the reason alone is not a difference), and layers only one plan has."""
    fa, fb = Figures.of(a.predicted), Figures.of(b.predicted)
    diffs = []
    for fqn in list(a.layers) + [fqn for fqn in b.layers if fqn not in a.layers]:
        la, lb = a.layers.get(fqn), b.layers.get(fqn)
        if la is not None and lb is not None:
            sa, sb = _settings(la), _settings(lb)
            changes = tuple(
                f"{k}: {sa.get(k, 'default')} → {sb.get(k, 'default')}"
                for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)
            )
            if la.format is lb.format and not changes:
                continue
        else:
            changes = ()

        def delta(key: str) -> Optional[float]:
            va, vb = fa.layer(fqn, key), fb.layer(fqn, key)
            return vb - va if va is not None and vb is not None else None

        either = lb or la  # the fqn comes from one of the plans
        diffs.append(LayerDiff(
            fqn, la.format if la else None, lb.format if lb else None, changes,
            either.reason if either is not None else "", delta("bytes"), delta("seconds"), delta("loss"),
        ))
    return PlanDiff(names[0], a, names[1], b, tuple(diffs))


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
