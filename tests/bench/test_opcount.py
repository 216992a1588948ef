"""`autoprec.opcount` (op and host-sync counting, graph breaks) and `autoprec bench --suite ops`.

Expected counts are built from the ops each test calls, never from a snapshot of a run. The ops
suite runs once, with the cheapest settings that still exercise every variant ("eager" backend,
1 warmup step, INT8 calibrating on 2 forwards).
"""

import collections
import json

import pytest
import torch

from autoprec.bench import OPS_COMPILE_VARIANTS, OPS_STEP_VARIANTS, BenchConfigError, OpsBenchConfig, run_ops_bench
from autoprec.cli import main
from autoprec.opcount import OpCounter, OpCountError, count_training_step, graph_breaks, max_abs_diff

aten = torch.ops.aten


@pytest.fixture
def t():
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def test_counts_each_called_overload_by_name(t):
    calls = [(aten.add.Tensor, (t, t)), (aten.mm.default, (t, t)), (aten.mm.default, (t, t)), (aten.relu.default, (t,)), (aten.sum.dim_IntList, (t, [0]))]
    expected = collections.Counter(str(op) for op, _ in calls)
    with OpCounter() as counter:
        for op, args in calls:
            op(*args)
    assert counter.counts().ops == dict(expected)


def test_total_is_the_number_of_calls(t):
    with OpCounter() as counter:
        for _ in range(7):
            torch.mm(t, t)
    assert counter.counts().total == 7


def test_backward_ops_are_counted(t):
    x = t.clone().requires_grad_()
    y = x.exp()
    with OpCounter() as counter:
        y.sum().backward()
    # d exp(x) = exp(x) * grad (torch's derivatives.yaml): backward runs a mul.
    assert counter.counts().ops.get("aten.mul.Tensor", 0) >= 1


def test_plain_ops_are_not_syncs(t):
    with OpCounter() as counter:
        torch.mm(t, t).relu().sum()
    assert counter.counts().sync_total == 0


def test_item_is_a_sync(t):
    with OpCounter() as counter:
        for _ in range(3):
            t.sum().item()
    assert counter.counts().syncs == {"aten._local_scalar_dense.default": 3}


def test_bool_of_a_tensor_is_a_sync(t):
    with OpCounter() as counter:
        bool(t[0, 0] > 0)
    assert counter.counts().sync_total == 1


def test_nonzero_is_a_sync(t):
    with OpCounter() as counter:
        t.nonzero()
    assert counter.counts().syncs == {"aten.nonzero.default": 1}


def test_boolean_mask_indexing_is_a_sync(t):
    mask = t > 0
    with OpCounter() as counter:
        t[mask]
    assert counter.counts().syncs == {"aten.index.Tensor": 1}


def test_integer_indexing_is_not_a_sync(t):
    index = torch.tensor([0, 2, 5])
    with OpCounter() as counter:
        t[index]
    assert counter.counts().sync_total == 0


def test_masked_fill_by_assignment_of_a_host_scalar_is_not_a_sync(t):
    # ATen turns x[mask] = scalar into masked_fill_: no nonzero, no device read.
    mask = t > 0
    with OpCounter() as counter:
        t[mask] = 0.0
    assert counter.counts().sync_total == 0


def test_mask_assignment_of_a_tensor_is_a_sync(t):
    mask = t > 0
    values = torch.zeros(int(mask.sum()))
    with OpCounter() as counter:
        t[mask] = values
    assert counter.counts().syncs == {"aten.index_put_.default": 1}


def test_count_training_step_counts_only_the_last_call(t):
    calls = []

    def fn():
        calls.append(1)
        torch.mm(t, t)
        torch.mm(t, t)

    counts = count_training_step(fn, warmup=3)
    assert (len(calls), counts.ops) == (4, {"aten.mm.default": 2})


def test_count_training_step_rejects_a_negative_warmup():
    with pytest.raises(OpCountError, match="warmup"):
        count_training_step(lambda: None, warmup=-1)


def test_graph_breaks_of_a_whole_graph_is_zero(t):
    breaks = graph_breaks(lambda x: torch.relu(x @ x).sum(), t)
    assert (breaks.graphs, breaks.breaks, breaks.reasons) == (1, 0, ())


def test_graph_breaks_counts_a_forced_break(t):
    def fn(x):
        y = torch.relu(x @ x)
        torch._dynamo.graph_break()
        return y.sum()

    breaks = graph_breaks(fn, t)
    assert (breaks.graphs, breaks.breaks, len(breaks.reasons)) == (2, 1, 1)


def test_max_abs_diff_matches_plain_torch(t):
    other = t + torch.linspace(0, 0.5, 64).reshape(8, 8)
    expected = (t - other).abs().max().item()
    assert max_abs_diff([t, t], [other, t]) == pytest.approx(expected)


# -- the ops suite --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ops_json(tmp_path_factory):
    config = OpsBenchConfig(warmup=1, calibration_batches=2, compile_backend="eager", device="cpu")
    path = run_ops_bench(config).save(tmp_path_factory.mktemp("ops") / "ops.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_ops_json_has_a_steady_row_for_every_variant(ops_json):
    assert {r["variant"] for r in ops_json["rows"] if r["step"] == "steady"} == set(OPS_STEP_VARIANTS)


@pytest.mark.slow
def test_ops_json_has_the_int8_calibration_steps(ops_json):
    assert [r["step"] for r in ops_json["rows"] if r["variant"] == "plan:int8"] == ["calibrating", "freeze", "steady"]


@pytest.mark.slow
def test_ops_json_has_a_compile_row_for_every_variant(ops_json):
    assert [r["variant"] for r in ops_json["compile"]] == list(OPS_COMPILE_VARIANTS)


@pytest.mark.slow
def test_ops_json_plain_step_counts_match_a_direct_count(ops_json):
    torch.manual_seed(ops_json["config"]["seed"])
    layer = torch.nn.Linear(256, 512)
    x = torch.randn(64, 256)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    plain = next(r for r in ops_json["rows"] if r["variant"] == "plain")
    assert plain["op_counts"] == count_training_step(step, warmup=1).ops


def test_ops_config_rejects_one_calibration_batch():
    with pytest.raises(BenchConfigError, match="calibration_batches"):
        OpsBenchConfig(calibration_batches=1)


def test_cli_ops_suite_rejects_models_only_flags(capsys):
    assert main(["bench", "--suite", "ops", "--steps", "3"]) == 2
    assert "--steps" in capsys.readouterr().err
