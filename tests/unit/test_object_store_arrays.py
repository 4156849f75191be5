"""The object store's NumPy hand-off (raysync/transports/object_store/arrays.py): every
dtype travels as a view of the tensor itself, out of band, and comes back bit for bit,
in its shape."""

from __future__ import annotations

import pickle

import pytest
import torch

from raysync.transports.object_store import arrays_of, as_array, as_tensor

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)], ids=str)
def test_a_tensor_round_trips_bit_for_bit_through_its_array(dtype, shape):
    generator = torch.Generator().manual_seed(3)
    count = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype is torch.bool:
        raw = raw % 2
    tensor = raw.view(dtype).reshape(shape)
    array = as_array(tensor)
    assert array.shape == shape
    assert array.nbytes == tensor.numel() * dtype.itemsize
    # The array views the tensor: no copy in the learner before ray.put.
    if count:
        assert array.ctypes.data == tensor.data_ptr()
    # What Ray's serializer does with put_arrays' list: pickle protocol 5, the bytes
    # out of band, nothing of the array pickled in band but its buffer's place.
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps([pickle.PickleBuffer(array)], protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 64
    [back_array] = arrays_of(pickle.loads(data, buffers=buffers))
    back = as_tensor(back_array, dtype)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(_bits(back), _bits(tensor))
