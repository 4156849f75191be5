"""The object store's NumPy hand-off (raysync/transports/object_store/arrays.py): every
dtype travels as a view of the tensor itself, out of band, and comes back bit for bit,
in its shape."""

from __future__ import annotations

import itertools
import pickle
import resource

import numpy as np
import pytest
import torch

from raysync.copies import as_tensor
from raysync.transports.object_store.arrays import (
    CHUNKED_UP_TO,
    MAX_PUTS,
    RAY_THREADED_COPY_ABOVE,
    SPLIT_PUT_BYTES,
    as_array,
    cold,
    object_of,
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
    # What Ray's serializer does with put_arrays' object: pickle protocol 5, the bytes
    # out of band, nothing of the array pickled in band but its buffer's place.
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(object_of([array]), protocol=5, buffer_callback=buffers.append)
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


def test_tensors_put_in_chunks_count_toward_a_runs_share():
    """Arrays of up to CHUNKED_UP_TO go to Ray in 1 MiB chunks, copied on the putting
    thread: a version of them is split in runs like one of small tensors."""
    runs = put_runs((4 * _MIB,) * 16, 2)
    assert len(runs) == 2 and _covers_in_order(runs, 16)
    assert put_runs((CHUNKED_UP_TO,) * 4, 2) == ((0, 2), (2, 4))


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
    # Over CHUNKED_UP_TO: Ray copies it on its own threads, so it is not shared out.
    assert put_runs((4096,) * 3 + (CHUNKED_UP_TO + 1,), 2) == ((0, 4),)


def _through_pickle(value: tuple, back_to_back: bool) -> tuple:
    """``value`` pickled as Ray's serializer pickles it (protocol 5, buffers out of band)
    and read back: from one block holding the buffers back to back, as Ray lays them in
    an object (its buffers over 2 KiB start at multiples of 64, which every chunk's
    size is), or from buffers of their own."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    kinds = [(memoryview(b).format, memoryview(b).shape) for b in buffers]  # Ray keeps them
    raw = [bytes(buffer.raw()) for buffer in buffers]
    if back_to_back:
        block = memoryview(bytearray(b"".join(raw))).toreadonly()
        offsets = np.cumsum([0] + [len(b) for b in raw])
        views = [block[a:b] for a, b in itertools.pairwise(offsets)]
    else:
        views = [memoryview(bytearray(b)).toreadonly() for b in raw]
    return pickle.loads(
        data,
        buffers=[view.cast(fmt, shape) for view, (fmt, shape) in zip(views, kinds, strict=True)],
    )


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("back_to_back", [True, False], ids=["as Ray lays them", "apart"])
def test_arrays_over_1_mib_travel_in_chunks_and_come_back_whole(back_to_back):
    """Arrays Ray would copy with six threads of its own (over 1 MiB) are put in chunks
    of 1 MiB; a reader gets each back whole, in order among the others: a view of the
    object where the chunks lie back to back (no copy), else a copy of them."""
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(1000, generator=generator),
        torch.randn(_MIB // 4 + 16, generator=generator),  # 1 MiB + 64 bytes
        torch.randn(3, 700_001, generator=generator).to(torch.bfloat16),  # 4.2 MB, ragged
        torch.randint(0, 9, (_MIB,), generator=generator, dtype=torch.int8),  # exactly 1 MiB
        torch.randn(CHUNKED_UP_TO // 4 + 1, generator=generator),  # over CHUNKED_UP_TO: whole
        torch.randn(5, generator=generator),
    ]
    arrays = [as_array(tensor) for tensor in tensors]
    value = object_of(arrays)
    joins = value[0]
    assert [(first, count) for first, count, _, _ in joins] == [(1, 2), (3, 5)]
    assert len(value) == 1 + 1 + 2 + 5 + 1 + 1 + 1
    back = arrays_of(_through_pickle(value, back_to_back))
    assert len(back) == len(tensors)
    for array, tensor, sent in zip(back, tensors, arrays, strict=True):
        assert array.shape == sent.shape and array.dtype == sent.dtype
        assert torch.equal(_bits(as_tensor(array, tensor.dtype)), _bits(tensor))
        assert not array.flags.writeable
    if back_to_back:  # the joined arrays view the block: consecutive, no copy
        assert back[2].ctypes.data == back[1].ctypes.data + back[1].nbytes


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_arrays_put_unchunked_go_whole_and_come_back_bitwise():
    """A cold put (``chunked=False``: Ray's own threads fault the pages in) hands Ray
    every array as one buffer, and a reader gets the same arrays as from a chunked one."""
    generator = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(_MIB // 4 + 16, generator=generator),  # 1 MiB + 64 bytes
        torch.randn(3, 700_001, generator=generator).to(torch.bfloat16),
        torch.randn(7, generator=generator),
    ]
    arrays = [as_array(tensor) for tensor in tensors]
    value = object_of(arrays, chunked=False)
    assert value[0] == () and len(value) == 1 + len(arrays)
    back = arrays_of(_through_pickle(value, back_to_back=True))
    chunked = arrays_of(_through_pickle(object_of(arrays), back_to_back=True))
    for array, other, tensor in zip(back, chunked, tensors, strict=True):
        assert array.shape == other.shape == tuple(tensor.shape)
        assert torch.equal(_bits(as_tensor(array, tensor.dtype)), _bits(tensor))
        assert np.array_equal(array, other)
