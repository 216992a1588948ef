"""Bad input, the search job file (issue 25): a job name is a name (it cannot move the runs folder),
sizes are bounded with a message, and every refusal is one line naming the key."""

import pytest

from autoprec.errors import SearchError
from autoprec.job.config import MAX_MEASURE_TOP, load_job

JOB = """
[job]
name = {name}

[workload]
factory = "autoprec.workloads:default_workload"

[search]
measure_top = {top}
"""


def job(tmp_path, name='"tiny"', top=3):
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(name=name, top=top), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ['"../../x"', '"a/b"', '"..\\\\x"', '".."', '"."', '" "', '"a\\u0000b"', '"tab\\there"'])
def test_a_job_name_that_is_a_path_is_refused(tmp_path, name):
    with pytest.raises(SearchError, match=r"job.toml: \[job\].name: expected a name for the runs/ folder") as info:
        load_job(job(tmp_path, name=name))
    assert "\n" not in str(info.value)


def test_a_plain_job_name_writes_under_runs(tmp_path):
    config = load_job(job(tmp_path, name='"my job.v2"'))
    assert config.out == (tmp_path / "runs" / "my job.v2").resolve()


@pytest.mark.parametrize("top", [10**9, MAX_MEASURE_TOP + 1])
def test_measure_top_beyond_the_bound_is_refused_with_the_bound(tmp_path, top):
    with pytest.raises(SearchError, match=rf"\[search\].measure_top: expected an integer from 1 to {MAX_MEASURE_TOP}"):
        load_job(job(tmp_path, top=top))


def test_measure_top_at_the_bound_is_accepted(tmp_path):
    assert load_job(job(tmp_path, top=MAX_MEASURE_TOP)).measure_top == MAX_MEASURE_TOP


@pytest.mark.parametrize("text, named", [
    ('["\\n"]\nx = 1\n', r'unknown table \["\\n"\]'),
    ('[job]\n"na\\"me" = 1\n', r'\[job\]."na\\"me": unknown key'),
])
def test_a_table_or_key_name_with_a_newline_or_quote_is_named_on_one_line(tmp_path, text, named):
    # Found by tests/models/test_properties.py: an unknown table named "\n" made a two-line error.
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SearchError, match=named) as info:
        load_job(path)
    assert "\n" not in str(info.value)
