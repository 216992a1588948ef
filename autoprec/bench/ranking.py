"""Is the cost model right where it matters? `check_uniform_ranking`: predicted (`CostModel`) vs
measured step seconds of the uniform plans on a workload, ranked (tests/costs/test_costs.py holds the
built-in LM to it)."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Mapping, Optional, Sequence

import torch

from ..calls import ModelCall
from ..costs.model import DEFAULT_FORMATS, CostModel
from ..costs.product_times import TimingSettings
from ..errors import CostModelError
from ..formats import Format
from ..runtime import EmulationWarning
from ..noise import median_interval, paired_ratios
from ..device_clock import rotated, timed
from ..workload import check_workload, to_device
from ._common import median_iqr
from .models import BenchVariant, VariantRunner

__all__ = ["RankingCheck", "check_uniform_ranking"]


@dataclasses.dataclass(frozen=True)
class RankingCheck:
    """Predicted vs measured step seconds of uniform plans, and whether their orders agree.

    ``exact``: the same order. ``agree``: no pair is ordered differently unless the measurement
    cannot order it either: its medians within ``tie`` (relative) of each other, or its per-round
    ratios' 90 % median interval (`noise.median_interval`) holding 1. ``kendall_tau``:
    rank correlation in [-1, 1] (1: same order).
    """

    formats: tuple[Format, ...]
    predicted: Mapping[str, float]
    measured: Mapping[str, float]
    measured_iqr: Mapping[str, float]
    tie: float
    kendall_tau: float
    exact: bool
    agree: bool
    discordant: tuple[tuple[str, str], ...]
    info: Mapping[str, Any]

    def table(self) -> str:
        order_p = sorted(self.predicted, key=self.predicted.__getitem__)
        order_m = sorted(self.measured, key=self.measured.__getitem__)
        lines = [f"{'plan':<10} {'predicted ms':>13} {'measured ms':>12} {'IQR':>7} {'pred/meas':>9} {'rank p':>6} {'rank m':>6}"]
        for f in self.formats:
            p, m = self.predicted[f.value], self.measured[f.value]
            lines.append(
                f"{f.value:<10} {p * 1e3:13.2f} {m * 1e3:12.2f} {self.measured_iqr[f.value] * 1e3:7.2f} {p / m:9.2f} "
                f"{order_p.index(f.value) + 1:6d} {order_m.index(f.value) + 1:6d}"
            )
        lines.append(
            f"kendall tau {self.kendall_tau:.2f}; exact order {'yes' if self.exact else 'no'}; "
            f"agree (ties within {self.tie:.0%} allowed) {'yes' if self.agree else 'no'}"
            + (f"; discordant pairs {list(self.discordant)}" if self.discordant else "")
        )
        return "\n".join(lines)


def _compare(predicted: Mapping[str, float], measured: Mapping[str, float], tie: float,
             rounds: Mapping[str, Sequence[float]]) -> tuple[float, bool, bool, tuple]:
    """Kendall's tau, the exact order, agreement and the pairs that disagree (`RankingCheck`);
    ``rounds``: each plan's step seconds per round, the rounds in step."""
    names = list(predicted)
    concordant = discordant_count = 0
    discordant = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            dp = predicted[a] - predicted[b]
            dm = measured[a] - measured[b]
            if dp * dm > 0:
                concordant += 1
            elif dp * dm < 0:
                discordant_count += 1
                low, _, high = median_interval(paired_ratios(rounds[a], rounds[b]))
                if abs(dm) > tie * min(measured[a], measured[b]) and not low <= 1.0 <= high:
                    discordant.append((a, b))
    pairs = len(names) * (len(names) - 1) // 2
    tau = (concordant - discordant_count) / pairs if pairs else 1.0
    exact = sorted(names, key=predicted.__getitem__) == sorted(names, key=measured.__getitem__)
    return tau, exact, not discordant, tuple(discordant)


def check_uniform_ranking(
    workload: Any,
    *,
    formats: Sequence["Format | str"] = DEFAULT_FORMATS,
    steps: int = 10,
    warmup: int = 3,
    tie: float = 0.15,
    cache_dir: Any = None,
    measure: bool = True,
    seed: int = 0,
    device: str = "cpu",
    threads: Optional[int] = None,
) -> RankingCheck:
    """Predicted (`CostModel`) vs measured step seconds of uniform plans on ``workload`` (an
    `autoprec.workload.Workload`).

    Measured: real training steps (`TrainStep.for_workload`: zero_grad, forward + loss under
    ``apply_plan``, backward, the workload's clipping and optimizer step) of one model per plan, built from one seed and fed the same batches, interleaved
    round-robin as ``autoprec bench`` runs them; medians over ``steps`` rounds after ``warmup``.
    ``threads``: CPU threads for the whole check (restored after); on a machine whose cores
    other processes share, 1 avoids OpenMP threads waiting on descheduled siblings (which can
    make a small product two orders of magnitude slower). Timings are cached per thread count.

    Cost: the cost model's measurements (one in-place timing pass per uniform plan when the
    cache is cold, none when warm) plus ``warmup + steps`` rounds of one training step per plan.
    """
    if threads is None:
        return _check_uniform_ranking(workload, formats, steps, warmup, tie, cache_dir, measure, seed, device)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise CostModelError(f"check_uniform_ranking(threads={threads!r}): must be a positive int or None")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _check_uniform_ranking(workload, formats, steps, warmup, tie, cache_dir, measure, seed, device)
    finally:
        torch.set_num_threads(before)


def _check_uniform_ranking(workload, formats, steps, warmup, tie, cache_dir, measure, seed, device) -> RankingCheck:
    formats = tuple(Format.parse(f) for f in formats)
    if len(formats) < 2:
        raise CostModelError(f"check_uniform_ranking(formats={[f.value for f in formats]}): a ranking needs two formats or more")
    if steps < 1 or warmup < 0:
        raise CostModelError(f"check_uniform_ranking(steps={steps}, warmup={warmup}): steps must be >= 1 and warmup >= 0")
    dev = torch.device(device)
    workload = check_workload(workload, type(workload).__name__)
    wl = workload
    sampler = iter(wl.train_batches(seed))
    batches = [to_device(next(sampler), dev) for _ in range(warmup + steps)]
    start = time.perf_counter()
    timing = TimingSettings(in_place=measure, cache_dir=cache_dir)
    costs = CostModel.build(wl.build_model(seed).to(dev), batches[0], loss_fn=wl.loss, formats=formats, timing=timing)
    predicted = {f.value: costs.plan_cost(costs.uniform_plan(f)).step_seconds for f in formats}
    model_seconds = time.perf_counter() - start

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        runners = []
        for f in formats:
            model = wl.build_model(seed).to(dev)
            example = ModelCall.first(model, lambda: wl.loss(model, batches[0]))
            runners.append(VariantRunner("workload", BenchVariant(f"plan:{f.value}", "plan", f), wl, model, example, dev))
        for r, batch in enumerate(batches):
            for runner in rotated(runners, r):
                _, seconds = timed(functools.partial(runner.step, batch), dev)
                if r >= warmup:
                    runner.times.append(seconds)
    measured, iqr = {}, {}
    for f, runner in zip(formats, runners):
        measured[f.value], iqr[f.value] = median_iqr(runner.times)
    tau, exact, agree, discordant = _compare(predicted, measured, tie, {f.value: r.times for f, r in zip(formats, runners)})
    info = {
        "workload": getattr(workload, "name", type(workload).__name__), "steps": steps, "warmup": warmup, "device": str(dev),
        "threads": torch.get_num_threads(),
        "rest_seconds": costs.rest_seconds, "cost_model_seconds": model_seconds,
        "time_sources": sorted({c.time_source for fmt in formats for c in costs.plan_cost(costs.uniform_plan(fmt)).layers.values()}),
    }
    return RankingCheck(formats, predicted, measured, iqr, tie, tau, exact, agree, discordant, info)
