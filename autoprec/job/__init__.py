"""The offline search job, `autoprec search JOB.toml`: an entry point of the planning pipeline.

Owns: `config` (`JobConfig`, the TOML file and its checks, `load_job`), `run` (`run_job`:
train and profile the workload, propose plans through `search.pipeline`, measure them with the
references in an Optuna study, write the plan and the review), `workers` (many processes, or
machines, measuring on one study). May import every part below the entry points (`search`,
`monitoring`, ...); imported by the CLI and users.
"""

from .config import JobConfig, load_job
from .run import JobResult, run_job

__all__ = ["JobConfig", "load_job", "JobResult", "run_job"]
