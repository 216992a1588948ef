"""Saved-activation bytes count what the saved tensors hold: a batch sliced from a dataset
tensor is its own bytes, not the dataset's, in the meter and in the cost model alike."""

import torch
import torch.nn as nn

from autoprec.costs import CostModel, TimingSettings
from autoprec.saved_bytes import SavedTensorMeter


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))


def metered(model, x):
    with SavedTensorMeter(model.parameters()) as meter:
        model(x).sum()
    return meter.total_bytes


DATASET = torch.randn(4096, 16)  # 256 KiB: the storage a sliced batch is a view of
BATCH = DATASET[64:96]


def test_a_sliced_batch_counts_its_own_bytes_not_the_dataset():
    model = mlp()
    assert metered(model, BATCH) == metered(model, BATCH.clone())


def test_a_sliced_batch_costs_what_a_copy_of_it_costs():
    model = mlp()
    sliced = CostModel.build(model, BATCH, formats=("fp32",), timing=TimingSettings(in_place=False)).fp32_bytes()
    copied = CostModel.build(model, BATCH.clone(), formats=("fp32",), timing=TimingSettings(in_place=False)).fp32_bytes()
    assert sliced == copied


def test_the_cost_model_predicts_the_metered_bytes_of_a_sliced_batch():
    model = mlp()
    costs = CostModel.build(model, BATCH, formats=("fp32",), timing=TimingSettings(in_place=False))
    assert costs.plan_cost(costs.uniform_plan("fp32")).saved_bytes == metered(model, BATCH)


def test_a_view_of_an_activation_keeps_its_whole_storage():
    # Backward keeps y's storage alive through the saved view, so all of y counts.
    lin = nn.Linear(16, 64)
    x = torch.randn(32, 16)
    with SavedTensorMeter(lin.parameters()) as meter:
        y = lin(x)
        y[:, :8].pow(2).sum()  # pow saves its input: the view
    y_bytes = 32 * 64 * 4
    x_bytes = 32 * 16 * 4
    assert meter.total_bytes == x_bytes + y_bytes
