"""The ``models`` suite of `autoprec bench` (`run_bench`): time and saved bytes of training steps
under every precision variant.

One run trains, side by side, each target workload (`autoprec.workload.Workload`; the CLI's are
the built-in byte-level LM, or the ``--workload module:function`` given, and one standalone
`TransformerBlock`) under each variant:

- ``fp32``: the plain model, no autoprec (the reference every ratio is taken against);
- ``plan:<format>``: ``Plan.uniform(model, format, example_input)`` run by ``apply_plan``; the
  runtime is made once per variant and re-entered every step, so amax histories and INT8
  calibration carry over as in real training;
- ``autocast:<bf16|fp16>``: plain ``torch.autocast`` around forward + loss;
- ``compiled:<any of the above>``: the same with the model under ``torch.compile`` (the context
  entered around the compiled call); compiling costs its first steps, so give enough warmup.

Per variant it measures the median step time (`TrainStep.for_workload`: zero_grad, forward + loss,
backward, the workload's clipping and optimizer step)
and the bytes autograd saves for backward in one forward (`SavedTensorMeter`, parameters
excluded), each also as a ratio to ``fp32`` on the same target.

Variants are interleaved round-robin so that a noisy machine treats them alike (`run_bench`).
Cost: ``(warmup + steps)`` rounds, each one training step of every variant on every target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, cast

import torch
import torch.nn as nn

from .._version import __version__
from .._io import atomic_write_text
from ..calls import ModelCall
from ..device import resolve_device
from ..errors import AutoprecError
from ..formats import Format
from ..saved_bytes import SavedTensorMeter
from ..plan import Plan
from ..runtime import EmulationWarning, PlanRuntime, apply_plan
from ..device_clock import rotated, timed
from ..workload import TrainStep, check_workload, to_device
from ._common import (
    BenchConfigError, CpuContention, check_device_and_seed, device_info, is_positive_int, json_safe, median_iqr, ratio_or_nan,
)

__all__ = ["DEFAULT_VARIANTS", "BenchConfig", "BenchRow", "TargetCheck", "BenchResult", "run_bench"]

logger = logging.getLogger(__name__)

REFERENCE = "fp32"
_COMPILED = "compiled:"
DEFAULT_VARIANTS = (
    "fp32",
    "plan:fp32",
    "plan:bf16",
    "plan:fp16",
    "plan:fp8_e4m3",
    "plan:int8",
    "autocast:bf16",
)
# Other processes' average CPU use (cores) from which the table warns that timings are contended.
_CONTENDED_CORES = 0.25
# Formats plain autocast can run (torch.autocast takes a half dtype only).
_AUTOCAST_FORMATS = (Format.BF16, Format.FP16)


@dataclasses.dataclass(frozen=True)
class BenchVariant:
    """One precision variant of the suite, as parsed from its name (``"compiled:plan:bf16"``)."""

    name: str
    kind: str  # "plain" | "plan" | "autocast"
    format: Format
    compiled: bool = False  # the model under torch.compile (default inductor backend)


def _parse_variant(name: str) -> BenchVariant:
    """``"fp32"``, ``"plan:<format>"`` or ``"autocast:<bf16|fp16>"``, each optionally prefixed
    ``"compiled:"``."""
    if name.startswith(_COMPILED):
        inner = _parse_variant(name[len(_COMPILED):])
        if inner.compiled:
            raise BenchConfigError(f"unknown variant {name!r}: 'compiled:' is given once")
        return dataclasses.replace(inner, name=_COMPILED + inner.name, compiled=True)
    if name == REFERENCE:
        return BenchVariant(name, "plain", Format.FP32)
    kind, _, fmt_name = name.partition(":")
    if kind not in ("plan", "autocast") or not fmt_name:
        raise BenchConfigError(
            f"unknown variant {name!r}; use 'fp32', 'plan:<format>' or 'autocast:<bf16|fp16>', optionally prefixed 'compiled:' "
            f"(formats: {', '.join(f.value for f in Format)})"
        )
    try:
        fmt = Format.parse(fmt_name)
    except AutoprecError as exc:
        raise BenchConfigError(f"variant {name!r}: {exc}") from None
    if kind == "autocast" and fmt not in _AUTOCAST_FORMATS:
        raise BenchConfigError(f"variant {name!r}: torch.autocast runs bf16 or fp16 only")
    return BenchVariant(f"{kind}:{fmt.value}", kind, fmt)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run_bench` measures. Immutable; derive variants with ``dataclasses.replace``.

    ``steps`` timed rounds follow ``warmup`` untimed ones (saved bytes are measured in the last
    warmup step, so ``warmup >= 1``). The targets are `run_bench`'s argument, not config.
    ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    """

    steps: int = 20
    warmup: int = 3
    device: str = "auto"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "warmup"):
            value = getattr(self, name)
            if not is_positive_int(value):
                hint = " (saved bytes are measured in the last warmup step)" if name == "warmup" else ""
                raise BenchConfigError(f"{name} must be a positive integer, got {value!r}{hint}")
        if isinstance(self.variants, str):
            raise BenchConfigError(f"variants must be a sequence of names, got the string {self.variants!r}")
        names = tuple(_parse_variant(v).name for v in self.variants)
        if REFERENCE not in names:
            raise BenchConfigError(f"variants must include {REFERENCE!r}: every ratio is taken against it")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise BenchConfigError(f"variants repeat {', '.join(duplicates)}")
        object.__setattr__(self, "variants", names)
        check_device_and_seed(self.device, self.seed)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "BenchConfig":
        """``"default"`` (the README's benchmark run) or ``"quick"`` (1 warmup + 3 timed rounds, for
        tests and smoke runs; too few rounds for timings to mean much), with fields overridden."""
        try:
            preset = _PRESETS[name]
        except KeyError:
            raise BenchConfigError(f"unknown bench preset {name!r}; choose one of {', '.join(sorted(_PRESETS))}") from None
        return dataclasses.replace(preset, **overrides)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


_PRESETS = {
    "default": BenchConfig(),
    # 4 forwards per variant: enough for INT8 calibration (4 batches by default) to freeze.
    "quick": BenchConfig(steps=3, warmup=1),
}


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (target, variant). Times in milliseconds (median over timed rounds, ``step_ms_iqr``
    the interquartile range), bytes as counted by `SavedTensorMeter`; ratios are to ``fp32`` on
    the same target. ``final_loss`` is the training loss of the last timed step."""

    target: str
    variant: str
    step_ms: float
    step_ratio: float
    saved_bytes: int
    saved_ratio: float
    final_loss: float
    step_ms_iqr: float = 0.0
    non_finite_steps: int = 0  # timed steps whose loss was NaN or inf
    saved_by_dtype: dict = dataclasses.field(default_factory=dict)

    @property
    def finite(self) -> bool:
        return self.non_finite_steps == 0 and math.isfinite(self.final_loss)


@dataclasses.dataclass(frozen=True)
class TargetCheck:
    """One acceptance target: ``passed`` is ``value <= limit``."""

    name: str
    value: float
    limit: float
    passed: bool


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Everything `run_bench` measured. ``calibration``: the INT8 calibration summary of the
    workload (None when ``plan:int8`` is not benchmarked); ``emulated``: target -> variant ->
    ``{layer fqn: [op, ...]}`` ran without a real kernel; ``reports``: target -> variant ->
    ``PlanRuntime.report()``."""

    config: BenchConfig
    device: dict
    targets_info: dict  # target -> one-line description of the model and its input
    rows: list[BenchRow]
    targets: list[TargetCheck]
    calibration: Optional[dict]
    emulated: dict
    reports: dict
    wall_s: float

    @property
    def passed(self) -> bool:
        """True when every checked target passed."""
        return all(t.passed for t in self.targets)

    def row(self, target: str, variant: str) -> BenchRow:
        for r in self.rows:
            if r.target == target and r.variant == variant:
                return r
        raise KeyError(f"no row for target {target!r}, variant {variant!r}")

    def to_dict(self) -> dict:
        """A JSON-ready dict (non-finite floats become null)."""
        data = {
            "schema": "autoprec.bench/1",
            "autoprec_version": __version__,
            "config": self.config.to_dict(),
            "device": dict(self.device),
            "targets_info": dict(self.targets_info),
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "targets": [dataclasses.asdict(t) for t in self.targets],
            "passed": self.passed,
            "calibration": self.calibration,
            "emulated": self.emulated,
            "reports": self.reports,
            "wall_s": self.wall_s,
        }
        return json_safe(data)

    def save(self, path: "str | os.PathLike") -> Path:
        """Write `to_dict` as JSON atomically (a temporary file renamed over ``path``)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    def format_table(self) -> str:
        """Plain aligned text: the table, the targets (PASS/FAIL), calibration, emulated layers."""
        d = self.device
        where = d["name"] + (f", {d['cpu_capability']}, {d['threads']} threads" if d["type"] == "cpu" else f", capability {d.get('capability')}")
        lines = [
            f"autoprec bench: {d['type']} ({where}), torch {d['torch']}; "
            f"median of {self.config.steps} interleaved rounds after {self.config.warmup} warmup; {self.wall_s:.0f} s",
        ]
        for target, info in self.targets_info.items():
            lines.append(f"  {target}: {info}")
        other = d.get("other_processes_cores")
        if other is not None and other >= _CONTENDED_CORES:
            lines.append(
                f"  note: other processes kept {other:.1f} of {d.get('cpu_count')} CPU cores busy during the run; "
                "timings are contended and noisier than on an idle machine"
            )
        header = ("target", "variant", "step ms", "±iqr", "x fp32", "saved MiB", "x fp32", "final loss", "")
        body = []
        for r in self.rows:
            body.append((
                r.target, r.variant, f"{r.step_ms:.1f}", f"{r.step_ms_iqr:.1f}", f"{r.step_ratio:.2f}",
                f"{r.saved_bytes / 2**20:.2f}", f"{r.saved_ratio:.3f}", f"{r.final_loss:.4f}",
                "" if r.finite else f"NON-FINITE ({r.non_finite_steps} steps)",
            ))
        widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
        left = {0, 1, 8}
        for row in (header, *body):
            cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
        lines.append("targets:")
        if not self.targets:
            lines.append("  (none checked: their variants were not benchmarked)")
        for t in self.targets:
            lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {t.name}: {t.value:.3f} (limit <= {t.limit:g})")
        lines.append("")
        cal = self.calibration
        if cal is not None:
            if cal.get("layers"):
                lines.append(
                    f"INT8 calibration ({cal['target']}, {cal['layers']} layers, {cal['gemms']} GEMMs, "
                    f"{cal['outlier_channels']} outlier channels kept in FP32): relative quantization error on real "
                    f"activations, mean over layers: naive max {cal['naive_max_rel_error']:.4f} -> calibrated "
                    f"{cal['calibrated_rel_error']:.4f}"
                )
            else:
                lines.append(f"INT8 calibration ({cal['target']}): {cal['note']}")
        lines.append("emulated (FP8/INT8 storage, FP32 compute; no real kernel):")
        any_plan = False
        for target, per_variant in self.emulated.items():
            for variant, layers in per_variant.items():
                any_plan = True
                text = ", ".join(f"{fqn} [{', '.join(ops)}]" for fqn, ops in layers.items()) or "none"
                lines.append(f"  {target} {variant}: {text}")
        if not any_plan:
            lines.append("  (no plan variants benchmarked)")
        return "\n".join(lines)


class VariantRunner:
    """One (target, variant): its model, training step, precision context and measurements."""

    def __init__(self, target: str, variant: BenchVariant, workload: Any, model: nn.Module, example: "ModelCall | None", device: torch.device):
        # ``example``: the model's first call (None: `Plan.uniform` finds layers in the module tree).
        self.target = target
        self.variant = variant
        self.model = model
        self.runtime: Optional[PlanRuntime] = None
        context: Callable[[], contextlib.AbstractContextManager]
        if variant.kind == "plan":
            runtime = self.runtime = apply_plan(model, Plan.uniform(model, variant.format, example))
            context = lambda: runtime  # noqa: E731  (one of three interchangeable context factories)
        elif variant.kind == "autocast":
            context = lambda: torch.autocast(device.type, dtype=variant.format.dtype)  # noqa: E731
        else:
            context = contextlib.nullcontext
        self.context = context
        self.train_step = TrainStep.for_workload(workload, model, context)
        # The precision context is entered around the compiled call, as around autocast.
        # torch.compile of a module returns an OptimizedModule (an nn.Module); its stubs say a callable.
        self.forward_model = cast(nn.Module, torch.compile(model)) if variant.compiled else model
        self.times: list[float] = []
        self.losses: list[float] = []
        self.saved_bytes = 0
        self.saved_by_dtype: dict = {}

    def step(self, batch: Any, meter: Optional[SavedTensorMeter] = None) -> torch.Tensor:
        # The metered (untimed) step runs eagerly: saved-tensor hooks see eager autograd's
        # tensors, so a compiled variant reports its plan's eager bytes.
        self.train_step.model = self.model if meter is not None else self.forward_model
        self.train_step.make_context = self.context if meter is None else lambda: _entered(meter, self.context())
        return self.train_step(batch)


@contextlib.contextmanager
def _entered(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def run_bench(
    targets: Mapping[str, Any],
    config: BenchConfig = BenchConfig(),
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> BenchResult:
    """Run the benchmark described by ``config`` on ``targets`` (name -> `Workload`); see the
    module docstring for the variants and what is measured.

    Fairness on a small, noisy machine: every variant's model is built from the same seed and
    sees the same batches; after ``warmup`` untimed rounds, variants are interleaved round-robin,
    one step of every (target, variant) per round, with the starting variant rotated each round
    so no variant always runs right after the same neighbour; medians are taken over rounds.
    On a CPU without BF16/FP16 matrix units the BF16 / FP16 variants dominate (that is the
    hardware, and the numbers show it). Other processes on the machine inflate every time; the
    result records how many cores they kept busy.

    ``progress(round, total_rounds, phase)`` is called after every round (``phase`` is
    ``"warmup"`` or ``"timed"``). Costs ``warmup + steps`` rounds of one training step per
    (target, variant), plus one traced forward per plan variant to build its plan; on CUDA every
    step ends with a device sync so its time is the device's. Emulation warnings are not raised:
    emulated layers are reported in the result.
    """
    if not targets:
        raise BenchConfigError("run_bench needs at least one target workload")
    targets = {name: check_workload(workload, f"target {name!r}") for name, workload in targets.items()}
    start = time.perf_counter()
    contention = CpuContention()
    device = resolve_device(config.device, BenchConfigError, "the bench")
    variants = [_parse_variant(v) for v in config.variants]
    rounds = config.warmup + config.steps
    logger.info("bench on %s: %d variants x %d targets, %d warmup + %d timed rounds", device, len(variants), len(targets), config.warmup, config.steps)

    inputs = {}
    for name, workload in targets.items():
        batches = iter(workload.train_batches(config.seed))
        inputs[name] = [to_device(next(batches), device) for _ in range(rounds)]
    targets_info = {name: getattr(workload, "description", None) or repr(workload) for name, workload in targets.items()}

    with warnings.catch_warnings():
        # Emulated layers are reported in the result (`emulated`); one warning per layer would only repeat it.
        warnings.simplefilter("ignore", EmulationWarning)
        runners = []
        for name, workload in targets.items():
            for variant in variants:
                model = workload.build_model(config.seed).to(device)  # same seed: same weights in every variant
                example = ModelCall.first(model, lambda: workload.loss(model, inputs[name][0]))
                runners.append(VariantRunner(name, variant, workload, model, example, device))

        gc.collect()
        for r in range(rounds):
            timed_round = r >= config.warmup
            for runner in rotated(runners, r):
                batch = inputs[runner.target][r]
                meter = None
                if r == config.warmup - 1:  # the last warmup step: calibration and histories are warm
                    meter = SavedTensorMeter(runner.model.parameters())
                loss, elapsed = timed(functools.partial(runner.step, batch, meter), device)
                if meter is not None:
                    runner.saved_bytes = meter.total_bytes
                    runner.saved_by_dtype = meter.bytes_by_dtype()
                if timed_round:
                    runner.times.append(elapsed)
                    runner.losses.append(float(loss.detach()))
            if progress is not None:
                progress(r + 1, rounds, "timed" if timed_round else "warmup")

    rows = []
    reference = {run.target: run for run in runners if run.variant.name == REFERENCE}
    ref_ms = {target: median_iqr(run.times)[0] * 1e3 for target, run in reference.items()}
    for run in runners:
        median, iqr = median_iqr(run.times)
        non_finite = sum(not math.isfinite(v) for v in run.losses)
        rows.append(BenchRow(
            target=run.target,
            variant=run.variant.name,
            step_ms=median * 1e3,
            step_ratio=ratio_or_nan(median * 1e3, ref_ms[run.target]),
            saved_bytes=run.saved_bytes,
            saved_ratio=ratio_or_nan(run.saved_bytes, reference[run.target].saved_bytes),
            final_loss=run.losses[-1],
            step_ms_iqr=iqr * 1e3,
            non_finite_steps=non_finite,
            saved_by_dtype=run.saved_by_dtype,
        ))
        if non_finite:
            logger.warning("%s %s: %d of %d timed steps had a non-finite loss", run.target, run.variant.name, non_finite, len(run.losses))

    plan_runs = [(run, run.runtime) for run in runners if run.runtime is not None]
    emulated = {target: {run.variant.name: runtime.emulated_layers() for run, runtime in plan_runs if run.target == target} for target in targets}
    emulated = {target: per for target, per in emulated.items() if per}
    reports = {target: {run.variant.name: runtime.report() for run, runtime in plan_runs if run.target == target} for target in targets}
    reports = {target: per for target, per in reports.items() if per}
    int8 = next((pair for pair in plan_runs if pair[0].variant.format is Format.INT8), None)  # the first target's
    calibration = _calibration_summary(*int8) if int8 is not None else None

    info = device_info(device)
    info["other_processes_cores"] = contention.other_cores()
    info["cpu_count"] = os.cpu_count()
    result = BenchResult(
        config=config,
        device=info,
        targets_info=targets_info,
        rows=rows,
        targets=_check_targets(rows),
        calibration=calibration,
        emulated=emulated,
        reports=reports,
        wall_s=time.perf_counter() - start,
    )
    logger.info("bench done in %.1f s; targets %s", result.wall_s, "passed" if result.passed else "FAILED")
    return result


def _calibration_summary(run: VariantRunner, runtime: PlanRuntime) -> dict:
    """Mean over layers (each layer: mean over its GEMMs) of the INT8 relative quantization error
    ‖x − q(x)‖/‖x‖ on the activations seen during calibration: naive max scaling vs calibrated."""
    per_layer = {}
    for fqn, entry in runtime.report().items():
        slots = entry.get("calibration")
        if not slots:
            continue
        per_layer[fqn] = {
            "gemms": len(slots),
            "naive_max_rel_error": statistics.fmean(s["naive_max_rel_error"] for s in slots),
            "calibrated_rel_error": statistics.fmean(s["calibrated_rel_error"] for s in slots),
            "outlier_channels": sum(s["outlier_channels"] for s in slots),
        }
    summary = {"target": run.target, "variant": run.variant.name, "layers": len(per_layer), "per_layer": per_layer}
    if not per_layer:
        summary["note"] = "no layer finished calibrating; run more steps (INT8 calibration freezes after Calibration.batches forwards, 4 by default)"
        return summary
    summary.update(
        gemms=sum(v["gemms"] for v in per_layer.values()),
        outlier_channels=sum(v["outlier_channels"] for v in per_layer.values()),
        naive_max_rel_error=statistics.fmean(v["naive_max_rel_error"] for v in per_layer.values()),
        calibrated_rel_error=statistics.fmean(v["calibrated_rel_error"] for v in per_layer.values()),
    )
    return summary


# (name, target, measured variant, reference variant, field, limit); a target is checked only when
# both of its variants were benchmarked.
_TARGET_SPECS = (
    ("block: plan:fp8_e4m3 saved bytes / autocast:bf16 saved bytes", "block", "plan:fp8_e4m3", "autocast:bf16", "saved_bytes", 0.75),
    ("block: plan:bf16 saved bytes / autocast:bf16 saved bytes", "block", "plan:bf16", "autocast:bf16", "saved_bytes", 1.0),
    ("workload: plan:fp32 step time / fp32 step time", "workload", "plan:fp32", REFERENCE, "step_ms", 1.05),
    ("block: plan:fp32 step time / fp32 step time", "block", "plan:fp32", REFERENCE, "step_ms", 1.05),
)


def _check_targets(rows: list[BenchRow]) -> list[TargetCheck]:
    by_key = {(r.target, r.variant): r for r in rows}
    checks = []
    for name, target, measured, reference, field, limit in _TARGET_SPECS:
        a, b = by_key.get((target, measured)), by_key.get((target, reference))
        if a is None or b is None:
            continue
        value = ratio_or_nan(getattr(a, field), getattr(b, field))
        checks.append(TargetCheck(name, value, limit, bool(value <= limit)))
    return checks

