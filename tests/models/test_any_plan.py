"""Any plan the search may return runs any model: a property test over random valid plans.

Hypothesis draws, for real Hugging Face models with their defaults (the KV cache on), a format
per layer out of every format (FP16 and BF16 mixed, FP8 per tensor / row / block with current
or delayed scaling and E4M3 or E5M2 gradients, calibrated INT8 with and without outlier
channels) and a set of recomputed blocks, and runs two steps of the README loop under
`DynamicPrecisionScheduler.from_plan` (the second after INT8 calibration froze): no error, a
finite loss, finite weights that moved; also for a Llama whose weights are stored in BF16 and a
mixture of experts (Mixtral). Before the boundary casts of `runtime.wrappers`, a plan
mixing FP16 and BF16 crashed GPT-2's KV cache (``Unexpected floating ScalarType in
at::autocast::prioritize``, torch 2.11 and 2.13 alike)."""

import copy
import functools
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support import hf_models  # noqa: E402
from support.readme_loop import readme_step  # noqa: E402
from autoprec.blocks import find_blocks  # noqa: E402
from autoprec.formats import Format, Granularity  # noqa: E402
from autoprec.plan import Calibration, LayerPrecision, Plan, Scaling, ScalingMode  # noqa: E402
from autoprec.runtime import EmulationWarning  # noqa: E402
from autoprec.scheduler import DynamicPrecisionScheduler  # noqa: E402

HALVES = (Format.BF16, Format.FP16)


@st.composite
def layer_precisions(draw) -> LayerPrecision:
    fmt = draw(st.sampled_from(list(Format)))
    if fmt.is_fp8:
        granularity = draw(st.sampled_from(list(Granularity)))
        mode = draw(st.sampled_from(list(ScalingMode))) if granularity is Granularity.TENSOR else ScalingMode.CURRENT
        if granularity is Granularity.MX:  # MXFP8: E4M3, FP8 gradients
            return LayerPrecision(Format.FP8_E4M3, draw(st.sampled_from([Format.FP8_E5M2, Format.FP8_E4M3])), Scaling(granularity))
        grad = draw(st.sampled_from([Format.FP8_E5M2, Format.FP8_E4M3, Format.FP32]))
        return LayerPrecision(fmt, grad, Scaling(granularity, mode, history_len=4))
    if fmt is Format.INT8:
        granularity = draw(st.sampled_from([Granularity.TENSOR, Granularity.ROW]))
        return LayerPrecision(fmt, scaling=Scaling(granularity), calibration=Calibration(batches=1, outlier_ratio=draw(st.sampled_from([None, 2.0]))))
    return LayerPrecision(fmt)


@st.composite
def plans(draw, base: Plan, blocks: tuple) -> Plan:
    layers = {fqn: draw(layer_precisions()) for fqn in base.layers}
    # Most draws mix both half types: the combination that crashed.
    if draw(st.booleans()):
        fqns = sorted(layers)
        first, second = draw(st.sampled_from(fqns)), draw(st.sampled_from(fqns))
        layers[first], layers[second] = LayerPrecision(Format.FP16), LayerPrecision(Format.BF16)
    recompute = draw(st.sets(st.sampled_from(blocks))) if blocks else set()
    return base.with_layers(layers).with_recompute(sorted(recompute))


def run_steps(model: torch.nn.Module, batch: dict, plan: Plan, steps: int = 2) -> list[float]:
    """``steps`` steps of the README loop under ``plan`` (fixed); the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scheduler = DynamicPrecisionScheduler.from_plan(model, plan)
    try:
        return [readme_step(model, batch, scheduler, optimizer) for _ in range(steps)]
    finally:
        scheduler.close()


@pytest.fixture(scope="module", params=["gpt2", "llama", "llama-bf16", "mixtral", "bert", "vit", "t5"])
def subject(request):
    """A model and its batch; ``-bf16``: its weights stored in BF16, as loaded with
    ``torch_dtype=torch.bfloat16`` (FP32 layers compute in FP32 and hand BF16 on)."""
    torch.manual_seed(0)
    name, _, stored = request.param.partition("-")
    model, batch = hf_models.MODELS[name]()
    if stored:
        model = model.to(getattr(torch, {"bf16": "bfloat16"}[stored]))
    base = Plan.uniform(model, Format.FP32, batch)
    return model, batch, base, find_blocks(model, base.layers)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_valid_plan_trains_the_model(subject, data):
    model, batch, base, blocks = subject
    plan = data.draw(plans(base, blocks), label="plan")
    trained = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)  # formats with no CPU kernel run emulated, by name
        losses = run_steps(trained, batch, plan)
    assert all(math.isfinite(loss) for loss in losses), losses
    params = dict(trained.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(p, params_before) for (_, p), params_before in zip(params.items(), model.parameters()))


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("outer, inner", [(Format.BF16, Format.FP16), (Format.FP16, Format.BF16)])
def test_a_half_layer_inside_another_half_type_keeps_its_own_and_returns_the_callers(name, outer, inner):
    """The boundary casts exactly: every attention in ``outer`` with its projections in
    ``inner``; the attention's KV cache concatenates tensors of its own half type, and the loss
    is the uniform ``outer`` plan's within the rounding the inner layers add."""
    torch.manual_seed(0)
    model, batch = hf_models.MODELS[name]()
    base = Plan.uniform(model, outer, batch)
    attention = [fqn for fqn in base.layers if fqn.endswith(("attn", "self_attn", "SelfAttention", "EncDecAttention"))]
    projections = {fqn: LayerPrecision(inner) for fqn in base.layers if any(fqn.startswith(a + ".") for a in attention)}
    assert attention and projections
    mixed = base.with_layers(projections)
    reference = run_steps(copy.deepcopy(model), batch, base, steps=1)[0]
    assert run_steps(copy.deepcopy(model), batch, mixed, steps=1)[0] == pytest.approx(reference, rel=2e-2)


# -- architectures drawn from the sweep -----------------------------------------------------------

# Model types from everything transformers and diffusers ship (tests/support/arch_sweep.py), drawn by the
# sweep's rotating seed: the property test draws the architecture as well as the plan.
from support import arch_sweep  # noqa: E402

SWEPT = 6  # architectures drawn, by the sweep's rotating seed (+1: others than its CI sample's)
_built: dict = {}


@functools.lru_cache(maxsize=None)
def swept() -> tuple:
    return tuple(arch_sweep.buildable(SWEPT, arch_sweep.rotating_seed() + 1))


def _swept(index: int):
    """The ``index``-th swept model (built once per module), its batch, loss, FP32 base plan and blocks."""
    if index not in _built:
        model, make, loss = arch_sweep.build(swept()[index])
        batch = make(0)
        base = Plan.uniform(model, Format.FP32, batch)
        _built[index] = (model, batch, loss, base, find_blocks(model, base.layers))
    return _built[index]


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_valid_plan_trains_an_architecture_drawn_from_the_sweep(data):
    index = data.draw(st.integers(0, SWEPT - 1), label=f"architecture of {[c.model_type for c in swept()]}")
    model, batch, loss_fn, base, blocks = _swept(index)
    plan = data.draw(plans(base, blocks), label="plan")
    trained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulationWarning)
        scheduler = DynamicPrecisionScheduler.from_plan(trained, plan)
        try:
            losses = []
            for _ in range(2):
                with scheduler.precision_context():
                    loss = loss_fn(trained, batch)
                scheduler.backward(loss)
                scheduler.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
        finally:
            scheduler.close()
    assert all(math.isfinite(x) for x in losses), (swept()[index].model_type, losses)
    assert all(torch.isfinite(p).all() for p in trained.parameters()), swept()[index].model_type
