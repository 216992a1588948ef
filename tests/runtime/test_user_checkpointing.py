"""The user's own activation checkpointing under a plan: ``torch.utils.checkpoint`` called by the
model's forward (reentrant or not, directly or through torch's ``checkpoint_wrapper`` as torchtitan
does) and Hugging Face's ``gradient_checkpointing_enable()``. Its recomputation runs in the
backward, outside ``precision_context()``, so it must run under the plan as the forward did, with
the forward's scales (`runtime.recompute.users_record`). Before, an FP8 plan failed in the
backward ("A different number of tensors was saved: 9 vs 5"), a reentrant checkpoint silently
recomputed in FP32 (gradients of neither model), and the search predicted FP8 layers inside
checkpointed blocks to save bytes they never keep. Each kind is run on torch 2.11 and 2.13 (the
detection reads checkpoint's internals)."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

transformers = pytest.importorskip("transformers")

import autoprec as ap  # noqa: E402
from autoprec.costs.memory import layer_memory  # noqa: E402
from autoprec.costs.trace import trace_model  # noqa: E402
from autoprec.profiling.profiler import LayerProfiler  # noqa: E402

transformers.logging.set_verbosity_error()


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def gradients(model, batch, plan, steps=2):
    """Parameter gradients of the last of ``steps`` planned steps (the optimizer stepping between)."""
    sch = ap.DynamicPrecisionScheduler.from_plan(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with sch.precision_context():
                loss = model(**batch).loss
            sch.backward(loss)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            sch.step(opt)
    finally:
        sch.close()
    return loss.detach(), grads


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int8"])
def test_a_checkpointed_model_trains_a_plan_exactly_as_without_checkpointing(fmt):
    plain, batch = llama()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    plain.train(), checkpointed.train()
    own = {name: m.__dict__["_gradient_checkpointing_func"] for name, m in checkpointed.named_modules() if "_gradient_checkpointing_func" in m.__dict__}
    plan = ap.Plan.uniform(plain, fmt, batch)
    loss, grads = gradients(plain, batch, plan)
    loss_ckpt, grads_ckpt = gradients(checkpointed, batch, plan)
    # The recomputation replays the forward's scales: the same activations, so the same gradients.
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # The model's own checkpoint function is never replaced: the recomputation is found from inside.
    assert own and {name: m.__dict__.get("_gradient_checkpointing_func") for name, m in checkpointed.named_modules() if name in own} == own


def test_layers_inside_the_users_checkpoints_are_predicted_to_save_nothing():
    model, batch = llama()
    model.gradient_checkpointing_enable()
    model.train()
    trace = trace_model(model, batch)
    inside = [fqn for fqn in trace.layers if fqn.startswith("model.layers.")]
    assert inside and "lm_head" in trace.layers
    for fmt in ("fp32", "bf16", "fp8_e4m3", "int8"):
        assert all(layer_memory(trace.layers[fqn], fmt, "cpu").saved_bytes == trace.layers[fqn].other_saved_bytes for fqn in inside), fmt
    # lm_head runs outside every checkpoint: its FP8 input is saved, a quarter of FP32's.
    head = {fmt: layer_memory(trace.layers["lm_head"], fmt, "cpu").saved_bytes for fmt in ("fp32", "fp8_e4m3")}
    assert 0 < head["fp8_e4m3"] < head["fp32"]


def test_the_seed_loop_plans_a_checkpointed_model():
    """The search's probe and trial steps run lowered formats through the user's checkpoints."""
    model, batch = llama()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sch = ap.DynamicPrecisionScheduler(model, monitor_window=4, monitor_steps=2, accuracy_budget=0.05, formats=("fp32", "bf16", "fp8_e4m3"),
                                       search_slice=None, search_timeout_s=20)
    losses = []
    for _ in range(30):
        with sch.precision_context():
            loss = model(**batch).loss
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sch.last_search_error is None and sch.phase == "planned"
    assert losses[-1] < 0.9 * losses[0]
    sch.close()


# -- a model that checkpoints its own blocks (torch.utils.checkpoint in its forward) -------------


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc, self.out, self.drop = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.out(torch.relu(self.fc(self.norm(x)))))


class Net(nn.Module):
    """Blocks checkpointed by the model's own forward while training: ``how`` is None (not
    checkpointed), "non-reentrant", "reentrant" or "wrapper" (torch's checkpoint_wrapper around
    each block, non-reentrant, as torchtitan applies activation checkpointing)."""

    def __init__(self, how=None, d=32, n=2):
        super().__init__()
        self.how = how
        self.inp, self.head = nn.Linear(16, d), nn.Linear(d, 4)
        blocks = [Block(d) for _ in range(n)]
        self.blocks = nn.ModuleList(checkpoint_wrapper(b) if how == "wrapper" else b for b in blocks)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.how in ("non-reentrant", "reentrant") and self.training:
                h = checkpoint(block, h, use_reentrant=self.how == "reentrant")
            else:
                h = block(h)
        return self.head(h)


def net(how=None):
    torch.manual_seed(0)
    return Net(how)


def batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


_EXAMPLE = (torch.zeros(1, 16),)
PLANS = {
    "fp32": lambda m: ap.Plan.uniform(m, "fp32", _EXAMPLE),
    "bf16": lambda m: ap.Plan.uniform(m, "bf16", _EXAMPLE),
    "fp8-current": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE),
    "fp8-delayed": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE, scaling=ap.Scaling(mode="delayed")),
    "fp8-rows": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE, scaling=ap.Scaling(granularity="row")),
    "int8": lambda m: ap.Plan.uniform(m, "int8", _EXAMPLE, calibration=ap.Calibration(batches=2)),
    "mixed": lambda m: _mixed(ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE)),
}


def _mixed(plan):
    # checkpoint_wrapper puts each block under "_checkpoint_wrapped_module".
    fc = next(fqn for fqn in plan.layers if fqn.startswith("blocks.1.") and fqn.endswith(".fc"))
    return plan.with_layers({"inp": "fp32", "head": "bf16", fc: "int8"})


def hand_gradients(model, plan, recompute=()):
    """Per step, the gradients of three SGD steps under ``plan`` applied by hand (`apply_plan`);
    dropout draws alike in every run (the RNG seeded the same)."""
    runtime = ap.apply_plan(model, plan.with_recompute(recompute))
    torch.manual_seed(2)
    grads = []
    for x, y in batches():
        model.zero_grad(set_to_none=True)
        with runtime:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    runtime.remove()
    return grads


def assert_bitwise(a, b):
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y), (x - y).abs().max()


@functools.cache
def unchekpointed_gradients(name):
    model = net()
    return hand_gradients(model, PLANS[name](model))


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "wrapper"])
@pytest.mark.parametrize("name", list(PLANS))
def test_the_users_own_checkpoint_recomputes_under_the_plan_with_the_forwards_scales(name, how):
    """Bit for bit the gradients of the same plan without checkpointing, over three steps: the
    recomputation ran in the plan's formats with the scales the forward chose, and state a forward
    updates (delayed scaling's amax history, INT8 calibration) was updated once per forward."""
    model = net(how)
    assert_bitwise(hand_gradients(model, PLANS[name](model)), unchekpointed_gradients(name))


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_a_planned_recomputed_block_inside_the_users_checkpoint_is_recomputed_once(how):
    model = net(how)
    plan = PLANS["fp8-delayed"](model)
    calls = []
    model.blocks[0].fc.register_forward_hook(lambda *_: calls.append(1))
    assert_bitwise(hand_gradients(model, plan, recompute=("blocks.0",)), unchekpointed_gradients("fp8-delayed"))
    assert len(calls) == 2 * 3  # per step: the forward, the user's recomputation; no second checkpoint inside


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_the_profiler_sees_each_checkpointed_forward_and_gradient_once(how):
    """Statistics of the profiling window: a reentrant checkpoint's forward runs without gradients
    and its gradient flows through the recomputation; each is still counted once."""

    def profile(model):
        runtime = ap.apply_plan(model, PLANS["fp8-current"](model))
        profiler = LayerProfiler(model, window=3).attach()
        torch.manual_seed(2)
        for x, y in batches():
            with runtime:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            profiler.step()
            model.zero_grad(set_to_none=True)
        return profiler.profile()

    plain, checkpointed = profile(net()), profile(net(how))
    assert plain.layers.keys() == checkpointed.layers.keys()
    for fqn, a in plain.layers.items():
        b = checkpointed.layers[fqn]
        for kind in ("activation", "grad"):
            assert b.tensors[kind].calls == a.tensors[kind].calls == 3, (fqn, kind)
            assert b.tensors[kind].amax == a.tensors[kind].amax, (fqn, kind)


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_the_seed_loop_plans_a_model_that_checkpoints_its_own_blocks(how):
    """The README loop, recomputation on (the default): probe, trial and planned steps all run
    lowered formats through the model's own checkpoints. Before: a CheckpointError at step 4 of
    the search ("saved as float32, recomputed as bfloat16")."""
    model = net(how)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sch = ap.DynamicPrecisionScheduler(model, monitor_window=4, monitor_steps=2, accuracy_budget=0.05, memory_budget=0.97,
                                       formats=("fp32", "bf16", "fp8_e4m3", "int8"), search_slice=None, search_timeout_s=20)
    g = torch.Generator().manual_seed(3)
    try:
        # The measured trials take more steps on a busy machine: up to 120, stopping 4 steps into the plan.
        planned_steps = 0
        for _ in range(120):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with sch.precision_context():
                loss = nn.functional.cross_entropy(model(x), y)
            sch.backward(loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
            planned_steps += sch.phase == "planned"
            if planned_steps == 4 or sch.last_search_error is not None:
                break
        assert sch.last_search_error is None and planned_steps == 4
        assert any(lp.format.value != "fp32" for lp in sch.plan.layers.values())
    finally:
        sch.close()
