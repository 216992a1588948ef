"""What every section of the GPU suite reports: a `Row` per check, and `guarded` to make one
failure a row instead of the end of the run."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable

import torch

__all__ = ["Row", "guarded", "error_text", "free_memory"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Row:
    """One result: ``name`` (section/what), ``ok`` (None: not run, ``detail`` says why), and
    ``detail`` (JSON-ready values)."""

    name: str
    ok: "bool | None"
    detail: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def error_text(exc: BaseException) -> str:
    """``"Type: first line of the message"``: enough to recognise a failure in a JSON row."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached CUDA blocks, so one measurement's memory (or an
    out-of-memory failure) does not weigh on the next. One collection; syncs on CUDA."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def guarded(name: str, device: torch.device, measure: Callable[[], "tuple[bool, dict[str, Any]]"]) -> Row:
    """``Row(name, *measure())``, or a failed row carrying the error when ``measure`` raises.

    Any ``Exception`` (a kernel that refuses a shape, CUDA out of memory, a compile error) is
    caught, logged and recorded, so the suite always reaches its report.
    """
    try:
        ok, detail = measure()
    except Exception as exc:  # noqa: BLE001 -- the suite's contract: one failure is one row
        logger.info("%s failed", name, exc_info=True)
        ok, detail = False, {"error": error_text(exc)}
    finally:
        free_memory(device)
    return Row(name, ok, detail)
