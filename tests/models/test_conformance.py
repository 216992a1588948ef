"""The conformance matrix: every model people train (Hugging Face decoders GPT-2, Llama and the
mixture of experts Mixtral, the
encoder BERT, the vision transformer ViT, the encoder-decoder T5, the convolutional ResNet),
through every entry point they train with (the README loop, `AutoprecTrainer`, the Lightning
plugin: 4 micro-batches a step, logging every step, an evaluation loop), at memory budgets of
0.5 and 0.75 of the FP32 bytes and a 5 % accuracy budget, with the scheduler's defaults
otherwise (the spread search, measured costs, recomputation found by itself): trains to the end,
a plan in force, memory and loss within their budgets. The runs are `conformance.run`'s;
`benchmarks/conformance.py` prints the same matrix with step times against FP32 and autocast."""

import functools
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")
from support import conformance  # noqa: E402
from support import hf_models  # noqa: E402

ACCURACY = 0.05
# Optimizer steps per run: the window (6), the search's probe, off-path and trial steps, then
# planned steps with several checks. T5's 39 layers take the search longer (a plan at about step
# 28), and at 0.75 its candidates sit at the memory budget's edge: in one CI run (under load, other
# measured times, other candidates) all three rounds measured 0.7-1.6 % over, the search failed at
# step 52 and searches again a window later (step 58), which then needs about 30 steps to plan.
STEPS = {"t5": 100}
CELLS = [(name, entry, memory) for name in hf_models.MODELS for entry in conformance.ENTRIES for memory in (0.5, 0.75)]


@functools.lru_cache(maxsize=None)
def outcome(name: str, entry: str, memory: float, tmp_root: str) -> conformance.Outcome:
    return conformance.run(name, entry, memory, ACCURACY, STEPS.get(name, 40), f"{tmp_root}/{name}-{entry}-{memory}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("conformance"))


def ids(cell):
    return "-".join(map(str, cell))


@pytest.mark.parametrize("cell", CELLS, ids=ids)
def test_trains_to_the_end_with_a_plan_in_force(cell, root):
    o = outcome(*cell, root)
    assert o.error is None and o.phase == "planned", (o.phase, o.error)
    assert o.steps == STEPS.get(o.model, 40) and all(math.isfinite(loss) for loss in o.losses)
    quarter = max(1, len(o.losses) // 4)
    assert sum(o.losses[-quarter:]) < sum(o.losses[:quarter])  # it learned
    # Evaluation ran while the plan was in force, and during the search, with a finite loss.
    assert {"searching", "planned"} <= {phase for phase, _ in o.eval_losses} and all(math.isfinite(loss) for _, loss in o.eval_losses)


@pytest.mark.parametrize("cell", CELLS, ids=ids)
def test_a_planned_step_keeps_to_the_memory_budget(cell, root):
    """Metered, not predicted: a planned step's saved bytes plus the gradient buffers against an
    FP32 step's, on the same batch and weights."""
    o = outcome(*cell, root)
    assert o.phase == "planned"
    assert o.memory_ratio <= o.memory_budget, (o.memory_ratio, o.formats, o.recompute)


@pytest.mark.parametrize("cell", CELLS, ids=ids)
def test_the_plans_measured_loss_increase_keeps_to_the_accuracy_budget(cell, root):
    """The last planned check's measured increase (the plan's loss against the window's precision
    on the same batches, averaged since the plan last changed)."""
    o = outcome(*cell, root)
    assert o.measured_increase is not None and o.allowed_increase == pytest.approx(ACCURACY)
    assert o.measured_increase <= o.allowed_increase
