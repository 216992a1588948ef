"""The scheduler's search at depth (issue 57), counted, not timed: what its off-path work does
(whole-model forwards, the layers of the runtimes it builds, the wrappers those install, the
integer program's variables, the modules walked from the model's root) on a deep, narrow model at two depths. Each must grow at most as
the number of layers does (whole-model forwards not at all): before, every (layer, format)
sensitivity runtime was a whole-model plan (layers^2 runtime layers and wrappers) and each block
was measured by its own two whole-model forwards (forwards grew with the blocks), and each
runtime walked the whole model (modules walked grew with layers^2)."""

import torch

from autoprec.runtime import context as runtime_context
from autoprec.runtime import layer_wrappers as runtime_layer_wrappers
from autoprec.scheduler import DynamicPrecisionScheduler
from autoprec.search import exact
from autoprec.search import in_run as search_in_run
from autoprec.workloads import default_workload
from autoprec.workloads.bytelm import ByteLM

SHALLOW, DEEP = 4, 16  # blocks of width 8


def counts(blocks: int, patching) -> dict:
    """Train through the README loop until a plan is in force; count inside the search's
    off-path work only (`TrainingSearch.work`)."""
    seen = {"forwards": 0, "runtime layers": 0, "wrappers": 0, "solver variables": 0, "modules walked": 0}
    inside = [False]

    real_work = search_in_run.TrainingSearch.work

    def work(self, passes):
        inside[0] = True
        try:
            return real_work(self, passes)
        finally:
            inside[0] = False

    real_init = runtime_context.PlanRuntime.__init__

    def init(self, model, plan, **kwargs):
        if inside[0]:
            seen["runtime layers"] += len(plan.layers)
        return real_init(self, model, plan, **kwargs)

    real_wrapper = runtime_layer_wrappers.LayerWrappers._wrapper

    def wrapper(self, *args, **kwargs):
        if inside[0]:
            seen["wrappers"] += 1
        return real_wrapper(self, *args, **kwargs)

    real_program = exact._program

    def program(space, paced=False):
        made = real_program(space, paced)
        seen["solver variables"] = max(seen["solver variables"], made.size)
        return made

    real_named_modules = torch.nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        # A walk from the model's root (named_modules, and parameters() through it): its modules.
        for item in real_named_modules(self, *args, **kwargs):
            if inside[0] and isinstance(self, ByteLM):
                seen["modules walked"] += 1
            yield item

    def forward_hook(module, args):
        if inside[0] and isinstance(module, ByteLM):
            seen["forwards"] += 1

    patching.setattr(search_in_run.TrainingSearch, "work", work)
    patching.setattr(runtime_context.PlanRuntime, "__init__", init)
    patching.setattr(runtime_layer_wrappers.LayerWrappers, "_wrapper", wrapper)
    patching.setattr(exact, "_program", program)
    patching.setattr(torch.nn.Module, "named_modules", named_modules)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_hook)
    try:
        wl = default_workload("tiny", batch_size=2, n_layers=blocks, d_model=8, n_heads=2, d_ff=16, context=8)
        model = wl.build_model(0)
        sch = DynamicPrecisionScheduler(monitor_window=4, formats=("fp32", "bf16"), memory_budget=0.9, accuracy_budget=0.05,
                                        search_slice=None, sample_every=1000)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        sampler = wl.train_batches(0)
        for _ in range(200):
            with sch.precision_context():
                loss = wl.loss(model, sampler.next())
            sch.backward(loss)
            sch.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            if sch.phase == "planned":
                break
        assert sch.phase == "planned", sch.last_search_error
        seen["layers"] = len(sch.plan.layers)
        sch.close()
    finally:
        handle.remove()
    return seen


def test_the_searchs_work_grows_linearly_with_depth(monkeypatch):
    runs = {}
    for blocks in (SHALLOW, DEEP):
        with monkeypatch.context() as patching:  # each run's counters on the real functions
            runs[blocks] = counts(blocks, patching)
    shallow, deep = runs[SHALLOW], runs[DEEP]
    growth = deep["layers"] / shallow["layers"]
    assert growth > 3
    assert deep["forwards"] <= shallow["forwards"] + 2, (shallow, deep)
    for name in ("runtime layers", "wrappers", "solver variables", "modules walked"):
        assert deep[name] <= 1.15 * growth * shallow[name], (name, shallow, deep)


def proposal_counts(blocks: int, patching) -> dict:
    """The offline job's proposal (`propose_plans`, recompute blocks on) on the same narrow
    model: its whole-model forwards, runtime layers, modules walked, and the in-place timing's
    training steps and autograd-node hooks per step."""
    from autoprec.blocks import find_blocks
    from autoprec.costs import inplace
    from autoprec.coverage import find_layers
    from autoprec.search.pipeline import propose_plans
    from autoprec.search.planning import Planning
    from autoprec.search.budgets import Budgets

    seen = {"forwards": 0, "runtime layers": 0, "modules walked": 0, "timed steps": 0, "node hooks per step": 0}

    real_init = runtime_context.PlanRuntime.__init__

    def init(self, model, plan, **kwargs):
        seen["runtime layers"] += len(plan.layers)
        return real_init(self, model, plan, **kwargs)

    real_named_modules = torch.nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        for item in real_named_modules(self, *args, **kwargs):
            if isinstance(self, ByteLM):
                seen["modules walked"] += 1
            yield item

    real_before_backward = inplace.StepTimer.before_backward

    def before_backward(self, loss):
        real_before_backward(self, loss)
        seen["timed steps"] += 1
        seen["node hooks per step"] = max(seen["node hooks per step"], len(self._node_handles))

    def forward_hook(module, args):
        if isinstance(module, ByteLM):
            seen["forwards"] += 1

    patching.setattr(runtime_context.PlanRuntime, "__init__", init)
    patching.setattr(torch.nn.Module, "named_modules", named_modules)
    patching.setattr(inplace.StepTimer, "before_backward", before_backward)
    wl = default_workload("tiny", batch_size=2, n_layers=blocks, d_model=8, n_heads=2, d_ff=16, context=8)
    model = wl.build_model(0)
    batch = wl.train_batches(0).next()
    layers = list(find_layers(model, batch))
    planning = Planning(formats=("fp32", "bf16", "int8"), budgets=Budgets(memory=0.9, accuracy=0.05))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_hook)
    try:
        proposal = propose_plans(model, batch, [batch], wl.loss, None, planning, baseline_loss=5.5, cost_inputs=batch,
                                 cost_loss_fn=wl.loss, blocks=find_blocks(model, layers))
    finally:
        handle.remove()
    seen["layers"] = len(proposal.plans[0].layers)
    return seen


def test_the_offline_proposal_grows_linearly_and_times_few_steps_with_depth(monkeypatch):
    """Before (94088f6): every layer was timed in every one of 12 steps per format (1 + 3 warmup
    + 8 timed), so the node hooks of a step grew with the layers; now a role's layers pool their
    samples, a repeated role is timed on a few of its layers per step, and INT8 is timed
    calibrated on one batch: 1 + `MIN_TIMED_ROUNDS` steps per format at any depth."""
    from autoprec.costs.inplace import MIN_TIMED_ROUNDS

    runs = {}
    for blocks in (SHALLOW, DEEP):
        with monkeypatch.context() as patching:
            runs[blocks] = proposal_counts(blocks, patching)
    shallow, deep = runs[SHALLOW], runs[DEEP]
    growth = deep["layers"] / shallow["layers"]
    assert growth > 3
    assert deep["forwards"] <= shallow["forwards"] + 2, (shallow, deep)
    for name in ("runtime layers", "modules walked"):
        assert deep[name] <= 1.15 * growth * shallow[name], (name, shallow, deep)
    formats = 3
    assert shallow["timed steps"] == deep["timed steps"] == formats * (1 + MIN_TIMED_ROUNDS), (shallow, deep)
    assert deep["node hooks per step"] <= 1.15 * shallow["node hooks per step"], (shallow, deep)
