"""`autoprec.scaling`: LossScaler against torch.amp.GradScaler and plain unscaled runs; OutputWatch."""

import collections
import copy
import json

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.amp.grad_scaler import OptState

import autoprec.scaling.scaler as scaling
from autoprec.opcount import OpCounter as OpCounts
from autoprec.errors import AutoprecError, RuntimeStateError
from autoprec.scaling import LossScaler, OutputWatch, ScalingError

INF = float("inf")
NAN = float("nan")


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return nn.functional.mse_loss(model(x), y)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it by name (``aten._local_scalar_dense`` is a host sync:
    what ``.item()`` and ``bool()`` of a tensor run)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def scaled_step(scaler, model, optimizer, step: int, poison: str | None = None, value: float = INF):
    """One iteration; ``poison`` names a parameter whose gradient gets ``value`` after backward."""
    scaler.scale(loss_of(model, step)).backward()
    if poison is not None:
        dict(model.named_parameters())[poison].grad.view(-1)[0] = value
    out = scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return out


# -- configuration ------------------------------------------------------------------------------


def test_defaults():
    scaler = LossScaler()
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4096.0, 2.0, 0.5, 2000)
    assert (scaler.min_scale, scaler.hysteresis, scaler.enabled) == (1.0, 1, True)


def test_is_a_grad_scaler():
    assert isinstance(LossScaler(), torch.amp.GradScaler)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": INF}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"init_scale": 2.0, "min_scale": 4.0}, "min_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": True}, "hysteresis"),
        ({"enabled": "yes"}, "enabled"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ScalingError, match=rf"{name}=") as info:
        LossScaler(**kwargs)
    assert isinstance(info.value, (AutoprecError, ValueError))


def test_unknown_watched_layer_is_named():
    with pytest.raises(ScalingError, match="'nope'"):
        LossScaler().watch(make_model(), layers=["0", "nope"])


# -- against torch.amp.GradScaler ----------------------------------------------------------------


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_matches_grad_scaler_step_by_step(opt_cls):
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    opt_kwargs = {"lr": 0.05, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 0.01}
    ours, ref = make_model(), make_model()
    opt, ref_opt = opt_cls(ours.parameters(), **opt_kwargs), opt_cls(ref.parameters(), **opt_kwargs)
    scaler = LossScaler(**kwargs)
    grad_scaler = torch.amp.GradScaler(device="cpu", **kwargs)
    overflow = {1: "2.weight", 2: "0.bias", 7: "4.weight", 14: "2.bias"}
    scales = []
    for step in range(20):
        poison = overflow.get(step)
        scaled_step(scaler, ours, opt, step, poison)
        scaled_step(grad_scaler, ref, ref_opt, step, poison)
        assert scaler.get_scale() == grad_scaler.get_scale(), step
        assert_identical(params(ours), params(ref))
        scales.append(scaler.get_scale())
    # The trajectory both grew and backed off, so the comparison covered both rules.
    changes = [b / a for a, b in zip(scales, scales[1:])]
    assert 2.0 in changes and 0.5 in changes
    assert scaler.skipped_steps == len(overflow) and scaler.steps == 20


def test_fused_adamw_matches_grad_scaler_step_by_step():
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    ours, ref = make_model(), make_model()
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    scaler, grad_scaler = LossScaler(**kwargs).watch(ours), torch.amp.GradScaler(device="cpu", **kwargs)
    overflow = {2: "2.weight", 5: "0.bias"}
    for step in range(8):
        scaled_step(scaler, ours, opt, step, overflow.get(step))
        scaled_step(grad_scaler, ref, ref_opt, step, overflow.get(step))
        assert scaler.get_scale() == grad_scaler.get_scale(), step
        assert_identical(params(ours), params(ref))
        assert scaler.last_nonfinite_layers == ((overflow[step][0],) if step in overflow else ())
    assert scaler.skipped_steps == len(overflow)


def test_fused_adamw_keeps_its_fast_path():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    counts = count_ops(LossScaler().watch(model), model, [opt])
    assert counts["_amp_foreach_non_finite_check_and_unscale_"] == 1  # GradScaler's check, scale 1
    assert counts["_fused_adamw_"] == 1  # which unscales and skips inside the fused kernel
    assert counts["_foreach_norm"] == 0  # no attribution pass while no overflow is known


class HostSyncs:
    """Host syncs inside it: autoprec.opcount's (``.item()``, data-dependent shapes, copies to the
    CPU) plus the scaler's batched transfers (``_to_host``: one ``.tolist()``, which on a CPU
    tensor dispatches no aten op, so opcount cannot see it here; on CUDA it is a copy to the CPU)."""

    def __init__(self, monkeypatch):
        self.transfers = 0
        to_host = scaling._to_host

        def counted(parts):
            self.transfers += 1
            return to_host(parts)

        monkeypatch.setattr(scaling, "_to_host", counted)

    def __enter__(self):
        self.transfers = 0
        self._counter = OpCounts().__enter__()
        return self

    def __exit__(self, *exc):
        self._counter.__exit__(*exc)
        self.total = self._counter.counts().sync_total + self.transfers


def whole_iteration_syncs(syncs: HostSyncs, scaler, model, opt, step: int, poison: str | None = None) -> int:
    """Host syncs of one whole iteration: forward, scale, backward, step, update, zero_grad."""
    with syncs:
        scaled_step(scaler, model, opt, step, poison)
    return syncs.total


@pytest.mark.parametrize("poison", [None, "2.weight"], ids=["clean", "overflowing"])
def test_fused_adamw_iteration_makes_no_host_sync_as_grad_scaler(poison, monkeypatch):
    syncs = HostSyncs(monkeypatch)
    model, ref = make_model(), make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    scaler = LossScaler(hysteresis=2, min_scale=1024.0).watch(model, outputs=True)
    grad_scaler = torch.amp.GradScaler(device="cpu")
    for step in range(2):  # the second iteration also drops what the first one held
        assert whole_iteration_syncs(syncs, grad_scaler, ref, ref_opt, step, poison) == 0
        assert whole_iteration_syncs(syncs, scaler, model, opt, step, poison) == 0


def test_fused_adamw_results_read_later_are_exact(monkeypatch):
    syncs = HostSyncs(monkeypatch)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = LossScaler(init_scale=1024.0, growth_interval=2).watch(model)
    overflow = {1: "0.bias", 4: "4.weight"}
    for step in range(5):
        scaled_step(scaler, model, opt, step, overflow.get(step))
    with syncs:
        skipped = scaler.skipped_steps
    assert syncs.total == 2  # the flags of the 5 iterations; the last one's attribution
    assert skipped == 2 and scaler.steps == 5
    # The last iteration's gradients were still held (zero_grad only dropped the optimizer's
    # references): named. Iteration 1's were released when iteration 2 began: counted, unnamed.
    assert scaler.events == ((1, ()), (4, ("4",)))
    assert scaler.last_overflowed and scaler.last_nonfinite_layers == ("4",)
    assert scaler.nonfinite_counts == {"4": 1}
    with syncs:
        assert scaler.last_loss_finite is True
    assert syncs.total == 0  # already on the host


def test_fused_adamw_result_read_before_the_next_iteration_names_the_layers():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = LossScaler().watch(model)
    for step, poison in enumerate([None, "0.weight", None, "2.bias"]):
        scaled_step(scaler, model, opt, step, poison)
        assert scaler.last_nonfinite_layers == ((poison[0],) if poison else ())
    assert scaler.events == ((1, ("0",)), (3, ("2",)))


@pytest.mark.parametrize("kwargs", [
    dict(init_scale=1024.0, growth_interval=2, hysteresis=2),
    dict(init_scale=1024.0, growth_interval=3, min_scale=256.0),
    dict(init_scale=1024.0, growth_interval=1, hysteresis=3, min_scale=128.0),
])
def test_scale_rule_on_the_device_matches_the_host_rule(kwargs):
    # Fused AdamW: the rule runs on the device (`found` never reaches the host); foreach AdamW:
    # the host knows `found` from GradScaler's skip decision. Same overflows, same scales.
    overflow = {1: "0.bias", 2: "2.weight", 3: "4.bias", 6: "0.weight", 7: "0.weight", 8: "0.weight", 9: "2.bias"}
    scales = []
    for fused in (True, False):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused, foreach=None if fused else True)
        scaler = LossScaler(**kwargs).watch(model)
        trajectory = []
        for step in range(12):
            scaled_step(scaler, model, opt, step, overflow.get(step))
            trajectory.append((scaler.scale_tensor.item(), int(scaler._hysteresis_tracker), int(scaler._growth_tracker)))
        scales.append(trajectory)
        assert scaler.skipped_steps == len(overflow)
    assert scales[0] == scales[1]
    assert len({s for s, _, _ in scales[0]}) >= 3  # the trajectory moved: grew and backed off


def test_fused_and_plain_optimizers_together_attribute_both():
    model = make_model()
    params_ = list(model.parameters())
    fused = torch.optim.AdamW(params_[:2], lr=0.01, fused=True)
    plain = torch.optim.SGD(params_[2:], lr=0.1)
    scaler = LossScaler().watch(model)
    scaler.scale(loss_of(model, 0)).backward()
    model[0].bias.grad[0] = INF
    model[4].bias.grad[0] = NAN
    scaler.step(fused)
    scaler.step(plain)
    scaler.update()
    assert scaler.last_nonfinite_layers == ("0", "4")
    assert scaler.get_scale() == 2048.0


def test_state_dict_reads_deferred_iterations():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = LossScaler().watch(model)
    scaled_step(scaler, model, opt, 0, "2.weight")
    scaled_step(scaler, model, opt, 1)
    sd = scaler.state_dict()
    assert (sd["steps"], sd["skipped_steps"], sd["events"], sd["scale"]) == (2, 1, [[0, []]], 2048.0)


def test_disabled_scaler_gives_fused_adamw_a_scale_of_one():
    ours, ref = make_model(), make_model()
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    scaler = LossScaler(enabled=False)
    for step in range(3):
        scaled_step(scaler, ours, opt, step)
        loss_of(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_identical(params(ours), params(ref))


# -- skipping and attribution ---------------------------------------------------------------------


def test_skipped_step_leaves_params_and_adam_state_untouched():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = LossScaler(init_scale=256.0).watch(model)
    for step in range(3):
        scaled_step(scaler, model, opt, step)
    before_params, before_state = params(model), copy.deepcopy(opt.state_dict())

    out = scaled_step(scaler, model, opt, 3, poison="2.weight", value=NAN)

    assert out is None
    assert_identical(params(model), before_params)
    after_state = opt.state_dict()["state"]
    for index, entry in before_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(after_state[index][key], value), (index, key)
    assert scaler.last_nonfinite_layers == ("2",)
    assert scaler.nonfinite_counts == {"2": 1}
    assert (scaler.skipped_steps, scaler.steps) == (1, 4)
    assert scaler.events == ((3, ("2",)),)
    assert scaler.get_scale() == 128.0


def test_step_returns_the_optimizer_value_and_forwards_arguments():
    class Recording(torch.optim.SGD):
        def step(self, closure=None, *, tag=None):
            super().step()
            return ("stepped", tag)

    model = make_model()
    opt = Recording(model.parameters(), lr=0.1)
    scaler = LossScaler()
    scaler.scale(loss_of(model, 0)).backward()
    assert scaler.step(opt, tag=7) == ("stepped", 7)


def test_nested_layers_and_unwatched_parameters_are_named():
    model = nn.Sequential(collections.OrderedDict(block=nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8)), head=nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model, layers=["block"])
    scaled_step(scaler, model, opt, 0, poison="head.weight")
    assert scaler.last_nonfinite_layers == ("head.weight",)
    scaled_step(scaler, model, opt, 1, poison="block.1.bias")
    assert scaler.last_nonfinite_layers == ("block",)


def test_several_layers_reported_in_model_order():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model)
    scaler.scale(loss_of(model, 0)).backward()
    model[4].bias.grad[0] = INF
    model[0].weight.grad[0, 0] = NAN
    scaler.step(opt)
    scaler.update()
    assert scaler.last_nonfinite_layers == ("0", "4")
    assert scaler.nonfinite_counts == {"0": 1, "4": 1}


def two_optimizers(model):
    half = len(list(model.parameters())) // 2
    return [torch.optim.SGD(list(model.parameters())[:half], lr=0.1), torch.optim.SGD(list(model.parameters())[half:], lr=0.1)]


def count_ops(scaler, model, opts, poison: str | None = None) -> collections.Counter:
    """The ops of one iteration's scaler calls (not of forward / backward)."""
    loss = loss_of(model, 0)
    counter = OpCounter()
    with counter:
        scaled = scaler.scale(loss)
    scaled.backward()
    if poison is not None:
        dict(model.named_parameters())[poison].grad.view(-1)[0] = INF
    with counter:
        for opt in opts:
            scaler.step(opt)
        scaler.update()
    return counter.counts


def test_clean_iteration_syncs_once_per_optimizer():
    model = make_model()
    counts = count_ops(LossScaler().watch(model, outputs=True), model, two_optimizers(model))
    assert counts["_local_scalar_dense"] == 2


def test_clean_iteration_checks_gradients_in_one_fused_pass_per_optimizer():
    model = make_model()
    counts = count_ops(LossScaler().watch(model), model, two_optimizers(model))
    assert counts["_amp_foreach_non_finite_check_and_unscale_"] == 2
    assert counts["_foreach_norm"] == 0  # no attribution pass


def test_clean_iterations_never_run_the_attribution(monkeypatch):
    calls = []
    real = scaling._nonfinite_gradients
    monkeypatch.setattr(scaling, "_nonfinite_gradients", lambda *a: calls.append(1) or real(*a))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model)
    for step in range(3):
        scaled_step(scaler, model, opt, step)
    assert calls == []
    scaled_step(scaler, model, opt, 3, poison="2.weight")
    assert calls == [1]
    assert scaler.last_nonfinite_layers == ("2",)


def test_overflowing_iteration_adds_one_transfer(monkeypatch):
    model = make_model()
    transfers = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append(self.numel()) or real_tolist(self))
    counts = count_ops(LossScaler().watch(model, outputs=True), model, two_optimizers(model), poison="4.bias")
    assert counts["_local_scalar_dense"] == 2  # still GradScaler's one per optimizer
    assert len(transfers) == 1


# -- the scale rule -------------------------------------------------------------------------------


def overflowing_trajectory(scaler, steps):
    """The scale after each of ``steps`` iterations that all overflow."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trajectory = []
    for step in range(steps):
        scaled_step(scaler, model, opt, step, poison="0.weight")
        trajectory.append(scaler.get_scale())
    return trajectory


def test_min_scale_is_a_floor():
    assert overflowing_trajectory(LossScaler(init_scale=8.0, min_scale=2.0), 4) == [4.0, 2.0, 2.0, 2.0]


def test_hysteresis_tolerates_h_minus_one_overflows_per_growth_interval():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0, growth_interval=3, hysteresis=3)
    # Overflows at 0, 2 (a clean step between does not restore the budget) and 3, 4; then three
    # clean steps grow the scale, which restores the budget: 8 and 9 are tolerated again.
    pattern = [1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    trajectory = []
    for step, bad in enumerate(pattern):
        before = params(model)
        scaled_step(scaler, model, opt, step, poison="2.weight" if bad else None)
        trajectory.append(scaler.get_scale())
        if bad:  # tolerated or not, an overflowing step is skipped
            assert_identical(params(model), before)
    assert trajectory == [1024, 1024, 1024, 512, 256, 256, 256, 512, 512, 512, 512]
    assert scaler.skipped_steps == sum(pattern)


def test_hysteresis_backs_off_on_the_nth_consecutive_overflow():
    assert overflowing_trajectory(LossScaler(init_scale=1024.0, hysteresis=3), 4) == [1024, 1024, 512, 256]


def test_growth_stops_at_float32_max():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler(init_scale=2.0**127, growth_interval=1)
    scaled_step(scaler, model, opt, 0, poison="0.weight", value=0.0)
    assert scaler.get_scale() == 2.0**127


# -- call-sequence errors ---------------------------------------------------------------------------


def test_second_unscale_before_update_raises():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeStateError, match="already called"):
        scaler.unscale_(opt)


def test_second_step_before_update_raises():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeStateError, match="update"):
        scaler.step(opt)


def test_update_without_step_raises():
    with pytest.raises(RuntimeStateError, match="step"):
        LossScaler().update()


def test_closure_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeStateError, match="closure"):
        LossScaler().step(opt, closure=lambda: loss_of(model, 0))


def test_fp16_gradients_are_refused_when_enabled():
    model = make_model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeStateError, match="FP16"):
        LossScaler().unscale_(opt)


# -- equivalence with unscaled training ---------------------------------------------------------------


def _unscale_then_torch_clip(scaler, opt, model):
    scaler.unscale_(opt)
    return nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)


def _scaler_clip(scaler, opt, model):
    return scaler.clip_grad_norm_(opt, 0.05)


@pytest.mark.parametrize("clip", [_unscale_then_torch_clip, _scaler_clip], ids=["unscale-then-torch-clip", "scaler-clip"])
def test_clipping_sees_unscaled_gradients_and_matches_torch(clip):
    ours, ref = make_model(), make_model()
    opt, ref_opt = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**14)
    for step in range(3):
        scaler.scale(loss_of(ours, step)).backward()
        norm = clip(scaler, opt, ours)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        loss_of(ref, step).backward()
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
        ref_opt.step()
        ref_opt.zero_grad()

        assert ref_norm > 0.05  # clipping was active
        assert torch.equal(norm, ref_norm)
        assert_identical(params(ours), params(ref))


def test_clip_grad_norm_keeps_the_attribution_of_an_overflow():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model)
    scaler.scale(loss_of(model, 0)).backward()
    model[2].weight.grad[0, 0] = NAN
    scaler.clip_grad_norm_(opt, 0.05)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_nonfinite_layers == ("2",)  # torch's clip would have made every gradient NaN


def test_gradient_accumulation_matches_unscaled_reference():
    ours, ref = make_model(), make_model()
    opt, ref_opt = torch.optim.Adam(ours.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    scaler = LossScaler(init_scale=2.0**12)
    for step in range(3):
        for micro in range(2):
            scaler.scale(loss_of(ours, 10 * step + micro) / 2).backward()
            (loss_of(ref, 10 * step + micro) / 2).backward()
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_identical(params(ours), params(ref))
    assert scaler.skipped_steps == 0


def test_two_optimizers_skip_independently_and_share_the_backoff():
    model = make_model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(list(model[2].parameters()) + list(model[4].parameters()), lr=0.1)
    scaler = LossScaler(init_scale=64.0).watch(model)
    a_before, b_before = params(model[0]), params(model[2]) + params(model[4])
    scaler.scale(loss_of(model, 0)).backward()
    model[2].weight.grad[0, 0] = INF
    assert scaler.step(opt_b) is None  # first, so that opt_a steps after an overflow in the same iteration
    scaler.step(opt_a)
    scaler.update()
    assert not torch.equal(model[0].weight, a_before[0])
    assert_identical(params(model[2]) + params(model[4]), b_before)
    assert scaler.get_scale() == 32.0
    assert scaler.last_nonfinite_layers == ("2",)


# -- disabled ---------------------------------------------------------------------------------------


def test_disabled_is_a_pass_through_that_still_skips_nonfinite_steps():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(growth_interval=1, enabled=False).watch(model)
    loss = loss_of(model, 0)
    assert scaler.scale(loss) is loss
    loss.backward()
    grad = model[0].weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(grad, model[0].weight.grad)  # not unscaled
    assert scaler.get_scale() == 1.0  # no growth after a clean step at interval 1
    opt.zero_grad()

    before = params(model)
    scaled_step(scaler, model, opt, 1, poison="4.bias", value=NAN)
    assert_identical(params(model), before)
    assert (scaler.skipped_steps, scaler.last_nonfinite_layers, scaler.get_scale()) == (1, ("4",), 1.0)


# -- persistence ------------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_identically():
    kwargs = dict(init_scale=256.0, growth_interval=3, hysteresis=2, min_scale=32.0)
    # Resumed after step 4 (hysteresis budget spent, the next overflow at 5 backs off at once) and
    # after step 7 (two clean steps counted, the next one grows), then down to the floor.
    overflow = {1: "0.weight", 2: "2.weight", 5: "4.bias", 9: "0.bias", 10: "2.bias", 11: "2.bias", 12: "4.weight"}
    segments = [range(0, 5), range(5, 8), range(8, 14)]

    def run(model, opt, scaler, steps):
        out = []
        for step in steps:
            scaled_step(scaler, model, opt, step, overflow.get(step))
            out.append(scaler.get_scale())
        return out

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = LossScaler(**kwargs).watch(model)
    straight = run(model, opt, scaler, range(14))
    assert straight == [256, 256, 128, 128, 128, 64, 64, 64, 128, 128, 64, 32, 32, 32]

    current = make_model()
    current_opt = torch.optim.Adam(current.parameters(), lr=0.01)
    current_scaler = LossScaler(**kwargs).watch(current)
    resumed = run(current, current_opt, current_scaler, segments[0])
    for steps in segments[1:]:
        saved = json.loads(json.dumps(current_scaler.state_dict()))  # plain values
        fresh = make_model(seed=1)
        fresh.load_state_dict(current.state_dict())
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fresh_opt.load_state_dict(current_opt.state_dict())
        current, current_opt = fresh, fresh_opt
        current_scaler = LossScaler().watch(current)  # defaults: the state dict brings the configuration
        current_scaler.load_state_dict(saved)
        resumed += run(current, current_opt, current_scaler, steps)

    assert resumed == straight
    assert_identical(params(current), params(model))
    assert current_scaler.state_dict() == scaler.state_dict()


def test_grad_scaler_loads_the_state_dict():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=512.0, growth_interval=4)
    scaled_step(scaler, model, opt, 0, poison="0.weight")
    scaled_step(scaler, model, opt, 1)
    grad_scaler = torch.amp.GradScaler(device="cpu")
    grad_scaler.load_state_dict(scaler.state_dict())
    assert (grad_scaler.get_scale(), grad_scaler._get_growth_tracker(), grad_scaler.get_growth_interval()) == (256.0, 1, 4)


def test_load_state_dict_names_missing_entries():
    saved = LossScaler().state_dict()
    del saved["_growth_tracker"]
    with pytest.raises(ScalingError, match="_growth_tracker"):
        LossScaler().load_state_dict(saved)


# -- non-finite outputs -------------------------------------------------------------------------------


def test_output_watch_names_the_first_nonfinite_layer_without_syncing(monkeypatch):
    model = make_model()
    with torch.no_grad():
        model[2].weight[0, 0] = NAN  # layers 2, 3 and 4 all produce NaN; 2 runs first
    x, _ = batch(0)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host sync during the forward")

    with OutputWatch(model) as watch:
        for name in ("item", "tolist", "__bool__", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        out = model(x)
        monkeypatch.undo()
    assert watch.layers == ("0", "2", "4")
    assert watch.calls == 3
    assert not torch.isfinite(out).all()
    assert watch.first_nonfinite() == "2"


def test_output_watch_clean_forward_names_nothing():
    model = make_model()
    with OutputWatch(model) as watch:
        model(batch(0)[0])
    assert watch.calls == 3
    assert watch.first_nonfinite() is None


def test_output_watch_removes_its_hooks_when_the_body_raises():
    model = make_model()
    with pytest.raises(KeyError):
        with OutputWatch(model):
            raise KeyError("boom")
    assert all(not m._forward_hooks for m in model.modules())


def test_output_watch_refuses_reentry():
    watch = OutputWatch(make_model())
    with watch:
        with pytest.raises(RuntimeStateError, match="already attached"):
            watch.attach()


def test_scaler_names_first_nonfinite_output_when_the_loss_is_nonfinite():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model, outputs=True)
    scaled_step(scaler, model, opt, 0)
    assert (scaler.last_loss_finite, scaler.first_nonfinite_output) == (None, None)  # clean: not checked

    with torch.no_grad():
        model[2].weight[0, 0] = NAN
    scaled_step(scaler, model, opt, 1)
    assert scaler.last_loss_finite is False
    assert scaler.first_nonfinite_output == "2"
    assert scaler.last_nonfinite_layers == ("0", "2", "4")
    assert scaler.get_scale() == 2048.0


def test_watch_outputs_arms_and_disarms_the_output_checks_keeping_the_layer_names():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler().watch(model, layers=["0", "2", "4"])
    with torch.no_grad():
        model[2].weight[0, 0] = NAN
    scaled_step(scaler, model, opt, 0)
    assert scaler.first_nonfinite_output is None and not scaler.watching_outputs  # not armed: not checked
    scaler.watch_outputs(True)
    scaled_step(scaler, model, opt, 1)
    assert scaler.first_nonfinite_output == "2"
    assert scaler.last_nonfinite_layers == ("0", "2", "4")  # named per watched layer, as before arming
    scaler.watch_outputs(False)
    assert not scaler.watching_outputs and all(not m._forward_hooks for m in model)  # its hooks are gone
    scaled_step(scaler, model, opt, 2)
    assert scaler.first_nonfinite_output is None


def test_grad_scaler_internals_loss_scaler_overrides_keep_their_shape():
    """`LossScaler` overrides GradScaler internals whose shape could change between releases;
    CI runs this on every supported torch (2.11 and 2.13). ``step`` returns what
    ``_maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)`` returns, as is (some releases
    unpack a ``(retval, found_inf)`` pair); the per-optimizer state holds ``stage`` and
    ``found_inf_per_device``; ``_scale`` and ``_growth_tracker`` are 0-d float32 / int32 tensors."""
    sentinel = object()
    seen = {}

    class Probe(torch.amp.GradScaler):
        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            seen.update(optimizer_state)
            return sentinel

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Probe("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    assert scaler.step(opt) is sentinel
    assert seen["stage"] is OptState.UNSCALED and set(seen["found_inf_per_device"]) == {torch.device("cpu")}
    assert (scaler._scale.shape, scaler._scale.dtype) == ((), torch.float32)
    assert (scaler._growth_tracker.shape, scaler._growth_tracker.dtype) == ((), torch.int32)


def test_found_inf_of_an_optimizer_without_gradients_found_nothing():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    found = scaler.found_inf(opt)  # before: IndexError on the empty list of flags
    assert found.shape == () and found.dtype == torch.float32 and float(found) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_gradient_sends_the_gradients_of_scale_and_keeps_the_losss_value(dtype):
    """A pipeline schedule reports the tensor its loss function returns and backpropagates it:
    `scale_gradient` keeps the value and sends ``scale(loss)``'s gradients."""
    grads = []
    for gradient_only in (False, True):
        torch.manual_seed(1)
        model = nn.Linear(4, 3).to(dtype)
        scaler = LossScaler(init_scale=2.0**10)
        loss = model(torch.randn(5, 4, dtype=dtype)).square().mean()
        out = scaler.scale_gradient(loss) if gradient_only else scaler.scale(loss)
        out.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert (out.detach() == loss.detach()) if gradient_only else (out.detach() == loss.detach().float() * 2.0**10)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    disabled = LossScaler(enabled=False)
    loss = torch.ones((), requires_grad=True)
    assert disabled.scale_gradient(loss) is loss
    with pytest.raises(ScalingError, match="scale_gradient"):
        LossScaler().scale_gradient("loss")
