"""Bad input, settings of the wrong type (issue 25): each refused at construction with one line
naming the argument and what it expects, not at the first window far from the call."""

import pathlib

import pytest
import torch.nn as nn

from autoprec.errors import SettingsError
from autoprec.scheduler import DynamicPrecisionScheduler
from autoprec.scheduler.config import SchedulerConfig


@pytest.mark.parametrize("kwargs, expects", [
    (dict(thresholds=None), "an autoprec.Thresholds(...)"),
    (dict(rules={"pin": {"fc": "bf16"}}), "an autoprec.LayerRules(...)"),
    (dict(loss_scaling=None), "an autoprec.LossScaling(...)"),
    (dict(loss_scaling={"init_scale": 2.0}), "an autoprec.LossScaling(...)"),
    (dict(log_dir=5), "a folder path"),
    (dict(dynamic="no"), "True or False"),
    (dict(accuracy_relative="false"), "True or False"),
    (dict(measure_costs=1), "True or False"),
    (dict(seed="0"), "an integer"),
    (dict(formats="fp8_e4m3"), "a list of format names"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_setting_of_the_wrong_type_is_refused_naming_it(kwargs, expects):
    (name,) = kwargs
    with pytest.raises(SettingsError, match=rf"^DynamicPrecisionScheduler\({name}=") as info:
        DynamicPrecisionScheduler(**kwargs)
    assert expects in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model", [lambda x: x, "model.pt", 5], ids=["function", "path", "int"])
def test_a_scheduler_given_something_other_than_a_module_is_refused(model):
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(model=.*\): expected the torch.nn.Module"):
        DynamicPrecisionScheduler(model)


def test_settings_of_the_right_type_are_kept():
    config = SchedulerConfig(log_dir=pathlib.Path("runs"), formats=["bf16", "fp32"], dynamic=True)
    assert config.log_dir == pathlib.Path("runs") and len(config.formats) == 2
    assert DynamicPrecisionScheduler(nn.Linear(4, 4)).model is not None


def test_choices_given_by_name_are_held_as_enums():
    """``grad_comm`` and ``scaling`` taken by name (as a config file spells them), held typed:
    the code downstream compares enums, never strings (``scaling`` as each format's scalings,
    a list given or one: `Planning.scaling`)."""
    from autoprec.formats import CommMethod, Format, Granularity
    from autoprec.scheduler.config import AUTO_COMM

    config = SchedulerConfig(grad_comm="bf16", scaling={"fp8_e4m3": "block", Format.INT8: "row"})
    assert config.grad_comm is CommMethod.BF16
    assert dict(config.scaling) == {Format.FP8_E4M3: (Scaling(granularity=Granularity.BLOCK),), Format.INT8: (Scaling(granularity=Granularity.ROW),)}
    assert SchedulerConfig(grad_comm=CommMethod.TOPK).grad_comm is CommMethod.TOPK
    assert SchedulerConfig(grad_comm="auto").grad_comm == AUTO_COMM


# --- issue 59: one rule for counts and numbers everywhere (`autoprec._checks`) -------------------

import numpy as np  # noqa: E402

from autoprec import Scaling, Thresholds  # noqa: E402
from autoprec.comm import CommSettings  # noqa: E402
from autoprec.errors import PlanError  # noqa: E402
from autoprec.layer_precision import LayerPrecision  # noqa: E402

REFUSED = [
    (CommSettings, dict(topk_ratio="0.01"), "a fraction in (0, 1]"),  # as read from a config file
    (CommSettings, dict(chunk=2.5), "an integer >= 1"),
    (CommSettings, dict(chunk=True), "an integer >= 1"),
    (CommSettings, dict(powersgd_rank=1.5), "an integer >= 1"),
    (CommSettings, dict(powersgd_rank=float("nan")), "an integer >= 1"),
    (CommSettings, dict(powersgd_start="2"), "an integer >= 2"),
    (Scaling, dict(history_len=8.0), "an integer from 1 to 4096"),  # an integral float is no count
    (Scaling, dict(margin=True), "an integer from 0 to"),
    (Scaling, dict(granularity="rows"), "'tensor', 'row', 'block' or 'mx'"),
    (Scaling, dict(mode="lazy"), "'delayed' or 'current'"),
    (Thresholds, dict(nonfinite_steps=np.float64(3.0)), "an integer >= 1"),
    (Thresholds, dict(overflow="0.1"), "a fraction from 0 to 1"),
    (Thresholds, dict(amax_drift=float("inf")), "a finite factor > 1"),
    (SchedulerConfig, dict(monitor_window=500.0), "a positive integer"),
    (SchedulerConfig, dict(lr="1e-3"), "the finite learning rate > 0"),
    (SchedulerConfig, dict(min_precision=16.0), "8, 16 or 32"),
]


@pytest.mark.parametrize("cls, kwargs, expects", REFUSED, ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_count_or_number_of_the_wrong_type_is_refused_when_made_naming_it(cls, kwargs, expects):
    (name,) = kwargs
    where = "DynamicPrecisionScheduler" if cls is SchedulerConfig else cls.__name__
    with pytest.raises(SettingsError, match=rf"^{where}\({name}=") as info:
        cls(**kwargs)
    assert expects in str(info.value) and "\n" not in str(info.value)


def test_numpy_scalars_are_taken_as_ints_and_floats():
    comm = CommSettings(chunk=np.int64(128), topk_ratio=np.float32(0.5), powersgd_rank=np.int32(4))
    assert (comm.chunk, comm.powersgd_rank) == (128, 4) and type(comm.chunk) is int and type(comm.topk_ratio) is float
    config = SchedulerConfig(monitor_window=np.int64(8), lr=np.float32(0.01), thresholds=Thresholds(stable_windows=np.int64(3)))
    assert type(config.monitor_window) is int and type(config.lr) is float and type(config.thresholds.stable_windows) is int


def test_a_scale_for_a_format_that_takes_none_is_refused_as_the_scheduler_refuses_it():
    with pytest.raises(PlanError, match=r"^LayerPrecision\('bf16'\)\.scaling: bf16 takes no scale") as info:
        LayerPrecision("bf16", scaling=Scaling(granularity="block"))
    assert "\n" not in str(info.value)
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(scaling=\{'bf16'"):
        DynamicPrecisionScheduler(scaling={"bf16": "block"})


def test_a_scaling_the_format_cannot_take_is_refused_by_the_scheduler_constructor():
    # Before: accepted, and the training stopped a window later with a PlanError naming layers['a'].
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(scaling=\{'fp8_e4m3'.*needs granularity 'tensor'") as info:
        DynamicPrecisionScheduler(scaling={"fp8_e4m3": Scaling(granularity="block", mode="delayed")})
    assert "\n" not in str(info.value)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_recompute_naming_layers_not_blocks_is_refused_at_construction():
    # Before: accepted; the search then put in force a plan recomputing 'blocks.1.0', which
    # Plan.validate refuses ("a layer, not a block").
    with pytest.raises(SettingsError, match=r"^DynamicPrecisionScheduler\(recompute=\['blocks.0.0', 'blocks.1.0'\]\): .*matches layers") as info:
        DynamicPrecisionScheduler(_Blocks(), recompute=["blocks.0.0", "blocks.1.0"])
    assert "e.g. 'blocks.0'" in str(info.value) and "\n" not in str(info.value)
    assert DynamicPrecisionScheduler(_Blocks(), recompute=["blocks.*"]).config.recompute == ("blocks.*",)
