"""The README loop's training step, as the tests run it on models that return their loss."""

import torch

from autoprec.scheduler import DynamicPrecisionScheduler

__all__ = ["readme_step"]


def readme_step(model: torch.nn.Module, batch: dict, scheduler: DynamicPrecisionScheduler, optimizer: torch.optim.Optimizer) -> float:
    """One step of the README loop on ``batch`` (keyword inputs with labels): the forward in the
    scheduler's context, its scaled backward and step; the step's loss."""
    with scheduler.precision_context():
        outputs = model(**batch)
    scheduler.backward(outputs.loss)
    scheduler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return outputs.loss.item()
