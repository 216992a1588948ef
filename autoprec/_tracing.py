"""Running a model to look at it: the module call stack, a run that leaves no trace, weights.

Three parts watch a model run to learn about it: `coverage` (which modules run matrix products),
`costs.trace` (what each module saves for backward) and `sensitivity` (which module calls which).
Each needs the stack of modules executing, and a run whose side effects are undone; the runtime
and the cost trace share one rule for what a weight is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["module_stack", "side_effect_free", "is_weight", "own_autograd_functions"]


@contextlib.contextmanager
def module_stack(model: nn.Module, on_enter: Optional[Callable[[str, list], None]] = None,
                 only: "Optional[Collection[str]]" = None) -> Iterator[list[str]]:
    """Yield the list of fully qualified names of the modules of ``model`` now executing,
    outermost first, kept by a forward pre-hook and a forward hook on every module (removed on
    exit, also when the body raises), or only on the modules named in ``only``.
    ``on_enter(fqn, stack)`` runs before a module is pushed.

    Cost: two Python calls per call of a hooked module (and two hooks registered and removed per
    hooked module); the hooks return None, so outputs stay as they are.
    """
    fqn_of = {module: fqn for fqn, module in model.named_modules() if only is None or fqn in only}
    stack: list[str] = []

    def push(module, *_):
        fqn = fqn_of[module]
        if on_enter is not None:
            on_enter(fqn, stack)
        stack.append(fqn)

    def pop(module, *_):
        stack.pop()

    handles = []
    try:
        for module in fqn_of:
            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop, always_call=True))
        yield stack
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def side_effect_free(model: nn.Module) -> Iterator[None]:
    """A run of ``model`` that leaves its buffers (BatchNorm statistics) and the global RNG
    (dropout draws) as they were, also when it raises: a look at the model must not change the
    real run. Costs one copy of the buffers. CUDA's RNG is forked only once CUDA is initialized
    (a CUDA model has done that), so a CPU run does not start CUDA.

    Every layer runs (`every_layer_runs`): a look measures the step a memory budget must hold.

    The buffers are written back through ``.data``, which autograd's version counters do not
    see (as BatchNorm's own running-statistics update is not seen): a look taken between a real
    forward and its backward (the scheduler binding at the end of a model's first call) must not
    make that backward refuse a buffer it saved (BERT's ``token_type_ids`` slice, BatchNorm's
    running statistics) as modified in place. The values written are the ones that forward left.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), every_layer_runs(model):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.data.copy_(buffers[name])


def _layer_drop_rates(owner: Any) -> list[str]:
    return [name for name, value in vars(owner).items()
            if (name == "layerdrop" or name.endswith("_layerdrop")) and isinstance(value, float) and value > 0]


@contextlib.contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[None]:
    """``model`` with its LayerDrop rates at 0 inside: a training-mode forward then runs every
    layer, where it would skip each at that rate (the rate attributes HF's speech and
    translation models and fairseq's read, ``layerdrop`` or ``*_layerdrop``, on a module or its
    ``config``). The saved bytes a look measures are then the step's without a skip, as the
    trace sees it (looks that each drew their own skips measured WavLM's mixed plans at
    0.67-1.39x what they hold). Restored on exit, also when the body raises. Costs one pass over
    the modules' attributes."""
    owners = {id(o): o for m in model.modules() for o in (m, getattr(m, "config", None)) if o is not None and hasattr(o, "__dict__")}
    rates = [(o, name, getattr(o, name)) for o in owners.values() for name in _layer_drop_rates(o)]
    try:
        for owner, name, _ in rates:
            setattr(owner, name, 0.0)
        yield
    finally:
        for owner, name, value in rates:
            setattr(owner, name, value)


def is_weight(t: Any) -> bool:
    """A Parameter or a view of one (``w.t()``): the runtime caches it per optimizer step and
    re-derives it in backward, and the cost trace counts it as a weight, not as a saved tensor."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def own_autograd_functions(output: Any) -> tuple[str, ...]:
    """The autograd Functions in the graph behind ``output``'s tensors that neither torch nor
    autoprec defines (a model's own, as YOSO's), by qualified name, sorted: their backward is the
    model's code, which a format can break where its forward ran (built-in ops' backward formulas
    take the dtypes their forward did). One visit per graph node; no tensor data read."""
    stack: list[Any] = [t.grad_fn for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)  # set on a Python autograd Function's backward node
        if cls is not None and cls.__module__.split(".")[0] not in ("torch", "autoprec"):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(sorted(found))
