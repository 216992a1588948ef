"""Tests for the built-in byte-level LM workload (autoprec/workloads/bytelm.py)."""

import dataclasses
import math

import pytest
import torch

from autoprec.workloads import (
    BatchSampler,
    CausalSelfAttention,
    LMConfig,
    TransformerBlock,
    default_workload,
    evaluate,
    load_corpus,
    split_corpus,
    train,
)


@pytest.fixture(scope="module")
def tiny():
    return default_workload("tiny", batch_size=16)


# --- corpus -----------------------------------------------------------------------------------


def test_corpus_is_large_and_deterministic():
    data = load_corpus()
    assert isinstance(data, bytes)
    assert len(data) > 400_000
    load_corpus.cache_clear()  # force a genuine second read, not the cached object
    assert load_corpus() == data


def test_corpus_is_english_text():
    text = load_corpus().decode("utf-8")
    assert "lambda" in text and "The" in text


def test_split_sizes_contiguous_and_disjoint():
    data = bytes(range(256)) * 40  # 10_240 bytes
    train_split, val_split = split_corpus(data, val_fraction=0.25)
    assert train_split.dtype == torch.long and val_split.dtype == torch.long
    assert train_split.numel() == 7_680 and val_split.numel() == 2_560
    # Train first, val last, nothing dropped or duplicated.
    assert torch.equal(torch.cat([train_split, val_split]), torch.tensor(list(data)))


def test_split_of_corpus_keeps_ten_percent_for_val():
    train_split, val_split = split_corpus(load_corpus())
    total = train_split.numel() + val_split.numel()
    assert total == len(load_corpus())
    assert abs(val_split.numel() / total - 0.1) < 1e-3


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        split_corpus(b"abcdef" * 10, val_fraction=fraction)


# --- config -----------------------------------------------------------------------------------


def test_presets():
    assert LMConfig.from_name("small") == LMConfig()
    tiny_cfg = LMConfig.from_name("tiny")
    assert tiny_cfg.d_model < LMConfig().d_model and tiny_cfg.context < LMConfig().context


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        LMConfig.from_name("huge")


def test_default_workload_takes_sizes_over_its_preset_as_the_gpu_search_job_does():
    """``searches/gpt_gpu.toml`` configures the built-in LM as a 12-layer d2048 GPT through the
    factory's keyword arguments; a name LMConfig has not, or sizes it refuses, are the job's
    one-line ``[workload].kwargs`` errors."""
    from pathlib import Path

    from autoprec.errors import WorkloadError
    from autoprec.job.config import load_job
    from autoprec.workload import load_workload

    job = load_job(Path(__file__).resolve().parents[2] / "searches" / "gpt_gpu.toml")
    workload = load_workload(job.factory, job.factory_kwargs)
    assert workload.batch_size == 8
    assert workload.config == LMConfig(context=1024, d_model=2048, n_heads=16, n_layers=12, d_ff=8192)
    for bad, why in (({"depth": 3}, "depth"), ({"d_model": 100, "n_heads": 3}, "divisible")):
        with pytest.raises(WorkloadError, match=why):
            load_workload("autoprec.workloads:default_workload", {"name": "tiny", **bad})


def test_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        LMConfig(d_model=100, n_heads=3)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LMConfig().d_model = 1  # type: ignore[misc]


# --- batches ----------------------------------------------------------------------------------


def test_batch_targets_are_inputs_shifted_by_one():
    data = torch.arange(1000)
    x, y = BatchSampler(data, batch_size=8, context=16, seed=0).next()
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == torch.long
    # With data = arange, every window is consecutive integers and y = x + 1 throughout.
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_cover_the_last_token():
    # 18 tokens, context 16: only two windows exist; the last ends on the final token.
    data = torch.arange(18)
    sampler = BatchSampler(data, batch_size=64, context=16, seed=0)
    x, y = sampler.next()
    assert set(x[:, 0].tolist()) == {0, 1}
    assert y.max().item() == 17


def test_sampler_seed_determines_batches():
    data = torch.arange(10_000)
    a = BatchSampler(data, 4, 8, seed=3).next()
    b = BatchSampler(data, 4, 8, seed=3).next()
    c = BatchSampler(data, 4, 8, seed=4).next()
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_sampler_state_dict_round_trip_reproduces_next_batch():
    data = torch.arange(10_000)
    sampler = BatchSampler(data, 4, 8, seed=0)
    sampler.next()
    state = sampler.state_dict()
    expected = sampler.next()
    resumed = BatchSampler(data, 4, 8, seed=99)  # different seed: state must override it
    resumed.load_state_dict(state)
    got = resumed.next()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_sampler_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    BatchSampler(torch.arange(100), 4, 8, seed=5).next()
    assert torch.equal(torch.rand(3), expected)


def test_sampler_rejects_data_shorter_than_a_window():
    with pytest.raises(ValueError, match="context"):
        BatchSampler(torch.arange(8), batch_size=2, context=8)


def test_val_batches_are_fixed(tiny):
    a, b = tiny.val_batches(n=2), tiny.val_batches(n=2)
    assert len(a) == 2
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


# --- model ------------------------------------------------------------------------------------


def test_model_output_shapes(tiny):
    model = tiny.build_model()
    x, y = tiny.train_batches().next()
    logits, loss = model(x, y)
    assert logits.shape == (tiny.batch_size, tiny.config.context, 256)
    assert loss.shape == () and loss.dtype == torch.float32
    logits_only, no_loss = model(x[:, :5])
    assert logits_only.shape == (tiny.batch_size, 5, 256) and no_loss is None


def test_initial_loss_is_near_uniform(tiny):
    # GPT-2 init (std 0.02) makes the logits almost flat, so the loss starts near ln 256 = 5.545.
    loss = evaluate(tiny.build_model(), tiny.val_batches(n=2))
    assert abs(loss - math.log(256)) < 0.15


def test_model_rejects_sequence_longer_than_context(tiny):
    model = tiny.build_model()
    too_long = torch.zeros(1, tiny.config.context + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context"):
        model(too_long)


def test_build_model_is_seeded_and_leaves_global_rng_alone(tiny):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a, b, c = tiny.build_model(7), tiny.build_model(7), tiny.build_model(8)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_gpt2_init(tiny):
    model = tiny.build_model()
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in linears if m.bias is not None]
    assert biases and all(torch.count_nonzero(b) == 0 for b in biases)


def test_attention_is_causal():
    cfg = LMConfig.from_name("tiny")
    torch.manual_seed(0)
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 10, cfg.d_model)
    x_changed = x.clone()
    x_changed[:, 6:] = torch.randn(2, 4, cfg.d_model)  # change only positions 6..9
    y, y_changed = attn(x), attn(x_changed)
    assert torch.allclose(y[:, :6], y_changed[:, :6], atol=1e-6)
    assert not torch.allclose(y[:, 6:], y_changed[:, 6:], atol=1e-3)


def test_attention_matches_sdpa_reference():
    # The explicit-matmul attention must compute the same thing as PyTorch's fused kernel.
    cfg = LMConfig.from_name("tiny")
    torch.manual_seed(0)
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 12, cfg.d_model)
    q, k, v = attn.qkv(x).split(cfg.d_model, dim=2)
    heads = lambda t: t.view(2, 12, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # noqa: E731
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(heads(q), heads(k), heads(v), is_causal=True)
    ref = attn.proj(ref.transpose(1, 2).reshape(2, 12, cfg.d_model))
    assert torch.allclose(attn(x), ref, atol=1e-5)


def test_block_runs_standalone_and_keeps_shape():
    cfg = LMConfig.from_name("tiny")
    block = TransformerBlock(cfg)
    x = torch.randn(3, 7, cfg.d_model)
    assert block(x).shape == x.shape


# --- training ---------------------------------------------------------------------------------


def test_evaluate_restores_training_mode(tiny):
    model = tiny.build_model()
    model.train()
    evaluate(model, tiny.val_batches(n=1))
    assert model.training
    model.eval()
    evaluate(model, tiny.val_batches(n=1))
    assert not model.training


def test_training_reduces_validation_loss(tiny):
    # Measured on 2 CPU cores, seeds 0-3: 5.53-5.58 -> 2.20-2.31 after 150 steps, 1.5-5 s.
    model = tiny.build_model(seed=0)
    val = tiny.val_batches()
    before = evaluate(model, val)
    losses = train(model, tiny, steps=150, seed=0)
    after = evaluate(model, val)
    assert len(losses) == 150
    assert before >= 5.0
    assert after <= 2.8


def test_training_is_deterministic(tiny):
    a = train(tiny.build_model(seed=1), tiny, steps=5, seed=1)
    b = train(tiny.build_model(seed=1), tiny, steps=5, seed=1)
    assert a == b


def test_train_enters_context_every_step(tiny):
    entered = []

    class Recorder:
        def __enter__(self):
            entered.append(torch.is_grad_enabled())

        def __exit__(self, *exc):
            return False

    train(tiny.build_model(), tiny, steps=3, context=Recorder)
    assert entered == [True, True, True]


def test_train_under_bf16_autocast_still_learns(tiny):
    model = tiny.build_model()
    losses = train(
        model, tiny, steps=40, context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


@pytest.mark.slow
def test_default_small_workload_learns_in_300_steps():
    # The quickstart's figure. Measured on 2 CPU cores: 5.57 -> 2.04 in 10-17 s.
    workload = default_workload()
    model = workload.build_model()
    val = workload.val_batches()
    before = evaluate(model, val)
    train(model, workload, steps=300)
    assert before >= 5.0
    assert evaluate(model, val) <= 2.5
