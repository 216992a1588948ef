"""Which method each layer's gradients travel by: the plan's ``comm`` (`Plan.comm`), chosen from
what the link was measured to cost and what each compression is predicted to cost in loss.

**Time.** `LinkCost.measure` times FP32 all-reduces of two sizes on the run's own process group
at bind (one warm-up and three timed calls each, the slowest rank's median) and fits a latency
and a per-byte time (the link's, whatever it is: loopback, a 100 Mbit/s veth, NVLink); it also
times each method's arithmetic on this rank's device (`compressed` on ``2**18`` values: casts,
chunk quantization, top-k). A layer's gradients then cost ``bytes_sent / bandwidth + values x
arithmetic`` per step by each method (`LinkCost.seconds`). The per-collective latency is left
out per layer (layers share DDP's buckets; a bucket mixing methods issues one collective more per
method), and DDP overlaps the all-reduces with the backward, so a saving is an upper bound on the
step time saved: a method is taken only where it saves time by these figures.

**Loss.** A compressed all-reduce adds an error ``e`` to a layer's averaged gradient g. It is
scored in two terms, with the optimizer's own learning rate η and preconditioner (Adam's ``P =
1/(√v + ε)``; 1 for SGD), e measured on the layer's real averaged gradient (`compressed` of it):

- as the sensitivity's gradient term scores a format's gradient error
  (`sensitivity.FisherEstimator`): treated as zero-mean gradient noise, SGD settles at an excess
  loss of ``(η/4) Σ_i P_i e_i²`` (Mandt, Hoffman & Blei, arXiv:1704.04289), counted twice for
  the methods that round twice (BF16 and FP16's sum, INT8's owner);
- plus the descent a step loses when e is not noise but correlated with g, ``η |Σ_i P_i g_i
  e_i|``: near zero for a rounding (BF16, INT8), most of a step's descent for top-k, whose e is
  everything it did not send. Error feedback sends it in later steps, so this is what the delay
  costs, at most; without it (the noise term alone) top-k 1 % passed a 1 % budget over a 100
  Mbit/s link and trained 4 % above FP32's loss after 30 steps (`benchmarks/comm_link.py`).

**Choice** (`choose`): greedy by time saved per loss added, each layer once (a layer may move
to a method that saves more when the budget left allows the difference): a knapsack whose items
are few (three methods per layer) and whose figures are estimates, where the format search's
exact solver would add nothing the estimates can carry. Then each method must pay for its own
collectives: a method whose layers together save less than the latency of the collectives it
adds to each bucket (``fixed``: INT8 two, the others one, per DDP bucket) is struck out and the
choice made again without it (a 256-value layer sent by top-k over 100 Mbit/s saves 0.08 ms a
step, less than the all-gather it adds costs on most links). FP16 is not among the choices (scaled
gradients may overflow it; ask for ``grad_comm="fp16"`` by name), nor PowerSGD (whole buckets).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..formats import CommMethod
from ..device_clock import start_clock, sync
from .buckets import CommSettings, _quantize_rows, _topk_count, bytes_sent

__all__ = ["CHOSEN", "COLLECTIVES", "LinkCost", "LayerComm", "compressed", "comm_loss_increase", "choose"]

# The methods the choice considers, besides FP32 (module docstring).
CHOSEN = (CommMethod.BF16, CommMethod.INT8, CommMethod.TOPK)

# How many times a method rounds a gradient on its way (module docstring: "twice").
_ROUNDINGS = {CommMethod.FP32: 0, CommMethod.BF16: 2, CommMethod.FP16: 2, CommMethod.INT8: 2, CommMethod.TOPK: 1}


def compressed(method: CommMethod, grad: torch.Tensor, settings: CommSettings = CommSettings()) -> torch.Tensor:
    """``grad`` (any shape) as ``method`` delivers it when it is every rank's gradient, rounded
    once: a cast to the dtype and back; INT8's chunks of ``settings.chunk`` values quantized and
    dequantized, then quantized again as the owner does; top-k's ``topk_ratio`` largest
    magnitudes kept. A new FP32 tensor shaped like ``grad``; no collective."""
    x = grad.detach().float()
    if method is CommMethod.FP32:
        return x.clone()
    if method in (CommMethod.BF16, CommMethod.FP16):
        return x.to(torch.bfloat16 if method is CommMethod.BF16 else torch.float16).float()
    flat = x.reshape(-1)
    n = flat.numel()
    if method is CommMethod.INT8:
        rows = torch.zeros(-(-n // settings.chunk) * settings.chunk, device=flat.device)
        rows[:n] = flat
        rows = rows.view(-1, settings.chunk)
        for _ in range(2):  # the sender's rounding, then the owner's of the average
            q, scales, _ = _quantize_rows(rows.clone())
            rows = q.float() * scales
        return rows.reshape(-1)[:n].view_as(x)
    if method is CommMethod.TOPK:
        out = torch.zeros_like(flat)
        index = flat.abs().topk(_topk_count(n, settings.topk_ratio), sorted=False).indices
        out[index] = flat[index]
        return out.view_as(x)
    raise ValueError(f"{method.value}: no per-layer model of it (PowerSGD compresses whole buckets)")


def comm_loss_increase(method: CommMethod, grads: Sequence[torch.Tensor], preconditioners: Sequence[Optional[torch.Tensor]],
                       lr: float, settings: CommSettings = CommSettings()) -> float:
    """The excess loss (units of the loss) of sending a layer's averaged gradients ``grads`` by
    ``method``: ``(lr/4) Σ P e²`` times the method's roundings, plus ``lr |Σ P g e|`` (module
    docstring); a preconditioner None is 1. One compression and two reductions per tensor, one
    host sync."""
    noise = torch.zeros((), dtype=torch.float64)
    descent = torch.zeros((), dtype=torch.float64)
    for g, p in zip(grads, preconditioners):
        exact = g.detach().float()
        e = compressed(method, g, settings) - exact
        weighted = e * p if p is not None else e
        noise += (weighted * e).sum(dtype=torch.float64).cpu()
        descent += (weighted * exact).sum(dtype=torch.float64).cpu()
    return float(lr / 4 * _ROUNDINGS[method] * noise + lr * abs(descent))


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """What sending gradients costs this run (module docstring): ``latency_s`` per collective,
    ``bytes_per_s`` (ring-equivalent bytes one rank sends, `bytes_sent`), ``arithmetic_s``:
    method value -> seconds per gradient value of its arithmetic on this rank's device."""

    latency_s: float
    bytes_per_s: float
    arithmetic_s: Mapping[str, float]
    world: int

    SIZES = (2**14, 2**19)  # FP32 values per timed all-reduce: 64 KiB and 2 MiB

    @classmethod
    def measure(cls, group: Any, device: "torch.device | str", settings: CommSettings = CommSettings()) -> "LinkCost":
        """Time the link and the arithmetic (every rank of ``group`` calls it at once). Costs 8
        all-reduces of up to 2 MiB, one of 2 floats, and 4 runs of each method's arithmetic on
        ``2**18`` values (well under a second on a 100 Mbit/s link)."""
        world = dist.get_world_size(group)
        seconds = []
        for n in cls.SIZES:
            x = torch.ones(n, device=device)
            runs = []
            for i in range(4):
                sync(device)
                clock = start_clock(device)
                dist.all_reduce(x, group=group)
                elapsed = clock()
                if i:
                    runs.append(elapsed)
            seconds.append(statistics.median(runs))
        slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        small, large = slowest.tolist()
        sent = [bytes_sent(CommMethod.FP32, [torch.Size([n])], world) for n in cls.SIZES]
        per_byte = max((large - small) / (sent[1] - sent[0]), 1e-15)
        grad = torch.randn(2**18, device=device)
        arithmetic = {}
        for method in CHOSEN:
            runs = []
            for i in range(4):
                sync(device)
                clock = start_clock(device)
                compressed(method, grad, settings)
                elapsed = clock()
                if i:
                    runs.append(elapsed / grad.numel())
            arithmetic[method.value] = statistics.median(runs)
        return cls(max(small - per_byte * sent[0], 0.0), 1.0 / per_byte, arithmetic, world)

    def seconds(self, method: CommMethod, shapes: Sequence[torch.Size], settings: CommSettings = CommSettings()) -> float:
        """Seconds per step to send gradients of ``shapes`` by ``method`` (no latency; module docstring)."""
        values = sum(math.prod(s) for s in shapes)
        return bytes_sent(method, shapes, self.world, settings) / self.bytes_per_s + values * self.arithmetic_s.get(method.value, 0.0)

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s, "arithmetic_s": dict(self.arithmetic_s), "world": self.world}


@dataclasses.dataclass(frozen=True)
class LayerComm:
    """One layer's figures per method: ``seconds`` to send its gradients per step, and the
    ``loss`` increase it is predicted to add (FP32's: 0)."""

    seconds: Mapping[CommMethod, float]
    loss: Mapping[CommMethod, float]


# Collectives a method issues per bucket (module docstring: what it must pay for).
COLLECTIVES = {CommMethod.FP32: 1, CommMethod.BF16: 1, CommMethod.FP16: 1, CommMethod.INT8: 2, CommMethod.TOPK: 1}


def choose(layers: Mapping[str, LayerComm], allowance: float, fixed: Optional[Mapping[CommMethod, float]] = None) -> dict[str, CommMethod]:
    """Every layer's method: FP32 unless another saves time and fits in ``allowance`` (loss
    units; inf: open) with the others chosen, and its layers together save more than ``fixed``
    (method -> seconds per step its collectives add; module docstring)."""
    struck: set[CommMethod] = set()
    while True:
        chosen = _greedy(layers, allowance, struck)
        saved: dict[CommMethod, float] = {}
        for fqn, method in chosen.items():
            saved[method] = saved.get(method, 0.0) + layers[fqn].seconds[CommMethod.FP32] - layers[fqn].seconds[method]
        unpaid = {m for m, s in saved.items() if m is not CommMethod.FP32 and s <= (fixed or {}).get(m, 0.0)}
        if not unpaid:
            return chosen
        struck |= unpaid


def _greedy(layers: Mapping[str, LayerComm], allowance: float, struck: "set[CommMethod]") -> dict[str, CommMethod]:
    options = []
    for fqn, layer in layers.items():
        base = layer.seconds[CommMethod.FP32]
        for method, seconds in layer.seconds.items():
            saved, loss = base - seconds, layer.loss.get(method, math.inf)
            if method is not CommMethod.FP32 and method not in struck and saved > 0 and math.isfinite(loss):
                options.append((saved / loss if loss > 0 else math.inf, saved, fqn, method, loss))
    chosen: dict[str, tuple[CommMethod, float, float]] = {}
    left = allowance
    for _, saved, fqn, method, loss in sorted(options, key=lambda o: (-o[0], -o[1], o[2], o[3].value)):
        held = chosen.get(fqn)
        extra = loss - (held[2] if held is not None else 0.0)
        if (held is None or saved > held[1]) and extra <= left:
            chosen[fqn] = (method, saved, loss)
            left -= extra
    return {fqn: chosen[fqn][0] if fqn in chosen else CommMethod.FP32 for fqn in layers}
