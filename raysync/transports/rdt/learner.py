"""Learner process: the RDT sender, publishing each version as an RDT object."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, TransportError, TransportSender, VersionDone
from raysync.transports.nixl.agent import apply_ucx_cuda_defaults
from raysync.transports.object_store.bucket_stream import open_broker
from raysync.transports.object_store.buckets import Outgoing, closed_before_sent
from raysync.transports.rdt.agent import ray_agent_progress
from raysync.transports.rdt.ring import RdtRing
from raysync.transports.rdt.wire import (
    REQUIREMENT,
    RdtBucketStream,
    RdtPayload,
    tensor_transport_enabled,
)
from raysync.transports.ring_pool import RingPool

logger = logging.getLogger(__name__)

#: Seconds ``send`` waits for the broadcast that last used a buffer to end.
REUSE_WAIT_S = 600.0
#: Seconds ``send`` then waits for Ray to free it: every reader is done by then but
#: one that timed out, whose queued delivery call still holds the version's ref.
FREED_AFTER_END_S = 2.0
#: Buffers set aside for such stragglers (each as large as the model) before ``send``
#: waits out ``REUSE_WAIT_S`` for them instead.
SET_ASIDE_MAX = 2


@dataclass(eq=False)  # compared by identity: a version's own
class _Sent:
    """What the learner knows of a whole version a ``send`` took a pair for. Each field
    goes once from unknown to known: on its way (until ``submitted`` or ``abandoned``),
    then ``abandoned`` (it never reached the hub, or its ``send`` failed) or ``done``."""

    buffer: torch.Tensor | None = None  #: the pair's buffer it went into, once written
    done: VersionDone | None = None  #: its broadcast, once ``submitted``
    abandoned: bool = False

    def never_latest(self) -> bool:
        """Whether it is known never to have become the hub's latest: abandoned, or its
        broadcast ended refused by the hub (asked without waiting)."""
        return self.abandoned or (self.done is not None and self.done.refused())

    def may_be_latest(self) -> bool:
        """Whether the hub may hold it as the model's latest: its broadcast ended other
        than refused (published, or how is not known)."""
        done = self.done
        return done is not None and done.ended() and not done.refused()


@dataclass(eq=False)  # compared by identity: is it still the sender's?
class _Pair:
    """A model's two registered whole-version buffers, written in turn."""

    #: ``buffers[0]`` is written next, ``buffers[1]`` was written last (but see
    #: ``RdtSender._turn_back``)
    buffers: list[torch.Tensor]
    #: One ``send`` of this model at a time: the wait for the broadcast that last used
    #: the next buffer (other models' sends do not wait for that).
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The version written last; only a ``send`` holding ``lock`` changes it.
    last: _Sent | None = None
    #: (``RdtSender._lock`` held.) While none of its versions may have become the hub's
    #: latest, those not yet known never to have become it (on their way, or their
    #: broadcasts running). None once one may have: the hub keeps that one readable for
    #: late joiners, so the pair is kept until the sender closes.
    unsettled: list[_Sent] | None = field(default_factory=list)

    def track(self, sent: _Sent) -> None:
        """(``RdtSender._lock`` held.) A ``send`` took this pair for ``sent``."""
        if self.unsettled is not None:
            self.unsettled.append(sent)

    def never_published(self) -> bool:
        """(``RdtSender._lock`` held.) Whether every version it was taken for is known
        never to have become the hub's latest (refused by the hub, or abandoned): no
        late joiner will read its buffers. Settles what became known since last asked."""
        if self.unsettled is None:
            return False
        if any(sent.may_be_latest() for sent in self.unsettled):
            self.unsettled = None
            return False
        self.unsettled = [sent for sent in self.unsettled if not sent.never_latest()]
        return not self.unsettled


class RdtSender(TransportSender):
    def __init__(self, hub: HubContext | None = None) -> None:
        """``hub``: the hub it broadcasts through, whose bucket broker hands bucketed
        versions out (None: it sends whole versions only)."""
        context = ray.get_runtime_context()
        if context.get_actor_id() is not None and not tensor_transport_enabled(
            context.current_actor
        ):
            raise TransportError(f"the learner actor {context.get_actor_id()} {REQUIREMENT}")
        apply_ucx_cuda_defaults()  # before Ray's NIXL agent starts in this process
        self._progress = ray_agent_progress()
        self._hub = hub
        #: Whole versions: two registered buffers per model (the hub keeps each model's
        #: latest version readable for late joiners: one model's buffer is not another's
        #: to reuse), spec and device, written in turn; let go of if none of its versions
        #: became the latest (``_let_go_of_unpublished``).
        self._pairs: dict[tuple[str, WeightSpec, torch.device], _Pair] = {}
        #: Bucketed versions: the rings of two registered slots (one per version
        #: streaming at once, see :mod:`raysync.transports.ring_pool`), and each version
        #: ``send_buckets`` started until ``submitted``.
        self._rings: RingPool[RdtRing] = RingPool(_new_ring)
        self._outgoing: dict[str, tuple[RdtRing, Outgoing]] = {}
        #: A whole version's ref (hex) -> the version, from ``send`` to ``submitted``
        self._in: dict[str, _Sent] = {}
        #: id of a buffer -> the broadcast that last used it
        self._broadcasts: dict[int, VersionDone] = {}
        #: Buffers a straggler still holds a version in (see ``_reusable``)
        self._set_aside: list[torch.Tensor] = []
        #: Buffers, rings, registrations, and each write into a buffer (``send``,
        #: ``send_buckets``); never held while a ``send`` waits for a buffer's last
        #: broadcast (its pair's ``lock`` is).
        self._lock = threading.Lock()
        self._closed = False  #: under ``_lock``: a send after ``close`` registers nothing
        #: ``_in``, ``_broadcasts`` and ``_outgoing``: never held while waiting, so that
        #: the versions already handed to the hub go on (a bucketed one streams from
        #: ``submitted``) while a ``send`` waits.
        self._state = threading.Lock()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str) -> RdtPayload:
        """Pack this version into the model's next buffer (``_turn_back``), once free (see
        ``_reusable``), and publish it. Only this model's sends wait with it: one slow
        receiver of model a does not hold up model b's broadcasts."""
        device = tensors[spec.names[0]].device
        layout = PackedLayout.of(spec)
        key = (model, spec, device)
        sent = _Sent()
        with self._lock:
            self._check_not_closed(f"version of model {model!r}")
            self._let_go_of_unpublished()  # first: a refused model's retry registers anew
            pair = self._pairs.get(key) or self._register_pair(key, layout.nbytes)
            pair.track(sent)
            self._deregister_freed()
        try:
            with pair.lock:
                self._turn_back(pair)
                buffer = self._reusable(pair, model)
                with self._lock:  # close() deregisters the buffers under it
                    self._check_open(pair, model)
                    pair.buffers.reverse()  # next time, the other buffer
                    sent.buffer, pair.last = buffer, sent
                    layout.pack(tensors, buffer)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    payload = RdtPayload(ray.put([buffer], _tensor_transport="nixl"))
                with self._state:
                    self._in[payload.ref.hex()] = sent
                return payload
        except BaseException:  # interrupted or cancelled while it waits, too
            sent.abandoned = True
            raise

    def _register_pair(self, key: tuple[str, WeightSpec, torch.device], nbytes: int) -> _Pair:
        """(``_lock`` held.) The pair of model, spec and device ``key``: two buffers of
        ``nbytes``, registered with Ray's NIXL agent."""
        from ray.experimental import register_nixl_memory

        buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=key[2]) for _ in range(2)]
        for buffer in buffers:
            register_nixl_memory(buffer)
        pair = self._pairs[key] = _Pair(buffers)
        return pair

    def _turn_back(self, pair: _Pair) -> None:
        """(In ``send``, the pair's ``lock`` held.) Make the buffer written last the next
        one again if its version is known never to have become the hub's latest
        (refused by the hub, or abandoned). The latest, if the pair holds it, is then
        in the other buffer, whose RDT object the hub holds for late joiners until a
        newer version is published: taking that one, ``_reusable`` would set it aside
        and register a new buffer as large as the model (past ``SET_ASIDE_MAX``, wait
        ``REUSE_WAIT_S`` for it, then fail)."""
        last = pair.last
        if last is None or pair.buffers[1] is not last.buffer or not last.never_latest():
            return
        with self._lock:  # close() deregisters the buffers under it
            pair.buffers.reverse()

    def _let_go_of_unpublished(self) -> None:
        """(``_lock`` held.) Deregister and forget each pair none of whose versions
        became the hub's latest, each known refused or abandoned (a misspelt model's,
        one whose spec the hub refuses): the hub keeps none of them for late joiners,
        and they held memory as large as the model until the sender closed. The model's
        next version registers a pair anew; Ray keeps a buffer alive while a ref to its
        last object is out."""
        from ray.experimental import deregister_nixl_memory

        for key, pair in list(self._pairs.items()):
            if not pair.never_published():
                continue
            del self._pairs[key]
            with self._state:
                for buffer in pair.buffers:
                    self._broadcasts.pop(id(buffer), None)
            for buffer in pair.buffers:
                deregister_nixl_memory(buffer)

    def _check_not_closed(self, what: str) -> None:
        """(``_lock`` held.) Raise once closed (its handle released, or the hub found
        closed, while another thread broadcast): buffers registered now would never be
        let go, and the version would go out through a released sender."""
        if self._closed:
            raise TransportError(f"rdt: the sender closed before {what} was sent")

    def _check_open(self, pair: _Pair, model: str) -> None:
        """(``_lock`` held.) Raise if the sender closed since ``pair`` was looked up."""
        if pair not in self._pairs.values():
            raise TransportError(
                f"rdt: the sender closed while model {model!r}'s version waited for its buffer"
            )

    def _reusable(self, pair: _Pair, model: str) -> torch.Tensor:
        """(The pair's ``lock`` held.) ``pair.buffers[0]``, the one to write next, once
        the version in it is freed: after its broadcast ended, and Ray dropped its last
        ref. A receiver that timed out while busy keeps its queued delivery call, and
        that version's ref, for as long as it stays busy: its buffer is set aside for it
        (freed once it lets go) and a new one takes its place, so the learner does not
        wait on it.

        The wait holds the pair's lock only: another thread's version of another model
        may be one a receiver must read before it can end the broadcast waited for
        (under the lock ``submitted`` takes, a bucketed one never streamed until that
        broadcast timed out), and one slow receiver of this model would otherwise hold
        every other model's sends."""
        from ray.experimental import register_nixl_memory, wait_tensor_freed

        buffer = pair.buffers[0]
        with self._state:
            done = self._broadcasts.pop(id(buffer), None)
        if done is not None:
            try:
                done.wait(REUSE_WAIT_S)
            except TimeoutError:
                pass  # Ray's word below decides
        try:
            wait_tensor_freed(buffer, timeout=FREED_AFTER_END_S)
            return buffer
        except TimeoutError:
            pass
        with self._lock:  # the set-aside list and registrations
            self._check_open(pair, model)
            if len(self._set_aside) < SET_ASIDE_MAX:
                self._set_aside.append(buffer)
                pair.buffers[0] = fresh = torch.zeros_like(buffer)
                register_nixl_memory(fresh)
                logger.warning(
                    "an rdt version's ObjectRef is still held %g s after its broadcast ended "
                    "(a receiver that timed out has its delivery queued): its buffer is set "
                    "aside until freed, and the learner writes a new one",
                    FREED_AFTER_END_S,
                )
                return fresh
        try:
            wait_tensor_freed(buffer, timeout=REUSE_WAIT_S)
        except TimeoutError as err:
            raise TransportError(
                f"an earlier version in this learner's rdt buffer is still referenced after "
                f"{REUSE_WAIT_S:g} s (a receiver or the hub still holds its ObjectRef), and "
                f"{SET_ASIDE_MAX} buffers are already set aside for such receivers"
            ) from err
        return buffer

    def _deregister_freed(self) -> None:
        """(``_lock`` held.) Deregister the buffers set aside that Ray has freed since."""
        from ray.experimental import deregister_nixl_memory, wait_tensor_freed

        kept = []
        for buffer in self._set_aside:
            try:
                wait_tensor_freed(buffer, timeout=0)
            except TimeoutError:
                kept.append(buffer)
                continue
            deregister_nixl_memory(buffer)
        self._set_aside = kept

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> RdtBucketStream:
        """A version larger than a bucket: published bucket by bucket out of a ring of
        two registered slots (see :mod:`raysync.transports.rdt.ring`) by ``submitted``;
        the ring is this version's until its stream ends
        (:mod:`raysync.transports.ring_pool`)."""
        if self._hub is None:
            raise TransportError("this sender was opened without a hub: whole versions only")
        with self._lock:
            self._check_not_closed("a bucketed version")
            self._let_go_of_unpublished()
            # Opened (found) for each version: a broker that died since is started again.
            broker = open_broker(self._hub)
            ring, stream, outgoing = self._rings.start(broker, tensors, spec, bucket_bytes, stall_s)
            payload = RdtBucketStream(stream.broker, stream.key, stream.bucket_bytes)
            with self._state:
                self._outgoing[payload.key.id] = (ring, outgoing)
            return payload

    def submitted(self, payload: RdtPayload | RdtBucketStream, done: VersionDone) -> None:
        """Stream a bucketed version out of its ring (a whole one is already published)."""
        if self._progress is not None:
            self._progress.serving(done)
        if isinstance(payload, RdtBucketStream):
            with self._state:
                started = self._outgoing.pop(payload.key.id, None)
            if started is None:  # the sender closed since (its handle released, the hub gone)
                raise closed_before_sent(payload, "rdt")
            ring, outgoing = started
            try:
                ring.stream_out(payload, outgoing, done)
            finally:
                self._rings.give_back(ring)
            return
        with self._state:
            sent = self._in.pop(payload.ref.hex(), None)
            if sent is not None:
                sent.done = done
                self._broadcasts[id(sent.buffer)] = done

    def abandoned(self, payload: RdtPayload | RdtBucketStream, why: str) -> None:
        """A whole version never became the hub's latest: its pair is let go of now if
        none of its versions did. A bucketed one gives its ring back, and its readers
        are told why."""
        ring, sent = None, None
        with self._state:
            if isinstance(payload, RdtBucketStream):
                ring, _ = self._outgoing.pop(payload.key.id, (None, None))
            else:
                sent = self._in.pop(payload.ref.hex(), None)
        if ring is not None:
            self._rings.give_back(ring)
        if isinstance(payload, RdtBucketStream):
            payload.broker.end.remote(payload.key, why)
        if sent is not None:
            sent.abandoned = True
            with self._lock:
                self._let_go_of_unpublished()

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        with self._lock, self._state:
            self._closed = True
            for pair in self._pairs.values():
                for buffer in pair.buffers:
                    deregister_nixl_memory(buffer)
            for ring in self._rings:
                for slot in ring.tensors:
                    deregister_nixl_memory(slot)
            for buffer in self._set_aside:
                deregister_nixl_memory(buffer)
            self._set_aside.clear()
            self._in.clear()
            self._broadcasts.clear()
            self._pairs.clear()
            self._rings.clear()
            self._outgoing.clear()


def _new_ring(bucket_bytes: int, device: torch.device) -> RdtRing:
    """Two bucket slots on ``device``, registered with Ray's NIXL agent (and more, each
    in the place of one set aside for a straggling reader)."""
    from ray.experimental import deregister_nixl_memory

    return RdtRing(
        [_registered_slot(bucket_bytes, device) for _ in range(2)],
        REUSE_WAIT_S,
        new_slot=lambda like: _registered_slot(like.numel(), like.device),
        deregister=deregister_nixl_memory,
    )


def _registered_slot(nbytes: int, device: torch.device) -> torch.Tensor:
    """A bucket slot of ``nbytes`` on ``device``, registered with Ray's NIXL agent."""
    from ray.experimental import register_nixl_memory

    slot = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    register_nixl_memory(slot)
    return slot
