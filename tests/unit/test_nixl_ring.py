"""The NIXL sender's bucket ring (raysync/transports/nixl/ring.py) without Ray or NIXL:
which slot each bucket goes to, when a slot an older version holds is free again, and
that a learner stopped while it waits for room ends its stream saying why. The broker
is a stand-in recording its calls; its ``room`` answers are read by a stand-in of
``ray.wait``/``ray.get`` (the broker's side is tested in test_bucket_broker.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from raysync.transports.base import VersionDone
from raysync.transports.nixl import ring as ring_module
from raysync.transports.nixl.ring import BucketRing
from raysync.transports.nixl.wire import SLOT_HEADER
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.buckets import Outgoing
from tests.unit.broker_stand_in import BUCKET, EndsAfter, recording_broker, stream_of


@pytest.fixture
def broker(monkeypatch):
    """The broker stand-in (its ``room`` never answers; ``broker.calls``)."""
    monkeypatch.setattr(ring_module, "this_actor", lambda: None)
    return recording_broker(monkeypatch)


def _ring() -> BucketRing:
    return BucketRing([torch.zeros(SLOT_HEADER + BUCKET, dtype=torch.uint8) for _ in range(2)], ())


def _send(ring: BucketRing, stream: tuple[BucketStream, Outgoing], done: VersionDone) -> None:
    payload, outgoing = stream
    stamps = itertools.count(1)
    ring.stream_out(payload, outgoing, done, lambda dst, src: dst.copy_(src), stamps.__next__)


def test_a_slot_an_older_version_holds_is_free_once_that_broadcast_ends(broker):
    """The older version's stream is unknown to the broker (it restarted since): asking
    it for room waited twice the timeout, and then failed the new version for every
    receiver, though the older broadcast ended (its readers done) meanwhile."""
    ring = _ring()
    older, newer = stream_of(broker, "v1", 2), stream_of(broker, "v2", 1)
    _send(ring, older, EndsAfter(after=3))  # both slots: the first two need no room
    _send(ring, newer, EndsAfter(after=50))
    assert [call[:3] for call in broker.calls if call[0] != "room"] == [
        ("offer", older[0].key, 0),
        ("offer", older[0].key, 1),
        ("offer", newer[0].key, 0),
    ]


def test_a_learner_interrupted_waiting_for_room_ends_its_stream_saying_why(broker, monkeypatch):
    """Ctrl-C (or a cancelled learner task) while it waits for its readers to make
    room: they were left waiting the stream's whole timeout for a bucket that never
    came."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ring_module, "wait_for_room", interrupted)
    ring = _ring()
    stream = stream_of(broker, "v1", 3)
    with pytest.raises(KeyboardInterrupt):
        _send(ring, stream, EndsAfter(after=None))
    assert broker.calls[-1] == (
        "end",
        stream[0].key,
        f"the learner failed waiting for room for bucket 2: {KeyboardInterrupt()!r}",
    )
