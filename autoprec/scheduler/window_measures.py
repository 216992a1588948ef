"""What a scheduler measures over its windows: `WindowMeasures`.

It owns the `LayerProfiler` of the profiling window, the `PlanWatch` of each planned window's
last steps (both record every ``sample_every``-th step, their hooks on the model only then), the loss baseline (the profiling window's finite losses, summed on the device:
a relative accuracy budget's anchor), the saved bytes metered on a window's last step but one, and the
`GradientCapture` of the profiling window's last steps (the sensitivity estimate's batches). The
scheduler keeps the clock and says when: `start_profiler` / `start_watch`, `enter_step`, `step`,
`end_window`.

Costs: the profiler's in its sampled steps (`profiling.profiler`), the watch's in its sampled
steps (`profiling.watch`: two kernels per tensor and one fused reduction); none in other steps
but a counter; per profiling step two small
device ops for the loss (no host sync; one when the baseline is read at the window's end); one
saved-tensor meter on a window's last step but one; the capture's on captured steps
(`sensitivity.capture`). Under ``torch.distributed`` the window's end reduces the profiler's
(or the watch's) accumulators and the loss sum across ranks (`RankAgreement.reduce_window`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..saved_bytes import SavedTensorMeter
from ..plan import Plan, Scaling
from ..sensitivity.capture import GradientCapture
from .binding import require_bound
from .lifecycle import CAPTURED_STEPS

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from ..monitoring import TrainingWriter
    from ..profiling import LayerProfiler, PlanWatch, Profile, WatchReport
    from .config import SchedulerConfig

__all__ = ["WindowMeasures"]

logger = logging.getLogger(__name__)


class WindowMeasures:
    """A scheduler's window measurements (module docstring); `bind` gives them the model."""

    def __init__(self, config: "SchedulerConfig"):
        self.config = config
        self._model: Optional[nn.Module] = None
        self._example: Any = None
        self._layers: tuple[str, ...] = ()
        self._profiler: "Optional[LayerProfiler]" = None
        self._profiled_window = 0  # the profiler's window in optimizer steps (it records every sample_every-th)
        self._watch: "Optional[PlanWatch]" = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._capture = GradientCapture(keep=CAPTURED_STEPS)
        self._meter_bytes: Optional[int] = None
        self._meter_next = False

    def bind(self, model: nn.Module, example: Any, layers: Sequence[str]) -> None:
        """The model profiled, its example call (`calls.ModelCall`) and its layers."""
        self._model, self._example, self._layers = model, example, tuple(layers)

    def _bound(self) -> nn.Module:
        return require_bound(self._model)

    # -- the profiler ---------------------------------------------------------------------------

    @property
    def profiling(self) -> bool:
        """Whether a profiler or a watch measures this window."""
        return self._profiler is not None or self._watch is not None

    def start_profiler(self, window: int) -> None:
        """Profile the bound model's layers over the next ``window`` steps: every
        ``sample_every``-th of them (the window's first included; `enter_step` says which)."""
        from ..profiling import LayerProfiler, with_grad_formats

        model, layers, every = self._bound(), self._layers, self.config.sample_every
        # In sampled steps: the delayed-scaling reference spans the training steps the runtime's does.
        settings = dict(formats=with_grad_formats(self.config.candidates), window=-(-window // every), history_len=-(-Scaling().history_len // every))
        profiler = LayerProfiler(model, self._example, **settings)  # type: ignore[arg-type]
        if set(profiler.layers) != set(layers):
            profiler = LayerProfiler(model, self._example, module_filter=lambda m, fqn: fqn in layers, **settings)  # type: ignore[arg-type]
        self._profiler, self._profiled_window = profiler, window

    def start_watch(self, plan: Plan, steps: int) -> None:
        """Watch ``plan``'s layers over the next ``steps`` steps (`profiling.watch.PlanWatch`)."""
        from ..profiling import PlanWatch

        self._watch = PlanWatch(self._bound(), {fqn: plan.layers[fqn] for fqn in self._layers}, window=steps, every=self.config.sample_every)

    def step(self) -> None:
        """An optimizer step: the profiler's or the watch's, which take their hooks off."""
        if self._profiler is not None and self._profiler.collecting:
            self._profiler.step()
            self._profiler.detach()
        if self._watch is not None:
            self._watch.step()

    def end_window(self, agreement: "Optional[RankAgreement]", *, with_loss: bool, writer: "Optional[TrainingWriter]",
                   step: int) -> "Profile | WatchReport | None":
        """The window's profile, or its watch's report in a planned window (None when nothing
        was measured), the hooks removed. Under torch.distributed (``agreement``) every rank's
        statistics, and with ``with_loss`` the loss sums, are reduced first, so every rank's
        profile is the same. With a ``writer``: the layers' gradient histograms at ``step``."""
        if writer is not None:  # once per window: one sync for all layers' histograms
            modules = dict(self._bound().named_modules())
            grads = {fqn: p.grad for fqn in self._layers for p in modules[fqn].parameters(recurse=False) if p.dim() >= 2 and p.grad is not None}
            writer.log_grad_histograms(step, grads)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.detach()
            if agreement is not None:
                agreement.reduce_window(watch, None)
            return watch.report() if watch.steps else None
        if agreement is not None:
            reduced = agreement.reduce_window(self._profiler, self._loss_sum if with_loss else None)
            if with_loss and reduced is not None:
                self._loss_sum, self._loss_count = reduced, self._loss_count * agreement.world
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.detach()
        return profiler.profile() if profiler is not None and profiler.steps else None

    # -- the loss baseline ----------------------------------------------------------------------

    def record_loss(self, loss: torch.Tensor) -> None:
        """A profiling step's loss (detached, FP32). No host sync."""
        # (sum of the finite losses, how many were finite): a NaN batch must not make the
        # baseline NaN (it would switch the accuracy budget off).
        finite = torch.isfinite(loss)
        entry = torch.stack([torch.where(finite, loss, torch.zeros_like(loss)), finite.float()])
        self._loss_sum = entry if self._loss_sum is None else self._loss_sum + entry
        self._loss_count += 1

    def baseline_loss(self, step: int) -> Optional[float]:
        """The mean of the window's finite losses (None without any); warns at ``step`` when some
        were NaN / inf. One host sync."""
        if not self._loss_count or self._loss_sum is None:
            return None
        total, finite = (float(v) for v in self._loss_sum)
        if finite < self._loss_count:
            logger.warning("autoprec: step %d: %d of the window's %d losses were NaN / inf; the baseline loss is the mean of the other %d",
                           step, self._loss_count - int(finite), self._loss_count, int(finite))
        return total / finite if finite else None

    def restart(self, window: int) -> None:
        """A fresh profiling window (a failed search's retry): no losses, no captured steps, a new
        profiler over ``window`` steps."""
        self._loss_sum, self._loss_count = None, 0
        self._capture.clear()
        self.start_profiler(window)

    # -- saved bytes and captured steps ---------------------------------------------------------

    @property
    def measured_bytes(self) -> Optional[int]:
        """The saved bytes metered on the last metered step (a window's last but one), None before one."""
        return self._meter_bytes

    def meter_next_step(self) -> None:
        """Meter the saved bytes of the next step."""
        self._meter_next = True

    def hooks_model(self, capture: bool, sample: bool) -> bool:
        """Whether the next step (``capture``: a captured one; ``sample``: a profiling window's
        sampled one) puts hooks on the model: a compiled model must then run it eagerly (the
        compiled code calls no hook added after it was compiled)."""
        return (capture or self._meter_next or (sample and self._profiler is not None and self._profiler.steps < self._profiler.window)
                or (self._watch is not None and self._watch.sampling))

    def enter_step(self, stack: contextlib.ExitStack, capture: bool, sample: bool) -> None:
        """Inside a step's context (``stack``): meter its saved bytes when due; with ``capture``,
        capture its calls and output gradients; with ``sample``, a sampled step of the profiling
        window (its profiler's hooks on until `step`). A planned window's watch knows its own."""
        model = self._bound()
        if sample and self._profiler is not None and not self._profiler.collecting:
            self._profiler.attach()  # a no-op once its window is complete
        if self._watch is not None:
            self._watch.attach()
        if self._meter_next:
            metered = stack.enter_context(SavedTensorMeter(list(model.parameters())))
            stack.callback(lambda: setattr(self, "_meter_bytes", metered.total_bytes))
            self._meter_next = False
        if capture:
            self._capture.arm(model)
            stack.callback(self._capture.disarm)

    def observe(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A model call that ran before the capture's hooks could see it (the binding call)."""
        if self._capture.armed:
            self._capture.observe(module, args, kwargs, output)

    def captured(self) -> list:
        """The captured steps' batches (`GradientCapture.batches`)."""
        return self._capture.batches()

    def clear_captured(self) -> None:
        """Forget the captured steps (a search consumed them)."""
        self._capture.clear()

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The scheduler state's ``loss_sum``, ``loss_count``, ``captured``, ``meter_next``,
        ``measured_bytes`` (the last metered step's, used at the window's end) and ``profiler``
        fields."""
        return {
            "loss_sum": self._loss_sum,
            "loss_count": self._loss_count,
            "captured": self._capture.state_dict(),
            "meter_next": self._meter_next,
            "measured_bytes": self._meter_bytes,
            "profiler": None if self._profiler is None else {"window": self._profiled_window, "state": self._profiler.state_dict()},
            "watch": None if self._watch is None else {"window": self._watch.window, "state": self._watch.state_dict()},
        }

    def load_state_dict(self, state: Mapping[str, Any], plan: Optional[Plan]) -> None:
        """Restore `state_dict`'s fields (a new profiler or watch for a saved one; ``plan``: the
        plan in force, which a watch watches)."""
        self._loss_sum, self._loss_count = state["loss_sum"], state["loss_count"]
        self._capture.load_state_dict(state["captured"])
        self._meter_next = state["meter_next"]
        self._meter_bytes = state.get("measured_bytes")  # absent from a state saved before it was kept
        self.close()
        if plan is not None and state.get("watch") is not None:
            self.start_watch(plan, state["watch"]["window"])
            if self._watch is not None:
                self._watch.load_state_dict(state["watch"]["state"])
        elif plan is None and state["profiler"] is not None:
            self.start_profiler(state["profiler"]["window"])
            if self._profiler is not None:
                self._profiler.load_state_dict(state["profiler"]["state"])
        elif state["profiler"] is not None:  # a planned window's profiler, saved before the watch replaced it
            logger.info("autoprec: the checkpoint's planned-window profiler is not restored; the window's watch starts at its next monitored step")

    def close(self) -> None:
        """Detach the profiler, the watch and the capture's hooks (their statistics dropped)."""
        if self._profiler is not None:
            self._profiler.detach()
            self._profiler = None
        if self._watch is not None:
            self._watch.detach()
            self._watch = None
        self._capture.disarm()
