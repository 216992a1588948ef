"""What a training loop hands the sensitivity estimate: `GradientCapture` and `LinearisedLoss`.

The scheduler's search estimates sensitivity on the user's own batches without knowing their loss
function: during the last steps of a window, `GradientCapture` keeps each model call (its inputs,
`calls.ModelCall`) and the gradient of the loss at the model's outputs; `LinearisedLoss` turns
such a pair back into a loss whose gradients are the real loss's.

Which outputs: those the loss was computed from. A model may return several floating tensors
(`calls.predictions_of`), and the loss need not start from the first: CLIP returns
``logits_per_image`` first, the transpose of ``logits_per_text`` that its loss never reads, then
the embeddings both logits are made of. So every output that requires grad is hooked, and after
the backward the outputs kept are those that received a gradient and feed no other output that
did (a gradient at an upstream output already holds the downstream one's: keeping both would
count it twice). A model that computes its loss from a tensor it does not return (ProphetNet's
n-gram streams: the loss reads the logits before they are split into the returned fields) gives
none of its predictions a gradient; then its returned loss is the target (`LOSS`), one term. Cost per captured step: one forward hook; with more than one output requiring
grad, one walk of the autograd graph per output (at the forward); one copy of the inputs and of
each receiving output's gradient (held until the search).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from ..calls import ModelCall, loss_field, predictions_of
from ..errors import ModelCallError

__all__ = ["GradientCapture", "LinearisedLoss", "LOSS"]

LOSS = -1  # a target's index meaning the output's own loss field, not one of its predictions


class LinearisedLoss:
    """``loss_fn(model, (call, targets))`` for the sensitivity estimate, ``targets`` pairs of an
    output's index in `calls.predictions_of` and dL/d(that output): per-row terms of ``y · dL/dy``
    over each target's rows (its last dimension), times the row count, whose mean is the real
    loss's linearisation (so its gradients, and the Fisher built from them, are the real loss's)."""

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        call, targets = batch
        result = call(model)
        outputs = predictions_of(result)
        terms = []
        for index, grad in targets:
            out = loss_field(result) if index == LOSS else outputs[index]
            rows = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
            terms.append((rows.float() * grad.reshape(rows.shape).float()).sum(-1))
        joined = torch.cat(terms)
        return joined * joined.numel()


@dataclasses.dataclass
class _Captured:
    """One captured call: ``outputs`` the indices (in `calls.predictions_of`) of its outputs
    that required grad, ``feeds`` pairs (a, b) of positions in ``outputs`` where output a is
    computed on the way to output b, ``grads`` position -> dL/d(output) once its backward ran."""

    call: ModelCall
    outputs: list
    feeds: set
    grads: dict = dataclasses.field(default_factory=dict)
    loss_grad: Optional[torch.Tensor] = None  # dL/d(the output's loss field), when it has one

    def targets(self) -> list:
        """(output index, gradient) of the outputs the loss was computed from: those that received
        a gradient and feed no other that did; else the loss field's (module docstring)."""
        got = set(self.grads)
        found = [(self.outputs[k], self.grads[k]) for k in sorted(got) if not any((k, j) in self.feeds for j in got if j != k)]
        return found or ([(LOSS, self.loss_grad)] if self.loss_grad is not None else [])


def _feeds(outputs: Sequence[torch.Tensor]) -> set:
    """Pairs (a, b): ``outputs[a]``'s autograd node is reached walking back from ``outputs[b]``'s."""
    position: dict = {}
    for a, y in enumerate(outputs):
        position.setdefault(y.grad_fn, []).append(a)
    pairs: set = set()
    for b, y in enumerate(outputs):
        seen: set = set()
        stack = [n for n, _ in y.grad_fn.next_functions if n is not None] if y.grad_fn is not None else []
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            pairs.update((a, b) for a in position.get(node, ()) if a != b)
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return pairs


class GradientCapture:
    """The model calls of the last ``keep`` captured steps, each with dL/d(its outputs) once its
    backward ran. `arm` hooks the model's forward for one step (`disarm` after it); a call whose
    outputs do not require grad is not kept."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._entries: list[_Captured] = []
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
            outputs = predictions_of(output)
        except ModelCallError:
            return  # nothing to linearise at: the search says no gradients were captured
        live = [i for i, y in enumerate(outputs) if y.requires_grad and y.grad_fn is not None]
        if not live:
            return
        entry = _Captured(ModelCall.capture(args, kwargs), live, _feeds([outputs[i] for i in live]) if len(live) > 1 else set())
        self._entries = (self._entries + [entry])[-self.keep:]
        for k, i in enumerate(live):
            outputs[i].register_hook(lambda g, k=k: entry.grads.__setitem__(k, g.detach().clone()))
        loss = loss_field(output) if not torch.is_tensor(output) else None
        if torch.is_tensor(loss) and loss.requires_grad and loss.grad_fn is not None:
            loss.register_hook(lambda g: setattr(entry, "loss_grad", g.detach().clone()))

    def batches(self) -> list[tuple[ModelCall, list]]:
        """The kept calls whose backward ran, oldest first, each with its targets
        (`_Captured.targets`): the batches of `LinearisedLoss`."""
        return [(entry.call, targets) for entry in self._entries if (targets := entry.targets())]

    def clear(self) -> None:
        self._entries = []

    def state_dict(self) -> list:
        return [(entry.call.to_state(), entry.targets()) for entry in self._entries]

    def load_state_dict(self, entries: Sequence) -> None:
        """``entries`` from `state_dict`; a gradient alone (a state saved before several outputs
        were captured) is the first output's."""
        self._entries = []
        for call, targets in entries:
            pairs = [] if targets is None else [(0, targets)] if torch.is_tensor(targets) else list(targets)
            self._entries.append(_Captured(ModelCall.from_state(call), [i for i, _ in pairs], set(), dict(enumerate(g for _, g in pairs))))
