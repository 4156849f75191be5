"""Copy a version's tensors on every core torch may use: :func:`copy_all`.

Called wherever a version's tensors are copied as a whole: the learner packing a version
into its buffer (:meth:`raysync.layout.PackedLayout.pack`), each receiver writing a
staged version into its model at the safe point.

``torch._foreach_copy_`` copies each tensor on the calling thread and lets torch split
only a tensor large enough (32K elements) across its intra-op threads. A model of 16
large tensors is copied on every core; one of 1000 small ones of the same bytes on one:
on 2 cores a 64 MB copy took 9.9 ms instead of 5.8. Here the small tensors are dealt,
by bytes, to as many threads as torch uses (``torch.get_num_threads()``), each running
one foreach copy of its share (torch releases the GIL inside it): 6.5 ms. Which tensor
goes to which thread is planned once per spec (:func:`copy_shares`), not per copy.

Tensors of middle size (32K elements up to ``DEAL_BELOW_BYTES``) are dealt the same
way, and each is copied with ``numpy.copyto`` on its thread (one memcpy, GIL released):
torch would copy each across all its threads in turn, and 1000 tensors of 1 MiB took
153 ms on 2 cores that way against 117 ms dealt to two threads. Only larger tensors,
and pairs of different dtypes or devices, are copied by torch itself.

The opposite, for a learner packing buckets while receivers read the previous ones:
:func:`copy_on_this_thread`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch

from raysync.spec import WeightSpec

#: Below this many elements torch copies a tensor on one thread (``at::internal::GRAIN_SIZE``).
SMALL_NUMEL = 32768
#: Below this many bytes of dealt tensors in all, one thread copies them (threads cost more).
SPLIT_BYTES = 4 << 20
#: Tensors of this many bytes or more stay with the caller's thread, and torch copies
#: each across its threads; smaller ones are dealt whole to the threads.
DEAL_BELOW_BYTES = 8 << 20
#: Same-size stand-ins for the dtypes NumPy does not have (bfloat16, float8, ...).
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


def copy_all(
    destinations: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    spec: WeightSpec,
    *,
    threads: int | None = None,
) -> None:
    """``destinations[i].copy_(sources[i])`` for every i (in ``spec`` order), no autograd.

    CPU destinations are copied on ``threads`` threads (default: torch's) as
    :func:`copy_shares` plans them for ``spec``; other devices in one foreach call.
    """
    threads = torch.get_num_threads() if threads is None else threads
    shares = copy_shares(spec, threads) if destinations and destinations[0].is_cpu else None
    with torch.no_grad():
        if shares is None:
            torch._foreach_copy_(list(destinations), list(sources))
            return
        pending = [
            executor(len(shares) - 1).submit(_copy, destinations, sources, share)
            for share in shares[1:]
        ]
        try:
            _copy(destinations, sources, shares[0])
        finally:
            for future in pending:
                future.result()


@functools.lru_cache(maxsize=32)
def copy_shares(spec: WeightSpec, threads: int) -> tuple[tuple[int, ...], ...] | None:
    """Which tensors of ``spec`` each of ``threads`` threads copies; None: one foreach
    call on one thread does as well (one thread, or too few bytes to deal).

    The tensors below ``DEAL_BELOW_BYTES`` are cut in ``threads`` runs of about equal
    bytes; the larger ones go with the first run, the caller's own thread, and torch
    splits each of them across its threads.
    """
    dealt = [i for i, entry in enumerate(spec.tensors) if entry.nbytes < DEAL_BELOW_BYTES]
    dealt_bytes = sum(spec.tensors[i].nbytes for i in dealt)
    if threads < 2 or dealt_bytes < SPLIT_BYTES:
        return None
    shares: list[list[int]] = [[] for _ in range(threads)]
    done = 0
    for i in dealt:
        shares[min(threads - 1, done * threads // dealt_bytes)].append(i)
        done += spec.tensors[i].nbytes
    is_dealt = set(dealt)
    shares[0].extend(i for i in range(len(spec.tensors)) if i not in is_dealt)
    return tuple(tuple(share) for share in shares)


def _copy(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], share: tuple[int, ...]
) -> None:
    """Copy ``share``'s tensors on this thread: middle-sized ones of one dtype on the
    CPU with one memcpy each, the rest in one foreach call."""
    alone: list[int] = []
    rest: list[int] = []
    for i in share:
        (alone if _memcpy_alone(destinations[i], sources[i]) else rest).append(i)
    with torch.no_grad():
        if rest:
            torch._foreach_copy_([destinations[i] for i in rest], [sources[i] for i in rest])
        for i in alone:
            numpy.copyto(numpy_view(destinations[i]), numpy_view(sources[i]))


def _memcpy_alone(destination: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether this pair is a middle-sized CPU copy of one dtype and shape (no cast)."""
    return (
        SMALL_NUMEL <= destination.numel()
        and destination.nbytes < DEAL_BELOW_BYTES
        and destination.dtype == source.dtype
        and destination.shape == source.shape
        and destination.is_cpu
        and source.is_cpu
    )


def numpy_view(tensor: torch.Tensor) -> numpy.ndarray:
    """A NumPy view of a CPU tensor, in its shape and strides: of its own dtype, or of
    the same-size integer dtype where NumPy has none (``bfloat16`` -> ``int16``)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not _numpy_takes(tensor.dtype):
        tensor = tensor.view(_INTEGER_OF_SIZE[tensor.dtype.itemsize])
    return tensor.numpy()


@functools.cache
def _numpy_takes(dtype: torch.dtype) -> bool:
    """Whether ``Tensor.numpy()`` takes tensors of ``dtype`` (asked once per dtype)."""
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def executor(workers: int) -> ThreadPoolExecutor:
    """This process's copy threads (the caller is one more), made once: the copies
    here, and the object store's concurrent puts."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="raysync-copy")
            _pool_workers = workers
        return _pool


def copy_on_this_thread(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy CPU bytes with this thread alone (numpy's memcpy, GIL released). torch's
    ``copy_`` fans a large copy out to every core, and its idle workers spin between
    buckets: the pack would then starve the very readers, hub and Ray threads it is
    meant to overlap with. One thread packs faster than one reader reads. A source on
    another device (a GPU tensor among CPU weights) goes through torch."""
    if source.device.type != "cpu" or destination.device.type != "cpu":
        destination.copy_(source)
        return
    numpy.copyto(numpy_view(destination), numpy_view(source))
