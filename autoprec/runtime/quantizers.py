"""One quantizer per operand role (input, weight, output gradient), for kernels and emulation.

A layer's FP8 / INT8 matrix product has three operands. Scaling state is kept per *role*, never
per call order (an index of "the i-th product of this forward" breaks under data-dependent
control flow), as Transformer Engine's ``Float8Quantizer`` / ``Float8CurrentScalingQuantizer``:

- `InputQuantizer`: current scaling (this tensor's amax) per tensor, row or 1x128 tile, or
  delayed scaling (the one amax history). INT8 kernel inputs per tensor use `Int8Calibrator`.
- `WeightQuantizer`: per tensor, output channel or 128x128 tile, on every forward: a weight can
  change without a sign a cache could key on (``.data`` writes, FSDP2's copy-in), so a copy is
  reused only inside `PlanRuntime.reusing_weights`, where the caller vouches for it.
- `GradQuantizer`: the output gradient, per tensor from its own amax on every backward
  (gradients drift too fast for a history); no state.

Every scale comes from `formats.inverse_scale` and every cast is `formats.quantize` (the
kernels' inverse-scale convention), or, where a caller passes ``casts`` (`casts.fused_casts`:
CUDA with Triton, eager), the fused kernels of `triton_cast`, which give the same bytes in fewer
passes. The kernel path (`gemm`) takes the scales and casts; emulation
(`emulation.StoredInFormat`) rounds any-rank tensors through `quantize` / `dequantize` of the
same objects. State lives on the data's device (moved on first use, any map_location).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..formats import ACTIVATION_BLOCK, WEIGHT_BLOCK, Format, Granularity, amax, block_amax, dequantize, expand_blocks, inverse_scale, quantize
from ..plan import Scaling, ScalingMode
from .block_gemm import block_cast
from .fsdp_fp8 import GatheredFp8
from .gemm import pad_to_multiple

if TYPE_CHECKING:
    from .triton_cast import FusedCasts

__all__ = ["InputQuantizer", "WeightQuantizer", "GradQuantizer", "QuantizedWeight"]


def _across(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` (an amax) max-reduced over ``group``, a tensor-parallel layer's ranks
    (`tensor_parallel`): one scale for the whole logical tensor. Unchanged for None."""
    if group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Tiles cover 2-D matrices; other ranks are viewed as (rows, last dim)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


class _RoundTrip:
    """``quantize`` / ``dequantize`` of any-rank tensors with this quantizer's scales (emulation's
    round trip): one elementwise pass each, plus one scale per element for tiles."""

    fmt: Format
    block: "tuple[int, int] | None" = None  # the tile of per-tile scales, else None

    def quantize(self, x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """x in the format, from FP32 (x's layout; 2-D (rows, last dim) with per-tile scales)."""
        if self.block is not None and inv.dim() == 2 and x.dim() >= 2:
            x = _as_2d(x)
            inv = expand_blocks(inv, x.shape, self.block)
        return quantize(x.float(), inv, self.fmt)

    def dequantize(self, q: torch.Tensor, inv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """FP32 values of ``q`` in ``shape``."""
        if self.block is not None and inv.dim() == 2 and q.dim() == 2:
            inv = expand_blocks(inv, q.shape, self.block)
        return dequantize(q, inv).reshape(shape)


class InputQuantizer(_RoundTrip):
    """How one layer's input (activation) is scaled into ``fmt``.

    Costs per call: one amax reduction (delayed scaling too: it records it) plus a few scalar
    ops; delayed scaling adds the history update. No host sync. ``margin`` applies to FP8 only
    (INT8 inputs always took the full range).
    """

    def __init__(self, fmt: Format, scaling: Scaling):
        self.fmt = fmt
        self.margin = scaling.margin if fmt.is_fp8 else 0
        self.rowwise = scaling.granularity is Granularity.ROW
        self.block = ACTIVATION_BLOCK if scaling.granularity is Granularity.BLOCK else None
        delayed = scaling.mode is ScalingMode.DELAYED and scaling.granularity is Granularity.TENSOR
        self.most_recent = scaling.reduction == "most_recent"
        # The delayed-scaling history, a shift register: history[0] is the newest amax; zeros are
        # "not seen yet" (an amax is never negative).
        self.history = torch.zeros(scaling.history_len) if delayed else None
        self.group: Any = None  # a tensor-parallel layer's ranks: its per-tensor amax is theirs (`_across`)

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        """The inverse scale for ``x`` (..., K): ``()`` per tensor, x's shape with K → 1 per row,
        ``(ceil(rows/1), ceil(K/128))`` per tile of x viewed as (rows, K).

        ``record``: append this step's amax to the delayed history (training forwards only).
        Call it under ``torch.no_grad()``: a scale carries no gradient.
        """
        if x.dim() >= 2 and self.block is not None:
            return inverse_scale(block_amax(_as_2d(x), self.block), self.fmt, self.margin)
        if x.dim() >= 2 and self.rowwise:
            return inverse_scale(amax(x, dim=-1), self.fmt, self.margin)
        current = _across(amax(x), self.group)
        history = self.history
        if history is None:  # current scaling
            return inverse_scale(current, self.fmt, self.margin)
        if history.device != x.device:
            history = self.history = history.to(x.device)
        # Read by a reduction either way: a compiled recomputed block keeps every amax output
        # instead of reading the history again after this forward updated it (runtime.recompute).
        past = history[:1].amax() if self.most_recent else history.amax()
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

    def fused_cast(self, x: torch.Tensor, casts: "FusedCasts", align: int, record: bool = False,
                   transposed: bool = False, inv: "torch.Tensor | None" = None):
        """`inverse_scale` of 2-D ``x`` and its casts for a GEMM, by the fused kernels:
        ``(inv, (xq, x_t, x_t_inv))``. ``xq`` (M, K') row-major scaled by ``inv`` (per tensor or
        per row), K padded to ``align``; with ``transposed`` ``x_t`` (K', M') row-major, M padded to
        ``align`` with zero bytes, in one per-tensor scale ``x_t_inv`` (``inv`` itself unless
        row-wise), else None. ``inv`` given (a recomputation replaying its forward): cast with it,
        record nothing. Bit for bit `inverse_scale` then `formats.quantize`.

        Costs (kernels, each one pass over x unless said): per tensor, current scaling: amax tiles,
        the one-program finalize, the cast (both copies in one pass); delayed: the cast writing the
        amax tiles, the finalize updating the history, a gated re-cast that moves no data unless the
        history could not give the scale; row-wise: one kernel (two reads of each row from cache)
        plus, with ``transposed``, the finalize and a cast. No host sync."""
        if self.rowwise:
            if inv is None:
                xq, inv, row_amax = casts.cast_rows(x, self.fmt, self.margin, pad_cols=align)
            else:
                xq, _, _ = casts.cast_rows(x, self.fmt, self.margin, pad_cols=align, inv=inv)
                row_amax = None
            if not transposed:
                return inv, (xq, None, None)
            # The backward contracts over the rows the forward scaled along: one scale (no margin).
            t_inv = casts.scale_from(row_amax, self.fmt) if row_amax is not None else casts.tensor_scale(x, self.fmt)
            _, x_t = casts.cast(x, t_inv, None, pad_cols=align, t_fmt=self.fmt, t_rows=align)
            return inv, (xq, x_t, t_inv)
        t_fmt = self.fmt if transposed else None
        if inv is None and self.history is not None:
            history = self.history
            if history.device != x.device:
                history = self.history = history.to(x.device)
            inv, xq, x_t = casts.cast_delayed(x, history, self.fmt, self.margin, self.most_recent, record,
                                              pad_cols=align, transposed=transposed, t_rows=align)
            return inv, (xq, x_t, inv)
        if inv is None:
            inv = casts.tensor_scale(x, self.fmt, self.margin)
        xq, x_t = casts.cast(x, inv, self.fmt, pad_cols=align, t_fmt=t_fmt, t_rows=align)
        return inv, (xq, x_t, inv)

    def saturation(self, steps: int = 1) -> "torch.Tensor | None":
        """Delayed scaling: how far past its scale's range an input of the last ``steps``
        recorded forwards went: the largest ratio of a forward's amax to the amax its scale came
        from (the older history; a forward with none scaled from itself); None for current
        scaling, which never saturates. Read off the history (a few small kernels), no sync."""
        history = self.history
        if history is None:
            return None
        if self.most_recent:
            basis = history[1:steps + 1]
        else:  # each entry's scale: the largest amax recorded before it (a suffix maximum)
            basis = history.flip(0).cummax(0).values.flip(0)[1:steps + 1]
        newest = history[:basis.numel()]
        return (newest / torch.where(basis > 0, basis, newest).clamp_min(torch.finfo(torch.float32).tiny)).amax()

    def reset(self) -> None:
        if self.history is not None:
            self.history.zero_()

    def state_dict(self) -> dict:
        return {"history": None if self.history is None else self.history.clone()}

    def state_problem(self, state: dict) -> "str | None":
        """What in ``state`` (a `state_dict`) does not fit this quantizer's scaling, e.g.
        ``"['history'] has shape (3,), expected (16,)"``; None when it fits. Shapes only: no sync."""
        saved, history = state.get("history"), self.history
        if saved is not None and not isinstance(saved, torch.Tensor):
            return f"['history'] is a {type(saved).__name__}, expected a tensor or None"
        if (saved is None) != (history is None) or (saved is not None and history is not None and saved.shape != history.shape):
            shape = lambda t: "none" if t is None else tuple(t.shape)  # noqa: E731
            return f"['history'] has shape {shape(saved)}, expected {shape(history)} (scaling mode or history_len changed)"
        return None

    def load_state_dict(self, state: dict) -> None:
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(f"input quantizer state {problem}")
        saved = state.get("history")
        if saved is not None:
            self.history = saved.clone()


class QuantizedWeight:
    """A weight (N, K) in a low-precision format, padded to the kernel's alignment.

    ``data``: (N', K') row-major, the forward GEMM's second operand as ``data.t()`` (column-major);
    ``transposed``: (K', N') row-major, the input-gradient GEMM's second operand as
    ``transposed.t()``; None when no backward needs it. ``inv_scale``: ``()`` per tensor, ``(N', 1)``
    per output channel for FP8, the row ``(1, N)`` for INT8 (as its kernel epilogue uses it).
    ``backward_inv_scale``: the per-tensor inverse scale of ``transposed`` when it differs from
    ``inv_scale`` (row-wise forward scales cannot be used across the contracted dimension), else None.
    """

    __slots__ = ("data", "inv_scale", "transposed", "backward_inv_scale")

    def __init__(self, data, inv_scale, transposed=None, backward_inv_scale=None):
        self.data = data
        self.inv_scale = inv_scale
        self.transposed = transposed
        self.backward_inv_scale = backward_inv_scale


class WeightQuantizer(_RoundTrip):
    """Quantizes one weight; keeps the result only while the caller vouches it is unchanged.

    ``fmt``: for the kernels FP8 E4M3 (legal against E4M3 and E5M2 activations and gradients,
    E5M2 x E5M2 is not) or INT8 (always one scale per output channel). ``granularity``: ROW is
    one scale per output channel (dim 0), BLOCK one per 128x128 tile (`get`: in the block-scaled
    kernels' layout, `block_gemm.block_cast`).
    ``align``: K and N padded to multiples of it (kernels).

    Cost per `get`: one amax and one cast over the weight, plus one transposed copy when a backward
    needs it; nothing on a reuse hit. A kept copy holds one byte per weight element (two with
    the transpose) until `clear`.
    """

    def __init__(self, fmt: Format, granularity: Granularity = Granularity.TENSOR, align: int = 1, row_scales: bool = False):
        self.fmt = fmt
        self.rowwise = granularity is Granularity.ROW or fmt is Format.INT8
        self.block = WEIGHT_BLOCK if granularity is Granularity.BLOCK else None
        self.align = align
        # Per-tensor FP8 scales handed to the forward kernel in row-wise shape (1, N'): see
        # gemm.Fp8Spec.expand_scales. The backward keeps the per-tensor scale.
        self.row_scales = row_scales and not self.rowwise and fmt is not Format.INT8
        self._key: "tuple | None" = None
        self._kept: "QuantizedWeight | None" = None
        self.group: Any = None  # a tensor-parallel layer's ranks: its per-tensor amax is theirs (`_across`)

    def inverse_scale(self, w: torch.Tensor) -> torch.Tensor:
        """The inverse scale of ``w`` (out, ...): ``()`` per tensor, ``(out, 1, ...)`` per output
        channel, per 128x128 tile of w viewed as (rows, last dim). One amax, two scalar ops."""
        if w.dim() >= 2 and self.block is not None:
            return inverse_scale(block_amax(_as_2d(w), self.block), self.fmt)
        if w.dim() >= 2 and self.rowwise:
            if w.dim() == 2:
                return inverse_scale(amax(w, dim=1), self.fmt)
            per_channel = inverse_scale(amax(w.reshape(w.shape[0], -1), dim=1), self.fmt)
            return per_channel.reshape(-1, *([1] * (w.dim() - 1)))
        return inverse_scale(_across(amax(w), self.group), self.fmt)

    def get(self, weight: torch.Tensor, need_transposed: bool, reuse: bool = False, casts: "FusedCasts | None" = None) -> QuantizedWeight:
        """The quantized ``weight`` (N, K), made now unless ``reuse`` and a copy of the same
        storage, layout and version was kept by an earlier call that also passed ``reuse``.

        ``reuse`` is the caller's promise that nothing wrote the weight since that call: the
        version counter alone cannot tell (``.data`` writes and FSDP2's copy-in keep it).
        ``casts``: made by the fused kernels (FP8 only; the same bytes), the padding included:
        per tensor amax tiles, finalize and one cast writing both copies; row-wise the row kernel,
        then for the transposed copy the finalize and a cast.
        """
        if isinstance(weight, GatheredFp8) and self.fmt is Format.FP8_E4M3 and not self.rowwise and self.block is None:
            return self._gathered(weight, need_transposed)
        keep = reuse and not torch.compiler.is_compiling()
        if keep:
            key = (weight.data_ptr(), weight.stride(), weight._version, weight.device)
            hit = self._kept
            if key == self._key and hit is not None and (hit.transposed is not None or not need_transposed or self.fmt is Format.INT8):
                return hit
        with torch.no_grad():  # no detach needed (one op less): nothing here records a graph
            if casts is not None and self.block is not None:  # one launch: blocks, grid, transposed copy
                data, grid, transposed = casts.block_casts(weight, need_transposed)
                result = QuantizedWeight(data, grid, transposed)
            elif casts is not None and self.fmt.is_fp8:
                result = self._fused(weight, need_transposed, casts)
            else:
                w = pad_to_multiple(weight, self.align, self.align)
                result = self._quantize(w, need_transposed and self.fmt is not Format.INT8, weight.shape[0])
        if keep:
            self._key, self._kept = key, result
        return result

    def _gathered(self, weight: "GatheredFp8", need_transposed: bool) -> QuantizedWeight:
        """A weight FSDP2 all-gathered in FP8 (`fsdp_fp8`): its bytes and agreed scale as they
        arrived, padded to the alignment; no amax, no cast. One copy (two with the transpose)."""
        rows, cols = weight.shape
        a = self.align
        data = torch.zeros(-(-rows // a) * a, -(-cols // a) * a, dtype=weight.fp8.dtype, device=weight.fp8.device)
        data[:rows, :cols].copy_(weight.fp8)
        inv = weight.inv_scale
        transposed = data.t().contiguous() if need_transposed else None
        if self.row_scales:
            return QuantizedWeight(data, inv.expand(1, data.shape[0]).contiguous(), transposed, inv if transposed is not None else None)
        return QuantizedWeight(data, inv, transposed)

    def _quantize(self, w: torch.Tensor, need_transposed: bool, weight_rows: int) -> QuantizedWeight:
        if self.block is not None:
            # The block-scaled kernels' layout: (N', K') and its block grid; the transposed copy
            # holds the same bytes (a 128x128 block scales the same either way).
            data, grid = block_cast(w)
            return QuantizedWeight(data, grid, data.t().contiguous() if need_transposed else None)
        inv = self.inverse_scale(w)
        if self.fmt is Format.INT8:
            # The kernel's epilogue wants the scales as a row (1, N) of the true N.
            return QuantizedWeight(quantize(w, inv, Format.INT8).contiguous(), inv[:weight_rows].t().contiguous())
        # contiguous(): a weight stored (in, out) arrives as a transposed view, and the cast keeps
        # its layout; the kernels need (N, K) row-major.
        data = quantize(w, inv, self.fmt).contiguous()
        if not need_transposed:
            return QuantizedWeight(data, inv.expand(1, w.shape[0]).contiguous() if self.row_scales else inv)
        if not self.rowwise:
            if self.row_scales:
                return QuantizedWeight(data, inv.expand(1, w.shape[0]).contiguous(), data.t().contiguous(), inv)
            return QuantizedWeight(data, inv, data.t().contiguous())
        backward_inv = inverse_scale(amax(w), self.fmt)
        return QuantizedWeight(data, inv, quantize(w.t(), backward_inv, self.fmt).contiguous(), backward_inv)

    def _fused(self, weight: torch.Tensor, need_transposed: bool, casts: "FusedCasts") -> QuantizedWeight:
        """`_quantize` of the padded weight by the fused kernels (the same tensors)."""
        a = self.align
        if self.rowwise:
            data, inv, row_amax = casts.cast_rows(weight, self.fmt, pad_rows=a, pad_cols=a)
            if not need_transposed:
                return QuantizedWeight(data, inv)
            backward_inv = casts.scale_from(row_amax, self.fmt)
            _, transposed = casts.cast(weight, backward_inv, None, pad_rows=a, pad_cols=a, t_fmt=self.fmt)
            return QuantizedWeight(data, inv, transposed, backward_inv)
        inv = casts.tensor_scale(weight, self.fmt)
        data, transposed = casts.cast(weight, inv, self.fmt, pad_rows=a, pad_cols=a, t_fmt=self.fmt if need_transposed else None)
        if self.row_scales:
            return QuantizedWeight(data, inv.expand(1, data.shape[0]).contiguous(), transposed, inv if transposed is not None else None)
        return QuantizedWeight(data, inv, transposed)

    def clear(self) -> None:
        """Drop the kept copy (its memory is freed once no backward holds it)."""
        self._key, self._kept = None, None


@dataclasses.dataclass(frozen=True)
class GradQuantizer(_RoundTrip):
    """The gradient of a layer's output: per tensor (per 1x128 tile under block scaling), from
    its own amax, on every backward.

    ``fmt``: the gradient's format (E5M2 or E4M3). ``weight_grad_fmt``: the format of the copy
    the weight-gradient GEMM takes; E4M3 where the layer's input is E5M2 and ``fmt`` is too
    (cuBLASLt refuses E5M2 x E5M2), else ``fmt``. Frozen (no state): it travels in `gemm.Fp8Spec`.
    """

    fmt: Format
    weight_grad_fmt: Format
    # 1x128 tiles of g viewed as (rows, last dim) under block scaling (emulation's round trip;
    # the block-scaled kernels tile g themselves, `block_gemm`), else None: one scale.
    block: "tuple[int, int] | None" = None
    # A tensor-parallel layer's ranks: the gradient's per-tensor amax is theirs (`_across`).
    group: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def for_layer(cls, input_fmt: Format, grad_fmt: Format, blocks: bool = False) -> "GradQuantizer":
        e5m2_pair = input_fmt is Format.FP8_E5M2 and grad_fmt is Format.FP8_E5M2
        return cls(grad_fmt, Format.FP8_E4M3 if e5m2_pair else grad_fmt, ACTIVATION_BLOCK if blocks else None)

    def inverse_scale(self, g: torch.Tensor) -> torch.Tensor:
        """``()``: one amax over g, two scalar ops; per 1x128 tile under block scaling."""
        if self.block is not None and g.dim() >= 2:
            return inverse_scale(block_amax(_as_2d(g), self.block), self.fmt)
        return inverse_scale(_across(amax(g), self.group), self.fmt)

    def quantize_for_gemms(self, g: torch.Tensor, input_grad: bool, weight_grad: bool, casts: "FusedCasts | None" = None, align: int = 1):
        """``((gq, inv) or None, (gq, inv) or None)``: 2-D ``g`` row-major in ``fmt`` for the
        input-gradient GEMM and in ``weight_grad_fmt`` for the weight-gradient GEMM, each only
        when asked. One amax, then one cast per distinct format (shared when they agree).

        ``casts`` (the fused kernels): ``g`` unpadded; the input-gradient copy (M, N') has N
        padded to ``align``, the weight-gradient copy comes transposed, (N', M') row-major with M
        padded to ``align`` by zero bytes (the layout that GEMM takes). Three kernels: amax tiles,
        the finalize (both scales), one cast writing both copies."""
        if casts is not None:
            return self._fused(g, input_grad, weight_grad, casts, align)
        g_amax = _across(amax(g), self.group)
        for_input = for_weight = None
        if input_grad:
            inv = inverse_scale(g_amax, self.fmt)
            for_input = quantize(g, inv, self.fmt).contiguous(), inv
        if weight_grad:
            if for_input is not None and self.weight_grad_fmt is self.fmt:
                for_weight = for_input
            else:
                inv = inverse_scale(g_amax, self.weight_grad_fmt)
                for_weight = quantize(g, inv, self.weight_grad_fmt).contiguous(), inv
        return for_input, for_weight

    def _fused(self, g: torch.Tensor, input_grad: bool, weight_grad: bool, casts: "FusedCasts", align: int):
        row_fmt = self.fmt if input_grad else None
        t_fmt = self.weight_grad_fmt if weight_grad else None
        if row_fmt is not None:
            first, second = row_fmt, (t_fmt if t_fmt is not None and t_fmt is not row_fmt else None)
        elif t_fmt is not None:
            first, second = t_fmt, None
        else:
            return None, None
        scales = casts.tensor_scale(g, first, 0, second)
        inv, t_inv = scales if second is not None else (scales, scales)
        gq, g_t = casts.cast(g, inv, row_fmt, pad_cols=align, t_fmt=t_fmt, t_inv=t_inv, t_rows=align)
        return (None if gq is None else (gq, inv)), (None if g_t is None else (g_t, t_inv))
