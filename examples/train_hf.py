"""Train a Hugging Face causal LM under the scheduler, exactly as the README's first example.

The model is called as its users call it, ``model(**batch)`` with ``labels``, and the scheduler is
made without ``model=``: its first context binds to the model it sees called. The model is a small
GPT-2 built from its config and trained on this file's own bytes, so nothing is downloaded; swap in
``AutoModelForCausalLM.from_pretrained(...)`` and your tokenizer's batches for a real run.

    python examples/train_hf.py --steps 300 --window 100
"""

import argparse
import logging

import torch
import transformers

import autoprec as ap


def batches(batch_size: int, length: int, seed: int = 0):
    """Endless ``{"input_ids", "attention_mask", "labels"}`` batches of this file's bytes."""
    data = torch.tensor(list(open(__file__, "rb").read()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - length, (batch_size,), generator=gen)
        ids = torch.stack([data[s : s + length] for s in starts.tolist()])
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main(argv=None) -> ap.DynamicPrecisionScheduler:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=100, help="monitor_window: steps profiled before the first plan")
    parser.add_argument("--memory-budget", type=float, default=0.6, help="fraction of the FP32 bytes")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = batches(batch_size=8, length=64)

    scheduler = ap.DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=args.window,
                                             memory_budget=args.memory_budget, accuracy_budget=0.01)
    for step in range(args.steps):
        batch = next(loader)
        with scheduler.precision_context():
            outputs = model(**batch)
        scheduler.backward(outputs.loss)
        scheduler.step(optimizer)
        optimizer.zero_grad()
        if step % 20 == 0 or step == args.steps - 1:
            logging.info("step %d  loss %.3f  %s", step, outputs.loss.item(), scheduler.plan.format_counts() if scheduler.plan else scheduler.phase)
    scheduler.close()
    return scheduler


if __name__ == "__main__":
    main()
