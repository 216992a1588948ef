"""A plan for torchtitan: `autoprec export PLAN.json --to torchtitan` writes the converter section
of a torchtitan job, for torchtitan 0.3.0 (`TORCHTITAN_RELEASE`), whose jobs are Python
(``config_registry`` functions) and whose float8 training is torchao's ``Float8Linear``.

torchtitan 0.3.0 converts a model's ``Linear`` configs with ``Float8LinearConverter.Config``:
``recipe_name`` one of "rowwise" and "rowwise_with_gw_hp" (torchao's recipes: every float8 operand
E4M3 with row-wise power-of-2 scales; the second keeps the weight-gradient GEMM in high
precision), and ``filter_fqns``, modules it skips: a module is skipped when any entry is a
*substring* of its fully-qualified name (``components/quantization/utils.py``,
``module_filter_fn``). The export:

- takes the layers torchao can convert as `export.torchao_export` decides them (FP8 E4M3
  ``nn.Linear`` with both dimensions divisible by 16; the others in ``NOT_CONVERTED`` with the
  reason), grouped by torchtitan recipe: "rowwise_with_gw_hp" where the plan keeps the layer's
  weight gradient (``weight_grad_format="fp32"``, its recipe exactly) or all its gradients in FP32, "mxfp8" for MXFP8 layers (``MXFP8LinearConverter``: torchao's
  ``MXFP8Linear``, whose scales are rounded up as the runtime's; torchtitan refuses it before
  sm_100), else "rowwise"; NVFP4 ``nn.Linear`` layers with both dimensions divisible by 128 go
  to "nvfp4" (``NVFP4LinearConverter``: torchao's NVFP4 training prototype, sm_100 and CUDA only,
  torchtitan's ``nvfp4.py``), the others to ``NOT_CONVERTED``;
- writes one float8 converter per recipe whose ``filter_fqns`` are every other planned layer, so
  each converts exactly its group, and checks the substring rule: a filter entry inside a
  converted layer's name would skip it (listed in ``NOTES``; rename or leave that layer out); the
  MXFP8 and NVFP4 converters list the layers they convert (``fqns``, substrings too: an entry
  inside another layer's name is listed in ``NOTES``);
- says, per converted layer, what torchtitan's recipe runs differently from the plan (per-tensor
  or block scaling, E5M2 gradients, delayed scaling, a margin, a high-precision input gradient).

What it cannot carry: half and FP32 layers (torchtitan's mixed precision is one dtype for the
model: ``parallelism.mixed_precision_param``), INT8 and E5M2-forward layers, recomputation per
module (torchtitan's activation checkpointing is per block: ``RECOMPUTE`` lists the plan's), and
per-layer gradient communication. Pure: no torchtitan import here or in the written module's
top (it imports ``torchtitan.components.quantization`` inside ``converters``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

from ..formats import Format, Granularity
from ..plan import Plan, ScalingMode
from .export import _literal, float8_linear_problem, torchao_export, write_export

__all__ = ["TORCHTITAN_RELEASE", "TorchtitanExport", "torchtitan_export", "write_torchtitan"]

TORCHTITAN_RELEASE = "0.3.0"
# torchtitan 0.3.0's Float8LinearConverter recipe names (its Config's recipe_name Literal).
RECIPES = ("rowwise", "rowwise_with_gw_hp")
# MXFP8 layers go to torchtitan's MXFP8LinearConverter (torchao's MXFP8Linear), NVFP4 layers to
# its NVFP4LinearConverter; both list the layers they convert by name.
MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
BY_NAME = (MXFP8, NVFP4)
# torchtitan 0.3.0's NVFP4Linear refuses a dimension not divisible by this (its `_NVFP4_BLOCK`:
# torchao's NVFP4 kernels' tile).
NVFP4_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class TorchtitanExport:
    """A plan's layers as torchtitan 0.3.0's float8 converters run them (module docstring)."""

    recipes: Mapping[str, tuple[str, ...]]  # torchtitan recipe -> fqns it converts
    filter_fqns: Mapping[str, tuple[str, ...]]  # torchtitan recipe -> its converter's filter_fqns
    not_converted: Mapping[str, str]  # fqn -> why it stays in high precision
    notes: tuple[str, ...]  # "fqn: ..." per converted layer whose numbers change, and substring clashes
    recompute: tuple[str, ...] = ()

    def summary(self) -> list[str]:
        """What `autoprec export` prints: the layers converted per recipe and those not."""
        converted = {k: len(v) for k, v in self.recipes.items()}
        return [f"{sum(converted.values())} layers converted by torchtitan's float8 converters "
                f"({', '.join(f'{k}: {n}' for k, n in converted.items()) or 'none'}), {len(self.not_converted)} not (see NOT_CONVERTED)"]


def torchtitan_export(plan: Plan) -> TorchtitanExport:
    """Map ``plan`` onto torchtitan 0.3.0's float8 converters (pure; module docstring)."""
    base = torchao_export(plan)
    recipes: dict[str, list[str]] = {}
    notes: list[str] = []
    for fqn in base.converted:
        lp = plan.layers[fqn]
        high = lp.grad_format is Format.FP32
        if lp.scaling.granularity is Granularity.MX:
            recipe = MXFP8
            notes.extend(f"{fqn}: {change}" for change in _mx_changes(lp))
        else:
            recipe = "rowwise_with_gw_hp" if high or lp.high_precision_weight_grad else "rowwise"
            notes.extend(f"{fqn}: {change}" for change in _changes(lp, high))
        recipes.setdefault(recipe, []).append(fqn)
    not_converted = dict(base.not_converted)
    for fqn, lp in plan.layers.items():
        if lp.format is Format.NVFP4:
            problem = float8_linear_problem(lp, plan.fingerprint.get(fqn), "torchtitan's NVFP4 converter swaps Linear layers only", NVFP4_MULTIPLE,
                                            "torchtitan's NVFP4Linear refuses it")
            if problem is not None:
                not_converted[fqn] = problem
                continue
            del not_converted[fqn]
            recipes.setdefault(NVFP4, []).append(fqn)
            if lp.weight_grad_format is Format.FP32:
                notes.append(f"{fqn}: {_high_gradients(lp)}; torchao's NVFP4Linear runs both backward GEMMs in NVFP4")
            else:
                notes.append(f"{fqn}: torchao's NVFP4Linear takes its own fixed Hadamard signs and a per-rank stochastic-rounding seed, so the "
                             "weight gradient's rounding differs from the plan's (not its expectation)")
    planned = list(plan.layers)
    filters: dict[str, tuple[str, ...]] = {}
    for recipe, fqns in recipes.items():
        members = set(fqns)  # a set: a plan of a thousand layers, each looked up per recipe
        others = tuple(f for f in planned if f not in members)
        # torchtitan matches names by substring: a float8 converter skips a module when one of its
        # filter_fqns (the other layers) is inside the module's name; the MXFP8 converter converts
        # one when one of its fqns (its layers) is, so an entry inside another layer's name converts that one too.
        for fqn in fqns:
            if recipe in BY_NAME:
                other = next((f for f in others if fqn in f), None)
                if other is not None:
                    notes.append(f"{fqn}: torchtitan's {recipe.upper()} converter converts a module when an fqns entry is a substring of its "
                                 f"name, so {other!r} would be converted too (rename one of them, or leave it out of the plan)")
                continue
            clash = next((f for f in others if f in fqn), None)
            if clash is not None:
                notes.append(f"{fqn}: torchtitan skips a module when a filter_fqns entry is a substring of its name, and {clash!r} is: "
                             f"its {recipe} converter would skip it (rename one of them, or leave it out of the plan)")
        if recipe not in BY_NAME:
            filters[recipe] = others
    for fqn, lp in plan.layers.items():
        if lp.format in (Format.BF16, Format.FP16, Format.FP32):  # torchao's reason says to wrap it in autocast: not how torchtitan runs
            not_converted[fqn] = (f"{lp.format.value} in the plan: not float8; torchtitan runs every unconverted layer in one dtype "
                                  "(FSDP2's parallelism.mixed_precision_param), not per layer")
    return TorchtitanExport({k: tuple(v) for k, v in recipes.items()}, filters, not_converted, tuple(notes), plan.recompute)


def _high_gradients(lp) -> str:
    """What of a layer's backward the plan keeps in high precision, in words (for the notes)."""
    return "fp32 gradients in the plan (a high-precision backward)" if lp.grad_format is Format.FP32 else "an fp32 weight gradient in the plan"


def _mx_changes(lp) -> list[str]:
    """What torchtitan's MXFP8 converter (torchao's ``MXFP8Linear``: E4M3 operands, 1x32 tiles,
    scales rounded up, its default ``RCEIL``) runs differently from an MXFP8 layer of the plan."""
    changes = []
    if lp.grad_format is Format.FP8_E5M2:
        changes.append("e5m2 gradients in the plan; torchao's MXFP8Linear casts gradients to e4m3")
    if lp.weight_grad_format is Format.FP32:
        changes.append(f"{_high_gradients(lp)}; torchao's MXFP8Linear runs both backward GEMMs in MXFP8 e4m3")
    if lp.scaling.margin:
        changes.append(f"scaling margin {lp.scaling.margin} in the plan; torchao's MXFP8 scales to the full range")
    return changes


def _changes(lp, high: bool) -> list[str]:
    """What torchtitan's recipe runs differently from the plan for one converted layer."""
    changes = []
    granularity = lp.scaling.granularity
    if granularity is not Granularity.ROW:
        changes.append(f"{granularity.value} scaling in the plan; torchtitan {TORCHTITAN_RELEASE}'s float8 recipes scale per row (power-of-2 scales)")
    if lp.grad_format is Format.FP8_E5M2:
        changes.append("e5m2 gradients in the plan; torchtitan's recipes cast gradients to e4m3")
    if high:
        changes.append(f"{lp.grad_format.value} gradients in the plan; rowwise_with_gw_hp keeps the weight gradient's GEMM in high precision, "
                       "but the input gradient's runs in e4m3")
    if lp.scaling.mode is ScalingMode.DELAYED:
        changes.append("delayed scaling in the plan; torchtitan scales currently")
    if lp.scaling.margin:
        changes.append(f"scaling margin {lp.scaling.margin} in the plan; torchtitan scales to the full range")
    return changes


_TEMPLATE = '''"""torchtitan {release} float8 training of the autoprec plan {source} (sha1 {digest}), exported by autoprec {version}.

torchtitan {release} jobs are Python: in your config_registry function,

    from {module} import converters
    config.model_spec = model_registry("<flavor>", converters=converters(model_compile_enabled=...))

Converted: {n_converted} layers (FP8_LAYERS, by recipe); not converted: {n_skipped} (NOT_CONVERTED says why);
NOTES says what torchtitan runs differently from the plan. Recomputed modules (RECOMPUTE): torchtitan's
activation checkpointing is per block (FullAC / SelectiveAC), not per module.
"""

TORCHTITAN_RELEASE = {release!r}

# torchtitan recipe -> fully-qualified names of the Linear layers it converts
FP8_LAYERS = {recipes}

# float8 recipe -> its converter's filter_fqns: the other planned layers (torchtitan skips a
# module when one of these is a substring of its name); "mxfp8" and "nvfp4" list what they convert instead
FILTER_FQNS = {filters}

# layers that stay in high precision, and why
NOT_CONVERTED = {not_converted}

# "layer: what changes", per converted layer whose numbers torchtitan's recipe cannot keep
NOTES = {notes}

# modules the plan recomputes in the backward
RECOMPUTE = {recompute}


def converters(model_compile_enabled=False, emulate=False):
    """torchtitan's converter configs, one Float8LinearConverter per float8 recipe (``emulate=True``:
    torchao's emulated float8, for a machine without float8 tensor cores, eager only), one
    MXFP8LinearConverter for the "mxfp8" layers and one NVFP4LinearConverter for the "nvfp4" ones
    (torchtitan refuses both before sm_100)."""
    from torchtitan.components.quantization import Float8LinearConverter

    made = [
        Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=list(FILTER_FQNS[recipe]), emulate=emulate,
                                     model_compile_enabled=model_compile_enabled)
        for recipe in FP8_LAYERS if recipe not in ("mxfp8", "nvfp4")
    ]
    if "mxfp8" in FP8_LAYERS:
        from torchtitan.components.quantization import MXFP8LinearConverter

        made.append(MXFP8LinearConverter.Config(fqns=list(FP8_LAYERS["mxfp8"]), model_compile_enabled=model_compile_enabled))
    if "nvfp4" in FP8_LAYERS:
        from torchtitan.components.quantization import NVFP4LinearConverter

        made.append(NVFP4LinearConverter.Config(fqns=list(FP8_LAYERS["nvfp4"]), model_compile_enabled=model_compile_enabled))
    return made
'''


def write_torchtitan(plan_path: "str | Path", out: "str | Path | None" = None) -> tuple[Path, TorchtitanExport]:
    """Export the plan at ``plan_path`` for torchtitan (atomically) to ``out`` (default: next to
    the plan, ``<plan stem>_torchtitan.py``); returns the path written and the mapping."""
    return write_export(plan_path, out, "torchtitan", torchtitan_export, _render)


def _render(export: TorchtitanExport, head: Mapping[str, str]) -> str:
    return _TEMPLATE.format(
        **head, release=TORCHTITAN_RELEASE, n_converted=sum(len(v) for v in export.recipes.values()), n_skipped=len(export.not_converted),
        recipes=_literal({k: list(v) for k, v in export.recipes.items()}), filters=_literal({k: list(v) for k, v in export.filter_fqns.items()}),
        not_converted=_literal(dict(export.not_converted)), notes=_literal(list(export.notes)), recompute=_literal(list(export.recompute)),
    )
