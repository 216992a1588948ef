"""Time of a layer's matrix products in a format: measured on the device, or a roofline estimate.

A `TimeModel` gives the seconds of forward + backward of each recorded call (`trace.MatmulCall`)
in each format. Two of them:

- `MeasuredTimeModel` replays each call in isolation: a tiny module whose forward calls the same
  function on random tensors of the recorded layouts (weights as Parameters), run under
  ``apply_plan(replay, Plan({"": LayerPrecision(fmt)}))`` — so the measured path is the runtime's
  own (autocast, ``torch._scaled_mm``, ``torch._int_mm``, emulation, quantization and scaling
  included). Formats are interleaved round by round and the median is kept. Results are cached
  on disk per device, torch version, call layout and format; a warm cache measures nothing.
  A call that cannot run falls back to the roofline estimate.
- `RooflineTimeModel`: ``max(flops / peak, bytes / bandwidth)`` per GEMM plus the cast /
  quantization passes and a fixed cost per kernel, from a table of datasheet peaks or from a
  one-off calibration on the device at hand.

Calls with the same layout (the blocks of a transformer) are measured once.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import warnings
from pathlib import Path
from typing import Callable, Generator, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .._io import atomic_write_text
from ..device import canonical_device, format_support, scaled_mm_form
from ..errors import CostModelError, first_line
from ..formats import Format
from ..plan import LayerPrecision, Plan
from ..runtime import EmulationWarning, apply_plan
from ..device_clock import interleaved, timed
from .memory import call_path, runs_natively
from .targets import DevicePeaks, TargetDevice, datasheet_target
from .trace import MatmulCall

__all__ = [
    "TimingSettings",
    "TimeEstimate",
    "TimeModel",
    "MeasuredTimeModel",
    "RooflineTimeModel",
    "calibrate_peaks",
    "calibration_steps",
    "device_key",
    "default_cache_dir",
]

logger = logging.getLogger(__name__)

CACHE_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TimeEstimate:
    """Seconds of forward + backward of one call in one format; ``source``: ``"measured"``,
    ``"cache"`` or ``"roofline"`` (with the reason when it replaced a measurement)."""

    seconds: float
    source: str


def device_key(device: "torch.device | str") -> str:
    """What timings depend on: the device model and, on CPUs, the ISA and thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm{major}{minor}"
    return f"cpu {_cpu_model()} {torch.backends.cpu.get_cpu_capability()} {torch.get_num_threads()}t"


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def default_cache_dir() -> Path:
    """``~/.cache/autoprec``, resolved when called (never read from the environment at import)."""
    return Path.home() / ".cache" / "autoprec"


class TimeModel:
    """Base class: seconds of forward + backward of recorded calls in formats.

    Subclasses implement `estimate`. The cost model sums a layer's calls, so an estimate must
    cover the whole work of the call in the format: the product, its backward, and the casts,
    quantization and scaling the runtime adds around it.
    """

    def estimate(self, calls: Sequence[MatmulCall], formats: Sequence[Format], device: torch.device) -> dict[tuple[str, Format], TimeEstimate]:
        """``(call.key, format) -> TimeEstimate`` for every call and format."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class TimingSettings:
    """How `CostModel.build` gets its seconds; the default times every layer in place.

    ``in_place``: time every layer where it runs (module docstring) on a copy of the model:
    per format one first step, up to ``warmup_steps`` untimed ones while INT8 layers calibrate,
    and timed ones until each role of layer met more than once (the same projection in every
    block) has ``timed_steps`` samples, 3 to ``timed_steps`` steps (`inplace.measure_in_place`;
    a deep model of repeated blocks: 3). Formats
    asked for later, or whose uniform plan cannot run, are replayed per call with
    `MeasuredTimeModel`, cached under ``cache_dir`` (None: ``~/.cache/autoprec``; False: no
    cache). ``False``: no step runs; per-call `RooflineTimeModel` estimates and a rest of the
    step of 0 s, so predicted step times cover the layers only.

    ``time_model``: per-call times from this model instead; with ``in_place`` only the FP32 step
    is timed, for the rest of the step. ``times_file``: a JSON file the in-place times are read
    from when it holds them for these layers, formats and device, and written to (atomically)
    when measured, so a resumed job predicts exactly what the interrupted one did.
    """

    in_place: bool = True
    warmup_steps: int = 3
    timed_steps: int = 8
    time_model: Optional[TimeModel] = None
    cache_dir: "str | os.PathLike | bool | None" = None
    times_file: "str | os.PathLike | None" = None

    def __post_init__(self):
        def bad(field: str, fix: str) -> CostModelError:
            value = getattr(self, field)
            shown = repr(value) if value is None or isinstance(value, (bool, int, float, str, os.PathLike)) else type(value).__name__
            return CostModelError(f"TimingSettings({field}={shown}): {fix}")

        if not isinstance(self.in_place, bool):
            raise bad("in_place", "must be True (time the layers in place) or False (roofline estimates)")
        for field, least in (("warmup_steps", 0), ("timed_steps", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad(field, f"must be an int >= {least} (training steps per format)")
        if self.time_model is not None and not isinstance(self.time_model, TimeModel):
            raise bad("time_model", "expected a TimeModel (MeasuredTimeModel, RooflineTimeModel or a subclass) or None")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (bool, str, os.PathLike)):
            raise bad("cache_dir", "expected a folder path, None (~/.cache/autoprec) or False (no cache)")
        if self.times_file is not None and not isinstance(self.times_file, (str, os.PathLike)):
            raise bad("times_file", "expected the path of a JSON file, or None")


# -- roofline ---------------------------------------------------------------------------------


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls after ``warmup`` (`device_clock.timed`)."""
    times = [timed(fn, device)[1] for _ in range(warmup + repeats)]
    return statistics.median(times[warmup:])


# Per (device key, device): `calibrate_peaks`'s cache, the peaks and the labels of the timings
# that measured them (`calibration_steps` yields as many whether it measures or not).
_CALIBRATED: dict[tuple[str, str], tuple[DevicePeaks, tuple[str, ...]]] = {}


def _calibrated(key: str, device_str: str) -> DevicePeaks:
    if (key, device_str) not in _CALIBRATED:
        for _ in _measured(key, device_str):
            pass
    return _CALIBRATED[(key, device_str)][0]


def _measured(key: str, device_str: str) -> Iterator[str]:
    """`_measure`'s steps, its peaks and labels cached at the end."""
    labels: list[str] = []
    steps = _measure(key, device_str)
    while True:
        try:
            labels.append(next(steps))
        except StopIteration as done:
            _CALIBRATED[(key, device_str)] = (done.value, tuple(labels))
            return
        yield labels[-1]


# On a CPU each format's GEMM is timed at 256^3 unless a 128^3 call of it predicts a 256^3 one
# over this many seconds: then at 128^3, whose rate is the same where the format is slow for its
# arithmetic (FP16 without FP16 units: 2.9 and 2.7 GFLOP/s), and whose calls stay short (12 ms at
# 256^3, a step of issue 57's 4-block Llama, where a 256^3 timing held its step 8x).
_CPU_CALL_LIMIT_S = 2e-3


def _measure(key: str, device_str: str) -> Generator[str, None, DevicePeaks]:
    """The calibration's timings, one per yield (each format's GEMM, then the copy; the
    1-element op before it returns the peaks). Uncached: each call measures."""
    device = torch.device(device_str)
    # 2048^3 fills a GPU; on a CPU, 256^3 or 128^3 (`_CPU_CALL_LIMIT_S`).
    n = 2048 if device.type == "cuda" else 256
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device)
    b = torch.randn(n, n, generator=gen).to(device)
    flops = {}
    runs: dict[Format, Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]] = {Format.FP32: functools.partial(_cast_mm, dtype=torch.float32)}
    for fmt in (Format.BF16, Format.FP16):
        if format_support(fmt, device).runnable:
            runs[fmt] = functools.partial(_cast_mm, dtype=fmt.dtype)
    for fmt in (Format.FP8_E4M3, Format.FP8_E5M2):
        if format_support(fmt, device).kernel:
            runs[fmt] = functools.partial(_scaled_mm_call, fmt)
    if format_support(Format.INT8, device).kernel:
        runs[Format.INT8] = _int_mm_call
    for fmt, prepare in runs.items():
        size = n
        if device.type == "cpu":
            small = prepare(a[:128, :128].contiguous(), b[:128, :128].contiguous())
            small()  # a first call's setup is not the rate
            if timed(small, device)[1] * 8 > _CPU_CALL_LIMIT_S:
                size = 128
        fn = prepare(a[:size, :size].contiguous(), b[:size, :size].contiguous())
        flops[fmt] = 2 * size**3 / _median_time(fn, device)
        yield fmt.value
    # 8 MB, past the L2 of most CPUs, copied into a buffer written once: a clone allocates anew,
    # and on a CPU paid the pages' first touch every call (2.9 against 16 GB/s copied, 2 CPU cores).
    big = torch.ones(1 << 21, device=device)
    into = torch.zeros_like(big)
    bandwidth = 2 * big.numel() * 4 / _median_time(lambda: into.copy_(big), device)
    yield "bandwidth"
    tiny = torch.ones(1, device=device)
    overhead = _median_time(lambda: tiny + tiny, device, repeats=50)
    return DevicePeaks(key, flops, bandwidth, overhead, f"calibrated on {key}: one GEMM per format ({n}^3, or 128^3 where that is slow), an 8 MB copy, a 1-element add")


def _cast_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> Callable[[], object]:
    """A plain GEMM of ``a`` and ``b`` cast to ``dtype`` (FP32: as they are)."""
    return functools.partial(torch.mm, a.to(dtype), b.to(dtype))


def _scaled_mm_call(fmt: Format, a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    """The runtime's forward call (runtime.gemm): an E4M3 weight, column-major (E5M2 x E5M2 is
    refused on CUDA), BF16 out, and on CPU per-tensor scales in row shape where the installed
    torch takes them, as the runtime does (2.13's CPU per-tensor E4M3 x E4M3 kernel is a slow
    reference path the runtime never takes there; 2.11 refuses rows)."""
    device, n = a.device, a.shape[0]
    a8, b8 = a.to(fmt.dtype), b.t().contiguous().t().to(Format.FP8_E4M3.dtype)
    rows = (
        device.type == "cpu" and fmt is Format.FP8_E4M3
        and scaled_mm_form(canonical_device(device), fmt.dtype, fmt.dtype, torch.bfloat16, row_scales=True, bias=True)[0]
    )
    one = torch.ones((), device=device)
    scale_a = torch.ones(n, 1, device=device) if rows else one
    scale_b = torch.ones(1, n, device=device) if rows else one
    return functools.partial(torch._scaled_mm, a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def _int_mm_call(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    """The runtime's call (runtime.gemm.Int8Linear): the weight (N, K) row-major passed as its
    transpose, a column-major second operand (the TN layout cuBLASLt's INT8 path is built for);
    a row-major one times another, slower kernel and under-rates INT8."""
    ai = a.clamp(-127, 127).to(torch.int8)
    bi = b.clamp(-127, 127).to(torch.int8).t().contiguous().t()
    return functools.partial(torch._int_mm, ai, bi)


def calibrate_peaks(device: "torch.device | str") -> DevicePeaks:
    """Peaks measured on ``device``: one GEMM per format (kernels it lacks run at the FP32
    rate), a copy for bandwidth and a 1-element op for the per-kernel cost. On a CPU each
    format's calls are sized to stay near `_CPU_CALL_LIMIT_S` or under (9 calls a format);
    cached per process."""
    device = torch.device(device)
    return _calibrated(device_key(device), str(device))


def calibration_steps(device: "torch.device | str") -> Iterator[str]:
    """`calibrate_peaks`'s timings on ``device`` as steps (one GEMM per format, the copy),
    filling its cache, for a caller that spreads them (the scheduler's
    search between training steps). As many steps when the cache holds them already (each then
    instant), so the caller's steps do not depend on what ran before in the process; none where
    `peaks_for` would not calibrate (a datasheet GPU)."""
    device = torch.device(device)
    if _datasheet_peaks(device) is not None:
        return
    key = (device_key(device), str(device))
    if key in _CALIBRATED:
        yield from _CALIBRATED[key][1]
    else:
        yield from _measured(*key)


def _datasheet_peaks(device: torch.device) -> Optional[DevicePeaks]:
    """The datasheet entry whose key appears in a CUDA device's name, or None."""
    target = datasheet_target(device)
    return target.peaks if target is not None else None


def peaks_for(device: "torch.device | str") -> DevicePeaks:
    """The datasheet entry whose key appears in the device name, else a calibration."""
    device = torch.device(device)
    peaks = _datasheet_peaks(device)
    return peaks if peaks is not None else calibrate_peaks(device)


def _einsum_flops(equation: str, shapes: Sequence[tuple[int, ...]]) -> Optional[float]:
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if "..." in equation or len(inputs) != len(shapes):
        return None
    sizes = {}
    for letters, shape in zip(inputs, shapes):
        for letter, size in zip(letters, shape):
            sizes[letter] = size
    return 2.0 * math.prod(sizes.values())


def call_flops(call: MatmulCall) -> tuple[float, int]:
    """(forward FLOPs, output elements) of a call, from its shapes (runs it on meta tensors).

    GEMMs: 2·M·K·N; convolutions: 2 · output elements · (weight elements / output channels);
    einsum: 2 · the product of every index size; anything else: 2 · output elements · the last
    dimension of its first operand (the contraction of matmul-like ops).
    """
    tensors = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in call.tensors]
    args, kwargs = call.arguments(tensors)
    try:
        out = call.func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t)]
        out_numel = outs[0].numel() if outs else 0
    except Exception:  # an op without a meta kernel: size the output like its first operand
        out_numel = call.tensors[0].numel
    operands = [s for s in call.tensors if s.operand]
    first = operands[0] if operands else call.tensors[0]
    if call.op.startswith("conv_transpose"):
        w = operands[1]
        return 2.0 * first.numel * (w.numel / w.shape[0]), out_numel
    if call.op.startswith("conv"):
        w = operands[1]
        return 2.0 * out_numel * (w.numel / w.shape[0]), out_numel
    if call.op == "einsum" and isinstance(call.leaves[0], str):
        flops = _einsum_flops(call.leaves[0], [s.shape for s in call.tensors])
        if flops is not None:
            return flops, out_numel
    if call.op == "linear":
        return 2.0 * out_numel * first.shape[-1], out_numel
    return 2.0 * out_numel * (first.shape[-1] if first.shape else 1), out_numel


# Kernels the runtime launches per call (forward + backward), counted from runtime/kernels.py:
# three GEMMs; autocast adds a cast of each operand and of the incoming gradient; Fp8Gemm /
# Int8Gemm add amaxes, quantizations and rescales; the tiled products (block FP8, MXFP8) tile
# and scale each operand of each GEMM; emulation also recomputes the forward.
_KERNELS = {"fp32": 3, "autocast": 6, "kernel": 13, "block": 15, "mx": 15, "emulated": 18, "nvfp4": 24}
# Bytes per element of a tiled product's operands: FP8 and one scale per 128 (block) or 32 (MX)
# elements; NVFP4 half a byte and one E4M3 scale per 16.
_TILED_WIDTH = {"block": 1 + 4 / 128, "mx": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


class RooflineTimeModel(TimeModel):
    """Analytic estimate: per GEMM ``max(flops / peak[format], bytes / bandwidth)``, three GEMMs
    per call (forward, gradient of each operand; four when emulation recomputes the forward),
    plus the cast / quantization passes over operands and gradient at memory bandwidth, plus
    ``overhead_s`` per kernel (on a GPU, launched while earlier ones run: the greater of the
    launches and the work).

    ``peaks``: a `DevicePeaks` (e.g. ``PEAKS["H100"]``); ``None`` picks the datasheet entry that
    matches the device name, else calibrates on the device (`calibrate_peaks`, ~0.5 s on a CPU).
    ``target``: price every call as it would run on that device instead (`targets.TargetDevice`:
    its rates, and a kernel where it has one; the device the calls were traced on is then only
    where their shapes come from). ``precisions``: format -> the `LayerPrecision` it is priced in
    (its scaling picks the tiled products: block FP8, MXFP8); default each format's own.
    INT8 backward runs in FP32 (`Int8Gemm`), FP8 backward in FP8 (`Fp8Gemm`), the tiled products'
    every GEMM in their format (NVFP4's at the FP4 rate); a high-precision backward (FP32
    gradients of an FP8, MXFP8 or NVFP4 layer) at the BF16 rate, the region's usual dtype.
    """

    def __init__(self, peaks: Optional[DevicePeaks] = None, *, target: "TargetDevice | None" = None,
                 precisions: "Mapping[Format, LayerPrecision] | None" = None):
        self.peaks = target.peaks if target is not None else peaks
        self.target = target
        self.precisions = dict(precisions or {})

    def seconds(self, call: MatmulCall, fmt: Format, device: torch.device) -> float:
        peaks = self.peaks if self.peaks is not None else peaks_for(device)
        fmt = Format.parse(fmt)
        precision = self.precisions.get(fmt, LayerPrecision(fmt))
        path, _ = call_path(call, precision, device, self.target)
        kernels = _KERNELS[path]
        if path in _TILED_WIDTH and not runs_natively(precision, device, self.target):
            path = "emulated"  # a tiled product without its kernel: FP32 GEMMs on the decoded tiles, as many casts
        flops, out_numel = call_flops(call)
        high_backward = precision.grad_format is Format.FP32 and (fmt.is_fp8 or fmt is Format.NVFP4)
        # Per GEMM: the weight gradient's alone in high precision (the input gradient's low).
        high_weight_grad = precision.high_precision_weight_grad
        operand_numel = sum(s.numel for s in call.tensors if s.operand)
        out_width = 2 if path in ("autocast", *_TILED_WIDTH) else 4  # FP8 / INT8 kernels return FP32 here

        def gemm(fmt_used: Format, in_width: float) -> float:
            moved = operand_numel * in_width + out_numel * out_width
            return max(flops / peaks.peak(fmt_used), moved / peaks.bandwidth)

        if path == "fp32":
            gemms = 3 * gemm(Format.FP32, 4)
            passes = 0.0
        elif path == "autocast":
            gemms = 3 * gemm(fmt, 2)
            passes = 6.0 * (operand_numel + out_numel)  # read 4 + write 2 bytes per cast element
        elif path == "kernel":
            if fmt is Format.INT8:
                backward = gemm(Format.FP32, 4)
            else:  # a high-precision backward (FP32 gradients) runs in the region's half dtype, BF16 taken
                backward = gemm(Format.BF16, 2) if high_backward else gemm(fmt, 1)
            weight_grad = gemm(Format.BF16, 2) if high_weight_grad else backward
            gemms = gemm(fmt, 1) + backward + weight_grad
            if high_backward:
                # amax (read 4) + quantize (read 4, write 1) of the operands in the forward; the
                # backward dequantizes them (read 1, write 2) and casts no gradient.
                passes = 12.0 * operand_numel
            elif high_weight_grad:
                # The same forward casts and dequantizations, and the gradient cast once (for the
                # input gradient's GEMM).
                passes = 12.0 * operand_numel + 9.0 * out_numel
            else:
                # amax (read 4) + quantize (read 4, write 1) of operands in forward and backward, and of the gradient.
                passes = 9.0 * (2 * operand_numel + out_numel)
        elif path in _TILED_WIDTH:
            backward = gemm(Format.BF16, 2) if high_backward else gemm(fmt, _TILED_WIDTH[path])
            gemms = gemm(fmt, _TILED_WIDTH[path]) + backward + (gemm(Format.BF16, 2) if high_weight_grad else backward)
            # As the kernel path's casts, each tile's amax fused into its cast (read 4, write the
            # tiled width and scales): the operands in the forward's and the backward's layouts,
            # the gradient once; NVFP4's weight-gradient operands also pass through the Hadamard
            # transform (read and write 2).
            width = _TILED_WIDTH[path]
            if high_backward:  # the forward's tiles only, dequantized by the backward (read them, write 2); no gradient cast or transform
                passes = (4 + width) * operand_numel + (width + 2) * operand_numel
            elif high_weight_grad:  # as above, and the gradient tiled once (for the input gradient's GEMM), no transform
                passes = (4 + width) * (operand_numel + out_numel) + (width + 2) * operand_numel
            else:
                passes = (4 + width) * (2 * operand_numel + out_numel) + (4.0 * (operand_numel + out_numel) if path == "nvfp4" else 0.0)
        else:
            gemms = 4 * gemm(Format.FP32, 4)
            passes = 9.0 * (2 * operand_numel + out_numel)
        work, launches = gemms + passes / peaks.bandwidth, kernels * peaks.overhead_s
        if self.target is not None or device.type == "cuda":
            # A GPU runs the kernels while the host launches the next ones: the slower of the two.
            return max(work, launches)
        return work + launches

    def estimate(self, calls, formats, device):
        device = torch.device(device)
        source = f"roofline, {self.target.name}" if self.target is not None else "roofline"
        return {
            (call.key, Format.parse(fmt)): TimeEstimate(self.seconds(call, fmt, device), source)
            for call in _unique(calls) for fmt in formats
        }


# -- measured ---------------------------------------------------------------------------------


def _unique(calls: Sequence[MatmulCall]) -> list[MatmulCall]:
    seen: dict[str, MatmulCall] = {}
    for call in calls:
        seen.setdefault(call.key, call)
    return list(seen.values())


class _Replay(nn.Module):
    """A module whose forward runs one recorded call on random tensors of its layouts.

    Weight arguments are Parameters of the module (views of one where the call got a view, such
    as ``w.t()``), so the runtime treats them as weights; activations are leaf tensors (or views
    of one) requiring grad as recorded. Values are N(0, 1) scaled by 1/sqrt(fan-in) for weights.
    """

    def __init__(self, call: MatmulCall, device: torch.device, seed: int = 0):
        super().__init__()
        self.call = call
        gen = torch.Generator().manual_seed(seed)
        self._weights: list = []
        self._inputs: list = []
        for i, s in enumerate(call.tensors):
            if s.weight:
                scale = 1 / math.sqrt(max(s.shape[-1] if s.shape else 1, 1))
                if s.param:  # the Parameter itself, in its own layout
                    data = torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device)
                    data.copy_(torch.randn(s.shape, generator=gen) * scale)
                else:  # a view of a Parameter (w.t()): the Parameter is its whole storage
                    data = (torch.randn(s.storage_numel, generator=gen) * scale).to(device=device, dtype=s.dtype)
                param = nn.Parameter(data, s.requires_grad)
                self.register_parameter(f"w{i}", param)
                self._weights.append((i, param, s))
            elif s.dtype.is_floating_point:
                dense = s.numel == s.storage_numel and s.offset == 0 and _contiguous(s)
                base = torch.randn(s.numel if dense else s.storage_numel, generator=gen).to(device=device, dtype=s.dtype)
                base.requires_grad_(s.requires_grad)
                self._inputs.append((i, base, s, dense))
            else:  # integer / bool arguments (indices, masks): zeros of the recorded layout
                self._inputs.append((i, torch.zeros(s.storage_numel, dtype=s.dtype, device=device), s, False))

    def inputs(self) -> list[torch.Tensor]:
        """Fresh views of the activation leaves (made outside the timed region)."""
        return [base.view(s.shape) if dense else base.as_strided(s.shape, s.stride, s.offset) for _, base, s, dense in self._inputs]

    def zero_grad_all(self) -> None:
        for _, t, _, _ in self._inputs:
            t.grad = None
        for p in self.parameters():
            p.grad = None

    def forward(self, *inputs):
        tensors: list = [None] * len(self.call.tensors)
        for (i, _, _, _), x in zip(self._inputs, inputs):
            tensors[i] = x
        for i, param, s in self._weights:
            tensors[i] = param if s.param else param.as_strided(s.shape, s.stride, s.offset)
        args, kwargs = self.call.arguments(tensors)
        return self.call.func(*args, **kwargs)


def _contiguous(s) -> bool:
    expected, stride = [], 1
    for d in reversed(s.shape):
        expected.append(stride)
        stride *= d
    return all(d == 1 or st == ex for d, st, ex in zip(s.shape, s.stride, reversed(expected)))


class _ReplayStep:
    """One format of one call: builds the replay and its runtime once; each ``()`` runs one
    forward + backward and returns its seconds (forward inside the runtime, backward after it;
    entering and leaving the runtime is per training step, not per call, and is not timed)."""

    def __init__(self, call: MatmulCall, fmt: Format, device: torch.device):
        self.device = device
        self.replay = _Replay(call, device)
        self.runtime = apply_plan(self.replay, Plan({"": LayerPrecision(fmt)}))
        self.grads: Optional[list[torch.Tensor]] = None

    def __call__(self) -> float:
        self.replay.zero_grad_all()
        inputs = self.replay.inputs()
        with self.runtime:
            out, forward = timed(lambda: self.replay(*inputs), self.device)
        outs = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
        if self.grads is None:
            gen = torch.Generator().manual_seed(1)
            self.grads = [torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype) for t in outs]
        grads = self.grads
        _, backward = timed(lambda: torch.autograd.backward(outs, grads) if outs else None, self.device)
        return forward + backward


def _time_replays(steps: Sequence[Callable[[], float]], warmup: int, repeats: int) -> list[list[float]]:
    """Run every step ``warmup + repeats`` rounds, interleaved (`device_clock.interleaved`: one of each
    per round, the first rotated, as autoprec.bench does); the seconds of the timed rounds.
    Collects garbage once before, so no collection lands in a timed round of one format only."""
    gc.collect()
    return interleaved(steps, warmup, repeats)


class MeasuredTimeModel(TimeModel):
    """Times each call in each format on the device (see the module docstring), cached on disk.

    ``cache_dir``: where ``times-<device>.json`` files live (default ``~/.cache/autoprec``,
    resolved at construction); ``None`` for the default, ``False`` for no disk cache.
    ``warmup`` rounds are untimed; the default 5 lets INT8 finish calibrating
    (`Calibration().batches` = 4 forwards) before timing. ``repeats``: timed rounds, median kept.
    ``fallback``: used where a replay cannot run (default `RooflineTimeModel`).

    Cost: ``(warmup + repeats)`` forward + backward passes per distinct call and format, all
    formats of a call interleaved; nothing for entries already in the cache.
    """

    def __init__(self, cache_dir: "str | os.PathLike | None | bool" = None, *, warmup: int = 5, repeats: int = 9, fallback: Optional[TimeModel] = None):
        for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CostModelError(f"MeasuredTimeModel({name}={value!r}): must be an int >= {least}")
        if cache_dir is False:
            self.cache_dir = None
        else:
            self.cache_dir = default_cache_dir() if cache_dir is None or cache_dir is True else Path(cache_dir)
            if self.cache_dir.exists() and not self.cache_dir.is_dir():
                raise CostModelError(f"MeasuredTimeModel(cache_dir={str(self.cache_dir)!r}): exists and is not a folder; pass a folder")
        self.warmup = warmup
        self.repeats = repeats
        self.fallback = fallback if fallback is not None else RooflineTimeModel()
        self.measured_calls = 0  # (call, format) pairs timed by this instance

    def cache_path(self, device: torch.device) -> Optional[Path]:
        if self.cache_dir is None:
            return None
        key = f"{device_key(device)} torch {torch.__version__}"
        slug = re.sub(r"[^A-Za-z0-9]+", "-", device_key(device)).strip("-")[:60]
        return self.cache_dir / f"times-{slug}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"

    def _load(self, path: Optional[Path]) -> dict:
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema_version") != CACHE_SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r}")
            return dict(data["entries"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("ignoring unreadable timing cache %s (%s); it will be rewritten", path, exc)
            return {}

    def _save(self, path: Path, device: torch.device, new: dict) -> None:
        entries = self._load(path)  # merge with what another process may have written meanwhile
        entries.update(new)
        data = {"schema_version": CACHE_SCHEMA_VERSION, "device": device_key(device), "torch": torch.__version__, "entries": entries}
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")

    def estimate(self, calls, formats, device):
        device = torch.device(device)
        formats = [Format.parse(f) for f in formats]
        path = self.cache_path(device)
        cached = self._load(path)
        result: dict[tuple[str, Format], TimeEstimate] = {}
        new: dict[str, dict] = {}
        for call in _unique(calls):
            missing = []
            for fmt in formats:
                entry = cached.get(f"{fmt.value}|{call.key}")
                if isinstance(entry, dict) and isinstance(entry.get("seconds"), (int, float)) and entry["seconds"] > 0:
                    result[(call.key, fmt)] = TimeEstimate(float(entry["seconds"]), "cache")
                else:
                    missing.append(fmt)
            if not missing:
                continue
            steps, timed_formats = [], []
            for fmt in missing:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", EmulationWarning)
                        step = _ReplayStep(call, fmt, device)
                        step()  # fails here, not mid-measurement, when the format cannot run
                    steps.append(step)
                    timed_formats.append(fmt)
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
                    reason = first_line(exc)
                    logger.warning("cannot time %s in %s on %s (%s); using the roofline estimate", call.op, fmt.value, device, reason)
                    estimate = self.fallback.estimate([call], [fmt], device)[(call.key, fmt)]
                    result[(call.key, fmt)] = TimeEstimate(estimate.seconds, f"{estimate.source} ({reason})")
            if not steps:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EmulationWarning)
                times = _time_replays(steps, self.warmup, self.repeats)
            self.measured_calls += len(steps)
            for fmt, seconds in zip(timed_formats, times):
                median = statistics.median(seconds)
                result[(call.key, fmt)] = TimeEstimate(median, "measured")
                new[f"{fmt.value}|{call.key}"] = {"seconds": median, "repeats": len(seconds), "min": min(seconds), "max": max(seconds)}
        if new and path is not None:
            self._save(path, device, new)
        return result

