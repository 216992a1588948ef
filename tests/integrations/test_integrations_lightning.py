"""`AutoprecPrecision` in a real `lightning.Trainer` on CPU: a plan is reached and training
converges, metrics reach the logger, every step is logged through the spread search, the plan and
a promotion with a validation loop running throughout, checkpoints resume the scheduler, gradient
clipping sees unscaled gradients, a non-finite gradient skips the step, unsupported settings are
refused."""

import csv
import glob
import math
import os
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from autoprec.errors import RuntimeStateError  # noqa: E402
from autoprec.formats import Format  # noqa: E402
from autoprec.integrations import AutoprecPrecision, IntegrationError  # noqa: E402
from autoprec.plan import Plan  # noqa: E402
from autoprec.scheduler import Thresholds  # noqa: E402

from support.phase_logs import assert_logged_through_the_search, phase_of  # noqa: E402


WINDOW = 10
STEPS = 40
SETTINGS = dict(monitor_window=WINDOW, monitor_steps=4, memory_budget=0.9, accuracy_budget=0.05, measure_costs=False, search_slice=None, search_timeout_s=10)


class Classifier(L.LightningModule):
    """A three-layer MLP on 16 features, 4 classes; ``training_step`` calls ``self(x)``."""

    def __init__(self, lr=3e-3, optimizer="adamw", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
        self.lr, self.optimizer = lr, optimizer
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def loader(shuffle=True, n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(-1)  # a learnable labelling
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=shuffle, generator=torch.Generator().manual_seed(1))


def trainer(tmp_path, plugin, max_steps, **kwargs):
    settings = dict(max_steps=max_steps, plugins=[plugin], accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path), name="logs"),
                    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, enable_checkpointing=False,
                    num_sanity_val_steps=0, limit_val_batches=0)
    settings.update(kwargs)
    return L.Trainer(default_root_dir=str(tmp_path), **settings)


def logged_rows(tmp_path):
    (path,) = glob.glob(os.path.join(str(tmp_path), "logs", "version_*", "metrics.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fit of STEPS steps with validation, CSV logs and a checkpoint every 20 steps."""
    tmp = tmp_path_factory.mktemp("fit")
    plugin = AutoprecPrecision(**SETTINGS)
    module = Classifier()
    checkpoints = ModelCheckpoint(dirpath=str(tmp / "ckpt"), every_n_train_steps=20, save_top_k=-1, filename="{step}")
    t = trainer(tmp, plugin, STEPS, enable_checkpointing=True, callbacks=[checkpoints], limit_val_batches=2, num_sanity_val_steps=2,
                val_check_interval=WINDOW + 5, check_val_every_n_epoch=None)
    t.fit(module, loader(), loader(shuffle=False, n=128))
    return tmp, plugin, module, t


def test_a_plan_is_reached_and_the_loss_falls(run):
    _, plugin, module, t = run
    sch = plugin.scheduler
    assert sch.phase == "planned" and sch.model is module
    assert sch.step_count == t.global_step == STEPS
    # The memory budget (the cost model's timings vary run to run; the bytes do not) forces a
    # plan with narrower layers.
    assert sch.plan.predicted["bytes"] <= 0.9 * sch.plan.predicted["fp32_bytes"]
    assert any(lp.format is not Format.FP32 for lp in sch.plan.layers.values())
    assert sum(module.losses[-5:]) / 5 < sum(module.losses[:5]) / 5 - 0.3


def test_metrics_reach_the_trainers_logger(run):
    tmp, plugin, _, _ = run
    rows = logged_rows(tmp)
    steps = [row for row in rows if row.get("autoprec/step")]
    assert len(steps) == STEPS  # log_every_n_steps=1: one row per optimizer step
    phases = [phase_of(row) for row in steps]
    assert phases[0] == "profiling" and phases[-1] == "planned"
    assert phases.index("planned") == WINDOW - 1  # the plan is in force from the window's last step on
    assert float(steps[-1]["autoprec/loss_scale"]) == plugin.scheduler.scaler.get_scale()
    counts = {key[len("autoprec/layers_"):]: float(value) for key, value in steps[-1].items() if key.startswith("autoprec/layers_") and value}
    assert counts == {fmt: float(n) for fmt, n in plugin.scheduler.plan.format_counts().items()}
    assert any(row.get("val_loss") for row in rows)  # validation ran under the plan


def test_metrics_are_logged_only_on_the_steps_the_trainer_writes(tmp_path):
    plugin = AutoprecPrecision(**SETTINGS)
    module = Classifier()
    calls = []
    log_dict = module.log_dict
    module.log_dict = lambda metrics, **kwargs: (calls.append(metrics["autoprec/step"]) if "autoprec/step" in metrics else None, log_dict(metrics, **kwargs))
    trainer(tmp_path, plugin, 12, log_every_n_steps=5).fit(module, loader())
    assert calls == [5.0, 10.0]  # not every step: each `log` is host work Lightning would discard
    logged = [float(row["autoprec/step"]) for row in logged_rows(tmp_path) if row.get("autoprec/step")]
    assert logged == [5.0, 10.0]  # and what the logger writes is the same


# The default spread search (search_slice=1.0, measured costs): probe and trial steps over tens of
# training steps, logged one by one. A non-finite gradient in one step promotes its layer at once.
SPREAD_WINDOW = 6
SPREAD_STEPS = 96  # the search's trial steps are bounded (54 at most; search.in_run): a plan with steps to spare
SPREAD = dict(monitor_window=SPREAD_WINDOW, monitor_steps=2, memory_budget=0.9, accuracy_budget=0.05, search_timeout_s=10,
              thresholds=Thresholds(nonfinite_steps=1))


class PoisonOnce(Callback):
    """NaN in one lowered layer's gradient in one optimizer step (each of its micro-batches): the
    second step the plan is in force. ``step``: the scheduler's steps before it."""

    def __init__(self):
        self.layer, self.step = None, None

    def on_after_backward(self, trainer, pl_module):
        sch = trainer.precision_plugin.scheduler
        if self.layer is None and sch.phase == "planned" and sch.step_count > sch.window_start:
            lowered = [fqn for fqn, lp in sch.plan.layers.items() if lp.format is not Format.FP32]
            assert lowered, f"the plan lowers no layer: {sch.plan.format_counts()}"
            self.layer, self.step = lowered[0], sch.step_count
        if sch.step_count == self.step:
            pl_module.get_submodule(self.layer).weight.grad[0, 0] = float("nan")


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    """One fit logging every step, 4 batches a step, validated after every step (so also between
    the profiling window's metered last step and the one before it)."""
    tmp = tmp_path_factory.mktemp("spread")
    plugin, poison = AutoprecPrecision(**SPREAD), PoisonOnce()
    t = trainer(tmp, plugin, SPREAD_STEPS, callbacks=[poison], accumulate_grad_batches=4, limit_val_batches=2, num_sanity_val_steps=2,
                val_check_interval=4, check_val_every_n_epoch=None)
    t.fit(Classifier(), loader(), loader(shuffle=False))  # validation labelled as training is
    sch = plugin.scheduler
    assert poison.layer is not None, f"no plan was in force with a step to spare in {SPREAD_STEPS} steps: {sch!r}, {sch.last_search_error}"
    return logged_rows(tmp), sch, poison


def test_every_step_is_logged_through_profiling_the_spread_search_and_the_plan(spread):
    rows, sch, _ = spread
    steps = [row for row in rows if row.get("autoprec/step")]
    assert [float(row["autoprec/step"]) for row in steps] == list(range(1, SPREAD_STEPS + 1))  # log_every_n_steps=1 under accumulation
    phases = [phase_of(row) for row in steps]
    assert_logged_through_the_search(phases, sch, SPREAD_STEPS)


def test_a_promotion_shows_in_the_logged_plan_changes(spread):
    rows, sch, poison = spread
    logs = {int(float(row["autoprec/step"])): row for row in rows if row.get("autoprec/step")}
    poisoned = poison.step + 1  # the row of the optimizer step the NaN was in
    for name in ("autoprec/plan_changes", "autoprec/skipped_steps"):  # counts since the start
        before, after = (float(logs[s][name]) for s in (poisoned - 1, poisoned))
        assert after > before, name
    (promotion,) = [c for c in sch.changes if (c.step, c.fqn) == (poisoned, poison.layer)]
    assert "non-finite" in promotion.reason
    # To a format with at least the range and the bits (FP16 -> BF16 keeps 16 bits, widens the range).
    assert promotion.new is not promotion.old and promotion.new.max >= promotion.old.max and promotion.new.bits >= promotion.old.bits
    layers = lambda row: {k: v for k, v in row.items() if k.startswith("autoprec/layers_") and v}  # noqa: E731
    assert layers(logs[poisoned]) != layers(logs[poisoned - 1])  # the plan in force changed


def test_validation_runs_under_the_plan_and_during_the_search(spread):
    rows, _, _ = spread
    # Lightning's step column: a validation row's is that of the optimizer step it followed.
    phase_at = {row["step"]: phase_of(row) for row in rows if row.get("autoprec/step")}
    validations = [(phase_at[row["step"]], float(row["val_loss"])) for row in rows if row.get("val_loss")]
    assert all(math.isfinite(loss) for _, loss in validations)
    # Validations during the search did not disturb it (the run reached its plan), and ran under it.
    assert {phase for phase, _ in validations} == {"profiling", "searching", "planned"}


def test_checkpoint_resumes_the_scheduler(run, tmp_path):
    tmp, _, _, _ = run
    path = str(tmp / "ckpt" / "step=20.ckpt")
    saved = torch.load(path, weights_only=False)["AutoprecPrecision"]["scheduler"]
    seen = {}

    class AtStart(Callback):
        # The state is applied when the first training forward binds the scheduler.
        def on_before_backward(self, trainer, pl_module, loss):
            sch = trainer.precision_plugin.scheduler
            if not seen:
                seen.update(step=sch.step_count, plan=sch.plan.to_dict(), phase=sch.phase, window_start=sch.window_start)

    plugin = AutoprecPrecision(**SETTINGS)
    module = Classifier(seed=1)  # other weights: the checkpoint restores them
    trainer(tmp_path, plugin, 25, callbacks=[AtStart()]).fit(module, loader(), ckpt_path=path)
    assert saved["step"] == 20
    assert seen == {"step": 20, "plan": saved["plan"], "phase": "planned", "window_start": saved["window_start"]}
    assert plugin.scheduler.step_count == 25 and plugin.scheduler.plan.to_dict() == saved["plan"]


class Record(Callback):
    """Parameters before and after each optimizer step, and the gradients the hooks see."""

    def __init__(self, poison_step=None):
        self.poison_step = poison_step
        self.updates, self.largest, self.grad_norms = [], [], []

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.poison_step:
            pl_module.net[2].weight.grad[0, 0] = float("nan")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = [p.detach().clone() for p in pl_module.parameters()]
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        deltas = [(a.detach() - b).flatten() for a, b in zip(pl_module.parameters(), self.before)]
        self.updates.append(float(torch.linalg.vector_norm(torch.cat(deltas))))
        self.largest.append(float(torch.cat(deltas).abs().max()))


def fp16_plan():
    # FP16 gradients switch the loss scale on (4096 at the start): clipping sees scaled gradients
    # unless the plugin unscales them first.
    return Plan.uniform(Classifier(), Format.FP16, torch.randn(64, 16))


def fp32_gradient_norm(batch):
    """The first batch's gradient norm in plain FP32, the reference for what hooks should see."""
    module = Classifier()
    x, y = batch
    F.cross_entropy(module(x), y).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()]))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_runs_on_unscaled_gradients(tmp_path, algorithm):
    lr, clip = 1.0, 1e-2
    plugin = AutoprecPrecision(plan=fp16_plan(), dynamic=False, monitor_window=WINDOW, measure_costs=False, search_slice=None)
    record = Record()
    data = loader(shuffle=False)
    t = trainer(tmp_path, plugin, 5, callbacks=[record], gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    t.fit(Classifier(lr=lr, optimizer="sgd"), data)
    assert plugin.scheduler.scaler.enabled and plugin.scheduler.scaler.get_scale() >= 4096.0
    # on_before_optimizer_step saw the true gradient (FP16 rounding apart), not 4096 times it.
    assert record.grad_norms[0] == pytest.approx(fp32_gradient_norm(next(iter(data))), rel=0.05)
    assert min(record.grad_norms) > 10 * clip
    # Plain SGD moves the parameters by lr x the clipped gradient: by lr x clip (in norm, or in
    # the largest element) when clipping saw unscaled gradients; 4096 times less had it clipped
    # the scaled ones.
    moved = record.updates if algorithm == "norm" else record.largest
    assert moved == pytest.approx([lr * clip] * 5, rel=1e-3)


def test_a_nonfinite_gradient_skips_the_step_and_leaves_the_weights(tmp_path):
    record = Record(poison_step=3)
    plugin = AutoprecPrecision(**SETTINGS)
    module = Classifier()
    trainer(tmp_path, plugin, 6, callbacks=[record]).fit(module, loader())
    assert plugin.scheduler.scaler.skipped_steps == 1
    assert plugin.scheduler.scaler.last_nonfinite_layers == () and "net.2" in plugin.scheduler.scaler.nonfinite_counts
    assert [u == 0.0 for u in record.updates] == [False, False, False, True, False, False]
    assert [float(r["autoprec/skipped_steps"]) for r in logged_rows(tmp_path) if r.get("autoprec/skipped_steps")] == [0, 0, 0, 1, 1, 1]


class Manual(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class CallsItsNet(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)  # the module's own forward never runs


class CallsNoModule(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(F.linear(x, self.net[0].weight, self.net[0].bias))  # the weights, not the modules
        return F.cross_entropy(F.linear(F.linear(h, self.net[2].weight).relu(), self.net[4].weight), y)


def test_manual_optimization_is_refused(tmp_path):
    t = trainer(tmp_path, AutoprecPrecision(**SETTINGS), 2)
    with pytest.raises(IntegrationError, match="manual optimization"):
        t.fit(Manual(), loader())


def test_a_training_step_that_calls_a_model_inside_the_module_trains_it(tmp_path):
    plugin = AutoprecPrecision(**SETTINGS)
    module = CallsItsNet()
    trainer(tmp_path, plugin, WINDOW + 2).fit(module, loader())
    assert plugin.scheduler.model is module.net and plugin.scheduler.phase == "planned"
    assert set(plugin.scheduler.plan.layers) == {"0", "2", "4"}


class HuggingFaceLM(L.LightningModule):
    """A Hugging Face GPT-2 inside a LightningModule, called as its users call it: ``self.model(**batch)``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_hugging_face_model_called_with_a_batch_dict_is_planned(tmp_path):
    gpt2 = pytest.importorskip("support.real_models").gpt2  # skipped without transformers
    torch.manual_seed(0)
    model, batch = gpt2()
    module = HuggingFaceLM(model)
    data = torch.utils.data.DataLoader([{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))], batch_size=4)
    plugin = AutoprecPrecision(**{**SETTINGS, "monitor_window": 3})
    trainer(tmp_path, plugin, 5).fit(module, data)
    assert plugin.scheduler.model is module.model and plugin.scheduler.phase == "planned"
    assert plugin.scheduler.last_search_error is None and any(lp.format is not Format.FP32 for lp in plugin.scheduler.plan.layers.values())


def test_a_training_step_that_calls_no_module_is_refused(tmp_path):
    t = trainer(tmp_path, AutoprecPrecision(**SETTINGS), 2)
    with pytest.raises(RuntimeStateError, match="no model was called inside it"):
        t.fit(CallsNoModule(), loader())


def test_clipping_in_two_places_is_refused(tmp_path):
    t = trainer(tmp_path, AutoprecPrecision(max_grad_norm=1.0, **SETTINGS), 2, gradient_clip_val=0.5)
    with pytest.raises(IntegrationError, match="gradient_clip_val"):
        t.fit(Classifier(), loader())


@pytest.mark.parametrize("fmt", [Format.FP8_E4M3, Format.INT8])
def test_validation_in_inference_mode_between_training_steps_under_a_plan(tmp_path, fmt):
    # The runtime caches quantized weights per optimizer step; a cache filled under Lightning's
    # inference_mode validation must not break the next training step's backward.
    plugin = AutoprecPrecision(plan=Plan.uniform(Classifier(), fmt, torch.randn(64, 16)), dynamic=False, monitor_window=WINDOW, measure_costs=False, search_slice=None)
    module = Classifier()
    t = trainer(tmp_path, plugin, 20, limit_val_batches=2, num_sanity_val_steps=2, val_check_interval=5, check_val_every_n_epoch=None)
    t.fit(module, loader(), loader(shuffle=False, n=128))
    assert t.global_step == 20 and plugin.scheduler.step_count == 20
    assert len([row for row in logged_rows(tmp_path) if row.get("val_loss")]) == 4
    assert sum(module.losses[-5:]) / 5 < sum(module.losses[:5]) / 5


def test_importing_the_integrations_imports_no_framework():
    import subprocess
    import sys

    code = "import sys, autoprec.integrations; print(sorted(m for m in ('lightning', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "[]"
