"""The NCCL transport on one GPU, in one process: a size-1
``commlib.init(backend="nccl")`` communicator.

- every collective (``collective_checks``) on CuPy, torch CUDA and JAX GPU
  arrays, float32, float16, bfloat16 (but for CuPy) and int32, bit-exact
  against NumPy, in the caller's framework, device and dtype;
- stream order: an input still being produced on a non-default torch stream
  when the collective is called is read only once it is ready;
- calls return before the GPU has done their work (the host does not wait),
  and the results are right once read;
- a non-contiguous torch input; an array on another GPU is refused, naming
  both devices (where there are two GPUs);
- CUDA arrays really travel over NCCL;
- collectives captured into a CUDA graph (on CuPy's stream, and on torch's
  capture stream) replay right on new input, after other allocations that
  their buffers, had they been freed, would have become.

At one rank a ring shift is a copy on the device: lane 1 (its own NCCL
communicator) first moves bytes at two ranks with a GPU each
(``tests/mpi/test_collectives_frameworks.py``).

Every test carries the ``gpu`` mark and skips, with the reason, where CuPy
sees no CUDA device or NCCL is missing.
"""

import time

import pytest

import commlib
from commlib.backends import nccl

import arrayimpl
from collective_checks import CHECKS, cases

NCCL_MISSING = nccl.unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(NCCL_MISSING is not None, reason=f"no NCCL: {NCCL_MISSING}")]

# GPU clock cycles torch.cuda._sleep spins for: about half a second
BUSY_CYCLES = 10**9


@pytest.fixture(scope="module")
def comm():
    c = commlib.init(backend="nccl", timeout=60)
    yield c
    c.free()


@pytest.fixture
def torch():
    reason = arrayimpl.cuda_skip_reason("torch")
    if reason is not None:
        pytest.skip(reason)
    import torch
    return torch


def test_cuda_arrays_travel_over_nccl(comm, torch, monkeypatch):
    calls = []
    original = nccl.NcclBackend.allreduce

    def counted(self, *args):
        calls.append(self)
        return original(self, *args)
    monkeypatch.setattr(nccl.NcclBackend, "allreduce", counted)
    y = comm.allreduce(torch.ones(8, device="cuda"))
    assert comm.backend == "nccl" and comm.size == 1
    assert len(calls) == 1 and y.is_cuda and y.tolist() == [1.0] * 8


@pytest.mark.parametrize("collective", list(CHECKS))
@pytest.mark.parametrize("impl, dtype", cases(arrayimpl.GPU))
def test_collective_is_bit_exact(comm, impl, dtype, collective):
    failures = CHECKS[collective](comm, impl, dtype)
    assert not failures, "\n".join(failures)


def _busy(torch) -> None:
    """Keep the current torch stream busy for about half a second."""
    torch.cuda._sleep(BUSY_CYCLES)


STREAM_ORDERED = {
    "alltoallv": lambda comm, x: comm.alltoallv(x, [x.shape[0]])[0],
    "alltoall": lambda comm, x: comm.alltoall(x),
    "ring_shift_async lane 1": lambda comm, x: comm.ring_shift_async(x, lane=1).wait(),
    "allgather": lambda comm, x: comm.allgather(x),
    "allreduce": lambda comm, x: comm.allreduce(x),
    "bcast": lambda comm, x: comm.bcast(x),
}


@pytest.mark.parametrize("collective", list(STREAM_ORDERED))
def test_an_input_still_being_made_on_a_torch_stream_is_read_when_ready(comm, torch,
                                                                         collective):
    """x gets its values on a side stream behind half a second of GPU work,
    and the collective is called on that stream at once: NCCL must wait for
    them (an unordered read would see the zeros)."""
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy(torch)
        x.add_(7)
        y = STREAM_ORDERED[collective](comm, x)
        right = bool((y == 7).all())  # read on the stream the result belongs to
    assert right and y.shape == x.shape


def test_calls_return_before_the_gpu_is_done_and_results_are_right_once_read(comm, torch):
    x = torch.zeros((64, 1024), device="cuda")
    chain = list(STREAM_ORDERED.values())
    for call in chain:  # the first calls make NCCL communicators: not what is timed
        call(comm, x)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy(torch)
        x.add_(7)
        made = torch.cuda.Event()
        made.record(side)
        start = time.monotonic()
        y = x
        for call in chain:
            y = call(comm, y)
        returned_after = time.monotonic() - start
        # every call was ordered after x's production: had the host waited
        # for any of them, x would be made by now
        host_waited = made.query()
        right = bool((y == 7).all())
    assert not host_waited, (f"the host waited for the GPU: {len(chain)} calls took "
                             f"{returned_after:.3f}s, and the input was made by then")
    assert right and y.shape == x.shape


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_non_contiguous_torch_input(comm, torch, dtype):
    base = torch.arange(24, device="cuda").reshape(4, 6).to(getattr(torch, dtype))
    x = base.T  # [6, 4], strided
    assert not x.is_contiguous()
    results = {"alltoallv": comm.alltoallv(x, [6])[0], "alltoall": comm.alltoall(x, 1, 0),
               "ring_shift": comm.ring_shift(x), "allgather": comm.allgather(x, axis=1),
               "allreduce": comm.allreduce(x, "max"), "bcast": comm.bcast(x)}
    wrong = [name for name, y in results.items()
             if not (y.is_cuda and y.dtype == x.dtype and torch.equal(y, x))]
    assert not wrong
    assert torch.equal(base, torch.arange(24, device="cuda").reshape(4, 6).to(base.dtype))


def test_an_array_on_another_gpu_is_refused_naming_both(torch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; {torch.cuda.device_count()} visible")
    c = commlib.init(backend="nccl", device=0, timeout=60)
    try:
        with pytest.raises(ValueError, match=r"the array is on CUDA device 1, but this "
                                             r"communicator drives device 0; move it there"):
            c.allreduce(torch.ones(4, device="cuda:1"))
    finally:
        c.free()


def _captured_by_torch(torch, work):
    """(graph, what it returned): ``work()`` warmed up, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = work()
    return graph, captured


def test_fixed_capacity_pair_is_captured_in_a_cuda_graph_and_replayed(comm, torch):
    """DeepEP's low-latency use: under a fixed capacity a dispatch + combine
    (FP8 rows, dequantized) reads nothing back from the GPU, so it can be
    captured once and replayed on new inputs written into the captured
    buffers; the replay gives what an eager pair gives."""
    from commlib.moe import Dispatcher

    num_experts, tokens, hidden, k = 8, 16, 256, 2
    d = Dispatcher(comm, num_experts, max_tokens_per_rank=tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, experts = torch.rand(tokens, num_experts, device="cuda").topk(k, dim=1)

    def pair():
        rows, handle = d.dispatch(x, experts, weights, quantize="fp8", dequantize=True)
        return d.combine(rows * 2, handle)
    graph, captured = _captured_by_torch(torch, pair)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(captured.float(), pair().float(), rtol=1e-3, atol=1e-3)


# collectives whose CuPy temporaries (a strided input's contiguous copy, the
# output, alltoall_many's parts and packed message) a captured graph replays
CAPTURED_ON_CUPY = {
    "allreduce of a strided input": lambda comm, x: [comm.allreduce(x[:, ::2])],
    "allgather of a strided input": lambda comm, x: [comm.allgather(x[:, 1::2])],
    "alltoall": lambda comm, x: [comm.alltoall(x)],
    "alltoall_many": lambda comm, x: comm.alltoall_many([x, x]),
    "alltoall_many of strided inputs": lambda comm, x: comm.alltoall_many([x[:, ::2],
                                                                         x[:, 1::2]]),
    # at one rank a shift by 0: a copy of the strided input's contiguous copy
    "ring_shift of a strided input": lambda comm, x: [comm.ring_shift(x[::2])],
}


@pytest.mark.parametrize("collective", list(CAPTURED_ON_CUPY))
def test_a_graph_captured_on_cupy_arrays_replays_right_after_other_allocations(comm, collective):
    """A CUDA graph owns no memory: the buffers of its NCCL launches must
    outlive the capture (issue 38.3). Had they gone back to CuPy's pool, the
    next allocations of this stream would be them, and the replay would
    write into those and read what they hold."""
    import cupy

    call = CAPTURED_ON_CUPY[collective]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.arange(64 * 32, dtype=cupy.float32).reshape(64, 32)
        call(comm, x)  # warm up: NCCL's links, the pool's blocks
        stream.synchronize()
        stream.begin_capture()
        try:
            captured = call(comm, x)
        finally:
            graph = stream.end_capture()
        others = [cupy.full(nbytes, 0xAB, dtype=cupy.uint8)
                  for nbytes in (x.nbytes // 4, x.nbytes // 2, x.nbytes, 2 * x.nbytes)
                  for _ in range(8)]
        x[...] = cupy.arange(x.size, dtype=cupy.float32).reshape(x.shape) * -3 + 1
        graph.launch(stream)
        stream.synchronize()
        overwritten = sum(not bool((o == 0xAB).all()) for o in others)
        eager = call(comm, x)
        wrong = [i for i, (a, b) in enumerate(zip(captured, eager))
                 if not bool(cupy.array_equal(a, b))]
    assert overwritten == 0, f"the replay wrote into {overwritten} later allocations"
    assert not wrong and len(captured) == len(eager)


def test_a_torch_collective_captured_in_a_cuda_graph_replays_on_new_input(comm, torch):
    """On torch's capture stream (issue 38.2): the DLPack handshake orders
    nothing and NCCL joins the capture; the replay gives what eager calls
    give on the new input, after other allocations."""
    x = torch.arange(64 * 32, device="cuda", dtype=torch.float32).reshape(64, 32)

    def calls():
        return [comm.allreduce(x.T), comm.alltoall(x), comm.alltoallv(x, [64], [64])[0],
                comm.ring_shift_async(x, lane=1).wait(), comm.allgather(x[:, ::2])]
    graph, captured = _captured_by_torch(torch, calls)
    others = [torch.full_like(x, -1.0) for _ in range(16)]
    x.copy_(x * -3 + 1)
    graph.replay()
    torch.cuda.synchronize()
    eager = calls()
    assert all(bool((o == -1).all()) for o in others)
    wrong = [i for i, (a, b) in enumerate(zip(captured, eager)) if not torch.equal(a, b)]
    assert not wrong and len(captured) == len(eager)
