"""The ``rdt`` and ``nixl`` receivers declining a payload they never read
(raysync/transports/rdt/receiver.py, raysync/transports/nixl/receiver.py), as a pull
whose answer came after it stopped waiting declines it (raysync/receiver_core.py
``_decline_when_answered``).

Both plan bucketed versions as the object store does: while nobody who read a version
whole can serve it, the hub answers a pull with the version's own stream, the one its
broadcast may be delivering to this very receiver. Declining that answer gave up the
receiver's place in the stream (the base ``decline``, ``release(payload, None)``, calls
the broker's ``leave``), and the broadcast's read then failed. It is left alone now; a
stream served for the declined read alone is still given up, and a whole version is let
go of as before (no buffer another delivery of it leased is freed).

The receivers are made without their agents (Ray's NIXL agent, a NIXL agent): letting go
of a payload uses none, only the broker, the object store's receiver of served streams
and the staging pools, which are real here (CPU buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportReceiver
from raysync.transports.nixl.receiver import NixlReceiver
from raysync.transports.nixl.wire import NixlBucketStream, NixlPayload
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.rdt.receiver import RdtReceiver
from raysync.transports.rdt.wire import RdtBucketStream, RdtPayload
from raysync.transports.staging import StagingPool

WORKER = "w"
SPEC = WeightSpec.of({"w": torch.zeros(16)})
BUCKET_BYTES = 32  #: SPEC's 64 bytes in two buckets
OWN = StreamId("the version's own stream", 2, 120.0)
SERVED = StreamId("served for this read alone", 2, 120.0, served=True)


class _Broker:
    """The hub's bucket broker, as a receiver calls its actor: every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(name, self.calls)


@dataclass
class _Method:
    name: str
    calls: list[tuple[Any, ...]]

    def remote(self, *args: Any) -> None:
        self.calls.append((self.name, *args))


def _staging_pool() -> StagingPool[torch.Tensor]:
    return StagingPool(lambda spec: torch.zeros(spec.nbytes, dtype=torch.uint8))


def _rdt_receiver() -> RdtReceiver:
    """An RDT receiver of worker ``WORKER`` as ``__init__`` makes it, but for Ray's NIXL
    agent and registered buffers."""
    receiver = object.__new__(RdtReceiver)
    receiver._worker = WORKER
    receiver._pool = _staging_pool()
    receiver._served = ObjectStoreReceiver(WORKER)
    return receiver


def _nixl_receiver() -> NixlReceiver:
    """A NIXL receiver of worker ``WORKER`` as ``__init__`` makes it, but for its NIXL
    agent and registered buffers."""
    receiver = object.__new__(NixlReceiver)
    receiver._worker = WORKER
    receiver._pool = _staging_pool()
    receiver._ring_pool = _staging_pool()
    receiver._served = ObjectStoreReceiver(WORKER)
    return receiver


@dataclass(frozen=True)
class _Transport:
    """One transport's receiver and the payloads its hub hands a receiver."""

    name: str
    receiver: Callable[[], TransportReceiver]
    #: The transport's own stream of a version, with this key through this broker.
    stream: Callable[[_Broker, StreamId], BucketStream]
    whole: Any  #: a whole version (never read: its fields do not matter)


RDT = _Transport(
    "rdt",
    _rdt_receiver,
    lambda broker, key: RdtBucketStream(broker, key, BUCKET_BYTES),
    RdtPayload(ref=None),
)
NIXL = _Transport(
    "nixl",
    _nixl_receiver,
    lambda broker, key: NixlBucketStream(
        broker, key, BUCKET_BYTES, agent="learner", metadata=b"", registration=1, ring=()
    ),
    NixlPayload(agent="learner", metadata=b"", registration=1, region=None, stamp=7),
)
TRANSPORTS = pytest.mark.parametrize("transport", [RDT, NIXL], ids=lambda t: t.name)


def _served_through_the_object_store(broker: _Broker, key: StreamId) -> BucketStream:
    """A stream another receiver serves (what the planner makes for one read)."""
    return BucketStream(broker, key, BUCKET_BYTES)


def _whole(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
    return [buffer]


@TRANSPORTS
def test_declining_the_versions_own_stream_leaves_this_receivers_place_in_it(transport):
    """The hub answered a pull late with the version's own stream, which its broadcast
    may be delivering to this receiver: declined, the broker hears nothing (its
    ``leave`` dropped this receiver from the stream, and the broadcast's read failed
    with "this receiver was dropped from the stream")."""
    broker = _Broker()
    transport.receiver().decline(transport.stream(broker, OWN))
    assert broker.calls == []


@TRANSPORTS
@pytest.mark.parametrize(
    "served_as",
    ["object_store", "own"],
    ids=["served through the object store", "the transport's stream"],
)
def test_declining_a_stream_served_for_this_read_alone_gives_it_up(transport, served_as):
    """A stream served for the declined read alone is given up at once: the broker (and
    the receiver serving it) stop waiting for this receiver."""
    broker = _Broker()
    make = _served_through_the_object_store if served_as == "object_store" else transport.stream
    transport.receiver().decline(make(broker, SERVED))
    assert broker.calls == [("leave", SERVED, WORKER)]


@TRANSPORTS
def test_declining_a_whole_version_frees_no_buffer_another_delivery_leased(transport):
    """A whole version declined unread is let go of as before: no broker call, and the
    staging buffer another delivery of it filled (a model may live there) stays leased
    until that delivery releases it."""
    receiver = transport.receiver()
    leased = receiver._pool.fill(SPEC, _whole)
    receiver.decline(transport.whole)
    assert receiver._pool.fill(SPEC, _whole)[0] is not leased[0]
    receiver.release(transport.whole, leased)
    assert receiver._pool.fill(SPEC, _whole)[0] is leased[0]
