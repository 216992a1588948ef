"""Devices a plan is priced for: their GEMM rates (`DevicePeaks`) and, for a device the machine
is not (`TargetDevice`), which low-precision products run on a kernel there.

A search prices a plan's matrix products on the device it runs on (measured in place, or a
roofline from these rates). To plan for a GPU the machine is not (a B200's NVFP4 and MXFP8 from
a workstation), a search takes a target: its layers are then priced by `RooflineTimeModel` at
the target's rates and on the kernel paths the target has, and its plans say the seconds are
predicted, never measured. The numerics (sensitivity, the measured loss) stay this machine's:
every format's rounding is emulated exactly where it has no kernel.

A target is a name of `TARGETS` (published dense datasheet rates) or a JSON profile of a device's
measured or published rates::

    {"name": "NVIDIA B200", "source": "datasheet", "bandwidth_tb_s": 8,
     "tflops": {"fp32": 80, "bf16": 2250, "fp16": 2250, "fp8_e4m3": 4500, "int8": 4500, "nvfp4": 9000},
     "kernels": ["fp8", "fp8_block", "mxfp8", "nvfp4", "int8"], "kernel_overhead_us": 5}

``kernels`` names the products the device runs on a kernel (`KERNEL_ROUTES`); a format missing
from ``tflops`` runs at the FP32 rate. Costs: plain arithmetic; loading a profile reads one file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import CostModelError
from ..formats import Format, Granularity
from ..layer_precision import LayerPrecision

__all__ = ["DevicePeaks", "PEAKS", "TargetDevice", "TARGETS", "KERNEL_ROUTES", "kernel_route", "load_target", "datasheet_target"]


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """Dense GEMM throughput per format (FLOP/s; a format missing runs at the FP32 rate),
    memory bandwidth (bytes/s) and fixed cost per kernel (s), with where the numbers come from."""

    name: str
    flops: Mapping[Format, float]
    bandwidth: float
    overhead_s: float
    source: str

    def peak(self, fmt: Format) -> float:
        return self.flops.get(fmt, self.flops[Format.FP32])


_T = 1e12
# Eager PyTorch costs a few microseconds per launched kernel (CUDA launch latency plus dispatch);
# an order of magnitude, not a datasheet number. Calibrated devices measure it.
_GPU_KERNEL_OVERHEAD_S = 5e-6
_HOPPER = {Format.FP32: 67 * _T, Format.BF16: 989 * _T, Format.FP16: 989 * _T, Format.FP8_E4M3: 1979 * _T, Format.FP8_E5M2: 1979 * _T,
           Format.INT8: 1979 * _T}
PEAKS: dict[str, DevicePeaks] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (https://www.nvidia.com/en-us/data-center/h100/):
    # dense (half the "with sparsity" figures): BF16/FP16 989, FP8 1979, INT8 1979 TOPS; FP32
    # without tensor cores 67 (torch keeps FP32 matmuls off TF32 by default,
    # torch.backends.cuda.matmul.allow_tf32 = False); HBM3 3.35 TB/s.
    "H100": DevicePeaks("NVIDIA H100 SXM5", _HOPPER, 3.35e12, _GPU_KERNEL_OVERHEAD_S, "NVIDIA H100 SXM5 datasheet (dense)"),
    # NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): the H100's compute
    # with HBM3e at 4.8 TB/s.
    "H200": DevicePeaks("NVIDIA H200 SXM", _HOPPER, 4.8e12, _GPU_KERNEL_OVERHEAD_S, "NVIDIA H200 SXM datasheet (dense)"),
    # NVIDIA A100 datasheet, 80GB SXM column (https://www.nvidia.com/en-us/data-center/a100/):
    # FP32 19.5, BF16/FP16 312, INT8 624 TOPS dense; no FP8 (emulated at the FP32 rate); 2.039 TB/s.
    "A100": DevicePeaks(
        "NVIDIA A100 SXM 80GB",
        {Format.FP32: 19.5 * _T, Format.BF16: 312 * _T, Format.FP16: 312 * _T, Format.INT8: 624 * _T},
        2.039e12, _GPU_KERNEL_OVERHEAD_S, "NVIDIA A100 80GB SXM datasheet (dense)",
    ),
    # NVIDIA HGX B200 datasheet, per GPU (https://www.nvidia.com/en-us/data-center/hgx/), dense
    # (half the "with sparsity" figures): FP4 9, FP8 / INT8 4.5, BF16 / FP16 2.25 PFLOPS; FP32 80
    # TFLOPS; HBM3e 8 TB/s. MXFP8 runs at the FP8 rate.
    "B200": DevicePeaks(
        "NVIDIA B200 (HGX)",
        {Format.FP32: 80 * _T, Format.BF16: 2250 * _T, Format.FP16: 2250 * _T, Format.FP8_E4M3: 4500 * _T, Format.FP8_E5M2: 4500 * _T,
         Format.INT8: 4500 * _T, Format.NVFP4: 9000 * _T},
        8e12, _GPU_KERNEL_OVERHEAD_S, "NVIDIA HGX B200 datasheet (dense)",
    ),
}

# The low-precision products a device may run on a kernel, by name (`kernel_route`): FP8 with one
# scale per tensor or per row (`torch._scaled_mm`), E4M3 with DeepSeek-V3's 1x128 / 128x128 block
# scales, MXFP8 (E8M0 scales per 32 elements), NVFP4 (E4M3 scales per 16 elements), INT8
# (`torch._int_mm`). BF16, FP16 and FP32 run natively everywhere.
KERNEL_ROUTES = ("fp8", "fp8_block", "mxfp8", "nvfp4", "int8")


def kernel_route(precision: LayerPrecision) -> "str | None":
    """Which of `KERNEL_ROUTES` a layer in ``precision`` needs for its products to run on a
    kernel; None for BF16, FP16 and FP32 (native on every device)."""
    fmt = precision.format
    if fmt is Format.NVFP4:
        return "nvfp4"
    if fmt is Format.INT8:
        return "int8"
    if not fmt.is_fp8:
        return None
    granularity = precision.scaling.granularity
    if granularity is Granularity.MX:
        return "mxfp8"
    return "fp8_block" if granularity is Granularity.BLOCK else "fp8"


@dataclasses.dataclass(frozen=True)
class TargetDevice:
    """A device a plan is priced for that the machine need not be: its rates (`DevicePeaks`)
    and the `KERNEL_ROUTES` it runs on a kernel (the rest it would emulate)."""

    peaks: DevicePeaks
    kernels: frozenset

    @property
    def name(self) -> str:
        return self.peaks.name

    def runs(self, precision: LayerPrecision) -> bool:
        """Whether a layer in ``precision`` runs its products on a kernel there."""
        route = kernel_route(precision)
        return route is None or route in self.kernels

    def to_dict(self) -> dict:
        """What a plan records of it (its ``metadata["target"]``)."""
        return {"name": self.peaks.name, "source": self.peaks.source, "kernels": sorted(self.kernels),
                "tflops": {f.value: v / _T for f, v in self.peaks.flops.items()}, "bandwidth_tb_s": self.peaks.bandwidth / 1e12}


_HOPPER_KERNELS = frozenset({"fp8", "fp8_block", "int8"})
# Hopper (sm_90) runs FP8 per tensor, per row and in DeepSeek-V3's blocks; MXFP8 and NVFP4 need
# Blackwell's (sm_100) block-scaled tensor cores; Ampere has INT8 only.
TARGETS: dict[str, TargetDevice] = {
    "H100": TargetDevice(PEAKS["H100"], _HOPPER_KERNELS),
    "H200": TargetDevice(PEAKS["H200"], _HOPPER_KERNELS),
    "A100": TargetDevice(PEAKS["A100"], frozenset({"int8"})),
    "B200": TargetDevice(PEAKS["B200"], frozenset(KERNEL_ROUTES)),
}


def datasheet_target(device: "torch.device | str") -> "TargetDevice | None":
    """The entry of `TARGETS` whose key appears in a CUDA device's name (``NVIDIA H200`` -> H200),
    or None (a CPU, or a GPU with no datasheet entry). One device query."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((target for key, target in TARGETS.items() if key in name), None)


def load_target(spec: "str | os.PathLike | TargetDevice", base: "Path | None" = None) -> TargetDevice:
    """A target from a name of `TARGETS` (any case) or the path of a JSON profile (module
    docstring; relative to ``base`` when given). `CostModelError` in one line naming what is
    wrong and the fix."""
    if isinstance(spec, TargetDevice):
        return spec
    text = os.fspath(spec)
    known = next((t for key, t in TARGETS.items() if key.lower() == text.lower()), None)
    if known is not None:
        return known
    path = Path(text).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.suffix == ".json":
        raise CostModelError(f"target {text!r}: not a known device ({', '.join(TARGETS)}) nor a .json profile; name one, or give a profile's path")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CostModelError(f"target {text!r}: cannot read the profile ({exc.strerror or exc}); check the path") from None
    except json.JSONDecodeError as exc:
        raise CostModelError(f"target {text!r}: not JSON (line {exc.lineno}: {exc.msg})") from None
    return _profile(data, str(path))


def _profile(data: Any, where: str) -> TargetDevice:
    def bad(field: str, fix: str) -> CostModelError:
        return CostModelError(f"{where}: {field}: {fix}")

    if not isinstance(data, dict):
        raise bad("the profile", 'expected a JSON object with "name", "tflops", "bandwidth_tb_s" and "kernels"')
    unknown = sorted(set(data) - {"name", "source", "tflops", "bandwidth_tb_s", "kernels", "kernel_overhead_us"})
    if unknown:
        raise bad(unknown[0], 'unknown key; the keys are "name", "source", "tflops", "bandwidth_tb_s", "kernels", "kernel_overhead_us"')
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("name", "expected the device's name, a string")

    def positive(field: str, value: Any, what: str) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
        raise bad(field, f"expected {what}, a positive number, got {value!r}")

    tflops = data.get("tflops")
    if not isinstance(tflops, dict) or "fp32" not in tflops:
        raise bad("tflops", 'expected a table of format name -> dense TFLOP/s with "fp32" in it, e.g. {"fp32": 67, "bf16": 989}')
    flops = {}
    for key, value in tflops.items():
        try:
            fmt = Format.parse(key)
        except ValueError:
            raise bad(f"tflops.{key}", f"not a format; formats are {', '.join(f.value for f in Format)}") from None
        flops[fmt] = positive(f"tflops.{key}", value, "its dense TFLOP/s") * _T
    bandwidth = positive("bandwidth_tb_s", data.get("bandwidth_tb_s"), "the memory bandwidth in TB/s") * 1e12
    overhead = positive("kernel_overhead_us", data.get("kernel_overhead_us", _GPU_KERNEL_OVERHEAD_S * 1e6), "the fixed cost of one kernel in microseconds") * 1e-6
    kernels = data.get("kernels")
    if not isinstance(kernels, list) or any(k not in KERNEL_ROUTES for k in kernels):
        wrong = next((k for k in kernels if k not in KERNEL_ROUTES), None) if isinstance(kernels, list) else kernels
        raise bad("kernels", f"expected a list of {', '.join(map(repr, KERNEL_ROUTES))} (the products it runs on a kernel; [] for none), got {wrong!r}")
    source = data.get("source", where)
    if not isinstance(source, str):
        raise bad("source", "expected a string saying where the rates come from")
    return TargetDevice(DevicePeaks(name, flops, bandwidth, overhead, source), frozenset(kernels))
