"""A candidate plan runs once off the training path before a training step runs it
(`search.preflight`): a format that breaks the model's code in the backward, outside every
layer (YOSO's custom autograd Function), is found by bisection and kept out of the layer's
role; a candidate that runs is unchanged, and the snapshot's state is left as it was."""

import logging
import math

import pytest
import torch
import torch.nn as nn

from autoprec.errors import SearchError
from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Plan
from autoprec.runtime import apply_plan
from autoprec.search.preflight import preflight, preflight_each


class Weighted(torch.autograd.Function):
    """YOSO's shape of backward: the incoming FP32 gradient times the saved value, whatever the
    value's dtype (``torch.matmul`` refuses mixed dtypes)."""

    @staticmethod
    def forward(ctx, scores, value):
        ctx.save_for_backward(value)
        with torch.autocast(scores.device.type, enabled=False):  # its own FP32 kernel, as YOSO's extension
            return scores.float() @ value.float()

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        return torch.matmul(grad, value.transpose(-1, -2)), None


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.query = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q = self.query(x)
        scores = torch.softmax(q @ q.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.out(self.drop(Weighted.apply(scores, self.value(x))))


class Net(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


def roles_of(plan: Plan) -> dict:
    return {fqn: fqn.rsplit(".", 1)[-1] for fqn in plan.layers}


def lowered(model: nn.Module, fmt: Format) -> Plan:
    return Plan({fqn: LayerPrecision(fmt) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)})


def drain(gen):
    runs = 0
    while True:
        try:
            next(gen)
            runs += 1
        except StopIteration as done:
            return done.value, runs


def test_a_candidate_whose_backward_raises_outside_every_layer_has_the_layers_role_kept_out_of_the_format():
    torch.manual_seed(0)
    model = Net()
    batch = torch.randn(4, 8, 8)
    plan = lowered(model, Format.FP16)
    runtime = apply_plan(model, plan)  # the plan as a training step would run it
    with runtime:
        loss = loss_fn(model, batch)
    with pytest.raises(RuntimeError, match="same dtype"):
        loss.backward()
    runtime.remove()
    model.zero_grad(set_to_none=True)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    failing: dict = {}
    ran, runs = drain(preflight(model, batch, loss_fn, plan, roles_of(plan), failing))
    assert set(failing) == {("value", "fp16")} and "same dtype" in failing[("value", "fp16")]
    assert {fqn for fqn, lp in ran.layers.items() if lp.format is Format.FP32} == {f"blocks.{i}.value" for i in range(3)}
    assert all(lp.format is Format.FP16 for fqn, lp in ran.layers.items() if not fqn.endswith("value"))
    assert ran.metadata["promoted_for_failure"] == [f"blocks.{i}.value" for i in range(3)]
    # One failing run, the bisection over 9 lowered layers, one run that passes.
    assert runs <= 1 + math.ceil(math.log2(9)) + 1
    # The snapshot as it was: no gradients, buffers (BatchNorm's statistics) and the RNG unchanged.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    # The plan it leaves trains: a forward and backward under it run.
    with apply_plan(model, ran):
        loss = loss_fn(model, batch)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_candidate_that_runs_is_unchanged_in_one_run_and_the_next_skips_a_known_failing_pair():
    torch.manual_seed(0)
    model = Net()
    batch = torch.randn(4, 8, 8)
    fine = Plan({**lowered(model, Format.FP16).layers, **{f"blocks.{i}.value": LayerPrecision(Format.FP32) for i in range(3)}})
    failing: dict = {}
    ran, runs = drain(preflight(model, batch, loss_fn, fine, roles_of(fine), failing))
    assert ran is fine and runs == 1 and failing == {}
    known = {("value", "bf16"): "RuntimeError: earlier"}
    plans, runs = drain(preflight_each(model, batch, loss_fn, [lowered(model, Format.BF16)], roles_of(fine), known))
    assert runs == 1 and len(plans) == 1  # the known pair kept out before it runs: no bisection
    assert all(plans[0].layers[f"blocks.{i}.value"].format is Format.FP32 for i in range(3))


def test_no_candidate_that_runs_is_a_search_error_naming_the_pair():
    torch.manual_seed(0)
    model = Net(blocks=1)
    batch = torch.randn(4, 8, 8)
    broken = Plan({"blocks.0.value": LayerPrecision(Format.FP16)})

    def always(model, batch):
        raise RuntimeError("the model's own bug\nsecond line")

    with pytest.raises(SearchError, match=r"\(value in fp16: RuntimeError: the model's own bug\); training stays"):
        drain(preflight_each(model, batch, always, [broken], {"blocks.0.value": "value"}, {}))


def test_the_graph_walk_names_the_models_own_autograd_functions_and_no_other():
    from torch.utils.checkpoint import checkpoint

    from autoprec._tracing import own_autograd_functions

    torch.manual_seed(0)
    model = Net(blocks=2)
    batch = torch.randn(4, 8, 8)
    assert own_autograd_functions(loss_fn(model, batch)) == (f"{__name__}.Weighted",)

    class Plain(nn.Module):  # torch's own Functions (a reentrant checkpoint) and autoprec's (FP8 and INT8 products) only
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True))

    plain = Plain()
    with apply_plan(plain, Plan({"a": LayerPrecision(Format.FP8_E4M3), "b": LayerPrecision(Format.INT8)})):
        out = plain(batch.requires_grad_())  # a reentrant checkpoint records a node only for inputs needing a gradient
    assert own_autograd_functions(out) == ()
    # ... though the graph holds autoprec's own Functions and torch's checkpoint.
    stack, modules = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is not None:
            modules.add(getattr(getattr(node, "_forward_cls", None), "__module__", "").split(".")[0])
            stack.extend(n for n, _ in node.next_functions)
    assert {"autoprec", "torch"} <= modules


def test_a_model_with_its_own_function_trains_to_a_plan_through_the_readme_loop_without_the_format_it_breaks(caplog):
    from autoprec import LayerRules
    from autoprec.scheduler import DynamicPrecisionScheduler

    torch.manual_seed(0)
    model = Net(d=16, blocks=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    caplog.set_level(logging.INFO, logger="autoprec")
    # The value layers pinned to FP16, so every candidate lowers them (left to the search, FP32
    # with blocks recomputed, the fastest on a CPU without BF16 arithmetic, meets the budget, and
    # which lowered plans follow it as candidates depends on how closely their bytes are priced).
    sch = DynamicPrecisionScheduler(monitor_window=4, monitor_steps=2, memory_budget=0.8, accuracy_budget=0.2, formats=("fp32", "bf16", "fp16"),
                                    rules=LayerRules(pin={"*.value": "fp16"}))
    for step in range(80):  # before: a probe step (value in a half format) raised in the Function's backward
        batch = torch.randn(8, 12, 16, generator=torch.Generator().manual_seed(step))
        with sch.precision_context():
            loss = loss_fn(model, batch)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        if sch.plan is not None:
            break
    assert sch.plan is not None, sch.last_search_error
    assert "probe steps" not in sch.plan.measured["search_timeline"]  # no probe plan ran unchecked
    assert all(sch.plan.layers[f"blocks.{i}.value"].format is Format.FP32 for i in range(3))
    found = [r.getMessage() for r in caplog.records if "off the training path" in r.getMessage()]
    assert any("value' in " in line for line in found), found  # the value layers' half formats, found off-path
