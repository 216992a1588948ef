"""The plan's gradient communication under ``grad_comm="auto"`` (DDP on several ranks):
`CommChoice` measures the link at bind (`comm.LinkCost`), and once a plan is in force and the
optimizer has stepped (its learning rate and Adam's v are what a compression's loss is scored
with), rank 0 chooses each layer's method from the gradients of that step (`comm.choice`) and
every rank takes the plan with that choice (`Plan.with_comm`; the plan's hash is verified at
each window end as ever). A plan that already names its communication (a checkpoint's, a given
plan's) keeps it; a new plan (a search's, a re-search's) gets its own.

Costs: at bind, `LinkCost.measure`; at the step that chooses, on rank 0 per layer and method
one compression of its gradients and one reduction, one host sync per layer, and one
``broadcast_object_list`` of the choice (a few KiB) on every rank."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from ..comm.choice import CHOSEN, COLLECTIVES, LayerComm, LinkCost, choose, comm_loss_increase
from ..formats import CommMethod
from ..plan import Plan
from ..sensitivity import adam_second_moment
from .config import AUTO_COMM

if TYPE_CHECKING:
    from ..distributed import RankAgreement
    from .config import SchedulerConfig

__all__ = ["CommChoice", "warn_without_effect"]

logger = logging.getLogger(__name__)


def warn_without_effect(config: "SchedulerConfig", agreement: "Optional[RankAgreement]") -> None:
    """Say once, at bind, that ``grad_comm`` has no effect in this run: DDP's communication hook
    is what applies it, and there is none on one process, without a process group, or where the
    model is not wrapped in ``DistributedDataParallel`` (or DDP keeps the user's own hook)."""
    if config.grad_comm is CommMethod.FP32 or (agreement is not None and agreement.comm_hook is not None):
        return
    why = ("no process group of several ranks is initialised" if agreement is None
           else "the model is not wrapped in DistributedDataParallel, or DDP keeps a communication hook of its own")
    warnings.warn(f"DynamicPrecisionScheduler(grad_comm='{config.grad_comm}') has no effect in this run: {why}, so no gradient "
                  "travels between ranks through autoprec; leave grad_comm out here", UserWarning, stacklevel=2)


class CommChoice:
    """Chooses a plan's per-layer gradient communication (module docstring); made by `join`."""

    def __init__(self, config: "SchedulerConfig", agreement: "RankAgreement", link: LinkCost):
        self.config = config
        self.link = link
        self._dist = agreement

    @classmethod
    def join(cls, config: "SchedulerConfig", agreement: "Optional[RankAgreement]", device: torch.device) -> "Optional[CommChoice]":
        """The choice for a run whose settings ask for it (``grad_comm="auto"`` with DDP's hook
        on several ranks), with the link measured now (every rank at once); else None."""
        if config.grad_comm != AUTO_COMM or agreement is None or agreement.comm_hook is None:
            return None
        link = LinkCost.measure(agreement.group, device, config.comm)
        logger.info("autoprec: the link sends %.1f MB/s (%.2f ms a collective); gradient communication is chosen per layer once a plan is in force",
                    link.bytes_per_s / 1e6, 1e3 * link.latency_s)
        return cls(config, agreement, link)

    @staticmethod
    def due(plan: Optional[Plan], optimizer_steps: int) -> bool:
        """Whether to choose now: a plan in force that names no communication, after the
        optimizer's first step (every rank computes the same)."""
        return plan is not None and not plan.comm and optimizer_steps >= 1

    def choose(self, plan: Plan, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss: Optional[torch.Tensor]) -> Plan:
        """``plan`` with every layer's method and the figures it was chosen by (``metadata["comm"]``):
        rank 0's choice, the same on every rank."""
        decided = self._dist.share(self._decided(plan, model, optimizers, loss) if self._dist.rank == 0 else None)
        return plan.with_comm(decided["methods"]).replace(metadata={**plan.metadata, "comm": decided["figures"]})

    def _decided(self, plan: Plan, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss: Optional[torch.Tensor]) -> dict:
        """`_decide`, or every layer FP32 with the reason when it fails: the other ranks wait in
        the broadcast for an answer, and FP32 is what they would send without one."""
        try:
            return self._decide(plan, model, optimizers, loss)
        except Exception as exc:  # noqa: BLE001 - any failure here must still reach the other ranks
            logger.warning("autoprec: gradient communication not chosen (%s: %s); every layer's travels in FP32", type(exc).__name__, exc)
            return {"methods": {fqn: CommMethod.FP32.value for fqn in plan.layers}, "figures": {"error": f"{type(exc).__name__}: {exc}"}}

    # -- rank 0 ---------------------------------------------------------------------------------

    def _decide(self, plan: Plan, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss: Optional[torch.Tensor]) -> dict:
        settings = self.config.comm
        allowance = self._allowance(plan, loss)
        scoring = _scoring(model, optimizers)
        modules = dict(model.named_modules())
        layers: dict[str, LayerComm] = {}
        shapes_of: dict[str, list] = {}
        for fqn in plan.layers:
            params = [p for p in modules[fqn].parameters(recurse=False) if p.grad is not None and p.requires_grad]
            if not params or scoring is None:
                continue
            lr, preconditioners = scoring(params)
            grads = [p.grad for p in params]
            shapes = [g.shape for g in grads]
            shapes_of[fqn] = shapes
            layers[fqn] = LayerComm(
                {m: self.link.seconds(m, shapes, settings) for m in (CommMethod.FP32, *CHOSEN)},
                {m: 0.0 if m is CommMethod.FP32 else comm_loss_increase(m, grads, preconditioners, lr, settings) for m in (CommMethod.FP32, *CHOSEN)},
            )
        # DDP's buckets: its default cap, 25 MiB of FP32 gradients each.
        buckets = max(1, math.ceil(sum(4 * sum(math.prod(s) for s in shapes) for shapes in shapes_of.values()) / (25 * 2**20)))
        fixed = {m: COLLECTIVES[m] * buckets * self.link.latency_s for m in CHOSEN}
        chosen = choose(layers, allowance, fixed)
        methods = {fqn: chosen.get(fqn, CommMethod.FP32).value for fqn in plan.layers}
        figures = {
            "link": self.link.to_dict(),
            "allowed_loss_increase": allowance,
            "scored": "no optimizer state to score a compression with (Adam without v): every layer FP32" if scoring is None else "measured",
            "layers": {fqn: {"method": methods[fqn],
                             "seconds": {m.value: s for m, s in layer.seconds.items()},
                             "loss_increase": {m.value: v for m, v in layer.loss.items()}} for fqn, layer in layers.items()},
        }
        counts = {m: sum(v == m for v in methods.values()) for m in sorted(set(methods.values()))}
        saved = sum(layer.seconds[CommMethod.FP32] - layer.seconds[chosen[fqn]] for fqn, layer in layers.items())
        logger.info("autoprec: gradient communication per layer: %s (predicted %.1f ms a step less to send, loss +%.3g of %.3g allowed)",
                    counts, 1e3 * saved, sum(layer.loss[chosen[fqn]] for fqn, layer in layers.items()), allowance)
        return {"methods": methods, "figures": figures}

    def _allowance(self, plan: Plan, loss: Optional[torch.Tensor]) -> float:
        """The loss increase left for the communication: the plan's budget (its ``budgets``,
        else the settings' accuracy budget, relative to ``loss``) less what its formats are
        predicted to cost; inf when no accuracy budget is set."""
        budget = plan.budgets.get("loss_increase")
        if not isinstance(budget, (int, float)):
            accuracy = self.config.accuracy_budget
            if accuracy is None:
                return math.inf
            if self.config.accuracy_relative:
                if loss is None or not bool(torch.isfinite(loss)):
                    return 0.0  # no loss to be relative to: nothing lossy
                return float(accuracy * abs(float(loss)))
            budget = float(accuracy)
        used = plan.predicted.get("loss_increase")
        return max(float(budget) - (float(used) if isinstance(used, (int, float)) else 0.0), 0.0)


def _scoring(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> "Optional[Any]":
    """``params -> (lr, per-parameter preconditioner or None)`` from the optimizers' own
    settings (Adam: ``1/(√v + ε)``, the bias-corrected v; others: 1), or None when an Adam's v is
    not readable (before its first step, a wrapper hiding its state)."""
    group_of: dict[int, Mapping[str, Any]] = {}
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            for p in group["params"]:
                group_of[id(p)] = group
    adam = any("betas" in g for g in group_of.values())
    moments = adam_second_moment(model, optimizers) if adam else None
    if adam and moments is None:
        return None
    name_of = {id(p): name for name, p in model.named_parameters()}

    def scoring(params: Sequence[torch.Tensor]) -> tuple[float, list]:
        lr = max(float(group_of.get(id(p), {}).get("lr", 0.0)) for p in params)
        if moments is None:
            return lr, [None] * len(params)
        return lr, [1.0 / (moments[name_of[id(p)]].sqrt() + group_of[id(p)].get("eps", 1e-8)) for p in params]

    return scoring
