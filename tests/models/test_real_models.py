"""Real `transformers` models, built from tiny configs (no download) and called the way their
users call them (keyword arguments, a ``ModelOutput`` with a ``loss``), trained under
`DynamicPrecisionScheduler` until it plans: a decoder LM whose projections are GPT-2's
``Conv1D`` (``torch.addmm`` on an (in, out) weight), an encoder classifier with a padding
attention mask, a vision transformer with a convolutional patch embedding, a mixture of
experts (Mixtral: the experts' (experts, out, in) weights in one module, run by
transformers' default grouped GEMM, which no autocast casts), and CLIP's two towers (a
contrastive loss read from its second output, ``logits_per_text``)."""

import contextlib
import copy
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autoprec as ap  # noqa: E402
from autoprec.runtime import EmulationWarning  # noqa: E402
from autoprec.scheduler import DynamicPrecisionScheduler  # noqa: E402
from support.products import ProductLog  # noqa: E402
from support.real_models import WEIGHT_LAYERS, bert, gpt2, vit  # noqa: E402

transformers.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids

WINDOW = 4
STEPS = 3 * WINDOW


def mixtral():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    return transformers.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def clip():
    cfg = transformers.CLIPConfig(text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 2, "max_position_embeddings": 16},
                                  vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                 "image_size": 16, "patch_size": 4}, projection_dim=16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 12), generator=gen)
    return transformers.CLIPModel(cfg), {"input_ids": ids, "pixel_values": torch.randn(8, 3, 16, 16, generator=gen), "return_loss": True}


@pytest.fixture(scope="module", params=[gpt2, bert, vit, mixtral, clip], ids=lambda f: f.__name__)
def trained(request):
    """``STEPS`` steps on one batch (the loss can only fall by learning it) with a memory budget
    that FP32 misses and formats only (``recompute=[]``: FP32 with blocks recomputed, which meets
    it and is fastest on a CPU, is a plan of its own), so the plan must lower layers (0.82: formats
    alone reach 0.800 of the FP32 bytes on the Mixtral, whose experts' gradient buffers stay FP32)."""
    torch.manual_seed(0)
    model, batch = request.param()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(
        model, monitor_window=WINDOW, monitor_steps=2, memory_budget=0.82, formats=("fp32", "bf16", "fp8_e4m3"),
        measure_costs=False, search_slice=None, search_timeout_s=20, recompute=[],
    )
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EmulationWarning)
        for step in range(STEPS):
            # The last (planned) step's forward runs under a log of its matrix products.
            with sch.precision_context(), ProductLog(model) if step == STEPS - 1 else contextlib.nullcontext() as log:
                out = model(**batch)
            sch.backward(out.loss)
            sch.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
    emulated = {m.group(1) for w in caught if (m := re.search(r"layer '([^']+)' runs .+? in \S+ emulated", str(w.message)))}
    yield model, sch, losses, (log, emulated)
    sch.close()


@pytest.mark.slow
def test_the_scheduler_reaches_a_plan_that_lowers_layers(trained):
    _, sch, _, _ = trained
    assert sch.last_search_error is None and sch.phase == "planned"
    assert any(lp.format.value != "fp32" for lp in sch.plan.layers.values())


@pytest.mark.slow
def test_the_loss_falls_under_the_plan(trained):
    _, _, losses, _ = trained
    planned = losses[WINDOW:]
    assert planned[-1] < 0.9 * planned[0]


@pytest.mark.slow
def test_the_plan_covers_every_weight_layer(trained):
    model, sch, _, _ = trained
    weight_layers = {fqn for fqn, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)}
    assert weight_layers and weight_layers <= set(sch.plan.layers)


@pytest.mark.slow
def test_no_matrix_product_runs_outside_the_plan(trained):
    # Every aten matrix product of a planned forward ran inside a planned layer, in its format:
    # FP32 / BF16 operands as planned, FP8 through _scaled_mm or, where the runtime warned it
    # emulates, FP32 compute.
    _, sch, _, (log, emulated) = trained
    assert log.products
    assert log.outside_plan({fqn: lp.format.value for fqn, lp in sch.plan.layers.items()}, emulated) == []


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3", "int8"])
def test_weights_stored_in_bf16_run_every_format(fmt):
    """A model loaded in BF16 (``torch_dtype=torch.bfloat16``, or a LoRA's frozen BF16 base):
    FP32 layers compute in FP32 with the BF16 weight cast up (before, ``F.linear`` refused the
    mixed dtypes), the others as planned; the loss is the FP32-upcast model's within the format's
    rounding, and the products ran in the plan's formats."""
    torch.manual_seed(0)
    model, batch = gpt2()
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model).float()(**batch).loss.item()
    plan = ap.Plan.uniform(model, fmt, batch)
    sch = DynamicPrecisionScheduler.from_plan(model, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EmulationWarning)
        with sch.precision_context():  # the first forward binds the plan (a trace runs the model as it is)
            model(**batch)
        with sch.precision_context(), ProductLog(model) as log:
            loss = model(**batch).loss
    sch.backward(loss)
    emulated = {m.group(1) for w in caught if (m := re.search(r"layer '([^']+)' runs .+? in \S+ emulated", str(w.message)))}
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert loss.item() == pytest.approx(reference, rel={"fp32": 1e-4, "bf16": 2e-2}.get(fmt, 5e-2))
    assert log.outside_plan({fqn: lp.format.value for fqn, lp in plan.layers.items()}, emulated) == []
    sch.close()
