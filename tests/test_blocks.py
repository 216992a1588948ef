"""Recompute units (issue 24): `find_blocks`, the Plan's per-block recompute flags (schema 2), and
the ``recompute`` patterns of job files and the scheduler."""

import copy
import json
import pickle

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.errors import PlanError, SearchError, SettingsError
from autoprec.plan import SCHEMA_VERSION
from autoprec.job.config import load_job
from autoprec.search.space import LayerRules
from autoprec.workloads.bytelm import ByteLM, LMConfig

TINY = LMConfig(context=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return ByteLM(TINY)


@pytest.fixture(scope="module")
def plan(lm):
    return ap.Plan.uniform(lm, "bf16")


# -- find_blocks ------------------------------------------------------------------------------


def test_the_built_in_lms_transformer_blocks_are_its_blocks(lm, plan):
    assert ap.find_blocks(lm, plan.layers) == ("blocks.0", "blocks.1")


def test_hugging_face_bert_layers_are_found_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64)
    model = transformers.BertForSequenceClassification(cfg)
    layers = ap.Plan.uniform(model, "bf16").layers
    assert ap.find_blocks(model, layers) == ("bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2")


def test_torchtitans_blocks_in_a_module_dict_are_found_and_keep_their_names_in_a_pipeline_stage():
    """torchtitan keeps a Llama's blocks in an ``nn.ModuleDict`` (a pipeline split deletes some
    and the rest keep their names): before, no block was found there, so its models were never
    searched for recomputation."""
    from support.titan_llama import pipeline_stage, titan_llama, token_batch

    model = titan_llama()
    layers = ap.Plan.uniform(model, "bf16", (token_batch(0)[0],)).layers
    assert ap.find_blocks(model, layers) == ("layers.0", "layers.1", "layers.2", "layers.3")
    stage = pipeline_stage(model, 1, 2)
    assert ap.find_blocks(stage, [fqn for fqn in layers if fqn.startswith(("layers.2.", "layers.3."))]) == ("layers.2", "layers.3")


def test_a_sequential_of_single_layers_has_no_block():
    """Recomputing one linear layer saves nothing: its own input is all it keeps."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert ap.find_blocks(model, ap.Plan.uniform(model, "bf16").layers) == ()


def test_blocks_without_a_planned_layer_are_left_out(lm):
    only_second = [fqn for fqn in ap.Plan.uniform(lm, "bf16").layers if fqn.startswith("blocks.1.")]
    assert ap.find_blocks(lm, only_second) == ("blocks.1",)


def test_patterns_name_the_outermost_matching_modules(lm, plan):
    # fnmatch's * crosses dots: "blocks.*" also matches blocks.0.attn, which lies inside blocks.0.
    assert ap.find_blocks(lm, plan.layers, ["blocks.*"]) == ("blocks.0", "blocks.1")
    assert ap.find_blocks(lm, plan.layers, ["blocks.1.mlp"]) == ("blocks.1.mlp",)


@pytest.mark.parametrize(
    "pattern, why",
    [("decoder.*", "matches no module"), ("blocks.*.ln1", "matches only modules without a layer"),
     # A layer is no block (issue 59: once accepted, and the plan made of it refused by Plan.validate).
     ("blocks.*.mlp.proj", "matches layers ('blocks.0.mlp.proj', 'blocks.1.mlp.proj'), not blocks")],
)
def test_a_pattern_that_names_no_block_is_refused_in_one_line(lm, plan, pattern, why):
    with pytest.raises(SearchError) as info:
        ap.find_blocks(lm, plan.layers, [pattern])
    message = str(info.value)
    assert "\n" not in message and repr(pattern) in message and why in message and "e.g." in message


# -- the plan ---------------------------------------------------------------------------------


def test_with_recompute_sets_flags_and_plans_stay_immutable(plan):
    recomputed = plan.with_recompute(["blocks.0", "blocks.1"])
    assert plan.blocks == {} and plan.recompute == ()
    assert recomputed.recompute == ("blocks.0", "blocks.1")
    # A mapping sets the named flags and keeps the others: what a solver choosing per block calls.
    one = recomputed.with_recompute({"blocks.1": False})
    assert dict(one.blocks) == {"blocks.0": True, "blocks.1": False} and one.recompute == ("blocks.0",)
    assert one != recomputed and one.with_layers({"lm_head": "fp32"}).blocks == one.blocks
    with pytest.raises(TypeError):
        one.blocks["blocks.0"] = False


def test_a_plan_with_blocks_round_trips_through_json_pickle_and_copy(plan, tmp_path):
    recomputed = plan.with_recompute({"blocks.0": True, "blocks.1": False})
    path = recomputed.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 4
    assert data["blocks"] == {"blocks.0": {"recompute": True}, "blocks.1": {"recompute": False}}
    assert ap.Plan.load(path) == recomputed
    assert pickle.loads(pickle.dumps(recomputed)) == recomputed
    assert copy.deepcopy(recomputed) == recomputed


def test_a_version_1_plan_loads_with_no_block_recomputed(plan, tmp_path):
    data = plan.to_dict()
    data["schema_version"] = 1
    del data["blocks"], data["comm"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    loaded = ap.Plan.load(path)
    assert loaded.blocks == {} and loaded.layers == plan.layers


def test_version_1_has_no_blocks_key(plan, tmp_path):
    data = dict(plan.with_recompute(["blocks.0"]).to_dict(), schema_version=1)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="unknown top-level key 'blocks'"):
        ap.Plan.load(path)


@pytest.mark.parametrize("entry", [True, {"recompute": "yes"}, {"recompute": True, "bytes": 1}])
def test_a_malformed_block_entry_is_named(plan, tmp_path, entry):
    data = plan.to_dict()
    data["blocks"] = {"blocks.0": entry}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"blocks\['blocks.0'\]: expected \{\"recompute\": true\}"):
        ap.Plan.load(path)


def test_nested_blocks_are_refused(plan):
    with pytest.raises(PlanError, match=r"blocks\['blocks.0.mlp'\]: lies inside block 'blocks.0'"):
        plan.with_recompute(["blocks.0", "blocks.0.mlp"])


def test_a_single_name_string_is_refused_with_the_fix(plan):
    with pytest.raises(PlanError, match=r"wrap one name in a list: \['blocks.0'\]"):
        plan.with_recompute("blocks.0")


@pytest.mark.parametrize(
    "block, message",
    [
        ("blocks.7", "the plan names a block the model lacks"),
        ("blocks.0.ln1", "LayerNorm holds no layer of the plan"),
        ("blocks.0.attn.qkv", "a layer, not a block"),
    ],
)
def test_validate_names_a_block_that_does_not_fit_the_model(lm, plan, block, message):
    bad = plan.with_recompute([block])
    with pytest.raises(PlanError) as info:
        bad.validate(lm)
    assert f"blocks[{block!r}]: {message}" in str(info.value)


def test_validate_accepts_the_found_blocks(lm, plan):
    plan.with_recompute(ap.find_blocks(lm, plan.layers)).validate(lm)  # raises on any problem


# -- settings: [rules].recompute and the scheduler's recompute= --------------------------------


def _job(tmp_path, rules: str):
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nname = "t"\n[workload]\nfactory = "autoprec.workloads.bytelm:default_workload"\n[rules]\n{rules}\n')
    return path


def test_a_job_files_recompute_patterns_reach_the_rules(tmp_path):
    assert load_job(_job(tmp_path, 'recompute = ["blocks.*"]')).rules.recompute == ("blocks.*",)
    assert load_job(_job(tmp_path, "")).rules.recompute is None  # absent: the blocks found automatically


@pytest.mark.parametrize("value", ['"blocks.*"', "[1]", '[""]'])
def test_a_bad_recompute_rule_is_one_line_naming_the_key(tmp_path, value):
    with pytest.raises(SearchError) as info:
        load_job(_job(tmp_path, f"recompute = {value}"))
    message = str(info.value)
    assert "\n" not in message and "[rules].recompute: expected a list of module name patterns" in message


def test_layer_rules_and_the_scheduler_refuse_a_bare_string():
    with pytest.raises(SearchError, match=r"LayerRules\(recompute=...\): expected a list"):
        LayerRules(recompute="blocks.*")
    with pytest.raises(SettingsError, match=r"DynamicPrecisionScheduler\(recompute='blocks.\*'\): expected a list"):
        ap.DynamicPrecisionScheduler(recompute="blocks.*")
    assert ap.DynamicPrecisionScheduler(recompute=["blocks.*"]).config.recompute == ("blocks.*",)


def test_the_scheduler_checks_its_patterns_against_the_model_when_it_binds():
    torch.manual_seed(0)
    model = ByteLM(TINY)
    scheduler = ap.DynamicPrecisionScheduler(recompute=["decoder.*"], monitor_window=4)
    idx = torch.randint(0, 256, (2, 16))
    with pytest.raises(SettingsError) as info:
        with scheduler.precision_context():
            model(idx)
    message = str(info.value)
    assert "\n" not in message and message.startswith("DynamicPrecisionScheduler(recompute=['decoder.*']): recompute pattern 'decoder.*'")
