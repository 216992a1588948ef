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
    "deberta": ("its attention fills BF16 scores with finfo(float32).min (q + q_bias is FP32), so plain torch.autocast fails too; "
                "the sensitivity estimate rules (attention, bf16) out, but the first probe step (search step 0) runs it before the "
                "estimate has: rerun a layer that raises on a search runtime's step in FP32 and rule the pair out, or probe a "
                "format only once the estimate has cleared it", True),
    "rwkv": ("the sensitivity estimate's recorded forward runs in eval mode (no dropout), where RWKV turns its cache on "
             "(use_cache defaults to the config's outside training) and writes its recurrent state in place, so the estimate's "
             "backward finds a [4, 32] state slice modified: record in train mode with the dropout masks drawn from one seed "
             "and BatchNorm's running statistics restored after, or keep such a model's recorded call at use_cache=False", True),
    "longt5": ("every lowered candidate's gradients go NaN in the first encoder block's local attention with a finite loss, "
               "in steps run without loss scaling (the scaler is off while searching); retrying (SKIPPED_TRIAL_STEPS) and "
               "promoting the last layer with NaN gradients (TRIAL_PROMOTIONS) do not reach it: the NaN starts in an op "
               "outside the layers; find it with the backward's anomaly mode and keep its region out of half formats", False),
    "inkling_text": ("its candidates' forwards overflow: with the layers the scaler named promoted to FP32 one plans on some "
                     "runs (the candidates hang on measured times), on others three promotions are not enough: as longt5", False),
    "yoso": ("its custom autograd Function's backward multiplies the FP32 incoming gradient by a saved half value "
             "(torch.matmul(grad, value.T)), an op outside every layer, so the per-layer estimate never sees it fail; the first "
             "trial (search step 10) puts the value projection in FP16 and its backward raises: run each candidate once off-path "
             "(forward and backward on the snapshot) and bisect a failing one to the layer that breaks it", True),
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
