"""Applying a plan: per-layer autocast, FP8 / INT8 kernels, calibration state.

Owns: `context` (`PlanRuntime`, `apply_plan`), `layer_wrappers` / `installed` (the forwards installed on
layers), `products` (each matrix product in its layer's format), `layers` (a layer's runtime
state), `quantizers`, `calibration` (INT8), `gemm` / `block_gemm` (the kernels' autograd
functions), `casts` / `triton_cast` / `triton_block_cast` / `triton_arith` (the fused casts),
`emulation` (formats without a kernel, named as such), `recompute` (recomputed blocks and the
user's own checkpoints), `fsdp_fp8` (FSDP2's FP8 all-gather), `tensor_parallel` (products on
DTensor shards), `pipelining` (a pipeline stage's metadata inference changes no state),
`model_index`. May import the
shared basics (`autoprec/*.py`) only.
"""

from .context import EmulationWarning, PlanRuntime, apply_plan, removing

__all__ = ["apply_plan", "PlanRuntime", "EmulationWarning", "removing"]
