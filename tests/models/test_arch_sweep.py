"""A CI-sized sample of the architecture sweep (`arch_sweep`): model types drawn from everything
transformers and diffusers ship, built from generated tiny configs, trained through the README loop
at a memory budget of 0.6 and a 5 % accuracy budget. Each must train to a plan within both budgets
(metered bytes, the plan's measured loss increase) or be refused with the reason.

The sample rotates: ``AUTOPREC_SWEEP_SEED`` picks it (default: the day of the year, so CI runs
see different types over time); `SAMPLE` types that build (``AUTOPREC_SWEEP_SAMPLE``, default 20), drawn in that seed's order (a type whose
generated config does not build is passed over, not counted). The failures the whole sweep still
shows are `KNOWN_FAILURES`, each with what it would take. ``python benchmarks/arch_sweep.py --sample 20 --seed N`` runs the same sample
outside pytest.
"""

import functools
import os

import pytest

pytest.importorskip("transformers")
from support import arch_sweep  # noqa: E402

# CI's torch 2.11 leg draws fewer (AUTOPREC_SWEEP_SAMPLE): the same seed's first types, the
# architectures' own code under the other torch release, at a third of the time.
SAMPLE = int(os.environ.get("AUTOPREC_SWEEP_SAMPLE", 20))
SEED = arch_sweep.rotating_seed()
# model type -> why it fails today, and what it would take (the sweep's remaining failure classes,
# docs/architecture_sweep.md). Strict: a drawn one must still fail, so a fix is noticed; the
# search outcomes that hang on measured step times are not strict.
KNOWN_FAILURES: dict[str, tuple[str, bool]] = {
    "longt5": ("every lowered candidate's gradients go NaN in the first encoder block's local attention with a finite loss, "
               "in steps run without loss scaling (the scaler is off while searching); retrying (SKIPPED_TRIAL_STEPS) and "
               "promoting the last layer with NaN gradients (TRIAL_PROMOTIONS) do not reach it: the NaN starts in an op "
               "outside the layers; find it with the backward's anomaly mode and keep its region out of half formats", False),
    "inkling_text": ("its candidates' forwards overflow: with the layers the scaler named promoted to FP32 one plans on some "
                     "runs (the candidates hang on measured times), on others three promotions are not enough: as longt5", False),
}


# Model types whose failure class is fixed, run in every CI run rather than when the sample draws
# them: each failed in a search step with the model's own error before.
FIXED_CLASSES = {
    # Its attention fills BF16 scores with finfo(float32).min: the first probe step ran it in BF16.
    "deberta": "a layer's code raises in its format on a search step: it runs in FP32 there, the format is ruled out for its role",
    # Eval mode turns its cache on, which writes its recurrent state in place after a product saved it.
    "rwkv": "the sensitivity's recorded forward writes a tensor it saved: recorded again with the saved tensors copied",
    # Its custom autograd Function's backward multiplies the FP32 gradient by a value saved in FP16.
    "yoso": "a candidate's backward raises outside every layer: each candidate runs once off-path first, bisected to the value projection",
}


@functools.lru_cache(maxsize=None)
def sampled() -> tuple:
    """The sample, drawn on first use (not at collection, which every test worker runs)."""
    return tuple(arch_sweep.buildable(SAMPLE, SEED))


@pytest.mark.parametrize("index", range(SAMPLE))
def test_a_generated_model_trains_to_a_plan_within_its_budgets_or_is_refused_with_the_reason(index, request):
    case = sampled()[index]
    if case.model_type in KNOWN_FAILURES:
        why, strict = KNOWN_FAILURES[case.model_type]
        request.applymarker(pytest.mark.xfail(reason=why, strict=strict))
    row = arch_sweep.run(case)
    assert row.outcome in ("planned", "refused"), (case.model_type, SEED, row.outcome, row.reason)
    if row.outcome == "refused":
        assert row.reason and "\n" not in row.reason  # one line naming why
    else:
        assert row.memory_ratio is not None and row.memory_ratio <= 0.6, (case.model_type, row.memory_ratio)
        assert row.measured_increase is not None and row.measured_increase <= 0.05, (case.model_type, row.measured_increase)
        assert row.layers > 0 and row.planned_at is not None


@pytest.mark.parametrize("model_type", sorted(FIXED_CLASSES))
def test_a_model_whose_code_fails_in_a_format_trains_to_a_plan_without_it(model_type):
    case = next(c for c in arch_sweep.cases() if c.model_type == model_type)
    row = arch_sweep.run(case)
    assert row.outcome == "planned", (model_type, FIXED_CLASSES[model_type], row.outcome, row.reason)
    assert row.memory_ratio is not None and row.memory_ratio <= 0.6, (model_type, row.memory_ratio)
    assert row.measured_increase is not None and row.measured_increase <= 0.05, (model_type, row.measured_increase)
    assert row.skipped_search_steps == 0  # no step lost to the failing format



def test_a_model_that_skips_layers_at_random_trains_to_a_plan_within_its_budgets():
    """UniSpeech-SAT skips encoder layers at random while training (LayerDrop, ``layerdrop=0.1``).
    The search measures what the loss saves beyond its cost model's forward once, on a safe step;
    layers skipped there made that figure negative (-566,592 bytes), which every candidate's
    measured bytes then carried: each measured 1.3-1.5x its prediction and the search refused
    ("every candidate measured over it (by up to 45.8% more bytes than predicted ...)")."""
    case = next(c for c in arch_sweep.cases() if c.model_type == "unispeech-sat")
    row = arch_sweep.run(case)
    assert row.outcome == "planned", (row.outcome, row.reason)
    assert row.memory_ratio is not None and row.memory_ratio <= 0.6, row.memory_ratio
    assert row.measured_increase is not None and row.measured_increase <= 0.05, row.measured_increase
