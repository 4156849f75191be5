"""What names a bucketed version and its broker, in every process that meets one: the
learner and receivers (:mod:`raysync.transports.object_store.buckets`), the hub, which
plans the version and may start the broker, and the broker itself
(``raysync.actors.bucket_broker``). No torch here: the broker's process never imports
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from raysync.actor_classes import BUCKET_BROKER, actor_class
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext
from raysync.transports.parts import Parts

#: Buckets of one version the object store holds at most: the one receivers copy, and
#: the one the learner packs meanwhile.
BUCKETS_IN_FLIGHT = 2


#: The namespace of the brokers (detached actors are named in a namespace of their own
#: rather than the learner's job's, which is anonymous unless the job names one).
BROKER_NAMESPACE = "raysync"


def broker_name(hub_id: str) -> str:
    """The name of a hub's bucket broker (every learner of the hub finds the same)."""
    return f"raysync-buckets-{hub_id}"


@dataclass(frozen=True)
class SenderActor:
    """The actor process that puts a stream (the learner, or a receiver serving a late
    joiner): the broker watches it while any stream of it runs. Ids, not an actor
    handle: Ray imports an actor's class to unpickle a handle of it, and so the
    sender's own modules and torch in the broker (its event loop stood still 1.7-2.5 s
    at the first bucketed version of a learner actor)."""

    actor_id: str  #: hex
    #: The process of the incarnation that puts it (hex): one Ray restarts runs in another.
    worker_id: str


@dataclass(frozen=True)
class StreamId:
    """One bucketed version at the broker: what every call about it carries (any may be
    the first the broker hears of it)."""

    id: str
    count: int  #: how many buckets
    #: How long a receiver waits for the next bucket; the broker ends a stream that is
    #: not planned within twice it, or not read to the end within it of its last bucket
    #: and its plan (whichever came later).
    wait_s: float
    #: A version a receiver serves to one late joiner (no broadcast ends it): the broker
    #: drops a reader that has not begun it within ``wait_s`` of its plan.
    served: bool = False
    #: The learner actor that made it (None: a driver, or a served version, whose offers
    #: name their sender): the broker watches it from the first call about the stream
    #: on, the hub's plan included, so that a learner that dies before its first bucket
    #: ends its stream too.
    sender: SenderActor | None = None

    @property
    def stall_s(self) -> float:
        """How long the others wait for a reader that holds them up before it is
        dropped: half of ``wait_s``, so that it is dropped before they time out."""
        return self.wait_s / 2


@dataclass(frozen=True)
class RingBucket:
    """What a ring's learner (``nixl``) offers the broker for bucket ``k`` of a stream,
    in place of an object-store ref: the slot of its ring that holds the bucket, and
    the stamp that slot holds meanwhile. Here, not beside the ring: the broker
    unpickles it, and importing the ``nixl`` transport would import torch there (its
    event loop stood still ~2 s at a hub's first NIXL bucketed version)."""

    slot: int
    stamp: int


@dataclass(frozen=True)
class BucketStream:
    """The payload of a bucketed version: where its buckets are handed out."""

    broker: Any  #: the hub's BucketBroker (an ActorHandle)
    key: StreamId
    bucket_bytes: int


#: Calls the broker runs at once. Each reader keeps up to two ``take``s waiting there (it
#: asks for the next bucket while it copies one), and the learner's ``offer`` and
#: ``room`` queue behind them once every slot is taken: at Ray's default (1000) a stream
#: to ~500 readers stalled until its takes timed out. Waiting coroutines cost the actor
#: memory only.
BROKER_CALLS_AT_ONCE = 20_000


def open_broker(hub: HubContext) -> Any:
    """The hub's bucket broker: started by a hub that has a ``bucket_mb`` as it starts,
    else by the first learner that needs it (detached from that learner: it lives as
    long as the hub). Either finds the one running."""
    broker_class = ray.remote(actor_class(BUCKET_BROKER))
    return broker_class.options(
        name=broker_name(hub.hub_id),
        namespace=BROKER_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=BROKER_CALLS_AT_ONCE,
    ).remote(hub.actor)


def parts_of(source: object) -> list[tuple[Any, WeightSpec | None]]:
    """The learner payloads of a version with each part's spec (None: the whole's)."""
    if isinstance(source, Parts):
        return [(part.payload, part.spec) for part in source.parts]
    return [(source, None)]


def is_bucketed(source: object) -> bool:
    """Whether a version (or some part of it) travels in buckets."""
    return any(isinstance(payload, BucketStream) for payload, _ in parts_of(source))


def streams_of(source: object) -> list[BucketStream]:
    """The bucket streams of a version (one per bucketed part if sent in parts)."""
    return [payload for payload, _ in parts_of(source) if isinstance(payload, BucketStream)]
