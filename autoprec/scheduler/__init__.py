"""`DynamicPrecisionScheduler`: the pipeline driven inside a training run.

Owns: `dynamic` (the scheduler: the window clock and the composition of the parts below),
`config` (`SchedulerConfig`, `Thresholds`), `state` (the checkpoint schema and its checks),
`binding` (which model, however it is called), `plan_keeper` (the plan in force, its runtime,
the loss scaler, promotions and demotions), `window_measures` (the profiler of the first window,
the watch of planned ones, the loss baseline, captured steps), `search_steps` (the search spread
over training steps), `grad_comm` (each layer's gradient communication under DDP),
`step_checks` (what a step refuses and warns of), `stance` (whether a step of a compiled model
runs eagerly), `fp8_gathers` (FSDP2's FP8 gathers switched with the plan), `pipeline_stage`
(a fixed plan on a pipeline stage), `plan_checks`,
`lifecycle` (the window clock's pure transitions) and
`policy` (the pure promote / demote rules), `promotion_bytes` (the lowerings that pay for a
promotion within the memory budget). May import every part below it (the shared basics,
`runtime`, `profiling`, `scaling`, `sensitivity`, `costs`, `search`, `monitoring`,
`distributed`); imported only by the entry points (`integrations`, the CLI) and users.
"""

from ..changes import PrecisionChange
from ..scaling import LossScaling
from .config import SchedulerConfig, Thresholds
from .dynamic import DynamicPrecisionScheduler

__all__ = ["DynamicPrecisionScheduler", "SchedulerConfig", "LossScaling", "Thresholds", "PrecisionChange"]
