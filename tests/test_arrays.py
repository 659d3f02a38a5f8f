"""DLPack adapters: zero-copy in, same framework out, every dtype."""

import ml_dtypes
import numpy as np
import pytest

from commlib.dlpack import byte_view, contiguous, unwrap, writable

import requires

torch = requires.module("torch")
jax = requires.module("jax")
jnp = jax.numpy

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
                torch.uint64]


class CupyLikeFlags:
    """What ``cupy.ndarray.flags`` has (CuPy 13-14): no ``writeable``."""

    c_contiguous, f_contiguous, owndata = True, False, True


class CupyLikeArray:
    flags = CupyLikeFlags()


def test_receive_buffers_are_writable_unless_numpy_says_otherwise():
    """A CuPy array, whose flags have no ``writeable``, is a receive buffer
    (reading the attribute raised AttributeError on every GPU transfer of
    the JAX binding); a read-only NumPy array is not."""
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    assert writable(CupyLikeArray()) and writable(np.zeros(3)) and not writable(frozen)


def test_numpy_is_itself():
    x = np.arange(6.0).reshape(2, 3)
    native = unwrap(x)
    assert native.data is x and native.framework == "numpy" and not native.on_device
    assert native.wrap(native.data) is x


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_shares_memory(dtype):
    x = torch.arange(12).reshape(3, 4).to(dtype)
    native = unwrap(x)
    assert native.framework == "torch" and native.dtype.itemsize == x.element_size()
    assert native.data.__array_interface__["data"][0] == x.data_ptr()  # zero-copy in
    back = native.wrap(native.data.copy())
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))


def test_torch_bfloat16_is_ml_dtypes_on_host():
    native = unwrap(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert native.data.dtype == np.dtype(ml_dtypes.bfloat16)
    assert native.data.astype(np.float32).tolist() == [1.5, -2.0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_,
                                   jnp.float16, jnp.uint32])
def test_jax_round_trip(dtype):
    x = jnp.arange(6).reshape(2, 3).astype(dtype)
    native = unwrap(x)
    assert native.framework == "jax" and native.data.dtype == np.dtype(dtype)
    back = native.wrap(native.data.copy())
    assert isinstance(back, jax.Array) and back.dtype == dtype
    assert np.array_equal(np.asarray(back), np.asarray(x))


def test_python_sequences_become_numpy():
    assert unwrap([1, 2, 3]).data.tolist() == [1, 2, 3]


def test_unknown_objects_are_rejected():
    with pytest.raises(TypeError, match="expected an array"):
        unwrap(object())


def test_other_dlpack_exporters_go_through_numpy():
    class Exporter:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, *args, **kwargs):
            return self.array.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    native = unwrap(Exporter(np.arange(4)))
    assert native.framework == "numpy" and native.data.tolist() == [0, 1, 2, 3]


def test_contiguous_copies_only_when_needed():
    x = np.arange(12).reshape(3, 4)
    assert contiguous(unwrap(x)) is x
    strided = contiguous(unwrap(x[:, ::2]))
    assert strided.flags.c_contiguous and strided.tolist() == x[:, ::2].tolist()
    t = torch.arange(12).reshape(3, 4).t()
    assert contiguous(unwrap(t)).tolist() == t.tolist()


def test_byte_view_has_no_copy():
    x = np.arange(4, dtype=np.float32)
    assert np.shares_memory(byte_view(x), x) and byte_view(x).size == 16


def test_results_are_allocated_where_the_input_lives():
    native = unwrap(torch.ones(3, dtype=torch.bfloat16))
    out = native.empty((2, 5))
    assert isinstance(out, np.ndarray) and out.shape == (2, 5) and out.dtype == native.data.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_cuda_results_come_from_torchs_caching_allocator(dtype):
    """Not from CuPy's pool, which would hold GPU memory torch cannot reuse."""
    import cupy
    native = unwrap(torch.ones(4, dtype=dtype, device="cuda"))
    pool_before = cupy.get_default_memory_pool().used_bytes()
    torch_before = torch.cuda.memory_allocated()
    out = native.empty((1024, 256))
    assert cupy.get_default_memory_pool().used_bytes() == pool_before
    assert torch.cuda.memory_allocated() - torch_before >= out.nbytes
    out[...] = 0
    result = native.wrap(out)
    assert result.dtype == dtype and result.device.type == "cuda" and result.shape == (1024, 256)
    assert float(result.float().abs().sum()) == 0.0
