"""Nothing the scheduler or a search job runs keeps an autograd graph alive past its step.

A hook or saved-tensor pack whose closure reaches back to its own graph makes a reference cycle
through autograd, which Python's collector cannot see (``THPVariable_traverse`` does not visit a
tensor's ``grad_fn``): the graph then lives for good. On an H100 such cycles kept 35 GiB of
activations after the scheduler's search. The check here is what found them: tensors with a
``grad_fn`` that the collector still tracks once the user has dropped the loss.
"""

import pytest
import torch

from autoprec.formats import Format, Granularity
from autoprec.plan import LayerPrecision, Plan, Scaling
from autoprec.scheduler import DynamicPrecisionScheduler
from autoprec.workloads import default_workload
from support.graphs import graph_snapshot, graph_tensors

WINDOW = 6


def train_step(wl, model, opt, sch, batch) -> None:
    with sch.precision_context():
        loss = wl.loss(model, batch)
    sch.backward(loss)
    sch.step(opt)
    opt.zero_grad(set_to_none=True)


def run_through(make, *, planned_steps=3, limit=120):
    """Train the tiny LM under ``make(model, example input)``'s scheduler until ``planned_steps``
    planned steps ran; the graph tensors alive after each of those, then after ``close()`` and
    after ``del``."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = wl.train_batches(0)
    sch = make(model, wl.train_batches(1).next()[0])
    before = graph_snapshot()  # empty, unless a test run before this one left a graph
    for _ in range(limit):
        train_step(wl, model, opt, sch, sampler.next())
        if sch.phase == "planned":
            break
    assert sch.phase == "planned", f"no plan: {sch.last_search_error}"
    between = []
    for _ in range(planned_steps):
        train_step(wl, model, opt, sch, sampler.next())
        between.append(graph_tensors(before))
    sch.close()
    closed = graph_tensors(before)
    del sch
    return between, closed, graph_tensors(before)


SEARCHES = {
    "fp8_tensorwise": dict(formats=("fp32", "bf16", "fp8_e4m3"), memory_budget=0.8),
    "int8": dict(formats=("fp32", "bf16", "int8"), memory_budget=0.85),
    "recompute": dict(formats=("fp32", "bf16"), memory_budget=0.6, recompute=["blocks.*"]),
}


@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_a_search_over_training_steps_keeps_no_graph(search):
    between, closed, deleted = run_through(lambda model, example: DynamicPrecisionScheduler(
        monitor_window=WINDOW, monitor_steps=WINDOW, accuracy_budget=0.05, **SEARCHES[search]))
    assert between == [0, 0, 0] and closed == 0 and deleted == 0


def test_a_dynamic_rowwise_fp8_plan_keeps_no_graph():
    rowwise = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.ROW))

    def make(model, example):
        plan = Plan.uniform(model, "bf16", example)
        plan = plan.with_layers({fqn: rowwise for fqn in plan.layers if fqn.endswith("mlp.fc")})
        return DynamicPrecisionScheduler.from_plan(model, plan, dynamic=True, monitor_window=WINDOW, monitor_steps=WINDOW)

    between, closed, deleted = run_through(make, planned_steps=2 * WINDOW + 1)  # two watched windows and their reviews
    assert set(between) == {0} and closed == 0 and deleted == 0


def test_metering_saved_bytes_without_a_backward_keeps_no_graph():
    """The saved-tensor meter's pack hook hands autograd a detached tensor: returning the tensor
    itself made a forward that is never backpropagated (the search's bytes measurements) a
    cycle through autograd."""
    from autoprec.saved_bytes import SavedTensorMeter

    weight = torch.randn(16, 16, requires_grad=True)
    before = graph_snapshot()
    with SavedTensorMeter([weight]) as meter:
        out = torch.randn(4, 16).matmul(weight).exp().tanh().sum()
    assert meter.total_bytes > 0 and graph_tensors(before) > 0
    del out
    assert graph_tensors(before) == 0


JOB = """
[job]
name = "tiny"
out = "out"
device = "cpu"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = { name = "tiny", batch_size = 4 }

[budgets]
memory = 0.85
accuracy = 0.05

[search]
formats = ["fp32", "bf16", "fp8_e4m3", "int8"]
measure_top = 2

[profile]
steps = 6
sensitivity_batches = 1

[measure]
val_batches = 2
steps = 1
"""


def test_a_search_job_keeps_no_graph_between_its_measured_trials(tmp_path, monkeypatch):
    from autoprec.cli import main
    from autoprec.search.candidate_runs import MeasuredStage

    seen = []
    memory = MeasuredStage.memory
    before = graph_snapshot()

    def counting(self, *args, **kwargs):  # each measured candidate's first measurement
        seen.append(graph_tensors(before))
        return memory(self, *args, **kwargs)

    monkeypatch.setattr(MeasuredStage, "memory", counting)
    (tmp_path / "job.toml").write_text(JOB, encoding="utf-8")
    assert main(["search", str(tmp_path / "job.toml")]) == 0
    assert len(seen) >= 3 and set(seen) == {0}
    assert graph_tensors(before) == 0
