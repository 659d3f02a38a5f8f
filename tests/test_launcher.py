"""A launcher that cannot reach MPI (srun --mpi=none, another MPI's
mpiexec) makes every process a world of one: init says so instead of
letting each train alone."""

import os
import subprocess
import sys

import pytest

import commlib
from commlib.launcher import check_world_size, launched_tasks

SRUN_WITHOUT_PMI = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}


def test_srun_without_pmi_names_the_srun_option():
    with pytest.raises(commlib.LaunchError) as caught:
        check_world_size(1, SRUN_WITHOUT_PMI)
    message = str(caught.value)
    assert "srun started 4 processes, but MPI sees a world of 1" in message
    assert "--mpi=pmi2" in message and "--mpi=pmix" in message and "COMM_SELF" in message


def test_another_mpis_mpiexec_is_named():
    for environ in ({"PMI_SIZE": "3"}, {"OMPI_COMM_WORLD_SIZE": "3"}):
        with pytest.raises(commlib.LaunchError, match="another MPI than the one mpi4py loaded"):
            check_world_size(1, environ)


@pytest.mark.parametrize("world, environ", [
    (1, {}),                                                # plain python
    (1, {"SLURM_STEP_NUM_TASKS": "1"}),                      # srun -n 1
    (1, {"SLURM_NTASKS": "4"}),                              # a batch script, no srun
    (4, {"SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "4"}),     # srun --mpi=pmi2
    (4, {"OMPI_COMM_WORLD_SIZE": "4"}),                      # mpirun
    (1, {"OMPI_COMM_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"}),  # mpirun -n 1 in a step
    (1, {"SLURM_STEP_NUM_TASKS": "many"}),                   # not a count: no claim
])
def test_worlds_that_match_their_launcher_pass(world, environ):
    check_world_size(world, environ)


def test_an_mpi_launcher_is_believed_over_the_slurm_step_it_runs_in():
    environ = {"OMPI_COMM_WORLD_SIZE": "8", "SLURM_STEP_NUM_TASKS": "2"}
    assert launched_tasks(environ) == (8, "Open MPI's mpirun")


def _init_in_a_fresh_process(code, **env):
    return subprocess.run([sys.executable, "-c", "import commlib\n" + code],
                          env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_init_refuses_a_singleton_that_srun_started_as_one_of_four():
    result = _init_in_a_fresh_process("commlib.init()", **SRUN_WITHOUT_PMI)
    assert result.returncode != 0
    assert "LaunchError: srun started 4 processes" in result.stderr, result.stderr


def test_comm_self_is_a_world_of_one_on_purpose():
    code = "from mpi4py import MPI\nc = commlib.init(mpi_comm=MPI.COMM_SELF)\nprint(c.size)"
    result = _init_in_a_fresh_process(code, **SRUN_WITHOUT_PMI)
    assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr
