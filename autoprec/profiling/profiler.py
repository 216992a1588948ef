"""`LayerProfiler`: forward and tensor hooks that gather per-layer statistics over a window,
with no host-device sync per step (costs in its docstring)."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..coverage import ModuleFilter, find_layers
from ..errors import ProfileError
from ..formats import Format
from ..saved_bytes import local_shard as _local  # FSDP2: per-shard statistics, reduced at the window's end (autoprec.distributed)
from ..plan import Scaling
from ..runtime.recompute import recomputing, training_forward
from .artifact import LayerProfile, Profile
from .stats import BIN_MASK, BIN_SHIFT, KINDS, NUM_BINS, REFERENCES, BinCounts, GradStats, Histogram, TensorStats, format_fractions

logger = logging.getLogger(__name__)

# Tensors summarized together by `LayerProfiler.profile`: their histograms are copied to the host
# and counted at once, 3 x 2048 int64 bins each (48 KiB), so a chunk holds 12 MiB on the host at
# most (and as much again for the running sums of its three histograms, `stats.BinCounts`), whatever the depth.
_SUMMARY_CHUNK = 256


@functools.lru_cache(maxsize=4096)
def sample_stride(numel: int, last: int, sample: int) -> int:
    """Smallest stride ``≥ numel / sample`` coprime with the last dimension (see module doc)."""
    stride = -(-numel // sample)
    if stride <= 1:
        return 1
    while math.gcd(stride, last) != 1:
        stride += 1
    return stride


class _TensorState:
    """Device accumulators of one (layer, kind)."""

    __slots__ = ("hist", "amax", "moments", "calls", "numel", "sampled", "first_step")

    def __init__(self, window: int, device: torch.device):
        self.hist = torch.zeros(len(REFERENCES) * NUM_BINS, dtype=torch.int64, device=device)
        self.amax = torch.zeros(window, dtype=torch.float32, device=device)
        self.moments = torch.zeros(2, dtype=torch.float64, device=device)  # sum x, sum x^2 (sampled)
        self.calls = self.numel = self.sampled = 0
        self.first_step: Optional[int] = None


class _Welford:
    """Per-element running mean / M2 of one parameter's (strided) gradient. The parameter is
    looked up on its module when read: FSDP2 registers the unsharded parameter during forward
    and backward and the sharded one (which holds the gradient) after, so one kept from an
    earlier moment may have lost its storage or never see a gradient."""

    __slots__ = ("module", "name", "stride", "mean", "m2", "n")

    def __init__(self, module: nn.Module, name: str, grad_sample: int, param: nn.Parameter):
        self.module, self.name = module, name
        last = param.shape[-1] if param.dim() else 1
        self.stride = sample_stride(param.numel(), last, grad_sample)
        self.mean: Optional[torch.Tensor] = None
        self.m2: Optional[torch.Tensor] = None
        self.n = 0

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.module, self.name)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running (mean, M2), both set by the first gradient: a `ProfileError` where only
        one is (a profiler state edited or from elsewhere)."""
        if self.mean is None or self.m2 is None:
            raise ProfileError(
                f"profiler state: the gradient mean and M2 of a {tuple(self.param.shape)} parameter are not both set "
                f"after {self.n} step(s); restore a state_dict this profiler wrote"
            )
        return self.mean, self.m2


class _LayerState:
    __slots__ = ("fqn", "module", "welford", "tensors", "steps", "last_step", "phase", "grads_pending")

    def __init__(self, fqn: str, module: nn.Module, grad_sample: int, phase: int):
        self.fqn = fqn
        self.phase = phase
        self.module = module
        self.welford = [_Welford(module, name, grad_sample, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]
        self.tensors: dict[str, _TensorState] = {}
        self.steps = 0
        self.last_step = -1
        # Forwards of a reentrant checkpoint (no gradients there) whose output gradient arrives
        # through the recomputation's output: its hook goes there.
        self.grads_pending = 0

    @property
    def weights(self) -> list[torch.Tensor]:
        """The layer's matrix parameters as registered now (`_Welford` says why not kept)."""
        return [p for p in self.module.parameters(recurse=False) if p.dim() >= 2]


def first_float(obj: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(obj):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        items: Iterable = obj
    elif isinstance(obj, Mapping):
        items = obj.values()
    else:
        return None
    for item in items:
        found = first_float(item)
        if found is not None:
            return found
    return None


class LayerProfiler:
    """Gathers per-layer statistics over ``window`` optimizer steps (`autoprec.profiling` lists them).

    ``model``: the model to watch; ``example_inputs``: one input (or a tuple / dict of inputs) to
    find the layers by tracing, as the runtime does (without it, the module tree's layers: a
    hand-written matmul module is then missed). ``formats``: the candidate formats whose
    underflow / overflow fractions are computed. ``window``: steps to profile, after which the
    hooks remove themselves. ``sample``: elements histogrammed per tensor per call.
    ``grad_sample``: gradient elements per parameter tracked by the Welford accumulators (they
    hold two float32 copies of that many elements on the parameter's device).
    ``history_len``: the delayed-scaling amax history (`Scaling`'s default).
    ``module_filter(module, fqn) -> bool``: False leaves a layer unprofiled.
    ``enabled=False``: a pass-through (attach / step do nothing, no hooks).

    Costs, all on the device and without a host sync: per layer call and tensor kind 4 small
    kernels (the amax), plus ~15 on the layer's histogram steps; `step` adds the weights' and
    five `torch._foreach_*` kernels for all Welford updates. Memory: per (layer, kind) 48 KiB of
    histogram and ``4 * window`` bytes of amax history; the Welford state (see ``grad_sample``).

    How it stays cheap:

    - **No host-device sync per step.** Every accumulator is a device tensor updated in place; step
      indices and counts are Python ints. `LayerProfiler.profile` syncs once, at the end.
    - **Every step, exactly:** the amax of every tensor (one reduction over the full tensor) and the
      Welford update of the parameter gradients.
    - **Subsampled in time:** histograms and moments are taken on every ``every``-th step of a layer
      (default 8), staggered across layers (layer ``i`` on steps where ``(step + i) % every == 0``)
      so that every step costs about the same. A window of 500 steps still pools 62 steps per tensor.
    - **Subsampled in space:** those steps see a strided subsample of at most ``sample`` elements
      per tensor (default 8192; all of it when smaller). The stride is the smallest integer
      ``≥ numel / sample`` that is coprime with the tensor's last dimension, so the samples cycle
      through every channel instead of hitting the same few (an outlier channel is never skipped
      systematically). Error: a fraction ``p`` estimated from ``n`` sampled values has a standard
      error ``sqrt(p(1-p)/n) ≤ 0.5/sqrt(n)`` for values without structure at the stride's period
      (≤ 0.55 % for one call at ``sample = 8192``; a window pools its steps' samples, ~0.07 % for 62
      of them). ``tests/profiling/test_profiling.py`` checks subsampled fractions against the full tensor
      within 5 standard errors, on a tensor whose channels span 12 octaves.
    - **Non-finite values**: ``nonfinite_steps`` is exact (the full-tensor amax is NaN or inf exactly
      when the tensor holds a non-finite value); ``nonfinite`` counts them in the subsample (exact for
      tensors of at most ``sample`` elements). An exact full count would cost ``isfinite`` + ``sum``
      over the full tensor: a full pass more per tensor than the amax already takes.
    - **Measured**: `autoprec.bench.measure_overhead` times training steps with the profiler inside
      its window, after it, and without it, interleaved in one process (ratios; see the README).
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any = None,
        *,
        formats: Iterable["Format | str"] = tuple(Format),
        window: int = 500,
        sample: int = 8192,
        every: int = 8,
        grad_sample: int = 1 << 20,
        history_len: int = Scaling().history_len,
        module_filter: Optional[ModuleFilter] = None,
        enabled: bool = True,
    ):
        for name, value in (("window", window), ("sample", sample), ("every", every), ("grad_sample", grad_sample), ("history_len", history_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"LayerProfiler({name}={value!r}): must be a positive integer")
        try:
            self.formats = tuple(dict.fromkeys(Format.parse(f) for f in formats))
        except Exception as exc:
            raise ProfileError(f"LayerProfiler(formats=...): {exc}") from None
        if not self.formats:
            raise ProfileError("LayerProfiler(formats=()): give at least one candidate format")
        self.model = model
        self.window = window
        self.sample = sample
        # A window shorter than `every` would leave some layers without a histogram step.
        self.every = min(every, window)
        self.grad_sample = grad_sample
        self.history_len = history_len
        self.enabled = enabled
        found = find_layers(model, example_inputs)
        modules = dict(model.named_modules())
        self.fingerprint = {fqn: info for fqn, info in found.items() if module_filter is None or module_filter(modules[fqn], fqn)}
        if enabled and not self.fingerprint:
            hint = "" if example_inputs is not None else "; pass example_inputs to find layers that call matmul themselves"
            raise ProfileError(f"{type(model).__name__} has no layers to profile (no module runs a matrix product){hint}")
        self._layers = {fqn: _LayerState(fqn, modules[fqn], grad_sample, i % self.every) for i, fqn in enumerate(self.fingerprint)}
        self._handles: list = []
        self._steps = 0
        self._attached = False
        self._buffers: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __repr__(self) -> str:
        state = "collecting" if self.collecting else ("done" if self._steps >= self.window else "detached")
        return f"LayerProfiler({len(self._layers)} layers, step {self._steps}/{self.window}, {state})"

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self._layers)

    @property
    def steps(self) -> int:
        """Steps completed (calls of `step` inside the window)."""
        return self._steps

    @property
    def collecting(self) -> bool:
        """True while hooks are attached and the window is not over."""
        return self._attached

    def attach(self) -> "LayerProfiler":
        """Register the forward hooks (one per layer). Refuses a second attach; a no-op once the
        window is over or when disabled."""
        if self._attached:
            raise ProfileError("this profiler is already attached; detach() it before attaching again")
        if not self.enabled or self._steps >= self.window:
            return self
        try:
            for fqn, state in self._layers.items():
                hook = functools.partial(self._forward_hook, state)
                self._handles.append(state.module.register_forward_hook(hook, with_kwargs=True))
        except BaseException:
            self._remove_hooks()
            raise
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the statistics so far stay readable with `profile`. Idempotent."""
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attached = False

    def __enter__(self) -> "LayerProfiler":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- hooks ----------------------------------------------------------------------------------

    def _forward_hook(self, state: _LayerState, module, args, kwargs, output) -> None:
        if not self._attached:
            return
        if recomputing():
            # A recomputed forward running again in the backward: this call was counted, but a
            # reentrant checkpoint's gradient flows through the recomputed output only.
            out = first_float(output) if state.grads_pending else None
            if out is not None and out.requires_grad:
                state.grads_pending -= 1
                out.register_hook(functools.partial(self._grad_hook, state))
            return
        if not training_forward(look_up=True):
            return
        if state.last_step != self._steps:
            state.last_step = self._steps
            state.steps += 1
        x = first_float((args, kwargs))
        if x is not None:
            self._record(state, "activation", x)
        out = first_float(output)
        if out is not None and out.requires_grad:
            out.register_hook(functools.partial(self._grad_hook, state))
        elif out is not None and not torch.is_grad_enabled():
            state.grads_pending += 1

    def _grad_hook(self, state: _LayerState, grad: torch.Tensor) -> None:
        # A backward that runs after detach() or after the window (graph built before) records nothing.
        if self._attached and grad is not None and grad.is_floating_point():
            self._record(state, "grad", grad)

    def _device_buffers(self, device: torch.device):
        bufs = self._buffers.get(device)
        if bufs is None:
            ones = torch.ones(len(REFERENCES) * self.sample, dtype=torch.int64, device=device)
            offsets = (torch.arange(len(REFERENCES), dtype=torch.int32, device=device) * NUM_BINS).unsqueeze(1)
            one = torch.ones((), dtype=torch.float32, device=device)
            factor = torch.tensor([1.0, 1.0 - 2.0**-22, 1.0 - 2.0**-22], device=device)
            bufs = self._buffers[device] = (ones, offsets, one, factor)
        return bufs

    def _record(self, layer: _LayerState, kind: str, x: torch.Tensor) -> None:
        """Fold one tensor into the (layer, kind) accumulators. No host sync: every branch below
        is on Python ints and shapes.

        Every call: the exact amax (3 kernels). On the layer's histogram steps (every ``every``-th
        step, staggered across layers so each step costs about the same): histograms and
        moments of a strided subsample (about 20 more kernels).
        """
        x = _local(x)
        numel = x.numel()
        if numel == 0:
            return
        step = self._steps
        ts = layer.tensors.get(kind)
        if ts is None:
            ts = layer.tensors[kind] = _TensorState(self.window, x.device)
        x = x.detach()
        # Exact amax over the full tensor; NaN propagates, so a non-finite value always shows.
        low, high = torch.aminmax(x)
        amax = torch.maximum(high, low.neg()).float()
        slot = ts.amax[step]
        torch.maximum(slot, amax, out=slot)
        if ts.first_step is None:
            ts.first_step = step
        ts.calls += 1
        ts.numel += numel
        if (step + layer.phase) % self.every:
            return
        ones, offsets, one, factor = self._device_buffers(x.device)
        stride = sample_stride(numel, x.shape[-1] if x.dim() else 1, self.sample)
        flat = x.reshape(-1)
        sub = flat[::stride] if stride > 1 else flat
        # Current scaling uses this call's amax; delayed scaling the largest finite amax of the
        # previous history_len steps, as the runtime's TensorDelayedQuantizer with reduction "max" (a
        # non-finite amax belongs to a skipped step and counts as zero); the first step has no
        # history and uses its own amax.
        if ts.first_step == step:
            ref = amax
        else:
            past = ts.amax[max(0, step - self.history_len) : step]
            ref = torch.nan_to_num(past, nan=0.0, posinf=0.0, neginf=0.0).amax()
        # 1, 1/amax and 1/ref, the last two lowered by 2**-22 so that |x| == amax lands strictly
        # below 1.0 and the bins from 1.0 up count exactly |x| > ref (up to 2**-22, far below any
        # format's resolution). 0 where the amax is 0 or not finite (every value is then 0 or
        # flagged as non-finite).
        scales = torch.stack((one, amax, ref)).reciprocal_().nan_to_num_(0.0, 0.0, 0.0).mul_(factor)
        scaled = sub.float() * scales.unsqueeze(1)  # (3, m): x, x/amax, x/ref
        # The mask keeps the exponent and the leading mantissa bits and drops the sign: |x|'s bin.
        index = (scaled.view(torch.int32) >> BIN_SHIFT).bitwise_and_(BIN_MASK).add_(offsets)
        ts.hist.index_add_(0, index.view(-1), ones[: index.numel()])
        values = scaled[0]
        ts.moments.add_(torch.stack((values.sum(), torch.dot(values, values))))
        ts.sampled += values.numel()

    # -- per step -------------------------------------------------------------------------------

    def step(self) -> bool:
        """Close one optimizer step: record weights and parameter gradients, advance the window.

        Call it once per optimizer step, after ``backward()`` and before gradient clipping, the
        optimizer step and ``zero_grad``. When the window is complete the hooks are removed.
        Returns whether the profiler is still collecting. No host sync.
        """
        if not self._attached:
            return False
        grads, means, m2s, inv_n = [], [], [], []
        with torch.no_grad():
            for layer in self._layers.values():
                for w in layer.weights:
                    self._record(layer, "weight", w)
                for wf in layer.welford:
                    g = wf.param.grad
                    if g is None or g.is_sparse:
                        continue
                    g = _local(g).detach().reshape(-1)
                    g = (g[:: wf.stride] if wf.stride > 1 else g).float()
                    if wf.mean is None:
                        wf.mean, wf.m2 = torch.zeros_like(g), torch.zeros_like(g)
                    mean, m2 = wf.moments()
                    wf.n += 1
                    grads.append(g)
                    means.append(mean)
                    m2s.append(m2)
                    inv_n.append(1.0 / wf.n)
            if grads:
                # Welford (1962): mean += (g - mean) / n; M2 += (g - mean_old) * (g - mean_new).
                delta = torch._foreach_sub(grads, means)
                torch._foreach_add_(means, torch._foreach_mul(delta, inv_n))
                torch._foreach_addcmul_(m2s, delta, torch._foreach_sub(grads, means))
        self._steps += 1
        if self._steps >= self.window:
            self._remove_hooks()
            logger.info("profiling window of %d steps complete; hooks removed", self.window)
        return self._attached

    # -- across ranks ---------------------------------------------------------------------------

    def reduce_(self, all_reduce: Callable[[torch.Tensor, Any], None], also_sum: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Combine this window's statistics with the other ranks', in place: histograms, counts and
        moments summed, amax histories maxed. At most three collectives, whatever the number of
        layers; one host read of the summed counts (three ints) per (layer, tensor kind)
        tracked, all after the first collective, and no other host sync.

        Args:
            all_reduce: ``all_reduce(tensor, op)`` reduces one tensor in place across the ranks
                (``op`` a ``torch.distributed.ReduceOp``); every rank must call `reduce_` with
                the same layers tracked.
            also_sum: a float tensor summed in the same collective as the moments (the caller's
                window loss); None: nothing extra.

        Returns:
            ``also_sum`` summed across the ranks (a new tensor of its dtype and shape), or None
            when it was None.
        """
        import torch.distributed as dist

        states = [self._layers[fqn].tensors[kind] for fqn in sorted(self._layers) for kind in sorted(self._layers[fqn].tensors)]
        ints = [torch.cat([ts.hist, torch.tensor([ts.calls, ts.numel, ts.sampled], device=ts.hist.device)]) for ts in states]
        floats = [ts.moments for ts in states] + ([also_sum.double().reshape(-1)] if also_sum is not None else [])
        if ints:
            flat = torch.cat(ints)
            all_reduce(flat, dist.ReduceOp.SUM)
            for ts, part in zip(states, flat.split([t.numel() for t in ints])):
                ts.hist.copy_(part[:-3])
                ts.calls, ts.numel, ts.sampled = (int(v) for v in part[-3:].tolist())
            # A NaN amax marks a non-finite step; as inf it survives MAX on every backend.
            amax = torch.cat([ts.amax.nan_to_num(nan=float("inf")) for ts in states])
            all_reduce(amax, dist.ReduceOp.MAX)
            for ts, part in zip(states, amax.split([ts.amax.numel() for ts in states])):
                ts.amax.copy_(part)
        if floats:
            flat = torch.cat(floats)
            all_reduce(flat, dist.ReduceOp.SUM)
            for ts, part in zip(states, flat.split([t.numel() for t in floats])):
                ts.moments.copy_(part)
            if also_sum is not None:
                return flat[-also_sum.numel():].to(also_sum.dtype).reshape(also_sum.shape)
        return also_sum

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The statistics gathered so far and the window position (tensors cloned, on their
        devices), so a resumed run's profile equals the uninterrupted run's. No host sync."""
        def tensors(ts: _TensorState) -> dict:
            return {slot: (v.clone() if torch.is_tensor(v) else v) for slot in _TensorState.__slots__ for v in [getattr(ts, slot)]}

        return {
            "steps": self._steps,
            "layers": {
                fqn: {
                    "steps": layer.steps,
                    "last_step": layer.last_step,
                    "welford": [(None if wf.mean is None else wf.mean.clone(), None if wf.m2 is None else wf.m2.clone(), wf.n) for wf in layer.welford],
                    "tensors": {kind: tensors(ts) for kind, ts in layer.tensors.items()},
                }
                for fqn, layer in self._layers.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` into a profiler made for the same model, window and settings
        (only the layers are checked). Past the window's end, the hooks are removed.

        Args:
            state: what `state_dict` returned.

        Raises:
            ProfileError: ``state`` names other layers than this profiler watches.
        """
        if set(state["layers"]) != set(self._layers):
            raise ProfileError("profiler state names other layers than this profiler watches; make it for the same model")
        self._steps = int(state["steps"])
        for fqn, saved in state["layers"].items():
            layer = self._layers[fqn]
            layer.steps, layer.last_step = saved["steps"], saved["last_step"]
            for wf, (mean, m2, n) in zip(layer.welford, saved["welford"]):
                wf.mean, wf.m2, wf.n = (None if mean is None else mean.clone()), (None if m2 is None else m2.clone()), n
            layer.tensors = {}
            for kind, slots in saved["tensors"].items():
                ts = _TensorState.__new__(_TensorState)
                for slot, value in slots.items():
                    setattr(ts, slot, value.clone() if torch.is_tensor(value) else value)
                layer.tensors[kind] = ts
        if self._steps >= self.window:
            self._remove_hooks()

    # -- result ---------------------------------------------------------------------------------

    def profile(self, metadata: Optional[Mapping[str, Any]] = None) -> Profile:
        """The `Profile` of the steps so far. Copies the accumulators to the host: three
        host-device syncs per `_SUMMARY_CHUNK` tensors, then a few numpy calls per chunk and
        threshold, and one small object per tensor and scaling: linear in the tensors.

        Args:
            metadata: JSON-serializable entries stored in the profile's ``metadata`` (None:
                empty).

        Returns:
            The profile of every watched layer over the steps closed by `step`.

        Raises:
            ProfileError: no step was profiled (the profiler is disabled, or `step` was never
                called while attached).
        """
        if self._steps == 0:
            why = "the profiler is disabled" if not self.enabled else "call step() once per optimizer step while attached"
            raise ProfileError(f"no steps were profiled: {why}")
        steps = self._steps
        watched = [(fqn, kind) for fqn, layer in self._layers.items() for kind in KINDS if kind in layer.tensors]
        tensors: dict[str, dict[str, TensorStats]] = {fqn: {} for fqn in self._layers}
        for start in range(0, len(watched), _SUMMARY_CHUNK):
            chunk = watched[start : start + _SUMMARY_CHUNK]
            summaries = self._tensor_stats([self._layers[fqn].tensors[kind] for fqn, kind in chunk], steps)
            for (fqn, kind), summary in zip(chunk, summaries):
                tensors[fqn][kind] = summary
        layers = {fqn: LayerProfile(layer.steps, self._grad_stats(layer), tensors[fqn]) for fqn, layer in self._layers.items()}
        return Profile(
            self.fingerprint, layers, steps, self.window, self.sample, self.every, self.grad_sample,
            self.history_len, self.formats, dict(metadata or {}),
        )

    def _tensor_stats(self, states: Sequence[_TensorState], steps: int) -> list[TensorStats]:
        """The summaries of ``states``, their accumulators copied to the host in one copy per kind
        of accumulator (three host-device syncs) and their fractions computed for all at once
        (`stats.format_fractions`)."""
        hist = torch.stack([ts.hist for ts in states]).cpu().view(len(states), len(REFERENCES), NUM_BINS).numpy()
        amaxes = torch.stack([ts.amax[:steps] for ts in states]).cpu().tolist()
        moments = torch.stack([ts.moments for ts in states]).cpu().tolist()
        histograms = Histogram.from_rows(hist.reshape(-1, NUM_BINS))
        sampled = [ts.sampled for ts in states]
        counts = {ref: BinCounts(hist[:, i]) for i, ref in enumerate(REFERENCES)}
        fractions = {f.value: format_fractions(counts, sampled, f) for f in self.formats}
        out = []
        for i, (ts, amax, (s1, s2)) in enumerate(zip(states, amaxes, moments)):
            n = ts.sampled
            mean = s1 / n if n else math.nan
            var = (s2 - n * mean * mean) / (n - 1) if n > 1 else math.nan
            out.append(TensorStats(
                calls=ts.calls, numel=ts.numel, sampled=n, amax=tuple(amax),
                nonfinite_steps=sum(1 for v in amax if not math.isfinite(v)),
                mean=mean, var=max(var, 0.0) if math.isfinite(var) else var,
                histograms=dict(zip(REFERENCES, histograms[i * len(REFERENCES) : (i + 1) * len(REFERENCES)])),
                fractions={fmt: per_tensor[i] for fmt, per_tensor in fractions.items()},
            ))
        return out

    @staticmethod
    def _grad_stats(layer: _LayerState) -> Optional[GradStats]:
        tracked = [wf for wf in layer.welford if wf.n > 0]
        if not tracked:
            return None
        numel = sampled = 0
        sum_mean = sum_var = sum_sq = 0.0
        steps = min(wf.n for wf in tracked)
        for wf in tracked:
            running_mean, running_m2 = wf.moments()
            mean = running_mean.double().cpu()
            m2 = running_m2.double().cpu()
            scale = wf.param.numel() / mean.numel()
            numel += wf.param.numel()
            sampled += mean.numel()
            sum_mean += float(mean.sum()) * scale
            sum_sq += float((mean * mean).sum()) * scale
            sum_var += (float(m2.sum()) / (wf.n - 1) if wf.n > 1 else math.nan) * scale
        nsr = sum_var / sum_sq if sum_sq > 0 else (math.inf if sum_var > 0 else math.nan)
        return GradStats(steps, numel, sampled, sum_mean / numel, sum_var / numel, sum_sq / numel, nsr)
