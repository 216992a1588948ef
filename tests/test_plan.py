"""Tests for the immutable, versioned `Plan` (autoprec/plan.py)."""

import copy
import dataclasses
import json
import os
import pickle
import sys

import pytest
import torch
import torch.nn as nn

import autoprec.plan as plan_module
from autoprec import Calibration, CalibrationMethod, Format, Granularity, LayerPrecision, Plan, PlanError, Reduction, Scaling, ScalingMode
from autoprec.coverage import LayerInfo
from autoprec.device import Support
from autoprec.errors import SettingsError
from autoprec.plan import SCHEMA_VERSION
from support.models import WithProjection

# --- models -----------------------------------------------------------------------------------


class TwoLinear(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.conv(x).mean(dim=(2, 3)))


def rich_plan() -> Plan:
    """A plan using every non-default field."""
    return Plan(
        {
            "fc1": LayerPrecision(
                Format.FP8_E4M3,
                grad_format=Format.FP32,
                scaling=Scaling(granularity=Granularity.ROW, mode=ScalingMode.CURRENT, history_len=4, reduction="most_recent", margin=2),
                reason="searched",
            ),
            "fc2": LayerPrecision(
                Format.INT8,
                calibration=Calibration(method=CalibrationMethod.MSE, percentile=99.5, batches=8, outlier_ratio=None),
                reason="calibrated",
            ),
        },
        fingerprint={"fc1": LayerInfo("Linear", ("linear",), {"weight": (16, 8), "bias": (16,)})},
        budgets={"memory": 0.5, "accuracy": 0.01},
        predicted={"bytes": 1234, "loss_increase": 0.003, "per_layer": {"fc1": [1, 2]}},
        measured={"seconds": 1.5},
        metadata={"source": "test", "tags": ["a", "b"]},
    )


def plan_dict(**layers) -> dict:
    """A minimal valid plan file's content with the given layer entries."""
    return {"schema_version": SCHEMA_VERSION, "layers": layers or {"fc1": {"format": "bf16"}, "fc2": {"format": "bf16"}}}


def write_json(tmp_path, data, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def load_error(path) -> PlanError:
    """The error loading ``path`` raises; checks it is a `PlanError` and a `ValueError`."""
    with pytest.raises(ValueError) as info:
        Plan.load(path)
    assert isinstance(info.value, PlanError), f"not a PlanError: {info.value!r}"
    return info.value


def validate_error(plan: Plan, model: nn.Module, *args, **kwargs) -> PlanError:
    with pytest.raises(ValueError) as info:
        plan.validate(model, *args, **kwargs)
    assert isinstance(info.value, PlanError), f"not a PlanError: {info.value!r}"
    return info.value


def set_support(monkeypatch, support: Support):
    monkeypatch.setattr(plan_module, "format_support", lambda fmt, device=None: support)


# --- uniform ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(Format))
def test_uniform_puts_every_layer_in_the_format(fmt):
    plan = Plan.uniform(TwoLinear(), fmt)
    assert {fqn: lp.format for fqn, lp in plan.layers.items()} == {"fc1": fmt, "fc2": fmt}


def test_uniform_accepts_a_format_name_in_any_case():
    assert Plan.uniform(TwoLinear(), "BF16") == Plan.uniform(TwoLinear(), Format.BF16)


def test_uniform_fp8_computes_gradients_in_e5m2():
    plan = Plan.uniform(TwoLinear(), Format.FP8_E4M3)
    assert plan["fc1"].grad_format is Format.FP8_E5M2


def test_uniform_non_fp8_gradients_use_the_layer_format():
    assert Plan.uniform(TwoLinear(), Format.FP16)["fc1"].grad_format is Format.FP16


def test_uniform_module_filter_keeps_rejected_layers_fp32_with_a_reason():
    plan = Plan.uniform(TwoLinear(), Format.BF16, module_filter=lambda module, fqn: fqn != "fc2")
    assert (plan["fc2"].format, plan["fc2"].reason) == (Format.FP32, "kept FP32 by module_filter")


def test_uniform_module_filter_leaves_accepted_layers_in_the_format():
    plan = Plan.uniform(TwoLinear(), Format.BF16, module_filter=lambda module, fqn: fqn != "fc2")
    assert plan["fc1"].format is Format.BF16


def test_uniform_module_filter_gets_module_and_fqn():
    model = TwoLinear()
    calls = []
    Plan.uniform(model, Format.BF16, module_filter=lambda module, fqn: calls.append((module, fqn)) or True)
    assert calls == [(model.fc1, "fc1"), (model.fc2, "fc2")]


def test_uniform_applies_scaling_and_calibration_to_every_layer():
    scaling = Scaling(granularity=Granularity.ROW, mode=ScalingMode.CURRENT)
    calibration = Calibration(batches=2)
    plan = Plan.uniform(TwoLinear(), Format.INT8, scaling=scaling, calibration=calibration)
    assert all((lp.scaling, lp.calibration) == (scaling, calibration) for lp in plan.layers.values())


def test_uniform_fingerprints_parameter_shapes():
    plan = Plan.uniform(TwoLinear(hidden=5), Format.BF16)
    assert dict(plan.fingerprint["fc1"].params) == {"weight": (5, 8), "bias": (5,)}


def test_uniform_from_the_module_tree_covers_the_addmm_projection():
    assert list(Plan.uniform(WithProjection(), Format.BF16).layers) == ["fc", "proj"]


def test_uniform_with_example_input_covers_the_addmm_projection():
    plan = Plan.uniform(WithProjection(), Format.BF16, torch.randn(2, 8))
    assert list(plan.layers) == ["fc", "proj"]


def test_uniform_with_delayed_row_fp8_scaling_names_the_argument_once():
    with pytest.raises(PlanError, match=r"^Plan.uniform\('fp8_e4m3', \.\.\.\): LayerPrecision\('fp8_e4m3'\)\.scaling: delayed scaling") as info:
        Plan.uniform(TwoLinear(), Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.ROW, mode="delayed"))
    assert "\n" not in str(info.value)


def test_uniform_with_unknown_format_lists_the_valid_ones():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        Plan.uniform(TwoLinear(), "fp7")


# --- immutability -----------------------------------------------------------------------------


def test_assigning_an_attribute_raises():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(AttributeError, match="immutable"):
        plan.budgets = {}


def test_adding_an_attribute_raises():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(AttributeError):
        plan.extra = 1


def test_deleting_an_attribute_raises():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(AttributeError, match="immutable"):
        del plan.budgets


def test_layers_mapping_is_read_only():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(TypeError):
        plan.layers["fc1"] = LayerPrecision(Format.FP32)


def test_metadata_mapping_is_read_only():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(TypeError):
        plan.metadata["source"] = "edited"


def test_layer_precision_is_frozen():
    lp = LayerPrecision(Format.BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lp.format = Format.FP32


def test_mutating_the_source_dict_does_not_change_the_plan():
    layers = {"fc1": LayerPrecision(Format.BF16)}
    plan = Plan(layers)
    layers["fc2"] = LayerPrecision(Format.BF16)
    assert list(plan.layers) == ["fc1"]


def test_mutating_the_source_budgets_does_not_change_the_plan():
    budgets = {"memory": 0.5}
    plan = Plan({"fc1": "bf16"}, budgets=budgets)
    budgets["memory"] = 0.9
    assert plan.budgets["memory"] == 0.5


# --- equality ---------------------------------------------------------------------------------


def test_plans_built_the_same_way_are_equal():
    assert Plan.uniform(TwoLinear(), Format.BF16) == Plan.uniform(TwoLinear(), Format.BF16)


def test_equal_plans_hash_equal():
    assert hash(Plan.uniform(TwoLinear(), Format.BF16)) == hash(Plan.uniform(TwoLinear(), Format.BF16))


def test_plans_with_different_formats_differ():
    assert Plan.uniform(TwoLinear(), Format.BF16) != Plan.uniform(TwoLinear(), Format.FP16)


def test_plans_with_different_scaling_differ():
    base = rich_plan()
    other = base.with_layers({"fc1": dataclasses.replace(base["fc1"], scaling=dataclasses.replace(base["fc1"].scaling, margin=3))})
    assert base != other


def test_plans_with_different_metadata_differ():
    base = rich_plan()
    assert base != base.replace(metadata={"source": "other"})


def test_a_plan_never_equals_its_dict():
    plan = rich_plan()
    assert plan != plan.to_dict()


def test_repr_counts_formats():
    assert repr(Plan.uniform(TwoLinear(), Format.BF16)) == "Plan(2 layers: bf16=2)"


# --- JSON round trip --------------------------------------------------------------------------


def test_uniform_plan_round_trips_through_a_file(tmp_path):
    plan = Plan.uniform(TwoLinear(), Format.FP8_E4M3)
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan


def test_plan_with_every_field_round_trips_through_a_file(tmp_path):
    plan = rich_plan()
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan


def test_round_trip_keeps_non_default_scaling(tmp_path):
    plan = rich_plan()
    assert Plan.load(plan.save(tmp_path / "plan.json"))["fc1"].scaling == plan["fc1"].scaling


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_a_reduction_is_held_as_its_enum_and_saved_as_its_string(tmp_path, reduction):
    scaling = Scaling(mode="delayed", reduction=reduction)
    assert scaling.reduction is Reduction(reduction) and scaling == Scaling(mode="delayed", reduction=Reduction(reduction))
    path = Plan({"fc1": LayerPrecision("fp8_e4m3", scaling=scaling)}).save(tmp_path / "plan.json")
    saved = json.loads(path.read_text())
    assert saved["layers"]["fc1"]["scaling"]["reduction"] == reduction  # the plan file's string, as before the enum
    assert Plan.load(path)["fc1"].scaling.reduction is Reduction(reduction)
    assert json.loads(Plan.load(path).save(tmp_path / "again.json").read_text()) == saved


def test_round_trip_keeps_non_default_calibration(tmp_path):
    plan = rich_plan()
    assert Plan.load(plan.save(tmp_path / "plan.json"))["fc2"].calibration == plan["fc2"].calibration


def test_round_trip_keeps_the_fingerprint_of_a_traced_layer(tmp_path):
    plan = Plan.uniform(WithProjection(), Format.BF16, torch.randn(2, 8))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.fingerprint["proj"] == LayerInfo("AddmmProjection", ("addmm",), {"weight": (6, 3), "bias": (3,)})


def test_round_trip_keeps_layer_order(tmp_path):
    plan = Plan({"b": "bf16", "a": "fp16", "c": "fp32"})
    assert list(Plan.load(plan.save(tmp_path / "plan.json")).layers) == ["b", "a", "c"]


def test_saved_file_is_versioned_json(tmp_path):
    path = rich_plan().save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_save_creates_missing_parent_directories(tmp_path):
    path = rich_plan().save(tmp_path / "a" / "b" / "plan.json")
    assert path.is_file()


def test_save_accepts_a_string_path(tmp_path):
    assert Plan.load(rich_plan().save(str(tmp_path / "plan.json"))) == rich_plan()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")
def test_saved_file_is_readable_like_any_other_written_file(tmp_path):
    # An atomic write through a 0600 temporary file would leave a plan others cannot read.
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    path = rich_plan().save(tmp_path / "plan.json")
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


def test_load_accepts_format_names_in_any_case(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "BF16"}, fc2={"format": "Fp8_E4m3", "grad_format": "FP8_E5M2"}))
    assert Plan.load(path) == Plan({"fc1": "bf16", "fc2": "fp8_e4m3"})


def test_load_accepts_a_format_name_as_a_layer_entry(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1="int8"))
    assert Plan.load(path)["fc1"] == LayerPrecision(Format.INT8)


def test_load_fills_defaults_for_missing_scaling_and_calibration(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3"}))
    assert Plan.load(path)["fc1"] == LayerPrecision(Format.FP8_E4M3, Format.FP8_E5M2, Scaling(), Calibration())


def test_plan_survives_pickle():
    plan = rich_plan()
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_plan_survives_deepcopy():
    plan = rich_plan()
    assert copy.deepcopy(plan) == plan


# --- atomic save ------------------------------------------------------------------------------


def test_save_leaves_no_temporary_files(tmp_path):
    rich_plan().save(tmp_path / "plan.json")
    rich_plan().replace(metadata={"v": 2}).save(tmp_path / "plan.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_save_overwrites_the_previous_plan(tmp_path):
    path = tmp_path / "plan.json"
    Plan.uniform(TwoLinear(), Format.BF16).save(path)
    Plan.uniform(TwoLinear(), Format.FP16).save(path)
    assert Plan.load(path) == Plan.uniform(TwoLinear(), Format.FP16)


def _boom(*args, **kwargs):
    raise OSError("disk full")


# Each target fails at a different stage: before anything is written, after the temporary file
# holds the text (fsync), and at the final rename.
FAILURE_POINTS = [(json, "dumps"), (os, "fsync"), (os, "replace")]


@pytest.mark.parametrize("target, name", FAILURE_POINTS, ids=["json.dumps", "os.fsync", "os.replace"])
def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch, target, name):
    path = tmp_path / "plan.json"
    Plan.uniform(TwoLinear(), Format.BF16).save(path)
    before = path.read_bytes()
    new = Plan.uniform(TwoLinear(), Format.FP16)
    monkeypatch.setattr(target, name, _boom)
    with pytest.raises(OSError):
        new.save(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("target, name", FAILURE_POINTS, ids=["json.dumps", "os.fsync", "os.replace"])
def test_failed_save_leaves_no_temporary_files(tmp_path, monkeypatch, target, name):
    path = tmp_path / "plan.json"
    Plan.uniform(TwoLinear(), Format.BF16).save(path)
    new = Plan.uniform(TwoLinear(), Format.FP16)
    monkeypatch.setattr(target, name, _boom)
    with pytest.raises(OSError):
        new.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_failed_first_save_creates_no_file(tmp_path, monkeypatch):
    plan = rich_plan()
    monkeypatch.setattr(os, "replace", _boom)
    with pytest.raises(OSError):
        plan.save(tmp_path / "plan.json")
    assert list(tmp_path.iterdir()) == []


# --- with_layers / replace --------------------------------------------------------------------


def test_with_layers_changes_only_the_named_layer():
    plan = Plan.uniform(TwoLinear(), Format.BF16).with_layers({"fc2": Format.FP32})
    assert plan.format_counts() == {"bf16": 1, "fp32": 1}


def test_with_layers_leaves_the_original_unchanged():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    plan.with_layers({"fc2": Format.FP32})
    assert plan["fc2"].format is Format.BF16


def test_with_layers_takes_a_full_layer_precision():
    lp = LayerPrecision(Format.INT8, calibration=Calibration(batches=2), reason="manual")
    assert Plan.uniform(TwoLinear(), Format.BF16).with_layers({"fc1": lp})["fc1"] == lp


def test_with_layers_format_name_keeps_no_other_setting():
    plan = Plan.uniform(TwoLinear(), Format.INT8, calibration=Calibration(batches=2)).with_layers({"fc1": "INT8"})
    assert plan["fc1"] == LayerPrecision(Format.INT8)


def test_with_layers_keeps_fingerprint_and_metadata():
    plan = rich_plan()
    changed = plan.with_layers({"fc2": "bf16"})
    assert (changed.fingerprint, changed.metadata) == (plan.fingerprint, plan.metadata)


def test_with_layers_names_every_unknown_layer():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(PlanError) as info:
        plan.with_layers({"nope": "bf16", "fc1": "fp16", "gone": "bf16"})
    assert "'nope'" in str(info.value) and "'gone'" in str(info.value)


def test_with_layers_unknown_format_is_a_plan_error_naming_the_layer():
    plan = Plan.uniform(TwoLinear(), Format.BF16)
    with pytest.raises(PlanError, match="fc2"):
        plan.with_layers({"fc2": "fp7"})


def test_replace_changes_the_named_field():
    assert rich_plan().replace(budgets={"memory": 0.25}).budgets == {"memory": 0.25}


def test_replace_keeps_the_other_fields():
    plan = rich_plan()
    assert plan.replace(budgets={}).layers == plan.layers


def test_replace_rejects_unknown_fields():
    plan = rich_plan()
    with pytest.raises(TypeError, match="colour"):
        plan.replace(colour="red")


def test_replace_checks_the_new_layers():
    plan = rich_plan()
    with pytest.raises(PlanError, match=r"layers\['fc1'\]\.calibration\.percentile"):
        plan.replace(layers={"fc1": {"format": "int8", "calibration": {"percentile": 0}}})


def test_a_calibration_out_of_range_is_refused_when_made_naming_the_field():
    with pytest.raises(SettingsError, match=r"^Calibration\(percentile=0\): expected a percentile in \(0, 100\]$"):
        Calibration(percentile=0)


# --- PlanError: the class ---------------------------------------------------------------------


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


def test_plan_error_lists_each_problem():
    error = PlanError(["first", "second"], "do this")
    assert (error.problems, str(error)) == (["first", "second"], "invalid plan (2 problems):\n  - first\n  - second\ndo this")


# --- PlanError: malformed files ---------------------------------------------------------------


def test_malformed_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{\n  "schema_version": 1,\n  "layers": {,}\n}\n')
    message = str(load_error(path))
    assert str(path) in message and "line 3" in message


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "absent.json"
    message = str(load_error(path))
    assert str(path) in message and "no such plan file" in message


def test_directory_instead_of_file_names_it(tmp_path):
    assert str(tmp_path) in str(load_error(tmp_path))


def test_binary_file_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\x00\x01 not text")
    assert str(path) in str(load_error(path))


@pytest.mark.parametrize("top", [[], "plan", 3, None], ids=["list", "string", "number", "null"])
def test_non_object_top_level_is_rejected(tmp_path, top):
    assert "top level" in str(load_error(write_json(tmp_path, top)))


def test_missing_schema_version_is_rejected(tmp_path):
    data = plan_dict()
    del data["schema_version"]
    assert "no 'schema_version'; this is not an autoprec plan" in str(load_error(write_json(tmp_path, data)))


def test_newer_schema_version_says_upgrade(tmp_path):
    data = dict(plan_dict(), schema_version=SCHEMA_VERSION + 1)
    assert "upgrade autoprec" in str(load_error(write_json(tmp_path, data)))


@pytest.mark.parametrize("version", [0, "1", 1.5], ids=["zero", "string", "float"])
def test_invalid_schema_version_is_rejected(tmp_path, version):
    data = dict(plan_dict(), schema_version=version)
    assert repr(version) in str(load_error(write_json(tmp_path, data)))


def test_unknown_top_level_keys_are_all_named(tmp_path):
    data = dict(plan_dict(), colour="red", notes=[])
    message = str(load_error(write_json(tmp_path, data)))
    assert "'colour'" in message and "'notes'" in message


def test_empty_layers_are_rejected(tmp_path):
    data = dict(plan_dict(), layers={})
    assert "'layers' must be a non-empty object" in str(load_error(write_json(tmp_path, data)))


def test_missing_layers_are_rejected(tmp_path):
    data = plan_dict()
    del data["layers"]
    assert "'layers'" in str(load_error(write_json(tmp_path, data)))


def test_layers_as_a_list_are_rejected(tmp_path):
    data = dict(plan_dict(), layers=["fc1", "fc2"])
    assert "'layers'" in str(load_error(write_json(tmp_path, data)))


def test_layer_problems_name_the_file(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp7"}))
    assert f"{path}: layers['fc1'].format" in str(load_error(path))


def test_unknown_formats_are_all_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp7"}, fc2={"format": "bf16"}, fc3={"format": "float4"}))
    error = load_error(path)
    assert [p.split(": ")[1] for p in error.problems] == ["layers['fc1'].format", "layers['fc3'].format"]


def test_unknown_format_message_lists_the_valid_formats(tmp_path):
    message = str(load_error(write_json(tmp_path, plan_dict(fc1={"format": "fp7"}))))
    assert all(f.value in message for f in Format)


def test_unknown_grad_format_is_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "grad_format": "e5m2"}))
    assert "layers['fc1'].grad_format" in str(load_error(path))


def test_non_string_format_is_named(tmp_path):
    assert "layers['fc1'].format" in str(load_error(write_json(tmp_path, plan_dict(fc1={"format": 8}))))


def test_missing_format_is_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"reason": "forgot"}, fc2={}))
    message = str(load_error(path))
    assert "layers['fc1'].format: missing" in message and "layers['fc2'].format: missing" in message


def test_layer_entry_of_wrong_type_is_named(tmp_path):
    assert "layers['fc1']" in str(load_error(write_json(tmp_path, plan_dict(fc1=16))))


def test_unknown_layer_keys_are_all_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "bf16", "dtype": "x"}, fc2={"format": "bf16", "scale": 1}))
    message = str(load_error(path))
    assert "layers['fc1'].dtype" in message and "layers['fc2'].scale" in message


def test_unknown_keys_in_scaling_and_calibration_are_all_named(tmp_path):
    path = write_json(
        tmp_path,
        plan_dict(
            fc1={"format": "fp8_e4m3", "scaling": {"amax_window": 4}},
            fc2={"format": "int8", "calibration": {"method": "max", "bins": 2048}},
        ),
    )
    message = str(load_error(path))
    assert "layers['fc1'].scaling.amax_window: unknown key" in message and "layers['fc2'].calibration.bins: unknown key" in message


def test_wrong_field_types_are_all_named(tmp_path):
    path = write_json(
        tmp_path,
        plan_dict(
            fc1={"format": "fp8_e4m3", "scaling": {"history_len": "16"}},
            fc2={"format": "int8", "calibration": {"batches": 4.0, "percentile": "99"}},
        ),
    )
    error = load_error(path)
    named = ["scaling.history_len", "calibration.batches", "calibration.percentile"]
    assert all(any(n in p for p in error.problems) for n in named) and len(error.problems) == 3


def test_wrong_type_message_shows_the_value_and_expected_type(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "scaling": {"history_len": "16"}}))
    assert "expected int, got '16'" in str(load_error(path))


def test_boolean_is_not_accepted_as_an_int(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "scaling": {"history_len": True}}))
    assert "scaling.history_len" in str(load_error(path))


def test_scaling_that_is_not_an_object_is_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "scaling": "delayed"}))
    assert "layers['fc1'].scaling" in str(load_error(path))


def test_unknown_granularity_value_is_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "scaling": {"granularity": "column"}}))
    message = str(load_error(path))
    assert "layers['fc1'].scaling" in message and "column" in message


def test_unknown_calibration_method_is_named(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "int8", "calibration": {"method": "entropy"}}))
    message = str(load_error(path))
    assert "layers['fc1'].calibration" in message and "entropy" in message


def test_non_string_reason_is_named(tmp_path):
    assert "layers['fc1'].reason" in str(load_error(write_json(tmp_path, plan_dict(fc1={"format": "bf16", "reason": 3}))))


INVALID_VALUES = [
    ({"format": "int8", "calibration": {"percentile": 0}}, "calibration.percentile"),
    ({"format": "int8", "calibration": {"percentile": 100.5}}, "calibration.percentile"),
    ({"format": "int8", "calibration": {"batches": 0}}, "calibration.batches"),
    ({"format": "int8", "calibration": {"outlier_ratio": 1}}, "calibration.outlier_ratio"),
    ({"format": "fp8_e4m3", "scaling": {"mode": "delayed", "granularity": "row"}}, "needs granularity 'tensor'"),
    ({"format": "fp8_e5m2", "scaling": {"mode": "delayed", "granularity": "block"}}, "needs granularity 'tensor'"),
    ({"format": "fp8_e4m3", "scaling": {"history_len": 0}}, "scaling.history_len"),
    ({"format": "fp8_e4m3", "scaling": {"reduction": "mean"}}, "scaling.reduction"),
    ({"format": "fp8_e4m3", "grad_format": "bf16"}, "grad_format"),
    ({"format": "bf16", "grad_format": "fp16"}, "grad_format"),
]


@pytest.mark.parametrize("entry, named", INVALID_VALUES, ids=[n for _, n in INVALID_VALUES][:4] + ["delayed-row", "delayed-block", "history", "reduction", "fp8-grad", "bf16-grad"])
def test_invalid_value_is_named(tmp_path, entry, named):
    message = str(load_error(write_json(tmp_path, plan_dict(fc1=entry))))
    assert "layers['fc1']" in message and named in message


def test_delayed_row_scaling_says_what_to_do(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "fp8_e4m3", "scaling": {"granularity": "row", "mode": "delayed"}}))
    assert "set mode 'current' or granularity 'tensor'" in str(load_error(path))


def test_delayed_row_scaling_is_fine_outside_fp8(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "int8", "scaling": {"granularity": "row"}}))
    assert Plan.load(path)["fc1"].scaling.granularity is Granularity.ROW


def test_null_outlier_ratio_turns_outliers_off(tmp_path):
    path = write_json(tmp_path, plan_dict(fc1={"format": "int8", "calibration": {"outlier_ratio": None}}))
    assert Plan.load(path)["fc1"].calibration.outlier_ratio is None


def test_every_invalid_value_in_a_file_is_reported(tmp_path):
    path = write_json(
        tmp_path,
        plan_dict(
            a={"format": "int8", "calibration": {"percentile": 0}},
            b={"format": "int8", "calibration": {"batches": 0}},
            c={"format": "int8", "calibration": {"outlier_ratio": 1}},
            d={"format": "fp8_e4m3", "scaling": {"granularity": "row", "mode": "delayed"}},
            ok={"format": "bf16"},
        ),
    )
    error = load_error(path)
    assert [p.split("layers[", 1)[1][:3] for p in error.problems] == ["'a'", "'b'", "'c'", "'d'"]


def test_fingerprint_that_is_not_an_object_is_rejected(tmp_path):
    data = dict(plan_dict(), fingerprint=["fc1"])
    assert "'fingerprint'" in str(load_error(write_json(tmp_path, data)))


def test_incomplete_fingerprint_entries_are_all_named(tmp_path):
    data = dict(plan_dict(), fingerprint={"fc1": {"module": "Linear"}, "fc2": "Linear"})
    message = str(load_error(write_json(tmp_path, data)))
    assert "fingerprint['fc1']" in message and "fingerprint['fc2']" in message


@pytest.mark.parametrize("key", ["budgets", "predicted", "measured", "metadata"])
def test_non_object_sections_are_named(tmp_path, key):
    data = dict(plan_dict(), **{key: [1]})
    assert repr(key) in str(load_error(write_json(tmp_path, data)))


def test_constructor_reports_every_bad_layer():
    with pytest.raises(PlanError) as info:
        Plan({"fc1": "fp7", "fc2": "bf16", "fc3": {"format": "int8", "calibration": {"batches": 0}}})
    assert [p[:13] for p in info.value.problems] == ["layers['fc1']", "layers['fc3']"]


# --- validate ---------------------------------------------------------------------------------


def test_uniform_plan_validates_against_its_model():
    model = TwoLinear()
    assert Plan.uniform(model, Format.BF16).validate(model) is None


def test_traced_plan_validates_with_example_input():
    model, x = WithProjection(), torch.randn(2, 8)
    assert Plan.uniform(model, Format.BF16, x).validate(model, x) is None


def test_layers_the_model_lacks_are_all_named():
    model = TwoLinear()
    plan = Plan.uniform(model, Format.BF16).replace(layers={"fc1": "bf16", "fc2": "bf16", "fc9": "bf16", "head": "bf16"})
    message = str(validate_error(plan, model))
    assert "'fc9': the plan names a layer the model lacks" in message and "'head': the plan names a layer the model lacks" in message


def test_covered_layers_the_plan_lacks_are_all_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))
    plan = Plan({"0": "bf16"})
    message = str(validate_error(plan, model))
    assert "'2': a covered layer (Linear) the plan lacks" in message and "'3': a covered layer (Linear) the plan lacks" in message


def test_plan_from_module_tree_passes_static_validation_despite_addmm_projection():
    model = WithProjection()
    assert Plan.uniform(model, Format.BF16).validate(model) is None


def test_addmm_projection_the_plan_lacks_is_named_when_traced():
    model = WithProjection()
    plan = Plan({"fc": "bf16"})
    message = str(validate_error(plan, model, torch.randn(2, 8)))
    assert "'proj': a covered layer (AddmmProjection) the plan lacks" in message


def test_fingerprinted_layer_the_plan_lacks_is_named_without_tracing():
    # The plan's fingerprint remembers that proj runs addmm, so static validation catches its loss.
    model = WithProjection()
    plan = Plan.uniform(model, Format.BF16, torch.randn(2, 8))
    message = str(validate_error(plan.replace(layers={"fc": "bf16"}), model))
    assert "'proj': a covered layer (AddmmProjection) the plan lacks" in message


def test_parameter_shape_mismatches_are_all_named():
    plan = Plan.uniform(TwoLinear(hidden=16), Format.BF16)
    message = str(validate_error(plan, TwoLinear(hidden=32)))
    assert "'fc1': parameter shapes" in message and "'fc2': parameter shapes" in message


def test_shape_mismatch_message_shows_both_shapes():
    plan = Plan.uniform(TwoLinear(hidden=16), Format.BF16)
    message = str(validate_error(plan, TwoLinear(hidden=32)))
    assert "(32, 8)" in message and "(16, 8)" in message


def test_plan_without_fingerprint_skips_the_shape_check():
    assert Plan({"fc1": "bf16", "fc2": "bf16"}).validate(TwoLinear(hidden=32)) is None


def test_unrunnable_format_names_every_layer_with_the_reason(monkeypatch):
    model = TwoLinear()
    plan = Plan.uniform(model, Format.FP8_E4M3)
    set_support(monkeypatch, Support(False, False, "no FP8 here"))
    error = validate_error(plan, model)
    assert [p[:6] for p in error.problems] == ["'fc1':", "'fc2':"] and all("no FP8 here" in p for p in error.problems)


def test_unrunnable_format_message_says_what_to_do(monkeypatch):
    model = TwoLinear()
    plan = Plan.uniform(model, Format.BF16)
    set_support(monkeypatch, Support(False, False, "no BF16 here"))
    assert "choose another format" in str(validate_error(plan, model))


def test_fp8_conv_without_emulation_names_the_conv_layer(monkeypatch):
    model = ConvNet()
    plan = Plan.uniform(model, Format.FP8_E4M3)
    set_support(monkeypatch, Support(True, True, "kernel"))
    error = validate_error(plan, model, allow_emulation=False)
    assert len(error.problems) == 1 and "'conv': fp8_e4m3 has no kernel for conv2d" in error.problems[0]


def test_fp8_conv_with_emulation_allowed_validates(monkeypatch):
    model = ConvNet()
    set_support(monkeypatch, Support(True, True, "kernel"))
    assert Plan.uniform(model, Format.FP8_E4M3).validate(model) is None


def test_fp8_conv_without_emulation_is_named_on_this_device():
    # No monkeypatch: whatever this device has, there is no FP8 convolution kernel.
    model = ConvNet()
    assert "'conv'" in str(validate_error(Plan.uniform(model, Format.FP8_E4M3), model, allow_emulation=False))


def test_missing_kernel_without_emulation_names_every_layer(monkeypatch):
    model = TwoLinear()
    plan = Plan.uniform(model, Format.INT8)
    set_support(monkeypatch, Support(True, False, "no _int_mm"))
    error = validate_error(plan, model, allow_emulation=False)
    assert [p[:6] for p in error.problems] == ["'fc1':", "'fc2':"] and all("no kernel" in p for p in error.problems)


def test_block_scaling_without_emulation_is_named(monkeypatch):
    model = TwoLinear()
    block = LayerPrecision(Format.FP8_E4M3, scaling=Scaling(granularity=Granularity.BLOCK, mode=ScalingMode.CURRENT))
    plan = Plan.uniform(model, Format.FP8_E4M3).with_layers({"fc2": block})
    set_support(monkeypatch, Support(True, True, "kernel"))
    error = validate_error(plan, model, allow_emulation=False)
    assert len(error.problems) == 1 and "'fc2': block scaling has no kernel" in error.problems[0]


def test_autocast_formats_never_count_as_emulated(monkeypatch):
    model = ConvNet()
    set_support(monkeypatch, Support(True, False, "autocast"))
    assert Plan.uniform(model, Format.BF16).validate(model, allow_emulation=False) is None


def test_validate_reports_every_kind_of_problem_at_once():
    model = TwoLinear(hidden=32)
    plan = Plan.uniform(TwoLinear(hidden=16), Format.BF16).replace(layers={"fc1": "bf16", "ghost": "bf16"})
    error = validate_error(plan, model)
    assert [p.split(":", 1)[0] for p in error.problems] == ["'ghost'", "'fc2'", "'fc1'"]


def test_validate_error_names_the_model_class():
    model = TwoLinear()
    assert "TwoLinear" in str(validate_error(Plan({"fc1": "bf16"}), model))


# --- enum values, schema_version types, non-layer entries ---------------------------------------


@pytest.mark.parametrize(
    "section, key, value, valid",
    [
        ("scaling", "granularity", "column", "tensor, row, block"),
        ("scaling", "mode", "lazy", "delayed, current"),
        ("calibration", "method", "entropy", "max, percentile, mse"),
    ],
)
def test_unknown_enum_value_lists_the_valid_values(tmp_path, section, key, value, valid):
    data = plan_dict(fc1={"format": "int8", section: {key: value}})
    error = load_error(write_json(tmp_path, data))
    assert f"layers['fc1'].{section}.{key}" in str(error)
    assert valid in str(error)


def test_boolean_schema_version_is_rejected_as_not_an_integer(tmp_path):
    data = {"schema_version": True, "layers": {"fc1": {"format": "bf16"}}}
    error = load_error(write_json(tmp_path, data))
    assert "positive integer" in str(error)


def test_validate_with_an_example_names_plan_entries_that_are_not_layers():
    model = TwoLinear()
    plan = Plan.uniform(model, "bf16").replace(layers={"fc1": "bf16", "fc2": "bf16", "act": "bf16"})
    error = validate_error(plan, model, torch.randn(2, 8))
    assert "'act': ReLU runs no matrix product" in str(error)
    assert "fc1" not in str(error)


def test_fingerprint_ops_must_be_a_list(tmp_path):
    data = plan_dict(fc1={"format": "bf16"})
    data["fingerprint"] = {"fc1": {"module": "Linear", "ops": "linear", "params": {}}}
    error = load_error(write_json(tmp_path, data))
    assert "fingerprint['fc1']" in str(error)


@pytest.mark.parametrize("scaling, field", [(dict(margin=10**6), "margin"), (dict(margin=-(10**6)), "margin"), (dict(history_len=10**12), "history_len")])
def test_scaling_out_of_its_sane_range_is_refused_when_made(scaling, field):
    with pytest.raises(SettingsError, match=rf"^Scaling\({field}=-?[0-9]+\): expected an integer from"):
        Scaling(**scaling)


def test_a_margin_beyond_the_formats_range_is_refused_naming_the_format():
    # 127 / 2**7 < 1: every INT8 value would round to 0 or ±1 (E4M3 allows 8).
    with pytest.raises(PlanError, match=r"^LayerPrecision\('int8'\)\.scaling\.margin: must be from 0 to 6 for int8"):
        LayerPrecision(Format.INT8, scaling=Scaling(margin=7))


def test_the_largest_useful_margin_is_accepted():
    plan = Plan({"fc": LayerPrecision(Format.FP8_E4M3, scaling=Scaling(margin=8))})  # 448 / 2**8 = 1.75
    assert plan["fc"].scaling.margin == 8


def test_numpy_figures_are_held_as_numbers_and_round_trip(tmp_path):
    import numpy as np

    # Before: a bare TypeError (int64 is not JSON serializable) from the constructor.
    plan = Plan({"fc": "bf16"}, predicted={"bytes": np.int64(5), "seconds": np.float32(0.5)})
    assert dict(plan.predicted) == {"bytes": 5, "seconds": 0.5} and Plan.load(plan.save(tmp_path / "p.json")) == plan
    with pytest.raises(PlanError, match=r"Plan\(metadata=\.\.\.\): .* cannot be saved as JSON"):
        Plan({"fc": "bf16"}, metadata={"x": object()})


def test_a_stages_part_of_a_plan_keeps_the_whole_plans_formats_through_a_round_trip():
    """`Plan.for_stage`: the part on a pipeline stage's layers says which formats the whole plan
    runs, so its runtime runs the model's own ops in the whole plan's autocast region (here an
    FP32 layer's stage, FP16 elsewhere: an FP16 region, where the part alone would run none), and
    keeps saying so through JSON."""
    import autoprec as ap

    class TwoStages(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.second(x if self.first is None else self.first(x).relu())

    model = TwoStages()
    plan = Plan.uniform(model, "fp32").with_layers({"first": "fp16"})
    stage = copy.deepcopy(model)
    stage.first = None  # as torchtitan's pipeline split leaves a stage
    part = plan.for_stage(stage)
    assert dict(part.layers) == {"second": plan.layers["second"]} and part.whole_formats == plan.whole_formats == {Format.FP16, Format.FP32}
    assert Plan.from_dict(json.loads(json.dumps(part.to_dict()))) == part
    whole_runtime, part_runtime = ap.apply_plan(copy.deepcopy(model), plan), ap.apply_plan(stage, part)
    assert part_runtime.low_precision and part_runtime.region_dtype == whole_runtime.region_dtype == torch.float16
    alone = ap.apply_plan(copy.deepcopy(stage), Plan.uniform(stage, "fp32"))
    assert not alone.low_precision  # a plan of its own: its own formats
