"""All processes: what the hub, rank 0 and receivers exchange (generations, jobs, header)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysync.layout import HEADER_BYTES
from raysync.spec import WeightSpec
from raysync.transports.object_store import ObjectStorePayload
from raysync.transports.options import DistributedOptions
from raysync.transports.parts import Parts

#: The first word of the header (``HEADER_BYTES``, int64 words) in front of every
#: broadcast buffer, checked by receivers: "raysyncd".
MAGIC = 0x7261_7973_796E_6364


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous store of a hub's process group listens."""

    host: str
    port: int


@dataclass(frozen=True)
class Generation:
    """One incarnation of the process group: fixed members, ranks and store prefix."""

    number: int
    members: tuple[str, ...]  #: worker ids; member i has rank i + 1, the source rank 0
    prefix: str
    store: StoreAddress
    settings: DistributedOptions

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
    source: ObjectStorePayload | Parts  #: the learner's put (one per part if sent in parts)


@dataclass(frozen=True)
class GroupPayload:
    """Hub -> receiver: enter collective ``seq`` of ``generation`` as ``rank``; if the
    collective fails (a member died or never entered it), read ``source``, the
    learner's object-store copy, instead."""

    generation: Generation
    rank: int
    seq: int
    source: ObjectStorePayload | Parts  #: the learner's put (one per part if sent in parts)


def process_group_name(hub_id: str) -> str:
    """The Ray name of the process-group actor (rank 0) of hub ``hub_id``."""
    return f"raysync-process-group-{hub_id}"


def header(generation: int, seq: int, nbytes: int) -> torch.Tensor:
    words = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
    words[:4] = torch.tensor([MAGIC, generation, seq, nbytes])
    return words.view(torch.uint8)
