"""The real-model suite's tiny GPT-2, BERT and ViT with their batches (8 rows, no download), and
the modules a user of these models knows run a matrix product with a weight (the seed API's and
the real-model tests; the Lightning test's Hugging Face model)."""

import torch
import torch.nn as nn
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.pytorch_utils import Conv1D

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids


# The modules a user of these models knows run a matrix product with a weight; the attention
# modules (matmul / scaled_dot_product_attention without a weight) come on top.
WEIGHT_LAYERS = (nn.Linear, nn.Conv2d, Conv1D, MixtralExperts)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (8, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[::2, 8:] = 0  # every other sequence is padded: the mask matters
    ids[mask == 0] = 0
    labels = torch.randint(0, 3, (8,), generator=gen)
    return transformers.BertForSequenceClassification(cfg), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(8, 3, 16, 16, generator=gen)
    return transformers.ViTForImageClassification(cfg), {"pixel_values": pixels, "labels": torch.randint(0, 3, (8,), generator=gen)}
