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
    # On test_sensitivity's linear network the exact term is the full backward's gradient error
    # under the plan (test_grad_term_matches_full_backward_under_the_plan). A linear network makes
    # each direction's central difference exact, so only the directions' own spread
    # (sqrt(2 / 3 batches x 256)) is left.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 5))
    data = [(torch.randn(24, 16),) for _ in range(3)]
    weights = torch.randn(5)

    def linear_loss(m, batch):
        return (m(batch[0]) * weights).sum(-1)

    def grad_part(upstream, probes=4):
        estimator = FisherEstimator(optimizer="sgd", lr=0.1, upstream=upstream, probes=probes)
        return estimate_sensitivity(model, data, linear_loss, ["fp8_e4m3"], estimator=estimator).part("grad")

    exact, sampled, own = grad_part(True), grad_part("sampled", 256), grad_part(False)
    first, second = ("0", Format.FP8_E4M3), ("1", Format.FP8_E4M3)
    assert sampled[first] == pytest.approx(exact[first], rel=1e-6)  # layer 0's input is the data: nothing upstream
    assert exact[second] - own[second] > 0.2 * exact[second]  # the upstream part is a real share of the term
    assert sampled[second] == pytest.approx(exact[second], rel=0.15)


def test_sampled_term_follows_the_exact_one_under_adams_preconditioner():
    model, data = _mlp(3), _data()
    exact = estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"], estimator=FisherEstimator(site="layer", upstream=True))
    sampled = estimate_sensitivity(model, data, per_sample_ce, ["fp8_e4m3"],
                                   estimator=FisherEstimator(site="layer", upstream="sampled", probes=128))
    keys = [k for k in exact.part("grad") if k[0] != "0"]  # the first layer has nothing upstream
    for key in keys:
        assert sampled.part("grad")[key] == pytest.approx(exact.part("grad")[key], rel=0.3), key
    assert sampled.part("grad")[("0", Format.FP8_E4M3)] == pytest.approx(exact.part("grad")[("0", Format.FP8_E4M3)], rel=1e-6)


def test_sampled_term_tells_a_split_backward_from_a_whole_high_precision_one():
    # The split runs the input gradient's product in E5M2 and the weight gradient's high; the
    # whole high backward runs both high. Their own weights' gradients are the same, so only the
    # upstream term can tell them apart.
    model, data = _mlp(3), _data()
    split = LayerPrecision("fp8_e4m3", high_precision_weight_grad=True)
    high = LayerPrecision("fp8_e4m3", grad_format="fp32")

    def grad_part(lp, upstream):
        est = estimate_sensitivity(model, data, per_sample_ce, [lp], ["4"], estimator=FisherEstimator(site="layer", upstream=upstream))
        return est.part("grad")[("4", Format.FP8_E4M3)]

    assert grad_part(split, False) == pytest.approx(grad_part(high, False), rel=1e-6)
    assert grad_part(split, "sampled") > 2 * grad_part(high, "sampled") > 0


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
