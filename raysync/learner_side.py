"""The learner's side of a hub in this process: one per hub, shared by every HubHandle.

A :class:`~raysync.HubHandle` is unpickled anew wherever it travels — each Ray task or
actor call that takes it as an argument gets a fresh instance. What a learner keeps for
a hub therefore lives here, per process and hub, not in the handle: its transport
senders (kept per handle, they were opened again for each: the node's shared-memory
owner made a learner given the hub with each call a new pool of slots each time, never
freed while the hub lived, and NIXL buffers were registered again), the number its
broadcasts are ordered by at the hub (one stream per process, not one more per handle
in the hub's books), the route the last broadcast brought back, the receivers' actor
handles and the compiled-graph channels. :meth:`HubHandle.release` ends it; the next
broadcast starts a new one. Called in learner processes only.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from raysync.transports.base import TransportSender

if TYPE_CHECKING:
    from raysync.learner_channel import ReceiverChannel

logger = logging.getLogger(__name__)

#: How long the check of other hubs (:func:`learner_side`) waits for their answers; a
#: hub that does not answer in time (busy, restarting) keeps its side.
GONE_CHECK_S = 10.0


class InFlight:
    """The learner's submit calls not yet complete, by number: the lowest one is the
    floor below which the hub need not wait for any (see ``InOrder.wait_turn``)."""

    def __init__(self) -> None:
        self._calls: dict[int, ray.ObjectRef] = {}

    def add(self, sequence: int, ref: ray.ObjectRef) -> None:
        self._calls[sequence] = ref

    def floor(self, sequence: int) -> int:
        """The lowest number still in flight, or ``sequence`` if none is."""
        if self._calls:
            refs = list(self._calls.values())
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            finished = set(done)
            self._calls = {s: r for s, r in self._calls.items() if r not in finished}
        return min(self._calls, default=sequence)


class DirectCalls:
    """This process's direct delivery calls that may still run, per receiver
    registration and model: a receiver with ``Transport.direct_calls_running_most`` of
    them running is busy in a long method, and the hub delivers it instead."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], list[ray.ObjectRef]] = {}

    def add(self, model: str, calls: dict[str, tuple[str, Any]]) -> None:
        """The calls of one broadcast of ``model``: per worker, its registration and
        the call (an ObjectRef; a channel's write is none)."""
        for token, call in calls.values():
            if isinstance(call, ray.ObjectRef):
                self._calls.setdefault((token, model), []).append(call)

    def running(self, model: str) -> dict[str, int]:
        """Per registration, how many of this process's calls of ``model`` to it have not
        returned (those returned are let go)."""
        keys = [key for key in self._calls if key[1] == model]
        refs = [ref for key in keys for ref in self._calls[key]]
        if not refs:
            return {}
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        returned = set(done)
        counts: dict[str, int] = {}
        for key in keys:
            running = [ref for ref in self._calls[key] if ref not in returned]
            if not running:
                del self._calls[key]
                continue
            self._calls[key] = running
            counts[key[0]] = len(running)
        return counts


class SendOrder:
    """The turns this process's broadcasts to one hub take by route key
    (``HubHandle._route_key``), so that each model's versions leave in the order they
    were sent (:meth:`LearnerSide.sending_in_order` says when a broadcast holds its
    turn). Called from the learner's broadcasting threads.

    One thread at a time holds a key's turn, and may take it again (for its submit
    call), as an RLock. The turns of different models are held at once: a model whose
    hand-off waits (for a slow receiver) holds up no other model. The ``None`` key's
    is held alone: a broadcast that leaves its model out, sent before any route named
    that model, is of the hub's only model, whichever that is, so it waits for every
    turn held and every other turn waits for it. Once it waits, the turns asked for
    after it wait behind it: other models' broadcasts, overlapping, would otherwise
    keep it waiting for ever."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: per key whose turn is held, the thread holding it and how many times it took it
        self._held: dict[str | None, tuple[int, int]] = {}
        #: how many threads wait for the ``None`` key's turn
        self._unknown_waiting = 0

    def turn(self, key: str | None) -> Turn:
        """Route key ``key``'s turn, to hold as a lock."""
        return Turn(self, key)

    def acquire(self, key: str | None, blocking: bool = True, timeout: float = -1) -> bool:
        """Take ``key``'s turn, waiting (at most ``timeout`` seconds, if not negative)
        unless ``blocking`` is false; whether it was taken, as ``Lock.acquire``."""
        me = threading.get_ident()
        with self._changed:
            if not self._free(key, me) and not (blocking and self._wait(key, me, timeout)):
                return False
            self._held[key] = (me, self._held.get(key, (me, 0))[1] + 1)
            return True

    def release(self, key: str | None) -> None:
        """Give ``key``'s turn back once for each time this thread took it."""
        me = threading.get_ident()
        with self._changed:
            holder, times = self._held.get(key, (None, 0))
            if holder != me:
                raise RuntimeError(f"route key {key!r}: released by a thread not holding it")
            if times > 1:
                self._held[key] = (me, times - 1)
                return
            del self._held[key]
            self._changed.notify_all()

    def _free(self, key: str | None, me: int) -> bool:
        """(Condition held.) Whether thread ``me`` may take ``key``'s turn now."""
        holder = self._held.get(key)
        if holder is not None:
            return holder[0] == me
        if key is None:
            return not self._held
        return None not in self._held and not self._unknown_waiting

    def _wait(self, key: str | None, me: int, timeout: float) -> bool:
        """(Condition held.) Wait until thread ``me`` may take ``key``'s turn; False if
        ``timeout`` (negative: none) passed first."""
        unknown = key is None
        self._unknown_waiting += unknown
        try:
            return self._changed.wait_for(
                lambda: self._free(key, me), None if timeout < 0 else timeout
            )
        finally:
            self._unknown_waiting -= unknown
            if unknown:  # the turns it held back wait no more if it gave up
                self._changed.notify_all()


@dataclass(frozen=True)
class Turn:
    """One route key's turn in a :class:`SendOrder`, held as a lock (``with turn:``)."""

    order: SendOrder
    key: str | None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.order.acquire(self.key, blocking, timeout)

    def release(self) -> None:
        self.order.release(self.key)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class LearnerSide:
    """What this process keeps for one hub as a learner (module doc)."""

    #: The hub's actor: asked whether it closed when this process begins another side.
    hub: Any = None
    #: The stream this process's broadcasts are numbered in at the hub.
    submitter: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: The number the next submit call that leaves this process takes.
    next_sequence: int = 1
    #: Held while a broadcast is numbered and sent, so numbers leave in order; never
    #: across a hand-off's send, which may wait long (for a slow receiver of its model).
    submitting: threading.RLock = field(default_factory=threading.RLock)
    #: The turns :meth:`sending_in_order` gives, by route key.
    in_order: SendOrder = field(default_factory=SendOrder)
    in_flight: InFlight = field(default_factory=InFlight)
    #: the model a route named for broadcasts that leave ``model`` out: their route key
    unnamed_model: str | None = None
    #: per route key (``HubHandle._route_key``), the number and result of its last
    #: broadcast, whose report (or ticket) carries the next broadcast's Route
    last_results: dict[str | None, tuple[int, ray.ObjectRef]] = field(default_factory=dict)
    #: per route key, the receivers' actor handles by registration, as the last route
    #: listed them (the hub leaves them out of the routes it sends back)
    handles: dict[str | None, dict[str, Any]] = field(default_factory=dict)
    #: per model, the version this process last delivered itself
    last_direct: dict[str, int] = field(default_factory=dict)
    #: its delivery calls on the direct path that may still run
    direct_calls: DirectCalls = field(default_factory=DirectCalls)
    #: per model, with ``channels``
    channels: dict[str, ReceiverChannel] = field(default_factory=dict)
    #: per hand-off, the transport's learner half
    senders: dict[str, TransportSender] = field(default_factory=dict)
    node_id: str = ""

    def submit(self, send: Callable[[int, int], ray.ObjectRef]) -> tuple[int, ray.ObjectRef]:
        """Number a submit call and send it: ``send(sequence, floor)`` makes the call.
        Under :attr:`submitting`, so numbers leave in order. A number is taken only by
        a call that left: one whose ``send`` raised is the next call's (a number the hub
        never sees would hold the calls after it back, ``InOrder``'s wait). Returns the
        number and the call's result."""
        with self.submitting:
            sequence = self.next_sequence
            result = send(sequence, self.in_flight.floor(sequence))
            self.next_sequence = sequence + 1
            self.in_flight.add(sequence, result)
            return sequence, result

    def sending_in_order(self, key: str | None) -> Turn:
        """The lock that keeps the broadcasts of route key ``key`` in the order they
        leave this process: its turn in :attr:`in_order`. A broadcast holds it from its
        send to its submit call where its hand-off needs its versions submitted in the
        order they were sent (``Transport.submits_in_send_order``: the shared-memory owner
        frees a learner's older unplanned slots of the model planned), and from the
        direct version it numbers for the learner's channel on (its receivers apply it
        before its object-store copy is made); every broadcast of ``key`` holds it for
        its submit call. Taken before :attr:`submitting`, one key's at a time: another
        model's broadcasts do not wait for this one's hand-off. A broadcast that leaves
        its model out before a route named it (key ``None``) may be of any model: it
        waits for every key's, and they for it (:class:`SendOrder`)."""
        return self.in_order.turn(key)

    def sender(self, hand_off: str, open_sender: Callable[[], TransportSender]) -> TransportSender:
        """The sender of ``hand_off``, opened with ``open_sender`` on first use."""
        with self.submitting:
            sender = self.senders.get(hand_off)
            if sender is None:
                sender = self.senders[hand_off] = open_sender()
            return sender


_lock = threading.Lock()
_sides: dict[str, LearnerSide] = {}
_closes_channels_at_exit = False


def learner_side(hub_id: str, hub: Any) -> LearnerSide:
    """This process's side of hub ``hub_id`` (whose actor is ``hub``), begun on first
    use; beginning one ends those of the other hubs found closed or dead, in a thread."""
    global _closes_channels_at_exit
    with _lock:
        side = _sides.get(hub_id)
        if side is not None:
            return side
        side = _sides[hub_id] = LearnerSide(hub=hub)
        others = {other: s.hub for other, s in _sides.items() if other != hub_id}
        if not _closes_channels_at_exit:
            # Registered after ray.init's own exit hook, so it runs first, while Ray is up.
            atexit.register(_close_channels)
            _closes_channels_at_exit = True
    if others:
        threading.Thread(
            target=_end_sides_of_gone_hubs, args=(others,), name="raysync-gone-hubs", daemon=True
        ).start()
    return side


def _end_sides_of_gone_hubs(hubs: dict[str, Any]) -> None:
    """End this process's sides of those of ``hubs`` (id -> actor) that closed or died
    (:data:`GONE_CHECK_S`); the others keep theirs."""
    asked = {hub_id: actor.closed.remote() for hub_id, actor in hubs.items()}
    answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=GONE_CHECK_S)
    for hub_id, ref in asked.items():
        if ref not in answered:
            continue
        try:
            gone = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            gone = True  # it will not restart
        except ray.exceptions.RayError:
            continue  # restarting: its learners broadcast to it again
        if gone:
            logger.info("hub %s closed: ending this learner's side of it", hub_id)
            end_learner_side(hub_id, tell_hub=False)


def _close_channels() -> None:
    """At exit: tear down every channel's compiled graph, killing no receiver (Ray's
    own exit hook would kill them all: :mod:`raysync.learner_channel`)."""
    with _lock:
        channels = [c for side in _sides.values() for c in side.channels.values()]
    for channel in channels:
        channel.close()


def end_learner_side(hub_id: str, *, tell_hub: bool = True) -> None:
    """End this process's side of hub ``hub_id``: close its senders and channels (a
    later broadcast begins a new side), and tell the hub (not one found closed or dead:
    a call to a dead actor ends in an error nobody reads, which Ray logs) that the
    numbers routed to this side hold nothing up any more."""
    with _lock:
        side = _sides.pop(hub_id, None)
    if side is None:
        return
    if tell_hub:
        # After a broadcast delivered directly and being submitted (under the lock): its
        # call. (One written into a channel before the lock is missed: release() is for
        # a learner whose broadcasts are acked.)
        with side.submitting:
            last_call = side.next_sequence - 1
        try:  # the answer is not awaited
            side.hub.forget_learner.remote(side.submitter, last_call)
        except Exception as err:  # Ray shut down already
            logger.debug("could not tell hub %s its learner side ended: %r", hub_id, err)
    for sender in side.senders.values():
        sender.close()
    for channel in side.channels.values():
        channel.close()
