"""torch.distributed as the data path: one collective broadcast per version.

Processes and roles:

* **learner process** — the object store's sender (``hand_off``) puts the version's
  tensors into the object store, exactly like the ``object_store`` transport (one
  copy, no pickling). It never touches torch.distributed.
* **hub process** — :class:`DistributedPlanner` starts one
  :class:`raysync.actors.process_group.ProcessGroupActor` per hub and decides, for every
  delivery, which *generation* of the process group carries it: the members are the
  delivery's targets (ranks 1..N in sorted worker order), the actor is rank 0. While
  the targets stay the same, consecutive versions reuse the group; a different set of
  targets (a receiver joined, left, died, or a subset broadcast), or a generation whose
  last collective failed, gets a new generation under a fresh random store prefix.
* **process-group actor** (rank 0, the source) — owns the rendezvous (a ``TCPStore``
  bound to its node's IP) and, per delivery, reads the learner's object-store copy
  (zero-copy on its node), packs it behind a 64-byte header into one uint8 buffer
  (:mod:`raysync.layout`) and runs **one** ``broadcast`` to the whole group.
* **receiver process** — :class:`DistributedReceiver` joins the generation named in
  its payload (rendezvous, then a barrier), enters the same ``broadcast`` inside
  ``fetch`` with a fresh buffer, checks the header and returns views of the buffer.

Why a source actor fed through the object store, and not the learner as rank 0: the
learner hands over its tensors *before* the hub knows who the version goes to (targets,
subsets, late joiners are the hub's business), a collective must be entered by exactly
its members, and torch.distributed state is per process — the learner may well be a
DDP rank already. A dedicated rank 0 keeps all process-group state out of the learner,
never blocks it on a slow or dead receiver, and can re-send the latest version to a
late joiner. The price is one object-store copy in the learner, the same as the
``object_store`` transport pays.

Groups are ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects built directly on a
``PrefixStore``, never the default group: a receiver that already runs its own
``init_process_group`` (tensor parallelism, say) keeps it, and switching generations
is ``shutdown()`` of one object and construction of another. A receiver is in at most
one raysync group at a time.

Order: the planner plans one delivery at a time and waits for rank 0 to finish the
previous collective before it plans the next, so each receiver is handed its deliveries
in collective order (threaded receivers also wait for their turn by sequence number),
and a failed collective is known before the next one is planned. A version whose
collective fails (a member died or never entered it within the timeout) is not lost on
the members that did not get it: each of them reads the learner's object-store copy
rank 0 was sending from (named in its payload) instead, so only the dead or absent
member fails; the next version goes to a new generation without it. Pull mode
(``pull_weights``) and a receiver's catch-up when it registers read the learner's
object-store copy directly: the hub hands them the learner's payload, and a collective
cannot be arranged for one receiver that asks on its own schedule.

Settings: ``WeightHub.remote(options=DistributedOptions(backend=..., timeout_s=...))``
(:class:`~raysync.transports.options.DistributedOptions`: ``gloo`` or ``nccl``, and the
timeout of every rendezvous and collective, default 30 s).

Security: the ``TCPStore`` master listens on a socket bound to the node's IP (never
``0.0.0.0``) on a random free port, and every generation uses a random 128-bit key
prefix. It lives as long as the hub. Like any TCPStore it has no authentication: any
process that can reach that port can read and write keys, so run it on a trusted
cluster network, as Ray itself expects. The gloo connections between members bind to
each process's node IP as well.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysync.actor_classes import PROCESS_GROUP, actor_class
from raysync.layout import PackedLayout
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
from raysync.transports.options import DistributedOptions
from raysync.transports.process_groups import node_ip

logger = logging.getLogger(__name__)

#: The header in front of every broadcast buffer: int64 words.
HEADER_BYTES = 64
_MAGIC = 0x7261_7973_796E_6364  # "raysyncd"
#: How often the hub asks a restarting process-group actor whether it is back.
_RESTART_POLL_S = 0.1


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
    source: ObjectStorePayload


@dataclass(frozen=True)
class GroupPayload:
    """Hub -> receiver: enter collective ``seq`` of ``generation`` as ``rank``; if the
    collective fails (a member died or never entered it), read ``source``, the
    learner's object-store copy, instead."""

    generation: Generation
    rank: int
    seq: int
    source: ObjectStorePayload


def process_group_name(hub_id: str) -> str:
    """The Ray name of the process-group actor (rank 0) of hub ``hub_id``."""
    return f"raysync-process-group-{hub_id}"


def header(generation: int, seq: int, nbytes: int) -> torch.Tensor:
    words = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
    words[:4] = torch.tensor([_MAGIC, generation, seq, nbytes])
    return words.view(torch.uint8)


def join_group(
    generation: Generation,
    rank: int,
    store: torch.distributed.Store | None = None,
) -> Any:
    """This process's member object of ``generation`` (rendezvous plus a barrier).

    ``store`` is the master store (rank 0); other ranks connect to the generation's
    address. Returns once every member has joined, so the rendezvous keys are no
    longer needed; raises on timeout.
    """
    import torch.distributed as dist

    settings = generation.settings
    if store is None:
        store = dist.TCPStore(
            generation.store.host,
            generation.store.port,
            is_master=False,
            timeout=settings.timeout,
        )
    prefixed = dist.PrefixStore(generation.prefix, store)
    if settings.backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = settings.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        group = dist.ProcessGroupGloo(prefixed, rank, generation.world_size, options)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = settings.timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, generation.world_size, options)
    barrier = group.barrier()
    barrier.wait(settings.timeout)
    return group


def run_broadcast(group: Any, buffer: torch.Tensor, settings: DistributedOptions) -> None:
    """Broadcast ``buffer`` from rank 0 (every member calls this); raises on failure."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = settings.timeout
    group.broadcast([buffer], options).wait(settings.timeout)
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()


def staging_device(settings: DistributedOptions) -> torch.device:
    if settings.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- hub --------------------------------------------------------------------------------
class DistributedPlanner(TransportPlanner):
    """Runs in the hub process; owns generation and rank assignment (see module doc)."""

    def __init__(self, hub: HubContext) -> None:
        self._settings = hub.options or DistributedOptions()
        self._name = process_group_name(hub.hub_id)
        options: dict[str, Any] = {
            "num_cpus": 0,
            "name": self._name,
            "max_restarts": -1,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True
            ),
        }
        if self._settings.backend == "nccl":
            options["num_gpus"] = 1
        rank0 = ray.remote(actor_class(PROCESS_GROUP))
        self._actor = rank0.options(**options).remote(self._settings)
        self._store: StoreAddress | None = None
        self._generation: Generation | None = None
        self._generations = 0  #: generations formed so far; numbers only grow
        self._next_seq = 0
        #: rank 0's result of the last collective planned: None, or why it failed.
        self._last_job: Any = None
        self._lock = asyncio.Lock()  #: plans run one at a time, in call order

    async def receiver_joined(self, receiver: ReceiverInfo) -> None:
        self._forget(receiver.worker)  # a re-registered worker is a new process

    async def receiver_left(self, worker: str) -> None:
        self._forget(worker)

    def _forget(self, worker: str) -> None:
        if self._generation is not None and worker in self._generation.members:
            self._generation = None

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        if not targets:
            return {}
        async with self._lock:
            last, self._last_job = self._last_job, None
            if last is not None and await self._collective_failed(last):
                self._generation = None  # form a new one
            store = await self._rank0_store()
            if store != self._store:  # first plan, or Ray restarted rank 0: new rendezvous
                self._store, self._generation = store, None
            members = tuple(sorted(t.worker for t in targets))
            generation = self._generation
            if generation is None or generation.members != members:
                self._generations += 1
                generation = Generation(
                    self._generations,
                    members,
                    f"raysync/{uuid.uuid4().hex}/",
                    self._store,
                    self._settings,
                )
                self._generation = generation
                self._next_seq = 0
            seq = self._next_seq
            self._next_seq += 1
            job = BroadcastJob(generation, seq, update.model, update.version, spec, update.payload)
            self._last_job = self._actor.broadcast.remote(job)
            return {
                worker: GroupPayload(generation, generation.rank_of(worker), seq, update.payload)
                for worker in members
            }

    @staticmethod
    async def _collective_failed(job: Any) -> bool:
        """Did rank 0's collective ``job`` fail (or rank 0 die while running it)?"""
        try:
            return await job is not None
        except ray.exceptions.RayActorError:
            return True

    async def _rank0_store(self) -> StoreAddress:
        """Where rank 0's store listens now, asked every plan: a process-group actor that
        Ray restarted listens elsewhere. One that is restarting is waited for (the hub
        bounds the wait by the broadcast's timeout); one gone for good fails the plan."""
        waiting = False
        while True:
            try:
                return await self._actor.store_address.remote()
            except ray.exceptions.ActorUnavailableError as err:
                if not waiting:
                    logger.warning("waiting for Ray to restart %s: %s", self._name, err)
                    waiting = True
                await asyncio.sleep(_RESTART_POLL_S)
            except ray.exceptions.RayActorError as err:
                raise TransportError(
                    f"the process-group actor {self._name} is dead and will not restart: {err}"
                ) from err

    async def close(self) -> None:
        try:
            await self._actor.close.remote()
        finally:
            ray.kill(self._actor)


# -- receiver ---------------------------------------------------------------------------
class DistributedReceiver(TransportReceiver):
    """Runs in the receiver process: a member of at most one generation at a time."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._generation: Generation | None = None
        self._group: Any = None
        self._next_seq = 0
        self._broken: dict[int, str] = {}  #: generation number -> why it broke here
        self._pull = ObjectStoreReceiver()

    @property
    def generation(self) -> int:
        """The number of the generation this receiver is a member of (0: none yet)."""
        return 0 if self._generation is None else self._generation.number

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if isinstance(payload, ObjectStorePayload):  # pull mode: the learner's copy
            return self._pull.fetch(payload, spec)
        try:
            return self._receive(payload, spec)
        except TransportError as err:
            # One member's death must not cost the others the version: read the copy
            # rank 0 was sending from instead.
            logger.warning("%s; reading the learner's object-store copy instead", err)
            try:
                return self._pull.fetch(payload.source, spec)
            except TransportError as fallback:
                raise TransportError(f"{err}; and then {fallback}") from fallback

    def _receive(self, payload: GroupPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """Enter ``payload``'s collective and return views of what rank 0 sent."""
        generation = payload.generation
        deadline = time.monotonic() + generation.settings.timeout_s
        with self._turn:
            self._wait_for_turn(payload, deadline)
            try:
                if self._generation != generation:
                    self._switch_to(generation, payload.rank)
                layout = PackedLayout.of(spec, HEADER_BYTES)
                buffer = torch.empty(
                    layout.nbytes, dtype=torch.uint8, device=staging_device(generation.settings)
                )
                run_broadcast(self._group, buffer, generation.settings)
            except Exception as err:
                self._break(generation, f"collective {payload.seq} failed: {err}")
                raise TransportError(
                    f"rank {payload.rank} could not receive collective {payload.seq} of "
                    f"process-group generation {generation.number} "
                    f"({generation.settings.backend}, {generation.world_size} ranks): {err}; "
                    "a member may have died or not entered the broadcast within "
                    f"{generation.settings.timeout_s:g} s"
                ) from err
            finally:
                self._next_seq = max(self._next_seq, payload.seq + 1)
                self._turn.notify_all()
        got = buffer[:HEADER_BYTES].cpu().view(torch.int64)[:4].tolist()
        expected = [_MAGIC, generation.number, payload.seq, layout.nbytes]
        if got != expected:
            raise TransportError(
                f"rank {payload.rank} received a buffer for (generation, collective, bytes) "
                f"= {tuple(got[1:])}, expected {tuple(expected[1:])}: the group is out of step"
            )
        return layout.views(buffer)

    def _wait_for_turn(self, payload: GroupPayload, deadline: float) -> None:
        """Collectives run in sequence order; a threaded actor may be handed them out
        of order. Called with ``self._turn`` held."""
        number = payload.generation.number
        while True:
            if number in self._broken:
                raise TransportError(
                    f"process-group generation {number} broke on this receiver earlier "
                    f"({self._broken[number]}); collective {payload.seq} cannot run"
                )
            current = self.generation
            if number < current or (number == current and payload.seq < self._next_seq):
                raise TransportError(
                    f"collective {payload.seq} of process-group generation {number} arrived "
                    f"after this receiver moved on to generation {current}, collective "
                    f"{self._next_seq}"
                )
            if payload.seq == (0 if number > current else self._next_seq):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"collective {payload.seq} of process-group generation {number} waited "
                    f"{payload.generation.settings.timeout_s:g} s for collective "
                    f"{self._next_seq} to be delivered to this receiver first"
                )
            self._turn.wait(remaining)

    def _switch_to(self, generation: Generation, rank: int) -> None:
        self._leave()
        self._generation = generation
        self._next_seq = 0
        self._group = join_group(generation, rank)

    def _break(self, generation: Generation, reason: str) -> None:
        self._broken[generation.number] = reason
        if self._generation == generation:
            self._leave()

    def _leave(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()

    def close(self) -> None:
        with self._turn:
            self._leave()
            self._generation = None


class DistributedTransport(Transport):
    name = "distributed"
    hand_off = "object_store"  #: the learner puts once; the hub's side reads that copy
    options = DistributedOptions

    @classmethod
    def availability(cls) -> Availability:
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed")
        if not dist.is_gloo_available():
            return Availability(False, "this torch build has no gloo backend")
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> DistributedPlanner:
        return DistributedPlanner(hub)

    @classmethod
    def open_sender(cls, hub: HubContext) -> ObjectStoreSender:
        return ObjectStoreSender()

    @classmethod
    def open_receiver(cls, info: Any) -> DistributedReceiver:
        return DistributedReceiver()
