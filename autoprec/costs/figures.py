"""What the cost model reports: one layer in one format (`LayerCost`), a plan's totals
(`PlanCost`) and what recomputing a block frees and costs (`BlockCost`). Plain records;
`model.CostModel` makes them."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..formats import Format

__all__ = ["LayerCost", "PlanCost", "BlockCost"]


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer in one format: bytes held for a step (see `memory`) and seconds per step
    (forward + backward of its matrix products, casts and quantization included)."""

    fqn: str
    format: Format
    weight_copy_bytes: int
    activation_bytes: int
    other_saved_bytes: int
    grad_bytes: int
    seconds: float
    time_source: str

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for backward: weight copies, activations, other saved tensors."""
        return self.weight_copy_bytes + self.activation_bytes + self.other_saved_bytes

    @property
    def bytes(self) -> int:
        """Saved bytes plus the FP32 gradient buffers."""
        return self.saved_bytes + self.grad_bytes


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """A plan's predicted totals: its layers' costs plus the format-independent rest."""

    layers: Mapping[str, LayerCost]
    rest_saved_bytes: int
    rest_seconds: float
    recompute_freed_bytes: int = 0  # what the plan's recomputed blocks do not keep (`BlockCost`)
    recompute_seconds: float = 0.0  # their forwards run once more
    rest_grad_bytes: int = 0  # gradient buffers of the parameters no layer owns (`ModelTrace`)

    @property
    def saved_bytes(self) -> int:
        return sum(c.saved_bytes for c in self.layers.values()) + self.rest_saved_bytes - self.recompute_freed_bytes

    @property
    def bytes(self) -> int:
        """Saved bytes (layers and rest) plus every trainable parameter's gradient buffer."""
        return self.saved_bytes + sum(c.grad_bytes for c in self.layers.values()) + self.rest_grad_bytes

    @property
    def layer_seconds(self) -> float:
        return sum(c.seconds for c in self.layers.values())

    @property
    def step_seconds(self) -> float:
        return self.layer_seconds + self.rest_seconds + self.recompute_seconds

    def to_dict(self) -> dict:
        """The totals, for a plan's ``predicted`` field."""
        out = {"bytes": self.bytes, "saved_bytes": self.saved_bytes, "step_seconds": self.step_seconds, "rest_seconds": self.rest_seconds}
        if self.recompute_freed_bytes or self.recompute_seconds:
            out.update(recompute_freed_bytes=self.recompute_freed_bytes, recompute_seconds=self.recompute_seconds)
        return out


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What recomputing one block costs and frees, per region: index 0 an all-FP32 plan, 1 a
    plan with any layer lowered.

    Bytes are measured with the saved-tensor meter: the uniform plan's saved bytes less those of
    the same plan with the block recomputed (the checkpoint keeps the block's inputs and the
    meter counts them, so this is what the block holds beyond its input). A mixed plan frees its
    layers' modelled saved bytes in their own formats plus the block's measured remainder in the
    plan's region (the one figure not re-measured per format). Seconds: one more forward of the
    block, its layers' forwards in their formats plus its own ops', measured in place in the
    uniform plans' steps; a format not timed in place takes the layer's replayed time times the
    share of its FP32 step time the FP32 forward took (a third, by the 2:4 forward-to-backward
    FLOP count of Kaplan et al. 2020, sec. 2.1, when nothing was timed in place). The extra bytes
    of an FP32 layer inside a lowered region are never counted as freed.

    ``freed_bytes``: measured, the uniform plan's saved bytes less those with this block
    recomputed. ``other_bytes``: that less its layers' modelled saved bytes in the region's
    format (the saves of the block's own ops beyond its input; negative when a layer saved the
    input itself). ``other_seconds``: the block's forward less its layers' forwards, in place."""

    fqn: str
    layers: tuple[str, ...]
    freed_bytes: tuple[int, int]
    other_bytes: tuple[int, int]
    other_seconds: tuple[float, float] = (0.0, 0.0)
