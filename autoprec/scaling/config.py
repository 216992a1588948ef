"""Dynamic loss-scaling settings: `LossScaling` (`scaling.LossScaler`'s arguments), the defaults
stated once, and the checks both run. Invalid values raise `ScalingError` naming the argument."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..errors import ScalingError

# The defaults asked for in DESIGN.md ("Numbers worth knowing"); torch's GradScaler starts at 65536
# with the same factors and interval. Stated here once: `LossScaling` and `LossScaler` use them.
DEFAULT_INIT_SCALE = 4096.0
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000
# Megatron-LM's DynamicGradScaler floor: below 1 the scale no longer protects small gradients and
# persistent overflows mean the model, not the scale, is wrong.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_HYSTERESIS = 1  # back off on every overflow, as GradScaler does

FLOAT32_MAX = float(torch.finfo(torch.float32).max)



@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss-scaling settings: `LossScaler`'s arguments (``LossScaler(**asdict(cfg))``)."""

    init_scale: float = DEFAULT_INIT_SCALE
    growth_factor: float = DEFAULT_GROWTH_FACTOR
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    min_scale: float = DEFAULT_MIN_SCALE
    hysteresis: int = DEFAULT_HYSTERESIS


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_config(where: str, init_scale, growth_factor, backoff_factor, growth_interval, min_scale, hysteresis, max_events) -> None:
    def bad(name: str, value: Any, expected: str) -> ScalingError:
        return ScalingError(f"{where}({name}={value!r}): {name} must be {expected}")

    if not is_number(init_scale) or not 0 < init_scale <= FLOAT32_MAX:
        raise bad("init_scale", init_scale, "a finite number > 0 (the first loss scale, e.g. 4096.0)")
    if not is_number(growth_factor) or growth_factor <= 1:
        raise bad("growth_factor", growth_factor, "a finite number > 1 (the scale is multiplied by it after growth_interval clean steps)")
    if not is_number(backoff_factor) or not 0 < backoff_factor < 1:
        raise bad("backoff_factor", backoff_factor, "a number in (0, 1) (the scale is multiplied by it on overflow)")
    if not is_int(growth_interval) or growth_interval < 1:
        raise bad("growth_interval", growth_interval, "an int >= 1 (consecutive clean steps before the scale grows)")
    if not is_number(min_scale) or min_scale <= 0:
        raise bad("min_scale", min_scale, "a finite number > 0 (the floor the scale never goes below)")
    if min_scale > init_scale:
        raise ScalingError(f"{where}(init_scale={init_scale!r}, min_scale={min_scale!r}): min_scale must be <= init_scale")
    if not is_int(hysteresis) or hysteresis < 1:
        raise bad("hysteresis", hysteresis, "an int >= 1 (overflowing steps per growth interval before the scale backs off; 1 backs off at once)")
    if not is_int(max_events) or max_events < 0:
        raise bad("max_events", max_events, "an int >= 0 (how many overflow events to keep)")
