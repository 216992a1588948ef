"""`PlanWatch`, the planned windows' check: its fractions against a plain-PyTorch count of the same
tensors, its sampling (hooks on the model only in sampled steps), non-finite values, its state."""

import math

import pytest
import torch
import torch.nn as nn

from autoprec.formats import Format
from autoprec.plan import LayerPrecision, Scaling
from autoprec.profiling import PlanWatch

PLAN = {
    "0": LayerPrecision("fp16"),  # unscaled: overflow above 65504, underflow below its subnormal
    "2": LayerPrecision("fp8_e4m3", scaling=Scaling(mode="delayed")),  # activations and weights delayed, gradients current (E5M2)
    "4": LayerPrecision("fp32"),  # not watched
}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g) * (1 + step)  # the activations grow: delayed scaling overflows
    x[0, 0] = 1e5  # over FP16's max
    x[1, 1] = 1e-9  # under FP16's smallest subnormal (6e-8)
    return x


def reference(tensors, fmt, scaling, refs):
    """(underflowing, overflowing, elements) of ``tensors`` by the rule in `profiling.stats`."""
    under = over = total = 0
    for t, ref in zip(tensors, refs):
        a = t.detach().float().abs().reshape(-1)
        amax = a.max()
        if scaling == "none":
            low, high = fmt.min_subnormal, fmt.max
        else:
            base = amax if scaling == "current" else ref
            low, high = base * fmt.min_subnormal / fmt.max, (math.inf if scaling == "current" else ref)
        under += int(((a > 0) & (a < low)).sum())
        over += int(((a > high) & a.isfinite()).sum())
        total += a.numel()
    return under, over, total


def run(watch, net, steps, start=0):
    """Train ``net`` ``steps`` steps under ``watch``; every tensor it should judge, per (fqn, kind)
    (the weights: of the window's last sampled step only)."""
    seen = {}
    modules = dict(net.named_modules())
    handles = []
    for fqn in ("0", "2"):
        def hook(m, args, out, fqn=fqn):
            seen.setdefault((fqn, "activation"), []).append(args[0].detach().clone())
            out.register_hook(lambda g: seen.setdefault((fqn, "grad"), []).append(g.detach().clone()))
        handles.append(modules[fqn].register_forward_hook(hook))
    for step in range(start, start + steps):
        watch.attach()
        net(batch(step)).square().mean().backward()
        if step == watch.window - 1:
            for fqn in ("0", "2"):
                seen.setdefault((fqn, "weight"), []).append(modules[fqn].weight.detach().clone())
        watch.step()
        with torch.no_grad():
            for p in net.parameters():
                p -= 1e-6 * p.grad
                p.grad = None
    for h in handles:
        h.remove()
    return seen


def test_fractions_and_amax_are_those_of_the_plain_rule_on_every_element():
    net = model()
    watch = PlanWatch(net, PLAN, window=4, every=1, sample=1 << 16)
    seen = run(watch, net, 4)
    report = watch.report()
    assert report.steps == 4 and set(report.layers) == {"0", "2"}  # the FP32 layer is not watched
    for (fqn, kind), tensors in seen.items():
        tw = report.layers[fqn][kind]
        fmt, scaling = PLAN[fqn].cast_of(kind)
        assert (tw.fmt, tw.scaling) == (fmt, scaling)
        amax = [float(t.abs().max()) for t in tensors]
        assert tw.amax == pytest.approx(([0.0] * 3 if kind == "weight" else []) + amax, rel=1e-6)
        # delayed: the largest amax of the previous steps (the history spans all 4), the first its own
        refs = [max(amax[:i]) if i else amax[0] for i in range(len(amax))]
        under, over, total = reference(tensors, fmt, scaling, refs)
        assert tw.sampled == total
        assert (round(tw.underflow * total), round(tw.overflow * total)) == (under, over), (fqn, kind)
    assert report.layers["0"]["activation"].overflow > 0 and report.layers["0"]["activation"].underflow > 0
    assert report.layers["2"]["activation"].overflow > 0  # growing activations overflow the delayed scale


def test_hooks_are_on_the_model_only_in_sampled_steps():
    net = model()
    watch = PlanWatch(net, PLAN, window=7, every=3, sample=1 << 16)
    hooked = []
    for step in range(7):
        watch.attach()
        hooked.append(len(net[0]._forward_hooks) + len(net[2]._forward_hooks))
        net(batch(step)).sum().backward()
        watch.step()
        net.zero_grad()
    assert hooked == [2, 0, 0, 2, 0, 0, 2]
    assert len(net[0]._forward_hooks) == 0 and not watch.collecting
    report = watch.report()
    assert report.steps == 3 and len(report.layers["0"]["activation"].amax) == 3


def test_a_non_finite_value_marks_its_step_and_is_neither_overflow_nor_underflow():
    net = model()
    watch = PlanWatch(net, {"0": LayerPrecision("fp16")}, window=2, every=1, sample=1 << 16)
    for step in range(2):
        watch.attach()
        x = torch.ones(8, 16)
        if step == 1:
            x[3, 3] = float("nan")
        net[0](x)
        watch.step()
    act = watch.report().layers["0"]["activation"]
    assert act.amax == (1.0, math.inf) and act.nonfinite_steps == 1
    assert act.overflow == 0 and act.underflow == 0


def test_a_large_tensor_is_judged_on_a_strided_subsample():
    torch.manual_seed(1)
    layer = nn.Linear(512, 8)
    watch = PlanWatch(layer, {"": LayerPrecision("fp16")}, window=1, every=1, sample=4096)
    x = torch.randn(64, 512)
    x[:, 7] = 1e6  # one channel of 512 over FP16's max: the coprime stride visits it
    watch.attach()
    layer(x)
    watch.step()
    act = watch.report().layers[""]["activation"]
    assert act.sampled <= 4096
    n = act.sampled
    assert abs(act.overflow - 1 / 512) < 5 * math.sqrt((1 / 512) * (1 - 1 / 512) / n)


def test_a_restored_watch_reports_what_the_uninterrupted_one_does():
    straight_net, resumed_net = model(), model()
    straight = PlanWatch(straight_net, PLAN, window=6, every=2, sample=1 << 16)
    run(straight, straight_net, 6)
    first = PlanWatch(resumed_net, PLAN, window=6, every=2, sample=1 << 16)
    run(first, resumed_net, 3)
    resumed = PlanWatch(resumed_net, PLAN, window=6, every=2, sample=1 << 16)
    resumed.load_state_dict(first.state_dict())
    run(resumed, resumed_net, 3, start=3)
    assert resumed.report() == straight.report()


def test_a_state_of_another_plan_is_refused():
    net = model()
    watch = PlanWatch(net, PLAN, window=4, every=1)
    other = PlanWatch(net, {"0": LayerPrecision(Format.BF16)}, window=4, every=1)
    with pytest.raises(Exception, match="another plan or window"):
        other.load_state_dict(watch.state_dict())


def test_the_stages_reports_join_and_a_stages_copies_pool_their_samples():
    """`WatchReport.joined`: each pipeline stage watches its own layers, so the reports' layers are
    united; two data-parallel copies of a stage watched the same (layer, kind) on other micro-batches,
    so their fractions are pooled by the elements each sampled, their amaxes maxed per step."""
    from autoprec.profiling.watch import TensorWatch, WatchReport

    a = TensorWatch(Format.FP8_E4M3, "current", 100, 0.10, 0.00, (1.0, 4.0), 0)
    b = TensorWatch(Format.FP8_E4M3, "current", 300, 0.02, 0.04, (2.0, 3.0), 1)
    stage0 = WatchReport(4, {"blocks.0.fc": {"activation": a}})
    copy0, copy1 = WatchReport(4, {"blocks.1.fc": {"grad": a}}), WatchReport(4, {"blocks.1.fc": {"grad": b}})
    joined = WatchReport.joined([stage0, copy0, None, copy1])
    assert set(joined.layers) == {"blocks.0.fc", "blocks.1.fc"} and joined.layers["blocks.0.fc"]["activation"] == a
    pooled = joined.layers["blocks.1.fc"]["grad"]
    assert pooled.sampled == 400 and pooled.overflow == pytest.approx((0.10 * 100 + 0.02 * 300) / 400)
    assert pooled.underflow == pytest.approx(0.03) and pooled.amax == (2.0, 4.0) and pooled.nonfinite_steps == 1
    assert WatchReport.joined([None, None]) is None
