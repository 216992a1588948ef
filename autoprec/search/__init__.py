"""Searching per-layer formats: the space, the k best plans of the additive proxy (exact), the
planning pipeline (`pipeline.propose_plans`), the measured stage (an Optuna study).

`run_proxy_study` (a TPE study on the additive table) is kept for library users; the pipeline
does not run it.
"""

from .exact import Solution, k_best, smallest_reachable, solve_exact
from .space import DEFAULT_CANDIDATES, Budgets, Choice, LayerRules, SearchSpace, Unit, formats_for_precision
from .study import ProxyResult, open_storage, run_proxy_study

__all__ = [
    "Budgets",
    "Choice",
    "LayerRules",
    "SearchSpace",
    "Unit",
    "DEFAULT_CANDIDATES",
    "formats_for_precision",
    "Solution",
    "solve_exact",
    "k_best",
    "smallest_reachable",
    "ProxyResult",
    "open_storage",
    "run_proxy_study",
]
