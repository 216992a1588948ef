"""The built-in default workload: a byte-level GPT-style language model on Python's own docs.

autoprec needs a real training run to decide precision on -- one whose loss visibly falls in a
few hundred steps, so that a precision choice that hurts convergence shows up as a worse loss.
This module provides one that needs no download and no GPU:

* **Data** (`load_corpus`). The text of ``pydoc_data.topics`` (the pages behind ``help("if")``
  and friends), which ships with every CPython, as raw bytes: a vocabulary of 256, no tokenizer.
* **Model** (`ByteLM`). A small pre-LayerNorm transformer in the style of nanoGPT
  (https://github.com/karpathy/nanoGPT, ``model.py``), its attention products written as
  explicit matmuls (`CausalSelfAttention`) so that a precision runtime sees them.
* **Training.** AdamW with warmup and clipping (`ByteLMWorkload.make_optimizer`,
  ``max_grad_norm``), run by the core's `autoprec.workload.TrainStep`; :func:`train` loops it
  with an optional context manager around forward + loss, e.g.
  ``lambda: torch.autocast("cpu", torch.bfloat16)``.

Everything is deterministic given seeds: batches are drawn from a private ``torch.Generator``
(:class:`BatchSampler`), and :meth:`ByteLMWorkload.build_model` seeds the initialisation inside
``torch.random.fork_rng`` so the caller's global RNG state is left untouched.

``default_workload("small")`` with batch 16 starts at a validation loss of about ln 256 = 5.545
(a flat initialisation) and learns the text's byte statistics within a few hundred steps of
:func:`train` at the default lr 3e-3 (``tests/workloads/test_workloads.py``: the "tiny" preset below 2.8
after 150 steps, "small" below 2.5 after 300).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..workload import TrainStep, to_device

__all__ = [
    "LMConfig",
    "load_corpus",
    "split_corpus",
    "CausalSelfAttention",
    "MLP",
    "TransformerBlock",
    "ByteLM",
    "BatchSampler",
    "ByteLMWorkload",
    "BlockWorkload",
    "adamw_with_warmup",
    "batch_inputs",
    "default_workload",
    "evaluate",
    "train",
]

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]

# GPT-2 initialisation (Radford et al. 2019, sec. 2.3; nanoGPT model.py `_init_weights`):
# weights ~ N(0, 0.02), biases zero, and residual output projections scaled by 1/sqrt(2 * n_layers)
# because each block adds two residual branches and their variances accumulate.
_INIT_STD = 0.02


@dataclass(frozen=True)
class LMConfig:
    """Shape of a :class:`ByteLM`. Immutable; derive variants with ``dataclasses.replace``.

    The defaults are the ``"small"`` preset (470,528 parameters, of which 65,536 are the two
    256-row byte tables). Use :meth:`from_name` for presets.
    """

    vocab_size: int = 256  # one token per byte value
    context: int = 64  # sequence length in tokens (= bytes)
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512  # MLP hidden width, 4 * d_model as in GPT-2
    dropout: float = 0.0  # 0: the few-hundred-step runs here never reach overfitting

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"LMConfig(d_model={self.d_model}, n_heads={self.n_heads}): d_model must be "
                f"divisible by n_heads; pick n_heads from the divisors of {self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LMConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_name(cls, name: str) -> LMConfig:
        """Preset by name: ``"small"`` (the defaults) or ``"tiny"`` (for fast unit tests)."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(
                f"LMConfig.from_name({name!r}): unknown preset; choose one of {sorted(_PRESETS)}"
            ) from None

    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return tuple(sorted(_PRESETS))


_PRESETS: dict[str, LMConfig] = {
    "small": LMConfig(),
    # 134,912 parameters; measured ~3-4x cheaper per step than "small" at the same batch size.
    "tiny": LMConfig(context=32, d_model=64, n_heads=2, n_layers=2, d_ff=256),
}


@functools.lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The training text: every ``pydoc_data.topics`` page, sorted by key, joined, UTF-8 encoded.

    Deterministic for a given Python version: ~466 KB of English and code samples across 79
    topics on CPython 3.x (the exact size varies a little between versions). Cached after the first
    call (bytes are immutable, so sharing is safe); the first call costs ~10 ms.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some minimal distro Pythons strip pydoc_data
        raise RuntimeError(
            "autoprec's default workload reads its text from the standard-library module "
            "pydoc_data.topics, which this Python install lacks; install the full Python "
            "standard library (e.g. the distro's python3 'full' or 'doc' package)"
        ) from exc
    # Topics are separated by a blank line so that no page runs into the next mid-word.
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def split_corpus(data: bytes, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split bytes into contiguous ``(train, val)`` int64 tensors: train first, val last.

    A contiguous split (rather than random chunks) keeps validation text unseen during
    training. Costs one copy of ``data`` as int64 (8 bytes per byte: ~3.7 MB for the corpus).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"split_corpus(val_fraction={val_fraction!r}): must be in (0, 1)")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else None
    n = 0 if tokens is None else tokens.numel()
    n_val = int(round(n * val_fraction))
    if tokens is None or n_val == 0 or n_val == n:
        raise ValueError(
            f"split_corpus: {n} bytes with val_fraction={val_fraction} leaves an empty split; "
            "pass more data or a val_fraction nearer 0.5"
        )
    return tokens[: n - n_val].clone(), tokens[n - n_val :].clone()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with the attention products as explicit matmuls.

    Written as matmuls, not ``F.scaled_dot_product_attention``, so that a precision runtime that
    intercepts a module's own matmuls sees the ``q @ k^T`` and ``att @ v`` products.
    ``att = (q @ k^T) * scale``, causal mask, softmax in float32, ``y = att @ v``. The softmax is
    upcast because exp() over bf16/fp16 logits loses most of its mantissa; the matmuls run in
    whatever dtype the inputs have, so a precision runtime (or autocast) controls them.
    """

    causal_mask: torch.Tensor  # a registered buffer

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)  # Vaswani et al. 2017, eq. 1
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.context, config.context, dtype=torch.bool))
        # Not persistent: derived from the config, so it need not bloat checkpoints.
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        if t > self.causal_mask.shape[0]:
            raise ValueError(
                f"CausalSelfAttention: sequence length {t} exceeds the configured context "
                f"{self.causal_mask.shape[0]}; crop the input or raise LMConfig.context"
            )
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, D)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        att = torch.softmax(att.float(), dim=-1).to(v.dtype)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """``Linear(C, d_ff) -> GELU -> Linear(d_ff, C)``, the GPT-2 feed-forward block."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``. Takes float ``(B, T, C)``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """Byte-level GPT: token + learned position embeddings, ``n_layers`` :class:`TransformerBlock`
    (causal self-attention and a GELU MLP, pre-LayerNorm), a final LayerNorm and an untied ``lm_head``.

    Parameters use the GPT-2 initialisation (see ``_INIT_STD``). Construction draws from the
    global torch RNG like any ``nn.Module``; use :meth:`ByteLMWorkload.build_model` for a seeded model
    that leaves the global RNG alone.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        resid_std = _INIT_STD / math.sqrt(2 * self.config.n_layers)
        for block in cast("Iterable[TransformerBlock]", self.blocks):  # ModuleList iterates as plain Modules
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: int64 ``(B, T)`` with ``T <= context``. Returns ``(logits (B, T, V), loss)``.

        ``loss`` is the mean float32 cross-entropy against ``targets``, or ``None`` without them.
        """
        if idx.dim() != 2:
            raise ValueError(f"ByteLM expects idx of shape (B, T), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.context:
            raise ValueError(
                f"ByteLM: sequence length {t} exceeds context {self.config.context}; "
                "crop the input or build the model with a larger LMConfig.context"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else _cross_entropy(logits, targets)
        return logits, loss


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Upcast: log-softmax over 256 classes in bf16 (8-bit mantissa) quantises the loss visibly,
    # and the loss is the signal precision decisions are judged by.
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _logits(output: Any) -> torch.Tensor:
    # ByteLM returns (logits, loss); accept a bare tensor too so wrapped models still work.
    return output[0] if isinstance(output, (tuple, list)) else output


class BatchSampler:
    """Uniformly random windows from a 1-D token tensor, from a private ``torch.Generator``.

    ``next()`` returns ``(x, y)``, both int64 ``(batch_size, context)``, with
    ``y[:, i] == x[:, i + 1]`` (and ``y[:, -1]`` the byte after the window). Seeding never touches
    the global RNG; :meth:`state_dict` captures the generator so a resumed run draws the same
    batches. Iterable (endlessly), so ``for x, y in sampler`` works.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, context: int, seed: int = 0) -> None:
        if data.dim() != 1:
            raise ValueError(f"BatchSampler expects a 1-D token tensor, got {tuple(data.shape)}")
        if batch_size <= 0 or context <= 0:
            raise ValueError(
                f"BatchSampler(batch_size={batch_size}, context={context}): both must be positive"
            )
        if data.numel() < context + 1:
            raise ValueError(
                f"BatchSampler: {data.numel()} tokens cannot fill one window of context "
                f"{context} plus its next-token target; use a shorter context or more data"
            )
        self.batch_size = batch_size
        self.context = context
        self.seed = seed
        # A strided view, no copy: row i is data[i : i + context + 1].
        self._windows = data.long().unfold(0, context + 1, 1)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def next(self) -> Batch:
        ix = torch.randint(
            self._windows.shape[0], (self.batch_size,), generator=self._generator
        )
        rows = self._windows[ix]  # (B, context + 1), a fresh tensor
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state(), "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "generator" not in state_dict:
            raise KeyError(
                "BatchSampler.load_state_dict: missing 'generator'; pass a dict produced by "
                "BatchSampler.state_dict()"
            )
        self._generator.set_state(state_dict["generator"])


# AdamW settings follow nanoGPT's train.py (betas (0.9, 0.95), grad clip 1.0) except weight decay:
# 0.01 instead of 0.1, since runs of a few hundred steps are far from overfitting and heavier
# decay only slows the early drop. Decay applies to matrices and embeddings (dim >= 2) only, as in
# nanoGPT's configure_optimizers; biases and LayerNorm gains are not decayed.
_WEIGHT_DECAY = 0.01
_BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
# Linear warmup damps the first Adam updates, whose second-moment estimate is still noisy.
# Measured on "small", 300 steps at lr 3e-3: val loss 2.04 with 10 warmup steps, 2.25 without.
# (lr 1e-3 gives 2.05 and 1e-2 gives 2.45, so 3e-3 is the default.)
_WARMUP_STEPS = 10


def adamw_with_warmup(model: nn.Module, lr: float):
    """The built-in workloads' optimizer: AdamW (weight decay on matrices only) and a linear
    warmup over ``_WARMUP_STEPS`` steps, as ``(optimizer, lr_scheduler)``."""
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": _WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / _WARMUP_STEPS))
    return optimizer, warmup


@dataclass(frozen=True, eq=False)
class ByteLMWorkload:
    """A model config, its data splits and batch size: everything needed to train and evaluate.

    ``eq=False``: tensors have no truth value, so field-wise ``==`` would raise; workloads compare
    by identity.
    """

    name: str
    config: LMConfig
    train: torch.Tensor = field(repr=False)
    val: torch.Tensor = field(repr=False)
    batch_size: int
    lr: float = 3e-3  # AdamW's peak learning rate for this workload (see adamw_with_warmup)
    max_grad_norm: float = GRAD_CLIP

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"ByteLMWorkload.batch_size must be positive, got {self.batch_size}")

    def build_model(self, seed: int = 0) -> ByteLM:
        """A freshly initialised :class:`ByteLM`; same seed, same weights. Global RNG untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return ByteLM(self.config)

    def train_batches(self, seed: int = 0) -> BatchSampler:
        return BatchSampler(self.train, self.batch_size, self.config.context, seed=seed)

    def val_batches(self, n: int = 8, seed: int = 1234) -> list[Batch]:
        """``n`` fixed held-out batches (same ``seed``, same batches), for :func:`evaluate`."""
        if n <= 0:
            raise ValueError(f"ByteLMWorkload.val_batches(n={n}): n must be positive")
        sampler = BatchSampler(self.val, self.batch_size, self.config.context, seed=seed)
        return [sampler.next() for _ in range(n)]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``model`` on ``batch``, computed in float32."""
        x, y = batch
        return _cross_entropy(_logits(model(x)), y)

    def make_optimizer(self, model: nn.Module):
        """`adamw_with_warmup` at this workload's ``lr`` (the `autoprec.workload` protocol)."""
        return adamw_with_warmup(model, self.lr)

    @property
    def description(self) -> str:
        c = self.config
        return f"ByteLM {self.name!r} ({c.n_layers} blocks, d_model {c.d_model}), batch {self.batch_size}x{c.context} bytes, cross-entropy"


@dataclass(frozen=True)
class BlockWorkload:
    """One standalone `TransformerBlock` on Gaussian inputs of ``shape`` ``(batch, seq, d_model)``
    with loss ``mean(out²)``: `autoprec bench`'s layer-level target (one block's matmuls without
    the LM's embeddings and head). Trains with the protocol's default AdamW at lr 1e-3."""

    shape: tuple[int, int, int] = (16, 64, 128)
    n_heads: int = LMConfig().n_heads
    name: str = "block"

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if len(shape) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in shape):
            raise ValueError(f"BlockWorkload.shape must be three positive integers (batch, seq, d_model), got {self.shape!r}")
        if shape[2] % self.n_heads:
            raise ValueError(f"BlockWorkload.shape: d_model {shape[2]} must be divisible by the block's {self.n_heads} attention heads")
        object.__setattr__(self, "shape", shape)

    @property
    def description(self) -> str:
        _, _, c = self.shape
        return f"TransformerBlock (d_model {c}, {self.n_heads} heads, d_ff {4 * c}), input randn{self.shape}, loss mean(out^2)"

    def build_model(self, seed: int = 0) -> TransformerBlock:
        _, t, c = self.shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TransformerBlock(LMConfig(context=t, d_model=c, d_ff=4 * c, n_heads=self.n_heads))

    def train_batches(self, seed: int = 0) -> Iterator[tuple[torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield (torch.randn(self.shape, generator=generator),)

    def val_batches(self, n: int = 8, seed: int = 1234) -> list[tuple[torch.Tensor]]:
        batches = self.train_batches(seed)
        return [next(batches) for _ in range(n)]

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return model(batch[0]).float().pow(2).mean()


def batch_inputs(batch: Sequence[torch.Tensor]) -> tuple:
    """The model's positional inputs in a batch: every tensor but the last, the targets.

    The convention every workload's batches keep (``(x, y)`` here; ``(ids, mask, labels)`` for
    the MiniLM fine-tune), so generic code can call ``model(*batch_inputs(batch))``.
    """
    return tuple(batch[:-1])


def default_workload(name: str = "small", batch_size: int = 16, **sizes: int) -> ByteLMWorkload:
    """The built-in workload: preset ``name`` on the pydoc corpus, 90/10 train/val split.

    ``sizes``: `LMConfig` fields that replace the preset's (``n_layers=12, d_model=2048,
    n_heads=16, d_ff=8192, context=1024``: a GPT whose GEMMs fill a GPU, as in
    ``searches/gpt_gpu.toml``); an unknown name raises TypeError, a bad value ValueError."""
    config = dataclasses.replace(LMConfig.from_name(name), **sizes)
    train_split, val_split = split_corpus(load_corpus())
    return ByteLMWorkload(name, config, train_split, val_split, batch_size)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch]) -> float:
    """Mean float32 cross-entropy over ``batches`` in eval mode; restores the training flag.

    Costs one forward per batch and a host sync per batch (``.item()``).
    """
    was_training = model.training
    model.eval()
    try:
        losses = [_cross_entropy(_logits(model(x)), y).item() for x, y in batches]
    finally:
        model.train(was_training)
    if not losses:
        raise ValueError("evaluate: got no batches; pass e.g. workload.val_batches()")
    return sum(losses) / len(losses)


def train(
    model: nn.Module,
    workload: ByteLMWorkload,
    steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
    context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``steps`` of the workload's steps (`TrainStep.for_workload` at
    learning rate ``lr``, batches from ``workload.train_batches(seed)``); return the per-step
    training losses. ``context`` wraps forward + loss (see `TrainStep`).

    ``log_every > 0`` logs the loss at INFO every that many steps. Each step costs one host sync
    (``loss.item()``).
    """
    if steps < 0:
        raise ValueError(f"train(steps={steps}): steps must be >= 0")
    if lr <= 0:
        raise ValueError(f"train(lr={lr}): lr must be positive")
    step = TrainStep.for_workload(dataclasses.replace(workload, lr=lr), model, context)
    device = next(model.parameters()).device
    batches = workload.train_batches(seed)
    losses: list[float] = []
    start = time.perf_counter()
    for i in range(steps):
        losses.append(step(to_device(next(batches), device)).item())
        if log_every > 0 and ((i + 1) % log_every == 0 or i + 1 == steps):
            logger.info("%s step %d/%d loss %.4f (%.1f s)", workload.name, i + 1, steps, losses[-1], time.perf_counter() - start)
    return losses
