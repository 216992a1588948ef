"""Bad input, the study's storage failing while measuring (issue 25): a full disk or an Optuna
storage error ends `autoprec search` in one line saying so, that the committed trials are kept
and how to resume; the same command then resumes from them."""

import errno
import textwrap

import optuna
import pytest

from autoprec.cli import main

JOB = """
[job]
name = "tiny"
out = "out"
device = "cpu"

[workload]
factory = "autoprec.workloads:default_workload"
kwargs = { name = "tiny", batch_size = 4 }

[search]
formats = ["fp32", "bf16"]
measure_top = 2

[profile]
steps = 2
sensitivity_batches = 1

[measure]
val_batches = 2
steps = 1
"""


def _finished(path):
    storage = optuna.storages.RDBStorage(f"sqlite:///{path.parent / 'out' / 'study.db'}")
    return sum(
        t.state.is_finished()
        for s in storage.get_all_studies()
        for t in storage.get_all_trials(s._study_id)
    )


@pytest.mark.parametrize("failure, says", [
    (optuna.exceptions.StorageInternalError("An exception is raised during the commit."), "the study's storage failed (An exception is raised during the commit.)"),
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
])
def test_a_storage_failing_while_measuring_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys, failure, says):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(JOB), encoding="utf-8")
    real = optuna.storages.RDBStorage.set_trial_state_values
    calls = []

    def write(self, trial_id, state, values=None):
        calls.extend([state] if state.is_finished() else [])
        if len(calls) > 1:  # the first trial's result is committed, the second's write fails
            raise failure
        return real(self, trial_id, state, values)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", write)
    assert main(["search", str(path)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("autoprec: error:")]
    assert len(lines) == 1, err
    assert says in lines[0]
    assert "trials already committed" in lines[0] and f"run the same command (autoprec search {path.resolve()}) to resume" in lines[0]
    assert "Traceback" not in err
    committed = _finished(path)
    assert committed >= 1

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", real)
    assert main(["search", str(path)]) == 0
    assert _finished(path) > committed
