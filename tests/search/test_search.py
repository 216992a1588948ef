"""The search core: space rules, the exact optimum and the k best plans (vs brute force), storages."""

import dataclasses
import itertools
import math
import types

import numpy as np
import optuna
import pytest

from autoprec.errors import InfeasibleBudgetError, SearchError
from autoprec.formats import Format
from autoprec.search import Block, Budgets, Choice, LayerRules, SearchSpace, formats_for_precision, k_best, solve_exact
from autoprec.search.space import MemoryPart

from autoprec.search import exact
from autoprec.search.exact import MIP_GAP
from autoprec.search.study import open_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)
FORMATS = (Format.FP32, Format.BF16, Format.FP8_E4M3, Format.INT8)


def random_table(layers, seed, formats=FORMATS):
    """Costs shaped like real ones: fewer bytes and less time in narrower formats, more loss."""
    rng = np.random.default_rng(seed)
    table = {}
    for i in range(layers):
        size = rng.integers(1, 50) * 1e4
        sensitivity = rng.lognormal(-6, 1.5)
        table[f"blocks.{i // 4}.layer{i % 4}"] = {
            f: Choice(size * f.bytes, size * 1e-9 * (f.bytes / 4 + rng.uniform(0, 0.3)), 0.0 if f is Format.FP32 else sensitivity * 8 / f.bits * rng.uniform(0.5, 2))
            for f in formats
        }
    return table


def brute_force(space, memory, loss):
    best = None
    for combo in itertools.product(*[u.formats for u in space.units]):
        assignment = {u.name: f for u, f in zip(space.units, combo)}
        total = space.totals(assignment)
        if total.bytes <= memory and total.loss <= loss and (best is None or total.seconds < best.seconds):
            best = total
    return best


def budgets_for(space, memory_fraction=0.6, loss_fraction=0.5):
    fp32 = space.totals(space.uniform(Format.FP32))
    most_loss = space.totals(space.extreme("bytes")).loss
    return memory_fraction * fp32.bytes, loss_fraction * most_loss


# -- space ----------------------------------------------------------------------------------------


def test_precision_bounds_select_formats_by_bits():
    assert formats_for_precision(16, 32) == (Format.FP32, Format.BF16, Format.FP16)
    assert formats_for_precision(8, 8) == (Format.FP8_E4M3, Format.INT8)


def test_precision_bounds_reject_other_widths():
    with pytest.raises(SearchError, match="4, 8, 16 or 32"):
        formats_for_precision(12, 32)


def test_min_above_max_precision_is_an_error():
    with pytest.raises(SearchError, match="swap"):
        formats_for_precision(32, 8)


def test_space_applies_precision_pins_and_forbids():
    table = random_table(8, 0)
    rules = LayerRules(pin={"blocks.0.layer0": Format.BF16}, forbid={"blocks.1.*": [Format.INT8]})
    space = SearchSpace(table, min_precision=8, max_precision=16, rules=rules)
    units = {u.name: u.formats for u in space.units}
    assert units["blocks.0.layer0"] == (Format.BF16,)
    assert units["blocks.1.layer2"] == (Format.BF16, Format.FP8_E4M3)
    assert units["blocks.0.layer1"] == (Format.BF16, Format.FP8_E4M3, Format.INT8)


def test_grouped_layers_form_one_unit_with_summed_costs():
    table = random_table(8, 0)
    group = ["blocks.0.layer0", "blocks.0.layer1", "blocks.0.layer2"]
    space = SearchSpace(table, rules=LayerRules(groups=[group]))
    unit = next(u for u in space.units if len(u.layers) == 3)
    assert unit.layers == tuple(group)
    expected = sum(table[fqn][Format.INT8].bytes for fqn in group)
    assert unit.choices[Format.INT8].bytes == pytest.approx(expected)
    assert len(space.units) == 6
    assignment = {u.name: Format.BF16 if u is unit else Format.FP32 for u in space.units}
    assert {space.layer_formats(assignment)[fqn] for fqn in group} == {Format.BF16}


def test_rule_pattern_matching_no_layer_is_named():
    with pytest.raises(SearchError, match="'blocks.9.\\*' matches no layer"):
        SearchSpace(random_table(4, 0), rules=LayerRules(forbid={"blocks.9.*": [Format.INT8]}))


def test_layer_left_without_format_is_named():
    rules = LayerRules(pin={"blocks.0.layer3": Format.FP16})  # FP16 not costed in this table
    with pytest.raises(SearchError, match="'blocks.0.layer3': no format left"):
        SearchSpace(random_table(4, 0), rules=rules)


def test_non_finite_cost_is_rejected():
    with pytest.raises(SearchError, match="finite"):
        Choice(1.0, float("nan"), 0.0)


def test_budgets_resolve_fractions_and_relative_loss():
    budgets = Budgets(memory=0.5, accuracy=0.01)
    assert budgets.memory_bytes(1000) == 500
    assert Budgets(memory=4096).memory_bytes(1000) == 4096
    assert Budgets(memory=1.0).memory_bytes(1000) == 1000  # the float 1.0: all of FP32's bytes
    assert budgets.loss_increase(2.5) == pytest.approx(0.025)
    assert Budgets(accuracy=0.1, accuracy_relative=False).loss_increase(None) == 0.1


@pytest.mark.parametrize("memory, outside", [(0.6, 0), (0.6, 40_000), (300_000, 40_000)])
def test_the_budget_a_refusal_asks_for_is_the_least_whose_limit_holds_the_plan(memory, outside):
    """`Budgets.setting_for`, which a refusal states ("raise memory_budget to at least ..."), is
    the least budget, spelled as the given one, whose `memory_limit` holds the plan's predicted
    bytes beside the bytes the prediction leaves out. The fraction stated used to leave those
    out: refusals at memory_budget=0.65 asked for 0.639-0.647."""
    fp32, smallest = 500_000.0, 210_000.0
    stated = Budgets(memory=memory).setting_for(smallest, fp32, outside)
    least = type(memory)(stated)
    step = 1 if isinstance(memory, int) else 0.001  # the stated figure's last digit
    assert Budgets(memory=least).memory_limit(fp32, outside) >= smallest > Budgets(memory=least - step).memory_limit(fp32, outside)


@pytest.mark.parametrize("spelled, expected", [
    ("6GiB", 6 * 2**30), ("512 MB", 512 * 10**6), ("1.5KiB", 1536), ("2048", 2048), ("3tb", 3 * 10**12), (np.int64(4096), 4096),
])
def test_memory_budget_in_bytes_is_an_integer_or_a_size_string(spelled, expected):
    budgets = Budgets(memory=spelled)
    assert budgets.memory == expected and isinstance(budgets.memory, int)
    assert budgets.memory_bytes(10**15) == expected  # bytes whatever FP32's


@pytest.mark.parametrize("spelled, why", [
    (1.5, "outside"), (0.0, "outside"), (-0.5, "outside"), (math.inf, "not finite"), (1, "no budget"), (0, "no budget"),
    ("lots", "not a size"), ("0.5", "not a positive number of bytes"), (True, "bool"), ([0.5], "list"),
])
def test_memory_budget_that_is_neither_a_fraction_nor_bytes_is_refused(spelled, why):
    # 1.5 used to mean 1.5 bytes; the message gives both spellings and what is wrong.
    with pytest.raises(SearchError, match=rf"memory budget: expected a fraction .* or bytes .*'6GiB', got .*{why}"):
        Budgets(memory=spelled)


def test_relative_accuracy_without_baseline_says_what_is_missing():
    with pytest.raises(SearchError, match="baseline"):
        Budgets(accuracy=0.01).loss_increase(None)


# -- exact ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fractions", [(0.6, 0.5), (0.45, 0.3), (0.9, 0.1)])
def test_exact_solver_matches_brute_force(seed, fractions, exact_solves):
    space = SearchSpace(random_table(7, seed))
    memory, loss = budgets_for(space, *fractions)
    best = brute_force(space, memory, loss)
    if best is None:
        with pytest.raises(InfeasibleBudgetError):
            solve_exact(space, memory, loss)
        return
    solution = solve_exact(space, memory, loss)
    assert solution.total.seconds == pytest.approx(best.seconds, rel=1e-9)
    assert solution.total.bytes <= memory
    assert solution.total.loss <= loss + 1e-12


def test_exact_solver_respects_groups():
    table = random_table(8, 3)
    group = ["blocks.0.layer0", "blocks.0.layer1"]
    space = SearchSpace(table, rules=LayerRules(groups=[group]))
    solution = solve_exact(space, *budgets_for(space))
    formats = space.layer_formats(solution.assignment)
    assert formats[group[0]] is formats[group[1]]


def test_infeasible_budget_states_the_smallest_reachable():
    space = SearchSpace(random_table(6, 1))
    least_bytes = space.totals(space.extreme("bytes")).bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_exact(space, least_bytes * 0.9, float("inf"))
    assert f"{least_bytes:,.0f} bytes" in str(info.value)
    assert info.value.min_bytes == pytest.approx(least_bytes)


def test_jointly_infeasible_budgets_name_both_minima():
    space = SearchSpace(random_table(6, 2))
    memory = space.totals(space.extreme("bytes")).bytes * 1.01  # reachable alone, at a high loss
    with pytest.raises(InfeasibleBudgetError, match="within the loss budget the smallest memory") as info:
        solve_exact(space, memory, 1e-9)
    brute = min(
        (space.totals(dict(zip([u.name for u in space.units], c))).loss
         for c in itertools.product(*[u.formats for u in space.units])
         if space.totals(dict(zip([u.name for u in space.units], c))).bytes <= memory),
    )
    assert info.value.min_loss == pytest.approx(brute)


@pytest.fixture
def exact_solves(monkeypatch):
    """Solves with no optimality gap allowed: what the formulation gives, to compare with an
    enumeration exactly (the default `MIP_GAP` lets a solve stop within one percent)."""
    monkeypatch.setattr(exact, "MIP_GAP", 0.0)


def all_feasible_by_seconds(space, memory, loss):
    """Every assignment meeting both budgets, fastest first (brute force)."""
    names = [u.name for u in space.units]
    totals = (space.totals(dict(zip(names, combo))) for combo in itertools.product(*[u.formats for u in space.units]))
    return sorted(t.seconds for t in totals if t.bytes <= memory and t.loss <= loss)


@pytest.mark.parametrize("seed", range(6))
def test_k_best_equals_brute_force_enumeration(seed, exact_solves):
    # With no gap allowed, the solves are exact: the k best of the enumeration, in order.
    space = SearchSpace(random_table(6, seed))
    memory, loss = budgets_for(space, 0.7, 0.6)
    expected = all_feasible_by_seconds(space, memory, loss)[:5]
    found = k_best(space, memory, loss, 5)
    assert [s.total.seconds for s in found] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("rest", [0.0, 3.0], ids=["layers-only", "rest-3x-the-layers"])
@pytest.mark.parametrize("seed", range(6))
def test_k_best_is_within_the_gap_of_brute_force_enumeration(seed, rest):
    # The i-th solution is the best plan unlike the ones before it, to MIP_GAP; one of the i
    # best differs from those, so it is within MIP_GAP of the i-th best. The gap is the whole
    # step's: with a rest of the step outside the layers, the layers' part may be further off.
    table = random_table(6, seed)
    fastest = sum(min(c.seconds for c in options.values()) for options in table.values())
    space = SearchSpace(table, fixed={"rest": Choice(0.0, rest * fastest, 0.0)})
    memory, loss = budgets_for(space, 0.7, 0.6)
    expected = all_feasible_by_seconds(space, memory, loss)[:5]
    found = k_best(space, memory, loss, 5)
    assert len(found) == len(expected)
    assert all(s.total.seconds <= e * (1 + MIP_GAP) + 1e-15 for s, e in zip(found, expected))
    assert all(0 <= s.gap <= MIP_GAP for s in found)


def test_k_best_plans_are_distinct_feasible_and_in_non_decreasing_time():
    space = SearchSpace(random_table(40, 11))
    memory, loss = budgets_for(space, 0.5, 0.4)
    found = k_best(space, memory, loss, 8)
    assert len(found) == 8
    assert len({tuple(sorted((n, f.value) for n, f in s.assignment.items())) for s in found}) == 8
    for s in found:
        assert s.total.bytes <= memory and s.total.loss <= loss + 1e-12
        assert s.total == space.totals(s.assignment)
    # Each solve stops within MIP_GAP of its optimum: the order holds to that, and the first is
    # the optimum to that.
    seconds = [s.total.seconds for s in found]
    assert all(b >= a / (1 + MIP_GAP) for a, b in zip(seconds, seconds[1:]))
    assert found[0].total.seconds == pytest.approx(solve_exact(space, memory, loss).total.seconds, rel=MIP_GAP)
    assert all(0 <= s.gap <= MIP_GAP for s in found)


def test_k_best_stops_at_the_number_of_feasible_plans():
    space = SearchSpace(random_table(3, 12, formats=(Format.FP32, Format.BF16)))
    assert len(k_best(space, k=20)) == 8  # 2 formats ** 3 layers, no budget


def test_k_best_keeps_grouped_layers_together():
    group = ["blocks.0.layer0", "blocks.0.layer1"]
    space = SearchSpace(random_table(6, 13), rules=LayerRules(groups=[group]))
    for s in k_best(space, *budgets_for(space, 0.7, 0.6), 6):
        formats = space.layer_formats(s.assignment)
        assert formats[group[0]] is formats[group[1]]


def test_k_best_of_infeasible_budgets_states_the_smallest_reachable():
    space = SearchSpace(random_table(6, 1))
    with pytest.raises(InfeasibleBudgetError, match="no plan meets the budgets"):
        k_best(space, space.totals(space.extreme("bytes")).bytes * 0.9, float("inf"), 3)


def test_k_best_on_120_layers_solves_one_program_per_plan_and_no_single_change_beats_them(monkeypatch):
    # Too many layers to enumerate: k_best costs one integer program per plan (no enumeration),
    # and no feasible plan one layer away from the optimum is faster than the last plan found
    # unless it is one of the plans found.
    space = SearchSpace(random_table(120, 7))
    memory, loss = budgets_for(space, 0.4, 0.3)
    solves = []
    real_solve = exact._solve
    monkeypatch.setattr(exact, "_solve", lambda *a, **kw: solves.append(1) or real_solve(*a, **kw))
    found = k_best(space, memory, loss, 4)
    assert len(found) == 4 and len(solves) == 4
    seconds = [s.total.seconds for s in found]
    assert all(b >= a / (1 + MIP_GAP) for a, b in zip(seconds, seconds[1:]))  # in order, to the proven gap
    keys = {tuple(sorted((n, f.value) for n, f in s.assignment.items())) for s in found}
    neighbours = 0
    for unit in space.units:
        for fmt in unit.formats:
            plan = {**found[0].assignment, unit.name: fmt}
            total = space.totals(plan)
            if tuple(sorted((n, f.value) for n, f in plan.items())) in keys or total.bytes > memory or total.loss > loss:
                continue
            neighbours += 1
            assert total.seconds >= seconds[-1] / (1 + MIP_GAP) * (1 - 1e-9), unit.name
    assert neighbours > 0  # the check compared something


def test_k_best_stops_at_its_time_limit_with_the_plans_found(monkeypatch):
    # A clock that moves only when a program is solved, one second per solve: with 2.5 s the third
    # solve starts with 0.5 s left and no fourth starts, whatever the machine's speed.
    space = SearchSpace(random_table(120, 7))
    memory, loss = budgets_for(space, 0.4, 0.3)
    clock = [0.0]
    limits = []
    real_solve = exact._solve

    def solve(*args, time_limit=None, **kwargs):
        limits.append(time_limit)
        result = real_solve(*args, **kwargs)  # no real limit: the fake clock alone decides
        clock[0] += 1.0
        return result

    monkeypatch.setattr(exact, "_solve", solve)
    monkeypatch.setattr(exact, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    found = k_best(space, memory, loss, 10_000, time_limit=2.5)
    assert limits == pytest.approx([2.5, 1.5, 0.5])
    assert len(found) == 3
    seconds = [s.total.seconds for s in found]
    assert all(b >= a / (1 + MIP_GAP) for a, b in zip(seconds, seconds[1:]))  # in order, to the proven gap


def test_unreachable_storage_is_a_one_line_error():
    with pytest.raises(SearchError, match="cannot open Optuna storage") as info:
        open_storage("sqlite:////nonexistent-dir/study.db")
    assert "\n" not in str(info.value)


# -- recompute blocks (issue 24) --------------------------------------------------------------------


def block_space(seed, layers=6, per_block=2, formats=(Format.FP32, Format.BF16, Format.FP8_E4M3), blocks=True, memory_share=(0.3, 0.9)):
    """A space of ``layers`` layers, ``per_block`` per recompute block (the last layer outside any
    block): recomputing frees a random share of a layer's bytes, costs a third of its seconds or so,
    and the block's own ops free and cost a little more."""
    rng = np.random.default_rng(seed)
    table, freed, forward = {}, {}, {}
    for i in range(layers):
        name = f"blocks.{i // per_block}.l{i % per_block}" if i < layers - 1 else "head"
        size = rng.integers(1, 50) * 1e4
        sensitivity = rng.lognormal(-6, 1.5)
        table[name] = {f: Choice(size * f.bytes, size * 1e-9 * (f.bytes / 4 + rng.uniform(0, 0.3)),
                                 0.0 if f is Format.FP32 else sensitivity * 8 / f.bits * rng.uniform(0.5, 2)) for f in formats}
        if name != "head":
            freed[name] = {f: table[name][f].bytes * rng.uniform(*memory_share) for f in formats}
            forward[name] = {f: table[name][f].seconds * rng.uniform(0.25, 0.4) for f in formats}
    block_names = sorted({n.rsplit(".", 1)[0] for n in freed})
    spec = [Block(b, {n: freed[n] for n in freed if n.startswith(b + ".")}, {n: forward[n] for n in forward if n.startswith(b + ".")},
                  other_bytes=float(rng.integers(0, 20) * 1e4), other_seconds=float(rng.uniform(0, 2e-5))) for b in block_names]
    return SearchSpace(table, fixed={"rest": Choice(1e5, 1e-4, 0.0)}, blocks=spec if blocks else ())


def plan_totals(space, assignment, recompute):
    """Totals of (formats, recompute set) from the Block specs directly, not `SearchSpace.totals`."""
    formats = space.layer_formats(assignment)
    total = [space.fixed_total.bytes, space.fixed_total.seconds, space.fixed_total.loss]
    for unit in space.units:
        c = unit.choices[assignment[unit.name]]
        total = [total[0] + c.bytes, total[1] + c.seconds, total[2] + c.loss]
    for block in space.blocks:
        if block.name in recompute:
            total[0] -= block.other_bytes + sum(block.freed[n][formats[n]] for n in block.layers)
            total[1] += block.other_seconds + sum(block.forward[n][formats[n]] for n in block.layers)
    if space.fp32_bytes is not None and all(f is Format.FP32 for f in formats.values()):
        # The all-FP32 family at its exact bytes: the reference less what each recomputed block
        # frees with its own ops at their all-FP32 figures.
        fp32 = [b for b in space.blocks if b.name in recompute]
        total[0] = space.fp32_bytes - sum(b.fp32_other_bytes + sum(b.freed[n][Format.FP32] for n in b.layers) for b in fp32)
        total[1] += sum(b.fp32_other_seconds - b.other_seconds for b in fp32)
    return tuple(total)


def every_plan(space):
    """(assignment, recompute set, (bytes, seconds, loss)) for every plan of ``space``."""
    names = [u.name for u in space.units]
    blocks = [b.name for b in space.blocks]
    for combo in itertools.product(*[u.formats for u in space.units]):
        assignment = dict(zip(names, combo))
        for flags in itertools.product((False, True), repeat=len(blocks)):
            recompute = frozenset(b for b, on in zip(blocks, flags) if on)
            yield assignment, recompute, plan_totals(space, assignment, recompute)


def exact_fp32_space(seed):
    """`block_space` whose all-FP32 plan the additive table overstates by a sixth, with the
    blocks' own ops at other figures in an all-FP32 region."""
    space = block_space(seed)
    rng = np.random.default_rng(seed + 100)
    table = {u.layers[0]: dict(u.choices) for u in space.units}
    blocks = [dataclasses.replace(b, fp32_other_bytes=float(rng.integers(0, 40) * 1e4), fp32_other_seconds=float(rng.uniform(0, 4e-5))) for b in space.blocks]
    additive = sum(c[Format.FP32].bytes for c in table.values()) + space.fixed_total.bytes
    return SearchSpace(table, fixed={"rest": space.fixed_total}, blocks=blocks, fp32_bytes=additive * 5 / 6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fractions", [(0.6, 0.5), (0.35, 0.4), (0.25, 1.0), (0.9, 0.1), (0.5, 0.0)])
def test_k_best_with_the_exact_all_fp32_family_matches_brute_force(seed, fractions):
    space = exact_fp32_space(seed)
    memory, loss = budgets_for(space, *fractions)
    feasible = sorted((t[1], t[0]) for a, r, t in every_plan(space) if t[0] <= memory and t[2] <= loss)
    if not feasible:
        with pytest.raises(InfeasibleBudgetError):
            k_best(space, memory, loss)
        return
    (solution,) = k_best(space, memory, loss)
    assert solution.total.seconds <= feasible[0][0] * (1 + MIP_GAP)
    assert (solution.total.bytes, solution.total.seconds, solution.total.loss) == pytest.approx(
        plan_totals(space, solution.assignment, solution.recompute), rel=1e-12)
    assert solution.total.bytes <= memory and solution.total.loss <= loss + 1e-12


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fractions", [(0.6, 0.5), (0.35, 0.4), (0.25, 1.0), (0.9, 0.1)])
def test_exact_solver_with_blocks_matches_brute_force_over_formats_and_recompute_sets(seed, fractions, exact_solves):
    space = block_space(seed)
    memory, loss = budgets_for(space, *fractions)
    feasible = [(t[1], a, r) for a, r, t in every_plan(space) if t[0] <= memory and t[2] <= loss]
    if not feasible:
        with pytest.raises(InfeasibleBudgetError):
            solve_exact(space, memory, loss)
        return
    best_seconds = min(f[0] for f in feasible)
    solution = solve_exact(space, memory, loss)
    assert solution.total.seconds == pytest.approx(best_seconds, rel=1e-9)
    assert (solution.total.bytes, solution.total.seconds, solution.total.loss) == pytest.approx(
        plan_totals(space, solution.assignment, solution.recompute), rel=1e-12)
    assert solution.total.bytes <= memory and solution.total.loss <= loss + 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_a_space_of_few_blocks_is_solved_as_one_whole_program_within_the_gap(monkeypatch, seed):
    # 4 components (3 blocks and the head), no more than `_restricted` frees: each restricted try
    # would be the whole program again (on issue 57's 4-block Llama, 4 such solves of 0.25 s each
    # before the whole program itself).
    space = block_space(seed, layers=7)
    programs = []
    real_milp = exact.milp
    monkeypatch.setattr(exact, "milp", lambda *a, **kw: programs.append(kw["options"]) or real_milp(*a, **kw))
    for fractions in [(0.6, 0.5), (0.35, 0.4), (0.25, 1.0)]:
        memory, loss = budgets_for(space, *fractions)
        feasible = [t[1] for _, _, t in every_plan(space) if t[0] <= memory and t[2] <= loss]
        programs.clear()
        if not feasible:
            continue
        solution = solve_exact(space, memory, loss)
        assert len(programs) == 1
        assert solution.total.seconds <= min(feasible) * (1 + MIP_GAP) and solution.gap <= MIP_GAP


@pytest.mark.parametrize("seed", range(4))
def test_a_memory_budget_at_exactly_a_recomputed_plans_bytes_is_met(seed, exact_solves):
    # The linearisation is exact: a plan whose bytes are the budget itself is feasible (y and w
    # never count more than the products), and nothing below its true bytes is reported feasible.
    space = block_space(seed)
    plans = [(t, a, r) for a, r, t in every_plan(space) if r]
    totals, _, _ = plans[seed * 7 % len(plans)]
    solution = solve_exact(space, totals[0], float("inf"))
    best = min(t[1] for a, r, t in every_plan(space) if t[0] <= totals[0])
    assert solution.total.seconds == pytest.approx(best, rel=1e-9)
    assert solution.total.bytes <= totals[0] * (1 + 1e-12)


def test_a_budget_only_recomputation_meets_is_met_and_without_blocks_is_infeasible():
    with_blocks, without = block_space(3), block_space(3, blocks=False)
    least_without = without.totals(without.extreme("bytes")).bytes
    least_with = min(t[0] for _, _, t in every_plan(with_blocks))
    assert least_with < least_without
    memory = (least_with + least_without) / 2
    solution = solve_exact(with_blocks, memory, float("inf"))
    assert solution.recompute and solution.total.bytes <= memory
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_exact(without, memory, float("inf"))
    assert info.value.min_bytes == pytest.approx(least_without)
    assert f"{least_without:,.0f} bytes" in str(info.value)
    # Below what recomputation reaches too, the error names the smallest reachable with it.
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_exact(with_blocks, least_with * 0.99, float("inf"))
    assert info.value.min_bytes == pytest.approx(least_with)
    assert f"{least_with:,.0f} bytes" in str(info.value)


def test_smallest_reachable_within_a_loss_budget_counts_recomputation():
    space = block_space(5)
    loss = budgets_for(space, 1.0, 0.3)[1]
    least = min(t[0] for _, _, t in every_plan(space) if t[2] <= loss)
    assert exact.smallest_reachable(space, float("inf"), loss)[0] == pytest.approx(least)


@pytest.mark.parametrize("seed", range(4))
def test_k_best_with_blocks_equals_brute_force_and_tells_recompute_sets_apart(seed, exact_solves):
    space = block_space(seed, layers=5)
    memory, loss = budgets_for(space, 0.7, 0.8)
    expected = sorted(t[1] for _, _, t in every_plan(space) if t[0] <= memory and t[2] <= loss)[:12]
    found = k_best(space, memory, loss, 12)
    # The i-th is the best plan none of those before it is, to the solver's proven gap; the
    # first i together are i distinct feasible plans, so sorted they are no better than the i best.
    assert len(found) == len(expected)
    assert all(s.total.seconds <= e * (1 + MIP_GAP) for s, e in zip(found, expected))
    assert all(s >= e * (1 - 1e-12) for s, e in zip(sorted(s.total.seconds for s in found), expected))
    keys = [(tuple(sorted((n, f.value) for n, f in s.assignment.items())), s.recompute) for s in found]
    assert len(set(keys)) == len(keys)
    # The same formats with another recompute set is another plan, not a repeat.
    assert len({k[0] for k in keys}) < len(keys)


def test_excluding_a_plan_keeps_its_formats_with_another_recompute_set():
    space = block_space(2, layers=5)
    first = solve_exact(space)
    assert first.recompute == frozenset()  # no budget: recomputing only costs time
    (second,) = k_best(space, exclude=[first])
    (plain,) = k_best(space, exclude=[dict(first.assignment)])  # an assignment: that plan recomputing nothing
    assert (second.assignment, second.recompute) != (first.assignment, first.recompute)
    assert (plain.assignment, plain.recompute) == (second.assignment, second.recompute)


def test_fixing_a_recompute_set_folds_it_into_the_choices():
    space = block_space(4)
    recompute = ("blocks.1",)
    fixed = space.fixing_recompute(recompute)
    assert fixed.blocks == ()
    for assignment, r, totals in every_plan(space):
        if r == frozenset(recompute):
            t = fixed.totals(assignment)
            assert (t.bytes, t.seconds, t.loss) == pytest.approx(totals, rel=1e-12)
    # The all-FP32 plan keeps its exact bytes with the set folded in (the learning sampler's space).
    space = exact_fp32_space(4)
    fp32 = space.uniform(Format.FP32)
    assert space.fixing_recompute(recompute).totals(fp32).bytes == space.totals(fp32, recompute).bytes < space.fp32_bytes


def test_bad_blocks_are_refused_naming_the_block():
    table = random_table(4, 0)
    names = list(table)
    ok = {n: {f: 1.0 for f in FORMATS} for n in names[:2]}
    with pytest.raises(SearchError, match=r"block 'b': freed\['blocks.0.layer0'\]\[fp32\] must be a finite number >= 0"):
        Block("b", {names[0]: {Format.FP32: -1.0}}, {names[0]: {Format.FP32: 0.0}})
    with pytest.raises(SearchError, match=r"'nope' is not in the search space"):
        SearchSpace(table, blocks=[Block("b", {"nope": {}}, {})])
    with pytest.raises(SearchError, match=r"layer 'blocks.0.layer0' is in blocks 'a' and 'b'"):
        SearchSpace(table, blocks=[Block("a", ok, ok), Block("b", ok, ok)])
    too_much = {names[0]: {f: table[names[0]][f].bytes * 2 for f in FORMATS}}
    with pytest.raises(SearchError, match=r"would free .* more than its"):
        SearchSpace(table, blocks=[Block("a", too_much, {names[0]: {f: 0.0 for f in FORMATS}})])


# -- the all-FP32 plan at the memory reference (issue 59) ------------------------------------------


def _fp32_overstated_space():
    """Two layers whose all-FP32 plan the additive table overstates (an FP32 layer charged its
    lowered neighbour's FP32 saves): 100 + 100 + 40 fixed = 240, exactly 200."""
    table = {name: {Format.FP32: Choice(100.0, 1.0, 0.0), Format.BF16: Choice(70.0, 0.6, 0.01)} for name in ("a", "b")}
    return SearchSpace(table, fixed={"rest": Choice(40.0, 0.1, 0.0)}, fp32_bytes=200.0)


def test_the_all_fp32_plan_meets_a_budget_of_its_own_exact_bytes():
    # Before: the all-FP32 plan counted 240 bytes against the reference 200, so memory_budget=1.0
    # with min_precision=32 was refused, advising a budget of 1.2 the settings refuse.
    space = _fp32_overstated_space()
    (best,) = k_best(space, memory_bytes=200.0, loss_budget=0.0)
    assert dict(best.assignment) == {"a": Format.FP32, "b": Format.FP32} and best.total.bytes == 200.0
    assert space.totals({"a": Format.FP32, "b": Format.FP32}).bytes == 200.0


def test_an_infeasible_budget_states_the_all_fp32_floor_exactly():
    with pytest.raises(InfeasibleBudgetError) as info:
        k_best(SearchSpace({"a": {Format.FP32: Choice(100.0, 1.0, 0.0)}}, fixed={"rest": Choice(40.0, 0.1, 0.0)}, fp32_bytes=120.0), 100.0, 0.0)
    assert info.value.formats_floor == 120.0 and info.value.min_bytes == 120.0


def test_the_all_fp32_plan_ranks_among_the_k_best_by_its_time():
    # Under 230 bytes the program alone sees three plans (all-BF16 180, the mixed two 210); the
    # all-FP32 plan (additive 240, exactly 200) is the fourth and slowest.
    plans = k_best(_fp32_overstated_space(), memory_bytes=230.0, loss_budget=1.0, k=4)
    assert [(p.total.bytes, round(p.total.seconds, 6)) for p in plans] == [(180.0, 1.3), (210.0, 1.7), (210.0, 1.7), (200.0, 2.1)]


def _fp32_recompute_space(parts=()):
    """Three one-layer blocks. The table charges each FP32 layer 40 bytes of its lowered
    neighbours' FP32 saves (100, truly 60); the exact all-FP32 plan holds 260 (80 outside the
    layers in FP32), and recomputing a block there frees its layer's 60 and its own ops' 10.
    BF16 is slower (a CPU without BF16 arithmetic) and saves 40 recomputable bytes a layer."""
    names = ("a", "b", "c")
    table = {n: {Format.FP32: Choice(100.0, 1.0, 0.0), Format.BF16: Choice(60.0, 1.5, 0.01)} for n in names}
    blocks = [Block(f"block_{n}", {n: {Format.FP32: 60.0, Format.BF16: 40.0}}, {n: {Format.FP32: 0.3, Format.BF16: 0.45}},
                    other_bytes=0.0, fp32_other_bytes=10.0) for n in names]
    return SearchSpace(table, fixed={"rest": Choice(40.0, 0.1, 0.0)}, blocks=blocks, fp32_bytes=260.0, parts=parts)


def test_recomputation_alone_is_priced_at_the_all_fp32_plans_exact_bytes():
    # Before: only the all-FP32 plan recomputing nothing was judged at its exact bytes; with
    # blocks recomputed it took the table's overstated figure (340 - 60 a block), so under 100
    # bytes the program lowered every layer to BF16 and recomputed all (100 bytes, 5.95 s)
    # where FP32 recomputing all three holds 50 bytes in 4.0 s (a diffusers UNet: the search's
    # plan measured 1.4x slower than recomputing every block in FP32).
    space = _fp32_recompute_space()
    fp32 = space.uniform(Format.FP32)
    assert space.totals(fp32, ["block_a"]) == Choice(190.0, 3.4, 0.0)
    best = k_best(space, memory_bytes=100.0, loss_budget=1.0, k=2)
    assert dict(best[0].assignment) == fp32 and best[0].recompute == {"block_a", "block_b", "block_c"}
    assert (best[0].total.bytes, round(best[0].total.seconds, 6)) == (50.0, 4.0)
    assert (best[1].total.bytes, round(best[1].total.seconds, 6)) == (100.0, 5.95)  # all BF16, all recomputed: the program's
    (best,) = k_best(space, memory_bytes=130.0, loss_budget=1.0)  # two blocks are enough: the fastest two
    assert len(best.recompute) == 2 and (best.total.bytes, round(best.total.seconds, 6)) == (120.0, 3.7)
    (best,) = k_best(space, memory_bytes=260.0, loss_budget=1.0)  # it fits as it is: nothing recomputed
    assert best.recompute == frozenset() and best.total.bytes == 260.0
    with pytest.raises(InfeasibleBudgetError) as info:
        k_best(space, memory_bytes=40.0, loss_budget=1.0)
    assert info.value.recompute_floor == 50.0 and info.value.min_bytes == 50.0 and info.value.formats_floor == 220.0


def test_recomputation_alone_is_priced_exactly_per_memory_part():
    parts = [MemoryPart("stage 0", frozenset({"a", "b"}), fixed_bytes=20.0, fp32_bytes=180.0, fixed_seconds=0.05),
             MemoryPart("stage 1", frozenset({"c"}), fixed_bytes=20.0, fp32_bytes=80.0, fixed_seconds=0.05)]
    space = _fp32_recompute_space(parts)
    fp32 = space.uniform(Format.FP32)
    assert space.part_bytes(fp32, ["block_a"]) == {"stage 0": 110.0, "stage 1": 80.0}
    (best,) = k_best(space, memory_bytes={"stage 0": 120.0, "stage 1": 80.0}, loss_budget=1.0)
    assert dict(best.assignment) == fp32 and len(best.recompute) == 1 and best.recompute <= {"block_a", "block_b"}
    assert space.part_bytes(best.assignment, best.recompute) == {"stage 0": 110.0, "stage 1": 80.0}


def test_a_loss_budget_of_a_few_millionths_is_held_exactly():
    """Per-token loss increases of a small model are 1e-7..1e-6 nats: the solver's budget row is
    scaled to its own size, so the least bytes within the budget are brute force's (HiGHS holds
    an unscaled row only to 1e-7, and stated 9 of 40 such floors too low)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        table = {}
        for i in range(8):
            size = rng.integers(1, 50) * 1e4
            s = rng.lognormal(-14, 1.0)
            table[f"l{i}"] = {Format.BF16: Choice(size * 2, size * 1e-9, s * 0.05), Format.NVFP4: Choice(size * 0.56, size * 2e-9, s)}
        space = SearchSpace(table, min_precision=4, max_precision=16)
        budget = space.totals(space.uniform(Format.BF16)).loss * (1 + 1e-6)
        totals = [space.totals(dict(zip(table, combo))) for combo in itertools.product([Format.BF16, Format.NVFP4], repeat=8)]
        least = min(t.bytes for t in totals if t.loss <= budget)
        assert exact.smallest_reachable(space, float("inf"), budget)[0] == pytest.approx(least)
        assert solve_exact(space, least, budget).total.loss <= budget


def test_every_all_fp32_recompute_set_is_priced_at_its_measured_bytes_on_a_real_model():
    """The space's all-FP32 totals with blocks recomputed are what the step holds, as measured
    (saved-tensor meter and gradient buffers), and what the cost model's plan-level figure says:
    not the additive table's, which charges each FP32 layer its lowered neighbours' FP32 saves."""
    from autoprec.blocks import find_blocks
    from autoprec.calls import ModelCall
    from autoprec.coverage import find_layers
    from autoprec.search.candidate_runs import MeasuredStage
    from autoprec.search.pipeline import measure_space
    from autoprec.search.planning import Planning
    from autoprec.workloads import default_workload

    wl = default_workload("tiny", batch_size=4)
    model = wl.build_model(0)
    sampler = wl.train_batches(0)
    batches = [sampler.next() for _ in range(2)]
    example = ModelCall.first(model, lambda: wl.loss(model, batches[0]))
    blocks = find_blocks(model, find_layers(model))
    found = measure_space(model, example, batches[:1], wl.loss, None, Planning(formats=(Format.FP32, Format.BF16), budgets=Budgets(memory=0.5, accuracy=0.05)),
                          cost_inputs=batches[0], cost_loss_fn=wl.loss, blocks=blocks)
    space, fp32 = found.space, found.space.uniform(Format.FP32)
    stage = MeasuredStage(model, wl.loss, batches, wl.val_batches(1), steps=1, warmup=0)
    additive = sum(u.choices[fp32[u.name]].bytes for u in space.units) + space.fixed_total.bytes
    assert additive > space.fp32_bytes  # the table overstates this family here too
    for recompute in ((), blocks[:1], blocks):
        plan = found.costs.uniform_plan(Format.FP32).with_recompute(recompute)
        predicted = space.totals(fp32, recompute).bytes
        assert predicted == found.costs.plan_cost(plan).bytes
        assert predicted == pytest.approx(stage.memory(plan), rel=0.01), recompute
