"""autoprec: per-layer training precision for PyTorch, searched and applied for real."""

__version__ = "0.1.0"

from .errors import AutoprecError, FormatError, PlanError, RuntimeStateError  # noqa: E402
from .formats import AmaxHistory, Format, Granularity  # noqa: E402
from .plan import Calibration, CalibrationMethod, LayerPrecision, Plan, Scaling, ScalingMode  # noqa: E402
from .runtime import EmulationWarning, PlanRuntime, apply_plan  # noqa: E402

__all__ = [
    # formats
    "Format",
    "Granularity",
    "AmaxHistory",
    # plan
    "Plan",
    "LayerPrecision",
    "Scaling",
    "ScalingMode",
    "Calibration",
    "CalibrationMethod",
    # runtime
    "apply_plan",
    "PlanRuntime",
    "EmulationWarning",
    # errors
    "AutoprecError",
    "FormatError",
    "PlanError",
    "RuntimeStateError",
]
