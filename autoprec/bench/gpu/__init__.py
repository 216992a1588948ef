"""The GPU benchmark suite (`autoprec bench --suite gpu`): correctness, per-layer speed, end to end.

One run, sized for one H100 in under 8 minutes, that needs only torch and this repository (no
Optuna, scipy or TensorBoard; torchao is used when it imports):

1. `probe`: FP8 / INT8 linears through the public API on kernel-hostile shapes, against FP32;
2. `layers`: forward + backward of one linear per shape and variant, eager and compiled, as a
   ratio to compiled BF16 autocast, plus the end-to-end model's own linear shapes (eager BF16 and
   FP8, the times the searched plan is chosen from);
3. `e2e`: a 12-layer GPT-style decoder trained 50 steps under BF16 autocast, the all-FP8 plan and
   the searched plan.

Every check is a `Row`; a failing one never stops the run. ``smoke`` shrinks every size so the
whole suite runs on a CPU in seconds (timings then mean nothing and targets are not judged).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..._version import __version__
from ..._io import atomic_write_text
from .._common import device_info, json_safe
from ...device import resolve_device
from ...errors import GpuBenchError
from ...formats import Format
from ...plan import Plan
from .e2e import E2EConfig, fp8_plan, linear_shapes, searched_plan, train_plan
from .layers import VARIANTS, measure_layers, torchao_status
from .probe import PROBE_CONFIGS, run_probe
from .rows import Row

__all__ = ["GpuBenchError", "GpuBenchConfig", "GpuBenchResult", "Target", "run_gpu_bench"]

logger = logging.getLogger(__name__)

# Targets (issue 10): FP8 per layer at least 1.3x compiled BF16 autocast on the large GEMM (Hopper
# doubles FP8 matmul throughput over BF16; the quantize passes must not eat more than that), within
# 10% of torchao's float8 training, and the searched plan never slower end to end than BF16.
FP8_SPEEDUP_TARGET = 1.3
TORCHAO_SLACK = 1.1
# Issue 36: eager, where the scheduler trains, FP8 per layer at least 1.2x eager BF16 autocast
# (the fused Triton casts; the unfused variant beside it shows what they save).
FP8_EAGER_SPEEDUP_TARGET = 1.2
# The variants the searched plan chooses between, at the end-to-end model's shapes (eager, as the
# end-to-end runs are): variant name -> the format it stands for.
_CHOICE_VARIANTS = {"bf16_autocast": Format.BF16, "autoprec_fp8_tensor": Format.FP8_E4M3}
Shape = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class GpuBenchConfig:
    """Sizes of one run; use `from_preset` ("full" for an H100, "smoke" for a CPU dry run).

    ``probe_features``: the probed linear's (in, out); ``probe_tokens``: its 2-D token counts;
    ``layer_shapes``: per-layer (M, K, N); ``warmup`` / ``repeats``: per-layer timing;
    ``compile_backend``: ``torch.compile``'s backend; ``recompile_limit``: Dynamo's recompiles per
    frame while a compiled variant is measured (below ``warmup``, so recompiles end in the warm-up);
    ``layers_budget_s``: seconds after which compiled per-layer variants are no longer started
    (sized so the full run ends within 8 minutes on one H100: probe and end to end take the rest).
    """

    probe_features: tuple[int, int] = (768, 768)
    probe_tokens: tuple[int, ...] = (1000, 24, 4104)
    layer_shapes: tuple[Shape, ...] = ((8192, 4096, 4096), (8192, 768, 3072), (4104, 768, 768))
    warmup: int = 5
    repeats: int = 20
    compile_backend: str = "inductor"
    recompile_limit: int = 3
    layers_budget_s: float = 300.0
    e2e: E2EConfig = E2EConfig()
    seed: int = 0
    smoke: bool = False

    @classmethod
    def from_preset(cls, name: str) -> "GpuBenchConfig":
        try:
            return _PRESETS[name]
        except KeyError:
            raise GpuBenchError(f"unknown GPU suite preset {name!r}; choose one of {', '.join(sorted(_PRESETS))}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_PRESETS = {
    "full": GpuBenchConfig(),
    # Every code path at sizes a CPU runs in seconds. aot_eager exercises Dynamo and AOTAutograd
    # without Inductor's C++ code generation, which alone would take minutes on a small CPU.
    "smoke": GpuBenchConfig(
        probe_features=(32, 16),
        probe_tokens=(40, 24, 72),
        layer_shapes=((32, 32, 32), (24, 16, 16)),
        warmup=1,
        repeats=2,
        compile_backend="aot_eager",
        recompile_limit=1,
        layers_budget_s=3600.0,  # a slow shared CPU must not skip the compiled paths the smoke run exists for
        e2e=E2EConfig(n_layers=2, d_model=32, n_heads=2, seq=16, batch=2, steps=3, warmup=1, pool=2),
        smoke=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal of the suite: ``value`` against ``threshold``; ``passed`` None when not judged."""

    name: str
    value: "float | None"
    threshold: float
    passed: "bool | None"
    detail: str


@dataclasses.dataclass
class GpuBenchResult:
    config: GpuBenchConfig
    environment: dict
    probe: list[Row]
    layers: list[Row]
    e2e: list[Row]
    searched_plan: dict
    targets: list[Target]
    elapsed_s: dict

    @property
    def rows(self) -> list[Row]:
        return [*self.probe, *self.layers, *self.e2e]

    @property
    def passed(self) -> bool:
        """No row failed and no judged target failed (rows and targets not run do not count)."""
        return all(r.ok is not False for r in self.rows) and all(t.passed is not False for t in self.targets)

    def to_dict(self) -> dict:
        """JSON-ready (non-finite floats become null)."""
        return json_safe({
            "schema": "autoprec.gpu_bench/1",
            "autoprec_version": __version__,
            "config": self.config.to_dict(),
            "environment": self.environment,
            "correctness": [r.to_dict() for r in self.probe],
            "layers": [r.to_dict() for r in self.layers],
            "e2e": [r.to_dict() for r in self.e2e],
            "searched_plan": self.searched_plan,
            "targets": [dataclasses.asdict(t) for t in self.targets],
            "passed": self.passed,
            "elapsed_s": self.elapsed_s,
        })

    def save(self, path: "str | os.PathLike") -> Path:
        """Write `to_dict` as JSON atomically."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    def format_table(self) -> str:
        from .report import format_table

        return format_table(self)


def _git() -> dict:
    """The commit this code is at and whether tracked files differ from it (None without git)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> "str | None":
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _environment(device: torch.device) -> dict:
    info = device_info(device)
    info["cuda"] = torch.version.cuda
    info["torchao"] = torchao_status()[1]
    info["git"] = _git()
    return info


def _choice_timings(rows: Sequence[Row]) -> dict[tuple[Shape, Format], float]:
    """``(shape, format) -> ms`` from the eager rows of the variants the searched plan chooses between."""
    return {
        (tuple(r.detail["shape"]), _CHOICE_VARIANTS[r.detail["variant"]]): r.detail["ms"]
        for r in rows
        if r.ok and not r.detail["compiled"] and r.detail["variant"] in _CHOICE_VARIANTS
    }


def _targets(config: GpuBenchConfig, layers: Sequence[Row], e2e: Sequence[Row], judged: bool) -> list[Target]:
    shape = list(config.layer_shapes[0])
    at_shape = [r for r in layers if r.ok and r.detail["shape"] == shape]
    fp8 = [r for r in at_shape if r.detail["variant"].startswith("autoprec_fp8")]
    torchao = [r for r in at_shape if r.detail["variant"].startswith("torchao")]
    best = min(fp8, key=lambda r: r.detail["ms"], default=None)
    best_ao = min(torchao, key=lambda r: r.detail["ms"], default=None)
    where = "x".join(map(str, shape))

    def target(name: str, value: "float | None", threshold: float, higher_is_better: bool, detail: str) -> Target:
        passed = None
        if judged and value is not None:
            passed = value >= threshold if higher_is_better else value <= threshold
        return Target(name, value, threshold, passed, detail)

    eager_fp8 = [r for r in fp8 if not r.detail["compiled"] and r.detail.get("ratio_to_eager_baseline") is not None]
    best_eager = max(eager_fp8, key=lambda r: r.detail["ratio_to_eager_baseline"], default=None)
    eager_speedup = best_eager.detail["ratio_to_eager_baseline"] if best_eager is not None else None
    speedup = best.detail.get("ratio_to_baseline") if best is not None else None
    vs_ao = best.detail["ms"] / best_ao.detail["ms"] if best is not None and best_ao is not None else None
    tokens = {r.name.split("/", 1)[1]: t for r in e2e if r.ok and (t := r.detail.get("tokens_per_s")) is not None}
    searched = tokens["searched"] / tokens["bf16_autocast"] if {"searched", "bf16_autocast"} <= set(tokens) else None
    return [
        target(f"fp8 per layer vs compiled bf16 autocast at {where}", speedup, FP8_SPEEDUP_TARGET, True,
               f"best autoprec FP8 variant: {best.name.rsplit('/', 1)[1] if best else 'none ran'}; x = bf16 ms / fp8 ms"),
        target(f"fp8 per layer eager vs eager bf16 autocast at {where}", eager_speedup, FP8_EAGER_SPEEDUP_TARGET, True,
               f"best eager autoprec FP8 variant: {best_eager.name.rsplit('/', 1)[1] if best_eager else 'none ran'} "
               f"(casts: {best_eager.detail['ops'].get('casts', '-') if best_eager else '-'}); x = eager bf16 ms / fp8 ms"),
        target(f"fp8 per layer vs torchao float8 at {where}", vs_ao, TORCHAO_SLACK, False,
               f"best autoprec FP8 ms / best torchao ms ({best_ao.name.rsplit('/', 1)[1] if best_ao else 'torchao did not run'})"),
        target("searched plan vs bf16 autocast end to end", searched, 1.0, True, "searched tokens/s / bf16 autocast tokens/s"),
    ]


def run_gpu_bench(
    config: GpuBenchConfig = GpuBenchConfig(),
    device: str = "auto",
    plan_path: "str | os.PathLike | None" = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> GpuBenchResult:
    """Run the suite; see the module docstring. ``plan_path``: the searched plan to train end to
    end instead of choosing one from the per-layer timings.

    Raises `GpuBenchError` before any work when the device is not CUDA and ``config.smoke`` is
    off, and `PlanError` when ``plan_path`` does not load; after that nothing raises: failures are
    rows. Warnings (emulation, compile) are silenced: what they say is in the rows.
    """
    started = time.perf_counter()
    dev = resolve_device(device, GpuBenchError, "the GPU suite")
    if dev.type != "cuda" and not config.smoke:
        raise GpuBenchError(f"the full GPU suite needs a CUDA device, got {str(dev)!r}; add --smoke for a CPU dry run of every code path")
    loaded = Plan.load(plan_path) if plan_path is not None else None
    e2e_shapes = linear_shapes(config.e2e)
    extra_shapes = sorted(set(e2e_shapes.values()) - set(config.layer_shapes))
    choice_variants = [v for v in VARIANTS if not v.compiled and v.name in _CHOICE_VARIANTS]
    total = len(PROBE_CONFIGS) + len(config.layer_shapes) * len(VARIANTS) + len(extra_shapes) * len(choice_variants) + 3
    done = 0

    def tick(phase: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, phase)

    elapsed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        probe = run_probe(dev, config.probe_features, config.probe_tokens, config.seed)
        for _ in PROBE_CONFIGS:
            tick("probe")
        elapsed["probe"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        timing: dict[str, Any] = dict(
            warmup=config.warmup, repeats=config.repeats, backend=config.compile_backend,
            recompile_limit=config.recompile_limit, seed=config.seed,
        )
        deadline = time.monotonic() + config.layers_budget_s
        layers = measure_layers(config.layer_shapes, VARIANTS, dev, deadline=deadline, progress=lambda name: tick("layers"), **timing)
        layers += measure_layers(extra_shapes, choice_variants, dev, progress=lambda name: tick("layers"), **timing)
        elapsed["layers"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ms = _choice_timings(layers)
        if loaded is not None:
            searched_info: dict[str, Any] = {"source": "file", "path": str(plan_path)}
            plan_for = lambda model, example: loaded  # noqa: E731
        else:
            searched_info = {
                "source": "per-layer timings",
                "rule": "per linear the faster of bf16 autocast and autoprec fp8_e4m3 (tensorwise delayed), "
                        "eager, at the layer's (M, K, N); what the search picks when its budgets do not bind "
                        "(the GPU machines have no Optuna); attention stays bf16",
                "timings_ms": {"x".join(map(str, s)): {f.value: t for (s2, f), t in ms.items() if s2 == s} for s in sorted(set(e2e_shapes.values()))},
            }
            plan_for = lambda model, example: searched_plan(model, example, ms, e2e_shapes)  # noqa: E731
        e2e = []
        for name, make in (("bf16_autocast", None), ("fp8_all", fp8_plan), ("searched", plan_for)):
            e2e.append(train_plan(name, config.e2e, dev, make, config.seed))
            tick("e2e")
        searched_row = e2e[-1]
        searched_info["layers"] = searched_row.detail.pop("plan_layers", None)
        for row in e2e[:-1]:
            row.detail.pop("plan_layers", None)
        elapsed["e2e"] = time.perf_counter() - t0
    elapsed["total"] = time.perf_counter() - started
    targets = _targets(config, layers, e2e, judged=not config.smoke)
    return GpuBenchResult(config, _environment(dev), probe, layers, e2e, searched_info, targets, elapsed)
