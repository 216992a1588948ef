"""INT8 activation calibration: observed ranges → a frozen scale, with outlier channels apart.

For the first ``Calibration.batches`` forward passes a layer quantizes with each batch's own range
(dynamic max) while an `Int8Calibrator` keeps, per input channel, the exact running amax and a
deterministic subsample of rows. On the last of those passes it freezes:

1. Outlier channels: input channels whose amax exceeds ``outlier_ratio`` × the median channel
   amax are computed apart in high precision (LLM.int8(), arXiv:2208.07339: a handful of feature
   dimensions carry magnitudes that would take the whole INT8 range). At most `outlier_slots`
   channels (the largest) are taken, so every tensor keeps a fixed shape.
2. The clipping range of the remaining channels, by ``method``: ``max`` (no clipping), ``percentile``
   of |x|, or ``mse`` (the clip with the smallest quantization MSE over the sampled values, a grid
   search as in NVIDIA's pytorch-quantization / TensorRT calibrators).

Everything stays on the device: no step, the freezing one included, reads a value back to the
host (outliers are a fixed-size top-k with a validity mask, not a data-dependent ``nonzero``).
The relative quantization error of the chosen scale and of naive max scaling is kept as tensors
and read only when `report` is asked for (that read syncs).
"""

from __future__ import annotations

import math
import struct
from typing import Any, Collection, Mapping

import torch

from ..formats import Format, amax, dequantize, inverse_scale, quantize
from ..plan import Calibration, CalibrationMethod
from .tensor_parallel import amax_over

__all__ = ["Int8Calibrator", "outlier_slots"]

_ROWS_PER_BATCH = 256  # rows (tokens) sampled per calibration batch; exact per-channel amax kept
_MSE_GRID = 100  # clip candidates between 1% and 100% of amax
_MSE_VALUES = 1 << 14  # sampled values the MSE grid is evaluated on (a 100 x 16384 temporary)


def outlier_slots(channels: int) -> int:
    """How many input channels may be kept apart: 1 in 128, at least one.

    LLM.int8() reports a few outlier dimensions per thousands of features; the cap keeps the
    high-precision side product small and its shape fixed.
    """
    return max(1, math.ceil(channels / 128))


def _fake_int8(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, inv, Format.INT8), inv)


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) of a 1-D tensor from one sort, with
    no host sync: torch 2.11's ``quantile`` syncs once (an ``aten.equal`` check), 2.13's does not.
    The rank ``q * (n - 1)`` is a host number, so the two neighbours are plain indices; it is
    rounded to FP32 as torch computes it (aten quantile: ranks in the input's dtype, then lerp).
    Only the two neighbours are needed, so the sort is a ``topk`` of the shorter side: for a
    calibration percentile (99.99 of a million values) a hundred values, not a million."""
    n = values.numel()
    rank = _fp32(_fp32(q) * _fp32(n - 1))  # a product of two FP32 values is exact in a double
    lo = min(int(math.floor(rank)), n - 1)
    hi = min(lo + 1, n - 1)
    if n - lo <= hi + 1:  # the neighbours are among the n - lo largest (descending order)
        top = values.topk(n - lo).values
        low, high = top[n - lo - 1], top[n - hi - 1]
    else:  # among the hi + 1 smallest (ascending order)
        bottom = values.topk(hi + 1, largest=False).values
        low, high = bottom[lo], bottom[hi]
    return torch.lerp(low, high, rank - lo)


class Int8Calibrator:
    """Calibration state of one INT8 input operand with ``channels`` input channels."""

    def __init__(self, calibration: Calibration, channels: int):
        self.calibration = calibration
        self.channels = channels
        self.slots = self._slots(calibration, channels)
        # A row-wise tensor-parallel layer's (`split_over`): the group, this rank's first channel
        # in the whole input and the whole input's channel count.
        self.group: Any = None
        self.offset, self.whole_channels = 0, channels
        self._start()

    def split_over(self, group: Any, whole_channels: int) -> None:
        """Calibrate this rank's slice of a row-wise tensor-parallel layer's input: its
        ``channels`` are the rank's contiguous share of ``whole_channels`` split over ``group``
        as DTensor's ``Shard(1)`` splits them (rank r from r * ceil(whole / ranks)). Each
        calibration batch is scaled by the whole input's amax, and the freeze gathers every
        rank's channel amaxes and row samples, so each rank freezes the unsharded layer's scale
        and outlier channels (the whole layer's slots; those outside its slice marked invalid).
        Costs: one 4-byte all-reduce per calibration batch, two all-gathers at the freeze (the
        channel amaxes, the samples: at most 256 rows per batch). After a resume, `saturation`
        reads the range of the rank's own channels (the gathered one is not kept). Idempotent."""
        ranks = torch.distributed.get_world_size(group)
        self.group, self.whole_channels = group, whole_channels
        self.offset = torch.distributed.get_rank(group) * -(-whole_channels // ranks)
        self.slots = self._slots(self.calibration, whole_channels)

    @staticmethod
    def _slots(calibration: Calibration, channels: int) -> int:
        return outlier_slots(channels) if calibration.outlier_ratio is not None and channels > 1 else 0

    @classmethod
    def state_problem(cls, state: "Mapping[str, Any]", calibration: Calibration, channels: "Collection[int] | None") -> "str | None":
        """What in ``state`` (a `state_dict`) does not fit a calibrator under ``calibration`` with
        one of ``channels`` input channels (None: any count, read from the state), e.g.
        ``"['keep'] has shape (4,), expected (8,)"``; None when it fits. Every tensor's shape is
        checked against the one channel count and outlier slots. Reads shapes only: no host sync."""
        observed = state.get("observed")
        if isinstance(observed, bool) or not isinstance(observed, int) or observed < 0:
            return f"['observed'] = {observed!r:.40} is not a count of batches"
        fields = ("channel_amax", "keep", "frozen_inv", "outlier_index", "outlier_valid")
        for name in fields:
            if name not in state or not (state[name] is None or isinstance(state[name], torch.Tensor)):
                return f"[{name!r}] is a {type(state.get(name)).__name__}, expected a tensor or None"
        samples = state.get("samples")
        if not isinstance(samples, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in samples):
            return f"['samples'] is a {type(samples).__name__}, expected a list of tensors"
        if not isinstance(state.get("errors"), Mapping):
            return f"['errors'] is a {type(state.get('errors')).__name__}, expected a dict"
        # The channel count: the layer's when known, else the first the state shows.
        shown = [state[n].shape[-1] for n in ("channel_amax", "keep") if state[n] is not None and state[n].dim() >= 1]
        shown += [t.shape[-1] for t in samples if t.dim() >= 1]
        allowed = sorted(set(channels)) if channels is not None else shown[:1]
        if not allowed:
            return None if not samples else "['samples'] holds tensors without a channel dimension"
        k = allowed[0] if len(allowed) == 1 else next((c for c in shown if c in allowed), allowed[0])

        def expected(shape: tuple) -> str:
            if len(allowed) == 1 or len(shape) == 0:
                return str(shape)
            return " or ".join(str(shape[:-1] + (c,)) for c in allowed)

        # A row-wise tensor-parallel rank keeps the whole layer's slots (`split_over`).
        whole = state.get("whole_channels", k)
        whole_ok = not isinstance(whole, bool) and isinstance(whole, int) and whole >= k
        slots = cls._slots(calibration, whole if whole_ok else k)
        want: dict[str, "tuple | None"] = {
            "channel_amax": (k,), "keep": (k,), "frozen_inv": (),
            "outlier_index": (slots,) if slots else None, "outlier_valid": (slots,) if slots else None,
        }
        for name in fields:
            value, shape = state[name], want[name]
            if value is None:
                continue
            if shape is None:
                return f"[{name!r}] has shape {tuple(value.shape)}, expected none (this layer's calibration keeps no outlier channels)"
            if tuple(value.shape) != shape:
                return f"[{name!r}] has shape {tuple(value.shape)}, expected {expected(shape)}"
        for i, t in enumerate(samples):
            if t.dim() != 2 or t.shape[1] != k:
                return f"['samples'][{i}] has shape {tuple(t.shape)}, expected {expected((t.shape[0] if t.dim() else 0, k))}"
        if not whole_ok:
            return f"['whole_channels'] = {whole!r:.40} is not a channel count of at least {k}"
        return None

    def _start(self) -> None:
        """Nothing observed, nothing frozen: the state of a new calibrator."""
        self.observed = 0
        self.channel_amax: "torch.Tensor | None" = None
        self.samples: list[torch.Tensor] = []
        self.frozen_inv: "torch.Tensor | None" = None
        # Outlier channels once frozen: indices (slots,), validity (slots,) as 0/1, and the mask of
        # channels quantized to INT8 (channels,) as 0/1.
        self.outlier_index: "torch.Tensor | None" = None
        self.outlier_valid: "torch.Tensor | None" = None
        self.keep: "torch.Tensor | None" = None
        self._errors: dict[str, torch.Tensor] = {}
        # Once frozen: 1 / the largest amax calibrated (outlier channels included), and the amax of
        # the last input quantized with the frozen scale.
        self.covered: "torch.Tensor | None" = None
        self.last_amax: "torch.Tensor | None" = None

    @property
    def calibrating(self) -> bool:
        return self.frozen_inv is None

    @property
    def has_outliers(self) -> bool:
        return self.keep is not None and self.slots > 0

    def to(self, device: torch.device) -> None:
        """Move the state to ``device`` (no-op when it is there): called with every input, so a
        state loaded with any ``map_location`` follows the data, mid-calibration too."""
        probe = self.frozen_inv if self.frozen_inv is not None else self.channel_amax
        if probe is None or probe.device == device:
            return
        for name in ("frozen_inv", "outlier_index", "outlier_valid", "keep", "channel_amax", "covered"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self.samples = [t.to(device) for t in self.samples]
        self._errors = {k: v.to(device) for k, v in self._errors.items()}

    def observe(self, a: torch.Tensor) -> torch.Tensor:
        """Record a (M, K) input while calibrating and return its inverse scale for this pass:
        NaN when ``a`` holds a NaN or an inf, so that the layer's output is NaN and the loss
        scaler skips the step (INT8 codes cannot carry NaN), as FP8's do.

        Calibrating: one per-channel amax, a strided row sample, and on the last batch the freeze
        (a few reductions over the sample). Frozen: one amax of ``a`` (kept for `saturation`) and
        one scalar add (the frozen scale, NaN for a non-finite input); no host sync either way.
        """
        if self.frozen_inv is not None:  # frozen (no longer `calibrating`)
            # inf * 0 and NaN * 0 are NaN, a finite amax adds 0: the frozen scale, or NaN. Under
            # no_grad, not detach(): one aten op fewer, and the scale keeps no graph either way.
            with torch.no_grad():
                current = amax(a)
                if not torch.compiler.is_compiling():  # a Python side effect Dynamo refuses in a checkpoint
                    self.last_amax = current  # kept, not computed on: the scheduler's check reads it (`saturation`)
                return self.frozen_inv.add(current, alpha=0)
        a = a.detach()
        channel = amax(a, dim=0).reshape(-1)
        # A non-finite batch belongs to a step the loss scaler skips (its own scale below is NaN):
        # it must not poison the frozen scale, so its non-finite values count as "not seen".
        finite = torch.nan_to_num(channel, nan=0.0, posinf=0.0, neginf=0.0)
        running = finite if self.channel_amax is None else torch.maximum(self.channel_amax, finite)
        self.channel_amax = running
        step = max(1, a.shape[0] // _ROWS_PER_BATCH)
        self.samples.append(torch.nan_to_num(a[::step][:_ROWS_PER_BATCH].float(), nan=0.0, posinf=0.0, neginf=0.0))
        self.observed += 1
        local = channel.amax()
        current = inverse_scale(amax_over(local.clone(), self.group), Format.INT8)
        if self.group is not None:  # NaN where this rank's slice is, whatever the reduction made of it
            current = current.add(local, alpha=0)
        if self.observed >= self.calibration.batches:
            self._freeze(running)
        return current

    @staticmethod
    def peek(calibrator: "Int8Calibrator | None", a: torch.Tensor) -> torch.Tensor:
        """The inverse scale ``calibrator`` (None: one not made yet) would quantize a (M, K) input
        ``a`` with, observing nothing: the frozen scale (NaN for a non-finite ``a``) once frozen,
        else ``a``'s own, as `observe` returns them; no outlier channels (the caller passes none).
        For a forward that is not training data (a pipeline stage's metadata inference,
        `pipelining`): one amax, no state changed, no host sync."""
        with torch.no_grad():
            current = amax(a)
            if calibrator is not None and calibrator.frozen_inv is not None:
                return calibrator.frozen_inv.to(a.device).add(current, alpha=0)
            return inverse_scale(current, Format.INT8)

    def recalibrate(self) -> None:
        """Forget the frozen scale and observe the next ``batches`` passes again."""
        self._start()

    def _freeze(self, channel_amax: torch.Tensor) -> None:
        """Freeze the scale from the observed samples and ``channel_amax``, the running per-channel amax."""
        cal = self.calibration
        samples = torch.cat(self.samples)
        if self.group is not None:  # the whole input's, as the unsharded layer sees it
            channel_amax, samples = self._gathered(channel_amax), self._gathered(samples)
        keep = torch.ones_like(channel_amax)
        ratio = cal.outlier_ratio
        if self.slots and ratio is not None:  # slots > 0 only where a ratio is set (see __init__)
            top, index = torch.topk(channel_amax, self.slots)
            valid = (top > ratio * channel_amax.median()).float()
            keep = keep.scatter(0, index, 1.0 - valid)
            self.outlier_index, self.outlier_valid = index, valid
        main = samples * keep
        full_max = (channel_amax * keep).amax()
        clip = self._clip(main.abs().flatten(), full_max, cal)
        self.frozen_inv = inverse_scale(clip, Format.INT8)
        self.keep = keep
        self._cover(channel_amax)
        if self.group is not None:
            self._keep_own_channels()
        norm = samples.norm().clamp_min(1e-30)
        calibrated = _fake_int8(main, self.frozen_inv) + samples * (1.0 - keep)
        self._errors = {
            "naive_max_rel_error": (samples - _fake_int8(samples, inverse_scale(amax(samples), Format.INT8))).norm() / norm,
            "calibrated_rel_error": (samples - calibrated).norm() / norm,
            "outlier_channels": (1.0 - keep).sum(),
            "clip": clip,
            "amax": channel_amax.amax(),
        }
        self.samples = []

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` (.., own channels), concatenated along the channels in rank
        order: the whole input's. The tail rank's shorter slice is padded for the all-gather."""
        ranks = torch.distributed.get_world_size(self.group)
        chunk = -(-self.whole_channels // ranks)
        padded = torch.nn.functional.pad(local, (0, chunk - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(ranks)]
        torch.distributed.all_gather(parts, padded, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.whole_channels]

    def _keep_own_channels(self) -> None:
        """The frozen whole-input mask and outlier channels, cut to this rank's slice: its part
        of ``keep``, the outliers by local index, those on other ranks marked invalid (index 0,
        contributing nothing)."""
        lo, hi = self.offset, self.offset + self.channels
        if self.keep is not None:
            self.keep = self.keep[lo:hi].contiguous()
        if self.outlier_index is not None and self.outlier_valid is not None:
            inside = (self.outlier_index >= lo) & (self.outlier_index < hi)
            self.outlier_index = torch.where(inside, self.outlier_index - lo, torch.zeros_like(self.outlier_index))
            self.outlier_valid = self.outlier_valid * inside.to(self.outlier_valid.dtype)

    def saturation(self) -> "torch.Tensor | None":
        """Once frozen, how far past the calibrated range the last eager input went (compiled
        code keeps no amax): its amax over the largest amax calibration saw (all channels); None
        before a frozen eager forward. One scalar kernel, no sync."""
        if self.covered is None or self.last_amax is None:
            return None
        return self.last_amax * self.covered

    def _cover(self, channel_amax: torch.Tensor) -> None:
        """The inverse of the range the frozen calibration saw (all channels), for `saturation`."""
        self.covered = 1.0 / channel_amax.amax().clamp_min(torch.finfo(torch.float32).tiny)

    @staticmethod
    def _clip(values: torch.Tensor, full_max: torch.Tensor, cal: Calibration) -> torch.Tensor:
        if cal.method is CalibrationMethod.MAX or values.numel() == 0:
            return full_max
        if cal.method is CalibrationMethod.PERCENTILE:
            # Subsampled evenly above 2**24 elements (torch.quantile's cap; kept so the clip
            # does not depend on which of the two computes it).
            step = max(1, math.ceil(values.numel() / (1 << 24)))
            return _quantile(values[::step], cal.percentile / 100.0).clamp(max=full_max)
        values = values[:: max(1, values.numel() // _MSE_VALUES)]
        candidates = full_max * torch.linspace(0.01, 1.0, _MSE_GRID, device=values.device)
        inv = inverse_scale(candidates, Format.INT8).unsqueeze(1)
        errors = (_fake_int8(values.unsqueeze(0), inv) - values).pow(2).mean(dim=1)
        return candidates[errors.argmin()]

    @property
    def report(self) -> dict:
        """Calibration quality as plain numbers (empty until frozen). Reading it syncs once."""
        if not self._errors:
            return {}
        values = {k: float(v) for k, v in self._errors.items()}
        values["outlier_channels"] = int(values["outlier_channels"])
        return values

    def state_dict(self) -> dict:
        return {
            "observed": self.observed,
            "channel_amax": self.channel_amax,
            "samples": list(self.samples),
            "frozen_inv": self.frozen_inv,
            "outlier_index": self.outlier_index,
            "outlier_valid": self.outlier_valid,
            "keep": self.keep,
            "errors": dict(self._errors),
            "whole_channels": self.whole_channels,
        }

    def load_state_dict(self, state: dict) -> None:
        self.observed = int(state["observed"])
        self.channel_amax = state["channel_amax"]
        self.samples = list(state["samples"])
        self.frozen_inv = state["frozen_inv"]
        self.outlier_index = state["outlier_index"]
        self.outlier_valid = state["outlier_valid"]
        self.keep = state["keep"]
        self._errors = dict(state["errors"])
        self.whole_channels = int(state.get("whole_channels", self.channels))  # absent before row-wise tensor parallelism
        self.slots = self._slots(self.calibration, self.whole_channels)
        self.covered = self.last_amax = None
        if self.frozen_inv is not None and self.channel_amax is not None:
            self._cover(self.channel_amax)
