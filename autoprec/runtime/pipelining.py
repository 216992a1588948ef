"""Pipeline parallelism: ``torch.distributed.pipelining``'s metadata inference changes no runtime state.

A ``PipelineStage`` built without its inputs' and outputs' shapes infers them on the first
``schedule.step()``, inside the user's ``with runtime:``, by running the stage's module:

- torch 2.13: ``PipelineStage._forward_metadata_inference`` runs its forward (the first stage on
  the real first micro-batch, later stages on uninitialised ``torch.empty`` tensors made from the
  received metadata), under ``torch.enable_grad`` when a backward follows, then
  ``_backward_metadata_inference`` a backward with ones as output gradients;
- torch 2.11: ``PipelineStage._shape_inference`` runs its forward under ``torch.no_grad`` on zeros.

Those calls are not training: INT8 calibration would observe them (a calibration batch spent on
garbage, or on the first micro-batch twice), delayed FP8 scaling would record their amaxes, the
profiler would count them. So each forward of a runtime's model (its root module) looks up the
Python stack for those functions' frames (`in_metadata_inference`): inside one, the forward still
runs the plan's kernels (its outputs keep their dtypes and shapes, which is what the stage infers)
but `inferring` is true, which `recompute.training_forward` reads (no amax history recorded, no
profiler or output-watch statistics) and the INT8 products read (the scale the calibrator would
use, nothing observed). It stays true until the model's next forward or the runtime's exit, so
torch 2.13's backward inference that follows is covered too (the runtime's backward keeps no
state of its own: gradients are scaled from their own amax).

Costs: nothing unless ``torch.distributed.pipelining`` was imported when the runtime was entered
(one dict lookup per entry until then); then one forward pre-hook on the model (registered at
that entry, removed with the runtime) and, per forward of the model under the runtime, one walk
up the Python stack (as `recompute`'s look-up for a reentrant checkpoint: tens of frames), never
per layer. Nothing in the products of a training forward (`tests/bench/test_opcount.py`). Eager
only: under ``torch.compile`` nothing is looked up, and a compiled stage's inference is not
recognised. A stage whose module is a part of the planned model (not the model the runtime was
made for) is not recognised either: apply the plan to each stage's module, as a pipeline split
(torchtitan's) makes it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import CodeType, FrameType, ModuleType
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["inferring", "in_metadata_inference", "in_stage", "stage_index", "loaded", "look_up", "watch", "leave"]

_STAGE = "torch.distributed.pipelining.stage"
# The PipelineStage methods that run the stage's module to infer shapes, per torch version:
# 2.13 (and the 2.12 line) `_forward_metadata_inference` and `_backward_metadata_inference` (which
# calls the schedule's loss function on the inferred output: not a training loss); 2.11 `_shape_inference`.
_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


class _State(threading.local):
    def __init__(self):
        self.inferring = False


_state = _State()


def inferring() -> bool:
    """Whether the calling thread's planned model runs a pipelining metadata inference (module
    docstring). Costs a thread-local read; False under ``torch.compile`` (folded, nothing read)."""
    return not torch.compiler.is_compiling() and _state.inferring


def loaded() -> bool:
    """Whether ``torch.distributed.pipelining`` is imported (no stage can exist before). One dict lookup."""
    return _STAGE in sys.modules


@functools.cache
def _codes(stage: ModuleType) -> frozenset:
    cls = getattr(stage, "PipelineStage", None)
    return frozenset(getattr(cls, name).__code__ for name in _INFERENCE if hasattr(cls, name))


def in_metadata_inference(frame: "FrameType | None") -> bool:
    """Whether ``frame`` or a frame above it runs one of `_INFERENCE`. One walk up the stack."""
    stage = sys.modules.get(_STAGE)
    if stage is None:
        return False
    codes = _codes(stage)
    return _any_frame(frame, lambda code: code in codes)


def in_stage(frame: "FrameType | None") -> bool:
    """Whether ``frame`` or a frame above it runs code of ``torch.distributed.pipelining`` (a
    stage's forward or backward, run by a schedule). One walk up the stack."""
    stage = sys.modules.get(_STAGE)
    if stage is None or stage.__file__ is None:
        return False
    folder = os.path.dirname(stage.__file__)
    return _any_frame(frame, lambda code: os.path.dirname(code.co_filename) == folder)


def stage_index(frame: "FrameType | None") -> "int | None":
    """The ``stage_index`` of the ``PipelineStage`` whose method runs in ``frame`` or a frame
    above it (the stage a schedule runs the module for), None outside one. One walk up the
    stack, reading each frame's ``self``."""
    stage = sys.modules.get(_STAGE)
    base = getattr(stage, "_PipelineStageBase", None)
    while frame is not None and base is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, base):
            return int(owner.stage_index)
        frame = frame.f_back
    return None


def _any_frame(frame: "FrameType | None", runs: Callable[[CodeType], bool]) -> bool:
    """Whether ``runs`` holds for the code of ``frame`` or of a frame above it."""
    while frame is not None:
        if runs(frame.f_code):
            return True
        frame = frame.f_back
    return False


def watch(model: nn.Module, active: Any) -> RemovableHandle:
    """Look up, at each forward of ``model`` while ``active()`` (the runtime is on for the calling
    thread), whether it is a metadata inference, and say so to `inferring`. A plain function as
    the hook, so that ``copy.deepcopy(model)`` copies a reference (the copy's calls are not this
    model's: ignored). Remove the returned handle with the runtime."""

    def starts(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or module is not model or not active():
            return
        _state.inferring = in_metadata_inference(sys._getframe(1))

    return model.register_forward_pre_hook(starts)


def look_up(frame: "FrameType | None") -> None:
    """Say to `inferring` whether ``frame`` runs inside a metadata inference: for a forward that
    started before its runtime's `watch` was registered. One walk up the stack."""
    _state.inferring = in_metadata_inference(frame)


def leave() -> None:
    """The runtime's exit: no inference runs past it."""
    _state.inferring = False
