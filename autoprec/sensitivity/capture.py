"""What a training loop hands the sensitivity estimate: `GradientCapture` and `LinearisedLoss`.

The scheduler's search estimates sensitivity on the user's own batches without knowing their loss
function: during the last steps of a window, `GradientCapture` keeps each model call (its inputs,
`calls.ModelCall`) and the gradient of the loss at the model's prediction; `LinearisedLoss`
turns such a pair back into a loss whose gradients are the real loss's. Cost per captured step:
one forward hook, and one copy of the inputs and of dL/d(prediction) (held until the search).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from ..calls import ModelCall, prediction_of
from ..errors import ModelCallError

__all__ = ["GradientCapture", "LinearisedLoss"]


class LinearisedLoss:
    """``loss_fn(model, (call, grad))`` for the sensitivity estimate: per-row terms of ``y · dL/dy``
    at the model's prediction (`calls.prediction_of`: its first floating output that is not a
    ``loss`` field), times the row count, whose mean is the real loss's linearisation (so its
    gradients, and the Fisher built from them, are the real loss's)."""

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        call, grad = batch
        out = prediction_of(call(model))
        rows = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
        terms = (rows.float() * grad.reshape(rows.shape).float()).sum(-1)
        return terms * terms.numel()


class GradientCapture:
    """The model calls of the last ``keep`` captured steps, each with dL/d(prediction) once its
    backward ran. `arm` hooks the model's forward for one step (`disarm` after it); a call whose
    output has no prediction requiring grad is not kept."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._entries: list[list] = []  # [ModelCall, dL/d prediction or None]
        self._handle: Optional[Any] = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, model: nn.Module) -> None:
        """Capture the next calls of ``model`` (until `disarm`)."""
        self.disarm()
        self._handle = model.register_forward_hook(self.observe, with_kwargs=True)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def observe(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Keep one call (the forward hook; also called for a call seen before the hook existed)."""
        try:
            prediction = prediction_of(output)
        except ModelCallError:
            return  # nothing to linearise at: the search says no gradients were captured
        if not prediction.requires_grad:
            return
        entry: list = [ModelCall.capture(args, kwargs), None]
        self._entries = (self._entries + [entry])[-self.keep:]
        prediction.register_hook(lambda g: entry.__setitem__(1, g.detach().clone()))

    def batches(self) -> list[tuple[ModelCall, torch.Tensor]]:
        """The kept calls whose backward ran, oldest first: the batches of `LinearisedLoss`."""
        return [(call, grad) for call, grad in self._entries if grad is not None]

    def clear(self) -> None:
        self._entries = []

    def state_dict(self) -> list:
        return [(call.to_state(), grad) for call, grad in self._entries]

    def load_state_dict(self, entries: Sequence) -> None:
        self._entries = [[ModelCall.from_state(call), grad] for call, grad in entries]
