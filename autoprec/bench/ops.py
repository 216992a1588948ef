"""The ops suite of `autoprec bench` (``--suite ops``): what one training step costs the host,
counted instead of timed: aten ops and host syncs of one layer's step under every precision
variant, then the graph breaks of a small MLP under each plan and whether torch.compile's forward
+ backward matches eager. Counts do not depend on how busy the machine is, so they hold the line
on a shared CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .._version import __version__
from .._io import atomic_write_text
from ..device import resolve_device
from ..formats import Format, Granularity
from ..opcount import OpCounts, count_training_step, graph_breaks, max_abs_diff, training_step
from ..plan import Calibration, Plan, Scaling, ScalingMode
from ..runtime import EmulationWarning, apply_plan
from ._common import BenchConfigError, build_seeded, check_device_and_seed, device_info, is_positive_int, json_safe

logger = logging.getLogger(__name__)

__all__ = ["OPS_STEP_VARIANTS", "OPS_COMPILE_VARIANTS", "OpsBenchConfig", "OpsRow", "CompileRow", "OpsBenchResult", "run_ops_bench"]

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
        if not is_positive_int(self.warmup):
            raise BenchConfigError(f"warmup must be a positive integer, got {self.warmup!r}")
        if not is_positive_int(self.calibration_batches) or self.calibration_batches < 2:
            raise BenchConfigError(f"calibration_batches must be an integer >= 2 (the freeze step is forward N), got {self.calibration_batches!r}")
        if self.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise BenchConfigError(f"compile_backend {self.compile_backend!r} is not a torch.compile backend; use 'inductor' or 'aot_eager'")
        check_device_and_seed(self.device, self.seed)

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
        return json_safe({
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
        compiled = []
        for r in self.compile_rows:
            compiled.append((r.variant, str(r.graphs), str(r.breaks), f"{r.loss_max_abs_diff:.3g}", f"{r.grad_max_abs_diff:.3g}", (r.reasons[0][:100] if r.reasons else "")))
        lines += _aligned(("variant", "graphs", "breaks", "loss |diff|", "grad |diff|", "first break reason"), compiled, left={0, 5})
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
        mlp = build_seeded(config.seed, lambda: nn.Sequential(nn.Linear(OPS_INPUT[1], OPS_MLP_HIDDEN), nn.GELU(), nn.Linear(OPS_MLP_HIDDEN, OPS_INPUT[1]))).to(device)
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
            layer = build_seeded(config.seed, lambda: nn.Linear(*OPS_LAYER)).to(device)
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

