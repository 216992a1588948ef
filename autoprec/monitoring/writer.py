"""Plans and their differences as TensorBoard event files under one logdir.

Layout (one TensorBoard run per folder)::

    LOGDIR/plans/<name>/       image  plan/precision_map   layers × formats, colour per format (matplotlib)
                               text   plan/summary         counts, totals vs FP32, budgets
                               text   plan/layers          per-layer table with the reasons
                               scalars plan/predicted_bytes, plan/measured_seconds_vs_fp32, ...
                               hparams session: counts per format, budgets (metrics: the scalars)
    LOGDIR/diffs/<a>-vs-<b>/   image  diff/precision_map   both plans side by side, changes marked (matplotlib)
                               text   diff/layers          the layers that differ
                               scalar diff/changed_layers

The HParams view is computed by TensorBoard from the sessions (no experiment summary is
written), so plans written by separate reviews into one logdir sort and filter together.
Events go through `torch.utils.tensorboard.SummaryWriter` (a background thread writes them); the
caller pays drawing (`figures`: one image of the cells, names for at most ~90 layers), PNG
encoding and a flush.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from ..errors import MonitoringError
from ..plan import Plan
from .figures import Drawing
from .plans import PlanDiff, diff_plans, format_plan_line, plan_hparams, plan_layers_markdown, plan_scalars, plan_summary_markdown, render_precision_map

if TYPE_CHECKING:  # imported lazily where used: it loads TensorBoard's protobufs
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["PLANS_DIR", "DIFFS_DIR", "PlanWriter", "ReviewResult", "write_plan", "write_review", "load_plans", "run_name"]

logger = logging.getLogger(__name__)

PLANS_DIR = "plans"
DIFFS_DIR = "diffs"
EVENT_FILE_PREFIX = "events.out.tfevents."


def run_name(name: str) -> str:
    """``name`` made safe as one folder name: characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(name)).lstrip(".")
    if not safe:
        raise MonitoringError(f"{name!r} cannot name a TensorBoard run; use letters, digits, '.', '_' or '-'")
    return safe


def ensure_writable_dir(path: Path, logdir: Path) -> None:
    """Create ``path`` and prove a file can be written there, or raise a one-line MonitoringError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".autoprec-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = "it or a parent is a file, not a directory" if isinstance(exc, (FileExistsError, NotADirectoryError)) else exc.strerror or str(exc)
        raise MonitoringError(f"cannot write to logdir {str(logdir)!r}: {reason}; choose a writable --logdir") from None


def add_figure(writer, tag: str, drawing: Drawing, step: int) -> None:
    """``drawing``'s figure as the image ``tag`` at ``step``, through ``SummaryWriter.add_figure``
    (one Agg draw and a PNG encode; the figure stays open, as it is no pyplot figure)."""
    writer.add_figure(tag, drawing.figure, step, close=False)


def add_text(writer, tag: str, markdown: str, step: int) -> None:
    """A text summary under ``tag`` itself (``SummaryWriter.add_text`` appends "/text_summary")."""
    from tensorboard.plugins.text.summary_v2 import text_pb

    writer.file_writer.add_summary(text_pb(tag, markdown), step)


def add_scalars(writer, values: Mapping[str, float], step: int, walltime: Optional[float] = None) -> None:
    """Scalars as one event, as ``SummaryWriter.add_scalar`` writes each: the event writer's cost
    is per event (a protobuf encode and a write), so a step's values share one."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()])
    writer.file_writer.add_summary(summary, step, walltime)


class PlanWriter:
    """Writes plans (`write_plan`) and plan differences (`write_diff`) as TensorBoard runs under
    ``logdir``; keeps one `SummaryWriter` per run open until `close` (or the end of a ``with``).

    Writing the same name again at a later ``step`` adds to that run (a timeline of plans). With
    ``replace=True`` the event files already in a run's folder are removed when this writer first
    opens it, so a run shows only what this writer wrote (what `write_review` wants).

    Raises `MonitoringError` at once when ``logdir`` cannot be created or written.
    """

    def __init__(self, logdir: "str | os.PathLike", *, replace: bool = False):
        self.logdir = Path(logdir)
        self.replace = replace
        self._writers: dict[str, SummaryWriter] = {}
        ensure_writable_dir(self.logdir, self.logdir)

    def _writer(self, run: str) -> SummaryWriter:
        writer = self._writers.get(run)
        if writer is None:
            # Lazy: importing torch.utils.tensorboard loads TensorBoard's protobufs.
            from torch.utils.tensorboard import SummaryWriter

            path = self.logdir / run
            ensure_writable_dir(path, self.logdir)
            if self.replace:
                for old in path.glob(EVENT_FILE_PREFIX + "*"):
                    old.unlink()
            writer = self._writers[run] = SummaryWriter(log_dir=str(path))
        return writer

    def write_plan(self, plan: Plan, name: str, step: int = 0) -> Path:
        """Write ``plan`` as the run ``plans/<name>``: precision map, summary and layer tables,
        total scalars, and an HParams session. Returns the run's folder."""
        from torch.utils.tensorboard.summary import hparams

        run = f"{PLANS_DIR}/{run_name(name)}"
        writer = self._writer(run)
        add_figure(writer, "plan/precision_map", render_precision_map(plan, name), step)
        add_text(writer, "plan/summary", plan_summary_markdown(plan, name), step)
        add_text(writer, "plan/layers", plan_layers_markdown(plan), step)
        for tag, value in plan_scalars(plan).items():
            writer.add_scalar(tag, value, step)
        # The session start and end only, not the experiment: without one TensorBoard derives the
        # HParams columns from all sessions and the metrics from the scalars in each session's run
        # (tensorboard/plugins/hparams/backend_context.py), so plans of separate reviews mix.
        _experiment, session_start, session_end = hparams(plan_hparams(plan, name), {})
        events = writer.file_writer
        if events is None:  # only a closed SummaryWriter has none, and `close` drops those
            raise MonitoringError(f"{run}: its TensorBoard writer is closed")
        events.add_summary(session_start, step)
        events.add_summary(session_end, step)
        writer.flush()
        return self.logdir / run

    def write_diff(self, diff: PlanDiff, step: int = 0) -> Path:
        """Write ``diff`` as the run ``diffs/<a>-vs-<b>``; returns the run's folder."""
        run = f"{DIFFS_DIR}/{run_name(diff.name_a)}-vs-{run_name(diff.name_b)}"
        writer = self._writer(run)
        add_figure(writer, "diff/precision_map", diff.render(), step)
        add_text(writer, "diff/layers", diff.markdown(), step)
        writer.add_scalar("diff/changed_layers", len(diff), step)
        writer.flush()
        return self.logdir / run

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def __enter__(self) -> "PlanWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_plan(plan: Plan, logdir: "str | os.PathLike", name: str, step: int = 0) -> Path:
    """Write one plan as the run ``plans/<name>`` under ``logdir``; returns the run's folder."""
    with PlanWriter(logdir) as writer:
        return writer.write_plan(plan, name, step)


@dataclasses.dataclass(frozen=True)
class ReviewResult:
    """What `write_review` wrote: ``runs`` maps each run name (``plans/a``, ``diffs/a-vs-b``) to
    its folder; ``diffs`` compare consecutive plans."""

    logdir: Path
    plans: tuple[tuple[str, Plan], ...]
    diffs: tuple[PlanDiff, ...]
    runs: Mapping[str, Path]

    def format_table(self) -> str:
        """For a terminal: one line per plan, then each difference as an aligned table."""
        lines = [format_plan_line(plan, name) for name, plan in self.plans]
        return "\n\n".join(["\n".join(lines), *(d.format_table() for d in self.diffs)])


def write_review(plans: Sequence[tuple[str, Plan]], logdir: "str | os.PathLike") -> ReviewResult:
    """Write each plan's run, a diff run for each consecutive pair, and an HParams session per plan.

    The runs it writes are replaced, so reviewing the same names again shows the new plans only;
    other runs under ``logdir`` are left alone. Raises `MonitoringError` for an unwritable
    ``logdir``, no plans, or two plans whose names give the same run.
    """
    plans = tuple((str(name), plan) for name, plan in plans)
    if not plans:
        raise MonitoringError("no plans to review; give at least one PLAN.json")
    seen: dict[str, str] = {}
    for name, _ in plans:
        run = run_name(name)
        if run in seen:
            raise MonitoringError(f"plans {seen[run]!r} and {name!r} would share the run {run!r}; give them different names")
        seen[run] = name
    diffs = tuple(diff_plans(a, b, (na, nb)) for (na, a), (nb, b) in zip(plans, plans[1:]))
    runs = {}
    with PlanWriter(logdir, replace=True) as writer:
        for name, plan in plans:
            path = writer.write_plan(plan, name)
            runs[path.relative_to(writer.logdir).as_posix()] = path
        for diff in diffs:
            path = writer.write_diff(diff)
            runs[path.relative_to(writer.logdir).as_posix()] = path
    logger.info("wrote %d runs under %s", len(runs), logdir)
    return ReviewResult(Path(logdir), plans, diffs, runs)


def load_plans(paths: Sequence["str | os.PathLike"]) -> list[tuple[str, Plan]]:
    """``[(name, Plan)]`` for plan files, named by file stem (``-2``, ``-3`` ... where stems repeat).

    A missing or malformed file raises `PlanError` naming it (from `Plan.load`).
    """
    if not paths:
        raise MonitoringError("no plan files given; pass one or more PLAN.json")
    named, used = [], set()
    for path in paths:
        stem = Path(path).stem or "plan"
        name, k = stem, 1
        while name in used:
            k += 1
            name = f"{stem}-{k}"
        used.add(name)
        named.append((name, Plan.load(path)))
    return named
