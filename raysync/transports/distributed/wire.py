"""All processes: what the hub, rank 0 and receivers exchange (generations, jobs, header)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysync.layout import HEADER_BYTES, PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.bucket_relay import relay_plan, relay_reader
from raysync.transports.object_store.bucket_stream import BucketStream, is_bucketed
from raysync.transports.object_store.wire import ObjectStorePayload
from raysync.transports.options import DistributedOptions
from raysync.transports.parts import Parts

#: The first word of the header (``HEADER_BYTES``, int64 words) in front of every
#: broadcast buffer, checked by receivers: "raysyncd".
MAGIC = 0x7261_7973_796E_6364


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous store of a hub's process group listens, and which incarnation
    of rank 0's actor made it: one that Ray restarted may bind the same port again, and
    its store holds none of the old generation's keys."""

    host: str
    port: int
    incarnation: str = ""


@dataclass(frozen=True)
class Generation:
    """One incarnation of the process group: fixed members, ranks and store prefix."""

    number: int
    members: tuple[str, ...]  #: worker ids; member i has rank i + 1, the source rank 0
    prefix: str
    store: StoreAddress
    settings: DistributedOptions
    #: How long its ranks, once every one arrived at its rendezvous, wait for the group
    #: to form (gloo's connections, then a barrier); None: the group's timeout. The
    #: planner sets a share of what is left of the broadcast's time: a member that died
    #: after it arrived there (the hub cannot call the rendezvous off any more) held
    #: every other rank in gloo's own wait for the group's timeout, longer than the
    #: broadcast's (see :func:`~raysync.transports.distributed.group.join_group`).
    form_s: float | None = None

    @property
    def world_size(self) -> int:
        return len(self.members) + 1

    def rank_of(self, worker: str) -> int:
        return self.members.index(worker) + 1


@dataclass(frozen=True)
class BroadcastJob:
    """Hub -> rank 0: broadcast ``source`` as collective ``seq`` of ``generation``."""

    generation: Generation
    seq: int
    model: str
    version: int
    spec: WeightSpec
    #: the learner's put, or its bucket stream (one per part if sent in parts)
    source: ObjectStorePayload | BucketStream | Parts


@dataclass(frozen=True)
class MemberInfo:
    """Hub -> receiver (its transport info): its worker id (how it names itself to the
    bucket broker), and the number of the last generation formed before it registered:
    it takes no part in those (a version planned in one before the hub heard of this
    registration was planned for the receiver it replaced)."""

    worker: str
    formed_before: int = 0


@dataclass(frozen=True)
class GroupPayload:
    """Hub -> receiver: enter collective ``seq`` of ``generation`` as ``rank``; if the
    collective fails (a member died or never entered it), read ``source``, the
    learner's object-store copy, instead."""

    generation: Generation
    rank: int
    seq: int
    #: the learner's put, or its bucket stream (one per part if sent in parts)
    source: ObjectStorePayload | BucketStream | Parts
    #: the bytes of each collective's buffer (:func:`collective_bytes`): a member that
    #: will not read the version still enters its collectives, with a buffer this size
    buffer_bytes: int
    #: how many collectives (one per bucket) carry the version, 0 if one carries it whole
    buckets: int = 0

    @property
    def worker(self) -> str:
        return self.generation.members[self.rank - 1]


def collective_bytes(source: object, spec: WeightSpec) -> int:
    """The bytes of the buffer each collective carrying a version from ``source`` (the
    learner's put or bucket streams) moves, header included: the whole version packed,
    or its largest bucket. ``spec``: the version as it travels (the wire dtype's)."""
    if not is_bucketed(source):
        return PackedLayout.of(spec, HEADER_BYTES).nbytes
    return HEADER_BYTES + max(bucket.nbytes for bucket in relay_plan(source, spec))


def rank0_reader(hub_id: str) -> str:
    """How rank 0 of hub ``hub_id`` names itself to the hub's bucket broker."""
    return relay_reader(f"rank0-{hub_id}")


def process_group_name(hub_id: str) -> str:
    """The Ray name of the process-group actor (rank 0) of hub ``hub_id``."""
    return f"raysync-process-group-{hub_id}"


def header(generation: int, seq: int, nbytes: int, bucket: int = 0) -> torch.Tensor:
    """The words in front of a collective's buffer: magic, generation, collective,
    buffer bytes, and for a bucketed version the bucket's number from 1."""
    words = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
    words[:5] = torch.tensor([MAGIC, generation, seq, nbytes, bucket])
    return words.view(torch.uint8)
