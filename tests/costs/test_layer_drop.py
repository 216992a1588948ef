"""Looks at a model that skips layers at random while training (LayerDrop: HF's speech and
translation models, at 0.05-0.1 by default) measure the step in which every layer runs, the one
a memory budget must hold."""

import torch

from autoprec.costs import saved_bytes_by_layer, trace_model
from support import arch_sweep


def test_every_look_at_a_layerdrop_model_measures_every_layer_and_leaves_its_rates():
    # Before: each look (the cost model's region, pair and block measurements, paced over
    # training steps) drew its own skips; WavLM's second layer measured 0 bytes on some looks
    # and in full on others, its mixed plans predicted at 0.67-1.39x the bytes they hold.
    case = next(c for c in arch_sweep.cases() if c.model_type == "wavlm")
    model, make, loss = arch_sweep.build(case)
    model.config.layerdrop = 0.5  # WavLM reads the rate from its config at each call
    batch = make(0)
    layers = list(trace_model(model, batch, loss).layers)
    second = [fqn for fqn in layers if ".encoder.layers.1." in fqn]
    assert second
    torch.manual_seed(0)
    looks = []
    for _ in range(6):
        looks.append(saved_bytes_by_layer(model, batch, layers, None, loss))
        torch.rand(1)  # a training step between looks draws from the global RNG
    assert all(look == looks[0] for look in looks)
    assert all(looks[0][0][fqn] > 0 for fqn in second)
    assert model.config.layerdrop == 0.5 and model.training
