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


@pytest.mark.parametrize("settings", [dict(memory_budget=0.85, formats=("fp32", "bf16", "int8"), sample_every=3, search_slice=None),
                                      dict(memory_budget=0.8)], ids=["int8", "every-format"])
def test_the_searchs_candidates_are_timed_compiled_around_a_compiled_model(settings):
    """Probe steps and a candidate's metered and calibrating steps run eagerly; its timed steps
    (after one that compiles it) run the compiled code."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(0)
    backend = Counting()
    sch = DynamicPrecisionScheduler(monitor_window=WINDOW, monitor_steps=WINDOW, accuracy_budget=0.05, **settings)
    # The window, the probe steps, the off-path work after them, and up to two rounds of candidates
    # (one round: a plan at step 78 on a quiet machine).
    steps = train(model, torch.compile(model, backend=backend), sch, 120, wl.train_batches(0), wl, backend)
    assert sch.phase == "planned" and sch.plan.measured["compiled"] is True
    searching = [runs for i, (_, phase, runs) in enumerate(steps) if phase == "searching" or (i and steps[i - 1][1] == "searching")]
    tried = len(sch.plan.measured["candidates"])
    assert sum(1 for runs in searching if runs > 0) >= 2 * tried  # every candidate's timed steps
    assert sum(1 for runs in searching if runs == 0) > tried  # probes and first steps: eager


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_a_product_of_a_weight_view_compiles_whole(fmt):
    """A layer computing ``x @ self.weight.t()`` runs its product through the runtime's mode, which
    names the weight by identity among the layer's parameters: an id() of the view's base has no
    source for Dynamo (a graph break; after it torch 2.11 stopped with an AssertionError when the
    search timed such a candidate compiled)."""
    import autoprec as ap

    class ViewProjection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32, 16) / 4)

        def forward(self, x):
            return x @ self.weight.t()

    torch.manual_seed(0)
    model = torch.nn.Sequential(ViewProjection(), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(16, 16)
    runtime = ap.apply_plan(model, ap.Plan.uniform(model, fmt, x))
    with runtime:
        for _ in range(3):  # eagerly past INT8 calibration: the report names how the product ran
            model(x).sum().backward()
    assert runtime.report()["0"]["ops"] == {"matmul": f"kernel torch.{'_int_mm' if fmt == 'int8' else '_scaled_mm'}"}
    step = torch.compile(lambda inp: model(inp).sum(), backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    with runtime:
        step(x).backward()
