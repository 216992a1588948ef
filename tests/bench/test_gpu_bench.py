"""`autoprec bench --suite gpu`: the GPU suite's code paths, run on CPU at --smoke sizes.

One smoke run of the command line (in a subprocess where Optuna, scipy and TensorBoard cannot be
imported, as on the GPU machines) is shared by the structure tests; the pieces with logic of their
own (the searched plan's choice, the FP8 plan, one failure staying one row) are tested directly.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autoprec.cli import main
from autoprec.device import has_scaled_mm, scaled_mm_form
from autoprec.formats import Format
from autoprec.bench.gpu import GpuBenchConfig
from autoprec.bench.gpu.e2e import BenchLM, E2EConfig, choose_formats, fp8_plan, linear_shapes
from autoprec.bench.gpu.layers import VARIANTS, measure_layers
from autoprec.bench.gpu.probe import PROBE_CONFIGS, run_probe
from support import torch_versions

ROOT = Path(__file__).resolve().parents[2]
SMOKE = GpuBenchConfig.from_preset("smoke")
# What the GPU machines lack; None in sys.modules makes `import name` raise ImportError.
BLOCK = "import sys\nfor name in ('optuna', 'scipy', 'tensorboard'):\n    sys.modules[name] = None\n"


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    # One thread: two OpenMP threads on a shared 2-core machine spin-wait (see conftest.py).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench") / "out.json"
    done = _python(
        "from autoprec.cli import main\nsys.exit(main(sys.argv[1:]))",
        "bench", "--suite", "gpu", "--smoke", "--device", "cpu", "--json", str(out),
    )
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_suite_imports_without_optuna_scipy_tensorboard():
    done = _python("import autoprec.bench.gpu, autoprec.cli\nautoprec.cli._build_parser()\nprint('imported')")
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_smoke_run_exits_zero_without_optuna_scipy_tensorboard(smoke):
    done, _ = smoke
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_json_names_device_torch_cuda_and_commit(smoke):
    env = smoke[1]["environment"]
    assert env["type"] == "cpu" and env["torch"] == torch.__version__
    assert "cuda" in env and len(env["git"]["commit"] or "") == 40


@pytest.mark.slow
def test_correctness_rows_cover_every_config_and_input(smoke):
    names = {row["name"] for row in smoke[1]["correctness"]}
    first = SMOKE.probe_tokens[0]
    inputs = [f"tokens{m}" for m in SMOKE.probe_tokens] + [f"transposed{first}", f"3d_2x{first // 2}", "state_dict_cpu_reload"]
    assert names == {f"probe/{config}/{name}" for config in PROBE_CONFIGS for name in inputs}


@pytest.mark.slow
def test_every_correctness_row_passes_on_cpu(smoke):
    failed = {row["name"]: row["detail"] for row in smoke[1]["correctness"] if row["ok"] is not True}
    assert not failed


@pytest.mark.slow
def test_correctness_rows_report_the_kernel_that_ran(smoke):
    # torch._scaled_mm and torch._int_mm run on CPU; row-wise scales only where the installed
    # torch's CPU kernel takes them (tests/support/torch_versions.py), else the row emulates and passes.
    ops = {tuple(row["name"].split("/")[1:3]): row["detail"]["ops"]["linear"] for row in smoke[1]["correctness"]}
    kernels = {"fp8_e4m3": "kernel torch._scaled_mm", "fp8_e5m2": "kernel torch._scaled_mm", "int8": "kernel torch._int_mm"}
    for (fmt, scaling), how in ops.items():
        if scaling == "row-current" and not torch_versions.CPU_SCALED_MM_ROW_SCALES:
            assert how.startswith("emulated (") and "row-wise scales" in how, (fmt, scaling, how)
        else:
            assert how == kernels[fmt], (fmt, scaling, how)


@pytest.mark.slow
def test_layer_rows_cover_every_shape_and_variant(smoke):
    rows = {(tuple(r["detail"]["shape"]), r["name"].rsplit("/", 1)[1]) for r in smoke[1]["layers"]}
    assert {(tuple(s), v.label) for s in SMOKE.layer_shapes for v in VARIANTS} <= rows


@pytest.mark.slow
def test_layer_rows_time_every_variant_that_can_run(smoke):
    rows = [r for r in smoke[1]["layers"] if not r["name"].split("/")[-1].startswith("torchao")]
    assert all(r["ok"] and r["detail"]["ms"] > 0 and r["detail"]["tflops"] > 0 for r in rows)


@pytest.mark.slow
def test_layer_rows_say_where_their_time_goes(smoke):
    rows = {r["name"].rsplit("/", 1)[1]: r["detail"] for r in smoke[1]["layers"] if r["ok"] and r["detail"]["shape"] == list(SMOKE.layer_shapes[0])}
    for label, detail in rows.items():
        profile = detail["profile"]
        assert profile["steps"] == 2 and profile["aten_ops"] > 0 and profile["top"], label
        assert all(entry["name"].startswith("aten::") for entry in profile["top"]), label
    # An FP8 layer's quantization (amax, scale, cast, transpose) is ops that BF16 autocast does not run.
    assert rows["autoprec_fp8_tensor_unfused"]["profile"]["aten_ops"] > rows["bf16_autocast"]["profile"]["aten_ops"]


@pytest.mark.slow
def test_torchao_rows_ran_or_say_why_not(smoke):
    rows = [r for r in smoke[1]["layers"] if r["name"].split("/")[-1].startswith("torchao")]
    assert rows and all(r["ok"] or (r["ok"] is None and "torchao" in r["detail"]["skipped"]) for r in rows)


@pytest.mark.slow
def test_searched_plan_is_chosen_from_the_measured_end_to_end_shapes(smoke):
    searched = smoke[1]["searched_plan"]
    shapes = {"x".join(map(str, s)) for s in linear_shapes(SMOKE.e2e).values()}
    assert searched["source"] == "per-layer timings" and set(searched["timings_ms"]) == shapes


@pytest.mark.slow
def test_every_end_to_end_plan_trains_and_its_loss_falls(smoke):
    rows = {r["name"]: r for r in smoke[1]["e2e"]}
    assert set(rows) == {"e2e/bf16_autocast", "e2e/fp8_all", "e2e/searched"}
    assert all(r["ok"] and r["detail"]["tokens_per_s"] > 0 and r["detail"]["loss_last"] < r["detail"]["loss_first"] for r in rows.values())


@pytest.mark.slow
def test_targets_are_not_judged_in_smoke(smoke):
    assert [t["passed"] for t in smoke[1]["targets"]] == [None, None, None, None]


@pytest.mark.slow
def test_table_is_printed_last_with_the_targets(smoke):
    done, _ = smoke
    lines = done.stdout.rstrip().splitlines()
    assert "correctness: 30/30 ok" in lines and lines[-5] == "targets:"


def test_full_suite_on_cpu_exits_2_naming_smoke(capsys):
    assert main(["bench", "--suite", "gpu", "--device", "cpu"]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_missing_plan_file_fails_before_any_work(tmp_path, capsys):
    assert main(["bench", "--suite", "gpu", "--smoke", "--device", "cpu", "--plan", str(tmp_path / "none.json")]) == 1
    assert "none.json" in capsys.readouterr().err


def test_choose_formats_takes_the_faster_format_per_shape():
    wide, narrow = (8, 16, 64), (8, 16, 16)
    ms = {(wide, Format.BF16): 2.0, (wide, Format.FP8_E4M3): 1.0, (narrow, Format.BF16): 1.0, (narrow, Format.FP8_E4M3): 3.0}
    chosen = choose_formats({"fc": wide, "proj": narrow}, ms)
    assert (chosen["fc"].format, chosen["proj"].format) == (Format.FP8_E4M3, Format.BF16)


def test_choose_formats_keeps_bf16_without_an_fp8_time():
    assert choose_formats({"fc": (8, 16, 64)}, {((8, 16, 64), Format.BF16): 2.0})["fc"].format is Format.BF16


def test_fp8_plan_puts_linears_in_fp8_and_attention_in_bf16():
    config = E2EConfig(n_layers=1, d_model=32, n_heads=2, seq=8, batch=2)
    model = BenchLM(config.lm_config())
    plan = fp8_plan(model, (torch.randint(0, 256, (2, 8)),))
    formats = {fqn: lp.format for fqn, lp in plan.layers.items()}
    assert formats == {**{fqn: Format.FP8_E4M3 for fqn in linear_shapes(config)}, "blocks.0.attn": Format.BF16}


@pytest.mark.slow
def test_a_failing_kernel_is_a_failed_row_and_the_probe_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no FP8 GEMM today")

    # Probed (and cached) with the real kernel before it breaks: the per-tensor forms, and the
    # row-wise form the row-current rows use (which torch 2.11's CPU kernel refuses).
    assert has_scaled_mm("cpu")[0]
    e4m3 = torch.float8_e4m3fn
    row_scales = scaled_mm_form("cpu", e4m3, e4m3, torch.bfloat16, row_scales=True, bias=True)[0]
    assert row_scales == torch_versions.CPU_SCALED_MM_ROW_SCALES
    monkeypatch.setattr(torch, "_scaled_mm", broken)
    rows = run_probe(torch.device("cpu"), (16, 16), (20, 24, 36))
    by_format = {fmt: [r for r in rows if r.name.startswith(f"probe/{fmt}/")] for fmt in ("fp8_e4m3", "int8")}
    emulated = [r for r in by_format["fp8_e4m3"] if "/row-current/" in r.name and not row_scales]
    assert all(not r.ok and "no FP8 GEMM today" in r.detail["error"] for r in by_format["fp8_e4m3"] if r not in emulated)
    assert all(r.ok for r in emulated + by_format["int8"])


def test_compiled_variants_do_not_start_after_the_deadline():
    variants = [v for v in VARIANTS if v.kind == "autocast"]
    rows = measure_layers([(8, 16, 16)], variants, torch.device("cpu"), warmup=1, repeats=1, backend="eager",
                          recompile_limit=1, deadline=time.monotonic() - 1)
    assert [(r.detail["compiled"], r.ok) for r in rows] == [(False, True), (True, None)]


def test_eager_target_compares_the_best_eager_fp8_variant_with_eager_bf16():
    from autoprec.bench.gpu import FP8_EAGER_SPEEDUP_TARGET, _targets
    from autoprec.bench.gpu.rows import Row

    config = GpuBenchConfig(layer_shapes=((64, 32, 32),))
    shape = [64, 32, 32]

    def row(variant, compiled, ms, **extra):
        return Row(f"layer/64x32x32/{variant}{'+compile' if compiled else ''}", True,
                   {"ms": ms, "shape": shape, "variant": variant, "compiled": compiled, "ops": extra})

    rows = [row("bf16_autocast", False, 2.0), row("bf16_autocast", True, 1.0),
            row("autoprec_fp8_tensor", False, 1.6, casts="fused Triton cast"), row("autoprec_fp8_tensor", True, 0.5),
            row("autoprec_fp8_tensor_unfused", False, 4.0, casts="PyTorch ops")]
    for r in rows:  # as measure_layers sets them
        r.detail["ratio_to_baseline"] = 1.0 / r.detail["ms"]
        if not r.detail["compiled"]:
            r.detail["ratio_to_eager_baseline"] = 2.0 / r.detail["ms"]
    eager = next(t for t in _targets(config, rows, [], judged=True) if "eager" in t.name)
    assert eager.value == pytest.approx(2.0 / 1.6) and eager.threshold == FP8_EAGER_SPEEDUP_TARGET and eager.passed
    assert "autoprec_fp8_tensor " in eager.detail and "fused Triton cast" in eager.detail


def test_eager_rows_on_a_datasheet_gpu_carry_the_cost_models_ratio_for_it(monkeypatch):
    from autoprec.bench.gpu import layers
    from autoprec.bench.gpu.report import predicted_lines
    from autoprec.costs import TARGETS

    # At the GPU run's large shape an H100 runs FP8 per tensor and in blocks faster than BF16
    # (block scaling's amax is fused into its tile cast), INT8 slower (its backward is FP32).
    ratios = layers.predicted_ratios((8192, 4096, 4096), VARIANTS, TARGETS["H100"])
    assert set(ratios) == {v.name for v in VARIANTS if v.kind == "autoprec" and not v.compiled}
    assert 1.0 < ratios["autoprec_fp8_tensor"] < ratios["autoprec_fp8_block"] and ratios["autoprec_int8"] < 1.0
    # On a GPU named in the datasheet table (here a CPU posing as one), measure_layers adds it to each eager autoprec row.
    monkeypatch.setattr(layers, "datasheet_target", lambda device: TARGETS["H100"])
    variants = [v for v in VARIANTS if v.name in ("bf16_autocast", "autoprec_fp8_tensor")]
    rows = measure_layers([(8, 16, 16)], variants, torch.device("cpu"), warmup=1, repeats=1, backend="eager", recompile_limit=1)
    marked = {(r.detail["variant"], r.detail["compiled"]): r.detail.get("predicted_ratio_to_eager_baseline") for r in rows}
    assert marked[("autoprec_fp8_tensor", False)] == pytest.approx(layers.predicted_ratios((8, 16, 16), variants, TARGETS["H100"])["autoprec_fp8_tensor"])
    assert marked[("bf16_autocast", False)] is None and marked[("autoprec_fp8_tensor", True)] is None
    (head, line) = predicted_lines(rows)
    assert head.startswith("eager x eager bf16 autocast, measured / predicted on NVIDIA H100 SXM5")
    fp8 = next(r for r in rows if r.detail["variant"] == "autoprec_fp8_tensor" and not r.detail["compiled"])
    assert line == f"  {fp8.name}: {fp8.detail['ratio_to_eager_baseline']:.2f} / {fp8.detail['predicted_ratio_to_eager_baseline']:.2f}"


def test_unfused_variant_runs_the_tensorwise_plan_with_pytorch_ops():
    from autoprec.bench.gpu.layers import UNFUSED

    unfused = next(v for v in VARIANTS if v.name == "autoprec_fp8_tensor_unfused")
    fused = next(v for v in VARIANTS if v.name == "autoprec_fp8_tensor" and not v.compiled)
    assert unfused is UNFUSED and not unfused.compiled and not unfused.fused_casts
    assert (unfused.format, unfused.scaling) == (fused.format, fused.scaling) and fused.fused_casts
    rows = measure_layers([(8, 16, 16)], [v for v in VARIANTS if not v.compiled and v.kind != "torchao"], torch.device("cpu"),
                          warmup=1, repeats=1, backend="eager", recompile_limit=1)
    by_variant = {r.detail["variant"]: r for r in rows}
    assert by_variant["autoprec_fp8_tensor_unfused"].detail["ops"]["casts"] == "PyTorch ops"
    assert all(r.ok and r.detail["ratio_to_eager_baseline"] > 0 for r in rows)
