"""All processes: slots, payloads, the owners' names and the segment header's format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Namespace of the owner actors (named per hub and node, looked up by the learner).
OWNER_NAMESPACE = "raysync"
#: Most slots an owner keeps per segment size; a learner waits once all are held.
MAX_SLOTS = 4
#: How long the learner (or a relaying owner) waits for a slot to be released.
SLOT_WAIT_S = 60.0
#: How long the learner waits for its node's owner to be (re)started by the hub.
OWNER_WAIT_S = 30.0
#: How long an owner waits for the hub's earlier holds when a later one comes first.
ORDER_WAIT_S = 1.0
#: Threads of an owner (a threaded actor: cheaper per call than an event loop, which
#: counts at one release per receiver per version). Calls that wait take one each: a
#: learner's ``acquire``, a hold waiting for its turn, a relay, the planner's watch.
OWNER_THREADS = 32

#: Header: [0:16] segment token, [16:24] sequence number of the version in the slot
#: (0 while it is being written), little-endian int64.
TOKEN_BYTES = 16
_SEQ = slice(16, 24)


def owner_name(hub_id: str, node_id: str) -> str:
    """Name of the owner actor of ``hub_id`` on ``node_id`` (in :data:`OWNER_NAMESPACE`)."""
    return f"raysync-shm-{hub_id}-{node_id}"


@dataclass(frozen=True)
class Slot:
    """Where one version lies: a segment of an owner on a node, and which version."""

    node_id: str
    pid: int  #: the owner's process
    fd: int  #: the segment's descriptor in the owner's process
    token: bytes  #: random, also in the segment's header
    nbytes: int
    seq: int  #: owner-wide sequence number of the version written into it


@dataclass(frozen=True)
class SharedMemoryPayload:
    """A version in a slot (plain data: no actor handle to pass per update)."""

    slot: Slot


@dataclass(frozen=True)
class SharedMemoryReceiverInfo:
    worker: str  #: the receiver's worker id, named in its holds
    owner: str  #: name of the owner on the receiver's node, to release slots to


def write_seq(buffer: torch.Tensor, seq: int) -> None:
    buffer[_SEQ].view(torch.int64)[0] = seq


def read_seq(buffer: torch.Tensor) -> int:
    return int(buffer[_SEQ].view(torch.int64)[0])
