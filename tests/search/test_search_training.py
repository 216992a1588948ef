"""The scheduler's search spread over training steps (`autoprec.search.in_run`): probe steps
time (role, format) in place, off-path units run in bounded slices, candidates are tried on
training steps, every step trains the model, a mid-search checkpoint resumes, DDP ranks agree."""

import copy
import math

import re

import pytest
import torch
import torch.nn as nn

from autoprec.coverage import find_layers
from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.scheduler import DynamicPrecisionScheduler
import autoprec.scheduler.search_steps as search_steps
from autoprec.search.memory_margin import MemoryMargin
import autoprec.search.in_run as in_run
from autoprec.search.in_run import MEMORY_ROUNDS, PROBE_ROUNDS, PROBED_PER_ROLE, TrainingSearch, probe_formats
from autoprec.search.trials import SKIPPED_TRIAL_STEPS, TIMED_TRIAL_STEPS, Trial
from autoprec.workloads import default_workload

WINDOW = 6
LR = 0.05  # plain SGD (see setup); at 0.5 the tiny LM is chaotic enough that rounding grows to a step's size


def setup(seed=0):
    """The tiny LM and plain SGD: an update proportional to the gradient, so a step's rounding
    moves the weights by as little (Adam's normalised update would magnify it to a step's size)."""
    wl = default_workload("tiny", batch_size=8)
    model = wl.build_model(seed)
    return wl, model, torch.optim.SGD(model.parameters(), lr=LR)


def make(**kwargs):
    settings = dict(monitor_window=WINDOW, monitor_steps=3, memory_budget=0.85, accuracy_budget=0.05, formats=("fp32", "bf16", "int8"))
    settings.update(kwargs)
    return DynamicPrecisionScheduler(**settings)


def train(wl, model, opt, sch, steps, sampler):
    phases = []
    for _ in range(steps):
        batch = sampler.next()
        with sch.precision_context():
            loss = wl.loss(model, batch)
        sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
        phases.append(sch.phase)
    return phases


def through_search(wl, model, opt, sch, sampler):
    """The window, then steps until its search has ended (planned or safe); the phases."""
    phases = train(wl, model, opt, sch, WINDOW, sampler)
    while phases[-1] == "searching" or len(phases) == WINDOW:
        phases += train(wl, model, opt, sch, 1, sampler)
    return phases


def until_planned(wl, model, opt, sch, sampler, limit=200):
    phases = []
    while sch.phase != "planned" and len(phases) < limit:
        phases += train(wl, model, opt, sch, 1, sampler)
    assert sch.phase == "planned", f"no plan after {limit} steps: {sch.last_search_error}"
    return phases


def test_layers_of_one_role_share_a_role_and_others_do_not():
    wl, model, _ = setup()
    layers = find_layers(model, wl.train_batches(0).next()[0])
    roles = {fqn: info.role(fqn) for fqn, info in layers.items()}
    assert roles["blocks.0.mlp.fc"] == roles["blocks.1.mlp.fc"]
    assert roles["blocks.0.attn.proj"] == roles["blocks.1.attn.proj"]
    assert roles["blocks.0.attn.proj"] != roles["blocks.0.mlp.fc"]
    assert roles["lm_head"] not in {roles[f] for f in roles if f != "lm_head"}


def search_for(model, example, known=None, profile=None, **settings):
    from autoprec.scheduler.config import SchedulerConfig

    config = SchedulerConfig(**{"formats": ("fp32", "bf16", "fp16", "int8"), **settings})
    fingerprint = find_layers(model, example)
    return TrainingSearch(model, example, [], None, profile, config=config, baseline_loss=None, fingerprint=fingerprint, step=0,
                          known={} if known is None else known, lead=False)


def test_probe_steps_give_every_role_every_format_and_mix_formats_within_a_step():
    wl, model, _ = setup()
    x = wl.train_batches(0).next()[0]
    search = search_for(model, x)
    allowed = probe_formats(search.layers, search.formats, None, torch.device("cpu"))
    assert search.probe_steps == PROBE_ROUNDS * max(len(f) for f in allowed.values())
    seen = {fqn: set() for fqn in search.layers}
    for plan in search._probes:
        for fqn, lp in plan.layers.items():
            seen[fqn].add(lp.format)
        # The layers of one role run different formats in one step (two blocks, two formats at least).
        assert plan.layers["blocks.0.mlp.fc"].format is not plan.layers["blocks.1.mlp.fc"].format
    by_role: dict = {}
    for fqn in search.layers:
        by_role.setdefault(search.roles[fqn], []).append(fqn)
    for fqns in by_role.values():
        probed = [fqn for fqn in fqns if seen[fqn] == set(allowed[fqn])]
        assert len(probed) == min(len(fqns), PROBED_PER_ROLE)  # each one sample of every format per cycle
        # The others run their widest format throughout: no slower format where no sample is taken.
        assert all(seen[fqn] == {Format.FP32} for fqn in fqns if fqn not in probed)


def test_a_role_of_many_layers_probes_three_spread_over_the_model():
    from autoprec.workloads.bytelm import ByteLMWorkload, LMConfig, split_corpus, load_corpus

    train, val = split_corpus(load_corpus())
    wl = ByteLMWorkload("gpt7", LMConfig(vocab_size=256, context=16, d_model=32, n_heads=2, n_layers=7, d_ff=64), train, val, 2)
    model = wl.build_model(0)
    search = search_for(model, wl.train_batches(0).next()[0])
    fc = [f"blocks.{i}.mlp.fc" for i in range(7)]
    probed = [fqn for fqn in fc if len({plan.layers[fqn].format for plan in search._probes}) > 1]
    assert probed == ["blocks.0.mlp.fc", "blocks.3.mlp.fc", "blocks.6.mlp.fc"]


def test_probes_keep_a_pinned_layer_in_its_format_and_never_run_a_forbidden_one():
    from autoprec.search.space import LayerRules

    wl, model, _ = setup()
    rules = LayerRules(pin={"lm_head": Format.FP32}, forbid={"blocks.*.mlp.*": [Format.INT8]})
    search = search_for(model, wl.train_batches(0).next()[0], rules=rules)
    for plan in search._probes:
        assert plan.layers["lm_head"].format is Format.FP32
        assert all(lp.format is not Format.INT8 for fqn, lp in plan.layers.items() if ".mlp." in fqn)
    assert any(plan.layers["blocks.0.mlp.fc"].format is Format.FP16 for plan in search._probes)


def test_known_times_skip_the_probes_and_a_partial_table_does_not():
    wl, model, _ = setup()
    x = wl.train_batches(0).next()[0]
    first = search_for(model, x)
    known = {f"{first.roles[fqn]}|{f.value}": 1e-3 for fqn in first.layers for f in first.formats}
    assert search_for(model, x, known=known).probe_steps > 0  # the rest of the step is not known yet
    known["rest"] = 1e-3
    assert search_for(model, x, known=known, recompute=[]).probe_steps == 0  # formats only: known
    assert first.blocks and search_for(model, x, known=known).probe_steps > 0  # the blocks' forwards are not
    known.update({f"forward|{first.roles[fqn]}|{f.value}": 1e-4 for fqn in first.layers for f in first.formats})
    known.update({f"block|{b}": 1e-4 for b in first.blocks})
    assert search_for(model, x, known=known).probe_steps == 0
    del known[f"{first.roles['lm_head']}|int8"]
    assert search_for(model, x, known=known).probe_steps > 0


def test_measure_costs_false_has_no_probe_steps():
    wl, model, _ = setup()
    assert search_for(model, wl.train_batches(0).next()[0], measure_costs=False).probe_steps == 0


@pytest.fixture(scope="module")
def searched():
    wl, model, opt = setup()
    sch = make()
    sampler = wl.train_batches(0)
    phases = train(wl, model, opt, sch, WINDOW, sampler)
    phases += until_planned(wl, model, opt, sch, sampler)
    return wl, model, opt, sch, phases


def test_the_search_runs_on_the_steps_after_the_window_and_tries_its_candidates(searched):
    _, _, _, sch, phases = searched
    assert phases[: WINDOW - 1] == ["profiling"] * (WINDOW - 1)
    searching = phases.count("searching")
    assert phases[WINDOW - 1 : WINDOW - 1 + searching] == ["searching"] * searching and phases[-1] == "planned"
    measured = sch.plan.measured
    assert measured["source"] == "training steps"
    assert 1 <= len(measured["candidates"]) <= 3 and measured["saved_bytes"] > 0  # the 2 best, and all-BF16 when it meets the budgets
    assert math.isfinite(measured["bytes_over_predicted"])  # in the cost model's bytes: a promotion pays from there
    assert [c["reference"] for c in measured["candidates"]][:2] == [None] * min(2, len(measured["candidates"]))
    assert all(c["reference"] in (None, "every layer bf16") for c in measured["candidates"]) and measured["compiled"] is False
    kept = [c["step_seconds"] for c in measured["candidates"] if c["dropped"] is None]
    # The fastest kept candidate won, unless its win was inside the candidates' own step spread:
    # then the predicted fastest kept one (the first) stays (issue 49).
    assert measured["step_seconds"] == (kept[0] if measured["within_noise"] else min(kept))
    assert not measured["within_noise"] or kept[0] > min(kept)
    assert searching >= PROBE_ROUNDS * 3  # three formats: at least one probe cycle each round
    # The timeline the log and TensorBoard show, kept with the plan: every stage, none negative.
    timeline = measured["search_timeline"]
    assert {"snapshot", "probe steps", "trace", "region bytes", "sensitivity", "solve", "trial steps"} <= set(timeline)
    # The first step after the window makes the search (the window's last summed it up): the
    # search runs on the steps after it.
    assert all(v >= 0 for v in timeline.values()) and measured["search_steps"] == searching - 1


def test_the_search_timeline_reaches_tensorboard(tmp_path):
    from support.tb_events import accumulator

    wl, model, opt = setup()
    sch = make(log_dir=str(tmp_path))
    until_planned(wl, model, opt, sch, wl.train_batches(0))
    sch.close()
    acc = accumulator(tmp_path / "train")
    timeline = sch.plan.measured["search_timeline"]
    for stage, seconds in timeline.items():
        (point,) = acc.Scalars(f"search/{stage.replace(' ', '_')}_seconds")
        assert point.value == pytest.approx(seconds, rel=1e-6)
    (ratio,) = acc.Scalars("search/longest_step_ratio")  # the longest search step over the median safe step
    assert 0 < ratio.value < float("inf")


def test_probe_measurements_are_kept_for_the_next_search(searched):
    _, _, _, sch, _ = searched
    roles = {info.role(fqn) for fqn, info in sch._fingerprint.items()}
    known = sch._searches.known_times
    assert "rest" in known
    assert all(f"{role}|{f}" in known for role in roles for f in ("fp32", "bf16"))
    assert sch.state_dict()["known_times"] == known


def test_every_search_step_trains_the_model_none_lost_or_repeated(searched):
    """The weights after window + search steps are those of as many FP32 steps, up to the
    formats' rounding: much nearer than a run one step short or one step long."""
    wl, model, _, sch, phases = searched
    n = len(phases)

    def plain(steps):
        torch.manual_seed(0)
        _, m, o = setup()
        sampler = wl.train_batches(0)
        for _ in range(steps):
            loss = wl.loss(m, sampler.next())
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        return torch.cat([p.detach().flatten() for p in m.parameters()])

    ours = torch.cat([p.detach().flatten() for p in model.parameters()])
    same, short, long = plain(n), plain(n - 1), plain(n + 1)
    distance = (ours - same).norm()
    assert distance < 0.25 * (short - same).norm() and distance < 0.25 * (long - same).norm()


class _EvenSteps:
    """A ``time`` whose clock advances one second per read: every training step measures alike,
    so a slice's budget, ``(1 + slice) * median step - this step``, does not depend on the
    machine's step-to-step noise (a step faster than the median would leave room for units)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def test_the_whole_search_runs_in_one_step_without_a_slice_and_over_many_with_a_tiny_one(monkeypatch):
    wl, model, opt = setup()
    sampler = wl.train_batches(0)
    sch = make(measure_costs=False, search_slice=None)
    train(wl, model, opt, sch, WINDOW, sampler)
    assert sch.phase == "planned"  # None: the whole search in the window's last step

    monkeypatch.setattr(search_steps, "time", _EvenSteps())
    wl, model, opt = setup()
    sch = make(measure_costs=False, search_slice=1e-9)  # no unit fits: one runs every third step
    phases = train(wl, model, opt, sch, WINDOW + 1, sampler)  # the window, then the step that makes the search
    assert phases[-1] == "searching"
    search = sch._searches.search
    steps = 0
    while sch.phase == "searching" and steps < 600:
        train(wl, model, opt, sch, 1, sampler)
        steps += 1
    assert sch.phase == "planned" and set(search.timeline) >= {"trace", "region bytes", "sensitivity", "solve"}
    # Region bytes (one unit per role) and sensitivity (one per layer and format): every third step.
    assert steps >= 3 * len(sch.layers)


def test_a_slice_runs_units_while_they_fit_hands_its_passes_on_when_it_runs_none_and_one_after_two_empty_slices():
    wl, model, _ = setup()
    search = search_for(model, wl.train_batches(0).next()[0], measure_costs=False)
    ran = []

    def units(n, weight):
        for i in range(n):
            ran.append(i)
            yield "sensitivity", weight

    search._offpath, search._unit_cost = units(3, 0.25), {}
    search.work(1.0)  # units of no known weight, then of a quarter pass each: all of them run
    assert ran == [0, 1, 2] and search._offpath is None
    ran.clear()
    search._offpath, search._unit_cost, search._next_stage = units(3, 0.6), {}, ""
    search.work(1.0)  # the first runs (no known weight), then 0.6 of 0.4 left does not fit
    assert ran == [0]
    ran.clear()
    search._offpath, search._unit_cost, search._next_stage = units(2, 0.1), {"sensitivity": 10.0}, "sensitivity"
    search.work(1.0)
    search.work(1.0)
    assert ran == []  # a 10-pass unit fits in no 1-pass slice
    search.work(1.0)  # the third slice in a row runs one anyway (then, at its own weight, the next fits)
    assert ran == [0, 1]
    ran.clear()
    search._offpath, search._unit_cost, search._next_stage = units(3, 1.5), {"sensitivity": 1.5}, "sensitivity"
    search.work(1.0)  # 1.5 passes do not fit in 1: the slice's pass goes to the next
    assert ran == []
    search.work(1.0)  # 1 + 1 >= 1.5: one runs, and the half pass left is not carried further
    assert ran == [0]
    search.work(1.0)
    assert ran == [0]
    search.work(1.0)
    assert ran == [0, 1]


def test_no_off_path_unit_runs_after_a_probe_step():
    """A probe step runs a probe plan, which where its formats are slower (an emulating CPU's)
    takes a step's time of its own: the units wait for the steps after the probes."""
    wl, model, _ = setup()
    search = search_for(model, wl.train_batches(0).next()[0])
    assert search.probe_steps > 0
    ran = []

    def units():
        while True:
            ran.append(search.steps)
            yield "sensitivity", 0.5

    search._offpath, search._unit_cost = units(), {}
    for steps in range(1, search.probe_steps + 3):  # the step count once each step is recorded
        search.steps = steps
        search.work(3.0)
    assert sorted(set(ran)) == [search.probe_steps + 1, search.probe_steps + 2]


def test_the_integer_programs_run_beside_training_steps_and_their_plans_arrive_a_fixed_count_of_steps_later(monkeypatch):
    import threading


    wl, model, opt = setup()
    sampler = wl.train_batches(0)
    sch = make(measure_costs=False)
    real = in_run.propose_from
    steps_done, seen = threading.Event(), {}

    def proposing(*args, **kwargs):
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        # Run inside a training step, this wait could only time out: the step it waits for
        # comes after it.
        seen["beside a step"] = steps_done.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(in_run, "propose_from", proposing)
    train(wl, model, opt, sch, WINDOW + 1, sampler)
    search = sch._searches.search
    while search._solve_from is None:
        train(wl, model, opt, sch, 1, sampler)
    started = search.steps
    train(wl, model, opt, sch, 1, sampler)
    steps_done.set()
    while sch.phase == "searching":
        train(wl, model, opt, sch, 1, sampler)
    assert seen == {"thread": True, "beside a step": True}
    # No trial steps (measure_costs=False): the plan is adopted the step its candidates arrive.
    assert search.steps == started + in_run.SOLVE_STEPS and sch.phase == "planned"


def test_the_heap_is_frozen_while_a_search_runs_and_released_after():
    import gc

    assert gc.get_freeze_count() == 0
    wl, model, opt = setup()
    sampler = wl.train_batches(0)
    sch = make(measure_costs=False)
    train(wl, model, opt, sch, WINDOW, sampler)
    assert sch.phase == "searching" and gc.get_freeze_count() > 0  # from the window's summary on
    train(wl, model, opt, sch, 1, sampler)  # the step that makes the search
    # The generations list every object but the frozen ones: the search's snapshot is frozen as
    # the search starts, and what is alive after each search step with it.
    snapshot = sch._searches.search._snapshot
    assert not any(o is snapshot for o in gc.get_objects())
    made = [[]]
    assert any(o is made for o in gc.get_objects())
    train(wl, model, opt, sch, 1, sampler)
    assert sch.phase == "searching" and not any(o is made for o in gc.get_objects())
    until_planned(wl, model, opt, sch, sampler)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a process that froze its heap itself: the next search leaves it so
    try:
        frozen = gc.get_freeze_count()
        wl, model, opt = setup()
        sch = make(measure_costs=False)
        train(wl, model, opt, sch, WINDOW, sampler)
        until_planned(wl, model, opt, sch, sampler)
        assert gc.get_freeze_count() > frozen // 2  # (objects freed by their count leave it; unfrozen, it would be 0)
    finally:
        gc.unfreeze()


def test_a_checkpoint_taken_mid_search_resumes_and_finishes(searched):
    wl, model, opt = setup()
    sampler = wl.train_batches(0)
    sch = make()
    train(wl, model, opt, sch, WINDOW + 6, sampler)  # the search made at WINDOW + 1; inside the probe steps: the second cycle began
    assert sch.phase == "searching"
    state = copy.deepcopy(sch.state_dict())
    assert state["search"]["steps"] == 5 and state["search"]["samples"]
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR)
    opt2.load_state_dict(opt.state_dict())
    resumed = make(model=model2)
    resumed.load_state_dict(state)
    assert resumed.phase == "searching" and resumed.step_count == sch.step_count
    assert resumed._searches.search.steps == 5 and resumed._searches.search.state_dict()["samples"] == sch._searches.search.state_dict()["samples"]
    sampler2 = copy.deepcopy(sampler)
    until_planned(wl, model2, opt2, resumed, sampler2)
    assert resumed.plan.measured["source"] == "training steps"
    assert resumed.plan.layers.keys() == set(resumed.layers)


def test_a_checkpoint_taken_between_the_windows_summary_and_its_search_resumes_the_same_search():
    """The window's last step sums it up and the next makes the search: a checkpoint between the
    two holds the summary (``due_search``), and the resumed run makes the same search at the same
    step, on the same profile, and finishes it."""
    wl, model, opt = setup()
    sampler = wl.train_batches(0)
    sch = make()
    train(wl, model, opt, sch, WINDOW, sampler)
    assert sch.phase == "searching" and sch._searches.search is None
    state = copy.deepcopy(sch.state_dict())
    assert state["search"] is None and state["due_search"]["profile"] is not None
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR)
    opt2.load_state_dict(opt.state_dict())
    resumed = make(model=model2)
    resumed.load_state_dict(state)
    assert resumed.phase == "searching" and resumed._searches.search is None
    sampler2 = copy.deepcopy(sampler)
    train(wl, model, opt, sch, 1, sampler)
    train(wl, model2, opt2, resumed, 1, sampler2)
    made, remade = sch._searches.search, resumed._searches.search
    assert made.started == remade.started == WINDOW + 1 and made.baseline_loss == remade.baseline_loss
    assert made.profile.to_dict() == remade.profile.to_dict() and [p.to_dict() for p in made._probes] == [p.to_dict() for p in remade._probes]
    until_planned(wl, model2, opt2, resumed, sampler2)
    assert resumed.plan.measured["source"] == "training steps"


# -- DDP ------------------------------------------------------------------------------------------


def ddp_search_scenario(rank, world, tmp):
    from support.data_parallel import make_model, train as ddp_train

    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sch = DynamicPrecisionScheduler(monitor_window=4, monitor_steps=2, memory_budget=0.9, accuracy_budget=0.05, formats=("fp32", "bf16", "int8"))
    phases = []
    for step in range(100):
        ddp_train(ddp, sch, opt, 1, rank, world, start=step)
        phases.append(sch.phase)
        if sch.phase == "planned":
            break
    return {"phases": phases, "plan": sch.plan.to_dict() if sch.plan else None, "error": sch.last_search_error}


@pytest.mark.slow
def test_ddp_ranks_probe_try_and_adopt_one_plan_at_one_step(tmp_path):
    from support.data_parallel import run

    r0, r1 = run(ddp_search_scenario, tmp_path)
    assert r0["error"] is None and r0["plan"] is not None
    assert r0["phases"] == r1["phases"] and r0["plan"] == r1["plan"]
    assert r0["phases"].count("searching") > 1  # spread over steps, the same ones on both ranks
    assert r0["plan"]["measured"]["source"] == "training steps"


def test_the_search_preconditions_with_the_training_optimizers_adam_state(monkeypatch):
    import autoprec.search.in_run as training
    from autoprec.sensitivity import adam_second_moment

    wl, model, _ = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    given = []
    real = training.sensitivity_steps
    monkeypatch.setattr(training, "sensitivity_steps", lambda *a, **k: (given.append(k["second_moment"]), real(*a, **k))[1])
    sch = make()
    sampler = wl.train_batches(0)
    train(wl, model, opt, sch, WINDOW + 1, sampler)
    expected = adam_second_moment(model, [opt])  # the state as the search was made: no step since
    until_planned(wl, model, opt, sch, sampler)
    (moments,) = given
    assert set(moments) == {name for name, _ in model.named_parameters()}
    for name, v in expected.items():
        torch.testing.assert_close(moments[name], v)


def test_recompute_blocks_reach_a_memory_budget_no_plan_of_formats_alone_meets():
    """16-bit formats alone hold at least 0.77 of the FP32 bytes on the tiny LM: with
    ``recompute=[]`` the search fails naming that floor and the setting; by default (blocks found
    as the offline search finds them) and with patterns naming them, it recomputes blocks to reach
    0.6, and training runs the plan: a recomputed block's forward runs again in each backward."""
    outcome = {}
    for recompute in ((), None, ("blocks.*",)):
        wl, model, opt = setup()
        sch = make(formats=("fp32", "bf16"), memory_budget=0.6, recompute=recompute)
        sampler = wl.train_batches(0)
        through_search(wl, model, opt, sch, sampler)
        outcome[recompute] = (wl, model, opt, sch, sampler)
    sch = outcome[()][3]
    assert sch.phase == "safe"
    floor = float(re.search(r"memory_budget >= (\d\.\d+) is met by formats alone", sch.last_search_error).group(1))
    assert floor > 0.6 and "recompute=[] turned recomputation off" in sch.last_search_error
    for recompute in (None, ("blocks.*",)):
        assert outcome[recompute][3].phase == "planned" and set(outcome[recompute][3].plan.recompute) <= {"blocks.0", "blocks.1"}
        assert outcome[recompute][3].plan.recompute
    wl, model, opt, sch, sampler = outcome[None]
    assert "block bytes" in sch.plan.measured["search_timeline"]
    assert sch.plan.predicted["bytes"] <= sch.plan.budgets["memory_bytes"]
    modules = dict(model.named_modules())
    # Counted as each block's MLP starts (the recomputation stops after the last tensor it must
    # save again, so hooks at a module's end need not run; the block's own call is not re-entered).
    calls = {fqn: 0 for fqn in ("blocks.0", "blocks.1")}
    # Forwards with autograd only: a planned check step also runs the model once without it.
    hooks = [modules[f"{fqn}.mlp"].register_forward_pre_hook(lambda m, a, fqn=fqn: calls.__setitem__(fqn, calls[fqn] + torch.is_grad_enabled()))
             for fqn in calls]
    train(wl, model, opt, sch, 1, sampler)
    for h in hooks:
        h.remove()
    assert calls == {fqn: 2 if fqn in sch.plan.recompute else 1 for fqn in calls}


class MeterOver(search_steps.SavedTensorMeter):
    """The trial steps' meter reading more than the cost model predicts for every plan, as an
    encoder-decoder's read 1.2 % over (issue 44): here ``factor`` times what it measures."""

    factor = 1.0

    @property
    def total_bytes(self) -> int:
        return int(super().total_bytes * self.factor)


MARGIN_BUDGET = 0.6  # the first round's candidates near it (the known times below), so 1.3x the saved bytes is over


@pytest.mark.parametrize("factor, adopted", [(1.3, True), (1e3, False)])
def test_candidates_measured_over_the_memory_budget_are_followed_by_a_round_under_the_learned_margin(monkeypatch, factor, adopted):
    """Every first-round candidate measures over the budget: the next round is proposed under the
    budget divided by the measured-to-predicted ratio and adopted, within the bounded trial
    steps (`MEMORY_ROUNDS` rounds), instead of the search failing. A meter no margin can satisfy
    ends the search after the last round, naming the budget the margin would need (for good:
    the scheduler does not profile and search again)."""
    monkeypatch.setattr(MeterOver, "factor", factor)
    monkeypatch.setattr(search_steps, "SavedTensorMeter", MeterOver)
    wl, model, opt = setup()
    sch = make(formats=("fp32", "bf16"), memory_budget=MARGIN_BUDGET, search_slice=None)
    # The times of a device where BF16 layers run in half FP32's time (a GPU's): the candidates then
    # spend the budget on formats before recomputation, as this test needs. Measured here, on a CPU
    # without BF16 arithmetic, the fastest plans are FP32 ones recomputing blocks, and a
    # recomputing candidate with room under the budget was in the first round on some runs.
    first = search_for(model, wl.train_batches(0).next()[0], formats=("fp32", "bf16"))
    roles = set(first.roles.values())
    known = {"rest": 1e-3, **{f"block|{b}": 1e-3 for b in first.blocks}}
    for role in roles:
        for fmt, seconds in (("fp32", 2e-3), ("bf16", 1e-3)):
            known[f"{role}|{fmt}"], known[f"forward|{role}|{fmt}"] = seconds, seconds / 3
    sch._searches.load_known_times(known)
    sampler = wl.train_batches(0)
    phases = through_search(wl, model, opt, sch, sampler)
    searching = phases.count("searching")
    bound = PROBE_ROUNDS * 3 + MEMORY_ROUNDS * 3 * (1 + TIMED_TRIAL_STEPS)  # probes of 3 formats at most; 3 candidates a round, no INT8
    assert searching <= bound
    if not adopted:
        assert sch.phase == "safe" and sch.last_search_error.startswith("no plan meets the memory budget as measured")
        need = float(re.search(r"raise memory_budget to at least (\d+\.\d+)", sch.last_search_error).group(1))
        assert need > 1.0  # a thousandfold meter: no budget a fraction can state
        assert sch.state_dict()["retry_at"] is None  # final: the budget does not change with the data
        return
    measured = sch.plan.measured
    # The next round's plans differ from the first's (by the measured times too): their bytes may
    # be off by another ratio, so a third round may be the one adopted.
    assert sch.phase == "planned" and 2 <= measured["rounds"] <= MEMORY_ROUNDS
    earlier = [c for c in measured["candidates"] if c["round"] < measured["rounds"] - 1]
    assert earlier and all(c["dropped"].startswith("measured") for c in earlier)
    margin = sch.plan.metadata["memory_margin"]
    # At least the meter's 1.3 on the saved bytes, diluted by the gradient buffers it does not meter;
    # more where the line through the safe step (metered without the factor) asks for more.
    assert 1.05 < margin
    assert sch.plan.budgets["memory"] == MARGIN_BUDGET and sch.plan.predicted["bytes"] * margin <= sch.plan.budgets["memory_bytes"]


def test_a_search_failed_over_the_memory_budget_is_retried_under_the_margin_its_last_round_learned(monkeypatch):
    """One memory round only (MEMORY_ROUNDS 1): the first search's candidates all measure 1.3x
    over the budget and it fails; its retry a window later proposes its first round under the
    margin that round learned, and adopts a plan there. Retried from 1.0, the same plans measured
    over again and the retry failed the same way (a T5 at memory 0.75 in one CI run: three rounds,
    then a retry repeating them candidate for candidate)."""
    monkeypatch.setattr(MeterOver, "factor", 1.3)
    monkeypatch.setattr(search_steps, "SavedTensorMeter", MeterOver)
    monkeypatch.setattr(in_run, "MEMORY_ROUNDS", 1)
    wl, model, opt = setup()
    sch = make(formats=("fp32", "bf16"), memory_budget=MARGIN_BUDGET, search_slice=None)
    first = search_for(model, wl.train_batches(0).next()[0], formats=("fp32", "bf16"))
    known = {"rest": 1e-3, **{f"block|{b}": 1e-3 for b in first.blocks}}
    for role in set(first.roles.values()):  # a device where BF16 layers run in half FP32's time (a GPU's), as above
        for fmt, seconds in (("fp32", 2e-3), ("bf16", 1e-3)):
            known[f"{role}|{fmt}"], known[f"forward|{role}|{fmt}"] = seconds, seconds / 3
    sch._searches.load_known_times(known)
    sampler = wl.train_batches(0)
    through_search(wl, model, opt, sch, sampler)
    assert sch.phase == "safe" and "every candidate plan failed on the training steps" in sch.last_search_error
    until_planned(wl, model, opt, sch, sampler)
    assert sch.plan.measured["rounds"] == 1 and sch.plan.metadata["memory_margin"] > 1.05


def test_the_next_round_keeps_to_the_line_through_the_safe_step_not_to_a_ratio():
    """Bytes no plan lowers (a tensor-parallel rank's replicated FP32 norms, residuals and loss)
    make a trial's measured bytes c + s * predicted, not r * predicted: a round proposed under the
    limit divided by the worst ratio measures over again (the TP Llama at ``memory_budget=0.8``
    ended its 3 rounds 0.06 % over). The next round's margin is where the line through the safe
    step (measured = predicted there) and the trials meets the limit."""
    wl, model, _ = setup()
    plan = Plan.uniform(model, "bf16", wl.train_batches(0).next()[0])
    limit, safe = 800, 1000  # predicted bytes: the budget's limit, the safe plan's (measured alike)
    # measured = safe + 0.5 * (predicted - safe): half of what a plan saves on paper shows on the rank.
    trials = [Trial(plan.replace(predicted={"bytes": p}), total_bytes=m, dropped=f"measured {m:,} bytes, over the memory budget of {limit:,}")
              for p, m in ((800, 900), (780, 890))]
    learned = MemoryMargin()
    assert learned.all_over(trials) and not learned.all_over(trials[:1] + [Trial(plan)])
    margin = learned.learn(trials, limit, safe)
    # Under the worst ratio (1.14) the next plan could take 701 predicted bytes: 851 measured, over again.
    assert learned.worst_ratio == pytest.approx(890 / 780) and learned.worst_ratio < margin
    assert margin == pytest.approx(limit / 600) and learned.as_measured(limit / margin, margin) == pytest.approx(limit)
    assert MemoryMargin().learn(trials, limit, None) == pytest.approx(890 / 780)  # no metered safe step: ratios alone


@pytest.mark.parametrize("skips, named", [(SKIPPED_TRIAL_STEPS, None), (SKIPPED_TRIAL_STEPS + 1, None), (SKIPPED_TRIAL_STEPS + 1, "lm_head")])
def test_a_candidates_skipped_steps_do_not_count_until_it_has_skipped_too_many(skips, named):
    """A candidate's first FP16 steps under a fresh loss scale overflow and are skipped (the scale
    backs off): those steps are not its timed ones, and it runs as many more. Past
    `SKIPPED_TRIAL_STEPS` it overflows where no scale helps: the layer the scaler named first goes
    to FP32 and the candidate starts again; with none named it is dropped (LongT5's candidates
    were all dropped on their first skipped step)."""
    wl, model, _ = setup()
    x = wl.train_batches(0).next()[0]
    unknown = search_for(model, x, formats=("fp32", "fp16"), recompute=[])
    known = {"rest": 1e-3, **{f"{unknown.roles[fqn]}|{f.value}": 1e-3 for fqn in unknown.layers for f in unknown.formats}}
    search = search_for(model, x, known=known, formats=("fp32", "fp16"), recompute=[])
    assert search.probe_steps == 0  # the trial steps alone
    plans = [Plan.uniform(model, "fp16", x), Plan.uniform(model, "fp32", x)]
    search.set_candidates(plans)
    first = search._trials[0]
    for _ in range(skips):
        assert search.step_runtime()[0] == "trial" and search._trial() is first
        search.record("trial", 0.5, saved_bytes=1000, skipped=True, first_bad_output=named)  # a skipped step is fast: no optimizer step
    if named is not None:  # started again with the layer in FP32: a new runtime, metered again
        assert first.promoted == (named,) and first.plan.layers[named].format is Format.FP32 and first.runtime is None
        assert first.plan.metadata["promoted_for_overflow"] == [named] and first.saved_bytes is None
        assert search.wants_bytes() and search.step_runtime()[1].plan.layers[named].format is Format.FP32
    steps = 0
    while search._trial() is first:
        search.record("trial", 1.0, saved_bytes=1000 if steps == 0 else None)
        steps += 1
    for _ in range(first.warmup + TIMED_TRIAL_STEPS):
        search.record("trial", 2.0)
    assert search.done
    if skips <= SKIPPED_TRIAL_STEPS or named is not None:
        assert steps == first.warmup + TIMED_TRIAL_STEPS and first.seconds == [1.0] * TIMED_TRIAL_STEPS and first.dropped is None
        assert search.result.layers == first.plan.layers and first.saved_bytes == 1000  # the faster kept candidate
    else:
        assert steps == 0 and first.dropped.startswith(f"non-finite gradients skipped {skips} of its steps")
        assert search.result.layers == plans[1].layers

def test_a_candidate_meters_every_eager_step_and_counts_the_most_saved():
    """A model that drops layers at random (HuBERT's LayerDrop) saves a dropped layer's tensors
    on some steps only: a candidate metered on its first step alone was judged on whatever that
    step drew, and one adopted within the budget metered 0.74 of FP32's bytes at 0.6. Every step
    of a candidate that runs eagerly is metered now, and the most it saved is what the budget
    judges."""
    wl, model, _ = setup()
    x = wl.train_batches(0).next()[0]
    unknown = search_for(model, x, formats=("fp32", "bf16"), recompute=[])
    known = {"rest": 1e-3, **{f"{unknown.roles[fqn]}|{f.value}": 1e-3 for fqn in unknown.layers for f in unknown.formats}}
    search = search_for(model, x, known=known, formats=("fp32", "bf16"), recompute=[])
    search.set_candidates([Plan.uniform(model, "bf16", x)])
    trial = search._trials[0]
    drawn = [700, 1000, 600]  # the second step kept the layer the others dropped
    assert trial.warmup + TIMED_TRIAL_STEPS == len(drawn)
    for saved in drawn:
        assert search.wants_bytes()
        search.record("trial", 1.0, saved_bytes=saved)
    assert search.done and trial.saved_bytes == max(drawn) and search.result.measured["saved_bytes"] == max(drawn)


def test_a_search_over_accumulated_micro_batches_times_whole_steps_and_leaves_no_hook():
    """Gradient accumulation (the HF Trainer's and Lightning's ``accumulate``): every micro-batch
    enters a context. A probe step's layer timer used to be installed again at each one, the
    earlier timers' hooks left on the model for good; now one timer spans the step."""
    wl, model, opt = setup()
    sch = make(formats=("fp32", "bf16"), search_slice=None)
    sampler = wl.train_batches(0)
    while sch.phase != "planned" and sch.step_count < 100:
        for _ in range(3):  # micro-batches
            with sch.precision_context():
                loss = wl.loss(model, sampler.next())
            sch.backward(loss)
        sch.step(opt)
        opt.zero_grad(set_to_none=True)
    assert sch.phase == "planned"
    hooked = {fqn for fqn, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks}
    assert not hooked, hooked
