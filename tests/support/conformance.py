"""The conformance matrix's runs: a tiny Hugging Face model (`hf_models`) trained under a
`DynamicPrecisionScheduler` made as a new user makes it (``min_precision=8, max_precision=32``, a
small window, a memory and an accuracy budget, every other setting its default: the spread search
with measured costs), through each entry point its users train with:

- ``loop``: the README loop (``with scheduler.precision_context(): outputs = model(**batch)``,
  ``scheduler.backward(outputs.loss)``, ``scheduler.step(optimizer)``);
- ``trainer``: `AutoprecTrainer` (``transformers.Trainer``) with 4 micro-batches a step, logging
  every step and an evaluation loop every few steps;
- ``lightning``: `AutoprecPrecision` in a ``lightning.Trainer`` with 4 micro-batches a step,
  logging every step and a validation loop.

`run` returns an `Outcome`: how it ended, the losses, the evaluation losses, the saved bytes of
a planned step against an FP32 step (both metered on the same batch and weights), and the last
planned check's measured loss increase. `tests/models/test_conformance.py` asserts on them;
`benchmarks/conformance.py` tabulates them with the step times against FP32 and BF16 autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Any, Optional

import torch

from support import hf_models
from support.readme_loop import readme_step
from autoprec.saved_bytes import SavedTensorMeter
from autoprec.runtime import EmulationWarning
from autoprec.scheduler import DynamicPrecisionScheduler

__all__ = ["ENTRIES", "Outcome", "run", "run_loop", "saved_bytes"]

ENTRIES = ("loop", "trainer", "lightning")
WINDOW = 6
ACCUMULATE = 4  # micro-batches per optimizer step (trainer, lightning)
MICRO_BATCH = 4
LR = 3e-3


@dataclasses.dataclass
class Outcome:
    model: str
    entry: str
    memory_budget: float
    accuracy_budget: float
    steps: int  # optimizer steps the scheduler took
    phase: str
    error: Optional[str]  # the search's, when it failed
    formats: dict  # the plan in force: format -> layers
    recompute: tuple  # its recomputed blocks
    losses: list  # training loss per optimizer step
    eval_losses: list  # (scheduler phase, loss) per evaluation
    planned_bytes: int  # saved for backward by a planned step, plus the FP32 gradient buffers
    fp32_bytes: int  # the same for an FP32 step on the same batch and weights
    measured_increase: Optional[float]  # the last planned check's (mean since the plan changed)
    allowed_increase: Optional[float]
    seconds: float

    @property
    def memory_ratio(self) -> float:
        return self.planned_bytes / self.fp32_bytes


def settings(memory: float, accuracy: float) -> dict:
    # A check every 2nd planned step, so a short run averages several.
    return dict(min_precision=8, max_precision=32, monitor_window=WINDOW, monitor_steps=2, sample_every=2, memory_budget=memory,
                accuracy_budget=accuracy, search_slice=None)


def saved_bytes(model: torch.nn.Module, batch: Any, scheduler: Optional[DynamicPrecisionScheduler], loss_fn: Any = None) -> int:
    """Bytes one training step of ``batch`` saves for backward (metered over its forward, under
    ``scheduler``'s precision, or plain FP32), plus the FP32 gradient buffers; no weight changes
    (the gradients are dropped, no optimizer step). ``loss_fn(model, batch)``: the step's loss
    (default ``model(**batch).loss``). The forward draws its random numbers from one fixed seed
    (the caller's generator state is restored after): a model that drops whole layers at random
    (HuBERT's LayerDrop) saves a layer's tensors or not by the draw, so two steps compare only
    under the same draws."""
    params = list(model.parameters())
    grads = sum(p.numel() * 4 for p in params if p.requires_grad)
    context = scheduler.precision_context() if scheduler is not None else contextlib.nullcontext()
    # Inside the context: a step the scheduler meters itself (a window's last) enters its own meter
    # there, and saved-tensor hooks do not nest (the innermost sees every tensor).
    with torch.random.fork_rng(), context, SavedTensorMeter(params) as meter:
        torch.manual_seed(0)
        loss = loss_fn(model, batch) if loss_fn is not None else model(**batch).loss
    (scheduler.scale(loss) if scheduler is not None else loss).backward()
    model.zero_grad(set_to_none=True)
    return meter.total_bytes + grads


def run(name: str, entry: str, memory: float, accuracy: float, steps: int, tmp: Any, seed: int = 0) -> Outcome:
    """Train model ``name`` for ``steps`` optimizer steps through ``entry`` (`ENTRIES`), on the CPU."""
    torch.manual_seed(seed)
    model, _ = hf_models.MODELS[name](seed)
    rows = hf_models.data(name, steps * ACCUMULATE * MICRO_BATCH, seed)
    held_out = hf_models.data(name, 2 * MICRO_BATCH, seed + 1)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # no FP8 / INT8 kernel for attention or convolutions on CPU
        sch, losses, evals = _RUNNERS[entry](model, settings(memory, accuracy), rows, held_out, steps, tmp)
        seconds = time.perf_counter() - start
        batch = hf_models.stack(held_out[:MICRO_BATCH])
        planned = saved_bytes(model, batch, sch) if sch.plan is not None else 0
        # The FP32 step on the same weights, the plan off the model (its runtime removed).
        sch.close()
        fp32 = saved_bytes(model, batch, None)
    check = sch.last_check
    plan = sch.plan
    return Outcome(name, entry, memory, accuracy, sch.step_count, sch.phase, sch.last_search_error,
                   plan.format_counts() if plan is not None else {}, plan.recompute if plan is not None else (), losses, evals, planned, fp32,
                   check.increase if check is not None else None, check.allowed if check is not None else None, seconds)


def run_loop(model, config, rows, held_out, steps, tmp=None):
    """The README loop, one micro-batch a step, on the model's device; an evaluation every 4 steps."""
    sch = DynamicPrecisionScheduler(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    device = next(model.parameters()).device
    losses, evals = [], []
    for step in range(steps):
        losses.append(readme_step(model, hf_models.stack(rows[step * MICRO_BATCH:(step + 1) * MICRO_BATCH], device), sch, optimizer))
        if step % 4 == 3:
            model.eval()
            with torch.no_grad(), sch.precision_context():
                evals.append((sch.phase, model(**hf_models.stack(held_out, device)).loss.item()))
            model.train()
    return sch, losses, evals


def _trainer(model, config, rows, held_out, steps, tmp):
    from transformers import TrainingArguments

    from autoprec.integrations import AutoprecTrainer

    sch = DynamicPrecisionScheduler(**config)
    args = TrainingArguments(output_dir=str(tmp), max_steps=steps, gradient_accumulation_steps=ACCUMULATE, per_device_train_batch_size=MICRO_BATCH,
                             per_device_eval_batch_size=len(held_out), learning_rate=LR, logging_steps=1, eval_strategy="steps", eval_steps=4,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, lr_scheduler_type="constant")
    trainer = AutoprecTrainer(model=model, args=args, train_dataset=rows, eval_dataset=held_out, scheduler=sch)
    phases: dict[int, str] = {}

    from transformers import TrainerCallback

    class Phases(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            phases[state.global_step] = sch.phase

    trainer.add_callback(Phases())
    trainer.train()
    history = trainer.state.log_history
    losses = [e["loss"] for e in history if "loss" in e]
    evals = [(phases.get(e["step"], "?"), e["eval_loss"]) for e in history if "eval_loss" in e]
    return sch, losses, evals


def _lightning(model, config, rows, held_out, steps, tmp):
    import lightning

    from autoprec.integrations import AutoprecPrecision

    plugin = AutoprecPrecision(**config)
    losses, evals = [], []

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            loss = self.model(**batch).loss
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def on_train_batch_end(self, outputs, batch, index):
            if (index + 1) % ACCUMULATE == 0:
                losses.append(outputs["loss"].item())

        def validation_step(self, batch, index):
            evals.append((plugin.scheduler.phase, self.model(**batch).loss.item()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    loader = torch.utils.data.DataLoader(rows, batch_size=MICRO_BATCH, collate_fn=hf_models.stack)
    val = torch.utils.data.DataLoader(held_out, batch_size=len(held_out), collate_fn=hf_models.stack)
    trainer = lightning.Trainer(plugins=[plugin], max_steps=steps, accumulate_grad_batches=ACCUMULATE, log_every_n_steps=1,
                                val_check_interval=4 * ACCUMULATE, check_val_every_n_epoch=None, num_sanity_val_steps=0, accelerator="cpu",
                                devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp))
    trainer.fit(Module(), loader, val)
    return plugin.scheduler, losses, evals


_RUNNERS = {"loop": run_loop, "trainer": _trainer, "lightning": _lightning}
