"""What recomputation alone costs a training step, beside autoprec's recomputed blocks: issue 57's
narrow Llama (`benchmarks/depth.py`'s model) at ``--blocks``, one thread, these steps interleaved
step by step (median of ``--steps``, the first 3 of each dropped):

- plain: the model as it is, FP32;
- an all-FP32 autoprec plan, no block recomputed, then every block recomputed;
- Hugging Face's own gradient checkpointing (``gradient_checkpointing_enable()``: ``torch.utils.checkpoint``
  per decoder layer), no autoprec.

Every variant without a KV cache (``use_cache=False``, as Hugging Face's checkpointing runs in
training). Ratios to the plain step, in one run. It says how much of a planned or searched step over a plain
one is recomputation itself, whoever runs it (docs/results.md, "The search at depth").

    python benchmarks/recompute_cost.py --blocks 4
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch

from depth import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from autoprec import Plan, apply_plan
    from autoprec.blocks import find_blocks
    from autoprec.formats import Format

    model = llama(args.blocks)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    fp32 = Plan.uniform(model, Format.FP32)
    runtimes = {"fp32 plan": apply_plan(model, fp32), "fp32 plan, every block recomputed": apply_plan(model, fp32.with_recompute(find_blocks(model, fp32.layers)))}
    variants = ["plain", *runtimes, "HF gradient checkpointing"]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(step))
        for variant in variants:
            if variant == "HF gradient checkpointing":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            start = time.perf_counter()
            with runtimes.get(variant, contextlib.nullcontext()):
                # No KV cache in any variant: Hugging Face's checkpointing turns it off in training,
                # and filling it is a third of this model's plain step.
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds[variant].append(time.perf_counter() - start)
            model.gradient_checkpointing_disable()
    plain = statistics.median(seconds["plain"][3:])
    print(f"| step ({args.blocks} blocks, median of {args.steps - 3}) | ms | / plain |")
    print("|---|---|---|")
    for variant in variants:
        median = statistics.median(seconds[variant][3:])
        print(f"| {variant} | {median * 1e3:.1f} | {median / plain:.2f} |")


if __name__ == "__main__":
    main()
