"""Copy a version's tensors on every core torch may use: :func:`copy_all`.

Called wherever a version's tensors are copied as a whole: the learner packing a version
into its buffer (:meth:`raysync.layout.PackedLayout.pack`), each receiver writing a
staged version into its model at the safe point.

Every copy a memcpy can do runs on this module's own threads (as many as torch uses,
``torch.get_num_threads()``, the caller one of them), not on torch's intra-op
(OpenMP) threads. GNU OpenMP's workers spin-wait after each parallel region: after a
``copy_`` of 64 MiB or 1 GiB on 2 cores the process burnt 5-9 ms of CPU in the next
20 ms (``benchmarks/omp_spin.py``), a core taken from the receivers, the hub and Ray's
threads that the broadcast then waits for. Copied here instead (two threads of
``numpy.copyto``: one memcpy each, GIL released) the same bytes took no longer (64
MiB 4.0-4.2 against 5.5-7.1 ms, 1 GiB 43-47 against 49-54 ms) and left nothing
spinning.

The plan (:func:`copy_shares`, made once per spec) cuts the work in one share per
thread, by bytes: tensors under ``DEAL_BELOW_BYTES`` are dealt whole, each larger one
is cut in one byte range per thread. Small tensors (under 32K elements) of a share go
in one ``torch._foreach_copy_`` call (torch copies those on the calling thread); each
larger one, or range of one, with one ``numpy.copyto``. Pairs that memcpy cannot copy
(a cast, another device, a range of a non-contiguous tensor) are left to torch: a cut
tensor then whole, in the share of its first range. A model of 1000 small tensors so
moves on every core too (on 2 cores a 64 MB copy took 9.9 ms on one thread, 6.5 ms
dealt), and so do 1000 of 1 MiB (153 ms one after another across torch's threads, 117
ms dealt whole to two threads).

Where a caller holds NumPy views of both sides already (:class:`Viewed`: a receiver's
model, whose views it keeps while the model stays where it is; the arrays a reader of
the object store gets), every memcpy pair is one ``numpy.copyto`` of them, small
tensors too: cheaper per tensor than a foreach call (1000 float32 tensors of 64 KiB: 4.0
against 4.5 ms on one thread), but not where the views are made for the purpose (two
per tensor cost more than the foreach call saves).

The opposite, for a learner packing buckets while receivers read the previous ones:
:func:`copy_on_this_thread`.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import NamedTuple, overload

import numpy
import torch

from raysync.spec import WeightSpec

#: Below this many elements torch copies a tensor on one thread (``at::internal::GRAIN_SIZE``).
SMALL_NUMEL = 32768
#: Below this many bytes in all, one thread copies a version (threads cost more).
SPLIT_BYTES = 4 << 20
#: Tensors of this many bytes or more are cut in one range per thread; smaller ones
#: are dealt whole to the threads.
DEAL_BELOW_BYTES = 8 << 20
#: Where a cut may fall: a multiple of this many bytes (a page).
CUT_ALIGN = 4096
#: Same-size stand-ins for the dtypes NumPy does not have (bfloat16, float8, ...).
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


class Viewed(Sequence[torch.Tensor]):
    """CPU tensors and a NumPy view of each (:func:`numpy_view`'s), in one order, for
    :func:`copy_all` to copy with ``numpy.copyto`` of the views: made by a process that
    holds both for longer than one copy. :func:`viewed` makes them of tensors (a
    receiver's write targets, kept while its model stays where it is); :meth:`over`
    of arrays (what a reader of the object store gets), the tensors then made on first
    use only."""

    __slots__ = ("_tensors", "arrays", "dtypes")

    def __init__(
        self,
        arrays: Sequence[numpy.ndarray],
        dtypes: Sequence[torch.dtype],
        tensors: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.arrays = tuple(arrays)
        #: Each tensor's torch dtype: a NumPy view of a bfloat16 tensor is int16.
        self.dtypes = tuple(dtypes)
        self._tensors = None if tensors is None else tuple(tensors)

    @classmethod
    def over(cls, arrays: Sequence[numpy.ndarray], dtypes: Sequence[torch.dtype]) -> Viewed:
        """The tensors of ``dtypes`` that ``arrays`` (:func:`numpy_view`'s views) hold."""
        return cls(arrays, dtypes)

    def alias(self) -> Viewed:
        """Another sequence of the same tensors and views: for a transport that knows
        each fetch's staged sequence by its identity."""
        return Viewed(self.arrays, self.dtypes, self._tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        if self._tensors is None:
            with warnings.catch_warnings():
                # Read-only arrays (a mapped object) make read-only tensors; none is written.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                self._tensors = tuple(
                    as_tensor(array, dtype)
                    for array, dtype in zip(self.arrays, self.dtypes, strict=True)
                )
        return self._tensors

    def __len__(self) -> int:
        return len(self.arrays)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        return self.tensors[index]


def viewed(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``tensors`` with their NumPy views (:class:`Viewed`), or as they are where NumPy
    cannot view one of them (not on the CPU; a conjugate or quantized tensor)."""
    try:
        arrays = [numpy_view(tensor) for tensor in tensors]
    except (TypeError, RuntimeError):
        return tensors
    return Viewed(arrays, [tensor.dtype for tensor in tensors], tensors)


class Piece(NamedTuple):
    """Bytes ``start`` to ``stop`` of the ``tensor``-th tensor (in spec order): one
    thread's work."""

    tensor: int
    start: int
    stop: int


def copy_all(
    destinations: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    spec: WeightSpec,
    *,
    threads: int | None = None,
) -> None:
    """``destinations[i].copy_(sources[i])`` for every i (in ``spec`` order), no autograd.

    CPU destinations are copied on ``threads`` threads (default: torch's), the caller
    one of them, as :func:`copy_shares` plans them for ``spec``; other devices in one
    foreach call.
    """
    if not destinations or not destinations[0].is_cpu:
        _foreach_copy(list(destinations), list(sources))
        wait_for_devices(destinations)
        return
    shares = copy_shares(spec, torch.get_num_threads() if threads is None else threads)
    pending = [
        executor(len(shares) - 1).submit(_copy, destinations, sources, share)
        for share in shares[1:]
    ]
    try:
        _copy(destinations, sources, shares[0])
    finally:  # every thread stopped writing before the first failure is raised
        wait(pending)
        for future in pending:
            future.result()
    # A model whose first tensor (by name) is on the CPU may hold others on a GPU.
    wait_for_devices(destinations)


def wait_for_devices(tensors: Sequence[torch.Tensor]) -> None:
    """Return once the work queued on the current streams of ``tensors``' CUDA devices
    has run (nothing to wait for on the CPU). A copy out of a transport's buffer is
    only queued until then, and the buffer, handed back, may be written again by DMA
    (NIXL, RDT), which waits for no stream: the model would get the next version's
    bytes."""
    for device in {tensor.device for tensor in tensors if tensor.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


@functools.lru_cache(maxsize=32)
def copy_shares(spec: WeightSpec, threads: int) -> tuple[tuple[Piece, ...], ...]:
    """What each of ``threads`` threads copies of ``spec``: one share, every tensor
    whole, for one thread or fewer than ``SPLIT_BYTES`` in all; else one share per
    thread of about equal bytes, the tensors under ``DEAL_BELOW_BYTES`` dealt whole
    and each larger one cut in ``threads`` ranges (at ``CUT_ALIGN`` bytes), range k in
    share k."""
    whole = [Piece(i, 0, entry.nbytes) for i, entry in enumerate(spec.tensors)]
    if threads < 2 or spec.nbytes < SPLIT_BYTES:
        return (tuple(whole),)
    shares: list[list[Piece]] = [[] for _ in range(threads)]
    dealt = [piece for piece in whole if piece.stop < DEAL_BELOW_BYTES]
    dealt_bytes = max(1, sum(piece.stop for piece in dealt))  # 0: only empty ones dealt
    done = 0
    for piece in dealt:
        shares[min(threads - 1, done * threads // dealt_bytes)].append(piece)
        done += piece.stop
    for piece in whole:
        if piece.stop >= DEAL_BELOW_BYTES:
            cuts = [piece.stop * k // threads // CUT_ALIGN * CUT_ALIGN for k in range(threads)]
            for k, (start, stop) in enumerate(zip(cuts, [*cuts[1:], piece.stop], strict=True)):
                shares[k].append(Piece(piece.tensor, start, stop))
    return tuple(tuple(share) for share in shares)


def _copy(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], share: Sequence[Piece]
) -> None:
    """Copy ``share`` on this thread: the small tensors in one foreach call, each larger
    one or range of one with one memcpy, what memcpy cannot copy with torch; where both
    sides are :class:`Viewed`, every memcpy pair with ``numpy.copyto`` of their views."""
    by_torch: list[int] = []
    views = (
        (destinations, sources)
        if isinstance(destinations, Viewed) and isinstance(sources, Viewed)
        else None
    )
    for index, start, stop in share:
        if views is not None and _copy_views(*views, index, start, stop):
            continue
        destination, source = destinations[index], sources[index]
        whole = start == 0 and stop == destination.nbytes
        if whole and destination.numel() >= SMALL_NUMEL and _memcpy_pair(destination, source):
            numpy.copyto(numpy_view(destination), numpy_view(source))
        elif not whole and _memcpy_pair(destination, source, contiguous=True):
            numpy.copyto(_bytes(destination)[start:stop], _bytes(source)[start:stop])
        elif start == 0:  # small, or torch's to copy whole (in its first range's share)
            by_torch.append(index)
    if by_torch:
        _foreach_copy([destinations[i] for i in by_torch], [sources[i] for i in by_torch])


def _foreach_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``torch._foreach_copy_`` outside autograd, under inference mode: a model made
    under ``torch.inference_mode()`` holds inference tensors, which refuse an in-place
    write outside it (under ``no_grad`` alone, a cast or GPU version failed partway,
    the tensors before the failing one holding it). Tensors are made before: none made
    here outlives the call as an inference tensor."""
    with torch.inference_mode():
        torch._foreach_copy_(destinations, sources)


def _copy_views(destinations: Viewed, sources: Viewed, index: int, start: int, stop: int) -> bool:
    """Copy bytes ``start`` to ``stop`` of the ``index``-th pair with its NumPy views,
    if memcpy copies it as ``copy_`` would (one torch dtype and shape; for a range,
    both contiguous); else copy nothing and say so."""
    destination, source = destinations.arrays[index], sources.arrays[index]
    if destinations.dtypes[index] != sources.dtypes[index] or destination.shape != source.shape:
        return False
    if start == 0 and stop == destination.nbytes:
        numpy.copyto(destination, source)
        return True
    if not (destination.flags.c_contiguous and source.flags.c_contiguous):
        return False
    numpy.copyto(array_bytes(destination)[start:stop], array_bytes(source)[start:stop])
    return True


def _memcpy_pair(destination: torch.Tensor, source: torch.Tensor, contiguous: bool = False) -> bool:
    """Whether memcpy copies this pair as ``copy_`` would: CPU both, one dtype and shape
    (no cast, no broadcast), and, for a range of bytes, both contiguous."""
    return (
        destination.dtype == source.dtype
        and destination.shape == source.shape
        and destination.is_cpu
        and source.is_cpu
        and (not contiguous or (destination.is_contiguous() and source.is_contiguous()))
    )


def _bytes(tensor: torch.Tensor) -> numpy.ndarray:
    """A contiguous CPU tensor's bytes, as a flat uint8 NumPy view."""
    return array_bytes(numpy_view(tensor))


def array_bytes(array: numpy.ndarray) -> numpy.ndarray:
    """A C-contiguous array's bytes, as a flat uint8 view (no copy)."""
    return array.reshape(-1).view(numpy.uint8)


def numpy_view(tensor: torch.Tensor) -> numpy.ndarray:
    """A NumPy view of a CPU tensor, in its shape and strides: of its own dtype, or of
    the same-size integer dtype where NumPy has none (``bfloat16`` -> ``int16``)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not _numpy_takes(tensor.dtype):
        tensor = tensor.view(_INTEGER_OF_SIZE[tensor.dtype.itemsize])
    return tensor.numpy()


def as_tensor(array: numpy.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that :func:`numpy_view` made ``array`` of (no copy)."""
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


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
            # The smaller pool is dropped, not shut down: a caller that got it may be
            # about to submit to it; its idle threads end once it is collected.
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
