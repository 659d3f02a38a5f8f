"""How often MoE makes the host wait for the device (issue 12, item 8), at
world size 1, in NumPy, torch (CPU) and JAX.

The minimum, and what this code reaches:

- ``dispatch``: ONE read. The transport must know, before anything moves,
  how many rows go to each rank; that copy also carries, at no extra wait,
  the rows each forwarder will pass on (two hops: exchanged between hosts,
  so the forwarder does not look at its device again), the assignments and
  drops per expert (the stats, whose allreduce also gives each owner its
  rows per local expert) and the smallest and largest expert id (checked on
  the host, so a bad id still raises the same error on every rank).
- ``combine``, ``dispatch_backward``, ``combine_backward``: NONE. They reuse
  the counts and index arrays kept in the handle.
- ``route``: ONE integer: the number of rows of logits holding NaN or inf,
  and whether the bias does, packed together.

The code before this change, with torch tensors, read the device through
``to_host`` 3 times per flat dispatch (the per-expert counts for the stats,
the per-rank send counts, the owner's per-expert counts), 4 times with two
hops, once more under a capacity (the drops); and besides, which the torch
witness below flags: ``int()`` of the smallest and largest id, one
boolean-mask compaction and one upload of the expert map per hop, and
``nonzero`` under a capacity. About ten waits per dispatch on a GPU.
``route`` read twice with a bias. (NumPy's old ``counts`` used a host
bincount, so the old NumPy flat path already had one ``to_host``.)

Two witnesses, so that a read cannot hide:

- every ``to_host`` and ``host_int`` (the one named way for commlib's
  algorithms to read device data) is replaced by a counter;
- under torch, a ``TorchFunctionMode`` sees every torch call made from
  commlib's algorithm code (commlib/moe, commlib/namespace.py) and flags
  each one that makes the host wait for a CUDA device: ``.item()``,
  ``int()``/``float()``/``bool()`` of a tensor, ``.tolist()``, ``.numpy()``,
  ``.cpu()``, ``nonzero``, boolean-mask indexing, ``unique``, ``bincount``
  (sized from the data on a GPU), and tensors made from host data (a
  blocking upload). The reads inside ``to_host``/``host_int`` are the
  counted ones; calls the transport makes (commlib.communicator, arrays,
  backends: host tensors are viewed as NumPy there) are its own business.
  On a CPU these calls wait for nothing, but they are the same calls the
  code makes on a GPU: the code path has no CPU-only branch for torch.
"""

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import commlib
from commlib import namespace
from commlib.moe import Dispatcher, route

import requires

COMMLIB = Path(commlib.__file__).resolve().parent
ALGORITHMS = (COMMLIB / "moe", COMMLIB / "namespace.py")
READERS = ("to_host", "host_int")  # the sanctioned, counted reads in namespace.py
EXPERTS, K, TOKENS, HIDDEN = 8, 3, 40, 5

DISPATCH_READS = 1
COMBINE_READS = BACKWARD_READS = 0
ROUTE_READS = 1


@pytest.fixture(scope="module")
def comm():
    c = commlib.init()
    yield c
    c.free()


class Reads:
    """Counts the calls of ``to_host`` and ``host_int`` wherever commlib
    imported them."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in READERS:
            original = getattr(namespace, name, None)
            if original is None:
                continue
            counted = self._counting(name, original)
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("commlib") \
                        and getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, counted)

    def _counting(self, name, original):
        def counted(x):
            self.calls.append(name)
            return original(x)
        return counted

    @contextmanager
    def during(self, found: list):
        """``found`` gets the reads made inside the block."""
        before = len(self.calls)
        yield
        found.extend(self.calls[before:])


def _torch_witness(roots=ALGORITHMS):
    """A TorchFunctionMode that lists the torch calls, made from code under
    ``roots``, that would make the host wait for a CUDA device."""
    torch = requires.module("torch")
    from torch.overrides import TorchFunctionMode

    waits = {"item", "__int__", "__float__", "__bool__", "__index__", "__complex__", "tolist",
             "numpy", "cpu", "__array__", "nonzero", "argwhere", "masked_select", "unique",
             "unique_consecutive", "bincount", "histc", "equal", "allclose"}
    uploads = {"asarray", "as_tensor", "tensor", "from_numpy"}
    transport = (COMMLIB / "communicator.py", COMMLIB / "arrays.py", COMMLIB / "backends",
                 COMMLIB / "consistency.py", COMMLIB / "watchdog.py")

    def is_mask(index):
        parts = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    def why(name, args, kwargs):
        if name in waits:
            return name
        if name == "repeat_interleave" and "output_size" not in kwargs:
            return name
        if name == "where" and len(args) + len(kwargs) == 1:
            return "where(condition) (nonzero)"
        if name in ("__getitem__", "__setitem__", "index_put", "index_put_") \
                and len(args) > 1 and is_mask(args[1]):
            return f"{name} with a boolean mask"
        if name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
            return "to(cpu)"
        if name in uploads and args and isinstance(args[0], (np.ndarray, list, tuple)):
            return f"{name} of host data (an upload)"
        return None

    def caller():
        """The innermost frame of ``roots``, unless the transport or a
        sanctioned reader is nearer."""
        frame = sys._getframe(2)
        while frame is not None:
            path = Path(frame.f_code.co_filename).resolve()
            if any(path == t or t in path.parents for t in transport):
                return None
            if path == COMMLIB / "namespace.py" and frame.f_code.co_name in READERS:
                return None
            if any(path == r or r in path.parents for r in roots):
                return f"{path.name}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return None

    class Witness(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.waits = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            reason = why(getattr(func, "__name__", str(func)), args, kwargs)
            if reason is not None:
                where = caller()
                if where is not None:
                    self.waits.append(f"{reason} at {where}")
            return func(*args, **kwargs)

    return Witness()


@pytest.fixture
def reads(monkeypatch):
    return Reads(monkeypatch)


def _impl(name):
    if name == "numpy":
        return np.asarray
    if name == "torch":
        return requires.module("torch").as_tensor
    return requires.module("jax.numpy").asarray


def _routing(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    experts = np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(TOKENS)])
    experts[rng.random(experts.shape) < 0.2] = -1
    return x, experts, rng.random((TOKENS, K)).astype(np.float32)


@contextmanager
def _watched(framework):
    """The torch witness around the block (nothing for other frameworks);
    yields the list of flagged calls."""
    if framework != "torch":
        yield []
        return
    with _torch_witness() as witness:
        yield witness.waits


def _dispatch_cases():
    """NumPy and torch: flat and two hops, with and without a capacity.
    JAX (whose eager mode compiles every operation for every new shape):
    the case that runs every path, two hops under a capacity."""
    for framework in ("numpy", "torch"):
        for hierarchical, hops in ((False, "flat"), (True, "two-hop")):
            for capacity, cap in ((None, "no-cap"), (0.5, "cap")):
                yield pytest.param(framework, hierarchical, capacity,
                                   id=f"{framework}-{hops}-{cap}")
    yield pytest.param("jax", True, 0.5, id="jax-two-hop-cap")


@pytest.mark.parametrize("framework, hierarchical, capacity", list(_dispatch_cases()))
def test_dispatch_reads_the_device_once_and_nothing_after(comm, reads, framework, hierarchical,
                                                          capacity):
    asarray = _impl(framework)
    x, experts, weights = (asarray(a) for a in _routing())
    d = Dispatcher(comm, EXPERTS, capacity_factor=capacity, hierarchical=hierarchical)
    d.dispatch(x, experts, weights)  # the first dispatch on a device uploads the hop maps
    counted = {phase: [] for phase in ("dispatch", "combine", "dispatch_backward",
                                       "combine_backward")}
    with _watched(framework) as waits:
        with reads.during(counted["dispatch"]):
            expert_x, handle = d.dispatch(x, experts, weights)
        with reads.during(counted["combine"]):
            y = d.combine(expert_x * 2, handle)
        with reads.during(counted["dispatch_backward"]):
            d.dispatch_backward(expert_x, handle)
        with reads.during(counted["combine_backward"]):
            d.combine_backward(expert_x, y, handle, K)
    assert {phase: len(calls) for phase, calls in counted.items()} == {
        "dispatch": DISPATCH_READS, "combine": COMBINE_READS,
        "dispatch_backward": BACKWARD_READS, "combine_backward": BACKWARD_READS}, counted
    assert waits == []
    # conservation: every assignment was delivered or dropped
    assert handle.stats.tokens_per_expert.sum() + handle.stats.dropped.sum() \
        == (_routing()[1] >= 0).sum()


def test_a_bad_expert_id_is_still_refused_with_its_values(comm, reads):
    x, experts, weights = _routing()
    experts[3, 1], experts[5, 0] = EXPERTS, -4
    found = []
    with reads.during(found), pytest.raises(commlib.CollectiveMismatchError,
                                            match=rf"expert indices must lie in \[-1, {EXPERTS}\) "
                                                  rf"\(-1: no expert\), got values from -4 to "
                                                  rf"{EXPERTS}"):
        Dispatcher(comm, EXPERTS).dispatch(x, experts, weights)
    assert len(found) == DISPATCH_READS


def test_torch_autograd_step_reads_the_device_once(comm, reads):
    """Forward and backward through commlib.bindings.torch: the dispatch's
    one read, nothing in combine or either backward."""
    torch = requires.module("torch")
    from commlib.bindings.torch import Dispatcher as TorchDispatcher

    x, experts, weights = (torch.as_tensor(a) for a in _routing(1))
    x.requires_grad_(True)
    weights.requires_grad_(True)
    d = TorchDispatcher(comm, EXPERTS, hierarchical=True)
    d.dispatch(x, experts, weights)  # uploads the hop maps
    found = []
    with _torch_witness() as witness, reads.during(found):
        expert_x, handle = d.dispatch(x, experts, weights)
        y = d.combine(torch.tanh(expert_x), handle)
        y.square().sum().backward()
    assert len(found) == DISPATCH_READS and witness.waits == [], (found, witness.waits)
    assert x.grad is not None and weights.grad is not None


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_route_reads_one_integer(reads, framework):
    asarray = _impl(framework)
    rng = np.random.default_rng(2)
    logits = asarray(rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32))
    bias = asarray(np.linspace(-1, 1, EXPERTS).astype(np.float32))
    found = []
    with _watched(framework) as waits, reads.during(found):
        route(logits, K, score="sigmoid", bias=bias, num_groups=4, topk_groups=2)
    assert len(found) == ROUTE_READS and waits == [], (found, waits)


def test_route_errors_keep_their_order(reads):
    """Bad logits are reported before a bad bias, as before the two checks
    shared their read."""
    logits = np.zeros((4, EXPERTS), np.float32)
    logits[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or inf values in 1 of 4 rows"):
        route(logits, 2, bias=np.zeros(EXPERTS - 1, np.float32))
    with pytest.raises(ValueError, match="bias must have shape"):
        route(np.zeros((4, EXPERTS), np.float32), 2, bias=np.zeros(EXPERTS - 1, np.float32))
    with pytest.raises(ValueError, match="bias has NaN or inf values"):
        route(np.zeros((4, EXPERTS), np.float32), 2, bias=np.full(EXPERTS, np.inf, np.float32))


def test_the_torch_witness_sees_what_it_must():
    """The witness flags int(), .item(), a boolean mask, nonzero and an
    upload made from the code it watches (here: this file)."""
    torch = requires.module("torch")
    t = torch.arange(6)
    with _torch_witness(roots=(Path(__file__).resolve(),)) as witness:
        int(t.max())
        t.sum().item()
        t[t > 2]
        torch.nonzero(t)
        torch.as_tensor(np.arange(3))
        t + 1  # no wait
    kinds = [w.split(" at ")[0] for w in witness.waits]
    assert kinds == ["__int__", "item", "__getitem__ with a boolean mask", "nonzero",
                     "as_tensor of host data (an upload)"], witness.waits
