#!/usr/bin/env bash
# The GPU session, one device-tool call per phase (see README.md beside this file):
#   wheels  here, with network: download into .whl/ what the GPU machines lack (Optuna and its
#           pure-Python dependencies, torchao) for their Python 3.12; carry it: carry [".whl"]
#   check   the GPU tests, then the GPU suite's smoke sizes on CUDA (minutes)
#   bench   the full GPU suite
#   search  `autoprec search` on the built-in job (needs the carried Optuna)
# Each phase installs the carried wheels first (the machine's own torch is used) and leaves at
# most 8 files, none over 16 MiB, directly in $OUT (the device tool's return limits).
#
# --dry-run (after the phase): on this CPU, every command exactly as there, with $PYTHON (default
# python3; give it torch 2.11 to match the machines), --device cpu and the smoke sizes, into a
# temporary $OUT that is then checked against the return limits.
set -uo pipefail
phase=${1:?usage: gpu_session.sh wheels|check|bench|search [--dry-run]}
dry=${2:-}
py=${PYTHON:-python3}
# Pinned to the versions CI tests; Optuna's own needs beside those the machines have (numpy,
# packaging, tqdm, PyYAML, MarkupSafe, typing-extensions are installed there).
wheels=(optuna==5.0.0 alembic==1.20.1 colorlog==6.12.0 Mako==1.4.3 SQLAlchemy==2.1.9 torchao==0.17.0)

if [ "$phase" = wheels ]; then
    mkdir -p .whl
    exec "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
fi

if [ "$dry" = --dry-run ]; then
    OUT=$(mktemp -d /tmp/autoprec-gpu-dry.XXXXXX)
    device=cpu smoke=--smoke
    echo "dry run: $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'), OUT=$OUT"
else
    device=cuda smoke=
fi
out=${OUT:-/tmp/autoprec-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    # As the device README says: no index there, no dependency resolution, into a target folder.
    # A dry run on another Python installs the same files for 3.12, as pip would there.
    target=/tmp/site
    extra=()
    [ "$dry" = --dry-run ] && target=$out.site && extra=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${extra[@]}" .whl/*.whl \
        && export PYTHONPATH=$target:$PWD
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  "$py" -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  "$py" -c "import optuna; print('optuna', optuna.__version__)" 2>&1 | tail -1
} | tee "$out/environment.txt"
failed=()  # the commands that exited non-zero (or timed out: 124), named in the last line
ran() { local rc=$1; shift; echo "$* rc $rc"; [ "$rc" -eq 0 ] || failed+=("$*=$rc"); }
case $phase in
check)
    # --check: a failing correctness row fails the command (the smoke sizes judge no speed target).
    timeout 300 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_runtime_gpu.py tests/test_profiling.py::test_steps_do_not_sync_on_cuda \
        2>&1 | tee "$out/gpu_tests.log" | tail -40
    ran "${PIPESTATUS[0]}" tests
    timeout 200 "$py" -m autoprec bench --suite gpu --smoke --check --device "$device" --json "$out/gpu_smoke.json" >"$out/gpu_smoke.log" 2>&1
    ran $? smoke; tail -30 "$out/gpu_smoke.log"
    ;;
bench)
    timeout 560 "$py" -m autoprec bench --suite gpu $smoke --device "$device" --json "$out/gpu_bench.json" 2>"$out/gpu_bench.stderr" | tee "$out/gpu_bench.txt"
    ran "${PIPESTATUS[0]}" bench; tail -5 "$out/gpu_bench.stderr"
    ;;
search)
    # The job's outputs (study, TensorBoard logs) stay on the machine; the plan and log come back.
    job=/tmp/autoprec-search.toml
    # A dry run searches at smoke size (the "tiny" ByteLM, 10 profiled steps): the real job takes
    # 5-10 minutes on a loaded 2-core CPU; every step of the pipeline still runs.
    smoke_job=()
    [ "$dry" = --dry-run ] && smoke_job=(-e 's|name = "small"|name = "tiny"|' -e 's|^steps = 100 |steps = 10 |')
    sed -e "s|^out = .*|out = \"/tmp/autoprec-search\"|" -e "s|^device = .*|device = \"$device\"|" "${smoke_job[@]}" searches/bytelm.toml >"$job"
    cp "$job" "$out/search_job.toml"
    rm -rf /tmp/autoprec-search  # a fresh study, not a resumed one
    timeout 560 "$py" -m autoprec search "$job" >"$out/search.log" 2>&1
    ran $? search; tail -30 "$out/search.log"
    cp /tmp/autoprec-search/plan.json "$out/plan.json" 2>/dev/null
    ;;
*)
    echo "unknown phase $phase (wheels|check|bench|search)"; exit 2
    ;;
esac
if [ "$dry" = --dry-run ]; then
    # The device tool returns at most 8 files, 16 MiB each, 64 MiB in all, 2 folders down.
    files=$(find "$out" -type f | wc -l)
    big=$(find "$out" -type f -size +16M | wc -l)
    deep=$(find "$out" -mindepth 4 -type f | wc -l)
    total=$(du -sm "$out" | cut -f1)
    echo "OUT: $files files, $big over 16 MiB, $deep too deep, ${total} MiB"
    [ "$files" -le 8 ] && [ "$big" -eq 0 ] && [ "$deep" -eq 0 ] && [ "$total" -le 64 ] || { echo "OUT breaks the return limits"; exit 1; }
fi
if [ ${#failed[@]} -gt 0 ]; then echo "$phase: FAILED ${failed[*]}"; exit 1; fi
echo "$phase: ok"
