"""`autoprec.profiling`: LayerProfiler statistics against plain-PyTorch references, the Profile
artifact, the `autoprec profile` command.

References are computed from tensors captured by the test's own hooks (or built with known
values), never from the profiler's code paths.
"""

import collections
import json
import math

import pytest
import torch
import torch.nn as nn

from autoprec.cli import main
from autoprec.coverage import find_layers
from autoprec.errors import ProfileError
from autoprec.formats import Format
from autoprec.bench import measure_overhead
from autoprec.profiling import (
    NUM_BINS,
    LayerProfiler,
    Profile,
    profile_workload,
)
from autoprec.workload import TrainStep
from autoprec.workloads import default_workload


class Tiny(nn.Module):
    def __init__(self, hidden=16, extra=False, out_name="fc2"):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        setattr(self, out_name, nn.Linear(hidden, 4))
        self.out_name = out_name
        self.fc3 = nn.Linear(4, 4) if extra else None

    def forward(self, x):
        y = getattr(self, self.out_name)(torch.relu(self.fc1(x)))
        return self.fc3(y) if self.fc3 is not None else y


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return Tiny(**kw)


def _batches(n, shape=(5, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _train(model, profiler, batches, on_backward=None):
    """Plain SGD steps: forward, backward, profiler.step(), update."""
    for x in batches:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        if on_backward is not None:
            on_backward()
        profiler.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad


def _hooks_left(model):
    return [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None)]


# -- statistics against references ---------------------------------------------------------------


def test_grad_mean_var_nsr_match_stacked_reference():
    model = _model()
    profiler = LayerProfiler(model, window=8, every=1)
    grads = {"fc1": [], "fc2": []}

    def capture():
        for fqn in grads:
            module = getattr(model, fqn)
            grads[fqn].append(torch.cat([p.grad.flatten() for p in module.parameters()]).double())

    with profiler:
        _train(model, profiler, _batches(8), capture)
    profile = profiler.profile()
    for fqn, steps in grads.items():
        g = torch.stack(steps)  # (steps, elements)
        mean, var = g.mean(0), g.var(0)  # unbiased across steps, per element
        stats = profile[fqn].param_grad
        assert stats.steps == 8 and stats.numel == g.shape[1]
        assert stats.mean == pytest.approx(mean.mean().item(), rel=1e-4, abs=1e-9)
        assert stats.var == pytest.approx(var.mean().item(), rel=1e-4)
        assert stats.signal == pytest.approx(mean.pow(2).mean().item(), rel=1e-4)
        assert stats.nsr == pytest.approx((var.sum() / mean.pow(2).sum()).item(), rel=1e-4)


def test_amax_histories_match_reference():
    model = _model()
    profiler = LayerProfiler(model, window=5, every=2)
    ref = {(fqn, kind): [] for fqn in ("fc1", "fc2") for kind in ("activation", "weight", "grad")}

    def forward_hook(fqn):
        def hook(module, args, output):
            ref[(fqn, "activation")].append(args[0].abs().max().item())
            output.register_hook(lambda g: ref[(fqn, "grad")].append(g.abs().max().item()))
        return hook

    handles = [getattr(model, f).register_forward_hook(forward_hook(f)) for f in ("fc1", "fc2")]

    def weights():
        for f in ("fc1", "fc2"):
            ref[(f, "weight")].append(getattr(model, f).weight.abs().max().item())

    with profiler:
        _train(model, profiler, _batches(5), weights)
    for h in handles:
        h.remove()
    profile = profiler.profile()
    for (fqn, kind), values in ref.items():
        assert profile[fqn].tensors[kind].amax == pytest.approx(values, rel=0, abs=0), (fqn, kind)


def _wide_values(n, seed=0):
    """Magnitudes 2**U(-40, 20) with random signs and a few zeros: every format's limits are hit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(n, generator=gen) * 60 - 40) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x[:7] = 0.0
    return x


def _profile_inputs(inputs, **kw):
    """Profile a Linear whose activations are exactly ``inputs`` (one tensor per step)."""
    torch.manual_seed(0)
    model = nn.Linear(inputs[0].shape[-1], 2)
    profiler = LayerProfiler(model, window=len(inputs), every=1, **kw)
    with profiler:
        for x in inputs:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            profiler.step()
    return profiler.profile()


def test_histogram_octaves_match_frexp_on_full_tensor():
    x = _wide_values(4000).reshape(40, 100)
    stats = _profile_inputs([x])[""].tensors["activation"]
    counts = torch.tensor(stats.histograms["absolute"].full())
    assert stats.sampled == x.numel()
    nonzero = x[x != 0].abs()
    octave = torch.frexp(nonzero)[1] - 1  # floor(log2|x|)
    reference = torch.bincount(octave + 149, minlength=300)
    # 8 bins per octave; bin index >> 3 is the biased float32 exponent.
    by_octave = torch.zeros(300, dtype=torch.int64)
    for b in range(1 << 3, 2040):
        by_octave[(b >> 3) - 127 + 149] += counts[b]
    assert torch.equal(by_octave, reference)
    assert stats.zeros == 7 and stats.nonfinite == 0


@pytest.mark.parametrize("fmt", list(Format))
def test_underflow_overflow_fractions_match_full_tensor(fmt):
    x = _wide_values(6000, seed=1).reshape(60, 100)
    stats = _profile_inputs([x])[""].tensors["activation"]
    a = x.abs().double()
    nonzero = a > 0
    amax = torch.tensor(float(a.max()))
    # NVFP4's E4M3 block scales reach below its one subnormal: a value keeps a nonzero code down to
    # E4M3's smallest subnormal times E2M1's, with amax mapped onto 448 x 6.
    smallest = 2.0**-9 * 0.5 * fmt.max / (448 * 6) if fmt is Format.NVFP4 else fmt.min_subnormal
    for scaling, got in stats.fractions[fmt.value].items():
        scale = fmt.max / float(amax) if scaling != "none" else 1.0  # the scale maps amax onto max
        under = ((a * scale < smallest) & nonzero).double().mean().item()
        over = (a * scale > fmt.max).double().mean().item()
        lo, hi = got.underflow_range
        assert lo - 1e-12 <= under <= hi + 1e-12 and lo - 1e-12 <= got.underflow <= hi + 1e-12, (scaling, under, got)
        lo, hi = got.overflow_range
        assert lo - 1e-12 <= over <= hi + 1e-12, (scaling, over, got)
        # Interpolation inside one bin of 1/8 octave: far tighter than the bound in practice.
        assert got.underflow == pytest.approx(under, abs=2e-3)


def test_a_profile_of_many_layers_summed_up_in_chunks_gives_each_tensor_its_own_fractions(monkeypatch):
    """The summary counts every tensor's histograms at once, in chunks (`_SUMMARY_CHUNK`): each
    layer's input fractions and histogram against the plain rule on that layer's own values,
    with inputs a different range per layer and chunks that split the layers unevenly."""
    import autoprec.profiling.profiler as profiler_module

    monkeypatch.setattr(profiler_module, "_SUMMARY_CHUNK", 2)
    inputs = [_wide_values(3000, seed=i).reshape(30, 100) * 2.0 ** (9 * i - 12) for i in range(5)]
    model = nn.ModuleList(nn.Linear(100, 2) for _ in inputs)
    profiler = LayerProfiler(model, window=1, every=1, sample=10**6)
    with profiler:
        sum(layer(x).sum() for layer, x in zip(model, inputs)).backward()
        profiler.step()
    profile = profiler.profile()
    for i, x in enumerate(inputs):
        stats = profile.layers[str(i)].tensors["activation"]
        a = x.abs().double()
        assert stats.histograms["absolute"].total == x.numel() and stats.zeros == 7  # every value sampled
        for fmt in (Format.BF16, Format.FP16, Format.FP8_E4M3, Format.INT8):
            scaling = "current" if fmt.needs_scale else "none"
            scale = fmt.max / float(a.max()) if fmt.needs_scale else 1.0
            under = ((a * scale < fmt.min_subnormal) & (a > 0)).double().mean().item()
            over = (a * scale > fmt.max).double().mean().item()
            got = stats.fractions[fmt.value][scaling]
            assert got.underflow_range[0] - 1e-12 <= under <= got.underflow_range[1] + 1e-12, (i, fmt, under, got)
            assert got.overflow_range[0] - 1e-12 <= over <= got.overflow_range[1] + 1e-12, (i, fmt, over, got)


def test_values_beyond_fp16_max_overflow_exactly():
    x = torch.full((10, 100), 0.5)
    x[0, :13] = 1e5  # > 65504
    stats = _profile_inputs([x])[""].tensors["activation"]
    assert stats.overflow(Format.FP16) == 13 / 1000
    assert stats.fractions["fp16"]["none"].overflow_range == (13 / 1000, 13 / 1000)
    assert stats.overflow(Format.BF16) == 0.0


def test_delayed_scaling_overflow_counts_values_above_previous_amax():
    x0 = torch.linspace(-1, 1, 500).reshape(5, 100)  # amax 1.0
    x1 = torch.linspace(-1, 1, 500).reshape(5, 100).clone()
    x1[0, :10] = 5.0  # 10 values above the previous step's amax; 1.0 itself is not above it
    stats = _profile_inputs([x0, x1])[""].tensors["activation"]
    for fmt in (Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8):
        assert stats.overflow(fmt, "delayed") == 10 / 1000
        assert stats.overflow(fmt, "current") == 0.0


def test_delayed_reference_forgets_beyond_history_len():
    amaxes = [4.0, 1.0, 1.0, 2.0]
    inputs = [torch.linspace(-a, a, 200).reshape(2, 100) for a in amaxes]
    short = _profile_inputs(inputs, history_len=2)[""].tensors["activation"]
    long = _profile_inputs(inputs, history_len=16)[""].tensors["activation"]
    # Step 3 (amax 2) sees reference max(1, 1) = 1 with a 2-step history, 4 with a 16-step one.
    expected = (torch.linspace(-2, 2, 200).abs() > 1.0).sum().item() / 800
    assert short.overflow(Format.FP8_E4M3, "delayed") == expected
    assert long.overflow(Format.FP8_E4M3, "delayed") == 0.0


def test_subsample_fractions_match_full_tensor_within_stated_error():
    # Channels spanning 12 octaves, so a stride that skipped channels would be visibly biased.
    gen = torch.Generator().manual_seed(3)
    channels = torch.exp2(torch.linspace(-6, 6, 96))
    x = torch.randn(64, 256, 96, generator=gen) * channels
    sample = 8192
    stats = _profile_inputs([x], sample=sample)[""].tensors["activation"]
    n = stats.sampled
    assert n <= sample and stats.numel == x.numel()
    assert stats.amax[0] == x.abs().max().item()  # the amax is never subsampled
    counts = torch.tensor(stats.histograms["absolute"].full(), dtype=torch.float64)
    octave_sub = torch.zeros(256, dtype=torch.float64).index_add_(0, torch.arange(NUM_BINS) >> 3, counts) / n
    exponent = torch.frexp(x.abs().flatten())[1] - 1 + 127
    octave_full = torch.bincount(exponent, minlength=256).double() / x.numel()
    sigma = (octave_full * (1 - octave_full) / n).sqrt()
    assert (octave_sub - octave_full).abs().le(5 * sigma + 1.0 / n).all()
    # A fraction that matters to a plan: INT8 underflow under current scaling.
    full = (x.abs() * (Format.INT8.max / x.abs().max().item()) < 1.0).double().mean().item()
    got = stats.underflow(Format.INT8, "current")
    assert abs(got - full) <= 5 * math.sqrt(full * (1 - full) / n) + 2e-3


def test_nonfinite_values_are_counted():
    inputs = _batches(3, shape=(4, 8))
    inputs[1] = inputs[1].clone()
    inputs[1][0, 0] = float("inf")
    inputs[1][1, 1] = float("-inf")
    inputs[1][2, 2] = float("nan")
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    profiler = LayerProfiler(model, window=3, every=1)
    with profiler:
        for x in inputs:
            model(x).sum().backward()
            profiler.step()
    stats = profiler.profile()[""].tensors["activation"]
    assert stats.nonfinite_steps == 1 and stats.nonfinite == 3
    assert math.isnan(stats.amax[1]) and math.isfinite(stats.amax[0]) and math.isfinite(stats.amax[2])


# -- cost and hygiene ----------------------------------------------------------------------------


def test_steps_do_not_sync_with_the_host(monkeypatch):
    model = _model()
    batches = _batches(4)
    profiler = LayerProfiler(model, window=10, every=1)

    def sync(*args, **kwargs):
        raise AssertionError("host-device sync in the per-step path")

    with profiler:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, sync)
        _train(model, profiler, batches)
        monkeypatch.undo()
    assert profiler.profile().steps == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_do_not_sync_on_cuda():
    model = _model().cuda()
    batches = [b.cuda() for b in _batches(4)]
    profiler = LayerProfiler(model, window=10, every=1)
    with profiler:
        _train(model, profiler, batches[:1])  # first-touch allocations happen here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _train(model, profiler, batches[1:])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert profiler.profile().steps == 4


def test_hooks_removed_after_window_and_state_dict_untouched():
    model = _model()
    keys = list(model.state_dict())
    profiler = LayerProfiler(model, window=3, every=1).attach()
    assert _hooks_left(model)
    _train(model, profiler, _batches(3))
    assert not profiler.collecting and _hooks_left(model) == []
    assert list(model.state_dict()) == keys
    _train(model, profiler, _batches(2))  # steps after the window record nothing
    assert profiler.profile().steps == 3 and profiler.profile()["fc1"].tensors["activation"].calls == 3


def test_detach_and_exceptions_remove_hooks():
    model = _model()
    profiler = LayerProfiler(model, window=10)
    with pytest.raises(RuntimeError, match="body failed"):
        with profiler:
            raise RuntimeError("body failed")
    assert _hooks_left(model) == []
    profiler.attach()
    profiler.detach()
    assert _hooks_left(model) == [] and not profiler.collecting


def test_second_attach_is_refused():
    profiler = LayerProfiler(_model()).attach()
    with pytest.raises(ProfileError, match="already attached"):
        profiler.attach()


def test_profiler_changes_no_numerics():
    plain, watched = _model(), _model()
    profiler = LayerProfiler(watched, window=10, every=1).attach()
    x = _batches(1)[0]
    for m in (plain, watched):
        m(x).pow(2).mean().backward()
    profiler.step()
    assert torch.equal(plain(x), watched(x))
    for p, q in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))


def test_disabled_profiler_is_a_pass_through():
    model = _model()
    profiler = LayerProfiler(model, enabled=False).attach()
    assert _hooks_left(model) == [] and profiler.step() is False
    with pytest.raises(ProfileError, match="disabled"):
        profiler.profile()


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"sample": -1}, {"every": 0}, {"formats": ["fp9"]}, {"formats": []}])
def test_bad_profiler_arguments(kwargs):
    with pytest.raises(ProfileError):
        LayerProfiler(_model(), **kwargs)


# -- the artifact --------------------------------------------------------------------------------


@pytest.fixture
def small_profile():
    model = _model()
    profiler = LayerProfiler(model, window=4, every=2)
    batches = _batches(4)
    batches[2] = batches[2].clone()
    batches[2][0, 0] = float("nan")  # a NaN amax must survive the JSON round trip
    with profiler:
        _train(model, profiler, batches)
    return profiler.profile({"note": "test"})


def test_save_load_round_trip_is_equal(small_profile, tmp_path):
    path = small_profile.save(tmp_path / "p.json")
    loaded = Profile.load(path)
    assert loaded == small_profile and loaded.to_dict() == small_profile.to_dict()
    assert math.isnan(loaded["fc1"].tensors["activation"].amax[2])
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_profile_fits_its_architecture_whatever_the_weights_and_no_other(small_profile):
    # The check passes models of the profiled architecture with other weights (other seeds, a
    # trained copy), and the same check refuses that architecture with one layer widened: it is
    # not a check that passes everything.
    trained = _model(seed=7)
    _train(trained, LayerProfiler(trained, enabled=False), _batches(2))
    for model in (_model(seed=5), _model(seed=6), trained):
        small_profile.check_model(model)
    with pytest.raises(ProfileError, match="'fc1': parameter shapes"):
        small_profile.check_model(_model(seed=5, hidden=17))


def test_profile_for_another_model_names_every_mismatching_layer(small_profile):
    other = _model(hidden=32, extra=True, out_name="head")
    with pytest.raises(ProfileError) as info:
        small_profile.check_model(other)
    message = str(info.value)
    assert "'fc1': parameter shapes" in message
    assert "'fc2': profiled layer missing" in message
    assert "'head': a covered layer" in message and "'fc3': a covered layer" in message
    assert len(info.value.problems) == 4


def test_loading_for_another_model_names_the_layers(small_profile, tmp_path):
    path = small_profile.save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match=r"p\.json: 'fc1': parameter shapes"):
        Profile.load(path, model=_model(hidden=32))
    assert Profile.load(path, model=_model()) == small_profile


def _corrupt(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: "not json {", "not valid JSON"),
        (lambda d: {k: v for k, v in d.items() if k != "schema_version"}, "no 'schema_version'"),
        (lambda d: {**d, "schema_version": 99}, "upgrade autoprec"),
        (lambda d: _corrupt(d, ["layers", "fc1", "tensors", "activation", "amax"], "x") or d, "layers['fc1'].tensors.activation.amax: expected number list"),
        (lambda d: _corrupt(d, ["layers", "fc2", "tensors", "grad", "histograms", "absolute", "counts"], [-1]) or d, "layers['fc2'].tensors.grad.histograms.absolute.counts"),
        (lambda d: _corrupt(d, ["config", "formats"], ["fp9"]) or d, "config.formats: unknown format 'fp9'"),
        (lambda d: _corrupt(d, ["layers", "fc1", "param_grad"], 3) or d, "layers['fc1'].param_grad: expected object or null"),
    ],
)
def test_malformed_files_name_the_field(small_profile, tmp_path, change, expected):
    data = change(small_profile.to_dict())
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ProfileError, match="bad.json") as info:
        Profile.load(path)
    assert expected in str(info.value)


def test_missing_file_says_how_to_create_one(tmp_path):
    with pytest.raises(ProfileError, match="autoprec profile"):
        Profile.load(tmp_path / "none.json")


# -- end to end ----------------------------------------------------------------------------------


def test_twenty_real_training_steps_profile_every_layer():
    profile = profile_workload(default_workload("tiny", batch_size=8), 20, device="cpu")
    workload = default_workload("tiny")
    model = workload.build_model()
    example = workload.val_batches(1)[0][0]
    assert list(profile.layers) == list(find_layers(model, example))
    profile.check_model(model, example)
    for fqn, layer in profile.layers.items():
        assert layer.steps == 20
        grad, act = layer.tensors["grad"], layer.tensors["activation"]
        assert len(act.amax) == 20 and all(v > 0 for v in act.amax) and act.sampled > 0
        assert grad.var > 0, fqn
        if dict(profile.fingerprint[fqn].params):
            assert layer.param_grad.steps == 20 and layer.param_grad.var > 0 and math.isfinite(layer.param_grad.nsr), fqn
            assert "weight" in layer.tensors
        else:  # the attention module multiplies activations only
            assert layer.param_grad is None
    assert math.isfinite(profile.metadata["loss_last"])


def test_cli_profile_writes_profile_and_tensorboard_histograms(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logdir = tmp_path / "profile.json", tmp_path / "tb"
    assert main(["profile", "--workload", "tiny", "--steps", "5", "--out", str(out), "--logdir", str(logdir)]) == 0
    profile = Profile.load(out)
    assert profile.steps == 5 and len(profile.layers) == 11
    assert "lm_head" in capsys.readouterr().out
    events = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    events.Reload()
    tags = events.Tags()["histograms"]
    assert "activation/lm_head/log2_abs" in tags and "grad/blocks.0.attn/log2_abs" in tags


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--workload", "huge"],
        ["--formats", "fp9"],
        ["--out", "/nonexistent-dir/p.json"],
        ["--lr", "-1"],
        ["--batch-size", "x"],
        ["--workload", "autoprec.workloads:default_workload", "--lr", "0.1"],
        ["--workload", "autoprec.workloads:nothing_here"],
    ],
)
def test_cli_bad_arguments_fail_with_one_line(argv, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error:") and err.count("\n") == 1


def test_cli_profiles_a_workload_named_module_function(tmp_path):
    out = tmp_path / "p.json"
    args = ["profile", "--workload", "autoprec.workloads:default_workload", "--workload-kwargs", '{"name": "tiny", "batch_size": 4}',
            "--steps", "3", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    profile = Profile.load(out)
    assert profile.metadata["workload"] == "autoprec.workloads:default_workload" and profile.metadata["batch_size"] == 4
    assert list(profile.layers) == list(find_layers(default_workload("tiny").build_model(), default_workload("tiny").val_batches(1)[0][0]))
    assert all(layer.steps == 3 for layer in profile.layers.values())


def test_measure_overhead_steps_three_models_alike_and_reports_ratios_of_its_medians(monkeypatch):
    # Counted from the real path: each of the three models (plain, window, after) trains every
    # round; the overheads are the ratios of the reported medians, recomputed here.
    stepped = collections.Counter()
    real = TrainStep.__call__

    def counted(self, *args, **kwargs):
        stepped[id(self)] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", counted)
    # Three timed steps: with two, a median is also the mean.
    result = measure_overhead(default_workload("tiny", batch_size=4), steps=3, warmup=1, device="cpu")
    median = result["median_ms"]
    assert sorted(stepped.values()) == [4, 4, 4] and set(median) == {"plain", "window", "after"}
    assert result["after_hooks_removed"] and all(v > 0 for v in median.values())
    assert (result["overhead_window"], result["overhead_after"]) == (
        pytest.approx(median["window"] / median["plain"] - 1), pytest.approx(median["after"] / median["plain"] - 1),
    )


def _edited(profile, tmp_path, edit):
    data = json.loads(json.dumps(profile.to_dict()))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_a_profile_missing_a_layers_statistics_is_refused_for_its_model(small_profile, tmp_path):
    path = _edited(small_profile, tmp_path, lambda d: d["layers"].pop("fc2"))
    with pytest.raises(ProfileError, match=r"layers\['fc2'\]: missing"):
        Profile.load(path, model=_model())


@pytest.mark.parametrize("value", ["nan", "inf", -1.0])
def test_an_amax_the_profiler_did_not_write_is_refused(tmp_path, value):
    model = _model()
    profiler = LayerProfiler(model, window=3)
    with profiler:
        _train(model, profiler, _batches(3))

    def edit(data):
        stats = data["layers"]["fc1"]["tensors"]["activation"]
        assert stats["nonfinite_steps"] == 0  # finite inputs: no step may hold a NaN / inf amax
        stats["amax"][0] = value

    path = _edited(profiler.profile(), tmp_path, edit)
    with pytest.raises(ProfileError, match=r"layers\['fc1'\]\.tensors\.activation\.amax"):
        Profile.load(path, model=_model())


def test_a_histograms_counts_below_and_above_any_threshold_match_a_sum_over_its_bins():
    """Each threshold's counts, read from the bins it splits (found once per threshold), against
    the sum over every finite bin of the part on each side (log-uniform inside the split bin),
    at bin edges, inside bins and outside the finite range."""
    import numpy as np

    from autoprec.profiling.stats import NUM_BINS, Histogram, _EDGES, _FIRST_NONFINITE

    rng = np.random.default_rng(0)
    full = np.zeros(NUM_BINS, dtype=np.int64)
    full[0], full[-1] = 5, 2  # zeros and non-finite: counted on neither side
    full[1000:1030] = rng.integers(0, 50, 30)
    hist = Histogram.from_full(full)
    lo, hi, counts = _EDGES[1:_FIRST_NONFINITE], _EDGES[2 : _FIRST_NONFINITE + 1], full[1:_FIRST_NONFINITE].astype(float)
    thresholds = [float(_EDGES[b]) for b in range(995, 1035, 3)] + [float(np.sqrt(_EDGES[b] * _EDGES[b + 1])) for b in range(995, 1035, 4)]
    for t in thresholds + [0.0, 1e-45, 3e38]:
        inside = (lo < t) & (t < hi)
        with np.errstate(divide="ignore", over="ignore"):  # the branches np.where leaves out
            below_share = np.where(inside, np.log(t / lo) / np.log(hi / lo), (hi <= t).astype(float))
            above_share = np.where(inside, np.log(hi / t) / np.log(hi / lo), (lo >= t).astype(float))
        est, low, high = hist.count_below(t)
        assert est == pytest.approx(float((counts * below_share).sum()), rel=1e-12, abs=1e-9) and low == int(counts[hi <= t].sum())
        assert high == low + int(counts[inside].sum())
        est, low, high = hist.count_above(t)
        assert est == pytest.approx(float((counts * above_share).sum()), rel=1e-12, abs=1e-9) and low == int(counts[lo >= t].sum())
        assert high == low + int(counts[inside].sum())
