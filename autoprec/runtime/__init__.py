"""Applying a plan: per-layer autocast, FP8 / INT8 kernels, calibration state."""

from .context import EmulationWarning, PlanRuntime, apply_plan, removing

__all__ = ["apply_plan", "PlanRuntime", "EmulationWarning", "removing"]
