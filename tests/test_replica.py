"""The search's copy of a model (`replica.plain_copy`): the model's own forward on weights of
its own, nothing shared with the model it was copied from."""

import torch
import torch.nn as nn

from autoprec.replica import plain_copy


class WeightNormed(nn.Module):
    """HuBERT's positional convolution: a weight norm (`torch.nn.utils.parametrize`), whose
    module refuses pickling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1), dim=2)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).transpose(1, 2))


def test_a_weight_normed_model_is_copied_with_its_parametrization_and_weights_of_its_own():
    torch.manual_seed(0)
    model = WeightNormed()
    x = torch.randn(2, 4, 6)
    copied = plain_copy(model)  # before: RuntimeError, "Serialization of parametrized modules ..."
    assert nn.utils.parametrize.is_parametrized(copied.conv, "weight")
    torch.testing.assert_close(copied(x), model(x), rtol=0, atol=0)
    ours = {id(p) for p in model.parameters()}
    assert all(id(p) not in ours for p in copied.parameters())
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        copied.conv.parametrizations.weight.original0.mul_(2.0)  # the magnitude g of w = g v / |v|
    assert not torch.allclose(copied(x), model(x))
    torch.testing.assert_close(plain_copy(model)(x), model(x), rtol=0, atol=0)  # the model's untouched
