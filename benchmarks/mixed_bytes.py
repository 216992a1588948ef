"""How close the search's bytes are to what a mixed plan's step holds.

For each model, the cost model the search builds (`search.pipeline.measure_space`, FP32 and BF16)
predicts uniform BF16 and random mixes of FP32 and BF16 layers; each is measured as one training
step's saved tensors and gradient buffers (`MeasuredStage.memory`). Prints predicted / measured
per plan and writes ``benchmarks/results/mixed_bytes_cpu_torch<version>.json``.

    PYTHONPATH=. python benchmarks/mixed_bytes.py                 # byte LM, GPT-2, Llama; 12 mixes each
    PYTHONPATH=. python benchmarks/mixed_bytes.py --mixes 4 --models gpt2
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


MODELS = {"byte_lm": byte_lm, "gpt2": lambda: hugging_face("gpt2"), "llama": lambda: hugging_face("llama")}


def ratios(name: str, mixes: int) -> list[dict]:
    model, batch, loss = MODELS[name]()
    example = ModelCall.first(model, lambda: loss(model, batch))
    found = measure_space(model, example, [batch], loss, None, Planning(formats=(Format.FP32, Format.BF16), budgets=Budgets(memory=0.5, accuracy=0.05)),
                          cost_inputs=batch, cost_loss_fn=loss, blocks=())
    stage = MeasuredStage(model, loss, [batch], [batch], steps=1, warmup=0)
    layers = list(found.costs.trace.layers)
    rng = random.Random(0)
    plans = [{fqn: Format.BF16 for fqn in layers}]
    for _ in range(mixes):
        share = rng.uniform(0.2, 0.9)
        plans.append({fqn: Format.BF16 if rng.random() < share else Format.FP32 for fqn in layers})
    rows = []
    for formats in plans:
        plan = Plan({fqn: LayerPrecision(fmt) for fqn, fmt in formats.items()})
        predicted, measured = found.costs.plan_cost(plan).bytes, stage.memory(plan)
        rows.append({"lowered": sum(f is Format.BF16 for f in formats.values()), "layers": len(layers), "predicted": predicted, "measured": measured,
                     "ratio": predicted / measured})
        print(f"{name:8s} {rows[-1]['lowered']:3d}/{len(layers)} lowered: predicted / measured {rows[-1]['ratio']:.4f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--mixes", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results = {name: ratios(name, args.mixes) for name in args.models.split(",")}
    for name, rows in results.items():
        print(f"{name}: predicted / measured {min(r['ratio'] for r in rows):.3f}-{max(r['ratio'] for r in rows):.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = pathlib.Path(args.out or f"benchmarks/results/mixed_bytes_cpu_torch{torch.__version__.split('+')[0]}.json")
    atomic_write_text(out, json.dumps({"torch": torch.__version__, "commit": commit, "mixes": args.mixes, "models": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
