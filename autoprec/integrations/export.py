"""A plan, portable: `autoprec export PLAN.json --to torchao` writes what a torchao user needs to
train with autoprec's decision under torchao's float8 training (``torchao.float8``).

torchao converts ``nn.Linear`` modules to ``Float8Linear`` with one ``Float8LinearConfig`` per
conversion call, choosing modules with a ``module_filter_fn(module, fqn)``. The export maps each
layer of the plan:

- **converted**: FP8 E4M3 layers that are exactly ``nn.Linear`` with both dimensions divisible by
  16 (the float8 kernels' requirement, which torchao checks too), grouped by the
  ``Float8LinearConfig`` that keeps their numbers where torchao can express them: per-tensor
  scaling with E5M2 gradients is torchao's ``"tensorwise"``; other gradient formats and row-wise
  scaling (row-wise forward, per-tensor backward, as the runtime runs it) get a config of their
  own, one ``CastConfig`` per GEMM operand (torchao's ``"rowwise"`` would cast the gradients to
  E4M3, row-wise, with power-of-2 scales). Where torchao cannot keep a layer's numbers, the
  layer's entry in ``NOTES`` says what changes: delayed scaling (torchao scales currently), block
  and MXFP8 scaling (torchao's float8 closest is ``"rowwise"``, E4M3 gradients), FP32 gradients (torchao's
  high-precision gradient path fails under autocast, so they stay float8), a scaling margin.
- **not converted**, each with the reason: FP8 layers that are not ``nn.Linear`` (a module's own
  matmuls, e.g. attention products), whose dimensions are not multiples of 16, or in E5M2
  forward (no torchao recipe); INT8 layers (torchao's float8 training has no INT8 path); BF16 /
  FP16 layers (run them under ``torch.autocast``, as autoprec does); FP32 layers.

The output is one self-contained Python file (no autoprec import) with the layer sets, a
``module_filter_fn`` per recipe, ``CONFIGS`` (each recipe's casts) and ``convert(model,
emulate=False)``, which calls ``convert_to_float8_training`` once per recipe. Module types and shapes come from the plan's
fingerprint, so no model is needed to export. Beside the filter, ``RECOMPUTE`` lists the modules
the plan recomputes (its blocks with ``recompute: true``): the modules to wrap in non-reentrant
activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, e.g.
torch's ``checkpoint_wrapper``), as autoprec's runtime runs them. ``GRAD_COMM`` names the layers
whose gradients the plan sends between DDP ranks by another method than FP32 (`Plan.comm`):
torchao has no counterpart, so the file says how to run them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

from .._io import atomic_write_text
from ..errors import PlanError
from ..formats import CommMethod, Format, Granularity
from ..plan import Plan, ScalingMode

__all__ = ["TorchaoExport", "torchao_export", "write_torchao"]

_FP8_MULTIPLE = 16  # float8 GEMMs need both matrix dimensions divisible by 16


@dataclasses.dataclass(frozen=True)
class TorchaoExport:
    """A plan's layers as torchao float8 training runs them (see the module docstring)."""

    recipes: Mapping[str, tuple[str, ...]]  # recipe name -> fqns converted with it
    not_converted: Mapping[str, str]  # fqn -> why torchao does not run it in FP8
    notes: tuple[str, ...]  # "fqn: ..." per converted layer whose numbers torchao changes, and how
    autocast: str | None  # the autocast dtype autoprec runs the plan under ("bfloat16", "float16"; None: all FP32)
    recompute: tuple[str, ...] = ()  # fqns of the modules the plan recomputes (to wrap in activation checkpointing)
    grad_comm: Mapping[str, str] = dataclasses.field(default_factory=dict)  # fqn -> how its gradients travel, where not FP32
    # recipe -> None (torchao's own recipe of that name) or {Float8LinearConfig cast field: (granularity, float8 dtype)}
    configs: Mapping[str, "Mapping[str, tuple[str, str]] | None"] = dataclasses.field(default_factory=dict)

    @property
    def converted(self) -> tuple[str, ...]:
        return tuple(sorted(f for fqns in self.recipes.values() for f in fqns))

    def summary(self) -> list[str]:
        """What `autoprec export` prints: the layers converted per recipe, those not, the recomputed."""
        lines = [f"{len(self.converted)} layers converted to torchao float8 ({', '.join(f'{k}: {len(v)}' for k, v in self.recipes.items()) or 'none'}), "
                 f"{len(self.not_converted)} not (see NOT_CONVERTED)"]
        if self.recompute:
            lines.append(f"{len(self.recompute)} modules recomputed (see RECOMPUTE: wrap them in activation checkpointing)")
        return lines


def torchao_export(plan: Plan) -> TorchaoExport:
    """Map ``plan`` onto torchao's float8 training (pure; see the module docstring)."""
    check_fingerprint(plan)
    recipes: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    notes: list[str] = []
    for fqn, lp in plan.layers.items():
        info = plan.fingerprint.get(fqn)
        if lp.format is Format.FP8_E4M3:
            problem = float8_linear_problem(lp, info, "torchao converts nn.Linear only")
            if problem is not None:
                skipped[fqn] = problem
                continue
            recipe, changes = _recipe(lp)
            recipes.setdefault(recipe, []).append(fqn)
            notes.extend(f"{fqn}: {change}" for change in changes)
        elif lp.format is Format.FP8_E5M2:
            skipped[fqn] = "fp8_e5m2 forward in the plan: torchao's recipes run e4m3 forward; it stays in high precision"
        elif lp.format is Format.INT8:
            skipped[fqn] = "int8 in the plan: torchao's float8 training has no INT8 path; it stays in high precision"
        elif lp.format is Format.NVFP4:
            skipped[fqn] = ("nvfp4 in the plan: torchao's float8 training has no NVFP4 recipe (torchtitan converts NVFP4 layers: "
                            "--to torchtitan); it stays in high precision")
        elif lp.format in (Format.BF16, Format.FP16):
            skipped[fqn] = f"{lp.format.value} in the plan: not float8; run it under torch.autocast({lp.format.dtype})"
        else:
            skipped[fqn] = "fp32 in the plan: autoprec runs it outside autocast (torch.autocast(enabled=False) around it matches that)"
    autocast = autocast_dtype(plan)
    grad_comm = {fqn: m.value for fqn, m in plan.comm.items() if m is not CommMethod.FP32}
    configs = {recipe: _CONFIGS.get(recipe) for recipe in recipes}
    return TorchaoExport({k: tuple(v) for k, v in recipes.items()}, skipped, tuple(notes), autocast, plan.recompute, grad_comm, configs)


def check_fingerprint(plan: Plan) -> None:
    """`PlanError` unless ``plan`` holds the fingerprint (module types and shapes) an export reads."""
    if not plan.fingerprint:
        raise PlanError("the plan has no fingerprint (module types and shapes) to export from; re-save it with autoprec >= 0.1")


def autocast_dtype(plan: Plan) -> "str | None":
    """The ``torch`` dtype name autoprec runs ``plan`` under autocast in, or None (every layer
    FP32). A plan with any non-FP32 layer runs in one autocast region, so the ops between layers
    run in half precision too: BF16 unless every half layer is FP16 (`runtime.context`)."""
    formats = {lp.format for lp in plan.layers.values()}
    if formats <= {Format.FP32}:
        return None
    return "float16" if formats & {Format.BF16, Format.FP16} == {Format.FP16} else "bfloat16"


def float8_linear_problem(lp, info, only: str, multiple: int = _FP8_MULTIPLE, kernels: str = "float8 kernels need it") -> "str | None":
    """Why a low-precision layer of the plan is not an ``nn.Linear`` a library runs (``only``
    says which modules it takes), from the plan's fingerprint: another module (a module's own
    matmuls, e.g. attention products) or a dimension not divisible by ``multiple`` (16: float8
    kernels; ``kernels`` says who needs it); None when it is one."""
    weight = dict(info.params).get("weight") if info is not None else None
    if info is None or info.module != "Linear" or weight is None:
        kind = info.module if info is not None else "unknown module"
        return f"{lp.format.value} in the plan, but a {kind} (its own {', '.join(info.ops) if info else 'ops'}), not nn.Linear: {only}; it stays in high precision"
    out_features, in_features = weight
    if in_features % multiple or out_features % multiple:
        return (f"{lp.format.value} in the plan, but Linear({in_features}, {out_features}) has a dimension not divisible by {multiple} "
                f"({kernels}); it stays in high precision")
    return None


# torchao's Float8LinearConfig cast fields, one per GEMM operand, as `_casts` fills them.
_FORWARD = ("cast_config_input", "cast_config_weight")
_BACKWARD = ("cast_config_input_for_grad_weight", "cast_config_weight_for_grad_input")
_GRADIENT = ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")


def _casts(forward: str, grad: str) -> dict[str, tuple[str, str]]:
    """The casts of the runtime's FP8 E4M3 linear (`runtime.gemm.Fp8Linear`): input and weight
    E4M3 scaled per ``forward`` ("tensorwise" or "axiswise", torchao's name for row-wise); the
    backward GEMMs take per-tensor E4M3 copies of both and a per-tensor ``grad`` copy of the
    output gradient (`runtime.quantizers`)."""
    return {**{f: (forward, "e4m3") for f in _FORWARD}, **{f: ("tensorwise", "e4m3") for f in _BACKWARD}, **{f: ("tensorwise", grad) for f in _GRADIENT}}


# Recipes the export writes: None is torchao's own recipe of that name (torchao 0.18's
# "tensorwise" is exactly _casts("tensorwise", "e5m2"), no power-of-2 scales); the others are
# written out cast by cast.
_CONFIGS: dict[str, "dict[str, tuple[str, str]] | None"] = {
    "tensorwise": None,
    "rowwise": None,
    "tensorwise_e4m3_gradients": _casts("tensorwise", "e4m3"),
    "rowwise_forward_e5m2_gradients": _casts("axiswise", "e5m2"),
    "rowwise_forward_e4m3_gradients": _casts("axiswise", "e4m3"),
}


def _recipe(lp) -> tuple[str, list[str]]:
    """The recipe of a convertible FP8 E4M3 layer and what torchao runs differently from the
    plan (empty when it keeps the layer's numbers)."""
    granularity, grad = lp.scaling.granularity, lp.grad_format
    changes = []
    if grad is Format.FP32:
        # torchao 0.18's high-precision gradient path (ScalingType.DISABLED) multiplies the
        # autocast-dtype gradient by the FP32 weight in its backward, which torch refuses.
        cast = "e4m3 per row (torchao's rowwise recipe)" if granularity in (Granularity.BLOCK, Granularity.MX) else "e5m2 per tensor"
        changes.append(f"FP32 gradients in the plan; torchao's high-precision gradient path fails under autocast, so its output "
                       f"gradient is cast to float8 {cast} and its gradients change")
    if granularity in (Granularity.BLOCK, Granularity.MX):
        recipe = "rowwise"
        tiles = "block scaling (1x128 / 128x128)" if granularity is Granularity.BLOCK else "MXFP8 (1x32 tiles, power-of-two scales)"
        changes.append(f"{tiles} in the plan; torchao's float8 training has no such recipe, its closest is rowwise")
        if grad is Format.FP8_E5M2:
            changes.append("e5m2 gradients in the plan; torchao's rowwise recipe casts them to e4m3")
    else:
        row = granularity is Granularity.ROW
        kept = grad if grad.is_fp8 else Format.FP8_E5M2
        if row:
            recipe = f"rowwise_forward_{kept.value.removeprefix('fp8_')}_gradients"
        else:
            recipe = "tensorwise" if kept is Format.FP8_E5M2 else "tensorwise_e4m3_gradients"
    if lp.scaling.mode is ScalingMode.DELAYED:
        row = granularity is not Granularity.TENSOR
        changes.append(f"delayed scaling in the plan; torchao scales currently (per {'row' if row else 'tensor'})")
    if lp.scaling.margin:
        changes.append(f"scaling margin {lp.scaling.margin} in the plan (2**-{lp.scaling.margin} of the range); torchao scales to the full range")
    return recipe, changes


_TEMPLATE = '''"""torchao float8 training of the autoprec plan {source} (sha1 {digest}), exported by autoprec {version}.

    from {module} import convert
    convert(model)            # nn.Linear layers the plan runs in FP8 become torchao Float8Linear
{autocast_usage}
Converted: {n_converted} layers; not converted: {n_skipped} (NOT_CONVERTED says why, layer by layer).
Recomputed: {n_recompute} modules (RECOMPUTE); wrap each in non-reentrant activation checkpointing
after convert(model), as autoprec runs them.
"""

import dataclasses

import torch
from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity, convert_to_float8_training
from torchao.float8.config import e4m3_dtype, e5m2_dtype

# recipe -> fully-qualified names of the nn.Linear layers converted with it
RECIPES = {recipes}

# recipe -> how it casts: None for torchao's own recipe of that name, else each GEMM operand's
# Float8LinearConfig field -> [scaling granularity, float8 dtype], as autoprec runs the layers
# (no power-of-2 scales)
CONFIGS = {configs}

# layers torchao does not run in float8, and why
NOT_CONVERTED = {not_converted}

# "layer: what changes", for each converted layer whose numbers torchao cannot keep
NOTES = {notes}

# autoprec runs this plan under torch.autocast in this dtype (None: every layer FP32); on a model
# whose weights are stored in one half dtype, in that dtype
AUTOCAST_DTYPE = {autocast}

# fully-qualified names of the modules the plan recomputes: wrap each in non-reentrant activation
# checkpointing (torch.utils.checkpoint.checkpoint(..., use_reentrant=False)); its forward runs
# again in the backward instead of its activations being kept
RECOMPUTE = {recompute}

# how the plan sends these layers' gradients between DDP ranks (every other layer's: FP32), chosen
# from the link it measured under the accuracy budget. torchao has no counterpart: run the plan
# with autoprec's DDP hook (DynamicPrecisionScheduler.from_plan(ddp, plan, grad_comm="auto")),
# or, where they are all "bf16", torch's own default_hooks.bf16_compress_hook
GRAD_COMM = {grad_comm}


def module_filter_fn(recipe):
    """torchao's ``module_filter_fn(module, fqn)`` for one recipe: convert exactly its layers."""
    wanted = frozenset(RECIPES[recipe])
    return lambda module, fqn: fqn in wanted


def make_config(recipe):
    """The ``Float8LinearConfig`` of one recipe (see CONFIGS)."""
    casts = CONFIGS[recipe]
    if casts is None:
        return Float8LinearConfig.from_recipe_name(recipe)
    dtypes = {{"e4m3": e4m3_dtype, "e5m2": e5m2_dtype}}
    return Float8LinearConfig(**{{
        field: CastConfig(scaling_granularity=ScalingGranularity(granularity), target_dtype=dtypes[dtype])
        for field, (granularity, dtype) in casts.items()
    }})


def convert(model, emulate=False):
    """Convert ``model`` in place, one ``convert_to_float8_training`` call per recipe; returns it.
    ``emulate=True`` runs torchao's emulated float8 (CPU, or a GPU without float8 tensor cores)."""
    for recipe in RECIPES:
        config = make_config(recipe)
        if emulate:
            config = dataclasses.replace(config, emulate=True)
        convert_to_float8_training(model, module_filter_fn=module_filter_fn(recipe), config=config)
    return model
'''


def _literal(value) -> str:
    """A Python literal for ``value`` (dicts and lists of strings, lists and None), one entry
    per line for readable diffs. Built from `repr`, which writes any string as valid Python:
    rewriting JSON's null / true / false renamed layers holding those words (``null_proj``)."""
    if isinstance(value, dict):
        brackets, entries = "{}", [f"{k!r}: {_literal(v)}" for k, v in value.items()]
    elif isinstance(value, list):
        brackets, entries = "[]", [_literal(v) for v in value]
    else:
        return repr(value)
    body = "".join("\n    " + e.replace("\n", "\n    ") + "," for e in entries)
    return brackets[0] + body + ("\n" if entries else "") + brackets[1]


def _docstring_text(text: str) -> str:
    """``text`` as it can stand inside a triple-quoted docstring: escapes, not quotes or newlines."""
    return text.encode("unicode_escape").decode("ascii").replace('"', '\\"')


def export_path(plan_path: Path, out: "str | Path | None", target: str) -> Path:
    """Where an export of the plan at ``plan_path`` is written: ``out``, else
    ``<plan stem>_<target>.py`` beside the plan; `PlanError` unless it names a Python module."""
    path = Path(out) if out is not None else plan_path.with_name(f"{plan_path.stem}_{target}.py")
    if path.suffix != ".py" or not path.stem.isidentifier():
        raise PlanError(f"--out {str(path)!r}: the export is a Python module; give a path like plan_{target}.py (a valid module name)")
    return path


def write_export(plan_path: "str | Path", out: "str | Path | None", target: str, mapping: Callable[[Plan], Any],
                 render: Callable[[Any, Mapping[str, str]], str]) -> tuple[Path, Any]:
    """Write the export of the plan at ``plan_path`` for ``target`` (atomically) to ``out``
    (`export_path`): ``mapping(plan)``, then ``render(mapping, head)`` the module's text, ``head``
    the fields every export's template states (``source``, ``digest``, ``version``, ``module``).
    Returns the path written and the mapping."""
    from .. import __version__

    plan_path = Path(plan_path)
    export = mapping(Plan.load(plan_path))
    out = export_path(plan_path, out, target)
    head = {"source": _docstring_text(plan_path.name), "digest": hashlib.sha1(plan_path.read_bytes()).hexdigest()[:12],
            "version": __version__, "module": out.stem}
    atomic_write_text(out, render(export, head))
    return out, export


def write_torchao(plan_path: "str | Path", out: "str | Path | None" = None) -> tuple[Path, TorchaoExport]:
    """Export the plan at ``plan_path`` for torchao (atomically) to ``out`` (default: next to the
    plan, ``<plan stem>_torchao.py``); returns the path written and the mapping."""
    return write_export(plan_path, out, "torchao", torchao_export, _render_torchao)


def _render_torchao(export: TorchaoExport, head: Mapping[str, str]) -> str:
    autocast_usage = (
        f"    with torch.autocast(device_type, dtype=torch.{export.autocast}):   # as autoprec runs the plan\n        loss = loss_fn(model(x), y)\n"
        if export.autocast else ""
    )
    return _TEMPLATE.format(
        **head, autocast_usage=autocast_usage, n_converted=len(export.converted), n_skipped=len(export.not_converted),
        recipes=_literal({k: list(v) for k, v in export.recipes.items()}), not_converted=_literal(dict(export.not_converted)),
        configs=_literal({k: None if v is None else {f: list(c) for f, c in v.items()} for k, v in export.configs.items()}),
        notes=_literal(list(export.notes)), autocast=f"torch.{export.autocast}" if export.autocast else "None",
        n_recompute=len(export.recompute), recompute=_literal(list(export.recompute)), grad_comm=_literal(dict(export.grad_comm)),
    )
