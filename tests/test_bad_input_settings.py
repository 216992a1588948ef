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
