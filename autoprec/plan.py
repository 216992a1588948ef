"""The `Plan`: which format each layer trains in, as an immutable, versioned artifact.

A plan maps fully qualified module names to `LayerPrecision` (format, scaling, calibration, and
the reason for the choice). It holds no runtime state: amax histories and calibrated scales live
in the runtime (`autoprec.runtime`), which can be saved and restored on its own.

JSON layout (``schema_version`` 4)::

    {"schema_version": 4, "autoprec_version": "...",
     "fingerprint": {fqn: {"module": "Linear", "ops": ["linear"], "params": {"weight": [o, i]}}},
     "budgets": {...}, "predicted": {...}, "measured": {...}, "metadata": {...},
     "layers": {fqn: {"format": "fp8_e4m3", "grad_format": "fp8_e5m2",
                      "scaling": {...}, "calibration": {...}, "reason": "...",
                      "weight_grad_format": "fp32"}},
     "blocks": {fqn: {"recompute": true}},
     "comm": {fqn: "int8"}}

``blocks`` (new in version 2) names recompute units (`autoprec.blocks.find_blocks`) and whether
each runs recomputed: its forward runs again in the backward instead of its activations being
kept. A plan saved at version 1 has none and loads with no block recomputed.

``comm`` (new in version 3) names how each layer's gradients travel between ranks under DDP
(`formats.CommMethod`: fp32, bf16, fp16, int8 or topk; `autoprec.comm`), as the scheduler chose
from the link it measured and the accuracy budget (``grad_comm="auto"``). Empty: not chosen
(every gradient travels as the run's ``grad_comm`` says). A plan saved before has none.

``weight_grad_format`` (new in version 4, in a layer's entry, written only where set): ``"fp32"``
runs that layer's weight-gradient product in high precision while its input gradient's takes
``grad_format`` (`LayerPrecision.high_precision_weight_grad`). A plan saved before has none.
"""

from __future__ import annotations

import json
import numbers
import os
import types
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch.nn as nn

from ._version import __version__
from ._io import atomic_write_text, check_schema_version
from .coverage import LayerInfo, ModuleFilter, changed_shapes, covered_layers, find_layers, layer_name
from .device import KERNEL_OPS, MX_EMULATED, block_support, format_support
from .errors import PlanError
from .formats import PER_LAYER_COMM, CommMethod, Format, Granularity
from .layer_precision import (
    MAX_HISTORY_LEN, Calibration, CalibrationMethod, LayerPrecision, Reduction, Scaling, ScalingMode, figure_problems, parse_layer,
)

__all__ = ["SCHEMA_VERSION", "ScalingMode", "Reduction", "CalibrationMethod", "Scaling", "Calibration", "LayerPrecision", "MAX_HISTORY_LEN", "Plan"]

SCHEMA_VERSION = 4  # 2: per-block recompute flags ("blocks"); 3: per-layer gradient communication ("comm"); 4: "weight_grad_format"


def _inside(fqn: str, block: str) -> bool:
    """Whether module ``fqn`` lies strictly inside module ``block`` ("" is the root)."""
    return fqn != block and (block == "" or fqn.startswith(block + "."))


def _parse_blocks(blocks: "Mapping[str, bool] | None", problems: list[str]) -> dict[str, bool]:
    """``blocks`` as a plain dict of ``fqn -> bool``; none inside another (the recomputation of
    the outer one already covers the inner one, and the runtime checkpoints each unit once)."""
    if blocks is None:
        return {}
    if not isinstance(blocks, Mapping):
        problems.append(f"blocks: expected a mapping of block fqn -> recompute (true/false), got {type(blocks).__name__}; use Plan.with_recompute([...])")
        return {}
    flags = {}
    for fqn, on in blocks.items():
        if not isinstance(fqn, str):
            problems.append(f"blocks[{fqn!r}]: a block is named by its module fqn, a string")
        elif not isinstance(on, bool):
            problems.append(f"blocks[{fqn!r}]: recompute must be true or false, got {on!r}")
        else:
            flags[fqn] = on
    for fqn in flags:
        outer = next((b for b in flags if _inside(fqn, b)), None)
        if outer is not None:
            problems.append(f"blocks[{fqn!r}]: lies inside block {outer!r}; name one of the two (blocks do not nest)")
    return flags


def _parse_comm(comm: "Mapping[str, CommMethod | str] | None", layers: Mapping[str, Any], problems: list[str]) -> dict[str, CommMethod]:
    """``comm`` as ``fqn -> CommMethod``: each a layer of the plan, each a per-layer method."""
    if comm is None:
        return {}
    if not isinstance(comm, Mapping):
        problems.append(f"comm: expected a mapping of layer fqn -> method, got {type(comm).__name__}; use Plan.with_comm({{...}})")
        return {}
    methods = {}
    choices = ", ".join(m.value for m in PER_LAYER_COMM)
    for fqn, value in comm.items():
        if fqn not in layers:
            problems.append(f"comm[{fqn!r}]: not a layer of this plan; name one of plan.layers")
            continue
        method = next((m for m in PER_LAYER_COMM if value in (m, m.value)), None)
        if method is None:
            why = "; PowerSGD compresses whole buckets: set grad_comm='powersgd' for the run" if value in (CommMethod.POWERSGD, "powersgd") else ""
            problems.append(f"comm[{fqn!r}]: {value!r} is not one of {choices}{why}")
        else:
            methods[fqn] = method
    return methods


def _plain(name: str, figures: "Mapping[str, Any] | None") -> dict:
    """``figures`` as the JSON a plan saves (numpy scalars as the Python numbers they hold), so a
    saved plan loads equal; a `PlanError` names what JSON cannot hold."""
    def number(value: Any) -> Any:
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        raise PlanError(f"Plan({name}=...): {value!r} ({type(value).__name__}) cannot be saved as JSON; give numbers, strings, lists and mappings")

    return json.loads(json.dumps(dict(figures or {}), default=number))


class Plan:
    """An immutable map ``fqn -> LayerPrecision`` with the context it was made in.

    Plans compare equal by value, and a JSON round trip gives an equal plan. Derive variants with
    `replace` / `with_layers` / `with_recompute`; nothing mutates a plan. ``blocks`` maps recompute
    units (module fqns, `autoprec.blocks.find_blocks`) to whether each runs recomputed; ``comm``
    layers to how their gradients travel between ranks (module docstring).
    """

    __slots__ = ("_layers", "_fingerprint", "_blocks", "_comm", "budgets", "predicted", "measured", "metadata")
    # Set once in __init__ (object.__setattr__, as the class refuses assignment); read-only views.
    _layers: Mapping[str, LayerPrecision]
    _fingerprint: Mapping[str, LayerInfo]
    _blocks: Mapping[str, bool]
    _comm: Mapping[str, CommMethod]
    budgets: Mapping[str, Any]
    predicted: Mapping[str, Any]
    measured: Mapping[str, Any]
    metadata: Mapping[str, Any]

    def __init__(
        self,
        layers: Mapping[str, "LayerPrecision | Format | str"],
        fingerprint: "Mapping[str, LayerInfo] | None" = None,
        budgets: "Mapping[str, Any] | None" = None,
        predicted: "Mapping[str, Any] | None" = None,
        measured: "Mapping[str, Any] | None" = None,
        metadata: "Mapping[str, Any] | None" = None,
        blocks: "Mapping[str, bool] | None" = None,
        comm: "Mapping[str, CommMethod | str] | None" = None,
    ):
        problems: list[str] = []
        parsed = {}
        for fqn, value in layers.items():
            # A LayerPrecision checked itself when it was made; a format name or a file's entry here.
            lp = value if isinstance(value, LayerPrecision) else parse_layer(fqn, value, problems)
            if lp is not None:
                parsed[fqn] = lp
        flags = _parse_blocks(blocks, problems)
        methods = _parse_comm(comm, layers, problems)
        if problems:
            raise PlanError(problems, "Fix these entries (see autoprec.plan for the JSON layout).")
        _set = object.__setattr__
        _set(self, "_layers", types.MappingProxyType(parsed))
        _set(self, "_fingerprint", types.MappingProxyType(dict(fingerprint or {})))
        _set(self, "_blocks", types.MappingProxyType(flags))
        _set(self, "_comm", types.MappingProxyType(methods))
        for name, figures in (("budgets", budgets), ("predicted", predicted), ("measured", measured), ("metadata", metadata)):
            _set(self, name, types.MappingProxyType(_plain(name, figures)))

    def __setattr__(self, name, value):
        raise AttributeError("Plan is immutable; derive a new one with plan.replace(...) or plan.with_layers(...)")

    def __delattr__(self, name):
        raise AttributeError("Plan is immutable; derive a new one with plan.replace(...) or plan.with_layers(...)")

    def __reduce__(self):
        # The default protocol restores __slots__ through __setattr__ (which refuses) and cannot
        # pickle mappingproxy; rebuild through the constructor instead (pickle, copy, deepcopy).
        return (Plan, (dict(self._layers), dict(self._fingerprint), dict(self.budgets), dict(self.predicted), dict(self.measured), dict(self.metadata), dict(self._blocks), dict(self._comm)))

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def uniform(
        cls,
        model: nn.Module,
        fmt: "Format | str",
        example_inputs: Any = None,
        *,
        module_filter: "ModuleFilter | None" = None,
        scaling: Scaling = Scaling(),
        calibration: Calibration = Calibration(),
    ) -> "Plan":
        """Every covered layer in ``fmt``; layers that ``module_filter`` rejects stay FP32.

        Layers come from the module tree (`coverage.static_layers`: known classes, and modules
        with a matrix parameter whose own forward runs a matrix product, such as GPT-2's
        ``Conv1D``), or, with ``example_inputs`` (one input, a tuple, a dict of keyword inputs or
        a `calls.ModelCall`), from tracing one forward pass, which also finds matrix products
        of modules without a matrix parameter (attention scores; costs one forward).

        Args:
            model: the model whose layers the plan covers.
            fmt: the format of every covered layer (a `Format` or its name, ``"fp8_e4m3"``).
            example_inputs: one forward's inputs, to find the layers by tracing (None: from the
                module tree).
            module_filter: ``(module, fqn) -> bool``; a layer it rejects stays FP32.
            scaling: how an FP8 / INT8 layer's tensors are scaled (`Scaling`).
            calibration: how an INT8 layer's input scale is calibrated (`Calibration`).

        Returns:
            The plan, its fingerprint the layers found.

        Raises:
            PlanError: the model has no layer that runs a matrix product, or ``fmt`` cannot take
                ``scaling`` / ``calibration``.
        """
        fmt = Format.parse(fmt)
        found = find_layers(model, example_inputs)
        if not found:
            # Plan.load refuses a plan without layers, so one is not created either.
            how = "" if example_inputs is not None else "; if its matrix products run in modules without a matrix parameter, pass example_inputs to find them by tracing"
            raise PlanError(f"Plan.uniform: {type(model).__name__} has no layer that runs a matrix product (linear, matmul, convolution), so there is nothing to plan{how}")
        modules = dict(model.named_modules())
        try:  # made once: a scaling the format cannot take is named once, as the argument it is
            chosen = LayerPrecision(fmt, scaling=scaling, calibration=calibration, reason=f"uniform {fmt.value} plan")
        except PlanError as exc:
            raise PlanError(f"Plan.uniform({fmt.value!r}, ...): {'; '.join(exc.problems)}", single_line=True) from None
        kept = LayerPrecision(Format.FP32, reason="kept FP32 by module_filter")
        layers = {fqn: kept if module_filter is not None and not module_filter(modules[fqn], fqn) else chosen for fqn in found}
        return cls(layers, fingerprint=found, metadata={"source": f"Plan.uniform({fmt.value})"})

    def replace(self, **changes) -> "Plan":
        """A copy with some of its fields replaced; this plan is unchanged.

        Args:
            **changes (Any): new values for some of ``layers``, ``fingerprint``, ``budgets``,
                ``predicted``, ``measured``, ``metadata``, ``blocks``, ``comm`` (as the
                constructor takes them); the others are kept.

        Returns:
            A new plan.

        Raises:
            TypeError: a keyword that is not one of these fields.
            PlanError: a replaced value the constructor refuses (a bad layer entry, nested
                blocks, a comm method for a layer the plan lacks).
        """
        fields = {
            "layers": self._layers,
            "blocks": self._blocks,
            "comm": self._comm,
            "fingerprint": self._fingerprint,
            "budgets": self.budgets,
            "predicted": self.predicted,
            "measured": self.measured,
            "metadata": self.metadata,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Plan.replace() got unknown fields {sorted(unknown)}; expected some of {sorted(fields)}")
        fields.update(changes)
        return Plan(**fields)

    def with_layers(self, changes: Mapping[str, "LayerPrecision | Format | str"]) -> "Plan":
        """A copy where the named layers get new precisions (a format name keeps nothing else).

        Args:
            changes: layer fqn -> its new `LayerPrecision`, `Format` or format name.

        Returns:
            A new plan; this one is unchanged.

        Raises:
            PlanError: a name that is not a layer of this plan, or a format name that is not one.
        """
        unknown = sorted(set(changes) - set(self._layers))
        if unknown:
            raise PlanError([f"{fqn!r}: not a layer of this plan" for fqn in unknown], "Use names from plan.layers.")
        layers: dict[str, "LayerPrecision | Format | str"] = dict(self._layers)
        # A format name goes through the constructor, so a bad one is a PlanError naming the layer.
        layers.update(changes)
        return self.replace(layers=layers)

    def with_comm(self, methods: "Mapping[str, CommMethod | str]") -> "Plan":
        """A copy where the gradients of exactly the layers in ``methods`` travel as it says,
        under ``grad_comm="auto"``: the other layers' in FP32 (a named ``grad_comm`` applies to
        every layer instead; `distributed.grad_comm_methods`).

        Args:
            methods: layer fqn -> `CommMethod` or its name, one of fp32, bf16, fp16, int8, topk
                (``{}``: none chosen).

        Returns:
            A new plan; this one is unchanged.

        Raises:
            PlanError: a layer the plan lacks, or a method no layer may take (PowerSGD compresses
                whole buckets: it is the run's ``grad_comm``, not a layer's).
        """
        return self.replace(comm=methods)

    def with_recompute(self, blocks: "Mapping[str, bool] | Iterable[str]") -> "Plan":
        """A copy with recompute flags set.

        A recomputed block keeps no activations of its own for the backward and runs its forward
        once more there: one extra forward of the block per backward, its layers in their formats.

        Args:
            blocks: a mapping ``block fqn -> bool`` sets those blocks' flags and keeps the others'
                (what a solver choosing per block calls); an iterable of fqns makes exactly those
                blocks recomputed and drops every other block (``()`` recomputes none). Whether
                each names a block of the model is checked by `validate`, not here.

        Returns:
            A new plan; this one is unchanged.

        Raises:
            PlanError: ``blocks`` is a single string, a flag is not a bool, or one block lies
                inside another.
        """
        if isinstance(blocks, str):
            raise PlanError(f"Plan.with_recompute({blocks!r}): expected fqns of blocks or a mapping fqn -> bool; wrap one name in a list: [{blocks!r}]")
        if isinstance(blocks, Mapping):
            flags = {**self._blocks, **blocks}
        else:
            flags = {fqn: True for fqn in blocks}
        return self.replace(blocks=flags)

    def for_stage(self, stage: nn.Module) -> "Plan":
        """This plan on the layers and blocks that ``stage`` holds under the same fqns: a pipeline
        stage's part of the whole model's plan (torchtitan's pipeline split keeps the whole
        model's names). What the plan says of the whole model (budgets, predictions, metadata)
        is kept as it is, and ``metadata["part_of"]`` says how many layers the whole plan has and
        in which formats: a runtime of the part runs the model's own ops between its layers in
        the whole plan's autocast region (`whole_formats`), as on the unsharded model.

        Args:
            stage: a module holding some of the plan's layers by their fqns.

        Returns:
            A new plan; this one is unchanged.

        Raises:
            PlanError: ``stage`` holds none of the plan's layers (its names are not the model's:
                a stage from a tracer that renames the modules).
        """
        names = {name for name, _ in stage.named_modules()}
        layers = {fqn: lp for fqn, lp in self._layers.items() if fqn in names}
        if not layers:
            raise PlanError(f"Plan.for_stage({type(stage).__name__}): the stage holds none of the plan's {len(self._layers)} layers by their names "
                            f"(the plan's first: {next(iter(self._layers), '-')!r}); split the model keeping its module names, as torchtitan's pipeline split does")
        whole = {"layers": len(self._layers), "formats": sorted(f.value for f in self.whole_formats)}
        return self.replace(layers=layers, fingerprint={f: info for f, info in self._fingerprint.items() if f in names},
                            blocks={f: flag for f, flag in self._blocks.items() if f in names},
                            comm={f: m for f, m in self._comm.items() if f in layers}, metadata={**self.metadata, "part_of": whole})

    @property
    def whole_formats(self) -> frozenset:
        """The formats of the whole plan this one is a pipeline stage's part of (`for_stage`), its
        own among them; a plan that is no part: its own formats."""
        own = {lp.format for lp in self._layers.values()}
        part_of = self.metadata.get("part_of")
        names = part_of.get("formats", ()) if isinstance(part_of, Mapping) else ()
        return frozenset(own | {f for f in Format if f.value in names})

    # -- reading ------------------------------------------------------------------------------

    @property
    def layers(self) -> Mapping[str, LayerPrecision]:
        """Read-only mapping ``fqn -> LayerPrecision`` in model order."""
        return self._layers

    @property
    def fingerprint(self) -> Mapping[str, LayerInfo]:
        """``fqn -> LayerInfo`` (module class, ops, parameter shapes) of the model the plan was made for."""
        return self._fingerprint

    @property
    def blocks(self) -> Mapping[str, bool]:
        """Read-only mapping ``block fqn -> recompute`` (empty: nothing recomputed)."""
        return self._blocks

    @property
    def comm(self) -> Mapping[str, CommMethod]:
        """Read-only mapping ``layer fqn -> CommMethod`` (empty: not chosen; module docstring)."""
        return self._comm

    @property
    def recompute(self) -> tuple[str, ...]:
        """The fqns of the blocks that run recomputed, in the order ``blocks`` holds them."""
        return tuple(fqn for fqn, on in self._blocks.items() if on)

    def __getitem__(self, fqn: str) -> LayerPrecision:
        return self._layers[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def format_counts(self) -> dict[str, int]:
        return dict(Counter(lp.format.value for lp in self._layers.values()))

    def layer_name(self, fqn: str) -> str:
        """A layer's name as shown (review, logs); the plan's key stays as it is.

        Args:
            fqn: a layer's key in this plan.

        Returns:
            ``fqn`` itself, except a one-layer model's root ``""``: its class from the
            fingerprint, e.g. ``"Linear"`` (``"the model"`` when the fingerprint lacks it;
            `coverage.layer_name`).
        """
        info = self._fingerprint.get(fqn)
        return layer_name(fqn, info.module if info is not None else "the model")

    def _key(self):
        return (
            dict(self._layers),
            dict(self._fingerprint),
            dict(self.budgets),
            dict(self.predicted),
            dict(self.measured),
            dict(self.metadata),
            dict(self._blocks),
            dict(self._comm),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self._key() == other._key()

    def __hash__(self):
        return hash(tuple(sorted((k, v.format.value) for k, v in self._layers.items())))

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.format_counts().items()))
        recomputed = f"; {len(self.recompute)} blocks recomputed" if self.recompute else ""
        sent = Counter(m.value for m in self._comm.values() if m is not CommMethod.FP32)
        comm = f"; gradients sent in {', '.join(f'{m}={n}' for m, n in sorted(sent.items()))}" if sent else ""
        return f"Plan({len(self)} layers: {counts}{recomputed}{comm})"

    # -- validation ---------------------------------------------------------------------------

    def validate(self, model: nn.Module, example_inputs: Any = None, *, device=None, allow_emulation: bool = True) -> None:
        """Raise `PlanError` naming every layer that does not fit ``model`` or ``device``.

        Checks: names the model lacks; with ``example_inputs``, modules that run no matrix
        product; covered layers the plan lacks (traced with ``example_inputs``, else from the
        module tree and the plan's fingerprint); blocks the model lacks or that hold no layer of
        the plan; parameter shapes that differ from the fingerprint; formats the device cannot
        run at all; and, with ``allow_emulation=False``, formats a layer would run without a real
        kernel. With ``example_inputs`` it costs one forward under ``torch.no_grad`` (a few in
        training mode, `coverage.trace_layers`); without, a walk of the module tree.

        Args:
            model: the model the plan is to be applied to (its fqns are the plan's keys).
            example_inputs: one forward's inputs (one input, a tuple, a dict of keyword inputs
                or a `calls.ModelCall`) to find the layers by tracing; None: from the module tree
                and the fingerprint.
            device (torch.device | str | None): the device the plan is to run on; None: that of
                the model's first parameter (CPU for a model without parameters).
            allow_emulation: False also refuses a format a layer would run emulated (no kernel on
                ``device`` for its ops, batched operands or block scaling).

        Raises:
            PlanError: every problem found, one per line.
            ModelCallError: ``example_inputs`` is a dict with a key that is not a string.
        """
        modules = dict(model.named_modules())
        problems = []
        for fqn in self._layers:
            if fqn not in modules:
                problems.append(f"{layer_name(fqn, model)!r}: the plan names a layer the model lacks; remove it or check the model")
        covered = covered_layers(model, example_inputs, self._fingerprint)
        for fqn in covered:
            if fqn not in self._layers:
                problems.append(f"{layer_name(fqn, model)!r}: a covered layer ({covered[fqn].module}) the plan lacks; add it (fp32 keeps it as is)")
        if example_inputs is not None:
            # Only a trace proves a module runs no matrix product; the module tree alone cannot.
            for fqn in self._layers:
                if fqn in modules and fqn not in covered:
                    problems.append(f"{layer_name(fqn, model)!r}: {type(modules[fqn]).__name__} runs no matrix product in its own forward, so it is not a layer; remove it")
        for fqn in self._blocks:
            holds_layer = any(_inside(layer, fqn) for layer in self._layers)
            if fqn not in modules:
                problems.append(f"blocks[{fqn!r}]: the plan names a block the model lacks; remove it or check the model")
            elif not holds_layer and fqn in self._layers:
                problems.append(f"blocks[{fqn!r}]: a layer, not a block; recomputing one layer saves nothing (it keeps only its input): name a module holding several layers")
            elif not holds_layer:
                problems.append(f"blocks[{fqn!r}]: {type(modules[fqn]).__name__} holds no layer of the plan, so recomputing it saves nothing; remove it")
        for fqn, actual, planned in changed_shapes(model, self._fingerprint, self._layers):
            problems.append(f"{layer_name(fqn, model)!r}: parameter shapes {actual} differ from the plan's {planned}; the plan was made for another model")
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else "cpu"
        for fqn, lp in self._layers.items():
            support = format_support(lp.format, device)
            if not support.runnable:
                problems.append(f"{layer_name(fqn, model)!r}: {lp.format.value} cannot run on {device}: {support.reason}; choose another format")
                continue
            if allow_emulation or lp.format in (Format.FP32, Format.BF16, Format.FP16):
                continue
            info, saved = covered.get(fqn) or self._fingerprint.get(fqn), self._fingerprint.get(fqn)
            ops = set(info.ops) if info else set()
            # Batched operands: a trace (example_inputs) is the truth; without one, the plan's trace.
            batched = (info.batched if info else ()) or (saved.batched if saved and example_inputs is None else ())
            if not support.kernel:
                problems.append(f"{layer_name(fqn, model)!r}: {lp.format.value} has no kernel on {device} ({support.reason})")
            elif ops - KERNEL_OPS:
                problems.append(f"{layer_name(fqn, model)!r}: {lp.format.value} has no kernel for {', '.join(sorted(ops - KERNEL_OPS))}; it would be emulated")
            elif batched:
                problems.append(f"{layer_name(fqn, model)!r}: {lp.format.value} has no kernel for {', '.join(batched)} on batched operands "
                                "(as in an attention product); it would be emulated: plan the layer in bf16, fp16 or fp32")
            elif lp.scaling.granularity is Granularity.BLOCK and lp.format.is_fp8 and (why := block_support(lp.format, lp.grad_format, device)):
                problems.append(f"{layer_name(fqn, model)!r}: block scaling has no kernel here ({why}); it would be emulated")
            elif lp.scaling.granularity is Granularity.MX and lp.format.is_fp8:
                problems.append(f"{layer_name(fqn, model)!r}: MXFP8 has no kernel here ({MX_EMULATED}); it would be emulated")
        if problems:
            raise PlanError(problems, f"The plan does not fit {type(model).__name__}.")

    # -- persistence --------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "autoprec_version": __version__,
            "fingerprint": {fqn: info.to_dict() for fqn, info in self._fingerprint.items()},
            "budgets": dict(self.budgets),
            "predicted": dict(self.predicted),
            "measured": dict(self.measured),
            "metadata": dict(self.metadata),
            "layers": {fqn: lp.to_dict() for fqn, lp in self._layers.items()},
            "blocks": {fqn: {"recompute": on} for fqn, on in self._blocks.items()},
            "comm": {fqn: m.value for fqn, m in self._comm.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        """A plan from its JSON form (`to_dict`), every entry checked.

        Args:
            data: the parsed JSON object, of schema version 1 to `SCHEMA_VERSION` (an older one
                loads with no block recomputed and no gradient communication chosen).
            source: where ``data`` came from (a file path), to begin each problem with.

        Returns:
            The plan.

        Raises:
            PlanError: every problem found (not an object, a missing or later schema version,
                an unknown key, a malformed entry), each prefixed with ``source``.
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
        version = check_schema_version(data, source, "plan", SCHEMA_VERSION, PlanError, "save plans with Plan.save")
        allowed = {"schema_version", "autoprec_version", "fingerprint", "budgets", "predicted", "measured", "metadata", "layers"}
        if version >= 2:  # version 1 had no blocks: such a plan recomputes none
            allowed.add("blocks")
        if version >= 3:  # nor before 3 a gradient communication: not chosen
            allowed.add("comm")
        problems = [f"{source}: unknown top-level key {key!r}; expected some of {', '.join(sorted(allowed))}" for key in sorted(set(data) - allowed)]
        layers = data.get("layers")
        if not isinstance(layers, Mapping) or not layers:
            problems.append(f"{source}: 'layers' must be a non-empty object mapping module names to precisions")
            layers = {}
        fingerprint = {}
        raw_fingerprint = data.get("fingerprint") or {}
        if not isinstance(raw_fingerprint, Mapping):
            problems.append(f"{source}: 'fingerprint' must be an object mapping module names to layer info")
            raw_fingerprint = {}
        for fqn, info in raw_fingerprint.items():
            try:
                fingerprint[fqn] = LayerInfo.from_dict(info)
            except ValueError as exc:
                problems.append(f"{source}: fingerprint[{fqn!r}]{'' if str(exc).startswith('.') else ' '}{exc}")
        for key in ("budgets", "predicted", "measured", "metadata"):
            if not isinstance(data.get(key) or {}, Mapping):
                problems.append(f"{source}: {key!r} must be an object")
            elif key != "metadata":
                problems.extend(f"{source}: {p}" for p in figure_problems(key, data.get(key) or {}))
        blocks = data.get("blocks") or {}
        if not isinstance(blocks, Mapping):
            problems.append(f"{source}: 'blocks' must be an object mapping module names to {{\"recompute\": true|false}}")
            blocks = {}
        flags = {}
        for fqn, entry in blocks.items():
            if not isinstance(entry, Mapping) or set(entry) != {"recompute"} or not isinstance(entry["recompute"], bool):
                problems.append(f"{source}: blocks[{fqn!r}]: expected {{\"recompute\": true}} or {{\"recompute\": false}}, got {json.dumps(entry)}")
            else:
                flags[fqn] = entry["recompute"]
        comm = data.get("comm") or {}
        if not isinstance(comm, Mapping):
            problems.append(f"{source}: 'comm' must be an object mapping module names to a method ({', '.join(m.value for m in PER_LAYER_COMM)})")
            comm = {}
        if problems:
            raise PlanError(problems)
        try:
            return cls(
                layers, fingerprint,
                data.get("budgets"), data.get("predicted"), data.get("measured"), data.get("metadata"), flags, comm,
            )
        except PlanError as exc:
            raise PlanError([f"{source}: {p}" for p in exc.problems]) from None

    def save(self, path: "str | os.PathLike") -> Path:
        """Write the plan as JSON atomically (a temporary file renamed over the target).

        Args:
            path: the file to write.

        Returns:
            The path written.
        """
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "Plan":
        """Read a plan saved by `save`; a `PlanError` names the file and what is wrong with it.

        Args:
            path: a JSON file written by `save` (older schema versions load too).

        Returns:
            The plan.

        Raises:
            PlanError: the file is missing, unreadable, not a plan, or of a later schema version.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PlanError(f"{path}: no such plan file") from None
        except OSError as exc:
            raise PlanError(f"{path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path}: not a UTF-8 text file (byte {exc.start}); is this a plan saved by Plan.save?") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
        except RecursionError:
            raise PlanError(f"{path}: JSON nested too deeply to be a plan; is this a plan saved by Plan.save?") from None
        return cls.from_dict(data, source=str(path))
