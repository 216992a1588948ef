"""Per-layer forward + backward speed of one ``nn.Linear`` under each way of training it.

Variants (all start from FP32 master weights and take BF16 activations, as a layer inside a
mixed-precision network does):

- ``bf16_autocast``: ``torch.autocast(bf16)``, the baseline every ratio is taken against (compiled);
- ``autoprec_fp8_tensor`` / ``autoprec_fp8_row`` / ``autoprec_fp8_block`` / ``autoprec_int8``:
  ``autoprec.apply_plan`` with a uniform plan (FP8 E4M3 tensorwise delayed, rowwise current,
  DeepSeek-V3's 1x128 / 128x128 blocks with E4M3 gradients; INT8 calibrated); eager on CUDA they
  quantize with the fused Triton casts (`autoprec.runtime.casts`);
- ``autoprec_fp8_tensor_unfused`` (eager only): the tensorwise plan with the fused casts turned
  off (``PlanRuntime.use_fused_casts(False)``: PyTorch ops), what the fused kernels save;
- ``torchao_fp8_tensorwise`` / ``torchao_fp8_rowwise``: ``torchao.float8.convert_to_float8_training``
  with the recipe of that name, when ``import torchao`` works (compiled only: torchao's float8
  training is meant to run under ``torch.compile``).

Each variant runs eager and ``torch.compile``d. On a GPU with a datasheet entry
(`costs.targets.datasheet_target`), each eager autoprec row also carries the cost model's
roofline ratio to eager BF16 autocast there (``predicted_ratio_to_eager_baseline``), so a run
checks the prices a search for that GPU uses (`costs.targets`). A step is forward, then ``torch.autograd.grad``
of the output against the input and the parameters (so nothing accumulates between repeats): six
``M*K*N`` multiply-adds, counted as ``6*M*K*N`` FLOPs. After its timed calls, each variant's
``profile`` (`autoprec.bench.step_profile`, two steps): its kernels, launches and the costliest
kernels, so a ratio that misses its target says what it spends.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from ...costs import RooflineTimeModel, trace_model
from ...costs.targets import TargetDevice, datasheet_target
from ...formats import Format, Granularity
from ...plan import LayerPrecision, Plan, Scaling, ScalingMode
from ...runtime import apply_plan
from ...runtime.layers import kernel_reason
from ..step_profile import profile_steps
from .rows import Row, error_text, guarded
from .warm_timing import median_ms, rotation_count, tflops, warm_up

__all__ = ["BASELINE", "EAGER_BASELINE", "UNFUSED", "VARIANTS", "TORCHAO_RECIPES", "LayerVariant", "torchao_status", "measure_layers", "predicted_ratios"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerVariant:
    """How one layer trains: ``kind`` "autocast", "autoprec" (``format`` + ``scaling``) or
    "torchao" (``recipe``); ``compiled`` through ``torch.compile``."""

    name: str
    kind: str
    compiled: bool
    format: Format = Format.BF16
    scaling: Scaling = Scaling()
    recipe: str = ""
    fused_casts: bool = True  # autoprec: the fused Triton casts where the device has them

    @property
    def label(self) -> str:
        return self.name + ("+compile" if self.compiled else "")


TORCHAO_RECIPES = ("tensorwise", "rowwise")
_ROWWISE = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(Granularity.ROW, ScalingMode.CURRENT))
_AUTOPREC = (
    ("autoprec_fp8_tensor", Format.FP8_E4M3, Scaling(Granularity.TENSOR, ScalingMode.DELAYED)),
    ("autoprec_fp8_row", Format.FP8_E4M3, Scaling(Granularity.ROW, ScalingMode.CURRENT)),
    # DeepSeek-V3's fine-grained recipe: 1x128 / 128x128 tiles, E4M3 gradients (runtime.block_gemm).
    ("autoprec_fp8_block", Format.FP8_E4M3, Scaling(Granularity.BLOCK, ScalingMode.CURRENT)),
    ("autoprec_int8", Format.INT8, Scaling()),
)
BASELINE = LayerVariant("bf16_autocast", "autocast", compiled=True)
EAGER_BASELINE = LayerVariant("bf16_autocast", "autocast", compiled=False)
UNFUSED = LayerVariant("autoprec_fp8_tensor_unfused", "autoprec", False, *_AUTOPREC[0][1:], fused_casts=False)
VARIANTS: tuple[LayerVariant, ...] = (
    EAGER_BASELINE,
    BASELINE,
    *(LayerVariant(name, "autoprec", compiled, fmt, scaling) for name, fmt, scaling in _AUTOPREC for compiled in (False, True)),
    UNFUSED,
    *(LayerVariant(f"torchao_fp8_{recipe}", "torchao", True, recipe=recipe) for recipe in TORCHAO_RECIPES),
)


PROFILED_STEPS = 2  # per variant, after its timed calls (`autoprec.bench.step_profile`)


def torchao_status() -> tuple[bool, str]:
    """Whether torchao's float8 training imports here, with its version or the reason it does not."""
    try:
        torchao = importlib.import_module("torchao")
        importlib.import_module("torchao.float8")
    except Exception as exc:  # noqa: BLE001 -- any import failure means "no torchao rows"
        return False, f"torchao unavailable: {error_text(exc)}"
    return True, f"torchao {getattr(torchao, '__version__', 'unknown')}"


def _prepare(variant: LayerVariant, layer: nn.Module, example: torch.Tensor, device: torch.device):
    """(module to call, context factory entered around each forward, report callable) for ``variant``.

    The context is entered per step, as a training loop does: autocast's cache of casted weights
    then lives for one forward, and autoprec's runtime re-enters every step."""

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    if variant.kind == "autocast":
        return layer, autocast, dict
    if variant.kind == "autoprec":
        # The plan traces one plain forward to find the layer: FP32 in, as the weights are.
        runtime = apply_plan(layer, Plan.uniform(layer, variant.format, example.float(), scaling=variant.scaling))
        runtime.use_fused_casts(variant.fused_casts)

        def report() -> dict:
            entry = runtime.report().get("", {})
            return {**entry.get("ops", {}), **({"casts": entry["casts"]} if "casts" in entry else {})}

        return layer, lambda: runtime, report
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    wrapped = convert_to_float8_training(nn.Sequential(layer), config=Float8LinearConfig.from_recipe_name(variant.recipe))
    return wrapped, autocast, lambda: {"linear": type(wrapped[0]).__name__}


def predicted_ratios(shape: tuple[int, int, int], variants: Sequence[LayerVariant], target: TargetDevice) -> dict[str, float]:
    """Per eager autoprec variant's name, BF16 autocast's roofline seconds over its own for one
    ``Linear(K, N)`` step at ``shape`` (M, K, N) on ``target`` (`RooflineTimeModel`: its rates,
    its kernel paths). Traced on the meta device: arithmetic on shapes, nothing runs."""
    m, k, n = shape
    trace = trace_model(nn.Linear(k, n, device="meta"), torch.empty(m, k, device="meta", requires_grad=True))
    (call,) = next(iter(trace.layers.values())).calls

    def seconds(precision: LayerPrecision) -> float:
        return RooflineTimeModel(target=target, precisions={precision.format: precision}).seconds(call, precision.format, torch.device("cpu"))

    bf16 = seconds(LayerPrecision(Format.BF16))
    return {v.name: bf16 / seconds(LayerPrecision(v.format, scaling=v.scaling)) for v in variants if v.kind == "autoprec" and not v.compiled}


def _dynamo_counts() -> dict[str, int]:
    """Dynamo's running totals of graph breaks and compiled graphs (private counters; empty when
    they move)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs_compiled": counters["stats"]["unique_graphs"]}


def _measure(
    variant: LayerVariant, shape: tuple[int, int, int], device: torch.device,
    warmup: int, repeats: int, backend: str, recompile_limit: int, seed: int,
) -> tuple[bool, dict]:
    m, k, n = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        layer = nn.Linear(k, n).to(device)
    bytes_per_input = (m * k + m * n) * torch.bfloat16.itemsize
    inputs = [
        (torch.randn(m, k, device=device, generator=generator, dtype=torch.bfloat16).requires_grad_(True),
         torch.randn(m, n, device=device, generator=generator, dtype=torch.bfloat16))
        for _ in range(rotation_count(bytes_per_input, device))
    ]
    module, context, report = _prepare(variant, layer, inputs[0][0], device)
    params = tuple(module.parameters())  # torchao swaps the module; its parameters are the ones trained
    before = _dynamo_counts()
    with torch._dynamo.config.patch(recompile_limit=recompile_limit):
        if variant.compiled:
            torch._dynamo.reset()  # a fresh cache: no recompile limit or dynamic shapes from earlier layers
            module = torch.compile(module, backend=backend, dynamic=False)

        def step(x: torch.Tensor, grad: torch.Tensor) -> None:
            with context():
                out = module(x)
            torch.autograd.grad(out, (x, *params), grad.to(out.dtype))

        warmup_s = warm_up(step, inputs, warmup, device)
        ms = median_ms(step, inputs[warmup % len(inputs):] + inputs[:warmup % len(inputs)], repeats, device)
        # Where the time goes (kernels, launches, the costliest kernels): what a missed ratio needs.
        profile = profile_steps(lambda: step(*inputs[0]), PROFILED_STEPS, device, top=6)
    detail = {"ms": ms, "tflops": tflops(6 * m * k * n, ms), "warmup_s": warmup_s, "inputs_rotated": len(inputs), "ops": report(),
              "profile": profile}
    if variant.compiled:
        after = _dynamo_counts()
        detail.update({key: after[key] - before[key] for key in after})
    return True, detail


def measure_layers(
    shapes: Sequence[tuple[int, int, int]],
    variants: Sequence[LayerVariant],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    backend: str,
    recompile_limit: int,
    seed: int = 0,
    deadline: Optional[float] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> list[Row]:
    """One row per (shape, variant) with ms, TFLOP/s and, per shape, ``ratio_to_baseline``:
    compiled BF16 autocast's time over this variant's (above 1 is faster than the baseline), and
    for eager rows ``ratio_to_eager_baseline``, eager BF16 autocast's over this one's.

    ``shapes`` are ``(M, K, N)``: M tokens through ``Linear(K, N)``. torchao variants become rows
    that did not run (``ok`` None) with the reason when torchao does not import. Each compiled
    variant resets Dynamo and compiles afresh during ``warmup`` (reported as ``warmup_s``, with the
    graphs compiled and graph breaks); ``recompile_limit`` caps Dynamo's recompiles of one frame, so
    a variant whose Python state changes every step (delayed scaling, INT8 calibration) settles
    within the warm-up instead of recompiling in the timed calls. Compiled variants that would start
    after ``deadline`` (``time.monotonic()`` seconds) do not run (``ok`` None), so compilation cannot
    push the run past its time; eager ones always run. Never raises for a failing variant.
    """
    have_torchao, torchao_reason = torchao_status()
    target = datasheet_target(device)
    rows: list[Row] = []
    for shape in shapes:
        shape_rows = []
        for variant in variants:
            name = f"layer/{'x'.join(map(str, shape))}/{variant.label}"
            if progress is not None:
                progress(name)
            if variant.kind == "torchao" and not have_torchao:
                row = Row(name, None, {"skipped": torchao_reason})
            elif variant.kind == "torchao" and variant.recipe == "rowwise" and (no_rowwise := kernel_reason(_ROWWISE, device)):
                # torchao calls _scaled_mm with row-wise scales and no fallback (torch 2.11's CPU kernel refuses them).
                row = Row(name, None, {"skipped": f"torchao rowwise needs _scaled_mm with row-wise scales: {no_rowwise}"})
            elif variant.compiled and deadline is not None and time.monotonic() > deadline:
                row = Row(name, None, {"skipped": "the per-layer time budget was spent (compilation); raise GpuBenchConfig.layers_budget_s"})
            else:
                row = guarded(name, device, functools.partial(_measure, variant, shape, device, warmup, repeats, backend, recompile_limit, seed))
            row.detail.update(shape=list(shape), variant=variant.name, compiled=variant.compiled)
            shape_rows.append(row)
        baseline = next((r for r in shape_rows if r.ok and r.detail["variant"] == BASELINE.name and r.detail["compiled"]), None)
        eager = next((r for r in shape_rows if r.ok and r.detail["variant"] == EAGER_BASELINE.name and not r.detail["compiled"]), None)
        for row in shape_rows:
            if row.ok and baseline is not None:
                row.detail["ratio_to_baseline"] = baseline.detail["ms"] / row.detail["ms"]
            if row.ok and eager is not None and not row.detail["compiled"]:
                row.detail["ratio_to_eager_baseline"] = eager.detail["ms"] / row.detail["ms"]
        if target is not None:
            predicted = predicted_ratios(shape, variants, target)
            for row in shape_rows:
                if row.detail["variant"] in predicted and not row.detail["compiled"]:
                    row.detail.update(predicted_ratio_to_eager_baseline=predicted[row.detail["variant"]], predicted_on=target.name)
        rows.extend(shape_rows)
    return rows
