"""The sampled upstream gradient term (`FisherEstimator(upstream="sampled")`): against the exact
term and a plain-torch full backward, what it tells apart, its cost, and that it leaves the model
as it found it."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoprec as ap
from autoprec.errors import SensitivityError
from autoprec.formats import Format
from autoprec.plan import LayerPrecision
from autoprec.sensitivity import FisherEstimator, estimate_sensitivity, sensitivity_steps


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.EmulationWarning)
        yield


def _mlp(depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(32, 5))


def _data(batches: int = 2, seed: int = 1):
    torch.manual_seed(seed)
    return [(torch.randn(24, 32), torch.randint(0, 5, (24,))) for _ in range(batches)]


def per_sample_ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def test_sampled_term_matches_the_exact_one_on_a_linear_network():
    # On test_sensitivity's linear network the exact terms are the full backward's gradient
    # error under the plan (test_grad_term_matches_full_backward_under_the_plan). A linear network
    # makes each direction's central difference exact, so only the directions' own spread
    # (sqrt(2 / 3 batches x 256)) is left.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 5))
    data = [(torch.randn(24, 16),) for _ in range(3)]
    weights = torch.randn(5)

    def linear_loss(m, batch):
        return (m(batch[0]) * weights).sum(-1)

    def estimate(upstream, probes=4):
        estimator = FisherEstimator(optimizer="sgd", lr=0.1, upstream=upstream, probes=probes)
        return estimate_sensitivity(model, data, linear_loss, ["fp8_e4m3"], estimator=estimator)

    exact, sampled, own = estimate(True), estimate("sampled", 256), estimate(False)
    first, second = ("0", Format.FP8_E4M3), ("1", Format.FP8_E4M3)
    assert sampled.grad == exact.grad == own.grad  # the own parameters' term: the same local backward
    assert sampled.input_grad[first] == exact.input_grad[first] == 0.0  # layer 0's input is the data
    assert own.input_grad[second] == 0.0 and exact.input_grad[second] > 0.2 * (exact.grad[second] + exact.input_grad[second])
    assert sampled.input_grad[second] == pytest.approx(exact.input_grad[second], rel=0.15)


def test_sampled_term_follows_the_exact_one_under_adams_preconditioner():
    model, data = _mlp(3), _data()
    exact = estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"], estimator=FisherEstimator(site="layer", upstream=True))
    sampled = estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"],
                                   estimator=FisherEstimator(site="layer", upstream="sampled", probes=128))
    assert sampled.grad == exact.grad and sampled.forward == exact.forward
    for key in sampled.input_grad:
        if key[0] == "0":  # the first layer has nothing upstream
            assert sampled.input_grad[key] == exact.input_grad[key] == 0.0
        else:
            assert sampled.input_grad[key] == pytest.approx(exact.input_grad[key], rel=0.3), key


def test_each_product_is_estimated_apart_so_a_split_backward_is_told_from_a_whole_high_one():
    # The split runs the input gradient's product as the low recipe does (E5M2) and the weight
    # gradient's as the whole high backward does: each of its parts is the recipe's it shares.
    # Without the upstream term nothing told the split from the whole high backward.
    model, data = _mlp(3), _data()
    low, split, high = (LayerPrecision("fp8_e4m3"), LayerPrecision("fp8_e4m3", high_precision_weight_grad=True),
                        LayerPrecision("fp8_e4m3", grad_format="fp32"))

    def parts(lp, upstream="sampled"):
        est = estimate_sensitivity(model, data, per_sample_ce, [lp], ["4"], estimator=FisherEstimator(site="layer", upstream=upstream))
        return {name: est.part(name)[("4", Format.FP8_E4M3)] for name in ("forward", "grad", "input_grad")}

    low_parts, split_parts, high_parts = parts(low), parts(split), parts(high)
    assert low_parts["forward"] == split_parts["forward"] == high_parts["forward"]
    assert split_parts["grad"] == high_parts["grad"] < low_parts["grad"]
    assert split_parts["input_grad"] == low_parts["input_grad"] > 2 * high_parts["input_grad"] > 0
    assert sum(parts(split, False).values()) == sum(parts(high, False).values())


@pytest.mark.parametrize("depth", [2, 6])
def test_sampled_term_costs_two_forwards_per_direction_whatever_the_depth(depth):
    model, data = _mlp(depth), _data()
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        counts = {}
        for upstream in (False, "sampled"):
            calls.clear()
            estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"], estimator=FisherEstimator(site="layer", upstream=upstream, probes=3))
            counts[upstream] = len(calls)
    finally:
        handle.remove()
    assert counts["sampled"] - counts[False] == 2 * 3 * len(data)


def test_the_parameters_come_back_bit_for_bit_also_when_the_estimate_stops_midway():
    model, data = _mlp(2), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = sensitivity_steps(model, data, per_sample_ce, ["fp8_e4m3"], estimator=FisherEstimator(site="layer", upstream="sampled"))
    assert "upstream direction" in iter(steps)  # stops right after a forward with moved parameters
    steps.close()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"], estimator=FisherEstimator(site="layer", upstream="sampled"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(("options", "field"), [({"upstream": "yes"}, "upstream"), ({"probes": 0}, "probes"), ({"probes": 2.5}, "probes")])
def test_bad_upstream_options_are_one_line_errors(options, field):
    with pytest.raises(SensitivityError, match=f"FisherEstimator\\({field}=") as info:
        FisherEstimator(**options)
    assert "\n" not in str(info.value)
