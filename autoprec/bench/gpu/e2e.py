"""End to end: a GPT-style byte-level decoder trained for a fixed number of steps under three plans.

The model is `autoprec.workloads.ByteLM` (pre-LN blocks, GELU MLP, untied head, vocabulary of
256 bytes) with its attention computed by ``F.scaled_dot_product_attention`` (flash attention on
CUDA): ByteLM's explicit ``q @ k^T`` would keep ``seq x seq`` scores per head for backward and, in an
FP8 plan, run emulated. Data: a few batches of random bytes drawn once on the device from a seeded
generator and cycled, so the loss falls as the model memorises them and a plan that hurts training
shows a higher loss at the end. AdamW is fused; every plan runs eager.

Plans:
- ``bf16_autocast``: plain ``torch.autocast(bf16)`` around forward and loss;
- ``fp8_all``: every linear FP8 E4M3 (tensorwise delayed scaling), attention BF16 (no FP8 kernel
  serves it);
- ``searched``: a plan file given by the caller, or per linear the faster of BF16 and FP8 as the
  per-layer timings measured at that layer's shape (what the search picks when the memory and
  accuracy budgets do not bind; the GPU machines have no Optuna to run the search itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...device import KERNEL_OPS
from ...formats import Format
from ...plan import LayerPrecision, Plan
from ...runtime import apply_plan
from ...workloads import ByteLM, CausalSelfAttention, LMConfig
from .rows import Row, guarded
from .warm_timing import start_clock

__all__ = ["E2EConfig", "BenchLM", "linear_shapes", "choose_formats", "fp8_plan", "searched_plan", "train_plan"]

Shape = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class E2EConfig:
    """Model and run sizes. ``batch`` sequences of ``seq`` bytes per step; ``steps`` in all, the
    first ``warmup`` untimed; ``pool`` distinct batches cycled."""

    n_layers: int = 12
    d_model: int = 2048
    n_heads: int = 16
    seq: int = 1024
    batch: int = 8
    steps: int = 50
    warmup: int = 5
    pool: int = 4
    lr: float = 3e-4

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def lm_config(self) -> LMConfig:
        return LMConfig(context=self.seq, d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers, d_ff=4 * self.d_model)


class _FlashAttention(CausalSelfAttention):
    """ByteLM's attention (same ``qkv`` / ``proj`` parameters) through ``scaled_dot_product_attention``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class BenchLM(ByteLM):
    """`ByteLM` with `_FlashAttention` in every block, initialised as ByteLM is."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__(config)
        for block in self.blocks:
            block.attn = _FlashAttention(config)
        self._init_weights()


def linear_shapes(config: E2EConfig) -> dict[str, Shape]:
    """``fqn -> (M, K, N)`` of every ``nn.Linear`` of the model at one training step (M tokens).
    Built on the meta device: no memory, no compute."""
    with torch.device("meta"):
        model = BenchLM(config.lm_config())
    return {fqn: (config.tokens_per_step, m.in_features, m.out_features) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


def choose_formats(shapes: Mapping[str, Shape], ms: Mapping[tuple[Shape, Format], float]) -> dict[str, LayerPrecision]:
    """Per layer, FP8 E4M3 when its measured step time at the layer's shape beats BF16's, else BF16.

    ``ms``: ``(shape, format) -> milliseconds`` (missing or non-finite: that format is not chosen).
    Pure; the reason of each choice names both times.
    """
    chosen = {}
    for fqn, shape in shapes.items():
        bf16, fp8 = ms.get((shape, Format.BF16), math.nan), ms.get((shape, Format.FP8_E4M3), math.nan)
        faster = math.isfinite(fp8) and not fp8 >= bf16  # a missing BF16 time leaves FP8 unbeaten
        fmt = Format.FP8_E4M3 if faster else Format.BF16
        reason = f"faster at {'x'.join(map(str, shape))}: fp8 {fp8:.3f} ms vs bf16 {bf16:.3f} ms"
        chosen[fqn] = LayerPrecision(fmt, reason=reason)
    return chosen


def fp8_plan(model: nn.Module, example: tuple) -> Plan:
    """Every layer FP8 E4M3 (tensorwise delayed), except layers running ops no FP8 kernel serves
    (attention), which get BF16. Traces one forward."""
    plan = Plan.uniform(model, Format.FP8_E4M3, example)
    no_kernel = {fqn: LayerPrecision(Format.BF16, reason="no FP8 kernel for " + ", ".join(info.ops))
                 for fqn, info in plan.fingerprint.items() if set(info.ops) - KERNEL_OPS}
    return plan.with_layers(no_kernel)


def searched_plan(model: nn.Module, example: tuple, ms: Mapping[tuple[Shape, Format], float], shapes: Mapping[str, Shape]) -> Plan:
    """`fp8_plan` with each linear switched to the faster of BF16 / FP8 (`choose_formats`)."""
    base = fp8_plan(model, example)
    plan = base.with_layers({fqn: lp for fqn, lp in choose_formats(shapes, ms).items() if fqn in base.layers})
    return plan.replace(metadata={"source": "gpu_bench: per layer the faster of bf16 / fp8_e4m3 in measured per-layer timings"})


def _batches(config: E2EConfig, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(seed)
    pool = []
    for _ in range(config.pool):
        tokens = torch.randint(0, 256, (config.batch, config.seq + 1), device=device, generator=generator)
        pool.append((tokens[:, :-1], tokens[:, 1:]))
    return pool


def train_plan(name: str, config: E2EConfig, device: torch.device, plan_for: Optional[Callable[[nn.Module, tuple], Plan]], seed: int = 0) -> Row:
    """Train a fresh seeded `BenchLM` for ``config.steps`` steps under ``plan_for(model, example)``
    (None: plain BF16 autocast). Row detail: tokens/s over the steps after warm-up, peak memory
    (CUDA), first and last loss, the plan's format counts. One host sync at the end of warm-up and
    of the run (the loss values are read then)."""

    def run() -> tuple[bool, dict]:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            with torch.device(device):
                model = BenchLM(config.lm_config())
        batches = _batches(config, device, seed)
        detail: dict = {}
        context: contextlib.AbstractContextManager
        if plan_for is None:
            context = torch.autocast(device.type, dtype=torch.bfloat16)
        else:
            plan = plan_for(model, batches[0])
            runtime = apply_plan(model, plan)
            context = runtime
            detail["plan_formats"] = plan.format_counts()
            detail["plan_layers"] = {fqn: lp.format.value for fqn, lp in plan.layers.items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, fused=True)
        losses = []
        stop = None
        for step in range(config.steps):
            if step == config.warmup:
                stop = start_clock(device)
            idx, targets = batches[step % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            with context:
                _, loss = model(idx, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        if stop is None:
            raise ValueError(f"E2EConfig(steps={config.steps}, warmup={config.warmup}) times no step; steps must exceed warmup")
        seconds = stop()
        losses = [float(v) for v in losses]
        timed_steps = config.steps - config.warmup
        detail.update(
            tokens_per_s=timed_steps * config.tokens_per_step / seconds,
            step_ms=seconds * 1e3 / timed_steps,
            loss_first=losses[0],
            loss_last=losses[-1],
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        )
        return all(math.isfinite(v) for v in losses), detail

    return guarded(f"e2e/{name}", device, run)

