"""The seed's API on the models people train: ``DynamicPrecisionScheduler(min_precision=8,
max_precision=32, monitor_window=...)`` with no ``model=``, and ``with
scheduler.precision_context(): outputs = model(**batch)``.

Hugging Face GPT-2, Llama, BERT and ViT, built from tiny configs (no download), each called the
way its users call it (keyword arguments, ``**batch``, a positional input with keywords, ``labels=``
so that it returns its loss; a ``ModelOutput`` or a tuple), are trained to a plan with 8-bit
layers under a memory budget that needs them, and end within the accuracy budget of the same
steps in plain FP32."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoprec.calls import ModelCall, loss_of  # noqa: E402
from autoprec.formats import Format  # noqa: E402
from autoprec.runtime import EmulationWarning  # noqa: E402
from autoprec.scheduler import DynamicPrecisionScheduler  # noqa: E402
from support.real_models import WEIGHT_LAYERS, bert, gpt2, vit  # noqa: E402

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids

WINDOW = 3
STEPS = 3 * WINDOW
ACCURACY = 0.01  # the accuracy budget: allowed loss increase relative to the first window's
EIGHT_BIT = {Format.INT8, Format.FP8_E4M3, Format.FP8_E5M2}


def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


# Each model called as its users call it.
CALLS = {
    "gpt2": lambda model, b: model(input_ids=b["input_ids"], labels=b["labels"]),  # keywords only
    "llama": lambda model, b: model(**b),  # **batch with an attention mask
    # positional and keyword inputs mixed, a padding mask that matters, a (loss, logits) tuple
    "bert": lambda model, b: model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], return_dict=False),
    "vit": lambda model, b: model(**b),  # pixel_values=, labels=: a convolutional patch embedding
}


# Memory budgets (fractions of FP32's bytes) that no plan of 16-bit formats meets (the smallest
# such plan needs 0.67 for GPT-2, 0.84 Llama, 0.85 BERT, 0.80 ViT), so the plan must hold 8-bit
# layers; Llama's smallest plan with them needs 0.64. Formats only (``recompute=[]``): by default
# the search may recompute blocks instead, and on this CPU 16-bit layers recomputed are faster.
MEMORY = {"gpt2": 0.6, "llama": 0.7, "bert": 0.6, "vit": 0.6}


def _fp32_losses(model, batch, call):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = loss_of(call(model, batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module", params=[gpt2, llama, bert, vit], ids=lambda f: f.__name__)
def trained(request):
    """``STEPS`` steps on one batch through the seed's API, and the same steps in plain FP32 from
    the same weights."""
    torch.manual_seed(0)
    model, batch = request.param()
    call = CALLS[request.param.__name__]
    initial = copy.deepcopy(model)
    reference = _fp32_losses(copy.deepcopy(model), batch, call)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = DynamicPrecisionScheduler(min_precision=8, max_precision=32, monitor_window=WINDOW, memory_budget=MEMORY[request.param.__name__],
                                          accuracy_budget=ACCURACY, measure_costs=False, search_slice=None, search_timeout_s=20, recompute=[])
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # no FP8 / INT8 kernel for attention on CPU
        for _ in range(STEPS):
            with scheduler.precision_context():
                outputs = call(model, batch)
            scheduler.backward(outputs)  # its loss field, or a tuple's first element
            scheduler.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append(loss_of(outputs).item())
    yield model, initial, scheduler, losses, reference
    scheduler.close()


def test_the_scheduler_binds_to_the_model_and_captures_its_whole_call(trained):
    model, initial, scheduler, _, reference = trained
    assert scheduler.model is model
    # The captured call, replayed on the initial weights, is the first step's: the same loss
    # (labels, mask and positional inputs all captured).
    example = ModelCall.from_state(scheduler.state_dict()["example"])
    with torch.no_grad():
        assert loss_of(example(initial)).item() == pytest.approx(reference[0], rel=1e-6)


def test_the_plan_has_8_bit_layers_and_covers_every_weight_layer(trained):
    model, _, scheduler, _, _ = trained
    assert scheduler.last_search_error is None and scheduler.phase == "planned"
    assert EIGHT_BIT & {lp.format for lp in scheduler.plan.layers.values()}
    weight_layers = {fqn for fqn, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)}
    assert weight_layers and weight_layers <= set(scheduler.plan.layers)


def test_the_final_loss_is_within_the_accuracy_budget_of_fp32(trained):
    _, _, _, losses, reference = trained
    assert losses[-1] < losses[0]  # it trained
    assert abs(losses[-1] - reference[-1]) <= ACCURACY * reference[-1]
