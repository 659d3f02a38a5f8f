"""Detection of a CUDA-aware MPI (backends.cuda_aware): the environment
override, mpi4py's query, the MPIX_Query_cuda_support symbol and the memory
allocation kinds, each with the MPI library stood in for; then what the MPI
library of this machine says."""

import ctypes

import pytest

from commlib.backends import cuda_aware
from commlib.backends.cuda_aware import ENV, Support, ask_library, detect, from_env


class Info:
    def __init__(self, values):
        self.values, self.freed = values, False

    def Get(self, key):
        return self.values.get(key)

    def Free(self):
        self.freed = True


class Comm:
    def __init__(self, info):
        self.info = info

    def Get_info(self):
        if self.info is None:
            raise NotImplementedError("MPI_Comm_get_info")
        return self.info


class FakeMPI:
    """An mpi4py.MPI without Query_cuda_support, with COMM_SELF's info."""

    def __init__(self, kinds=None, info=True):
        values = {} if kinds is None else {"mpi_memory_alloc_kinds": kinds}
        self.COMM_SELF = Comm(Info(values) if info else None)


class Library:
    """A shared library that may export MPIX_Query_cuda_support."""

    def __init__(self, answer=None, name="libmpi.so.40"):
        self._name = name
        if answer is not None:
            self.MPIX_Query_cuda_support = lambda: answer


@pytest.mark.parametrize("raw, aware", [("1", True), ("true", True), (" ON ", True),
                                        ("0", False), ("no", False), ("off", False)])
def test_the_environment_decides_first(raw, aware):
    support = detect({ENV: raw})
    assert support.aware is aware and ENV in support.reason


@pytest.mark.parametrize("raw", ["", "auto", "AUTO"])
def test_unset_or_auto_asks_the_library(raw):
    assert from_env({ENV: raw}) is None and from_env({}) is None


def test_a_bad_value_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="COMMLIB_MPI_CUDA_AWARE='maybe'.*use 1"):
        detect({ENV: "maybe"})


def test_mpi4py_query_when_it_has_one():
    mpi = FakeMPI(kinds="mpi,system")
    mpi.Query_cuda_support = lambda: True
    support = ask_library(mpi, [Library(0)])
    assert support == Support(True, "mpi4py's MPI.Query_cuda_support() returned True")


@pytest.mark.parametrize("answer, aware", [(1, True), (0, False)])
def test_the_library_symbol(answer, aware):
    support = ask_library(FakeMPI(kinds="mpi,system,cuda"), [Library(), Library(answer)])
    assert support.aware is aware
    assert support.reason == f"MPIX_Query_cuda_support() in libmpi.so.40 returned {answer}"


def test_the_symbol_is_called_as_int_of_void():
    """restype and argtypes are set before the call (ctypes' default would
    do, but say so)."""
    library = Library(1)
    ask_library(FakeMPI(), [library])
    function = library.MPIX_Query_cuda_support
    assert function.restype is ctypes.c_int and function.argtypes == []


@pytest.mark.parametrize("kinds, aware", [("mpi,system", False), ("mpi,system,cuda", True),
                                          ("mpi, system, cuda:device", True),
                                          ("mpi,system,cuda:host", False),
                                          ("mpi,system,rocm:device", False)])
def test_memory_kinds_when_there_is_no_symbol(kinds, aware):
    mpi = FakeMPI(kinds=kinds)
    support = ask_library(mpi, [Library(None)])
    assert support.aware is aware and repr(kinds) in support.reason
    assert mpi.COMM_SELF.info.freed


@pytest.mark.parametrize("mpi", [FakeMPI(), FakeMPI(info=False)], ids=["no-kinds", "no-info"])
def test_unknown_when_the_library_says_nothing(mpi):
    support = ask_library(mpi, [Library(None)])
    assert support.aware is None and f"set {ENV}=1" in support.reason


def test_this_machines_mpi(monkeypatch):
    """The MPI library mpi4py loaded here answers through its symbol; the
    mpich wheel is built without GPU support, so it says False."""
    monkeypatch.delenv(ENV, raising=False)
    from mpi4py import MPI
    support = detect()
    assert support == cuda_aware._library_answer()  # asked once, then remembered
    assert support.reason.startswith(("MPIX_Query_cuda_support() in ", "mpi4py's",
                                      "MPI_COMM_SELF's"))
    if "pypi.org/p/mpich" in MPI.Get_library_version():
        assert support.aware is False, support
