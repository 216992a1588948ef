"""What a search plans under (`Planning`: candidates, rules, budgets, how each format is scaled,
the range limits), one object from its caller's settings to every stage of the pipeline.

A scaled format may be given several scalings (``Planning(scaling={"fp8_e4m3": ["tensor",
"block"]})``): the first is the format's own, the rest are *alternative recipes* of it
(`Planning.alternatives`) that the search weighs per layer beside it, so one layer may take FP8
with one scale per tensor and the next FP8 in 1x128 blocks (`search.space`'s choice keys).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..costs.targets import TargetDevice
from ..errors import FormatError, PlanError, SearchError
from ..formats import Format, Granularity
from ..plan import LayerPrecision, Scaling
from .budgets import Budgets
from .space import LayerRules

__all__ = ["RangeLimits", "Planning"]


@dataclasses.dataclass(frozen=True)
class RangeLimits:
    """The fractions of a tensor's values out of its format's range (after the layer's scaling)
    past which the scheduler promotes a planned layer (`SchedulerConfig.thresholds`' ``overflow``
    and ``underflow``). The search rules a format out for a layer whose profile already shows
    more (`planner.range_reason`): a plan the next window's statistics would promote at once is
    not a plan within its budgets (the promotion adds bytes the memory budget did not count)."""

    overflow: float = 1e-3
    underflow: float = 0.25


def _held_grads(value: Any) -> bool:
    """Whether ``value`` is one held entry of `Planning.grad_formats`: a (Format, bool) pair."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Format) and isinstance(value[1], bool)


def _grads(value: Any) -> tuple[Format, bool]:
    """One gradient entry as held: ``"fp8_e5m2"`` (both backward products), ``"fp8_e5m2/fp32"``
    (the input gradient's in E5M2, the weight gradient's in high precision) or a held pair.
    Raises ValueError (FormatError) or TypeError for anything else."""
    if _held_grads(value):
        return value
    if isinstance(value, str) and "/" in value:
        grad, weight = (Format.parse(part.strip()) for part in value.split("/"))
        if weight is not Format.FP32 and weight is not grad:
            raise ValueError(value)
        return grad, weight is Format.FP32 and grad is not Format.FP32
    return Format.parse(value), False


@dataclasses.dataclass(frozen=True)
class Planning:
    """What a search plans under, one object from its caller's settings (`SchedulerConfig.planning`,
    `JobConfig.planning`) to every stage of the pipeline.

    ``formats``: the candidates, of which those within ``min_precision`` / ``max_precision``
    (bits) are searched; ``rules``: pins and forbids; ``budgets``;
    ``lr``: the learning rate the sensitivity's gradient term assumes; ``k``: plans wanted, the
    optimum first; ``time_limit``: seconds for the integer programs (None: unbounded);
    ``measure``: time layers in place (False: roofline times); ``target``: price the layers for
    that device instead (`costs.targets.TargetDevice`, e.g. ``load_target("B200")``: roofline at
    its rates on its kernels, nothing timed here); ``limits``: the range fractions a
    planned layer is promoted past (`RangeLimits`), which the profile's rule out. ``scaling``: how each scaled
    format's tensors are scaled (format -> `Scaling`, or a list of them; a format not named takes
    the default, current per-tensor): the costs are timed, the sensitivity estimated and the plans
    made in the first, e.g. ``{Format.FP8_E4M3: Scaling(granularity="block")}`` for DeepSeek-V3's
    fine-grained FP8 (1x128 / 128x128 tiles, E4M3 gradients); the rest of a list are alternatives
    the search chooses among per layer (`alternatives`). ``grad_formats``: the gradient format of each
    format's layers (format -> format; a format not named takes its default), e.g.
    ``{Format.NVFP4: Format.FP32}``: NVFP4 forwards with a high-precision backward
    (`LayerPrecision`), costed, estimated and planned so; a list, e.g. ``{"fp8_e4m3": ["fp8_e5m2",
    "fp32"]}``, makes the rest alternatives as well (each with each scaling). Per GEMM,
    ``"fp8_e5m2/fp32"`` is the input gradient's product in E5M2 and the weight gradient's in high
    precision (`LayerPrecision.high_precision_weight_grad`, torchao's ``rowwise_with_gw_hp``).
    ``recipes``: named recipes (`LayerPrecision.preset`, e.g. ``["te_mxfp8",
    "torchao_rowwise_with_gw_hp"]``) or `LayerPrecision` s, each an alternative of its format
    beside those ``scaling`` and ``grad_formats`` make; its format must be a candidate."""

    formats: tuple[Format, ...]
    rules: LayerRules = LayerRules()
    budgets: Budgets = Budgets()
    min_precision: int = 8
    max_precision: int = 32
    lr: float = 1e-3
    k: int = 1
    time_limit: "float | None" = None
    measure: bool = True
    target: "TargetDevice | None" = None
    limits: RangeLimits = RangeLimits()
    # Given as format (or name) -> Scaling (or a granularity name), or a list of them; held as
    # Format -> tuple of distinct Scalings, the format's own first.
    scaling: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    # Given as format (or name) -> gradient format (or name, "grad/fp32" per GEMM), or a list of
    # them; held as Format -> tuple of distinct (gradient Format, high-precision weight gradient)
    # pairs, the format's own first.
    grad_formats: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    # Given as preset names or LayerPrecisions; held as a tuple of distinct LayerPrecisions.
    recipes: Any = ()

    def __post_init__(self):
        if self.target is not None and not isinstance(self.target, TargetDevice):
            raise SearchError(f"Planning(target={self.target!r}): expected a TargetDevice or None; make one with autoprec.costs.load_target('B200') or a profile's path")
        if not isinstance(self.scaling, Mapping):
            raise SearchError(f"Planning(scaling={self.scaling!r}): expected a table of format = scaling, e.g. {{'fp8_e4m3': 'block'}}")
        scaling = {}
        for name, given in self.scaling.items():
            try:
                fmt = Format.parse(name)
            except (FormatError, ValueError):
                raise SearchError(f"Planning(scaling={{{name!r}: {given!r}}}): expected a format name and 'tensor', 'row', 'block', 'mx' or a Scaling") from None
            values = tuple(given) if isinstance(given, (list, tuple)) else (given,)
            if not values:
                raise SearchError(f"Planning(scaling={{{fmt.value!r}: []}}): name at least one scaling, e.g. ['tensor', 'block']")
            scaling[fmt] = tuple(dict.fromkeys(self._checked_scaling(fmt, value) for value in values))
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "grad_formats", self._checked_grad_formats())
        object.__setattr__(self, "recipes", self._checked_recipes())

    @staticmethod
    def _checked_scaling(fmt: Format, value: Any) -> Scaling:
        """One scaling of ``fmt`` as given (a granularity name is short for current scaling at
        that granularity), checked as a plan holding it checks it."""
        try:
            scaling = Scaling(granularity=Granularity(value)) if isinstance(value, str) else value
        except (FormatError, ValueError):
            raise SearchError(f"Planning(scaling={{{fmt.value!r}: {value!r}}}): expected 'tensor', 'row', 'block', 'mx' or a Scaling") from None
        if not isinstance(scaling, Scaling):
            raise SearchError(f"Planning(scaling={{{fmt.value!r}: ...}}): expected 'tensor', 'row', 'block', 'mx' or a Scaling, got {type(value).__name__}")
        if not fmt.needs_scale:
            raise SearchError(f"Planning(scaling={{{fmt.value!r}: ...}}): {fmt.value} takes no scale; name fp8_e4m3, fp8_e5m2 or int8")
        try:
            LayerPrecision(fmt, scaling=scaling)
        except PlanError as exc:
            raise SearchError(f"Planning(scaling={{{fmt.value!r}: {value!r}}}): {exc}") from None
        return scaling

    def _checked_grad_formats(self) -> dict[Format, tuple[tuple[Format, bool], ...]]:
        if not isinstance(self.grad_formats, Mapping):
            raise SearchError(f"Planning(grad_formats={self.grad_formats!r}): expected a table of format = gradient format, e.g. {{'nvfp4': 'fp32'}}")
        grad_formats = {}
        for name, given in self.grad_formats.items():
            values = list(given) if isinstance(given, list) or (isinstance(given, tuple) and not _held_grads(given)) else [given]
            try:
                fmt, grads = Format.parse(name), tuple(dict.fromkeys(_grads(v) for v in values))
            except (FormatError, ValueError, TypeError):
                raise SearchError(f"Planning(grad_formats={{{name!r}: {given!r}}}): expected a format name and gradient formats, e.g. "
                                  "{'nvfp4': 'fp32'} or, per GEMM (input gradient / weight gradient), {'fp8_e4m3': 'fp8_e5m2/fp32'}") from None
            if not grads:
                raise SearchError(f"Planning(grad_formats={{{fmt.value!r}: []}}): name at least one gradient format, e.g. ['fp8_e5m2', 'fp32']")
            for grad, high_weight_grad in grads:
                try:  # the rules between a format and its gradients, as a plan holding it checks them, in each of its scalings
                    for scaling in self.scaling.get(fmt, (Scaling(),)):
                        LayerPrecision(fmt, grad_format=grad, scaling=scaling, high_precision_weight_grad=high_weight_grad)
                except PlanError as exc:
                    shown = grad.value + ("/fp32" if high_weight_grad else "")
                    raise SearchError(f"Planning(grad_formats={{{fmt.value!r}: {shown!r}}}): {exc}") from None
            grad_formats[fmt] = grads
        return grad_formats

    def _checked_recipes(self) -> tuple[LayerPrecision, ...]:
        given = self.recipes
        if isinstance(given, (str, LayerPrecision)) or not isinstance(given, (list, tuple)):
            raise SearchError(f"Planning(recipes={given!r}): expected a list of recipe names or LayerPrecisions, e.g. ['te_mxfp8', 'torchao_rowwise_with_gw_hp']")
        held = []
        for value in given:
            name = value if isinstance(value, str) else getattr(value, "recipe", value)
            if isinstance(value, str):
                try:
                    value = LayerPrecision.preset(value)
                except PlanError as exc:
                    raise SearchError(f"Planning(recipes=[{value!r}]): {str(exc).split(': ', 1)[-1]}") from None
            elif not isinstance(value, LayerPrecision):
                raise SearchError(f"Planning(recipes=[{value!r}]): expected a recipe name (LayerPrecision.preset) or a LayerPrecision")
            if self.formats and value.format not in self.formats:
                raise SearchError(f"Planning(recipes=[{name!r}]): a {value.format.value} recipe, and {value.format.value} is not among the "
                                  f"candidate formats ({', '.join(f.value for f in self.formats)}); add it to the formats or leave the recipe out")
            # Without its reason: a preset that is a format's own recipe (te_current) is that recipe.
            held.append(dataclasses.replace(value, reason=""))
        return tuple(dict.fromkeys(held))

    def _recipes(self, fmt: Format) -> list[LayerPrecision]:
        """Every recipe of ``fmt`` given, its own first: each scaling with each gradient format
        (none named: the scaling's default), then the named ``recipes`` of ``fmt``."""
        grads = self.grad_formats.get(fmt, ((None, False),))
        recipes = [LayerPrecision(fmt, grad_format=g, scaling=s, high_precision_weight_grad=w) for s in self.scaling.get(fmt, (Scaling(),)) for g, w in grads]
        return list(dict.fromkeys(recipes + [lp for lp in self.recipes if lp.format is fmt]))

    def precisions(self) -> dict[Format, LayerPrecision]:
        """Each candidate format as the search costs, estimates and plans it: its first scaling
        with its first gradient format."""
        return {f: self._recipes(f)[0] for f in self.formats}

    def alternative_rounds(self) -> tuple[tuple[LayerPrecision, ...], ...]:
        """`alternatives` in rounds that hold each format once, as one sensitivity estimate
        scores them: the n-th alternative of every format in the n-th round."""
        by_format = [self._recipes(f)[1:] for f in self.formats]
        return tuple(tuple(r[n] for r in by_format if len(r) > n) for n in range(max(map(len, by_format), default=0)))

    def alternatives(self) -> tuple[LayerPrecision, ...]:
        """The candidate formats' other recipes (each further scaling and gradient format given):
        choices a layer may take beside its format's own, costed and estimated apart."""
        return tuple(lp for f in self.formats for lp in self._recipes(f)[1:])
