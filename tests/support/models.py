"""Hand-written test models shared by the test files: layers that call ``torch.addmm`` themselves
(weight stored transposed), which a module-class filter would miss and tracing finds."""

import torch
import torch.nn as nn


class AddmmProjection(nn.Module):
    """A hand-written projection: weight stored transposed (in, out), ``torch.addmm`` called directly."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class WithProjection(nn.Module):
    """``nn.Linear(8, 6)``, ReLU, then an `AddmmProjection(6, 3)`."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.proj = AddmmProjection(6, 3)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)))


class TransposedProjection(nn.Module):
    """A projection storing its weight as (in, out), scaled by 1/sqrt(in), calling torch.addmm itself."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight_t = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight_t)


class ViewWeight(nn.Module):
    """A projection multiplying by a view of its weight (``x @ w.t()``): still a weight."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x):
        return x @ self.weight.t()
