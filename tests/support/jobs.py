"""A search job file on the built-in LM ("tiny"), written for `autoprec search`."""

import textwrap

JOB = """
[job]
name = "tiny"
out = "out"
device = "cpu"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = {{ name = "tiny", batch_size = 4 }}

[budgets]
memory = {memory}
accuracy = 0.05

[search]
formats = ["fp32", "bf16", "fp8_e4m3", "int8"]
measure_top = 2

[rules]
groups = [["blocks.0.attn", "blocks.0.attn.qkv"]]

[profile]
steps = 10
sensitivity_batches = 1
{profile}

[measure]
val_batches = 2
steps = 1
"""


def write_job(folder, memory=0.85, profile="", name="job.toml"):
    path = folder / name
    path.write_text(textwrap.dedent(JOB.format(memory=memory, profile=profile)), encoding="utf-8")
    return path
