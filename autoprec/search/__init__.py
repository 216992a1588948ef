"""Searching per-layer formats: the space, the k best plans of the additive proxy (exact), the
planning pipeline (`pipeline.propose_plans`), the measured stage (an Optuna study).

Owns: `space` (units, choices, budgets), `exact` (the integer program), `planner` / `pipeline`
(from costs and sensitivity to proposed plans), `units` (off-path work weighed in model passes),
`in_run` (the search spread over training steps) with `probes` (its probe steps' plans) and
`memory_margin` (the margin its rounds learn from measured bytes), `tensor_parallel` (what a
sharded layer may take), `stages` (one plan for a pipeline's stages, each measured on its rank), `candidate_runs` / `trials` / `study` /
`refine` (timing candidates, the Optuna study, the learning sampler; their noise is the shared
`autoprec.noise`). The job that
drives it offline is `autoprec.job`. May import the shared basics, `runtime`, `profiling`,
`scaling`, `costs` and `sensitivity`.
"""

from .exact import k_best, smallest_reachable, solve_exact
from .solution import Solution
from .budgets import Budgets
from .space import DEFAULT_CANDIDATES, Block, Choice, LayerRules, MemoryPart, SearchSpace, Unit, formats_for_precision
from .study import open_storage

__all__ = [
    "Budgets",
    "Choice",
    "LayerRules",
    "SearchSpace",
    "Unit",
    "Block",
    "MemoryPart",
    "DEFAULT_CANDIDATES",
    "formats_for_precision",
    "Solution",
    "solve_exact",
    "k_best",
    "smallest_reachable",
    "open_storage",
]
