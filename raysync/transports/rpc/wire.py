"""All processes: what the hub, the agent and receivers exchange (members, jobs, payloads)."""

from __future__ import annotations

from dataclasses import dataclass

from raysync.spec import WeightSpec
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.wire import ObjectStorePayload
from raysync.transports.options import RpcOptions
from raysync.transports.parts import Parts

#: Places of processes that left the hub, kept for their return (the oldest forgotten):
#: torch RPC keeps a process's rank for life, so one that attaches again needs its own.
#: One forgotten is admitted as a new process, and its receiver refuses that rank saying
#: why (its torch RPC lives on under the old one).
LEFT_KEPT = 4096


@dataclass(frozen=True)
class RpcMember:
    """Hub -> receiver (its transport info): how to join the hub's RPC group."""

    url: str  #: ``raysync-rpc://<node ip>:<port>/<random prefix>``
    key: str  #: the group's key in receivers' inboxes (new with every agent)
    hub: str  #: the hub's actor id: a group of the same hub may replace this one
    name: str  #: this receiver's RPC name
    rank: int
    settings: RpcOptions
    worker: str  #: the receiver's worker id (how it reads a served bucket stream)
    #: The group's number among the hub's (each new agent's is higher, across hub
    #: restarts too): a process never goes back to an older group it skipped
    generation: int = 0


@dataclass(frozen=True)
class RpcJob:
    """Hub -> agent: send version ``version`` of ``model`` as ``seq`` to ``workers``."""

    seq: int
    model: str
    version: int
    workers: tuple[str, ...]
    #: the learner's put, or its bucket stream (one per part if sent in parts)
    source: ObjectStorePayload | BucketStream | Parts
    spec: WeightSpec  #: what travels (the wire's): a bucket's place in the receivers' buffer


@dataclass(frozen=True)
class RpcPayload:
    """Hub -> receiver: the version lands in your inbox under (``key``, ``seq``), sent
    by the group ``member`` belongs to (a new one after the hub replaced a dead agent)."""

    key: str
    seq: int
    timeout_s: float
    member: RpcMember
    #: how many buckets the version lands in (one call each), 0 if it lands whole
    buckets: int = 0


def agent_name(hub_id: str) -> str:
    """The Ray name of the RPC agent actor of hub ``hub_id``."""
    return f"raysync-rpc-agent-{hub_id}"


def rpc_name(key: str, rank: int) -> str:
    return f"raysync_{key[:12]}_{rank}"
