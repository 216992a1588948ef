"""Bytes a layer holds for one training step in a format, from the shapes of its traced calls.

Three parts, following how the runtime runs each format (docs/runtime.md, "How each format runs"):

- **weight copies** saved for backward: BF16 / FP16 layers run under ``torch.autocast``, which
  saves a 2-byte copy of each FP32 weight operand whose partner operand needs a gradient.
  FP8 / INT8 layers re-quantize weights from the FP32 master in backward and save none; FP32
  layers save the parameter itself, which costs nothing extra.
- **activations** saved for backward: the matrix operands that are not weights, at the format's
  width. FP32: exactly what autograd saved inside the call in the FP32 trace. BF16 / FP16: what
  FP32 saved inside the call (operands saved as they are, copies the op made), at 2 bytes per
  element, plus a 2-byte copy of each operand FP32 had already saved before the call (the
  softmax output an attention layer multiplies with: autocast casts it, and the copy is saved).
  Ops autocast keeps in FP32 (``mv`` on CPU) save their operands at 4 bytes.
  FP8 / INT8 with a kernel (`Fp8Gemm`, `Int8Gemm`): ``numel * 1`` for each non-weight operand
  plus the FP32 scales they keep (two scalars per FP8 GEMM, M + N values with row scaling; INT8:
  the activation scale and one weight scale per output column). Emulated ops (`StoredInFormat`):
  ``numel * 1`` for every non-weight floating input, scales kept outside autograd. MXFP8
  (`mx_gemm`): the input tiled along M and the weight tiled along N, one byte per element and one
  per 32-element tile (the weight's copy counted as a weight copy). E4M3 block scaling
  (`block_gemm`, kernel or emulated GEMMs alike): the input re-tiled along M and the weight's
  transposed blocks, every dimension padded to 128, with their FP32 scales. NVFP4 (`nvfp4`): the
  input along M (its Hadamard-transformed copy) and the weight's 16x16 blocks, half a byte per
  element with every blocked dimension padded to 16, one E4M3 byte per block and an FP32 scale
  each; emulated ops in NVFP4 half a byte per element.
  Plus ``other``: what the layer's non-matmul ops saved in the FP32 trace (the FP32 softmax
  output of an attention layer, a mask), carried unchanged in every format.
- **gradient buffers**: the FP32 master gradients of the layer's own parameters, the same in
  every format.

A call under the user's own checkpointing saves nothing in any format (``MatmulCall.saved_elsewhere``).

Not predicted: INT8 outlier channels kept apart in FP32 (data-dependent, none on typical
activations), and storage shared between layers (counted where it is first saved).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from ..formats import Format, Granularity
from ..plan import LayerPrecision
from ..runtime.layers import as_gemm, kernel_reason
from ..runtime.gemm import FP8_ALIGN, INT8_ALIGN, INT8_MIN_ROWS
from ..runtime.block_gemm import BLOCK
from ..runtime.mx_gemm import MX_TILE
from ..runtime.nvfp4 import NVFP4_TILE, rows_and_columns
from .trace import LayerTrace, MatmulCall, TensorSpec

if TYPE_CHECKING:
    from .targets import TargetDevice

__all__ = ["MemoryCost", "call_path", "layer_memory", "runs_natively"]

# Matrix-product ops that torch.autocast leaves in FP32 (with FP32 inputs), per device type: not
# in its lower-precision list, or "promote" (aten/src/ATen/autocast_mode.cpp; checked on CPU with
# torch 2.13: mv, addmv and bilinear return float32 under autocast, einsum and tensordot bfloat16).
_AUTOCAST_KEEPS_FP32 = {"cpu": frozenset({"mv", "addmv", "bilinear"}), "cuda": frozenset({"bilinear", "tensordot"})}

# Bytes of one FP32 scale value (scales are FP32 tensors: formats.inverse_scale).
_SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class MemoryCost:
    """Bytes one layer holds for a step in one format (see the module docstring)."""

    weight_copy_bytes: int
    activation_bytes: int
    other_saved_bytes: int
    grad_bytes: int

    @property
    def saved_bytes(self) -> int:
        """What autograd keeps for backward: weight copies, activations, other saved tensors."""
        return self.weight_copy_bytes + self.activation_bytes + self.other_saved_bytes

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + self.grad_bytes


def _meta_arguments(call: MatmulCall) -> tuple[tuple, dict]:
    tensors = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in call.tensors]
    return call.arguments(tensors)


def call_path(call: MatmulCall, precision: LayerPrecision, device: "torch.device | str",
              target: "TargetDevice | None" = None) -> tuple[str, Optional[tuple[int, int, int]]]:
    """How the runtime runs ``call`` in ``precision`` on ``device``, and its GEMM shape (M, K, N).

    ``"fp32"`` (also for ops autocast keeps in FP32), ``"autocast"``, ``"kernel"`` (``torch._scaled_mm`` / ``torch._int_mm``),
    ``"block"`` / ``"mx"`` / ``"nvfp4"`` (`block_gemm` / `mx_gemm` / `nvfp4` products, kernel or
    emulated GEMMs) or ``"emulated"``; the shape is given for all but the emulated and
    high-precision calls. Mirrors
    `runtime.products.Products.run_low_precision` (it asks the runtime's own GEMM matcher and kernel rule).
    ``target``: as it would run on that GPU instead (`targets.TargetDevice`: its kernels decide
    kernel or emulated, CUDA's autocast rules apply).
    """
    fmt = precision.format
    device = torch.device(device) if target is None else torch.device("cuda")
    if fmt is Format.FP32 or (fmt in (Format.BF16, Format.FP16) and call.op in _AUTOCAST_KEEPS_FP32.get(device.type, ())):
        return "fp32", None
    if fmt in (Format.BF16, Format.FP16):
        return "autocast", None
    args, kwargs = _meta_arguments(call)
    gemm = as_gemm(call.op, call.func, args, kwargs)
    tiled = _tiled(precision)
    if gemm is None or (tiled is None and not runs_natively(precision, device, target)):
        return "emulated", None
    a, b = gemm[0], gemm[1]
    m, k = a.shape
    n = b.shape[1]
    return tiled or "kernel", (m, k, n)


def runs_natively(precision: LayerPrecision, device: torch.device, target: "TargetDevice | None" = None) -> bool:
    """Whether a layer in ``precision`` runs its products on a kernel: on ``target`` when given
    (its kernels), else on ``device`` (`runtime.layers.kernel_reason`, the runtime's own rule)."""
    return target.runs(precision) if target is not None else kernel_reason(precision, device) is None


def _tiled(precision: LayerPrecision) -> "str | None":
    """``"block"``, ``"mx"`` or ``"nvfp4"`` where a layer's products are tiled ones
    (`runtime.block_gemm`, `runtime.mx_gemm`, `runtime.nvfp4`), which save their own re-tiled
    copies whether their GEMMs run on a kernel or emulated; None otherwise (E4M3 block scaling
    with an E5M2 operand runs `products.emulate`)."""
    fmt, granularity = precision.format, precision.scaling.granularity
    if fmt is Format.NVFP4:
        return "nvfp4"
    if not fmt.is_fp8:
        return None
    if granularity is Granularity.MX:
        return "mx"
    if granularity is Granularity.BLOCK and fmt is Format.FP8_E4M3 and precision.grad_format is Format.FP8_E4M3:
        return "block"
    return None


def _saved_operands(call: MatmulCall) -> list[tuple[int, TensorSpec]]:
    """``(i, spec)`` of the operands native autograd saves: each one whose partner (any other
    operand) needs a gradient (derivatives.yaml saves ``self`` for ``mat2``'s gradient, and so on)."""
    operands = [(i, s) for i, s in enumerate(call.tensors) if s.operand]
    return [(i, s) for i, s in operands if any(o.requires_grad for j, o in operands if j != i)]


def _call_bytes(call: MatmulCall, precision: LayerPrecision, device, target: "TargetDevice | None") -> tuple[int, int]:
    """(weight copy bytes, activation bytes) one call saves in ``precision`` (on ``target`` when given)."""
    fmt = precision.format
    if call.saved_elsewhere:  # the user's checkpoint keeps it (`trace.MatmulCall`), in every format
        return 0, 0
    path, gemm = call_path(call, precision, device, target)
    if path == "fp32" and fmt is Format.FP32:
        return 0, call.saved_bytes
    if path == "fp32":  # an op autocast keeps in FP32 inside a half layer: its operands as they are
        saved = {call.alias[i]: s for i, s in _saved_operands(call) if not s.weight}
        return 0, sum(s.held_bytes for s in saved.values())
    if path == "autocast":
        weights = sum(0 if s.dtype == fmt.dtype else s.numel * fmt.bytes for _, s in _saved_operands(call) if s.weight)
        # Saved as is in FP32 (a whole storage, or a copy the op made): the same tensors in the
        # half dtype. Saved before this call in FP32 (deduplicated there): a new half copy now.
        activations = sum(nbytes * fmt.bytes // 4 for _, nbytes in call.saved)
        activations += sum(s.numel * fmt.bytes for i, s in _saved_operands(call) if not s.weight and call.already_saved[i])
        return int(weights), int(activations)
    if not any(s.requires_grad for s in call.tensors):
        return 0, 0  # no autograd node, nothing saved
    if path == "emulated" or gemm is None:  # call_path gives every kernel call its shape
        inputs = [s for s in call.tensors if s.dtype.is_floating_point and not s.weight]
        if fmt is Format.NVFP4:  # codes of (rows, last dimension), the last padded to 16, two per byte
            return 0, sum(_nvfp4_codes_bytes(s.shape) for s in inputs)
        return 0, int(sum(s.numel * fmt.bytes for s in inputs))
    m, k, n = gemm
    has_weight = any(s.operand and s.weight for s in call.tensors)
    grads = [s.requires_grad for s in call.tensors if s.operand]  # (input, weight) of a linear
    high_backward = precision.grad_format is Format.FP32
    # The weight gradient's product in high precision takes the forward's input copy.
    high_weight_grad = high_backward or precision.high_precision_weight_grad
    if path == "mx":
        # mx_gemm.Fp8MxLinear saves x tiled along M (for the weight's gradient) and the weight
        # tiled along N (for the input's): K rows each, the tiled dimension padded to 32, one byte
        # per element and one E8M0 byte per tile. A high-precision product takes the forward's
        # copy instead: M or N rows, K padded to 32.
        k32 = _round_up(k, MX_TILE)
        x_t, w_t = ((rows * k32 if high else k * _round_up(rows, MX_TILE)) * (1 + 1 / MX_TILE) * bool(need)
                    for rows, need, high in ((m, grads[-1], high_weight_grad), (n, grads[0], high_backward)))
        return (int(w_t), int(x_t)) if has_weight else (0, int(x_t + w_t))
    if path == "nvfp4":
        # nvfp4.Nvfp4Linear saves the input along M (K rows, M padded to 16; a high-precision
        # weight gradient: the forward's copy, M rows, K padded to 16) and the weight in 16x16 blocks
        # (N and K padded to 16): half a byte per element, an E4M3 byte per block, one FP32 scale per tensor.
        k16, m16, n16 = (_round_up(v, NVFP4_TILE) for v in (k, m, n))
        x_elements = m * k16 if high_weight_grad else k * m16
        x_t = (x_elements // 2 + x_elements // NVFP4_TILE + _SCALE_BYTES) * bool(grads[-1])
        w = (n16 * k16 // 2 + (n16 // NVFP4_TILE) * (k16 // NVFP4_TILE) + _SCALE_BYTES) * bool(grads[0])
        return (w, x_t) if has_weight else (0, x_t + w)
    if path == "block":
        # block_gemm.Fp8BlockLinear saves x re-tiled along M (for the weight's gradient: (K', M'),
        # 1x128 tiles, FP32 scales) and the weight's transposed blocks ((K', N'), FP32 block grid)
        # whenever a gradient is needed; every dimension padded to 128.
        # A high-precision weight gradient keeps the forward's copy instead: M rows, K' tiled.
        k_pad, m_pad, n_pad = (_round_up(v, BLOCK) for v in (k, m, n))
        x_rows = m if high_weight_grad else m_pad
        x_t = (k_pad * x_rows + (k_pad // BLOCK) * x_rows * _SCALE_BYTES) * bool(grads[-1])
        w_t = k_pad * n_pad + (k_pad // BLOCK) * (n_pad // BLOCK) * _SCALE_BYTES
        return (w_t, x_t) if has_weight else (0, x_t + w_t)
    if fmt.is_fp8:
        # gemm.Fp8Linear saves the input in FP8 with K padded to the kernel's 16, two scalar
        # scales, and the weight's cached FP8 transpose (K', N') — a fresh one when the operand is
        # no weight.
        k_pad, n_pad = _round_up(k, FP8_ALIGN), _round_up(n, FP8_ALIGN)
        transposed = k_pad * n_pad * int(fmt.bytes)
        activations = m * k_pad * int(fmt.bytes) + 2 * _SCALE_BYTES
        return (transposed, activations) if has_weight else (0, activations + transposed)
    # gemm.Int8Linear saves the INT8 input padded to the kernel's shape (M > 16, K a multiple of 8)
    # and its scale(s); the weight it keeps is the FP32 master itself. Outlier channels, once
    # calibration froze, add at most one high-precision column in 128 of the input: left out.
    row = precision.scaling.granularity is Granularity.ROW
    rows = max(m, INT8_MIN_ROWS)
    return 0, rows * _round_up(k, INT8_ALIGN) + (m if row else 1) * _SCALE_BYTES


def _nvfp4_codes_bytes(shape) -> int:
    """Bytes of an NVFP4 round trip's saved codes (`quantizers.Nvfp4Quantizer`): two per byte,
    the last dimension of its 2-D view padded to 16."""
    rows, cols = rows_and_columns(shape)
    return rows * _round_up(cols, NVFP4_TILE) // 2


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def layer_memory(layer: LayerTrace, precision: "LayerPrecision | Format | str", device: "torch.device | str",
                 target: "TargetDevice | None" = None) -> MemoryCost:
    """`MemoryCost` of ``layer`` in ``precision`` (a `LayerPrecision` or a format) on ``device``,
    or as it would run on ``target`` (`call_path`: a kernel's saved operands or an emulation's).

    Pure arithmetic on the traced shapes; no kernel runs.
    """
    if not isinstance(precision, LayerPrecision):
        precision = LayerPrecision(precision)
    weights = activations = 0
    for call in layer.calls:
        w, a = _call_bytes(call, precision, device, target)
        weights += w
        activations += a
    return MemoryCost(weights, activations, layer.other_saved_bytes, layer.param_bytes)
