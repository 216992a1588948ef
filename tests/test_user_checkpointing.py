"""The user's own activation checkpointing (Hugging Face's ``gradient_checkpointing_enable()``,
non-reentrant ``torch.utils.checkpoint`` around each decoder layer) under a plan: its recomputation
runs in the backward, outside ``precision_context()``, so it must run under the plan as the
forward did (`runtime.recompute.user_checkpoint`). Before, the first lowered step failed in the
backward ("Recomputed values for the following tensors have different metadata") and the search
predicted FP8 layers inside checkpointed blocks to save bytes they never keep."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autoprec as ap  # noqa: E402
from autoprec.costs.memory import layer_memory  # noqa: E402
from autoprec.costs.trace import trace_model  # noqa: E402

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
    plan = ap.Plan.uniform(plain, fmt, batch)
    loss, grads = gradients(plain, batch, plan)
    loss_ckpt, grads_ckpt = gradients(checkpointed, batch, plan)
    # The recomputation replays the forward's scales: the same activations, so the same gradients.
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # close() gave the model its own checkpoint function back.
    assert all(m.__dict__["_gradient_checkpointing_func"].__module__ != "autoprec.runtime.recompute"
               for m in checkpointed.modules() if "_gradient_checkpointing_func" in m.__dict__)


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
