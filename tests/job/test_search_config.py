"""Search job files: a good file loads; every bad key or value is one line naming it."""

import sys
import textwrap

import pytest

from autoprec.errors import SearchError
from autoprec.formats import Format
from autoprec.job.config import load_job

GOOD = """
[job]
name = "bytelm"
out = "runs/bytelm"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = { name = "tiny" }

[budgets]
memory = 0.5
accuracy = 0.01

[search]
min_precision = 8
max_precision = 32
formats = ["fp32", "bf16", "fp8_e4m3", "int8"]
measure_top = 5
seed = 3

[rules]
pin = { "lm_head" = "bf16" }
forbid = { "blocks.*.attn" = ["int8"] }
groups = [["blocks.0.attn.qkv", "blocks.0.attn.proj"]]
"""


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path) -> str:
    with pytest.raises(SearchError) as info:
        load_job(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_good_job_loads_with_paths_resolved_against_the_file(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.name == "bytelm"
    assert job.out == tmp_path / "runs" / "bytelm"
    assert job.formats == (Format.FP32, Format.BF16, Format.FP8_E4M3, Format.INT8)
    assert job.budgets.memory == 0.5 and job.budgets.accuracy == 0.01 and job.budgets.accuracy_relative
    assert job.rules.pin == {"lm_head": Format.BF16}
    assert job.rules.forbid == {"blocks.*.attn": (Format.INT8,)}
    assert job.rules.groups == (("blocks.0.attn.qkv", "blocks.0.attn.proj"),)
    assert job.storage_url == f"sqlite:///{tmp_path / 'runs' / 'bytelm' / 'study.db'}"
    assert job.study_name == "bytelm" and job.measure_top == 5 and job.seed == 3
    assert job.measured_trials == 0  # the learning sampler is off unless asked for


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("measure_top = 5", "measure_top = 5\nmeasure_tpo = 5", "[search].measure_tpo: unknown key; expected one of"),
        ("measure_top = 5", 'measure_top = "many"', "[search].measure_top: expected an integer from 1 to 256 (each plan is trained and timed; more do not finish), got 'many'"),
        ("measure_top = 5", "measure_top = 0", "[search].measure_top: expected an integer from 1 to 256 (each plan is trained and timed; more do not finish), got 0"),
        ("measure_top = 5", "measure_top = 5\nmeasured_trials = -1", "[search].measured_trials: expected an integer >= 0 (0: no learning sampler), got -1"),
        ("measure_top = 5", "trials = 200", "[search].trials: no longer used: the candidates are the [search].measure_top best plans"),
        ("measure_top = 5", "multi_objective = true", "[search].multi_objective: no longer used: the logs always show the Pareto front (step time, memory, loss increase) of the measured plans; delete the key"),
        ("memory = 0.5", "memory = -1", "[budgets].memory: expected a fraction of the FP32 bytes as a float in (0, 1], or bytes as an integer or a size string such as '6GiB'"),
        ("memory = 0.5", "memory = 1.5", "[budgets].memory: expected a fraction of the FP32 bytes as a float in (0, 1], or bytes"),
        ("memory = 0.5", 'memory = "6 gigs"', "[budgets].memory: expected a fraction"),
        ("memory = 0.5", "memory = true", "[budgets].memory: expected"),
        ('"bf16", "fp8_e4m3"', '"bf16", "fp9"', "[search].formats: unknown format 'fp9'"),
        ('"lm_head" = "bf16"', '"lm_head" = "bf17"', "[rules].pin: unknown format 'bf17'"),
        ("min_precision = 8", "min_precision = 12", "[search]: min_precision must be 4, 8, 16 or 32"),
        ("min_precision = 8\nmax_precision = 32", "min_precision = 32\nmax_precision = 16", "swap them"),
        ('factory = "autoprec.workloads:default_workload"', 'factory = "autoprec.workloads:nope"', "has no callable 'nope'"),
        ('factory = "autoprec.workloads:default_workload"', 'factory = "no_such_module_x:f"', "cannot import module 'no_such_module_x'"),
        ('factory = "autoprec.workloads:default_workload"', 'factory = "just_a_name"', 'expected "module:function"'),
        ("[rules]", "[rulez]", "unknown table [rulez]"),
        ('groups = [["blocks.0.attn.qkv", "blocks.0.attn.proj"]]', 'groups = ["x"]', "[rules].groups: expected a list of lists"),
    ],
)
def test_bad_entries_are_one_line_errors_naming_the_key(tmp_path, old, new, expected):
    assert old in GOOD
    message = error_of(write(tmp_path, GOOD.replace(old, new, 1)))
    assert str(tmp_path / "job.toml") in message
    assert expected in message


@pytest.mark.parametrize("spelled, expected", [("0.5", 0.5), ('"6GiB"', 6 * 2**30), ("1048576", 2**20)])
def test_memory_budget_is_a_fraction_or_bytes(tmp_path, spelled, expected):
    job = load_job(write(tmp_path, GOOD.replace("memory = 0.5", f"memory = {spelled}", 1)))
    assert job.budgets.memory == expected and type(job.budgets.memory) is type(expected)


def test_missing_factory_is_named(tmp_path):
    text = GOOD.replace('factory = "autoprec.workloads:default_workload"\n', "")
    assert "[workload].factory is missing" in error_of(write(tmp_path, text))


def test_malformed_toml_names_the_file(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "[job\nname = 1"))


def test_missing_file_is_named(tmp_path):
    assert "no such job file" in error_of(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("memory = 0.5", "memory = inf", "[budgets].memory: expected a fraction of the FP32 bytes"),
        ("accuracy = 0.01", "accuracy = nan", "[budgets].accuracy: expected an allowed loss increase >= 0, finite"),
        ("seed = 3", "seed = 3\ntimeout_s = inf", "[search].timeout_s: expected a number of seconds > 0, finite"),
    ],
)
def test_non_finite_or_unbounded_values_are_refused(tmp_path, old, new, expected):
    assert old in GOOD
    assert expected in error_of(write(tmp_path, GOOD.replace(old, new, 1)))


def test_a_huge_number_of_held_out_batches_is_refused(tmp_path):
    message = error_of(write(tmp_path, GOOD + "\n[measure]\nval_batches = 100000000\n"))
    assert "[measure].val_batches: expected an integer from 2 to 1024" in message


def test_the_job_and_the_scheduler_hand_the_pipeline_one_planning_of_their_settings(tmp_path):
    from autoprec.scheduler.config import SchedulerConfig
    from autoprec.search.planning import Planning
    from autoprec.search.budgets import Budgets
    from autoprec.search.space import LayerRules

    job = load_job(write(tmp_path, GOOD.replace("seed = 3", "seed = 3\ntimeout_s = 7.5")))
    assert job.planning(3e-4) == Planning(
        (Format.FP32, Format.BF16, Format.FP8_E4M3, Format.INT8), job.rules, Budgets(0.5, 0.01), 8, 32, 3e-4, k=5, time_limit=7.5)
    rules = LayerRules(pin={"lm_head": Format.BF16})
    config = SchedulerConfig(max_precision=16, memory_budget="6GiB", accuracy_budget=0.02, accuracy_relative=False, rules=rules,
                             search_timeout_s=5.0, lr=2e-4, measure_costs=False)
    assert config.planning == Planning((Format.BF16, Format.FP16, Format.FP8_E4M3, Format.INT8), rules,
                                       Budgets(6 * 2**30, 0.02, False), 8, 16, 2e-4, k=1, time_limit=5.0, measure=False)


def test_a_target_is_a_device_name_or_a_profile_beside_the_job_and_refuses_the_learning_sampler(tmp_path):
    job = load_job(write(tmp_path, GOOD.replace("seed = 3", 'seed = 3\ntarget = "h100"')))
    assert job.target is not None and job.target.name == "NVIDIA H100 SXM5" and job.planning(1e-3).target is job.target
    (tmp_path / "gpu.json").write_text('{"name": "G", "tflops": {"fp32": 1}, "bandwidth_tb_s": 1, "kernels": ["int8"]}')
    assert load_job(write(tmp_path, GOOD.replace("seed = 3", 'seed = 3\ntarget = "gpu.json"'))).target.kernels == {"int8"}
    assert "[search].target: target 'B300': not a known device (H100, H200, A100, B200)" in error_of(
        write(tmp_path, GOOD.replace("seed = 3", 'seed = 3\ntarget = "B300"')))
    assert "[search].target: target 'missing.json': cannot read the profile" in error_of(
        write(tmp_path, GOOD.replace("seed = 3", 'seed = 3\ntarget = "missing.json"')))
    message = error_of(write(tmp_path, GOOD.replace("seed = 3", 'seed = 3\ntarget = "B200"\nmeasured_trials = 8')))
    assert message.endswith("[search].measured_trials: the learning sampler learns from this machine's step times, not the target's; "
                            "with [search].target set, leave it out or set 0")


USERS_MODULE = """
from autoprec.workloads import default_workload


def make(**kwargs):
    return default_workload(**kwargs)
"""


def test_a_factory_module_beside_the_job_file_or_in_the_working_directory_is_found(tmp_path, monkeypatch):
    # `autoprec search job.toml` is a console script: unlike `python -m`, it does not put the
    # working directory on sys.path, so a user's own module beside the job was "No module named".
    from autoprec.job.config import load_job_workload

    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", ".")])  # `python -m pytest` puts the working directory there
    for name, folder, cwd in [("users_wl_beside_job", tmp_path / "jobs", tmp_path), ("users_wl_in_cwd", tmp_path / "here", tmp_path / "here")]:
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.py").write_text(USERS_MODULE, encoding="utf-8")
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.chdir(cwd)
        job_dir = tmp_path / "jobs"
        job_dir.mkdir(exist_ok=True)
        job = load_job(write(job_dir, GOOD.replace("autoprec.workloads:default_workload", f"{name}:make")))
        workload = load_job_workload(job)
        assert type(workload.build_model(0)).__name__ == "ByteLM"
        assert str(folder) in sys.path and sys.path[0] != str(folder)  # appended: installed packages win


def test_a_factory_module_that_fails_on_its_own_import_says_so_not_that_it_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.path", list(sys.path))
    (tmp_path / "users_wl_broken.py").write_text("import no_such_dependency_x\n\ndef make():\n    pass\n", encoding="utf-8")
    message = error_of(write(tmp_path, GOOD.replace("autoprec.workloads:default_workload", "users_wl_broken:make")))
    assert "[workload].factory: cannot import module 'users_wl_broken' (No module named 'no_such_dependency_x')" in message
    message = error_of(write(tmp_path, GOOD.replace("autoprec.workloads:default_workload", "users_wl_absent:make")))
    assert f"(No module named 'users_wl_absent', nor in {tmp_path} or " in message
