"""Shared memory on each node: one write per version per node, zero-copy reads.

Who does what:

* **Owner** (``raysync.actors.shm_owner``, one per node per hub, started by the hub's
  planner): creates the segments, decides which one the next version may use, and
  frees them when it closes. A segment is an anonymous ``memfd``: it is never linked
  into ``/dev/shm`` or any file system, so there is no name to guess and nothing left
  behind when a process dies; the kernel frees it when the last descriptor and mapping
  close. Processes on the node open it as ``/proc/<owner pid>/fd/<fd>`` (same user
  only) and check the random 16-byte token in its header.
* **Learner** (:class:`SharedMemorySender`): asks its node's owner for a free slot,
  packs the version into it once (:class:`raysync.layout.PackedLayout`: 64-byte aligned
  offsets after a 64-byte header), and hands the hub a :class:`SharedMemoryPayload`.
* **Hub** (:class:`SharedMemoryPlanner`): groups the targets by node. On the learner's
  node it asks the owner to hold the slot for them (without waiting for the answer:
  the learner's own hold covers the slot until then); for every other node it has the
  learner's owner put the slot into the object store *once* and that node's owner
  relay it into a slot of its own (one transfer per node, not per receiver).
* **Receiver** (:class:`SharedMemoryReceiver`): maps each segment once and returns
  views of the slot; the mixin copies them into the model at the safe point, then
  calls :meth:`~SharedMemoryReceiver.release`. A zero-copy receiver's model instead
  becomes those (read-only) views, and releases the slot when it moves on to a newer
  version; registering again keeps the holds on the slots its models live in.

The no-tearing rule: a slot is rewritten only when nobody holds it. The owner holds a
slot for the learner from ``acquire`` until the hub plans it, for each receiver it was
planned for until that receiver releases it (after its copy, or when it skips the
version) or leaves the hub, and for the latest version of each model so that late
joiners and pull receivers can still read it. A version is therefore never overwritten
while a receiver may still copy it, however far behind that receiver is; the price is
at most ``MAX_SLOTS`` slots per model size per node, after which the learner waits for
a release (``SLOT_WAIT_S``) and then fails naming the receivers that hold them. Each
slot's header also carries the sequence number written into it; a receiver checks it
and raises :class:`TransportError` rather than read a slot that holds anything else.

Memory: the learner asks for its next slot right after each send, so at steady state
an owner keeps three slots per model size (latest, in flight, next), up to
``MAX_SLOTS`` while receivers lag. Segments are allocated when created, off the path
of a broadcast.

One learner process per hub: slots are ordered by the hub's planning order, which is
the order in which one learner submits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from raysync.actor_classes import SHM_OWNER, actor_class
from raysync.background import BackgroundTasks
from raysync.layout import HEADER_BYTES, PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    HubContext,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    TransportSender,
)

logger = logging.getLogger(__name__)

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


def _open(slot: Slot, writable: bool) -> torch.Tensor:
    """Map ``slot``'s segment (shared; read-only for readers) as a uint8 tensor, page
    tables filled up front; check its token."""
    path = f"/proc/{slot.pid}/fd/{slot.fd}"
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as err:
        raise TransportError(
            f"cannot open shared-memory segment {path} of the owner on node {slot.node_id} "
            f"({err.strerror}); the owner may have died or runs as another user"
        ) from err
    try:
        segment = mmap.mmap(
            fd,
            slot.nbytes,
            flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
        )
    finally:
        os.close(fd)
    if segment[:TOKEN_BYTES] != slot.token:
        raise TransportError(
            f"{path} is not the shared-memory segment it should be (token mismatch); "
            f"the owner on node {slot.node_id} may have been replaced"
        )
    with warnings.catch_warnings():
        # Readers map the segment read-only and only ever read from it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(segment, dtype=torch.uint8)


class _Mappings:
    """Segments this process has mapped, by token. Mappings of a replaced owner (another
    pid) are dropped when the new owner's first segment is mapped."""

    def __init__(self, writable: bool) -> None:
        self._writable = writable
        self._buffers: dict[bytes, tuple[int, torch.Tensor]] = {}

    def buffer(self, slot: Slot) -> torch.Tensor:
        known = self._buffers.get(slot.token)
        if known is not None:
            return known[1]
        self._buffers = {t: e for t, e in self._buffers.items() if e[0] == slot.pid}
        buffer = _open(slot, self._writable)
        self._buffers[slot.token] = (slot.pid, buffer)
        return buffer

    def clear(self) -> None:
        self._buffers.clear()


def write_seq(buffer: torch.Tensor, seq: int) -> None:
    buffer[_SEQ].view(torch.int64)[0] = seq


def read_seq(buffer: torch.Tensor) -> int:
    return int(buffer[_SEQ].view(torch.int64)[0])


class SharedMemorySender(TransportSender):
    """Learner side: write each version once into a slot of this node's owner."""

    def __init__(self, hub: HubContext) -> None:
        self._hub = hub
        self._name = owner_name(hub.hub_id, ray.get_runtime_context().get_node_id())
        self._mappings = _Mappings(writable=True)
        ray.get(hub.actor.__ray_ready__.remote(), timeout=OWNER_WAIT_S)
        self._owner = self._find_owner()
        #: The slot asked for right after the previous send, by size: the owner's answer
        #: is usually back before the next send needs it.
        self._next: tuple[int, ray.ObjectRef] | None = None

    def _find_owner(self) -> Any:
        """This node's owner; waits while the hub restarts one that died."""
        deadline = time.monotonic() + OWNER_WAIT_S
        while True:
            try:
                return ray.get_actor(self._name, namespace=OWNER_NAMESPACE)
            except ValueError:
                if time.monotonic() > deadline or self._hub.stopped():
                    raise TransportError(
                        f"no shared-memory owner {self._name!r} on the learner's node after "
                        f"{OWNER_WAIT_S:g} s: the hub starts one per node it sees at start-up "
                        "and restarts those that die; is the hub alive?"
                    ) from None
                time.sleep(0.2)  # the restarting hub starts it: poll, nothing to wait on

    def _slot(self, nbytes: int) -> tuple[Slot, torch.Tensor]:
        """A slot of ``nbytes`` and its mapping: the one asked for ahead if it fits.

        A slot asked for ahead but not used (another size came) stays held until the hub
        plans a newer version, which frees it (see ``ShmOwner.deliver``)."""
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == nbytes:
            try:
                slot = ray.get(ahead[1])
                if os.path.exists(f"/proc/{slot.pid}"):
                    return slot, self._mappings.buffer(slot)
                # Its owner died after answering (it goes with a restarting hub): the
                # slot is gone with it; ask the owner the hub starts next.
                self._owner = self._find_owner()
            except RayActorError:
                pass  # the owner died before answering: ask the one the hub restarts
            except TransportError:
                pass  # the owner died after answering, or had no free slot: ask again
        slot = self._acquire(nbytes)
        return slot, self._mappings.buffer(slot)

    def _acquire(self, nbytes: int) -> Slot:
        """A slot from this node's owner; if the owner died, from the one the hub restarts."""
        deadline = time.monotonic() + OWNER_WAIT_S
        while True:
            try:
                return ray.get(self._owner.acquire.remote(nbytes, SLOT_WAIT_S))
            except RayActorError as err:
                if time.monotonic() > deadline or self._hub.stopped():
                    raise TransportError(
                        f"the shared-memory owner {self._name!r} on the learner's node died "
                        f"and no working one was back within {OWNER_WAIT_S:g} s (or the "
                        "hub that restarts it stopped)"
                    ) from err
                time.sleep(0.2)
                self._owner = self._find_owner()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> SharedMemoryPayload:
        layout = PackedLayout.of(spec, HEADER_BYTES)
        slot, buffer = self._slot(layout.nbytes)
        write_seq(buffer, 0)
        layout.pack(tensors, buffer)
        write_seq(buffer, slot.seq)
        self._next = (layout.nbytes, self._owner.acquire.remote(layout.nbytes, SLOT_WAIT_S))
        return SharedMemoryPayload(slot)

    def close(self) -> None:
        self._mappings.clear()


class SharedMemoryReceiver(TransportReceiver):
    """Receiver side: views of this node's slot; release it after the copy."""

    def __init__(self, info: SharedMemoryReceiverInfo) -> None:
        self._worker = info.worker
        self._owner_name = info.owner
        self._owner: tuple[int, Any] | None = None  #: (pid, handle) of the owner last used
        self._node_id = ray.get_runtime_context().get_node_id()
        self._mappings = _Mappings(writable=False)

    def fetch(self, payload: SharedMemoryPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        slot = payload.slot
        if slot.node_id != self._node_id:
            raise TransportError(
                f"the update's shared-memory slot is on node {slot.node_id}, but receiver "
                f"{self._worker} runs on node {self._node_id}; the hub plans a slot per node, "
                "so this payload was not planned for this receiver"
            )
        layout = PackedLayout.of(spec, HEADER_BYTES)
        if layout.nbytes != slot.nbytes:
            raise TransportError(
                f"slot of {slot.nbytes} bytes does not fit the spec's layout of "
                f"{layout.nbytes} bytes ({spec.summary()})"
            )
        buffer = self._mappings.buffer(slot)
        if read_seq(buffer) != slot.seq:
            raise TransportError(
                f"shared-memory slot of receiver {self._worker} holds sequence "
                f"{read_seq(buffer)}, expected {slot.seq}: it was rewritten before this "
                "receiver read it (its hold was lost: did it re-register meanwhile?)"
            )
        return layout.views(buffer)

    def release(self, payload: SharedMemoryPayload, staged: Sequence[torch.Tensor] | None) -> None:
        slot = payload.slot
        if self._owner is None or self._owner[0] != slot.pid:
            try:
                handle = ray.get_actor(self._owner_name, namespace=OWNER_NAMESPACE)
            except ValueError:
                return  # the owner died, and its holds with it
            self._owner = (slot.pid, handle)
        # The owner ignores it if it is not the slot's owner (it was restarted meanwhile).
        self._owner[1].release.remote(slot.pid, slot.seq, self._worker)

    def close(self) -> None:
        self._mappings.clear()


class SharedMemoryPlanner(TransportPlanner):
    """Hub side: one owner per node; holds on the learner's node, relays to the others."""

    def __init__(self, hub: HubContext) -> None:
        self._hub_id = hub.hub_id
        self._owners: dict[str, Any] = {}
        #: Per node, the number of the next hold sent to its owner (see ShmOwner.deliver).
        self._orders: dict[str, itertools.count] = {}
        self._closed = False
        self._background = BackgroundTasks("shared-memory planner")
        #: per model: (version, node -> payload) of the latest version planned.
        self._latest: dict[str, tuple[int, dict[str, SharedMemoryPayload]]] = {}
        for node in ray.nodes():
            if node["Alive"]:
                self._start_owner(node["NodeID"])

    def _start_owner(self, node_id: str) -> Any:
        owner = (
            ray.remote(actor_class(SHM_OWNER))
            .options(
                name=owner_name(self._hub_id, node_id),
                namespace=OWNER_NAMESPACE,
                num_cpus=0,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id, soft=False
                ),
            )
            .remote(node_id, MAX_SLOTS)
        )
        self._owners[node_id] = owner
        self._orders[node_id] = itertools.count(1)
        self._background.spawn(self._watch(node_id, owner), f"watch the owner on {node_id}")
        return owner

    async def _watch(self, node_id: str, owner: Any) -> None:
        """Restart ``node_id``'s owner if it dies while the hub is open and the node lives."""
        try:
            await owner.closed.remote()
        except RayActorError:
            if self._closed or self._owners.get(node_id) is not owner:
                return
            del self._owners[node_id]
            for _, payloads in self._latest.values():
                payloads.pop(node_id, None)
            if any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
                self._start_owner(node_id)

    def _owner(self, node_id: str) -> Any:
        owner = self._owners.get(node_id)
        return owner if owner is not None else self._start_owner(node_id)

    async def receiver_joined(self, receiver: ReceiverInfo) -> SharedMemoryReceiverInfo:
        # A (re)joining worker holds nothing yet: drop what a former incarnation held,
        # but the slots its zero-copy models live in (they are its memory).
        kept = tuple(
            (p.slot.pid, p.slot.seq)
            for p in receiver.kept
            if isinstance(p, SharedMemoryPayload) and p.slot.node_id == receiver.node_id
        )
        await self._owner(receiver.node_id).drop_worker.remote(receiver.worker, kept)
        return SharedMemoryReceiverInfo(receiver.worker, owner_name(self._hub_id, receiver.node_id))

    async def receiver_left(self, worker: str) -> None:
        for owner in list(self._owners.values()):
            try:
                await owner.drop_worker.remote(worker)
            except RayActorError:
                continue  # its watch restarts it; a new owner holds nothing

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """A puller reads its own node's copy, held for it like a broadcast's target."""
        return (await self.plan(update, spec, [receiver]))[receiver.worker]

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        source: SharedMemoryPayload = update.payload
        slot = source.slot
        by_node: dict[str, list[str]] = {}
        for receiver in targets:
            by_node.setdefault(receiver.node_id, []).append(receiver.worker)
        owner = self._owners.get(slot.node_id)
        if owner is None:
            raise TransportError(
                f"version {update.version} of model {update.model!r} was lost with the "
                f"shared-memory owner on the learner's node {slot.node_id}, which died; "
                "the next broadcast is readable again"
            )
        # Not awaited, so receivers start reading at once: the learner's PENDING hold
        # keeps the slot until the owner gets this, and a receiver's release that
        # arrives first is remembered. Numbered, so the owner takes the holds in the
        # hub's planning order (which frees slots of versions the hub refused).
        held = owner.deliver.remote(
            slot.pid,
            slot.seq,
            update.model,
            tuple(by_node.pop(slot.node_id, ())),
            next(self._orders[slot.node_id]),
        )
        self._background.spawn(self._confirm(held, update), f"hold of {update.model!r}")
        payloads = {r.worker: source for r in targets if r.node_id == slot.node_id}
        if not by_node:
            return payloads
        version, relayed = self._latest.get(update.model, (0, {}))
        if version != update.version:
            relayed = {}
            if update.version > version:
                self._latest[update.model] = (update.version, relayed)
        missing = [node_id for node_id in by_node if node_id not in relayed]
        export = await owner.export.remote(slot.pid, slot.seq) if missing else None

        async def to_node(node_id: str, workers: tuple[str, ...]) -> None:
            node_owner = self._owner(node_id)
            known = relayed.get(node_id)
            if known is not None:
                node_slot = await node_owner.deliver.remote(
                    known.slot.pid,
                    known.slot.seq,
                    update.model,
                    workers,
                    next(self._orders[node_id]),
                )
            else:
                node_slot = await node_owner.relay.remote(
                    export, slot.nbytes, update.model, workers, SLOT_WAIT_S
                )
            relayed[node_id] = SharedMemoryPayload(node_slot)
            payloads.update({w: relayed[node_id] for w in workers})

        await asyncio.gather(*(to_node(n, tuple(ws)) for n, ws in by_node.items()))
        return payloads

    async def _confirm(self, held: ray.ObjectRef, update: Any) -> None:
        """Log a hold the owner refused; its receivers fail on the slot's sequence check."""
        try:
            await held
        except (RayActorError, TransportError) as err:
            logger.warning(
                "shared-memory owner could not hold version %d of model %r: %s",
                update.version,
                update.model,
                err,
            )

    async def close(self) -> None:
        self._closed = True
        await self._background.close()
        for owner in self._owners.values():
            try:
                await owner.close.remote()
            except RayActorError:
                pass  # died already: its segments died with its process
            ray.kill(owner)
        self._owners.clear()


class SharedMemoryTransport(Transport):
    name = "shared_memory"
    zero_copy = "read_only"

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, "needs Linux (memfd_create and /proc/<pid>/fd)")
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> SharedMemoryPlanner:
        return SharedMemoryPlanner(hub)

    @classmethod
    def open_sender(cls, hub: HubContext) -> SharedMemorySender:
        return SharedMemorySender(hub)

    @classmethod
    def open_receiver(cls, info: SharedMemoryReceiverInfo) -> SharedMemoryReceiver:
        return SharedMemoryReceiver(info)
