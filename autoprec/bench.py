"""`autoprec bench`: the foundation benchmark of every precision variant on two real models.

Two suites: ``models`` (`run_bench`, below: time and saved bytes of training steps) and ``ops``
(`run_ops_bench`, in its own section at the end: aten ops, host syncs and graph breaks per step,
counted rather than timed).

One ``models`` run trains, side by side, the built-in byte-level LM (`default_workload`) and one standalone
`TransformerBlock` under each variant:

- ``fp32``: the plain model, no autoprec (the reference every ratio is taken against);
- ``plan:<format>``: ``Plan.uniform(model, format, example_input)`` run by ``apply_plan``; the
  runtime is made once per variant and re-entered every step, so amax histories and INT8
  calibration carry over as in real training;
- ``autocast:<bf16|fp16>``: plain ``torch.autocast`` around forward + loss;
- ``compiled:<any of the above>``: the same with the model under ``torch.compile`` (the context
  entered around the compiled call); compiling costs its first steps, so give enough warmup.

Per variant it measures the median step time (zero_grad, forward + loss, backward, AdamW step)
and the bytes autograd saves for backward in one forward (`SavedTensorMeter`, parameters
excluded), each also as a ratio to ``fp32`` on the same target.

Fairness on a small, noisy machine: every variant's model is built from the same seed and sees
the same batches; after ``warmup`` untimed rounds, variants are interleaved round-robin, one step
of every (target, variant) per round, with the starting variant rotated each round so no variant
always runs right after the same neighbour; medians are taken over rounds.

Cost: ``(warmup + steps)`` rounds, each one training step of every variant on both targets. On 2
CPU cores (AVX2, no BF16/FP16 matrix units, torch 2.13) one default round takes ~3.6 s, so the
default 3 + 20 rounds take ~85 s; BF16 / FP16 dominate, their matmuls being ~8-20x slower than FP32
there (that is the hardware, and the numbers show it). Other processes on the machine inflate
every time; the result records how many cores they kept busy.
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
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from . import __version__
from ._io import atomic_write_text
from .device import resolve_device
from .errors import ProfileError
from .errors import AutoprecError
from .formats import Format, Granularity
from .measure import SavedTensorMeter
from .opcount import OpCounts, count_training_step, graph_breaks, max_abs_diff, training_step
from .plan import Calibration, Plan, Scaling, ScalingMode
from .profiling import LayerProfiler
from .profiling.drivers import builtin_workload, workload_trainer
from .runtime import EmulationWarning, PlanRuntime, apply_plan
from .workloads import LMConfig, TransformerBlock, default_workload

__all__ = [
    "DEFAULT_VARIANTS",
    "measure_overhead",
    "BenchConfig",
    "BenchConfigError",
    "BenchRow",
    "TargetCheck",
    "BenchResult",
    "run_bench",
    "OPS_STEP_VARIANTS",
    "OPS_COMPILE_VARIANTS",
    "OpsBenchConfig",
    "OpsRow",
    "CompileRow",
    "OpsBenchResult",
    "run_ops_bench",
]

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
TARGETS = ("workload", "block")
# Same AdamW for every variant; the value only has to keep all of them finite over a few dozen
# steps (the benchmark compares cost, not convergence).
_LR = 1e-3
# The block's attention heads; LMConfig's default.
_BLOCK_HEADS = LMConfig().n_heads
# Other processes' average CPU use (cores) from which the table warns that timings are contended.
_CONTENDED_CORES = 0.25
# Formats plain autocast can run (torch.autocast takes a half dtype only).
_AUTOCAST_FORMATS = (Format.BF16, Format.FP16)


class BenchConfigError(AutoprecError, ValueError):
    """A `BenchConfig` field (or the device it names) cannot be benchmarked; the message says why."""


@dataclasses.dataclass(frozen=True)
class _Variant:
    name: str
    kind: str  # "plain" | "plan" | "autocast"
    format: Format
    compiled: bool = False  # the model under torch.compile (default inductor backend)


def _parse_variant(name: str) -> _Variant:
    """``"fp32"``, ``"plan:<format>"`` or ``"autocast:<bf16|fp16>"``, each optionally prefixed
    ``"compiled:"``."""
    if name.startswith(_COMPILED):
        inner = _parse_variant(name[len(_COMPILED):])
        if inner.compiled:
            raise BenchConfigError(f"unknown variant {name!r}: 'compiled:' is given once")
        return dataclasses.replace(inner, name=_COMPILED + inner.name, compiled=True)
    if name == REFERENCE:
        return _Variant(name, "plain", Format.FP32)
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
    return _Variant(f"{kind}:{fmt.value}", kind, fmt)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_device_and_seed(device: str, seed: Any) -> None:
    """Raises `BenchConfigError` for a device name torch does not parse or a non-integer seed
    (whether the device exists is checked when the run starts)."""
    if device != "auto":
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise BenchConfigError(f"device {device!r} is not a torch device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BenchConfigError(f"seed must be an integer, got {seed!r}")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run_bench` measures. Immutable; derive variants with ``dataclasses.replace``.

    ``steps`` timed rounds follow ``warmup`` untimed ones (saved bytes are measured in the last
    warmup step, so ``warmup >= 1``). ``block_shape`` is the block's input ``(batch, seq, d_model)``;
    the block is ``LMConfig(context=seq, d_model=d_model, d_ff=4 * d_model)`` with 4 heads.
    ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    """

    workload: str = "small"
    batch_size: int = 16
    steps: int = 20
    warmup: int = 3
    device: str = "auto"
    block_shape: tuple[int, int, int] = (16, 64, 128)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in LMConfig.preset_names():
            raise BenchConfigError(f"unknown workload {self.workload!r}; choose one of {', '.join(LMConfig.preset_names())}")
        for name in ("batch_size", "steps", "warmup"):
            value = getattr(self, name)
            if not _positive_int(value):
                hint = " (saved bytes are measured in the last warmup step)" if name == "warmup" else ""
                raise BenchConfigError(f"{name} must be a positive integer, got {value!r}{hint}")
        shape = tuple(self.block_shape)
        if len(shape) != 3 or not all(_positive_int(v) for v in shape):
            raise BenchConfigError(f"block_shape must be three positive integers (batch, seq, d_model), got {self.block_shape!r}")
        if shape[2] % _BLOCK_HEADS:
            raise BenchConfigError(f"block_shape d_model {shape[2]} must be divisible by the block's {_BLOCK_HEADS} attention heads")
        object.__setattr__(self, "block_shape", shape)
        if isinstance(self.variants, str):
            raise BenchConfigError(f"variants must be a sequence of names, got the string {self.variants!r}")
        names = tuple(_parse_variant(v).name for v in self.variants)
        if REFERENCE not in names:
            raise BenchConfigError(f"variants must include {REFERENCE!r}: every ratio is taken against it")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise BenchConfigError(f"variants repeat {', '.join(duplicates)}")
        object.__setattr__(self, "variants", names)
        _check_device_and_seed(self.device, self.seed)

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
        return _json_safe(data)

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


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# -- running ----------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    """Name, capability and software versions of ``device`` (no kernel runs; no sync)."""
    info = {"type": device.type, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info.update(name=torch.cuda.get_device_name(index), capability=f"{major}.{minor}", cuda=torch.version.cuda)
    else:
        info.update(
            name=platform.processor() or platform.machine() or "unknown CPU",
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            threads=torch.get_num_threads(),
        )
    return info


class _Runner:
    """One (target, variant): its model, optimizer, precision context and measurements."""

    def __init__(self, target: str, variant: _Variant, model: nn.Module, loss_fn: Callable, example: Any, device: torch.device):
        self.target = target
        self.variant = variant
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=_LR)
        self.runtime: Optional[PlanRuntime] = None
        if variant.kind == "plan":
            plan = Plan.uniform(model, variant.format, example)
            self.runtime = apply_plan(model, plan)
            self.context = lambda: self.runtime
        elif variant.kind == "autocast":
            self.context = lambda: torch.autocast(device.type, dtype=variant.format.dtype)
        else:
            self.context = contextlib.nullcontext
        # The precision context is entered around the compiled call, as around autocast.
        self.forward_model = torch.compile(model) if variant.compiled else model
        self.times: list[float] = []
        self.losses: list[float] = []
        self.saved_bytes = 0
        self.saved_by_dtype: dict = {}

    def step(self, batch: Any, meter: Optional[SavedTensorMeter] = None) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # The metered (untimed) step runs eagerly: saved-tensor hooks see eager autograd's
        # tensors, so a compiled variant reports its plan's eager bytes.
        model = self.model if meter is not None else self.forward_model
        with meter if meter is not None else contextlib.nullcontext():
            with self.context():
                loss = self.loss_fn(model, batch)
        loss.backward()
        self.optimizer.step()
        return loss


class _CpuContention:
    """CPU time other processes used during a run, in cores (Linux ``/proc/stat`` minus this
    process's own CPU time); None where ``/proc/stat`` is missing. Two reads of a small file."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> "tuple[float, float, float] | None":
        try:
            with open("/proc/stat", encoding="ascii") as handle:
                fields = [int(v) for v in handle.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def other_cores(self) -> "float | None":
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / (end[0] - self.start[0]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _block_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _median_iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q3 - q1


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else float("nan")


def run_bench(config: BenchConfig = BenchConfig(), progress: Optional[Callable[[int, int, str], None]] = None) -> BenchResult:
    """Run the benchmark described by ``config``; see the module docstring for the method.

    ``progress(round, total_rounds, phase)`` is called after every round (``phase`` is
    ``"warmup"`` or ``"timed"``). Costs ``warmup + steps`` rounds of one training step per
    (target, variant), plus one traced forward per plan variant to build its plan; on CUDA every
    step ends with a device sync so its time is the device's. Emulation warnings are not raised:
    emulated layers are reported in the result.
    """
    start = time.perf_counter()
    contention = _CpuContention()
    device = resolve_device(config.device, BenchConfigError, "the bench")
    variants = [_parse_variant(v) for v in config.variants]
    rounds = config.warmup + config.steps
    logger.info("bench on %s: %d variants x %d targets, %d warmup + %d timed rounds", device, len(variants), len(TARGETS), config.warmup, config.steps)

    workload = default_workload(config.workload, config.batch_size)
    sampler = workload.train_batches(config.seed)
    lm_batches = [tuple(t.to(device) for t in sampler.next()) for _ in range(rounds)]
    _, t, c = config.block_shape
    block_config = dataclasses.replace(LMConfig(), context=t, d_model=c, d_ff=4 * c, n_heads=_BLOCK_HEADS)
    generator = torch.Generator().manual_seed(config.seed)
    block_inputs = [torch.randn(config.block_shape, generator=generator).to(device) for _ in range(rounds)]
    inputs = {"workload": lm_batches, "block": block_inputs}
    targets_info = {
        "workload": f"ByteLM {config.workload!r} ({workload.config.n_layers} blocks, d_model {workload.config.d_model}), "
                    f"batch {config.batch_size}x{workload.config.context} bytes, cross-entropy",
        "block": f"TransformerBlock (d_model {c}, {_BLOCK_HEADS} heads, d_ff {4 * c}), input randn{config.block_shape}, loss mean(out^2)",
    }

    with warnings.catch_warnings():
        # Emulated layers are reported in the result (`emulated`); one warning per layer would only repeat it.
        warnings.simplefilter("ignore", EmulationWarning)
        runners = []
        for target in TARGETS:
            for variant in variants:
                if target == "workload":
                    model = workload.build_model(config.seed).to(device)
                    example, loss_fn = lm_batches[0][0], workload.loss
                else:
                    model = _seeded(config.seed, lambda: TransformerBlock(block_config)).to(device)
                    example, loss_fn = block_inputs[0], _block_loss
                model.train()
                runners.append(_Runner(target, variant, model, loss_fn, example, device))

        gc.collect()
        for r in range(rounds):
            timed = r >= config.warmup
            shift = r % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                batch = inputs[runner.target][r]
                meter = None
                if r == config.warmup - 1:  # the last warmup step: calibration and histories are warm
                    meter = SavedTensorMeter(runner.model.parameters())
                _sync(device)
                t0 = time.perf_counter()
                loss = runner.step(batch, meter)
                _sync(device)
                elapsed = time.perf_counter() - t0
                if meter is not None:
                    runner.saved_bytes = meter.total_bytes
                    runner.saved_by_dtype = meter.bytes_by_dtype()
                if timed:
                    runner.times.append(elapsed)
                    runner.losses.append(float(loss.detach()))
            if progress is not None:
                progress(r + 1, rounds, "timed" if timed else "warmup")

    rows = []
    reference = {run.target: run for run in runners if run.variant.name == REFERENCE}
    ref_ms = {target: _median_iqr(run.times)[0] * 1e3 for target, run in reference.items()}
    for run in runners:
        median, iqr = _median_iqr(run.times)
        non_finite = sum(not math.isfinite(v) for v in run.losses)
        rows.append(BenchRow(
            target=run.target,
            variant=run.variant.name,
            step_ms=median * 1e3,
            step_ratio=_ratio(median * 1e3, ref_ms[run.target]),
            saved_bytes=run.saved_bytes,
            saved_ratio=_ratio(run.saved_bytes, reference[run.target].saved_bytes),
            final_loss=run.losses[-1],
            step_ms_iqr=iqr * 1e3,
            non_finite_steps=non_finite,
            saved_by_dtype=run.saved_by_dtype,
        ))
        if non_finite:
            logger.warning("%s %s: %d of %d timed steps had a non-finite loss", run.target, run.variant.name, non_finite, len(run.losses))

    plan_runs = [run for run in runners if run.runtime is not None]
    emulated = {target: {run.variant.name: run.runtime.emulated_layers() for run in plan_runs if run.target == target} for target in TARGETS}
    emulated = {target: per for target, per in emulated.items() if per}
    reports = {target: {run.variant.name: run.runtime.report() for run in plan_runs if run.target == target} for target in TARGETS}
    reports = {target: per for target, per in reports.items() if per}
    int8 = next((run for run in plan_runs if run.target == "workload" and run.variant.format is Format.INT8), None)
    calibration = _calibration_summary(int8) if int8 is not None else None

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


def _calibration_summary(run: _Runner) -> dict:
    """Mean over layers (each layer: mean over its GEMMs) of the INT8 relative quantization error
    ‖x − q(x)‖/‖x‖ on the activations seen during calibration: naive max scaling vs calibrated."""
    per_layer = {}
    for fqn, entry in run.runtime.report().items():
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
        value = _ratio(getattr(a, field), getattr(b, field))
        checks.append(TargetCheck(name, value, limit, bool(value <= limit)))
    return checks


# -- the ops suite ----------------------------------------------------------------------------
#
# What one training step costs the host, counted instead of timed: aten ops and host syncs of one
# layer's step under every precision variant, then the graph breaks of a small MLP under each
# plan and whether torch.compile's forward + backward matches eager. Counts do not depend on how
# busy the machine is, so they hold the line on a shared CPU.

OPS_LAYER = (256, 512)  # nn.Linear(in, out) whose training step is counted
OPS_INPUT = (64, 256)  # its input (and the MLP's)
OPS_MLP_HIDDEN = 512  # the MLP is Linear(256, 512) - GELU - Linear(512, 256)
# Variant -> (format, scaling) of the uniform plans; "plain" and "autocast:bf16" use no plan.
OPS_PLANS = {
    "plan:fp32": (Format.FP32, Scaling()),
    "plan:bf16": (Format.BF16, Scaling()),
    "plan:fp8_e4m3": (Format.FP8_E4M3, Scaling()),  # current per-tensor scaling, the default
    "plan:fp8_e4m3/delayed": (Format.FP8_E4M3, Scaling(mode=ScalingMode.DELAYED)),
    "plan:fp8_e4m3/row-current": (Format.FP8_E4M3, Scaling(granularity=Granularity.ROW, mode=ScalingMode.CURRENT)),
    "plan:fp8_e5m2": (Format.FP8_E5M2, Scaling()),
    "plan:int8": (Format.INT8, Scaling()),
}
OPS_STEP_VARIANTS = ("plain", "autocast:bf16", *OPS_PLANS)
# The MLP's mixed plan: its first layer in FP8 E4M3, its second in BF16.
OPS_MIXED = "plan:mixed(0=fp8_e4m3,2=bf16)"
OPS_COMPILE_VARIANTS = (*OPS_STEP_VARIANTS, OPS_MIXED)


@dataclasses.dataclass(frozen=True)
class OpsBenchConfig:
    """What `run_ops_bench` counts. ``warmup`` steps run before every counted steady-state step;
    INT8 calibrates on ``calibration_batches`` forwards (``>= 2``, so that the calibrating step
    and the freeze step are different steps). ``compile_backend`` is the ``torch.compile``
    backend checked against eager (``"inductor"``, what ``torch.compile`` uses by default;
    ``"aot_eager"`` traces forward and backward the same way without generating code)."""

    warmup: int = 3
    calibration_batches: int = 4
    compile_backend: str = "inductor"
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not _positive_int(self.warmup):
            raise BenchConfigError(f"warmup must be a positive integer, got {self.warmup!r}")
        if not _positive_int(self.calibration_batches) or self.calibration_batches < 2:
            raise BenchConfigError(f"calibration_batches must be an integer >= 2 (the freeze step is forward N), got {self.calibration_batches!r}")
        if self.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise BenchConfigError(f"compile_backend {self.compile_backend!r} is not a torch.compile backend; use 'inductor' or 'aot_eager'")
        _check_device_and_seed(self.device, self.seed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class OpsRow:
    """One counted training step: ``step`` is ``"steady"``, or for INT8 ``"calibrating"`` (the
    first step) and ``"freeze"`` (the step whose forward freezes the calibrated scale)."""

    variant: str
    step: str
    ops: int
    syncs: int
    op_counts: dict
    sync_ops: dict


@dataclasses.dataclass(frozen=True)
class CompileRow:
    """The MLP under one variant: `graph_breaks` of forward + loss, and the largest absolute
    difference between ``torch.compile``d and eager forward + backward (loss, parameter grads)."""

    variant: str
    graphs: int
    breaks: int
    reasons: list
    loss_max_abs_diff: float
    grad_max_abs_diff: float


@dataclasses.dataclass(frozen=True)
class OpsBenchResult:
    """Everything `run_ops_bench` counted."""

    config: OpsBenchConfig
    device: dict
    rows: list[OpsRow]
    compile_rows: list[CompileRow]
    wall_s: float

    def row(self, variant: str, step: str = "steady") -> OpsRow:
        for r in self.rows:
            if r.variant == variant and r.step == step:
                return r
        raise KeyError(f"no ops row for variant {variant!r}, step {step!r}")

    def to_dict(self) -> dict:
        """A JSON-ready dict (non-finite floats become null)."""
        return _json_safe({
            "schema": "autoprec.bench.ops/1",
            "autoprec_version": __version__,
            "config": self.config.to_dict(),
            "device": dict(self.device),
            "step": _OPS_STEP_INFO,
            "mlp": _OPS_MLP_INFO,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "compile": [dataclasses.asdict(r) for r in self.compile_rows],
            "wall_s": self.wall_s,
        })

    def save(self, path: "str | os.PathLike") -> Path:
        """Write `to_dict` as JSON atomically (a temporary file renamed over ``path``)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    def format_table(self) -> str:
        """Two aligned tables: ops and syncs per step, then graph breaks and compile differences."""
        d = self.device
        lines = [f"autoprec bench --suite ops: {d['type']} ({d['name']}), torch {d['torch']}; {self.wall_s:.0f} s", f"  {_OPS_STEP_INFO}"]
        body = [(r.variant, r.step, str(r.ops), str(r.syncs), ", ".join(f"{k} x{v}" for k, v in sorted(r.sync_ops.items()))) for r in self.rows]
        lines += _aligned(("variant", "step", "aten ops", "host syncs", "sync ops"), body, left={0, 1, 4})
        lines += ["", f"  {_OPS_MLP_INFO}; torch.compile backend {self.config.compile_backend!r}"]
        body = []
        for r in self.compile_rows:
            body.append((r.variant, str(r.graphs), str(r.breaks), f"{r.loss_max_abs_diff:.3g}", f"{r.grad_max_abs_diff:.3g}", (r.reasons[0][:100] if r.reasons else "")))
        lines += _aligned(("variant", "graphs", "breaks", "loss |diff|", "grad |diff|", "first break reason"), body, left={0, 5})
        return "\n".join(lines)


_OPS_STEP_INFO = (
    f"one training step of nn.Linear{OPS_LAYER} on randn{OPS_INPUT}: forward, .sum() loss, backward "
    "(grads set to None before it; optimizer step excluded); steady state after the warmup steps"
)
_OPS_MLP_INFO = (
    f"MLP Linear({OPS_INPUT[1]}, {OPS_MLP_HIDDEN}) - GELU - Linear({OPS_MLP_HIDDEN}, {OPS_INPUT[1]}), forward + .sum() loss "
    "traced with the precision context entered around the traced call (as around a compiled model)"
)


def _aligned(header: tuple, body: list, left: set) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in (header, *body)]


def _ops_context(variant: str, model: nn.Module, device: torch.device, config: OpsBenchConfig) -> Callable[[], Any]:
    """A factory of the variant's precision context for ``model``; a plan variant's runtime is
    made once here (one ``apply_plan``) and re-entered every step, as in training."""
    if variant == "plain":
        return contextlib.nullcontext
    if variant == "autocast:bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    calibration = Calibration(batches=config.calibration_batches)
    if variant == OPS_MIXED:
        plan = Plan.uniform(model, Format.FP8_E4M3, calibration=calibration).with_layers({"2": Format.BF16})
    else:
        fmt, scaling = OPS_PLANS[variant]
        plan = Plan.uniform(model, fmt, scaling=scaling, calibration=calibration)
    runtime = apply_plan(model, plan)
    return lambda: runtime


def _sum_loss(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward + ``.sum()`` loss (the loss every variant shares)."""
    def loss(inp: torch.Tensor) -> torch.Tensor:
        return model(inp).sum()

    return loss


def _ops_rows(variant: str, step: Callable[[], Any], config: OpsBenchConfig) -> list[OpsRow]:
    def row(name: str, counts: OpCounts) -> OpsRow:
        return OpsRow(variant, name, counts.total, counts.sync_total, dict(counts.ops), dict(counts.syncs))

    if variant != "plan:int8":
        return [row("steady", count_training_step(step, warmup=config.warmup))]
    # INT8 calibrates on forwards 1..N and freezes on forward N: count step 1, step N, then a later one.
    first = row("calibrating", count_training_step(step, warmup=0))
    freeze = row("freeze", count_training_step(step, warmup=config.calibration_batches - 2))
    return [first, freeze, row("steady", count_training_step(step, warmup=config.warmup))]


def _compile_row(variant: str, device: torch.device, x: torch.Tensor, config: OpsBenchConfig) -> CompileRow:
    """Graph breaks of the MLP's forward + loss, and compiled vs eager after ``warmup + 1`` steps
    on two identically seeded copies (each with its own runtime, so their states match)."""
    def build() -> tuple[nn.Module, Callable[[], Any]]:
        mlp = _seeded(config.seed, lambda: nn.Sequential(nn.Linear(OPS_INPUT[1], OPS_MLP_HIDDEN), nn.GELU(), nn.Linear(OPS_MLP_HIDDEN, OPS_INPUT[1]))).to(device)
        return mlp, _ops_context(variant, mlp, device, config)

    mlp, context = build()
    with context():
        breaks = graph_breaks(_sum_loss(mlp), x)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()  # `_sum_loss`'s code is shared by all variants: no stale cache
        model, ctx = build()
        forward = _sum_loss(model)
        if compiled:
            forward = torch.compile(forward, backend=config.compile_backend)
        step = training_step(model, functools.partial(forward, x), ctx)
        for _ in range(config.warmup + 1):
            loss = step()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    return CompileRow(
        variant, breaks.graphs, breaks.breaks, list(breaks.reasons),
        max_abs_diff(eager_loss, compiled_loss), max_abs_diff(eager_grads, compiled_grads),
    )


def run_ops_bench(config: OpsBenchConfig = OpsBenchConfig(), progress: Optional[Callable[[int, int, str], None]] = None) -> OpsBenchResult:
    """Count ops and host syncs of every variant's training step, then graph breaks and compiled
    vs eager differences of the MLP (see the section comment above).

    Costs per step variant ``warmup + 1`` steps (INT8: ``calibration_batches + warmup + 1``), the
    counted ones slowed by a Python call per op; per compile variant one Dynamo trace and
    ``2 * (warmup + 1)`` MLP steps, half of them compiled (backend compilation of the forward and
    backward graphs dominates the run). ``progress(done, total, variant)`` follows each variant.
    Emulation warnings are not raised: the counts are the point here.
    """
    start = time.perf_counter()
    device = resolve_device(config.device, BenchConfigError, "the ops bench")
    generator = torch.Generator().manual_seed(config.seed)
    x = torch.randn(OPS_INPUT, generator=generator).to(device)
    total = len(OPS_STEP_VARIANTS) + len(OPS_COMPILE_VARIANTS)
    rows, compile_rows = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        for variant in OPS_STEP_VARIANTS:
            layer = _seeded(config.seed, lambda: nn.Linear(*OPS_LAYER)).to(device)
            step = training_step(layer, functools.partial(_sum_loss(layer), x), _ops_context(variant, layer, device, config))
            rows += _ops_rows(variant, step, config)
            if progress is not None:
                progress(len({r.variant for r in rows}), total, variant)
        for variant in OPS_COMPILE_VARIANTS:
            compile_rows.append(_compile_row(variant, device, x, config))
            if progress is not None:
                progress(len(OPS_STEP_VARIANTS) + len(compile_rows), total, variant)
    result = OpsBenchResult(config, device_info(device), rows, compile_rows, time.perf_counter() - start)
    logger.info("ops bench done in %.1f s", result.wall_s)
    return result


# -- profiler overhead ---------------------------------------------------------------------------


def measure_overhead(
    workload_name: str = "small",
    steps: int = 30,
    *,
    warmup: int = 3,
    batch_size: int = 16,
    sample: int = 8192,
    every: int = 8,
    device: "str | torch.device" = "auto",
    seed: int = 0,
) -> dict:
    """Median training-step time with and without the profiler, interleaved in one process.

    Three identical models train side by side, one step of each per round (the order rotated
    every round): ``plain`` (no profiler), ``window`` (profiler attached, inside its window for
    every timed step) and ``after`` (profiler attached whose 1-step window ended in warmup: hooks
    gone, `step` still called). A step is zero_grad, forward + loss, backward, profiler step,
    clipping and AdamW; timings end with a device sync. Returns medians (ms) and the overheads
    ``window / plain - 1`` and ``after / plain - 1``.
    """
    wl = builtin_workload(workload_name, batch_size)
    dev = resolve_device(device, ProfileError, "profiling")
    example = wl.val_batches(1)[0][0].to(dev)
    trainers = {name: workload_trainer(wl, seed, 3e-3, dev) for name in ("plain", "window", "after")}
    profilers = {
        "plain": None,
        "window": LayerProfiler(trainers["window"].model, example, window=warmup + steps + 1, sample=sample, every=every).attach(),
        "after": LayerProfiler(trainers["after"].model, example, window=1, sample=sample, every=every).attach(),
    }
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + steps):
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name in order:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            profiler = profilers[name]
            trainers[name].step(profiler.step if profiler is not None else None)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    for profiler in profilers.values():
        if profiler is not None:
            profiler.detach()
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    mean = {name: statistics.fmean(ts) * 1e3 for name, ts in times.items()}
    return {
        "workload": workload_name, "batch_size": batch_size, "steps": steps, "sample": sample, "every": every,
        "device": str(dev), "threads": torch.get_num_threads(),
        "median_ms": med,
        "mean_ms": mean,
        "overhead_window": med["window"] / med["plain"] - 1.0,
        "overhead_after": med["after"] / med["plain"] - 1.0,
        "overhead_window_mean": mean["window"] / mean["plain"] - 1.0,
        "after_hooks_removed": not profilers["after"].collecting,
    }
