"""Blocks a plan recomputes (issue 24): real ``torch.utils.checkpoint`` (non-reentrant) under the
plan's formats. Gradients equal those without recomputation bit for bit; state a forward updates
is updated once; eager, ``torch.compile`` (aot_eager: Dynamo and AOTAutograd as torch.compile runs
them) and the context's restoration. DDP / FSDP2: `tests/test_runtime_recompute_distributed.py`.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import autoprec as ap
from autoprec.errors import RuntimeStateError
from autoprec.scaling.nonfinite import OutputWatch
from autoprec.opcount import graph_breaks
from autoprec.workloads.bytelm import ByteLM, LMConfig

# Dropout on everywhere (embeddings, attention, residuals): recomputation must redraw the same masks.
CONFIG = LMConfig(context=16, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.2)
BLOCKS = ("blocks.0", "blocks.1")
STEPS = 3


@pytest.fixture(autouse=True)
def _no_emulation_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        yield


def _lm():
    torch.manual_seed(0)
    return ByteLM(CONFIG)


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)) for _ in range(steps)]


# Traced with an example input, so the attention modules (their own q @ k^T and att @ v) are
# layers too: their matrix products run through the runtime's per-layer mode inside the blocks.
_EXAMPLE = (torch.zeros(1, 16, dtype=torch.long),)
PLANS = {
    "fp32": lambda m: ap.Plan.uniform(m, "fp32", _EXAMPLE),
    "bf16": lambda m: ap.Plan.uniform(m, "bf16", _EXAMPLE),
    "fp8-current": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE),
    "fp8-delayed": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE, scaling=ap.Scaling(mode="delayed")),
    "int8": lambda m: ap.Plan.uniform(m, "int8", _EXAMPLE, calibration=ap.Calibration(batches=2)),
    # An FP32 attention holding lowered projections, a BF16 layer among FP8 ones.
    "mixed": lambda m: ap.Plan.uniform(m, "fp8_e4m3", _EXAMPLE).with_layers({"blocks.0.attn": "fp32", "blocks.1.mlp.fc": "bf16"}),
}


def _train(model, plan, blocks, step_fn=None, batches=None):
    """STEPS SGD steps of ``model`` under ``plan`` with ``blocks`` recomputed; per step the
    gradients, the runtime. The RNG is seeded the same for every run: dropout draws alike."""
    runtime = ap.apply_plan(model, plan.with_recompute(blocks))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    grads = []
    for idx, tgt in batches or _batches():
        opt.zero_grad(set_to_none=True)
        with runtime:
            _, loss = model(idx, tgt)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, runtime


def _assert_bitwise(a, b):
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y), (x - y).abs().max()


def _saved_bytes(model, plan, blocks):
    """Activation bytes (parameters left out) the autograd graph of one forward keeps for the
    backward. Checkpoint's own hooks take a recomputed block's saved tensors before this outer
    meter sees them, and keep only the block's inputs."""
    runtime = ap.apply_plan(model, plan.with_recompute(blocks))
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t.detach()  # as autoprec.saved_bytes.keep_for_backward: the tensor itself would cycle through autograd

    idx, tgt = _batches()[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), runtime:
        model(idx, tgt)[1].backward()
    runtime.remove()
    return total


# -- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_gradients_with_recomputation_equal_plain_pytorchs_bit_for_bit(name):
    """FP32 plan vs the plain model; uniform BF16 plan vs plain ``torch.autocast`` (which it is
    exactly): the same dropout masks, the same ops, so the same bits."""
    model = _lm()
    reference = copy.deepcopy(model)
    grads, _ = _train(model, PLANS[name](model), BLOCKS)
    scope = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if name == "bf16" else torch.enable_grad
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(2)
    plain = []
    for idx, tgt in _batches():
        opt.zero_grad(set_to_none=True)
        with scope():
            _, loss = reference(idx, tgt)
        loss.backward()
        plain.append([p.grad.clone() for p in reference.parameters()])
        opt.step()
    _assert_bitwise(grads, plain)


@pytest.mark.parametrize("name", list(PLANS))
def test_gradients_with_recomputation_equal_those_without_bit_for_bit(name):
    """FP8 and INT8 too, eagerly: the recomputation reads back the scales its forward chose
    (delayed histories, INT8 calibration) and runs the same kernels on the same inputs, so even
    the low formats' rounding repeats exactly; no tolerance is needed. (Under torch.compile the
    same holds, see below.)"""
    with_rc, _ = _train(_lm(), PLANS[name](_lm()), BLOCKS)
    without, _ = _train(_lm(), PLANS[name](_lm()), ())
    _assert_bitwise(with_rc, without)


@pytest.mark.parametrize("name", ["bf16", "fp8-current"])
def test_recomputed_blocks_keep_only_their_inputs_for_the_backward(name):
    """The recomputation is real: recomputing both blocks frees each block's activations but its
    input (one (4, 16, 32) FP32 tensor); recomputing one block frees about half as much."""
    model = _lm()
    plan = PLANS[name](model)
    kept, one, both = (_saved_bytes(model, plan, blocks) for blocks in ((), ("blocks.1",), BLOCKS))
    block_input = 4 * 16 * 32 * 4
    freed_one, freed_both = kept - one, kept - both
    assert freed_one > 4 * block_input
    assert freed_both == pytest.approx(2 * freed_one, rel=0.05)


def _llama(use_cache=False):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.2, use_cache=use_cache)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "default_cache"])
def test_a_hugging_face_llama_built_from_its_config_gets_the_same_gradients(name, use_cache):
    """With its cache on too (the default in training): each recomputed block runs on a copy of
    the cache holding its own layer as the forward found it, the other layers shared; the
    gradients and the keys and values the forward left in the user's cache are those without
    recomputation."""
    model = _llama(use_cache)
    blocks = ap.find_blocks(model, ap.Plan.uniform(model, "fp32").layers)
    assert blocks == ("model.layers.0", "model.layers.1", "model.layers.2")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for recompute in (blocks, ()):
        m = copy.deepcopy(model)
        runtime = ap.apply_plan(m, ap.Plan.uniform(m, name).with_recompute(recompute))
        torch.manual_seed(4)
        with runtime:
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        cache = [] if not use_cache else [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        assert len(cache) == (6 if use_cache else 0) and all(t.shape[-2] == 12 for t in cache)
        results.append([[p.grad.clone() for p in m.parameters()] + [t.detach() for t in cache]])
    _assert_bitwise(*results)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_an_encoder_decoder_whose_blocks_change_its_kv_cache_gets_the_same_gradients(name):
    """T5 with its defaults: the decoder's self-attention appends to the KV cache, its
    cross-attention fills the cache once and marks it filled. The recomputation runs on the cache
    as the block's forward found it; run on the changed one, the cross-attention skipped its key
    and value projections ("A different number of tensors was saved", torch 2.11 and 2.13)."""
    from support import hf_models

    torch.manual_seed(0)
    model, batch = hf_models.t5()
    blocks = ap.find_blocks(model, ap.Plan.uniform(model, "fp32").layers)
    assert blocks == ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    results = []
    for recompute in (blocks, ()):
        m = copy.deepcopy(model)
        runtime = ap.apply_plan(m, ap.Plan.uniform(m, name).with_recompute(recompute))
        with runtime:
            loss = m(**batch).loss
        loss.backward()
        results.append([[p.grad.clone() for p in m.parameters()]])
    _assert_bitwise(*results)


# -- state updated once -----------------------------------------------------------------------


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if torch.is_tensor(t)]


def test_delayed_scaling_histories_record_each_forward_once():
    runs = [_train(_lm(), PLANS["fp8-delayed"](_lm()), blocks)[1].state_dict() for blocks in (BLOCKS, ())]
    history = runs[0]["layers"]["blocks.0.mlp.fc"]["inputs"]["blocks.0.mlp.fc.weight"]["history"]
    assert int((history > 0).sum()) == STEPS  # one amax per step, not two
    assert all(torch.equal(a, b) for a, b in zip(_tensors(runs[0]), _tensors(runs[1]), strict=True))


def test_int8_calibration_observes_each_forward_once():
    plan = ap.Plan.uniform(_lm(), "int8", _EXAMPLE, calibration=ap.Calibration(batches=STEPS + 1))
    runtimes = [_train(_lm(), plan, blocks)[1] for blocks in (BLOCKS, ())]
    calibrators = [rt._layers["blocks.1.attn.qkv"].calibrators["blocks.1.attn.qkv.weight"] for rt in runtimes]
    assert [c.observed for c in calibrators] == [STEPS, STEPS]  # still calibrating: a double count would freeze it
    assert all(c.calibrating for c in calibrators)
    states = [rt.state_dict() for rt in runtimes]
    assert all(torch.equal(a, b) for a, b in zip(_tensors(states[0]), _tensors(states[1]), strict=True))


def test_the_profilers_statistics_count_each_forward_once():
    profiles = []
    for blocks in (BLOCKS, ()):
        model = _lm()
        profiler = ap.LayerProfiler(model, window=STEPS, every=1).attach()
        runtime = ap.apply_plan(model, PLANS["bf16"](model).with_recompute(blocks))
        torch.manual_seed(2)
        for idx, tgt in _batches():
            with runtime:
                _, loss = model(idx, tgt)
            loss.backward()
            profiler.step()
        profiles.append(profiler.profile().to_dict())
    activation = profiles[0]["layers"]["blocks.0.mlp.fc"]["tensors"]["activation"]
    assert activation["calls"] == STEPS
    assert profiles[0]["layers"] == profiles[1]["layers"]


def test_the_loss_scalers_output_watch_records_each_forward_once():
    records = []
    for blocks in (BLOCKS, ()):
        model = _lm()
        runtime = ap.apply_plan(model, PLANS["fp8-current"](model).with_recompute(blocks))
        idx, tgt = _batches()[0]
        torch.manual_seed(2)
        with OutputWatch(model) as watch:
            with runtime:
                _, loss = model(idx, tgt)
            loss.backward()  # the recomputation runs here, its hooks still attached
        names, flags = watch.records()
        records.append((names, [bool(f) for f in flags]))
    assert records[0] == records[1]
    assert records[0][0].count("blocks.0.mlp.fc") == 1


# -- torch.compile ----------------------------------------------------------------------------

# Layers from the module tree (every one an nn.Linear): inside a compiled recomputed block no layer
# may need the runtime's mode for its own matrix products (see the refusal below).
COMPILE_PLANS = {
    "fp32": lambda m: ap.Plan.uniform(m, "fp32"),
    "bf16": lambda m: ap.Plan.uniform(m, "bf16", _EXAMPLE),  # attention traced too: a uniform BF16 plan wraps nothing
    "fp8-current": lambda m: ap.Plan.uniform(m, "fp8_e4m3"),
    # The forward updates the amax history in place; the recomputation must scale as the forward did.
    "fp8-delayed": lambda m: ap.Plan.uniform(m, "fp8_e4m3", scaling=ap.Scaling(mode="delayed")),
    "fp8-delayed-most-recent": lambda m: ap.Plan.uniform(m, "fp8_e4m3", scaling=ap.Scaling(mode="delayed", reduction="most_recent")),
    "int8": lambda m: ap.Plan.uniform(m, "int8", calibration=ap.Calibration(batches=1)),
    # FP32, BF16 and FP16 layers run under their own autocast scope among FP8 and INT8 ones.
    "mixed": lambda m: ap.Plan.uniform(m, "fp8_e4m3").with_layers({
        "blocks.1.mlp.fc": "bf16", "blocks.0.mlp.proj": "fp32", "blocks.1.attn.qkv": "fp16",
        "blocks.0.attn.proj": ap.LayerPrecision("int8", calibration=ap.Calibration(batches=1)),
    }),
}


# FP32 attention modules (traced: their own q @ k^T and att @ v are layers, routed by the runtime's
# mode) holding FP8 projections, in a BF16 region.
MODE_PLAN = {"mode": lambda m: ap.Plan.uniform(m, "bf16", _EXAMPLE).with_layers(
    {"blocks.0.attn": "fp32", "blocks.0.attn.qkv": "fp8_e4m3", "blocks.0.attn.proj": "fp8_e4m3", "blocks.1.attn": "fp32"}
)}
# Compiled from the first step: quantizers made and INT8 calibrated (2 batches, frozen in the 3rd)
# inside the compiled recomputed blocks.
FIRST_STEPS_PLANS = {
    "first-fp8-delayed": lambda m: ap.Plan.uniform(m, "fp8_e4m3", scaling=ap.Scaling(mode="delayed")),
    "first-int8": lambda m: ap.Plan.uniform(m, "int8", calibration=ap.Calibration(batches=2)),
}


def _compiled_run(name, blocks, eager_first=True, steps=STEPS):
    """``eager_first``: one eager step (quantizers made, INT8 calibration frozen at batches=1),
    then ``steps`` compiled steps with the region inside the compiled function; their gradients."""
    model = _lm()
    plan = {**COMPILE_PLANS, **MODE_PLAN, **FIRST_STEPS_PLANS}[name](model)
    runtime = ap.apply_plan(model, plan.with_recompute(blocks))

    def step(idx, tgt):
        with runtime.region():
            return model(idx, tgt)[1]

    if eager_first:
        step(*_batches()[0]).backward()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # fullgraph: raises on any graph break
    torch.manual_seed(2)
    grads = []
    for idx, tgt in _batches(steps):
        for p in model.parameters():
            p.grad = None
        compiled(idx, tgt).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    torch._dynamo.reset()
    return grads, runtime, step


@pytest.mark.parametrize("name", list(COMPILE_PLANS))
def test_a_compiled_step_with_recomputed_blocks_has_no_graph_break(name):
    _, runtime, step = _compiled_run(name, BLOCKS)
    breaks = graph_breaks(step, *_batches()[0])
    assert (breaks.graphs, breaks.breaks) == (1, 0), "\n".join(breaks.reasons)


@pytest.mark.parametrize("name", list(COMPILE_PLANS))
def test_compiled_gradients_with_recomputation_equal_compiled_ones_without(name):
    """The compiled backward recomputes the blocks from the forward's values (dropout's RNG
    included): the same bits as the compiled step that keeps the activations."""
    with_rc, runtime_rc, _ = _compiled_run(name, BLOCKS)
    without, runtime, _ = _compiled_run(name, ())
    _assert_bitwise(with_rc, without)
    # Each compiled forward recorded its amax once: the histories match the run without recomputation.
    histories = [_histories(r) for r in (runtime_rc, runtime)]
    assert histories[0].keys() == histories[1].keys()
    for key, history in histories[0].items():
        assert torch.equal(history, histories[1][key]), key
    if name.startswith("fp8-delayed"):
        assert histories[0] and all(int((h > 0).sum()) == 1 + STEPS for h in histories[0].values())


def _histories(runtime):
    layers = runtime.state_dict()["layers"]
    return {(fqn, k): q["history"] for fqn, layer in layers.items() for k, q in layer["inputs"].items() if q["history"] is not None}


@pytest.mark.parametrize(
    "name, eager_first, message",
    [
        # The FP32 attention's own matmuls (q @ k^T, att @ v) are routed by the runtime's mode, which
        # reads the running layer from a stack in thread state.
        ("mode", True, r"layer 'blocks.0.attn' \(fp32\) routes its own matrix products through the runtime's mode"),
        ("first-fp8-delayed", False, r"layer 'blocks.0.attn.qkv' has not run yet"),
        ("first-int8", True, r"layer 'blocks.0.attn.qkv' is still calibrating INT8"),  # one eager batch of two
    ],
)
def test_python_state_a_compiled_recomputed_block_would_change_is_refused_naming_the_layer_and_the_fix(name, eager_first, message):
    """Dynamo refuses Python state changed inside a checkpointed body unless told not to replay it
    in the recomputation. With fullgraph=True the refusal is the error; without, Dynamo runs the
    block eagerly, where the recomputation replays the plan."""
    model = _lm()
    runtime = ap.apply_plan(model, {**MODE_PLAN, **FIRST_STEPS_PLANS}[name](model).with_recompute(["blocks.0"]))

    def step(idx, tgt):
        with runtime.region():
            return model(idx, tgt)[1]

    if eager_first:
        step(*_batches()[0]).backward()
    torch._dynamo.reset()
    fix = r".*set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"recomputed block 'blocks.0' under torch.compile: " + message + fix):
        torch.compile(step, backend="aot_eager", fullgraph=True)(*_batches()[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("name, eager_first", [("mode", True), ("first-fp8-delayed", False), ("first-int8", False)])
def test_with_dynamo_not_replaying_side_effects_every_plan_compiles_in_recomputed_blocks_from_the_first_step(name, eager_first):
    """What the refusals above propose: the layer stack's changes are undone within each layer's
    call, and quantizers made or INT8 observations taken in a compiled forward are not needed
    again by its recomputation (it recomputes from the forward's values). The step compiles
    whole, and the gradients and the runtime's state (amax histories, calibration) are those of
    the compiled step without recomputation, bit for bit."""
    steps = 4  # first-int8: two calibrating steps, the freeze, one calibrated step
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        with_rc, runtime_rc, step = _compiled_run(name, BLOCKS, eager_first, steps)
        without, runtime, _ = _compiled_run(name, (), eager_first, steps)
        states = [pytree.tree_leaves(r.state_dict()) for r in (runtime_rc, runtime)]
        breaks = graph_breaks(step, *_batches()[0])  # (another forward: after the states are taken)
    assert (breaks.graphs, breaks.breaks) == (1, 0), "\n".join(breaks.reasons)
    _assert_bitwise(with_rc, without)
    assert len(states[0]) == len(states[1]) > (0 if name == "mode" else 8)
    for a, b in zip(*states):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b


# -- the context and its restoration ----------------------------------------------------------


def test_exit_and_remove_restore_the_blocks_forward_exactly():
    model = _lm().eval()  # no dropout: outputs comparable run to run
    block = model.blocks[0]
    own = lambda x: type(block).forward(block, x) * 1.0  # noqa: E731  a user's instance forward
    block.forward = own
    runtime = ap.apply_plan(model, PLANS["fp32"](model).with_recompute(BLOCKS))
    assert block.__dict__["forward"] is not own  # installed once, while the runtime lives
    idx = _batches()[0][0]
    with torch.no_grad():
        plain = copy.deepcopy(model)(idx)[0]
    with pytest.raises(ValueError, match="boom"):
        with runtime:
            model(idx)
            raise ValueError("boom")
    assert not runtime.active
    with torch.no_grad():
        assert torch.equal(model(idx)[0], plain)  # outside the context: the module's own forward
    runtime.remove()
    assert block.__dict__["forward"] is own
    assert "forward" not in model.blocks[1].__dict__


def test_a_backward_after_remove_is_refused_in_one_line():
    model = _lm()
    runtime = ap.apply_plan(model, PLANS["bf16"](model).with_recompute(BLOCKS))
    idx, tgt = _batches()[0]
    with runtime:
        _, loss = model(idx, tgt)
    runtime.remove()
    with pytest.raises(RuntimeStateError) as info:
        loss.backward()
    message = str(info.value)
    assert "\n" not in message and "run loss.backward() before runtime.remove()" in message


def test_recomputation_runs_only_in_the_thread_that_entered_the_plan():
    """Outside the context or under no_grad the block runs its own forward: no checkpoint."""
    model = _lm()
    runtime = ap.apply_plan(model, PLANS["fp32"](model).with_recompute(BLOCKS))
    plan_saved = _saved_bytes(model, PLANS["fp32"](model), BLOCKS)
    kept = 0

    def pack(t):
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t.detach()  # this forward is never backpropagated: the tensor itself would keep its graph for good

    idx, tgt = _batches()[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, tgt)  # the runtime is installed but not entered
    runtime.remove()
    assert kept > 2 * plan_saved


def test_a_recomputed_block_called_by_keyword_keeps_its_dropout_masks():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

        def forward(self, hidden, scale=1.0):
            return hidden + self.fc2(self.drop(torch.relu(self.fc1(hidden)))) * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(hidden=x, scale=0.5)
            return x

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    grads = []
    for blocks in (("layers.0", "layers.1"), ()):
        m = copy.deepcopy(net)
        plan = ap.Plan.uniform(m, "fp32")
        assert ap.find_blocks(m, plan.layers) == ("layers.0", "layers.1")
        runtime = ap.apply_plan(m, plan.with_recompute(blocks))
        torch.manual_seed(5)
        with runtime:
            out = m(x)
        out.pow(2).sum().backward()
        grads.append([[p.grad.clone() for p in m.parameters()]])
    _assert_bitwise(*grads)


# -- a block that is a layer too ----------------------------------------------------------------

# Each attention module is a layer (its own q @ k^T and att @ v) holding layers (its projections):
# a block and a layer at once, as diffusers' Attention is (sdpa in its own forward, to_q / to_k /
# to_v / to_out children) in a UNet whose attentions the search recomputes.
LAYER_BLOCKS = ("blocks.0.attn", "blocks.1.attn")


@pytest.mark.parametrize("name", ["fp8-current", "int8", "mixed"])
def test_a_block_that_is_a_layer_too_recomputes_under_its_own_format(name):
    """Both wrappers on one module: the block's checkpoint runs the layer's planned forward, and
    the backward finds its runtime installed (it took the layer's wrapper under the block's for a
    displacement and refused every backward)."""
    model = _lm()
    plan = PLANS[name](model)
    plan.with_recompute(LAYER_BLOCKS).validate(model, _EXAMPLE)  # a layer holding layers is a block
    with_rc, runtime = _train(model, plan, LAYER_BLOCKS)
    without, _ = _train(_lm(), PLANS[name](_lm()), ())
    _assert_bitwise(with_rc, without)
    assert runtime.report()["blocks.0.attn"]["ops"] == _train(_lm(), PLANS[name](_lm()), ())[1].report()["blocks.0.attn"]["ops"]


def test_a_leaf_layer_named_as_a_block_is_still_refused():
    model = _lm()
    with pytest.raises(ap.PlanError, match="a layer, not a block"):
        PLANS["bf16"](model).with_recompute(("blocks.0.attn.qkv",)).validate(model, _EXAMPLE)
