"""The object store's NumPy hand-off (raysync/transports/object_store/arrays.py): every
dtype travels as a view of the tensor itself, out of band, and comes back bit for bit,
in its shape."""

from __future__ import annotations

import pickle
import resource

import pytest
import torch

from raysync.copies import as_tensor
from raysync.transports.object_store.arrays import (
    MAX_PUTS,
    RAY_THREADED_COPY_ABOVE,
    SPLIT_PUT_BYTES,
    as_array,
    cold,
    put_runs,
)
from raysync.transports.object_store.wire import arrays_of

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


_MIB = 1 << 20


def _covers_in_order(runs: tuple[tuple[int, int], ...], count: int) -> bool:
    starts = [start for start, _ in runs]
    ends = [end for _, end in runs]
    return (
        starts[0] == 0
        and ends[-1] == count
        and starts[1:] == ends[:-1]
        and all(start < end for start, end in runs)
    )


def test_a_version_of_large_tensors_or_few_bytes_is_one_put():
    assert put_runs((64 * _MIB,) * 16, 2) == ((0, 16),)  # Ray copies each on its threads
    assert put_runs((64 << 10,) * 100, 2) == ((0, 100),)  # 6.25 MiB: below SPLIT_PUT_BYTES
    assert put_runs((64 << 10,) * 1000, 1) == ((0, 1000),)  # one copy thread


def test_many_small_tensors_are_split_in_runs_of_about_equal_bytes_per_thread():
    sizes = (64 << 10,) * 1000  # 64 MB of 64 KiB tensors
    for threads in (2, 3, 4, 64):
        runs = put_runs(sizes, threads)
        assert len(runs) == min(threads, MAX_PUTS) and _covers_in_order(runs, len(sizes))
        per_run = [sum(sizes[start:end]) for start, end in runs]
        assert max(per_run) - min(per_run) <= 2 * sizes[0], per_run


def test_tensors_ray_copies_on_its_own_threads_do_not_count_toward_a_runs_share():
    sizes = (256 * _MIB,) + (64 << 10,) * 400  # the large one first
    runs = put_runs(sizes, 2)
    assert _covers_in_order(runs, len(sizes))
    small = [sum(s for s in sizes[start:end] if s < RAY_THREADED_COPY_ABOVE) for start, end in runs]
    assert small[0] == small[1] == 200 * (64 << 10)


def test_a_put_that_faulted_on_many_of_its_pages_was_cold():
    pages = (64 << 20) // resource.getpagesize()
    assert cold(pages, 64 << 20)  # every page: a region this process never touched
    assert cold(pages // 4, 64 << 20)
    assert not cold(64, 64 << 20)  # what a warm 64 MB put faults, steady state
    assert not cold(0, 0)


def test_no_run_is_empty_when_the_last_tensor_holds_a_large_share():
    sizes = (4096,) * 10 + (_MIB - 64,) * 8  # the last one: an eighth of the bytes
    assert SPLIT_PUT_BYTES <= sum(sizes)
    for threads in (2, 4, 8, 16, 64):
        runs = put_runs(sizes, threads)
        assert _covers_in_order(runs, len(sizes)) and 2 <= len(runs) <= min(threads, MAX_PUTS)
    assert put_runs((4096,) * 3 + (9 * _MIB,), 2) == ((0, 4),)  # over 1 MiB: not shared
