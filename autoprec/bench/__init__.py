"""`autoprec bench`: what each precision variant costs, measured in one run.

- `models`: median step time and bytes saved for backward of training steps of target workloads
  under every variant (plain FP32, uniform plans, plain autocast, compiled), as ratios to FP32;
- `ops`: aten ops, host syncs and graph breaks per training step, counted rather than timed;
- `overhead`: the profiler's cost per step (`measure_overhead`);
- `ranking`: the cost model's predicted ranking of uniform plans against measured step times;
- `step_profile`: where a step's time goes (kernels, launches, syncs, the costliest kernels or ops),
  recorded by the GPU suite and `benchmarks/scheduler_costs.py` beside their figures;
- `link` / `comm_link`: two network namespaces joined by a rate-limited veth pair, and DDP trained
  across it per gradient communication method (`benchmarks/comm_link.py`; root).

The GPU suite is `autoprec.bench.gpu`. Targets are `autoprec.workload.Workload` objects: the CLI
passes the built-in ones or ``--workload module:function``; this package imports no workload.
"""

from ._common import BenchConfigError
from .models import DEFAULT_VARIANTS, BenchConfig, BenchResult, BenchRow, TargetCheck, run_bench
from .ops import OPS_COMPILE_VARIANTS, OPS_STEP_VARIANTS, CompileRow, OpsBenchConfig, OpsBenchResult, OpsRow, run_ops_bench
from .overhead import measure_overhead
from .ranking import RankingCheck, check_uniform_ranking

__all__ = [
    "BenchConfigError",
    "DEFAULT_VARIANTS",
    "BenchConfig",
    "BenchResult",
    "BenchRow",
    "TargetCheck",
    "run_bench",
    "OPS_COMPILE_VARIANTS",
    "OPS_STEP_VARIANTS",
    "CompileRow",
    "OpsBenchConfig",
    "OpsBenchResult",
    "OpsRow",
    "run_ops_bench",
    "measure_overhead",
    "RankingCheck",
    "check_uniform_ranking",
]
