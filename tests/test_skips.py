"""No skip goes unseen: the junit check of multi-rank launches
(tests/rank_outcomes.py), ``COMMLIB_TEST_REQUIRE=all`` (tests/requires.py)
and the CUDA probe's "no GPU here" against "CUDA here but broken"
(tests/cuda_probe.py)."""

import os
import subprocess
import sys
import types

import pytest

import cuda_probe
import rank_outcomes
import requires
from launch import TESTS


def _junit(path, *cases):
    """A junit file as pytest writes it, one <testcase> per ``cases`` entry:
    "pass", "fail", or ("skip", reason)."""
    body = []
    for index, case in enumerate(cases):
        inner = {"pass": "", "fail": '<failure message="assert 0">boom</failure>'}.get(case)
        if inner is None:
            inner = f'<skipped type="pytest.skip" message="{case[1]}">here: {case[1]}</skipped>'
        body.append(f'<testcase classname="tests.mpi.test_x" name="test_{index}" time="0.1">'
                    f'{inner}</testcase>')
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                    + "".join(body) + "</testsuite></testsuites>")
    return path


def _launch(tmp_path, world_size, *cases):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        _junit(tmp_path / f"rank{rank}.xml", *cases)
    return rank_outcomes.read_launch(tmp_path, world_size)


def test_a_skip_not_on_the_allowlist_fails_the_launch(tmp_path):
    ranks = _launch(tmp_path, 2, "pass", ("skip", "needs torch: torch is not installed"))
    found = rank_outcomes.problems(ranks)
    assert len(found) == 2 and all("needs torch" in line for line in found), found
    assert "NOT ALLOWED 1" in rank_outcomes.summary("tests/mpi[2]", ranks)


def test_a_world_size_skip_is_allowed_only_at_the_sizes_it_names(tmp_path):
    one_rank = ("skip", "needs two ranks to differ")
    assert rank_outcomes.problems(_launch(tmp_path / "1", 1, "pass", one_rank)) == []
    assert len(rank_outcomes.problems(_launch(tmp_path / "3", 3, "pass", one_rank))) == 3
    four = ("skip", "the late round needs 4 ranks")
    assert rank_outcomes.problems(_launch(tmp_path / "3b", 3, "pass", four)) == []
    assert rank_outcomes.problems(_launch(tmp_path / "4", 4, "pass", four)) != []


def test_a_file_skipped_at_import_fails_the_launch(tmp_path):
    (tmp_path / "test_needs_a_framework.py").write_text(
        "import requires\nrequires.module('no_such_framework_commlib_test')\n"
        "def test_never_runs():\n    pass\n")
    junit = tmp_path / "rank0.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", str(tmp_path)], cwd=tmp_path, capture_output=True,
                   env=_env_with_tests_on_path(), timeout=300)
    found = rank_outcomes.problems(rank_outcomes.read_launch(tmp_path, 1))
    assert len(found) == 1 and "collection skipped" in found[0], found


def test_a_launch_that_ran_nothing_or_wrote_no_report_fails(tmp_path):
    _junit(tmp_path / "rank0.xml")
    found = rank_outcomes.problems(rank_outcomes.read_launch(tmp_path, 2))
    assert found == ["rank 0 ran no test", "rank 1 wrote no junit report"]


def test_the_summary_counts_each_outcome_and_why_it_skipped(tmp_path):
    ranks = _launch(tmp_path, 1, "pass", "pass", "fail", ("skip", "needs a peer"),
                    ("skip", "no CUDA device here: no CUDA driver"))
    assert rank_outcomes.summary("tests/mpi[1]", ranks) == (
        "tests/mpi[1]: 2 passed, 1 failed, 2 skipped (no GPU 1, one rank 1), on its one rank")


def test_a_missing_framework_skips_unless_everything_is_required(monkeypatch):
    monkeypatch.delenv(requires.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_framework_commlib_test"):
        requires.module("no_such_framework_commlib_test")
    monkeypatch.setenv(requires.REQUIRE_ENV, "all")
    with pytest.raises(pytest.fail.Exception, match="COMMLIB_TEST_REQUIRE=all requires it"):
        requires.module("no_such_framework_commlib_test")
    assert requires.module("numpy").__name__ == "numpy"


def test_a_missing_commlib_module_is_an_error_never_a_skip():
    with pytest.raises(ModuleNotFoundError, match="commlib.no_such_module"):
        requires.module("commlib.no_such_module")


def test_an_unknown_require_value_is_refused(monkeypatch):
    monkeypatch.setenv(requires.REQUIRE_ENV, "yes")
    with pytest.raises(ValueError, match="the only value is 'all'"):
        requires.everything_required()


def test_under_require_all_a_file_skipped_at_import_is_an_error(tmp_path):
    (tmp_path / "test_needs_a_framework.py").write_text(
        "import requires\nrequires.module('no_such_framework_commlib_test')\n"
        "def test_never_runs():\n    pass\n")
    env = _env_with_tests_on_path(**{requires.REQUIRE_ENV: "all"})
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode != 0 and "1 error" in result.stdout, result.stdout


def _env_with_tests_on_path(**extra):
    """This environment, tests/ importable, ``COMMLIB_TEST_REQUIRE`` as told."""
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, **extra)
    if requires.REQUIRE_ENV not in extra:
        env.pop(requires.REQUIRE_ENV, None)
    return env


# -- the CUDA probe ------------------------------------------------------------

class _Driver:
    """libcuda.so.1's cuInit and cuDeviceGetCount, answering as told."""

    def __init__(self, init_status, devices=1):
        self.init_status, self.devices = init_status, devices

    def cuInit(self, flags):
        return self.init_status

    def cuDeviceGetCount(self, count):
        count._obj.value = self.devices
        return 0


@pytest.fixture
def driver(monkeypatch):
    """Install a fake CUDA driver (or none: ``driver(None)``); the probe's
    caches are cleared before and after."""
    def install(fake):
        def load():
            if fake is None:
                raise OSError("libcuda.so.1: cannot open shared object file")
            return fake
        monkeypatch.setattr(cuda_probe, "_load_driver", load)
        _clear()
    monkeypatch.delenv(requires.REQUIRE_ENV, raising=False)
    yield install
    _clear()


def _clear():
    cuda_probe.cuda_skip_reason.cache_clear()
    cuda_probe._no_device_reason.cache_clear()


@pytest.mark.parametrize("fake", [None, _Driver(cuda_probe.CUDA_ERROR_NO_DEVICE),
                                  _Driver(0, devices=0)], ids=["no-driver", "no-device", "zero"])
def test_no_gpu_here_is_a_clean_skip_the_multirank_check_allows(driver, fake):
    driver(fake)
    for framework in ("torch", "jax", "cupy"):
        reason = cuda_probe.cuda_skip_reason(framework)
        assert reason.startswith(cuda_probe.NO_DEVICE), reason
        assert rank_outcomes.allowed(reason, 3) is not None, reason


def test_a_failing_driver_is_an_error(driver):
    driver(_Driver(999))
    with pytest.raises(cuda_probe.CudaBrokenError, match="CUDA error 999"):
        cuda_probe.cuda_skip_reason("torch")


def test_a_gpu_with_a_framework_lacking_cuda_is_a_missing_requirement(driver, monkeypatch):
    torch = requires.module("torch")
    monkeypatch.setattr(torch.version, "cuda", None)
    driver(_Driver(0))
    reason = cuda_probe.cuda_skip_reason("torch")
    assert "build without CUDA" in reason and rank_outcomes.allowed(reason, 1) is None
    _clear()
    monkeypatch.setenv(requires.REQUIRE_ENV, "all")
    with pytest.raises(pytest.fail.Exception, match="build without CUDA"):
        cuda_probe.cuda_skip_reason("torch")


def test_a_gpu_with_a_cuda_framework_that_cannot_use_it_is_an_error(driver, monkeypatch):
    fake_torch = types.SimpleNamespace(
        __version__="9.9", version=types.SimpleNamespace(cuda="12.4"),
        cuda=types.SimpleNamespace(is_available=lambda: False, init=_raise_no_driver))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    driver(_Driver(0))
    with pytest.raises(cuda_probe.CudaBrokenError, match="torch, built with CUDA support, "
                                                         "cannot use it .*no NVIDIA driver"):
        cuda_probe.cuda_skip_reason("torch")


def _raise_no_driver():
    raise RuntimeError("Found no NVIDIA driver on your system")
