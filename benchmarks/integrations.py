"""The two integrations against their framework's own BF16 mixed precision (and FP32), on CPU.

    python benchmarks/integrations.py [--steps 80] [--window 20] [--threads 1]

Lightning: an MLP classifier (256 -> 1024 -> 1024 -> 16, batch 256) trained by ``lightning.Trainer``
with ``precision="32-true"``, ``"bf16-mixed"`` and ``plugins=[AutoprecPrecision(...)]``.
Hugging Face: a 2-layer BERT classifier built from a config (hidden 128, sequence 64, batch 16,
gradient accumulation 2) trained by ``transformers.Trainer`` (FP32, ``bf16=True``) and by
``AutoprecTrainer``, each under the settings in ``SCHEDULER`` (a memory budget of 0.75) and with
no memory budget (``-open-memory``). Same seed, data, batch order and steps for every variant;
nothing is downloaded.

Per variant: the final loss (mean training loss of the last 10 optimizer steps), the mean
optimizer-step time over the steps after the scheduler's first window (the window's profiling
and the search at its end are a one-off cost, reported apart as ``first window s``), and the
bytes saved for backward by one micro-batch's forward (`autoprec.saved_bytes.SavedTensorMeter`,
``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) on one step of the last window. The
variants run one after the other in one process: read the ratios of one run, on one machine
(a CPU without AVX-512 runs BF16 matmuls slowly; that is what the ``bf16`` rows measure here).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.saved_bytes import SavedTensorMeter

# Roofline time model instead of timing every layer in place (seconds of measurement per search,
# noisy on a shared 2-core machine); on a CPU its peaks are calibrated once per process, and the
# memory budget is what fixes which layers the plan narrows.
# monitor_steps=4: each window profiles its last 4 steps, as 64 of 500 would in a long run.
SCHEDULER = dict(memory_budget=0.75, accuracy_budget=0.05, measure_costs=False, search_timeout_s=30, monitor_steps=4)
# The same with no memory budget: the plan then only minimises the predicted step time.
OPEN_MEMORY = {**SCHEDULER, "memory_budget": None}
LAST = 10  # steps whose mean training loss is the "final loss"


class Clock:
    """Optimizer-step times and one micro-batch's saved bytes, filled by framework callbacks."""

    def __init__(self, model: nn.Module, meter_at: int):
        self.model, self.meter_at = model, meter_at
        self.times: list[float] = []
        self.losses: list[float] = []
        self.saved_bytes = None
        self._meter = None
        self._t0 = 0.0

    def begin(self, step: int) -> None:
        self._t0 = time.perf_counter()
        if step == self.meter_at:
            self._meter = SavedTensorMeter(list(self.model.parameters())).__enter__()

    def after_micro_batch(self) -> None:
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.saved_bytes, self._meter = self._meter.total_bytes, None

    def end(self) -> None:
        self.times.append(time.perf_counter() - self._t0)


def meter_step(steps: int, window: int) -> int:
    """A step in the middle of the last window: neither profiled (the window's last steps) nor the
    step whose saved bytes the scheduler meters itself (its own, inner, saved-tensor hooks would
    hide the tensors from this meter)."""
    return steps - window // 2


def summary(name: str, clock: Clock, window: int, phase: str = "-") -> dict:
    steady = clock.times[window + 1:]  # after the window's last step (which runs the search)
    return {
        "variant": name,
        "final loss": statistics.fmean(clock.losses[-LAST:]),
        "step ms": 1e3 * statistics.fmean(steady),
        "first window s": sum(clock.times[: window + 1]),
        "saved MiB": clock.saved_bytes / 2**20 if clock.saved_bytes is not None else float("nan"),
        "phase": phase,
    }


# -- Lightning ------------------------------------------------------------------------------------


def lightning_runs(steps: int, window: int, out: str) -> list[dict]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from autoprec.integrations import AutoprecPrecision

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 16))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timing(Callback):
        def __init__(self, clock):
            self.clock = clock

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.clock.begin(trainer.global_step)

        def on_before_backward(self, trainer, pl_module, loss):
            self.clock.after_micro_batch()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.clock.end()
            self.clock.losses.append(float(outputs["loss"]))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256 * 16, 256, generator=g)
    y = (x @ torch.randn(256, 16, generator=g)).argmax(-1)

    rows = []
    for name, setting in (("fp32", dict(precision="32-true")), ("bf16-mixed", dict(precision="bf16-mixed")),
                          ("autoprec", dict(plugins=[AutoprecPrecision(monitor_window=window, **SCHEDULER)])),
                          ("autoprec-open-memory", dict(plugins=[AutoprecPrecision(monitor_window=window, **OPEN_MEMORY)]))):
        module = MLP()
        # A loader per variant: one shared loader's shuffle generator would give each variant
        # another batch order.
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(1))
        clock = Clock(module, meter_at=meter_step(steps, window))
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[Timing(clock)], default_root_dir=out, **setting)
        trainer.fit(module, data)
        plugin = setting.get("plugins", [None])[0]
        rows.append(summary(f"lightning {name}", clock, window, plugin.scheduler.phase + " " + str(plugin.scheduler.plan.format_counts() if plugin.scheduler.plan else "") if plugin else "-"))
    return rows


# -- Hugging Face ---------------------------------------------------------------------------------


def transformers_runs(steps: int, window: int, out: str) -> list[dict]:
    from transformers import BertConfig, BertForSequenceClassification, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from autoprec.integrations import AutoprecTrainer
    from autoprec.scheduler import DynamicPrecisionScheduler

    def bert():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                                                        vocab_size=1000, max_position_embeddings=64, num_labels=2))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (2048, 64), generator=g)
    labels = (ids[:, 0] < 500).long()  # a function of the first token: learnable in a few dozen steps
    dataset = [{"input_ids": ids[i], "attention_mask": torch.ones(64, dtype=torch.long), "labels": labels[i]} for i in range(len(ids))]

    class Timing(TrainerCallback):
        def __init__(self, clock):
            self.clock = clock

        def on_step_begin(self, args, state, control, **kwargs):
            self.clock.begin(state.global_step)

        def on_substep_end(self, args, state, control, **kwargs):
            self.clock.after_micro_batch()

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.end()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.clock.losses.append(logs["loss"])

    rows = []
    for name, flags, settings in (("fp32", {}, None), ("bf16=True", {"bf16": True}, None), ("autoprec", None, SCHEDULER), ("autoprec-open-memory", None, OPEN_MEMORY)):
        model = bert()
        clock = Clock(model, meter_at=meter_step(steps, window))
        args = TrainingArguments(output_dir=os.path.join(out, name), max_steps=steps, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                                 learning_rate=5e-4, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, **(flags or {}))
        if flags is None:
            scheduler = DynamicPrecisionScheduler(monitor_window=window, **settings)
            trainer = AutoprecTrainer(model=model, args=args, train_dataset=dataset, scheduler=scheduler, callbacks=[Timing(clock)])
        else:
            scheduler = None
            trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Timing(clock)])
        trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print every log line
        trainer.train()
        rows.append(summary(f"hf {name}", clock, window, scheduler.phase + " " + str(scheduler.plan.format_counts() if scheduler.plan else "") if scheduler else "-"))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | final loss | step ms (after window) | vs framework bf16 | first window s | saved MiB / micro-batch | vs framework bf16 | plan |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        group = row["variant"].split()[0]
        ref = next(r for r in rows if r["variant"].startswith(group) and "bf16" in r["variant"])
        lines.append(f"| {row['variant']} | {row['final loss']:.4f} | {row['step ms']:.1f} | {row['step ms'] / ref['step ms']:.2f}x | "
                     f"{row['first window s']:.1f} | {row['saved MiB']:.2f} | {row['saved MiB'] / ref['saved MiB']:.2f}x | {row['phase']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=20, help="the scheduler's monitor_window (optimizer steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady timings on a shared machine)")
    parser.add_argument("--only", choices=["lightning", "transformers"], default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        if args.only in (None, "lightning"):
            rows += lightning_runs(args.steps, args.window, out)
        if args.only in (None, "transformers"):
            rows += transformers_runs(args.steps, args.window, out)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} optimizer steps, window {args.window}", file=sys.stderr)
    print(table(rows))


if __name__ == "__main__":
    main()
