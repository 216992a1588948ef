"""autoprec: per-layer training precision for PyTorch, searched and applied for real."""

from ._version import __version__ as __version__

import importlib

from .errors import (
    AutoprecError,
    BenchConfigError,
    CostModelError,
    DistributedError,
    FormatError,
    GpuBenchError,
    InfeasibleBudgetError,
    IntegrationError,
    ModelCallError,
    MonitoringError,
    OpCountError,
    PlanError,
    ProblemsError,
    ProfileError,
    RuntimeStateError,
    ScalingError,
    SearchError,
    SensitivityError,
    SettingsError,
    UserCodeError,
    WorkloadError,
)
from .formats import Format, Granularity
from .plan import Calibration, CalibrationMethod, LayerPrecision, Plan, Reduction, Scaling, ScalingMode
from .blocks import find_blocks
from .runtime import EmulationWarning, PlanRuntime, apply_plan
from .workload import TrainStep, Workload, load_workload

# Heavier parts load on first use (Optuna, scipy, TensorBoard, the sensitivity machinery).
_LAZY = {
    "LayerProfiler": "profiling",
    "Profile": "profiling",
    "CostModel": "costs",
    "estimate_sensitivity": "sensitivity",
    "measure_sensitivity": "sensitivity",
    "SearchSpace": "search",
    "Budgets": "search",
    "LayerRules": "search",
    "solve_exact": "search",
    "load_job": "job",
    "run_job": "job",
    "DynamicPrecisionScheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "LossScaling": "scaling",
    "Thresholds": "scheduler",
    "LossScaler": "scaling",
    "OutputWatch": "scaling",
    "CommSettings": "comm",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")


__all__ = [
    # formats
    "Format",
    "Granularity",
    # plan
    "Plan",
    "LayerPrecision",
    "Scaling",
    "ScalingMode",
    "Reduction",
    "Calibration",
    "CalibrationMethod",
    "find_blocks",
    # runtime
    "apply_plan",
    "PlanRuntime",
    "EmulationWarning",
    # profiling, sensitivity, costs, search (lazy)
    "LayerProfiler",
    "Profile",
    "CostModel",
    "estimate_sensitivity",
    "measure_sensitivity",
    "SearchSpace",
    "Budgets",
    "LayerRules",
    "solve_exact",
    "load_job",
    "run_job",
    # training (lazy)
    "DynamicPrecisionScheduler",
    "SchedulerConfig",
    "LossScaling",
    "Thresholds",
    "LossScaler",
    "OutputWatch",
    "CommSettings",
    # workloads
    "Workload",
    "TrainStep",
    "load_workload",
    # errors: every one derives from AutoprecError (and the builtin it fits)
    "AutoprecError",
    "ProblemsError",
    "FormatError",
    "PlanError",
    "ProfileError",
    "RuntimeStateError",
    "DistributedError",
    "SettingsError",
    "SearchError",
    "InfeasibleBudgetError",
    "SensitivityError",
    "CostModelError",
    "ScalingError",
    "ModelCallError",
    "MonitoringError",
    "WorkloadError",
    "UserCodeError",
    "BenchConfigError",
    "OpCountError",
    "GpuBenchError",
    "IntegrationError",
]
