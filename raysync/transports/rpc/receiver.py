"""Receiver process: the RPC receiver, its inbox and its membership of the hub's group."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from raysync.bounded import keep_newest
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.bucket_relay import place
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.parts import PartedReceiver
from raysync.transports.rpc.rendezvous import init_rpc
from raysync.transports.rpc.wire import LEFT_KEPT, RpcMember, RpcPayload

#: When a receiver takes version #n of a model from its inbox, of the versions of that
#: model older than it that landed and were never taken (their delivery never came: a
#: receiver's delivery that turns one down lets it go), the newest this many are kept
#: and the others dropped, but none a take waits for. Deliveries of a threaded or async
#: receiver run several at once, in any order, hence a count, not "< n"; per model, and
#: counted, not numbered (the hub numbers across its models: two of one model may be
#: far apart).
_INBOX_WINDOW = 4
#: Reasons the agent gave versions up (and bucketed versions of any model that landed),
#: kept per group until a version this much newer is taken (a few bytes each).
_FAILED_KEPT = 1024


class _RecentVersions:
    """The last versions (key, seq) of some kind (turned down by their delivery, so
    that what lands of them after is not kept; taken by theirs, so that one delivered
    again is refused at once): a bounded set; the caller holds its inbox's lock."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], None] = {}

    def add(self, version: tuple[str, int]) -> None:
        self._seen[version] = None
        keep_newest(self._seen, _FAILED_KEPT)

    def __contains__(self, version: object) -> bool:
        return version in self._seen


def _refuse_taken(taken: _RecentVersions, key: str, seq: int) -> None:
    """Raise TransportError at once if a delivery here already took version #``seq``
    (the hub delivered it again, not knowing whether its first call ran): it lands
    once, and waiting for it again would block the host for the whole timeout."""
    if (key, seq) in taken:
        raise TransportError(
            f"version #{seq} of RPC hub {key[:12]} was taken by an earlier delivery of it "
            "to this process (it was delivered again)"
        )


class _Awaited:
    """The versions (key, seq) a ``take`` waits for now, on some thread: a take of a
    newer one never drops them as stale. The caller holds its inbox's lock."""

    def __init__(self) -> None:
        self._waits: Counter[tuple[str, int]] = Counter()

    @contextmanager
    def waiting(self, key: str, seq: int) -> Iterator[None]:
        self._waits[(key, seq)] += 1
        try:
            yield
        finally:
            self._waits[(key, seq)] -= 1
            if not self._waits[(key, seq)]:
                del self._waits[(key, seq)]

    def __contains__(self, version: object) -> bool:
        return version in self._waits


def _beyond_window(key: str, older: list[int], awaited: _Awaited) -> list[int]:
    """Of ``older`` (the numbers of one model's versions under ``key`` that landed before
    the one taken, never taken), those to drop: all but the newest ``_INBOX_WINDOW``,
    and none a take waits for."""
    return [s for s in sorted(older)[:-_INBOX_WINDOW] if (key, s) not in awaited]


class _Inbox:
    """Per process: versions that landed by RPC, until ``fetch`` takes them.

    Every pushed version is kept until its delivery takes it, or until a newer one of
    its model is taken with ``_INBOX_WINDOW`` others between them: a receiver kept busy
    for many broadcasts holds each version pushed meanwhile here (RPC deliveries do not
    take turns). Once no receiver of this process is open, nothing is kept: its
    deliveries queued behind a busy host find it closed and take nothing.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: key -> seq -> (model, its tensors)
        self._landed: dict[str, dict[int, tuple[str, list[torch.Tensor]]]] = {}
        #: key -> seq -> why the agent gave that version up here
        self._failed: dict[str, dict[int, str]] = {}
        self._turned_down = _RecentVersions()
        self._taken = _RecentVersions()
        #: keys of groups this process left: what lands under one now is never taken
        self._gone: set[str] = set()
        #: this process's open receivers (see :meth:`opened`)
        self._receivers = 0
        self._awaited = _Awaited()

    def opened(self) -> None:
        """A receiver of this process opened: what lands is kept for its deliveries."""
        with self._cond:
            self._receivers += 1

    def closed(self) -> None:
        """A receiver of this process closed: once none is open, drop what landed and
        what still lands (no delivery takes it: the hub forgot the receiver)."""
        with self._cond:
            self._receivers -= 1
            if not self._receivers:
                self._landed.clear()
                self._failed.clear()

    def put(self, key: str, seq: int, tensors: list[torch.Tensor], model: str = "") -> None:
        with self._cond:
            if (key, seq) in self._turned_down or key in self._gone or not self._receivers:
                return
            self._landed.setdefault(key, {})[seq] = (model, tensors)
            self._cond.notify_all()

    def discard(self, key: str, seq: int) -> None:
        """Its delivery turned version #``seq`` down: drop it, now or as it lands."""
        with self._cond:
            self._landed.get(key, {}).pop(seq, None)
            self._turned_down.add((key, seq))

    def fail(self, key: str, seq: int, why: str) -> None:
        with self._cond:
            if key not in self._gone and self._receivers:
                self._failed.setdefault(key, {})[seq] = why
                self._cond.notify_all()

    def forget(self, key: str) -> None:
        """This process left the group of ``key`` (its agent was replaced): drop what
        landed under it, and what still lands (no delivery of it takes anything now)."""
        with self._cond:
            self._gone.add(key)
            self._landed.pop(key, None)
            self._failed.pop(key, None)

    def take(self, key: str, seq: int, timeout_s: float) -> list[torch.Tensor]:
        """Version #``seq`` once it landed; TransportError if the agent gave it up, or
        it did not land within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            versions = self._landed.setdefault(key, {})
            failed = self._failed.setdefault(key, {})
            for stale in [s for s in failed if s < seq - _FAILED_KEPT]:
                del failed[stale]
            _refuse_taken(self._taken, key, seq)
            with self._awaited.waiting(key, seq):
                while seq not in versions:
                    if seq in failed:
                        why = failed.pop(seq)
                        raise TransportError(f"version #{seq} of RPC hub {key[:12]}: {why}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransportError(
                            f"version #{seq} of RPC hub {key[:12]} did not land within "
                            f"{timeout_s:g} s; the RPC agent may have died or could not "
                            "reach this receiver"
                        )
                    self._cond.wait(remaining)
            model, tensors = versions.pop(seq)
            self._taken.add((key, seq))
            older = [s for s, (m, _) in versions.items() if m == model and s < seq]
            for stale in _beyond_window(key, older, self._awaited):
                del versions[stale]
            return tensors


_INBOX = _Inbox()


@dataclass
class _Landing:
    """A bucketed version landing: its staging buffer and how far it got."""

    buffer: torch.Tensor
    model: str = ""
    landed: int = 0
    failed: str | None = None
    placing: int = 0  #: buckets being copied into ``buffer`` now (outside the lock)


class _BucketInbox:
    """Per process: bucketed versions landing by RPC, each into a staging buffer of its
    packed layout, until ``fetch`` takes the buffer; buffers come back with ``release``
    and are reused (one kept free per size)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._landing: dict[tuple[str, int], _Landing] = {}
        self._free: dict[int, torch.Tensor] = {}
        self._turned_down = _RecentVersions()
        self._taken = _RecentVersions()
        #: keys of groups this process left (see :meth:`_Inbox.forget`)
        self._gone: set[str] = set()
        #: this process's open receivers (see :meth:`_Inbox.opened`)
        self._receivers = 0
        self._awaited = _Awaited()

    def opened(self) -> None:
        with self._cond:
            self._receivers += 1

    def closed(self) -> None:
        """As :meth:`_Inbox.closed`; the buffers kept for reuse go too (a receiver
        opened later makes its own)."""
        with self._cond:
            self._receivers -= 1
            if not self._receivers:
                for landing in list(self._landing):
                    self._drop(landing)
                self._free.clear()

    def put(
        self,
        key: str,
        seq: int,
        nbytes: int,
        places: Sequence[tuple[int, int]],
        pieces: list[torch.Tensor],
        model: str = "",
    ) -> None:
        with self._cond:
            if (key, seq) in self._turned_down or key in self._gone or not self._receivers:
                return  # its delivery came first and turned it down, or it never will
            landing = self._landing.get((key, seq))
            if landing is None:
                buffer = self._free.pop(nbytes, None)
                if buffer is None:
                    buffer = torch.empty(nbytes, dtype=torch.uint8)
                landing = self._landing[(key, seq)] = _Landing(buffer, model)
            landing.placing += 1
        # One bucket of a version lands at a time (the agent waits for each call).
        try:
            place(landing.buffer, places, pieces)
        finally:
            with self._cond:
                landing.placing -= 1
        with self._cond:
            landing.landed += 1
            self._cond.notify_all()

    def fail(self, key: str, seq: int, why: str) -> None:
        with self._cond:
            if (key, seq) in self._turned_down or key in self._gone or not self._receivers:
                return  # no delivery takes it
            landing = self._landing.get((key, seq))
            if landing is None:
                landing = self._landing[(key, seq)] = _Landing(torch.empty(0, dtype=torch.uint8))
            landing.failed = why
            self._cond.notify_all()

    def take(self, key: str, seq: int, count: int, timeout_s: float) -> torch.Tensor:
        """The buffer of version #``seq`` once its ``count`` buckets landed; TransportError
        if the agent gave it up, or no bucket landed for ``timeout_s``."""
        with self._cond:
            # What the agent gave up (or landed) long ago and no delivery took: its
            # delivery timed out first, or another model's receiver left.
            for stale in [k for k in self._landing if k[0] == key and k[1] < seq - _FAILED_KEPT]:
                self._drop(stale)
            _refuse_taken(self._taken, key, seq)
            with self._awaited.waiting(key, seq):
                return self._wait_and_take(key, seq, count, timeout_s)

    def _wait_and_take(self, key: str, seq: int, count: int, timeout_s: float) -> torch.Tensor:
        """:meth:`take`'s wait, under the lock."""
        progress, deadline = -1, 0.0
        while True:
            landing = self._landing.get((key, seq))
            if landing is not None and landing.failed is not None:
                self._drop((key, seq))
                raise TransportError(f"version #{seq} of RPC hub {key[:12]}: {landing.failed}")
            landed = 0 if landing is None else landing.landed
            if landed >= count:
                taken = self._landing.pop((key, seq))
                self._taken.add((key, seq))
                older = [
                    k[1]
                    for k, other in self._landing.items()
                    if k[0] == key and k[1] < seq and other.model == taken.model
                ]
                for stale in _beyond_window(key, older, self._awaited):
                    self._drop((key, stale))
                return taken.buffer
            if landed != progress:
                progress, deadline = landed, time.monotonic() + timeout_s
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._drop((key, seq))
                raise TransportError(
                    f"version #{seq} of RPC hub {key[:12]}: bucket {landed} of {count} did "
                    f"not land within {timeout_s:g} s; the RPC agent may have died or "
                    "could not reach this receiver"
                )
            self._cond.wait(remaining)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free[buffer.numel()] = buffer

    def discard(self, key: str, seq: int) -> None:
        """Its delivery turned bucketed version #``seq`` down: drop what landed of it,
        and what lands of it later."""
        with self._cond:
            self._drop((key, seq))
            self._turned_down.add((key, seq))

    def forget(self, key: str) -> None:
        """This process left the group of ``key``: drop its landings (their buffers
        are reused) and what still lands under it."""
        with self._cond:
            self._gone.add(key)
            for landing in [k for k in self._landing if k[0] == key]:
                self._drop(landing)

    def _drop(self, key: tuple[str, int]) -> None:
        """Forget a landing and reuse its buffer (holds the lock), unless a bucket is
        still being copied into it (a call that stalled past the agent's patience: the
        next version would get a buffer that copy then overwrites)."""
        landing = self._landing.pop(key, None)
        if landing is not None and landing.buffer.numel() and not landing.placing:
            self._free[landing.buffer.numel()] = landing.buffer


_BUCKETS = _BucketInbox()


def answer_ping() -> bool:
    """The agent's liveness probe of a listed member (runs on its RPC thread pool)."""
    return True


def land(key: str, seq: int, tensors: list[torch.Tensor], model: str = "") -> int:
    """Runs on the receiver's RPC thread pool when the agent's ``rpc_async`` arrives:
    version #``seq`` (of ``model``) lands in this process's inbox."""
    _INBOX.put(key, seq, tensors, model)
    return seq


def land_bucket(
    key: str,
    seq: int,
    nbytes: int,
    places: Sequence[tuple[int, int]],
    pieces: list[torch.Tensor],
    model: str = "",
) -> int:
    """One bucket of bucketed version #``seq`` of ``model`` (RPC thread pool): its
    ``pieces`` go to their ``places`` ((offset, bytes)) in the version's staging buffer
    of ``nbytes``."""
    _BUCKETS.put(key, seq, nbytes, places, pieces, model)
    return seq


def abandon_whole(key: str, seq: int, why: str) -> None:
    """The agent gave whole version #``seq`` up (RPC thread pool): its fetch raises
    ``why`` at once instead of waiting its timeout for a version that will not land."""
    _INBOX.fail(key, seq, why)


def abandon_bucketed(key: str, seq: int, why: str) -> None:
    """The agent gave bucketed version #``seq`` up (RPC thread pool): its fetch raises."""
    _BUCKETS.fail(key, seq, why)


class _Attached:
    """The workers of this process's open RPC receivers, one count per receiver (a
    registration replacing one opens its new receiver before it closes the old)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def add(self, worker: str) -> None:
        with self._lock:
            self._open[worker] += 1

    def remove(self, worker: str) -> None:
        with self._lock:
            self._open[worker] -= 1
            if not self._open[worker]:
                del self._open[worker]

    def other_than(self, worker: str) -> bool:
        """Whether a receiver of a worker other than ``worker`` is open here."""
        with self._lock:
            return any(open_worker != worker for open_worker in self._open)


class _Membership:
    """This process's place in one RPC group.

    torch RPC is per process and, in practice, once per process: a second ``init_rpc``
    gets a different store prefix and ``dist_autograd`` refuses a new rank. So a
    receiver process joins the first RPC hub it registers with and stays in its group
    until it exits; registering again with the same hub reuses the membership, another
    RPC hub is refused.
    """

    lock = threading.Lock()
    member: RpcMember | None = None
    #: This process's rank once it joined a group: torch's distributed autograd keeps
    #: it for life, so every later group (a replaced agent's) must give it the same.
    #: Set while ``member`` is None too: between groups, after a move that failed.
    rank: int | None = None
    #: Keys of the groups this process left (their agents were replaced): a delivery
    #: of one that comes late must not move it back.
    left: set[str] = set()
    #: The newest group (:attr:`RpcMember.generation`) this process joined or tried
    #: to: a late delivery of an older one it skipped (two agents replaced in a row)
    #: must not move it there either.
    generation: int = 0
    #: The workers of this process's open receivers (each counted once it joined).
    attached = _Attached()

    @classmethod
    def join(cls, member: RpcMember) -> RpcMember:
        """Join ``member``'s group, or stay in it; moves from an earlier group of the same
        hub (its agent was replaced, or the hub restarted); refuses another hub's, and
        another place in this hub's (see :meth:`_forgotten`)."""
        with cls.lock:
            cls._refuse_left(member)
            if cls.member is None:
                cls._init(member)
            elif cls.member.hub != member.hub:
                raise TransportError(
                    f"this process already belongs to the RPC group of another hub "
                    f"({cls.member.url}); torch RPC allows one group per process"
                )
            elif cls.member.rank != member.rank and not cls.attached.other_than(member.worker):
                raise cls._forgotten(cls.member, member)
            elif cls.member.key != member.key:
                cls._move(member)
            elif cls.member.name != member.name:
                raise TransportError(
                    f"this process is {cls.member.name} in the hub's RPC group (receiver "
                    f"{cls.member.worker!r}), and torch RPC gives a process one place in "
                    f"it: the hub admitted receiver {member.worker!r} as {member.name}. "
                    "Attach every model of this process in one receiver, or give this "
                    "one another transport"
                )
            assert cls.member is not None  # joined, or raised
            cls.attached.add(member.worker)
            return cls.member

    @staticmethod
    def _forgotten(own: RpcMember, admitted: RpcMember) -> TransportError:
        """The refusal of ``admitted``, another rank than this process's ``own``, with no
        other receiver open here: the process left the hub and attaches again, and the
        hub no longer had its place (its books keep the last ``LEFT_KEPT`` processes that
        left), so it admitted it as a new process."""
        return TransportError(
            f"this process left the hub's RPC group as rank {own.rank} ({own.name}) and "
            f"attaches again as receiver {admitted.worker!r}, but the hub no longer has its "
            f"place (it keeps those of the last {LEFT_KEPT} processes that left it, and more "
            f"left since): it admitted it at rank {admitted.rank}, and torch RPC keeps a "
            "process's first rank for its life. Restart this actor (a new process joins "
            "under a new rank), or give this receiver another transport"
        )

    @classmethod
    def follow(cls, member: RpcMember) -> None:
        """Called with every delivery's member: move if the hub's group changed, or join
        it if an earlier move failed (that delivery failed; this one tries again)."""
        with cls.lock:
            cls._refuse_left(member)
            if cls.member is None:
                if cls.rank is not None:
                    cls._init(member)
            elif cls.member.key != member.key:
                cls._move(member)

    @classmethod
    def _refuse_left(cls, member: RpcMember) -> None:
        """TransportError if ``member``'s group is one this process left, or older than
        one it joined (a delivery or registration of a replaced agent's, come late).
        Holds ``lock``."""
        if member.key in cls.left or member.generation < cls.generation:
            raise TransportError(
                f"this comes from an RPC group this process has left or passed over (its "
                f"agent was replaced; key {member.key[:12]}): the hub's new group carries "
                "the next version"
            )

    @classmethod
    def _move(cls, member: RpcMember) -> None:
        """Leave the (dead) group and join ``member``'s under the same rank. Holds
        ``lock``."""
        import torch.distributed.rpc as rpc

        if cls.member is not None and cls.member.rank != member.rank:
            raise TransportError(
                f"the hub moved this process from rank {cls.member.rank} to rank "
                f"{member.rank} of its new RPC group; torch RPC keeps a process's rank"
            )
        rpc.shutdown(graceful=False)
        if cls.member is not None:
            cls.left.add(cls.member.key)
            _INBOX.forget(cls.member.key)  # landed there, never to be taken
            _BUCKETS.forget(cls.member.key)
        cls.member = None
        cls._init(member)

    @classmethod
    def _init(cls, member: RpcMember) -> None:
        """``init_rpc`` into ``member``'s group: this process's first, or again under the
        rank it had (after a move's shutdown, or a move that failed). Holds ``lock``."""
        import torch.distributed.rpc as rpc

        if cls.rank is not None and member.rank != cls.rank:
            raise TransportError(
                f"the hub placed this process at rank {member.rank} of its RPC group; "
                f"it was rank {cls.rank}, which torch RPC keeps for a process's life"
            )
        # init_rpc prefixes its store keys with a per-process count of init_rpc calls,
        # counted once its store connects (a join that fails after counts too); the
        # agent's process counts its first, so each join here must too.
        with rpc._init_counter_lock:
            rpc._init_counter = 0
        cls.generation = max(cls.generation, member.generation)
        init_rpc(member.name, member.rank, member.url, member.settings)
        cls.member, cls.rank = member, member.rank


class RpcReceiver(TransportReceiver):
    def __init__(self, member: RpcMember) -> None:
        # Opened before joining: the agent's sends reach this process as soon as its
        # join did, inside ``init_rpc``; what landed before was not kept (a version sent
        # while a restarted receiver joined waited out its whole timeout).
        _INBOX.opened()
        _BUCKETS.opened()
        try:
            self._member = _Membership.join(member)
        except BaseException:
            _INBOX.closed()
            _BUCKETS.closed()
            raise
        self._worker = member.worker
        self._closed = False
        #: the learner's put(s), or a bucket stream served to this receiver
        self._pull = PartedReceiver(ObjectStoreReceiver(member.worker))
        self._lock = threading.Lock()
        self._leased: dict[int, torch.Tensor] = {}  #: id(staged) -> its landed buffer

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if not isinstance(payload, RpcPayload):  # pull mode: from the object store
            return self._pull.fetch(payload, spec)
        _Membership.follow(payload.member)
        if payload.buckets:
            buffer = _BUCKETS.take(payload.key, payload.seq, payload.buckets, payload.timeout_s)
            staged = PackedLayout.of(spec).views(buffer)
            with self._lock:
                self._leased[id(staged)] = buffer
            return staged
        tensors = _INBOX.take(payload.key, payload.seq, payload.timeout_s)
        if len(tensors) != len(spec):
            raise TransportError(
                f"version #{payload.seq} landed with {len(tensors)} tensors, the update's "
                f"spec has {len(spec)}"
            )
        # Each landed in its shape (the learner put NumPy views of its tensors); only a
        # dtype NumPy lacks (bfloat16, float8) arrives as a same-size integer stand-in.
        return [
            raw if raw.dtype == entry.dtype else raw.view(entry.dtype)
            for raw, entry in zip(tensors, spec.tensors, strict=True)
        ]

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if not isinstance(payload, RpcPayload):
            self._pull.release(payload, staged)
            return
        with self._lock:
            buffer = None if staged is None else self._leased.pop(id(staged), None)
        if buffer is not None:
            _BUCKETS.give_back(buffer)
        elif staged is None:  # turned down (or its fetch failed): not kept for a take
            if payload.buckets:
                _BUCKETS.discard(payload.key, payload.seq)
            else:
                _INBOX.discard(payload.key, payload.seq)

    def serve(self, payload: Any, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        self._pull.serve(payload, tensors, spec)

    def close(self) -> None:
        self._pull.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _Membership.attached.remove(self._worker)
        _INBOX.closed()
        _BUCKETS.closed()
