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
  memory; its failures are kept for ``describe``.
* **receiver process** — joins the group in ``open_receiver`` (``init_rpc`` with
  dynamic membership, ``world_size=None``). ``land`` runs on the receiver's RPC thread
  pool, independent of what the actor is doing, and parks the tensors in a per-process
  inbox; ``fetch`` (inside the delivery call) waits for its version there, with a
  timeout, and returns views of the landed tensors. So the receiver's ack resolves
  once the RPC has landed *and* the copy is applied; an RPC that never lands raises
  :class:`TransportError` from ``fetch`` at the timeout.

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

import asyncio
import datetime
import fcntl
import logging
import os
import pickle
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import ray
import torch
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysync.actor_classes import RPC_AGENT, actor_class
from raysync.hub_snapshot import KV_NAMESPACE
from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    HubContext,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
)
from raysync.transports.object_store import (
    ObjectStorePayload,
    ObjectStoreReceiver,
    ObjectStoreSender,
)
from raysync.transports.options import RpcOptions
from raysync.transports.process_groups import bound_master_store, node_ip

SCHEME = "raysync-rpc"
#: When a receiver takes version #n from its inbox, versions older than #(n - this) that
#: landed but were never taken (superseded: their delivery skipped them) are dropped.
#: Deliveries of a threaded receiver may run out of order, hence a window, not "< n".
_INBOX_WINDOW = 4

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RpcMember:
    """Hub -> receiver (its transport info): how to join the hub's RPC group."""

    url: str  #: ``raysync-rpc://<node ip>:<port>/<random prefix>``
    key: str  #: the group's key in receivers' inboxes (new with every agent)
    hub: str  #: the hub's actor id: a group of the same hub may replace this one
    name: str  #: this receiver's RPC name
    rank: int
    settings: RpcOptions


@dataclass(frozen=True)
class RpcJob:
    """Hub -> agent: send version ``version`` of ``model`` as ``seq`` to ``workers``."""

    seq: int
    model: str
    version: int
    workers: tuple[str, ...]
    source: ObjectStorePayload


@dataclass(frozen=True)
class RpcPayload:
    """Hub -> receiver: the version lands in your inbox under (``key``, ``seq``), sent
    by the group ``member`` belongs to (a new one after the hub replaced a dead agent)."""

    key: str
    seq: int
    timeout_s: float
    member: RpcMember


def agent_name(hub_id: str) -> str:
    """The Ray name of the RPC agent actor of hub ``hub_id``."""
    return f"raysync-rpc-agent-{hub_id}"


def rpc_name(key: str, rank: int) -> str:
    return f"raysync_{key[:12]}_{rank}"


# -- rendezvous -------------------------------------------------------------------------
#: Master stores made by agents in this process, by URL (the handler hands them out).
_MASTER_STORES: dict[str, Any] = {}


def open_master_store(host: str, timeout_s: float) -> tuple[str, Any]:
    """A TCPStore master bound to ``host`` on a free port; returns (url, store)."""
    port, store = bound_master_store(host, timeout_s)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    base = f"{SCHEME}://{netloc}/{uuid.uuid4().hex}"
    _MASTER_STORES[base] = store
    return f"{base}?timeout_s={timeout_s:g}", store


def _rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous handler for ``raysync-rpc://`` URLs (see ``init_rpc``)."""
    import torch.distributed as dist

    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    rank = int(query["rank"][0])
    world_size = int(query.get("world_size", ["-1"])[0])
    base = parsed._replace(query="").geturl()
    store = _MASTER_STORES.get(base)
    if store is None:
        timeout_s = float(query.get("timeout_s", [RpcOptions().timeout_s])[0])
        store = dist.TCPStore(
            parsed.hostname,
            parsed.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    yield dist.PrefixStore(parsed.path.strip("/") + "/", store), rank, world_size


def _register_rendezvous() -> None:
    from torch.distributed.rendezvous import register_rendezvous_handler

    register_rendezvous_handler(SCHEME, _rendezvous)


def interface_of(ip: str) -> str | None:
    """The name of the network interface that carries IPv4 address ``ip`` (Linux)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    finally:
        probe.close()
    return None


def init_rpc(name: str, rank: int, url: str, settings: RpcOptions) -> None:
    """Join the RPC group at ``url`` as ``name`` (dynamic membership); raises on timeout."""
    import torch.distributed.rpc as rpc

    host = node_ip()
    interface = interface_of(host)
    if interface is not None:
        os.environ.setdefault("TP_SOCKET_IFNAME", interface)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=url,
        rpc_timeout=settings.timeout_s,
        num_worker_threads=8,
        # TCP only for TensorPipe's control messages: its shared-memory transport polls
        # in a loop, 8-20% of a core in every idle receiver and agent (the tensors still
        # go by its channels: cross-memory attach on a node).
        _transports=["uv"],
    )
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)


# -- receiver inbox ---------------------------------------------------------------------
class _Inbox:
    """Per process: versions that landed by RPC, until ``fetch`` takes them.

    Every pushed version is kept until its delivery takes it (or a version more than
    ``_INBOX_WINDOW`` newer is taken): a receiver kept busy for many broadcasts holds
    each of them here, as it would hold their object-store references otherwise.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._landed: dict[str, dict[int, list[torch.Tensor]]] = {}

    def put(self, key: str, seq: int, tensors: list[torch.Tensor]) -> None:
        with self._cond:
            self._landed.setdefault(key, {})[seq] = tensors
            self._cond.notify_all()

    def take(self, key: str, seq: int, timeout_s: float) -> list[torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            versions = self._landed.setdefault(key, {})
            while seq not in versions:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"version #{seq} of RPC hub {key[:12]} did not land within "
                        f"{timeout_s:g} s; the RPC agent may have died or could not reach "
                        "this receiver"
                    )
                self._cond.wait(remaining)
            for stale in [s for s in versions if s < seq - _INBOX_WINDOW]:
                del versions[stale]
            return versions.pop(seq)


_INBOX = _Inbox()


def answer_ping() -> bool:
    """The agent's liveness probe of a listed member (runs on its RPC thread pool)."""
    return True


def land(key: str, seq: int, tensors: list[torch.Tensor]) -> int:
    """Runs on the receiver's RPC thread pool when the agent's ``rpc_async`` arrives."""
    _INBOX.put(key, seq, tensors)
    return seq


class _Membership:
    """This process's place in one RPC group.

    torch RPC is per process and, in practice, once per process: a second ``init_rpc``
    gets a different store prefix and ``dist_autograd`` refuses a new rank. So a
    receiver process joins the first RPC hub it registers with and stays in its group
    until it exits; registering again with the same hub reuses the membership, another
    RPC hub is refused.
    """

    lock = threading.Lock()
    member: RpcMember | None = None

    @classmethod
    def join(cls, member: RpcMember) -> RpcMember:
        """Join ``member``'s group, or stay in it; moves from an earlier group of the same
        hub (its agent was replaced, or the hub restarted); refuses another hub's."""
        with cls.lock:
            if cls.member is None:
                init_rpc(member.name, member.rank, member.url, member.settings)
                cls.member = member
            elif cls.member.hub != member.hub:
                raise TransportError(
                    f"this process already belongs to the RPC group of another hub "
                    f"({cls.member.url}); torch RPC allows one group per process"
                )
            elif cls.member.key != member.key:
                cls._move(member)
            elif cls.member.name != member.name:
                raise TransportError(
                    f"this process is {cls.member.name} in the hub's RPC group, the hub "
                    f"admitted it as {member.name}"
                )
            return cls.member

    @classmethod
    def follow(cls, member: RpcMember) -> None:
        """Called with every delivery's member: move if the hub's group changed."""
        with cls.lock:
            if cls.member is not None and cls.member.key != member.key:
                cls._move(member)

    @classmethod
    def _move(cls, member: RpcMember) -> None:
        """Leave the (dead) group and join ``member``'s under the same rank: torch's
        distributed autograd, initialised by ``init_rpc``, keeps a process's first rank
        for life. Holds ``lock``."""
        import torch.distributed.rpc as rpc

        if cls.member is None:
            raise TransportError("this process is in no RPC group to move from")
        if cls.member.rank != member.rank:
            raise TransportError(
                f"the hub moved this process from rank {cls.member.rank} to rank "
                f"{member.rank} of its new RPC group; torch RPC keeps a process's rank"
            )
        rpc.shutdown(graceful=False)
        cls.member = None
        # init_rpc prefixes its store keys with a per-process count of init_rpc calls;
        # the new agent's process counts its first, so this one must too.
        with rpc._init_counter_lock:
            rpc._init_counter = 0
        init_rpc(member.name, member.rank, member.url, member.settings)
        cls.member = member


# -- hub --------------------------------------------------------------------------------
class RpcPlanner(TransportPlanner):
    """Runs in the hub process: admits receivers to the agent's group, numbers versions,
    and replaces the agent when it dies (its members follow it under the same ranks)."""

    def __init__(self, hub: HubContext) -> None:
        self._settings = hub.options or RpcOptions()
        self._hub = hub.hub_id
        self._name = agent_name(hub.hub_id)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._members: dict[str, RpcMember] = {}  #: worker -> its place in the group
        #: worker -> (its process, its rank), kept in GCS so a restarted hub has it too.
        self._ranks = _RankBook(self._hub)
        self._key, self._actor = self._start_agent()
        self._seq = 0
        self._lock = asyncio.Lock()  #: agent replacement and plans, one at a time

    def _start_agent(self) -> tuple[str, Any]:
        """A new agent (new key, new group) that re-admits every known member at its rank."""
        key = uuid.uuid4().hex
        known = self._ranks.load()
        actor = (
            ray.remote(actor_class(RPC_AGENT))
            .options(
                num_cpus=0,
                name=self._name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=True),
            )
            .remote(key, self._hub, self._settings, known)
        )
        return key, actor

    async def _live_agent(self) -> Any:
        """The agent, after checking it answers; a dead one is replaced (and its members
        re-admitted to the new group, which they join on their next delivery)."""
        try:
            await self._actor.ping.remote()
            return self._actor
        except ray.exceptions.RayActorError as err:
            logger.warning("the RPC agent %s died (%s); starting a new group", self._name, err)
        self._key, self._actor = self._start_agent()
        try:
            self._members = await self._actor.members.remote()
        except ray.exceptions.RayActorError as err:
            raise TransportError(f"a new RPC agent {self._name} could not start: {err}") from err
        return self._actor

    async def receiver_joined(self, receiver: ReceiverInfo) -> RpcMember:
        async with self._lock:
            agent = await self._live_agent()
            member = await agent.admit.remote(receiver.worker, receiver.process)
            self._members[receiver.worker] = member
            self._ranks.set(receiver.worker, receiver.process, member.rank)
            return member

    async def receiver_left(self, worker: str) -> None:
        async with self._lock:
            self._members.pop(worker, None)
            self._ranks.remove(worker)
            try:
                await self._actor.forget.remote(worker)
            except ray.exceptions.RayActorError:
                pass  # the next plan replaces the agent, without this worker

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        if not targets:
            return {}
        async with self._lock:
            agent = await self._live_agent()
            self._seq += 1
            workers = tuple(t.worker for t in targets)
            job = RpcJob(self._seq, update.model, update.version, workers, update.payload)
            agent.send.remote(job)  # its outcome is the receivers' to report
            return {
                worker: RpcPayload(
                    self._key, job.seq, self._settings.timeout_s, self._members[worker]
                )
                for worker in workers
            }

    async def close(self) -> None:
        try:
            await self._actor.close.remote()
        except ray.exceptions.RayActorError:
            pass  # already dead
        finally:
            ray.kill(self._actor)


class _RankBook:
    """worker -> (process, rank) of a hub's RPC members, in Ray's GCS next to the hub's
    restart snapshot (:mod:`raysync.hub_snapshot`, deleted with it), so a restarted hub
    gives every receiver process its rank again. Hub process only."""

    def __init__(self, hub: str) -> None:
        self._key = f"hub/{hub}/rpc-ranks"
        raw = internal_kv._internal_kv_get(self._key, namespace=KV_NAMESPACE)
        self._ranks: dict[str, tuple[str, int]] = {} if raw is None else pickle.loads(raw)

    def load(self) -> dict[str, tuple[str, int]]:
        return dict(self._ranks)

    def set(self, worker: str, process: str, rank: int) -> None:
        if self._ranks.get(worker) != (process, rank):
            self._ranks[worker] = (process, rank)
            self._save()

    def remove(self, worker: str) -> None:
        if self._ranks.pop(worker, None) is not None:
            self._save()

    def _save(self) -> None:
        internal_kv._internal_kv_put(
            self._key, pickle.dumps(self._ranks), overwrite=True, namespace=KV_NAMESPACE
        )


# -- receiver ---------------------------------------------------------------------------
class RpcReceiver(TransportReceiver):
    def __init__(self, member: RpcMember) -> None:
        self._member = _Membership.join(member)
        self._pull = ObjectStoreReceiver()

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if isinstance(payload, ObjectStorePayload):  # pull mode: the learner's copy
            return self._pull.fetch(payload, spec)
        _Membership.follow(payload.member)
        tensors = _INBOX.take(payload.key, payload.seq, payload.timeout_s)
        if len(tensors) != len(spec):
            raise TransportError(
                f"version #{payload.seq} landed with {len(tensors)} tensors, the update's "
                f"spec has {len(spec)}"
            )
        return [
            raw.view(entry.dtype).view(entry.shape)
            for raw, entry in zip(tensors, spec.tensors, strict=True)
        ]


class RpcTransport(Transport):
    name = "rpc"
    hand_off = "object_store"  #: the learner puts once; the hub's side reads that copy
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
    def open_sender(cls, hub: HubContext) -> ObjectStoreSender:
        return ObjectStoreSender()

    @classmethod
    def open_receiver(cls, info: RpcMember) -> RpcReceiver:
        return RpcReceiver(info)


_register_rendezvous()
