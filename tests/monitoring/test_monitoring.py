"""`autoprec.monitoring`: plans and their differences, for a person, in TensorBoard.

Event files are read back with TensorBoard's own `EventAccumulator`; one real `tensorboard`
process on 127.0.0.1 (shared by the HTTP tests, always stopped) serves the same runs.
"""

import gc
import io
import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import matplotlib.image
import numpy as np
import pytest
import torch.nn as nn
from support.drawn_text import drawn_texts, outside, overlaps
from support.tb_events import accumulator, image_of, text_of
from tensorboard.plugins.hparams import metadata as hparams_metadata

from autoprec import Format, LayerPrecision, Plan, PlanError, Scaling
from autoprec.errors import MonitoringError
from autoprec.monitoring import PlanWriter, diff_plans, load_plans, render_precision_map, start_tensorboard, write_review
from autoprec.monitoring.plans import (
    CHANGED_COLUMN,
    FORMAT_COLOURS,
    ROW_HEIGHT,
    budget_checks,
    plan_hparams,
    plan_layers_markdown,
    plan_scalars,
    plan_summary_markdown,
)

LAYERS = {
    "embed": "fp32",
    "blocks.0.attn.qkv": "bf16",
    "blocks.0.attn.out": "fp8_e4m3",
    "blocks.0.mlp.fc1": "int8",
    "blocks.0.mlp.fc2": "fp16",
    "lm_head": "fp8_e5m2",
}


def make_plan(**changes) -> Plan:
    layers = {fqn: LayerPrecision(fmt, reason=f"cheapest for {fqn}") for fqn, fmt in LAYERS.items()}
    predicted = {
        "bytes": 6_000_000, "seconds": 0.012, "loss_increase": 0.004, "fp32_bytes": 20_000_000, "fp32_seconds": 0.02,
        "layers": {fqn: {"bytes": 1_000_000 + i, "seconds": 0.001 * (i + 1), "loss": 0.0005 * i} for i, fqn in enumerate(LAYERS)},
    }
    plan = Plan(layers, predicted=predicted, budgets={"memory": 0.5, "loss_increase": 0.003}, metadata={"source": "test"})
    return plan.with_layers(changes) if changes else plan


@pytest.fixture(scope="module")
def plan():
    return make_plan()


@pytest.fixture(scope="module")
def other():
    """`plan` with qkv in FP8 (half its bytes) and delayed scaling on the output projection."""
    changed = make_plan(**{
        "blocks.0.attn.qkv": LayerPrecision("fp8_e4m3", reason="fits the memory budget"),
        "blocks.0.attn.out": LayerPrecision("fp8_e4m3", scaling=Scaling(mode="delayed"), reason="amax drifts"),
    })
    predicted = json.loads(json.dumps(dict(changed.predicted)))
    predicted["layers"]["blocks.0.attn.qkv"]["bytes"] = 500_001
    return changed.replace(predicted=predicted)






def colour_at(pixels: np.ndarray, xy) -> tuple:
    """The RGB colour at ``(x, y)`` of a ``(height, width, 3)`` image."""
    x, y = xy
    return tuple(int(v) for v in pixels[y, x])


# --- rendering --------------------------------------------------------------------------------


def test_every_format_draws_in_a_colour_of_its_own():
    # Read off the rendered map, one layer per format: each filled cell differs from every other
    # format's filled cell and from every empty cell.
    plan = Plan({f"layers.{i}": f for i, f in enumerate(Format)})
    picture = render_precision_map(plan)
    image = picture.to_array()

    def colour(i, fmt):
        x, y = picture.cell_center(f"layers.{i}", fmt.value)
        return tuple(image[y, x])

    filled = {colour(i, f) for i, f in enumerate(Format)}
    empty = {colour(i, g) for i, f in enumerate(Format) for g in Format if g is not f}
    assert len(filled) == len(Format) and not filled & empty


def test_map_fills_a_layers_format_cell_in_its_colour(plan):
    picture = render_precision_map(plan)
    image = picture.to_array()
    x, y = picture.cell_center("blocks.0.mlp.fc1", "int8")
    assert tuple(image[y, x]) == FORMAT_COLOURS[Format.INT8]


def test_map_leaves_the_other_formats_of_a_row_empty(plan):
    picture = render_precision_map(plan)
    image = picture.to_array()
    colours = {tuple(image[y, x]) for x, y in (picture.cell_center("blocks.0.mlp.fc1", f.value) for f in Format if f is not Format.INT8)}
    assert not colours & set(FORMAT_COLOURS.values())


def test_map_names_every_layer_of_a_small_plan_in_rows_of_a_line_each(plan):
    picture = render_precision_map(plan)
    rows = [picture.cell_center(fqn, "fp32")[1] for fqn in LAYERS]
    assert picture.named == tuple(LAYERS) and all(b - a == pytest.approx(ROW_HEIGHT, abs=1) for a, b in zip(rows, rows[1:]))


def test_map_of_hundreds_of_layers_stays_readable_and_names_every_kth():
    # 500 layers in a bounded image: each row its own pixels (its cell still in its colour),
    # a regular subset of the names written without two touching, the rest left to the table.
    plan = Plan({f"model.layers.{i}.attention.proj": list(Format)[i % 6] for i in range(500)})
    picture = render_precision_map(plan)
    pixels = picture.to_array()
    stride = list(plan.layers).index(picture.named[1])
    assert picture.size[1] < 1500 and 1 < stride and picture.named == tuple(list(plan.layers)[::stride])
    assert all(colour_at(pixels, picture.cell_center(fqn, lp.format.value)) == FORMAT_COLOURS[lp.format] for fqn, lp in plan.layers.items())
    drawn = drawn_texts(picture)
    assert overlaps(drawn) == [] and outside(drawn, picture) == []
    assert sum(f"  {fqn}" in text for fqn in plan.layers for text, _ in drawn) == len(picture.named)


def test_layer_table_has_every_layer_format_and_reason(plan):
    table = plan_layers_markdown(plan)
    assert all(f"`{fqn}`" in table and fmt in table and f"cheapest for {fqn}" in table for fqn, fmt in LAYERS.items())


def test_layer_table_shows_predicted_figures_and_dashes_for_measured(plan):
    row = next(line for line in plan_layers_markdown(plan).splitlines() if "`lm_head`" in line)
    assert "976.6 KiB / –" in row and "6 ms / –" in row and "0.0025 / –" in row


def test_uniform_plan_renders_with_dashes():
    plan = Plan.uniform(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), "bf16")
    summary = plan_summary_markdown(plan, "uniform")
    assert "| memory | – | – | – / – |" in summary and "budgets: –" in summary


def test_summary_checks_each_budget(plan):
    summary = plan_summary_markdown(plan, "a")
    assert "| memory | 50 % of FP32 = 9.5 MiB | 5.7 MiB ✓ | – |" in summary and "| loss increase | 0.003 | 0.004 ✗ over | – |" in summary


def test_memory_fraction_is_read_against_fp32_bytes(plan):
    memory = next(c for c in budget_checks(plan) if c.name == "memory")
    assert memory.bound == 0.5 * 20_000_000


def test_scalars_are_the_figures_the_plan_has(plan):
    assert plan_scalars(plan) == pytest.approx({
        "plan/predicted_bytes": 6e6, "plan/predicted_seconds": 0.012, "plan/predicted_loss_increase": 0.004,
        "plan/predicted_fp32_bytes": 2e7, "plan/predicted_fp32_seconds": 0.02,
        "plan/predicted_bytes_vs_fp32": 0.3, "plan/predicted_seconds_vs_fp32": 0.6,
    })


def test_hparams_count_every_format_and_budget(plan):
    hparams = plan_hparams(plan, "a")
    assert {k: hparams[k] for k in ("count/fp32", "count/bf16", "count/int8", "budget/memory", "layers")} == {
        "count/fp32": 1, "count/bf16": 1, "count/int8": 1, "budget/memory": 0.5, "layers": 6,
    }


# --- differences ------------------------------------------------------------------------------


def test_diff_lists_changed_layers_in_model_order(plan, other):
    diff = diff_plans(plan, other)
    assert [(d.layer, d.before, d.after) for d in diff] == [
        ("blocks.0.attn.qkv", Format.BF16, Format.FP8_E4M3),
        ("blocks.0.attn.out", Format.FP8_E4M3, Format.FP8_E4M3),
    ]


def test_diff_names_scaling_changes_but_not_implied_gradient_formats(plan, other):
    changes = {d.layer: d.changes for d in diff_plans(plan, other)}
    assert changes == {"blocks.0.attn.qkv": (), "blocks.0.attn.out": ("scaling.mode: current → delayed",)}


def test_diff_reports_layers_only_one_plan_has(plan):
    smaller = Plan({fqn: lp for fqn, lp in plan.layers.items() if fqn != "lm_head"})
    assert [(d.layer, d.before, d.after) for d in diff_plans(plan, smaller)] == [("lm_head", Format.FP8_E5M2, None)]


def test_identical_plans_say_so(plan):
    assert diff_plans(plan, make_plan(), ("a", "b")).format_table() == "a → b: identical (6 layers)"


def test_diff_carries_predicted_deltas(plan, other):
    qkv = next(d for d in diff_plans(plan, other) if d.layer == "blocks.0.attn.qkv")
    assert (qkv.bytes_delta, qkv.seconds_delta) == (-500_000, 0)


def test_diff_table_aligns_its_columns(plan, other):
    header, qkv, out = diff_plans(plan, other, ("a", "b")).format_table().splitlines()[1:]
    column = header.index("other changes")
    assert qkv[column:].startswith("–  ") and out[column:].startswith("scaling.mode: current → delayed")


def test_diff_table_shows_signed_deltas(plan, other):
    qkv = diff_plans(plan, other, ("a", "b")).format_table().splitlines()[2]
    assert "-488.3 KiB" in qkv and "fits the memory budget" in qkv


# --- event files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def review(tmp_path_factory, plan, other):
    return write_review([("a", plan), ("b", other)], tmp_path_factory.mktemp("review") / "tb")


def test_review_writes_a_run_per_plan_and_per_pair(review):
    assert sorted(review.runs) == ["diffs/a-vs-b", "plans/a", "plans/b"]


def test_plan_run_has_image_text_and_scalar_tags(review):
    tags = accumulator(review.runs["plans/a"]).Tags()
    assert (tags["images"], sorted(tags["tensors"]), "plan/predicted_bytes" in tags["scalars"]) == (
        ["plan/precision_map"], ["plan/layers", "plan/summary"], True,
    )


def test_plan_image_decodes_to_the_map(review, plan):
    event = accumulator(review.runs["plans/a"]).Images("plan/precision_map")[0]
    pixels = image_of(event)
    expected = render_precision_map(plan, "a")
    assert pixels.shape[1::-1] == expected.size == (event.width, event.height)
    assert colour_at(pixels, expected.cell_center("lm_head", "fp8_e5m2")) == FORMAT_COLOURS[Format.FP8_E5M2]


def test_map_texts_neither_overlap_nor_leave_the_image(plan):
    picture = render_precision_map(plan.with_recompute({"blocks.0": True}), "a plan with a long name to fit")
    drawn = drawn_texts(picture)
    assert overlaps(drawn) == [] and outside(drawn, picture) == [] and any("a plan with a long name to fit" in t for t, _ in drawn)


def test_plan_text_names_every_layer_and_format(review):
    text = text_of(accumulator(review.runs["plans/b"]), "plan/layers")
    assert all(f"`{fqn}`" in text for fqn in LAYERS) and text.count("`fp8_e4m3") == 2


def test_plan_scalar_has_the_predicted_total(review):
    (event,) = accumulator(review.runs["plans/a"]).Scalars("plan/predicted_bytes_vs_fp32")
    assert (event.step, event.value) == (0, pytest.approx(0.3))


def test_plan_run_is_an_hparams_session(review):
    content = accumulator(review.runs["plans/b"]).PluginTagToContent("hparams")[hparams_metadata.SESSION_START_INFO_TAG]
    hparams = hparams_metadata.parse_session_start_info_plugin_data(content).hparams
    assert (hparams["plan"].string_value, hparams["count/fp8_e4m3"].number_value, hparams["count/bf16"].number_value) == ("b", 2, 0)


def test_diff_run_lists_the_changed_layers(review):
    text = text_of(accumulator(review.runs["diffs/a-vs-b"]), "diff/layers")
    assert "2 of 6 layers differ" in text and "`blocks.0.attn.qkv` | `bf16` | `fp8_e4m3`" in text


def test_diff_image_marks_both_formats_of_a_changed_layer(review, plan, other):
    event = accumulator(review.runs["diffs/a-vs-b"]).Images("diff/precision_map")[0]
    pixels = image_of(event)
    expected = diff_plans(plan, other, ("a", "b")).render()
    assert pixels.shape[1::-1] == expected.size == (event.width, event.height)
    cells = [colour_at(pixels, expected.cell_center("blocks.0.attn.qkv", name)) for name in ("a", "b", CHANGED_COLUMN)]
    unchanged = colour_at(pixels, expected.cell_center("lm_head", CHANGED_COLUMN))
    assert cells == [FORMAT_COLOURS[Format.BF16], FORMAT_COLOURS[Format.FP8_E4M3], (0, 0, 0)] and unchanged != (0, 0, 0)


def test_reviewing_again_replaces_the_runs(tmp_path, plan, other):
    write_review([("a", plan), ("b", other)], tmp_path)
    write_review([("a", other), ("b", plan)], tmp_path)
    images = accumulator(tmp_path / "plans" / "a").Images("plan/precision_map")
    assert len(images) == 1


def test_writer_adds_later_steps_to_a_run(tmp_path, plan, other):
    with PlanWriter(tmp_path) as writer:
        writer.write_plan(plan, "live", step=0)
        path = writer.write_plan(other, "live", step=100)
    assert [e.step for e in accumulator(path).Images("plan/precision_map")] == [0, 100]


def test_review_table_has_a_line_per_plan_and_the_diff(review):
    lines = review.format_table().splitlines()
    assert lines[0].startswith("a: 6 layers") and lines[1].startswith("b: 6 layers") and "a → b: 2 of 6 layers differ" in lines[3]


def test_writing_figures_leaves_the_users_matplotlib_as_it_was(tmp_path, plan, other):
    # The figures draw on their own Agg canvas: no pyplot figure is opened, no backend switched.
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    write_review([("a", plan), ("b", other)], tmp_path)
    assert (matplotlib.get_backend(), plt.get_fignums()) == (backend, [])


def test_importing_autoprec_and_its_monitoring_loads_no_matplotlib():
    code = "import sys, autoprec, autoprec.monitoring; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=pathlib.Path(__file__).parents[2])
    assert out.stdout.strip() == "False"


# --- bad input --------------------------------------------------------------------------------


def test_missing_plan_file_names_it(tmp_path):
    with pytest.raises(PlanError, match="nope.json: no such plan file"):
        load_plans([tmp_path / "nope.json"])


def test_malformed_plan_file_says_where(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1, "layers": ')
    with pytest.raises(PlanError, match=r"bad.json: not valid JSON \(line 1"):
        load_plans([path])


def test_plans_are_named_by_file_stem(tmp_path, plan):
    paths = [plan.save(tmp_path / "x" / "p.json"), plan.save(tmp_path / "y" / "p.json"), plan.save(tmp_path / "q.json")]
    assert [name for name, _ in load_plans(paths)] == ["p", "p-2", "q"]


def test_unwritable_logdir_is_one_line(tmp_path, plan):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MonitoringError, match=r"^cannot write to logdir .*file.*: it or a parent is a file, not a directory; choose a writable --logdir$"):
        write_review([("a", plan)], blocker / "tb")


def test_names_sharing_a_run_are_refused(tmp_path, plan):
    with pytest.raises(MonitoringError, match="would share the run 'a_b'"):
        write_review([("a/b", plan), ("a b", plan)], tmp_path)


def test_review_needs_a_plan(tmp_path):
    with pytest.raises(MonitoringError, match="no plans to review"):
        write_review([], tmp_path)


def test_tensorboard_needs_an_existing_logdir(tmp_path):
    with pytest.raises(MonitoringError, match="is not a directory"):
        start_tensorboard(tmp_path / "missing")


def test_tensorboard_on_a_taken_port_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(MonitoringError, match="already in use"):
            start_tensorboard(tmp_path, port=taken.getsockname()[1], timeout=30)


# --- a real TensorBoard -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(review):
    tb = start_tensorboard(review.logdir, timeout=60)
    try:
        deadline = time.monotonic() + 30
        while len(fetch(tb, "data/runs")) < len(review.runs) and time.monotonic() < deadline:
            time.sleep(0.2)  # TensorBoard loads event files on a background thread
        yield tb
    finally:
        tb.stop()


def fetch(tb, route, **query):
    url = tb.url + route + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=20) as response:
        body = response.read()
    return body if response.headers.get_content_type() == "image/png" else json.loads(body)


def test_server_lists_the_review_runs(server):
    assert sorted(fetch(server, "data/runs")) == ["diffs/a-vs-b", "plans/a", "plans/b"]


def test_server_serves_the_plan_image(server, plan):
    (entry,) = fetch(server, "data/plugin/images/images", run="plans/a", tag="plan/precision_map")
    png = fetch(server, "data/plugin/images/individualImage?" + entry["query"])
    pixels = np.round(matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(np.uint8)
    assert colour_at(pixels, render_precision_map(plan, "a").cell_center("embed", "fp32")) == FORMAT_COLOURS[Format.FP32]


def test_server_serves_the_layer_table_as_html(server):
    (entry,) = fetch(server, "data/plugin/text/text", run="plans/a", tag="plan/layers")
    assert "<table>" in entry["text"] and all(fqn in entry["text"] for fqn in LAYERS)


def test_server_hparams_view_has_counts_and_metrics(server):
    experiment = fetch(server, "data/plugin/hparams/experiment", request=json.dumps({"experimentName": ""}))
    hparams = {h["name"] for h in experiment["hparamInfos"]}
    metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
    assert {f"count/{f.value}" for f in Format} <= hparams and "plan/predicted_bytes" in metrics


def test_stopped_server_leaves_no_process(tmp_path):
    tb = start_tensorboard(tmp_path, timeout=60)
    process = tb._process
    tb.stop()
    assert process.poll() is not None


def test_dropped_server_is_stopped(tmp_path):
    process = start_tensorboard(tmp_path, timeout=60)._process
    gc.collect()
    assert process.poll() is not None


# -- recomputed blocks (issue 24) -------------------------------------------------------------


def test_map_marks_the_layers_of_recomputed_blocks_in_a_column_of_their_own(plan):
    from autoprec.monitoring.plans import RECOMPUTE_COLUMN, _RECOMPUTED

    recomputed = plan.with_recompute({"blocks.0": True, "blocks.1": False})
    picture = render_precision_map(recomputed)
    image = picture.to_array()
    assert picture.columns[-1] == RECOMPUTE_COLUMN
    inside = [fqn for fqn in plan.layers if fqn.startswith("blocks.0.")]
    outside = [fqn for fqn in plan.layers if not fqn.startswith("blocks.0.")]
    assert inside and outside
    assert all(tuple(image[y, x]) == _RECOMPUTED for x, y in (picture.cell_center(f, RECOMPUTE_COLUMN) for f in inside))
    assert all(tuple(image[y, x]) != _RECOMPUTED for x, y in (picture.cell_center(f, RECOMPUTE_COLUMN) for f in outside))
    assert RECOMPUTE_COLUMN not in render_precision_map(plan).columns  # a plan recomputing nothing: the map as before


def test_summary_and_line_name_the_recomputed_blocks(plan):
    from autoprec.monitoring.plans import format_plan_line, plan_summary_markdown

    recomputed = plan.with_recompute({"blocks.0": True, "blocks.1": False})
    summary = plan_summary_markdown(recomputed, "p")
    assert "recomputed blocks: 1 of 2" in summary and "| `blocks.0` | yes |" in summary and "| `blocks.1` | no |" in summary
    assert "recomputed" not in plan_summary_markdown(plan, "p")
    assert format_plan_line(recomputed, "p").startswith(f"p: {len(plan)} layers (") and ", 1 blocks recomputed" in format_plan_line(recomputed, "p")


def test_summary_gives_the_searchs_reason_for_each_block(plan):
    reasons = {"blocks.0": "recomputed: frees 10 KiB", "blocks.1": "kept: recomputing would free 9 KiB"}
    searched = plan.with_recompute({"blocks.0": True, "blocks.1": False}).replace(metadata={"recompute_reasons": reasons})
    summary = plan_summary_markdown(searched, "p")
    assert "| `blocks.0` | yes | " in summary and "| recomputed: frees 10 KiB |" in summary
    assert "| `blocks.1` | no |" in summary and "| kept: recomputing would free 9 KiB |" in summary
    assert "| why |" not in plan_summary_markdown(plan.with_recompute({"blocks.0": True}), "p")  # a hand-made plan has no reasons
