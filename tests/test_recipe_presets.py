"""Named recipes (`LayerPrecision.preset`): Transformer Engine's and torchao's defaults as
autoprec runs them, named in a plan file, refused in one line when unknown."""

import pytest
import torch
import torch.nn as nn

import autoprec as ap
from autoprec.errors import PlanError
from autoprec.formats import Format
from autoprec.layer_precision import PRESETS
from autoprec.plan import LayerPrecision, Plan

pytestmark = pytest.mark.filterwarnings("ignore::autoprec.EmulationWarning")


def test_named_recipes_are_the_libraries_defaults_and_a_plan_file_may_name_them(tmp_path):
    """`LayerPrecision.preset`: Transformer Engine's and torchao's recipes as autoprec runs them;
    a plan file's layer may name one (written back as its fields); an unknown name is one line
    listing them."""
    te_delayed = LayerPrecision.preset("te_delayed")
    assert (te_delayed.format, te_delayed.grad_format, te_delayed.scaling.mode.value, te_delayed.scaling.history_len) == (
        Format.FP8_E4M3, Format.FP8_E5M2, "delayed", 1024)  # DelayedScaling(): HYBRID, a 1024-step max history
    assert LayerPrecision.preset("te_mxfp8").recipe == "fp8_e4m3/mx" and LayerPrecision.preset("te_mxfp8").grad_format is Format.FP8_E4M3
    assert LayerPrecision.preset("te_block").grad_format is Format.FP8_E4M3 and LayerPrecision.preset("te_nvfp4").grad_format is Format.NVFP4
    gw_hp = LayerPrecision.preset("torchao_rowwise_with_gw_hp")
    assert gw_hp.recipe == "fp8_e4m3/row+fp8_e4m3 backward+fp32 wgrad" and gw_hp.reason == "preset torchao_rowwise_with_gw_hp"
    data = {"schema_version": 4, "layers": {name: name for name in PRESETS}}
    plan = Plan.from_dict(data)
    assert {fqn: lp for fqn, lp in plan.layers.items()} == {name: LayerPrecision.preset(name) for name in PRESETS}
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").layers == plan.layers
    with pytest.raises(PlanError, match=r"preset\('te_fp8'\): unknown recipe; expected one of te_current, te_delayed") as info:
        LayerPrecision.preset("te_fp8")
    assert "\n" not in str(info.value)
    with pytest.raises(PlanError, match=r"layers\['fc'\]\.format: .*'te_fp8'.*or name a recipe instead of the entry: te_current"):
        Plan.from_dict({"schema_version": 4, "layers": {"fc": "te_fp8"}})
    # Each runs: a forward and backward under it, finite gradients.
    for name in PRESETS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32))
        with ap.apply_plan(model, Plan({"0": LayerPrecision.preset(name)})):
            model(torch.randn(16, 64)).float().square().sum().backward()
        assert torch.isfinite(model[0].weight.grad).all() and model[0].weight.grad.abs().sum() > 0, name
