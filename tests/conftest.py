"""Test-wide settings."""

import os

import pytest
import torch

# Without CUDA, Triton kernels run only under its interpreter, and only when TRITON_INTERPRET is
# set before triton is first imported (its own library functions are decorated then): the fused
# casts' tests (test_triton_cast.py) run that way on CPU. With CUDA it stays unset: compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.cuda_rules import CudaRules

# The test models are small, so a second intra-op thread buys little, while two OpenMP threads on
# two cores that another process also uses spin-wait: a 10 s training test was measured at 331 s
# that way. One thread keeps the suite's time steady on a shared machine.
torch.set_num_threads(1)

# The roofline time model (``measure_costs=False``, `costs.RooflineTimeModel`) calibrates a CPU's
# peaks once per process by timing one GEMM per format: on a shared machine the bandwidth read
# varies twofold between processes, and the plans a test searches with it changed with it (a
# seed-API test then missed its accuracy budget in some runs). Tests plan with this machine's
# median calibration instead, the same in every run and on every CPU; what a calibration measures
# is tested on its own (test_costs, through `_measure`, uncached).
def _test_peaks(device):
    from autoprec.costs import DevicePeaks
    from autoprec.formats import Format

    flops = {Format.FP32: 1e11, Format.BF16: 2e11, Format.FP16: 3e9, Format.FP8_E4M3: 4e10, Format.FP8_E5M2: 5e10, Format.INT8: 4e11}
    return DevicePeaks("test CPU", flops, 3e10, 2e-6, "fixed for the tests (tests/conftest.py)")


def _pin_cpu_peaks():
    from autoprec.costs import product_times as timing

    calibrate = timing.calibrate_peaks
    timing.calibrate_peaks = lambda device: _test_peaks(device) if torch.device(device).type == "cpu" else calibrate(device)


_pin_cpu_peaks()

# Test files whose every test runs under `CudaRules`: the runtime and what drives it. A kernel
# call or FP8 cast that an H100 would refuse fails the test there, though the CPU accepts it.
CUDA_RULES_MODULES = frozenset({"test_runtime", "test_profiling", "test_costs", "test_scheduler"})


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "no_cuda_rules(reason): run this test without the CudaRules checker; the reason is required"
    )


@pytest.fixture(autouse=True)
def cuda_rules(request):
    """`CudaRules` around each test of `CUDA_RULES_MODULES`, unless marked ``no_cuda_rules``.

    Violations fail the test at teardown, listed one per line.
    """
    if request.module.__name__.rpartition(".")[2] not in CUDA_RULES_MODULES:
        yield None
        return
    opt_out = request.node.get_closest_marker("no_cuda_rules")
    if opt_out is not None:
        reason = opt_out.kwargs.get("reason") or (opt_out.args[0] if opt_out.args else "")
        if not str(reason).strip():
            pytest.fail("@pytest.mark.no_cuda_rules needs a reason: no_cuda_rules(reason='why CudaRules cannot apply')", pytrace=False)
        yield None
        return
    with CudaRules() as rules:
        yield rules
