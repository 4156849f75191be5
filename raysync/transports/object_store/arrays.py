"""Tensors as NumPy arrays in Ray's object store: how every object-store hand-off of
raysync puts a version's (or a bucket's) bytes, and how every reader gets them back.

Learner process: :func:`put_arrays` hands ``ray.put`` each array wrapped in a
:class:`pickle.PickleBuffer`, so Ray's serializer writes its bytes out-of-band, back to
back (64-byte aligned), into *one* object-store buffer, and pickles nothing per array
but the buffer's place. A bare NumPy array costs more: NumPy's own ``__reduce_ex__``
pickles its dtype and a constructor call per array, which Ray then unpickles on every
reader. For a 1000-tensor model that was a third of the learner's put (64 MB: ~29 ms
against ~22 ms, steady state, 2 cores) and most of a reader's ``ray.get``.

Ray copies a buffer of more than 1 MiB with six threads it starts for that buffer, and
smaller ones one after another on the thread that puts. An array of up to 16 MiB is
therefore handed to Ray in chunks of 1 MiB (:func:`object_of`), and a version of many
such arrays is put by :func:`put_version` as one object per copy thread, each holding a
run of consecutive arrays, put at the same time (Ray releases the GIL while it copies). On
2 cores, warm, per version (``benchmarks/put_threads.py``): 1000 float32 tensors of
64 KiB 14.0 against 8.9 ms, of 1 MiB 167-179 against 99-103 ms; 2000 of 512 KiB
171-176 against 101-103 ms. A version of large tensors, or of few bytes, stays one
object. So does every version while the learner's page tables do not yet cover the
store's pages (:class:`VersionPuts`): until then each put faults on every page it
writes, and two threads faulting at once took twice as long as one (64 KiB tensors, by
hand: 31 against 14 ms); its arrays then go whole, not chunked, since Ray's six
threads fault a large buffer's pages in faster than the putting thread alone.

Reader process: ``ray.get`` maps that buffer read-only (zero-copy on the node) and gives
Ray's buffer objects back, which carry each array's shape and format;
:func:`~raysync.transports.object_store.wire.arrays_of` views them as arrays again, an
array's chunks as one (no copy).
"""

from __future__ import annotations

import functools
import pickle
import resource
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray
import torch

from raysync.copies import array_bytes, executor, numpy_view
from raysync.transports.object_store.wire import Join

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: Ray's serializer copies a buffer of more bytes than this with threads of its own.
RAY_THREADED_COPY_ABOVE = 1 << 20
#: Arrays of more than ``RAY_THREADED_COPY_ABOVE`` and at most this many bytes are
#: handed to Ray in chunks of ``RAY_THREADED_COPY_ABOVE`` (see :func:`put_arrays`).
CHUNKED_UP_TO = 16 << 20
#: Below this many bytes in buffers Ray copies on one thread, a version is one put.
SPLIT_PUT_BYTES = 8 << 20
#: At most this many puts per version (Ray's own copy of a large buffer uses 6 threads).
MAX_PUTS = 8


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous tensor, in its shape: of its own dtype, or of the
    same-size integer dtype where NumPy has none (``bfloat16`` -> ``int16``). GPU
    tensors are copied to host first. :func:`raysync.copies.as_tensor` undoes it."""
    return numpy_view(tensor if tensor.is_cpu else tensor.cpu())


def put_arrays(arrays: Iterable[np.ndarray], *, chunked: bool = True) -> ray.ObjectRef:
    """Learner: one object holding the C-contiguous ``arrays``' bytes, in order (one
    copy, into the object store), :func:`object_of` them; read back with
    :func:`~raysync.transports.object_store.wire.arrays_of`."""
    return ray.put(object_of(arrays, chunked=chunked))


def object_of(arrays: Iterable[np.ndarray], *, chunked: bool = True) -> tuple[Any, ...]:
    """What :func:`put_arrays` puts: ``(joins, buffer, buffer, ...)``, each buffer a
    ``PickleBuffer`` that Ray's serializer writes out of band.

    Ray copies a buffer of more than 1 MiB by starting six threads for it and joining
    them: on 2 cores, 64 arrays of 1 MiB + 64 bytes took 12.2 ms to put, 64 of 1 MiB
    3.7 (``benchmarks/put_threads.py``). So an array of up to ``CHUNKED_UP_TO`` bytes
    goes in chunks of at most 1 MiB, which Ray copies on this thread, back to back;
    the object's first item (:data:`~raysync.transports.object_store.wire.Joins`) says
    which buffers a reader views as one array again. Larger arrays go whole: Ray's
    threads then cost little beside their copy. So does every array if not
    ``chunked``: onto pages this process never wrote, Ray's six threads fault them in
    faster than one (16 arrays of 4 MiB, cold: 34 against 43 ms; warm: 6.1 against 5.1).
    """
    joins: list[Join] = []
    items: list[pickle.PickleBuffer] = []
    for array in arrays:
        if chunked and RAY_THREADED_COPY_ABOVE < array.nbytes <= CHUNKED_UP_TO:
            flat = array_bytes(array)
            starts = range(0, array.nbytes, RAY_THREADED_COPY_ABOVE)
            joins.append((len(items), len(starts), array.dtype.str, array.shape))
            items.extend(
                pickle.PickleBuffer(cast("Buffer", flat[start : start + RAY_THREADED_COPY_ABOVE]))
                for start in starts
            )
        else:
            # (numpy's stubs give an array the buffer protocol on Python 3.12+ only; it
            # has it on every version.)
            items.append(pickle.PickleBuffer(cast("Buffer", array)))
    # A tuple, not a list: Ray hands a list to msgpack item by item (a Python callback
    # per array), a tuple to pickle in one call.
    return (tuple(joins), *items)


def put_version(
    arrays: Sequence[np.ndarray], threads: int, *, chunked: bool = True
) -> tuple[ray.ObjectRef, ...]:
    """Learner: ``arrays`` in one object, or in one per thread (``threads``, the caller
    included) where Ray would copy many small ones on one thread: consecutive runs, in
    order, put at the same time. Read back with ``arrays_of`` of each, in turn.
    ``chunked``: as :func:`object_of`'s."""
    runs = put_runs(tuple(array.nbytes for array in arrays), threads)
    if len(runs) == 1:
        return (put_arrays(arrays, chunked=chunked),)
    pending = [
        executor(len(runs) - 1).submit(put_arrays, arrays[start:end], chunked=chunked)
        for start, end in runs[1:]
    ]
    first = put_arrays(arrays[runs[0][0] : runs[0][1]], chunked=chunked)
    return (first, *(future.result() for future in pending))


@functools.lru_cache(maxsize=32)
def put_runs(sizes: tuple[int, ...], threads: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each put's run of arrays of ``sizes`` bytes: one run, or one
    per thread (``MAX_PUTS`` at most), of about equal bytes in arrays of up to
    ``CHUNKED_UP_TO`` (which Ray copies on the putting thread) when those add up to
    ``SPLIT_PUT_BYTES`` or more."""
    small = [size if size <= CHUNKED_UP_TO else 0 for size in sizes]
    total = sum(small)
    puts = min(threads, MAX_PUTS)
    if puts < 2 or total < SPLIT_PUT_BYTES:
        return ((0, len(sizes)),)
    runs: list[tuple[int, int]] = []
    start = done = 0
    for index, size in enumerate(small):
        done += size
        cut = done * puts >= total * (len(runs) + 1) and len(runs) < puts - 1
        if cut and index + 1 < len(sizes):
            runs.append((start, index + 1))
            start = index + 1
    runs.append((start, len(sizes)))
    return tuple(runs)


class VersionPuts:
    """Learner: puts each version with :func:`put_version`, on one thread and with its
    arrays whole (Ray's own threads fault the pages in) while the last put faulted on
    more than ``1 / COLD_SHARE`` of the pages it wrote (this process had not touched
    that part of the store before: the first few dozen versions of a run, and whenever
    Ray's allocator reaches a new region), else on ``threads``, chunked."""

    #: A put that faulted on more than this share of its pages counts as cold.
    COLD_SHARE = 8

    def __init__(self) -> None:
        self._warm = False

    @property
    def warm(self) -> bool:
        """Whether the last put did not fault on its pages (the next one may split)."""
        return self._warm

    def put(self, arrays: Sequence[np.ndarray], threads: int) -> tuple[ray.ObjectRef, ...]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        refs = put_version(arrays, threads if self._warm else 1, chunked=self._warm)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        self._warm = not cold(faults, sum(array.nbytes for array in arrays))
        return refs


def cold(faults: int, nbytes: int) -> bool:
    """Whether a put of ``nbytes`` that took ``faults`` page faults wrote cold pages."""
    return faults * resource.getpagesize() * VersionPuts.COLD_SHARE > nbytes
