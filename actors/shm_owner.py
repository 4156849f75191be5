"""ShmOwner: owns the shared-memory segments of one hub on one node (a threaded Ray actor).

Started by :class:`raysync.transports.shared_memory.SharedMemoryPlanner` on every
node, named :func:`~raysync.transports.shared_memory.owner_name` so the learner finds
the one on its node. It creates segments (anonymous memfds, see the transport's module
docstring), hands out slots, and keeps the *holds* that decide when a slot may be
rewritten:

* ``PENDING``: the learner is writing it, or wrote it and the hub has not planned it yet
  (nor refused it: :meth:`ShmOwner.abandon`);
* ``Hold.of_worker(id)``: a receiver the version was planned for has not released it
  yet (on the owner's *release board*, :class:`~raysync.transports.shared_memory.Board`,
  or by calling :meth:`ShmOwner.release`), nor has the hub withdrawn every delivery of
  it to that receiver (:meth:`ShmOwner.withdraw`: a plan cut short);
* ``Hold.latest(model)``: the newest version of ``model`` here, for late joiners;
* ``RELAYING``: the owner itself is copying a relayed version in;
* ``Hold.exporting(n)``: the owner is putting the version into the object store for
  other nodes (export ``n``), which it does outside its lock.

A slot with no hold may be given out again. Each pool (a learner's slots of one size,
or a model's relays) has at most ``max_slots`` slots, one more for the latest of each
model in it beyond the first (one sender serves every model of its process: models of
one size share its pool), and one more for each slot held only for receivers, counting
at most ``KEPT_PER_RECEIVER`` per receiver and model, as the hub keeps a call per
receiver and model (see :meth:`ShmOwner._room`): receivers busy from different
versions each keep an old one of each model without filling the pool, while one that
holds more (it never releases) still fills it and the learner's wait fails naming it.
A free slot beyond that room is freed, not kept, as the owner next looks at the pools
(any learner's next slot on the node, or :meth:`ShmOwner.stats`), not at its release.

The actor runs its calls in a pool of threads (``OWNER_THREADS``); every method
touches the holds holding one lock, so each sees and leaves them consistent, and the
waits (a free slot, a call's turn) let the others run. ``close`` (the planner calls it
when the hub closes) closes every segment; if the actor dies instead, its process's
descriptors close with it and the kernel frees the memory once receivers unmap it.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import ray

from raysync.bounded import keep_newest
from raysync.ordering import ThreadsInOrder
from raysync.transports.base import TransportError
from raysync.transports.parts import stream_layout
from raysync.transports.shared_memory.wire import (
    BOARD_COLUMNS,
    BOARD_POLL_S,
    BOARD_ROWS,
    HEADER_BYTES,
    KEPT_PER_RECEIVER,
    ORDER_WAIT_S,
    RETIRED_SEQ,
    SLOT_WAIT_S,
    TOKEN_BYTES,
    Board,
    Slot,
    holds_model,
    read_seq,
    write_seq,
)

from .heap import settle_heap


class HoldKind(enum.Enum):
    """Why a slot may not be rewritten yet (see the module's docstring)."""

    PENDING = "pending"
    RELAYING = "relaying"
    EXPORTING = "exporting"
    WORKER = "worker"
    LATEST = "latest"


@dataclass(frozen=True)
class Hold:
    """One reason a slot is held: its kind and whom it is for (a worker, a model)."""

    kind: HoldKind
    name: str = ""

    @classmethod
    def of_worker(cls, worker: str) -> Hold:
        return cls(HoldKind.WORKER, worker)

    @classmethod
    def latest(cls, model: str) -> Hold:
        return cls(HoldKind.LATEST, model)

    @classmethod
    def exporting(cls, number: int) -> Hold:
        return cls(HoldKind.EXPORTING, str(number))

    def __str__(self) -> str:
        """As :class:`OwnerStats` and errors name it: ``worker/w0``, ``pending``."""
        return f"{self.kind.value}/{self.name}" if self.name else self.kind.value


PENDING = Hold(HoldKind.PENDING)
RELAYING = Hold(HoldKind.RELAYING)

#: How long a slot of a learner gone (left, or died) stays ``PENDING``: it may hold a
#: version the learner submitted that the hub plans yet (within that broadcast's
#: timeout); after this it holds one that never will be.
PENDING_KEPT_S = 2 * SLOT_WAIT_S
#: How many closed senders the owner remembers (a call of one may come after its
#: ``leave``, within a slot wait; a learner that releases its hub every step closes a
#: sender per step).
CLOSED_SENDERS_KEPT = 1024
#: How many dropped workers' former holds the owner remembers (see ``_hold_again``).
DROPPED_KEPT = 1024
#: How long the owner remembers a worker gone (``drop_worker``, ``lapse``) to turn away
#: the holds for it that land after (departures reach every node's owner: kept for good,
#: a long job whose collectors come and go grew them without bound). Such a hold comes
#: from a plan the hub began while the worker was registered. The hub numbers its
#: ordered calls (``deliver``, ``abandon``) as it sends them: one sent before the drop
#: runs before it (and the drop forgets its hold); one sent after left the hub as the
#: plan began (``_hold``, a direct-path booking's too), as the version's export for
#: other nodes answered (a relayed node's ``deliver``) or as the hub refused the version
#: (``abandon``), moments after the departure, and runs in its turn. A ``relay`` is not
#: numbered: sent as the export answered, it starts moments after, then waits up to
#: ``SLOT_WAIT_S`` for a slot and copies the version in for as long as the fetch takes
#: (it has no timeout) before it takes its receivers' holds: a departure is kept this
#: long counted from now or, if earlier, from the start of the oldest relay still in
#: flight (see ``_went``). A hold taken for a worker forgotten too soon keeps its slot
#: for good (nobody releases it).
GONE_KEPT_S = 2 * (PENDING_KEPT_S + SLOT_WAIT_S)


@dataclass
class _Segment:
    fd: int
    buffer: np.ndarray  #: uint8 view of the whole mapping
    token: bytes
    column: int  #: its column on the release board (-1: none)
    seq: int = 0  #: the version written into it (0: none yet)
    #: whose slots it is among: a learner's sender (``acquire``), or the relays of a model
    stream: str = ""
    #: the model of the version in it, as the hub planned it (``deliver``; a relay copies
    #: the payload, not the header's tag), "" until it is planned (or the hub refused it)
    model: str = ""
    holds: set[Hold] = field(default_factory=set)
    #: workers whose release of ``seq`` came before the hub's hold for them (by call;
    #: each forestalls one hold)
    released: set[str] = field(default_factory=set)
    #: worker -> the hub's deliveries (their ``placement`` numbers) its hold is for: the
    #: hub may hand one worker the same version twice (a pull or a welcome's catch-up
    #: beside a broadcast of it), and a delivery that never reaches the worker takes
    #: back its own part (:meth:`ShmOwner.withdraw`), not the others'
    placements: dict[str, set[int]] = field(default_factory=dict)
    #: worker -> the placement of the hold taken for its learner's own call (the direct
    #: path: the receiver reads the learner's slot before the hub books the version),
    #: which that call's turn-down unread (:meth:`ShmOwner.release_unread`) takes back
    learners_calls: dict[str, int] = field(default_factory=dict)
    #: workers that turned their learner's own call of ``seq`` down unread before a hold
    #: for that call came, or with none to come (the hub numbered the version anew and
    #: delivers it itself, under a hold of its own): each forestalls one such hold only
    turned_down: set[str] = field(default_factory=set)
    pending_since: float = 0.0  #: the owner's clock when last held ``PENDING``


@dataclass(frozen=True)
class OwnerStats:
    """What an owner did, for tests and benchmarks."""

    node_id: str
    segments: int  #: segments it holds now
    segment_bytes: int  #: their total size
    relays: int  #: versions it received from another node through the object store
    exports: int  #: versions it put into the object store for other nodes
    holds: tuple[str, ...]  #: every hold on its slots, e.g. "worker/w0", "latest/policy"
    board_releases: int  #: receivers' releases it read on its board
    #: receivers' releases made by a call (no row or column), whether the call came
    #: before the hub's hold for it (which it then forestalls) or after
    release_calls: int


class ShmOwner:
    """See module docstring."""

    def __init__(
        self,
        node_id: str,
        max_slots: int,
        pending_kept_s: float = PENDING_KEPT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node_id = node_id
        self._pending_kept_s = pending_kept_s
        #: tells how long a slot, a learner or a worker has been in a state (its waits
        #: are real time)
        self._clock = clock
        self._pid = os.getpid()
        self._max_slots = max_slots
        #: by (stream, segment size): each learner, and each model's relays, has its own
        #: pool of at most ``max_slots`` (and each model's latest beyond the first, and
        #: the slots held only for receivers: :meth:`_room`), so learners of a sharded
        #: model on one node (one part each) never wait for each other's slots
        self._pools: dict[tuple[str, int], list[_Segment]] = {}
        self._by_seq: dict[int, _Segment] = {}
        #: model -> (version, seq) of its latest version here: the hub's version orders
        #: them (two learners, or a learner's threads, take slots in another order)
        self._latest: dict[str, tuple[int, int]] = {}
        #: pools (stream, size) of a model's former layout (see ``_retire_other_layouts``):
        #: their slots are freed as their holds go, unless the stream asks for one again
        self._retired_pools: set[tuple[str, int]] = set()
        self._next_seq = 1
        self._in_order = ThreadsInOrder(ORDER_WAIT_S)
        #: Guards every field; notified whenever a hold goes.
        self._lock = self._in_order.lock
        self._closed = threading.Event()
        self._relays = 0
        self._exports = 0
        self._board = self._create(Board.NBYTES, "release board", column=-1)
        #: [row, column]: the last sequence that row's receiver released in the segment
        #: of that column (receivers write it; only the owner reads it)
        self._cells = Board.cells(self._board.buffer)
        #: worker -> its row; given to another worker only once every process it was
        #: handed to is gone for good (a former holder of a row may still write there:
        #: see :meth:`_reclaim_rows`)
        self._rows: dict[str, int] = {}
        #: worker -> the processes its row was handed to, (pid, its start; None: not
        #: known), as it joined
        self._row_writers: dict[str, set[tuple[int, int | None]]] = {}
        self._next_row = 0
        self._free_rows: list[int] = []  #: rows reclaimed (zeroed), for new workers
        #: workers that died, left or moved to another node, oldest first, with the
        #: owner's clock then: a hold for one of them that lands after (a relay's, or a
        #: plan's made before the hub heard) is not taken, for ``GONE_KEPT_S``
        self._gone: dict[str, float] = {}
        #: the owner's clock as each relay in flight began (:meth:`relay`): the
        #: departures from ``GONE_KEPT_S`` before then on are kept until it ends
        self._relays_began: list[float] = []
        self._next_column = 0
        self._free_columns: list[int] = []  #: columns of freed segments
        #: learner (sender id) -> its process, and the learners gone, with when they
        #: were found gone (their slots are freed as their holds go)
        self._learner_pids: dict[str, tuple[int, int | None]] = {}  #: (pid, its start)
        self._left: dict[str, float] = {}  #: learner -> the owner's clock then
        #: receiver (worker) -> its process on this node as it joined (pid, its start),
        #: and the receivers that lapsed (see :meth:`lapse`)
        self._receiver_pids: dict[str, tuple[int, int | None]] = {}
        self._lapsed: set[str] = set()
        #: worker -> the sequences whose holds :meth:`drop_worker` took from it, until
        #: it joins again (see :meth:`_hold_again`), for the last ``DROPPED_KEPT``
        self._dropped: dict[str, set[int]] = {}
        #: the last senders that called :meth:`leave`, oldest first (a call of theirs
        #: may come after it)
        self._closed_senders: dict[str, None] = {}
        self._board_releases = 0
        self._release_calls = 0
        settle_heap()

    # -- learner -------------------------------------------------------------------------
    def acquire(self, nbytes: int, timeout_s: float, learner: str = "", pid: int = 0) -> Slot:
        """A slot of ``nbytes`` for the next version of ``learner`` (its sender's id),
        held ``PENDING``. ``pid``: the learner's process (on this node): once it is
        gone, its slots are freed as their holds go (see :meth:`leave`)."""
        with self._lock:
            self._check_not_closed(learner)
            if pid and self._learner_pids.get(learner, (0, None))[0] != pid:
                self._learner_pids[learner] = (pid, _started_at(pid))
            segment = self._free_segment(learner, nbytes, timeout_s)
            self._check_not_closed(learner)  # it may have while this call waited
            segment.holds.add(PENDING)
            segment.pending_since = self._clock()
            return self._assign(segment)

    def leave(self, learner: str) -> None:
        """``learner``'s sender closed (``HubHandle.release``): its slots are freed, each
        once nothing holds it (a version receivers still read, or the latest of its
        model, stays until a newer one replaces it; one the hub has not planned yet,
        ``pending_kept_s`` at most); those never written whole (the one it asked for
        ahead, answered or not yet) at once, and it is given no slot after."""
        with self._lock:
            self._left.setdefault(learner, self._clock())
            self._closed_senders[learner] = None
            keep_newest(self._closed_senders, CLOSED_SENDERS_KEPT)
            for pool_key, pool in self._pools.items():
                if pool_key[0] == learner:
                    for segment in pool:
                        if not _written_whole(segment):
                            segment.holds.discard(PENDING)
            self._free_left()

    def _check_not_closed(self, learner: str) -> None:
        """(Lock held.) Refuse a slot to a sender that closed: asked for ahead, its
        call ran after (or waited through) its ``leave``."""
        if learner in self._closed_senders:
            raise TransportError(
                f"the shared-memory sender {learner} closed; it is given no slot"
            )

    # -- hub's planner -------------------------------------------------------------------
    def deliver(
        self,
        pid: int,
        seq: int,
        model: str,
        workers: tuple[str, ...],
        order: int = 0,
        version: int = 0,
        placement: int = 0,
        called: tuple[str, ...] = (),
    ) -> Slot:
        """Hold version ``seq`` of ``model`` for ``workers`` and, if ``version`` is the
        newest here, as the latest of ``model`` (late joiners and pulls are planned to
        read it, so it must not be written again). ``placement``: the hub's number of
        this delivery, which :meth:`withdraw` names if it never reaches ``workers``.
        ``called``: those of ``workers`` the learner delivered the version to itself
        (the direct path), whose turn-down unread takes their hold back
        (:meth:`release_unread`).

        The hub plans each model's versions in the order the learner submitted them
        and numbers its calls here (``order``, run in that order: Ray may start them out
        of order), so a ``PENDING`` slot of the same learner older than ``seq`` that
        holds a version of ``model`` holds one the hub refused, and one never written
        whole (asked for ahead and not used, or its write failed: a learner writes one
        at a time) holds nothing: both are freed. One that holds another model's
        version is not: the hub may plan it yet, after this one (nor are another
        learner's). ``pid`` names the owner the slot came from: a restarted owner knows
        none of its slots.
        """
        with self._in_order.turn("hub", order):
            return self._deliver(pid, seq, model, workers, version, placement, called)

    def _deliver(
        self,
        pid: int,
        seq: int,
        model: str,
        workers: tuple[str, ...],
        version: int,
        placement: int,
        called: tuple[str, ...] = (),
    ) -> Slot:
        """(Lock held.)"""
        self._check_mine(pid, seq)
        segment = self._by_seq.get(seq)
        if segment is None:
            raise TransportError(
                f"version (sequence {seq}) of model {model!r} is no longer in shared memory "
                f"on node {self._node_id}: a newer version superseded it and its slot was reused"
            )
        for other in self._by_seq.values():
            if other.seq < seq and other.stream == segment.stream and _dead(other, model):
                other.holds.discard(PENDING)
        segment.holds.discard(PENDING)
        segment.model = model
        for worker in workers:
            if worker in self._gone:  # nobody would ever release it
                continue
            if worker in called:
                self._hold_for_learners_call(segment, worker, placement)
            else:
                self._hold_unless_released(segment, worker, placement)
        latest = self._latest.get(model, (0, 0))
        if (version, seq) > latest:
            previous = self._by_seq.get(latest[1])
            if previous is not None:
                previous.holds.discard(Hold.latest(model))
            self._latest[model] = (version, seq)
            segment.holds.add(Hold.latest(model))
            self._retire_other_layouts(model, version, segment)
        self._lock.notify_all()
        return self._slot(segment)

    def _check_mine(self, pid: int, seq: int) -> None:
        """(Lock held.) Raise if slot ``seq`` came from another owner process: this
        one's former incarnation, which died (its slots with it)."""
        if pid != self._pid:
            raise TransportError(
                f"version (sequence {seq}) was written into a slot of the shared-memory "
                f"owner on node {self._node_id} that died (pid {pid}); its restarted owner "
                f"(pid {self._pid}) holds none of its slots: the next broadcast is readable"
            )

    def _retire_other_layouts(self, stream: str, version: int, latest: _Segment) -> None:
        """(Lock held.) ``stream`` holds the latest ``version`` of its model, in
        ``latest``: the latest of that model sent in another layout (whole, or in
        another number of parts: its learners split it anew), older, is read by no late
        joiner or pull again (they are planned the newest version). Its latest hold
        goes, and the pools it lived in (its relays here, or its learner's slots of that
        size, unless ``latest`` is among them) are freed as their holds go; a stream
        that asks for a slot again takes its pool back."""
        model, parts = stream_layout(stream)
        for other, (other_version, seq) in list(self._latest.items()):
            other_model, other_parts = stream_layout(other)
            if other_model != model or other_parts == parts or other_version >= version:
                continue
            del self._latest[other]
            held = self._by_seq.get(seq)
            if held is not None:
                held.holds.discard(Hold.latest(other))
            self._retired_pools.update(
                key
                for key, pool in self._pools.items()
                if not any(s is latest for s in pool)
                and (key[0] == _relays_of(other) or any(s is held for s in pool))
            )

    def abandon(
        self, pid: int, seq: int, read_by: tuple[str, ...] = (), order: int = 0
    ) -> None:
        """The hub refused version ``seq`` (a stale or unknown version, a version in
        parts that failed): it is never planned, so its ``PENDING`` hold goes. Its
        learner delivered it to ``read_by`` itself (the direct path) before the hub
        refused it: each reads it (or a zero-copy model lives in it) all the same, so
        it is held for each until its release (one that came first forestalls it).
        ``order``: its number among the hub's calls (see :meth:`deliver`): before the
        plan of a newer version, which frees this learner's older pending slots."""
        with self._in_order.turn("hub", order):
            segment = self._by_seq.get(seq) if pid == self._pid else None
            if segment is None:
                return
            segment.holds.discard(PENDING)
            for worker in read_by:
                if worker not in self._gone:  # else nobody would ever release it
                    self._hold_for_learners_call(segment, worker)
            self._lock.notify_all()

    def export(self, pid: int, seq: int, order: int = 0) -> list[ray.ObjectRef]:
        """Put version ``seq`` into the object store once, for other nodes' owners.
        ``order``: its number among the hub's calls (see :meth:`deliver`), taken right
        after the version's own hold, so a newer version's cannot come between and
        leave it held by nothing."""
        with self._in_order.turn("hub", order):
            self._check_mine(pid, seq)
            segment = self._by_seq.get(seq)
            if segment is None or not segment.holds:
                raise TransportError(
                    f"sequence {seq} is not held on node {self._node_id}; cannot export it"
                )
            self._exports += 1
            # Its other holds may all go while the lock is out (a newer version becomes
            # the latest): its own keeps the slot from being written meanwhile.
            exporting = Hold.exporting(self._exports)
            segment.holds.add(exporting)
            data = segment.buffer[HEADER_BYTES:]
        try:
            return [ray.put(data)]
        finally:
            with self._lock:
                segment.holds.discard(exporting)
                self._lock.notify_all()

    def relay(
        self,
        refs: list[ray.ObjectRef],
        nbytes: int,
        model: str,
        workers: tuple[str, ...],
        timeout_s: float,
        version: int = 0,
        placement: int = 0,
        after: int = 0,
    ) -> Slot:
        """Copy an exported version into a slot here; hold it like :meth:`deliver`, once
        the hub's calls numbered up to ``after`` (those sent before it: a worker's join
        among them, which would forget a hold taken before it) have run. Not numbered
        itself: the holds sent after it do not wait for its copy."""
        with self._relay_in_flight():
            with self._lock:
                segment = self._free_segment(_relays_of(model), nbytes, timeout_s)
                segment.holds.add(RELAYING)
                # Numbered now, not once the bytes are here: a late hold of the version
                # it held before (a plan reusing that relay) is refused from here on.
                slot = self._assign(segment)
                write_seq(segment.buffer, 0)
            try:
                data = ray.get(refs[0])
                np.copyto(segment.buffer[HEADER_BYTES:], data)
                write_seq(segment.buffer, slot.seq)
            except BaseException:
                with self._lock:
                    segment.holds.discard(RELAYING)
                    self._lock.notify_all()
                raise
            with self._lock:  # its receivers' holds are taken before its own goes
                self._in_order.wait_passed("hub", after)
                try:
                    self._relays += 1
                    return self._deliver(self._pid, slot.seq, model, workers, version, placement)
                finally:
                    segment.holds.discard(RELAYING)
                    self._lock.notify_all()

    @contextlib.contextmanager
    def _relay_in_flight(self) -> Iterator[None]:
        """(Lock not held.) A :meth:`relay` from its start to its end: the departures
        from ``GONE_KEPT_S`` before its start on are not forgotten meanwhile (see
        :meth:`_went`), however long its copy takes, so its receivers' holds for them
        are turned away."""
        with self._lock:
            began = self._clock()
            self._relays_began.append(began)
        try:
            yield
        finally:
            with self._lock:
                self._relays_began.remove(began)

    def release(self, pid: int, seq: int, worker: str) -> None:
        """``worker`` is done with version ``seq`` (copied or skipped it). It may come
        before the hub's hold for it (the hub does not wait for its holds to land)."""
        with self._lock:
            segment = self._by_seq.get(seq) if pid == self._pid else None
            if segment is None:
                return
            self._release_calls += 1
            hold = Hold.of_worker(worker)
            if hold in segment.holds:
                segment.holds.discard(hold)
                self._lock.notify_all()
            else:
                segment.released.add(worker)

    def release_unread(self, pid: int, seq: int, worker: str) -> None:
        """``worker`` turned its learner's own call of version ``seq`` down without
        reading it (it holds a newer version, or another learner's of that number). The
        hold taken for that call goes; one that came for another delivery stays: the
        hub numbers a version anew when another learner's took its number first, and
        delivers this very slot itself, where a zero-copy model then lives (taken for
        that delivery's hold, this release left the slot held by nobody). One that
        comes before the call's hold forestalls it (the hub books the direct path's
        holds after the call)."""
        with self._lock:
            segment = self._by_seq.get(seq) if pid == self._pid else None
            if segment is None:
                return
            self._release_calls += 1
            placement = segment.learners_calls.pop(worker, None)
            if placement is None:
                segment.turned_down.add(worker)
                return
            _take_back(segment, worker, placement)
            self._lock.notify_all()

    def withdraw(
        self, pid: int, seq: int, workers: tuple[str, ...], placement: int, order: int = 0
    ) -> None:
        """The hub's delivery ``placement`` of version ``seq`` never reaches ``workers``
        (its plan was cut short, its relay given up, or it waits for a busy receiver's
        running call): the holds it took for them go,
        but a worker's hold that another delivery of the same version took too stays
        (that one reached it, and it reads the slot yet, or a zero-copy model lives
        there). Unlike :meth:`release`, nothing is remembered for a hold not found: the
        worker has not read the version, and a later delivery of it must hold it.
        ``order``: its number among the hub's calls (see :meth:`deliver`; 0: none, for
        a withdrawal sent once the hold's call answered), after the hold's."""
        with self._in_order.turn("hub", order):
            segment = self._by_seq.get(seq) if pid == self._pid else None
            if segment is None:
                return
            for worker in workers:
                _take_back(segment, worker, placement)
            self._lock.notify_all()

    def join(
        self, worker: str, keep: tuple[tuple[int, int], ...] = (), pid: int = 0, order: int = 0
    ) -> Board | None:
        """``worker`` (re)joined on this node, from process ``pid`` (0: not known): it
        holds nothing but ``keep`` (see :meth:`drop_worker`; held again if only a drop
        let go of them: :meth:`_hold_again`), and gets its row of the
        release board (the same one again if it still has one; None once every row is
        taken by a process that may still write there: it then releases by call).
        ``order``: its number among the hub's calls (see :meth:`deliver`), taken as the
        hub booked the registration: the holds of plans that target the new
        registration come after it and are kept."""
        with self._in_order.turn("hub", order):
            self._forget(worker, keep)
            self._hold_again(worker, keep)
            self._gone.pop(worker, None)
            self._lapsed.discard(worker)
            if pid:
                self._receiver_pids[worker] = (pid, _started_at(pid))
            else:
                self._receiver_pids.pop(worker, None)
            row = self._row_of(worker)
            return None if row is None else Board(self._slot(self._board), row)

    def _row_of(self, worker: str) -> int | None:
        """(Lock held.) ``worker``'s row of the release board as it joins, from its
        process in ``_receiver_pids`` (none there: not known): the one it has, else a
        new one (:meth:`_new_row`). That process is one of the row's writers from now
        on; those seen gone are forgotten."""
        row = self._rows.get(worker)
        if row is None:
            row = self._new_row()
            if row is None:
                return None
            self._rows[worker] = row
        writers = {w for w in self._row_writers.get(worker, ()) if not _gone_for_good(w)}
        writers.add(self._receiver_pids.get(worker, (0, None)))
        self._row_writers[worker] = writers
        return row

    def _new_row(self) -> int | None:
        """(Lock held.) A row of the release board for a worker that has none: one
        never given out, else one reclaimed from workers whose processes are gone
        (:meth:`_reclaim_rows`); None once every row may still be written."""
        if self._next_row < BOARD_ROWS:
            self._next_row += 1
            return self._next_row - 1
        if not self._free_rows:
            self._reclaim_rows()
        return self._free_rows.pop() if self._free_rows else None

    def _reclaim_rows(self) -> None:
        """(Lock held.) Take back the row of each worker every process of which it was
        handed to is gone for good (its pid is dead, or another process's now): nothing
        writes there any more. The row is zeroed, so no release its former worker wrote
        there is read as the next one's; that worker keeps the holds it has until it is
        dropped (a dead process releases nothing), and, should it join again, gets
        another row. A row handed to a live process (a receiver that left may still
        release there late), or to one not known, is kept. Run only once every row was
        given out: it reads each writer's ``/proc`` entry."""
        processes = set().union(*self._row_writers.values())
        gone = {process for process in processes if _gone_for_good(process)}
        for worker, writers in list(self._row_writers.items()):
            if writers <= gone:
                row = self._rows.pop(worker)
                del self._row_writers[worker]
                self._cells[row, :] = 0
                self._free_rows.append(row)

    def drop_worker(
        self, worker: str, keep: tuple[tuple[int, int], ...] = (), order: int = 0
    ) -> None:
        """``worker`` died, left or moved to another node: it holds nothing any more,
        but the slots in ``keep`` ((owner pid, seq) pairs: its zero-copy models live
        there), and a hold for it that lands later (the hub does not wait for its holds
        to land; a relay takes its receivers' after its copy) is not taken, until it
        joins here again (or ``GONE_KEPT_S`` passed, counted up to the start of the
        oldest relay in flight: none lands that late; see :meth:`_went`). ``order``: its
        number among the hub's calls (see :meth:`deliver`): a join of the worker's next
        registration comes after it."""
        with self._in_order.turn("hub", order):
            dropped = self._forget(worker, keep)
            self._dropped.pop(worker, None)
            if dropped:
                self._dropped[worker] = dropped
                keep_newest(self._dropped, DROPPED_KEPT)
            self._went(worker)
            self._lapsed.discard(worker)
            self._receiver_pids.pop(worker, None)

    def _went(self, worker: str) -> None:
        """(Lock held.) ``worker`` is gone as of now (:meth:`drop_worker`, :meth:`lapse`);
        the departures no hold can follow any more are forgotten: those ``GONE_KEPT_S``
        older than now and than the start of every relay in flight (see ``GONE_KEPT_S``)."""
        now = self._clock()
        self._gone.pop(worker, None)  # its latest departure goes last: oldest first
        self._gone[worker] = now
        # A relay takes its receivers' holds once its copy is in, however late: one
        # that started a moment after a departure may carry a hold for that worker.
        since = min([now, *self._relays_began])
        oldest = next(iter(self._gone))
        while since - self._gone[oldest] > GONE_KEPT_S:
            del self._gone[oldest]
            oldest = next(iter(self._gone))

    def _hold_again(self, worker: str, keep: tuple[tuple[int, int], ...]) -> None:
        """(Lock held.) A join: hold again the slots of ``keep`` that :meth:`drop_worker`
        took from ``worker`` and that it has not released since. The hub drops a
        registration whose delivery reached it retired (its process registered again,
        zero-copy models kept where they live) before it books the new one: that new
        registration still reads them, and, forgotten, the learner could rewrite the
        slot a model lives in."""
        dropped = self._dropped.pop(worker, set())
        for pid, seq in keep:
            segment = self._by_seq.get(seq) if pid == self._pid else None
            if segment is None or seq not in dropped or Hold.of_worker(worker) in segment.holds:
                continue
            self._hold_unless_released(segment, worker)

    def _hold_unless_released(self, segment: _Segment, worker: str, placement: int = 0) -> None:
        """(Lock held.) Hold ``segment`` for ``worker`` (on behalf of the hub's delivery
        ``placement``; 0: outside any), unless a release of it came first. A release
        counts once (the same version may reach a worker again: a pull after it
        declined a catch-up; a learner's own call turned down unread is handed back
        apart, :meth:`release_unread`): it is of the hold the worker has of this
        version, if any (an earlier delivery's: that one goes, this one is taken),
        else of this one (done with it before its hold came)."""
        if self._use_board_release(segment, worker):
            self._board_releases += 1
            if Hold.of_worker(worker) not in segment.holds:
                return
            segment.holds.discard(Hold.of_worker(worker))
        elif worker in segment.released:
            segment.released.discard(worker)
            return
        _hold_for(segment, worker, placement)

    def _hold_for_learners_call(self, segment: _Segment, worker: str, placement: int = 0) -> None:
        """(Lock held.) Hold ``segment`` for ``worker``, which its learner delivered it
        to itself, unless it turned that call down (:meth:`release_unread`) or released
        what it read (:meth:`_hold_unless_released`) first."""
        if worker in segment.turned_down:
            segment.turned_down.discard(worker)
            return
        self._hold_unless_released(segment, worker, placement)
        if Hold.of_worker(worker) in segment.holds:
            segment.learners_calls[worker] = placement

    def lapse(self, worker: str, order: int = 0) -> None:
        """``worker`` stopped beating and may be alive (a driver or a task: Ray cannot
        tell): a hold for it that lands later is not taken, but those it has stay (a
        zero-copy model may live in one, a staged version wait in another) until it
        joins again, keeping those it still reads, or leaves, or its process is seen
        gone (checked here and whenever a slot is looked for). One whose process is
        not known (it joined without a pid, or from another pid namespace) keeps them
        until the owner closes: a slot or two, where letting go could rewrite a live
        model under it. ``order``: as :meth:`drop_worker`'s."""
        with self._in_order.turn("hub", order):
            self._went(worker)
            self._lapsed.add(worker)
            self._forget_lapsed_dead()

    def _forget_lapsed_dead(self) -> None:
        """(Lock held.) The lapsed receivers whose process is gone hold nothing more."""
        for worker in list(self._lapsed):
            pid, started = self._receiver_pids.get(worker, (0, None))
            if started is not None and _started_at(pid) != started:  # its pid may be reused
                self._forget(worker, ())
                self._lapsed.discard(worker)
                self._receiver_pids.pop(worker, None)

    def _forget(self, worker: str, keep: tuple[tuple[int, int], ...]) -> set[int]:
        """(Lock held.) ``worker``'s holds and releases go, but those of the slots in
        ``keep``: its early releases, and what its row of the board says it released
        (a new incarnation gets the same row: its reads of those versions are to come).
        The sequences whose holds went."""
        kept = {seq for pid, seq in keep if pid == self._pid}
        row = self._rows.get(worker)
        dropped = set()
        for segment in self._by_seq.values():
            if segment.seq in kept:
                continue
            if Hold.of_worker(worker) in segment.holds:
                segment.holds.discard(Hold.of_worker(worker))
                dropped.add(segment.seq)
            segment.released.discard(worker)
            segment.turned_down.discard(worker)
            segment.learners_calls.pop(worker, None)
            if row is not None and segment.column >= 0:
                self._cells[row, segment.column] = 0
        self._lock.notify_all()
        return dropped

    def stats(self) -> OwnerStats:
        """What the owner did and holds now, once it read the board (and freed the
        segments beyond a pool's room that its releases left free)."""
        with self._lock:
            for pool in self._pools.values():
                self._free_beyond_room(pool, self._unheld(pool))
            segments = [s for pool in self._pools.values() for s in pool]
            return OwnerStats(
                node_id=self._node_id,
                segments=len(segments),
                segment_bytes=sum(s.buffer.size for s in segments),
                relays=self._relays,
                exports=self._exports,
                holds=tuple(sorted(str(h) for s in segments for h in s.holds)),
                board_releases=self._board_releases,
                release_calls=self._release_calls,
            )

    def closed(self) -> None:
        """Returns once :meth:`close` ran; the planner watches it to notice a death."""
        self._closed.wait()

    def close(self) -> None:
        """Close every segment (receivers' existing mappings stay valid until unmapped)."""
        with self._lock:
            for pool in self._pools.values():
                for segment in pool:
                    os.close(segment.fd)
            os.close(self._board.fd)
            self._pools.clear()
            self._by_seq.clear()
            self._lock.notify_all()
        self._closed.set()

    # -- slots (lock held) -----------------------------------------------------------------
    def _free_left(self, asking: str = "") -> None:
        """Free the slots of learners gone (left, or their process died) that nothing
        holds any more, and those beyond any pool's room (one that grew for busy
        receivers, and is asked for no more: a model sent only now and then); forget
        such a learner once it has none. ``asking``: the stream a slot is being found
        for (alive: it asks)."""
        for learner, (pid, started) in self._learner_pids.items():
            if learner in self._left or learner == asking:
                continue
            if started is None or _started_at(pid) != started:  # its pid may be reused
                self._left[learner] = self._clock()
        for key, pool in list(self._pools.items()):
            left_at = self._left.get(key[0])
            if left_at is None and key not in self._retired_pools:
                continue
            for segment in list(pool):
                # Kept from when it was asked for, or its learner was found gone: one
                # asked for ahead was asked a whole step before it was written.
                if (
                    left_at is not None
                    and self._clock() - max(segment.pending_since, left_at) > self._pending_kept_s
                ):
                    segment.holds.discard(PENDING)  # its version was never planned
                self._read_board(segment)
                if not segment.holds:
                    pool.remove(segment)
                    self._free(segment)
            if not pool:
                del self._pools[key]
                self._retired_pools.discard(key)
        for pool in self._pools.values():
            self._free_beyond_room(pool, self._unheld(pool))
        streams = {stream for stream, _ in self._pools}
        for learner in self._left.keys() - streams:
            del self._left[learner]
            self._learner_pids.pop(learner, None)

    def _free(self, segment: _Segment) -> None:
        """Close ``segment`` (no hold on it); processes that map it let their mappings go
        when they see it retired (the kernel frees it with the last one)."""
        write_seq(segment.buffer, RETIRED_SEQ)
        self._by_seq.pop(segment.seq, None)
        os.close(segment.fd)
        if segment.column >= 0:
            self._free_columns.append(segment.column)

    def _free_segment(self, stream: str, nbytes: int, timeout_s: float) -> _Segment:
        deadline = time.monotonic() + timeout_s
        self._retired_pools.discard((stream, nbytes))  # in use again
        while True:
            self._free_left(asking=stream)
            self._forget_lapsed_dead()
            # Looked up again after each wait: a pool of a learner gone may be dropped.
            pool = self._pools.setdefault((stream, nbytes), [])
            free = self._unheld(pool)  # beyond its room, one at most (``_free_left``)
            if free:
                return free[0]
            if len(pool) < self._room(pool):
                segment = self._new_segment(nbytes, stream)
                pool.append(segment)
                return segment
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holders = sorted({str(h) for s in pool for h in s.holds})
                raise TransportError(
                    f"all {len(pool)} shared-memory slots of {nbytes} bytes on node "
                    f"{self._node_id} stayed held for {timeout_s:g} s by: "
                    f"{', '.join(holders)}; a receiver that never reaches a safe point "
                    "holds the versions it was sent"
                )
            # Releases on the board notify nobody: read it again soon.
            self._lock.wait(min(remaining, BOARD_POLL_S))

    def _unheld(self, pool: list[_Segment]) -> list[_Segment]:
        """The segments of ``pool`` that nothing holds, once the board's releases of
        them are read."""
        for segment in pool:
            self._read_board(segment)
        return [segment for segment in pool if not segment.holds]

    def _room(self, pool: list[_Segment]) -> int:
        """How many segments ``pool`` may have: ``max_slots``, one more for the latest
        of each model in it beyond the first, and the segments kept for receivers
        (:func:`_kept_for_receivers`). Models of one size share a learner's pool, and
        each keeps its latest for late joiners: within ``max_slots`` they would fill it
        with those alone. Receivers busy from different versions (collectors in their
        rollouts) each hold an old version's slot of each model: within ``max_slots``
        they would fill the pool and fail every receiver's broadcast, not just theirs."""
        models = len(_latest_models(pool))
        return self._max_slots + max(0, models - 1) + _kept_for_receivers(pool)

    def _free_beyond_room(self, pool: list[_Segment], spare: list[_Segment]) -> None:
        """Free the ``spare`` segments of ``pool`` (nothing holds them) that it has
        beyond its room, but one: a pool that grew for busy receivers shrinks back once
        they let go, as the owner next looks at it (any learner's next slot, or
        :meth:`stats`), rather than keep their slots for good; and the learner still
        finds a free slot where the holds it cannot count (its own pending versions,
        the latest, exports) alone fill the room."""
        # Not below 0: a pool within its room has nothing beyond it, and a negative
        # count would slice the free slots from their end and free all but that many.
        beyond = max(0, min(len(spare) - 1, len(pool) - self._room(pool)))
        for segment in spare[:beyond]:
            pool.remove(segment)
            self._free(segment)

    def _use_board_release(self, segment: _Segment, worker: str) -> bool:
        """Whether ``worker`` wrote on the board that it is done with ``segment``'s
        version (each cell holds the last sequence its receiver released there); if so
        the release is used up here (its cell cleared): it counts once."""
        row = self._rows.get(worker)
        if row is None or segment.column < 0:
            return False
        if int(self._cells[row, segment.column]) != segment.seq:
            return False
        self._cells[row, segment.column] = 0
        return True

    def _read_board(self, segment: _Segment) -> None:
        """Drop the holds of receivers that released ``segment`` on the board; each
        release is used up (its cell cleared): a later delivery of the same version to
        that receiver is held again."""
        if segment.column < 0:
            return
        released = [
            hold
            for hold in segment.holds
            if hold.kind is HoldKind.WORKER and self._use_board_release(segment, hold.name)
        ]
        segment.holds.difference_update(released)
        self._board_releases += len(released)

    def _new_column(self) -> int:
        """The next free column of the release board, -1 once they are all taken."""
        if self._free_columns:  # the cells there hold older sequences: never a new one's
            return self._free_columns.pop()
        if self._next_column >= BOARD_COLUMNS:
            return -1
        self._next_column += 1
        return self._next_column - 1

    def _new_segment(self, nbytes: int, stream: str) -> _Segment:
        """A segment for ``stream``'s pool, with a column of the board if one is free;
        a clear error, and nothing kept, if the node has no memory for it."""
        column = self._new_column()
        try:
            return self._create(nbytes, stream, column)
        except OSError as err:
            if column >= 0:
                self._free_columns.append(column)
            raise TransportError(
                f"could not create a shared-memory segment of {nbytes} bytes on node "
                f"{self._node_id} for {stream}: {err} (is the node out of memory?)"
            ) from err

    def _create(self, nbytes: int, stream: str, column: int) -> _Segment:
        token = secrets.token_bytes(TOKEN_BYTES)
        fd = os.memfd_create("raysync-segment", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            # Allocate (and zero) every page now, in the owner, ahead of the first
            # write: the learner asks for its next slot ahead, off the broadcast's path.
            os.posix_fallocate(fd, 0, nbytes)
            buffer = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
        except BaseException:
            os.close(fd)
            raise
        buffer[:TOKEN_BYTES] = np.frombuffer(token, dtype=np.uint8)
        return _Segment(fd, buffer, token, column, stream=stream)

    def _assign(self, segment: _Segment) -> Slot:
        """Give ``segment`` the next sequence number (its previous version is gone)."""
        self._by_seq.pop(segment.seq, None)
        segment.released.clear()
        segment.placements.clear()
        segment.learners_calls.clear()
        segment.turned_down.clear()
        segment.model = ""
        segment.seq = self._next_seq
        self._next_seq += 1
        self._by_seq[segment.seq] = segment
        return self._slot(segment)

    def _slot(self, segment: _Segment) -> Slot:
        return Slot(
            self._node_id,
            self._pid,
            segment.fd,
            segment.token,
            segment.buffer.size,
            segment.seq,
            segment.column,
        )


def _relays_of(stream: str) -> str:
    """The pool name of the slots a stream's versions are relayed into on this node."""
    return f"relays of {stream}"


def _hold_for(segment: _Segment, worker: str, placement: int) -> None:
    """(Lock held.) Hold ``segment`` for ``worker`` on behalf of the hub's delivery
    ``placement`` too. A hold taken anew starts its deliveries afresh: those of a hold
    that went (the worker released it, or was forgotten) are done with."""
    hold = Hold.of_worker(worker)
    if hold in segment.holds:
        segment.placements.setdefault(worker, set()).add(placement)
    else:
        segment.holds.add(hold)
        segment.placements[worker] = {placement}


def _take_back(segment: _Segment, worker: str, placement: int) -> None:
    """(Lock held.) The hub's delivery ``placement`` no longer holds ``segment`` for
    ``worker``; the worker's hold goes with the last delivery it was for. Nothing if that
    delivery held nothing (never taken: gone, or done with it; or released since)."""
    placements = segment.placements.get(worker)
    if placements is None or placement not in placements:
        return
    placements.discard(placement)
    if not placements:
        del segment.placements[worker]
        segment.holds.discard(Hold.of_worker(worker))


def _held_only_for(segment: _Segment) -> list[str]:
    """The receivers holding ``segment``, by name, if nothing else holds it (no
    learner's, latest, relay or export hold); none otherwise."""
    if any(hold.kind is not HoldKind.WORKER for hold in segment.holds):
        return []
    return sorted(hold.name for hold in segment.holds)


def _kept_for_receivers(pool: list[_Segment]) -> int:
    """How many segments of ``pool`` are held only for receivers, counting at most
    ``KEPT_PER_RECEIVER`` per receiver and model (each segment once, for one of its
    holders with room left): a busy receiver holds its queued call's slot, and its
    zero-copy model's, of each model (the hub keeps a call per receiver and model). A
    receiver that holds more (it never releases) still fills the pool, and memory stays
    bounded per receiver and model."""
    counted: dict[tuple[str, str], int] = {}
    for segment in pool:
        with_room = [
            (worker, segment.model)
            for worker in _held_only_for(segment)
            if counted.get((worker, segment.model), 0) < KEPT_PER_RECEIVER
        ]
        if with_room:
            counted[with_room[0]] = counted.get(with_room[0], 0) + 1
    return sum(counted.values())


def _latest_models(pool: list[_Segment]) -> set[str]:
    """The models whose latest version is in a segment of ``pool``."""
    return {hold.name for segment in pool for hold in segment.holds if hold.kind is HoldKind.LATEST}


def _dead(segment: _Segment, model: str) -> bool:
    """Whether an older ``PENDING`` slot of a learner holds nothing the hub may plan
    now that it planned a newer version of ``model`` (see :meth:`ShmOwner.deliver`)."""
    return not _written_whole(segment) or holds_model(segment.buffer, model)


def _written_whole(segment: _Segment) -> bool:
    """Whether the learner finished writing the version ``segment`` was given out for
    (it writes the sequence into the header last)."""
    return read_seq(segment.buffer) == segment.seq


def _gone_for_good(process: tuple[int, int | None]) -> bool:
    """Whether ``process`` (pid, its start as :func:`_started_at` read it; None: not
    known) has ended: its pid names no process, or another one."""
    pid, started = process
    return started is not None and _started_at(pid) != started


def _started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: field 22 of
    ``/proc/<pid>/stat``), None if there is none. With the pid it names one process
    for good: a pid is given to a new process once the old one is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command's name
    except OSError:
        return None
    return int(fields[19])
