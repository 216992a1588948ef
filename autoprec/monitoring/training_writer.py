"""A training run under the precision scheduler, in TensorBoard, written off the hot path.

Layout of the run ``LOGDIR/<run>`` (``train`` by default)::

    scalars  train/loss, train/loss_scale, train/skipped (0/1), train/skipped_total, train/<name>
    scalars  overflow/<fqn>, underflow/<fqn>, nonfinite/<fqn>, ...      (per-layer counts)
    scalars  memory/predicted_bytes, memory/measured_bytes, memory/measured_vs_predicted
    histos   grad/<fqn>                                                   (at window ends)
    scalars  format/<fqn>     the layer's format as its `FORMAT_INDEX` (text format/legend)
    scalars  precision/changes, precision/promotions, precision/demotions (running counts)
    text     precision/timeline  every promotion/demotion so far: step, layer, from, to, reason
    image    train/timeline      loss scale with the skipped steps marked, and the running
                                 promotions and demotions, by step (`render_timeline`)
    image    plan/precision_map, text plan/summary, plan/layers            (`log_plan`)

What syncs: `log_step`, `log_layer_counts` and `log_memory` keep tensors (on any device) as
detached copies and never read them; every ``flush_every`` distinct steps, and at `flush` /
`close`, the buffered values move to the host in one transfer per device: one host-device sync
per ``flush_every`` steps (``flush_every=1`` is per-step detail, a sync per step).
`log_grad_histograms` syncs once per call (the histograms are computed on the device, then
moved in one transfer). `log_change`, `log_formats` and `log_plan` take host values only.
The ``train/timeline`` figure is drawn from host copies of what was written (the loss scale where
it changed, the skipped steps, the changes) at each step whose precision changes are written and
at `flush` / `close` when something new came in: ~0.2 s of matplotlib each, never per step.

Host costs, one slow CPU core: `log_step` ~10 µs plus one copy per tensor value; a batch ~50 µs
per step written (one event per step, queued for TensorBoard's writer thread).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import time
import types
from bisect import bisect_right
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

from ..coverage import layer_name
from ..errors import MonitoringError
from ..formats import Format
from ..plan import LayerPrecision, Plan
from ..changes import PrecisionChange
from .figures import OKABE_ITO, Drawing, declutter_ticks, mpl_colour, new_figure, settle
from .plans import markdown_table, plan_layers_markdown, plan_summary_markdown, render_precision_map
from .writer import add_figure, add_scalars, add_text, ensure_writable_dir, run_name

if TYPE_CHECKING:  # imported lazily where used: it loads TensorBoard's protobufs
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["FORMAT_INDEX", "PrecisionChange", "TrainingWriter", "TRAIN_RUN", "render_timeline"]

logger = logging.getLogger(__name__)

TRAIN_RUN = "train"

# The value of a ``format/<fqn>`` scalar: formats ordered by width, then by range (exponent
# bits), so a promotion draws as a step up: int8 0, fp8_e4m3 1, fp8_e5m2 2, fp16 3, bf16 4,
# fp32 5. Derived from the formats' own numbers, and written out as the text ``format/legend``.
FORMAT_INDEX: Mapping[Format, int] = types.MappingProxyType(
    {f: i for i, f in enumerate(sorted(Format, key=lambda f: (f.bits, f.spec.exponent_bits)))}
)

_DEFAULT_FLUSH_EVERY = 100
_DEFAULT_TIMELINE_ROWS = 500
# Loss-scale changes and skipped steps kept for the timeline figure (the newest; 16 bytes each).
_HISTORY = 100_000


def _step(step: Any) -> int:
    # A tensor step would need .item() (a sync); training loops count steps on the host.
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise MonitoringError(f"step must be a Python int, got {type(step).__name__} {step!r}")
    return int(step)


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise MonitoringError(f"a scalar or count name must be a non-empty string, got {name!r}")
    return name


def _value(name: str, value: Any) -> "float | torch.Tensor":
    """A detached one-element tensor (a copy: GradScaler updates its scale in place) or a float.

    Never reads a tensor's value: no host-device sync, just one copy kernel on its device.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MonitoringError(f"{name} must be a scalar (one element), got a tensor of shape {tuple(value.shape)}")
        return value.detach().clone()
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    raise MonitoringError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")


class TrainingWriter:
    """Writes a training run's precision events as the TensorBoard run ``logdir/run``.

    ``flush_every``: buffered scalars are moved to the host and written once they span this many
    distinct steps (one host-device sync each time); ``None`` waits for `flush` (the buffer
    grows by a few tensors a step until then). ``enabled=False``
    makes every method a pass-through that creates no files. ``timeline_rows`` caps the rows of
    the ``precision/timeline`` table (the newest are kept; the counts cover all).

    Events reach the event file at each batch and at `flush` / `close`, readable by TensorBoard
    (and `EventAccumulator`) from then on. A ``with`` block closes the writer, also when the body
    raises. Raises `MonitoringError` at once for an unwritable ``logdir``.
    """

    def __init__(
        self,
        logdir: "str | os.PathLike",
        run: str = TRAIN_RUN,
        *,
        flush_every: Optional[int] = _DEFAULT_FLUSH_EVERY,
        enabled: bool = True,
        timeline_rows: int = _DEFAULT_TIMELINE_ROWS,
    ):
        if flush_every is not None and (isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1):
            raise MonitoringError(f"flush_every must be a positive int (steps) or None (only at flush()), got {flush_every!r}")
        if isinstance(timeline_rows, bool) or not isinstance(timeline_rows, int) or timeline_rows < 1:
            raise MonitoringError(f"timeline_rows must be a positive int, got {timeline_rows!r}")
        self.logdir = Path(logdir)
        self.path = self.logdir / "/".join(run_name(part) for part in str(run).split("/"))
        self.flush_every = flush_every
        self.enabled = enabled
        self.timeline_rows = timeline_rows
        # (step, walltime, tag, float or one-element tensor), in call order.
        self._buffer: list[tuple[int, float, str, "float | torch.Tensor"]] = []
        self._buffered_steps = 0
        self._last_buffered_step: Optional[int] = None
        self._skipped_total = 0.0
        self._changes: list[PrecisionChange] = []
        self._timeline_step: Optional[int] = None  # a step whose timeline text is not written yet
        self._legend_written = False
        self._scale_points: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (step, loss scale) where it changed
        self._skipped_steps: deque[int] = deque(maxlen=_HISTORY)
        self._last_step: Optional[int] = None  # the latest step written to the timeline
        self._timeline_drawn = True  # nothing new since the timeline figure was last drawn
        self._root = "model"  # the tag name of a layer '' (a one-layer model's root): its class, from the last plan logged
        self._closed = False
        self._writer: Optional[SummaryWriter] = None  # None when disabled
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # lazy: loads TensorBoard's protobufs

            ensure_writable_dir(self.path, self.logdir)
            # A deep queue: the writer thread drains it, so a batch of events rarely waits on it
            # (at the default of 10 each event past the tenth waits ~0.1 ms for the thread).
            self._writer = SummaryWriter(log_dir=str(self.path), max_queue=1024)

    # -- state --------------------------------------------------------------------------------

    @property
    def changes(self) -> tuple[PrecisionChange, ...]:
        """Every change logged so far, in call order."""
        return tuple(self._changes)

    @property
    def pending(self) -> int:
        """Buffered scalar values not yet moved to the host and written."""
        return len(self._buffer)

    def _live(self) -> bool:
        if self._closed:
            raise MonitoringError(f"this TrainingWriter for {str(self.path)!r} is closed; open a new one to write more")
        return self.enabled

    @property
    def _events(self) -> "SummaryWriter":
        """The event writer, for code that `_live` let through (an enabled writer has one)."""
        if self._writer is None:
            raise MonitoringError(f"this TrainingWriter for {str(self.path)!r} was made with enabled=False and writes nothing")
        return self._writer

    # -- deferred scalars ---------------------------------------------------------------------

    def _defer(self, step: int, values: Sequence[tuple[str, "float | torch.Tensor"]]) -> None:
        if not values:
            return
        if step != self._last_buffered_step:
            self._buffered_steps += 1
            self._last_buffered_step = step
        wall = time.time()
        self._buffer.extend((step, wall, tag, value) for tag, value in values)
        if self.flush_every is not None and self._buffered_steps >= self.flush_every:
            self._drain()
            self._events.flush()

    def log_step(
        self,
        step: int,
        *,
        loss: Any = None,
        loss_scale: Any = None,
        skipped: Any = None,
        scalars: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Buffer one step's ``train/loss``, ``train/loss_scale``, ``train/skipped`` (1 when the
        optimizer step was skipped: a bool, 0/1, or GradScaler's found-inf tensor) and any other
        ``scalars`` as ``train/<name>``; the running ``train/skipped_total`` is added when written.

        Values are floats or one-element tensors on any device. No sync: tensors are kept as
        detached copies (one copy kernel each) until the batch is written.
        """
        if not self._live():
            return
        step = _step(step)
        values = [(f"train/{name}", _value(name, v)) for name, v in (("loss", loss), ("loss_scale", loss_scale), ("skipped", skipped)) if v is not None]
        for name, v in (scalars or {}).items():
            values.append((f"train/{_name(name)}", _value(f"scalars[{name!r}]", v)))
        self._defer(step, values)

    def log_search(self, step: int, timeline: Mapping[str, float], longest_step_ratio: Optional[float] = None) -> None:
        """Buffer a search's timeline: ``search/<stage>_seconds`` per stage (off-path work, and
        what probe and trial steps took beyond the median step) and ``search/longest_step_ratio``."""
        if not self._live():
            return
        step = _step(step)
        values = [(f"search/{_name(stage.replace(' ', '_'))}_seconds", float(seconds)) for stage, seconds in timeline.items()]
        if longest_step_ratio is not None:
            values.append(("search/longest_step_ratio", float(longest_step_ratio)))
        self._defer(step, values)

    def log_layer_counts(self, step: int, counts: Mapping[str, Mapping[str, Any]]) -> None:
        """Buffer per-layer counts, ``{fqn: {"overflow": n, "underflow": n, "nonfinite": n}}``
        (any count names), as ``<name>/<fqn>``. Ints or one-element tensors; no sync."""
        if not self._live():
            return
        step = _step(step)
        values: list[tuple[str, "float | torch.Tensor"]] = []
        for fqn, kinds in counts.items():
            if not isinstance(kinds, Mapping):
                raise MonitoringError(f"counts[{fqn!r}] must map a count name to a number, e.g. {{'overflow': 3}}; got {type(kinds).__name__}")
            values.extend((f"{_name(kind)}/{layer_name(fqn, self._root)}", _value(f"counts[{fqn!r}][{kind!r}]", n)) for kind, n in kinds.items())
        self._defer(step, values)

    def log_memory(self, step: int, predicted_bytes: Any = None, measured_bytes: Any = None) -> None:
        """Buffer ``memory/predicted_bytes`` and ``memory/measured_bytes`` (e.g.
        ``torch.cuda.max_memory_allocated()``, a host counter that does not sync); with both,
        ``memory/measured_vs_predicted`` is added when written. No sync."""
        if not self._live():
            return
        step = _step(step)
        values = [(f"memory/{name}", _value(name, v)) for name, v in (("predicted_bytes", predicted_bytes), ("measured_bytes", measured_bytes)) if v is not None]
        self._defer(step, values)

    def log_accuracy(self, step: int, measured: float, allowed: Optional[float] = None) -> None:
        """Buffer a planned check's ``accuracy/measured_loss_increase`` (the plan's loss against
        the window's precision on the same batches, `scheduler.plan_checks`) and
        ``accuracy/allowed_loss_increase``. No sync."""
        if not self._live():
            return
        values = [("accuracy/measured_loss_increase", float(measured))]
        if allowed is not None:
            values.append(("accuracy/allowed_loss_increase", float(allowed)))
        self._defer(_step(step), values)

    def _drain(self) -> None:
        """Move the buffered values to the host (one transfer per device: the sync) and write them."""
        buffer, self._buffer = self._buffer, []
        self._buffered_steps, self._last_buffered_step = 0, None
        if not buffer:
            return
        values: list[float] = [v if isinstance(v, float) else math.nan for _, _, _, v in buffer]
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, (_, _, _, v) in enumerate(buffer):
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((i, v))
        for entries in by_device.values():
            # stack promotes mixed dtypes (bool found-inf, int counts, bf16 losses) to one.
            host = torch.stack([v.reshape(()) for _, v in entries]).cpu().double().tolist()
            for (i, _), value in zip(entries, host):
                values[i] = value
        # One event per step holding all its values: the event writer's cost is per event (~0.1 ms).
        steps: dict[int, tuple[float, dict[str, float]]] = {}
        for (step, wall, tag, _), value in zip(buffer, values):
            if tag == "train/skipped":  # GradScaler's found-inf can count devices: any means skipped
                value = float(value > 0)
                self._skipped_total += value
            figures = steps.setdefault(step, (wall, {}))[1]
            figures[tag] = value
            if tag == "train/skipped":
                figures["train/skipped_total"] = self._skipped_total
                if value:
                    self._skipped_steps.append(step)
                self._seen(step)
            elif tag == "train/loss_scale":
                if not self._scale_points or self._scale_points[-1][1] != value:
                    self._scale_points.append((step, value))
                self._seen(step)
        for step, (wall, figures) in steps.items():
            predicted, measured = figures.get("memory/predicted_bytes"), figures.get("memory/measured_bytes")
            if predicted and measured is not None:
                figures["memory/measured_vs_predicted"] = measured / predicted
            add_scalars(self._events, figures, step, wall)

    def _seen(self, step: int) -> None:
        """``step`` brought the timeline figure something new."""
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        self._timeline_drawn = False

    def _write_timeline_figure(self, step: int) -> None:
        """The ``train/timeline`` figure of everything written so far, at the latest step it shows."""
        end = max(step, self._last_step if self._last_step is not None else step)
        drawing = render_timeline(list(self._scale_points), list(self._skipped_steps), self._changes, end=end)
        add_figure(self._events, "train/timeline", drawing, end)
        self._timeline_drawn = True

    # -- gradients ----------------------------------------------------------------------------

    def log_grad_histograms(self, step: int, grads: Mapping[str, torch.Tensor], *, bins: int = 30) -> None:
        """Write ``grad/<fqn>`` histograms of each gradient's finite values in ``bins`` equal
        buckets between their min and max (non-finite values are counted by `log_layer_counts`,
        not here; an all-non-finite gradient gets no histogram).

        Computed on the gradient's device (a pass over it with a few FP32 temporaries of its
        size), then moved in one transfer per device: one host-device sync per call. Meant for
        window ends, not every step.
        """
        if not self._live():
            return
        step = _step(step)
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise MonitoringError(f"bins must be a positive int, got {bins!r}")
        rows: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for fqn, grad in grads.items():
            if not isinstance(grad, torch.Tensor):
                raise MonitoringError(f"grads[{fqn!r}] must be a tensor, got {type(grad).__name__}")
            rows.setdefault(grad.device, []).append((fqn, _histogram(grad.detach(), bins)))
        wall = time.time()
        for device_rows in rows.values():
            host = torch.stack([row for _, row in device_rows]).cpu().double()
            for (fqn, _), row in zip(device_rows, host.tolist()):
                count, lo, hi, total, squares = row[:5]
                if count == 0:
                    logger.debug("grad of %s at step %d has no finite value; no histogram", fqn, step)
                    continue
                counts = row[5:]
                if hi > lo:
                    limits = [lo + (hi - lo) * (i + 1) / bins for i in range(bins)]
                    limits[-1] = hi
                else:  # one value: one bucket
                    limits, counts = [hi], [count]
                self._events.add_histogram_raw(
                    f"grad/{layer_name(fqn, self._root)}", lo, hi, count, total, squares, limits, counts, global_step=step, walltime=wall
                )

    # -- precision changes --------------------------------------------------------------------

    def _format_scalars(self, formats: Mapping[str, Format], step: int) -> None:
        if not self._legend_written:
            rows = [[str(i), f.value, str(f.bits), str(f.spec.exponent_bits)] for f, i in sorted(FORMAT_INDEX.items(), key=lambda kv: kv[1])]
            add_text(self._events, "format/legend", "The value of each `format/<layer>` scalar:\n\n" + markdown_table(["value", "format", "bits", "exponent bits"], rows), step)
            self._legend_written = True
        add_scalars(self._events, {f"format/{layer_name(fqn, self._root)}": FORMAT_INDEX[fmt] for fqn, fmt in formats.items()}, step)

    def log_formats(self, step: int, formats: "Plan | Mapping[str, Format | str | LayerPrecision]") -> None:
        """Write every layer's ``format/<fqn>`` scalar (the start of each layer's line; call it,
        or `log_plan`, once at the start of training). Host values only."""
        if not self._live():
            return
        step = _step(step)
        if isinstance(formats, Plan) and "" in formats.fingerprint:
            self._root = formats.fingerprint[""].module
        items = formats.layers.items() if isinstance(formats, Plan) else formats.items()
        self._format_scalars({fqn: value.format if isinstance(value, LayerPrecision) else Format.parse(value) for fqn, value in items}, step)

    def log_change(self, step: int, fqn: str, old_format: "Format | str", new_format: "Format | str", reason: str = "",
                   old_grad: "Format | str | None" = None, new_grad: "Format | str | None" = None) -> PrecisionChange:
        """Record that layer ``fqn`` moved from ``old_format`` to ``new_format`` at ``step``
        because of ``reason`` (a backward change: its gradient format from ``old_grad`` to
        ``new_grad``, the format kept): writes ``format/<fqn>`` at once, and the ``precision/timeline``
        table of every change so far with the running ``precision/changes``, ``promotions`` and
        ``demotions`` counts once per step (when a later step's change arrives, or at `flush`).
        Host values only. Returns the change."""
        grads = (Format.parse(old_grad), Format.parse(new_grad)) if old_grad is not None and new_grad is not None else (None, None)
        change = PrecisionChange(_step(step), str(fqn), Format.parse(old_format), Format.parse(new_format), str(reason), *grads)
        if not self._live():
            return change
        if self._timeline_step is not None and self._timeline_step != change.step:
            self._write_timeline()
        self._changes.append(change)
        self._seen(change.step)
        self._timeline_step = change.step
        self._format_scalars({change.fqn: change.new}, change.step)
        return change

    def _write_timeline(self) -> None:
        step, self._timeline_step = self._timeline_step, None
        if step is None:
            return
        shown = self._changes[-self.timeline_rows:]
        rows = [[str(c.step), f"`{layer_name(c.fqn, self._root)}`", _side(c.old, c.old_grad), _side(c.new, c.new_grad), c.direction, c.reason or "–"] for c in shown]
        text = f"{len(self._changes)} precision changes"
        if len(shown) < len(self._changes):
            text += f" (the last {len(shown)} shown)"
        add_text(self._events, "precision/timeline", text + "\n\n" + markdown_table(["step", "layer", "from", "to", "change", "reason"], rows), step)
        counts = {"precision/changes": len(self._changes)}
        counts.update({f"precision/{d}s": sum(c.direction == d for c in self._changes) for d in ("promotion", "demotion")})
        add_scalars(self._events, counts, step)
        self._write_timeline_figure(step)

    def log_plan(self, step: int, plan: Plan, name: str = "plan") -> None:
        """Write the plan in force from ``step`` into this run: ``plan/precision_map`` (image),
        ``plan/summary`` and ``plan/layers`` (text), and every layer's ``format/<fqn>``, so
        TensorBoard's step slider walks through the plans. Host work only (0.2 to 0.8 s on one
        slow shared core for 6 to 500 layers, mostly drawing the map's names and encoding its PNG)."""
        if not self._live():
            return
        step = _step(step)
        add_figure(self._events, "plan/precision_map", render_precision_map(plan, name), step)
        add_text(self._events, "plan/summary", plan_summary_markdown(plan, name), step)
        add_text(self._events, "plan/layers", plan_layers_markdown(plan), step)
        self.log_formats(step, plan)

    # -- lifetime -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Move every buffered value to the host (one sync per device holding any), write it,
        the pending timeline and (when anything new came in) the ``train/timeline`` figure, and
        flush the event file to disk."""
        if not self._live():
            return
        self._drain()
        self._write_timeline()
        if not self._timeline_drawn and self._last_step is not None:
            self._write_timeline_figure(self._last_step)
        self._events.flush()

    def close(self) -> None:
        """`flush`, then close the event file. Closing again does nothing."""
        if self._closed:
            return
        try:
            if self.enabled:
                self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.close()

    def __enter__(self) -> "TrainingWriter":
        if self._closed:
            raise MonitoringError(f"this TrainingWriter for {str(self.path)!r} is closed; a closed writer cannot be entered again")
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _side(fmt: Format, grad: "Format | None") -> str:
    """One side of a change in the timeline: the format, and the gradient format a backward change moved."""
    return f"`{fmt.value}`" if grad is None else f"`{fmt.value}`, gradients `{grad.value}`"


# How each kind of change is drawn: colour-blind-safe colours, shapes of their own, and a side of
# the zero line (promotions count up, demotions down, so neither hides the other).
_DIRECTIONS = (
    ("promotion", "promotions", OKABE_ITO["bluish green"], "^", 1),
    ("demotion", "demotions", OKABE_ITO["reddish purple"], "v", -1),
    ("lateral", "lateral changes", OKABE_ITO["sky blue"], "o", 0),
)


def render_timeline(
    loss_scale: Sequence[tuple[int, float]],
    skipped: Sequence[int],
    changes: Sequence[PrecisionChange],
    *,
    end: int,
    size: tuple[int, int] = (800, 480),
) -> Drawing:
    """A training run by step, two panels sharing the step axis: the loss scale (``(step,
    value)`` where it changed; a base-2 logarithmic axis when it spans more than a decade) with
    each ``skipped`` step a vermillion cross on it at the scale logged then, and the running
    counts of promotions (up) and demotions (down), a marker at each change (lateral ones on the
    zero line). The ``precision/timeline`` table beside it names every change.
    Host-only: one line and one scatter per kind, whatever the number of steps."""
    from matplotlib import ticker

    kinds = [(label, colour, marker, sign, [c.step for c in changes if c.direction == d]) for d, label, colour, marker, sign in _DIRECTIONS]
    scale_steps = [s for s, _ in loss_scale]

    def scale_at(step: int) -> float:
        return loss_scale[max(bisect_right(scale_steps, step) - 1, 0)][1]

    def build(figure):
        ax, changes_ax = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        if loss_scale:
            values = [v for _, v in loss_scale]
            ax.step([*scale_steps, max(end, scale_steps[-1])], [*values, values[-1]], where="post", color=mpl_colour(OKABE_ITO["blue"]), linewidth=1.6, label="loss scale")
            positive = [v for v in values if v > 0]
            if positive and len(positive) == len(values) and max(positive) > 10 * min(positive):
                ax.set_yscale("log", base=2)
                ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"2^{math.log2(v):g}" if v > 0 else ""))
        else:
            ax.text(0.5, 0.5, "no loss scale logged", transform=ax.transAxes, ha="center", va="center")
        if skipped:
            ax.scatter(list(skipped), [scale_at(s) if loss_scale else 1.0 for s in skipped], marker="x", s=36,
                       color=mpl_colour(OKABE_ITO["vermillion"]), linewidths=1.6, label="skipped step", zorder=3)
        ax.set_ylabel("loss scale")
        for label, colour, marker, sign, steps in kinds:
            if steps:
                counts = [sign * k for k in range(1, len(steps) + 1)]
                if sign:
                    changes_ax.step([0, *steps, max(end, steps[-1])], [0, *counts, counts[-1]], where="post", color=mpl_colour(colour), linewidth=1.4)
                changes_ax.scatter(steps, counts, marker=marker, s=36, color=mpl_colour(colour), label=label, zorder=3)
        changes_ax.axhline(0, color="#9a9a9a", linewidth=0.8)
        changes_ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True, nbins=4))
        changes_ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{abs(v):g}"))
        changes_ax.set_ylabel("promoted ↑ / demoted ↓")
        changes_ax.set_xlabel("step")
        changes_ax.set_xlim(left=min([0, *scale_steps, *skipped, *(c.step for c in changes)]), right=max(end, 1))
        for a in (ax, changes_ax):
            a.grid(True, color="#e4e4e4", linewidth=0.8)
            a.set_axisbelow(True)
        counts = {label: len(steps) for label, _, _, _, steps in kinds}
        figure.suptitle(f"training to step {end}: {len(skipped)} skipped, {counts['promotions']} promotions, {counts['demotions']} demotions")
        handles = [h for a in (ax, changes_ax) for h in a.get_legend_handles_labels()[0]]
        if handles:
            figure.legend(handles=handles, loc="outside lower center", ncols=5, frameon=False)
        return ax

    figure, _ax = new_figure(*size, build)
    declutter_ticks(figure, settle(figure))
    return Drawing(figure)


def _histogram(grad: torch.Tensor, bins: int) -> torch.Tensor:
    """``[count, min, max, sum, sum of squares, bucket counts...]`` of the finite values, as one
    FP32 tensor on the gradient's device; no sync (histc gets fixed bounds, 0 and 1, after the
    values are scaled into them on the device)."""
    x = grad.reshape(-1).float()
    finite = torch.isfinite(x)
    count = finite.sum().float()
    lo = torch.where(finite, x, math.inf).amin() if x.numel() else x.new_tensor(math.inf)
    hi = torch.where(finite, x, -math.inf).amax() if x.numel() else x.new_tensor(-math.inf)
    kept = torch.where(finite, x, 0.0)
    span = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    # Non-finite values become -1, outside histc's [0, 1], so they fall in no bucket.
    scaled = torch.where(finite, (x - lo) / span, -1.0)
    counts = torch.histc(scaled, bins=bins, min=0.0, max=1.0)
    return torch.cat([torch.stack([count, lo, hi, kept.sum(), (kept * kept).sum()]), counts])
