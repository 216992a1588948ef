"""Tiny Hugging Face models, built from their configs (nothing downloaded), with their defaults
(the KV cache on), and their batches as their users feed them: the decoders GPT-2 (``Conv1D``
projections, ``torch.addmm`` on an (in, out) weight), Llama (grouped-query attention, rotary
positions) and Mixtral (a mixture of experts: its experts' 3-D weights run by transformers'
default grouped GEMM), the encoder BERT (a padding mask that matters), the vision transformer ViT (a
convolutional patch embedding), the encoder-decoder T5 (relative position bias, a cross-attention
cache) and the convolutional network ResNet (convolutions and batch norm only).

Each factory returns ``(model, batch)``; ``model(**batch)`` returns an output with its ``loss``.
`data` gives more rows of the same task (``rows`` examples, one dict per row, as a
``Dataset`` holds them; `stack` makes a batch of such rows): labels a model can learn (the next
token, or a class read off the input), so that training lowers the loss.
"""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids

__all__ = ["MODELS", "data", "stack", "gpt2", "llama", "mixtral", "bert", "vit", "t5", "resnet"]

VOCAB = 64


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    """Token rows of a learnable pattern: each row counts up from a random start (mod the vocabulary)."""
    start = torch.randint(1, VOCAB, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return 1 + (start + torch.arange(length)) % (VOCAB - 1)


def _images(batch: int, seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` x ``size`` images whose class is the brightest of three colour channels."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (batch,), generator=gen)
    pixels = torch.randn(batch, 3, size, size, generator=gen)
    pixels[torch.arange(batch), labels] += 1.0
    return pixels, labels


def _decoder_batch(batch: int, seed: int) -> dict:
    ids = _tokens(batch, 16, seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _classifier_batch(batch: int, seed: int) -> dict:
    ids = _tokens(batch, 12, seed)
    mask = torch.ones_like(ids)
    mask[::2, 8:] = 0  # every other sequence is padded: the mask matters
    labels = ids[:, 0] % 3
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _image_batch(batch: int, seed: int, size: int = 16) -> dict:
    pixels, labels = _images(batch, seed, size)
    return {"pixel_values": pixels, "labels": labels}


def _large_image_batch(batch: int, seed: int) -> dict:
    return _image_batch(batch, seed, 32)


def _seq2seq_batch(batch: int, seed: int) -> dict:
    ids = _tokens(batch, 20, seed)
    return {"input_ids": ids[:, :12].contiguous(), "attention_mask": torch.ones(batch, 12, dtype=torch.long), "labels": ids[:, 12:].contiguous()}


def gpt2(seed: int = 1, batch: int = 4):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg), _decoder_batch(batch, seed)


def llama(seed: int = 1, batch: int = 4):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg), _decoder_batch(batch, seed)


def mixtral(seed: int = 1, batch: int = 4):
    # Experts as wide as the model: wider, at this toy size their FP32 gradient buffers (which no
    # plan lowers) would take more than the 0.5 budget leaves (0.531 of the FP32 bytes at best).
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.MixtralForCausalLM(cfg), _decoder_batch(batch, seed)


def bert(seed: int = 1, batch: int = 4):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg), _classifier_batch(batch, seed)


def vit(seed: int = 1, batch: int = 4):
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg), _image_batch(batch, seed)


def t5(seed: int = 1, batch: int = 4):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg), _seq2seq_batch(batch, seed)


def resnet(seed: int = 1, batch: int = 4):
    # Activations, not gradient buffers, hold most bytes (as at a real resolution): 32x32 images,
    # a narrow stem, two stages of two basic blocks.
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=4, hidden_sizes=[16, 16], depths=[2, 2], layer_type="basic", num_labels=3)
    return transformers.ResNetForImageClassification(cfg), _large_image_batch(batch, seed)


MODELS = {f.__name__: f for f in (gpt2, llama, mixtral, bert, vit, t5, resnet)}
_BATCHES = {"gpt2": _decoder_batch, "llama": _decoder_batch, "mixtral": _decoder_batch, "bert": _classifier_batch, "vit": _image_batch, "t5": _seq2seq_batch,
            "resnet": _large_image_batch}


def data(name: str, rows: int, seed: int = 0) -> list[dict]:
    """``rows`` examples of model ``name``'s task, one dict of tensors per row."""
    batch = _BATCHES[name](rows, seed)
    return [{k: v[i] for k, v in batch.items()} for i in range(rows)]


def stack(rows: list[dict], device: "torch.device | str | None" = None) -> dict:
    """A batch of `data`'s rows (on ``device``, default where they are)."""
    return {k: torch.stack([row[k] for row in rows]).to(device) for k in rows[0]}
