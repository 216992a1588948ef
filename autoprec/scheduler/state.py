"""The scheduler's checkpoint schema: its version, its fields and their checks, as pure functions.

`check_state` refuses a ``DynamicPrecisionScheduler.state_dict()`` of another version, one
missing keys or one with a field of the wrong type or sign; `check_state_fits` one saved for
another model (layer names, parameter shapes) or whose plan runs a format the scheduler's
settings exclude. Both raise one `RuntimeStateError` line before anything is restored, and
change nothing. Costs: a walk of the model's modules and one `LayerInfo` per saved layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Optional

import torch
import torch.nn as nn

from ..coverage import LayerInfo, layer_name
from ..errors import RuntimeStateError
from ..plan import Plan

if TYPE_CHECKING:
    from .config import SchedulerConfig

__all__ = ["LATER_STATE", "STATE_FIX", "STATE_VERSION", "check_state", "check_state_fits"]

STATE_VERSION = 2  # 2: the example and captured inputs are ModelCall states (args and kwargs)

STATE_FIX = "pass the whole dict that DynamicPrecisionScheduler.state_dict() returned"


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _optional_dict(v: Any) -> bool:
    return v is None or isinstance(v, Mapping)


# The scheduler state's fields, each with its check and what it expects: a hand-edited or
# damaged checkpoint is refused naming the field before anything is restored.
STATE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_count, "a step count, an integer >= 0"),
    "window_start": (_count, "a step count, an integer >= 0"),
    "loss_count": (_count, "a count, an integer >= 0"),
    "window_skipped": (_count, "a count, an integer >= 0"),
    "search_failures": (_count, "a count, an integer >= 0"),
    "retry_at": (lambda v: v is None or _count(v), "None or a step, an integer >= 0"),
    "loss_sum": (lambda v: v is None or (isinstance(v, torch.Tensor) and v.shape == (2,)), "None or a tensor of (loss sum, finite count)"),
    "meter_next": (lambda v: isinstance(v, bool), "True or False"),
    "scaler_enabled": (lambda v: isinstance(v, bool), "True or False"),
    "pipeline_stage": (lambda v: isinstance(v, bool), "True or False"),
    "stage": (lambda v: v is None or (isinstance(v, Mapping) and _optional_dict(v.get("plan"))), "None or a dict with 'index' and 'plan' (None or a plan as a dict)"),
    "fingerprint": (lambda v: isinstance(v, Mapping), "a dict of layers"),
    "window_nonfinite": (lambda v: isinstance(v, Mapping) and all(_count(n) for n in v.values()), "a dict of layer -> count >= 0"),
    "changes": (lambda v: isinstance(v, (list, tuple)), "a list of changes"),
    "captured": (lambda v: isinstance(v, (list, tuple)), "a list of captured calls"),
    "plan": (_optional_dict, "None or a plan as a dict"),
    "searched_plan": (_optional_dict, "None or a plan as a dict"),
    "runtime": (_optional_dict, "None or PlanRuntime.state_dict()"),
    "scaler": (lambda v: isinstance(v, Mapping), "LossScaler.state_dict()"),
    "profiler": (lambda v: v is None or (isinstance(v, Mapping) and _count(v.get("window")) and "state" in v), "None or a dict with 'window' (>= 1) and 'state'"),
    "watch": (lambda v: v is None or (isinstance(v, Mapping) and _count(v.get("window")) and "state" in v), "None or a dict with 'window' (>= 1) and 'state'"),
    "history": (lambda v: isinstance(v, Mapping), "a dict of layer -> formats"),
    "stable": (lambda v: isinstance(v, Mapping) and all(_count(n) for n in v.values()), "a dict of layer -> count >= 0"),
    "wait": (lambda v: isinstance(v, Mapping) and all(_count(n) for n in v.values()), "a dict of layer -> count >= 0"),
    "previous_amax": (lambda v: isinstance(v, Mapping), "a dict of layer -> amax"),
    "search": (_optional_dict, "None or the search in progress (TrainingSearch.state_dict())"),
    "known_times": (lambda v: isinstance(v, Mapping) and all(isinstance(t, (int, float)) for t in v.values()), "a dict of 'role|format' -> seconds"),
    "checks": (lambda v: v is None or (isinstance(v, Mapping) and _count(v.get("count"))), "None or the planned checks' state (sum, reference, count, recalibrated)"),
    "comm": (lambda v: v is None or isinstance(v, Mapping), "None or the gradient communication's error feedback (autoprec.comm)"),
    "measured_bytes": (lambda v: v is None or _count(v), "None or a count of bytes, an integer >= 0"),
    "due_search": (lambda v: v is None or (isinstance(v, Mapping) and {"profile", "baseline_loss"} <= set(v)),
                   "None or a window's search due at the next step ('profile', 'baseline_loss')"),
}


# Fields added within state version 2, with the value a state saved without them means.
LATER_STATE: dict[str, Any] = {"window_skipped": 0, "search_failures": 0, "retry_at": None, "search": None, "known_times": {}, "watch": None,
                               "checks": None, "comm": None, "due_search": None, "measured_bytes": None, "pipeline_stage": False,
                               "stage": None}


def check_state(state: Any, expected_keys: Collection[str]) -> None:
    """`RuntimeStateError` unless ``state`` is a state of this version holding ``expected_keys``
    (the fields of `LATER_STATE` may be absent), each field of the right type and sign, saved
    after the scheduler was bound."""
    if not isinstance(state, Mapping):
        raise RuntimeStateError(f"load_state_dict({type(state).__name__}): expected a dict; {STATE_FIX} (torch.load a saved one first)")
    if not state:
        raise RuntimeStateError(f"load_state_dict(): the state is empty; {STATE_FIX}")
    if state.get("version") != STATE_VERSION:
        raise RuntimeStateError(f"scheduler state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by another autoprec")
    missing = sorted(set(expected_keys) - set(state) - set(LATER_STATE))
    if missing:
        raise RuntimeStateError(f"load_state_dict(): the state lacks {', '.join(map(repr, missing))}; {STATE_FIX}")
    for field, (ok, expects) in STATE_FIELDS.items():
        if field in LATER_STATE and field not in state:
            continue
        if not ok(state[field]):
            raise RuntimeStateError(f"load_state_dict(): state[{field!r}] = {state[field]!r:.60} is not {expects}; {STATE_FIX}")
    if state["window_start"] > state["step"]:
        raise RuntimeStateError(f"load_state_dict(): state['window_start'] = {state['window_start']} is after state['step'] = {state['step']}; {STATE_FIX}")
    if state["example"] is None:
        raise RuntimeStateError("load_state_dict(): the state was saved before the scheduler was bound; there is nothing to restore")


def check_state_fits(state: Mapping[str, Any], model: nn.Module, config: "SchedulerConfig", fixed_plan: Optional[Plan]) -> None:
    """`RuntimeStateError` when ``state`` (checked by `check_state`) was saved for a model other
    than ``model`` (layer names or parameter shapes, compared without a forward) or, unless the
    scheduler runs ``fixed_plan``, its plan runs a format ``config`` (`SchedulerConfig`) excludes."""
    modules = dict(model.named_modules())
    for fqn, raw in state["fingerprint"].items():
        saved = LayerInfo.from_dict(raw)
        if fqn not in modules:
            raise RuntimeStateError(f"load_state_dict(): the state was saved for a model with a layer {fqn!r} this {type(model).__name__} lacks; load it into the model it was saved from")
        actual = dict(LayerInfo.of(modules[fqn], saved.ops).params)
        if actual != dict(saved.params):
            raise RuntimeStateError(
                f"load_state_dict(): layer {layer_name(fqn, model)!r} has parameter shapes {actual} here but {dict(saved.params)} in the state; "
                "load it into the model it was saved from"
            )
    if state["plan"] is None or fixed_plan is not None:
        return
    allowed = set(config.candidates)
    for fqn, lp in Plan.from_dict(state["plan"], "the saved plan").layers.items():
        if lp.format not in allowed:
            raise RuntimeStateError(
                f"load_state_dict(): the saved plan runs {layer_name(fqn, model)!r} in {lp.format.value}, which this scheduler's settings "
                f"(min_precision={config.min_precision}, max_precision={config.max_precision}, formats {', '.join(f.value for f in config.candidates)}) "
                "exclude; create the scheduler with the settings the state was saved with"
            )
