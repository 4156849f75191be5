"""A distributed member without a process group (raysync/transports/distributed/
receiver.py): once a bucketed version's collective failed it reads the rest from the
hub's bucket broker and tells the broker whether it got the version whole (only then
may it serve it to a late joiner); a fetch waiting for its turn ends when it closes."""

from __future__ import annotations

import threading

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.distributed import receiver as receiver_mod
from raysync.transports.distributed.group import bucket_timeout_s
from raysync.transports.distributed.receiver import DistributedReceiver
from raysync.transports.distributed.wire import (
    HEADER_BYTES,
    Generation,
    GroupPayload,
    StoreAddress,
)
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.options import MIN_TIMEOUT_S, DistributedOptions

SPEC = WeightSpec.of({"w": torch.zeros(32)})  # 128 bytes: two buckets of 64
BUCKET_BUFFER = HEADER_BYTES + 64  #: each collective's buffer: a bucket behind the header


class _Broker:
    """Stands for the bucket broker's actor handle: records the calls made to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.take = _Method(self.calls, "take")
        self.leave = _Method(self.calls, "leave")


class _Method:
    def __init__(self, calls: list, name: str) -> None:
        self._calls, self._name = calls, name

    def remote(self, *args) -> None:
        self._calls.append((self._name, args))


def _fallback(monkeypatch, bucket_read) -> tuple[_Broker, StreamId, object]:
    """A member whose first collective failed, reading the rest with ``bucket_read``:
    the broker, the stream, and what its fetch returned or raised."""
    broker, key = _Broker(), StreamId("s", 2, 10.0)
    generation = Generation(1, ("w",), "p", StoreAddress("h", 1), DistributedOptions())
    payload = GroupPayload(
        generation, 1, 0, BucketStream(broker, key, 64), BUCKET_BUFFER, buckets=2
    )
    failed = TransportError("rank 1 could not receive collective 0 (a member died)")
    monkeypatch.setattr(DistributedReceiver, "_receive_buckets", lambda *args: (0, failed))
    monkeypatch.setattr(receiver_mod, "read_bucket_now", bucket_read)
    try:
        return broker, key, DistributedReceiver("w").fetch(payload, SPEC)
    except TransportError as err:
        return broker, key, err


def test_a_member_whose_fallback_read_failed_leaves_the_stream(monkeypatch):
    """It said it took every bucket: the broker offered it to serve the version to a
    late joiner, which it could not (it holds another version), and the catch-up
    failed."""

    def gone(bucket, reader, timeout_s):
        raise TransportError("bucket 1 of 2 is gone")

    broker, key, outcome = _fallback(monkeypatch, gone)
    assert isinstance(outcome, TransportError) and "is gone" in str(outcome)
    assert broker.calls == [("leave", (key, "w"))]


def test_a_member_whose_fallback_read_the_rest_finishes_the_stream(monkeypatch):
    broker, key, outcome = _fallback(
        monkeypatch,
        lambda bucket, reader, timeout_s: [torch.ones(bucket.nbytes, dtype=torch.uint8)],
    )
    assert not isinstance(outcome, Exception)
    assert broker.calls == [("take", (key, 2, "w", ()))]


def test_a_fetch_waiting_for_its_turn_ends_when_the_receiver_closes():
    """Collective 1 waits for collective 0 to be delivered first; the receiver closes
    (it registered again): the wait ends then, not at its deadline."""
    generation = Generation(1, ("w",), "p", StoreAddress("h", 1), DistributedOptions())
    receiver = DistributedReceiver("w")
    receiver._generation, receiver._next_seq = generation, 0
    stream = BucketStream(_Broker(), StreamId("s", 1, 60.0), 64)
    payload = GroupPayload(generation, 1, 1, stream, BUCKET_BUFFER)
    outcome: list[BaseException] = []

    def fetch() -> None:
        try:
            receiver._receive(payload, SPEC)
        except TransportError as err:
            outcome.append(err)

    waiting = threading.Thread(target=fetch)
    waiting.start()
    with receiver._turn:  # it waits in the turn's condition (or has not reached it yet)
        pass
    receiver.close()
    waiting.join(10)
    assert not waiting.is_alive(), "the fetch waited on after the close"
    assert "closed before collective 1" in str(outcome[0])


def test_a_collective_of_a_new_generation_names_the_one_it_waited_for():
    """Collective 1 of a new generation waits for that generation's collective 0 (not
    for the next one of the generation this receiver is in, which it named)."""
    settings = DistributedOptions(timeout_s=0.05)
    receiver = DistributedReceiver("w")
    receiver._generation = Generation(1, ("w",), "p", StoreAddress("h", 1), settings)
    receiver._next_seq = 3
    newer = Generation(2, ("w",), "q", StoreAddress("h", 1), settings)
    stream = BucketStream(_Broker(), StreamId("s", 1, 60.0), 64)
    payload = GroupPayload(newer, 1, 1, stream, BUCKET_BUFFER)
    with pytest.raises(TransportError, match="waited 0.05 s for its collective 0 to be"):
        receiver._receive(payload, SPEC)


def test_only_a_version_released_unread_is_sat_in(monkeypatch):
    """A version whose fetch ran (here it raised: its collective failed) is let go; one
    handed back without a fetch (the receiver failed it before) enters its collectives."""
    sat_in: list[int] = []
    monkeypatch.setattr(DistributedReceiver, "_sit_in", lambda self, p: sat_in.append(p.seq))
    generation = Generation(1, ("w",), "p", StoreAddress("h", 1), DistributedOptions())
    failed = TransportError("rank 1 could not receive collective 0 (a member died)")

    def receive(self, payload, spec):
        raise failed

    monkeypatch.setattr(DistributedReceiver, "_receive", receive)
    monkeypatch.setattr(
        receiver_mod.PartedReceiver, "fetch", lambda *args: (_ for _ in ()).throw(failed)
    )
    receiver = DistributedReceiver("w")
    source = BucketStream(_Broker(), StreamId("s", 1, 60.0), 64)
    fetched, unread = (GroupPayload(generation, 1, seq, source, BUCKET_BUFFER) for seq in (0, 1))
    with pytest.raises(TransportError):
        receiver.fetch(fetched, SPEC)
    receiver.release(fetched, None)
    receiver.release(unread, None)
    assert sat_in == [1]


def test_a_closed_receiver_sits_in_no_bucketed_version_and_leaves_its_stream():
    """Its turn never comes: rank 0 makes the members readers of the rest once the
    collective failed; this one gives the stream up, so no one waits for its read."""
    broker, key = _Broker(), StreamId("s", 2, 10.0)
    generation = Generation(1, ("w",), "p", StoreAddress("h", 1), DistributedOptions())
    receiver = DistributedReceiver("w")
    receiver.close()
    payload = GroupPayload(
        generation, 1, 0, BucketStream(broker, key, 64), BUCKET_BUFFER, buckets=2
    )
    receiver.release(payload, None)
    assert broker.calls == [("leave", (key, "w"))]


def test_a_receiver_keeps_no_word_of_generations_older_than_its_own(monkeypatch):
    """Why each generation broke here was kept for the receiver's life: one entry per
    membership change that followed a failure. A collective of an older generation is
    turned away as older all the same."""
    monkeypatch.setattr(receiver_mod, "join_group", lambda generation, rank: None)
    settings = DistributedOptions(timeout_s=0.05)
    receiver = DistributedReceiver("w")
    generations = [Generation(n, ("w",), "p", StoreAddress("h", 1), settings) for n in (1, 2, 3)]
    for generation in generations[:2]:
        receiver._switch_to(generation, 1)
        receiver._break(generation, "collective 0 failed: a member died")
    receiver._switch_to(generations[2], 1)
    assert receiver._broken == {}
    stream = BucketStream(_Broker(), StreamId("s", 1, 60.0), 64)
    with pytest.raises(TransportError, match="after this receiver moved on to generation 3"):
        receiver._receive(GroupPayload(generations[0], 1, 1, stream, BUCKET_BUFFER), SPEC)


def test_a_receiver_turns_away_a_generation_formed_before_it_registered_at_once():
    """Its worker registered again in the same process while a version was planned in
    generation 1 for the receiver it replaced: that version's collective 1 reached the
    new receiver, which waited the group's whole timeout for a collective 0 it never
    gets (another's to enter), its next delivery queued behind it. It reads the
    learner's copy at once instead; a later generation is its own."""
    settings = DistributedOptions(backend="gloo", timeout_s=600.0)
    formed_before, own = (
        Generation(n, ("w",), "p", StoreAddress("h", 1), settings) for n in (1, 2)
    )
    receiver = DistributedReceiver("w", formed_before=1)
    stale = GroupPayload(formed_before, 1, 1, None, 64)  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="formed before this receiver registered"):
        receiver._receive(stale, SPEC)
    with receiver._turn:  # its own generation's first collective is its turn
        receiver._wait_for_turn(GroupPayload(own, 1, 0, None, 64), deadline=0.0)  # type: ignore[arg-type]


def test_a_failed_collectives_group_is_let_go_before_the_fallback_read(monkeypatch):
    """The collective's error, kept as the cause of the receiver's, held its frames and
    they the group the receiver had left: its connections stayed open (gloo's shutdown
    closes none), and its peers waited on it for the group's timeout, through the whole
    fallback read of the learner's copy."""
    import weakref

    class _Group:
        def shutdown(self) -> None: ...

    made: list[weakref.ref] = []

    def join_group(generation, rank):
        group = _Group()
        made.append(weakref.ref(group))
        return group

    def run_broadcast(group, buffer, settings, **kwargs):
        raise RuntimeError("a peer hung up (injected)")  # its frame holds ``group``

    monkeypatch.setattr(receiver_mod, "join_group", join_group)
    monkeypatch.setattr(receiver_mod, "run_broadcast", run_broadcast)
    generation = Generation(1, ("w",), "p", StoreAddress("h", 1), DistributedOptions())
    receiver = DistributedReceiver("w")
    try:
        receiver._receive(GroupPayload(generation, 1, 0, None, 64), SPEC)  # type: ignore[arg-type]
    except TransportError as err:  # where the fallback read runs
        assert "a peer hung up (injected)" in str(err)
        assert made and made[0]() is None, "the group outlives the receiver's leaving it"
    else:
        raise AssertionError("the collective's failure was not raised")


def test_a_bucket_collective_of_a_very_short_broadcast_still_has_a_timeout():
    """A broadcast's ``timeout_s`` of 3 ms gives a bucket 0.75 ms, which torch would
    keep as 0 ms: no timeout, a collective a frozen member never enters waits for good."""
    short = BucketStream(None, StreamId("short", 2, 0.003), 64)
    assert bucket_timeout_s(DistributedOptions(), short) == MIN_TIMEOUT_S
    usual = BucketStream(None, StreamId("usual", 2, 60.0), 64)
    assert bucket_timeout_s(DistributedOptions(timeout_s=7.0), usual) == 7.0
