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
        #: Every handle on the hub in this process shares this sender, from any thread:
        #: two sends must not take the same slot asked for ahead.
        self._lock = threading.Lock()
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

    def _slot(self, nbytes: int) -> tuple[Slot, torch.Tensor]:
        """A slot of ``nbytes`` and its mapping: the one asked for ahead if it fits.

        A slot asked for ahead but not used (another size came) stays held until the hub
        plans a newer version, which frees it (see ``ShmOwner.deliver``). One the owner
        found none free for counts its wait: asked again, the owner waits only what is
        left of ``SLOT_WAIT_S`` since then, and the first refusal is what is raised."""
        ahead, self._next = self._next, None
        wait_s, refused = SLOT_WAIT_S, None
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
            except TransportError as err:  # no free slot: ask again, for what is left
                wait_s, refused = max(0.0, SLOT_WAIT_S - (time.monotonic() - ahead[2])), err
        try:
            slot = self._acquire(nbytes, wait_s)
        except TransportError:
            if refused is not None:
                raise refused from None  # held since it was asked for: what it said
            raise
        return slot, self._mappings.buffer(slot)

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
        layout = PackedLayout.of(spec, HEADER_BYTES)
        with self._lock:
            slot, buffer = self._slot(layout.nbytes)
            header = buffer.numpy()
            write_seq(header, 0)
            write_model(header, model)
            layout.pack(tensors, buffer, self._mappings.views(slot, layout))
            write_seq(header, slot.seq)
            return SharedMemoryPayload(slot)

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
