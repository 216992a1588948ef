"""How close the search's bytes are to what a mixed plan's step holds.

For each model, the cost model the search builds (`search.pipeline.measure_space`, in the
formats given: FP32 and BF16 by default) predicts each format's uniform plan and random mixes of
the formats; each is measured as one training step's saved tensors and gradient buffers
(`MeasuredStage.memory`, with no layer skipped: `every_layer_runs`, as the search's looks).
Prints predicted / measured per plan and writes ``benchmarks/results/mixed_bytes_cpu_torch<version>.json``
(``mixed_bytes_<n>formats_...`` for other formats).

    PYTHONPATH=. python benchmarks/mixed_bytes.py                 # byte LM, GPT-2, Llama; 12 mixes each
    PYTHONPATH=. python benchmarks/mixed_bytes.py --mixes 4 --models gpt2
    PYTHONPATH=. python benchmarks/mixed_bytes.py --models wavlm,unispeech_sat --formats fp32,bf16,fp16,fp8_e4m3,int8 --mixes 16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import warnings

import torch

from autoprec._io import atomic_write_text
from autoprec.calls import ModelCall
from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Plan
from autoprec.search.candidate_runs import MeasuredStage
from autoprec.search.pipeline import measure_space
from autoprec.search.planning import Planning
from autoprec.search.budgets import Budgets


def byte_lm():
    from autoprec.workloads import default_workload

    wl = default_workload("small", batch_size=16)
    return wl.build_model(0), wl.train_batches(0).next(), wl.loss


def hugging_face(name: str):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, attn_implementation="sdpa"))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                                       num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 256, (8, 64))
    return model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss


def speech(name: str):
    """A CTC speech model (LayerDrop at its default 0.1; WavLM's attention is torch's multi-head
    attention with separate projections), on 4 clips of 1,600 samples."""
    import transformers

    torch.manual_seed(0)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(32, 32), conv_stride=(5, 2),
                 conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32)
    if name == "wavlm":
        model = transformers.WavLMForCTC(transformers.WavLMConfig(**shape, num_buckets=16, max_bucket_distance=32))
    else:
        model = transformers.UniSpeechSatForCTC(transformers.UniSpeechSatConfig(**shape))
    model.train()
    batch = {"input_values": torch.randn(4, 1600), "labels": torch.randint(1, 32, (4, 12))}
    return model, batch, lambda m, b: m(**b).loss


MODELS = {"byte_lm": byte_lm, "gpt2": lambda: hugging_face("gpt2"), "llama": lambda: hugging_face("llama"),
          "wavlm": lambda: speech("wavlm"), "unispeech_sat": lambda: speech("unispeech_sat")}
DEFAULT_MODELS = "byte_lm,gpt2,llama"


def ratios(name: str, mixes: int, formats: tuple[Format, ...]) -> list[dict]:
    from autoprec._tracing import every_layer_runs

    model, batch, loss = MODELS[name]()
    example = ModelCall.first(model, lambda: loss(model, batch))
    found = measure_space(model, example, [batch], loss, None, Planning(formats=formats, budgets=Budgets(memory=0.5, accuracy=0.05)),
                          cost_inputs=batch, cost_loss_fn=loss, blocks=())
    stage = MeasuredStage(model, loss, [batch], [batch], steps=1, warmup=0)
    layers = list(found.costs.trace.layers)
    rng = random.Random(0)
    lowered = [f for f in formats if f is not Format.FP32]
    plans = [{fqn: fmt for fqn in layers} for fmt in lowered]
    for _ in range(mixes):
        share = rng.uniform(0.2, 0.9)
        plans.append({fqn: rng.choice(lowered) if rng.random() < share else Format.FP32 for fqn in layers})
    rows = []
    for chosen in plans:
        plan = Plan({fqn: LayerPrecision(fmt) for fqn, fmt in chosen.items()})
        with every_layer_runs(model):
            measured = stage.memory(plan)
        predicted = found.costs.plan_cost(plan).bytes
        rows.append({"lowered": sum(f is not Format.FP32 for f in chosen.values()), "layers": len(layers), "predicted": predicted,
                     "measured": measured, "ratio": predicted / measured, "formats": sorted({f.value for f in chosen.values()})})
        print(f"{name:8s} {rows[-1]['lowered']:3d}/{len(layers)} lowered ({','.join(rows[-1]['formats'])}): predicted / measured {rows[-1]['ratio']:.4f}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(MODELS)}")
    parser.add_argument("--formats", default="fp32,bf16")
    parser.add_argument("--mixes", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    formats = tuple(Format.parse(f) for f in args.formats.split(","))
    results = {name: ratios(name, args.mixes, formats) for name in args.models.split(",")}
    for name, rows in results.items():
        print(f"{name}: predicted / measured {min(r['ratio'] for r in rows):.3f}-{max(r['ratio'] for r in rows):.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tag = "" if args.formats == "fp32,bf16" else f"{len(formats)}formats_"
    out = pathlib.Path(args.out or f"benchmarks/results/mixed_bytes_{tag}cpu_torch{torch.__version__.split('+')[0]}.json")
    atomic_write_text(out, json.dumps({"torch": torch.__version__, "commit": commit, "mixes": args.mixes, "formats": args.formats, "models": results},
                                      indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
