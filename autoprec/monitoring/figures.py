"""What every review figure shares: a matplotlib `Figure` on the Agg canvas, its colours, axis
scales, and text that never overlaps.

Figures are made with `matplotlib.figure.Figure` and drawn by `FigureCanvasAgg` directly: no
pyplot, no display and no backend switch, so a user's own backend (an interactive one, say) is
left as it was. matplotlib is imported here only, and this module only by the monitoring modules
that draw (``import autoprec`` never loads it).

Labels never overlap: `place_labels` tries a few offsets around each point and leaves a label out
when none is free (the text table written beside each figure lists every point), and
`declutter_ticks` hides a tick label that would touch its neighbour. Costs: an Agg draw per
written image, and one more to settle the layout where labels are placed; a draw is ~0.1 to
0.5 s on one slow CPU core, most of it rendering the texts (linear in them, not in the points).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # imported where used: loading matplotlib costs ~0.2 s
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "RGB",
    "OKABE_ITO",
    "DPI",
    "FONT",
    "mpl_colour",
    "Drawing",
    "new_figure",
    "settle",
    "to_array",
    "to_png",
    "pixel",
    "Unit",
    "bytes_unit",
    "seconds_unit",
    "use_scale",
    "Label",
    "place_labels",
    "declutter_ticks",
]

RGB = tuple[int, int, int]

# Okabe & Ito's colour-blind-safe palette (https://jfly.uni-koeln.de/color/), by their names.
OKABE_ITO: dict[str, RGB] = {
    "black": (0, 0, 0),
    "orange": (230, 159, 0),
    "sky blue": (86, 180, 233),
    "bluish green": (0, 158, 115),
    "yellow": (240, 228, 66),
    "blue": (0, 114, 178),
    "vermillion": (213, 94, 0),
    "reddish purple": (204, 121, 167),
}

DPI = 100  # figure inches x DPI = image pixels
FONT = 9  # points: ~12 px tall at DPI 100, legible when TensorBoard shows the image at its width
# Read when each artist is made; usetex and mathtext off, so a user's global LaTeX setting or a
# "$" in a plan or layer name cannot change or break a text.
_STYLE: Any = {"font.size": FONT, "axes.titlesize": FONT + 1, "figure.titlesize": FONT + 1, "legend.fontsize": FONT,
          "xtick.labelsize": FONT - 1, "ytick.labelsize": FONT - 1, "axes.labelsize": FONT,
          "text.usetex": False, "text.parse_math": False}
_GAP = 2.0  # px kept free around every label


def mpl_colour(rgb: RGB) -> tuple[float, float, float]:
    """An 8-bit RGB triple as matplotlib's 0..1 floats."""
    return (rgb[0] / 255, rgb[1] / 255, rgb[2] / 255)


@dataclasses.dataclass(frozen=True)
class Drawing:
    """A drawn review figure: ``figure`` is a matplotlib `Figure` on the Agg canvas."""

    figure: Any

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        return round(self.figure.bbox.width), round(self.figure.bbox.height)

    def to_array(self) -> np.ndarray:
        """``(height, width, 3)`` uint8 RGB (HWC)."""
        return to_array(self.figure)

    def to_png(self) -> bytes:
        return to_png(self.figure)


def new_figure(width_px: int, height_px: int, build: Callable[["Figure"], Any]) -> tuple["Figure", Any]:
    """A ``width_px`` x ``height_px`` figure on the Agg canvas with constrained layout, filled by
    ``build(figure)`` under the review's font sizes; returns ``(figure, build's result)``."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_STYLE):
        figure = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, layout="constrained", facecolor="white")
        FigureCanvasAgg(figure)
        return figure, build(figure)


def settle(figure: "Figure"):
    """Draw once so the constrained layout places the axes, then keep that layout (later labels
    must not move the axes they were placed on). Returns the renderer, for text extents. A
    figure already settled is not drawn again."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    canvas: Any = figure.canvas  # the FigureCanvasAgg `new_figure` put there
    if isinstance(figure.get_layout_engine(), ConstrainedLayoutEngine):
        with _style():
            canvas.draw()
        figure.set_layout_engine("none")
    return canvas.get_renderer()


def _style():
    import matplotlib

    return matplotlib.rc_context(_STYLE)


def to_array(figure: "Figure") -> np.ndarray:
    """The figure as ``(height, width, 3)`` uint8 RGB (HWC), as the Agg canvas draws it."""
    canvas: Any = figure.canvas
    with _style():
        canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def to_png(figure: "Figure") -> bytes:
    """The figure as a PNG file's bytes, at its own size."""
    buffer = io.BytesIO()
    with _style():
        figure.savefig(buffer, format="png", dpi=figure.dpi, facecolor=figure.get_facecolor())
    return buffer.getvalue()


def pixel(figure: "Figure", ax: "Axes", x: float, y: float) -> tuple[int, int]:
    """``(column, row)`` of the image pixel holding data point ``(x, y)`` of ``ax`` (row 0 at
    the top, as in `to_array`)."""
    dx, dy = ax.transData.transform((x, y))
    return int(math.floor(dx)), int(math.floor(figure.bbox.height - dy))


# -- units and scales ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unit:
    """Values are plotted divided by ``factor`` and labelled in ``name``: tick labels stay short
    numbers ("2", "250") with the unit in the axis label."""

    factor: float
    name: str


def bytes_unit(values: Sequence[float]) -> Unit:
    """B, KiB, MiB or GiB: the largest in which the largest value is at least 1."""
    top = max((abs(v) for v in values), default=0.0)
    unit = Unit(1.0, "B")
    for k, name in enumerate(("KiB", "MiB", "GiB"), start=1):
        if top >= 1024 ** k:
            unit = Unit(1024.0 ** k, name)
    return unit


def seconds_unit(values: Sequence[float]) -> Unit:
    """s, ms, µs or ns: the largest in which the largest value is at least 1."""
    top = max((abs(v) for v in values), default=0.0)
    for factor, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if top >= factor:
            return Unit(factor, name)
    return Unit(1e-9, "ns")


def use_scale(ax: "Axes", axis: str, values: Sequence[float]) -> str:
    """Put ``ax``'s ``axis`` ("x" or "y") on a logarithmic scale when ``values`` span more than a
    decade (symmetric-log when some are zero or negative), else leave it linear. Tick labels are
    plain numbers (``0.5``, ``20``). Returns the scale's name."""
    from matplotlib import ticker

    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    nonzero = [abs(v) for v in finite if v != 0]
    scale = "linear"
    if finite and len(positive) == len(finite) and max(positive) > 10 * min(positive):
        scale = "log"
    elif nonzero and len(positive) < len(finite) and max(nonzero) > 10 * min(nonzero):
        scale = "symlog"
    target = ax.xaxis if axis == "x" else ax.yaxis
    if scale == "log":
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        decades = math.log10(max(positive) / min(positive))
        # Ticks at 1, 2 and 5 of each decade over short spans (a vertical axis has room for more
        # of its short labels), so a cluster within one decade still reads; `declutter_ticks` hides any that meet.
        short = decades < (4 if axis == "y" else 2)
        target.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0) if short else (1.0,)))
        target.set_minor_formatter(ticker.NullFormatter())
    elif scale == "symlog":
        (ax.set_xscale if axis == "x" else ax.set_yscale)("symlog", linthresh=min(nonzero))
    if scale != "linear":
        target.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    return scale


# -- text that never overlaps --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Label:
    """A text for the point ``(x, y)`` of an axes (data coordinates), in priority order."""

    x: float
    y: float
    text: str
    colour: RGB = OKABE_ITO["black"]
    bold: bool = False


# Offsets tried in points, nearest corners first, each with the alignment keeping the text off the point.
_OFFSETS = (
    (5, 4, "left", "bottom"), (5, -4, "left", "top"), (-5, 4, "right", "bottom"), (-5, -4, "right", "top"),
    (7, 0, "left", "center"), (-7, 0, "right", "center"), (0, 8, "center", "bottom"), (0, -8, "center", "top"),
    (12, 12, "left", "bottom"), (-12, -12, "right", "top"), (12, -12, "left", "top"), (-12, 12, "right", "bottom"),
)


def _free(box, taken: Sequence, inside) -> bool:
    grown = box.padded(_GAP)
    within = inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
    return within and not any(grown.overlaps(other) for other in taken)


def place_labels(ax: "Axes", renderer, labels: Sequence[Label], taken: Optional[list] = None) -> tuple[list[Label], list[Label]]:
    """Annotate ``ax`` with ``labels`` in order, each at the first offset around its point where
    it stays inside the axes and clear of every text placed before and of the boxes in ``taken``
    (display pixels; placed labels are appended to it). A label with no free offset is left out.
    Returns ``(placed, left out)``. Call after `settle`: positions are read from the layout."""
    taken = [] if taken is None else taken
    inside = ax.get_window_extent(renderer)
    placed: list[Label] = []
    left_out: list[Label] = []
    with _style():  # the texts are made here, under the figures' settings
        _place(ax, renderer, labels, taken, inside, placed, left_out)
    return placed, left_out


def _place(ax, renderer, labels, taken, inside, placed, left_out) -> None:
    for label in labels:
        for dx, dy, ha, va in _OFFSETS:
            text = ax.annotate(
                label.text, (label.x, label.y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                color=mpl_colour(label.colour), fontsize=FONT - 1, fontweight="bold" if label.bold else "normal",
                annotation_clip=False, zorder=8,
                # A faint white ground keeps the text legible over dots (inside the kept gap).
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.75},
            )
            text.set_in_layout(False)
            box = text.get_window_extent(renderer)
            if _free(box, taken, inside):
                taken.append(box)
                placed.append(label)
                break
            text.remove()
        else:
            left_out.append(label)


def declutter_ticks(figure: "Figure", renderer) -> None:
    """Hide every tick label that would overlap the one kept before it on its axis (after `settle`)."""
    for ax in figure.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            kept: list = []
            for minor in (False, True):
                locs = axis.get_minorticklocs() if minor else axis.get_majorticklocs()
                ticks = axis.get_minor_ticks(len(locs)) if minor else axis.get_major_ticks(len(locs))
                for loc, tick in sorted(zip(locs, ticks), key=lambda pair: pair[0]):
                    label = tick.label1
                    if not (lo <= loc <= hi) or not label.get_visible() or not label.get_text():
                        continue
                    box = label.get_window_extent(renderer)
                    if any(box.padded(_GAP).overlaps(other) for other in kept):
                        label.set_visible(False)
                    else:
                        kept.append(box)
