"""Which model a `precision_context` runs, learnt from the module calls of the thread that entered it.

A *model* here is a module holding a matrix parameter (2-D or more, outside embedding tables):
what has layers to plan. Loss modules, metrics and activations called beside the model hold none
and are never in question.

Inside one context, `ModelWatch` sees every module call of the entering thread that is not inside
the model (a global forward pre-hook, paused while the model runs, so the model's own submodules
keep torch's hook-free fast path):

- no model known yet (a scheduler made without ``model=``, first context): the first model called
  is the model. torch hands a global pre-hook the positional inputs only, and a hook registered
  on the module while its call is under way first runs at that call's end; so the keyword inputs
  of that first call are read by a forward hook at its end (``at_end``), the one point where
  positional and keyword inputs and the output are all at hand however the model was called;
- a model known: a call of a module that is neither a part of it nor wraps it (DDP) is another
  model, refused with one `RuntimeStateError` line before it runs, since it would run unplanned
  under the plan's autocast.

`Binding` holds what a scheduler is bound to (the model, its DDP wrapper, its first call) and
builds each context's watch; binding checks what it binds (`check_materialised`, `check_layers`,
`check_prediction`). Costs: per context two hook registrations; per call of a module outside the model one Python call (loss modules),
plus a walk of the module trees when that module holds parameters. Inside the model: nothing.
At bind: one traced forward to find the layers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from ..blocks import find_blocks
from ..calls import ModelCall, prediction_of
from ..coverage import LayerInfo, find_layers
from ..distributed import unwrap_ddp
from ..errors import AutoprecError, ModelCallError, RuntimeStateError, SearchError, SettingsError
from ..runtime import EmulationWarning, pipelining

if TYPE_CHECKING:
    from .config import SchedulerConfig

__all__ = ["Binding", "ModelWatch", "bindable_layers", "check_layers", "check_materialised", "check_prediction", "holds_matrix", "require_bound", "unbound_exit"]

# Tables looked up, not multiplied: a model of embeddings alone has no layer (coverage does the same).
_LOOKUP_CLASSES = (nn.Embedding, nn.EmbeddingBag)


def holds_matrix(module: nn.Module) -> bool:
    """Whether ``module`` (with its children) holds a matrix parameter outside embedding tables."""
    return any(p.dim() >= 2 for m in module.modules() if not isinstance(m, _LOOKUP_CLASSES) for p in m.parameters(recurse=False))


def _related(module: nn.Module, model: nn.Module) -> bool:
    """``module`` is ``model``, a part of it, or wraps it (a DDP wrapper, a parent module)."""
    return module is model or any(m is module for m in model.modules()) or any(m is model for m in module.modules())


class ModelWatch:
    """One context's watch over which model runs (see the module doc). Enter it with the context.

    ``model``: the model already known (bound, or given as ``model=``), else None: the first
    model called becomes it. ``at_start(module, args, kwargs)``: once, at the start of the first
    call of the model (``kwargs`` is None when the model was found by the global hook, which
    cannot see them). ``at_end(module, args, kwargs, output)``: once, when that call returns.
    Both run with the watch deaf, so they may run the model themselves (tracing).
    """

    def __init__(self, model: Optional[nn.Module] = None, *, at_start: Optional[Callable[..., None]] = None,
                 at_end: Optional[Callable[..., None]] = None, bound_before: bool = False, on_compiled: Optional[Callable[[], None]] = None):
        self.model = model
        self._on_compiled = on_compiled  # called when the model is called through a torch.compile wrapper
        self.called = False  # the model (or a part of it) ran in this context
        self._bound_before = bound_before  # the model was bound in an earlier context
        self._at_start, self._at_end = at_start, at_end
        self._thread = threading.get_ident()
        self._guard: Optional[RemovableHandle] = None  # the global pre-hook, while it watches
        self._outer: Optional[nn.Module] = None  # the model's call under way (the guard paused)
        self._deaf = False
        self._active = False
        self._handles: list = []
        self._hooked: set[int] = set()  # ids of modules carrying this watch's end-of-call hook

    def __enter__(self) -> "ModelWatch":
        if self.model is not None and self._at_start is not None:
            # A hook on the model itself sees its keyword inputs before it runs.
            self._handles.append(self.model.register_forward_pre_hook(self._model_starts, with_kwargs=True))
        self._guard = register_module_forward_pre_hook(self._on_call)
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mine(self) -> bool:
        return not self._deaf and threading.get_ident() == self._thread

    def _run_deaf(self, fn: Callable[..., None], *args: Any) -> None:
        self._deaf = True
        try:
            fn(*args)
        finally:
            self._deaf = False

    def _on_call(self, module: nn.Module, args: tuple) -> None:
        """The global pre-hook: a module call outside the model."""
        if not self._mine():
            return
        if hasattr(module, "_orig_mod"):
            _quiet_compiled_hook_warning()
            if self._on_compiled is not None:
                self._on_compiled()
        if self.model is None:
            if not holds_matrix(module):
                return
            self.model = module
            self._begin(module)
            if self._at_start is not None:
                at_start, self._at_start = self._at_start, None
                self._run_deaf(at_start, module, args, None)
            return
        if _related(module, self.model):
            self._begin(module)
        elif holds_matrix(module) and not pipelining.in_stage(sys._getframe()):
            # Another stage a schedule runs on this rank: refused at the first step on every rank
            # (`pipeline_stage`), not here, inside a forward, while the other ranks wait on this one.
            raise RuntimeStateError(self._refusal(module))

    def _begin(self, module: nn.Module) -> None:
        """The model (or a part or wrapper of it) starts: pause the guard until this call returns."""
        self.called = True
        self._outer = module
        if self._guard is not None:  # the guard's own hook calls this, so it is registered
            self._guard.remove()
        self._guard = None
        if id(module) not in self._hooked:
            self._hooked.add(id(module))
            self._handles.append(module.register_forward_hook(self._returns, with_kwargs=True, always_call=True))

    def _model_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._mine() and self._at_start is not None:
            at_start, self._at_start = self._at_start, None
            self._run_deaf(at_start, module, args, kwargs)

    def _returns(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        """The end of a call of the model: ``rest`` is ``(kwargs, output)``, or ``(None,)`` when
        the forward raised (torch then calls always-call hooks without keyword inputs)."""
        if not self._mine() or module is not self._outer:
            return
        self._outer = None
        try:
            if self._at_end is not None and len(rest) == 2:
                at_end, self._at_end = self._at_end, None
                self._run_deaf(at_end, module, args, rest[0], rest[1])
        finally:
            if self._active:
                self._guard = register_module_forward_pre_hook(self._on_call)

    def _refusal(self, other: nn.Module) -> str:
        a, b = type(self.model).__name__, type(other).__name__
        if self.called:
            return (f"precision_context(): {a} and then {b} were called in one context; a scheduler plans one model: "
                    f"call {b} outside the context or give it a scheduler of its own (if both are parts of one model, call that model itself, model(...), not model.forward(...))")
        if self._bound_before:
            return (f"precision_context(): this context called {b}, but the scheduler's model is {a} (bound in its first context); "
                    f"a scheduler plans one model for the whole run: call {a} here, or make a new DynamicPrecisionScheduler for {b}")
        return (f"precision_context(): this context called {b}, but the scheduler was made with model={a}; "
                f"call {a} inside the context, or make the scheduler for {b}")


@functools.lru_cache(maxsize=None)
def _quiet_compiled_hook_warning() -> None:
    """torch warns at each call of a ``torch.compile``-d module while a global module hook exists
    ("hooks fire an extra time for the OptimizedModule"): the context's guard is one, and it takes
    the wrapper's call for the model's own. Ignored by its message from the first compiled model
    the scheduler meets on (the call that meets it has warned already), once per process."""
    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks", category=UserWarning)


def require_bound(model: Optional[nn.Module]) -> nn.Module:
    """``model``, or the `RuntimeStateError` a scheduler's part raises before binding gave it one."""
    if model is None:
        raise RuntimeStateError("the scheduler is not bound to a model yet: run the model inside precision_context() first")
    return model


class Binding:
    """What a scheduler is bound to, and how it gets bound (module docstring).

    ``model``: the scheduler's ``model=`` (a DDP wrapper is unwrapped: the plan is the inner
    module's, the wrapper kept as `ddp`), None to bind to the first model called. `example` is
    the binding call (None until bound). A state loaded before binding is `hold`-ed and restored
    when the first forward binds. ``check_output``: the first forward's output must hold a
    prediction (`check_prediction`; a dynamic scheduler's search needs one).
    """

    def __init__(self, model: Optional[nn.Module], *, check_output: bool):
        if model is not None and not isinstance(model, nn.Module):
            raise SettingsError(f"DynamicPrecisionScheduler(model={model!r}): expected the torch.nn.Module being trained, or None to bind to the model run in the first precision_context()")
        self.model, self.ddp = unwrap_ddp(model)
        self.example: Optional[ModelCall] = None
        self._pending: Optional[Mapping[str, Any]] = None  # loaded before binding: applied on bind
        self._check_output = check_output
        self._output_checked = False
        self.compiled = False  # the model was called through a torch.compile wrapper

    def _saw_compiled(self) -> None:
        self.compiled = True

    @property
    def bound(self) -> nn.Module:
        """The bound model (or the one given): what every step after the first forward runs."""
        return require_bound(self.model)

    def use_model(self, model: Optional[nn.Module]) -> None:
        """Take ``model`` as the model before binding, as if given as ``model=``."""
        self.model = model

    def attach(self, model: nn.Module, example: ModelCall) -> None:
        """Bound: to ``model``, by its call ``example``."""
        self.model, self.example = model, example

    def hold(self, state: Mapping[str, Any]) -> None:
        """Keep a state loaded before binding, for the first forward to restore."""
        self._pending = state

    def watch(self, *, bind: Callable[[nn.Module, ModelCall, bool], None], resume: Callable[[Mapping[str, Any]], None],
              enter: Callable[[], None], observe: Callable[..., None]) -> ModelWatch:
        """This context's `ModelWatch`, binding as the case needs: ``bind(model, example,
        at_end)`` binds afresh (``at_end``: at the end of its first call, which ran unplanned);
        ``resume(state)`` restores the held state (the model set); then ``enter()`` enters the
        step's precision; ``observe(module, args, kwargs, output)`` sees a call bound at its end."""
        if self.example is not None:
            return ModelWatch(self.ddp if self.ddp is not None else self.model, bound_before=True, on_compiled=self._saw_compiled)
        if self.model is not None:  # model=: its own pre-hook sees the keyword inputs before it runs
            def at_start(module: nn.Module, args: tuple, kwargs: dict) -> None:
                bind(self.bound, ModelCall.capture(args, kwargs), False)
                enter()

            return ModelWatch(self.ddp if self.ddp is not None else self.model, at_start=at_start, on_compiled=self._saw_compiled)
        if self._pending is not None:  # the saved example call: bind before the first forward
            def resumed(module: nn.Module, args: tuple, kwargs: None) -> None:
                state, self._pending = self._pending, None
                if state is None:
                    raise RuntimeStateError("no saved state to bind with")  # installed only while one is pending
                self.model, self.ddp = unwrap_ddp(module)
                try:
                    resume(state)
                except BaseException:  # a state for another model: stay unbound, as before the call
                    self.model, self.ddp, self._pending = None, None, state
                    raise
                enter()

            return ModelWatch(at_start=resumed, on_compiled=self._saw_compiled)

        def at_end(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            model, self.ddp = unwrap_ddp(module)
            bind(model if model is not None else module, ModelCall.capture(args, kwargs), True)
            enter()
            self._first_output(module, args, kwargs, output)
            observe(module, args, kwargs, output)

        return ModelWatch(at_end=at_end, on_compiled=self._saw_compiled)

    def check_first_output(self, stack: contextlib.ExitStack) -> None:
        """Until it ran: check the bound model's next output (its hook removed with ``stack``)."""
        if not self._output_checked:
            handle = self.bound.register_forward_hook(self._first_output, with_kwargs=True)
            stack.callback(handle.remove)

    def _first_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._output_checked:
            return
        self._output_checked = True
        if self._check_output:
            check_prediction(module, output)


# -- what binding checks ----------------------------------------------------------------------------


def check_materialised(model: nn.Module) -> None:
    """`RuntimeStateError` for a model on the meta device."""
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeStateError(
            f"{type(model).__name__} ran on the meta device inside precision_context(); materialise it first "
            "(model.to_empty(device=...) and initialise the weights), then train it under the scheduler"
        )


def bindable_layers(model: nn.Module, example: ModelCall) -> dict[str, LayerInfo]:
    """The layers of ``model`` (`coverage.find_layers` on its ``example`` call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        return find_layers(model, example)


def check_layers(model: nn.Module, layers: Sequence[str], config: "SchedulerConfig") -> None:
    """`AutoprecError` for a model with no layer; `SettingsError` when ``config.recompute``
    names no block of ``model``."""
    if not layers:
        raise AutoprecError(f"{type(model).__name__} runs no matrix product: autoprec has no layer to manage")
    check_recompute(model, layers, config)


def check_recompute(model: nn.Module, layers: Sequence[str], config: "SchedulerConfig") -> None:
    """`SettingsError` when ``config.recompute`` names no block of ``model`` holding ``layers``
    (a layer alone is no block). Run where the model is given to the constructor, with the
    layers of its module tree, and again at bind, with the traced ones. Costs one walk of the
    module tree."""
    if config.recompute is not None and layers:
        try:
            find_blocks(model, layers, config.recompute)
        except SearchError as exc:
            raise SettingsError(f"DynamicPrecisionScheduler(recompute={list(config.recompute)!r}): {exc}") from None


def check_prediction(module: nn.Module, output: Any) -> None:
    """`ModelCallError` when a dynamic scheduler's model returns no floating-point tensor
    (None, say): the search linearises the loss at the model's prediction, so it needs one."""
    try:
        prediction_of(output)
    except ModelCallError:
        raise ModelCallError(
            f"DynamicPrecisionScheduler: {type(module).__name__}'s forward returned {type(output).__name__} with no floating-point tensor; "
            "the scheduler estimates each layer's sensitivity at the model's prediction: return the output (a tensor, or a tuple, dict "
            "or ModelOutput holding one), or run a fixed plan (DynamicPrecisionScheduler.from_plan)"
        ) from None


def unbound_exit(model: Optional[nn.Module]) -> str:
    """Why a first `precision_context` bound nothing (``model``: the scheduler's ``model=``)."""
    if model is not None:
        return (f"precision_context(): the scheduler's model ({type(model).__name__}, model=) was not called inside it; "
                "call it inside the context as model(...), not model.forward(...)")
    return ("precision_context(): no model was called inside it, so the scheduler has nothing to bind to; call the model "
            "inside the context as model(...), not model.forward(...) or a function of its weights, or pass DynamicPrecisionScheduler(model=...)")
