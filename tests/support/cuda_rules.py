"""`CudaRules`: fail a CPU test when a low-precision kernel call would be refused on an H100.

The CPU kernels of ``torch._scaled_mm`` and ``torch._int_mm`` take any shape and layout, and
CPU casts to ``float8_e4m3fn`` saturate, so a runtime can pass every CPU test and still fail (or
produce NaN) on the GPU. `CudaRules` is a `TorchDispatchMode` that inspects those calls at the
aten level and records each one that CUDA under torch >= 2.11 (the supported floor) would reject.

Sources of the rules (pytorch/pytorch):

- ``aten/src/ATen/native/cuda/Blas.cpp``: ``_scaled_mm_out_cuda`` (K and N divisible by 16, FP8
  operands, never E5M2 x E5M2, bias dtypes and out_dtype), ``get_joint_scaling`` with
  ``is_tensorwise_scaling`` / ``is_rowwise_scaling`` (scale dtypes and shapes), ``_scaled_gemm``
  ("Only multiplication of row-major and column-major matrices is supported by cuBLASLt"),
  ``_int_mm_out_cuda`` (M > 16, K and N positive multiples of 8).
- ``aten/src/ATen/native/cuda/RowwiseScaledMM.cu``: ``check_inputs`` of ``f8f8bf16_rowwise``,
  the kernel rowwise scaling uses before cuBLAS 12.9 or sm_90 (E4M3 second operand, no FP32
  output); from cuBLAS 12.9 on sm_90 (torch 2.11's CUDA 13 wheel) cuBLASLt runs it, FP16 out too.
- ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` (torch 2.11): ``_scaled_mm_cuda_v2_out`` and the
  block-scaled recipes it dispatches (``_scaled_block1x128_block128x128``,
  ``_scaled_block1x128_block1x128``: E4M3 operands, FP32 scales outer-dim-major, the 128x128
  operand's K-block count padded to 4); torch 2.11's ``_meta_registrations.py``
  (``_check_scaled_mm_sizes_v2``: K // 128 tiles, so whole tiles under compile).
- ``test/test_linalg.py``: ``test__int_mm`` expects ``CUBLAS_STATUS_NOT_SUPPORTED`` for a
  transposed first operand.
- NVIDIA cuBLAS docs, ``cublasLtMatmul`` FP8 requirements: 16-byte aligned pointers and leading
  dimensions.

Casts: a finite value that a cast rounds past the FP8 format's max relies on saturation, which
eager CUDA casts lack before torch 2.12 (E4M3 gives NaN) and E5M2 never has (it gives inf).
Values up to max plus half an ulp round to max on every device and pass. Infinities and NaN may
reach a cast: they must propagate.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autoprec.runtime.block_gemm  # noqa: F401  (registers torch.ops.autoprec.block_scaled_mm)

__all__ = ["CudaRules", "Violation"]

aten = torch.ops.aten
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALED_MM_OUT = (torch.float32, torch.bfloat16, torch.float16, *FP8)
_ALIGN = 16  # bytes; cuBLASLt FP8 pointers and leading dimensions


@dataclasses.dataclass(frozen=True)
class Violation:
    """One call CUDA would refuse: the op, the rule it breaks, and what it was called with."""

    op: str
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.op}: {self.rule} [{self.detail}]"


def _describe(**tensors) -> str:
    return ", ".join(
        f"{name}={tuple(t.shape)}/{tuple(t.stride())}/{str(t.dtype).removeprefix('torch.')}"
        for name, t in tensors.items()
        if torch.is_tensor(t)
    )


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _col_major(t: torch.Tensor) -> bool:
    return _row_major(t.t())


def _bind(func, args, kwargs) -> dict:
    """The call's arguments by schema name (missing optional ones read as None)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    return bound


def _layout_problems(a, b, multiple: int, rule: str) -> list[str]:
    """cuBLASLt's layout rules for ``a @ b``: K and N multiples of ``multiple``, first operand
    row-major, second column-major, pointers and leading dimensions 16-byte aligned."""
    k, n = a.shape[1], b.shape[1]
    unaligned = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % multiple]
    problems = [f"{' and '.join(unaligned)} {rule}"] if unaligned else []
    if not (_row_major(a) and _col_major(b)):
        problems.append("first operand must be row-major and second column-major")
    elif not unaligned:  # a slice can keep K, N aligned and still break the pointer
        misaligned = [
            name
            for name, t, lead in (("a", a, a.stride(0)), ("b", b, b.stride(1)))
            if t.data_ptr() % _ALIGN or (lead * t.element_size()) % _ALIGN
        ]
        if misaligned:
            problems.append(f"{'/'.join(misaligned)}: pointer or leading dimension not {_ALIGN}-byte aligned")
    return problems


def _scaled_mm_problems(a, b, scale_a, scale_b, bias, scale_result, out_dtype) -> list[str]:
    m, k = a.shape
    n = b.shape[1]
    problems = []
    if a.dtype not in FP8 or b.dtype not in FP8:
        problems.append("operands must be float8_e4m3fn or float8_e5m2")
    elif a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("E5M2 x E5M2 is not supported (make one operand E4M3)")
    problems += _layout_problems(a, b, 16, "must be divisible by 16 (pad)")
    if out_dtype not in _SCALED_MM_OUT:
        problems.append(f"out_dtype {out_dtype} not allowed")
    tensorwise = all(s.dtype == torch.float32 and s.numel() == 1 for s in (scale_a, scale_b))
    rowwise = (
        scale_a.dtype == scale_b.dtype == torch.float32
        and scale_a.dim() == scale_b.dim() == 2
        and tuple(scale_a.shape) == (m, 1)
        and tuple(scale_b.shape) == (1, n)
        and scale_a.is_contiguous()
        and scale_b.t().is_contiguous()
        and scale_b.stride(1) == 1
    )
    if not (tensorwise or rowwise):
        problems.append(f"scales must be float32, both one element or ({m},1) and (1,{n}) contiguous")
    if rowwise and not tensorwise:
        # torch 2.11 on sm_90 with cuBLAS >= 12.9 (its CUDA 13 wheel) runs row-wise scaling in
        # cuBLASLt, with a BF16 or FP16 output (Blas.cpp, _scaled_mm_out_cuda); the
        # f8f8bf16_rowwise fallback (RowwiseScaledMM.cu check_inputs) takes no FP32 output.
        if out_dtype not in (torch.bfloat16, torch.float16):
            problems.append("rowwise scaling needs out_dtype bfloat16 or float16")
        if b.dtype != torch.float8_e4m3fn:
            problems.append("rowwise scaling needs an E4M3 second operand")
    if bias is not None:
        if out_dtype == torch.float32:
            problems.append("bias is not supported with out_dtype float32 (add it after the GEMM)")
        elif bias.dtype not in (torch.bfloat16, torch.float16):
            problems.append(f"bias must be bfloat16 or float16, got {bias.dtype}")
        elif out_dtype in (torch.bfloat16, torch.float16) and bias.dtype != out_dtype:
            problems.append(f"bias dtype {bias.dtype} must match out_dtype {out_dtype}")
        if bias.numel() != n:
            problems.append(f"bias must have N={n} elements")
    if scale_result is not None and (scale_result.numel() != 1 or scale_result.dtype != torch.float32):
        problems.append("scale_result must be a one-element float32 tensor")
    return problems


_TILE, _BLOCK = 4, 5  # torch.nn.functional.ScalingType.BlockWise1x128 / BlockWise128x128
_RECIPE_NAMES = {0: "TensorWise", 1: "RowWise", 2: "BlockWise1x16", 3: "BlockWise1x32", _TILE: "BlockWise1x128", _BLOCK: "BlockWise128x128"}


def _outer_major(scale: torch.Tensor, rows: int, cols: int, lead: int) -> bool:
    """``scale`` is (rows, cols) with strides (1, lead), or (rows, 1) with stride 1 (a size-1
    dimension's stride is free): ScaledBlas.cpp's "outer-dim-major" layout."""
    return (
        tuple(scale.shape) == (rows, cols)
        and scale.stride(0) == 1
        and (scale.stride(1) == lead or (cols == 1 and scale.stride(1) == 1))
    )


def _scaled_mm_v2_problems(a, b, scales_a, recipe_a, scales_b, recipe_b, bias, out_dtype, contraction_dim, use_fast_accum) -> list[str]:
    """The block-scaled GEMM (``aten::_scaled_mm_v2``; ScaledBlas.cpp ``_scaled_mm_cuda_v2_out``,
    ``_scaled_block1x128_block128x128``, ``_scaled_block1x128_block1x128``, cuBLASLt's layouts)."""
    m, k = a.shape
    n = b.shape[1]
    pair = (tuple(recipe_a), tuple(recipe_b))
    if pair not in (((_TILE,), (_BLOCK,)), ((_TILE,), (_TILE,))):
        named = " x ".join("+".join(_RECIPE_NAMES.get(r, str(r)) for r in side) for side in pair)
        return [f"recipes {named}: the runtime issues only BlockWise1x128 x BlockWise128x128 / x BlockWise1x128 "
                "here (per-tensor and row-wise go through torch._scaled_mm)"]
    problems = []
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        problems.append("block-scaled recipes take float8_e4m3fn operands only (both)")
    if len(scales_a) != 1 or len(scales_b) != 1 or any(s.dtype != torch.float32 for s in (*scales_a, *scales_b)):
        problems.append("block-scaled recipes take one float32 scale tensor per operand")
        return problems
    if contraction_dim:
        problems.append("contraction_dim must stay empty (K is a's dim 1 and b's dim 0)")
    # The CUDA kernel counts ceil(K/128) tiles, torch 2.11's meta function (what compile traces)
    # K // 128: the two agree on whole tiles only.
    problems += _layout_problems(a, b, 128, "must be multiples of 128 for block scales (pad)")
    kb = -(-k // 128)
    sa, sb = scales_a[0], scales_b[0]
    if not _outer_major(sa, m, kb, m):
        problems.append(f"scale_a (1x128) must be ({m}, {kb}) with strides (1, {m})")
    if pair[1] == (_BLOCK,):
        l4 = -(-kb // 4) * 4
        if not _outer_major(sb, l4, -(-n // 128), l4):
            problems.append(f"scale_b (128x128) must be ({l4}, {-(-n // 128)}) with strides (1, {l4}): K blocks padded to 4")
    elif not _outer_major(sb, n, kb, n):
        problems.append(f"scale_b (1x128) must be ({n}, {kb}) with strides (1, {n})")
    if use_fast_accum:
        problems.append("use_fast_accum must be False with block scales (their kernels keep FP32 partial sums)")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        problems.append(f"out_dtype {out_dtype} not allowed")
    if bias is not None:
        if out_dtype == torch.float32:
            problems.append("bias is not supported with out_dtype float32 (add it after the GEMM)")
        elif bias.dtype != out_dtype:
            problems.append(f"bias dtype {bias.dtype} must match out_dtype {out_dtype}")
        if bias.numel() != n:
            problems.append(f"bias must have N={n} elements")
    return problems


def _int_mm_problems(a, b) -> list[str]:
    m, k = a.shape
    n = b.shape[1]
    problems = []
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        problems.append("operands must be int8")
    if m <= 16:
        problems.append(f"M={m} must be greater than 16")
    unaligned = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size <= 0 or size % 8]
    if unaligned:
        problems.append(f"{' and '.join(unaligned)} must be positive multiples of 8 (pad)")
    if not _row_major(a):
        problems.append("first operand must be row-major (cuBLASLt rejects a transposed one)")
    return problems


def _rounding_limit(dtype: torch.dtype) -> float:
    """The smallest magnitude a round-to-nearest cast takes past the format's max: max plus half
    an ulp at max (E4M3: 448 + 16, E5M2: 57344 + 4096). Below it the cast gives max without any
    saturation (c10/util/Float8_e4m3fn.h ``fp8e4m3fn_from_fp32_value``); from it on, NaN or inf."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _overflow(src: torch.Tensor, dst_dtype: torch.dtype) -> tuple[int, float]:
    """How many finite elements of ``src`` a cast to ``dst_dtype`` takes past its max, and the
    largest finite magnitude (two reductions, one host sync)."""
    wide = src.double() if src.dtype == torch.float64 or not src.is_floating_point() else src.float()
    magnitude = torch.where(torch.isfinite(wide), wide.abs(), 0.0)
    over = magnitude >= _rounding_limit(dst_dtype)
    return int(over.sum()), float(magnitude.max()) if magnitude.numel() else 0.0


class CudaRules(TorchDispatchMode):
    """``with CudaRules() as rules:`` records every ``_scaled_mm`` / ``_int_mm`` call and FP8 cast
    an H100 would refuse or turn into NaN, and raises `AssertionError` on exit listing them (also
    when the body raises), unless ``raise_on_exit=False``.

    ``violations``: the `Violation` list; ``counts``: calls seen per op (``"_scaled_mm"``,
    ``"_scaled_mm_v2"``, ``"_int_mm"``, ``"fp8_cast"``), so tests can assert the kernels ran. Each FP8 cast costs one
    extra pass over its source and one host sync; other ops only a dict lookup.
    """

    def __init__(self, raise_on_exit: bool = True):
        super().__init__()
        self.raise_on_exit = raise_on_exit
        self.violations: list[Violation] = []
        self.counts: collections.Counter = collections.Counter()
        self._checks = {
            aten._scaled_mm.default: self._check_scaled_mm,
            aten._scaled_mm.out: self._check_scaled_mm,
            aten._int_mm.default: self._check_int_mm,
            aten._int_mm.out: self._check_int_mm,
            aten._to_copy.default: self._check_to_copy,
            aten.copy_.default: self._check_copy,
            aten._scaled_mm_v2.default: self._check_scaled_mm_v2,
            # autoprec's opaque wrapper of the block-scaled call (runtime.block_gemm): the mode
            # sees the wrapper, not the aten call it makes.
            torch.ops.autoprec.block_scaled_mm.default: self._check_block_scaled_mm,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self._checks.get(func)
        if check is not None:
            check(_bind(func, args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        if self.raise_on_exit and self.violations:
            lines = "\n".join(str(v) for v in self.violations)
            raise AssertionError(f"{len(self.violations)} call(s) CUDA would refuse:\n{lines}") from exc

    def _record(self, op: str, problems: list[str], **tensors) -> None:
        detail = _describe(**tensors)
        self.violations.extend(Violation(op, rule, detail) for rule in problems)

    def _check_scaled_mm(self, call: dict) -> None:
        self.counts["_scaled_mm"] += 1
        a, b, out = call["self"], call["mat2"], call.get("out")
        out_dtype = call.get("out_dtype") or (out.dtype if out is not None else a.dtype)
        problems = _scaled_mm_problems(
            a, b, call["scale_a"], call["scale_b"], call.get("bias"), call.get("scale_result"), out_dtype
        )
        self._record(
            "_scaled_mm", problems, a=a, b=b, scale_a=call["scale_a"], scale_b=call["scale_b"], bias=call.get("bias")
        )

    def _check_block_scaled_mm(self, call: dict) -> None:
        self.counts["_scaled_mm_v2"] += 1
        a, b, scale_a, scale_b = call["a"], call["b"], call["scale_a"], call["scale_b"]
        recipe_b = _BLOCK if call["blocks_b"] else _TILE
        problems = _scaled_mm_v2_problems(a, b, [scale_a], [_TILE], [scale_b], [recipe_b], call.get("bias"), call["out_dtype"], (), False)
        self._record("_scaled_mm_v2", problems, a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=call.get("bias"))

    def _check_int_mm(self, call: dict) -> None:
        self.counts["_int_mm"] += 1
        a, b = call["self"], call["mat2"]
        self._record("_int_mm", _int_mm_problems(a, b), a=a, b=b)

    def _check_cast(self, op: str, src: torch.Tensor, dst_dtype) -> None:
        if dst_dtype not in FP8 or src.dtype == dst_dtype:
            return
        self.counts["fp8_cast"] += 1
        over, largest = _overflow(src, dst_dtype)
        if over:
            limit = torch.finfo(dst_dtype).max
            rule = f"{over} finite value(s) round past {limit:g} (largest {largest:.7g}): they rely on saturation (clamp first)"
            self._record(op, [rule], src=src)

    def _check_to_copy(self, call: dict) -> None:
        self._check_cast("_to_copy", call["self"], call.get("dtype"))

    def _check_copy(self, call: dict) -> None:
        self._check_cast("copy_", call["src"], call["self"].dtype)

    def _check_scaled_mm_v2(self, call: dict) -> None:
        self.counts["_scaled_mm_v2"] += 1
        a, b = call["self"], call["mat2"]
        problems = _scaled_mm_v2_problems(
            a, b, call["scale_a"], call["recipe_a"], call["scale_b"], call["recipe_b"], call.get("bias"),
            call.get("out_dtype") or torch.bfloat16, call.get("contraction_dim") or (), call.get("use_fast_accum", False),
        )
        self._record("_scaled_mm_v2", problems, a=a, b=b, scale_a=call["scale_a"][0], scale_b=call["scale_b"][0], bias=call.get("bias"))
