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

A reader the broker dropped (stalled past ``stall_s``) may still be inside its get of a
slot's object, for as long as Ray's own fetch limit (60 s). Waiting for it would fail
every other reader at its timeout, and the ring's next version after them: once the
broker made room, a slot still referenced :data:`SET_ASIDE_AFTER_S` later is set aside
for the straggler and a new one takes its place (:data:`SLOTS_SET_ASIDE_MAX` per ring
at most; then the learner waits for it as before). A slot set aside is deregistered
once Ray frees its object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import ray
import torch

from raysync.copies import copy_on_this_thread
from raysync.transports.base import TransportError, VersionDone
from raysync.transports.buckets import pack_bucket
from raysync.transports.object_store.buckets import Outgoing, room_or_end, this_actor
from raysync.transports.rdt.wire import RdtBucketStream

logger = logging.getLogger(__name__)

#: How often a wait for a slot's last object to be freed looks whether the broadcast
#: ended meanwhile (then the slot is left as it is, and the stream ends).
_FREED_LOOK_S = 1.0
#: Seconds a slot whose bucket every reader the broker still counts has taken may stay
#: referenced before it is set aside for a straggler (a reader it dropped).
SET_ASIDE_AFTER_S = 2.0
#: Slots one ring sets aside at most (each one bucket); beyond them the learner waits.
SLOTS_SET_ASIDE_MAX = 2


@dataclass
class _Slot:
    tensor: torch.Tensor  #: uint8, one bucket, registered with Ray's NIXL agent
    #: The view last published from it: Ray tracks an RDT object's tensors by identity.
    published: torch.Tensor | None = field(default=None)


class RdtRing:
    """A sender's two registered bucket slots for one bucket size on one device.

    ``new_slot(like)`` registers a new slot like ``like`` (to take the place of one set
    aside), ``deregister(slot)`` lets one go."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        reuse_wait_s: float,
        new_slot: Callable[[torch.Tensor], torch.Tensor],
        deregister: Callable[[torch.Tensor], None],
    ) -> None:
        self._slots = [_Slot(t) for t in tensors]
        self._reuse_wait_s = reuse_wait_s
        self._new_slot = new_slot
        self._deregister = deregister
        self._next = 0
        #: Slots whose last object a straggling reader still holds
        self._set_aside: list[_Slot] = []

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The registered slots, those set aside included (the sender deregisters them
        when it closes)."""
        return [slot.tensor for slot in [*self._slots, *self._set_aside]]

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
        self._let_go_of_freed()
        for index in range(key.count):
            try:  # interrupted or cancelled while it waits, too: its readers are told
                if not room_or_end(broker, key, index, done):
                    return
                slot = self._free_slot(self._next, done)
            except TransportError as err:
                broker.end.remote(key, f"the learner could not reuse a bucket slot: {err}")
                raise
            except BaseException as err:
                why = f"the learner failed waiting for room for bucket {index}: {err!r}"
                broker.end.remote(key, why)
                raise
            if slot is None:
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

    def _free_slot(self, position: int, done: VersionDone) -> _Slot | None:
        """The slot at ``position``, once nothing reads its last object: if it is still
        referenced :data:`SET_ASIDE_AFTER_S` after the broker made room (a reader it
        dropped is still in its get), a new slot in its place, while fewer than
        :data:`SLOTS_SET_ASIDE_MAX` are set aside. None if the broadcast ended first."""
        slot = self._slots[position]
        if len(self._set_aside) >= SLOTS_SET_ASIDE_MAX:
            return slot if self._wait_until_freed(slot, done) else None
        state = self._freed_within(slot, done, SET_ASIDE_AFTER_S)
        if state == "freed":
            return slot
        if state == "ended":
            return None
        logger.warning(
            "a bucket in this learner's rdt ring is still referenced %g s after every "
            "reader the broker counts took it (a reader it dropped is still reading): "
            "that slot is set aside until freed, and a new one takes its place",
            SET_ASIDE_AFTER_S,
        )
        replacement = _Slot(self._new_slot(slot.tensor))  # first: it may fail to register
        self._set_aside.append(slot)
        self._slots[position] = replacement
        return replacement

    def _let_go_of_freed(self) -> None:
        """Deregister the slots set aside whose object Ray has freed since."""
        from ray.experimental import wait_tensor_freed

        kept = []
        for slot in self._set_aside:
            assert slot.published is not None  # set aside: still published
            try:
                wait_tensor_freed(slot.published, timeout=0)
            except TimeoutError:
                kept.append(slot)
                continue
            self._deregister(slot.tensor)
        self._set_aside = kept

    def _wait_until_freed(self, slot: _Slot, done: VersionDone) -> bool:
        """Wait until Ray freed the object last published from ``slot`` (nothing reads
        it any more); True then. False if the broadcast ended first: the slot is not
        written (a reader that timed out may still read it), and the version's stream
        ends rather than waiting out ``reuse_wait_s`` for a broadcast already over.
        TransportError after ``reuse_wait_s``."""
        state = self._freed_within(slot, done, self._reuse_wait_s)
        if state == "held":
            raise TransportError(
                f"a bucket in this learner's rdt ring is still referenced after "
                f"{self._reuse_wait_s:g} s (a receiver or the broker still holds its "
                "ObjectRef)"
            )
        return state == "freed"

    def _freed_within(
        self, slot: _Slot, done: VersionDone, wait_s: float
    ) -> Literal["freed", "ended", "held"]:
        """Wait up to ``wait_s`` for Ray to free ``slot``'s last object: "freed" (the slot
        may be written), "ended" (the broadcast ended first) or "held"."""
        from ray.experimental import wait_tensor_freed

        if slot.published is None:
            return "freed"
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                wait_tensor_freed(slot.published, timeout=max(0.0, min(_FREED_LOOK_S, left)))
                break
            except TimeoutError:
                if done.ended():
                    return "ended"
                if left <= _FREED_LOOK_S:
                    return "held"
        slot.published = None
        return "freed"
