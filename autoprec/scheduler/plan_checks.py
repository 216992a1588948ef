"""What a planned step checks of the plan in force, at once rather than at the window's end:
`PlanChecks`.

A window's review (`plan_keeper.PlanKeeper.review_window`) judges statistics gathered over its
last steps; two things cannot wait for it. Both are checked on every ``sample_every``-th planned
step of a dynamic scheduler (counted from the window's start, the first included), and acted on
after that step's optimizer step:

- **Saturation** (a gross drift): a layer whose inputs are scaled from the past reads how far past
  its scale's range its input went (`runtime.PlanRuntime.saturation`, off the amaxes the
  quantizers take anyway: nothing added to a forward): a frozen INT8 calibration's on the check
  step's forward, delayed FP8 scaling's on any forward since the last check (its history holds
  them; it heals in a step by itself, so a jump there is named rather than a lasting harm).
  Past ``thresholds.saturation`` every layer is recalibrated at once, and a layer is promoted if
  it saturates again in the same window (`policy.saturation_actions`). A drift that lasts,
  starting at any step, is acted on at the next check step: at most ``sample_every`` steps (8 by
  default) run damaged.
- **The accuracy budget, measured**: on a check step the model's first call (a micro-batch's)
  is captured (its inputs, isolated, and the RNG state, so dropout draws the same masks), and
  after its backward the same call runs once more without gradients in the window's precision
  (FP32, or BF16 / FP16 autocast). The measured increase is relative: the planned loss minus that
  reference loss, over the reference loss, when the model returns its loss; else the first-order
  change of the loss through the model's output, ``<dL/dy, y_planned - y_reference>`` (the
  output's gradient, unscaled), over the loss backpropagated (so a loss the framework divides by
  its micro-batches measures alike). Its mean over the checks since the plan last changed (two
  at least) over the relative increase the budget allows promotes the layers with the largest
  predicted loss (`policy.accuracy_promotions`). Logged when over, and written to TensorBoard
  (``accuracy/measured_loss_increase``, ``accuracy/allowed_loss_increase``, both relative).

**On a pipeline stage** (`pipeline_stage`) no stage sees both the whole model's output and its
input: each stage measures its own term of the linearised change, ``<dL/dy_s, y_s planned -
y_s reference>`` on its first captured micro-batch (``y_s``: the stage's output, its gradient the
one the schedule's backward brought; the reference run on the input the plan gave the stage), the
last stage adds that micro-batch's loss, and the ranks sum them (a stage's data-parallel copies
averaged): by the chain rule the stages' terms add up to the whole model's first-order change.
The gradients that reach an earlier stage went through the plan's backward, so its term carries
that backward's rounding too: a plan whose change is at the level of rounding noise reads as
noise around zero, as the whole model's linearised check does.

Costs, on a check step only: a forward pre-hook on the model; one forward without gradients
(about a third of a step) when an accuracy budget is set; one host read of the losses and the
saturation ratios (after the scaler's own sync, so nothing waits longer). Under
``torch.distributed`` the figures are reduced across ranks first (two all-reduces of a few
floats), so every rank acts alike.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.nn as nn

from ..calls import ModelCall, fresh, loss_of, prediction_of
from ..errors import ModelCallError
from ..formats import Format
from ..runtime.recompute import training_forward
from .policy import accuracy_promotions, saturation_actions

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from ..plan import Plan
    from ..runtime import PlanRuntime
    from .config import SchedulerConfig

__all__ = ["CheckFigures", "PlanChecks"]

logger = logging.getLogger(__name__)

MIN_CHECKS = 2  # accuracy checks averaged before the measured increase can promote a layer


class CheckFigures:
    """One check's readings: the saturation per layer (ratio of input amax to the scale's range)
    and, with an accuracy check, the mean measured loss increase since the plan last changed
    (relative to the reference loss: 0.01 is 1 %), the checks it averages and the relative
    increase allowed."""

    def __init__(self, saturation: dict[str, float], increase: Optional[float], checks: int, allowed: Optional[float]):
        self.saturation, self.increase, self.checks, self.allowed = saturation, increase, checks, allowed

    @property
    def over_budget(self) -> bool:
        return self.increase is not None and self.allowed is not None and self.checks >= MIN_CHECKS and self.increase > self.allowed


class PlanChecks:
    """The checks of one dynamic scheduler (module docstring). `bind` gives the model; each
    planned step, `enter_step` (inside the step's context) captures the call when the step is
    due, `note_loss` sees the losses backpropagated, `measure` runs the reference before the
    optimizer step, `read` gives the figures after it; a new plan restarts the average."""

    def __init__(self, config: "SchedulerConfig"):
        self.config = config
        self._model: Optional[nn.Module] = None
        # This check step's first model call (its micro-batch's): (the call, cpu rng, device rng),
        # the loss it returned (the exact check) or its prediction and that prediction's
        # gradient (the linearised check) with the loss backpropagated through it.
        self._call: Optional[tuple] = None
        self._planned: Optional[torch.Tensor] = None
        self._output: Optional[torch.Tensor] = None
        self._grad: Optional[torch.Tensor] = None
        self._user_loss: Optional[torch.Tensor] = None
        self._pending: Optional[torch.Tensor] = None  # [relative increase, reference loss] of this step
        self._sum = 0.0  # relative increases measured since the plan changed
        self._reference = 0.0  # reference losses since then (an absolute budget's denominator)
        self._count = 0
        self._plan: "Optional[Plan]" = None  # the plan the running mean is of
        self._stage = False  # the model is a pipeline stage: its term of the change, summed over the stages (module docstring)
        self.recalibrated: set[str] = set()  # layers recalibrated for saturation in this window
        self.last: Optional[CheckFigures] = None

    def bind(self, model: nn.Module, stage: bool = False) -> None:
        """The model checked; ``stage``: a pipeline stage's (module docstring)."""
        self._model, self._stage = model, stage

    def due(self, step: int, window_start: int) -> bool:
        """Whether the step after ``step`` done steps is a check step (every ``sample_every``-th
        planned one, the window's first included)."""
        return self.config.dynamic and (step - window_start) % self.config.sample_every == 0

    def wants_accuracy(self, plan: "Plan") -> bool:
        """Whether a check step measures the loss increase: ``plan`` or the settings set an
        accuracy budget."""
        return self.config.accuracy_budget is not None or isinstance((plan.budgets or {}).get("accuracy"), (int, float))

    def eager(self, plan: "Plan") -> bool:
        """Whether a check step's forward must run eagerly around a compiled model: it captures
        the call (an accuracy budget), or reads a frozen INT8 calibration's last input amax, which
        compiled code does not keep."""
        return self.wants_accuracy(plan) or any(lp.format is Format.INT8 for lp in plan.layers.values())

    def allowed(self, plan: "Plan") -> Optional[float]:
        """The relative loss increase ``plan`` allows: its budget as the search set it (relative,
        or absolute over the checks' mean reference loss), else the settings'; None without an
        accuracy budget (or an absolute one before any check)."""
        budgets = plan.budgets or {}
        budget, relative = budgets.get("accuracy"), budgets.get("accuracy_relative", True)
        if not isinstance(budget, (int, float)) or not math.isfinite(budget):
            budget, relative = self.config.accuracy_budget, self.config.accuracy_relative
        if budget is None:
            return None
        if relative:
            return float(budget)
        return float(budget) / abs(self._reference / self._count) if self._count and self._reference else None

    # -- on a check step ------------------------------------------------------------------------

    def enter_step(self, stack: contextlib.ExitStack, accuracy: bool) -> None:
        """A check step's context: with ``accuracy``, capture the model's call as it starts, and
        its output as it ends (hooks removed with the context)."""
        if not accuracy or self._model is None:
            return
        for handle in (self._model.register_forward_pre_hook(self._capture, with_kwargs=True),
                       self._model.register_forward_hook(self._observe_output)):
            stack.callback(handle.remove)

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not training_forward() or self._call is not None:
            return  # an evaluation forward, a pipeline's metadata inference, or a second call of the model in this step
        device = next(module.parameters()).device
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        # Objects the forward changes (a KV cache) as they were, their tensors detached (`ModelCall.first`).
        self._call = (ModelCall(*fresh((args, kwargs), torch.Tensor.detach)), torch.get_rng_state(), cuda_rng)

    def _observe_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The captured call's output: its loss when the model returns one (the exact check), else
        its prediction, whose gradient is hooked (the linearised check)."""
        if self._call is None or not torch.is_grad_enabled() or self._planned is not None or self._output is not None:
            return
        try:
            loss = loss_of(output)
        except ModelCallError:
            loss = None
        if loss is not None and loss.dim() == 0:
            self._planned = loss.detach().float()
            return
        try:
            y = prediction_of(output)
        except ModelCallError:
            self._call = None  # nothing to compare: no check this step
            return
        if y.requires_grad:
            self._output = y.detach()
            y.register_hook(self._keep_grad)

    def _keep_grad(self, grad: torch.Tensor) -> None:
        if self._grad is None:
            self._grad = grad.detach()

    def note_loss(self, loss: torch.Tensor) -> None:
        """A loss about to be backpropagated (`DynamicPrecisionScheduler.scale`): the first one
        after the captured call is what its prediction's gradient is of, in the user's units
        (divided by the micro-batches, as Lightning and the HF Trainer do)."""
        if self._output is not None and self._user_loss is None:
            self._user_loss = loss.detach().float()

    def measure(self, window_format: Format, loss_scale: Any) -> None:
        """Before the optimizer step of a check step: the captured call once more without
        gradients in ``window_format`` (the plan's runtime is not active now), the relative loss
        increase kept on the device. ``loss_scale``: the scale the output gradient carries. No
        host sync."""
        call, planned, output, grad, user_loss = self._call, self._planned, self._output, self._grad, self._user_loss
        self._call = self._planned = self._output = self._grad = self._user_loss = None
        if call is None or self._model is None or (planned is None and (grad is None or (user_loss is None and not self._stage))):
            return  # nothing captured, or a prediction that took no gradient
        model_call, cpu_rng, cuda_rng = call
        device = next(self._model.parameters()).device
        autocast = (torch.autocast(device.type, dtype=window_format.dtype) if window_format in (Format.BF16, Format.FP16)
                    else contextlib.nullcontext())
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            reference = model_call(self._model)
        if planned is not None:
            ref_loss = loss_of(reference).detach().float()
            increase = planned - ref_loss
        elif grad is not None and output is not None and (user_loss is not None or self._stage):
            y_ref = prediction_of(reference).float()
            scale = loss_scale if loss_scale is not None else 1.0
            increase = (grad.float() * (output.float() - y_ref)).sum() / scale
            if self._stage:  # this stage's term and, on the last, the loss: summed over the stages in `read`
                self._pending = torch.stack([increase.reshape(()), (user_loss if user_loss is not None else torch.zeros_like(increase)).reshape(())])
                return
            if user_loss is None:
                return
            ref_loss = user_loss - increase
        else:
            return
        self._pending = torch.stack([(increase / ref_loss.abs()).reshape(()), ref_loss.reshape(())])

    def read(self, runtime: "Optional[PlanRuntime]", plan: "Plan", agreement: "Optional[RankAgreement]") -> CheckFigures:
        """After the optimizer step of a check step: the saturation ratios (`PlanRuntime.saturation`)
        and this step's measured increase, one host read (reduced across ranks first: ratios
        maxed, increases averaged); the running mean updated, afresh for a new ``plan``. The
        figures are `last` too."""
        pending, self._pending = self._pending, None
        peaks = runtime.saturation(self.config.sample_every) if runtime is not None else {}
        # One ratio per layer of the plan, -1 where this rank has none (a layer not run yet, a
        # calibration not frozen yet): the ranks' vectors must have one length whatever each saw,
        # or their all-reduces would pair up wrongly. A ratio is >= 0.
        names = sorted(plan.layers)
        device = next(iter(peaks.values())).device if peaks else (pending.device if pending is not None else torch.device("cpu"))
        absent = torch.full((), -1.0, device=device)
        ratios = torch.stack([peaks[n].float() if n in peaks else absent for n in names]) if names else torch.zeros(0, device=device)
        measured = pending.to(device) if pending is not None else torch.full((2,), math.nan, device=device)
        if agreement is not None:
            ratios, measured = agreement.reduce_checks(ratios, measured)
        values = torch.cat([ratios, measured]).tolist()
        saturation = {n: v for n, v in zip(names, values[: len(names)]) if not v < 0}  # NaN (a non-finite input) stays
        increase, reference = values[len(names):]
        if self._stage:  # the stages' terms summed, and the loss: the whole model's linearised change
            change, loss = increase, reference
            reference = loss - change
            increase = change / abs(reference) if reference else math.nan
        if plan is not self._plan:  # a promotion, a demotion, a new search: its own mean
            self._sum = self._reference = 0.0
            self._count = 0
            self._plan = plan
        if math.isfinite(increase) and math.isfinite(reference):
            self._sum += increase
            self._reference += reference
            self._count += 1
        mean = self._sum / self._count if self._count else None
        self.last = CheckFigures(saturation, mean, self._count, self.allowed(plan))
        return self.last

    def actions(self, runtime: "Optional[PlanRuntime]", plan: "Plan", agreement: "Optional[RankAgreement]", step: int,
                writer: Any = None) -> tuple[dict[str, str], dict[str, str]]:
        """A check step's figures (`read`: one host read) and what to do at once: the layers to
        recalibrate, and to promote (fqn -> why) for saturating again (`policy.saturation_actions`)
        or while the measured loss increase is over the budget (`policy.accuracy_promotions`;
        logged, and written to TensorBoard through ``writer``, a `TrainingWriter`)."""
        figures = self.read(runtime, plan, agreement)
        recalibrate, promote = saturation_actions(figures.saturation, self.config.thresholds.saturation, self.recalibrated)
        self.note_recalibrated(recalibrate)
        if figures.over_budget and figures.increase is not None and figures.allowed is not None:
            promote = {**accuracy_promotions(plan, figures.increase, figures.allowed), **promote}
            logger.warning("autoprec: step %d: measured loss increase %.2f%% (mean of %d checks against the window's precision) is over the allowed %.2f%%",
                           step, 100 * figures.increase, figures.checks, 100 * figures.allowed)
        if writer is not None and figures.increase is not None:
            writer.log_accuracy(step, figures.increase, figures.allowed)
        return recalibrate, promote

    def note_recalibrated(self, fqns: "Iterable[str]") -> None:
        """``fqns`` were recalibrated for saturation: saturating again in this window promotes them."""
        self.recalibrated |= set(fqns)

    def new_window(self) -> None:
        """A window starts: no layer recalibrated in it yet."""
        self.recalibrated = set()

    def state_dict(self) -> dict:
        """The running mean and the window's recalibrated layers (the scheduler state's ``checks``)."""
        return {"sum": self._sum, "reference": self._reference, "count": self._count, "recalibrated": sorted(self.recalibrated)}

    def load_state_dict(self, state: "Optional[dict]", plan: "Optional[Plan]") -> None:
        """Restore `state_dict` (None: a state saved before the checks, which start afresh); the
        mean is of ``plan``, the plan restored."""
        state = state or {}
        self._sum, self._reference, self._count = float(state.get("sum", 0.0)), float(state.get("reference", 0.0)), int(state.get("count", 0))
        self.recalibrated = set(state.get("recalibrated", ()))
        self._plan = plan
