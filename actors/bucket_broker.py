"""BucketBroker: hands one hub's bucketed versions from learners to receivers (an async
Ray actor), a few buckets at a time.

Started by a hub that has a ``bucket_mb`` as it starts (so its first bucketed broadcast
does not wait for this process), else by the first learner that sends a bucketed version
through the hub (named
:func:`raysync.transports.object_store.bucket_stream.broker_name`, so every learner of
the hub finds the same one), detached from that learner (a sharded learner's rank may
die; the others' versions go on), stopped by the hub when it closes, and by itself once
its hub is closed or dead. It never holds bytes: each bucket is an object the learner
put, and the broker keeps only its reference, from ``offer`` until every reader has
taken it, so the object store holds at most
:data:`~raysync.transports.object_store.bucket_stream.BUCKETS_IN_FLIGHT` buckets of a
version whatever the model's size, and never imports torch. Who calls what, per
version (one *stream*):

* the learner: ``offer(stream, k, [ref], sender)`` for each bucket (``sender``: its
  own actor, watched while any stream of it runs), and before putting bucket
  ``k`` ``room(stream, k)``, which returns once every reader has taken the
  buckets before ``k - 1``; ``end(stream, why)`` if the broadcast ended before it was
  done;
* the hub's planner: ``readers(stream, workers)`` when it plans the version,
  ``drop_reader(worker)`` when a receiver dies or leaves, ``finished(stream)`` to find
  receivers that hold a version a late joiner needs, and ``end(stream, why)`` when the
  one it asked to serve it cannot;
* the hub, for a version several planners name readers of (object-store receivers,
  ``rpc``'s agent, ``distributed``'s rank 0, planned at once): ``hold(stream)`` before
  they plan and ``seal(stream)`` once they all did. Meanwhile the readers named so far
  are not all of them: no bucket is freed, the learner gets no room past the first
  buckets, and no reader set left empty (a receiver died) ends the stream;
* each receiver: ``take(stream, k, worker, copied=c)`` for bucket ``k``, saying it has
  copied ``c`` buckets (default: every bucket before ``k``). A receiver keeps two asks
  ahead: it asks for buckets 0 and 1, then for ``k + 2`` with ``copied=k + 1`` as soon
  as it has read bucket ``k``; a relay asks for ``k + 1`` while it passes ``k`` on.
  ``take(stream, count, worker)`` at the end, or ``leave(stream, worker)`` if it gives
  the version up (refused it, or could not read a bucket).

The broker stamps each of those calls on its clock (:mod:`raysync.transports.hand_off`):
``hand_off()`` says where the time between a stream's buckets went.

Ray does not keep an async actor's calls in order, so any of them may be the first the
broker hears of a stream (a :class:`~raysync.transports.object_store.bucket_stream.StreamId`:
its id, bucket count and the receivers' wait): each one opens it. A stream the hub has
not planned (named its readers; sealed them too, if it held them) within twice that wait
(it refused the version; one part of a version sent in parts waits up to that wait for
the others before the hub plans the whole; its delivery broke off while the hub held
them), or whose readers have not finished within it of its last bucket and its plan,
whichever came later (the receivers of a version in parts read its streams one after
the other, from the plan on), ends and frees its buckets.

A reader that has not taken bucket ``k - 1`` within the stream's ``stall_s`` (half its
``wait_s``) of the learner asking for room, once the stream is planned and some reader
began it, is dropped from the stream (its ``take`` then answers why): one stuck
receiver fails only itself, the others go on. A version served to a late joiner that
no reader began within ``wait_s`` of its plan drops its reader too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from raysync.background import BackgroundTasks
from raysync.bounded import keep_newest
from raysync.transports.hand_off import HandOff, HandOffClock
from raysync.transports.object_store.bucket_stream import BUCKETS_IN_FLIGHT, SenderActor, StreamId

#: Streams whose end is remembered, so a late ``take`` is told the buckets are gone.
_ENDED_KEPT = 256
#: Streams whose hand-off clock is kept (:meth:`BucketBroker.hand_off`).
_CLOCKS_KEPT = 16
logger = logging.getLogger(__name__)

#: Seconds between the broker's looks at whether its hub still runs.
_HUB_LOOK_S = 5.0
#: Seconds between the broker's looks at which process runs a stream's sender.
_SENDER_LOOK_S = 1.0
#: Seconds the broker waits for Ray's GCS to say which process runs a sender.
_GCS_ANSWER_S = 10.0
#: Why a reader the hub dropped (:meth:`BucketBroker.drop_reader`) is out of a stream.
_DROPPED_BY_HUB = "the hub dropped it (it died or left)"


@dataclass
class _Stream:
    key: StreamId
    buckets: dict[int, list[ray.ObjectRef]] = field(default_factory=dict)
    offered: int = 0  #: buckets the learner has put so far
    #: Every reader copied the buckets below it: they were freed. (Not ``offered``: Ray
    #: may start the learner's offers out of order, bucket 1 before bucket 0.)
    freed_below: int = 0
    readers: set[str] | None = None  #: the workers it goes to; None: none named yet
    #: The hub said more planners name readers (:meth:`BucketBroker.hold`), and has not
    #: sealed the set yet: the readers named so far are not all of them.
    held: bool = False
    taken: dict[str, int] = field(default_factory=dict)  #: worker -> buckets it copied
    asked: dict[str, int] = field(default_factory=dict)  #: worker -> bucket it asked for last
    dropped: dict[str, str] = field(default_factory=dict)  #: worker -> why
    finished: list[str] = field(default_factory=list)  #: readers that took every bucket
    ended: str | None = None  #: why the learner stopped sending it
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    sender: str | None = None  #: the actor id of the process that puts it, if watched
    sender_process: str | None = None  #: that process's worker id
    clock: HandOffClock = field(default_factory=HandOffClock)
    deadline_set: bool = False  #: whether its readers' deadline to finish runs
    planned_at: float | None = None  #: ``time.monotonic()`` when it was first planned

    @property
    def planned(self) -> bool:
        """Whether every reader is named: the hub named readers, and it does not hold
        the set open for another planner's."""
        return self.readers is not None and not self.held

    def behind(self, needed: int) -> list[str]:
        """Readers that have copied fewer than ``needed`` buckets (all, unplanned)."""
        if self.readers is None or self.held:  # not planned
            return ["(not planned yet)"]
        return [w for w in self.readers if self.taken.get(w, 0) < needed]

    def free_taken(self) -> None:
        """Forget the buckets every reader has taken: the object store frees them. Not
        before every reader is named: one still to come has taken none."""
        if self.readers is None or self.held:  # not planned
            return
        lowest = min((self.taken.get(w, 0) for w in self.readers), default=self.key.count)
        for index in [i for i in self.buckets if i < lowest]:
            del self.buckets[index]
        self.freed_below = max(self.freed_below, lowest)

    async def changed_now(self) -> None:
        async with self.changed:
            self.changed.notify_all()


@dataclass(frozen=True)
class BrokerStats:
    """What the broker holds, for tests and benchmarks."""

    streams: int  #: versions being streamed now
    peak_buckets: int  #: the most bucket references one stream held at once, ever


async def _process_running(actor_id: str) -> str | None:
    """The worker id (hex) of the process that runs the actor ``actor_id`` now; None if
    it is dead or restarting. Asked of Ray's GCS by id, as Ray's dashboard does (Ray's
    state API needs the dashboard, which a cluster may run without; a handle of the
    actor would import its class here: see
    :class:`~raysync.transports.object_store.bucket_stream.SenderActor`)."""
    worker: Any = ray._private.worker.global_worker
    gcs = worker.gcs_client
    key = ray.ActorID.from_hex(actor_id)
    found = await gcs.async_get_all_actor_info(actor_id=key, timeout=_GCS_ANSWER_S)
    info = found.get(key)
    if info is None or info.state != info.ALIVE:
        return None
    return info.address.worker_id.hex()


class BucketBroker:
    """See module docstring."""

    def __init__(self, hub: Any) -> None:
        """``hub``: the hub's actor handle; the broker ends itself once it is gone."""
        self._hub = hub
        self._watching: asyncio.Task | None = None
        self._streams: dict[str, _Stream] = {}
        #: stream id -> why it ended ("" once every reader took it), who was dropped,
        #: who took every bucket
        self._ended: dict[str, tuple[str, dict[str, str], list[str]]] = {}
        #: model -> the streams of its latest version (:meth:`latest`): their ends are
        #: remembered however many other streams end after
        self._latest_of: dict[str, frozenset[str]] = {}
        self._peak = 0
        #: actor id of a stream's sender -> the ids of its streams that still run
        self._sending: dict[str, set[str]] = {}
        #: actor id -> the one task watching it (it outlives the sender's streams while
        #: its call waits behind a long method, and covers the sender's next streams)
        self._watches: dict[str, asyncio.Task] = {}
        #: stream id -> its hand-off clock (once it ended, the clock's summary), for the
        #: last ``_CLOCKS_KEPT`` streams opened
        self._clocks: dict[str, HandOffClock | HandOff] = {}
        self._background = BackgroundTasks("bucket broker")  #: streams ended by timers
        # An actor: unit tests make a plain object, in a process where Ray may be up.
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            # Its own call: one from the hub that opened it would be dropped by Ray if
            # the hub died before the broker ran it, and the broker would outlive it.
            ray.get_runtime_context().current_actor.watch_hub.remote()

    async def watch_hub(self) -> None:
        """Start watching the hub, if not yet: the broker asks itself as it starts, so
        that one whose hub dies before any stream reached it still ends."""
        self._watch_hub()

    # -- the learner ------------------------------------------------------------------
    async def offer(
        self,
        key: StreamId,
        index: int,
        boxed: list[Any],
        sender: SenderActor | None = None,
    ) -> None:
        """Bucket ``index`` is in the object store (``boxed``: its ref, in a list so that
        Ray passes the ref, not the bytes), or in a ring slot (a
        :class:`~raysync.transports.object_store.bucket_stream.RingBucket`). ``sender``:
        the actor process that puts the stream (None: a driver); once it is gone, the
        stream ends within ``_SENDER_LOOK_S`` instead of its readers waiting
        ``key.wait_s`` for a bucket that never comes."""
        state = self._open(key)
        if state is None:
            return
        if sender is not None:
            self._watch(state, sender)
        state.clock.offer(index)
        state.buckets[index] = boxed
        state.offered = max(state.offered, index + 1)
        state.free_taken()
        self._peak = max(self._peak, len(state.buckets))
        self._start_readers_deadline(state)
        await state.changed_now()

    async def room(self, key: StreamId, index: int) -> str | None:
        """Wait until bucket ``index`` may be put: every reader has copied the buckets
        :data:`BUCKETS_IN_FLIGHT` before it. Readers still behind ``key.stall_s`` after
        the version was planned and a reader began reading it are dropped (a receiver
        reads the parts of a version one stream after the other: the later ones wait
        for it meanwhile); so are the readers of a version served to a late joiner
        (``key.served``) that none began within ``key.wait_s`` of its plan (its pull
        gave up first: nothing else would end it; a broadcast's ends with the broadcast).
        None, or why the stream cannot go on."""
        stall_s = key.stall_s
        state = self._open(key)
        if state is None:
            return self._ended.get(key.id, ("",))[0] or "the stream is over"
        state.clock.ask_room(index)
        needed = index - BUCKETS_IN_FLIGHT + 1
        stalled_at = None  #: when the stall deadline ends, once a reader began
        async with state.changed:
            while state.ended is None and state.behind(needed):
                if state.planned and state.taken and stalled_at is None:
                    stalled_at = time.monotonic() + stall_s
                deadline, why = _room_deadline(state, stalled_at, needed)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    for worker in state.behind(needed):
                        self._drop(state, worker, why)
                    break
                try:
                    await asyncio.wait_for(state.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass  # a deadline passed: the next turn drops who is behind
        if state.ended is not None:
            return state.ended
        if not state.readers:
            return "no receiver reads this version any more"
        state.clock.grant_room(index)
        return None

    async def end(self, key: StreamId, why: str) -> None:
        """The broadcast ended before every bucket was taken (``why``)."""
        state = self._streams.pop(key.id, None)
        if state is None and key.id in self._ended:
            return  # ended before (its record says who read it whole)
        self._remember_end(key.id, why, state)
        if state is not None:
            state.ended = why
            state.buckets.clear()
            await state.changed_now()

    # -- the hub's planner ----------------------------------------------------------------
    async def readers(self, key: StreamId, workers: list[str]) -> None:
        """The version of ``key`` goes to ``workers`` too: each planner whose receivers
        read it names its readers (the object store's: receivers; ``rpc``'s: its agent),
        and a relay that gives the version up names its members. Unless the hub holds
        the stream (:meth:`hold`), the readers named so far are all of them."""
        state = self._open(key)
        if state is None:
            return
        state.readers = (state.readers or set()) | {w for w in workers if w not in state.dropped}
        self._now_planned(state)
        await state.changed_now()

    async def hold(self, key: StreamId) -> None:
        """Hub, before the planners of a version that several of them name readers of
        run (at once): the readers they name are not all of them until :meth:`seal`.
        Else a bucket every reader named so far took was freed before the next planner
        named its relay, and an object-store receiver that died left no reader: the
        stream freed every bucket, and the learner was told nobody reads it."""
        state = self._open(key)
        if state is not None:
            state.held = True

    async def seal(self, key: StreamId) -> None:
        """Hub, once every planner of the version named its readers (none: nobody reads
        it): the readers named are all of them (but for those a relay hands the rest
        to). The stream goes on as one planned then: what every reader took is freed,
        and a stream with no reader left ends."""
        state = self._open(key)
        if state is None:
            return
        state.held = False
        if state.readers is None:
            state.readers = set()
        self._now_planned(state)
        if not state.readers and state.finished:  # the last finished before the seal
            self._end_read(state)
        elif not state.readers:  # the last was dropped before the seal, or none was named
            self._end_unread_later(state)
        await state.changed_now()

    async def drop_reader(self, worker: str) -> None:
        """``worker`` died or left; no stream waits for it: not one it reads, nor one
        it is named a reader of later (a relay that gives a version up hands its
        members the rest, and may not have heard of the death)."""
        for state in list(self._streams.values()):
            if worker not in state.dropped:
                self._drop(state, worker, _DROPPED_BY_HUB)
                await state.changed_now()

    async def readmit(self, worker: str) -> None:
        """``worker`` registered again (a new process under the same worker id): the
        streams its earlier process was dropped from by :meth:`drop_reader` before it
        took any bucket (opened ahead, not planned yet) may name it a reader again."""
        for state in self._streams.values():
            if state.dropped.get(worker) == _DROPPED_BY_HUB and worker not in state.taken:
                del state.dropped[worker]

    # -- receivers -------------------------------------------------------------------------
    async def leave(self, key: StreamId, worker: str) -> None:
        """``worker`` gave the version up (it refused it, or could not read a bucket;
        its ack says why): neither the learner nor the other readers wait for it."""
        state = self._open(key)  # the first call about a stream may be this one
        if state is None or worker in state.dropped or worker in state.finished:
            return
        self._drop(state, worker, "it gave the version up (its ack says why)")
        await state.changed_now()

    async def take(
        self,
        key: StreamId,
        index: int,
        worker: str,
        passed_on: tuple[str, ...] = (),
        copied: int | None = None,
    ) -> tuple[list[ray.ObjectRef] | None, str | None]:
        """Bucket ``index`` for ``worker`` (waiting up to ``key.wait_s`` for the learner
        to put it), which has copied the ``copied`` buckets before it (default: every
        bucket before ``index``; one less when it asks for the next bucket while it
        still reads this one). ``(boxed ref, None)``, or ``(None, why not)``;
        ``index == count`` says the reader is done: ``(None, None)``, and ``passed_on``
        names the receivers it handed every bucket to (a relaying reader, ``rpc``'s
        agent): like readers that finished, they may serve the version."""
        state = self._open(key)
        if state is None:
            why, dropped, _ = self._ended.get(key.id, ("", {}, []))
            if worker in dropped:
                return None, f"this receiver was dropped from the stream: {dropped[worker]}"
            why = why or "every reader took it"
            return None, (
                f"the version's stream is over ({why}); its buckets are gone, and no "
                "receiver holding it whole served it (a pull receiver needs a push "
                "receiver of the model beside it; a push receiver gets the next version)"
            )
        if worker in state.dropped:
            return None, f"this receiver was dropped from the stream: {state.dropped[worker]}"
        state.taken[worker] = max(state.taken.get(worker, 0), index if copied is None else copied)
        state.asked[worker] = max(state.asked.get(worker, 0), index)
        state.free_taken()
        if index >= key.count:
            # A member that gave the version up (a distributed one that sat in its
            # collectives unread) holds nothing to serve, though its relay passed it on.
            state.finished.extend(w for w in passed_on if w not in state.dropped)
            self._finish_reader(state, worker)
            await state.changed_now()
            return None, None
        state.clock.take(worker, index)
        if index < state.freed_below and index not in state.buckets:
            return None, (
                f"bucket {index} of {key.count} is gone: every reader of the version took "
                "it before this receiver asked (it was not among the version's readers)"
            )
        async with state.changed:
            state.changed.notify_all()
            try:
                await asyncio.wait_for(
                    state.changed.wait_for(
                        lambda: (
                            index in state.buckets
                            or state.ended is not None
                            or worker in state.dropped
                        )
                    ),
                    key.wait_s,
                )
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                return None, (
                    f"bucket {index} of {key.count} did not arrive within {key.wait_s:g} s "
                    f"(the {_sender_of(key)} may have died or stalled)"
                )
        if worker in state.dropped:
            return None, f"this receiver was dropped from the stream: {state.dropped[worker]}"
        if index in state.buckets:
            state.clock.answer(worker, index)
            return state.buckets[index], None
        return None, f"the {_sender_of(key)} stopped sending this version: {state.ended}"

    def latest(self, model: str, keys: list[StreamId]) -> None:
        """Hub: ``keys``' streams carry the latest version of ``model``. Who read them
        whole (they serve it to late joiners) is remembered until a newer version of
        it comes, however many other streams end meanwhile (another model's, every
        step: a late joiner of this one was then served nobody's copy, and waited out
        the timeout for buckets long gone)."""
        self._latest_of[model] = frozenset(key.id for key in keys)

    def finished(self, key: StreamId) -> list[str]:
        """Hub's planner: the readers that took every bucket of ``key``'s stream (they
        may serve the version to a late joiner)."""
        state = self._streams.get(key.id)
        if state is not None:
            return list(state.finished)
        return list(self._ended.get(key.id, ("", {}, []))[2])

    async def holders(self, key: StreamId, worker: str) -> list[str] | None:
        """Hub's planner, for ``worker`` reading ``key``'s version outside its broadcast
        (joining, restarted): the readers that took every bucket (they may serve it),
        once one has. While the stream runs and none has, this waits for the first, up to
        ``key.wait_s``: a version streamed back to back with the next one always runs
        when a receiver joins, and its buckets are no one else's to take. None if
        ``worker`` is one of its readers still (a restarted process taken in again): it
        reads the stream itself."""
        state = self._streams.get(key.id)
        if state is None:
            return self.finished(key)

        def settled() -> bool:
            return (
                worker in (state.readers or ())
                or bool(state.finished)
                or state.ended is not None
                or self._streams.get(key.id) is not state
            )

        async with state.changed:
            try:
                await asyncio.wait_for(state.changed.wait_for(settled), key.wait_s)
            except asyncio.TimeoutError:  # the caller serves nobody's copy: its read says why
                pass
        if worker in (state.readers or ()):
            return None
        return list(state.finished)

    # -- tests and benchmarks ----------------------------------------------------------
    def stats(self) -> BrokerStats:
        return BrokerStats(streams=len(self._streams), peak_buckets=self._peak)

    def hand_off(self, stream: str | None = None) -> HandOff | None:
        """Where the time between buckets went in stream ``stream`` (an id), or in the
        last stream opened that had a bucket offered; None if the broker has no such
        stream's clock (it keeps the last few)."""
        if stream is not None:
            clock = self._clocks.get(stream)
            return None if clock is None else _summary(clock)
        for clock in reversed(self._clocks.values()):
            summary = _summary(clock)
            if summary.buckets:
                return summary
        return None

    def taken(self, worker: str) -> int:
        """The bucket ``worker`` asked for last in any stream (tests watch a reader's
        progress with it)."""
        return max((s.asked.get(worker, 0) for s in self._streams.values()), default=0)

    # -- inside --------------------------------------------------------------------------
    def _open(self, key: StreamId) -> _Stream | None:
        """The stream of ``key``, opened if this is the first call about it; None if it
        is over."""
        self._watch_hub()
        if key.id in self._ended:
            return None
        state = self._streams.get(key.id)
        if state is None:
            state = self._streams[key.id] = _Stream(key)
            self._clocks[key.id] = state.clock
            keep_newest(self._clocks, _CLOCKS_KEPT)
            asyncio.get_running_loop().call_later(
                2 * key.wait_s, self._expire, state, "the hub never planned this version", True
            )
            if key.sender is not None:
                self._watch(state, key.sender)
        return state

    def _watch(self, state: _Stream, sender: SenderActor) -> None:
        """``state``'s stream is put by ``sender``: it ends once that process is gone
        (:meth:`_watch_sender`, one task per actor)."""
        if state.sender is not None:
            return
        state.sender, state.sender_process = sender.actor_id, sender.worker_id
        self._sending.setdefault(sender.actor_id, set()).add(state.key.id)
        if sender.actor_id not in self._watches:
            watch = asyncio.get_running_loop().create_task(self._watch_sender(sender.actor_id))
            self._watches[sender.actor_id] = watch

    def _now_planned(self, state: _Stream) -> None:
        """``readers`` or ``seal`` named readers: once every one is named, its clocks run
        from now, and the buckets every reader took are freed."""
        if not state.planned:
            return
        if state.planned_at is None:
            state.planned_at = time.monotonic()
        state.free_taken()
        self._start_readers_deadline(state)

    def _start_readers_deadline(self, state: _Stream) -> None:
        """Once every bucket is offered and the hub planned the stream, its readers have
        ``wait_s`` to finish it (not from the last bucket: the stream of an early part
        of a version sent in parts waits for the others, then for its turn)."""
        if state.deadline_set or not state.planned or state.offered < state.key.count:
            return
        state.deadline_set = True
        asyncio.get_running_loop().call_later(
            state.key.wait_s, self._expire, state, "its readers did not finish in time", False
        )

    def _watch_hub(self) -> None:
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._outlive_hub())

    async def _outlive_hub(self) -> None:
        """End this actor once its hub is closed or dead (it is detached: nothing else
        would, if the hub's planner never heard of it)."""
        while True:
            await asyncio.sleep(_HUB_LOOK_S)
            try:
                closed = await self._hub.closed.remote()
            except ray.exceptions.ActorDiedError:
                closed = True
            except ray.exceptions.RayError:
                continue  # restarting, or slow to answer
            if closed:
                ray.kill(ray.get_runtime_context().current_actor)
                return

    async def _watch_sender(self, actor_id: str) -> None:
        """End each stream the actor ``actor_id`` puts once the process that puts it is
        gone (the actor died, or Ray restarts it: its new process holds none of them),
        asking Ray which process runs it every ``_SENDER_LOOK_S`` while any of its
        streams runs (a training loop's actor may be busy for hours: a call to it would
        wait behind the method that sends)."""
        while self._sending.get(actor_id):
            try:
                running = await _process_running(actor_id)
            except Exception as err:  # Ray's GCS did not answer: look again
                logger.warning("could not ask Ray which process runs %s: %r", actor_id, err)
            else:
                for stream in list(self._sending.get(actor_id, ())):
                    state = self._streams.get(stream)
                    if state is not None and state.sender_process != running:
                        why = "the process sending it " + (
                            "died" if running is None else "is gone: Ray restarted its actor"
                        )
                        await self.end(state.key, why)
            await asyncio.sleep(_SENDER_LOOK_S)
        self._sending.pop(actor_id, None)
        del self._watches[actor_id]

    def _expire(self, state: _Stream, why: str, unless_planned: bool) -> None:
        """End ``state`` for ``why`` if it still runs (and, ``unless_planned``, was
        never planned)."""
        if self._streams.get(state.key.id) is not state:
            return
        if unless_planned and state.planned:
            return
        self._background.spawn(self.end(state.key, why), f"end of stream {state.key.id}")

    def _drop(self, state: _Stream, worker: str, why: str) -> None:
        if state.readers is not None:
            state.readers.discard(worker)
        state.dropped[worker] = why
        state.free_taken()
        if state.planned and not state.readers:
            self._end_unread_later(state)

    def _end_unread_later(self, state: _Stream) -> None:
        """Nobody reads ``state`` any more: the learner's next ``room`` ends it, but a
        learner that died mid-version (a driver: not watched) never asks, and the stream
        stayed here for good. It ends once its wait passed, unless a relay adopted
        readers since."""
        asyncio.get_running_loop().call_later(state.key.wait_s, self._end_unread, state)

    def _end_unread(self, state: _Stream) -> None:
        if not state.readers:  # none adopted since (a relay names its members readers)
            self._expire(state, "no receiver reads this version any more", False)

    def _finish_reader(self, state: _Stream, worker: str) -> None:
        """``worker`` took every bucket; the stream ends once every reader has (and every
        one is named)."""
        state.finished.append(worker)
        if state.readers is None:
            return
        state.readers.discard(worker)
        state.free_taken()
        if state.planned and not state.readers:
            self._end_read(state)

    def _end_read(self, state: _Stream) -> None:
        """Every reader of ``state`` took every bucket: it is over."""
        self._streams.pop(state.key.id, None)
        self._remember_end(state.key.id, "", state)

    def _remember_end(self, stream: str, why: str, state: _Stream | None) -> None:
        """``stream`` ended (``state``: what it was, if the broker had it open)."""
        clock = self._clocks.get(stream)
        if isinstance(clock, HandOffClock):  # kept as its few figures
            self._clocks[stream] = clock.summary()
        if state is not None and state.sender is not None:
            self._sending.get(state.sender, set()).discard(stream)
        self._ended[stream] = (
            (why, {}, []) if state is None else (why, state.dropped, state.finished)
        )
        keep_newest(self._ended, _ENDED_KEPT, kept=frozenset().union(*self._latest_of.values()))


def _sender_of(key: StreamId) -> str:
    """Who puts ``key``'s buckets, for its readers' errors."""
    return "receiver serving it" if key.served else "learner"


def _room_deadline(
    state: _Stream, stalled_at: float | None, needed: int
) -> tuple[float | None, str]:
    """When the learner's wait for room in ``state`` ends with the readers that have not
    copied ``needed`` buckets dropped (None: not yet known), and why they are."""
    key = state.key
    if stalled_at is not None or state.planned_at is None or not key.served:
        return stalled_at, (
            f"it had not taken bucket {needed - 1} of {key.count} within {key.stall_s:g} s "
            "while the other receivers waited for it; the version went on without it"
        )
    return state.planned_at + key.wait_s, (
        f"no reader began the version within {key.wait_s:g} s of its plan (its "
        "receivers' wait for a bucket)"
    )


def _summary(clock: HandOffClock | HandOff) -> HandOff:
    return clock if isinstance(clock, HandOff) else clock.summary()
