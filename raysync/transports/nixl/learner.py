"""Learner process: the NIXL sender, packing versions into registered buffers."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from raysync.copies import copy_on_this_thread
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, TransportError, TransportSender, VersionDone
from raysync.transports.nixl.agent import device_index, memory_type, new_agent
from raysync.transports.nixl.progress import SourceProgress
from raysync.transports.nixl.ring import BucketRing
from raysync.transports.nixl.wire import (
    ABANDONED,
    RING_SLOTS,
    SLOT_HEADER,
    Frame,
    NixlBucketStream,
    NixlPayload,
    NixlRegion,
)
from raysync.transports.object_store.bucket_stream import open_broker
from raysync.transports.object_store.buckets import Outgoing, closed_before_sent
from raysync.transports.ring_pool import RingPool

logger = logging.getLogger(__name__)

#: Stamps of every sender of this process: a sender opened again after ``release()``
#: may get buffers at the addresses of the one before, and a reader of one of its
#: versions (a late joiner's, a pull's) must not take the new sender's stamp for it.
_stamps = itertools.count(1)
_stamps_lock = threading.Lock()
#: Upper bound on how long ``send`` waits for the broadcast that last filled a buffer.
#: Broadcasts end within their own timeout; past this bound the stamps still protect
#: readers, so the learner goes on.
REUSE_WAIT_S = 600.0
#: Seconds a send waits for another thread's version in the same buffer to be written.
WRITTEN_WAIT_S = 5.0


@dataclass
class _SourceBuffer:
    tensor: torch.Tensor  #: uint8, stamps + packed tensors, registered
    region: NixlRegion
    frame: Frame
    broadcast: VersionDone | None = None  #: the end of the broadcast that last filled it
    #: The version ``send`` handed out and ``submitted`` writes: its stamp and sources.
    pending: tuple[int, list[torch.Tensor]] | None = None
    writing: bool = False  #: ``submitted`` is writing ``pending`` into it
    #: It holds no version a reader may ask for, so not the hub's latest: none was sent
    #: into it yet, or its last one was ``abandoned`` (it never left for the hub, or will
    #: never be written).
    void: bool = True


@dataclass
class _SourcePair:
    buffers: tuple[_SourceBuffer, _SourceBuffer]
    registered: Any  #: nixlRegDList, for deregistration
    #: The buffer of the version ``send`` handed out last (the first one before any: it
    #: holds none, so the first version goes there).
    last: int = 0
    #: One ``send`` of this model at a time: the choice of buffer, and the wait for the
    #: broadcast that last filled it (other models' sends do not wait for that).
    lock: threading.Lock = field(default_factory=threading.Lock)


class NixlSender(TransportSender):
    def __init__(self, hub: HubContext | None = None) -> None:
        """``hub``: the hub it broadcasts through, whose bucket broker hands bucketed
        versions out (None: it sends whole versions only)."""
        self._hub = hub
        self._agent = new_agent("learner", shared=True)
        self._progress = SourceProgress(self, self._agent)
        #: Whole versions: two registered buffers per model (the hub keeps each model's
        #: latest version readable for late joiners: one model's buffer is not another's
        #: to write, even of the same spec); let go of if none of its versions became the
        #: latest (``_free_unpublished``).
        self._pairs: dict[tuple[str, WeightSpec, torch.device], _SourcePair] = {}
        self._closed = False  #: set by close(): no buffer is registered after it
        self._by_address: dict[int, _SourceBuffer] = {}
        #: Bucketed versions: the rings (one per version streaming at once, see
        #: :mod:`raysync.transports.ring_pool`), their registrations, and each version
        #: ``send_buckets`` started until ``submitted`` streams it out.
        self._rings: RingPool[BucketRing] = RingPool(self._register_ring)
        self._ring_registrations: list[Any] = []
        self._outgoing: dict[str, tuple[BucketRing, Outgoing]] = {}
        self._registration = 0
        self._metadata = self._agent.get_agent_metadata()
        #: Registrations and the choice of ring (``send_buckets``); never held while a
        #: ``send`` waits for a buffer's last broadcast (its pair's ``lock`` is).
        self._lock = threading.Lock()
        #: Who holds each buffer (``pending``, ``broadcast``) and each bucketed version's
        #: ring: never held while waiting for a broadcast, so that the versions already
        #: handed to the hub are written (``submitted``) while a ``send`` waits.
        self._state = threading.Lock()
        #: Notified as a version sent into a buffer is written there, or abandoned.
        self._written = threading.Condition(self._state)

    def send(
        self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str
    ) -> NixlPayload:
        """Pick the buffer for this version (``_target``) and clear its stamps;
        ``submitted`` writes it.

        Waits for the broadcast that last filled the buffer. Meanwhile other threads'
        versions already handed to the hub are written: a receiver may be reading one
        of them before it can apply the version this waits for (two models broadcast
        from two threads: waiting under the lock ``submitted`` takes held the other
        model's write until that broadcast timed out). Only this model's sends wait with
        it: one slow receiver of model a does not hold up model b's broadcasts."""
        device = tensors[spec.names[0]].device
        key = (model, spec, device)
        pair = self._locked_pair(model, spec, device)
        try:
            index = self._target(pair)
            buffer = pair.buffers[index]
            with self._state:
                if not self._wait_until_written(buffer):
                    logger.warning(
                        "a version sent into this learner's buffer by another thread was not "
                        "written within %g s; the buffer is reused (that version fails)",
                        WRITTEN_WAIT_S,
                    )
                last, buffer.broadcast = buffer.broadcast, None
                # Claimed (stamp 0 is never sent): a version the wait gave up on is
                # refused by ``submitted`` instead of written under this one.
                buffer.pending = (0, [])
            try:
                self._wait_until_read(last)
                stamp = _next_stamp()
                buffer.frame.stamps(buffer.tensor).zero_()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                sources = buffer.frame.layout.byte_views(tensors)
            except BaseException:  # interrupted or cancelled while it waits, too
                with self._state:
                    buffer.pending = None
                    # Its readers may still read it: the next send into it waits for them.
                    buffer.broadcast = last
                    self._written.notify_all()
                raise
            # Both locks (close() takes them in this order): the metadata that holds this
            # buffer's registration, and no close between the look and the hand-out.
            with self._lock, self._state:
                closed = self._pairs.get(key) is not pair
                metadata, registration = self._metadata, self._registration
                buffer.pending = None if closed else (stamp, sources)
                # Only now: a send that failed before wrote no version the next must
                # keep clear of (it goes to the same buffer again).
                pair.last, buffer.void = index, False
                self._written.notify_all()
            if closed:
                raise TransportError(
                    f"nixl: the sender closed while model {model!r}'s version waited for "
                    "its buffer"
                )
            return NixlPayload(self._agent.name, metadata, registration, buffer.region, stamp)
        finally:
            pair.lock.release()

    def _locked_pair(self, model: str, spec: WeightSpec, device: torch.device) -> _SourcePair:
        """(``send``.) The pair of buffers the version of ``model`` goes into, its
        ``lock`` held for the caller to release: registered if the model has none, or
        if ``_free_unpublished`` (in another thread's send, or ``abandoned``) let it go
        while this waited for its lock. A pair is locked as it is registered: none is
        let go before its first version went in."""
        key = (model, spec, device)
        while True:
            with self._lock:
                self._check_open(f"model {model!r}'s version")
                self._free_unpublished(keep=key)
                pair = self._pairs.get(key)
                if pair is None:
                    pair = self._register(model, spec, device)
                    pair.lock.acquire()
                    return pair
            pair.lock.acquire()
            with self._lock:
                if self._pairs.get(key) is pair:
                    return pair
            pair.lock.release()

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> NixlBucketStream:
        """A version larger than a bucket: streamed out of a ring (see
        :mod:`raysync.transports.nixl.ring`) by ``submitted``; the ring is this
        version's until its stream ends (:mod:`raysync.transports.ring_pool`)."""
        if self._hub is None:
            raise TransportError("this sender was opened without a hub: whole versions only")
        with self._lock:
            self._check_open("a bucketed version")
            self._free_unpublished()
            # Opened (found) for each version: a broker that died since is started again.
            broker = open_broker(self._hub)
            ring, stream, outgoing = self._rings.start(broker, tensors, spec, bucket_bytes, stall_s)
            payload = NixlBucketStream(
                stream.broker,
                stream.key,
                stream.bucket_bytes,
                agent=self._agent.name,
                metadata=self._metadata,
                registration=self._registration,
                ring=ring.regions,
            )
            with self._state:
                self._outgoing[payload.key.id] = (ring, outgoing)
            return payload

    def submitted(self, payload: NixlPayload | NixlBucketStream, done: VersionDone | None) -> None:
        """Write the version into its buffer, bucket by bucket, while receivers read it;
        or stream a bucketed one out of its ring."""
        if done is not None:
            self._progress.serving(done)
        if isinstance(payload, NixlBucketStream):
            assert done is not None  # the learner's handle passes its broadcast's end
            with self._state:
                started = self._outgoing.pop(payload.key.id, None)
            if started is None:  # the sender closed since (its handle released, the hub gone)
                raise closed_before_sent(payload, "nixl")
            ring, outgoing = started
            try:
                ring.stream_out(payload, outgoing, done, copy_on_this_thread, _next_stamp)
            finally:
                self._rings.give_back(ring)
            return
        with self._state:
            buffer = self._by_address.get(payload.region.address)
            if buffer is None:  # the sender closed since (its handle released, the hub gone)
                raise TransportError(
                    f"nixl: the sender closed before version stamp {payload.stamp} was written"
                )
            pending = buffer.pending
            if pending is None or pending[0] != payload.stamp:
                raise TransportError(f"nixl: version stamp {payload.stamp} was not sent here")
            buffer.broadcast = done
            buffer.pending, buffer.writing = None, True
        stamp, sources = pending
        stamps = buffer.frame.stamps(buffer.tensor)
        try:
            if buffer.tensor.device.type == "cuda":
                # One pass, then the stamps: the GPU copies fast, and a stamp must not be
                # readable before the data it vouches for is.
                buffer.frame.layout.pack(sources, buffer.tensor)
                torch.cuda.synchronize(buffer.tensor.device)
                stamps.fill_(stamp)
                torch.cuda.synchronize(buffer.tensor.device)
                return
            for index, (start, end) in enumerate(buffer.frame.buckets):
                buffer.frame.layout.pack_range(
                    sources, buffer.tensor, start, end, copy=copy_on_this_thread
                )
                stamps[index] = stamp
        except BaseException:
            stamps.fill_(ABANDONED)
            raise
        finally:
            with self._state:
                buffer.writing = False
                self._written.notify_all()

    def abandoned(self, payload: NixlPayload | NixlBucketStream, why: str) -> None:
        """Free the buffer (or the ring's place) ``payload`` was sent into; readers
        handed it already find its stamps ``ABANDONED`` and fail at once. A model none of
        whose versions may have become the hub's latest lets go of its pair now."""
        if isinstance(payload, NixlBucketStream):
            with self._state:
                ring, _ = self._outgoing.pop(payload.key.id, (None, None))
            if ring is not None:
                self._rings.give_back(ring)
            payload.broker.end.remote(payload.key, why)
            return
        with self._state:
            buffer = self._by_address.get(payload.region.address)
            if buffer is None or buffer.pending is None or buffer.pending[0] != payload.stamp:
                return
            buffer.pending, buffer.void = None, True
            buffer.frame.stamps(buffer.tensor).fill_(ABANDONED)
            self._written.notify_all()
        with self._lock:
            self._free_unpublished()

    def _target(self, pair: _SourcePair) -> int:
        """(In ``send``, the pair's ``lock`` held: no other send moves ``pair.last``.)
        Which buffer of ``pair`` the next version goes into. The hub keeps the model's
        latest version readable for late joiners and pulls, and that may be the version
        written last: so the other buffer, unless the version written last is known
        never to have become the latest (``_never_latest``). Then the latest, if either
        buffer holds it, is in the other one, and two versions in a row that the hub
        refused (or that failed before they left) would have overwritten it. A refusal
        not back yet is not known: the next send does not wait for it, which would
        hold every version back until the one before it was acked (two in flight)."""
        if self._never_latest(pair.buffers[pair.last]):
            return pair.last
        return pair.last ^ 1

    def _never_latest(self, buffer: _SourceBuffer) -> bool:
        """(Its pair's ``lock`` held: ``send``, ``_free_unpublished``.) Whether
        ``buffer`` holds no version that may have become the hub's latest: none sent
        into it, or one ``abandoned``, or one whose broadcast ended refused by the hub
        before it was published. Not while that version is still on its way (handed
        out, or being written): whether the hub takes it is not known yet."""
        with self._state:
            if buffer.pending is not None or buffer.writing:
                return False
            void, broadcast = buffer.void, buffer.broadcast
        # Settled: only a send (which holds the pair's lock) changes it now. Asked
        # outside ``_state``, which ``submitted`` of other versions takes meanwhile.
        return void or (broadcast is not None and broadcast.refused())

    def _wait_until_written(self, buffer: _SourceBuffer) -> bool:
        """(The pair's ``lock`` and ``_state`` held.) Wait while another thread's version, sent into
        ``buffer``, is neither written to its end (``submitted``) nor ``abandoned``: three
        threads sending one spec at once would otherwise take the buffer from the first
        before it wrote, and lose that version after the hub took it (or write under it
        while it is written). The wait for a version not yet submitted is bounded by
        ``WRITTEN_WAIT_S``: the first thread may itself wait for this one (a broadcast on
        the channel path holds its model's lock across its hand-off), and
        then its version is lost (refused by ``submitted``) rather than both waiting.
        A write under way is always waited for to its end: it holds no lock, so it ends,
        and a version written beside it could mix both in one bucket under a stamp.
        False if it gave up on a version not yet submitted."""
        deadline = time.monotonic() + WRITTEN_WAIT_S
        while buffer.pending is not None or buffer.writing:
            if buffer.writing:
                self._written.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._written.wait(remaining)
        return True

    def _free_unpublished(self, keep: tuple[str, WeightSpec, torch.device] | None = None) -> None:
        """(``_lock`` held.) Deregister and forget each pair none of whose versions may
        have become the hub's latest, each known refused by the hub or abandoned (a
        misspelt model's, one whose spec the hub refuses): the hub keeps none of them
        for late joiners, and they held twice the model's memory until the sender
        closed. The model's next version registers a pair anew. Not the pair ``keep``
        names, whose model ``send`` sends again: its version goes into it (freed, it
        was registered again at once, and its receivers loaded the learner's metadata
        again). Nor a pair a ``send`` holds (choosing its buffer, or waiting for it):
        it is left for a later call."""
        for key, pair in list(self._pairs.items()):
            if key == keep or not pair.lock.acquire(blocking=False):
                continue
            try:
                if all(self._never_latest(buffer) for buffer in pair.buffers):
                    del self._pairs[key]
                    with self._state:
                        for buffer in pair.buffers:
                            del self._by_address[buffer.region.address]
                    self._agent.deregister_memory(pair.registered)
            finally:
                pair.lock.release()

    def _register(self, model: str, spec: WeightSpec, device: torch.device) -> _SourcePair:
        frame = Frame.of(spec)
        tensors = [
            torch.zeros(frame.layout.nbytes, dtype=torch.uint8, device=device) for _ in range(2)
        ]
        registered = self._registered(tensors, f"the two send buffers of model {model!r}")
        first, second = (
            _SourceBuffer(
                t,
                NixlRegion(t.data_ptr(), t.numel(), device_index(device), memory_type(device)),
                frame,
            )
            for t in tensors
        )
        buffers = (first, second)
        pair = _SourcePair(buffers, registered)
        self._pairs[(model, spec, device)] = pair
        with self._state:
            for buffer in buffers:
                self._by_address[buffer.region.address] = buffer
        return pair

    def _register_ring(self, bucket_bytes: int, device: torch.device) -> BucketRing:
        """(``_lock`` held: ``send_buckets`` takes rings under it.)"""
        tensors = [
            torch.zeros(SLOT_HEADER + bucket_bytes, dtype=torch.uint8, device=device)
            for _ in range(RING_SLOTS)
        ]
        registered = self._registered(tensors, f"a ring of {bucket_bytes}-byte buckets")
        regions = tuple(
            NixlRegion(t.data_ptr(), t.numel(), device_index(device), memory_type(device))
            for t in tensors
        )
        self._ring_registrations.append(registered)
        return BucketRing(tensors, regions)

    def _registered(self, tensors: list[torch.Tensor], what: str) -> Any:
        """Register ``tensors`` (``what`` they are) with the agent; receivers load its
        new metadata. TransportError saying which if NIXL refuses (pinned memory run
        out, a device UCX cannot register), before any receiver is asked to read."""
        try:
            registered = self._agent.register_memory(tensors)
        except Exception as err:
            nbytes = sum(t.nbytes for t in tensors)
            raise TransportError(
                f"NIXL could not register {what} ({nbytes} bytes on {tensors[0].device}): "
                f"{type(err).__name__}: {err}"
            ) from err
        self._registration += 1
        self._metadata = self._agent.get_agent_metadata()
        return registered

    def _wait_until_read(self, done: VersionDone | None) -> None:
        """Wait for ``done``, the end of the broadcast that last filled a buffer (see the
        package doc)."""
        if done is None:
            return
        try:
            done.wait(REUSE_WAIT_S)
        except TimeoutError:
            logger.warning(
                "a broadcast of this learner is still running after %g s; reusing its buffer "
                "(receivers still reading it will fail that version, not apply torn data)",
                REUSE_WAIT_S,
            )

    def _check_open(self, what: str) -> None:
        """(Holds ``_lock``.) A send after ``close`` (another thread's broadcast took
        this sender before the learner's handle closed it) registered a pair nobody
        deregisters: it fails instead."""
        if self._closed:
            raise TransportError(
                f"nixl: the sender closed before {what} was sent"
            )

    def close(self) -> None:
        with self._lock, self._state:
            self._closed = True
            # Now, not when the sender is collected (its ring pool's bound method makes
            # a cycle: a full collection away), so that a learner that releases its hub
            # per step leaves no thread polling a dead agent per step.
            self._progress.stop()
            for pair in self._pairs.values():
                self._agent.deregister_memory(pair.registered)
            for registered in self._ring_registrations:
                self._agent.deregister_memory(registered)
            self._pairs.clear()
            self._rings.clear()
            self._ring_registrations.clear()
            self._outgoing.clear()
            self._by_address.clear()


def _next_stamp() -> int:
    """A fresh stamp, larger than every one before in this process (whole buffers and
    ring slots), whichever sender wrote it."""
    with _stamps_lock:
        return next(_stamps)
