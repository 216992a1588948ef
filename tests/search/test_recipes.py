"""Recipes as choices of the search: a format given several scalings (`Planning.scaling` lists,
likewise gradient formats and named recipes),
each weighed per layer (`Planning.alternatives`, `space.choice_key`): settings, the space and the
exact program, the learning sampler's names and ids, and the plan each layer gets."""

from __future__ import annotations

import itertools

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

import autoprec as ap
from autoprec.errors import SearchError, SettingsError
from autoprec.formats import Format, Granularity
from autoprec.search.candidate_runs import candidate_id
from autoprec.search.exact import k_best
from autoprec.search.planning import Planning
from autoprec.search.refine import CorrectingSampler
from autoprec.search.space import Choice, SearchSpace, choice_key, key_format, key_name

E4M3, B16, F32 = Format.FP8_E4M3, Format.BF16, Format.FP32
BLOCK = ap.LayerPrecision(E4M3, scaling=ap.Scaling(granularity="block"))


def test_a_format_takes_several_scalings_the_first_its_own_the_rest_alternatives():
    planning = Planning((B16, E4M3), scaling={"fp8_e4m3": ["tensor", "block", "row", "block"]})
    assert planning.precisions()[E4M3].scaling.granularity is Granularity.TENSOR
    assert [lp.scaling.granularity for lp in planning.alternatives()] == [Granularity.BLOCK, Granularity.ROW]  # the repeat once
    # Block scaling's own gradient format (E4M3), not the per-tensor recipe's E5M2.
    assert [lp.grad_format for lp in planning.alternatives()] == [E4M3, Format.FP8_E5M2]
    assert Planning((B16, E4M3), scaling={"fp8_e4m3": "block"}).alternatives() == ()
    # A format not searched has no alternatives.
    assert Planning((B16,), scaling={"fp8_e4m3": ["tensor", "block"]}).alternatives() == ()


@pytest.mark.parametrize("scaling, words", [
    ({"fp8_e4m3": ["tensor", "diagonal"]}, "'diagonal'.*'tensor', 'row', 'block', 'mx' or a Scaling"),
    ({"fp8_e4m3": []}, "name at least one scaling"),
    ({"int8": ["tensor", "mx"]}, "int8"),
])
def test_a_wrong_list_of_scalings_is_refused_in_one_line_naming_it(scaling, words):
    with pytest.raises(SearchError, match=words) as info:
        Planning((E4M3,), scaling=scaling)
    assert "\n" not in str(info.value)


def test_the_scheduler_takes_the_same_lists():
    config = ap.DynamicPrecisionScheduler(scaling={"fp8_e4m3": ["tensor", "block"]}, grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp32"]}).config
    assert [lp.recipe for lp in config.planning.alternatives()] == ["fp8_e4m3+fp32 backward", "fp8_e4m3/block+fp8_e5m2 backward",
                                                                     "fp8_e4m3/block+fp32 backward"]
    with pytest.raises(SettingsError, match=r"DynamicPrecisionScheduler\(scaling=\{'fp8_e4m3': \[\]\}\): name at least one scaling") as info:
        ap.DynamicPrecisionScheduler(scaling={"fp8_e4m3": []})
    assert "\n" not in str(info.value)


def test_a_job_file_takes_a_list_of_scalings(tmp_path):
    from autoprec.job.config import load_job

    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "x"\n[workload]\nfactory = "autoprec.workloads:default_workload"\n[search]\nscaling = {fp8_e4m3 = ["row", "block"]}\n')
    planning = load_job(job).planning(1e-3)
    assert planning.precisions()[E4M3].scaling.granularity is Granularity.ROW
    assert [lp.scaling.granularity for lp in planning.alternatives()] == [Granularity.BLOCK]


def test_a_job_file_takes_named_recipes_and_refuses_a_wrong_one_in_one_line(tmp_path):
    from autoprec.job.config import load_job

    job = tmp_path / "job.toml"
    head = '[job]\nname = "x"\n[workload]\nfactory = "autoprec.workloads:default_workload"\n[search]\n'
    job.write_text(head + 'recipes = ["te_mxfp8", "torchao_rowwise_with_gw_hp"]\n')
    assert [lp.recipe for lp in load_job(job).planning(1e-3).alternatives()] == ["fp8_e4m3/mx", "fp8_e4m3/row+fp8_e4m3 backward+fp32 wgrad"]
    job.write_text(head + "recipes = []\n")
    assert load_job(job).planning(1e-3).alternatives() == ()
    for bad, words in (('["te_nvfp4"]', r"\[search\].recipes: a nvfp4 recipe, and nvfp4 is not among the candidate formats"),
                       ('["te_fp2"]', r"\[search\].recipes: expected a list of named recipes .*te_mxfp8.*, got \['te_fp2'\]")):
        job.write_text(head + f"recipes = {bad}\n")
        with pytest.raises(SearchError, match=words) as info:
            load_job(job)
        assert "\n" not in str(info.value)


def test_choice_keys_name_each_recipe_once_and_know_their_format():
    tensor = ap.LayerPrecision(E4M3, scaling=ap.Scaling(granularity="tensor"))
    assert choice_key("fp8_e4m3") is E4M3 and choice_key(BLOCK) == BLOCK
    assert choice_key(ap.LayerPrecision(E4M3, reason="x")) == ap.LayerPrecision(E4M3)  # the reason is not the recipe
    assert key_format(BLOCK) is E4M3 and key_format("bf16") is B16
    # An alternative per tensor (beside a format whose own recipe is another) never reads as the format's name.
    assert [key_name(k) for k in (E4M3, BLOCK, tensor)] == ["fp8_e4m3", "fp8_e4m3/block", "fp8_e4m3/tensor"]
    assert key_name(ap.LayerPrecision(Format.NVFP4, grad_format="fp32")) == "nvfp4+fp32 backward"


def _space(rows):
    """Layers a0..: each with FP32, FP8 (its own recipe) and FP8 in blocks as (bytes, seconds, loss)."""
    return SearchSpace({fqn: {F32: Choice(*row[0]), E4M3: Choice(*row[1]), BLOCK: Choice(*row[2])} for fqn, row in rows.items()})


def test_the_exact_program_chooses_a_recipe_per_layer():
    # a0's own FP8 loses much where blocks do not; a1's blocks are slower for the same loss.
    space = _space({"a0": [(4, 4, 0), (1, 1, 5.0), (1.1, 1.2, 0.1)], "a1": [(4, 4, 0), (1, 1, 0.1), (1.1, 1.5, 0.1)]})
    best = k_best(space, memory_bytes=2.5, loss_budget=1.0, k=1)[0]
    assert best.assignment == {"a0": BLOCK, "a1": E4M3}
    # Every plan the program could pick, enumerated: the optimum is the fastest meeting both budgets.
    plans = [dict(zip(("a0", "a1"), keys)) for keys in itertools.product(*(list(u.choices) for u in space.units))]
    meeting = [a for a in plans if space.totals(a).bytes <= 2.5 and space.totals(a).loss <= 1.0]
    assert space.totals(best.assignment).seconds == min(space.totals(a).seconds for a in meeting)
    assert space.layer_formats(best.assignment) == {"a0": BLOCK, "a1": E4M3}


def test_the_learning_sampler_names_recipes_apart_and_proposes_the_measured_optimum():
    # Truth: blocks run 1.6x slower than the proxy says; the proxy's optimum puts every layer in
    # blocks, the true one keeps per-tensor FP8 where its loss fits the budget.
    rng = np.random.default_rng(0)
    rows = {f"l{i}": [(4, 4, 0), (1, 1, float(rng.uniform(0.05, 0.3))), (1.05, 0.9, 0.01)] for i in range(5)}
    space = _space(rows)
    truth = {F32: 1.0, E4M3: 1.0, BLOCK: 1.6}

    def measured(assignment):
        seconds = sum(space.units[i].choices[assignment[u.name]].seconds * truth[assignment[u.name]] for i, u in enumerate(space.units))
        return seconds, space.totals(assignment).bytes, space.totals(assignment).loss

    memory, loss = 6.0, 0.4
    precisions = {E4M3: ap.LayerPrecision(E4M3), F32: ap.LayerPrecision(F32)}
    design = [s.assignment for s in k_best(space, memory, loss, 2)]
    probe = CorrectingSampler(space, [], memory, loss, fp32_seconds=1.0, max_trials=12, precisions=precisions)
    plans = [probe.candidate(a).plan for a in design]
    # Each layer's plan entry is its recipe; the ids tell the recipes apart.
    assert all(lp == ap.LayerPrecision(E4M3) or lp.scaling.granularity is Granularity.BLOCK or lp.format is F32 for p in plans for lp in p.layers.values())
    all_block = {u.name: BLOCK for u in space.units}
    all_tensor = {u.name: E4M3 for u in space.units}
    assert probe.candidate(all_block).id != probe.candidate(all_tensor).id
    sampler = CorrectingSampler(space, plans, memory, loss, fp32_seconds=1.0, max_trials=12, precisions=precisions)
    assert [sampler.assignment_of(p) for p in plans] == design  # plan -> keys, recipes kept
    study = optuna.create_study(sampler=sampler)
    for a in design:
        seconds, b, l_ = measured(a)
        study.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=seconds, user_attrs={
            "candidate": candidate_id(sampler.candidate(a).plan), "bytes": b, "loss_increase": l_, "fp32_ratio": seconds, "seconds": seconds}))
    while True:
        trial = study.ask()
        if not trial.relative_params:
            study.tell(trial, state=TrialState.PRUNED)
            break
        proposed = sampler.assignment_named({u.name: trial.suggest_categorical(u.name, list(sampler.choice_names(u))) for u in space.units})
        assert set(trial.params.values()) <= {"fp32", "fp8_e4m3", "fp8_e4m3/block"}
        seconds, b, l_ = measured(proposed)
        for key, value in {"bytes": b, "loss_increase": l_, "fp32_ratio": seconds, "seconds": seconds}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, seconds)
    every = [dict(zip([u.name for u in space.units], keys)) for keys in itertools.product(*(list(u.choices) for u in space.units))]
    true_best = min((a for a in every if measured(a)[1] <= memory and measured(a)[2] <= loss), key=lambda a: measured(a)[0])
    met = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if t.user_attrs["bytes"] <= memory and t.user_attrs["loss_increase"] <= loss]
    assert min(t.value for t in met) == pytest.approx(measured(true_best)[0])
    assert true_best not in design  # the proxy's own top 2 missed it
    assert len({k for k in true_best.values()}) > 1  # it mixes recipes


def test_gradient_formats_given_as_a_list_are_recipes_with_every_scaling():
    planning = Planning((B16, E4M3), scaling={"fp8_e4m3": ["tensor", "block"]}, grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp32"]})
    assert planning.precisions()[E4M3] == ap.LayerPrecision(E4M3, grad_format="fp8_e5m2")
    assert [lp.recipe for lp in planning.alternatives()] == ["fp8_e4m3+fp32 backward", "fp8_e4m3/block+fp8_e5m2 backward", "fp8_e4m3/block+fp32 backward"]
    with pytest.raises(SearchError, match=r"grad_formats=\{'fp8_e4m3': \[\]\}.*at least one") as info:
        Planning((E4M3,), grad_formats={"fp8_e4m3": []})
    assert "\n" not in str(info.value)


def test_a_gradient_entry_per_gemm_is_the_split_recipe_and_a_wrong_one_is_refused_in_one_line():
    planning = Planning((B16, E4M3), grad_formats={"fp8_e4m3": ["fp8_e5m2", "fp8_e5m2/fp32", "fp8_e4m3/fp8_e4m3"]})
    assert [lp.recipe for lp in planning.alternatives()] == ["fp8_e4m3+fp32 wgrad", "fp8_e4m3+fp8_e4m3 backward"]
    assert Planning((B16,), grad_formats=planning.grad_formats).grad_formats == planning.grad_formats  # held entries read back as given
    for bad, words in (({"fp8_e4m3": "fp8_e5m2/bf16"}, r"per GEMM \(input gradient / weight gradient\)"),
                       ({"bf16": "bf16/fp32"}, r"'bf16/fp32'.*a high-precision weight gradient .* leave it out")):
        with pytest.raises(SearchError, match=words) as info:
            Planning((E4M3,), grad_formats=bad)
        assert "\n" not in str(info.value)


def test_the_schedulers_search_weighs_the_recipes_between_steps_and_plans_each_layers_own():
    # The in-run search: one more paced estimate for the alternatives, the same space and solver
    # as the offline search; its trials run the recipes the candidates hold.
    import sys
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from block_fp8 import OutlierMLP

    torch.manual_seed(0)
    model, teacher = OutlierMLP(128, 256, 2, outliers=2, gain=100.0, seed=0), OutlierMLP(128, 256, 2, outliers=2, gain=100.0, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sch = ap.DynamicPrecisionScheduler(formats=["bf16", "fp8_e4m3"], scaling={"fp8_e4m3": ["tensor", "block"]}, monitor_window=6, monitor_steps=2,
                                       memory_budget=0.7, accuracy_budget=1e-3, search_timeout_s=20)
    for _ in range(300):
        x = torch.randn(256, 128)
        with torch.no_grad():
            y = teacher(x)
        with sch.precision_context():
            loss = F.mse_loss(model(x).float(), y)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        if sch.phase == "planned" or sch.last_search_error is not None:
            break
    assert sch.phase == "planned" and sch.last_search_error is None
    given = {ap.LayerPrecision("bf16"), ap.LayerPrecision(E4M3), BLOCK}
    for lp in sch.plan.layers.values():
        assert choice_key(lp) in given, lp
        assert lp.reason.startswith(key_name(lp if lp.scaling.granularity is Granularity.BLOCK else lp.format) + ":"), lp.reason
    sch.close()


def test_named_recipes_are_alternatives_of_their_format_and_a_wrong_one_is_refused_in_one_line():
    planning = Planning((B16, E4M3), scaling={"fp8_e4m3": ["tensor", "block"]},
                        recipes=["te_current", "te_block", "te_mxfp8", "torchao_rowwise_with_gw_hp"])
    # te_current is the format's own recipe, te_block the block scaling already given: each once.
    assert [lp.recipe for lp in planning.alternatives()] == ["fp8_e4m3/block", "fp8_e4m3/mx", "fp8_e4m3/row+fp8_e4m3 backward+fp32 wgrad"]
    assert planning.alternatives()[-1] == ap.LayerPrecision("fp8_e4m3", scaling=ap.Scaling(granularity="row"), grad_format="fp8_e4m3",
                                                            high_precision_weight_grad=True)
    for bad, words in ((["te_nvfp4"], r"recipes=\['te_nvfp4'\]\): a nvfp4 recipe, and nvfp4 is not among the candidate formats \(bf16, fp8_e4m3\)"),
                       (["te_fp2"], r"recipes=\['te_fp2'\]\): unknown recipe; expected one of te_current, "),
                       ("te_mxfp8", r"expected a list of recipe names"), ([3], r"recipes=\[3\]\): expected a recipe name")):
        with pytest.raises(SearchError, match=words) as info:
            Planning((B16, E4M3), recipes=bad)
        assert "\n" not in str(info.value)
    with pytest.raises(SettingsError, match=r"DynamicPrecisionScheduler\(recipes=\['te_nvfp4'\]\): a nvfp4 recipe") as info:
        ap.DynamicPrecisionScheduler(formats=["bf16", "fp8_e4m3"], recipes=["te_nvfp4"])
    assert "\n" not in str(info.value)
    assert ap.DynamicPrecisionScheduler(formats=["bf16", "nvfp4"], recipes=["te_nvfp4"], min_precision=4).config.recipes == (ap.LayerPrecision("nvfp4"),)


def test_a_search_weighs_named_recipes_per_layer_each_estimated_and_planned_as_its_own():
    import copy
    import sys
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    from autoprec.search.pipeline import measure_space, propose_from
    from autoprec.search.budgets import Budgets

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from block_fp8 import OutlierMLP

    torch.manual_seed(0)
    model = OutlierMLP(128, 256, 2, outliers=2, gain=100.0, seed=0)
    data = [(torch.randn(256, 128), torch.randn(256, 128)) for _ in range(2)]

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]).float(), batch[1])

    names = ["te_block", "torchao_rowwise", "torchao_rowwise_with_gw_hp"]
    planning = Planning((B16, E4M3), recipes=names, measure=False, budgets=Budgets(memory=0.7))
    found = measure_space(copy.deepcopy(model), data[0][0], data, loss_fn, None, planning)
    recipes = [ap.LayerPrecision.preset(n) for n in names]
    for unit in found.space.units:
        own = unit.choices[E4M3]
        losses = [unit.choices[choice_key(lp)].loss for lp in recipes]
        assert len({own.loss, *losses}) == 4  # each estimated as its own recipe
        # The split's weight gradient is the row-wise recipe's without its E4M3 rounding.
        assert losses[2] < losses[1]
    plan = propose_from(found, planning, baseline_loss=None).plans[0]
    held = {lp.recipe for lp in plan.layers.values()}
    assert held <= {lp.recipe for lp in recipes} | {"bf16", "fp8_e4m3", "fp32"}
    assert held & {lp.recipe for lp in recipes}, held  # a named recipe is planned somewhere
