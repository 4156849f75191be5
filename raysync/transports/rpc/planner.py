"""Hub process: the RPC planner, admitting receivers and handing the agent its jobs."""

from __future__ import annotations

import asyncio
import logging
import pickle
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysync.actor_classes import RPC_AGENT, actor_class
from raysync.bounded import keep_newest
from raysync.hub_snapshot import KV_NAMESPACE
from raysync.named_actors import start_again
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, ReceiverInfo, TransportError, TransportPlanner
from raysync.transports.bucket_relay import bucket_count, relay_reader
from raysync.transports.object_store.bucket_stream import is_bucketed, streams_of
from raysync.transports.object_store.planner import BucketServing
from raysync.transports.options import RpcOptions
from raysync.transports.parts import plan_pull_parts
from raysync.transports.rpc.wire import LEFT_KEPT, RpcJob, RpcMember, RpcPayload, agent_name

logger = logging.getLogger(__name__)

#: Seconds a plan waits for Ray to let the hub name a new agent as the dead one was
#: (:func:`raysync.named_actors.start_again`).
AGENT_NAME_WAIT_S = 10.0


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
        #: The agent key ``_members`` was read under (receivers join the first agent).
        self._members_of = self._key
        self._seq = 0
        self._lock = asyncio.Lock()  #: agent replacement and plans, one at a time
        #: The agent's ``forget`` calls not answered yet (see :meth:`receiver_left`), each
        #: with the process of the receiver it forgets (None: not known)
        self._forgetting: dict[asyncio.Future[Any], str | None] = {}
        self._receivers: dict[str, ReceiverInfo] = {}
        self._serving = BucketServing(self._receivers)  #: bucketed versions, pulled
        self._broker: Any = None  #: the hub's bucket broker, once a bucketed version came

    def _start_agent(self) -> tuple[str, Any]:
        """A new agent (new key, new group) that re-admits every known member at its rank."""
        key = uuid.uuid4().hex
        known, left = self._ranks.load(), self._ranks.left()
        generation = self._ranks.next_generation()
        actor = (
            ray.remote(actor_class(RPC_AGENT))
            .options(
                num_cpus=0,
                name=self._name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=True),
            )
            .remote(key, self._hub, self._settings, known, left, generation)
        )
        return key, actor

    async def _live_agent(self) -> Any:
        """The agent, after checking it answers; a dead one is replaced (and its members
        re-admitted to the new group, which they join on their next delivery).

        Reading the new agent's members waits for its process to start: a plan whose
        timeout cancels it there leaves them unread (``_members_of`` is the old key),
        and the next call reads them before anything is planned with them."""
        if self._actor is not None:
            try:
                await self._actor.ping.remote()
            except ray.exceptions.ActorUnavailableError as err:  # alive, out of reach a while
                raise TransportError(
                    f"the RPC agent {self._name} did not answer now ({err}); it is kept, "
                    "and the next version tries it again"
                ) from err
            except ray.exceptions.RayActorError as err:
                logger.warning(
                    "the RPC agent %s died (%s); starting a new group", self._name, err
                )
                if self._broker is not None:  # no bucketed version waits for the dead agent
                    self._broker.drop_reader.remote(relay_reader(self._key))
                self._actor = None  # no handle of the dead agent kept: Ray keeps its name
        if self._actor is None:
            try:
                self._key, self._actor = await start_again(self._start_agent, AGENT_NAME_WAIT_S)
            except ray.exceptions.ActorAlreadyExistsError as err:
                raise TransportError(
                    f"a new RPC agent {self._name} could not start: Ray still gives its "
                    f"name to the dead one after {AGENT_NAME_WAIT_S:g} s ({err}); the next "
                    "version tries again"
                ) from err
        if self._members_of != self._key:
            try:
                members = await self._actor.members.remote()
            except ray.exceptions.RayActorError as err:
                raise TransportError(
                    f"a new RPC agent {self._name} could not start: {err}"
                ) from err
            self._members, self._members_of = members, self._key
        return self._actor

    async def receiver_joined(self, receiver: ReceiverInfo) -> RpcMember:
        async with self._lock:
            # A process that left comes back to its place (or rank), which its
            # ``forget`` records: its own still running end first (another process's
            # may wait for the group's join token as long as the RPC timeout, and every
            # plan waits for this admit).
            own = [f for f, p in self._forgetting.items() if p in (None, receiver.process)]
            if own:
                await asyncio.wait(own)
            agent = await self._live_agent()
            member = await agent.admit.remote(receiver.worker, receiver.process)
            self._members[receiver.worker] = member
            self._receivers[receiver.worker] = receiver
            self._ranks.set(receiver.worker, receiver.process, member.rank)
            return member

    async def receiver_left(self, worker: str) -> None:
        """Off the plans at once; the agent takes it off the group's member list, which
        waits for the group's join token (a receiver may hold it, joining, up to the RPC
        timeout): the plans meanwhile do not wait for that."""
        async with self._lock:
            self._members.pop(worker, None)
            self._receivers.pop(worker, None)
            process = self._ranks.remove(worker)
            if self._actor is None:  # dead, not replaced yet: the next one lacks it
                return
            forgetting = asyncio.ensure_future(self._actor.forget.remote(worker))
            self._forgetting[forgetting] = process
        try:
            await forgetting
        except ray.exceptions.RayActorError:
            pass  # the next plan replaces the agent, without this worker
        finally:
            self._forgetting.pop(forgetting, None)

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        if not targets:
            return {}
        async with self._lock:
            agent = await self._live_agent()
            self._seq += 1
            # A target that left while this plan waited for the lock has no place in
            # the group any more: the hub fails it alone (it gets no payload).
            workers = tuple(t.worker for t in targets if t.worker in self._members)
            for stream in streams_of(update.payload):  # the agent reads and relays it
                self._broker = stream.broker
                await stream.broker.readers.remote(stream.key, [relay_reader(self._key)])
            buckets = bucket_count(update.payload) if is_bucketed(update.payload) else 0
            job = RpcJob(self._seq, update.model, update.version, workers, update.payload, spec)
            agent.send.remote(job)  # its outcome is the receivers' to report
            return {
                worker: RpcPayload(
                    self._key,
                    job.seq,
                    self._settings.timeout_s,
                    self._members[worker],
                    buckets,
                )
                for worker in workers
            }

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """The learner's put, read directly; a bucketed version is served again by a
        receiver that got it, one stream per part (read from the broker)."""
        if not is_bucketed(update.payload):
            return update.payload
        return await plan_pull_parts(self._serving, update, spec, receiver, in_one_plan=False)

    async def close(self) -> None:
        self._serving.close()
        self._ranks.delete()  # a closed hub is not restarted: nobody needs them
        if self._actor is None:  # it died, and no new one started
            return
        try:
            await self._actor.close.remote()
        except ray.exceptions.RayActorError:
            pass  # already dead
        finally:
            ray.kill(self._actor)


class _RankBook:
    """worker -> (process, rank) of a hub's RPC members, and process -> rank of the
    processes that left, in Ray's GCS next to the hub's restart snapshot
    (:mod:`raysync.hub_snapshot`), deleted as the hub closes: a new agent or a restarted
    hub gives every receiver process its rank again, torch RPC keeping a process's first
    rank for its life. Hub process only."""

    def __init__(self, hub: str) -> None:
        self._key = f"hub/{hub}/rpc-ranks"
        self._deleted = False
        raw = internal_kv._internal_kv_get(self._key, namespace=KV_NAMESPACE)
        self._ranks: dict[str, tuple[str, int]] = {}
        self._left: dict[str, int] = {}
        self._generations = 0  #: groups (agents) the hub started, its restarts' too
        if raw is not None:
            self._ranks, self._left, self._generations = pickle.loads(raw)

    def next_generation(self) -> int:
        """The number of the hub's next RPC group (saved: a restarted hub goes on)."""
        self._generations += 1
        self._save()
        return self._generations

    def load(self) -> dict[str, tuple[str, int]]:
        return dict(self._ranks)

    def left(self) -> dict[str, int]:
        return dict(self._left)

    def set(self, worker: str, process: str, rank: int) -> None:
        if self._ranks.get(worker) != (process, rank) or process in self._left:
            self._ranks[worker] = (process, rank)
            self._left.pop(process, None)
            self._save()

    def remove(self, worker: str) -> str | None:
        """Off the book, its process's rank kept as left; its process (None: unknown)."""
        gone = self._ranks.pop(worker, None)
        if gone is None:
            return None
        process, rank = gone
        self._left[process] = rank
        keep_newest(self._left, LEFT_KEPT)
        self._save()
        return process

    def delete(self) -> None:
        """The hub closed: the book goes, and is not written again (a receiver may still
        leave, or register, while the closed hub's actor lives)."""
        self._deleted = True
        internal_kv._internal_kv_del(self._key, namespace=KV_NAMESPACE)

    def _save(self) -> None:
        if self._deleted:
            return
        internal_kv._internal_kv_put(
            self._key,
            pickle.dumps((self._ranks, self._left, self._generations)),
            overwrite=True,
            namespace=KV_NAMESPACE,
        )
