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


def tiny_lm_under(scheduler, steps: int, seed: int = 0) -> torch.Tensor:
    """A 2-block ByteLM (context 16, width 64) trained ``steps`` steps on random bytes of a
    64-symbol alphabet through ``scheduler``'s loop (AdamW, lr 1e-3), the scheduler closed at
    the end; returns the last loss."""
    from autoprec.workloads.bytelm import ByteLM, LMConfig

    torch.manual_seed(seed)
    model = ByteLM(LMConfig(context=16, d_model=64, n_heads=2, n_layers=2, d_ff=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        idx = torch.randint(0, 64, (8, 16), generator=g)
        with scheduler.precision_context():
            _, loss = model(idx, idx)
        scheduler.backward(loss)
        scheduler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    scheduler.close()
    return loss


def tiny_lms_side_by_side(precisions, steps: int = 30):
    """Identical 2-block ByteLMs (context 16, width 64), each with every layer in its entry of
    ``precisions`` (a `LayerPrecision`, or None: plain FP32, no runtime), trained ``steps`` steps
    on the same random batches of a 64-symbol alphabet (learnable in a few steps; AdamW, lr 3e-3).
    Returns (models, runtimes, per-model losses, the batches' generator for more)."""
    import autoprec as ap
    from autoprec.workloads.bytelm import ByteLM, LMConfig

    torch.manual_seed(0)
    config = LMConfig(context=16, d_model=64, n_heads=2, n_layers=2, d_ff=128)
    models = [ByteLM(config) for _ in precisions]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    fqns = ap.Plan.uniform(models[0], "fp32").layers
    runtimes = [None if lp is None else ap.apply_plan(m, ap.Plan({fqn: lp for fqn in fqns})) for m, lp in zip(models, precisions)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    g = torch.Generator().manual_seed(1)
    losses = [[] for _ in models]
    for _ in range(steps):
        idx = torch.randint(0, 64, (8, 16), generator=g)
        for model, runtime, opt, history in zip(models, runtimes, optimizers, losses):
            with runtime if runtime is not None else torch.enable_grad():
                _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            history.append(loss.item())
    return models, runtimes, losses, g


def first_lm_step_graphs(models, runtimes, g):
    """The first of `tiny_lms_side_by_side`'s models as a loss function of a batch under its
    runtime, a next batch from ``g``, and the graphs ``torch.compile`` makes of that step
    (`opcount.graph_breaks`): (step, batch, breaks)."""
    from autoprec.opcount import graph_breaks

    idx = torch.randint(0, 64, (8, 16), generator=g)

    def step(idx):
        with runtimes[0]:
            return models[0](idx, idx)[1]

    return step, idx, graph_breaks(step, idx)
