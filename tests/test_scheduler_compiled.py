"""The scheduler around a ``torch.compile``-d model: the README's loop, a fixed plan and a dynamic
one train without error, planned steps run compiled without recompiling step after step, steps
whose forward the scheduler hooks run eagerly, and the losses are those of the eager model.

A counting backend stands for Inductor (same Dynamo tracing and guards, no code generation):
it records each compile and each run of compiled code. Run on torch 2.13 and 2.11 (CI's legs).
"""

import pytest
import torch

from autoprec.plan import Plan
from autoprec.scheduler import DynamicPrecisionScheduler
from autoprec.workloads import default_workload

WINDOW = 6


class Counting:
    """A ``torch.compile`` backend running the traced graph as it is, counting compiles and runs."""

    def __init__(self):
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1

        def run(*args):
            self.runs += 1
            return gm(*args)

        return run


def train(model, called, sch, steps, sampler, wl, backend=None):
    """``steps`` steps calling ``called`` (the compiled model or the model itself); per step
    (loss, phase after the step, compiled runs during it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        runs = backend.runs if backend is not None else 0
        batch = sampler.next()
        with sch.precision_context():
            loss = wl.loss(called, batch)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), sch.phase, (backend.runs - runs) if backend is not None else 0))
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_and_eager(make_scheduler, steps):
    """The same training run twice: once calling ``torch.compile(model)``, once the model itself."""
    wl = default_workload("tiny", batch_size=8)
    results = []
    for compile_it in (True, False):
        model = wl.build_model(0)
        backend = Counting() if compile_it else None
        called = torch.compile(model, backend=backend) if compile_it else model
        sch = make_scheduler(model, wl)
        results.append((train(model, called, sch, steps, wl.train_batches(0), wl, backend), backend, sch))
    return results


def test_the_readme_loop_around_a_compiled_model_trains_as_eager_and_its_planned_steps_run_compiled():
    (compiled, backend, sch), (eager, _, _) = compiled_and_eager(
        lambda model, wl: DynamicPrecisionScheduler(monitor_window=WINDOW, monitor_steps=WINDOW, sample_every=3, memory_budget=0.85, search_slice=None, measure_costs=False,
                                                    accuracy_budget=0.05, formats=("fp32", "bf16", "int8")), steps=60)
    assert sch.phase == "planned"
    assert [phase for _, phase, _ in compiled] == [phase for _, phase, _ in eager]
    assert [loss for loss, _, _ in compiled] == pytest.approx([loss for loss, _, _ in eager], rel=1e-5)
    planned = [(i, runs) for i, (_, phase, runs) in enumerate(compiled) if phase == "planned" and compiled[i - 1][1] == "planned"]
    assert planned, "no planned step"
    ran_compiled = [i for i, runs in planned if runs > 0]
    assert len(ran_compiled) >= len(planned) // 2  # the watch's sampled steps (1 in 3) run eagerly
    assert any(runs == 0 for _, runs in planned)
    assert all(runs <= 2 for _, runs in planned)  # one graph (forward and backward) per step
    compiles = backend.compiles
    train(sch.model, torch.compile(sch.model, backend=backend), sch, 12, default_workload("tiny", batch_size=8).train_batches(3),
          default_workload("tiny", batch_size=8), backend)
    assert backend.compiles - compiles <= 2  # a fresh wrapper compiles once, then reuses its code


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_given_plan_around_a_compiled_model_trains_as_eager(dynamic):
    def make(model, wl):
        plan = Plan.uniform(model, "bf16", wl.train_batches(1).next()[0]).with_layers({"lm_head": "fp32"})
        return DynamicPrecisionScheduler.from_plan(model, plan, dynamic=dynamic, monitor_window=WINDOW, monitor_steps=WINDOW, sample_every=3)

    (compiled, backend, _), (eager, _, _) = compiled_and_eager(make, steps=14)
    assert [loss for loss, _, _ in compiled] == pytest.approx([loss for loss, _, _ in eager], rel=1e-5)
    after_first = [runs for _, _, runs in compiled[2:]]
    assert sum(1 for runs in after_first if runs > 0) >= len(after_first) // 2
    assert backend.compiles <= 4  # no recompiling step after step


def test_the_searchs_candidates_are_timed_compiled_around_a_compiled_model():
    """Probe steps and a candidate's metered and calibrating steps run eagerly; its timed steps
    (after one that compiles it) run the compiled code."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    backend = Counting()
    sch = DynamicPrecisionScheduler(monitor_window=WINDOW, monitor_steps=WINDOW, sample_every=3, memory_budget=0.85, search_slice=None,
                                    accuracy_budget=0.05, formats=("fp32", "bf16", "int8"))
    steps = train(model, torch.compile(model, backend=backend), sch, 80, wl.train_batches(0), wl, backend)
    assert sch.phase == "planned" and sch.plan.measured["compiled"] is True
    searching = [runs for i, (_, phase, runs) in enumerate(steps) if phase == "searching" or (i and steps[i - 1][1] == "searching")]
    tried = len(sch.plan.measured["candidates"])
    assert sum(1 for runs in searching if runs > 0) >= 2 * tried  # every candidate's timed steps
    assert sum(1 for runs in searching if runs == 0) > tried  # probes and first steps: eager
