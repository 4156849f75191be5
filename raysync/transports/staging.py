"""Receiver process: staging buffers reused across versions.

A transport that reads each version into memory of its own — registered with an agent
(``nixl``, ``rdt``), or a plain buffer a bucketed version is assembled in
(``object_store``, ``distributed``) — keeps one :class:`StagingPool` per receiver.
``fetch`` fills a buffer for the version's spec (a free one, else one the transport
creates, and registers if it must) and returns the views the fill made, leased with the
buffer; the receiver core hands those views back through ``release`` once the version
is applied (or, with zero copy, replaced), and the buffer is free again. A fill that
fails frees its buffer at once, unless a transfer into it may still run
(:class:`StillWriting`: a READ that timed out): that buffer is set aside, so a late
completion cannot land in a later version, until :data:`SET_ASIDE_KEPT` others of its
spec were set aside after it (each a READ timeout later: its own READ is long over by
then), so that a learner that keeps timing out costs a bounded number of buffers. A
buffer is never written
while leased, so a model that lives in it never changes under its reader. ``close``
hands every buffer the pool created back to the transport to deregister.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from raysync.copies import Viewed, viewed
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError

logger = logging.getLogger(__name__)

Buffer = TypeVar("Buffer")

#: Buffers of one spec set aside at most (their READs timed out); the oldest is taken
#: back when another is set aside.
SET_ASIDE_KEPT = 2


class StillWriting(TransportError):
    """A fill failed while a transfer into its buffer may still be running (a READ
    that timed out, which the agent may not abort): :meth:`StagingPool.fill` sets the
    buffer aside for good instead of freeing it."""


@functools.cache
def staging_device() -> torch.device:
    """Where this process stages versions: CUDA when it sees one, else CPU. The CUDA
    device is the one current in the thread that asked first (a receiver's ``attach``,
    in the caller's thread, which set it): a receiver opened again later in the hub
    watch's thread, where the current device is 0, stages there too."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StagingPool(Generic[Buffer]):
    """Buffers per spec, free or leased; thread-safe.

    ``create(spec)`` makes (and registers) a new buffer when none is free. ``Buffer``
    is whatever the transport keeps per buffer: a tensor (``rdt``), or a tensor with
    its registration and prepared transfers (``nixl``). ``discard(buffer)`` lets go of
    one that must be (registered memory): such a pool, once closed, makes none (a fill
    raises TransportError; one made as it closed is discarded), since nobody would let
    it go after. Without, a fill after close makes a fresh one, as before it.
    """

    def __init__(
        self,
        create: Callable[[WeightSpec], Buffer],
        discard: Callable[[Buffer], None] | None = None,
    ) -> None:
        self._create = create
        self._discard = discard
        self._closed = False
        self._lock = threading.Lock()
        self._free: dict[WeightSpec, list[Buffer]] = {}
        self._created: list[Buffer] = []
        self._leased: dict[int, tuple[WeightSpec, Buffer]] = {}
        self._set_aside: dict[WeightSpec, list[Buffer]] = {}
        #: id(tensor) -> (tensor, layout, its views): see :meth:`views`
        self._views: dict[int, tuple[torch.Tensor, PackedLayout, Sequence[torch.Tensor]]] = {}

    def fill(
        self, spec: WeightSpec, write: Callable[[Buffer], Sequence[torch.Tensor]]
    ) -> Sequence[torch.Tensor]:
        """``write(buffer)`` a version of ``spec`` into a buffer no lease holds; the views
        it returns, leased with that buffer until :meth:`release`. If ``write`` raises,
        the buffer is free again and the error goes on."""
        buffer = self._take(spec)
        try:
            # A sequence of its own: the lease is keyed by its identity, and a write may
            # return views it keeps (nixl's staging views) for every fill.
            written = write(buffer)
            staged = written.alias() if isinstance(written, Viewed) else list(written)
        except StillWriting as err:
            # Kept in ``created`` (``close`` deregisters it) and out of the free list.
            logger.warning("a staging buffer of %d bytes is set aside: %s", spec.nbytes, err)
            with self._lock:
                aside = self._set_aside.setdefault(spec, [])
                aside.append(buffer)
                if len(aside) > SET_ASIDE_KEPT:
                    self._free.setdefault(spec, []).append(aside.pop(0))
            raise
        except BaseException:
            with self._lock:
                self._free.setdefault(spec, []).append(buffer)
            raise
        with self._lock:
            self._leased[id(staged)] = (spec, buffer)
        return staged

    def _take(self, spec: WeightSpec) -> Buffer:
        """A buffer for ``spec`` that no lease holds (made if none is free)."""
        with self._lock:
            self._check_open()
            free = self._free.setdefault(spec, [])
            if free:
                return free.pop()
        buffer = self._create(spec)
        with self._lock:
            closed = self._closed and self._discard is not None
            if not closed:
                self._created.append(buffer)
        if closed:  # as it was made: nobody would let it go after
            assert self._discard is not None
            self._discard(buffer)
            raise _closed()
        return buffer

    def _check_open(self) -> None:
        """(Lock held.) Raise once closed, if its buffers must be let go."""
        if self._closed and self._discard is not None:
            raise _closed()

    def views(self, tensor: torch.Tensor, layout: PackedLayout) -> Sequence[torch.Tensor]:
        """``layout.views(tensor)`` of a buffer tensor this pool created (what a ``write``
        returns), with their NumPy views (:func:`raysync.copies.viewed`, which the
        receiver copies from), made once per buffer and layout: a buffer is filled once
        per version, and a model of 1000 tensors took ~1.4 ms to view each time. Kept
        until :meth:`close`, as the buffers are."""
        with self._lock:
            known = self._views.get(id(tensor))
        if known is None or known[0] is not tensor or known[1] is not layout:
            known = (tensor, layout, viewed(layout.views(tensor)))
            with self._lock:
                self._views[id(tensor)] = known
        return known[2]

    def release(self, staged: Sequence[torch.Tensor] | None) -> None:
        """The receiver is done with ``staged``: its buffer is free again. ``None`` (the
        fetch never returned) and views the pool no longer knows (after
        :meth:`close`) are ignored."""
        if staged is None:
            return
        with self._lock:
            lease = self._leased.pop(id(staged), None)
            if lease is not None:
                spec, buffer = lease
                self._free.setdefault(spec, []).append(buffer)

    def created(self) -> list[Buffer]:
        """Every buffer the pool made, free or leased."""
        with self._lock:
            return list(self._created)

    def close(self) -> list[Buffer]:
        """Forget every buffer and lease; the buffers, for the transport to deregister."""
        with self._lock:
            self._closed = True
            created, self._created = self._created, []
            self._free.clear()
            self._set_aside.clear()
            self._leased.clear()
            self._views.clear()
            return created


def _closed() -> TransportError:
    """A fill after :meth:`StagingPool.close`: the receiver registered again (or closed)
    while a delivery of its former registration still fetched."""
    return TransportError("this receiver closed: its staging buffers were let go")
