"""The settings of a `DynamicPrecisionScheduler`: one frozen `SchedulerConfig`.

Every default is stated here once; the loss-scaling defaults are `scaling.LossScaling`'s (the same
as `LossScaler`'s). Derive variants with ``dataclasses.replace``; invalid values raise
`SettingsError` at construction with one line naming the setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional, Sequence

from .._checks import check_fields, integer, number, optional
from ..blocks import check_block_patterns
from ..comm import CommSettings
from ..errors import SearchError, SettingsError
from ..formats import CommMethod, Format
from ..plan import LayerPrecision, Scaling
from ..scaling import LossScaling
from ..search.planning import Planning, RangeLimits
from ..search.budgets import MEMORY_SPELLINGS, Budgets, memory_budget
from ..search.space import DEFAULT_CANDIDATES, LayerRules, formats_for_precision

__all__ = ["SchedulerConfig", "Thresholds", "GRAD_COMM", "AUTO_COMM", "config_of"]

# ``grad_comm="auto"``: the plan chooses each layer's `CommMethod` (`Plan.comm`).
AUTO_COMM = "auto"
# How DDP may communicate gradients (`grad_comm`, `autoprec.comm`), by name.
GRAD_COMM = tuple(m.value for m in CommMethod) + (AUTO_COMM,)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a layer is promoted: more than ``overflow`` / ``underflow`` of a tensor's values out
    of its format's range (with the layer's scaling) in the monitored steps, an amax that moved
    by more than ``amax_drift`` times (either way) since the last window, or ``nonfinite_steps``
    steps with non-finite gradients in one window. Demoted after ``stable_windows`` quiet ones.
    ``saturation``: an input scaled from the past (frozen INT8 calibration, delayed FP8) whose
    amax went more than this many times past the range its scale covers is recalibrated at the
    next check step, and promoted when it does so again in the window (`scheduler.plan_checks`)."""

    overflow: float = RangeLimits.overflow  # the search rules out what the profile shows past these
    underflow: float = RangeLimits.underflow
    amax_drift: float = 16.0
    nonfinite_steps: int = 3
    stable_windows: int = 2
    saturation: float = 4.0

    def __post_init__(self):
        check_fields(self, "Thresholds", {
            "overflow": (number(0, 1), "a fraction from 0 to 1"),
            "underflow": (number(0, 1), "a fraction from 0 to 1"),
            "amax_drift": (number(above=1), "a finite factor > 1"),
            "saturation": (number(above=1), "a finite factor > 1"),
            "nonfinite_steps": (integer(1), "an integer >= 1"),
            "stable_windows": (integer(1), "an integer >= 1"),
        })


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What a `DynamicPrecisionScheduler` does; its keyword arguments build one.

    ``min_precision`` / ``max_precision``: bits (4, 8, 16, 32) of the formats a layer may take.
    ``monitor_window``: optimizer steps per window. ``memory_budget``: a fraction of the FP32
    bytes (a float in (0, 1]) or bytes (an int, or a size string such as ``"6GiB"``); ``accuracy_budget``: the allowed loss increase, relative to the first
    window's mean training loss (or absolute with ``accuracy_relative=False``); None leaves a
    budget open. ``formats``, ``rules``: the search's candidates and layer rules;
    ``search_timeout_s`` bounds the integer program that finds the plan; ``search_slice``: the
    search's work after each training step while it runs, in training steps of work (a step and
    its work then take about ``1 + search_slice`` steps' FLOPs), counted in model passes, not
    timed, so the same work follows the same steps however loaded the machine is (a unit of work
    heavier than that runs alone, in every third step at most; see `search.in_run`), or None:
    all of it in the window's last step (one long step; with
    ``measure_costs=False`` the plan is then in force from the next step); ``lr``: the learning
    rate the sensitivity's gradient term assumes. ``loss_scaling``, ``max_grad_norm`` (clip the unscaled
    gradients; None: no clipping), ``thresholds`` (when layers are promoted and demoted),
    ``monitor_steps`` (profiled steps at the end of each window), ``log_dir`` (TensorBoard).
    ``measure_costs=False`` uses the roofline time model instead of timing every layer on the
    device: cheaper, but deterministic only where the device has a datasheet entry (elsewhere,
    a CPU included, its peaks are calibrated once per process by one GEMM per format, so the
    predicted seconds, and a plan without a memory budget, can differ between runs).
    ``dynamic=False`` runs a fixed plan and never re-plans.
    ``recompute``: which blocks the search may recompute (activation checkpointing, chosen
    together with the formats where it meets a memory budget faster than narrower formats do):
    None (the default) finds them as the offline search does (`autoprec.blocks.find_blocks`: the
    repeated children of a ``ModuleList`` / ``Sequential`` / ``ModuleDict``, the transformer blocks), fnmatch
    patterns name them (e.g. ``["blocks.*"]``, checked against the model when the scheduler
    binds), ``[]`` turns recomputation off (formats only). Costs the search two forwards per
    block on its snapshot, and the blocks' forwards timed in probe steps.
    A plan given with ``plan=`` runs its recomputed blocks either way (`Plan.with_recompute`).
    ``sample_every``: the profiling window's statistics and the planned windows' watch are taken
    on every ``sample_every``-th step (hooks on the model only then; other steps run no Python
    per layer); a non-finite gradient is still caught on every step, by the loss scaler.
    ``window_format``: the precision the profiling window (and training after a failed search)
    runs in; None: BF16 where the device computes it natively (CUDA, compute capability 8.0 or
    newer) and BF16 is a candidate, else FP32 (no statistic needs FP32: see docs/scheduler.md).

    Under ``torch.distributed`` (see `autoprec.distributed`): ``process_group`` is the group the
    ranks agree in (None: the default group, once initialised); ``grad_comm`` how DDP communicates
    gradients (`autoprec.comm`): ``"fp32"``, ``"bf16"``, ``"fp16"`` (torch's own hooks),
    ``"powersgd"`` (torch's PowerSGD hook, rank 2), ``"int8"`` (per-chunk scaled, error feedback),
    ``"topk"`` (1 % of each bucket, error feedback; ``comm=CommSettings(...)`` sets the INT8
    chunk, the top-k fraction and PowerSGD's rank), or ``"auto"``: the plan chooses per layer
    (`Plan.comm`) among FP32, BF16, INT8 and top-k, from the link measured at bind and the loss
    each compression is predicted to add within the accuracy budget (`scheduler.grad_comm`,
    `comm.choice`); FP32 until a plan is in force.
    """

    min_precision: int = 8
    max_precision: int = 32
    monitor_window: int = 500
    memory_budget: "float | int | str | None" = None
    accuracy_budget: Optional[float] = None
    accuracy_relative: bool = True
    formats: tuple[Format, ...] = DEFAULT_CANDIDATES
    rules: LayerRules = LayerRules()
    # format -> how its tensors are scaled in the search and the plan (`Planning.scaling`), e.g.
    # {"fp8_e4m3": "block"} for DeepSeek-V3's fine-grained FP8; empty: current per-tensor.
    # Given by name or enum, or a list of them the search weighs per layer (`Planning.alternatives`);
    # held as Format -> tuple of Scalings.
    scaling: "Mapping[Format | str, Scaling | str]" = dataclasses.field(default_factory=dict)
    # format -> its layers' gradient format in the search and the plan (`Planning.grad_formats`),
    # e.g. {"nvfp4": "fp32"}: NVFP4 forwards, high-precision backwards; empty: each format's default.
    # A list: weighed per layer, as ``scaling``'s; "fp8_e5m2/fp32": per GEMM, the weight gradient's
    # product in high precision; held as Format -> tuple of (Format, bool) pairs.
    grad_formats: "Mapping[Format | str, Format | str]" = dataclasses.field(default_factory=dict)
    # Named recipes (`LayerPrecision.preset`: "te_mxfp8", "torchao_rowwise_with_gw_hp", ...) or
    # LayerPrecisions the search weighs per layer beside those (`Planning.recipes`); each
    # recipe's format must be a candidate. Held as a tuple of LayerPrecisions.
    recipes: "Sequence[str | LayerPrecision]" = ()
    search_timeout_s: float = 60.0
    search_slice: Optional[float] = 1.0
    lr: float = 1e-3
    loss_scaling: LossScaling = LossScaling()
    max_grad_norm: Optional[float] = None
    thresholds: Thresholds = Thresholds()
    monitor_steps: int = 64
    log_dir: Optional[str] = None
    measure_costs: bool = True
    dynamic: bool = True
    seed: int = 0
    process_group: Any = None
    grad_comm: "CommMethod | Literal['auto']" = CommMethod.FP32  # given by name too; held as a CommMethod or AUTO_COMM
    comm: CommSettings = CommSettings()
    recompute: Optional[tuple[str, ...]] = None
    sample_every: int = 8
    window_format: "Format | str | None" = None

    def __post_init__(self):
        self._check_types()
        check_fields(self, "DynamicPrecisionScheduler", {
            "monitor_window": (integer(1), "a positive integer"),
            "monitor_steps": (integer(1), "a positive integer"),
            "sample_every": (integer(1), "a positive integer"),
            "min_precision": (integer(), "4, 8, 16 or 32 (bits)"),
            "max_precision": (integer(), "4, 8, 16 or 32 (bits)"),
            "max_grad_norm": (optional(number(above=0)), "a finite number > 0 or None"),
            "accuracy_budget": (optional(number(0)), "a finite loss increase >= 0, or None"),
            "lr": (number(above=0), "the finite learning rate > 0"),
            "search_timeout_s": (number(above=0), "a finite number of seconds > 0"),
            "search_slice": (optional(number(above=0)), "a finite number of median steps > 0 (1.0: a step about twice the median), or None (all at once)"),
        })
        try:
            object.__setattr__(self, "memory_budget", memory_budget(self.memory_budget))
        except ValueError as exc:
            raise SettingsError(f"DynamicPrecisionScheduler(memory_budget={self.memory_budget!r}): expected {MEMORY_SPELLINGS} ({exc})") from None
        if self.grad_comm not in GRAD_COMM:
            raise SettingsError(f"DynamicPrecisionScheduler(grad_comm={self.grad_comm!r}): expected one of {', '.join(map(repr, GRAD_COMM))}")
        object.__setattr__(self, "grad_comm", AUTO_COMM if self.grad_comm == AUTO_COMM else CommMethod.parse(self.grad_comm))
        object.__setattr__(self, "formats", tuple(Format.parse(f) for f in self.formats))
        if self.window_format is not None:
            try:
                window_format = Format.parse(self.window_format)
            except ValueError:
                window_format = None
            if window_format not in (Format.FP32, Format.BF16, Format.FP16) or window_format.bits > self.max_precision:
                raise SettingsError(f"DynamicPrecisionScheduler(window_format={self.window_format!r}): expected None, 'fp32', 'bf16' or 'fp16', "
                                    f"no wider than max_precision={self.max_precision}")
            object.__setattr__(self, "window_format", window_format)
        try:
            allowed = formats_for_precision(self.min_precision, self.max_precision, self.formats)  # refuses bad bounds now
        except SearchError as exc:
            raise SettingsError(str(exc)) from None
        if not allowed:
            raise SettingsError(
                f"DynamicPrecisionScheduler(min_precision={self.min_precision}, max_precision={self.max_precision}): no format in "
                f"formats ({', '.join(f.value for f in self.formats) or 'none'}) lies within these bounds; widen the bounds or add a format "
                "of that width (e.g. 'bf16' for 16 bits)"
            )
        try:
            object.__setattr__(self, "recipes", Planning(allowed, recipes=self.recipes).recipes)  # each recipe's format a candidate
        except SearchError as exc:
            raise SettingsError(str(exc).replace("Planning(", "DynamicPrecisionScheduler(", 1)) from None

    def _check_types(self) -> None:
        """Settings of the wrong type, refused naming the argument (``dynamic='no'`` is truthy,
        ``thresholds=None`` would fail at the first window, far from the call)."""
        import os

        def refuse(name: str, expected: str) -> None:
            raise SettingsError(f"DynamicPrecisionScheduler({name}={getattr(self, name)!r}): expected {expected}")

        for name in ("accuracy_relative", "measure_costs", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                refuse(name, "True or False")
        for name, cls in (("thresholds", Thresholds), ("rules", LayerRules), ("loss_scaling", LossScaling), ("comm", CommSettings)):
            if not isinstance(getattr(self, name), cls):
                refuse(name, f"an autoprec.{cls.__name__}(...); leave it out for the defaults")
        if self.log_dir is not None and not isinstance(self.log_dir, (str, os.PathLike)):
            refuse("log_dir", "a folder path (str or pathlib.Path) or None")
        check_fields(self, "DynamicPrecisionScheduler", {"seed": (integer(), "an integer")})
        if isinstance(self.formats, (str, Format)) or not isinstance(self.formats, (tuple, list)):
            refuse("formats", "a list of format names, e.g. ['bf16', 'fp8_e4m3']")
        try:
            checked = Planning((), scaling=self.scaling, grad_formats=self.grad_formats)
            object.__setattr__(self, "scaling", checked.scaling)
            object.__setattr__(self, "grad_formats", checked.grad_formats)
        except SearchError as exc:
            raise SettingsError(str(exc).replace("Planning(", "DynamicPrecisionScheduler(", 1)) from None
        if self.recompute is not None:
            try:
                patterns = check_block_patterns(self.recompute, f"DynamicPrecisionScheduler(recompute={self.recompute!r})")
            except SearchError as exc:
                raise SettingsError(str(exc)) from None
            object.__setattr__(self, "recompute", patterns)

    @property
    def candidates(self) -> tuple[Format, ...]:
        """The formats a layer may take: ``formats`` within the precision bounds."""
        return formats_for_precision(self.min_precision, self.max_precision, self.formats)

    @property
    def budgets(self) -> Budgets:
        return Budgets(self.memory_budget, self.accuracy_budget, self.accuracy_relative)

    @property
    def planning(self) -> Planning:
        """The search's settings as one `Planning` (one plan: the optimum)."""
        return Planning(self.candidates, self.rules, self.budgets, self.min_precision, self.max_precision, self.lr,
                        k=1, time_limit=self.search_timeout_s, measure=self.measure_costs, scaling=self.scaling, grad_formats=self.grad_formats,
                        recipes=self.recipes,
                        limits=RangeLimits(self.thresholds.overflow, self.thresholds.underflow))

    @property
    def profiled_steps(self) -> int:
        """Steps profiled at the end of each window (at most the window)."""
        return min(self.monitor_steps, self.monitor_window)


def config_of(config: Optional[SchedulerConfig], settings: Mapping[str, Any]) -> SchedulerConfig:
    """A scheduler's settings: ``config``, or a `SchedulerConfig` of ``settings`` (its fields, given
    to `DynamicPrecisionScheduler` by keyword). `SettingsError` for both at once, or for a removed
    or unknown setting."""
    if config is not None and settings:
        raise SettingsError(f"DynamicPrecisionScheduler(config=..., {', '.join(sorted(settings))}=...): give the settings in the config or as keywords, not both (dataclasses.replace(config, ...) derives one)")
    if "search_trials" in settings:  # the scheduler's search has no trials since it is exact
        raise SettingsError("DynamicPrecisionScheduler(search_trials=...): removed: the search is the optimum of the integer program (to a proven gap), bounded by search_timeout_s; delete the argument")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(SchedulerConfig)})
    if unknown:
        raise SettingsError(f"DynamicPrecisionScheduler({unknown[0]}=...): unknown setting; expected one of SchedulerConfig's fields: {', '.join(f.name for f in dataclasses.fields(SchedulerConfig))}")
    return config if config is not None else SchedulerConfig(**settings)
