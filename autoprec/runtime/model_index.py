"""What a plan runtime reads of its model, walked once: `ModelIndex`.

A `PlanRuntime` looks modules up by name and names the parameters its quantizers keep state
for. Walking the model for that costs O(modules)
per runtime; the sensitivity estimate makes a few runtimes per layer on one model, so there the
walks alone grew with the square of the depth. Made once (`ModelIndex.of`) and passed to each
runtime (`apply_plan(..., index=)`), a runtime costs O(its plan's layers) instead.

An index describes the model as it was when made: valid while no module or parameter is added,
removed or replaced (the estimator holds the model for its whole run).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
import torch.nn as nn

__all__ = ["ModelIndex"]


@dataclasses.dataclass(frozen=True)
class ModelIndex:
    """``modules``: fqn -> module; ``param_names``: id(parameter) -> its fqn (the first name of a
    tied one); ``device``: the first parameter's (CPU without parameters); ``on_meta``: whether
    any parameter is on the meta device."""

    modules: Mapping[str, nn.Module]
    param_names: Mapping[int, str]
    device: torch.device
    on_meta: bool

    @classmethod
    def of(cls, model: nn.Module) -> "ModelIndex":
        """The index of ``model``: one walk over its modules and parameters."""
        modules = dict(model.named_modules())
        named = list(model.named_parameters())
        param_names: dict[int, str] = {}
        for name, p in named:
            param_names.setdefault(id(p), name)
        device = named[0][1].device if named else torch.device("cpu")
        return cls(modules, param_names, device, any(p.is_meta for _, p in named))
