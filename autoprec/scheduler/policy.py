"""The precision policy: when a layer is promoted to a wider format and when it comes back.

Pure functions of a window's statistics and the policy's own `PolicyState`: they touch no module
and no device, so every rule is unit-tested without a training run. The scheduler keeps the
clock (when a window ends, when non-finite steps are counted) and applies the `PrecisionChange`s
they return; the TensorBoard training writer shows the same records.

- `window_triggers`: overflow / underflow beyond the thresholds in the plan's format (with the
  runtime's scaling), or an activation amax drift;
- `promotions`: one step up the ladder (8-bit and FP16 -> BF16 -> FP32); a layer whose gradients
  alone left their format's range (`backward_triggers`) takes a high-precision backward first
  (`takes_high_backward`: FP8, MXFP8 and NVFP4 layers keep their forward, ``grad_format`` FP32),
  as Transformer Engine's ``backward_override`` does for a whole recipe;
- `demotions`: back down after quiet windows, the wait doubling each time (hysteresis);
- `accuracy_promotions`, `saturation_actions`: what a planned step's check (`plan_checks`) acts
  on at once: a measured loss increase over the budget, an input grossly past its scale's range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from ..changes import PrecisionChange
from ..formats import Format, Granularity
from ..plan import LayerPrecision, Plan

if TYPE_CHECKING:
    from .config import Thresholds

__all__ = ["PolicyState", "wider_format", "takes_high_backward", "promotions", "window_triggers", "backward_triggers", "demotions", "accuracy_promotions",
           "saturation_actions"]

# A layer's history entry for a high-precision backward taken: this prefix, then the gradient
# format it had (a demotion gives that back).
_BACKWARD = "grad:"


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between windows, per layer (saved in scheduler checkpoints).

    ``history``: the formats a layer was promoted from, newest last (a demotion pops one; a
    high-precision backward taken: ``"grad:"`` and the gradient format it had);
    ``stable``: quiet windows since its last change; ``wait``: quiet windows it must see before
    its next demotion (doubles at each demotion: hysteresis); ``previous_amax``: its activation
    amax in the last window that saw one (for the drift rule).
    """

    history: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    stable: Mapping[str, int] = dataclasses.field(default_factory=dict)
    wait: Mapping[str, int] = dataclasses.field(default_factory=dict)
    previous_amax: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "stable": dict(self.stable),
            "wait": dict(self.wait),
            "previous_amax": dict(self.previous_amax),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PolicyState":
        return cls({k: tuple(v) for k, v in data["history"].items()}, dict(data["stable"]), dict(data["wait"]), dict(data["previous_amax"]))


def wider_format(fmt: Format, ladder: Sequence[Format]) -> Optional[Format]:
    """The next format up for a layer in ``fmt``: 8-bit formats and FP16 go to the first of
    ``ladder`` (BF16 then FP32, those within the bounds and runnable: BF16 has FP32's range),
    BF16 to FP32; None when there is nothing wider."""
    if fmt is Format.FP16 or fmt.bits < 16:
        return next(iter(ladder), None)
    return Format.FP32 if fmt is Format.BF16 and Format.FP32 in ladder else None


def takes_high_backward(lp: LayerPrecision) -> bool:
    """Whether a layer in ``lp`` can keep its forward and run its backward in high precision
    (``grad_format`` FP32) on the products it runs now: FP8 per tensor or row, MXFP8 and NVFP4
    with low-precision gradients (block-scaled FP8's kernels take E4M3 gradients only)."""
    if lp.format is Format.NVFP4:
        return lp.grad_format is Format.NVFP4
    return lp.format.is_fp8 and lp.grad_format.is_fp8 and lp.scaling.granularity is not Granularity.BLOCK


def promotions(
    plan: Plan, reasons: Mapping[str, str], state: PolicyState, step: int, ladder: Sequence[Format], backward: Iterable[str] = ()
) -> tuple[list[PrecisionChange], PolicyState]:
    """Promote each layer of ``reasons`` (fqn -> why) one step up `wider_format`'s ladder;
    layers already at the top stay. Those in ``backward`` (their gradients alone triggered,
    `backward_triggers`) that `takes_high_backward` keep their format and take FP32 gradients
    instead. Returns the changes and the state that remembers them."""
    history = {k: tuple(v) for k, v in state.history.items()}
    stable = dict(state.stable)
    changes = []
    backward = set(backward)
    for fqn, reason in reasons.items():
        lp = plan.layers[fqn]
        current = lp.format
        if fqn in backward and takes_high_backward(lp):
            history[fqn] = history.get(fqn, ()) + (_BACKWARD + lp.grad_format.value,)
            stable[fqn] = 0
            changes.append(PrecisionChange(step, fqn, current, current, reason, lp.grad_format, Format.FP32))
            continue
        wider = wider_format(current, ladder)
        if wider is None:
            continue
        history[fqn] = history.get(fqn, ()) + (current.value,)
        stable[fqn] = 0
        changes.append(PrecisionChange(step, fqn, current, wider, reason))
    return changes, dataclasses.replace(state, history=history, stable=stable)


def window_triggers(
    plan: Plan, layers: Sequence[str], report: Any, nonfinite: Mapping[str, int], state: PolicyState, thresholds: "Thresholds"
) -> tuple[dict[str, str], dict[str, dict[str, float]], PolicyState]:
    """Judge one window's statistics: ``(triggers, counts, state)``.

    ``report``: the window's `profiling.watch.WatchReport` (None: nothing watched): per layer
    and tensor kind, the fractions that overflowed / underflowed the format the plan casts it
    to (with the runtime's scaling) and the amax per sampled step. ``triggers``: fqn -> why it
    must be promoted, for layers beyond ``thresholds.overflow`` or ``thresholds.underflow``, or
    whose activation amax moved by more than ``thresholds.amax_drift`` times since the last
    window (FP32 layers are never watched, so never triggered). ``counts``: per layer the
    fractions and non-finite steps judged (for the training log).
    """
    triggers: dict[str, str] = {}
    counts: dict[str, dict[str, float]] = {}
    previous_amax = dict(state.previous_amax)
    for fqn in layers:
        row = {"nonfinite": float(nonfinite.get(fqn, 0))}
        watched = report.layers.get(fqn, {}) if report is not None else {}
        for kind, tw in watched.items():
            row[f"overflow_{kind}"], row[f"underflow_{kind}"] = tw.overflow, tw.underflow
            if tw.overflow > thresholds.overflow:
                triggers.setdefault(fqn, f"{tw.overflow:.2%} of {kind} values overflow {tw.fmt.value}")
            elif tw.underflow > thresholds.underflow:
                triggers.setdefault(fqn, f"{tw.underflow:.2%} of {kind} values underflow {tw.fmt.value}")
        act = watched.get("activation")
        finite = [a for a in (act.amax if act is not None else ()) if math.isfinite(a) and a > 0]
        if finite:
            amax = max(finite)
            before = previous_amax.get(fqn)
            previous_amax[fqn] = amax
            if before and plan.layers[fqn].format is not Format.FP32 and max(amax / before, before / amax) > thresholds.amax_drift:
                triggers.setdefault(fqn, f"activation amax drifted {before:.3g} -> {amax:.3g}")
        counts[fqn] = row
    return triggers, counts, dataclasses.replace(state, previous_amax=previous_amax)


def backward_triggers(triggers: Iterable[str], report: Any, thresholds: "Thresholds") -> set[str]:
    """The layers of ``triggers`` (`window_triggers`) whose gradients alone were beyond the
    thresholds in ``report``: no activation or weight out of range, no activation drift (a
    drift triggers on the activation's amax, which no backward change helps)."""
    out = set()
    for fqn in triggers:
        watched = report.layers.get(fqn, {}) if report is not None else {}
        over = {kind for kind, tw in watched.items() if tw.overflow > thresholds.overflow or tw.underflow > thresholds.underflow}
        if over == {"grad"}:
            out.add(fqn)
    return out


def demotions(triggered: Iterable[str], state: PolicyState, step: int, stable_windows: int, current: Mapping[str, Format],
              skipped_steps: int = 0, grads: Mapping[str, Format] = {}) -> tuple[list[PrecisionChange], PolicyState]:
    """After a window: every promoted layer not in ``triggered`` counts one more quiet window;
    one that has waited its ``wait`` (``stable_windows`` the first time) goes back to the format
    it was promoted from (a high-precision backward: to the gradient format it had), and its
    next wait doubles (a layer that keeps flapping waits longer each time). ``current``: fqn ->
    the format it runs in now; ``grads``: fqn -> its gradient format now (a backward given back
    to the format it has already records no change).

    A window with ``skipped_steps`` (optimizer steps skipped for non-finite gradients or loss)
    is never quiet: its statistics come from steps that did not train, and an inf in every
    batch (which no format fixes) must not read as "stable". No layer is demoted after it and
    every promoted layer's run of quiet windows starts again."""
    triggered = set(triggered)
    history = {k: tuple(v) for k, v in state.history.items()}
    stable, wait = dict(state.stable), dict(state.wait)
    changes = []
    for fqn, stack in state.history.items():
        if skipped_steps and stack:
            stable[fqn] = 0
            continue
        if not stack or fqn in triggered:
            continue
        stable[fqn] = stable.get(fqn, 0) + 1
        if stable[fqn] >= wait.get(fqn, stable_windows):
            history[fqn] = tuple(stack[:-1])
            stable[fqn] = 0
            waited = wait.get(fqn, stable_windows)
            wait[fqn] = waited * 2
            why = f"stable for {waited} windows"
            if stack[-1].startswith(_BACKWARD):
                back, now = Format.parse(stack[-1][len(_BACKWARD):]), grads.get(fqn, Format.FP32)
                if back is not now:
                    changes.append(PrecisionChange(step, fqn, current[fqn], current[fqn], why, now, back))
            else:
                changes.append(PrecisionChange(step, fqn, current[fqn], Format.parse(stack[-1]), why))
    return changes, dataclasses.replace(state, history=history, stable=stable, wait=wait)


def accuracy_promotions(plan: Plan, increase: float, allowed: float) -> dict[str, str]:
    """The layers to promote when the measured loss ``increase`` exceeds the ``allowed`` one
    (both relative, as `plan_checks` measures them):
    the lowered layers (any format but FP32) by their predicted loss (`Plan.predicted`'s per
    layer), as many as carry the excess's share of their predicted total, ``(increase - allowed)
    / increase``, at least one; without predictions (a plan made by hand) that share of the
    lowered layers, the narrowest formats first. fqn -> why; empty when
    nothing is over or every layer is FP32."""
    if not increase > allowed:
        return {}
    lowered = [fqn for fqn, lp in plan.layers.items() if lp.format is not Format.FP32]
    predicted = plan.predicted.get("layers", {}) if plan.predicted else {}

    def loss(fqn: str) -> float:
        value = predicted.get(fqn, {}).get("loss") if isinstance(predicted.get(fqn), Mapping) else None
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0

    ranked = sorted(lowered, key=lambda f: (-loss(f), plan.layers[f].format.bits, lowered.index(f)))
    total = sum(loss(f) for f in ranked)
    share = (increase - allowed) / increase
    why = f"measured loss increase {increase:.2%} over the allowed {allowed:.2%}"
    if total <= 0:  # no prediction to weigh them by: that share of the layers, the narrowest first
        return {fqn: why for fqn in ranked[:max(1, math.ceil(share * len(ranked) - 1e-9))]}  # (an exact product rounded up by a bit)
    chosen: dict[str, str] = {}
    carried = 0.0
    for fqn in ranked:
        chosen[fqn] = why
        carried += loss(fqn)
        if carried >= share * total:
            break
    return chosen


def saturation_actions(saturation: Mapping[str, float], threshold: float, recalibrated: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(recalibrate, promote)``, fqn -> why, for the layers whose input went more than
    ``threshold`` times past its scale's range (``saturation``: the ratios a check read; a
    non-finite one is a non-finite input, the loss scaler's): recalibrated the first time, promoted
    when already ``recalibrated`` (in this window) and past it again."""
    again = set(recalibrated)
    recalibrate: dict[str, str] = {}
    promote: dict[str, str] = {}
    for fqn, ratio in saturation.items():
        if math.isfinite(ratio) and ratio > threshold:
            why = f"input amax {ratio:.3g}x the range its scale covers"
            (promote if fqn in again else recalibrate)[fqn] = why
    return recalibrate, promote
