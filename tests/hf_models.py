"""Tiny Hugging Face models, built from their configs (nothing downloaded), with their defaults
(the KV cache on), and a batch each as their users feed it: the decoders GPT-2 (``Conv1D``
projections, ``torch.addmm`` on an (in, out) weight) and Llama (grouped-query attention, rotary
positions), the encoder BERT (a padding mask that matters), the vision transformer ViT (a
convolutional patch embedding), the encoder-decoder T5 (relative position bias, a cross-attention
cache) and the convolutional network ResNet (convolutions and batch norm only).

Each factory returns ``(model, batch)``; ``model(**batch)`` returns an output with its ``loss``.
"""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids

__all__ = ["MODELS", "gpt2", "llama", "bert", "vit", "t5", "resnet"]


def _tokens(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def gpt2(seed: int = 1):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _tokens(4, 16, 64, seed)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def llama(seed: int = 1):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = _tokens(4, 16, 64, seed)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def bert(seed: int = 1):
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = _tokens(4, 12, 64, seed)
    mask = torch.ones_like(ids)
    mask[::2, 8:] = 0  # every other sequence is padded: the mask matters
    ids[mask == 0] = 0
    labels = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(seed + 1))
    return transformers.BertForSequenceClassification(cfg), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def vit(seed: int = 1):
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(seed)
    return transformers.ViTForImageClassification(cfg), {"pixel_values": torch.randn(4, 3, 16, 16, generator=gen),
                                                          "labels": torch.randint(0, 3, (4,), generator=gen)}


def t5(seed: int = 1):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    ids = _tokens(4, 12, 64, seed)
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                           "labels": _tokens(4, 8, 64, seed + 1)}


def resnet(seed: int = 1):
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    gen = torch.Generator().manual_seed(seed)
    return transformers.ResNetForImageClassification(cfg), {"pixel_values": torch.randn(4, 3, 16, 16, generator=gen),
                                                             "labels": torch.randint(0, 3, (4,), generator=gen)}


MODELS = {f.__name__: f for f in (gpt2, llama, bert, vit, t5, resnet)}
