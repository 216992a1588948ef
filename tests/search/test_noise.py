"""Measured comparisons that know their noise (`autoprec.noise`, `MeasuredStage.settle`)."""

from __future__ import annotations

import random

import pytest

from autoprec.formats import Format
from autoprec.plan import Plan
from autoprec.search.candidate_runs import Candidate, MeasuredStage
from autoprec.noise import median_interval, separate, unseparated
from autoprec.workloads import default_workload


def test_the_median_interval_is_order_statistics_and_the_whole_range_when_few():
    values = list(range(1, 21))  # n = 20: at 90 % the 6th smallest and 6th largest (binomial)
    low, median, high = median_interval(values, 0.9)
    assert (low, median, high) == (6, 10.5, 15)
    assert median_interval([3.0, 1.0, 2.0], 0.9) == (1.0, 2.0, 3.0)  # too few for 90 %: all of it


def _rounds(base: float, spread: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [base * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_a_contender_faster_beyond_the_noise_is_taken_even_when_predicted_slower():
    times = {"a": _rounds(10.0, 0.01, 15, 1), "b": _rounds(13.0, 0.01, 15, 2)}
    control = (_rounds(10.0, 0.01, 15, 3), _rounds(10.0, 0.01, 15, 4))
    verdict = separate(times, {"a": 2.0, "b": 1.0}, control)
    assert verdict.choice == "a" and verdict.tied == ("a",) and verdict.resolved
    assert verdict.ratios["b"][0] > 1.25
    assert "a separated from the rest" in verdict.summary()


def test_a_difference_smaller_than_the_control_pairs_spread_is_not_ranked_on():
    # b measures 3 % faster, but the control pair (the same work twice) strays by up to ~10 %.
    times = {"a": _rounds(10.0, 0.02, 15, 5), "b": _rounds(9.7, 0.02, 15, 6)}
    control = (_rounds(10.0, 0.08, 15, 7), _rounds(10.0, 0.08, 15, 8))
    verdict = separate(times, {"a": 1.0, "b": 2.0}, control)
    assert verdict.fastest == "b" and set(verdict.tied) == {"a", "b"}
    assert verdict.choice == "a"  # the cost model's pick among the tied
    assert not verdict.resolved and "cannot separate" in verdict.summary()


def test_an_unsound_control_pair_is_said_in_the_summary():
    times = {"a": _rounds(10.0, 0.01, 9, 9)}
    control = (_rounds(14.0, 0.01, 9, 10), _rounds(10.0, 0.01, 9, 11))  # the same work measured 1.4x apart
    verdict = separate(times, {"a": 1.0}, control)
    assert not verdict.control_sound and not verdict.resolved
    assert "control pair 1.40x" in verdict.summary() and "off 1.0" in verdict.summary()


def test_settle_times_contenders_and_the_control_pair_in_the_same_rounds(monkeypatch):
    import autoprec.search.candidate_runs as measured

    made = []

    class Counted(measured.StepVariant):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(measured, "StepVariant", Counted)
    wl = default_workload("tiny", batch_size=4)
    model = wl.build_model(0)
    sampler = wl.train_batches(0)
    train = [sampler.next() for _ in range(2)]
    fp32 = Plan.uniform(model, Format.FP32, train[0][0])
    bf16 = Plan.uniform(model, Format.BF16, train[0][0])
    stage = MeasuredStage(model, wl.loss, train, wl.val_batches(2), steps=3, warmup=1)
    contenders = [Candidate("uniform-fp32", fp32), Candidate("autocast-bf16", bf16, autocast=True)]
    control = (Candidate("uniform-bf16", bf16), Candidate("autocast-bf16", bf16, autocast=True))
    before = len(made)  # the stage's own FP32 copy
    verdict = stage.settle(contenders, control, max_rounds=6)
    assert verdict.rounds in (3, 6)  # 3 rounds, 3 more when unresolved, never past 6
    assert set(verdict.ratios) == {"uniform-fp32", "autocast-bf16"} and verdict.control is not None
    assert verdict.choice in verdict.tied
    assert len(made) - before == 3  # the control's autocast-bf16 is the contender's own copy
    assert stage.spare_copies() >= 2  # a tiny model: room for several copies
    with pytest.raises(ValueError):
        separate({}, {})


def test_unpaired_steps_are_not_ranked_on_a_difference_inside_their_own_spread():
    # The training-time search's candidates: two timed steps each, not in the same rounds.
    assert unseparated([1.00, 1.10], [0.98, 1.02])  # 3 % apart, each step pair spreads 10 %
    assert not unseparated([1.00, 1.01], [0.80, 0.81])  # 20 % apart, 1 % spread


def test_settle_keeps_emulation_warnings_out_of_the_users_output():
    """The interleaved rounds run candidate plans as the trials do: a layer without a kernel here
    is named in the plan's metadata, not warned once per layer on the job's console (a diffusers
    UNet's INT8 convolutions printed 25 of them)."""
    import warnings

    from autoprec.runtime import EmulationWarning, apply_plan, removing

    wl = default_workload("tiny", batch_size=4)
    model = wl.build_model(0)
    sampler = wl.train_batches(0)
    train = [sampler.next() for _ in range(2)]
    int8 = Plan.uniform(model, Format.INT8, train[0][0])
    with warnings.catch_warnings(record=True) as seen:  # the same plan outside the stage does warn
        warnings.simplefilter("always")
        runtime = apply_plan(model, int8, validate=False)
        with removing([runtime]), runtime:
            wl.loss(model, train[0])
    assert any(issubclass(w.category, EmulationWarning) for w in seen)
    stage = MeasuredStage(model, wl.loss, train, wl.val_batches(2), steps=2, warmup=1)
    fp32 = Plan.uniform(model, Format.FP32, train[0][0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stage.settle([Candidate("uniform-int8", int8), Candidate("uniform-fp32", fp32)], max_rounds=2)
    assert not [w for w in seen if issubclass(w.category, EmulationWarning)]
