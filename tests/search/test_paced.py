"""A whole-model call run in parts between training steps (`autoprec.search.paced`): the parts
return what the call returns at once, draw what it draws, leave the training thread's draws and
state alone, end cleanly when dropped, and never stop inside a backward."""

import threading

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autoprec.costs import CostModel, RooflineTimeModel, trace_model
from autoprec.costs.trace import saved_bytes_by_layer
from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Plan
from autoprec.runtime import apply_plan, removing
from autoprec.runtime.installed import owner_of
from autoprec.search.paced import Pacer, paced, pause_layers


class Block(nn.Module):
    def __init__(self, width: int, checkpointed: bool = False):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(0.3)
        self.checkpointed = checkpointed

    def inner(self, x):
        return x + self.drop(self.down(torch.relu(self.up(x))))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False) if self.checkpointed else self.inner(x)


class Stack(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 16, checkpointed: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, checkpointed) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layers_of(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


def run_in_parts(steps, between=lambda: None):
    """Drive a paced generator to its end, calling ``between`` after each part; (parts, value)."""
    parts = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return parts + 1, done.value
        parts += 1
        between()


def test_pause_layers_spaces_the_stops_evenly_and_keeps_at_most_parts_minus_one():
    layers = [f"l{i}" for i in range(33)]
    assert pause_layers(layers, 8) == ("l4", "l8", "l12", "l16", "l20", "l24", "l28")
    assert pause_layers(layers[:5], 8) == ("l1", "l2", "l3", "l4")
    assert pause_layers(layers, 1) == () and pause_layers(layers[:1], 8) == ()


def test_a_paced_forward_draws_what_it_draws_at_once_and_leaves_the_training_draws_alone():
    torch.manual_seed(0)
    model = Stack().train()  # dropout on: every block draws
    x = torch.randn(5, 16)

    torch.manual_seed(123)
    at_once = model(x)
    torch.manual_seed(123)
    training_alone = [torch.rand(3) for _ in range(8)]  # what the training thread draws without the call

    torch.manual_seed(123)
    training = []
    stops = pause_layers(layers_of(model), 8)
    parts, paced_out = run_in_parts(paced(lambda: model(x), model, stops, "part"), lambda: training.append(torch.rand(3)))

    assert parts == len(stops) + 1 == 8
    assert torch.equal(paced_out, at_once)  # the same dropout masks
    # Between the parts the training thread drew on from where it was, as if no call had run,
    # and after the last one the same state holds.
    after = [torch.rand(3) for _ in range(8 - len(training))]
    assert all(torch.equal(a, b) for a, b in zip(training + after, training_alone))


def test_saved_bytes_measured_in_parts_equal_the_bytes_measured_at_once():
    torch.manual_seed(0)
    model = Stack().train()
    x = torch.randn(5, 16)
    layers = layers_of(model)
    plan = Plan({fqn: LayerPrecision(Format.BF16) for fqn in layers})

    def measure():
        runtime = apply_plan(model, plan, validate=False)
        with removing([runtime]):
            return saved_bytes_by_layer(model, x, layers, lambda: runtime)

    expected = measure()
    parts, got = run_in_parts(Pacer(model, layers)(measure))

    assert parts == len(Pacer(model, layers).stops) + 1 > 1
    assert got == expected and sum(got[0].values()) > 0
    assert all(owner_of(m.forward) is None for m in model.modules())  # the runtime came off the model


def test_the_cost_model_stages_measure_the_same_bytes_in_parts_as_at_once():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(5, 16)
    layers = layers_of(model)
    blocks = {f"blocks.{i}": (f"blocks.{i}.up", f"blocks.{i}.down") for i in range(4)}
    figures = []
    for pace in (None, Pacer(model, layers)):
        costs = CostModel(trace_model(model, x), RooflineTimeModel(), formats=[Format.FP32])
        labels = list(costs.region_bytes_steps(model, x, pace=pace)) + list(costs.block_bytes_steps(model, x, None, blocks, pace=pace))
        figures.append((labels.count("part"), costs.rest_saved_bytes, dict(costs.fp32_in_region_bytes), {k: b.freed_bytes for k, b in costs.blocks.items()}))
    (none, *at_once), (parts, *in_parts) = figures
    assert none == 0 and parts > 0
    assert in_parts == at_once


def test_a_call_dropped_between_parts_ends_there_and_its_thread_exits():
    model = Stack().eval()
    x = torch.randn(5, 16)
    before = model(x)
    layers = layers_of(model)
    plan = Plan({fqn: LayerPrecision(Format.BF16) for fqn in layers})
    entered = []

    def measure():
        runtime = apply_plan(model, plan, validate=False)
        with removing([runtime]):
            entered.append(threading.current_thread())
            return saved_bytes_by_layer(model, x, layers, lambda: runtime)

    steps = Pacer(model, layers)(measure)
    next(steps)
    next(steps)
    assert any(owner_of(m.forward) is not None for m in model.modules())  # mid-call: its runtime is on
    steps.close()

    entered[0].join(timeout=10)
    assert not entered[0].is_alive()
    assert all(owner_of(m.forward) is None for m in model.modules())
    assert all(not m._forward_pre_hooks for m in model.modules())  # the stops' hooks too
    assert torch.equal(model(x), before)  # the model runs as before the call


def test_an_error_in_the_call_is_raised_in_the_training_thread():
    model = Stack()
    stops = pause_layers(layers_of(model), 8)

    def broken():
        model(torch.randn(5, 16))
        raise ValueError("the call's own error")

    with pytest.raises(ValueError, match="the call's own error"):
        run_in_parts(paced(broken, model, stops, "part"))


def test_a_forward_rerun_inside_a_backward_does_not_stop_there():
    """A checkpointed block re-runs its forward in the backward; on a GPU that runs on the
    device's autograd thread, which a training step's backward needs: no part ends there."""
    torch.manual_seed(0)
    model = Stack(checkpointed=True)
    x = torch.randn(5, 16)
    stops = pause_layers(layers_of(model), 8)

    def forward_backward():
        model(x).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(1)
    parts, grads = run_in_parts(paced(forward_backward, model, stops, "part"))
    model.zero_grad()
    torch.manual_seed(1)
    expected = forward_backward()

    assert parts == len(stops) + 1  # the forward's stops only, not their re-runs
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_the_sensitivity_estimated_with_its_recorded_batch_in_parts_equals_the_estimate_at_once():
    from autoprec.search.pipeline import search_estimator
    from autoprec.sensitivity import sensitivity_steps

    torch.manual_seed(0)
    model = Stack()
    x, y = torch.randn(6, 16), torch.randint(0, 3, (6,))

    def loss_fn(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    estimates, parts = [], []
    for pace in (None, Pacer(model, layers_of(model))):
        torch.manual_seed(1)
        steps = sensitivity_steps(model, [(x, y)], loss_fn, ["bf16", "int8"], layers=layers_of(model), example_inputs=(x,),
                                  estimator=search_estimator(1e-3), pace=pace)
        labels = []
        while True:
            try:
                labels.append(next(steps))
            except StopIteration as done:
                estimates.append({k: v for k, v in done.value.to_dict().items() if k != "metadata"})  # its seconds differ
                break
        parts.append(labels.count("part"))
    assert parts[0] == 0 and parts[1] == len(Pacer(model, layers_of(model)).stops)
    assert estimates[0] == estimates[1]
    assert sum(entry["total"] for by_format in estimates[0]["layers"].values() for entry in by_format.values()) > 0
