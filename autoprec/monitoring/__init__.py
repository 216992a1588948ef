"""Monitoring: plans and their differences for a person to look at, in TensorBoard.

Two concerns, one module each, over the pure rendering in `plans`:

- `plans`: what a plan shows (precision map image, per-layer and totals tables, budgets) and the
  layer-by-layer differences between two plans; no I/O;
- `writer`: those as TensorBoard event files under one logdir (`PlanWriter`, `write_review`);
- `server`: a local TensorBoard process on that logdir (`start_tensorboard`);
- `search`: a search's trials, Pareto front and compared candidate plans (`write_search`,
  `write_candidates`);
- `training`: a training run under the scheduler, buffered off the hot path (`TrainingWriter`).

What ``autoprec review PLAN.json... --logdir DIR [--open]`` runs::

    result = write_review(load_plans(paths), logdir)
    print(result.format_table())
    with start_tensorboard(logdir) as tb:      # --open
        print(tb.url); tb.wait()
"""

from .plans import (
    FORMAT_COLOURS,
    ROW_HEIGHT,
    BudgetCheck,
    Figures,
    LayerDiff,
    PlanDiff,
    PrecisionMap,
    budget_checks,
    describe_scaling,
    diff_plans,
    format_plan_line,
    plan_figures,
    plan_hparams,
    plan_layers_markdown,
    plan_scalars,
    plan_summary_markdown,
    render_precision_map,
)
from .search import (
    CANDIDATES_DIR,
    SEARCH_RUN,
    ParetoFigure,
    TrialPoint,
    best_so_far,
    budget_scalars,
    pareto_front,
    render_pareto,
    search_points,
    search_summary_markdown,
    write_candidates,
    write_search,
)
from .server import TensorBoardServer, free_port, start_tensorboard
from .training import FORMAT_INDEX, TRAIN_RUN, PrecisionChange, TrainingWriter
from .writer import DIFFS_DIR, PLANS_DIR, PlanWriter, ReviewResult, load_plans, run_name, write_plan, write_review

__all__ = [
    # review
    "write_review",
    "load_plans",
    "ReviewResult",
    "PlanWriter",
    "write_plan",
    "run_name",
    "PLANS_DIR",
    "DIFFS_DIR",
    # rendering
    "FORMAT_COLOURS",
    "ROW_HEIGHT",
    "PrecisionMap",
    "render_precision_map",
    "plan_layers_markdown",
    "plan_summary_markdown",
    "format_plan_line",
    "describe_scaling",
    "Figures",
    "plan_figures",
    "BudgetCheck",
    "budget_checks",
    "plan_scalars",
    "plan_hparams",
    # differences
    "LayerDiff",
    "PlanDiff",
    "diff_plans",
    # search
    "write_search",
    "write_candidates",
    "SEARCH_RUN",
    "CANDIDATES_DIR",
    "TrialPoint",
    "search_points",
    "pareto_front",
    "best_so_far",
    "render_pareto",
    "ParetoFigure",
    "search_summary_markdown",
    "budget_scalars",
    # training
    "TrainingWriter",
    "PrecisionChange",
    "TRAIN_RUN",
    "FORMAT_INDEX",
    # TensorBoard
    "TensorBoardServer",
    "start_tensorboard",
    "free_port",
]
