"""What a DDP gradient bucket sends, and the error it leaves behind (error feedback).

On a cluster the gradient all-reduce, not the GEMM, is often what a step waits for. Each
parameter of a DDP bucket travels by one `CommMethod` (a plan gives each layer its own,
`Plan.comm`; a bucket mixing methods sends one group per method):

- ``fp32``, ``bf16``, ``fp16``: torch's ``default_hooks`` (``allreduce_hook``,
  ``bf16_compress_hook``, ``fp16_compress_hook``): an all-reduce in that precision, no memory.
- ``powersgd``: torch's ``powerSGD_hook`` (rank-``powersgd_rank`` factors P and Q all-reduced,
  its own error feedback and warm start), one ``PowerSGDState`` for every bucket that uses it.
- ``int8``: per-chunk scaled INT8 in two phases, like a reduce-scatter then an all-gather:
  each rank quantizes its bucket (a scale per ``chunk`` values of one parameter, amax / 127) and
  sends each chunk to the rank that owns it (``all_to_all_single``); each rank averages the chunks
  it owns in FP32, quantizes them again and ``all_gather``s them. Both roundings are kept for the
  next step.
- ``topk``: each parameter's ``topk_ratio`` x n values of largest magnitude (of gradient +
  residual), sent as (int32 index, FP32 value) pairs by ``all_gather``; the rest stays in the
  residual.

Bytes one rank sends per bucket of n FP32 values in c chunks, w ranks (``bytes_sent``,
ring-equivalent): FP32 ``2(w-1)/w * 4n``, BF16/FP16 half that, INT8 ``2(w-1)/w * c * (chunk +
4)`` (a quarter of FP32's and a little more: each parameter is padded to whole chunks), top-k
``(w-1) * 8k``, PowerSGD ``2(w-1)/w * 4`` x (r(rows + cols) per compressed matrix + the numel of
the rest).

**Error feedback** (`ErrorFeedback`): a lossy method adds the bucket's residual to its gradient
before compressing and keeps what it could not send. Residuals are kept in unscaled units
(divided by the loss scale, multiplied back when used), so GradScaler's growth and backoff do not
mis-scale them; each step's new residuals are *pending* until the ranks agree the step was taken
(`BucketCommunicator.commit`): a step skipped for non-finite gradients on any rank leaves every
residual as it was (PowerSGD's state, which torch keeps, restarts its warm start instead). The
residuals are part of the scheduler's checkpoint, so a resumed run continues bit-identically.
Costs: one FP32 copy of each compressed bucket (two while pending); per INT8 bucket one amax per
chunk and two collectives, the first waited for in the hook (the backward pauses for it: see
`BucketCommunicator._int8`); per top-k bucket one ``topk`` and one collective.

INT8 and top-k see a bucket in a canonical order (its parameters sorted by name), chunk and
select per parameter, give each INT8 chunk an owner by its parameter's name, and keep one
residual per parameter: DDP lays its buckets out one way for the first step and rebuilds them
another way after, and a resumed run starts from the first again, so no figure may depend on the
layout (a copy of the bucket in and out, one read and write of it). torch's PowerSGD keys its
state by bucket index instead; a resumed run keeps its step count and restarts its error feedback.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .._checks import check_fields, integer, number
from ..formats import PER_LAYER_COMM, CommMethod

__all__ = ["CommSettings", "ErrorFeedback", "BucketCommunicator", "bytes_sent", "quantize_chunks", "dequantize_chunks"]


@dataclasses.dataclass(frozen=True)
class CommSettings:
    """``chunk``: INT8 values per scale; ``topk_ratio``: the fraction of a bucket top-k sends;
    ``powersgd_rank``: PowerSGD's matrix approximation rank; ``powersgd_start``: the steps PowerSGD
    all-reduces in FP32 before compressing (torch's ``start_powerSGD_iter``, at least 2 with error
    feedback: DDP rebuilds its buckets after the first)."""

    chunk: int = 256
    topk_ratio: float = 0.01
    powersgd_rank: int = 2
    powersgd_start: int = 2

    def __post_init__(self):
        check_fields(self, "CommSettings", {
            "chunk": (integer(1), "an integer >= 1 (INT8 values per scale)"),
            "topk_ratio": (number(above=0, high=1), "a fraction in (0, 1] (of each bucket's values sent)"),
            "powersgd_rank": (integer(1), "an integer >= 1 (PowerSGD's approximation rank)"),
            "powersgd_start": (integer(2), "an integer >= 2 (steps all-reduced in FP32 before compressing)"),
        })


def quantize_chunks(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D FP32, a multiple of ``chunk`` long) as (int8 values, FP32 scale per chunk):
    scale = chunk amax / 127 (1 for an all-zero chunk), values rounded to nearest."""
    q, scales, _ = _quantize_rows(x.reshape(-1, chunk).clone())
    return q.view(-1), scales.view(-1)


def dequantize_chunks(q: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    return (q.view(-1, chunk).float() * scales[:, None]).view(-1)


def bytes_sent(method: CommMethod, shapes: Sequence[torch.Size], world: int, settings: CommSettings = CommSettings()) -> int:
    """Bytes one rank sends to communicate a bucket of FP32 tensors of ``shapes`` (module
    docstring; ring-equivalent for all-reduces)."""
    n = sum(math.prod(s) for s in shapes)
    ring = 2 * (world - 1) / world
    if method is CommMethod.FP32:
        return round(ring * 4 * n)
    if method in (CommMethod.BF16, CommMethod.FP16):
        return round(ring * 2 * n)
    if method is CommMethod.INT8:  # each parameter padded to whole chunks; a byte per value, 4 per chunk
        chunks = sum(-(-math.prod(s) // settings.chunk) for s in shapes)
        return round(ring * chunks * (settings.chunk + 4))
    if method is CommMethod.TOPK:
        return (world - 1) * 8 * sum(_topk_count(math.prod(s), settings.topk_ratio) for s in shapes)
    values = 0  # PowerSGD: torch compresses a matrix when its factors are smaller than it
    for s in shapes:
        rows, cols = (s[0], math.prod(s[1:])) if len(s) > 1 else (1, math.prod(s))
        r = min(rows, cols, settings.powersgd_rank)
        values += r * (rows + cols) if len(s) > 1 and r * (rows + cols) < rows * cols else rows * cols
    return round(ring * 4 * values)


def _topk_count(n: int, ratio: float) -> int:
    return max(1, min(n, math.ceil(ratio * n)))


class ErrorFeedback:
    """Per bucket key, the residual (FP32, unscaled units) a lossy method could not send: the
    committed one, read by the next step, and this step's pending one (module docstring)."""

    def __init__(self) -> None:
        self.committed: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}

    def residual(self, key: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The committed residual of ``key`` (None before the first, or when its size changed)."""
        r = self.committed.get(key)
        return r if r is not None and r.shape == like.shape else None

    def keep(self, key: str, residual: torch.Tensor) -> None:
        self.pending[key] = residual

    def commit(self, taken: bool) -> None:
        """The step was taken on every rank: its residuals become the committed ones; else they
        are dropped (they may hold the non-finite values that skipped it)."""
        if taken:
            self.committed.update(self.pending)
        self.pending = {}

    def state_dict(self) -> dict:
        return {key: r.detach().cpu().clone() for key, r in self.committed.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], device: "torch.device | None" = None) -> None:
        self.committed = {key: r.to(device) if device is not None else r.clone() for key, r in state.items()}
        self.pending = {}


class BucketCommunicator:
    """Communicates one DDP bucket by a `CommMethod` (`allreduce`, which returns the future DDP's
    ``register_comm_hook`` expects: the bucket averaged over the ranks), and keeps the error
    feedback and the bytes sent (``sent``: method -> bytes this rank sent since built, by
    `bytes_sent`).

    ``names``: ``id(parameter)`` -> its name (residual keys); ``scale``: the loss scale applied
    to the gradients (a 0-d device tensor; None or a callable returning None: unscaled)."""

    def __init__(self, group, names: Mapping[int, str], settings: CommSettings = CommSettings(),
                 scale: Callable[[], Optional[torch.Tensor]] = lambda: None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.settings = settings
        self.feedback = ErrorFeedback()
        self.sent: dict[str, int] = {}
        self._names = dict(names)
        self._scale = scale
        self._powersgd: Any = None

    def allreduce(self, bucket, method_of: "CommMethod | Callable[[torch.Tensor], CommMethod]") -> torch.futures.Future:
        """Send ``bucket`` (a DDP ``GradBucket``), each parameter by ``method_of(parameter)`` (or
        all by one method);
        the future DDP waits for, holding the bucket averaged over the ranks. A bucket of one
        dense method (or PowerSGD) goes through torch's own hook; otherwise each method's
        parameters are sent as one group, in `PER_LAYER_COMM` order (the same on every rank: DDP
        buckets the same parameters everywhere), one or two collectives per group."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        grads, params = bucket.gradients(), bucket.parameters()
        methods = [method_of if isinstance(method_of, CommMethod) else method_of(p) for p in params]
        only = methods[0] if len(set(methods)) == 1 else None
        if only is CommMethod.POWERSGD:
            # PowerSGD all-reduces uncompressed (FP32) until its start step; counted as it travels.
            travels = CommMethod.FP32 if self._powersgd_state().iter < self.settings.powersgd_start else only
            self._count(travels, grads)
            return self._powersgd_hook(bucket)
        hooks = {CommMethod.FP32: default_hooks.allreduce_hook, CommMethod.BF16: default_hooks.bf16_compress_hook,
                 CommMethod.FP16: default_hooks.fp16_compress_hook}
        if only in hooks:
            self._count(only, grads)
            return hooks[only](self.group, bucket)
        # Each group in a canonical order (its parameters by name): DDP lays a bucket out in one
        # order for its first step and rebuilds it in another, and a resumed run starts again
        # from the first; chunks, shards and residuals must not depend on it.
        if CommMethod.POWERSGD in methods:
            raise ValueError("PowerSGD compresses whole buckets; it cannot share one with other methods")
        names = [self._names.get(id(p), f"#{i}") for i, p in enumerate(params)]
        futures = []
        for method in PER_LAYER_COMM:
            members = sorted((i for i, m in enumerate(methods) if m is method), key=lambda i: names[i])
            if members:
                group = [grads[i] for i in members]
                self._count(method, group)
                futures.append(self._send(method, group, [names[i] for i in members]))
        return torch.futures.collect_all(futures).then(lambda _: bucket.buffer())

    def _count(self, method: CommMethod, grads: Sequence[torch.Tensor]) -> None:
        self.sent[method.value] = self.sent.get(method.value, 0) + bytes_sent(method, [g.shape for g in grads], self.world, self.settings)

    def _send(self, method: CommMethod, grads: Sequence[torch.Tensor], names: Sequence[str]) -> torch.futures.Future:
        """One group of a bucket's gradients (views of its buffer, canonical order), averaged
        into place over the ranks when the future completes."""
        if method in (CommMethod.FP32, CommMethod.BF16, CommMethod.FP16):
            return self._dense(method, grads)
        scale = self._scale()
        residuals = [self.feedback.residual(name, g) for name, g in zip(names, grads)]
        if method is CommMethod.INT8:
            layout = _ChunkLayout([(name, g.numel()) for name, g in zip(names, grads)], self.settings.chunk, self.world)
            return self._int8(layout, grads, residuals, scale)
        x = torch.cat([g.detach().reshape(-1).float() for g in grads])
        if any(r is not None for r in residuals):
            residual = torch.cat([(r if r is not None else torch.zeros_like(g, dtype=torch.float32)).reshape(-1) for r, g in zip(residuals, grads)])
            x = x + (residual * scale if scale is not None else residual)
        sizes = [g.numel() for g in grads]

        def keep(residual: torch.Tensor) -> None:  # in unscaled units, per parameter
            residual = residual / scale if scale is not None else residual
            for name, g, piece in zip(names, grads, residual.split(sizes)):
                self.feedback.keep(name, piece.view_as(g))

        def give_back(average: torch.Tensor) -> None:
            for g, piece in zip(grads, average.split(sizes)):
                g.copy_(piece.view_as(g))

        return self._topk(x, sizes, keep, give_back)

    def _dense(self, method: CommMethod, grads: Sequence[torch.Tensor]) -> torch.futures.Future:
        """An all-reduce of the group in ``method``'s dtype (as torch's hooks: the sum divided by
        the world size, rounded once more into the dtype), written back into ``grads``."""
        dtype = {CommMethod.FP32: torch.float32, CommMethod.BF16: torch.bfloat16, CommMethod.FP16: torch.float16}[method]
        flat = torch.cat([g.detach().reshape(-1) for g in grads]).to(dtype).div_(self.world)
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def give_back(_) -> None:
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))

        return work.get_future().then(give_back)

    # -- the lossy methods ----------------------------------------------------------------------

    def _int8(self, layout: "_ChunkLayout", grads: Sequence[torch.Tensor], residuals: Sequence[Optional[torch.Tensor]],
              scale: Optional[torch.Tensor]) -> torch.futures.Future:
        """Two phases (module docstring), on the bucket's chunks laid out by owner
        (`_ChunkLayout`): no chunk straddles two parameters, and a chunk's owner follows from its
        parameter's name and its place in it, so no figure depends on which bucket a parameter
        travels in. The owner's rounding error of its chunks of the average joins its residual
        times the world size: added to its gradient next step, it reaches the average once, so
        one residual per rank and parameter holds both roundings. Passes over the bucket: one
        gather (gradient + residual), four to quantize and keep the rounding error, one to keep
        the residuals per parameter, three to dequantize into the gradients; half of it again
        for the owned chunks."""
        world, chunk, rank = self.world, layout.chunk, self.rank
        values = layout.gather(grads, residuals, scale)
        q, scales, error = _quantize_rows(values)  # error: values' storage, reused
        counts, starts = layout.counts, layout.starts
        mine = counts[rank]
        recv = torch.empty(world * mine, chunk + 4, dtype=torch.uint8, device=values.device)
        # The first phase waits here, so each rank issues its buckets' collectives in the hook's
        # own order: a second phase issued from a completion callback could interleave with the
        # next bucket's first in another order on another rank, and the ranks would hang on
        # mismatched collectives. The all-gather still overlaps the rest of the backward.
        dist.all_to_all_single(recv, _pack(q, scales), output_split_sizes=[mine] * world, input_split_sizes=counts, group=self.group)
        got_q, got_s = _unpack(recv, chunk)
        shard = (got_q.float().mul_(got_s)).view(world, mine, chunk).sum(0).div_(world)  # every rank's part, in rank order
        q_own, s_own, own_error = _quantize_rows(shard)
        error[starts[rank]:starts[rank] + mine].add_(own_error, alpha=world)
        if scale is not None:
            error.div_(scale)  # residuals are kept unscaled
        for (name, residual), g in zip(layout.scatter_new(error).items(), grads):
            self.feedback.keep(name, residual.view_as(g))
        widest = max(counts)
        share = torch.zeros(widest, chunk + 4, dtype=torch.uint8, device=values.device)  # all-gather parts are equal: padded
        share[:mine] = _pack(q_own, s_own)
        gathered = torch.empty(world * widest, chunk + 4, dtype=torch.uint8, device=values.device)
        work = _all_gather(gathered, share, self.group)

        def dequantize(_):
            parts = gathered.view(world, widest, chunk + 4)
            rows = torch.cat([parts[r, :counts[r]] for r in range(world)])
            got_q, got_s = _unpack(rows, chunk)
            layout.scatter_into(got_q.float().mul_(got_s), grads)

        return work.get_future().then(dequantize)

    def _topk(self, x: torch.Tensor, sizes: Sequence[int], keep: Callable[[torch.Tensor], None],
              give_back: Callable[[torch.Tensor], None]) -> torch.futures.Future:
        """Each parameter's ``topk_ratio`` largest magnitudes (so nothing depends on the bucket a
        parameter travels in), all-gathered as (int32 index, FP32 value) pairs."""
        n, world = x.numel(), self.world
        chosen, start = [], 0
        for size in sizes:
            k = _topk_count(size, self.settings.topk_ratio)
            chosen.append(x[start:start + size].abs().topk(k, sorted=False).indices + start)
            start += size
        index = torch.cat(chosen)
        k = index.numel()
        values = x[index]
        left = x.clone()
        left[index] = 0.0
        keep(left)
        mine = torch.cat([index.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        work = _all_gather(gathered, mine, self.group)

        def scatter(_):
            pairs = gathered.view(world, -1)
            indices = pairs[:, : 4 * k].contiguous().view(torch.int32).reshape(-1).long()
            vals = pairs[:, 4 * k :].contiguous().view(torch.float32).reshape(-1)
            total = torch.zeros(n, dtype=torch.float32, device=x.device).index_add_(0, indices, vals)
            give_back(total / world)

        return work.get_future().then(scatter)

    def _powersgd_hook(self, bucket) -> torch.futures.Future:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

        future = powerSGD.powerSGD_hook(self._powersgd_state(), bucket)
        if not bucket.buffer().is_cuda:
            # torch's hook issues its second and third collectives from completion callbacks. A
            # CUDA future runs those at once, in the hook's order; a CPU (gloo) future runs them
            # when the first completes, which can interleave with the next bucket's collectives
            # in another order on another rank: gloo then fails on mismatched collectives. Waiting
            # here keeps one order (the CPU backward pauses for each PowerSGD bucket).
            future.wait()
        return future

    def _powersgd_state(self) -> Any:
        """torch's ``PowerSGDState`` for every PowerSGD bucket (made on first use)."""
        if self._powersgd is None:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

            self._powersgd = powerSGD.PowerSGDState(
                process_group=self.group, matrix_approximation_rank=self.settings.powersgd_rank,
                start_powerSGD_iter=self.settings.powersgd_start, min_compression_rate=1, use_error_feedback=True,
                warm_start=True, random_seed=0)
        return self._powersgd

    # -- the step's outcome and checkpoints -----------------------------------------------------

    def commit(self, taken: bool) -> None:
        """After the ranks agreed on the step (`RankAgreement.agree_on_step`): keep this step's
        residuals when it was taken; when skipped, keep the old ones and restart PowerSGD's error
        feedback and factors (torch's state has already absorbed the skipped gradients)."""
        self.feedback.commit(taken)
        if not taken and self._powersgd is not None:
            self._powersgd.error_dict.clear()
            self._powersgd.p_memory_dict.clear()
            self._powersgd.q_memory_dict.clear()

    def state_dict(self) -> dict:
        state: dict = {"residuals": self.feedback.state_dict(), "sent": dict(self.sent)}
        if self._powersgd is not None:
            state["powersgd"] = {"iter": self._powersgd.iter, "rng": self._powersgd.rng.get_state(),
                                 "error_buckets": len(self._powersgd.error_dict)}
        return state

    def load_state_dict(self, state: Mapping[str, Any], device: "torch.device | None" = None) -> None:
        """Restore `state_dict`: the residuals onto ``device``, the bytes sent, PowerSGD's step."""
        self.feedback.load_state_dict(state.get("residuals", {}), device)
        self.sent = dict(state.get("sent", {}))
        saved = state.get("powersgd")
        if saved is not None:  # its error and factors are laid out by bucket index (module docstring)
            p = self._powersgd_state()
            p.iter = saved["iter"]
            p.rng.set_state(saved["rng"])


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> Any:
    """Every rank's ``mine`` into ``out`` (async work): torch 2.13 names the one-tensor all-gather
    ``all_gather_single`` (``all_gather_into_tensor`` is deprecated there), torch 2.11 only the latter."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=True)


def _pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per row (a chunk): its int8 values then its FP32 scale, as ``chunk + 4`` bytes."""
    return torch.cat([q.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def _unpack(rows: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values (rows, chunk), FP32 scales (rows, 1)) of `_pack`'s rows."""
    return rows[:, :chunk].contiguous().view(torch.int8), rows[:, chunk:].contiguous().view(torch.float32)


def _quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values`` (rows, chunk) FP32 -> (int8 values, FP32 scale per row (rows, 1), rounding
    error), as `quantize_chunks`; the error is written over ``values`` (no new bucket-sized
    FP32 tensor but one)."""
    amax = values.abs().amax(dim=1, keepdim=True)  # on a CPU about twice as fast as an inf-norm
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    rounded = (values / scales).round_()  # |values| <= amax: within [-127, 127], no clamp needed
    q = rounded.to(torch.int8)
    return q, scales, values.addcmul_(rounded, scales, value=-1.0)


class _ChunkLayout:
    """A bucket's parameters (canonical order) cut into chunks of ``chunk`` values (the last of
    each zero-padded) and laid out by owner: rank r's chunks first for r = 0, 1, ...; within a
    rank, by parameter then place. Chunk j of a parameter is owned by rank
    ``(crc32(name) + j) % world``, so a parameter's chunks and their owners are the same in any
    bucket. ``counts`` / ``starts``: each rank's rows and where they begin."""

    def __init__(self, pieces: Sequence[tuple[str, int]], chunk: int, world: int):
        self.pieces, self.chunk, self.world = list(pieces), chunk, world
        per_rank = [0] * world
        spans = []
        for name, n in self.pieces:
            count, first = -(-n // chunk), zlib.crc32(name.encode())
            span = []
            for r in range(world):
                j0 = (r - first) % world
                rows = len(range(j0, count, world))
                span.append((j0, rows, per_rank[r]))
                per_rank[r] += rows
            spans.append(span)
        self.counts = per_rank
        self.starts = [sum(per_rank[:r]) for r in range(world)]
        self.rows = sum(per_rank)
        # Per parameter and rank: (first chunk j0, how many, row in the layout) of chunks j0, j0 + world, ...
        self.places = [[(j0, rows, self.starts[r] + at) for r, (j0, rows, at) in enumerate(span)] for span in spans]

    def _chunks(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """``t`` (n values) as (chunks, chunk): a view when whole, else a zero-padded copy."""
        flat = t.reshape(-1)
        if n % self.chunk == 0:
            return flat.view(-1, self.chunk)
        padded = torch.zeros(-(-n // self.chunk) * self.chunk, dtype=flat.dtype, device=flat.device)
        padded[:n] = flat
        return padded.view(-1, self.chunk)

    def gather(self, grads: Sequence[torch.Tensor], residuals: Sequence[Optional[torch.Tensor]], scale: Optional[torch.Tensor]) -> torch.Tensor:
        """(rows, chunk) FP32: each gradient plus its residual times ``scale``, in layout order."""
        out = torch.empty(self.rows, self.chunk, dtype=torch.float32, device=grads[0].device)
        for (name, n), g, residual, places in zip(self.pieces, grads, residuals, self.places):
            src = self._chunks(g.detach(), n)
            res = self._chunks(residual, n) if residual is not None else None
            for j0, rows, at in places:
                if rows:
                    dst = out[at:at + rows]
                    dst.copy_(src[j0::self.world])
                    if res is not None:
                        if scale is not None:
                            dst.addcmul_(res[j0::self.world], scale)
                        else:
                            dst.add_(res[j0::self.world])
        return out

    def scatter_new(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``rows`` back in each parameter's order, as new FP32 tensors (flat, unpadded)."""
        out = {}
        for (name, n), places in zip(self.pieces, self.places):
            dst = torch.empty(-(-n // self.chunk), self.chunk, dtype=torch.float32, device=rows.device)
            for j0, count, at in places:
                if count:
                    dst[j0::self.world] = rows[at:at + count]
            out[name] = dst.view(-1)[:n]
        return out

    def scatter_into(self, rows: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """``rows`` written into ``grads`` (views of the bucket's buffer)."""
        for (name, n), g, places in zip(self.pieces, grads, self.places):
            whole = n % self.chunk == 0 and g.is_contiguous()
            dst = g.view(-1, self.chunk) if whole else torch.empty(-(-n // self.chunk), self.chunk, dtype=g.dtype, device=g.device)
            for j0, count, at in places:
                if count:
                    dst[j0::self.world] = rows[at:at + count]
            if not whole:
                g.copy_(dst.view(-1)[:n].view_as(g))
