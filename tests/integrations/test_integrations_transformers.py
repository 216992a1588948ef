"""`AutoprecTrainer` in a real ``transformers.Trainer.train()`` on CPU, on a small BERT classifier
built from a config (nothing downloaded): a plan is reached with gradient accumulation and the
loss falls, logs and TensorBoard carry the scheduler's metrics, every step is logged through the
spread search, the plan and a promotion with an evaluation loop running throughout, checkpoints
resume the scheduler, ``max_grad_norm`` clips unscaled gradients, a non-finite gradient skips the
step (and the learning-rate schedule), and a second precision manager is refused."""

import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments  # noqa: E402

from autoprec.formats import Format  # noqa: E402
from autoprec.integrations import AutoprecTrainer, IntegrationError  # noqa: E402
from autoprec.integrations.transformers import SCHEDULER_NAME  # noqa: E402
from autoprec.plan import Plan  # noqa: E402
from autoprec.scheduler import DynamicPrecisionScheduler, Thresholds  # noqa: E402
from support.phase_logs import assert_logged_through_the_search, phase_of  # noqa: E402
from support.tb_events import accumulator  # noqa: E402

PHASES = DynamicPrecisionScheduler.PHASES  # what the logged autoprec/phase numbers index

WINDOW = 10
STEPS = 40
SETTINGS = dict(monitor_window=WINDOW, monitor_steps=4, memory_budget=0.9, accuracy_budget=0.05, measure_costs=False, search_slice=None, search_timeout_s=10)


def bert(seed=0):
    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                        max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(config)


def dataset(n=256, length=16):
    """Random token rows labelled by their first token (learnable in a few dozen steps)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (n, length), generator=g)
    labels = (ids[:, 0] < 50).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels[i]} for i in range(n)]


def arguments(out, **kwargs):
    settings = dict(output_dir=str(out), max_steps=STEPS, gradient_accumulation_steps=2, per_device_train_batch_size=16, max_grad_norm=1.0,
                    learning_rate=1e-3, save_steps=20, logging_steps=5, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    settings.update(kwargs)
    return TrainingArguments(**settings)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    scheduler = DynamicPrecisionScheduler(**SETTINGS)
    args = arguments(out, report_to=["tensorboard"])
    trainer = AutoprecTrainer(model=bert(), args=args, train_dataset=dataset(), scheduler=scheduler)
    trainer.train()
    return out, trainer, scheduler


def training_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_a_plan_is_reached_with_gradient_accumulation_and_the_loss_falls(run):
    _, trainer, sch = run
    assert sch.phase == "planned" and sch.model is trainer.model
    # The memory budget (the cost model's timings vary run to run; the bytes do not) forces a
    # plan with narrower layers.
    assert sch.plan.predicted["bytes"] <= 0.9 * sch.plan.predicted["fp32_bytes"]
    assert any(lp.format is not Format.FP32 for lp in sch.plan.layers.values())
    # One scheduler step per optimizer step, not per micro-batch (2 per step here).
    assert sch.step_count == trainer.state.global_step == STEPS
    logs = training_logs(trainer)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1


def test_logs_and_tensorboard_carry_the_scheduler_metrics(run):
    out, trainer, sch = run
    logs = training_logs(trainer)
    assert all("autoprec/loss_scale" in entry and "autoprec/skipped_steps" in entry for entry in logs)
    assert logs[0]["step"] == 1 and phase_of(logs[0]) == "profiling"  # the phase change is logged at once
    planned = [entry["step"] for entry in logs if phase_of(entry) == "planned"]
    assert planned[0] == WINDOW and planned[-1] == STEPS
    assert {k[len("autoprec/layers_"):]: v for k, v in logs[-1].items() if k.startswith("autoprec/layers_")} == sch.plan.format_counts()
    (run_dir,) = {os.path.dirname(p) for p in _event_files(out)}
    scalars = accumulator(run_dir).Scalars("train/autoprec/phase")
    assert PHASES[int([e.value for e in scalars][-1])] == "planned" and len(scalars) == len(logs)


def _event_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if "tfevents" in f]


# The default spread search (search_slice=1.0, measured costs): probe and trial steps over tens of
# training steps, logged one by one. A non-finite gradient in one step promotes its layer at once.
# Formats only (recompute=[]): with recomputation a searched plan may meet the memory budget in
# FP32 by recomputing both blocks, the faster choice where the measured BF16 step is slow (seen on
# a loaded CPU), and leave no lowered layer to promote.
SPREAD_WINDOW = 6
SPREAD_STEPS = 120  # the search's trial steps are bounded (54 at most; search.in_run): a plan with steps to spare
SPREAD = dict(monitor_window=SPREAD_WINDOW, monitor_steps=2, memory_budget=0.9, accuracy_budget=0.05, search_timeout_s=10, recompute=[],
              thresholds=Thresholds(nonfinite_steps=1))


class PoisonOnce(TrainerCallback):
    """NaN gradients for one lowered layer with a weight (not an attention product) in one
    optimizer step (each of its micro-batches): the second step the plan is in force. ``step``:
    the scheduler's steps before it."""

    def __init__(self, scheduler):
        self.scheduler, self.layer, self.step, self.hook = scheduler, None, None, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        sch = self.scheduler
        if self.layer is None and sch.phase == "planned" and sch.step_count > sch.window_start:
            lowered = [fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32 and hasattr(model.get_submodule(fqn), "weight")]
            assert lowered, f"the plan lowers no layer with a weight: {sch.plan.format_counts()}"
            self.layer, self.step = lowered[0], sch.step_count
            self.hook = model.get_submodule(self.layer).weight.register_hook(lambda g: torch.full_like(g, float("nan")))

    def on_step_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    """One train() logging every step, 4 micro-batches a step, evaluated after every step (so also
    between the profiling window's metered last step and the one before it)."""
    sch = DynamicPrecisionScheduler(**SPREAD)
    poison = PoisonOnce(sch)
    args = arguments(tmp_path_factory.mktemp("spread"), max_steps=SPREAD_STEPS, gradient_accumulation_steps=4, per_device_train_batch_size=8,
                     logging_steps=1, save_steps=1000, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=32)
    trainer = AutoprecTrainer(model=bert(), args=args, train_dataset=dataset(), eval_dataset=dataset(64), scheduler=sch, callbacks=[poison])
    trainer.train()
    assert poison.layer is not None, f"no plan was in force with a step to spare in {SPREAD_STEPS} steps: {sch!r}, {sch.last_search_error}"
    return trainer, sch, poison


def test_every_step_is_logged_through_profiling_the_spread_search_and_the_plan(spread):
    trainer, sch, _ = spread
    logs = training_logs(trainer)
    assert [entry["step"] for entry in logs] == list(range(1, SPREAD_STEPS + 1))  # logging_steps=1 under accumulation
    phases = [phase_of(entry) for entry in logs]
    assert_logged_through_the_search(phases, sch, SPREAD_STEPS)


def test_a_promotion_shows_in_the_logged_plan_changes(spread):
    trainer, sch, poison = spread
    logs = {entry["step"]: entry for entry in training_logs(trainer)}
    poisoned = poison.step + 1  # the log of the optimizer step the NaN gradients were in
    for name in ("autoprec/plan_changes", "autoprec/skipped_steps"):  # counts since the start
        before, after = (logs[s][name] for s in (poisoned - 1, poisoned))
        assert after > before, name
    (promotion,) = [c for c in sch.changes if (c.step, c.fqn) == (poisoned, poison.layer)]
    assert "non-finite" in promotion.reason
    # To a format with at least the range and the bits (FP16 -> BF16 keeps 16 bits, widens the range).
    assert promotion.new is not promotion.old and promotion.new.max >= promotion.old.max and promotion.new.bits >= promotion.old.bits
    layers = lambda entry: {k: v for k, v in entry.items() if k.startswith("autoprec/layers_")}  # noqa: E731
    assert layers(logs[poisoned]) != layers(logs[poisoned - 1])  # the plan in force changed


def test_evaluation_runs_under_the_plan_and_during_the_search(spread):
    trainer, _, _ = spread
    phase_at = {entry["step"]: phase_of(entry) for entry in training_logs(trainer)}
    evaluations = [(phase_at[entry["step"]], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    assert all(math.isfinite(loss) for _, loss in evaluations)
    # Evaluations during the search did not disturb it (the run reached its plan), and ran under it.
    assert {phase for phase, _ in evaluations} == {"profiling", "searching", "planned"}


def test_a_checkpoint_resumes_the_scheduler(run, tmp_path):
    out, _, _ = run
    checkpoint = out / "checkpoint-20"
    saved = torch.load(checkpoint / SCHEDULER_NAME, weights_only=False)
    seen = {}

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.update(step=sch.step_count, phase=sch.phase, plan=sch.plan.to_dict(), window_start=sch.window_start)

    sch = DynamicPrecisionScheduler(**SETTINGS)
    trainer = AutoprecTrainer(model=bert(seed=1), args=arguments(tmp_path, max_steps=30), train_dataset=dataset(), scheduler=sch, callbacks=[AtStart()])
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert saved["step"] == 20
    assert seen == {"step": 20, "phase": "planned", "plan": saved["plan"], "window_start": saved["window_start"]}
    assert sch.step_count == trainer.state.global_step == 30


def test_a_checkpoint_without_scheduler_state_is_refused(run, tmp_path):
    out, _, _ = run
    trainer = AutoprecTrainer(model=bert(), args=arguments(tmp_path), train_dataset=dataset(), scheduler=DynamicPrecisionScheduler(**SETTINGS))
    with pytest.raises(IntegrationError, match=SCHEDULER_NAME):
        trainer.train(resume_from_checkpoint=str(tmp_path))


class Updates(TrainerCallback):
    """Parameter update norms per optimizer step and the gradient norm the step was given."""

    def __init__(self, model):
        self.model, self.updates, self.grad_norms = model, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.before = [p.detach().clone() for p in self.model.parameters()]
        self.grad_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])))

    def on_optimizer_step(self, args, state, control, **kwargs):
        deltas = [(p.detach() - b).flatten() for p, b in zip(self.model.parameters(), self.before)]
        self.updates.append(float(torch.linalg.vector_norm(torch.cat(deltas))))


def test_max_grad_norm_clips_the_unscaled_gradients(tmp_path):
    # FP16 gradients switch the loss scale on (4096): clipping scaled gradients would leave the
    # update 4096 times smaller than lr x max_grad_norm.
    lr, clip = 1.0, 1e-2
    model = bert()
    sch = DynamicPrecisionScheduler.from_plan(model, Plan.uniform(model, Format.FP16, {k: v[None] for k, v in dataset(1)[0].items() if k != "labels"}), monitor_window=WINDOW, measure_costs=False, search_slice=None)
    record = Updates(model)
    args = arguments(tmp_path, max_steps=4, optim="sgd", learning_rate=lr, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=clip, logging_steps=1)
    trainer = AutoprecTrainer(model=model, args=args, train_dataset=dataset(), scheduler=sch, callbacks=[record])
    trainer.train()
    assert sch.scaler.enabled and sch.scaler.get_scale() >= 4096.0
    logged = [entry["grad_norm"] for entry in training_logs(trainer)]
    assert min(logged) > 10 * clip and max(logged) < 4096 * clip  # the unscaled norm, before clipping
    assert record.grad_norms == pytest.approx([clip] * 4, rel=1e-3)  # what the optimizer was given
    assert record.updates == pytest.approx([lr * clip] * 4, rel=1e-2)


def test_a_nonfinite_gradient_skips_the_step_and_the_lr_schedule(tmp_path):
    model = bert()
    sch = DynamicPrecisionScheduler(**SETTINGS)
    poison_at = 3

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.moved = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, **kwargs):
            self.moved.append(any(not torch.equal(p, b) for p, b in zip(model.parameters(), self.before)))

    snapshots = Snapshots()
    args = arguments(tmp_path, max_steps=6, logging_steps=100, save_steps=100)
    trainer = AutoprecTrainer(model=model, args=args, train_dataset=dataset(), scheduler=sch, callbacks=[snapshots])
    model.classifier.weight.register_hook(lambda g: torch.full_like(g, float("nan")) if trainer.state.global_step == poison_at else g)
    trainer.train()
    assert sch.scaler.skipped_steps == 1 and sch.scaler.nonfinite_counts == {"classifier": 1}
    assert snapshots.moved == [True, True, True, False, True, True]
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - 1  # not advanced on the skipped step
    logged = {entry["step"]: entry["autoprec/skipped_steps"] for entry in training_logs(trainer)}
    assert logged[poison_at + 1] == 1.0  # logged at the skipping step, though logging_steps is 100


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_a_second_precision_manager_is_refused(tmp_path, flag):
    args = arguments(tmp_path, **{flag: True})
    with pytest.raises(IntegrationError, match=f"{flag}=True"):
        AutoprecTrainer(model=bert(), args=args, train_dataset=dataset(), scheduler=DynamicPrecisionScheduler(**SETTINGS))


def test_a_scheduler_bound_to_another_model_is_refused(tmp_path):
    other = DynamicPrecisionScheduler(bert(seed=2), **SETTINGS)
    with pytest.raises(IntegrationError, match="bound to a BertForSequenceClassification, not this Trainer's"):
        AutoprecTrainer(model=bert(), args=arguments(tmp_path), train_dataset=dataset(), scheduler=other)
