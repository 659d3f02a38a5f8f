"""gpu_check.sh's step summaries (commlib.tools.gpu_check): counted over every
rank's junit report, and honest about a step killed before it wrote one."""

from commlib.tools.gpu_check import summarize

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="boom"/></testcase>
<testcase classname="tests.test_a" name="test_gpu" time="0">
<skipped message="no CUDA device here"/></testcase>
<testcase classname="tests.test_a" name="test_err" time="0"><error message="fixture"/></testcase>
</testsuite></testsuites>"""


def test_counts_every_rank_and_names_failures(tmp_path):
    reports = []
    for rank in range(2):
        reports.append(tmp_path / f"rank{rank}.xml")
        reports[-1].write_text(REPORT)
    line = summarize("mpi2", reports)
    assert line.startswith("mpi2: 2 passed, 2 failure, 2 error, 2 skipped over 2 report(s)")
    assert "2 x no CUDA device here" in line
    assert "tests.test_a::test_bad" in line and "tests.test_a::test_err" in line


def test_a_step_killed_before_its_report_says_so(tmp_path):
    assert "killed before pytest wrote one" in summarize("bench", [tmp_path / "absent.xml"])


def test_an_unreadable_report_is_named(tmp_path):
    broken = tmp_path / "rank0.xml"
    broken.write_text("<testsuites>")
    assert "unreadable junit report" in summarize("mpi1", [broken])
