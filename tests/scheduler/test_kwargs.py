"""Models as people call them: keyword inputs captured and replayed (by a scheduler with or
without ``model=``), losses read from model outputs, layers that are not `nn.Linear` found without
an example, and a scheduler state loaded before the scheduler is bound."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoprec as ap
from autoprec.calls import ModelCall, loss_of, prediction_of
from autoprec.coverage import static_layers, trace_layers
from autoprec.errors import ModelCallError
from autoprec.runtime import EmulationWarning
from autoprec.scheduler import DynamicPrecisionScheduler
from autoprec.search.candidate_runs import MeasuredStage
from support.models import WithProjection
from support.products import ProductLog

WINDOW = 3


class KeywordOnly(nn.Module):
    """Takes keyword-only inputs and returns a dict with a loss, as `transformers` models do."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, *, x, targets=None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits, targets)
        return out


class GatedByKeyword(nn.Module):
    """``model(x, gate=g)``: the second projection runs only when the keyword input is given."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate_proj = nn.Linear(8, 8)

    def forward(self, x, gate=None):
        y = self.fc(x)
        return y if gate is None else y * torch.sigmoid(self.gate_proj(gate))


def scheduler(**kwargs):
    settings = dict(monitor_window=WINDOW, monitor_steps=2, formats=("fp32", "bf16", "fp8_e4m3"),
                    measure_costs=False, search_slice=None, search_timeout_s=10)
    settings.update(kwargs)
    return DynamicPrecisionScheduler(**settings)


# --- the call helper ------------------------------------------------------------------------------


def test_trace_replays_positional_and_keyword_inputs_together():
    layers = trace_layers(GatedByKeyword(), ModelCall((torch.randn(2, 8),), {"gate": torch.randn(2, 8)}))
    assert list(layers) == ["fc", "gate_proj"]


def test_captured_call_is_detached_from_later_changes_to_the_batch():
    x = torch.randn(2, 8)
    call = ModelCall.capture((), {"x": x})
    x.add_(1.0)
    assert not torch.equal(call.kwargs["x"], x)


def test_a_dict_example_with_a_non_string_key_names_the_fix():
    with pytest.raises(ModelCallError, match="pass a tuple for positional inputs"):
        ModelCall.of({0: torch.randn(2, 8)})


def test_loss_of_reads_the_loss_field_of_a_dict_output():
    loss = torch.tensor(1.5)
    assert loss_of({"logits": torch.randn(2, 3), "loss": loss}) is loss


def test_loss_of_reads_the_first_element_of_a_tuple_output():
    loss = torch.tensor(0.5)
    assert loss_of((loss, torch.randn(2, 3))) is loss


def test_loss_of_an_output_without_a_loss_says_to_pass_labels():
    with pytest.raises(ModelCallError, match="labels"):
        loss_of({"logits": torch.randn(2, 3)})


def test_prediction_of_a_dict_with_a_loss_is_its_logits():
    logits = torch.randn(2, 3)
    assert prediction_of({"loss": torch.tensor(1.0), "logits": logits}) is logits


def test_the_measured_stage_takes_a_loss_fn_that_returns_the_model_output():
    torch.manual_seed(0)
    model = KeywordOnly()
    batches = [{"x": torch.randn(8, 8), "targets": torch.randint(0, 4, (8,))} for _ in range(2)]
    stage = MeasuredStage(model, lambda m, batch: m(**batch), batches[:1], batches[1:])
    reference = F.cross_entropy(model(x=batches[1]["x"])["logits"], batches[1]["targets"]).item()
    assert stage.baseline_loss == pytest.approx(reference)


# --- the scheduler with keyword inputs ------------------------------------------------------------


def test_scheduler_plans_a_model_called_with_keyword_inputs_only():
    torch.manual_seed(0)
    model = KeywordOnly()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sch = scheduler(model=model)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for _ in range(WINDOW + 1):
        with sch.precision_context():
            out = model(x=x, targets=y)
        sch.backward(out)  # the output itself: its "loss" field is the loss
        sch.step(opt)
        opt.zero_grad()
    assert sch.last_search_error is None and set(sch.plan.layers) == {"fc1", "fc2"}


def test_scheduler_without_model_plans_a_model_called_with_keyword_inputs_only():
    torch.manual_seed(0)
    model = KeywordOnly()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sch = scheduler()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for _ in range(WINDOW + 1):
        with sch.precision_context():
            out = model(x=x, targets=y)
        sch.backward(out)
        sch.step(opt)
        opt.zero_grad()
    assert sch.model is model and sch.last_search_error is None and set(sch.plan.layers) == {"fc1", "fc2"}


def test_scheduler_without_model_captures_the_keyword_input_of_a_mixed_call():
    # gate_proj runs only when gate= is given: it is a layer only if the keyword input was captured.
    model = GatedByKeyword()
    sch = scheduler()
    with sch.precision_context():
        model(torch.randn(2, 8), gate=torch.randn(2, 8))
    assert sch.layers == ("fc", "gate_proj")


# --- layers found without an example ---------------------------------------------------------------


def test_uniform_plan_without_example_lowers_the_addmm_projection():
    model = WithProjection()
    plan = ap.Plan.uniform(model, "fp8_e4m3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        with ap.apply_plan(model, plan) as runtime, ProductLog(model) as log:
            model(torch.randn(4, 8))
    report = runtime.report()
    assert "addmm" in report["proj"]["ops"]
    # Both products ran, each inside its layer and in FP8 (a kernel, or emulation where reported).
    assert [p.modules[-1] for p in log.products] == ["fc", "proj"]
    emulated = {fqn for fqn, entry in report.items() if any(how.startswith("emulated") for how in entry["ops"].values())}
    assert log.outside_plan({fqn: lp.format.value for fqn, lp in plan.layers.items()}, emulated) == []


def test_validate_without_example_names_the_addmm_projection_the_plan_lacks():
    with pytest.raises(ap.PlanError, match="'proj': a covered layer"):
        ap.Plan({"fc": "bf16"}).validate(WithProjection())


class PositionTable(nn.Module):
    """A 2-D parameter that is added, not multiplied: not a layer."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 8))

    def forward(self, x):
        return x + self.table


def test_a_matrix_parameter_that_no_matrix_product_uses_is_not_a_layer():
    assert static_layers(nn.Sequential(PositionTable(), nn.Linear(8, 4))).keys() == {"1"}


# --- loading a state before the scheduler is bound --------------------------------------------------


def _train(model, opt, sch, batches):
    losses = []
    for x, y in batches:
        with sch.precision_context():
            loss = F.mse_loss(model(x), y)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _setup(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_state_loaded_before_binding_resumes_bit_identically():
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(2 * WINDOW + 2)]
    stop = WINDOW + 1  # planned, mid-window
    model, opt = _setup(0)
    reference = _train(model, opt, scheduler(), batches)

    model, opt = _setup(0)
    sch = scheduler()
    first = _train(model, opt, sch, batches[:stop])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sch": sch.state_dict()})
    sch.close()
    model, opt = _setup(1)  # other weights: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = scheduler()  # no model=: bound by the first forward
    resumed.load_state_dict(saved["sch"])
    assert first + _train(model, opt, resumed, batches[stop:]) == reference
