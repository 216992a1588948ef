"""Correctness probe: FP8 / INT8 linears through the public API, on the shapes that break kernels.

For every scaling configuration in `PROBE_CONFIGS`, one ``nn.Linear`` runs forward + backward under
``autoprec.apply_plan(layer, Plan.uniform(layer, fmt, example, scaling=...))`` on each probe input:
token counts that are not multiples of 16 (1000, 4104), a tiny one (24), a transposed
(non-contiguous) input and a 3-D input. Each input is one row: outputs and gradients finite, their
SQNR against the same layer in plain FP32 above the format's floor, and, where the device has the
kernel, the product ran through it (``runtime.report()``). A last row per configuration saves the
runtime's ``state_dict()`` with ``torch.save``, loads it with ``map_location="cpu"`` and trains a
fresh copy of the layer on the device with it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
from typing import Any, Sequence

import torch
import torch.nn as nn

from ...formats import Format, Granularity, sqnr
from ...plan import Plan, Scaling, ScalingMode
from ...runtime import apply_plan
from ...runtime.layers import kernel_reason
from .rows import Row, error_text, guarded

__all__ = ["PROBE_CONFIGS", "run_probe"]

PROBE_CONFIGS: dict[str, tuple[Format, Scaling]] = {
    "fp8_e4m3/tensor-delayed": (Format.FP8_E4M3, Scaling(Granularity.TENSOR, ScalingMode.DELAYED)),
    "fp8_e4m3/tensor-current": (Format.FP8_E4M3, Scaling(Granularity.TENSOR, ScalingMode.CURRENT)),
    "fp8_e4m3/row-current": (Format.FP8_E4M3, Scaling(Granularity.ROW, ScalingMode.CURRENT)),
    "fp8_e5m2/tensor-delayed": (Format.FP8_E5M2, Scaling(Granularity.TENSOR, ScalingMode.DELAYED)),
    "int8/tensor": (Format.INT8, Scaling()),
}

# SQNR floors in dB for (output, gradients). Round-to-nearest with m mantissa bits leaves noise
# ~6.02(m+1) + 4.8 dB below the signal (uniform error within half a unit in the last place); two
# rounded operands cost 3 dB more: E4M3 ~26 dB, E5M2 ~20 dB (FP8 gradients are E5M2). INT8 with
# a 99.99th-percentile clip of Gaussian data has ~40 dB. Floors keep ~6 dB of margin, so a row
# fails on a broken kernel or scale, not on rounding.
_FLOORS_DB = {Format.FP8_E4M3: (20.0, 14.0), Format.FP8_E5M2: (14.0, 14.0), Format.INT8: (30.0, 30.0)}


def _inputs(tokens: Sequence[int], features: int, device: torch.device, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    first = tokens[0]
    named = {f"tokens{m}": randn(m, features) for m in tokens}
    named[f"transposed{first}"] = randn(features, first).t()  # (first, features), column-major
    named[f"3d_2x{first // 2}"] = randn(2, first // 2, features)
    return named


def _train_once(layer: nn.Linear, runtime, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and weight gradient of one forward + backward under ``runtime``."""
    x = x.detach().requires_grad_(True)
    with runtime:
        out = layer(x)
    grads = torch.autograd.grad(out, (x, layer.weight), grad.to(out.dtype))
    return (out, *grads)


def _compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], fmt: Format) -> tuple[bool, dict]:
    floor_out, floor_grad = _FLOORS_DB[fmt]
    values = [sqnr(w, g) for g, w in zip(got, want)]
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    ok = finite and values[0] >= floor_out and min(values[1:]) >= floor_grad
    # JSON has no infinity; an exact match (inf dB) is written as the string "inf".
    detail: dict[str, Any] = {f"sqnr_{n}_db": v if math.isfinite(v) else "inf" for n, v in zip(("out", "grad_input", "grad_weight"), values)}
    detail.update(finite=finite, floors_db=[floor_out, floor_grad])
    return ok, detail


def _probe_config(
    name: str, fmt: Format, scaling: Scaling, features: tuple[int, int], tokens: Sequence[int], device: torch.device, seed: int
) -> list[Row]:
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        reference = nn.Linear(*features).to(device)
    inputs = _inputs(tokens, features[0], device, generator)
    layer = copy.deepcopy(reference)
    plan = Plan.uniform(layer, fmt, next(iter(inputs.values())), scaling=scaling)
    runtime = apply_plan(layer, plan)
    # The runtime's own decision (row-wise scales are a form of their own: torch 2.11's CPU
    # _scaled_mm refuses them), so a form the installed torch refuses is expected to emulate.
    kernel_expected = kernel_reason(next(iter(plan.layers.values())), device) is None
    rows = []

    def check(x: torch.Tensor, run_layer: nn.Linear, run_runtime) -> tuple[bool, dict]:
        grad = torch.randn(*x.shape[:-1], features[1], device=device, generator=generator)
        got = _train_once(run_layer, run_runtime, x, grad)
        want = _train_once(reference, contextlib.nullcontext(), x, grad)
        ok, detail = _compare(got, want, fmt)
        ops = run_runtime.report().get("", {}).get("ops", {})
        detail["ops"] = ops
        detail["kernel_expected"] = kernel_expected
        if kernel_expected and not all(how.startswith("kernel") for how in ops.values()):
            ok = False
        return ok, detail

    for input_name, x in inputs.items():
        rows.append(guarded(f"probe/{name}/{input_name}", device, functools.partial(check, x, layer, runtime)))

    def reload() -> tuple[bool, dict]:
        buffer = io.BytesIO()
        torch.save(runtime.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, map_location="cpu")
        fresh = copy.deepcopy(reference)
        fresh_runtime = apply_plan(fresh, plan)
        fresh_runtime.load_state_dict(state)
        ok, detail = check(inputs[f"tokens{tokens[0]}"], fresh, fresh_runtime)
        detail["state_bytes"] = buffer.getbuffer().nbytes
        return ok, detail

    rows.append(guarded(f"probe/{name}/state_dict_cpu_reload", device, reload))
    return rows


def run_probe(device: torch.device, features: tuple[int, int], tokens: Sequence[int], seed: int = 0) -> list[Row]:
    """Every `PROBE_CONFIGS` entry on every probe input, plus the state-dict reload: one row each.

    ``features``: the linear's (in, out); ``tokens``: the 2-D token counts (the first also sizes the
    transposed and 3-D inputs). Costs two forward + backward passes per row (autoprec and the FP32
    reference) and a host sync per SQNR; never raises for a failing check.
    """
    rows: list[Row] = []
    for name, (fmt, scaling) in PROBE_CONFIGS.items():
        try:
            rows.extend(_probe_config(name, fmt, scaling, features, tokens, device, seed))
        except Exception as exc:  # noqa: BLE001 -- a plan that cannot be made is one failed row
            rows.append(Row(f"probe/{name}/plan", False, {"error": error_text(exc)}))
    return rows
