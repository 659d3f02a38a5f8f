"""Runs tests/mpi/ under mpiexec, and checks what every rank ran
(tests/rank_outcomes.py): a launch that exits 0 having skipped what it
should have run, or having run nothing, fails too.

Each file of tests/mpi names the world sizes at which it tests something
(``WORLD_SIZES``: 1 where the degenerate case is the point, odd sizes where
layouts care, 4 where two hosts or a Ulysses x Ring grid do). The full tier
launches every file at each of its sizes, the whole matrices at 2 and 3 ranks
and their samples where a launch repeats a world (the ``sampled`` tier:
1 rank, 4 ranks on two hosts, the checked rerun); the quick tier
(tests/tiers.py) launches every file once at 2 ranks and the files that name
3 at 3, leaving out their tests marked ``full``."""

import ast
import subprocess
import sys
from typing import Tuple

import pytest

import rank_outcomes
import tiers
from launch import TESTS, hosts_for, run

# a hang detector (COMMLIB_TIMEOUT=120 ends a stuck collective sooner): the
# whole suite at 4 ranks, oversubscribing a 2-core machine, took 560 s once;
# its framework half on 2 emulated hosts (TCP between them) 661 s
TIMEOUT_S = 1200
MPI_TESTS = TESTS / "mpi"
SIZES = (1, 2, 3, 4)
# the files whose tests are about the MPI library underneath: collectives,
# communicators and their lifecycle (splits, duplicates, frees, deadlines),
# point-to-point rings and stages. .ci/run reruns them under Open MPI; the
# rest (attention and MoE in each framework, transformers) sit above the
# same calls and show nothing more about another MPI.
MPI_LAYER = ("test_alltoallv.py", "test_collectives.py", "test_device_choice.py",
             "test_fuzz.py", "test_gpu_faults.py", "test_moe.py", "test_reliability.py",
             "test_ring.py", "test_staged.py", "test_topology.py", "test_ulysses.py")
# COMMLIB_CHECK=1 adds a fingerprint agreement before every collective: what
# it can catch or break is in the collectives and agreement themselves, and
# in the algorithms whose ranks pass different shapes legitimately (uneven
# lengths and heads, packed documents, routed counts) or check on the
# hybrid's sub-communicators, which a check must not refuse. The framework
# variants repeat the same collectives.
CHECKED = ("test_alltoallv.py", "test_collectives.py", "test_fuzz.py", "test_moe.py",
           "test_packed.py", "test_reliability.py", "test_ring.py", "test_ulysses.py",
           "test_ulysses_uneven.py")
# inference, masks and the matrices at 4 ranks in a launch of their own:
# the frameworks launch alone took 661 s of its 1200 s on 2 emulated hosts
SERVING = ("test_conformance.py", "test_generate.py", "test_inference.py", "test_masks.py",
           "test_moe_matrix.py", "test_moe_replicated.py")

# whole models (transformers, diffusers, the Trainer, compiled models) at 2
# and 3 ranks in a launch of their own: with them, the 2-rank launch came
# within a minute of its 1200 s on a loaded machine
MODELS = ("test_compile.py", "test_compile_inference.py", "test_compile_models.py",
          "test_diffusers.py", "test_generate.py", "test_generate_rebalance.py",
          "test_generate_recurrent.py", "test_model_axis.py", "test_trainer.py",
          "test_transformers_changes.py", "test_transformers_dense.py",
          "test_transformers_encoders.py", "test_transformers_gpt_oss.py",
          "test_transformers_mla.py",
          "test_transformers_moe.py", "test_transformers_placement.py",
          "test_transformers_recurrent.py")

# the quick tier's 3-rank launch: the attention matrix (odd sizes change
# every layout's cuts), and any file that does not run at 2
QUICK_AT_3 = ("test_conformance.py",)


def world_sizes(path) -> Tuple[int, ...]:
    """The ``WORLD_SIZES = (...)`` a file of tests/mpi states, read without
    importing it (an error names the file that lacks it)."""
    stated = [tuple(ast.literal_eval(node.value)) for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "WORLD_SIZES" for t in node.targets)]
    if len(stated) != 1:
        raise ValueError(f"{path.name} states WORLD_SIZES {len(stated)} times: state once at "
                         f"which world sizes it tests something, e.g. WORLD_SIZES = (2, 3)")
    sizes = stated[0]
    if not sizes or not set(sizes) <= set(SIZES):
        raise ValueError(f"{path.name}: WORLD_SIZES {sizes} must be some of {SIZES}")
    return sizes


def _files(nprocs, names=None, exclude=()):
    """tests/mpi's test files that run at ``nprocs`` ranks (of ``names``
    only, if given), less ``exclude``, sorted."""
    found = {path.name for path in MPI_TESTS.glob("test_*.py")
             if nprocs in world_sizes(path)}
    return sorted((found if names is None else found & set(names)) - set(exclude))


def _launch(nprocs, files, check, name, tier=None):
    """A launch of ``files`` at ``nprocs`` ranks in ``tier`` (default: this
    run's), across ``COMMLIB_TEST_HOSTS`` emulated hosts where they divide it
    (CI: the 4-rank launches on 2 hosts x 2)."""
    hosts = hosts_for(nprocs)
    return pytest.param(nprocs, hosts, files, check, tier or tiers.tier(),
                        id=name + (f"-on-{hosts}-hosts" if hosts > 1 else ""))


def _quick_files(nprocs):
    """The quick tier's files at 2 ranks (all that name 2) or at 3
    (``QUICK_AT_3``, and those that do not run at 2)."""
    at_two = _files(2)
    return at_two if nprocs == 2 else sorted(set(QUICK_AT_3) | (set(_files(3)) - set(at_two)))


def _launches():
    if not tiers.full():
        return [_launch(2, _quick_files(2), "0", "2-quick"),
                _launch(3, _quick_files(3), "0", "3-quick")]
    # the whole matrices where layouts differ (2 and 3 ranks); sampled where a
    # launch repeats a world for another reason (tests/tiers.py)
    return [_launch(1, _files(1), "0", "1", "sampled"),
            _launch(2, _files(2, exclude=MODELS + SERVING), "0", "2"),
            _launch(2, _files(2, SERVING, exclude=MODELS), "0", "2-serving"),
            _launch(2, _files(2, MODELS), "0", "2-models"),
            _launch(3, _files(3, exclude=MODELS + SERVING), "0", "3"),
            _launch(3, _files(3, SERVING, exclude=MODELS), "0", "3-serving"),
            _launch(3, _files(3, MODELS), "0", "3-models"),
            _launch(4, _files(4, MPI_LAYER), "0", "4-mpi-layer", "sampled"),
            _launch(4, _files(4, exclude=MPI_LAYER + SERVING), "0", "4-frameworks", "sampled"),
            _launch(4, _files(4, SERVING), "0", "4-serving", "sampled"),
            _launch(3, _files(3, CHECKED), "1", "3-checked", "sampled")]


LAUNCHES = _launches()


@pytest.mark.parametrize("nprocs, hosts, files, check, tier", LAUNCHES)
def test_mpi_suite(nprocs, hosts, files, check, tier, tmp_path, request):
    """tests/mpi at each world size (4 ranks in two launches, so that a second
    MPI can rerun the MPI layer alone); some of it once more with
    COMMLIB_CHECK=1."""
    argv = [sys.executable, str(TESTS / "mpi_pytest.py"), str(tmp_path),
            *(str(MPI_TESTS / name) for name in files)]
    env = {"COMMLIB_CHECK": check, "COMMLIB_TIMEOUT": "120", tiers.TIER_ENV: tier}
    if nprocs != 2:  # JAX's programs compiled as users do at 2 ranks (tests/tiers.py)
        env["XLA_FLAGS"] = tiers.quick_xla_flags()
    try:
        result = run(nprocs, argv, timeout=TIMEOUT_S, env=env, hosts=hosts)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tests/mpi at {nprocs} ranks did not finish in {TIMEOUT_S}s (a hang):\n"
                    + _logs(tmp_path, nprocs))
    ranks = rank_outcomes.read_launch(tmp_path, nprocs)
    request.config.stash.setdefault(rank_outcomes.SUMMARY_KEY, []).append(
        rank_outcomes.summary(request.node.name, ranks))
    assert result.returncode == 0, (f"tests/mpi failed at {nprocs} ranks "
                                    f"(exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                                    + _logs(tmp_path, nprocs))
    problems = rank_outcomes.problems(ranks)
    assert not problems, (
        f"tests/mpi at {nprocs} ranks passed, but not everything it should have ran "
        f"({len(problems)} problems). Install what is missing (pip install -e "
        "'.[test,torch,jax,transformers]'); a skip this world size or machine cannot avoid "
        "goes on rank_outcomes.ALLOWED_SKIPS:\n" + "\n".join(problems[:40]))


def test_the_named_selections_are_files_of_tests_mpi():
    """A misspelt or renamed file would drop out of its launch unseen."""
    every = {path.name for path in MPI_TESTS.glob("test_*.py")}
    missing = sorted(set(MPI_LAYER + CHECKED + SERVING + MODELS) - every)
    assert not missing, f"named in test_multirank.py but not in tests/mpi: {missing}"


def test_every_file_of_tests_mpi_states_its_world_sizes_and_runs_in_both_tiers():
    """Each file names where it tests something, and every file runs at
    least once in the full tier (and, at 2 ranks, in the quick tier)."""
    quick = {name for launch in ("2", "3") for name in _quick_files(int(launch))}
    for path in sorted(MPI_TESTS.glob("test_*.py")):
        assert world_sizes(path), path.name
        assert path.name in quick, f"{path.name} runs in no launch of the quick tier"



def test_every_launch_shares_one_jax_compilation_cache():
    """Two launches see the same cache directory, which exists, with every
    program kept however quick to compile."""
    show = ("import os; print(os.environ['JAX_COMPILATION_CACHE_DIR'], "
            "os.path.isdir(os.environ['JAX_COMPILATION_CACHE_DIR']), "
            "os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'])")
    seen = {run(1, [sys.executable, "-c", show], timeout=120).stdout.strip() for _ in range(2)}
    assert len(seen) == 1 and seen.pop().endswith(" True 0"), seen


def _logs(logdir, nprocs):
    parts = []
    for rank in range(nprocs):
        log = logdir / f"rank{rank}.log"
        text = log.read_text() if log.exists() else "(no log)"
        parts.append(f"----- rank {rank} -----\n{text[-6000:]}")
    return "\n".join(parts)
