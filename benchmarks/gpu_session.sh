#!/usr/bin/env bash
# One call on a lent GPU machine (see README.md beside this file): `check` runs the GPU tests and
# the GPU suite's smoke sizes on CUDA (minutes: catches what breaks on the device before the long
# run); `bench` runs the full GPU suite. Logs and JSON go to $OUT. Carried wheels (.whl/, e.g.
# torchao) are installed first; the machine's own torch is used.
set -uo pipefail
phase=${1:?usage: gpu_session.sh check|bench}
out=${OUT:-/tmp/autoprec-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
} | tee "$out/environment.txt"
case $phase in
check)
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_runtime_gpu.py tests/test_profiling.py::test_steps_do_not_sync_on_cuda \
        2>&1 | tee "$out/gpu_tests.log" | tail -40
    timeout 200 python3 -m autoprec bench --suite gpu --smoke --device cuda --json "$out/gpu_smoke.json" >"$out/gpu_smoke.log" 2>&1
    echo "smoke rc $?"; tail -30 "$out/gpu_smoke.log"
    ;;
bench)
    timeout 560 python3 -m autoprec bench --suite gpu --json "$out/gpu_bench.json" 2>"$out/gpu_bench.stderr" | tee "$out/gpu_bench.txt"
    echo "bench rc $?"; tail -5 "$out/gpu_bench.stderr"
    ;;
esac
