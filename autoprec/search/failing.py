"""Formats a model's code cannot run, found on the search's steps: a layer that raised in a
format on a probe or trial step (`PlanRuntime.take_failures`) or in a candidate's run off the
training path (`preflight`). A role's layers (the same projection in every block) run the same
code, so the format is out for the whole role: in the probe plans, the candidates, and the
search space (through the sensitivity's ``metadata["failed"]``, which `planner.space_steps`
reads). Keyed ``(role, format name) -> the error's first line``. Each function O(layers)."""

from __future__ import annotations

from typing import Mapping

from ..formats import Format
from ..plan import Plan

__all__ = ["failing_roles", "mark_failed", "without_failing"]


def failing_roles(plan: Plan, failed: Mapping[str, str], roles: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """``(role, format name) -> why`` for each layer of ``plan`` whose forward raised in its
    format (``failed``: fqn -> why, `PlanRuntime.take_failures`)."""
    return {(roles[fqn], plan.layers[fqn].format.value): why for fqn, why in failed.items()}


def without_failing(plan: Plan, failing: Mapping[tuple[str, str], str], roles: Mapping[str, str]) -> Plan:
    """``plan`` with each layer whose (role, format) is ``failing`` in FP32, listed in its
    metadata ``promoted_for_failure``; ``plan`` itself when none is."""
    out = sorted(fqn for fqn, lp in plan.layers.items() if (roles[fqn], lp.format.value) in failing)
    if not out:
        return plan
    return plan.with_layers({fqn: Format.FP32 for fqn in out}).replace(metadata={**plan.metadata, "promoted_for_failure": out})


def mark_failed(failed_meta: dict, failing: Mapping[tuple[str, str], str], roles: Mapping[str, str]) -> None:
    """Each layer of a ``failing`` role has the format marked failed in ``failed_meta`` (a
    sensitivity's ``metadata["failed"]``: fqn -> format name -> why), where the estimate had not."""
    for fqn, role in roles.items():
        for (failing_role, fmt), why in failing.items():
            if role == failing_role:
                failed_meta.setdefault(fqn, {}).setdefault(fmt, f"on a step of the search: {why}")
