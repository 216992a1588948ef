"""Monitoring: plans and their differences for a person to look at, in TensorBoard.

Two concerns, one module each, over the pure rendering in `plans`:

- `figures`: what every figure shares (a matplotlib figure on the Agg canvas, colours, scales,
  labels that never overlap); matplotlib is imported only when a figure is drawn;
- `plans`: what a plan shows (precision map figure, per-layer and totals tables, budgets) and the
  layer-by-layer differences between two plans; no I/O;
- `writer`: those as TensorBoard event files under one logdir (`PlanWriter`, `write_review`);
- `server`: a local TensorBoard process on that logdir (`start_tensorboard`);
- `search`: a search's trials, Pareto front, progress and compared candidate plans
  (`write_search`, `write_candidates`);
- `training_writer`: a training run under the scheduler, buffered off the hot path (`TrainingWriter`),
  and its timeline figure.

What ``autoprec review PLAN.json... --logdir DIR [--open]`` runs::

    result = write_review(load_plans(paths), logdir)
    print(result.format_table())
    with start_tensorboard(logdir) as tb:      # --open
        print(tb.url); tb.wait()

May import the shared basics, `runtime`, `profiling`, `scaling`, `costs`, `sensitivity` and
`search` (it renders what they produce and changes none of it).
"""

from .plans import LayerDiff, PlanDiff, PrecisionMap, diff_plans, render_precision_map
from .search import pareto_front, write_candidates, write_search
from .server import TensorBoardServer, start_tensorboard
from .training_writer import TrainingWriter
from .writer import PlanWriter, ReviewResult, load_plans, write_plan, write_review

# The API: what a user calls to write, read, diff and serve reviews. The rendering helpers,
# constants and run names are the modules' own (`monitoring.plans`, `.search`, ...), not API.
__all__ = [
    "write_review",
    "ReviewResult",
    "load_plans",
    "write_plan",
    "PlanWriter",
    "diff_plans",
    "PlanDiff",
    "LayerDiff",
    "render_precision_map",
    "PrecisionMap",
    "write_search",
    "write_candidates",
    "pareto_front",
    "TrainingWriter",
    "TensorBoardServer",
    "start_tensorboard",
]
