"""buckets_of (raysync/transports/object_store/buckets.py): the order in which a
receiver asks the broker for buckets and says what it copied. Its ``take`` calls are
recorded by a stand-in broker; the answers are read by ``_answer`` (patched here to
read the stand-in's boxes instead of Ray's refs: the broker's side is tested in
test_bucket_broker.py and, with Ray, in tests/test_buckets.py)."""

from __future__ import annotations

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import VersionDone
from raysync.transports.buckets import BucketPlan
from raysync.transports.object_store import buckets
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.object_store.buckets import Outgoing, buckets_of, stream_out


class _Take:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def remote(self, key, index, worker, passed_on=(), copied=None):
        self.calls.append((index, copied))
        return ([f"ref{index}"], None)


class _Broker:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.take = _Take(self.calls)


@pytest.fixture(autouse=True)
def _answers_are_the_boxes(monkeypatch):
    monkeypatch.setattr(buckets, "_answer", lambda asked: asked)


def stream(count: int) -> tuple[_Broker, BucketStream]:
    broker = _Broker()
    return broker, BucketStream(broker, StreamId("s", count, 5.0), 64)


def test_a_reader_keeps_two_asks_ahead_and_says_what_it_copied_once_it_read_it():
    broker, payload = stream(5)
    reading = buckets_of(payload, 5, "w")
    seen = []
    for index, boxed in reading:
        seen.append((index, boxed, list(broker.calls)))
        broker.calls.clear()
    # Before the caller reads bucket 0: buckets 0 and 1 asked, nothing copied.
    assert seen[0] == (0, ["ref0"], [(0, 0), (1, 0)])
    # Having read bucket k, it asks for k + 2 and says it copied k + 1 buckets (none
    # after reading bucket 3: bucket 5 is past the end).
    assert [entry[2] for entry in seen[1:]] == [[(2, 1)], [(3, 2)], [(4, 3)], []]
    assert [entry[1] for entry in seen] == [[f"ref{i}"] for i in range(5)]
    assert broker.calls == [(5, None)]  # done: every bucket read


@pytest.mark.parametrize("count", [1, 2])
def test_a_short_stream_asks_for_no_bucket_it_does_not_have(count):
    broker, payload = stream(count)
    assert [index for index, _ in buckets_of(payload, count, "w")] == list(range(count))
    assert broker.calls == [(index, 0) for index in range(count)] + [(count, None)]


def test_a_bucket_that_cannot_be_had_is_named():
    broker, payload = stream(3)
    broker.take.remote = lambda key, index, *rest: (None, "gone") if index == 1 else ([0], None)
    reading = buckets_of(payload, 3, "w")
    next(reading)
    with pytest.raises(buckets.TransportError, match="bucket 1 of 3: gone"):
        next(reading)


class _Calls:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def remote(self, *args):
        self.calls.append((self.name, *args))


def _recorded_stream() -> tuple[BucketStream, Outgoing, list]:
    """A stream of four 64-byte buckets to a broker whose ``offer`` and ``end`` calls
    are recorded (the list)."""
    calls: list = []
    broker = _Broker()
    broker.offer, broker.end = _Calls("offer", calls), _Calls("end", calls)
    weights = {"w": torch.zeros(64)}  # 256 bytes: four buckets of 64
    plan = BucketPlan.of(WeightSpec.of(weights), 64)
    payload = BucketStream(broker, StreamId("s", plan.count, 5.0), 64)
    return payload, Outgoing([weights["w"]], plan), calls


class _Running(VersionDone):
    """A broadcast still running."""

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError


def test_a_learner_that_fails_putting_a_bucket_ends_its_stream_saying_why(monkeypatch):
    """Its readers are told at once, instead of waiting the version's timeout for a
    bucket that never comes."""
    payload, outgoing, calls = _recorded_stream()
    puts = iter(["ref0"])
    full = "the object store is full"

    def put_arrays(arrays):
        try:
            return next(puts)
        except StopIteration:
            raise MemoryError(full) from None

    monkeypatch.setattr(buckets, "put_arrays", put_arrays)
    monkeypatch.setattr(buckets, "this_actor", lambda: None)
    with pytest.raises(MemoryError):
        stream_out(payload, outgoing, _Running())
    assert calls == [
        ("offer", payload.key, 0, ["ref0"], None),
        ("end", payload.key, f"the learner failed putting bucket 1: {MemoryError(full)!r}"),
    ]


def test_a_learner_interrupted_waiting_for_room_ends_its_stream_saying_why(monkeypatch):
    """Ctrl-C (or a cancelled learner task) while it waits for its readers to make
    room: they were left waiting the stream's whole timeout, then told the learner
    stalled."""
    payload, outgoing, calls = _recorded_stream()

    def room_or_end(broker, key, index, done):
        if index == 2:
            raise KeyboardInterrupt
        return True

    monkeypatch.setattr(buckets, "room_or_end", room_or_end)
    monkeypatch.setattr(buckets, "put_arrays", lambda arrays: "ref")
    monkeypatch.setattr(buckets, "this_actor", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        stream_out(payload, outgoing, done=None)
    assert calls[-1] == (
        "end",
        payload.key,
        f"the learner failed waiting for room for bucket 2: {KeyboardInterrupt()!r}",
    )


class _Ended(VersionDone):
    """A broadcast that has ended (the hub refused it before the learner streamed)."""

    def wait(self, timeout_s: float) -> None:
        return None


def test_a_learner_whose_broadcast_ended_already_puts_no_bucket(monkeypatch):
    """The first two buckets go out without waiting for room: a refused version (a
    whole model, in two buckets) was put and offered all the same, and held until the
    broker expired its unplanned stream."""
    payload, outgoing, calls = _recorded_stream()

    def put_arrays(arrays):
        raise AssertionError("a bucket was put")

    monkeypatch.setattr(buckets, "put_arrays", put_arrays)
    monkeypatch.setattr(buckets, "this_actor", lambda: None)
    stream_out(payload, outgoing, _Ended())
    assert calls == [("end", payload.key, "the broadcast ended before every bucket was sent")]


def test_the_planner_ends_a_refused_versions_stream_unless_its_learner_delivered_it():
    from raysync.transports.object_store.planner import ObjectStorePlanner

    payload, _, calls = _recorded_stream()
    planner = ObjectStorePlanner()
    planner.abandoned(payload, read_by=("w",))  # read by receivers the learner called
    assert calls == []
    planner.abandoned(payload)
    assert calls == [("end", payload.key, "the hub refused this version")]
