"""Agreement across ranks: one plan, one skip decision, one clock, DCP checkpoints.

`DynamicPrecisionScheduler` needs no new call under ``torch.distributed``: when a process group
is initialised (the default one, or ``SchedulerConfig.process_group``) and has more than one rank,
it makes a `RankAgreement` when it binds. Every communication is torch's (``dist.all_reduce``,
``broadcast_object_list``, ``all_gather_object``, DDP's ``register_comm_hook``); the gradient
buckets travel by `comm.BucketCommunicator`.

- `RankAgreement`: rank 0 decides (the search, the window review) and broadcasts, then every
  rank's plan is verified by hash (`decide`); the profiler's statistics and the loss baseline
  are reduced first (`reduce_window`); each step's skip decision is one all-reduce of flags
  naming the ranks where a non-finite value arose (`agree_on_step`, `StepVerdict`).
- `GradCommHook`: DDP's communication hook; how the gradients travel (`grad_comm_methods`:
  FP32, BF16, FP16, PowerSGD, INT8 or top-k, `comm`) and the non-finite local gradients seen
  before they are communicated; a lossy method's error feedback is committed only when the
  ranks agree the step was taken.
- `SchedulerCheckpoint`: the scheduler as a ``torch.distributed.checkpoint`` ``Stateful``.

Costs: per optimizer step one all-reduce of ``8 * (optimizers + 2 + 2 * layers)`` bytes, one
inf-norm over every gradient and one host transfer; per window end three all-reduces of the
profiler's accumulators, one broadcast of the decision and one gather of plan hashes (the
details, and why amax histories need no reduction, in `RankAgreement`). Under FSDP2
(``fully_shard``) the search's off-path work runs on a gathered plain copy (`RankAgreement.check_bind`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import BucketCommunicator, CommMethod, CommSettings
from .errors import DistributedError, RuntimeStateError
from .saved_bytes import local_shard

if TYPE_CHECKING:
    from .plan import Plan
    from .scheduler import DynamicPrecisionScheduler

__all__ = ["RankAgreement", "StepVerdict", "SchedulerCheckpoint", "GradCommHook", "unwrap_ddp", "plan_hash", "settings_hash", "grad_comm_methods"]

logger = logging.getLogger(__name__)

_MAX_NAMED_RANK = 62  # 1 << 62 still fits an int64 sum of distinct bits


def unwrap_ddp(model: Optional[nn.Module]) -> tuple[Optional[nn.Module], Any]:
    """``(the module to plan, the DDP wrapper or None)``: the plan's fqns are the inner model's.
    A ``torch.compile`` wrapper (outside DDP or inside it) is peeled too: the scheduler plans and
    measures the module it compiles, and the user keeps calling the compiled one."""
    from torch.nn.parallel import DistributedDataParallel

    model = uncompiled(model)
    if isinstance(model, DistributedDataParallel):
        return uncompiled(model.module), model
    return model, None


def uncompiled(model: Optional[nn.Module]) -> Optional[nn.Module]:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) compiles, else ``model``."""
    if model is not None and hasattr(model, "_orig_mod"):
        from torch._dynamo.eval_frame import OptimizedModule

        if isinstance(model, OptimizedModule):
            return model._orig_mod
    return model


def plan_hash(plan: "Optional[Plan]") -> str:
    """SHA-256 of the plan's canonical JSON (``"none"`` while profiling)."""
    if plan is None:
        return "none"
    return hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """One step's agreed outcome: which optimizers skip, and where and on which ranks it began.

    ``layers``: layers with non-finite gradients on some rank (model order); ``ranks``: layer ->
    ranks that reported it; ``first_output``: the first layer (model order) whose forward output
    went non-finite on some rank, with ``output_ranks``; ``loss_ranks``: ranks whose loss was
    non-finite. Rank lists are exact up to rank 62 (`RankAgreement.agree_on_step`)."""

    skipped: tuple[bool, ...]
    layers: tuple[str, ...] = ()
    ranks: dict = dataclasses.field(default_factory=dict)
    first_output: Optional[str] = None
    output_ranks: tuple[int, ...] = ()
    loss_ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = [f"non-finite gradients in {fqn} on rank {', '.join(map(str, self.ranks[fqn]))}" for fqn in self.layers]
        if self.first_output is not None:
            parts.append(f"first non-finite output {self.first_output} on rank {', '.join(map(str, self.output_ranks))}")
        if self.loss_ranks:
            parts.append(f"non-finite loss on rank {', '.join(map(str, self.loss_ranks))}")
        return "; ".join(parts) or "non-finite gradients outside the watched layers"


def _ranks(value: int, world: int) -> tuple[int, ...]:
    if world > _MAX_NAMED_RANK + 1:
        return ()  # counts, not bits: the ranks cannot be told apart
    return tuple(r for r in range(world) if value >> r & 1)


def _count_nonfinite(flags: torch.Tensor, grads: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Add 1 to ``flags[i]`` for each ``(i, gradient)`` holding an inf or NaN; returns ``flags``.
    One inf-norm per non-empty gradient (NaN propagates through max), no sync."""
    grads = [(i, g) for i, g in grads if g.numel()]  # the inf-norm of nothing is undefined
    if grads:
        with torch.no_grad():
            bad = ~torch.stack(torch._foreach_norm([g for _, g in grads], math.inf)).isfinite()
            flags.index_add_(0, torch.tensor([i for i, _ in grads], device=flags.device), bad.long().to(flags.device))
    return flags


class GradCommHook:
    """The state DDP's ``register_comm_hook`` holds: how each bucket's gradients travel
    (`comm.BucketCommunicator`: torch's FP32/BF16/FP16 hooks and PowerSGD, INT8 and top-k with
    error feedback; each parameter by `method_of`, switched by `set_methods`, since DDP takes
    one registration for its life), and,
    per step, which layers' local gradients were non-finite before they were communicated (one
    inf-norm per bucket gradient, no sync): seen before any compression."""

    def __init__(self, group, layer_of: dict[int, int], layers: int, names: dict[int, str], settings: CommSettings = CommSettings(),
                 loss_scale: Callable[[], Optional[torch.Tensor]] = lambda: None):
        self.default = CommMethod.FP32  # a parameter's method unless `per_layer` names its layer
        self.per_layer: dict[int, CommMethod] = {}  # layer index -> method
        self.communicator = BucketCommunicator(group, names, settings, scale=loss_scale)
        self._layer_of = layer_of  # id(parameter) -> layer index
        self._layers = layers
        self.flags: Optional[torch.Tensor] = None  # int64 (layers + 1,), since the last take()

    def set_methods(self, default: CommMethod, per_layer: Mapping[int, CommMethod]) -> bool:
        """Whether that changed how any gradient travels."""
        per_layer = {i: m for i, m in per_layer.items() if m is not default}
        changed = (default, per_layer) != (self.default, self.per_layer)
        self.default, self.per_layer = default, per_layer
        return changed

    def method_of(self, param: torch.Tensor) -> CommMethod:
        layer = self._layer_of.get(id(param))
        return self.per_layer.get(layer, self.default) if layer is not None else self.default

    @property
    def lossy(self) -> bool:
        """Whether some gradient travels by a method that may round an inf away."""
        return self.default.lossy or any(m.lossy for m in self.per_layer.values())

    def take(self) -> Optional[torch.Tensor]:
        flags, self.flags = self.flags, None
        return flags

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP compares them to real types, and this module's are strings
        grads, params = bucket.gradients(), bucket.parameters()
        # Per layer, and in the last entry any parameter's (a lossy method may round an inf away).
        kept = [(state._layer_of.get(id(p), state._layers), g) for p, g in zip(params, grads)]
        if state.flags is None:
            state.flags = torch.zeros(state._layers + 1, dtype=torch.int64, device=grads[0].device)
        _count_nonfinite(state.flags, kept)
        return state.communicator.allreduce(bucket, state.method_of)


def settings_hash(config, plan: "Optional[Plan]") -> str:
    """A hash of the scheduler's settings (but the group and the log folder) and ``plan``."""
    settings = repr(dataclasses.replace(config, process_group=None, log_dir=None))
    return hashlib.sha256((settings + plan_hash(plan)).encode()).hexdigest()


class RankAgreement:
    """What the ranks of ``group`` agree on for one scheduler.

    ``sent``: collective -> calls and bytes the scheduler itself issued (``all_reduce`` bytes are
    the tensors'; object collectives count their pickled payload), for measuring its overhead.

    Costs: per optimizer step one all-reduce of ``8 * (optimizers + 2 + 2 * layers)`` bytes, one
    inf-norm over every gradient (a read of the gradients; in the DDP hook instead of after it),
    and one host transfer of that vector. Per window end: three all-reduces of the profiler's
    accumulators (about 48 KiB of histogram per layer and tensor kind), one
    ``broadcast_object_list`` of the decision (the plan's JSON, a few KiB) and one
    ``all_gather_object`` of plan hashes. While the first search runs (`search.in_run`): every
    rank runs the same probe and trial steps (their plans follow from the step and the reduced
    profile), rank 0 alone the off-path work, and one ``broadcast_object_list`` per step (None
    until rank 0's candidates exist, then their JSON) keeps the ranks on one schedule
    (`share`); under FSDP2, when it starts or resumes, one all-gather of each parameter on every
    rank (`replica.plain_copy`: the off-path work's whole copy). At bind: one
    ``all_gather_object`` of the settings' and given plan's hashes (on a pipeline stage at its
    first step instead, with its layer names: `scheduler.pipeline_stage`; there ``max_grad_norm``
    adds one 8-byte all-reduce per optimizer and step, `whole_norm`). Under FSDP2 with FP8 layers,
    per FP8 weight and all-gather one all-reduce of 4 bytes (`runtime.fsdp_fp8`).

    Amax histories and INT8 calibration agree without a reduction: under DDP the weights and
    every rank's state start equal, but activations differ per rank. autoprec's FP8 inputs
    default to current scaling (the tensor's own amax, no history) and output gradients always
    use it, so they need no agreement at all; what is kept per rank (delayed input histories,
    INT8 calibration samples) only scales that rank's own local products, like torchao's current
    scaling, which needs no ``sync_float8_amax_and_scale_history``. A reduction of every history
    per step would be one more collective per layer. The plan (formats, scaling modes) is what
    must agree, and does.
    """

    def __init__(self, group, model: nn.Module, layers: Sequence[str], ddp: Any = None,
                 loss_scale: Callable[[], Optional[torch.Tensor]] = lambda: None, settings: CommSettings = CommSettings()):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sent: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.last_verdict: Optional[StepVerdict] = None
        self.stage_replicas: Optional[int] = None  # under a pipeline, the ranks holding each stage (`set_stages`)
        self._bit = 1 << self.rank if self.world <= _MAX_NAMED_RANK + 1 else 1
        self._params: list[tuple[int, torch.Tensor]] = []
        self.hold_layers(model, layers)
        self.comm_hook: Optional[GradCommHook] = None
        if ddp is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            state = GradCommHook(group, {id(p): i for i, p in self._params}, len(self.layers), names, settings, loss_scale)
            try:
                ddp.register_comm_hook(state, GradCommHook.hook)
                self.comm_hook = state
            except RuntimeError as exc:  # the user registered a hook of their own: keep it
                logger.info("autoprec: DDP keeps its own communication hook (%s); non-finite gradients are named after the all-reduce", exc)

    def hold_layers(self, model: nn.Module, layers: Sequence[str]) -> None:
        """Agree over ``layers`` (fqns, the same order on every rank), of which ``model`` holds
        some: a pipeline stage agrees over the whole pipeline's layers and holds only its own
        (the whole plan's, or every stage's when a stage's plan is searched: known at its
        first step). Each step's flags have one entry per layer."""
        self.layers = tuple(layers)
        modules = dict(model.named_modules())
        self._params = [(i, p) for i, fqn in enumerate(self.layers) if fqn in modules for p in modules[fqn].parameters(recurse=False)]

    @classmethod
    def join(cls, config, model: nn.Module, layers: Sequence[str], ddp: Any = None,
             loss_scale: Callable[[], Optional[torch.Tensor]] = lambda: None) -> "Optional[RankAgreement]":
        """The agreement for ``config.process_group`` (None: the default group), or None when not
        distributed (no initialised group, or one rank). ``loss_scale``: the scale the gradients
        DDP communicates carry (error feedback keeps its residuals unscaled, `comm`)."""
        if not (dist.is_available() and dist.is_initialized()):
            if config.process_group is not None:
                raise DistributedError("SchedulerConfig(process_group=...) given but torch.distributed is not initialised; call dist.init_process_group first")
            return None
        if dist.get_world_size(config.process_group) == 1:
            return None
        return cls(config.process_group, model, layers, ddp, loss_scale, config.comm)

    # -- counted collectives --------------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor, op) -> None:
        self.sent["all_reduce"].update(calls=1, bytes=tensor.numel() * tensor.element_size())
        dist.all_reduce(tensor, op=op, group=self.group)

    def _gather(self, value: Any) -> list:
        out: list = [None] * self.world
        self.sent["all_gather_object"].update(calls=1, bytes=len(json.dumps(value, default=str)))
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        self.sent["broadcast_object_list"].update(calls=1, bytes=len(json.dumps(value, default=str)) if self.rank == 0 else 0)
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    # -- agreement ------------------------------------------------------------------------------

    def verify(self, what: str, value: str) -> None:
        """Gather ``value`` (a hash) from every rank; `DistributedError` on all when one differs
        from rank 0's, naming the ranks."""
        values = self._gather(value)
        bad = [r for r, v in enumerate(values) if v != values[0]]
        if bad:
            raise DistributedError(f"rank {', '.join(map(str, bad))} holds another {what} than rank 0 ({values[bad[0]][:12]} vs {values[0][:12]}); start every rank with the same settings, plan and model")

    def check_bind(self, config, plan: "Optional[Plan]") -> None:
        """At bind: every rank has the same settings (but the group object) and given plan.

        Under FSDP2 (``fully_shard``) parameters are DTensors: the runtime runs inside FSDP2's
        all-gathered forward, the scaler and flags read the local shards (``to_local``). The
        in-run search's training steps (probes, trials) run on every rank alike; its off-path
        forwards run on rank 0 alone on a plain copy of the model whose parameters every rank
        gathered whole when the search started (`replica.plain_copy`), so no rank waits on an
        all-gather the others never issue."""
        self.verify("scheduler settings or plan=", settings_hash(config, plan))

    def set_stages(self, replicas: int) -> None:
        """The ranks make one pipeline, each stage held by ``replicas`` ranks (data-parallel
        copies): a gradient norm is then the whole model's over the stages (`whole_norm`)."""
        self.stage_replicas = replicas

    def whole_norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The whole model's gradient norm from this pipeline stage's ``local`` one: the p-th
        powers summed over the ranks and divided by `stage_replicas` (the max for the inf-norm).
        One all-reduce of 8 bytes, no sync."""
        if math.isinf(norm_type):
            total = local.detach().double().reshape(1).clone()
            self._all_reduce(total, dist.ReduceOp.MAX)
            return total[0].to(local.dtype)
        total = local.detach().double().pow(norm_type).reshape(1)
        self._all_reduce(total, dist.ReduceOp.SUM)
        return (total[0] / (self.stage_replicas or 1)).pow(1.0 / norm_type).to(local.dtype)

    def gather(self, value: Any) -> list:
        """Every rank's ``value`` (JSON-like), in rank order: one ``all_gather_object``. A pipeline
        stage's first step compares the stages this way (`scheduler.pipeline_stage`)."""
        return self._gather(value)

    def decide(self, decide: Callable[[], Any], adopt: Callable[[Any], None], plan: Callable[[], "Optional[Plan]"]) -> None:
        """Rank 0 runs ``decide`` (the search or the window review), which returns its outcome as
        plain data; the outcome is broadcast and the other ranks ``adopt`` it; then every rank's
        ``plan()`` is verified to hash alike (a mismatch raises `DistributedError` on every rank,
        naming the ranks).

        Why one rank decides: the search times layers on the device (``measure_costs``) under a
        wall-clock limit (``search_timeout_s``), so ranks that "solve identically" could still
        return different plans; one rank solving and one broadcast cannot disagree. The window
        review goes the same way, so promotions and demotions happen at the same step everywhere."""
        outcome = decide() if self.rank == 0 else None
        outcome = self._broadcast(outcome)
        if self.rank != 0:
            adopt(outcome)
        self.verify("plan", plan_hash(plan()))

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (JSON-like) on every rank: one ``broadcast_object_list``. The
        scheduler's search sends its candidate plans (or its error) this way, once they exist."""
        return self._broadcast(value)

    def reduce_checks(self, ratios: torch.Tensor, measured: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A planned check step's figures (`scheduler.plan_checks`) of every rank: the saturation
        ``ratios`` maxed, the ``measured`` loss figures averaged over the ranks (under a pipeline,
        over each stage's data-parallel copies, and summed over the stages); two all-reduces of a
        few floats."""
        ratios, measured = ratios.clone(), measured.clone()
        if ratios.numel():
            self._all_reduce(ratios, dist.ReduceOp.MAX)
        self._all_reduce(measured, dist.ReduceOp.SUM)
        return ratios, measured / (self.stage_replicas or self.world)

    def reduce_window(self, profiler, loss_sum: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Combine the profiler's (or a planned window's `PlanWatch`'s) window statistics and the
        loss sum across ranks, in place (`LayerProfiler.reduce_`: three all-reduces;
        `PlanWatch.reduce_`: two); returns the reduced loss sum.

        Before rank 0 decides, so the plan sees every rank's data: histograms, counts and moments
        summed, per-step amax maxed, the loss baseline's sum and count summed. Per-parameter
        gradient statistics (Welford) are not reduced: under DDP the gradients are already
        identical; under FSDP2 rank 0 sees its own shard (a sample)."""
        if profiler is None:
            if loss_sum is None:
                return None
            reduced = loss_sum.double().reshape(-1).clone()
            self._all_reduce(reduced, dist.ReduceOp.SUM)
            return reduced.to(loss_sum.dtype).reshape(loss_sum.shape)
        return profiler.reduce_(self._all_reduce, also_sum=loss_sum)

    # -- the step -------------------------------------------------------------------------------

    def _local_grad_flags(self, device: torch.device) -> torch.Tensor:
        flags = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        return _count_nonfinite(flags, [(i, local_shard(p.grad)) for i, p in self._params if p.grad is not None])

    def _output_flags(self, scaler, device: torch.device) -> torch.Tensor:
        """One-hot (per layer) of this rank's first non-finite forward output."""
        flags = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        watch = scaler.output_watch
        names, finite = watch.pending() if watch is not None else ([], None)
        index = {fqn: i for i, fqn in enumerate(self.layers)}
        at = [(k, index[n]) for k, n in enumerate(names) if n in index]
        if at:
            bad = ~finite.to(device)[[k for k, _ in at]]
            first = bad & (bad.long().cumsum(0) == 1)
            flags.index_add_(0, torch.tensor([i for _, i in at], device=device), first.long())
        return flags

    def agree_on_step(self, scaler, optimizers: Sequence[torch.optim.Optimizer], loss: Optional[torch.Tensor]) -> StepVerdict:
        """Unscale, then one all-reduce (SUM) of the step's flags; the scaler's found-inf of each
        optimizer becomes the reduced one, so GradScaler skips (and backs off) on every rank or on
        none. One host transfer.

        The flags are one int64 vector: per optimizer the scaler's found-inf, the loss's
        non-finite flag, per layer a non-finite-gradient flag and a first-non-finite-output
        flag, and whether a lossy communication method saw a non-finite gradient, each entry ``1 << rank`` when set, so the sum names the ranks (up to rank 62;
        above, entries count ranks). Under DDP the layer flags come from the communication hook
        (`GradCommHook`), before the all-reduce spreads an inf to every rank, so they name the
        rank where it arose; elsewhere (FSDP2, a user's own hook) from the local gradients after it."""
        found = [scaler.found_inf(opt) for opt in optimizers]
        device = found[0].device
        hooked = self.comm_hook.take() if self.comm_hook is not None else None
        grads = hooked[:-1] if hooked is not None else self._local_grad_flags(device)
        # A lossy method (INT8, top-k, PowerSGD) may round a rank's inf away before any scaler sees
        # it: any non-finite gradient seen before communication then skips every optimizer.
        lossy = self.comm_hook is not None and hooked is not None and self.comm_hook.lossy
        seen = (hooked.sum() > 0).reshape(1) if lossy and hooked is not None else torch.zeros(1, dtype=torch.bool, device=device)
        loss_bad = (~torch.isfinite(loss)).reshape(1) if loss is not None else torch.zeros(1, dtype=torch.bool, device=device)
        flags = torch.cat([torch.stack(found).reshape(-1) > 0, loss_bad.to(device), grads.to(device) > 0, self._output_flags(scaler, device) > 0, seen.to(device)])
        vector = flags.long() * self._bit
        self._all_reduce(vector, dist.ReduceOp.SUM)
        host = vector.tolist()
        k, n = len(optimizers), len(self.layers)
        skipped = tuple(bool(v) or bool(host[-1]) for v in host[:k])
        for opt, skip in zip(optimizers, skipped):
            scaler.set_found_inf(opt, skip)
        if self.comm_hook is not None:  # error feedback keeps this step's residuals only if it is taken
            self.comm_hook.communicator.commit(not any(skipped))
        grad_bits, out_bits = host[k + 1 : k + 1 + n], host[k + 1 + n : k + 1 + 2 * n]
        layers = tuple(fqn for fqn, v in zip(self.layers, grad_bits) if v)
        first = next((i for i, v in enumerate(out_bits) if v), None)
        verdict = StepVerdict(
            skipped, layers, {fqn: _ranks(v, self.world) for fqn, v in zip(self.layers, grad_bits) if v},
            None if first is None else self.layers[first], () if first is None else _ranks(out_bits[first], self.world),
            _ranks(host[k], self.world),
        )
        self.last_verdict = verdict
        return verdict

    def set_grad_comm(self, default: CommMethod, per_layer: "Mapping[str, CommMethod]" = {}) -> None:
        """How DDP communicates the gradients from now on: ``default``, and ``per_layer`` (layer
        fqn -> method) for the layers a plan names (no-op without the hook)."""
        if self.comm_hook is None:
            return
        index = {fqn: i for i, fqn in enumerate(self.layers)}
        if self.comm_hook.set_methods(default, {index[fqn]: m for fqn, m in per_layer.items() if fqn in index}):
            named = collections.Counter(m.value for m in per_layer.values() if m is not default)
            logger.info("autoprec: DDP gradients now communicated in %s%s", default.value,
                        "".join(f", {n} layer(s) in {m}" for m, n in sorted(named.items())))

    def comm_state_dict(self) -> Optional[dict]:
        """The gradient communication's error feedback (this rank's), or None without the hook."""
        return self.comm_hook.communicator.state_dict() if self.comm_hook is not None else None

    def load_comm_state_dict(self, state: Optional[dict], device: torch.device) -> None:
        if self.comm_hook is not None and state is not None:
            self.comm_hook.communicator.load_state_dict(state, device)


class SchedulerCheckpoint:
    """A ``torch.distributed.checkpoint`` ``Stateful`` for a scheduler::

        dcp.save({"model": ..., "optim": ..., "autoprec": SchedulerCheckpoint(scheduler)}, checkpoint_id=path)
        dcp.load({"model": ..., "optim": ..., "autoprec": SchedulerCheckpoint(scheduler)}, checkpoint_id=path)

    Each rank saves its whole `state_dict` as one bytes entry under its own key (``rank<r>``):
    the profiler's window accumulators and captured inputs are per rank, and a plain tensor in a
    DCP state dict would be taken as replicated and loaded from one rank. So a checkpoint resumes
    on the same world size (refused in one line otherwise). Cost: one ``torch.save`` per rank."""

    def __init__(self, scheduler: "DynamicPrecisionScheduler"):
        self.scheduler = scheduler

    @staticmethod
    def _rank() -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def state_dict(self) -> dict:
        rank, world = self._rank()
        buffer = io.BytesIO()
        torch.save(self.scheduler.state_dict(), buffer)
        return {f"rank{rank}": buffer.getvalue(), "world_size": world}

    def load_state_dict(self, state: dict) -> None:
        rank, world = self._rank()
        blob = state.get(f"rank{rank}")
        if not isinstance(blob, (bytes, bytearray)) or state.get("world_size") != world:
            raise RuntimeStateError(f"the autoprec checkpoint was not saved by rank {rank} of a {world}-rank run; resume on the world size it was saved with")
        self.scheduler.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))


def grad_comm_methods(config, plan: "Optional[Plan]") -> "tuple[CommMethod, dict[str, CommMethod]]":
    """How DDP communicates the gradients, as ``config.grad_comm`` asks under ``plan``: (the
    default method, layer fqn -> method). A named method applies to every layer; ``"auto"``
    takes the plan's own choice (`Plan.comm`, made by `comm.choice` from the link's measured
    cost under the accuracy budget), FP32 for the layers it does not name and while no plan is
    in force."""
    if isinstance(config.grad_comm, CommMethod):
        return config.grad_comm, {}
    return CommMethod.FP32, dict(plan.comm) if plan is not None else {}
