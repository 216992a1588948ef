"""`autoprec.monitoring.training_writer`: a training run's precision events, buffered without syncs and
read back with TensorBoard's own `EventAccumulator`."""

import math
import re

import pytest
import torch
from support.drawn_text import drawn_texts, outside, overlaps
from support.tb_events import accumulator, image_of

from autoprec import Format, Plan
from autoprec.errors import FormatError, MonitoringError
from autoprec.monitoring import render_precision_map
from autoprec.monitoring.plans import FORMAT_COLOURS
from autoprec.monitoring.training_writer import FORMAT_INDEX, PrecisionChange, TrainingWriter, render_timeline




def scalars(path, tag) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in accumulator(path).Scalars(tag)]


def texts(path, tag) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode("utf-8")) for e in accumulator(path).Tensors(tag)]


def legend_rows(path) -> list[list[str]]:
    """The rows (value, format, bits, exponent bits) of the run's ``format/legend`` table, as a
    reader of the run sees them."""
    (_, legend), = texts(path, "format/legend")
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in legend.splitlines() if re.match(r"^\|\s*\d+\s*\|", line)]


def formats_read_back(path, fqn) -> list[tuple[int, str]]:
    """``format/<fqn>`` decoded with the legend written into the same run (no autoprec table)."""
    names = {float(value): name for value, name, *_ in legend_rows(path)}
    return [(step, names[value]) for step, value in scalars(path, f"format/{fqn}")]


@pytest.fixture
def writer(tmp_path):
    with TrainingWriter(tmp_path, flush_every=None) as w:
        yield w


# --- per-step scalars ---------------------------------------------------------------------------


def test_step_values_are_written_at_their_steps(writer):
    for step in range(3):
        writer.log_step(step, loss=torch.tensor(2.0 - step, requires_grad=True) * 1, loss_scale=2.0 ** (16 - step), skipped=torch.tensor(step == 1))
    writer.flush()
    assert (scalars(writer.path, "train/loss"), scalars(writer.path, "train/loss_scale"), scalars(writer.path, "train/skipped")) == (
        [(0, 2.0), (1, 1.0), (2, 0.0)], [(0, 65536.0), (1, 32768.0), (2, 16384.0)], [(0, 0.0), (1, 1.0), (2, 0.0)],
    )


@pytest.fixture
def no_reads(monkeypatch):
    """Every way a tensor's value reaches the host raises while this fixture is active."""

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called: a host-device sync")
        return method

    for name in ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    return monkeypatch


def test_logging_a_step_never_reads_a_tensor(writer, no_reads):
    found_inf = torch.tensor([1.0])
    for step in range(5):
        writer.log_step(step, loss=torch.tensor(0.5) * step, loss_scale=torch.tensor(1024.0), skipped=found_inf, scalars={"grad_norm": torch.tensor(3.0)})
        writer.log_layer_counts(step, {"fc1": {"overflow": torch.tensor(step), "nonfinite": torch.tensor(0)}})
        writer.log_memory(step, 1000, torch.tensor(900))
    no_reads.undo()
    writer.flush()
    assert scalars(writer.path, "train/loss") == [(s, 0.5 * s) for s in range(5)] and scalars(writer.path, "overflow/fc1")[-1] == (4, 4.0)


def test_a_buffered_tensor_is_a_copy(writer):
    scale = torch.tensor(65536.0)
    writer.log_step(0, loss_scale=scale)
    scale.mul_(0.5)  # GradScaler.update changes its scale in place
    writer.flush()
    assert scalars(writer.path, "train/loss_scale") == [(0, 65536.0)]


def test_values_wait_for_flush(writer):
    writer.log_step(0, loss=1.0)
    assert "train/loss" not in accumulator(writer.path).Tags()["scalars"] and writer.pending == 1


def test_a_batch_is_written_every_flush_every_steps(tmp_path):
    with TrainingWriter(tmp_path, flush_every=3) as w:
        for step in range(7):
            w.log_step(step, loss=torch.tensor(float(step)))
        before = scalars(w.path, "train/loss")
        w.flush()
        after = scalars(w.path, "train/loss")
    assert (before, after) == ([(s, float(s)) for s in range(6)], [(s, float(s)) for s in range(7)])


def test_skipped_steps_are_counted(writer):
    for step, skipped in enumerate([True, False, torch.tensor([2.0]), torch.tensor(False), 1]):
        writer.log_step(step, skipped=skipped)
    writer.flush()
    assert scalars(writer.path, "train/skipped_total") == [(0, 1.0), (1, 1.0), (2, 2.0), (3, 2.0), (4, 3.0)]


def test_non_scalar_tensor_is_refused(writer):
    with pytest.raises(MonitoringError, match=r"loss must be a scalar \(one element\), got a tensor of shape \(4,\)"):
        writer.log_step(0, loss=torch.zeros(4))


def test_tensor_step_is_refused(writer):
    with pytest.raises(MonitoringError, match="step must be a Python int, got Tensor"):
        writer.log_step(torch.tensor(3), loss=1.0)


# --- per-layer counts and memory -----------------------------------------------------------------


def test_layer_counts_are_one_scalar_per_layer_and_kind(writer):
    writer.log_layer_counts(10, {"blocks.0.fc1": {"overflow": 3, "underflow": torch.tensor(7), "nonfinite": 0}, "lm_head": {"overflow": 1}})
    writer.flush()
    tags = {t for t in accumulator(writer.path).Tags()["scalars"]}
    assert tags == {"overflow/blocks.0.fc1", "underflow/blocks.0.fc1", "nonfinite/blocks.0.fc1", "overflow/lm_head"}
    assert scalars(writer.path, "underflow/blocks.0.fc1") == [(10, 7.0)]


def test_memory_is_written_with_its_ratio(writer):
    writer.log_memory(5, predicted_bytes=4_000_000, measured_bytes=5_000_000)
    writer.log_memory(6, predicted_bytes=4_000_000)
    writer.flush()
    assert (scalars(writer.path, "memory/measured_bytes"), scalars(writer.path, "memory/measured_vs_predicted"), len(scalars(writer.path, "memory/predicted_bytes"))) == (
        [(5, 5e6)], [(5, 1.25)], 2,
    )


# --- gradient histograms ---------------------------------------------------------------------------


def histogram(path, tag):
    (event,) = accumulator(path).Histograms(tag)
    return event.step, event.histogram_value


def test_histogram_has_the_gradients_count_range_and_sums(writer):
    grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    writer.log_grad_histograms(7, {"fc1": grad}, bins=20)
    writer.flush()
    step, h = histogram(writer.path, "grad/fc1")
    assert (step, h.num, len(h.bucket), sum(h.bucket), h.min, h.max, h.bucket_limit[-1]) == (
        7, 2048, 20, 2048, pytest.approx(grad.min().item()), pytest.approx(grad.max().item()), pytest.approx(grad.max().item()),
    )
    assert (h.sum, h.sum_squares) == (pytest.approx(grad.sum().item(), rel=1e-4), pytest.approx((grad * grad).sum().item(), rel=1e-4))


def test_histogram_buckets_match_a_reference(writer):
    grad = torch.tensor([0.0, 0.1, 0.2, 0.9, 1.0, 1.0])
    writer.log_grad_histograms(0, {"w": grad}, bins=4)
    writer.flush()
    _, h = histogram(writer.path, "grad/w")
    assert (list(h.bucket), list(h.bucket_limit)) == ([3, 0, 0, 3], pytest.approx([0.25, 0.5, 0.75, 1.0]))


def test_histogram_leaves_out_non_finite_values(writer):
    writer.log_grad_histograms(0, {"w": torch.tensor([1.0, float("inf"), -2.0, float("nan")], dtype=torch.bfloat16)})
    writer.flush()
    _, h = histogram(writer.path, "grad/w")
    assert (h.num, h.min, h.max, sum(h.bucket)) == (2, -2.0, 1.0, 2)


def test_histogram_of_a_constant_has_one_bucket(writer):
    writer.log_grad_histograms(0, {"w": torch.full((10,), 0.5)})
    writer.flush()
    _, h = histogram(writer.path, "grad/w")
    assert (list(h.bucket), list(h.bucket_limit)) == ([10], [0.5])


# --- precision changes ------------------------------------------------------------------------------


def test_format_scalar_steps_up_on_every_promotion_and_down_on_every_demotion():
    # What the index is for: a promotion draws as a step up. Checked against the policy's own
    # notion of direction (PrecisionChange, from the formats' bits) over every pair of formats.
    assert sorted(FORMAT_INDEX.values()) == list(range(len(Format)))
    for a in Format:
        for b in Format:
            direction = PrecisionChange(0, "x", a, b).direction
            rise = FORMAT_INDEX[b] - FORMAT_INDEX[a]
            assert (direction != "promotion" or rise > 0) and (direction != "demotion" or rise < 0), (a, b, direction, rise)


def test_change_writes_the_layers_format_scalar_at_its_step(writer):
    writer.log_formats(0, {"fc1": "fp8_e4m3", "fc2": Format.BF16})
    writer.log_change(300, "fc1", "fp8_e4m3", "bf16", "overflow in 3 of 100 steps")
    writer.log_change(900, "fc1", "bf16", "fp8_e4m3", "amax stable")
    writer.flush()
    assert formats_read_back(writer.path, "fc1") == [(0, "fp8_e4m3"), (300, "bf16"), (900, "fp8_e4m3")]
    assert formats_read_back(writer.path, "fc2") == [(0, "bf16")]


def test_format_legend_names_every_format_once_with_its_own_numbers(writer):
    writer.log_formats(0, {"fc1": "int8"})
    writer.flush()
    rows = legend_rows(writer.path)
    assert sorted(int(value) for value, *_ in rows) == list(range(len(Format)))
    assert sorted(name for _, name, *_ in rows) == sorted(f.value for f in Format)
    assert all((int(bits), int(exponent)) == (Format(name).bits, Format(name).spec.exponent_bits) for _, name, bits, exponent in rows)


def test_timeline_lists_every_change_with_its_reason_once_per_step(writer):
    writer.log_change(100, "fc1", "fp8_e4m3", "bf16", "overflow")
    writer.log_change(100, "fc2", "fp8_e4m3", "fp16", "underflow | saturation")
    writer.log_change(200, "fc1", "bf16", "fp8_e4m3", "amax stable again")
    writer.flush()
    timeline = texts(writer.path, "precision/timeline")
    assert [step for step, _ in timeline] == [100, 200]
    last = timeline[-1][1]
    assert "3 precision changes" in last and "| 100 | `fc1` | `fp8_e4m3` | `bf16` | promotion | overflow |" in last
    assert "underflow \\| saturation" in last and "| 200 | `fc1` | `bf16` | `fp8_e4m3` | demotion | amax stable again |" in last


def test_timeline_counts_promotions_and_demotions(writer):
    writer.log_change(1, "a", "int8", "bf16", "r")
    writer.log_change(2, "b", "fp8_e4m3", "fp8_e5m2", "r")
    writer.log_change(3, "a", "bf16", "int8", "r")
    writer.flush()
    assert [scalars(writer.path, f"precision/{k}") for k in ("changes", "promotions", "demotions")] == [
        [(1, 1), (2, 2), (3, 3)], [(1, 1), (2, 1), (3, 1)], [(1, 0), (2, 0), (3, 1)],
    ]


def test_a_backward_change_shows_its_gradient_formats_and_counts_by_them(writer):
    """A high-precision backward taken (the format kept, FP8 gradients to FP32) is a promotion
    in the counts, and its row names the gradient formats; given back, a demotion."""
    change = writer.log_change(4, "fc1", "fp8_e4m3", "fp8_e4m3", "grad values underflow", "fp8_e5m2", "fp32")
    assert (change.old_grad, change.new_grad, change.direction) == (Format.FP8_E5M2, Format.FP32, "promotion")
    writer.log_change(8, "fc1", "fp8_e4m3", "fp8_e4m3", "stable", "fp32", "fp8_e5m2")
    writer.flush()
    assert [scalars(writer.path, f"precision/{k}")[-1] for k in ("promotions", "demotions")] == [(8, 1), (8, 1)]
    last = texts(writer.path, "precision/timeline")[-1][1]
    assert "| 4 | `fc1` | `fp8_e4m3`, gradients `fp8_e5m2` | `fp8_e4m3`, gradients `fp32` | promotion | grad values underflow |" in last


def test_timeline_keeps_the_newest_rows(tmp_path):
    with TrainingWriter(tmp_path, timeline_rows=2) as w:
        for step in range(4):
            w.log_change(step, f"l{step}", "bf16", "fp32", f"reason {step}")
    (_, last) = texts(w.path, "precision/timeline")[-1]
    assert "4 precision changes (the last 2 shown)" in last and "reason 3" in last and "reason 1" not in last


def test_change_direction_follows_the_bits():
    assert [PrecisionChange(0, "x", a, b).direction for a, b in [(Format.INT8, Format.FP16), (Format.FP32, Format.BF16), (Format.FP16, Format.BF16)]] == ["promotion", "demotion", "lateral"]


def test_unknown_format_names_the_choices(writer):
    with pytest.raises(FormatError, match="unknown format 'fp4'"):
        writer.log_change(0, "fc1", "bf16", "fp4", "r")


def test_plan_is_written_into_the_run_with_its_formats(writer):
    plan = Plan({"embed": "fp32", "fc1": "fp8_e4m3", "head": "int8"})
    writer.log_plan(50, plan, "start")
    writer.flush()
    acc = accumulator(writer.path)
    (event,) = acc.Images("plan/precision_map")
    expected = render_precision_map(plan, "start")
    x, y = expected.cell_center("head", "int8")
    assert (event.width, event.height) == expected.size == image_of(event).shape[1::-1]
    assert tuple(int(v) for v in image_of(event)[y, x]) == FORMAT_COLOURS[Format.INT8]
    assert (event.step, formats_read_back(writer.path, "embed"), sorted(acc.Tags()["tensors"])) == (
        50, [(50, "fp32")], ["format/legend", "plan/layers", "plan/summary"],
    )
    assert acc.Tags()["images"] == ["plan/precision_map"]  # no loss scale, skip or change: no timeline figure


# --- the timeline figure ----------------------------------------------------------------------------


def run_with_changes(writer):
    """2000 steps: the loss scale halving on each skipped step (150, 151, 900) and doubling every
    500 clean ones; two layers swapped at steps 500 and 1000, one sideways at 1500."""
    scale = 4096.0
    for step in range(2000):
        skipped = step in (150, 151, 900)
        writer.log_step(step, loss=torch.tensor(1.0), loss_scale=torch.tensor(scale), skipped=torch.tensor(skipped))
        scale = scale / 2 if skipped else (scale * 2 if step % 500 == 499 else scale)
        if step in (500, 1000):
            writer.log_change(step, "fc1", "fp8_e4m3", "bf16", "overflow")
            writer.log_change(step, "fc2", "bf16", "fp8_e4m3", "quiet")
        if step == 1500:
            writer.log_change(step, "fc3", "fp8_e4m3", "fp8_e5m2", "range")


def test_timeline_figure_is_written_with_each_change_and_at_close(tmp_path):
    with TrainingWriter(tmp_path, flush_every=100) as w:
        run_with_changes(w)
    events = accumulator(w.path).Images("train/timeline")
    # Each change step's table brings a figure (at the latest step written then); closing adds the whole run.
    assert [e.step for e in events] == [999, 1499, 1999]
    assert all((e.width, e.height) == (800, 480) and image_of(e).shape == (480, 800, 3) for e in events)


def test_timeline_draws_the_loss_scale_the_skips_on_it_and_the_changes_by_direction():
    changes = [PrecisionChange(500, "a", Format.FP8_E4M3, Format.BF16), PrecisionChange(900, "b", Format.BF16, Format.INT8),
               PrecisionChange(900, "c", Format.INT8, Format.FP16), PrecisionChange(1200, "d", Format.FP8_E4M3, Format.FP8_E5M2)]
    scale = [(0, 65536.0), (100, 32768.0), (101, 16384.0), (700, 512.0)]
    drawing = render_timeline(scale, [100, 101, 700], changes, end=1500)
    top, bottom = drawing.figure.axes
    assert top.get_yscale() == "log"  # 512 to 65536: more than a decade
    (skips,) = top.collections
    assert [tuple(p) for p in skips.get_offsets()] == [(100, 32768.0), (101, 16384.0), (700, 512.0)]  # the scale logged at that step
    marks = {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in bottom.collections}
    assert marks == {"promotions": [(500, 1), (900, 2)], "demotions": [(900, -1)], "lateral changes": [(1200, 0)]}
    drawn = drawn_texts(drawing)
    assert overlaps(drawn) == [] and outside(drawn, drawing) == [] and any("2 promotions, 1 demotions" in t for t, _ in drawn)


def test_constant_loss_scale_is_a_linear_axis():
    drawing = render_timeline([(0, 4096.0)], [], [], end=100)
    assert drawing.figure.axes[0].get_yscale() == "linear" and math.isclose(drawing.figure.axes[0].lines[0].get_ydata()[-1], 4096.0)


# --- lifetime ---------------------------------------------------------------------------------------


def test_disabled_writer_is_a_pass_through(tmp_path):
    with TrainingWriter(tmp_path / "tb", enabled=False) as w:
        w.log_step(0, loss=torch.tensor(1.0))
        w.log_change(0, "fc1", "bf16", "fp32", "r")
        w.log_grad_histograms(0, {"fc1": torch.ones(3)})
    assert not (tmp_path / "tb").exists()


def test_leaving_a_with_block_on_error_writes_what_was_buffered(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with TrainingWriter(tmp_path, flush_every=None) as w:
            w.log_step(0, loss=torch.tensor(1.5))
            raise RuntimeError("boom")
    assert scalars(w.path, "train/loss") == [(0, 1.5)]


def test_closed_writer_refuses_more(writer):
    writer.close()
    with pytest.raises(MonitoringError, match="is closed; open a new one"):
        writer.log_step(1, loss=1.0)


def test_flush_every_must_be_positive(tmp_path):
    with pytest.raises(MonitoringError, match=r"flush_every must be a positive int \(steps\) or None"):
        TrainingWriter(tmp_path, flush_every=0)


def test_unwritable_logdir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MonitoringError, match=r"^cannot write to logdir .*file.*: it or a parent is a file, not a directory; choose a writable --logdir$"):
        TrainingWriter(blocker / "tb")
