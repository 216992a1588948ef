"""Per-layer seconds measured in place: real training steps, each layer timed where it runs.

Why in place rather than replaying each call alone (`product_times.MeasuredTimeModel`): a replay pays
per call what a real step pays once or overlaps (Python dispatch, entering the runtime, a
device sync per timed span) and runs in another cache and thread state than the step, so on a
model of small layers the replays' sum can exceed the whole FP32 step several times over, and
"the rest of the step" (step minus layers) becomes meaningless. Timed in place, a layer costs
what it costs inside the step, and the rest is the step minus the layers of the same steps.

How one step is attributed (`StepTimer`):

- **forward**: a pre- and post-forward hook per layer; a layer's time excludes the layers
  nested in it (an attention layer whose q/k/v projection is a layer of its own);
- **backward**: every autograd node a layer's forward created (its sequence number lies in the
  range the layer's forward spanned; nodes of a nested layer go to that layer) and the
  gradient accumulation of the parameters it owns, each node timed by a pre-hook and a hook;
- **rest**: the step's time outside every layer (embeddings, norms, the loss, the optimizer).

`measure_in_place` runs each plan on one copy of the model, the plans interleaved round by round
(medians over the timed rounds; a plan far slower than the first is stopped and extrapolated).
Costs per step: two Python calls per layer forward and per autograd node of a layer, one walk
of the autograd graph, and on CUDA two events per timed span and one host sync.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
import warnings
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import CostModelError, first_line
from ..plan import Plan
from ..runtime import EmulationWarning, apply_plan
from ..device_clock import Clock, rotated
from .trace import forward_or_loss

__all__ = ["InPlaceTimes", "MIN_TIMED_ROUNDS", "StepTimer", "measure_in_place", "timed_rounds"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InPlaceTimes:
    """One plan's median training-step seconds and each layer's median seconds in that step
    (forward + backward, nested layers excluded); ``rest_seconds`` is the step minus its layers."""

    step_seconds: float
    layer_seconds: Mapping[str, float]
    extrapolated: bool = False  # stopped past the deadline; scaled from the first plan's layers
    # Each layer's median forward alone (nested layers excluded) and each recompute block's median
    # forward, its layers included: what one more forward of the block costs (`CostModel.blocks`).
    # Empty for an extrapolated plan (its forwards were cut short) and in caches written before them.
    forward_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    block_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def rest_seconds(self) -> float:
        return self.step_seconds - sum(self.layer_seconds.values())


class _TooSlow(Exception):
    """Raised by a forward pre-hook once the step's deadline has passed."""


class StepTimer:
    """Attributes one training step's time to layers (the module docstring says how).

    Install once with `__enter__` (forward hooks), call `before_backward(loss)` between the
    forward and the backward (registers node hooks), and `finish()` after the backward: it
    removes the node hooks and returns the step's seconds per layer. `time_only` narrows the
    next steps to some layers (the layers nested in them included): the others pay one set
    lookup per forward and no node hook.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], blocks: Sequence[str] = ()):
        modules = dict(model.named_modules())
        self.layers = list(layers)
        # Recompute blocks (`autoprec.blocks`): their whole forward, layers included, is timed too.
        self._blocks = [(fqn, modules[fqn]) for fqn in blocks]
        first = next(model.parameters(), None)
        # Marks on the host clock, or CUDA events read after the step's sync (`finish`).
        self.clock = Clock(first.device if first is not None else torch.device("cpu"))
        # Innermost layer owning each parameter: outer layers first, nested ones overwrite.
        self.owner_of_param: dict[int, str] = {}
        for fqn in sorted(self.layers, key=lambda f: f.count(".") if f else -1):
            for p in modules[fqn].parameters():
                self.owner_of_param[id(p)] = fqn
        self._modules = [(fqn, modules[fqn]) for fqn in self.layers]
        # The layers nested in each layer (its module's descendants that are layers): O(layers x depth).
        known = set(self.layers)
        self._nested: dict[str, list[str]] = {fqn: [] for fqn in self.layers}
        for fqn in self.layers:
            parts = fqn.split(".") if fqn else []
            for cut in range(len(parts) - 1, -1, -1):
                outer = ".".join(parts[:cut])
                if outer in known:
                    self._nested[outer].append(fqn)
        self._timed: "frozenset[str]" = frozenset(self.layers)
        # A leaf whose views read autograd's sequence counter (each new node takes the next number).
        self._probe = torch.zeros(1, requires_grad=True)
        self._handles: list = []
        self._node_handles: list = []
        self.deadline: Optional[float] = None  # host perf_counter() past which a layer's forward raises _TooSlow
        self._reset()

    def time_only(self, fqns: "Collection[str] | None") -> None:
        """Time only ``fqns`` and the layers nested in them from the next step on (None: every
        layer). O(layers given x their nested layers)."""
        if fqns is None:
            self._timed = frozenset(self.layers)
            return
        timed = set(fqns)
        for fqn in fqns:
            timed.update(self._nested[fqn])
        self._timed = frozenset(timed)

    def _reset(self) -> None:
        self._stack: list[list] = []  # open spans: [fqn, start mark, first sequence number, children spans]
        self._spans: list[tuple] = []  # closed forward spans: (fqn, start, end, children, complete)
        self._ranges: list[tuple[int, int, str]] = []  # (first, last) sequence numbers of each layer forward
        self._node_marks: list[tuple[str, list]] = []
        self._block_marks: list[tuple[str, list]] = []  # (block, [start, end]) per block forward
        self._stopped = False  # set when _TooSlow was raised: spans closed after it are partial

    def _sequence_nr(self) -> int:
        with torch.enable_grad():
            node = self._probe.view(1).grad_fn
        if node is None:  # the probe requires grad: a view of it always has a node
            raise CostModelError("StepTimer: autograd recorded no node for its probe; is grad mode forced off?")
        return node._sequence_nr()

    def __enter__(self) -> "StepTimer":
        def pre(fqn):
            def hook(module, args):
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    self._stopped = True
                    raise _TooSlow
                if fqn not in self._timed:
                    return
                self._stack.append([fqn, self.clock.mark(), self._sequence_nr(), []])
            return hook

        def post(fqn):
            def hook(module, args, output):
                if not self._stack or self._stack[-1][0] != fqn:
                    return  # its pre-hook raised _TooSlow: no span was opened
                _, start, first, children = self._stack.pop()
                span = (fqn, start, self.clock.mark(), children, not self._stopped)
                self._ranges.append((first, self._sequence_nr(), fqn))
                (self._stack[-1][3] if self._stack else self._spans).append(span)
            return hook

        for fqn, module in self._modules:
            self._handles.append(module.register_forward_pre_hook(pre(fqn)))
            self._handles.append(module.register_forward_hook(post(fqn), always_call=True))

        def block_pre(fqn):
            def hook(module, args):
                self._block_marks.append((fqn, [self.clock.mark()]))
            return hook

        def block_post(fqn):
            def hook(module, args, output):
                open_spans = [marks for name, marks in self._block_marks if name == fqn and len(marks) == 1]
                if open_spans:
                    open_spans[-1].append(self.clock.mark())
            return hook

        for fqn, module in self._blocks:
            self._handles.append(module.register_forward_pre_hook(block_pre(fqn)))
            self._handles.append(module.register_forward_hook(block_post(fqn), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles + self._node_handles:
            handle.remove()
        self._handles.clear()
        self._node_handles.clear()

    def before_backward(self, loss: torch.Tensor) -> None:
        """Hook every autograd node a layer owns (one walk of the graph from ``loss``)."""
        owner_at: dict[int, str] = {}
        # Longest ranges first so that a nested layer's range overwrites its parent's.
        for first, last, fqn in sorted(self._ranges, key=lambda r: r[0] - r[1]):
            for nr in range(first + 1, last):
                owner_at[nr] = fqn
        seen: set = set()
        todo = [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            owner = self.owner_of_param.get(id(variable)) if variable is not None else owner_at.get(node._sequence_nr())
            if owner is not None and owner in self._timed:
                marks: list = []
                self._node_marks.append((owner, marks))
                self._node_handles.append(node.register_prehook(lambda grads, marks=marks: marks.append(self.clock.mark())))
                self._node_handles.append(node.register_hook(lambda grads_in, grads_out, marks=marks: marks.append(self.clock.mark())))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def finish(self) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds per timed layer of the step just run (`time_only`): (forward + backward,
        forward), forwards exclusive of nested layers; the forward only of layers that finished
        before a stop.
        The blocks' forwards of the step are left in `block_forward` until the next `finish`."""
        for handle in self._node_handles:
            handle.remove()
        self._node_handles.clear()
        self.clock.wait()  # CUDA: the one host sync per step, before the events are read
        seconds = {fqn: 0.0 for fqn in self.layers if fqn in self._timed}
        forward: dict[str, float] = {}
        spans = list(self._spans)
        while spans:
            fqn, start, end, children, in_time = spans.pop()
            own = self.clock.seconds(start, end) - sum(self.clock.seconds(c[1], c[2]) for c in children)
            seconds[fqn] += own
            if in_time:
                forward[fqn] = forward.get(fqn, 0.0) + own
            spans.extend(children)
        for owner, marks in self._node_marks:
            if len(marks) == 2:  # a node the backward did not reach has no marks
                seconds[owner] += self.clock.seconds(marks[0], marks[1])
        self.block_forward: dict[str, float] = {}
        for fqn, marks in self._block_marks:
            if len(marks) == 2:
                self.block_forward[fqn] = self.block_forward.get(fqn, 0.0) + self.clock.seconds(marks[0], marks[1])
        self._reset()
        return seconds, forward


def _default_loss(output: Any) -> torch.Tensor:
    """The mean of every floating output that needs a gradient, summed (a stand-in loss)."""
    tensors = [t for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise CostModelError("the model's output has no floating tensor that needs a gradient; pass loss_fn=(model, inputs) -> loss")
    total = tensors[0].float().mean()
    for t in tensors[1:]:
        total = total + t.float().mean()
    return total


def _step_loss(model: nn.Module, batch: Any, loss_fn: Optional[Callable]) -> torch.Tensor:
    output = forward_or_loss(model, batch, loss_fn)
    return output if loss_fn is not None else _default_loss(output)


_Key = TypeVar("_Key")


def measure_in_place(
    model: nn.Module,
    batches: Sequence[Any],
    plans: Mapping[_Key, Plan],
    layers: Sequence[str],
    loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
    *,
    warmup: int = 3,
    steps: int = 8,
    slow_factor: float = 20.0,
    blocks: Sequence[str] = (),
    roles: Optional[Mapping[str, str]] = None,
) -> dict[_Key, InPlaceTimes]:
    """Median step and per-layer seconds of each of ``plans`` (key -> plan, e.g. a name or format) over real training
    steps (zero_grad, forward + loss under ``apply_plan``, backward, AdamW step) of one copy of
    ``model`` (the caller's weights stay untouched), ``batches`` taken in turn.

    ``layers``: the fqns timed (the plans' layers). ``blocks``: recompute blocks whose whole
    forward is timed too (`InPlaceTimes.block_seconds`), in the plans' own steps: two more host
    marks (CUDA events) per block forward. ``loss_fn(model, batch)``: the loss (default:
    the mean of the floating outputs). A plan whose first step raises is left out with a warning.
    The plans run interleaved round by round (one step of each per round, the first rotated) so
    the machine's drift spreads over all of them; medians over the timed rounds are kept. A plan
    whose first step runs past ``slow_factor`` times the first plan's (a format with only a
    reference kernel here: FP8 ``torch._scaled_mm`` on a CPU can be a thousand times slower than
    FP32) is stopped at the next layer it enters: each of its layers costs the first plan's median
    time of that layer times the median slowdown of the layers whose forward finished (a
    host-clock deadline, so on CUDA, where the host runs ahead, it rarely fires).

    ``warmup``: untimed rounds after each plan's first (cold) step, run only by a plan whose
    runtime is still calibrating (INT8 layers observe their first `Calibration.batches` forwards
    with each batch's own range, then freeze): the others are warm after their first step.
    ``roles``: fqn -> role (`trace.trace_roles`: the same projection of every block on the same
    shapes); layers of one role pool their samples, each getting the median over the role's
    layers and the timed rounds, and timing stops once every role met more than once has
    ``steps`` samples, after `MIN_TIMED_ROUNDS` rounds at least (a layer met once, such as the
    output head, gets those). None: each layer is its own role, ``steps`` rounds.

    Cost: per plan, one first step, up to ``warmup`` more while calibrating and
    ``min(steps, max(MIN_TIMED_ROUNDS, ceil(steps / c)))`` timed ones (``c``: the fewest layers
    of a role met more than once), plus the hooks' overhead (module docstring): a deep model of
    repeated blocks times `MIN_TIMED_ROUNDS` steps per plan, not ``steps``. A stopped plan costs
    one partial step. The RNG is left as it was.
    """
    clone = copy.deepcopy(model)
    clone.train()
    optimizer = torch.optim.AdamW(clone.parameters(), lr=1e-3)  # the value does not change the cost
    device = next(clone.parameters()).device
    timer = StepTimer(clone, layers, blocks)
    runtimes: dict = {}
    results: dict = {}
    first_steps: dict = {}
    stopped: dict = {}

    def step(runtime, batch) -> tuple[float, tuple[dict[str, float], dict[str, float], dict[str, float]]]:
        optimizer.zero_grad(set_to_none=True)
        start = timer.clock.mark()
        with runtime:
            loss = _step_loss(clone, batch, loss_fn)
        timer.before_backward(loss)
        loss.backward()
        optimizer.step()
        end = timer.clock.mark()
        per_layer, forward = timer.finish()
        return timer.clock.seconds(start, end), (per_layer, forward, timer.block_forward)

    members = _role_members(layers, roles)
    rounds = timed_rounds(members, steps)
    per_role = math.ceil(steps / rounds)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), warnings.catch_warnings(), timer:
        warnings.simplefilter("ignore", EmulationWarning)
        # The cold first steps time the first round's sample: what a stopped plan is compared on.
        timer.time_only(_round_sample(members, 0, per_role))
        for name, plan in plans.items():
            runtime = apply_plan(clone, plan, validate=False)
            if first_steps:
                timer.deadline = time.perf_counter() + slow_factor * next(iter(first_steps.values()))[0]
            try:
                first_steps[name] = step(runtime, batches[0])
            except _TooSlow:
                stopped[name] = timer.finish()[1]
                logger.info("plan %s is over %gx slower than the first plan; its layers are extrapolated", name, slow_factor)
                continue
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
                timer.finish()
                logger.warning("cannot time plan %s in place (%s); left to the time model", name, first_line(exc))
                continue
            finally:
                timer.deadline = None
            runtimes[name] = runtime
        times: dict[_Key, list] = {name: [] for name in runtimes}
        order = list(runtimes)
        timer.time_only(())  # warmup steps are not timed: no hooks
        for r in range(warmup):
            for name in rotated([n for n in order if runtimes[n].calibrating], r):
                step(runtimes[name], batches[r % len(batches)])
        for r in range(rounds):
            timer.time_only(_round_sample(members, r, per_role))
            for name in rotated(order, r):
                times[name].append(step(runtimes[name], batches[(warmup + r) % len(batches)]))
    for name, runs in times.items():
        results[name] = InPlaceTimes(
            statistics.median(s for s, _ in runs),
            _pooled_medians(members, [per for _, (per, _, _) in runs]),
            forward_seconds=_pooled_medians(members, [per for _, (per, _, _) in runs], [fwd for _, (_, fwd, _) in runs]) if blocks else {},
            block_seconds={fqn: statistics.median(b.get(fqn, 0.0) for _, (_, _, b) in runs) for fqn in blocks},
        )
    if stopped and runtimes:
        first = next(iter(runtimes))
        # Against the first plan's median forwards of the timed rounds, not its first step: that
        # one is cold (first calls, allocations), and under load it can be slow enough that a
        # stopped plan's ratio, applied to the median times, comes out far too small.
        first_forward = _pooled_medians(members, [per for _, (per, _, _) in times[first]], [fwd for _, (_, fwd, _) in times[first]])
        for name, forward in stopped.items():
            ratios = [forward[fqn] / first_forward[fqn] for fqn in forward if first_forward.get(fqn, 0.0) > 0]
            slowdown = statistics.median(ratios) if ratios else slow_factor  # no layer finished: at least this slow
            layer_seconds = {fqn: slowdown * s for fqn, s in results[first].layer_seconds.items()}
            results[name] = InPlaceTimes(results[first].rest_seconds + sum(layer_seconds.values()), layer_seconds, extrapolated=True)
    return results


# Timed rounds a plan runs at least when its layers' roles repeat: a median of three takes one
# slow step (a collection, a page fault) without moving.
MIN_TIMED_ROUNDS = 3


def _role_members(layers: Sequence[str], roles: Optional[Mapping[str, str]]) -> list[list[str]]:
    """``layers`` grouped by role, in first-seen order (each its own group without ``roles``)."""
    if roles is None:
        return [[fqn] for fqn in layers]
    groups: dict[str, list[str]] = {}
    for fqn in layers:
        groups.setdefault(roles.get(fqn, fqn), []).append(fqn)
    return list(groups.values())


def timed_rounds(members: Sequence[Sequence[str]], steps: int) -> int:
    """The timed rounds `measure_in_place` runs for layers grouped by role (`_role_members`):
    enough for ``steps`` samples of every role met more than once, at least `MIN_TIMED_ROUNDS`
    and at most ``steps``. O(roles)."""
    repeated = [len(group) for group in members if len(group) > 1]
    if not repeated:
        return steps
    return min(steps, max(MIN_TIMED_ROUNDS, math.ceil(steps / min(repeated))))


def _round_sample(members: Sequence[Sequence[str]], r: int, per_role: int) -> list[str]:
    """The layers timed in timed round ``r``: ``per_role`` of each role, the next ones each round
    (all of a role with fewer). O(roles x per_role)."""
    return [group[(r * per_role + j) % len(group)] for group in members for j in range(min(per_role, len(group)))]


def _pooled_medians(members: Sequence[Sequence[str]], timed: Sequence[Mapping[str, float]],
                    values: Optional[Sequence[Mapping[str, float]]] = None) -> dict[str, float]:
    """Per layer, the median of its role's samples: each layer of the role that run ``i`` timed
    (a key of ``timed[i]``), its value in ``values[i]`` (default ``timed[i]``; 0 s where absent:
    timed but its forward never finished)."""
    values = timed if values is None else values
    out = {}
    for group in members:
        median = statistics.median(v.get(fqn, 0.0) for t, v in zip(timed, values) for fqn in group if fqn in t)
        out.update(dict.fromkeys(group, median))
    return out
