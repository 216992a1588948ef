"""Scaling state per operand role: one quantizer for a layer's input, one for its weight.

A layer's FP8 / INT8 matrix product has three operands: the input (activation), the weight, and in
backward the gradient of the output. State is kept per *role*, never per call order (an index of
"the i-th product of this forward" breaks under data-dependent control flow):

- `InputQuantizer` owns how the input is scaled: current (this tensor's amax) or delayed (an amax
  history of earlier steps), per tensor or per row. INT8 inputs use the `Int8Calibrator` instead.
- `WeightQuantizer` quantizes the weight on every forward (as torchao does): a weight can change
  without any sign a cache could key on (``p.data -= lr * p.grad``, an EMA update, FSDP2's
  all-gather into re-allocated storage under ``_unsafe_preserve_version_counter``), so a copy
  is reused only where the caller vouches that the weights did not change: inside
  `PlanRuntime.reusing_weights` (the micro-batches of one optimizer step; Transformer Engine's
  ``is_first_microbatch`` made a scope). The forward's copy and its transpose are saved for
  that forward's backward either way. Under ``torch.compile`` the quantization is traced into
  the graph, where it fuses.
- The output gradient is scaled per tensor from its own amax on every backward (gradients drift too
  fast for a history); that is a pure function in `gemm`, with no state.

All state lives on the data's device: it moves there on first use and after ``load_state_dict``
with any ``map_location``.
"""

from __future__ import annotations

import torch

from ..formats import Format, Granularity
from ..plan import Scaling, ScalingMode
from .quantize import amax, inverse_scale, pad_to_multiple, to_fp8, to_int8

__all__ = ["InputQuantizer", "WeightQuantizer", "QuantizedWeight"]


class InputQuantizer:
    """How one layer's input is scaled into an FP8 format.

    Costs per call: one amax reduction (current, row and delayed scaling alike: delayed scaling
    records it) plus a few scalar ops; delayed scaling adds the history update. No host sync.
    """

    def __init__(self, fmt: Format, scaling: Scaling):
        self.fmt = fmt
        self.margin = scaling.margin
        self.rowwise = scaling.granularity is Granularity.ROW
        self.delayed = scaling.mode is ScalingMode.DELAYED and not self.rowwise
        self.most_recent = scaling.reduction == "most_recent"
        # history[0] is the newest amax; zeros are "not seen yet" (an amax is never negative).
        self.history = torch.zeros(scaling.history_len) if self.delayed else None

    def inverse_scale(self, x: torch.Tensor, record: bool) -> torch.Tensor:
        """The inverse scale for 2-D ``x``: ``()`` per tensor, ``(M, 1)`` per row.

        ``record``: append this step's amax to the delayed history (training forwards only).
        Call it under ``torch.no_grad()``: a scale carries no gradient.
        """
        if self.rowwise:
            return inverse_scale(amax(x, dim=1), self.fmt, self.margin)
        current = amax(x)
        if not self.delayed:
            return inverse_scale(current, self.fmt, self.margin)
        history = self.history
        if history.device != x.device:
            history = self.history = history.to(x.device)
        past = history[0] if self.most_recent else history.amax()
        # The first step has no history and scales from its own amax. Adding current * 0 keeps a
        # non-finite input non-finite after the saturating cast (the loss scaler must see it).
        basis = torch.where(past > 0, past, current)
        result = inverse_scale(basis, self.fmt, self.margin) + current * 0
        if record:
            # A non-finite amax belongs to a step the loss scaler skips: it must not poison later
            # scales, so it is recorded as "not seen".
            newest = torch.nan_to_num(current, nan=0.0, posinf=0.0, neginf=0.0)
            history.copy_(torch.cat((newest.reshape(1), history[:-1])))
        return result

    def reset(self) -> None:
        if self.history is not None:
            self.history.zero_()

    def state_dict(self) -> dict:
        return {"history": None if self.history is None else self.history.clone()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("history")
        if (saved is None) != (self.history is None) or (saved is not None and saved.shape != self.history.shape):
            raise ValueError("input quantizer state does not match this layer's scaling (mode or history_len changed)")
        if saved is not None:
            self.history = saved.clone()


class QuantizedWeight:
    """A weight (N, K) in a low-precision format, padded to the kernel's alignment.

    ``data``: (N', K') row-major, the forward GEMM's second operand as ``data.t()`` (column-major);
    ``transposed``: (K', N') row-major, the input-gradient GEMM's second operand as
    ``transposed.t()``; None when no backward needs it. ``inv_scale``: ``()`` per tensor, ``(N', 1)``
    per output channel for FP8, the row ``(1, N)`` for INT8 (as its kernel epilogue uses it). ``backward_inv_scale``: the per-tensor inverse scale of
    ``transposed`` when it differs from ``inv_scale`` (row-wise forward scales cannot be used
    across the contracted dimension), else None.
    """

    __slots__ = ("data", "inv_scale", "transposed", "backward_inv_scale")

    def __init__(self, data, inv_scale, transposed=None, backward_inv_scale=None):
        self.data = data
        self.inv_scale = inv_scale
        self.transposed = transposed
        self.backward_inv_scale = backward_inv_scale


class WeightQuantizer:
    """Quantizes one weight; keeps the result only while the caller vouches it is unchanged.

    ``fmt``: FP8 E4M3 (FP8 layers: E4M3 weights are legal against E4M3 and E5M2 activations and
    gradients, E5M2 x E5M2 is not) or INT8 (one scale per output channel). ``rowwise``: one scale
    per output channel for FP8. ``align``: K and N are padded to multiples of it.

    Cost per call: one amax and one cast over the weight, plus one transposed copy when a backward
    needs it; nothing on a reuse hit. A kept copy holds one byte per weight element (two with
    the transpose) until `clear`.
    """

    def __init__(self, fmt: Format, rowwise: bool, align: int, row_scales: bool = False):
        self.fmt = fmt
        self.rowwise = rowwise or fmt is Format.INT8
        self.align = align
        # Per-tensor FP8 scales handed to the forward kernel in row-wise shape (1, N'): see
        # gemm.Fp8Spec.expand_scales. The backward keeps the per-tensor scale.
        self.row_scales = row_scales and not self.rowwise and fmt is not Format.INT8
        self._key: "tuple | None" = None
        self._kept: "QuantizedWeight | None" = None

    def get(self, weight: torch.Tensor, need_transposed: bool, reuse: bool = False) -> QuantizedWeight:
        """The quantized ``weight`` (N, K), made now unless ``reuse`` and a copy of the same
        storage, layout and version was kept by an earlier call that also passed ``reuse``.

        ``reuse`` is the caller's promise that nothing wrote the weight since that call: the
        version counter alone cannot tell (``.data`` writes and FSDP2's copy-in keep it).
        """
        keep = reuse and not torch.compiler.is_compiling()
        if keep:
            key = (weight.data_ptr(), weight.stride(), weight._version, weight.device)
            hit = self._kept
            if key == self._key and hit is not None and (hit.transposed is not None or not need_transposed or self.fmt is Format.INT8):
                return hit
        with torch.no_grad():  # no detach needed (one op less): nothing here records a graph
            w = pad_to_multiple(weight, self.align, self.align)
            result = self._quantize(w, need_transposed and self.fmt is not Format.INT8, weight.shape[0])
        if keep:
            self._key, self._kept = key, result
        return result

    def _quantize(self, w: torch.Tensor, need_transposed: bool, weight_rows: int) -> QuantizedWeight:
        if self.fmt is Format.INT8:
            inv = inverse_scale(amax(w, dim=1), Format.INT8)
            # The kernel's epilogue wants the scales as a row (1, N) of the true N.
            return QuantizedWeight(to_int8(w, inv).contiguous(), inv[: weight_rows].t().contiguous())
        inv = inverse_scale(amax(w, dim=1) if self.rowwise else amax(w), self.fmt)
        # contiguous(): a weight stored (in, out) arrives as a transposed view, and the cast keeps
        # its layout; the kernels need (N, K) row-major.
        data = to_fp8(w, inv, self.fmt).contiguous()
        if not need_transposed:
            return QuantizedWeight(data, inv.expand(1, w.shape[0]).contiguous() if self.row_scales else inv)
        if not self.rowwise:
            if self.row_scales:
                return QuantizedWeight(data, inv.expand(1, w.shape[0]).contiguous(), data.t().contiguous(), inv)
            return QuantizedWeight(data, inv, data.t().contiguous())
        backward_inv = inverse_scale(amax(w), self.fmt)
        return QuantizedWeight(data, inv, to_fp8(w.t(), backward_inv, self.fmt).contiguous(), backward_inv)

    def clear(self) -> None:
        """Drop the kept copy (its memory is freed once no backward holds it)."""
        self._key, self._kept = None, None
