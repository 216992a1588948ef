"""Searching per-layer formats: the space, the exact optimum of the additive proxy, the Optuna study."""

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
