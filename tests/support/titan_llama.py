"""A tiny Llama laid out as torchtitan lays out its Llama 3 (`torchtitan/models/llama3/model`):
``tok_embeddings``, ``layers`` (a ModuleDict of ``TransformerBlock``: ``attention`` with ``wq``,
``wk``, ``wv``, ``wo``, ``feed_forward`` with ``w1``, ``w2``, ``w3``, ``attention_norm``,
``ffn_norm``), ``norm``, ``output``; rotary embeddings, grouped-query attention through
``scaled_dot_product_attention``. Written here (not imported) so the tests need no torchtitan."""

import copy
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class TitanArgs:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 128
    hidden_dim: int = 64
    max_seq_len: int = 32


def rope(head_dim: int, seq_len: int) -> torch.Tensor:
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)  # (seq, head_dim / 2, 2)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = freqs[: x.shape[1], None, :, 0], freqs[: x.shape[1], None, :, 1]
    rotated = torch.stack((pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads as -1, as torchtitan writes it: under tensor parallelism a rank holds its share.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), freqs)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), freqs)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.attention, self.feed_forward = Attention(args), FeedForward(args)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5), nn.RMSNorm(args.dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: TitanArgs = TitanArgs()):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", rope(args.dim // args.n_heads, args.max_seq_len), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The parts a pipeline stage lacks are None (`pipeline_stage`) and skipped, as torchtitan's
        # forward skips them: a later stage takes the previous stage's hidden states.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def pipeline_stage(model: Transformer, stage: int, stages: int) -> Transformer:
    """Stage ``stage`` of ``model`` split in ``stages`` runs of blocks, as torchtitan's pipeline
    split makes it (`torchtitan/distributed/pipeline_parallel.py`, `pipeline_module_split`): a deep
    copy with the other stages' blocks deleted (the kept ones keep their names, so a plan's fqns
    still apply), ``tok_embeddings`` only on the first stage, ``norm`` and ``output`` only on the
    last (None elsewhere)."""
    part = copy.deepcopy(model)
    per = len(part.layers) // stages
    kept = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in [name for name in part.layers if name not in kept]:
        del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != stages - 1:
        part.norm = part.output = None
    return part


def titan_llama(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TitanArgs(**overrides))


def token_batch(step: int, rank: int = 0, world: int = 1, batch: int = 8, seq: int = 32, vocab: int = 128):
    """This rank's rows of global batch ``step``: (inputs, targets shifted by one)."""
    g = torch.Generator().manual_seed(5000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    rows = tokens[rank::world]
    return rows[:, :-1], rows[:, 1:]


def tensor_parallel_plan(sequence_parallel: bool = False) -> dict:
    """torchtitan's Llama tensor-parallel plan for one block (fqn within the block -> style), with
    sequence parallel the norms sharded along the sequence as torchtitan does."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return plan


def parallelize(model: "Transformer", mesh, sequence_parallel: bool = False) -> "Transformer":
    """``model`` under tensor parallelism on the 1-D ``mesh``, as torchtitan's ``apply_tp``:
    the blocks by `tensor_parallel_plan`, the embeddings row-wise, the head column-wise with a
    replicated output (the loss sees the whole vocabulary); a pipeline stage's absent parts
    (`pipeline_stage`) are passed over."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    seq = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, {name: style for name, style in top.items() if getattr(model, name) is not None})
    for block in model.layers.values():
        parallelize_module(block, mesh, tensor_parallel_plan(sequence_parallel))
    return model


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The LM loss of ``logits`` (batch, seq, vocab) against ``target`` tokens, in FP32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def two_stage_step(scheduler, schedule, rank: int, step: int) -> list:
    """One training step's schedule of a 2-stage pipeline under ``scheduler``: stage 0 feeds
    `token_batch` ``step``'s tokens, stage 1 its targets. Returns stage 1's micro-batch losses
    (empty on stage 0)."""
    x, y = token_batch(step)
    out: list = []
    with scheduler.precision_context():
        if rank == 0:
            schedule.step(x.contiguous())
        else:
            schedule.step(target=y.contiguous(), losses=out)
    return [float(v) for v in out]


def mixed_plan(model: Transformer, kinds: tuple):
    """A plan of ``model`` cycling ``kinds`` (`LayerPrecision`s) over its layers, so a stage and
    either split holds every kind."""
    import autoprec as ap

    plan = ap.Plan.uniform(model, "bf16", (token_batch(0)[0],))
    return plan.with_layers({fqn: kinds[i % len(kinds)] for i, fqn in enumerate(plan.layers)})
