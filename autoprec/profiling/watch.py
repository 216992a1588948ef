"""`PlanWatch`: what a planned window checks of its plan, sampled and reduced in one fused pass.

Once a plan is in force the scheduler needs three things of each layer's tensors (its input
``activation``, ``weight`` and output ``grad``), each in the format the plan casts it to
(`LayerPrecision.cast_of`): the fraction that overflows, the fraction that underflows, and the
amax (drift, non-finite values). `LayerProfiler` measures far more (histograms for every
candidate format, gradient noise) at a kernel sequence per tensor per step; this is the lean
check the planned windows run.

How it stays cheap:

- **Sampled in time**: every ``every``-th optimizer step (the span's first included). Its hooks
  are on the model only during sampled steps, so other steps run no Python per layer.
- **One kernel per tensor on a sampled step**: a strided subsample of at most ``sample``
  elements, copied (the stride coprime with the last dimension, as the profiler's, so the
  samples cycle through every channel). Activations and output gradients on every sampled
  step; weights, which move slowly, on the window's last one.
- **One fused reduction per sampled step** (`step`): every subsample concatenated, each element
  judged against its tensor's thresholds, the counts added per (layer, kind) and the amaxes
  written into the window's history, whatever the number of layers (about 30 kernels).
- **No host sync** until `report` (one, at the window's end); the index tensors of a pattern of
  calls are made once and reused.

The amax is the subsample's (the tensor's own for tensors of at most ``sample`` elements, else a
lower bound): what drift and the scales are judged by. The thresholds are `profiling.stats`'
rule: unscaled formats overflow above ``fmt.max`` and underflow (nonzero) below
``fmt.min_subnormal``; current scaling underflows below ``amax * fmt.scaled_floor`` and never
overflows; delayed scaling compares with the largest finite amax of the previous
``ceil(history_len / every)`` sampled steps (the training steps the runtime's history spans).
Non-finite values count as neither; they mark the step (``nonfinite_steps``). A condition that
persists is caught by the next sampled step; a transient non-finite gradient is the loss
scaler's, which checks every step. FP32 casts are not watched (nothing to promote them to).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import ProfileError
from ..formats import Format
from ..saved_bytes import local_shard
from ..plan import LayerPrecision
from ..runtime.recompute import recomputing, training_forward
from .profiler import first_float, sample_stride

__all__ = ["PlanWatch", "TensorWatch", "WatchReport", "WATCHED_KINDS"]

WATCHED_KINDS = ("activation", "weight", "grad")
_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class TensorWatch:
    """One (layer, kind) over a window, in format ``fmt`` with ``scaling``: fractions of the
    ``sampled`` elements that overflow / underflow, the amax per sampled step (0 where the layer
    did not run; inf where the tensor held inf or NaN) and the sampled steps with such a value."""

    fmt: Format
    scaling: str
    sampled: int
    overflow: float
    underflow: float
    amax: tuple[float, ...]
    nonfinite_steps: int


@dataclasses.dataclass(frozen=True)
class WatchReport:
    """A window's `TensorWatch` per layer fqn and kind, over ``steps`` sampled steps."""

    steps: int
    layers: Mapping[str, Mapping[str, TensorWatch]]

    @classmethod
    def joined(cls, reports: "Sequence[Optional[WatchReport]]") -> "Optional[WatchReport]":
        """One report of several ranks' (None: a rank that sampled nothing): the pipeline
        stages' each watch their own layers. A (layer, kind) two ranks watched (data-parallel
        copies of a stage) is their pooled sample: fractions weighted by the elements each
        sampled, per-step amaxes maxed, non-finite steps the most either saw. None when no
        rank sampled a step. Python over the reports' entries, no tensors."""
        present = [r for r in reports if r is not None]
        if not present:
            return None
        pooled: dict[str, dict[str, TensorWatch]] = {}
        for report in present:
            for fqn, kinds in report.layers.items():
                into = pooled.setdefault(fqn, {})
                for kind, tw in kinds.items():
                    into[kind] = tw if kind not in into else _pooled(into[kind], tw)
        return cls(max(r.steps for r in present), pooled)


def _pooled(a: TensorWatch, b: TensorWatch) -> TensorWatch:
    """Two ranks' watch of one (layer, kind): `WatchReport.joined`."""
    sampled = a.sampled + b.sampled
    share = (lambda x, y: (x * a.sampled + y * b.sampled) / sampled) if sampled else (lambda x, y: max(x, y))
    amax = tuple(max(x, y) for x, y in zip(a.amax, b.amax)) if len(a.amax) == len(b.amax) else a.amax
    return TensorWatch(a.fmt, a.scaling, sampled, share(a.overflow, b.overflow), share(a.underflow, b.underflow), amax, max(a.nonfinite_steps, b.nonfinite_steps))


@dataclasses.dataclass(frozen=True)
class _Row:
    fqn: str
    kind: str
    fmt: Format
    scaling: str


class PlanWatch:
    """Watches ``layers`` of ``model`` under ``plan`` (fqn -> `LayerPrecision`) for ``window``
    optimizer steps, sampling every ``every``-th (see the module docstring for what and how).

    Call `attach` before each step's forward and `step` once per optimizer step after its
    backward; `report` after the last. ``history_len``: the runtime's
    delayed-scaling history, in training steps.
    """

    def __init__(self, model: nn.Module, plan: Mapping[str, LayerPrecision], *, window: int, every: int,
                 sample: int = 4096, history_len: int = 16):
        for name, value in (("window", window), ("every", every), ("sample", sample), ("history_len", history_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"PlanWatch({name}={value!r}): must be a positive integer")
        self.window, self.every, self.sample = window, every, sample
        self.slots = -(-window // every)  # sampled steps in the window
        self._history = max(1, -(-history_len // every))
        modules = dict(model.named_modules())
        self._rows: list[_Row] = []
        self._row_of: dict[tuple[str, str], int] = {}
        for fqn, lp in plan.items():
            for kind in WATCHED_KINDS:
                fmt, scaling = lp.cast_of(kind)
                if fmt is not Format.FP32:
                    self._row_of[fqn, kind] = len(self._rows)
                    self._rows.append(_Row(fqn, kind, fmt, scaling))
        self._modules = [(fqn, modules[fqn]) for fqn in dict.fromkeys(r.fqn for r in self._rows)]
        # The modules whose weights are watched, not the weights: FSDP2 swaps a module's parameters
        # (sharded between steps, unsharded inside a forward, their storage freed after it), and a
        # watch made inside a forward (bound there, a given plan's first window) read a freed
        # unsharded weight at the window's end: a segmentation fault (2 stages x FSDP2 2).
        self._weighted = [(self._row_of[fqn, "weight"], m) for fqn, m in self._modules if (fqn, "weight") in self._row_of]
        self._step = 0  # optimizer steps done in the window
        self._handles: list = []
        self._attached = False
        self._pending: list[tuple[int, torch.Tensor]] = []  # (row, subsample) of this sampled step
        self._sampled = [0] * len(self._rows)  # elements judged per row (host ints)
        self._amax: Optional[torch.Tensor] = None  # (rows, slots) float32, on the device of the first tensor met
        self._counts: Optional[torch.Tensor] = None  # (rows, 2): underflowing, overflowing elements
        self._consts: Optional[dict[str, torch.Tensor]] = None
        self._patterns: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def rows(self) -> int:
        """The (layer, kind) pairs watched."""
        return len(self._rows)

    @property
    def steps(self) -> int:
        return self._step

    @property
    def collecting(self) -> bool:
        return self._step < self.window

    @property
    def sampling(self) -> bool:
        """Whether the step under way (the next `step`) is a sampled one: its hooks go on."""
        return self._step < self.window and self._step % self.every == 0

    # -- hooks ------------------------------------------------------------------------------------

    def attach(self) -> "PlanWatch":
        """Hooks on, if this step is sampled (a no-op otherwise, and when on already): call it
        before each step's forward; `step` takes them off."""
        if self.sampling and not self._attached:
            for fqn, module in self._modules:
                self._handles.append(module.register_forward_hook(functools.partial(self._forward_hook, fqn), with_kwargs=True))
            self._attached = True
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attached = False

    def _forward_hook(self, fqn: str, module, args, kwargs, output) -> None:
        if not self._attached or not training_forward(look_up=True) or recomputing():
            return  # a recomputed block's second forward was seen the first time
        row = self._row_of.get((fqn, "activation"))
        if row is not None:
            x = first_float((args, kwargs))
            if x is not None:
                self._take(row, x)
        row = self._row_of.get((fqn, "grad"))
        out = first_float(output)
        if row is not None and out is not None and out.requires_grad:
            # The hook holds this watch, which holds no graph: nothing cycles through autograd.
            out.register_hook(functools.partial(self._grad_hook, row))

    def _grad_hook(self, row: int, grad: Optional[torch.Tensor]) -> None:
        if self._attached and grad is not None and grad.is_floating_point():
            self._take(row, grad)

    def _take(self, row: int, x: torch.Tensor) -> None:
        """Keep a strided subsample of one tensor for this step's fused reduction (one kernel)."""
        x = local_shard(x).detach()
        numel = x.numel()
        if numel == 0:
            return
        flat = x.reshape(-1)
        stride = sample_stride(numel, x.shape[-1] if x.dim() else 1, self.sample)
        self._pending.append((row, (flat[::stride] if stride > 1 else flat).to(torch.float32, copy=True)))

    # -- per step ---------------------------------------------------------------------------------

    def step(self) -> bool:
        """Close one optimizer step (a sampled one: its weights, then the fused reduction) and take
        the hooks off. Returns whether the window goes on. No host sync."""
        if self._step >= self.window:
            return False
        if self._step % self.every == 0:
            with torch.no_grad():
                if self._step // self.every == self.slots - 1:  # weights move slowly: once, nearest the review
                    for row, module in self._weighted:
                        for weight in module.parameters(recurse=False):
                            if weight.dim() >= 2:
                                self._take(row, weight)
                if self._pending:
                    self._reduce_step(self._step // self.every)
        self._pending = []
        self._step += 1
        self.detach()
        return self.collecting

    def _accumulators(self, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Per row: the constants of its thresholds; the amax history and the counts. Made on
        ``device`` when first needed."""
        if self._consts is None or self._amax is None or self._counts is None:
            rows = self._rows
            self._consts = {
                "unscaled": torch.tensor([not r.fmt.needs_scale for r in rows], device=device),
                "current": torch.tensor([r.scaling == "current" for r in rows], device=device),
                # Unscaled: the format's own bounds; scaled: the ratio that maps the reference onto fmt.max.
                "low": torch.tensor([r.fmt.scaled_floor if r.fmt.needs_scale else r.fmt.min_subnormal for r in rows], device=device),
                "high": torch.tensor([r.fmt.max for r in rows], device=device),
            }
            self._amax = torch.zeros(len(rows), self.slots, dtype=torch.float32, device=device)
            self._counts = torch.zeros(len(rows), 2, dtype=torch.float32, device=device)
        return self._consts, self._amax, self._counts

    def _pattern(self, rows: Sequence[int], lengths: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pending tensor's row and length as device tensors, made once per pattern (a training
        step calls the same layers the same way): a few bytes per tensor."""
        key = (tuple(rows), tuple(lengths))
        found = self._patterns.get(key)
        if found is None:
            found = self._patterns[key] = (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(lengths, dtype=torch.int64, device=device))
        return found

    def _reduce_step(self, slot: int) -> None:
        """The sampled step's one fused pass over every pending subsample (about 30 kernels, no
        host sync; its per-element temporaries are freed when it returns)."""
        rows = [row for row, _ in self._pending]
        subs = [sub for _, sub in self._pending]
        total = sum(sub.numel() for sub in subs)
        device = subs[0].device
        consts, history, counts = self._accumulators(device)
        index, lengths = self._pattern(rows, [sub.numel() for sub in subs], device)
        element_row = torch.repeat_interleave(index, lengths, output_size=total)
        # |x|, NaN as inf: MAX keeps it on every backend (a NaN may not survive scatter_reduce).
        values = torch.cat(subs).abs_().nan_to_num_(nan=_INF)
        amax = torch.zeros(len(self._rows), dtype=torch.float32, device=device).scatter_reduce_(0, element_row, values, "amax")
        history[:, slot] = amax
        ref = amax  # the delayed reference; on a row's first step, its own amax
        if slot and any(r.scaling == "delayed" for r in self._rows):
            past = history[:, max(0, slot - self._history):slot]
            past = past.masked_fill(~past.isfinite(), 0.0).amax(1)
            ref = torch.where(past > 0, past, amax)
        # Per row, then per element: a non-finite reference judges nothing (its tensor counts as non-finite instead).
        low = torch.where(consts["unscaled"], consts["low"], torch.where(consts["current"], amax, ref) * consts["low"]).nan_to_num_(nan=0.0, posinf=0.0)
        high = torch.where(consts["unscaled"], consts["high"], torch.where(consts["current"], _INF, ref))
        low, high = (torch.repeat_interleave(t.index_select(0, index), lengths, output_size=total) for t in (low, high))
        under = (values > 0) & (values < low)
        over = (values > high) & (values < _INF)
        counts.index_add_(0, element_row, torch.stack((under, over), 1).float())
        for row, sub in zip(rows, subs):
            self._sampled[row] += sub.numel()

    # -- results and state -----------------------------------------------------------------------

    def report(self) -> WatchReport:
        """The window so far, per layer and kind. One host sync."""
        sampled = -(-self._step // self.every)
        layers: dict[str, dict[str, TensorWatch]] = {}
        amax = self._amax[:, :sampled].cpu().tolist() if self._amax is not None else [[0.0] * sampled for _ in self._rows]
        counts = self._counts.cpu().tolist() if self._counts is not None else [[0.0, 0.0] for _ in self._rows]
        for i, r in enumerate(self._rows):
            n = self._sampled[i]
            under, over = counts[i]
            layers.setdefault(r.fqn, {})[r.kind] = TensorWatch(
                r.fmt, r.scaling, n, over / n if n else 0.0, under / n if n else 0.0, tuple(amax[i]),
                sum(1 for v in amax[i] if not math.isfinite(v)))
        return WatchReport(sampled, layers)

    def reduce_(self, all_reduce: Callable[[torch.Tensor, Any], None], also_sum: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Combine with the other ranks' windows in place, as `LayerProfiler.reduce_`: counts summed
        (the sampled counts and ``also_sum`` with them, returned reduced), amaxes maxed: two
        all-reduces. Every rank must have met a tensor (or none)."""
        import torch.distributed as dist

        if self._counts is None or self._amax is None:
            return also_sum
        extra = [] if also_sum is None else [also_sum.reshape(-1).float().to(self._counts.device)]
        flat = torch.cat([self._counts.reshape(-1), torch.tensor(self._sampled, dtype=torch.float32, device=self._counts.device), *extra])
        all_reduce(flat, dist.ReduceOp.SUM)
        rows = len(self._rows)
        self._counts.copy_(flat[:2 * rows].view(rows, 2))
        self._sampled = [int(v) for v in flat[2 * rows:3 * rows].tolist()]
        all_reduce(self._amax, dist.ReduceOp.MAX)
        if also_sum is None:
            return None
        return flat[3 * rows:].to(also_sum.dtype).reshape(also_sum.shape)

    def state_dict(self) -> dict:
        """The window so far (tensors cloned). No host sync."""
        return {"step": self._step, "sampled": list(self._sampled),
                "amax": None if self._amax is None else self._amax.clone(),
                "counts": None if self._counts is None else self._counts.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a watch made for the same plan and settings."""
        if len(state["sampled"]) != len(self._rows) or (state["amax"] is not None and tuple(state["amax"].shape) != (len(self._rows), self.slots)):
            raise ProfileError("watch state is for another plan or window; make the watch for the plan it was saved with")
        self.detach()
        self._step, self._sampled = int(state["step"]), [int(v) for v in state["sampled"]]
        if state["amax"] is not None:
            _, history, counts = self._accumulators(state["amax"].device)
            history.copy_(state["amax"])
            counts.copy_(state["counts"])
