"""Dynamic loss scaling: `LossScaler` (a ``torch.amp.GradScaler`` with a floor, hysteresis and
per-layer attribution of non-finite gradients), its settings and the attribution.

Owns: `scaler` (`LossScaler`, on torch's two fused ops), `config` (`LossScaling` and the
defaults, their checks), `nonfinite` (which layers' gradients or outputs went non-finite: the
fused check, the attribution, the per-layer output watch). May import the shared basics and
`runtime`; imported by `sensitivity` (a scale default) and the scheduler.
"""

from .config import (DEFAULT_BACKOFF_FACTOR, DEFAULT_GROWTH_FACTOR, DEFAULT_GROWTH_INTERVAL, DEFAULT_HYSTERESIS, DEFAULT_INIT_SCALE,
                     DEFAULT_MIN_SCALE, LossScaling)
from .nonfinite import OutputWatch
from .scaler import LossScaler, ScalingError

__all__ = [
    "ScalingError", "LossScaler", "LossScaling", "OutputWatch", "DEFAULT_INIT_SCALE", "DEFAULT_GROWTH_FACTOR",
    "DEFAULT_BACKOFF_FACTOR", "DEFAULT_GROWTH_INTERVAL", "DEFAULT_MIN_SCALE", "DEFAULT_HYSTERESIS",
]
