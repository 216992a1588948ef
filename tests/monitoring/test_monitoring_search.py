"""`autoprec.monitoring.search`: studies of measured plans (as the search job's measured stage
leaves them) and candidate plans, written as TensorBoard runs and read back with TensorBoard's own
`EventAccumulator`."""

import numpy as np
import optuna
import pytest
from support.drawn_text import drawn_texts, outside, overlaps
from support.tb_events import accumulator, image_of, text_of
from tensorboard.plugins.hparams import metadata as hparams_metadata

from autoprec import Format, Plan
from autoprec.errors import MonitoringError
from autoprec.monitoring.figures import mpl_colour
from autoprec.monitoring.plans import budget_scalars, render_precision_map
from autoprec.monitoring.search import (
    BUDGET_COLOUR,
    CHOSEN_COLOUR,
    FEASIBLE_COLOUR,
    INFEASIBLE_COLOUR,
    MEASURED_COLOUR,
    PARETO_COLOUR,
    TrialPoint,
    best_so_far,
    pareto_front,
    render_pareto,
    render_progress,
    search_points,
    search_summary_markdown,
    study_budgets,
    write_candidates,
    write_search,
)
from autoprec.search import Choice, SearchSpace
from autoprec.search.study import feasible

optuna.logging.set_verbosity(optuna.logging.WARNING)
FORMATS = (Format.FP32, Format.BF16, Format.FP8_E4M3, Format.INT8)


def tradeoff_table(layers, seed):
    """Costs with a memory/time trade-off (the idea of test_search's `random_table`): INT8 holds
    the fewest bytes but dequantizes, so it is slower than FP8, which carries its scales."""
    rng = np.random.default_rng(seed)
    table = {}
    for i in range(layers):
        size, t = rng.integers(1, 50) * 1e4, rng.uniform(1e-4, 1e-3)
        sensitivity = rng.lognormal(-6, 1.5)
        shape = {Format.FP32: (4.0, 1.0, 0.0), Format.BF16: (2.0, 0.55, 0.2), Format.FP8_E4M3: (1.2, 0.35, 1.0), Format.INT8: (1.0, 0.7, 1.5)}
        table[f"blocks.{i // 4}.layer{i % 4}"] = {
            f: Choice(size * b, t * s * rng.uniform(0.9, 1.1), sensitivity * sens * rng.uniform(0.5, 2)) for f, (b, s, sens) in shape.items()
        }
    return table






def colour_at(pixels: np.ndarray, xy) -> tuple:
    x, y = xy
    return tuple(int(v) for v in pixels[y, x])


def colours(pixels: np.ndarray) -> set:
    return {tuple(int(v) for v in c) for c in np.unique(pixels.reshape(-1, 3), axis=0)}


def plot_area(figure, pixels: np.ndarray) -> np.ndarray:
    """The pixels inside the memory panel's axes."""
    box = figure.axes.get_window_extent()
    height = pixels.shape[0]
    return pixels[int(height - box.y1) + 2:int(height - box.y0) - 2, int(box.x0) + 2:int(box.x1) - 2]


def crowded_points(n=300, seed=0):
    """``n`` trials packed into a small corner, one in 37 far slower than the rest (a step-time
    axis spanning two decades), half of them over a budget."""
    rng = np.random.default_rng(seed)
    points = []
    for i in range(n):
        b, t, loss = float(rng.uniform(2e6, 8e6)), float(rng.uniform(1e-3, 3e-3)), float(rng.uniform(0, 0.05))
        points.append(TrialPoint(i, b, t * (60 if i % 37 == 0 else 1), loss, b < 6e6 and loss < 0.04, f"plan-{i}"))
    return points


@pytest.fixture(scope="module")
def space():
    return SearchSpace(tradeoff_table(12, 0))


@pytest.fixture(scope="module")
def budgets(space):
    fp32 = space.totals(space.uniform(Format.FP32))
    return {"memory": 0.45 * fp32.bytes, "loss": 0.4 * space.totals(space.extreme("bytes")).loss, "fp32": fp32}


def random_plans(space, n, seed):
    """``n`` random plans of ``space`` as (name, bytes, seconds, loss increase) rows, their totals
    standing in for measured ones."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        assignment = {u.name: u.formats[rng.integers(len(u.formats))] for u in space.units}
        total = space.totals(assignment)
        rows.append((f"plan-{i}", total.bytes, total.seconds, total.loss, {k: f.value for k, f in assignment.items()}))
    return rows


@pytest.fixture(scope="module")
def result(space, budgets):
    """A study of 120 plans stored as the measured stage stores them."""
    return measured_study(random_plans(space, 120, 0), memory=budgets["memory"], loss=budgets["loss"])


@pytest.fixture(scope="module")
def fp32(budgets):
    return {"bytes": budgets["fp32"].bytes, "seconds": budgets["fp32"].seconds}


@pytest.fixture(scope="module")
def written(tmp_path_factory, result, budgets, fp32):
    return write_search(result, tmp_path_factory.mktemp("search"), fp32=fp32, memory_bytes=budgets["memory"])


@pytest.fixture(scope="module")
def acc(written):
    return accumulator(written)


def complete(study):
    return sorted((t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE), key=lambda t: t.number)


# --- scalars ----------------------------------------------------------------------------------------


def test_one_scalar_per_trial_at_its_number(acc, result):
    assert [e.step for e in acc.Scalars("search/trial/seconds")] == [t.number for t in complete(result)] and len(complete(result)) == 120


@pytest.mark.parametrize(("tag", "attr"), [("seconds", "seconds"), ("bytes", "bytes"), ("loss_increase", "loss_increase")])
def test_trial_scalars_are_the_trials_totals(acc, result, tag, attr):
    values = [e.value for e in acc.Scalars(f"search/trial/{tag}")]
    assert values == pytest.approx([t.user_attrs[attr] for t in complete(result)], rel=1e-6)


def test_feasible_scalar_follows_the_constraints(acc, result):
    flags = [e.value for e in acc.Scalars("search/trial/feasible")]
    assert flags == [float(feasible(t)) for t in complete(result)] and 0 < sum(flags) < len(flags)


def test_fractions_of_fp32_divide_by_the_fp32_totals(acc, result, fp32):
    values = [e.value for e in acc.Scalars("search/trial/bytes_vs_fp32")]
    assert values == pytest.approx([t.user_attrs["bytes"] / fp32["bytes"] for t in complete(result)], rel=1e-6)


def test_best_feasible_so_far_never_rises_and_ends_at_the_studys_best(acc, result):
    values = [e.value for e in acc.Scalars("search/best_feasible_seconds")]
    best = min(t.user_attrs["seconds"] for t in complete(result) if feasible(t))
    assert all(b <= a for a, b in zip(values, values[1:])) and values[-1] == pytest.approx(best, rel=1e-6)


def test_best_feasible_so_far_starts_at_the_first_feasible_trial():
    points = [TrialPoint(0, 1.0, 3.0, 0.0, False), TrialPoint(1, 1.0, 2.0, 0.0, True), TrialPoint(2, 1.0, 1.0, 0.0, False), TrialPoint(3, 1.0, 2.5, 0.0, True)]
    assert best_so_far(points) == [(1, 2.0), (2, 2.0), (3, 2.0)]


# --- the Pareto front -------------------------------------------------------------------------------


def non_dominated(points):
    """Brute force: the (bytes, seconds, loss) of feasible points no other feasible point beats on all three."""
    good = {(p.bytes, p.seconds, p.loss_increase) for p in points if p.feasible}  # repeated trials count once
    return {p for p in good if not any(all(a <= b for a, b in zip(q, p)) and q != p for q in good)}


def test_front_holds_exactly_the_feasible_trials_nothing_beats(result):
    points = search_points(result)
    front = [(p.bytes, p.seconds, p.loss_increase) for p in pareto_front(points)]
    assert sorted(front) == sorted(non_dominated(points)) and len(front) > 1


def test_front_runs_from_least_memory_and_a_point_beaten_on_memory_and_time_is_less_lossy(result):
    front = pareto_front(search_points(result))
    assert [p.bytes for p in front] == sorted(p.bytes for p in front)
    for p in front:
        for q in front:
            if q.bytes <= p.bytes and q.seconds <= p.seconds and q is not p:
                assert p.loss_increase < q.loss_increase


def test_search_run_has_its_figures_with_their_tags_and_sizes(acc):
    assert sorted(acc.Tags()["images"]) == ["search/pareto", "search/progress"]
    for tag, size in (("search/pareto", (880, 480)), ("search/progress", (720, 400))):
        (event,) = acc.Images(tag)
        assert (event.width, event.height) == size and image_of(event).shape == (size[1], size[0], 3)


def test_pareto_image_draws_the_front_and_each_kind_of_dot_in_its_colour(acc, result, budgets):
    pixels = image_of(acc.Images("search/pareto")[0])
    figure = render_pareto(search_points(result), title=result.study_name, memory_bytes=budgets["memory"], loss_increase=budgets["loss"])  # as write_search drew it
    # The front point farthest from the other marked points: nothing else is drawn over its dot.
    front = [p for p in search_points(result) if p.number in figure.front]
    alone = max(front, key=lambda p: min(np.hypot(*np.subtract(figure.point_xy(p.number), figure.point_xy(q.number))) for q in front if q is not p))
    assert colour_at(pixels, figure.point_xy(alone.number)) == FEASIBLE_COLOUR
    rings = [c for c in figure.axes.collections if len(c.get_facecolors()) == 0]
    assert len(rings) == 1 and tuple(rings[0].get_edgecolors()[0][:3]) == pytest.approx(mpl_colour(PARETO_COLOUR))
    ringed = np.array(sorted(map(tuple, rings[0].get_offsets())))
    assert ringed == pytest.approx(np.array(sorted((p.bytes / figure.x_unit.factor, p.seconds / figure.y_unit.factor) for p in front)))


def test_dots_are_grey_when_infeasible_and_blue_when_feasible():
    points = [TrialPoint(0, 1e6, 3e-3, 0.01, True), TrialPoint(1, 3e6, 1e-3, 0.02, True),
              TrialPoint(2, 3.5e6, 3.5e-3, 0.05, True), TrialPoint(3, 4e6, 4e-3, 0.0, False)]
    figure = render_pareto(points)
    pixels = figure.to_array()
    centre = {p.number: colour_at(pixels, figure.point_xy(p.number)) for p in points}
    assert centre == {0: FEASIBLE_COLOUR, 1: FEASIBLE_COLOUR, 2: FEASIBLE_COLOUR, 3: INFEASIBLE_COLOUR} and figure.front == (0, 1)


def test_study_without_feasible_trials_has_no_front():
    figure = render_pareto([TrialPoint(i, 1e6 * (i + 1), 1e-3 / (i + 1), 0.1, False) for i in range(5)])
    assert figure.front == () and PARETO_COLOUR not in colours(plot_area(figure, figure.to_array()))


def test_measured_plan_is_an_orange_square_at_its_measured_totals(result):
    plan = Plan({"a": "bf16"}, predicted={"bytes": 2e6, "seconds": 1e-3}, measured={"bytes": 2.5e6, "seconds": 1.2e-3})
    figure = render_pareto(search_points(result), measured=[("best", plan)])
    assert colour_at(figure.to_array(), figure.xy(2.5e6, 1.2e-3)) == MEASURED_COLOUR


def test_returned_plan_is_a_black_star_and_labelled_first(result):
    points = search_points(result)
    returned = next(p for p in points if p.feasible and p.number not in pareto_front(points))
    figure = render_pareto(points, chosen=returned.name)
    assert figure.chosen == returned.number and colour_at(figure.to_array(), figure.point_xy(returned.number)) == CHOSEN_COLOUR
    assert figure.labels[0] == f"returned: {returned.name}"


def test_budgets_are_read_back_from_the_trials_constraints_and_drawn(result, budgets):
    read = study_budgets(result)
    assert read == pytest.approx({"memory_bytes": budgets["memory"], "loss_increase": budgets["loss"]}, rel=1e-9)
    figure = render_pareto(search_points(result), memory_bytes=read["memory_bytes"], loss_increase=read["loss_increase"])
    lines = {ax: [line.get_xdata()[0] for line in ax.lines if tuple(line.get_color()) == pytest.approx(mpl_colour(BUDGET_COLOUR))] for ax in (figure.axes, figure.loss_axes)}
    assert lines[figure.axes] == pytest.approx([budgets["memory"] / figure.x_unit.factor]) and lines[figure.loss_axes] == pytest.approx([budgets["loss"]])
    assert {"memory budget", "loss budget"} <= set(figure.labels)


def test_unlimited_budget_is_not_drawn():
    study = measured_study([(f"p{i}", 1e6 * (i + 1), 1e-3, 0.01) for i in range(4)], memory=float("inf"))
    assert "memory_bytes" not in study_budgets(study)


def test_step_time_axis_is_logarithmic_only_past_a_decade(result):
    points = search_points(result)
    assert max(p.seconds for p in points) < 10 * min(p.seconds for p in points)
    assert render_pareto(points).axes.get_yscale() == "linear"
    assert render_pareto(crowded_points()).axes.get_yscale() == "log"


def test_no_two_labels_overlap_in_a_crowded_search():
    # 300 trials in a corner, a far slower outlier, budgets, a returned plan and a measured one:
    # every text the image shows (labels, ticks, legend, titles) is clear of every other and
    # inside the image; the labels that found no room are trials the summary's table lists.
    points = crowded_points()
    plan = Plan({"a": "bf16"}, predicted={"bytes": 3e6, "seconds": 1.5e-3, "loss_increase": 0.01}, measured={"bytes": 3.3e6, "seconds": 1.8e-3, "loss_increase": 0.012})
    figure = render_pareto(points, title="crowded", memory_bytes=6e6, loss_increase=0.04, chosen="plan-5", measured=[("exact", plan)])
    drawn = drawn_texts(figure)
    assert overlaps(drawn) == [] and outside(drawn, figure) == []
    assert {"returned: plan-5", "memory budget", "loss budget", "exact"} <= {t for t, _ in drawn}
    table = search_summary_markdown(points).split("Pareto front")[1]
    assert figure.left_out and all(f"| {name} |" in table for name in figure.left_out)


def test_a_users_latex_setting_and_dollars_in_names_change_no_text():
    import matplotlib
    import matplotlib.text

    points = [TrialPoint(0, 1e6, 1e-3, 0.0, True, "cost $5"), TrialPoint(1, 2e6, 5e-4, 0.01, True, "a_b $x$")]
    with matplotlib.rc_context({"text.usetex": True}):
        figure = render_pareto(points, chosen="cost $5", memory_bytes=3e6)
        drawn = drawn_texts(figure)
    texts = figure.figure.findobj(matplotlib.text.Text)
    assert not any(t.get_usetex() for t in texts) and {"returned: cost $5", "a_b $x$"} <= {t for t, _ in drawn}


def test_progress_texts_do_not_overlap_and_mark_the_best_so_far():
    points = crowded_points()
    figure = render_progress(points, fp32_seconds=4e-3, chosen="plan-5")
    drawn = drawn_texts(figure)
    assert overlaps(drawn) == [] and outside(drawn, figure) == []
    (ax,) = figure.figure.axes
    best = next(line for line in ax.lines if tuple(line.get_color()) == pytest.approx(mpl_colour(PARETO_COLOUR)))
    expected = best_so_far(points)
    assert list(best.get_xdata()[:len(expected)]) == [n for n, _ in expected]
    assert list(best.get_ydata()[:len(expected)]) == pytest.approx([v * 1e3 for _, v in expected])
    assert ax.get_yscale() == "log"


def test_drawing_keeps_one_artist_per_kind_of_point_whatever_the_trials():
    # The work grows with the points inside one scatter per kind, not with artists per trial.
    rng = np.random.default_rng(0)
    drawn = {}
    for n in (100, 400):
        points = [TrialPoint(i, float(b), float(s), float(loss), bool(f)) for i, (b, s, loss, f) in
                  enumerate(zip(rng.uniform(1e6, 1e7, n), rng.uniform(1e-3, 1e-2, n), rng.uniform(0, 0.1, n), rng.random(n) < 0.5))]
        figure = render_pareto(points)
        drawn[n] = [(len(ax.collections), len(ax.lines), len(ax.patches)) for ax in (figure.axes, figure.loss_axes)]
    assert drawn[100] == drawn[400], drawn


def test_summary_names_the_best_trial(acc, result):
    best = min((p for p in search_points(result) if p.feasible), key=lambda p: p.seconds)
    assert f"best feasible: trial {best.number}:" in text_of(acc, "search/summary")


def test_summary_names_the_returned_plan_on_the_front(result):
    points = search_points(result)
    name = pareto_front(points)[0].name
    summary = search_summary_markdown(points, chosen=name)
    row = next(line for line in summary.splitlines() if f"| {name} |" in line)
    assert f"returned plan: `{name}`" in summary and row.endswith("| yes |") and summary.count("| yes |") == 1


def test_multi_objective_study_is_written_too(tmp_path, space, budgets):
    multi = optuna.create_study(directions=["minimize"] * 3)
    for name, bytes_, seconds, increase, _ in random_plans(space, 30, 1):
        attrs = {"name": name, "bytes": bytes_, "seconds": seconds, "loss_increase": increase}
        constraints = {"memory": bytes_ - budgets["memory"], "loss": increase - budgets["loss"]}
        multi.add_trial(optuna.trial.create_trial(values=[seconds, bytes_, increase], user_attrs=attrs, constraints=constraints))
    acc = accumulator(write_search(multi, tmp_path))
    assert len(acc.Scalars("search/trial/bytes")) == 30 and len(acc.Images("search/pareto")) == 1


def test_writing_again_replaces_the_run(tmp_path, result):
    write_search(result, tmp_path)
    path = write_search(result, tmp_path)
    assert len(accumulator(path).Scalars("search/trial/seconds")) == 120


# --- a study of measured plans, as the search job's measured stage leaves it ------------------------


def measured_study(rows, memory=3e6, loss=0.05):
    """A study holding trials as `MeasuredStage.run` writes them: (name, bytes, seconds, loss
    increase[, unit formats]) complete, or (name, None, None, None) pruned before it was measured."""
    study = optuna.create_study()
    for name, bytes_, seconds, increase, *formats in rows:
        if bytes_ is None:
            study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs={"name": name, "pruned": "slow"}))
            continue
        attrs = {"name": name, "bytes": bytes_, "seconds": seconds, "loss_increase": increase, "candidate": name}
        if formats:
            attrs["formats"] = formats[0]
        study.add_trial(optuna.trial.create_trial(value=seconds, user_attrs=attrs, constraints={"memory": bytes_ - memory, "loss": increase - loss}))
    return study


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    rng = np.random.default_rng(3)
    rows = [(f"plan-{i}", float(b), float(t), float(loss)) for i, (b, t, loss) in enumerate(zip(rng.uniform(1e6, 4e6, 24), rng.uniform(1e-3, 4e-3, 24), rng.uniform(0, 0.08, 24)))]
    study = measured_study(rows[:12] + [("pruned", None, None, None)] + rows[12:])
    return study, accumulator(write_search(study, tmp_path_factory.mktemp("measured"), fp32={"bytes": 4e6, "seconds": 4e-3}, memory_bytes=3e6))


def test_measured_plans_are_the_points_pruned_ones_left_out(measured):
    study, acc = measured
    done = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE]
    assert [e.value for e in acc.Scalars("search/trial/loss_increase")] == pytest.approx([t.user_attrs["loss_increase"] for t in done])
    assert [e.step for e in acc.Scalars("search/trial/seconds")] == [t.number for t in done] and len(done) == 24


def test_written_front_holds_only_non_dominated_measured_plans(measured):
    study, acc = measured
    points = search_points(study)
    by_name = {p.name: (p.bytes, p.seconds, p.loss_increase) for p in points}
    table = text_of(acc, "search/summary").split("Pareto front")[1]
    shown = {name for name in by_name if f"| {name} |" in table}
    assert {by_name[n] for n in shown} == non_dominated(points) and 1 < len(shown) < sum(p.feasible for p in points)


def test_front_ignores_plans_that_missed_a_budget():
    points = [TrialPoint(0, 1e6, 1e-3, 0.0, False, "over"), TrialPoint(1, 2e6, 2e-3, 0.01, True, "a"), TrialPoint(2, 3e6, 3e-3, 0.0, True, "b")]
    assert [p.name for p in pareto_front(points)] == ["a", "b"]


def test_study_not_made_by_the_measured_stage_is_refused(tmp_path):
    study = optuna.create_study()
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(MonitoringError, match="trial 0 .* has no finite user attributes bytes/seconds/loss"):
        write_search(study, tmp_path)


def test_unwritable_logdir_is_one_line(tmp_path, result):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MonitoringError, match=r"^cannot write to logdir .*file.*: it or a parent is a file, not a directory; choose a writable --logdir$"):
        write_search(result, blocker / "tb")


# --- candidates in the HParams view -----------------------------------------------------------------


def candidate(space, trial, budgets, measured=None) -> Plan:
    layers = space.layer_formats({u.name: trial.user_attrs["formats"][u.name] for u in space.units})
    predicted = {"bytes": trial.user_attrs["bytes"], "seconds": trial.user_attrs["seconds"], "loss_increase": trial.user_attrs["loss_increase"],
                 "fp32_bytes": budgets["fp32"].bytes, "fp32_seconds": budgets["fp32"].seconds}
    return Plan(layers, predicted=predicted, measured=measured or {}, budgets={"memory_bytes": budgets["memory"], "loss_increase": budgets["loss"]})


@pytest.fixture(scope="module")
def candidates(space, result, budgets):
    top = sorted((t for t in complete(result) if feasible(t)), key=lambda t: t.user_attrs["seconds"])[:2]
    over = next(t for t in complete(result) if t.user_attrs["bytes"] > budgets["memory"])
    return [
        ("fastest", candidate(space, top[0], budgets, measured={"bytes": budgets["memory"] * 1.1, "seconds": top[0].user_attrs["seconds"] * 1.2})),
        ("second", candidate(space, top[1], budgets, measured={"bytes": budgets["memory"] * 0.9, "seconds": top[1].user_attrs["seconds"]})),
        ("over-memory", candidate(space, over, budgets)),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, candidates):
    return write_candidates(candidates, tmp_path_factory.mktemp("candidates"))


def session(path):
    content = accumulator(path).PluginTagToContent("hparams")[hparams_metadata.SESSION_START_INFO_TAG]
    return hparams_metadata.parse_session_start_info_plugin_data(content).hparams


def test_one_run_per_candidate(runs):
    assert list(runs) == ["candidates/fastest", "candidates/second", "candidates/over-memory"]


def test_each_candidate_has_its_precision_map_at_its_size(runs, candidates):
    for (name, plan), path in zip(candidates, runs.values()):
        (event,) = accumulator(path).Images("plan/precision_map")
        assert (event.width, event.height) == render_precision_map(plan, name).size == image_of(event).shape[1::-1]


def test_each_candidate_is_a_session_with_its_counts_and_rank(runs, candidates):
    for rank, ((name, plan), path) in enumerate(zip(candidates, runs.values())):
        hparams = session(path)
        counts = plan.format_counts()
        assert (hparams["plan"].string_value, hparams["rank"].number_value) == (name, rank)
        assert {f.value: hparams[f"count/{f.value}"].number_value for f in Format} == {f.value: counts.get(f.value, 0) for f in Format}


def test_candidate_metrics_are_its_predicted_and_measured_totals(runs, candidates):
    acc = accumulator(runs["candidates/fastest"])
    plan = candidates[0][1]
    values = {tag: acc.Scalars(tag)[0].value for tag in ("plan/predicted_seconds", "plan/measured_bytes", "plan/measured_seconds")}
    assert values == pytest.approx({"plan/predicted_seconds": plan.predicted["seconds"], "plan/measured_bytes": plan.measured["bytes"], "plan/measured_seconds": plan.measured["seconds"]}, rel=1e-6)


def test_candidate_metrics_say_which_budgets_were_met(runs):
    met = {name: {tag: accumulator(path).Scalars(tag)[0].value for tag in ("plan/predicted_within_budgets", "plan/measured_within_bytes")}
           for name, path in runs.items() if name != "candidates/over-memory"}
    assert met == {"candidates/fastest": {"plan/predicted_within_budgets": 1.0, "plan/measured_within_bytes": 0.0},
                   "candidates/second": {"plan/predicted_within_budgets": 1.0, "plan/measured_within_bytes": 1.0}}


def test_candidates_share_their_metric_tags(runs):
    tags = [set(accumulator(path).Tags()["scalars"]) for path in runs.values()]
    assert tags[0] == tags[1] and {t for t in tags[0] if "predicted" in t} == {t for t in tags[2] if "predicted" in t}


def test_budget_scalars_check_only_what_the_plan_has():
    plan = Plan({"a": "bf16"}, predicted={"bytes": 10, "loss_increase": 0.2}, budgets={"memory_bytes": 20, "loss_increase": 0.1})
    assert budget_scalars(plan) == {"plan/predicted_within_bytes": 1.0, "plan/predicted_within_loss_increase": 0.0, "plan/predicted_within_budgets": 0.0}


def test_candidates_sharing_a_run_are_refused(tmp_path, candidates):
    with pytest.raises(MonitoringError, match="would share the run 'candidates/a_b'"):
        write_candidates([("a/b", candidates[0][1]), ("a b", candidates[1][1])], tmp_path)


def test_no_candidates_is_an_error(tmp_path):
    with pytest.raises(MonitoringError, match="no candidate plans"):
        write_candidates([], tmp_path)
