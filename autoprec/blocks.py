"""Recompute units: the blocks of a model whose forward can run again in the backward.

Recomputing one matrix product saves nothing (a linear layer keeps only its input, which the
recomputation would need anyway), so the unit is a *block*: a module holding several layers whose
intermediate activations (attention scores, MLP hidden states, norms) are what recomputation
frees. `find_blocks` finds them the way torchtitan and Megatron apply activation checkpointing:
the repeated children of an ``nn.ModuleList`` / ``nn.Sequential`` (the transformer blocks of a
GPT, BERT, ViT or Llama), or the modules a user names by pattern. The Plan stores a recompute flag
per block (`autoprec.Plan.with_recompute`); the runtime runs the flagged ones under
``torch.utils.checkpoint``.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Iterable, Sequence

import torch.nn as nn

from .errors import SearchError

__all__ = ["find_blocks", "check_block_patterns", "layers_of_blocks"]


def _inside(fqn: str, block: str) -> bool:
    return fqn != block and (block == "" or fqn.startswith(block + "."))


def check_block_patterns(patterns: object, where: str) -> tuple[str, ...]:
    """``patterns`` as a tuple of non-empty strings, or a one-line `SearchError` naming ``where`` (the
    setting: ``[rules].recompute``, ``recompute=``) and the fix. No model needed."""
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise SearchError(f'{where}: expected a list of module name patterns like ["blocks.*"], got {patterns!r}')
    bad = [p for p in patterns if not isinstance(p, str) or not p.strip()]
    if bad:
        raise SearchError(f'{where}: every entry must be a non-empty module name pattern like "blocks.*", got {bad[0]!r}')
    return tuple(patterns)


def find_blocks(model: nn.Module, layers: Iterable[str], patterns: "Sequence[str] | None" = None) -> tuple[str, ...]:
    """The recompute units of ``model`` holding at least one of ``layers`` (fqns, e.g. a plan's),
    outermost first in model order; no block lies inside another.

    Without ``patterns``: the children of an ``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict`` whose class occurs at least twice among that container's children and that
    hold a layer strictly inside (``blocks.0``, ``blocks.1`` of a GPT; ``bert.encoder.layer.0`` of
    BERT; ``layers.0`` of torchtitan's Llama, whose blocks are a ``ModuleDict`` so a pipeline
    split keeps their names); the search does not
    descend into a block found. A container's lone or layer-only children (an MLP's two
    ``nn.Linear`` in a ``Sequential``) are not blocks: recomputing one layer saves nothing.

    With ``patterns`` (``fnmatch`` on fqns, e.g. ``["blocks.*"]``): the outermost modules that match
    and hold a layer strictly inside (a pattern's matches inside another match are dropped:
    ``"blocks.*"`` also matches ``blocks.0.attn``; a layer itself is no block, ``"blocks.*.fc"``
    names none). Each pattern must match such a module: a one-line `SearchError` names the
    pattern and the fix otherwise. Costs one walk of the module tree.

    Args:
        model: the model.
        layers: the fqns of its layers (a plan's ``plan.layers``).
        patterns: ``fnmatch`` patterns naming the blocks (None: found as above).

    Returns:
        The blocks' fqns, outermost first in model order.

    Raises:
        SearchError: a pattern matches no module that holds a layer strictly inside.
    """
    layers = [fqn for fqn in layers]
    modules = dict(model.named_modules())

    def holds_layer(fqn: str, strictly: bool) -> bool:
        return any(_inside(layer, fqn) or (not strictly and layer == fqn) for layer in layers)

    if patterns is None:
        found: list[str] = []
        for fqn, module in modules.items():
            if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or any(_inside(fqn, b) or fqn == b for b in found):
                continue
            children = list(module.named_children())
            repeated = Counter(type(child) for _, child in children)
            for name, child in children:
                child_fqn = f"{fqn}.{name}" if fqn else name
                if repeated[type(child)] >= 2 and holds_layer(child_fqn, strictly=True):
                    found.append(child_fqn)
        return tuple(fqn for fqn in modules if fqn in set(found))

    patterns = check_block_patterns(patterns, "recompute patterns")
    matched: dict[str, str] = {}  # fqn -> the first pattern matching it
    for pattern in patterns:
        # A block holds a layer strictly inside: a layer alone is no block, as `Plan.validate` says.
        hits = [fqn for fqn in modules if fnmatch.fnmatchcase(fqn, pattern) and holds_layer(fqn, strictly=True)]
        if not hits:
            some = [fqn for fqn in modules if fnmatch.fnmatchcase(fqn, pattern)]
            named = ", ".join(map(repr, some[:3]))
            if some and not set(some).isdisjoint(layers):
                why = f"it matches layers ({named}), not blocks: recomputing one layer saves nothing (it keeps only its input)"
            else:
                why = f"it matches only modules without a layer ({named})" if some else "it matches no module"
            automatic = find_blocks(model, layers)  # the blocks found without patterns make the best example
            example = automatic[0] if automatic else next((fqn for fqn in modules if holds_layer(fqn, strictly=True) and fqn), None)
            hint = f"e.g. {example!r}" if example is not None else "here only the whole model, ''"
            raise SearchError(f"recompute pattern {pattern!r}: {why}; give fnmatch patterns of module names that hold layers, {hint}")
        for fqn in hits:
            matched.setdefault(fqn, pattern)
    return tuple(fqn for fqn in matched if not any(_inside(fqn, other) for other in matched))


def layers_of_blocks(blocks: Iterable[str], layers: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """``block fqn -> the layers strictly inside it``, in the order of ``layers`` (every layer
    for the root block ``""``): each layer's dotted prefixes looked up once, O(layers x nesting
    depth), not a scan of every layer per block."""
    out: dict[str, list[str]] = {b: [] for b in blocks}
    for fqn in layers:
        parts = fqn.split(".")
        for prefix in ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]:
            if prefix in out and fqn != prefix:
                out[prefix].append(fqn)
    return {b: tuple(inside) for b, inside in out.items()}
