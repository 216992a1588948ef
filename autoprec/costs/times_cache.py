"""The in-place times of a model's layers, cached in a JSON file per (layers, device, blocks,
scaling): `load_times` / `save_times`. A cache, so a damaged file is measured again and rewritten
(one warning), and a file of another model, device or scaling is ignored. Written atomically.

Costs: one small JSON read or write per cost model built with ``cache_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._io import atomic_write_text
from ..formats import Format
from ..plan import LayerPrecision, Scaling
from .inplace import InPlaceTimes

__all__ = ["load_times", "precision_key", "save_times"]

logger = logging.getLogger(__name__)


def _times_key(layers: Sequence[str], device: Any, blocks: Sequence[str] = (), scaling: "Mapping[str, Any] | None" = None) -> dict:
    # Blocks and non-default scalings join the key only when there are some, so caches written
    # without any stay valid.
    return {"layers": list(layers), "device": str(device), **({"blocks": list(blocks)} if blocks else {}),
            **({"scaling": dict(scaling)} if scaling else {})}


def precision_key(precisions: "Mapping[Format, LayerPrecision]") -> dict:
    """The formats timed in a non-default scaling or gradient format, as the times file records
    them (each its scaling, and its gradient formats where not the default)."""
    default = Scaling()
    key = {}
    for f, lp in precisions.items():
        default_grad = LayerPrecision(f, scaling=lp.scaling).grad_format
        if lp.scaling != default or lp.grad_format is not default_grad or lp.high_precision_weight_grad:
            grads = {"grad_format": lp.grad_format.value} if lp.grad_format is not default_grad else {}
            if lp.high_precision_weight_grad:
                grads["weight_grad_format"] = lp.weight_grad_format.value
            key[f.value] = {**lp.to_dict()["scaling"], **grads}
    return key


def load_times(path, layers: Sequence[str], formats: Sequence[Format], device: Any,
                blocks: Sequence[str] = (), scaling: "Mapping[str, Any] | None" = None) -> "dict[Format, InPlaceTimes] | None":
    """In-place times saved by `save_times` for exactly these layers and device, covering every
    format in ``formats``; None when there are none (or the file is another model's)."""
    if path is None or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        key = _times_key(layers, device, blocks, scaling)
        if {k: data.get(k) for k in ("layers", "device", "blocks", "scaling")} != {"blocks": None, "scaling": None, **key}:
            return None
        times = {Format.parse(f): InPlaceTimes(t["step_seconds"], t["layer_seconds"], t["extrapolated"],
                                               dict(t.get("forward_seconds", {})), dict(t.get("block_seconds", {})))
                 for f, t in data["times"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        # A cache: damaged (a hand edit, a crash of another tool), it is measured again and rewritten.
        logger.warning("ignoring the damaged timing cache %s (%s: %s); the layers are timed again and it is rewritten", path, type(exc).__name__, exc)
        return None
    return times if all(f in times for f in formats) else None


def save_times(path, layers: Sequence[str], times: "dict[Format, InPlaceTimes]", device: Any, blocks: Sequence[str] = (),
                scaling: "Mapping[str, Any] | None" = None) -> None:
    if path is None:
        return
    data = {**_times_key(layers, device, blocks, scaling), "times": {f.value: dataclasses.asdict(t) for f, t in times.items()}}
    atomic_write_text(Path(path), json.dumps(data, indent=1))
