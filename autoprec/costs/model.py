"""`CostModel`: per (layer, format) bytes and seconds, and whole-plan predictions.

Built from one traced forward (`trace.trace_model`), the memory arithmetic (`memory`) and
per-layer times. A plan's predicted step time is the sum of its layers' times plus a
format-independent *rest of the step* (embeddings, norms, the loss, the optimizer).

**Times** are measured **in place** by default (`inplace.measure_in_place`): real training steps
under each format's uniform plan, each layer's forward and backward timed where it runs, the rest
being the FP32 step minus its layers. So every uniform plan's prediction is its measured step,
and a mixed plan's the sum of the same layers' in-place times (calibrating per-call replays
against one step cannot: their error is a per-call fixed cost that weighs differently on every
layer size and format). Replays (`product_times.MeasuredTimeModel`) remain for a format asked for
later, or one whose uniform plan cannot run.

**Bytes**: the layers' own plus what ops outside layers save, measured with an FP32 region and a
low-precision one (`region_bytes_steps`), plus for each FP32 layer inside a low region the
measured extra that costs, less what two FP32 layers in a row hold once (`fp32_pair_bytes`);
a layer whose kernel saves more in the low region than its shapes say is charged the measured
difference (`low_saved_correction`). Predictions err toward more memory.

**Recompute blocks** (`autoprec.blocks`, built with ``blocks=``): what recomputing each block
frees and costs, `BlockCost` (measured per region, `block_bytes_steps`; its seconds one more
forward of the block, timed in place).

`autoprec.bench.check_uniform_ranking` checks the model against reality: predicted and measured
step times of the uniform plans on a workload, ranked.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from .._generators import Pace, at_once
from ..blocks import layers_of_blocks
from ..device import format_support
from ..errors import CostModelError
from ..formats import Format
from ..plan import LayerPrecision, Plan
from ..runtime import EmulationWarning, apply_plan, removing
from .figures import BlockCost, LayerCost, PlanCost
from .inplace import InPlaceTimes, measure_in_place
from .memory import layer_memory
from .product_times import MeasuredTimeModel, RooflineTimeModel, TimeEstimate, TimeModel, TimingSettings, peaks_for
from .targets import TargetDevice
from .times_cache import load_times, precision_key, save_times
from .trace import ModelTrace, saved_bytes_by_layer, trace_model, trace_roles

__all__ = ["DEFAULT_FORMATS", "CostModel"]

logger = logging.getLogger(__name__)

# The formats a search chooses from by default (search.space.DEFAULT_CANDIDATES): FP8 E5M2 is
# a gradient format; cost it by passing formats=.
DEFAULT_FORMATS = (Format.FP32, Format.BF16, Format.FP16, Format.FP8_E4M3, Format.INT8)


class CostModel:
    """Per (layer, format) costs of one model on one device; build it with `CostModel.build`.

    Times are estimated lazily per format (the formats given at construction up front, all
    their calls interleaved); a format asked for later is measured then.
    """

    def __init__(
        self,
        trace: ModelTrace,
        time_model: TimeModel,
        *,
        formats: Iterable["Format | str"] = DEFAULT_FORMATS,
        rest_seconds: float = 0.0,
        in_place: "Mapping[Format, InPlaceTimes] | None" = None,
        rest_saved_bytes: "tuple[int, int] | None" = None,
        fp32_in_region_bytes: "Mapping[str, int] | None" = None,
        fp32_pair_bytes: "Mapping[tuple[str, str], int] | None" = None,
        low_saved_correction: "Mapping[str, int] | None" = None,
        blocks: "Mapping[str, BlockCost] | None" = None,
        precisions: "Mapping[Format, LayerPrecision] | None" = None,
        target: "TargetDevice | None" = None,
    ):
        self.trace = trace
        # The device the layers are priced for when not the one they run on (`build`'s ``target``).
        self.target = target
        # format -> the precision a layer in it is costed and planned in (default: the format's own).
        self.precisions: dict[Format, LayerPrecision] = {Format.parse(f): lp for f, lp in (precisions or {}).items()}
        self.time_model = time_model
        self.device = trace.device
        self.rest_seconds = float(rest_seconds)
        # format -> per-layer seconds measured in place; these formats never ask the time model.
        self.in_place = dict(in_place or {})
        # (FP32 region, low-precision region); the trace's FP32 figure for both when unmeasured.
        self.rest_saved_bytes = tuple(rest_saved_bytes) if rest_saved_bytes is not None else (trace.rest_saved_bytes, trace.rest_saved_bytes)
        # fqn -> extra bytes saved when that layer stays FP32 inside a lowered region (see build).
        self.fp32_in_region_bytes = dict(fp32_in_region_bytes or {})
        # (fqn, the layer that ran before it) -> the part of fqn's extra that is not held when that
        # layer is FP32 too (its input then arrives in FP32: no upcast copy; see region_bytes_steps).
        self.fp32_pair_bytes = dict(fp32_pair_bytes or {})
        # fqn -> what the layer saved in the lowered region's forward beyond what its model says it
        # saves in `region_format` (region_bytes_steps): a kernel may save more than its operands'
        # format suggests (CPU math attention upcasts BF16 to FP32 and saves that).
        self.low_saved_correction = dict(low_saved_correction or {})
        # block fqn -> what recomputing it frees and costs (`BlockCost`); empty: none costed.
        self.blocks: dict[str, BlockCost] = dict(blocks or {})
        self._times: dict[tuple[str, Format], TimeEstimate] = {}
        self._timed: set[Format] = set()  # formats every call has a time in (`_ensure_times`)
        # (format, reason) -> its precision (`precision`): made and validated once, not per layer.
        self._precisions: dict[tuple[Format, str], LayerPrecision] = {}
        # (layer, precision) -> its modelled bytes: the space asks each twice (its table and its
        # recompute blocks), each candidate plan again.
        self._memory: dict[tuple[str, LayerPrecision], Any] = {}
        # Gradient-recipe alternatives' roofline ratios (`_backward_ratio`), and the peaks they take.
        self._ratios: dict[tuple[str, LayerPrecision], float] = {}
        self._peaks: Any = None
        self.formats = tuple(Format.parse(f) for f in formats)
        self._ensure_times(self.formats)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        model: nn.Module,
        example_inputs: Any,
        *,
        loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
        formats: Iterable["Format | str"] = DEFAULT_FORMATS,
        blocks: "Sequence[str] | None" = None,
        timing: TimingSettings = TimingSettings(),
        precisions: "Mapping[Format, LayerPrecision] | None" = None,
        target: "TargetDevice | None" = None,
    ) -> "CostModel":
        """Trace ``model`` on ``example_inputs`` and cost every layer in ``formats``.

        Cost: one FP32 forward (trace), one low-precision forward per role of layer + 1 (bytes
        saved between layers; `trace_roles`), and the timed steps (FP32 only with a
        ``time_model``); with ``blocks``, two more forwards per kind of block and two per run
        (the bytes it frees, per region). The model is left unchanged.

        Args:
            model: the model to cost, on the device it will train on.
            example_inputs: one batch's inputs (one input, a tuple, a dict of keyword inputs or
                a `calls.ModelCall`); its shapes are the ones costed.
            loss_fn: ``loss_fn(model, example_inputs) -> loss`` (None: the mean of the floating outputs).
            formats: the formats costed up front; another is estimated when first asked.
            blocks: fqns of recompute units (`autoprec.blocks.find_blocks`) to cost
                (`BlockCost`); their forwards are timed in the same steps and kept in the
                ``times_file`` with the layers' times.
            timing: how the seconds are got (`TimingSettings`; default: every layer timed in place).
            precisions: format -> the `LayerPrecision` a layer in it is timed, costed and planned
                in (a scaling other than the default, e.g. block-scaled FP8; the times file keys
                on it); default each format's own.
            target: price the layers for this device instead of the one they run on
                (`targets.TargetDevice`): `RooflineTimeModel` at its rates on its kernel paths,
                bytes as its kernels save them, no step timed (``timing`` is then
                ``TimingSettings(in_place=False)``: the predicted step covers the layers only).

        Returns:
            The cost model.

        Raises:
            CostModelError: ``timing`` is not a `TimingSettings`, ``formats`` is empty, the model
                runs no matrix product, a block is no module or holds no traced layer, or the
                FP32 step fails in place.
            FormatError: an unknown format name.
        """
        if not isinstance(timing, TimingSettings):
            raise CostModelError(
                f"CostModel.build(timing={type(timing).__name__}): expected a TimingSettings, e.g. TimingSettings(in_place=False)"
            )
        measure, time_model, times_file = timing.in_place, timing.time_model, timing.times_file
        if target is not None:
            measure, time_model = False, RooflineTimeModel(target=target, precisions=precisions)
        formats = parsed = tuple(Format.parse(f) for f in formats)
        if not formats:
            raise CostModelError("CostModel.build(formats=()): give at least one format, e.g. DEFAULT_FORMATS")
        trace = trace_model(model, example_inputs, loss_fn)
        roles = trace_roles(trace)
        block_layers = _block_layers(model, trace, blocks or ())
        in_place: dict[Format, InPlaceTimes] = {}
        if measure:
            wanted = parsed if time_model is None else (Format.FP32,)
            timed = (Format.FP32,) + tuple(f for f in wanted if f is not Format.FP32)
            layers = list(trace.layers)
            chosen = {f: (precisions or {}).get(f, LayerPrecision(f)) for f in timed}
            plans = {f: Plan({fqn: _steady(chosen[f]) for fqn in layers}) for f in timed}
            scaling = precision_key(chosen)
            loaded = load_times(times_file, layers, timed, trace.device, list(block_layers), scaling)
            if loaded is not None:
                in_place = loaded
            else:
                in_place = measure_in_place(model, [example_inputs], plans, layers, loss_fn, warmup=timing.warmup_steps,
                                            steps=timing.timed_steps, blocks=list(block_layers), roles=roles)
                save_times(times_file, layers, in_place, trace.device, list(block_layers), scaling)
            if Format.FP32 not in in_place:
                raise CostModelError("CostModel.build: the FP32 training step failed in place; check loss_fn and example_inputs")
        if time_model is None:
            time_model = MeasuredTimeModel(timing.cache_dir) if measure else RooflineTimeModel(precisions=precisions)
            costs = cls(trace, time_model, formats=formats, in_place=in_place, precisions=precisions)
        else:
            costs = cls(trace, time_model, formats=formats, precisions=precisions, target=target)
        for _ in costs.region_bytes_steps(model, example_inputs, loss_fn, roles=roles):
            pass
        for _ in costs.block_bytes_steps(model, example_inputs, loss_fn, block_layers, roles=roles):
            pass
        if measure:
            fp32 = in_place[Format.FP32]
            layers_seconds = costs.plan_cost(costs.uniform_plan(Format.FP32)).layer_seconds
            costs.rest_seconds = max(0.0, fp32.step_seconds - layers_seconds)
        return costs

    def region_bytes_steps(self, model: nn.Module, example_inputs: Any, loss_fn: Optional[Callable] = None,
                           roles: "Mapping[str, str] | None" = None, pace: "Pace | None" = None) -> Iterator[str]:
        """Bytes that depend on a layer's neighbours, measured: what ops outside layers save in a
        lowered region (activations between layers 2 bytes wide: a uniform BF16, else FP16,
        plan), and per layer the extra that keeping it FP32 inside that region costs (its FP32
        output makes the ops after it save FP32; half inputs are upcast copies). The extra is
        measured against half-precision neighbours, the most it can be, so predictions err on
        the side of more memory. A generator: one forward (autograd on, no backward) per unit,
        the region first, then one per layer, or per role with ``roles``. Sets
        ``rest_saved_bytes`` and ``fp32_in_region_bytes``; on a device with no half format it
        measures nothing.

        Part of an extra is pairwise: an FP32 layer fed a half input saves an FP32 copy of it,
        which it does not when the layer before it (`ModelTrace.ran_before`) is FP32 too (an
        attention's products after an FP32 input projection). So a layer with an extra is
        measured once more with the layer before it FP32 too, and what the two hold together
        less than apart is ``fp32_pair_bytes`` (zero where they do not interact): one more
        forward per layer with an extra (per pair of roles with ``roles``).

        Args:
            model: the model this cost model was built from.
            example_inputs: the inputs it was built on.
            loss_fn: the loss it was built with (None: the mean of the floating outputs).
            roles: fqn -> its role (`trace_roles`): a layer takes the figure of the first layer
                of its role; None: each layer measured.
            pace: runs each forward, in parts (`search.paced`: its labels yielded between
                them); None: each at once.

        Yields:
            ``"region"`` after the region's forward, then each layer's fqn once measured.
        """
        fmt = next((f for f in (Format.BF16, Format.FP16) if format_support(f, self.device).runnable), None)
        if fmt is None:
            return
        layers = list(self.trace.layers)
        low = Plan({fqn: LayerPrecision(fmt) for fqn in layers})

        def saved(plan: Plan) -> Generator[str, None, tuple[dict[str, int], int]]:
            return (pace or at_once)(lambda: self._saved_by_layer(model, example_inputs, loss_fn, plan))

        per_low, rest_low = yield from saved(low)
        self.rest_saved_bytes = (self.trace.rest_saved_bytes, rest_low)
        # Only where a layer saved more than its shapes say: one that saved less shares a cast
        # input with a layer before it in the same format (a Llama's k_proj and v_proj, after
        # q_proj), which a plan giving them other formats does not.
        modelled_low = {fqn: layer_memory(self._layer(fqn), LayerPrecision(fmt), self.device, self.target).saved_bytes for fqn in layers}
        self.low_saved_correction = {fqn: per_low[fqn] - modelled_low[fqn] for fqn in layers if per_low.get(fqn, 0) > modelled_low[fqn]}
        self._memory.clear()
        total_low = sum(per_low.values()) + rest_low
        yield "region"
        by_role: dict[str, int] = {}
        for fqn in layers:
            role = roles.get(fqn) if roles is not None else None
            if role is not None and role in by_role:
                self.fp32_in_region_bytes[fqn] = by_role[role]
                continue
            per, rest = yield from saved(low.with_layers({fqn: Format.FP32}))
            modelled = self._fp32_modelled_extra(fqn, fmt)
            self.fp32_in_region_bytes[fqn] = max(0, sum(per.values()) + rest - total_low - modelled)
            if role is not None:
                by_role[role] = self.fp32_in_region_bytes[fqn]
            yield fqn
        before = self.trace.ran_before()
        by_roles: dict[tuple[str, str], int] = {}
        for fqn in layers:
            other = before.get(fqn)
            if other is None or self.fp32_in_region_bytes[fqn] == 0:
                continue
            role, other_role = (roles.get(fqn), roles.get(other)) if roles is not None else (None, None)
            key = (role, other_role) if role is not None and other_role is not None else None
            if key is not None and key in by_roles:
                shared = by_roles[key]
            else:
                pair = {fqn: Format.FP32, other: Format.FP32}
                per, rest = yield from saved(low.with_layers(pair))
                modelled = sum(self._fp32_modelled_extra(name, fmt) for name in pair)
                apart = self.fp32_in_region_bytes[fqn] + self.fp32_in_region_bytes[other]
                shared = min(apart, max(0, apart - (sum(per.values()) + rest - total_low - modelled)))
                if key is not None:
                    by_roles[key] = shared
                yield fqn
            if shared:
                self.fp32_pair_bytes[(fqn, other)] = shared

    def _fp32_modelled_extra(self, fqn: str, fmt: Format) -> int:
        """The bytes a layer's own costs say it saves more in FP32 than in ``fmt``."""
        return self._layer_memory(fqn, LayerPrecision(Format.FP32)).saved_bytes - self._layer_memory(fqn, LayerPrecision(fmt)).saved_bytes

    def _layer_memory(self, fqn: str, precision: LayerPrecision) -> Any:
        """A layer's `MemoryCost` in ``precision``: modelled from its traced shapes, plus in a
        lowered format its measured correction (`low_saved_correction`); none for a target
        device (the correction is this device's kernels'). Cached."""
        memory = self._memory.get((fqn, precision))
        if memory is None:
            memory = layer_memory(self._layer(fqn), precision, self.device, self.target)
            if self.target is None and precision.format is not Format.FP32 and fqn in self.low_saved_correction:
                memory = dataclasses.replace(memory, other_saved_bytes=memory.other_saved_bytes + self.low_saved_correction[fqn])
            self._memory[(fqn, precision)] = memory
        return memory

    @property
    def region_format(self) -> "Format | None":
        """The half format of a lowered region's activations here (BF16, else FP16), or None."""
        return next((f for f in (Format.BF16, Format.FP16) if format_support(f, self.device).runnable), None)

    def _saved_by_layer(self, model, example_inputs, loss_fn, plan: Plan) -> tuple[dict[str, int], int]:
        """Bytes one forward under ``plan`` saves, per layer and outside layers (measured). A layer
        whose code raises in its format (DeBERTa's attention in BF16) is measured in FP32: the
        search rules that format out for it (`PlanRuntime.tolerate_failures`)."""
        runtime = apply_plan(model, plan, validate=False)
        runtime.tolerate_failures()
        with warnings.catch_warnings(), removing([runtime]):
            warnings.simplefilter("ignore", EmulationWarning)
            return saved_bytes_by_layer(model, example_inputs, list(self.trace.layers), lambda: runtime, loss_fn)

    def block_bytes_steps(self, model: nn.Module, example_inputs: Any, loss_fn: Optional[Callable],
                          blocks: Mapping[str, Sequence[str]], roles: "Mapping[str, str] | None" = None,
                          pace: "Pace | None" = None) -> Iterator[str]:
        """Measure what recomputing each of ``blocks`` (fqn -> its traced layers) frees, into
        `blocks` (`BlockCost`): per region (the FP32 plan, the uniform plan in
        `region_format`) one forward as it is and one per block recomputed, autograd on and no
        backward; with ``roles`` (fqn -> `LayerInfo.role`) one per kind of block instead: blocks
        of one class whose layers have the same roles (a decoder's identical layers) save the
        same tensors, so the first of a kind is measured and the others take its figures:
        O(kinds) forwards of O(layers) each, where one per block made the stage quadratic in
        depth. The in-place times (when measured) must be set before, since the block's own
        forward seconds are taken from them.

        Args:
            model: the model this cost model was built from.
            example_inputs: the inputs it was built on.
            loss_fn: the loss it was built with (None: the mean of the floating outputs).
            blocks: block fqn -> the traced layers it holds.
            roles: fqn -> its role (`trace_roles`); None: each block measured.
            pace: as `region_bytes_steps`'.

        Yields:
            ``"block forward"`` after each forward, and each block's fqn once costed.
        """
        if not blocks:
            return
        regions = [Format.FP32] + ([self.region_format] if self.region_format is not None else [])
        modules = dict(model.named_modules())
        bases: dict[Format, int] = {}
        by_kind: dict[Any, tuple[int, int]] = {}

        def saved(plan: Plan) -> Generator[str, None, int]:
            per, rest = yield from (pace or at_once)(lambda: self._saved_by_layer(model, example_inputs, loss_fn, plan))
            return sum(per.values()) + rest

        for fqn, layers in blocks.items():
            kind = (type(modules[fqn]).__name__, tuple(roles.get(layer) for layer in layers)) if roles is not None else fqn
            if kind not in by_kind:
                freed = []
                for fmt in regions:
                    plan = self.uniform_plan(fmt)
                    if fmt not in bases:
                        bases[fmt] = yield from saved(plan)
                        yield "block forward"
                    freed.append(bases[fmt] - (yield from saved(plan.with_recompute([fqn]))))
                    yield "block forward"
                by_kind[kind] = (freed[0], freed[-1])  # a device without a half format: the FP32 figure for both
            pair = by_kind[kind]
            # The layers' part from the memory model (no time estimate needed for the region's format).
            other = tuple(pair[i] - sum(layer_memory(self._layer(layer), LayerPrecision(regions[min(i, len(regions) - 1)]), self.device).saved_bytes
                                        for layer in layers) for i in (0, 1))
            seconds = tuple(self._block_other_seconds(fqn, layers, fmt) for fmt in (regions[0], regions[-1]))
            self.blocks[fqn] = BlockCost(fqn, tuple(layers), pair, (other[0], other[1]), (seconds[0], seconds[1]))
            yield fqn

    def _block_other_seconds(self, fqn: str, layers: Sequence[str], fmt: Format) -> float:
        """The block's own ops' forward seconds (its forward less its layers') in the uniform
        ``fmt`` step timed in place, else the FP32 one; 0 when neither timed blocks."""
        times = self.in_place.get(fmt) if fmt in self.in_place and fqn in self.in_place[fmt].block_seconds else self.in_place.get(Format.FP32)
        if times is None or fqn not in times.block_seconds:
            return 0.0
        # Timing noise can make the difference of two medians slightly negative: no op costs less than nothing.
        return max(0.0, times.block_seconds[fqn] - sum(times.forward_seconds.get(layer, 0.0) for layer in layers))

    def layer_forward_seconds(self, fqn: str, fmt: "Format | str") -> float:
        """Seconds of one forward of a layer (its share of one more forward of a recomputed
        block): timed in place when the format was, else derived (`BlockCost`).

        Args:
            fqn: a traced layer.
            fmt: its format (a `Format` or its name).

        Returns:
            Seconds of one forward.

        Raises:
            CostModelError: ``fqn`` is not a traced layer.
            FormatError: an unknown format name.
        """
        fmt = Format.parse(fmt)
        times = self.in_place.get(fmt)
        if times is not None and fqn in times.forward_seconds:
            return times.forward_seconds[fqn]
        fp32 = self.in_place.get(Format.FP32)
        if fp32 is not None and fp32.layer_seconds.get(fqn, 0.0) > 0 and fqn in fp32.forward_seconds:
            share = min(1.0, fp32.forward_seconds[fqn] / fp32.layer_seconds[fqn])
        else:
            share = 1 / 3  # forward 2N of the 6N FLOPs per token of a step (Kaplan et al. 2020, sec. 2.1)
        return self.layer_cost(fqn, fmt).seconds * share

    # -- queries ------------------------------------------------------------------------------

    @property
    def layers(self) -> tuple[str, ...]:
        """Layer fqns in model order."""
        return tuple(self.trace.layers)

    def precision(self, fmt: "Format | str", reason: str = "") -> LayerPrecision:
        """A format as this model costs it.

        Args:
            fmt: a `Format` or its name.
            reason: the returned precision's ``reason``.

        Returns:
            Its `LayerPrecision`: the model's ``precisions`` entry, else the format's default.

        Raises:
            FormatError: an unknown format name.
        """
        fmt = Format.parse(fmt)
        made = self._precisions.get((fmt, reason))
        if made is None:
            lp = self.precisions.get(fmt)
            made = self._precisions[fmt, reason] = LayerPrecision(fmt, reason=reason) if lp is None else dataclasses.replace(lp, reason=reason)
        return made

    def uniform_plan(self, fmt: "Format | str") -> Plan:
        """Every traced layer in one format (the traced layers are exactly the plan's layers).

        Args:
            fmt: a `Format` or its name, costed as `precision` gives it.

        Returns:
            The plan (without a fingerprint).

        Raises:
            FormatError: an unknown format name.
        """
        fmt = Format.parse(fmt)
        return Plan({fqn: self.precision(fmt, f"uniform {fmt.value} plan") for fqn in self.trace.layers})

    def _ensure_times(self, formats: Sequence[Format]) -> None:
        """Estimate every call's time in ``formats`` once per format (each `layer_cost` asks:
        a check over every call each time made costing the model quadratic in its layers)."""
        if all(f in self._timed for f in formats):
            return
        calls = [call for layer in self.trace.layers.values() for call in layer.calls]
        missing = [f for f in formats if f not in self.in_place and any((call.key, f) not in self._times for call in calls)]
        if missing:
            self._times.update(self.time_model.estimate(calls, missing, self.device))
        self._timed.update(formats)

    def _layer(self, fqn: str):
        try:
            return self.trace.layers[fqn]
        except KeyError:
            known = ", ".join(repr(f) for f in list(self.trace.layers)[:6])
            raise CostModelError(f"layer_cost({fqn!r}): not a layer of the traced model; layers are {known}{', ...' if len(self.trace.layers) > 6 else ''}") from None

    def layer_cost(self, fqn: str, precision: "LayerPrecision | Format | str") -> LayerCost:
        """The bytes and seconds of one layer in one precision. A format not costed before is
        estimated first (per-call replays: `TimingSettings`).

        Args:
            fqn: a traced layer.
            precision: a format (a `Format` or its name, costed as `precision` gives it), or a
                `LayerPrecision` whose scaling changes the bytes of saved scales; times are those
                of the format as the model was built (in place in its ``precisions``), scaled
                where ``precision`` differs from it in its gradients only (`_backward_ratio`).

        Returns:
            The `LayerCost` (bytes held per step; seconds per step, forward and backward).

        Raises:
            CostModelError: ``fqn`` is not a traced layer.
            FormatError: an unknown format name.
        """
        layer = self._layer(fqn)
        if not isinstance(precision, LayerPrecision):
            precision = self.precision(precision)
        fmt = precision.format
        self._ensure_times([fmt])
        memory = self._layer_memory(fqn, precision)
        if fmt in self.in_place:
            estimates = [TimeEstimate(self.in_place[fmt].layer_seconds[fqn], "in place")]
        else:
            estimates = [self._times[(call.key, fmt)] for call in layer.calls]
        sources = sorted({e.source for e in estimates})
        seconds = sum(e.seconds for e in estimates)
        ratio = self._backward_ratio(layer, precision)
        if ratio != 1.0:
            sources.append("its backward by roofline")
        return LayerCost(
            fqn=fqn,
            format=fmt,
            weight_copy_bytes=memory.weight_copy_bytes,
            activation_bytes=memory.activation_bytes,
            other_saved_bytes=memory.other_saved_bytes,
            grad_bytes=memory.grad_bytes,
            seconds=seconds * ratio,
            time_source="; ".join(sources),
        )

    def _backward_ratio(self, layer: Any, precision: LayerPrecision) -> float:
        """A recipe that differs from its format's costed one in its gradients only (a
        high-precision backward, or weight gradient, beside the format's own): the measured
        seconds times the roofline ratio of the two over the layer's calls, since the forward
        products are the ones timed and the backward GEMMs' formats differ. 1.0 for the
        format's own recipe and for other scalings (timed as the format's, docs/fp8_blocks.md).
        One roofline estimate per call and recipe (the device's peaks calibrated once)."""
        own = self.precision(precision.format)
        if precision.scaling != own.scaling or (precision.grad_format, precision.high_precision_weight_grad) == (
                own.grad_format, own.high_precision_weight_grad):
            return 1.0
        key = (layer.fqn, precision)
        if key not in self._ratios:
            if self._peaks is None:
                given = self.time_model.peaks if isinstance(self.time_model, RooflineTimeModel) else None
                self._peaks = given or (self.target.peaks if self.target is not None else peaks_for(self.device))
            mine, theirs = (RooflineTimeModel(self._peaks, target=self.target, precisions={precision.format: lp}) for lp in (precision, own))
            planned = sum(theirs.seconds(call, precision.format, self.device) for call in layer.calls)
            self._ratios[key] = sum(mine.seconds(call, precision.format, self.device) for call in layer.calls) / planned if planned > 0 else 1.0
        return self._ratios[key]

    def plan_cost(self, plan: Plan) -> PlanCost:
        """Predicted bytes and step seconds of a plan.

        Args:
            plan: a plan naming exactly the traced layers (e.g. from `uniform_plan`) and
                recomputing only blocks this model costed.

        Returns:
            The `PlanCost` (bytes held per step, seconds per step, recomputation included).

        Raises:
            CostModelError: the plan's layers differ from the traced ones, or it recomputes a
                block not costed.
        """
        unknown = sorted(set(plan.layers) - set(self.trace.layers))
        missing = [fqn for fqn in self.trace.layers if fqn not in plan.layers]
        problems = [f"{fqn!r}: ran no matrix product in the traced forward" for fqn in unknown]
        problems += [f"{fqn!r}: a traced layer the plan lacks" for fqn in missing]
        if problems:
            raise CostModelError(
                "plan_cost: the plan does not match the traced model:\n  - " + "\n  - ".join(problems)
                + "\nMake the plan with an example input (Plan.uniform(model, fmt, example)) or from cost_model.uniform_plan(fmt)."
            )
        unknown_blocks = [fqn for fqn in plan.recompute if fqn not in self.blocks]
        if unknown_blocks:
            known = ", ".join(map(repr, self.blocks)) or "none"
            raise CostModelError(f"plan_cost: the plan recomputes {unknown_blocks[0]!r}, a block this cost model did not cost (costed: {known}); "
                                 "build it with blocks=find_blocks(model, layers)")
        self._ensure_times(sorted({lp.format for lp in plan.layers.values()}, key=list(Format).index))
        layers = {fqn: self.layer_cost(fqn, plan.layers[fqn]) for fqn in self.trace.layers}
        lowered = any(lp.format is not Format.FP32 for lp in plan.layers.values())
        freed, seconds = 0, 0.0
        for fqn in plan.recompute:
            block = self.blocks[fqn]
            freed += block.other_bytes[lowered] + sum(layers[layer].saved_bytes for layer in block.layers)
            seconds += block.other_seconds[lowered] + sum(self.layer_forward_seconds(layer, layers[layer].format) for layer in block.layers)
        if not lowered:
            return PlanCost(layers, self.rest_saved_bytes[0], self.rest_seconds, freed, seconds, self.trace.rest_grad_bytes)
        fp32 = {fqn for fqn, lp in plan.layers.items() if lp.format is Format.FP32}
        extra = sum(self.fp32_in_region_bytes.get(fqn, 0) for fqn in fp32)
        extra -= sum(held for (fqn, other), held in self.fp32_pair_bytes.items() if fqn in fp32 and other in fp32)
        return PlanCost(layers, self.rest_saved_bytes[1] + extra, self.rest_seconds, freed, seconds, self.trace.rest_grad_bytes)

    def fp32_bytes(self) -> int:
        """Predicted bytes of the all-FP32 plan: the denominator of a fractional memory budget."""
        return self.plan_cost(self.uniform_plan(Format.FP32)).bytes

    def table(self, formats: Optional[Iterable["Format | str"]] = None) -> dict[str, dict[Format, LayerCost]]:
        """Every layer's cost in each of some formats.

        Args:
            formats: the formats (`Format` or names); None: the model's ``formats``.

        Returns:
            ``fqn -> {format: LayerCost}``, layers in model order.

        Raises:
            FormatError: an unknown format name.
        """
        formats = tuple(Format.parse(f) for f in formats) if formats is not None else self.formats
        return {fqn: {f: self.layer_cost(fqn, f) for f in formats} for fqn in self.trace.layers}

    def describe(self, fqns: Optional[Sequence[str]] = None, formats: Optional[Iterable["Format | str"]] = None) -> str:
        """A text table: per layer and format, milliseconds per step and saved kilobytes.

        Args:
            fqns: the layers, as rows (None: every traced layer).
            formats: the formats, as columns (None: the model's ``formats``).

        Returns:
            The table, one line per layer under two header lines.

        Raises:
            CostModelError: a name in ``fqns`` is not a traced layer.
            FormatError: an unknown format name.
        """
        formats = tuple(Format.parse(f) for f in formats) if formats is not None else self.formats
        fqns = list(fqns) if fqns is not None else list(self.trace.layers)
        width = max(len(f) for f in fqns + ["layer"])
        head = f"{'layer':<{width}}  " + "  ".join(f"{f.value:>17}" for f in formats)
        lines = [head, f"{'':<{width}}  " + "  ".join(f"{'ms':>8} {'saved KB':>8}" for _ in formats)]
        for fqn in fqns:
            cells = []
            for f in formats:
                c = self.layer_cost(fqn, f)
                cells.append(f"{c.seconds * 1e3:8.3f} {c.saved_bytes / 1024:8.1f}")
            lines.append(f"{fqn:<{width}}  " + "  ".join(cells))
        return "\n".join(lines)


def _steady(precision: LayerPrecision) -> LayerPrecision:
    """``precision`` as timed: INT8 calibrated on one batch, so its runtime is steady after the
    first (untimed) step instead of after `Calibration.batches` warmup steps; a steady step
    costs the same whatever the calibration's length."""
    if precision.format is not Format.INT8:
        return precision
    return dataclasses.replace(precision, calibration=dataclasses.replace(precision.calibration, batches=1))


def _block_layers(model: nn.Module, trace: ModelTrace, blocks: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``block fqn -> its traced layers`` for each of ``blocks``; a one-line `CostModelError` for
    a name that is no module, or a module holding no traced layer."""
    modules = dict(model.named_modules())
    out = {}
    within = layers_of_blocks(blocks, trace.layers)
    for fqn in blocks:
        if fqn not in modules:
            raise CostModelError(f"CostModel.build(blocks=...): {fqn!r} is not a module of the model; pass find_blocks(model, layers)")
        inside = within[fqn]
        if not inside:
            raise CostModelError(f"CostModel.build(blocks=...): {fqn!r} holds no traced layer, so recomputing it frees nothing; drop it")
        out[fqn] = inside
    return out
