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

    The buffers are written back through ``.data``, which autograd's version counters do not
    see (as BatchNorm's own running-statistics update is not seen): a look taken between a real
    forward and its backward (the scheduler binding at the end of a model's first call) must not
    make that backward refuse a buffer it saved (BERT's ``token_type_ids`` slice, BatchNorm's
    running statistics) as modified in place. The values written are the ones that forward left.
    """
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.data.copy_(buffers[name])


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
