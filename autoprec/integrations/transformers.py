"""`AutoprecTrainer`: a drop-in ``transformers.Trainer`` that trains under a `DynamicPrecisionScheduler`.

    scheduler = DynamicPrecisionScheduler(memory_budget=0.6, accuracy_budget=0.01, monitor_window=200)
    trainer = AutoprecTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, scheduler=scheduler)
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

Where each part of the step goes (the Trainer's loop itself is untouched; each method's
docstring says the details): the forward (``compute_loss``) runs inside the scheduler's
`precision_context`; backward and optimizer step go through accelerate's own loss-scaler slot
(`_SchedulerScaling`, so the scheduler scales each loss and takes each optimizer step);
``max_grad_norm`` clips the unscaled gradients (``_clip_grad_norm``); checkpoints carry
``autoprec_scheduler.pt``; every training log carries ``autoprec/*`` metrics (``log``).

Refused with an `IntegrationError`: ``fp16=True`` / ``bf16=True`` (two precision managers would
fight over the same step), and a scheduler bound to another model. Costs: the scheduler's (see
`autoprec.scheduler`), plus one host sync per log for the loss scale.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..scheduler import DynamicPrecisionScheduler
from ..errors import IntegrationError
from ._metrics import scheduler_metrics

__all__ = ["AutoprecTrainer", "SCHEDULER_NAME"]

SCHEDULER_NAME = "autoprec_scheduler.pt"  # beside the Trainer's optimizer.pt / scheduler.pt in checkpoint-N


class _SchedulerScaling:
    """What accelerate asks of its GradScaler (``accelerator.scaler``), answered by the scheduler:
    `scale` in ``accelerator.backward``, `step` + `update` in ``AcceleratedOptimizer.step``.

    So ``accelerator.backward`` scales each micro-batch's loss with the scheduler
    (`DynamicPrecisionScheduler.scale`), and the ``AcceleratedOptimizer`` hands its step to
    `DynamicPrecisionScheduler.step`, once per optimizer step (accelerate steps only when the
    gradient-accumulation window closes). accelerate reports a step the scheduler skipped (its
    optimizer's ``step`` was never called) as ``optimizer_step_was_skipped``, so the Trainer does
    not advance the learning-rate schedule on a skipped step, as with its own fp16 GradScaler."""

    def __init__(self, scheduler: DynamicPrecisionScheduler, accelerator: Any):
        self.scheduler = scheduler
        self.accelerator = accelerator

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scheduler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        if closure is not None:
            raise IntegrationError("AutoprecTrainer: optimizer.step(closure) is not supported; the scheduler checks gradients before it steps")
        stepped = self.scheduler.step(optimizer)
        if not stepped:
            # accelerate counts a step as skipped when the optimizer's step was never called. A
            # fused optimizer (the Trainer's default adamw_torch_fused) is called on a skipped step
            # too and skips on the device (GradScaler hands it found_inf), so say so here; the
            # flag is accelerate's own (AcceleratedOptimizer), read right after this returns.
            for wrapper in getattr(self.accelerator, "_optimizers", ()):
                if getattr(wrapper, "optimizer", None) is optimizer and hasattr(wrapper, "_accelerate_step_called"):
                    wrapper._accelerate_step_called = False
        return stepped

    def update(self, new_scale: Optional[float] = None) -> None:
        """Nothing: `DynamicPrecisionScheduler.step` has updated the scale already."""

    def get_scale(self) -> float:
        return self.scheduler.scaler.get_scale()

    def is_enabled(self) -> bool:
        return self.scheduler.scaler.enabled

    # The Trainer saves and loads its scaler's state as scaler.pt (with weights_only=True, which a
    # scheduler state, holding plans as Python objects, does not pass). The scheduler's state goes
    # to autoprec_scheduler.pt instead (AutoprecTrainer._save_checkpoint), so scaler.pt stays empty.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing: AutoprecTrainer.train restores the scheduler from autoprec_scheduler.pt."""


class _LogOnEvents(TrainerCallback):
    """Asks the Trainer to log at a step that changed the plan or the phase, or skipped."""

    def __init__(self, scheduler: DynamicPrecisionScheduler):
        self.scheduler = scheduler
        self._seen = self._events()

    def _events(self) -> tuple:
        s = self.scheduler
        return (s.phase, len(s.changes), s.scaler.skipped_steps, None if s.plan is None else s.plan.format_counts())

    def on_step_end(self, args, state, control, **kwargs):
        events = self._events()
        if events != self._seen:
            control.should_log = True
            self._seen = events
        return control


class AutoprecTrainer(Trainer):
    """``transformers.Trainer`` with ``scheduler=DynamicPrecisionScheduler(...)`` managing
    precision (see the module doc); every other argument is the Trainer's.

    The scheduler is bound to the Trainer's model (as with ``model=``), so that its first
    training forward already runs the scheduler's precision (a scheduler binding itself runs
    that one at FP32) and a ``compute_loss`` override calling another model is refused
    (`autoprec.scheduler.binding`)."""

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, scheduler: Optional[DynamicPrecisionScheduler] = None, **kwargs: Any):
        if not isinstance(scheduler, DynamicPrecisionScheduler):
            raise IntegrationError(f"AutoprecTrainer(scheduler={type(scheduler).__name__}): pass scheduler=DynamicPrecisionScheduler(...)")
        for flag in ("fp16", "bf16"):
            if args is not None and getattr(args, flag, False):
                raise IntegrationError(
                    f"AutoprecTrainer: TrainingArguments({flag}=True) with a DynamicPrecisionScheduler would run two precision managers; "
                    f"set {flag}=False and let the scheduler choose each layer's format"
                )
        if not hasattr(Trainer, "_clip_grad_norm"):
            raise IntegrationError("AutoprecTrainer needs a transformers Trainer with _clip_grad_norm (transformers 5); upgrade transformers")
        # Read by create_accelerator_and_postprocess, which Trainer.__init__ calls.
        self.scheduler = scheduler
        super().__init__(model, args, *rest, **kwargs)
        if scheduler.model is not None and scheduler.model is not self.model:
            raise IntegrationError(
                f"AutoprecTrainer: the scheduler is bound to a {type(scheduler.model).__name__}, not this Trainer's "
                f"{type(self.model).__name__}; create the scheduler without model= (the Trainer binds it) or with this model"
            )
        scheduler.model = self.model
        self.add_callback(_LogOnEvents(scheduler))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The optimizers accelerate prepares take this scaler: see _SchedulerScaling.
        self.accelerator.scaler = _SchedulerScaling(self.scheduler, self.accelerator)

    # -- forward --------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, *args: Any, **kwargs: Any):
        """The Trainer's ``compute_loss`` inside the scheduler's `precision_context` (plain FP32
        for evaluation before the first training step, so that the scheduler takes its example
        call from a training batch)."""
        if not torch.is_grad_enabled() and self.scheduler.phase == "unbound":
            return super().compute_loss(model, inputs, *args, **kwargs)
        with self.scheduler.precision_context():
            return super().compute_loss(model, inputs, *args, **kwargs)

    # -- clipping -------------------------------------------------------------------------------

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        # accelerate's AcceleratedOptimizer steps (and the scaler keys its state by) the inner one.
        # Called from the Trainer's clipping and grad-norm hooks, after it created its optimizer.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if optimizer is None:
            raise IntegrationError("AutoprecTrainer: no optimizer yet; the Trainer creates it in train()")
        return optimizer

    def _clip_grad_norm(self, model):
        """Unscale, then clip to ``args.max_grad_norm`` (`LossScaler.clip_grad_norm_`, which
        leaves non-finite gradients as they are; the step is skipped either way); returns the
        total norm of the unscaled gradients (a 0-d device tensor), so the logged ``grad_norm`` is
        the true one. Replaces the Trainer's own. One norm pass, no sync."""
        return self.scheduler.scaler.clip_grad_norm_(self._torch_optimizer(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged gradient norm, of the unscaled gradients (unscaled here when no clipping did)."""
        if grad_norm is None:
            optimizer = self._torch_optimizer()
            self.scheduler.scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- logs -----------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with the scheduler's metrics added to training logs (those with a
        ``loss``, every ``logging_steps``): ``autoprec/loss_scale``, ``autoprec/skipped_steps``,
        ``autoprec/plan_changes``, ``autoprec/phase``, ``autoprec/step`` and
        ``autoprec/layers_<format>`` (`scheduler_metrics`); a step that changes the plan, the
        phase or skips is logged at once (`_LogOnEvents`). They go wherever the Trainer reports
        (``report_to="tensorboard"``). One host sync for the loss scale when scaling is on."""
        if "loss" in logs:
            logs = {**logs, **scheduler_metrics(self.scheduler, sync=True)}
        super().log(logs, *args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial, *args: Any, **kwargs: Any) -> None:
        """The Trainer's checkpoint, plus the scheduler's state as ``autoprec_scheduler.pt``."""
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if self.args.should_save and self.scheduler.phase != "unbound":
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            torch.save(self.scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))

    def train(self, resume_from_checkpoint: "str | bool | None" = None, *args: Any, **kwargs: Any):
        """The Trainer's ``train``; resuming from a checkpoint restores the scheduler from its
        ``autoprec_scheduler.pt`` first (an `IntegrationError` when the checkpoint has none)."""
        path = resume_from_checkpoint
        if isinstance(path, bool) and path:
            path = get_last_checkpoint(self.args.output_dir)  # the Trainer raises its own error when None
        if isinstance(path, (str, os.PathLike)):
            file = os.path.join(path, SCHEDULER_NAME)
            if not os.path.isfile(file):
                raise IntegrationError(f"AutoprecTrainer.train(resume_from_checkpoint={str(path)!r}): the checkpoint has no {SCHEDULER_NAME}; resume from a checkpoint an AutoprecTrainer wrote")
            # The state holds plans and calls as plain Python objects besides tensors: a full
            # unpickle, as for any checkpoint; load only checkpoints you trust.
            self.scheduler.load_state_dict(torch.load(file, map_location=self.args.device, weights_only=False))
        return super().train(resume_from_checkpoint, *args, **kwargs)
