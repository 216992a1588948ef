"""Calls whose arguments include a KV cache (a ``transformers`` ``Cache``), which the call appends
to and whose tensors sit in the forward's graph: the sensitivity estimate's re-run of each layer,
a recorded model call replayed by tracing, and GPT-2 / Llama trained through the scheduler with
their default ``use_cache=True``."""

import collections
import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import autoprec as ap  # noqa: E402
from autoprec.calls import ModelCall  # noqa: E402
from autoprec.costs.trace import trace_model  # noqa: E402
from autoprec.coverage import find_layers  # noqa: E402
from autoprec.runtime import EmulationWarning  # noqa: E402
from autoprec.scheduler import DynamicPrecisionScheduler  # noqa: E402
from autoprec.sensitivity import estimate_sensitivity  # noqa: E402
from autoprec.sensitivity.problem import CallRecorder  # noqa: E402

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids
DynamicCache = transformers.DynamicCache


class _CachedAttention(nn.Module):
    """Attention as a ``transformers`` decoder layer writes it: append this layer's keys and
    values to the cache it is given, attend over everything the cache holds for the layer."""

    def __init__(self, layer_idx: int, width: int = 8):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, cache=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_CachedAttention(0), _CachedAttention(1)])

    def forward(self, x, cache=None):
        for layer in self.layers:
            x = x + layer(x, cache=cache)
        return x


@pytest.mark.parametrize("past", [0, 3], ids=["empty_cache", "filled_cache"])
def test_a_recorded_layer_call_with_a_cache_reruns_as_the_layer_ran_and_leaves_the_forward_alone(past):
    torch.manual_seed(0)
    model = _Decoder()
    cache = DynamicCache()
    for i in range(2 if past else 0):  # a cache the user filled before the call
        cache.update(torch.randn(2, past, 8), torch.randn(2, past, 8), i)
    x = torch.randn(2, 5, 8, requires_grad=True)
    fqns = ["layers.0", "layers.1"]
    recorder = CallRecorder(model, fqns)
    with recorder:
        loss = model(x, cache=cache).square().mean()
    recorder.take_grads(loss, keep_graph=False)  # the forward's graph is freed, as in the estimate
    for fqn in fqns:
        (call,) = recorder.calls[fqn]
        assert call.kwargs["cache"] is not cache
        for _ in range(2):  # every re-run sees the cache as the layer did, not what a re-run appended
            args, kwargs = call.inputs()
            with torch.enable_grad():
                out = recorder.modules[fqn](*args, **kwargs)
            torch.testing.assert_close(out, call.outputs[0], rtol=0, atol=0)
            grads = torch.autograd.grad(out.sum(), list(recorder.modules[fqn].parameters()))  # not through the freed graph
            assert all(torch.isfinite(g).all() for g in grads)
    assert [cache.get_seq_length(i) for i in range(2)] == [past + 5] * 2  # only the real forward appended


def test_a_captured_call_copies_the_tensors_inside_a_cache():
    cache = DynamicCache()
    keys = torch.randn(1, 2, 4, requires_grad=True) * 2  # in a graph, as a forward leaves it
    cache.update(keys, keys + 1, 0)
    call = ModelCall.capture((), {"past_key_values": cache})
    copied = call.kwargs["past_key_values"]
    assert copied is not cache and copied.layers[0] is not cache.layers[0]
    assert not copied.layers[0].keys.requires_grad
    assert copied.layers[0].keys.untyped_storage().data_ptr() != cache.layers[0].keys.untyped_storage().data_ptr()
    torch.testing.assert_close(copied.layers[0].keys, keys.detach())


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _ids(length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 64, (8, length), generator=torch.Generator().manual_seed(seed))


def test_the_sensitivity_estimate_is_the_same_with_the_cache_on_as_off():
    """The estimate re-runs each attention module; with the cache on, each re-run must see the
    cache as its layer did, so the numbers are those of the same model with the cache off."""
    torch.manual_seed(0)
    model = _gpt2()
    assert model.config.use_cache
    ids = _ids()

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        on = estimate_sensitivity(model, [ids], loss_fn, ["bf16", "int8"]).part("total")
        model.config.use_cache = False
        off = estimate_sensitivity(model, [ids], loss_fn, ["bf16", "int8"]).part("total")
    assert on.keys() == off.keys()
    assert all(v > 0 for v in off.values())
    for key in off:
        assert on[key] == pytest.approx(off[key], rel=1e-5), key


def test_a_model_call_with_past_key_values_replays_as_it_was_made():
    """``ModelCall.first`` (how ``autoprec search`` and profiling take the example) of a call
    given a filled cache: layer tracing and cost tracing replay it, every replay attends to the
    cache as the call found it, and the user's cache keeps only what the real call appended."""
    torch.manual_seed(0)
    model = _gpt2().eval()
    # transformers 5 renames the keyword past_key_values to cache (the old name warns until 5.40)
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    ids = _ids(length=6)
    with torch.no_grad():
        past = model(input_ids=_ids(length=4, seed=2)).past_key_values
        expected = model(input_ids=ids, **{name: copy.deepcopy(past)}).logits
    example = ModelCall.first(model, lambda: model(input_ids=ids, **{name: past}))
    assert past.get_seq_length() == 10  # the real call appended its 6 positions
    assert "transformer.h.0.attn.c_attn" in find_layers(model, example)
    assert trace_model(model, example).layers
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(example(model).logits, expected)
    assert past.get_seq_length() == 10


WINDOW = 3
MEMORY = {"gpt2": 0.6, "llama": 0.7}  # budgets that need 8-bit layers (as in test_seed_api)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_causal_lm_with_its_default_cache_trains_through_the_scheduler_to_a_plan(build):
    torch.manual_seed(0)
    model = build()
    assert model.config.use_cache  # the default, left on
    ids = _ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=WINDOW, memory_budget=MEMORY[build.__name__[1:]],
                                          accuracy_budget=0.01, measure_costs=False, search_slice=None, search_timeout_s=20)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # no FP8 / INT8 kernel for attention on CPU
        for _ in range(WINDOW + 1):
            with scheduler.precision_context():
                out = model(input_ids=ids, labels=ids)
            scheduler.backward(out.loss)
            scheduler.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
    scheduler.close()
    assert scheduler.last_search_error is None
    assert scheduler.phase == "planned" and scheduler.plan.layers
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# -- recomputed blocks ---------------------------------------------------------------------------


class _StateCache:
    """A cache that writes its tensors in place, as Mamba's does: each layer copies the state it
    computed into its slot and reads it back, and counts its calls."""

    def __init__(self, layers: int):
        self.states = [torch.zeros(8) for _ in range(layers)]
        self.calls = [torch.zeros(()) for _ in range(layers)]


class _StateBlock(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(8, 8)

    def forward(self, x, cache):
        h = self.fc(x)
        cache.calls[self.index].add_(1.0)
        state = cache.states[self.index]
        state.copy_(h.detach().mean(0))
        return x + h * state


class _StateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_StateBlock(i) for i in range(3)])

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x


def test_a_recomputed_block_that_writes_its_cache_in_place_recomputes_on_a_copy():
    """The recomputation runs the block on a copy of the tensors it writes in place, so the
    user's cache holds what the forward wrote (each layer called once) and the gradients are
    those of the same model without recomputation."""
    torch.manual_seed(0)
    model = _StateNet()
    x = torch.randn(4, 8)
    grads, states = [], []
    for recompute in (("layers.0", "layers.1", "layers.2"), ()):
        m = copy.deepcopy(model)
        cache = _StateCache(3)
        with ap.apply_plan(m, ap.Plan.uniform(m, "fp32").with_recompute(recompute)):
            loss = m(x, cache=cache).square().sum()
        loss.backward()
        assert [c.item() for c in cache.calls] == [1.0, 1.0, 1.0]
        grads.append([p.grad for p in m.parameters()])
        states.append(cache.states)
    for a, b in zip(grads[0] + states[0], grads[1] + states[1], strict=True):
        assert torch.equal(a, b)


def _clones_in_backward(blocks: int) -> int:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=blocks, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    plan = ap.Plan.uniform(model, "fp32")
    with ap.apply_plan(model, plan.with_recompute(ap.find_blocks(model, plan.layers))):
        loss = model(input_ids=_ids(12), labels=_ids(12)).loss
    counter = _OpCounter()
    with counter:
        loss.backward()
    return counter.counts["aten.clone.default"]


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_recomputed_blocks_share_a_cache_that_replaces_its_tensors_so_copies_grow_with_the_blocks():
    """``DynamicCache`` concatenates: it never writes a tensor it holds, so the recomputation of
    block i shares the keys and values of blocks 0..i-1 instead of cloning them (which made a
    step's copies grow with the square of the depth). Whatever the step still clones, it clones
    per block: twice the blocks, twice the clones."""
    assert _clones_in_backward(4) == 2 * _clones_in_backward(2)


def _cache_objects_walked(blocks: int) -> int:
    """Objects the recomputation's copies of the cache walk in one training step of a Llama of
    ``blocks`` recomputed decoder layers, its default cache on."""
    from autoprec import calls

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=blocks, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    plan = ap.Plan.uniform(model, "fp32")
    walked = [0]
    real = calls._isolated_contents

    def counted(*args):
        walked[0] += 1
        return real(*args)

    calls._isolated_contents = counted
    try:
        with ap.apply_plan(model, plan.with_recompute(ap.find_blocks(model, plan.layers))):
            loss = model(input_ids=_ids(12), labels=_ids(12)).loss
        loss.backward()
    finally:
        calls._isolated_contents = real
    return walked[0]


def test_the_walks_of_a_cache_by_recomputed_blocks_grow_linearly_with_the_blocks():
    """Each recomputed decoder layer copies the cache around its own layer (its attention's
    ``layer_idx``), not all of them: walked whole, a step's walks grew with the square of the
    depth (4, 8, 16 blocks: 48, 160, 576 objects; now 16, 32, 64), and at 128 blocks of
    issue 57's Llama a planned step took 1.56x the same checkpointing by hand (1.04x now)."""
    four, eight, sixteen = (_cache_objects_walked(b) for b in (4, 8, 16))
    assert sixteen - eight == 2 * (eight - four)
