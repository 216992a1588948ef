"""One layer's precision in a `Plan` (`LayerPrecision`: format, gradient format, whether the
weight gradient's product runs in high precision, `Scaling`, `Calibration`, reason), how a plan file's layer entry is parsed into one, and the consistency
rules it must meet, independent of any model (`check_layer`)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any, Mapping, TypeVar

from ._checks import check_fields, choice, choices, integer, number, optional
from .errors import FormatError, PlanError
from .formats import Format, Granularity

__all__ = [
    "ScalingMode", "Reduction", "CalibrationMethod", "Scaling", "Calibration", "LayerPrecision", "MAX_HISTORY_LEN", "PRESETS", "parse_layer",
    "check_layer", "figure_problems",
]


class ScalingMode(str, enum.Enum):
    """DELAYED: scale from an amax history of earlier steps (no extra pass over the tensor before
    the cast). CURRENT: scale from this tensor's own amax (one extra reduction, always in range)."""

    DELAYED = "delayed"
    CURRENT = "current"

    def __str__(self) -> str:
        return self.value


class Reduction(str, enum.Enum):
    """How delayed scaling reads its amax history (Transformer Engine's ``amax_compute_algo``).
    MAX: the largest amax of the window (a spike keeps its range for ``history_len`` steps).
    MOST_RECENT: the previous step's amax (follows drift at once, saturates on a rise)."""

    MAX = "max"
    MOST_RECENT = "most_recent"

    def __str__(self) -> str:
        return self.value


class CalibrationMethod(str, enum.Enum):
    """How an INT8 activation range is chosen from observed values."""

    MAX = "max"  # the largest magnitude seen: no clipping, coarsest resolution
    PERCENTILE = "percentile"  # clip at a percentile of |x|
    MSE = "mse"  # clip where the quantization mean squared error is smallest

    def __str__(self) -> str:
        return self.value


# An amax history is one float32 tensor of this length per scaled operand, kept on the device;
# 4096 steps is four times Transformer Engine's default window (1024) and 16 KiB per tensor.
MAX_HISTORY_LEN = 4096


def _max_margin(fmt: Format) -> int:
    """The largest margin that still maps an amax onto a value >= 1 of ``fmt`` (``fmt.max /
    2**margin >= 1``): INT8 6, FP8 E4M3 8, E5M2 15. Beyond it every value rounds to a few levels."""
    return math.floor(math.log2(fmt.max))


# The largest margin of any scaled format; a layer's own format may allow less (`check_layer`).
_ANY_MARGIN = max(_max_margin(f) for f in Format if f.needs_scale)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How FP8 / INT8 tensors of a layer are scaled.

    ``granularity`` applies to activations and weights of FP8 layers and to activations of INT8
    layers (INT8 weights always get one scale per output channel). Delayed scaling keeps one
    amax per tensor, so it needs TENSOR granularity; ROW, BLOCK and MX scale from the current tensor.
    MX (MXFP8) is for FP8 E4M3 layers only, their gradients E4M3 (the default) or E5M2.
    Gradients always use current per-tensor scaling computed on the fly.
    """

    granularity: Granularity = Granularity.TENSOR
    # Current scaling by default, as torchao's float8 recipes: it is always in range (a spike
    # cannot saturate), keeps no state, and costs one amax pass that torch.compile fuses into the
    # cast. Delayed scaling saves that pass only inside a fused kernel and needs a history.
    mode: ScalingMode = ScalingMode.CURRENT
    history_len: int = 16  # Transformer Engine's default window is 1024; 16 reacts faster to drift
    reduction: Reduction = Reduction.MAX  # a plan file holds its value, "max" or "most_recent"
    margin: int = 0  # scale targets fmt.max / 2**margin

    def __post_init__(self):
        check_fields(self, "Scaling", _RULES[Scaling])


@dataclasses.dataclass(frozen=True)
class Calibration:
    """How INT8 activation scales are calibrated from the first ``batches`` forward passes.

    During calibration the layer quantizes with the current batch's own range; afterwards the
    calibrated scale is frozen until the runtime is asked to re-calibrate. Input channels whose
    range exceeds ``outlier_ratio`` times the median channel range are kept apart and computed in
    FP32 (LLM.int8()'s decomposition, arXiv:2208.07339); ``None`` turns that off.
    """

    method: CalibrationMethod = CalibrationMethod.PERCENTILE
    percentile: float = 99.99
    batches: int = 4
    outlier_ratio: "float | None" = 8.0

    def __post_init__(self):
        check_fields(self, "Calibration", _RULES[Calibration])


# Each field's check and what it expects (`autoprec._checks`): at construction, and for a file's
# entry field by field (`parse_layer`), so that both accept the same values.
_RULES: dict[type, dict[str, tuple[Any, str]]] = {
    Scaling: {
        "granularity": (choice(Granularity), choices(Granularity)),
        "mode": (choice(ScalingMode), choices(ScalingMode)),
        "history_len": (integer(1, MAX_HISTORY_LEN), f"an integer from 1 to {MAX_HISTORY_LEN} (steps of amax history)"),
        "reduction": (choice(Reduction), choices(Reduction)),
        "margin": (integer(0, _ANY_MARGIN), f"an integer from 0 to {_ANY_MARGIN} (the scale targets the format's max / 2**margin)"),
    },
    Calibration: {
        "method": (choice(CalibrationMethod), choices(CalibrationMethod)),
        "percentile": (number(above=0, high=100), "a percentile in (0, 100]"),
        "batches": (integer(1), "an integer >= 1 (forward passes calibrated)"),
        "outlier_ratio": (optional(number(above=1)), "a finite ratio > 1, or null (no outlier channels)"),
    },
}


# FP8 layers compute gradients in E5M2 (the "hybrid" recipe); INT8 layers run backward in FP32
# (INT8 has no useful gradient format); every other format differentiates in itself (NVFP4: all
# three products in NVFP4, NVIDIA's recipe, the gradients rounded stochastically).
_DEFAULT_GRAD_FORMAT = {Format.FP8_E4M3: Format.FP8_E5M2, Format.FP8_E5M2: Format.FP8_E5M2, Format.INT8: Format.FP32}


# init=False: the constructor takes format names and ``grad_format=None`` (the format's default),
# while the fields hold the parsed `Format`s, never None.
@dataclasses.dataclass(frozen=True, init=False)
class LayerPrecision:
    """One layer's format. FP8 layers compute gradients in ``grad_format`` (E5M2 by default:
    the "hybrid" recipe, E4M3 forward and E5M2 backward; E4M3 under block scaling, DeepSeek-V3's
    recipe); INT8 layers' is FP32; NVFP4 layers' is NVFP4 (stochastically rounded).
    ``grad_format="fp32"`` on an FP8, MXFP8 or NVFP4 layer: the forward in the low format, the
    backward's two products in high precision from the forward's dequantized operands
    (Transformer Engine's ``backward_override="dequantized"``).

    ``high_precision_weight_grad``: per GEMM, the weight gradient's product alone in high precision
    (the unrounded output gradient times the forward's input dequantized, in FP32) while the input
    gradient's takes ``grad_format`` (torchao's ``rowwise_with_gw_hp``): the weight gradient goes
    straight to the FP32 master weight, the input gradient on through the model. Only where the
    gradients are low (FP8, MXFP8, NVFP4); with ``grad_format="fp32"`` it is implied (held
    False). A plan file writes it as ``"weight_grad_format": "fp32"``."""

    format: Format
    grad_format: Format
    scaling: Scaling = Scaling()
    calibration: Calibration = Calibration()
    reason: str = ""
    high_precision_weight_grad: bool = False

    def __init__(
        self,
        format: "Format | str",
        grad_format: "Format | str | None" = None,
        scaling: Scaling = Scaling(),
        calibration: Calibration = Calibration(),
        reason: str = "",
        high_precision_weight_grad: bool = False,
    ):
        problems = self._fill(format, grad_format, scaling, calibration, reason, high_precision_weight_grad)
        problems = problems or check_layer(f"LayerPrecision({self.format.value!r})", self)
        if problems:
            raise PlanError(problems, single_line=True)

    def _fill(self, format, grad_format, scaling, calibration, reason, high_weight_grad) -> list[str]:
        """Set the fields; the problems of a field of the wrong type (then the rest unchecked)."""
        fmt = Format.parse(format)
        where = f"LayerPrecision({fmt.value!r})"
        for name, value, cls in (("scaling", scaling, Scaling), ("calibration", calibration, Calibration), ("reason", reason, str),
                                 ("high_precision_weight_grad", high_weight_grad, bool)):
            if not isinstance(value, cls):
                expected = {str: "a string", bool: "True or False"}.get(cls, f"an autoprec.{cls.__name__}(...)")
                return [f"{where}: {name}={value!r}: expected {expected}"]
        if grad_format is None:
            # Block scaling is DeepSeek-V3's recipe, MX Transformer Engine's MXFP8 default: E4M3
            # gradients, made safe by the fine tiles' scales.
            tiled = fmt is Format.FP8_E4M3 and scaling.granularity in (Granularity.BLOCK, Granularity.MX)
            grad_format = Format.FP8_E4M3 if tiled else _DEFAULT_GRAD_FORMAT.get(fmt, fmt)
        _set = object.__setattr__
        _set(self, "format", fmt)
        _set(self, "grad_format", Format.parse(grad_format))
        _set(self, "scaling", scaling)
        _set(self, "calibration", calibration)
        _set(self, "reason", reason)
        # Implied by a high-precision backward (and so held False there: one recipe, one value).
        _set(self, "high_precision_weight_grad", high_weight_grad and self.grad_format is not Format.FP32)
        return []

    @classmethod
    def _parsed(cls, where: str, fmt: Format, grad_format: "Format | None", scaling: Scaling, calibration: Calibration,
                reason: str, high_weight_grad: bool, problems: list[str]) -> "LayerPrecision | None":
        """A plan entry's precision, its problems (named from ``where``: ``layers['fc']``) added
        to ``problems`` instead of raised, so that a plan names every bad entry at once."""
        lp = cls.__new__(cls)
        found = lp._fill(fmt, grad_format, scaling, calibration, reason, high_weight_grad) or check_layer(where, lp)
        problems.extend(found)
        return None if found else lp

    @property
    def weight_grad_format(self) -> Format:
        """The output gradient's format in the weight gradient's product: FP32 (high precision)
        where `high_precision_weight_grad` or the whole backward is, else ``grad_format``."""
        return Format.FP32 if self.high_precision_weight_grad else self.grad_format

    @property
    def recipe(self) -> str:
        """The layer's recipe in words: its format, then its scaling granularity, delayed scaling,
        gradient format where not the format's defaults and a high-precision weight gradient
        (``"fp8_e4m3"``, ``"fp8_e4m3/block"``, ``"nvfp4+fp32 backward"``, ``"fp8_e4m3/row+fp32
        wgrad"``); calibration, margins and histories aside."""
        name = self.format.value
        if self.format.needs_scale and self.scaling.granularity is not Granularity.TENSOR:
            name += f"/{self.scaling.granularity.value}"
        if self.format.needs_scale and self.scaling.mode is ScalingMode.DELAYED:
            name += "/delayed"
        if self.grad_format is not LayerPrecision(self.format, scaling=self.scaling).grad_format:
            name += f"+{self.grad_format.value} backward"
        if self.high_precision_weight_grad:
            name += "+fp32 wgrad"
        return name

    @classmethod
    def preset(cls, name: str) -> "LayerPrecision":
        """A named recipe of the libraries engineers train with (`PRESETS`: ``"te_mxfp8"``,
        ``"torchao_rowwise_with_gw_hp"``, ...), as autoprec runs it. `PlanError` in one line
        naming the presets for an unknown name."""
        settings = PRESETS.get(name) if isinstance(name, str) else None
        if settings is None:
            raise PlanError(f"LayerPrecision.preset({name!r}): unknown recipe; expected one of {', '.join(PRESETS)}", single_line=True)
        fmt, kwargs = settings
        return cls(fmt, **{**kwargs, "reason": f"preset {name}"})

    def cast_of(self, kind: str) -> tuple[Format, str]:
        """The format this layer casts a tensor of one kind to, and the scaling that casts it, as
        a profile names it: gradients use current scaling, weights and activations the layer's
        ``scaling.mode``; unscaled formats "none".

        Args:
            kind: ``"grad"`` (cast to ``grad_format``), or ``"weight"`` / ``"activation"`` (cast
                to ``format``); any value other than ``"grad"`` is taken as the latter, unchecked.

        Returns:
            ``(format, scaling)``: the `Format`, and ``"none"``, ``"current"`` or another
            `ScalingMode` value.
        """
        fmt = self.grad_format if kind == "grad" else self.format
        if not fmt.needs_scale:
            return fmt, "none"
        return fmt, "current" if kind == "grad" else self.scaling.mode.value

    def to_dict(self) -> dict:
        def plain(obj):
            return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(obj).items()}

        out = {
            "format": self.format.value,
            "grad_format": self.grad_format.value,
            "scaling": plain(self.scaling),
            "calibration": plain(self.calibration),
            "reason": self.reason,
        }
        if self.high_precision_weight_grad:  # written only where set (plan schema 4)
            out["weight_grad_format"] = Format.FP32.value
        return out


# Named recipes (`LayerPrecision.preset`; a plan file's layer may name one instead of a format):
# format and settings, as the library that names them runs them by default.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # Transformer Engine 2.x recipes (transformer_engine.common.recipe), their default fp8_format:
    # Float8CurrentScaling and DelayedScaling HYBRID (E4M3 forward, E5M2 gradients; delayed with
    # amax_history_len 1024, amax_compute_algo "max", margin 0), Float8BlockScaling (E4M3
    # throughout, 1x128 / 128x128 tiles), MXFP8BlockScaling (E4M3, 1x32 tiles, E8M0 scales),
    # NVFP4BlockScaling.
    "te_current": ("fp8_e4m3", {}),
    "te_delayed": ("fp8_e4m3", {"scaling": Scaling(mode=ScalingMode.DELAYED, history_len=1024, reduction=Reduction.MAX)}),
    "te_block": ("fp8_e4m3", {"scaling": Scaling(granularity=Granularity.BLOCK)}),
    "te_mxfp8": ("fp8_e4m3", {"scaling": Scaling(granularity=Granularity.MX)}),
    "te_nvfp4": ("nvfp4", {}),
    # "Forward low, backward high": Transformer Engine's backward_override="dequantized".
    "fp8_forward_only": ("fp8_e4m3", {"grad_format": "fp32"}),
    # torchao's Float8LinearConfig recipes: tensorwise (E4M3 forward, E5M2 gradients), rowwise
    # (E4M3 throughout; torchao also rounds the scales to powers of 2, autoprec does not), and
    # rowwise_with_gw_hp (rowwise, the weight gradient's GEMM in high precision).
    "torchao_tensorwise": ("fp8_e4m3", {}),
    "torchao_rowwise": ("fp8_e4m3", {"scaling": Scaling(granularity=Granularity.ROW), "grad_format": "fp8_e4m3"}),
    "torchao_rowwise_with_gw_hp": ("fp8_e4m3", {"scaling": Scaling(granularity=Granularity.ROW), "grad_format": "fp8_e4m3",
                                                "high_precision_weight_grad": True}),
    # DeepSeek-V3's fine-grained FP8 (arXiv:2412.19437): Transformer Engine's block recipe.
    "deepseek_v3": ("fp8_e4m3", {"scaling": Scaling(granularity=Granularity.BLOCK)}),
}


# The type each JSON field must have, to name the field and the fix when it has another.
_FIELD_TYPES: dict[str, dict[str, "type | tuple[type, ...]"]] = {
    "scaling": {"granularity": str, "mode": str, "history_len": int, "reduction": str, "margin": int},
    "calibration": {"method": str, "percentile": (int, float), "batches": int, "outlier_ratio": (int, float, type(None))},
}


_FIELD_CHOICES = {
    "granularity": tuple(g.value for g in Granularity),
    "mode": tuple(m.value for m in ScalingMode),
    "method": tuple(m.value for m in CalibrationMethod),
    "reduction": tuple(r.value for r in Reduction),
}


_Section = TypeVar("_Section", Scaling, Calibration)


def _parse_section(where: str, cls: type[_Section], data: Any, problems: list[str]) -> "_Section | None":
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        problems.append(f"{where}: expected an object like {json.dumps(dataclasses.asdict(cls()), default=str)}, got {type(data).__name__}")
        return None
    expected = _FIELD_TYPES[where.rsplit(".", 1)[-1]]
    ok = True
    for key, value in data.items():
        if key not in expected:
            problems.append(f"{where}.{key}: unknown key; expected one of {', '.join(expected)}")
            ok = False
        elif isinstance(value, bool) or not isinstance(value, expected[key]):
            problems.append(f"{where}.{key}: expected {_type_name(expected[key])}, got {value!r}")
            ok = False
        elif key in _FIELD_CHOICES and value not in _FIELD_CHOICES[key]:
            problems.append(f"{where}.{key}: {value!r} is not one of {', '.join(_FIELD_CHOICES[key])}")
            ok = False
        else:
            check, expected_value = _RULES[cls][key]
            try:
                check(value)
            except ValueError:
                problems.append(f"{where}.{key}: expected {expected_value}, got {value!r}")
                ok = False
    return cls(**data) if ok else None


def _type_name(t) -> str:
    names = [x.__name__ for x in (t if isinstance(t, tuple) else (t,))]
    return " or ".join("null" if n == "NoneType" else n for n in names)


def parse_layer(fqn: str, data: Any, problems: list[str]) -> "LayerPrecision | None":
    where = f"layers[{fqn!r}]"
    if isinstance(data, str) and data in PRESETS:  # a named recipe
        return LayerPrecision.preset(data)
    if isinstance(data, str):
        data = {"format": data}
    if not isinstance(data, Mapping):
        problems.append(f"{where}: expected an object with a 'format', got {type(data).__name__}")
        return None
    allowed = {"format", "grad_format", "weight_grad_format", "scaling", "calibration", "reason"}
    unknown = sorted(set(data) - allowed)
    for key in unknown:
        problems.append(f"{where}.{key}: unknown key; expected one of {', '.join(sorted(allowed))}")
    formats = {}
    for key in ("format", "grad_format", "weight_grad_format"):
        if key not in data or (key != "format" and data[key] is None):
            if key == "format":
                problems.append(f"{where}.format: missing; set one of {', '.join(f.value for f in Format)}")
            continue
        try:
            formats[key] = Format.parse(data[key])
        except FormatError as exc:
            named = "; or name a recipe instead of the entry: " + ", ".join(PRESETS) if key == "format" else ""
            problems.append(f"{where}.{key}: {exc}{named}")
    scaling = _parse_section(f"{where}.scaling", Scaling, data.get("scaling"), problems)
    calibration = _parse_section(f"{where}.calibration", Calibration, data.get("calibration"), problems)
    reason = data.get("reason", "")
    if not isinstance(reason, str):
        problems.append(f"{where}.reason: expected a string, got {reason!r}")
    if unknown or "format" not in formats or scaling is None or calibration is None or not isinstance(reason, str):
        return None
    # The weight gradient's format: the gradients' own (the default) or fp32 (high precision).
    weight_grad = formats.get("weight_grad_format")
    lp = LayerPrecision._parsed(where, formats["format"], formats.get("grad_format"), scaling, calibration, reason, weight_grad is Format.FP32, problems)
    if lp is not None and weight_grad is not None and weight_grad is not lp.weight_grad_format:
        problems.append(f"{where}.weight_grad_format: the weight gradient's product takes the gradients' format ({lp.grad_format.value!r}) "
                        f"or 'fp32' (high precision), got {weight_grad.value!r}")
        return None
    return lp


def figure_problems(key: str, figures: Mapping[str, Any]) -> list[str]:
    """A loaded plan's ``budgets`` / ``predicted`` / ``measured`` numbers (and the per-layer ones
    under ``predicted.layers``): none NaN, byte counts and times not negative, and only budgets
    open (inf). The search writes no other; a hand edit that breaks this is named here."""
    problems = []

    def check(where: str, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if value is not None and (name.endswith(("bytes", "seconds")) or name in ("loss", "loss_increase")):
                problems.append(f"{where}: expected a number, got {value!r}")
            return
        if math.isnan(value):
            problems.append(f"{where}: NaN; give a number or remove the field")
        elif name.endswith(("bytes", "seconds")) or key == "budgets":
            if value < 0:
                problems.append(f"{where}: must be >= 0, got {value}")
            elif math.isinf(value) and key != "budgets":
                problems.append(f"{where}: must be finite, got {value}")

    for name, value in figures.items():
        check(f"{key}.{name}", name, value)
    layers = figures.get("layers") if key == "predicted" else None
    for fqn, row in (layers.items() if isinstance(layers, Mapping) else ()):
        for name, value in (row.items() if isinstance(row, Mapping) else ()):
            check(f"{key}.layers[{fqn!r}].{name}", name, value)
    return problems


def check_layer(where: str, lp: LayerPrecision) -> list[str]:
    """The rules between a `LayerPrecision`'s fields (its fields' own ranges are `Scaling`'s and
    `Calibration`'s), independent of any model; each problem names ``where`` (``layers['fc']``,
    ``LayerPrecision('int8')``) and the field."""
    s = lp.scaling
    if lp.format is Format.NVFP4 and s != Scaling():  # the one problem: its other scaling checks do not apply
        return [f"{where}.scaling: nvfp4 scales itself (16-element blocks with E4M3 scales and one FP32 scale per tensor); leave scaling out"]
    problems = []
    scaled = [f for f in (lp.format, lp.grad_format) if f.needs_scale]
    if not scaled and s != Scaling():
        problems.append(f"{where}.scaling: {lp.format.value} takes no scale, so its scaling has no effect; leave it out "
                        "(fp8_e4m3, fp8_e5m2 and int8 layers are scaled)")
    if s.mode is ScalingMode.DELAYED and s.granularity is not Granularity.TENSOR and lp.format.is_fp8:
        problems.append(
            f"{where}.scaling: delayed scaling keeps one amax per tensor, so it needs "
            f"granularity 'tensor', got {s.granularity.value!r}; set mode 'current' or granularity 'tensor'"
        )
    if s.granularity is Granularity.MX and lp.format.is_fp8 and lp.format is not Format.FP8_E4M3:
        problems.append(f"{where}.scaling.granularity: MXFP8 ('mx') is E4M3 with E4M3, E5M2 or high-precision (fp32) gradients, got format "
                        f"{lp.format.value!r}; set format 'fp8_e4m3'")
    if s.granularity is Granularity.MX and lp.format is Format.INT8:
        problems.append(f"{where}.scaling.granularity: 'mx' is MXFP8, for fp8_e4m3 layers; an int8 layer scales per 'tensor' or 'row'")
    max_margin = min((_max_margin(f) for f in scaled), default=_ANY_MARGIN)
    if s.margin > max_margin:
        problems.append(
            f"{where}.scaling.margin: must be from 0 to {max_margin} for {lp.format.value} "
            f"(the scaled amax must stay >= 1 so values keep their levels), got {s.margin}"
        )
    if lp.format.is_fp8 and not lp.grad_format.is_fp8 and lp.grad_format is not Format.FP32:
        problems.append(f"{where}.grad_format: an FP8 layer's gradients are fp8_e5m2, fp8_e4m3 or fp32, got {lp.grad_format.value!r}")
    if lp.format is Format.NVFP4 and lp.grad_format not in (Format.NVFP4, Format.FP32):
        problems.append(f"{where}.grad_format: an NVFP4 layer's gradients are nvfp4 or fp32 (a high-precision backward), got {lp.grad_format.value!r}")
    if lp.high_precision_weight_grad and not ((lp.format.is_fp8 and lp.grad_format.is_fp8) or (lp.format is Format.NVFP4 and lp.grad_format is Format.NVFP4)):
        problems.append(f"{where}: a high-precision weight gradient (weight_grad_format 'fp32') is for FP8, MXFP8 and NVFP4 layers with "
                        f"low-precision gradients (this one computes it in {lp.grad_format.value} already); leave it out")
    default_grad = _DEFAULT_GRAD_FORMAT.get(lp.format, lp.format)
    if not lp.format.is_fp8 and lp.format is not Format.NVFP4 and lp.grad_format is not default_grad:
        problems.append(
            f"{where}.grad_format: only FP8 and NVFP4 layers choose a separate gradient format; "
            f"remove it or set it to {default_grad.value!r}"
        )
    return problems
