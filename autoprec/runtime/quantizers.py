"""One quantizer class per scaling strategy, made for one operand role, for kernels and emulation.

A layer's FP8 / INT8 matrix product has three operands (`OperandRole`: input, weight, output
gradient). Scaling state is kept per *role*, never per call order (an index of "the i-th product
of this forward" breaks under data-dependent control flow), and the strategy is the class, as
Transformer Engine's ``Float8CurrentScalingQuantizer`` / ``Float8Quantizer`` /
``Float8BlockQuantizer``; `quantizer` picks it from (role, format, `Scaling`):

- `TensorCurrentQuantizer`: one scale from this tensor's own amax. Inputs under current scaling,
  every per-tensor weight (a weight follows its own amax whatever the plan's mode) and every
  kernel output gradient (gradients drift too fast for a history).
- `TensorDelayedQuantizer`: one scale from the amax history of earlier steps (inputs only; the
  one quantizer with state, `state_dict`).
- `RowQuantizer`: one scale per row of an input, per output channel of a weight (INT8 weights
  always: their kernel's epilogue takes one scale per output channel).
- `BlockQuantizer`: one scale per 1x128 tile of an input or output gradient, per 128x128 block of
  a weight (DeepSeek-V3; the kernels' layout is `block_gemm`'s).
- `MxQuantizer`: one power-of-two scale per 32 elements (MXFP8; emulated ops only: a linear
  layer's MX products are `mx_gemm`'s).
- `Nvfp4Quantizer`: NVFP4's E4M3 scale per 16 elements (16x16 for a weight) under one FP32 scale
  per tensor, gradients rounded stochastically (emulated ops only: a linear layer's NVFP4
  products are `nvfp4`'s).

INT8 kernel inputs per tensor use `Int8Calibrator` instead. A weight is quantized on every forward
(`Quantizer.get`): it can change without a sign a cache could key on (``.data`` writes, FSDP2's
copy-in), so a copy is reused only inside `PlanRuntime.reusing_weights`, where the caller vouches.

Every scale comes from `formats.inverse_scale` and every cast is `formats.quantize` (the kernels'
inverse-scale convention), or, where a caller passes ``casts`` (`casts.fused_casts`: CUDA with
Triton, eager), the fused kernels of `triton_cast`, which give the same bytes in fewer passes.
Both hand a GEMM its operand as a `QuantizedOperand`. Emulation (`emulation.StoredInFormat`)
rounds any-rank tensors through `quantize` / `dequantize` of the same objects. State lives on the
data's device (moved on first use, any map_location).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch

from ..formats import ACTIVATION_BLOCK, MX_BLOCK, WEIGHT_BLOCK, Format, Granularity, amax, block_amax, dequantize, expand_blocks, inverse_scale, mx_inverse_scale, quantize
from ..plan import Reduction, Scaling, ScalingMode
from .block_gemm import block_cast
from .fsdp_fp8 import GatheredFp8
from .gemm import pad_to_multiple
from .nvfp4 import NVFP4_TILE, block_scales, decode_scales, decoded, encoded, padded, rows_and_columns
from .tensor_parallel import amax_over

if TYPE_CHECKING:
    from .triton_cast import FusedCasts

__all__ = [
    "OperandRole", "QuantizedOperand", "Quantizer", "TensorCurrentQuantizer", "TensorDelayedQuantizer", "RowQuantizer", "BlockQuantizer",
    "MxQuantizer", "Nvfp4Quantizer", "quantizer",
]


class OperandRole(str, enum.Enum):
    """Which operand of a layer's product ``y = x @ W.T`` a quantizer scales."""

    INPUT = "input"  # x, an activation
    WEIGHT = "weight"  # W, a parameter (or an activation in a weight's place, which is never kept)
    GRAD_OUTPUT = "grad_output"  # dL/dy, in the backward

    def __str__(self) -> str:
        return self.value


class QuantizedOperand:
    """One GEMM operand in a low-precision format, padded to the kernel's alignment.

    ``data``: row-major, the forward GEMM's operand (a weight (N', K') as ``data.t()``,
    column-major); None for an input `gemm.Fp8Linear` casts itself with ``inv_scale``.
    ``inv_scale``: ``data``'s inverse scale as the forward kernel takes it: ``()`` per tensor (the
    row ``(1, N')`` for a weight whose layer passes per-tensor scales in row shape,
    `layers.row_scaled_outs`), ``(rows, 1)`` per row, the row ``(1, N)`` of an INT8 weight, a
    block grid. ``transposed``: the copy a backward GEMM takes ((K', N') of a weight, (K', M')
    of an input, row-major), None when no backward needs it. ``transposed_inv_scale``: its
    inverse scale, per tensor (``inv_scale`` itself unless that is row-shaped).
    """

    __slots__ = ("data", "inv_scale", "transposed", "transposed_inv_scale")

    def __init__(self, data, inv_scale, transposed=None, transposed_inv_scale=None):
        self.data = data
        self.inv_scale = inv_scale
        self.transposed = transposed
        self.transposed_inv_scale = inv_scale if transposed_inv_scale is None else transposed_inv_scale


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Tiles cover 2-D matrices; other ranks are viewed as (rows, last dim)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


class Quantizer:
    """Scales one operand role of one layer into ``fmt`` (a strategy per subclass; `quantizer`
    makes them). ``margin``: the scale targets ``fmt.max / 2**margin`` (FP8 inputs only).
    ``align``: a weight's kernel copy has its rows and columns padded to multiples of it (`get`).
    ``group``: a tensor-parallel layer's ranks, over which a per-tensor amax is reduced
    (`tensor_parallel.amax_over`); ``rows_split``: the rows (or channels) it scales run across
    those ranks (a row-wise layer, split along K), so their amaxes are reduced too.
    A tensor of rank < 2 has one scale under every strategy.

    Round trips (emulation): `quantize` / `dequantize`, one elementwise pass each, plus one scale
    per element for tiles. Stateless but for the delayed history and a kept weight copy.
    """

    block: "tuple[int, int] | None" = None  # the tile of per-tile scales (`BlockQuantizer`)
    history: "torch.Tensor | None" = None  # the amax history (`TensorDelayedQuantizer`)

    def __init__(self, role: OperandRole, fmt: Format, margin: int = 0, align: int = 1):
        self.role, self.fmt, self.margin, self.align = role, fmt, margin, align
        self.group: Any = None
        self.rows_split = False
        self._key: "tuple | None" = None
        self._kept: "QuantizedOperand | None" = None

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        """The inverse scale of ``x`` by this strategy; per tensor here (rank < 2 too): one amax,
        two scalar ops. ``record``: delayed scaling's. Call it under ``torch.no_grad()``."""
        return inverse_scale(amax_over(amax(x), self.group), self.fmt, self.margin)

    def quantize(self, x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """x in the format, from FP32 (x's layout; 2-D (rows, last dim) with per-tile scales)."""
        if self.block is not None and inv.dim() == 2 and x.dim() >= 2:
            x = _as_2d(x)
            inv = expand_blocks(inv, x.shape, self.block)
        return quantize(x, inv, self.fmt)

    def dequantize(self, q: torch.Tensor, inv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """FP32 values of ``q`` in ``shape``."""
        if self.block is not None and inv.dim() == 2 and q.dim() == 2:
            inv = expand_blocks(inv, q.shape, self.block)
        return dequantize(q, inv).reshape(shape)

    def fused_cast(self, x: torch.Tensor, casts: "FusedCasts", transposed: bool, pad_rows: int = 1, pad_cols: int = 1, t_rows: int = 1,
                   inv: "torch.Tensor | None" = None, record: bool = False) -> QuantizedOperand:
        """2-D ``x`` scaled and cast by the fused kernels: ``data`` (rows padded to ``pad_rows``,
        columns to ``pad_cols``) and, with ``transposed``, the transposed copy (its columns, x's
        rows, padded further to ``t_rows`` with zero bytes). ``inv`` given (a recomputation
        replaying its forward): cast with it, record nothing. Bit for bit `inverse_scale` then
        `formats.quantize`; the kernels each strategy runs (each one pass over x unless said) are in
        its docstring. No host sync."""
        raise NotImplementedError(f"{type(self).__name__} has no fused cast")

    def _cast(self, w: torch.Tensor, transposed: bool, rows: int) -> QuantizedOperand:
        """A weight ``w`` (N', K'), already padded from ``rows`` (N), cast by PyTorch ops for the kernels."""
        raise NotImplementedError(f"{type(self).__name__} casts no kernel weight")

    def get(self, weight: torch.Tensor, need_transposed: bool, reuse: bool = False, casts: "FusedCasts | None" = None) -> QuantizedOperand:
        """The quantized ``weight`` (N, K) for the kernels, made now unless ``reuse`` and a copy of
        the same storage, layout and version was kept by an earlier call that also passed ``reuse``.

        ``reuse`` is the caller's promise that nothing wrote the weight since that call: the
        version counter alone cannot tell (``.data`` writes and FSDP2's copy-in keep it).
        ``casts``: made by the fused kernels (FP8 only; the same bytes, the padding included).
        Cost: one amax and one cast over the weight, plus one transposed copy when a backward
        needs it (the strategy's docstring says its kernels); nothing on a reuse hit. A kept copy
        holds one byte per weight element (two with the transpose) until `clear`.
        """
        keep = reuse and not torch.compiler.is_compiling()
        if keep:
            key = (weight.data_ptr(), weight.stride(), weight._version, weight.device)
            hit = self._kept
            if key == self._key and hit is not None and (hit.transposed is not None or not need_transposed or self.fmt is Format.INT8):
                return hit
        with torch.no_grad():  # no detach needed (one op less): nothing here records a graph
            if casts is not None and self.fmt.is_fp8:
                result = self.fused_cast(weight, casts, need_transposed, pad_rows=self.align, pad_cols=self.align)
            else:
                w = pad_to_multiple(weight, self.align, self.align)
                result = self._cast(w, need_transposed and self.fmt is not Format.INT8, weight.shape[0])
        if keep:
            self._key, self._kept = key, result
        return result

    def clear(self) -> None:
        """Drop the kept weight copy (its memory is freed once no backward holds it)."""
        self._key, self._kept = None, None

    def saturation(self, steps: int = 1) -> "torch.Tensor | None":
        """None: only delayed scaling can saturate (`TensorDelayedQuantizer.saturation`)."""
        return None

    def reset(self) -> None:
        """Forget the scaling state (the delayed history); nothing for the others."""

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
            raise ValueError(f"{self.role} quantizer state {problem}")
        saved = state.get("history")
        if saved is not None:
            self.history = saved.clone()


class TensorCurrentQuantizer(Quantizer):
    """One scale per tensor from its own amax (`Quantizer.inverse_scale`).

    Fused kernels: amax tiles, the one-program finalize, one cast writing both copies. A weight's
    per-tensor scale goes in row shape ``(1, N')`` where ``row_scaled`` (its layer's forward takes
    its scales so: `layers.row_scaled_outs`), made with the copy; the transposed copy keeps ``()``.
    The FSDP2-gathered FP8 weight (`fsdp_fp8.GatheredFp8`) arrives cast with its agreed scale: its
    bytes are padded (and transposed), no amax, no cast. As an output gradient, `quantize_for_gemms`.
    """

    def __init__(self, role: OperandRole, fmt: Format, margin: int = 0, align: int = 1, row_scaled: bool = False):
        super().__init__(role, fmt, margin, align)
        self.row_scaled = row_scaled and fmt.is_fp8

    def _operand(self, data: torch.Tensor, inv: torch.Tensor, transposed: "torch.Tensor | None") -> QuantizedOperand:
        if self.row_scaled:
            return QuantizedOperand(data, inv.expand(1, data.shape[0]).contiguous(), transposed, inv)
        return QuantizedOperand(data, inv, transposed)

    def get(self, weight: torch.Tensor, need_transposed: bool, reuse: bool = False, casts: "FusedCasts | None" = None) -> QuantizedOperand:
        if isinstance(weight, GatheredFp8) and self.fmt is Format.FP8_E4M3:
            return self._gathered(weight, need_transposed)
        return super().get(weight, need_transposed, reuse, casts)

    def _gathered(self, weight: "GatheredFp8", need_transposed: bool) -> QuantizedOperand:
        """A weight FSDP2 all-gathered in FP8 (`fsdp_fp8`): its bytes and agreed scale as they
        arrived, padded to the alignment; no amax, no cast. One copy (two with the transpose)."""
        rows, cols = weight.shape
        a = self.align
        data = torch.zeros(-(-rows // a) * a, -(-cols // a) * a, dtype=weight.fp8.dtype, device=weight.fp8.device)
        data[:rows, :cols].copy_(weight.fp8)
        return self._operand(data, weight.inv_scale, data.t().contiguous() if need_transposed else None)

    def _cast(self, w: torch.Tensor, transposed: bool, rows: int) -> QuantizedOperand:
        inv = self.inverse_scale(w)
        # contiguous(): a weight stored (in, out) arrives as a transposed view, and the cast keeps
        # its layout; the kernels need (N, K) row-major.
        data = quantize(w, inv, self.fmt).contiguous()
        return self._operand(data, inv, data.t().contiguous() if transposed else None)

    def fused_cast(self, x, casts, transposed, pad_rows=1, pad_cols=1, t_rows=1, inv=None, record=False) -> QuantizedOperand:
        if inv is None:
            inv = casts.tensor_scale(x, self.fmt, self.margin)
        t_fmt = self.fmt if transposed else None
        data, x_t = casts.cast(x, inv, self.fmt, pad_rows=pad_rows, pad_cols=pad_cols, t_fmt=t_fmt, t_rows=t_rows)
        return self._operand(data, inv, x_t)

    def quantize_for_gemms(self, g: torch.Tensor, input_grad: bool, weight_grad_fmt: "Format | None", casts: "FusedCasts | None" = None,
                           align: int = 1) -> "tuple[QuantizedOperand | None, QuantizedOperand | None]":
        """The output gradient 2-D ``g`` for the backward GEMMs: ``(for the input gradient, for
        the weight gradient)``, each None unless asked (``input_grad``; ``weight_grad_fmt``, the
        format that GEMM takes: `gemm.weight_grad_format`). Row-major in ``fmt`` and in
        ``weight_grad_fmt``, as ``data`` with ``inv_scale``. One amax, then one cast per distinct
        format (one operand, shared, when they agree).

        ``casts`` (the fused kernels): ``g`` unpadded; the input-gradient copy (M, N') has N
        padded to ``align``, the weight-gradient copy comes transposed, (N', M') row-major with M
        padded to ``align`` by zero bytes (the layout that GEMM takes). Three kernels: amax tiles,
        the finalize (both scales), one cast writing both copies."""
        if casts is not None:
            return self._fused_grads(g, input_grad, weight_grad_fmt, casts, align)
        g_amax = amax_over(amax(g), self.group)
        g = g.float()  # once for both copies (`formats.quantize` divides in FP32)
        for_input = for_weight = None
        if input_grad:
            inv = inverse_scale(g_amax, self.fmt)
            for_input = QuantizedOperand(quantize(g, inv, self.fmt).contiguous(), inv)
        if weight_grad_fmt is not None:
            if for_input is not None and weight_grad_fmt is self.fmt:
                for_weight = for_input
            else:
                inv = inverse_scale(g_amax, weight_grad_fmt)
                for_weight = QuantizedOperand(quantize(g, inv, weight_grad_fmt).contiguous(), inv)
        return for_input, for_weight

    def _fused_grads(self, g, input_grad, t_fmt, casts, align):
        row_fmt = self.fmt if input_grad else None
        if row_fmt is not None:
            first, second = row_fmt, (t_fmt if t_fmt is not None and t_fmt is not row_fmt else None)
        elif t_fmt is not None:
            first, second = t_fmt, None
        else:
            return None, None
        scales = casts.tensor_scale(g, first, 0, second)
        inv, t_inv = scales if second is not None else (scales, scales)
        gq, g_t = casts.cast(g, inv, row_fmt, pad_cols=align, t_fmt=t_fmt, t_inv=t_inv, t_rows=align)
        return (None if gq is None else QuantizedOperand(gq, inv)), (None if g_t is None else QuantizedOperand(g_t, t_inv))


class TensorDelayedQuantizer(Quantizer):
    """One scale per tensor from the amax history of earlier steps (an input's): its largest
    amax (`Reduction.MAX`) or the previous step's (`Reduction.MOST_RECENT`).

    Costs per call: one amax reduction (it records it) plus a few scalar ops and the history
    update. No host sync. Fused kernels: the cast writing the amax tiles, the finalize updating
    the history, a gated re-cast that moves no data unless the history could not give the scale.
    """

    history: torch.Tensor

    def __init__(self, fmt: Format, margin: int, history_len: int, reduction: Reduction):
        super().__init__(OperandRole.INPUT, fmt, margin)
        self.most_recent = reduction is Reduction.MOST_RECENT
        # A shift register: history[0] is the newest amax; zeros are "not seen yet" (an amax is
        # never negative).
        self.history = torch.zeros(history_len)

    def _history(self, device: torch.device) -> torch.Tensor:
        if self.history.device != device:
            self.history = self.history.to(device)
        return self.history

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        """``()`` from the history (the step's own amax while it holds none). ``record``: append
        this step's amax to the history (training forwards only)."""
        current = amax_over(amax(x), self.group)
        history = self._history(x.device)
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

    def fused_cast(self, x, casts, transposed, pad_rows=1, pad_cols=1, t_rows=1, inv=None, record=False) -> QuantizedOperand:
        if inv is not None:  # a replay: a plain per-tensor cast with the forward's scale
            data, x_t = casts.cast(x, inv, self.fmt, pad_rows=pad_rows, pad_cols=pad_cols, t_fmt=self.fmt if transposed else None, t_rows=t_rows)
            return QuantizedOperand(data, inv, x_t)
        inv, data, x_t = casts.cast_delayed(x, self._history(x.device), self.fmt, self.margin, self.most_recent, record,
                                            pad_cols=pad_cols, transposed=transposed, t_rows=t_rows)
        return QuantizedOperand(data, inv, x_t)

    def saturation(self, steps: int = 1) -> "torch.Tensor | None":
        """How far past its scale's range an input of the last ``steps`` recorded forwards went:
        the largest ratio of a forward's amax to the amax its scale came from (the older history;
        a forward with none scaled from itself). Read off the history (a few small kernels), no sync."""
        history = self.history
        if self.most_recent:
            basis = history[1:steps + 1]
        else:  # each entry's scale: the largest amax recorded before it (a suffix maximum)
            basis = history.flip(0).cummax(0).values.flip(0)[1:steps + 1]
        newest = history[:basis.numel()]
        return (newest / torch.where(basis > 0, basis, newest).clamp_min(torch.finfo(torch.float32).tiny)).amax()

    def reset(self) -> None:
        self.history.zero_()


class RowQuantizer(Quantizer):
    """One scale per row: an input's rows (x's shape with the last dim 1), a weight's output
    channels (``(out, 1, ...)``: a conv weight's over everything but dim 0). One amax, two
    scalar ops.

    A kernel copy's backward GEMMs contract over the rows these scales run along: its transposed
    copy takes one per-tensor scale (no margin) from the row amaxes. Fused kernels: the row kernel
    (two reads of each row, the second from cache), then for the transposed copy the finalize and
    a cast. An INT8 weight's scales go to its kernel as the row ``(1, N)`` of the true N, and it
    has no transposed copy (its backward runs in high precision).
    """

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        if x.dim() < 2:
            return super().inverse_scale(x)
        rows_group = self.group if self.rows_split else None
        if self.role is not OperandRole.WEIGHT:
            return inverse_scale(amax_over(amax(x, dim=-1), rows_group), self.fmt, self.margin)
        if x.dim() == 2:
            return inverse_scale(amax_over(amax(x, dim=1), rows_group), self.fmt)
        per_channel = inverse_scale(amax(x.reshape(x.shape[0], -1), dim=1), self.fmt)
        return per_channel.reshape(-1, *([1] * (x.dim() - 1)))

    def _cast(self, w: torch.Tensor, transposed: bool, rows: int) -> QuantizedOperand:
        inv = self.inverse_scale(w)
        data = quantize(w, inv, self.fmt).contiguous()
        if self.fmt is Format.INT8:
            return QuantizedOperand(data, inv[:rows].t().contiguous())
        if not transposed:
            return QuantizedOperand(data, inv)
        backward_inv = inverse_scale(amax_over(amax(w), self.group), self.fmt)  # the whole weight's, under tensor parallelism
        return QuantizedOperand(data, inv, quantize(w.t(), backward_inv, self.fmt).contiguous(), backward_inv)

    def fused_cast(self, x, casts, transposed, pad_rows=1, pad_cols=1, t_rows=1, inv=None, record=False) -> QuantizedOperand:
        if inv is None:
            data, inv, row_amax = casts.cast_rows(x, self.fmt, self.margin, pad_rows=pad_rows, pad_cols=pad_cols)
        else:
            data, _, _ = casts.cast_rows(x, self.fmt, self.margin, pad_rows=pad_rows, pad_cols=pad_cols, inv=inv)
            row_amax = None
        if not transposed:
            return QuantizedOperand(data, inv)
        t_inv = casts.scale_from(row_amax, self.fmt) if row_amax is not None else casts.tensor_scale(x, self.fmt)
        _, x_t = casts.cast(x, t_inv, None, pad_rows=pad_rows, pad_cols=pad_cols, t_fmt=self.fmt, t_rows=t_rows)
        return QuantizedOperand(data, inv, x_t, t_inv)


class BlockQuantizer(Quantizer):
    """One scale per tile of x viewed as (rows, last dim): 1x128 for an input or output gradient,
    128x128 for a weight (``(ceil(rows/128), ceil(K/128))``). One amax per tile, two scalar ops.

    A weight's kernel copy (`get`) is in the block-scaled kernels' layout (`block_gemm.block_cast`:
    (N', K') and its block grid); its transposed copy holds the same bytes (a 128x128 block scales
    the same either way). Fused: one launch writing the blocks, the grid and the transposed copy.
    Inputs and gradients are tiled by `block_gemm.Fp8BlockLinear` itself.
    """

    block: tuple[int, int]

    def __init__(self, role: OperandRole, fmt: Format, margin: int = 0, align: int = 1):
        super().__init__(role, fmt, margin, align)
        self.block = WEIGHT_BLOCK if role is OperandRole.WEIGHT else ACTIVATION_BLOCK

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        if x.dim() < 2:
            return super().inverse_scale(x)
        return inverse_scale(block_amax(_as_2d(x), self.block), self.fmt, self.margin)

    def _cast(self, w: torch.Tensor, transposed: bool, rows: int) -> QuantizedOperand:
        data, grid = block_cast(w)
        return QuantizedOperand(data, grid, data.t().contiguous() if transposed else None)

    def fused_cast(self, x, casts, transposed, pad_rows=1, pad_cols=1, t_rows=1, inv=None, record=False) -> QuantizedOperand:
        data, grid, x_t = casts.block_casts(x, transposed)
        return QuantizedOperand(data, grid, x_t)


class MxQuantizer(Quantizer):
    """One power-of-two scale per 32 consecutive elements of x's last dimension (MXFP8,
    `formats.mx_inverse_scale`: rounded up), for every role. Emulation only: a linear layer's MX
    products quantize their operands themselves (`mx_gemm.Fp8MxLinear`, along each GEMM's
    contracted dimension); another op's operands are rounded along their last dimension. One amax
    per tile, a few scalar ops per tile."""

    block = MX_BLOCK

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        x2 = _as_2d(x.reshape(1, -1) if x.dim() < 2 else x)
        return mx_inverse_scale(block_amax(x2, MX_BLOCK), self.fmt, self.margin)

    def quantize(self, x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        return super().quantize(x.reshape(1, -1) if x.dim() < 2 else x, inv)


class Nvfp4Quantizer(Quantizer):
    """NVFP4 (`nvfp4`): an E4M3 decode scale per 16 elements of x's last dimension (per 16x16
    block of a weight) under one FP32 scale per tensor, the values in E2M1, two per byte; an
    output gradient rounded stochastically (NVIDIA's recipe). Emulation only: a linear layer's
    NVFP4 products are `nvfp4.Nvfp4Linear`'s. `inverse_scale` gives each 1x16 block's FP32
    decode scale, which `quantize` and `dequantize` take (the arithmetic of `nvfp4.nvfp4_cast`).
    One amax per tensor and per block, a few elementwise passes, a pack."""

    block = (1, NVFP4_TILE)

    def inverse_scale(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        xp = padded(_nvfp4_2d(x), self.role is OperandRole.WEIGHT)
        scales, global_decode = block_scales(xp, self.role is OperandRole.WEIGHT)
        return decode_scales(scales, global_decode, xp.shape[0])

    def quantize(self, x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        xp = padded(_nvfp4_2d(x), self.role is OperandRole.WEIGHT)
        return encoded(xp, inv, stochastic=self.role is OperandRole.GRAD_OUTPUT)

    def dequantize(self, q: torch.Tensor, inv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows, cols = rows_and_columns(shape)
        return decoded(q, inv)[:rows, :cols].reshape(shape)


def _nvfp4_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(rows_and_columns(x.shape))


def quantizer(role: OperandRole, fmt: Format, scaling: Scaling, align: int = 1, row_scaled: bool = False) -> Quantizer:
    """The quantizer of one operand ``role`` in ``fmt`` under a layer's ``scaling``: the class by
    strategy (module docstring), the margin only for FP8 inputs (weights and gradients take the
    full range; INT8 inputs always did).

    Args:
        role: which operand it scales.
        fmt: the operand's format.
        scaling: the layer's `Scaling`. Delayed scaling applies to per-tensor inputs only;
            gradients are per tensor unless tiled (BLOCK); INT8 weights always per output channel.
        align: a weight's kernel copy padded to multiples of it (`Quantizer.get`).
        row_scaled: a per-tensor FP8 weight's scale handed to the kernel in row shape
            (`layers.row_scaled_outs`).

    Returns:
        A new `Quantizer` (its state, if any, empty).
    """
    margin = scaling.margin if role is OperandRole.INPUT and fmt.is_fp8 else 0
    if fmt is Format.NVFP4:
        return Nvfp4Quantizer(role, fmt)
    if scaling.granularity is Granularity.BLOCK:
        return BlockQuantizer(role, fmt, margin, align)
    if scaling.granularity is Granularity.MX:
        return MxQuantizer(role, fmt, margin, align)
    if role is not OperandRole.GRAD_OUTPUT and (scaling.granularity is Granularity.ROW or (role is OperandRole.WEIGHT and fmt is Format.INT8)):
        return RowQuantizer(role, fmt, margin, align)
    if role is OperandRole.INPUT and scaling.mode is ScalingMode.DELAYED:
        return TensorDelayedQuantizer(fmt, margin, scaling.history_len, scaling.reduction)
    return TensorCurrentQuantizer(role, fmt, margin, align, row_scaled)
