"""`AutoprecPrecision`: a Lightning precision plugin that trains under a `DynamicPrecisionScheduler`.

    trainer = lightning.Trainer(plugins=[AutoprecPrecision(memory_budget=0.6, accuracy_budget=0.01, monitor_window=200)])

What the plugin does at Lightning's precision hooks (`lightning.pytorch.plugins.precision.Precision`):
``forward_context`` runs each step under the scheduler's `precision_context` (the scheduler binds
to the model ``training_step`` calls); ``pre_backward`` multiplies the loss by the loss scale;
``optimizer_step`` runs the closure, unscales, lets Lightning's hooks and gradient clipping see
true gradients, then `DynamicPrecisionScheduler.step` (skip on non-finite gradients, scale
update, the window clock) and logs ``autoprec/*`` metrics; ``state_dict`` / ``load_state_dict``
carry the scheduler's state in Lightning checkpoints. Each method's docstring says the details.

Supported: one device (Lightning's single-device strategies), automatic optimization, optimizers
that step without a closure re-evaluation (not LBFGS). Anything else is refused with an
`IntegrationError` naming the setting. Costs: the scheduler's (see `autoprec.scheduler`): one host
sync per optimizer step (the skip decision), none for logging (the loss scale is logged as a device
tensor, read when Lightning writes its logs).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision

from ..plan import Plan
from ..scheduler import DynamicPrecisionScheduler
from ..scheduler.config import SchedulerConfig
from ..errors import IntegrationError
from ._metrics import scheduler_metrics

__all__ = ["AutoprecPrecision"]


class AutoprecPrecision(Precision):
    """Lightning precision plugin running a `DynamicPrecisionScheduler`.

    ``config`` or the `SchedulerConfig` fields by keyword (``memory_budget=0.6,
    monitor_window=200, ...``), and ``plan`` (start from it; with ``dynamic=False`` run it fixed),
    as `DynamicPrecisionScheduler` takes them; ``log_metrics=False`` logs nothing. The scheduler is `scheduler` (its `phase`, `plan`, `changes`, `scaler`).
    """

    # Parameters, optimizer state and master weights stay FP32; what runs narrower is per layer,
    # decided by the scheduler. Lightning reads this string for summaries and its own checks.
    precision = "32-true"

    def __init__(self, *, config: Optional[SchedulerConfig] = None, plan: Optional[Plan] = None, log_metrics: bool = True, **settings: Any):
        self.scheduler = DynamicPrecisionScheduler(config=config, plan=plan, **settings)
        self.log_metrics = log_metrics
        self._module: Optional[LightningModule] = None

    # -- setup ----------------------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Take ``module`` as the one this plugin trains; the scheduler binds to what its
        ``training_step`` calls (the module or a model inside it) at the first training step."""
        bound = self.scheduler.model
        if bound is not None and not any(m is bound for m in module.modules()):
            raise IntegrationError(
                f"AutoprecPrecision is bound to a {type(bound).__name__} but this Trainer runs a {type(module).__name__}; "
                "create one AutoprecPrecision per model"
            )
        self._module = module if isinstance(module, LightningModule) else None
        return module

    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Refuse what the plugin cannot run: a wrapped model (multi-device strategies), manual
        optimization, LBFGS, and ``max_grad_norm`` together with Lightning's ``gradient_clip_val``."""
        module = self._module
        if module is None or model is not module:
            raise IntegrationError(
                f"AutoprecPrecision needs a single-device strategy (the model reached it as {type(model).__name__}); "
                "use Trainer(devices=1) or strategy='auto' on one device"
            )
        if not module.automatic_optimization:
            raise IntegrationError(
                "AutoprecPrecision does not support manual optimization (automatic_optimization=False); "
                "use automatic optimization, or drive DynamicPrecisionScheduler yourself in training_step"
            )
        for optimizer in optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise IntegrationError("AutoprecPrecision does not support torch.optim.LBFGS: its closure recomputes gradients after the non-finite check; use another optimizer")
        trainer = module._trainer
        if trainer is not None and trainer.gradient_clip_val and self.scheduler.config.max_grad_norm is not None:
            raise IntegrationError(
                f"AutoprecPrecision(max_grad_norm={self.scheduler.config.max_grad_norm}) with Trainer(gradient_clip_val={trainer.gradient_clip_val}): "
                "clip in one place; drop max_grad_norm and keep Lightning's gradient_clip_val"
            )
        return model, optimizers, lr_schedulers

    # -- forward and backward -------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """The scheduler's `precision_context` (training, validation, test and predict steps).

        The scheduler is made without ``model=``, so it binds to the outermost model
        ``training_step`` calls, however it calls it: the LightningModule (``self(x)``) or the
        model it holds (``self.model(**batch)``, as Hugging Face models are called); its first
        forward runs at FP32 (`autoprec.scheduler`, step 1). Without autograd before the
        scheduler is bound (the sanity check, an evaluation step before the first training
        forward), plain FP32: the scheduler must take its example call, and start its window,
        from a training step, not from the sanity-check batch."""
        if not torch.is_grad_enabled() and self.scheduler.phase == "unbound":
            yield
            return
        with self.scheduler.precision_context():
            yield

    # Lightning's own Precision narrows fabric's hooks the same way (and ignores the same finding).
    def pre_backward(self, tensor: torch.Tensor, module: LightningModule) -> torch.Tensor:  # type: ignore[override]
        """The loss times the loss scale (records the loss for the scheduler's baseline). No sync.
        A ``training_step`` that called no model was refused when its `precision_context` ended."""
        return super().pre_backward(self.scheduler.scale(tensor), module)

    # -- the optimizer step ---------------------------------------------------------------------

    def optimizer_step(self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]  # as Lightning's Precision
        """The closure (training_step and backward), then the scaler's ``unscale_``, then
        Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, then
        `DynamicPrecisionScheduler.step` (skip on non-finite gradients, scale update, the window clock).

        Gradient clipping: Lightning's own ``gradient_clip_val`` / ``gradient_clip_algorithm``
        (and a module's ``configure_gradient_clipping`` override) run as usual, on gradients just
        unscaled, as Lightning's ``MixedPrecision`` does with its GradScaler. Unscaling first,
        rather than translating the Trainer's setting into the scheduler's ``max_grad_norm``,
        keeps every clipping path Lightning offers (value or norm, a module's own rule) and lets
        ``on_before_optimizer_step`` callbacks (gradient-norm logging) see true gradients; the
        scaler's non-finite check has already run inside ``unscale_``, so clipping cannot hide an
        overflow from the skip.

        Metrics, logged with the module's ``log`` on the optimizer steps the Trainer writes logs at
        (every ``log_every_n_steps``, so every logger it has receives them):
        ``autoprec/loss_scale``, ``autoprec/skipped_steps``, ``autoprec/plan_changes``,
        ``autoprec/phase``, ``autoprec/step`` and ``autoprec/layers_<format>`` (`scheduler_metrics`).

        Returns the closure's result (the loss, as ``optimizer.step(closure)`` would) when the
        optimizer stepped, None when the scheduler skipped the step for non-finite gradients (as
        Lightning's ``MixedPrecision`` returns GradScaler's None). Lightning's loop reads the loss
        from the closure itself, so a skipped step still logs its loss. One host sync."""
        if kwargs:
            raise IntegrationError(f"AutoprecPrecision: optimizer_step(..., {', '.join(sorted(kwargs))}=...) is not supported; the scheduler steps the optimizer without arguments")
        closure_result = closure()
        if closure_result is None:
            # training_step returned None: Lightning skipped backward, so there is nothing to step.
            return None
        # True gradients for on_before_optimizer_step and clipping; the non-finite check runs here.
        self.scheduler.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        stepped = self.scheduler.step(optimizer)
        if self.log_metrics and model._current_fx_name is not None and model.trainer._logger_connector.should_update_logs:
            # Lightning's `log` is allowed in `optimizer_step` (on step); the loss scale stays a
            # device tensor until Lightning writes its logs. Only on the steps Lightning writes
            # (every `log_every_n_steps`; its own LearningRateMonitor and DeviceStatsMonitor gate on
            # the same flag): each `log` builds a tensor and updates Lightning's result collection,
            # which cost ~10 % of a small MLP's step on CPU when done every step.
            model.log_dict(scheduler_metrics(self.scheduler, sync=False), on_step=True, on_epoch=False)
        return closure_result if stepped else None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Lightning's norm clipping on the unscaled gradients, leaving non-finite ones untouched
        (`LossScaler.clip_grad_norm_`) instead of spreading NaN to every layer (the step is
        skipped either way, and the attribution stays exact): one norm pass and one multiply per
        gradient, no sync."""
        self.scheduler.scaler.clip_grad_norm_(optimizer, float(clip_val))

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"scheduler": DynamicPrecisionScheduler.state_dict()}``, or ``{}`` before the scheduler
        is bound (Lightning then writes no entry)."""
        if self.scheduler.phase == "unbound":
            return {}
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scheduler (from a Lightning checkpoint): at once when it is bound, else
        when the first training forward binds it, where the state is checked against the model
        (layer names and shapes)."""
        if "scheduler" not in state_dict:
            raise IntegrationError(
                f"AutoprecPrecision.load_state_dict(): the checkpoint's precision state has {sorted(state_dict)}, not 'scheduler'; "
                "resume from a checkpoint written under AutoprecPrecision"
            )
        self.scheduler.load_state_dict(state_dict["scheduler"])
