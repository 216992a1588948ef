"""What autoprec trains when it searches, profiles or benchmarks: the `Workload` protocol, and the
one training step (`TrainStep`) every entry point runs it with.

A workload is any object with four methods::

    build_model(seed) -> nn.Module           # same seed, same weights
    train_batches(seed) -> iterator          # next(it) gives a training batch
    val_batches(n) -> sequence of n batches  # fixed held-out batches
    loss(model, batch) -> scalar tensor      # calls model(...) on the batch, any signature

and, optionally, how it is trained (read with ``getattr``; the defaults in brackets):

    lr: float                                  # [1e-3] the default optimizer's learning rate
    make_optimizer(model) -> Optimizer | (Optimizer, LRScheduler)   # [AdamW(lr)]
    max_grad_norm: float | None                # [None] clip the total gradient norm to this

The search job's ``[workload].factory``, ``autoprec profile --workload module:factory`` and
``autoprec bench --workload module:factory`` all name a function returning one. The profiled
steps, the measured stage's timed steps and ``autoprec bench`` all train with the workload's own
optimizer, schedule and clipping (`TrainStep.for_workload`), so the plan is chosen on the steps the
user will run. The built-in workloads (`autoprec.workloads`) are examples of the protocol; the core
never imports them.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .calls import loss_of
from .errors import AutoprecError, UserCodeError, WorkloadError, first_line

__all__ = ["Workload", "WorkloadError", "TrainStep", "load_workload", "resolve_factory", "learning_rate", "to_device"]

logger = logging.getLogger(__name__)

_DEFAULT_LR = 1e-3
_REQUIRED = ("build_model", "train_batches", "val_batches", "loss")


@runtime_checkable
class Workload(Protocol):
    """A model, its data and its loss (see the module docstring for the optional members).

    autoprec calls a workload through a check (`load_workload`): an exception its own code raises
    becomes a `UserCodeError` naming the method, a result it must not return a `WorkloadError`.
    """

    def build_model(self, seed: int) -> nn.Module:
        """A freshly built model to train.

        Args:
            seed: the random seed of its initial weights: the same seed gives the same weights.

        Returns:
            The `torch.nn.Module` to train.
        """
        ...

    def train_batches(self, seed: int) -> Iterator[Any]:
        """The training data.

        Args:
            seed: the seed of the batches' order (the same seed, the same batches).

        Returns:
            An iterator (or iterable) of training batches, each as `loss` takes it, that never
            runs out (e.g. ``itertools.cycle`` over an epoch).
        """
        ...

    def val_batches(self, n: int) -> Sequence[Any]:
        """Fixed held-out batches, the same on every call, on which the loss is compared.

        Args:
            n: how many batches.

        Returns:
            ``n`` batches (at least one), each as `loss` takes it, their floating tensors finite.
        """
        ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one batch.

        Args:
            model: a model `build_model` made, to be called on the batch as ``model(...)``
                with any signature.
            batch: one batch of `train_batches` or `val_batches`.

        Returns:
            The loss, a floating scalar tensor with its graph (or an output holding it: a
            ``loss`` field, or a tuple whose first element is the loss).
        """
        ...


def check_workload(obj: Any, where: str) -> Any:
    """``obj`` wrapped so that each hook's failure is one error naming it (`CheckedWorkload`);
    `WorkloadError` naming ``where`` and what is missing when it lacks a method or holds a bad
    setting. Checking a checked workload returns it."""
    if isinstance(obj, CheckedWorkload):
        return obj
    missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise WorkloadError(f"{where} returned a {type(obj).__name__} without {', '.join(missing)}; a workload provides {', '.join(_REQUIRED)} (see autoprec.workload)")
    grad_norm = getattr(obj, "max_grad_norm", None)
    if grad_norm is not None and (isinstance(grad_norm, bool) or not isinstance(grad_norm, (int, float)) or not grad_norm > 0):
        raise WorkloadError(f"{where}: max_grad_norm must be a positive number or None, got {grad_norm!r}")
    lr = getattr(obj, "lr", None)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf):
        raise WorkloadError(f"{where}: lr must be a positive finite number, got {lr!r}")
    return CheckedWorkload(obj)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def _shape(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else f"{type(value).__name__}"


class CheckedWorkload:
    """A workload whose hooks report their own failures: an exception raised by the user's code
    becomes a `UserCodeError` naming the hook (the original is its ``__cause__``), and a result a
    hook must not return (``build_model`` giving None, a vector loss, no held-out batches, a
    training iterator that runs out, a non-finite held-out batch) a `WorkloadError` saying what to
    return instead. Every other attribute is the workload's own. Costs one Python call per hook
    and no host sync per step (held-out batches are checked once, when asked for)."""

    def __init__(self, workload: Any):
        object.__setattr__(self, "_workload", workload)
        object.__setattr__(self, "_name", type(workload).__name__)
        object.__setattr__(self, "_warned", set())  # warnings given once per workload (`_check_held`)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in ("_workload", "_name", "_warned"):
            raise AttributeError(attr)  # copy / pickle probes: not the workload's
        return getattr(self._workload, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._workload, attr, value)

    def __repr__(self) -> str:
        return repr(self._workload)

    def call(self, hook: str, signature: str, *args: Any) -> Any:
        """``inner.<hook>(*args)``; a `UserCodeError` naming ``NAME.signature`` if it raises."""
        try:
            return getattr(self._workload, hook)(*args)
        except AutoprecError:
            raise
        except Exception as exc:
            raise UserCodeError(f"{self._name}.{signature} raised {_first_line(exc)}", hook) from exc

    def build_model(self, seed: int) -> nn.Module:
        model = self.call("build_model", f"build_model({seed})", seed)
        if not isinstance(model, nn.Module):
            raise WorkloadError(f"{self._name}.build_model({seed}) returned {_shape(model)}; return the torch.nn.Module to train")
        return model

    def train_batches(self, seed: int) -> Iterator[Any]:
        batches = self.call("train_batches", f"train_batches({seed})", seed)
        try:
            iterator = iter(batches)
        except TypeError:
            raise WorkloadError(f"{self._name}.train_batches({seed}) returned {_shape(batches)}, which is not iterable; return an iterator of training batches") from None
        return _TrainingBatches(self._name, seed, iterator)

    def val_batches(self, n: int) -> list:
        batches = self.call("val_batches", f"val_batches({n})", n)
        try:
            batches = list(batches)
        except TypeError:
            raise WorkloadError(f"{self._name}.val_batches({n}) returned {_shape(batches)}; return a list of {n} held-out batches") from None
        if not batches:
            raise WorkloadError(f"{self._name}.val_batches({n}) returned no batches; return {n} held-out batches (the loss is measured on them)")
        for i, batch in enumerate(batches):
            bad = _non_finite(batch)
            if bad:
                raise WorkloadError(f"{self._name}.val_batches({n}): held-out batch {i} holds {bad}; held-out batches must be finite (the loss is compared on them)")
        return batches

    def loss(self, model: nn.Module, batch: Any) -> Any:
        output = self.call("loss", "loss(model, batch)", model, batch)
        try:
            value = loss_of(output)
        except AutoprecError:
            raise WorkloadError(f"{self._name}.loss(model, batch) returned {_shape(output)}; return the loss, a scalar tensor") from None
        if value.numel() != 1:
            raise WorkloadError(f"{self._name}.loss(model, batch) returned {_shape(value)}; return a scalar (reduce it, e.g. with .mean())")
        if not value.is_floating_point():
            raise WorkloadError(f"{self._name}.loss(model, batch) returned a {value.dtype} tensor; return a floating-point loss")
        return output


def _non_finite(batch: Any) -> str:
    """'NaN' / 'inf' when a floating tensor in ``batch`` holds one, else ''. One host sync."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(batch) if torch.is_tensor(t) and t.is_floating_point()]
    if not tensors:
        return ""
    if any(bool(torch.isnan(t).any()) for t in tensors):
        return "NaN"
    return "inf" if any(bool(torch.isinf(t).any()) for t in tensors) else ""


class _TrainingBatches:
    """The training iterator, which must not run out: a `WorkloadError` saying so when it does."""

    def __init__(self, name: str, seed: int, iterator: Iterator[Any]):
        self.name, self.seed, self.iterator, self.taken = name, seed, iterator, 0

    def __iter__(self) -> "_TrainingBatches":
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.iterator)
        except StopIteration:
            raise WorkloadError(
                f"{self.name}.train_batches({self.seed}) ran out after {self.taken} batches; yield batches without end "
                "(e.g. itertools.cycle over an epoch) or train fewer steps"
            ) from None
        except AutoprecError:
            raise
        except Exception as exc:
            raise UserCodeError(f"{self.name}.train_batches({self.seed}) raised {_first_line(exc)} at batch {self.taken}", "train_batches") from exc
        self.taken += 1
        return batch


def resolve_factory(spec: str, search_dirs: Sequence[Path] = ()) -> Callable[..., Any]:
    """Import ``"module:function"``; `WorkloadError` (one line, with the fix) when it cannot.

    A module that is not importable from ``sys.path`` is looked for in ``search_dirs`` in turn
    (the job file's folder, the working directory: where a user keeps the module beside the job,
    as ``python -m`` would find it), and the first folder holding it is appended to ``sys.path``
    (after the installed packages, which keep precedence; spawned workers inherit it).
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise WorkloadError(f'expected "module:function", got {spec!r}')
    try:
        module = _import_beside(module_name, search_dirs)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".", 1)[0]
        where = f", nor in {' or '.join(str(d) for d in search_dirs)}" if search_dirs and missing else ""
        raise WorkloadError(f"cannot import module {module_name!r} ({exc}{where}); install it or fix the module name") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(f"module {module_name!r} has no callable {attr!r}; fix the name after the colon")
    return factory


def _import_beside(module_name: str, search_dirs: Sequence[Path]) -> Any:
    """``importlib.import_module(module_name)``, retried with the first of ``search_dirs`` that
    holds its top-level package (``name.py`` or ``name/``) appended to ``sys.path``. A module that
    is found but fails to import (its own imports missing) raises as it is."""
    top = module_name.split(".", 1)[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != top:
            raise
        for folder in search_dirs:
            folder = Path(folder).resolve()
            if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
                if str(folder) not in sys.path:
                    sys.path.append(str(folder))
                importlib.invalidate_caches()
                return importlib.import_module(module_name)
        raise


def load_workload(spec: str, kwargs: Optional[Mapping[str, Any]] = None, search_dirs: Sequence[Path] = ()) -> Any:
    """Import ``"module:function"``, call it with ``kwargs`` and check that the result is a workload.

    Args:
        spec: ``"module:function"``, the function returning a workload (`Workload`).
        kwargs: keyword arguments for the function (None: none).
        search_dirs: folders to find the module in when ``sys.path`` does not hold it
            (`resolve_factory`).

    Returns:
        The workload, wrapped so that each method's failure is one error naming it (the
        workload's own attributes stay readable).

    Raises:
        WorkloadError: one line, what failed and the fix: a malformed spec, a missing module or
            function, arguments the function rejects (it raised ``TypeError``, ``ValueError`` or
            ``KeyError``), a result that is not a workload, or a bad ``lr`` / ``max_grad_norm``.
        UserCodeError: the function raised anything else; the original is ``__cause__``.
    """
    factory = resolve_factory(spec, search_dirs)
    kwargs = dict(kwargs or {})
    try:
        workload = factory(**kwargs)
    except (TypeError, ValueError, KeyError) as exc:  # what a factory raises for arguments it cannot use
        reason = first_line(exc)
        raise WorkloadError(f"{spec} rejected {kwargs}: {reason}; fix the keyword arguments") from None
    except AutoprecError:
        raise
    except Exception as exc:
        raise UserCodeError(f"the workload factory {spec} raised {_first_line(exc)}", "factory") from exc
    return check_workload(workload, spec)


def to_device(batch: Any, device: "torch.device | str") -> Any:
    """``batch`` with every tensor in it (tuples, lists and dicts, nested) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _optimizer_and_schedule(workload: Any, model: nn.Module):
    make = getattr(workload, "make_optimizer", None)
    if make is None:
        return torch.optim.AdamW(model.parameters(), lr=float(getattr(workload, "lr", _DEFAULT_LR))), None
    try:
        made = make(model)
    except AutoprecError:
        raise
    except Exception as exc:
        raise UserCodeError(f"{type(getattr(workload, '_workload', workload)).__name__}.make_optimizer(model) raised {_first_line(exc)}", "make_optimizer") from exc
    optimizer, schedule = made if isinstance(made, tuple) else (made, None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WorkloadError(f"{type(getattr(workload, '_workload', workload)).__name__}.make_optimizer returned {type(optimizer).__name__}; return a torch.optim.Optimizer or (optimizer, lr_scheduler)")
    bad = [g["lr"] for g in optimizer.param_groups if not isinstance(g.get("lr"), torch.Tensor) and not 0 <= float(g.get("lr", 0.0)) < math.inf]
    if bad:
        raise WorkloadError(f"{type(getattr(workload, '_workload', workload)).__name__}.make_optimizer: the optimizer's learning rate is {bad[0]!r}; give a finite, non-negative lr")
    _check_held(workload, optimizer, model)
    return optimizer, schedule


def _check_held(workload: Any, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """`WorkloadError` when ``optimizer`` holds none of ``model``'s trainable parameters (the
    model would never train, yet be profiled and searched as if it did: typically
    ``make_optimizer`` built it from another copy of the model than the one passed in); one
    warning per workload with the count when it holds only some (legitimate, e.g. a part left
    out on purpose, but those parameters keep their values). Parameters with
    ``requires_grad=False`` are not counted. Costs a set of parameter ids, no host sync."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = sum(id(p) not in held for p in trainable)
    name = type(getattr(workload, "_workload", workload)).__name__
    if missing == len(trainable):
        raise WorkloadError(
            f"{name}.make_optimizer(model): the optimizer holds none of {type(model).__name__}'s {len(trainable)} trainable parameters, "
            "so the model would never train; build it from the model passed in (model.parameters()), not from another copy"
        )
    warned = getattr(workload, "_warned", None) if isinstance(workload, CheckedWorkload) else None
    if missing and (warned is None or "optimizer" not in warned):
        if warned is not None:
            warned.add("optimizer")
        logger.warning(
            "autoprec: %s.make_optimizer(model): the optimizer does not hold %d of %s's %d trainable parameters; they keep their values "
            "while the rest trains (set requires_grad=False on them if that is meant)", name, missing, type(model).__name__, len(trainable),
        )


def learning_rate(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer's base learning rate (its first group's, before any schedule scaled it):
    the step size the sensitivity estimate assumes."""
    group = optimizer.param_groups[0]
    return float(group.get("initial_lr", group["lr"]))


class TrainStep:
    """One training step as the workload trains: zero_grad, forward + loss inside ``context()``,
    backward, ``after_backward()`` (a profiler's ``step``), clipping, optimizer and schedule step.

    ``context``, if given, is called every step and the context manager it returns wraps forward
    + loss only (e.g. ``lambda: torch.autocast("cpu", torch.bfloat16)``). Costs the model's step
    and no host sync: the returned loss is detached, not read.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        optimizer: torch.optim.Optimizer,
        schedule: Any = None,
        max_grad_norm: Optional[float] = None,
        context: Optional[Callable[[], AbstractContextManager[Any]]] = None,
    ):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.schedule = schedule
        self.max_grad_norm = max_grad_norm
        self.make_context = context if context is not None else nullcontext
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.steps_done = 0
        model.train()

    @classmethod
    def for_workload(cls, workload: Any, model: nn.Module, context: Optional[Callable[[], AbstractContextManager[Any]]] = None) -> "TrainStep":
        """The workload's own optimizer, schedule and clipping (module docstring) for ``model``.

        Args:
            workload: the workload (`load_workload`'s); its ``loss`` is the step's loss.
            model: the model to train, built by the workload; the optimizer is made for it.
            context: called every step; the context manager it returns wraps forward + loss
                (None: none).

        Returns:
            The `TrainStep` (the model is put in training mode).

        Raises:
            WorkloadError: ``make_optimizer`` returned no optimizer, one with a negative or
                non-finite lr, or one holding none of ``model``'s trainable parameters.
            UserCodeError: ``make_optimizer`` raised.
        """
        optimizer, schedule = _optimizer_and_schedule(workload, model)
        return cls(model, workload.loss, optimizer, schedule, getattr(workload, "max_grad_norm", None), context)

    @property
    def lr(self) -> float:
        return learning_rate(self.optimizer)

    def __call__(self, batch: Any, after_backward: Optional[Callable[[], Any]] = None) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with self.make_context():
            loss = loss_of(self.loss_fn(self.model, batch))
        loss.backward()
        if after_backward is not None:
            after_backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        self.steps_done += 1
        return loss.detach()
