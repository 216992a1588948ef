"""`autoprec.bench.step_profile`: the per-step profile a benchmark records beside a missed target.

Steps whose operators and kernels are known by construction, counted through the profiler; the
CUDA checks run on the GPU session (`benchmarks/gpu_session.sh`), skipped here without CUDA.
"""

import pytest
import torch
import torch.nn as nn

from autoprec.bench.step_profile import profile_steps

CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device: kernel launches and syncs cannot be counted on this machine"


def _three_adds(device: str):
    a, b = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)

    def step():
        c = torch.add(a, b)
        d = torch.add(c, b)
        return torch.add(d, a)

    return step


def test_a_cpu_step_of_three_adds_counts_three_aten_ops_per_step():
    profile = profile_steps(_three_adds("cpu"), 4, torch.device("cpu"))
    assert profile["steps"] == 4
    assert profile["aten_ops"] == 3
    assert profile["top"][0]["name"] == "aten::add" and profile["top"][0]["calls"] == 3
    assert 0 < profile["host_ms"] <= profile["wall_ms"]
    assert "kernels" not in profile  # CUDA's counts only where CUDA runs


def test_a_training_step_ranks_its_costliest_ops_and_counts_nested_ones():
    torch.manual_seed(0)
    layer, x = nn.Linear(256, 256), torch.randn(512, 256)

    def step():
        layer(x).square().sum().backward()

    profile = profile_steps(step, 2, torch.device("cpu"), top=3)
    assert len(profile["top"]) == 3
    times = [entry["ms"] for entry in profile["top"]]
    assert times == sorted(times, reverse=True)
    names = {entry["name"] for entry in profile["top"]}
    assert names & {"aten::addmm", "aten::mm"}  # the products are the costliest ops of this step
    assert profile["aten_ops"] > 5  # linear's own ops and backward's, nested ones included


def test_profiling_no_step_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        profile_steps(lambda: None, 0, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_a_cuda_step_of_three_adds_launches_three_kernels_and_syncs_nothing():
    profile = profile_steps(_three_adds("cuda"), 3, torch.device("cuda"))
    assert profile["kernels"] == 3
    assert profile["launches"] >= 3
    assert profile["syncs"] == 0 and profile["memcpy"] == 0
    assert profile["kernel_ms"] > 0 and profile["top"][0]["calls"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_a_cuda_step_that_reads_a_value_on_the_host_counts_its_sync():
    step = _three_adds("cuda")
    profile = profile_steps(lambda: step().sum().item(), 3, torch.device("cuda"))
    assert profile["syncs"] >= 1
    assert profile["memcpy"] >= 1  # the value's copy to the host
