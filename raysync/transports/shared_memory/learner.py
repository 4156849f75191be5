"""Learner process: the shared-memory sender, writing each version into its node's slot."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, TransportError, TransportSender, VersionDone
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.learner import ObjectStoreSender
from raysync.transports.shared_memory.segments import Mappings
from raysync.transports.shared_memory.wire import (
    HEADER_BYTES,
    OWNER_NAMESPACE,
    OWNER_WAIT_S,
    SLOT_WAIT_S,
    SharedMemoryPayload,
    Slot,
    owner_name,
    write_model,
    write_seq,
)


class SharedMemorySender(TransportSender):
    """Learner side: write each version once into a slot of this node's owner."""

    def __init__(self, hub: HubContext) -> None:
        self._hub = hub
        self._name = owner_name(hub.hub_id, ray.get_runtime_context().get_node_id())
        self._mappings = Mappings(writable=True)
        ray.get(hub.actor.__ray_ready__.remote(), timeout=OWNER_WAIT_S)
        self._owner = self._find_owner()
        #: This sender's id at the owner: its slots are its own pool (sharded learners on
        #: one node each send a part), and only its own unplanned slots are freed by
        #: the hub's planning of its newer versions.
        self._learner = uuid.uuid4().hex
        #: The slot asked for once the previous version left for the hub, by size: the
        #: owner's answer is usually back before the next send needs it.
        #: (size, the owner's answer, when it was asked)
        self._next: tuple[int, ray.ObjectRef, float] | None = None
        #: Every handle on the hub in this process shares this sender, from any thread,
        #: for every model: two sends must not take the same slot asked for ahead, and
        #: they write one at a time, in the order of their slots (see :meth:`send`).
        #: Never held across a wait for a slot: one model's full pool would hold the
        #: sends of all the others.
        self._lock = threading.Lock()
        #: Owner's pid -> sequence of the newest of its slots this sender began writing
        #: (a restarted owner has another pid and numbers from 1 again); the owners
        #: gone are dropped when another one's slot is first written (see :meth:`_began`).
        self._newest: dict[int, int] = {}
        #: Bucketed versions travel as the object store's bucket stream (opened on use).
        self._streams: ObjectStoreSender | None = None

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

    def _slot(self, nbytes: int, wait_s: float) -> Slot:
        """A slot of ``nbytes``, found free within ``wait_s``: the one asked for ahead if
        it fits. Waits for the owner without the lock (called by :meth:`send`).

        A slot asked for ahead but not used (another size came) stays held until the hub
        plans a newer version, which frees it (see ``ShmOwner.deliver``). One the owner
        found none free for counts its wait: asked again, the owner waits only what is
        left of ``SLOT_WAIT_S`` since then, and the first refusal is what is raised."""
        with self._lock:
            ahead, self._next = self._next, None
        refused = None
        if ahead is not None and ahead[0] == nbytes:
            try:
                slot = ray.get(ahead[1])
                if os.path.exists(f"/proc/{slot.pid}/fd/{slot.fd}"):
                    return slot
                # Its owner died after answering (it goes with a restarting hub): the
                # slot is gone with it; ask the owner the hub starts next. Its
                # descriptor, not its process, says so: a killed process closes its
                # descriptors before its parent reaps it, and /proc/<pid> stays
                # meanwhile (the slot could not be opened).
                self._owner = self._find_owner()
            except RayActorError:
                pass  # the owner died before answering: ask the one the hub restarts
            except TransportError as err:  # no free slot: ask again, for what is left
                left_s = max(0.0, SLOT_WAIT_S - (time.monotonic() - ahead[2]))
                wait_s, refused = min(wait_s, left_s), err
        try:
            return self._acquire(nbytes, wait_s)
        except TransportError:
            if refused is not None:
                raise refused from None  # held since it was asked for: what it said
            raise

    def _acquire(self, nbytes: int, wait_s: float = SLOT_WAIT_S) -> Slot:
        """A slot from this node's owner, found free within ``wait_s``; if the owner
        died, from the one the hub restarts, given :data:`OWNER_WAIT_S` from the death
        (an owner may die well into a slot wait)."""
        deadline: float | None = None  #: set at the first death
        while True:
            try:
                return ray.get(
                    self._owner.acquire.remote(nbytes, wait_s, self._learner, os.getpid())
                )
            except RayActorError as err:
                if deadline is None:
                    deadline = time.monotonic() + OWNER_WAIT_S
                if time.monotonic() > deadline or self._hub.stopped():
                    raise TransportError(
                        f"the shared-memory owner {self._name!r} on the learner's node died "
                        f"and no working one was back within {OWNER_WAIT_S:g} s (or the "
                        "hub that restarts it stopped)"
                    ) from err
                time.sleep(0.2)
                self._owner = self._find_owner()

    def send(
        self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str
    ) -> SharedMemoryPayload:
        """Write the version into a slot of its size, waited for without the lock: a
        model whose pool is full (its receivers hold every slot) holds no other model's
        send. The writes are one at a time, each into a slot newer than the last (see
        :meth:`_superseded`); a slot skipped is given back, and the send waits for slots
        ``SLOT_WAIT_S`` in all."""
        layout = PackedLayout.of(spec, HEADER_BYTES)
        deadline = time.monotonic() + SLOT_WAIT_S
        while True:
            slot = self._slot(layout.nbytes, max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._superseded(slot):
                    self._give_back(slot)
                    continue
                buffer = self._mappings.buffer(slot)
                self._began(slot)
                header = buffer.numpy()
                write_seq(header, 0)
                write_model(header, model)
                layout.pack(tensors, buffer, self._mappings.views(slot, layout))
                write_seq(header, slot.seq)
                return SharedMemoryPayload(slot)

    def _superseded(self, slot: Slot) -> bool:
        """(Lock held, by :meth:`send`.) Whether another send began writing a newer slot
        of ``slot``'s owner while this one waited for ``slot``. The owner frees a
        learner's older slots never written whole once the hub plans a newer version
        (a learner writes one at a time: see ``ShmOwner.deliver``), so ``slot`` may be
        freed, and given again, while it is written."""
        return slot.seq < self._newest.get(slot.pid, 0)

    def _give_back(self, slot: Slot) -> None:
        """(Called by :meth:`send`.) Let the owner free ``slot``, skipped: held
        ``PENDING`` until the hub planned a newer version of this learner, it would
        count against its pool meanwhile. Not waited for: unnumbered, it takes no turn
        among the hub's calls, and the owner looks the slot up by sequence, so it does
        nothing to a slot freed and given again meanwhile (under a new sequence) or to
        one of a former owner (another pid); an ``acquire`` that runs before it waits
        for the pool and is woken when it lands."""
        self._owner.abandon.remote(slot.pid, slot.seq)

    def _began(self, slot: Slot) -> None:
        """(Lock held, by :meth:`send`, once ``slot`` is mapped: a slot of an owner gone
        may not be.) ``slot`` is the newest of its owner this sender writes; an owner
        seen for the first time drops those whose process is gone (replaced)."""
        if slot.pid not in self._newest:
            self._newest = {
                pid: seq for pid, seq in self._newest.items() if os.path.exists(f"/proc/{pid}")
            }
        self._newest[slot.pid] = slot.seq

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> BucketStream:
        """A version larger than a bucket: the object store's bucket stream (two buckets
        in Ray's shared memory at once; Ray moves each once per node), not a slot."""
        if self._streams is None:
            self._streams = ObjectStoreSender(self._hub)
        return self._streams.send_buckets(tensors, spec, bucket_bytes, stall_s)

    def submitted(self, payload: Any, done: VersionDone) -> None:
        """Ask for the next version's slot now that this one has left: asked in
        :meth:`send`, the call went out ahead of this version's delivery calls and the
        hub's booking, and the owner answered it while they waited for the cores."""
        if isinstance(payload, SharedMemoryPayload):
            nbytes = payload.slot.nbytes  # a slot is as large as the layout asked for
            with self._lock:
                if self._next is None:  # another thread's send may have asked already
                    ahead = self._owner.acquire.remote(
                        nbytes, SLOT_WAIT_S, self._learner, os.getpid()
                    )
                    self._next = (nbytes, ahead, time.monotonic())
        elif self._streams is not None and isinstance(payload, BucketStream):
            self._streams.submitted(payload, done)

    def abandoned(self, payload: Any, why: str) -> None:
        """A slot written for nothing stays held until the hub plans a newer version of
        its model from this sender, which frees it; a bucket stream ends now."""
        if self._streams is not None and isinstance(payload, BucketStream):
            self._streams.abandoned(payload, why)

    def close(self) -> None:
        """Let this sender's slots go (the owner frees each once nothing holds it; the
        one asked for ahead, never written, at once, even if not given yet)."""
        self._owner.leave.remote(self._learner)
        self._mappings.clear()
        if self._streams is not None:
            self._streams.close()
