"""Learner process: bucketed versions through RDT, out of two registered bucket slots.

A version larger than ``bucket_mb`` is not packed into the sender's whole-version pair.
Per bucket size and device the sender registers two slots with Ray's NIXL agent, once
(and another two per version streaming at the same time: a ring streams one version,
from its hand-off to its stream's end; :mod:`raysync.transports.ring_pool`);
:func:`stream_out` packs bucket ``k`` into slot ``k`` mod 2 — each piece cast to the
wire dtype as it is copied — publishes it as an RDT object (``ray.put([bucket],
_tensor_transport="nixl")``, a view of the slot: Ray keeps no copy) and hands the ref
to the hub's bucket broker, as the object store's stream hands its puts. Before
writing a slot again the learner waits twice: for the broker's room (every reader took
the bucket after the one the slot holds; a reader that holds the others up is dropped
there) and for Ray to report every reference to the slot's last object gone
(``wait_tensor_freed``: the broker forgot it and no receiver's get still runs). So the
learner holds two buckets beyond its model, the object store none, and no read is torn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
import torch

from raysync.copies import copy_on_this_thread
from raysync.transports.base import TransportError, VersionDone
from raysync.transports.buckets import pack_bucket
from raysync.transports.object_store.buckets import Outgoing, room_or_end, this_actor
from raysync.transports.rdt.wire import RdtBucketStream

#: How often a wait for a slot's last object to be freed looks whether the broadcast
#: ended meanwhile (then the slot is left as it is, and the stream ends).
_FREED_LOOK_S = 1.0


@dataclass
class _Slot:
    tensor: torch.Tensor  #: uint8, one bucket, registered with Ray's NIXL agent
    #: The view last published from it: Ray tracks an RDT object's tensors by identity.
    published: torch.Tensor | None = field(default=None)


class RdtRing:
    """A sender's two registered bucket slots for one bucket size on one device."""

    def __init__(self, tensors: list[torch.Tensor], reuse_wait_s: float) -> None:
        self._slots = [_Slot(t) for t in tensors]
        self._reuse_wait_s = reuse_wait_s
        self._next = 0

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The registered slots (the sender deregisters them when it closes)."""
        return [slot.tensor for slot in self._slots]

    def stream_out(
        self,
        payload: RdtBucketStream,
        outgoing: Outgoing,
        done: VersionDone,
    ) -> None:
        """Pack and publish every bucket of ``payload``'s version, each once its slot
        is free; stop early if the broadcast ended (refused, or no reader left)."""
        broker, key = payload.broker, payload.key
        plan = outgoing.plan
        sender = this_actor()
        for index in range(key.count):
            if not room_or_end(broker, key, index, done):
                return
            slot = self._slots[self._next]
            try:
                freed = self._wait_until_freed(slot, done)
            except TransportError as err:
                broker.end.remote(key, f"the learner could not reuse a bucket slot: {err}")
                raise
            if not freed:
                broker.end.remote(key, f"the broadcast ended before bucket {index} was packed")
                return
            start = index * plan.bucket_bytes
            length = min(plan.bucket_bytes, plan.layout.nbytes - start)
            bucket = slot.tensor[:length]
            try:
                pack_bucket(bucket, plan, outgoing.sources, index, copy_on_this_thread)
                ref = ray.put([bucket], _tensor_transport="nixl")
            except BaseException as err:
                broker.end.remote(key, f"the learner failed packing bucket {index}: {err!r}")
                raise
            slot.published = bucket
            self._next = (self._next + 1) % len(self._slots)
            broker.offer.remote(key, index, [ref], sender)
            del ref  # the broker's reference keeps it until every reader took it

    def _wait_until_freed(self, slot: _Slot, done: VersionDone) -> bool:
        """Wait until Ray freed the object last published from ``slot`` (nothing reads
        it any more); True then. False if the broadcast ended first: the slot is not
        written (a reader that timed out may still read it), and the version's stream
        ends rather than waiting out ``reuse_wait_s`` for a broadcast already over.
        TransportError after ``reuse_wait_s``."""
        from ray.experimental import wait_tensor_freed

        if slot.published is None:
            return True
        deadline = time.monotonic() + self._reuse_wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                wait_tensor_freed(slot.published, timeout=max(0.0, min(_FREED_LOOK_S, left)))
                break
            except TimeoutError as err:
                if done.ended():
                    return False
                if left <= _FREED_LOOK_S:
                    raise TransportError(
                        f"a bucket in this learner's rdt ring is still referenced after "
                        f"{self._reuse_wait_s:g} s (a receiver or the broker still holds its "
                        "ObjectRef)"
                    ) from err
        slot.published = None
        return True
