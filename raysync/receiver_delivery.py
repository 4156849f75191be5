"""How an update reaches a receiver's process: Ray's ``__ray_call__`` into the host actor.

A receiver lives in a *host* process — an actor written with the mixin, or any actor or
process that called :func:`raysync.attach` — and is known to its hub by an
*attachment* key. The hub (and the receiver's own hub watch, to apply at a safe point)
calls :func:`delivery_call`: Ray runs :func:`deliver` inside the host actor, in the
host's method queue, like any of its methods — through ``__ray_call__``, so no method on
the host's class is needed, or through the mixin's ``_raysync_deliver`` (in an async
class, ``_raysync_deliver_async``, which calls it on a thread). :func:`deliver` finds
the receiver by its key in this process's :data:`attached` registry.

A learner's compiled-graph channel (:mod:`raysync.learner_channel`) reaches the host
another way: Ray runs :func:`deliver_on_channel` on the actor's compiled-graph thread,
once the learner's :func:`claim_channel` on that thread succeeded.

Who calls what: the host process fills the registry (:meth:`Attachments.reserve` before
registering with the hub, :meth:`Attachments.fill` once the receiver exists,
:meth:`Attachments.remove` when it closes); the hub process and the hub watch call
:func:`delivery_call`; Ray runs :func:`deliver` in the host.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import ray
from ray.dag.compiled_dag_node import do_cancel_executable_tasks

from raysync.bounded import keep_newest
from raysync.messages import Ack, AckStatus, Entry, ServeRequest, Update
from raysync.receiver_receipt import Receipt, reply_to_hub

#: How long a delivery waits for a receiver that is still connecting (its key reserved,
#: the hub already answered, the receiver not yet stored: a threaded host).
CONNECTING_WAIT_S = 30.0


class Deliverable(Protocol):
    """What :func:`deliver` needs of a receiver (a :class:`~raysync.receiver_core.ReceiverCore`)."""

    def receive(self, update: Update, *, write_on_host_loop: bool = False) -> Receipt: ...

    def refuse_learner_deliveries(self, token: str) -> None: ...

    def serve(self, request: ServeRequest) -> str | None: ...


#: :meth:`Attachments.reserve`'s check: given the receivers attached under other keys
#: and the claims of the other keys still connecting, raise to reserve nothing.
ClaimCheck = Callable[[list[Deliverable], list[Hashable]], None]


class Attachments:
    """This process's receivers by attachment key (one registry per process)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._receivers: dict[str, Deliverable | None] = {}  # None: reserved, connecting
        #: What each key still connecting connects as (see :meth:`reserve`).
        self._claims: dict[str, Hashable] = {}

    def reserve(
        self, key: str, claim: Hashable | None = None, check: ClaimCheck | None = None
    ) -> None:
        """Announce ``key`` before registering with the hub: a delivery that arrives
        before :meth:`fill` waits for it instead of failing.

        ``check(receivers, claims)``, given the receivers under other keys and the
        ``claim`` of each other key still connecting, runs first under this registry's
        lock, and what it raises reserves nothing: two threads of a host connecting at
        once cannot both pass it (each saw neither the other's receiver nor, without
        claims, its reservation). ``claim`` (the connecting side's, e.g. its hub and
        worker id) stays until the key is filled or removed."""
        with self._cond:
            if check is not None:
                receivers = [r for k, r in self._receivers.items() if k != key and r is not None]
                check(receivers, [c for k, c in self._claims.items() if k != key])
            self._receivers[key] = None
            if claim is not None:
                self._claims[key] = claim

    def fill(self, key: str, receiver: Deliverable) -> None:
        with self._cond:
            self._receivers[key] = receiver
            self._claims.pop(key, None)  # the receiver itself says what it is now
            self._cond.notify_all()

    def remove(self, key: str) -> None:
        with self._cond:
            self._receivers.pop(key, None)
            self._claims.pop(key, None)
            self._cond.notify_all()

    def receivers(self) -> list[Deliverable]:
        """The receivers of this process (those still connecting left out)."""
        with self._cond:
            return [r for r in self._receivers.values() if r is not None]

    def find(self, key: str, wait_s: float = CONNECTING_WAIT_S) -> Deliverable | None:
        """The receiver under ``key``, waiting up to ``wait_s`` while it is reserved;
        None if there is none (closed, or this is a new process after a restart)."""
        with self._cond:
            self._cond.wait_for(lambda: self._receivers.get(key, False) is not None, wait_s)
            return self._receivers.get(key)


#: The receivers of this process.
attached = Attachments()


def deliver(host: Any, key: str, update: Update) -> Ack | None:
    """Runs in the host actor: hand ``update`` to the receiver attached under ``key``;
    its Ack, or None when the ack follows from a later safe point (see
    :func:`raysync.receiver_receipt.reply_to_hub`).

    Ray runs ``__ray_call__`` of an async actor outside its event loop: the version is
    read here, and only its write is handed to the loop where async hosts' safe point
    lives (:mod:`raysync.host_loop`), so the host's coroutines run on while it is read.
    """
    receiver = attached.find(key)
    if receiver is None:
        error = (
            f"no raysync receiver is attached under {key!r} in {type(host).__name__}'s "
            f"process (closed, or a restarted process that has not attached again)"
        )
        return Ack("?", update.model, update.version, AckStatus.NOT_ATTACHED, error)
    return reply_to_hub(receiver.receive(update, write_on_host_loop=True))


def deliver_on_channel(host: Any, key: str, update: Update, token: str) -> Ack | None:
    """Runs in the host actor on Ray's compiled-graph thread, for each version a
    learner writes into its channel (:mod:`raysync.learner_channel`): as
    :func:`deliver`, concurrently with the host's methods (the mixin's gate holds the
    write until they leave it), to the registration ``token`` the channel was built
    for (one version goes to every receiver of the graph: each names its own here).
    Never raises: an error is a FAILED ack, so that the graph, shared by every
    receiver of the channel, keeps running."""
    try:
        return deliver(host, key, dataclasses.replace(update, token=token))
    except Exception:
        return Ack("?", update.model, update.version, AckStatus.FAILED, traceback.format_exc())


#: A stamp on a learner's claim, hold and release calls: (its channel's instance id, a
#: number that grows with each call it sends). A threaded host runs a caller's calls in
#: any order; a call stamped before one already run here is stale.
CallStamp = tuple[str, int]

#: How many holders' last stamps a process keeps (learners that claimed its thread).
_STAMPS_KEPT = 256
#: How long a claim whose graph named no loop here (:meth:`_ChannelClaim.hold`) keeps
#: other learners out: its learner may have died while building (no loop of its to
#: watch). A build takes seconds; a learner whose build outlived this finds its hold
#: refused and tears its graph down.
BUILD_CLAIM_EXPIRES_S = 120.0


class _ChannelClaim:
    """Which learner's compiled graph this process serves: Ray runs one graph at a
    time on an actor's compiled-graph thread, and a second would wait for ever.

    Once the holder's graph is built it names that graph's loop on this actor
    (:meth:`hold`): the ref of Ray's ``do_exec_tasks`` task, which the learner owns,
    and the loop's executable tasks. A learner killed without ``release()`` (SIGKILL,
    out of memory) leaves its loop waiting on this thread for a version that never
    comes; Ray fails that ref with ``OwnerDiedError`` then (within seconds), and the
    next learner to claim takes the thread over: the dead graph's loop is cancelled
    here, as its teardown would have done. A learner that died while building its graph
    (no loop named yet) keeps others out for :data:`BUILD_CLAIM_EXPIRES_S`.

    Each call carries its :data:`CallStamp`: on a threaded host the release of a torn
    graph could run after the claim of the next build, sent after it, and wipe it (that
    graph then ran here unclaimed, and another learner's graph waited behind it); a
    stale call is ignored (a stale claim is refused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: str | None = None
        self._loop: ray.ObjectRef | None = None  #: the holder's graph's, once built
        self._tasks: list[Any] = []  #: that loop's ExecutableTasks
        self._stamps: dict[str, CallStamp] = {}  #: holder -> the latest stamp run here
        self._claimed_at = 0.0  #: when the holder claimed (``time.monotonic()``)

    def claim(self, host: Any, holder: str, stamp: CallStamp) -> bool:
        with self._lock:
            if self._stale(holder, stamp):
                return False
            if self._holder not in (None, holder) and not self._holder_gone(host):
                return False
            self._holder, self._loop, self._tasks = holder, None, []
            self._claimed_at = time.monotonic()
            return True

    def hold(self, holder: str, stamp: CallStamp, loop: ray.ObjectRef, tasks: list[Any]) -> bool:
        """Whether ``holder`` holds this process's thread for its graph's ``loop`` (False:
        its claim expired and another learner's took the thread over)."""
        with self._lock:
            if self._stale(holder, stamp) or self._holder != holder:
                return False
            self._loop, self._tasks = loop, tasks
            return True

    def release(self, holder: str, stamp: CallStamp) -> None:
        with self._lock:
            if not self._stale(holder, stamp) and self._holder == holder:
                self._holder, self._loop, self._tasks = None, None, []

    def _stale(self, holder: str, stamp: CallStamp) -> bool:
        """Whether ``holder`` sent ``stamp`` before a call already run here; if not, it
        is the latest (caller holds the lock). A channel of another instance (the
        learner made it anew) starts its own count."""
        last = self._stamps.pop(holder, None)
        if last is not None and last[0] == stamp[0] and stamp[1] < last[1]:
            self._stamps[holder] = last
            return True
        self._stamps[holder] = stamp  # the newest at the end: the oldest go first
        keep_newest(self._stamps, _STAMPS_KEPT)
        return False

    def _holder_gone(self, host: Any) -> bool:
        """Whether the holder's learner died with its graph's loop running here; if
        so, that loop is cancelled (caller holds the lock). A holder still building
        its graph has named no loop yet: it keeps its claim for
        :data:`BUILD_CLAIM_EXPIRES_S`."""
        if self._loop is None:
            return time.monotonic() - self._claimed_at > BUILD_CLAIM_EXPIRES_S
        try:
            ray.get(self._loop, timeout=0)
        except ray.exceptions.OwnerDiedError:
            do_cancel_executable_tasks(host, self._tasks)
            return True
        except ray.exceptions.RayError:  # running (GetTimeoutError), or it ended
            pass  # a live learner's: it releases its claim once it tore the graph down
        return False


_channel_claim = _ChannelClaim()


def claim_channel(host: Any, holder: str, stamp: CallStamp) -> bool:
    """Runs in the host actor, asked by a learner before it builds a channel: whether
    ``holder``'s graph may use this process's compiled-graph thread (False: another
    live learner's does, or a later call of ``holder``'s ran here first)."""
    return _channel_claim.claim(host, holder, stamp)


def hold_channel(
    host: Any, holder: str, stamp: CallStamp, loop: list[ray.ObjectRef], tasks: list[Any]
) -> bool:
    """Runs in the host actor, called by the learner ``holder`` once its graph is built:
    the graph's loop on this actor (``loop``: its task's ref, in a list so that Ray
    passes the ref on unresolved; ``tasks``: Ray's ExecutableTasks for this actor).
    False if its claim expired meanwhile and another learner's took the thread over."""
    return _channel_claim.hold(holder, stamp, loop[0], tasks)


def release_channel(host: Any, holder: str, stamp: CallStamp) -> None:
    """Runs in the host actor once ``holder``'s graph was torn down."""
    _channel_claim.release(holder, stamp)


def refuse_learner_deliveries(host: Any, key: str, token: str) -> None:
    """Runs in the host actor, called by a hub that is shutting down: the receiver under
    ``key`` refuses every learner's own delivery from now on, while registered as
    ``token`` (a learner may still hold a route the hub gave before; see
    :class:`raysync.messages.Route`)."""
    receiver = attached.find(key, wait_s=0)
    if receiver is not None:
        receiver.refuse_learner_deliveries(token)


def serve(host: Any, key: str, request: ServeRequest) -> str | None:
    """Runs in the host actor, asked by a hub's planner: the receiver under ``key`` sends
    the version it holds to another receiver (see :class:`ServeRequest`). None once sent,
    or why it did not."""
    receiver = attached.find(key, wait_s=0)
    if receiver is None:
        return f"no raysync receiver is attached under {key!r} any more"
    return receiver.serve(request)


def serve_call(handle: Any, key: str, request: ServeRequest) -> Any:
    """Ask the host actor behind ``handle`` to serve ``request``; the call's ObjectRef.
    Through ``__ray_call__`` (in the host's method queue), never retried."""
    return handle.__ray_call__.options(max_task_retries=0).remote(serve, key, request)


def delivery_call(handle: Any, through: Entry, key: str, update: Update) -> Any:
    """Ask the host actor behind ``handle`` to apply ``update``; the call's ObjectRef.

    ``through`` is the host's entry point: the mixin's own method (its coroutine one in
    an async actor), or ``__ray_call__`` for any other actor. Never retried on a
    restarted incarnation, whatever the actor's ``max_task_retries``: the hub must see
    the death (the new incarnation gets the latest version when it registers again).
    """
    if through is Entry.RAY_CALL:
        return handle.__ray_call__.options(max_task_retries=0).remote(deliver, key, update)
    method = getattr(handle, through.value)
    return method.options(max_task_retries=0).remote(key, update)
