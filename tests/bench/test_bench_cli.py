"""`autoprec.bench` and the `autoprec` command line.

One small benchmark run (tiny LM, small block, 1 warmup + 3 timed rounds) is shared by the
structure tests; the CLI runs `bench --quick` once on the default sizes.
"""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from autoprec.bench import DEFAULT_VARIANTS, BenchConfig, BenchConfigError, TargetCheck, run_bench
from autoprec.cli import main
from autoprec.workloads import BlockWorkload, default_workload

SMALL = BenchConfig(steps=3, warmup=1, device="cpu")
TARGETS = {"workload": default_workload("tiny", batch_size=4), "block": BlockWorkload((4, 32, 64))}


@pytest.fixture(scope="module")
def result():
    return run_bench(TARGETS, SMALL)


def test_every_target_and_variant_has_a_row(result):
    assert {(r.target, r.variant) for r in result.rows} == {(t, v) for t in ("workload", "block") for v in DEFAULT_VARIANTS}


def test_times_and_bytes_are_positive(result):
    assert all(r.step_ms > 0 and r.saved_bytes > 0 for r in result.rows)


def test_fp8_plan_saves_less_than_autocast_on_block(result):
    assert result.row("block", "plan:fp8_e4m3").saved_ratio < result.row("block", "autocast:bf16").saved_ratio


def test_bf16_plan_saves_what_autocast_saves_on_block(result):
    # The runtime runs BF16 layers under torch.autocast, so it keeps exactly what autocast keeps.
    assert result.row("block", "plan:bf16").saved_bytes == result.row("block", "autocast:bf16").saved_bytes


def test_final_losses_are_finite(result):
    assert all(r.finite and math.isfinite(r.final_loss) for r in result.rows)


def test_all_four_targets_are_the_ratios_of_the_rows_they_name(result):
    # Each target's name says which rows it divides ("block: plan:bf16 saved bytes / autocast:bf16
    # saved bytes"); its value is recomputed here from those rows, and it passes when within its limit.
    fields = {"saved bytes": "saved_bytes", "step time": "step_ms"}
    assert len(result.targets) == 4
    for check in result.targets:
        target, ratio = check.name.split(": ", 1)
        (a, field), (b, field_b) = (side.split(" ", 1) for side in ratio.split(" / "))
        assert field == field_b, check.name
        a_row, b_row = result.row(target, a), result.row(target, b)
        value = getattr(a_row, fields[field]) / getattr(b_row, fields[field])
        assert (check.value, check.passed) == (pytest.approx(value), value <= check.limit), check


def test_int8_calibration_is_summarised(result):
    cal = result.calibration
    assert cal["layers"] > 0 and 0 <= cal["calibrated_rel_error"] < 1 and 0 <= cal["naive_max_rel_error"] < 1


def test_attention_matmuls_are_reported_emulated(result):
    # Batched q @ k^T and att @ v have no FP8 / INT8 kernel: the report must name them.
    assert result.emulated["block"]["plan:fp8_e4m3"] == {"attn": ["matmul"]}


def test_result_is_json_and_table_lists_targets(result):
    text = json.dumps(result.to_dict(), allow_nan=False)
    table = result.format_table()
    assert json.loads(text)["rows"] and table.count("PASS") + table.count("FAIL") == len(result.targets)


@pytest.mark.parametrize(
    "changes",
    [
        {"steps": 0},
        {"warmup": 0},
        {"variants": ("plan:bf16",)},
        {"variants": ("fp32", "plan:nope")},
        {"variants": ("fp32", "autocast:int8")},
        {"variants": ("fp32", "fp32")},
        {"variants": ("fp32", "compiled:compiled:fp32")},
        {"device": "not-a-device"},
    ],
)
def test_config_rejects_bad_input(changes):
    with pytest.raises(BenchConfigError):
        dataclasses.replace(SMALL, **changes)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "huge"], "argument --workload: unknown preset 'huge'"),
        (["--block-shape", "4,32,63"], "d_model 63 must be divisible"),
        (["--workload", "no_such_module_xyz:f"], "argument --workload: cannot import module 'no_such_module_xyz'"),
        (["--workload", "tiny", "--workload-kwargs", "{}"], "argument --workload-kwargs: applies to --workload MODULE:FUNCTION only"),
        (["--workload", "autoprec.workloads:default_workload", "--workload-kwargs", "[1]"], "argument --workload-kwargs: give a JSON object"),
        (["--workload", "autoprec.workloads:default_workload", "--workload-kwargs", '{"size": 3}'], "argument --workload: autoprec.workloads:default_workload rejected {'size': 3}"),
        (["--workload", "autoprec.workloads:LMConfig"], "returned a LMConfig without build_model, train_batches, val_batches, loss"),
    ],
)
def test_bench_workload_arguments_fail_in_one_line(capsys, args, message):
    assert main(["bench", "--quick", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bench_runs_a_workload_named_module_function(tmp_path, capsys, monkeypatch):
    """``--workload module:function`` is trained like the search job's factory: here a user's
    module in the working directory (which a console script does not put on ``sys.path``)
    returning the built-in LM's workload with keyword arguments, one variant beside fp32."""
    (tmp_path / "users_bench_wl.py").write_text("from autoprec.workloads import default_workload as make\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    path = tmp_path / "bench.json"
    args = ["bench", "--quick", "--variants", "fp32,plan:bf16", "--block-shape", "2,8,16", "--json", str(path),
            "--workload", "users_bench_wl:make", "--workload-kwargs", '{"name": "tiny", "batch_size": 2}']
    assert main(args) == 0
    data = json.loads(path.read_text())
    assert "ByteLM 'tiny'" in data["targets_info"]["workload"] and "batch 2x" in data["targets_info"]["workload"]
    assert {(r["target"], r["variant"]) for r in data["rows"]} == {(t, v) for t in ("workload", "block") for v in ("fp32", "plan:bf16")}


def test_compiled_variant_trains_the_compiled_model_and_matches_eager_loss():
    # aot_eager: Dynamo + AOTAutograd as torch.compile runs them, without Inductor's C++ build.
    import torch

    config = dataclasses.replace(SMALL, variants=("fp32", "compiled:fp32"), steps=2)
    with pytest.MonkeyPatch.context() as patch:
        real = torch.compile
        patch.setattr(torch, "compile", lambda model: real(model, backend="aot_eager"))
        result = run_bench(TARGETS, config)
    rows = {(r.target, r.variant): r for r in result.rows}
    for target in ("workload", "block"):
        eager, compiled = rows[(target, "fp32")], rows[(target, "compiled:fp32")]
        assert compiled.final_loss == pytest.approx(eager.final_loss, rel=1e-4)
        assert compiled.saved_bytes == eager.saved_bytes


def test_config_error_is_a_value_error():
    assert issubclass(BenchConfigError, ValueError)


# -- CLI --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_bench_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    data = json.loads(path.read_text())
    assert len(data["rows"]) == 2 * len(DEFAULT_VARIANTS) and "targets:" in out and "[bench]" in err
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_negative_steps_is_one_line_error(capsys):
    status = main(["bench", "--steps", "-1"])
    err = capsys.readouterr().err
    assert status != 0 and err.startswith("autoprec: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_unknown_variant_is_one_line_error(capsys):
    status = main(["bench", "--variants", "fp32,plan:nope"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("autoprec: error: ") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_unavailable_device_is_one_line_error(capsys):
    status = main(["bench", "--quick", "--device", "cuda"])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("autoprec: error: ") and err.count("\n") == 1


def test_cli_check_fails_on_failed_target(monkeypatch, result, capsys):
    failed = dataclasses.replace(result, targets=[TargetCheck("made up", 2.0, 1.0, False)])
    monkeypatch.setattr("autoprec.bench.run_bench", lambda targets, config, progress=None: failed)
    assert main(["bench", "--quick"]) == 0
    assert main(["bench", "--quick", "--check"]) == 1


def test_cli_help_and_every_commands_help_exit_zero(capsys):
    # The commands are read off the top-level help, then each one's own help is asked for.
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    listing = capsys.readouterr().out.split("commands:", 1)[1]
    commands = [line.split()[0] for line in listing.splitlines() if line.startswith("    ") and not line.startswith("     ")]
    assert len(commands) >= 5 and "bench" in commands, commands
    for command in commands:
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"usage: autoprec {command}"), command


def test_cli_without_command_is_usage_error(capsys):
    assert main([]) == 2


def test_python_m_autoprec_bench_help():
    proc = subprocess.run([sys.executable, "-m", "autoprec", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--quick" in proc.stdout and proc.stderr == ""


def test_progress_rewrites_one_line_on_a_terminal():
    import io

    from autoprec.cli import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    progress = _Progress("bench", stream=stream)
    progress(1, 2, "warmup")
    progress(2, 2, "timed")
    progress.close()
    text = stream.getvalue()
    assert "\n" not in text and "timed round 2/2" in text and text.endswith("\r")
