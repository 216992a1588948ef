"""`scheduler_metrics`, the flat metrics both integrations log: every phase the scheduler can be in
is numbered, by the scheduler's own `PHASES`, so that no phase crashes a logger (a copy of the
list once lacked "searching", and every log inside a search raised ValueError). Needs neither
Lightning nor transformers."""

import math

import pytest
import torch

from autoprec.integrations import scheduler_metrics
from autoprec.scheduler import DynamicPrecisionScheduler, lifecycle
from autoprec.workloads import default_workload


class InPhase(DynamicPrecisionScheduler):
    """A scheduler that reports ``phase`` as given: each phase without training into it."""

    def __init__(self, phase):
        super().__init__(monitor_window=4)
        self.given = phase

    @property
    def phase(self):
        return self.given


def decoded(metrics):
    """The phase a log reader gets back from the logged number."""
    value = metrics["autoprec/phase"]
    assert value == int(value)
    return DynamicPrecisionScheduler.PHASES[int(value)]


# Every phase the window clock can take (`WindowClock` refuses any other), and "unbound" before it.
@pytest.mark.parametrize("phase", ("unbound",) + lifecycle.PHASES)
def test_every_phase_of_the_lifecycle_is_logged_as_a_number_that_names_it(phase):
    metrics = scheduler_metrics(InPhase(phase))
    assert decoded(metrics) == phase
    assert math.isfinite(metrics["autoprec/loss_scale"]) and metrics["autoprec/step"] == 0.0


def run(steps, **settings):
    """The built-in tiny LM under a scheduler; the metrics of each step, after it."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(monitor_window=4, monitor_steps=2, accuracy_budget=0.05, measure_costs=False, **settings)
    sampler, logged = wl.train_batches(0), [(sch.phase, scheduler_metrics(sch))]
    for _ in range(steps):
        with sch.precision_context():
            loss = wl.loss(model, sampler.next())
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        logged.append((sch.phase, scheduler_metrics(sch, sync=False)))
    return logged


def test_a_real_run_logs_every_phase_it_passes_through():
    # A spread search (search_slice=1.0) spans steps: logs fall inside it. A memory budget no plan
    # meets ends the other run safe.
    logged = run(80, memory_budget=0.8, search_slice=1.0) + run(6, memory_budget=0.1, search_slice=None)
    assert [decoded(metrics) for _, metrics in logged] == [phase for phase, _ in logged]
    assert {phase for phase, _ in logged} == set(DynamicPrecisionScheduler.PHASES)
