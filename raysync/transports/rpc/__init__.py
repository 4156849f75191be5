"""torch.distributed.rpc as the data path: the agent pushes each version with ``rpc_async``.

Processes and roles:

* **learner process** — the object store's sender (``hand_off``) puts the version's
  tensors into the object store, exactly like the ``object_store`` transport; it never
  joins the RPC group.
* **hub process** — :class:`RpcPlanner` starts one :class:`raysync.actors.rpc_agent.RpcAgentActor`
  per hub. When a receiver registers, the agent admits it (a rank and RPC name of its
  own, never given to another actor) and the receiver gets the rendezvous URL in its
  Welcome. Per delivery the planner numbers the version and hands the agent one job; it
  waits for nothing, so a slow receiver never delays the others.
* **RPC agent** (rank 0, the sender) — reads the learner's object-store copy (zero-copy
  on its node) and calls ``rpc_async(receiver, land, (hub key, seq, tensors))`` once
  per target; TensorPipe moves the tensors (same-host shared-memory/CMA channels, TCP
  across nodes). Each RPC future completes when the tensors are in the receiver's
  memory; its failures are kept for ``describe``, and a receiver the version will not
  reach (the learner's copy could not be read, or its RPC failed) is told why at once
  (``abandon_whole``, a call not waited for).
* **receiver process** — joins the group in ``open_receiver`` (``init_rpc`` with
  dynamic membership, ``world_size=None``). ``land`` runs on the receiver's RPC thread
  pool, independent of what the actor is doing, and parks the tensors in a per-process
  inbox; ``fetch`` (inside the delivery call) waits for its version there, with a
  timeout, and returns views of the landed tensors. So the receiver's ack resolves
  once the RPC has landed *and* the copy is applied; a version the agent gave up, or
  an RPC that never lands, raises :class:`TransportError` from ``fetch``: with the
  agent's reason as soon as it is told, else at the timeout.

Membership is repaired, not rebuilt: TensorPipe's dynamic membership lets receivers join
a running group; a dead receiver's RPCs fail alone (nobody else waits for it), and the
agent takes it off torch's member list (see :mod:`raysync.actors.rpc_agent`), because every
joiner calls every listed member and would otherwise fail. RPC state is per process and,
in practice, once per process (a second ``init_rpc`` in the same process gets another
store prefix and ``dist_autograd`` refuses a new rank): a receiver process joins the
group of the first RPC hub it registers with and keeps its rank in that hub's groups
until it exits; another RPC hub is refused. An actor that Ray restarts is a new
process: it is admitted under a new rank and name, and its old name is taken off the
member list. Pull mode reads the learner's object-store copy directly.

A dead agent is replaced, not restarted: before every plan the planner pings it, and a
dead one is succeeded by a new agent (new store, new key) that re-admits every member
under its old rank. Each payload names the receiver's place in the current group, so a
receiver still in the dead group leaves it (``rpc.shutdown``) and joins the new one
inside that delivery's ``fetch``, keeping its rank (torch's distributed autograd
holds a process to its first rank). A version in flight when the agent dies never
lands: its receivers fail with :class:`TransportError` at the timeout; the next one
goes through the new group. A restarted hub does the same: the planner keeps every
member's (process, rank) in Ray's GCS beside the hub's restart snapshot, its new agent
reserves those ranks, and receivers move to the new group when they register again.

Memory: every version pushed to a receiver waits in its inbox until its delivery takes
it, so a receiver kept busy for many broadcasts holds each of them meanwhile.

A version larger than ``bucket_mb`` leaves the learner as the object store's bucket
stream (at most two buckets in the object store). The agent relays it
(:mod:`raysync.transports.bucket_relay`): it takes bucket ``k`` from the hub's bucket
broker, calls ``land_bucket`` on every receiver still in the version, waits for those
calls, then takes ``k + 1``. ``land_bucket`` copies the pieces into the receiver's
staging buffer on its RPC threads (a busy actor never holds the stream up); ``fetch``
waits until every bucket landed, so the model changes at one safe point and a version
whose later bucket fails never reaches it. A receiver whose call fails, or is not made
and done within half the timeout, or half the broadcast's stall if shorter (half its
``timeout_s``: the bucket broker drops a reader that long behind; its process stopped, or
it never became reachable),
gets no further bucket and fails alone, told at once with the agent's reason (a call
not waited for): the others wait for each bucket no longer than the timeout. A stream
that ends early is abandoned on every receiver at once, with the reason. A receiver
that pulls a bucketed version later (joining, restarted) reads it from the broker,
served by a receiver that got it.

Settings: ``WeightHub.remote(options=RpcOptions(timeout_s=...))``
(:class:`~raysync.transports.options.RpcOptions`: the timeout of the rendezvous, of
every RPC and of the wait in ``fetch``, default 30 s).

Addresses: the rendezvous ``TCPStore`` listens on a socket the agent binds to its node's
IP on a free port (never ``0.0.0.0``), under a random key prefix, for the hub's
lifetime. TensorPipe listens on the interface that carries the node's IP
(``TP_SOCKET_IFNAME``, set here unless the user set it). Neither authenticates its
peers: run on a trusted cluster network.
"""

from __future__ import annotations

from raysync.transports.base import (
    Availability,
    HubContext,
    MemoryFootprint,
    Transport,
    TransportSender,
)
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.options import RpcOptions
from raysync.transports.rpc.planner import RpcPlanner
from raysync.transports.rpc.receiver import (
    RpcReceiver,
    abandon_bucketed,
    abandon_whole,
    answer_ping,
    land,
    land_bucket,
)
from raysync.transports.rpc.rendezvous import (
    JOIN_TOKEN_KEY,
    MEMBER_LIST_KEY,
    SCHEME,
    init_rpc,
    interface_of,
    open_master_store,
)
from raysync.transports.rpc.wire import (
    LEFT_KEPT,
    RpcJob,
    RpcMember,
    RpcPayload,
    agent_name,
    rpc_name,
)

__all__ = [
    "JOIN_TOKEN_KEY",
    "LEFT_KEPT",
    "MEMBER_LIST_KEY",
    "SCHEME",
    "RpcJob",
    "RpcMember",
    "RpcPayload",
    "RpcPlanner",
    "RpcReceiver",
    "RpcTransport",
    "abandon_bucketed",
    "abandon_whole",
    "agent_name",
    "answer_ping",
    "init_rpc",
    "interface_of",
    "land",
    "land_bucket",
    "open_master_store",
    "rpc_name",
]


class RpcTransport(Transport):
    name = "rpc"
    #: The learner's put (two alive); the landed tensors in each receiver's inbox.
    #: Bucketed: two buckets in the object store, one staged version per receiver.
    memory = MemoryFootprint(learner=2, per_receiver=1)
    hand_off = "object_store"  #: the learner puts once; the hub's side reads that copy
    #: Sharded learners: its resource actor reads every part's put and sends the version
    #: whole (one collective / one call per receiver), so members enter it once.
    parts_in_one_plan = True
    buckets = True
    options = RpcOptions

    @classmethod
    def availability(cls) -> Availability:
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed")
        import torch.distributed.rpc as rpc

        if not rpc.is_available():
            return Availability(False, "this torch build has no torch.distributed.rpc")
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> RpcPlanner:
        return RpcPlanner(hub)

    @classmethod
    def open_sender(cls, hub: HubContext) -> TransportSender:
        return ObjectStoreTransport.open_sender(hub)  # its hand-off's: never called as its own

    @classmethod
    def open_receiver(cls, info: RpcMember) -> RpcReceiver:
        return RpcReceiver(info)
