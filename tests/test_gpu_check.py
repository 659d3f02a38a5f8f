"""gpu_check.sh's step summaries (commlib.tools.gpu.check): counted over every
rank's junit report, and honest about a step killed before it wrote one."""

from commlib.tools.gpu.check import summarize

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


def test_the_transport_each_rank_chose_is_counted(tmp_path):
    """A launch where one rank fell back to MPI shows it (tests/mpi/conftest.py
    records the property)."""
    reports = []
    for rank, backend in enumerate(("nccl", "mpi")):
        reports.append(tmp_path / f"rank{rank}.xml")
        reports[-1].write_text(REPORT.replace(
            '<testsuite name="pytest" tests="4">',
            '<testsuite name="pytest" tests="4"><properties>'
            f'<property name="commlib_backend" value="{backend}"/></properties>'))
    assert "; backend mpi on 1, nccl on 1" in summarize("nccl2", reports)


def test_nccl_peers_refuses_an_nccl_without_shared_gpus(monkeypatch):
    """Before NCCL 2.30 two ranks cannot share the GPU in one communicator:
    the NCCL steps are not run, and the reason is printed."""
    from click.testing import CliRunner

    from commlib.tools.gpu import check as gpu_check
    main = gpu_check.main
    monkeypatch.setattr(gpu_check, "nccl_version_code", lambda: 22907)
    refused = CliRunner().invoke(main, ["nccl-peers"])
    assert refused.exit_code == 1
    assert "NCCL 2.29.7: ranks share one GPU in an NCCL communicator from NCCL 2.30 only" \
        in str(refused.exception)
    monkeypatch.setattr(gpu_check, "nccl_version_code", lambda: 23206)
    allowed = CliRunner().invoke(main, ["nccl-peers"])
    assert allowed.exit_code == 0 and "NCCL 2.32.6: ranks share the GPU" in allowed.output
