"""Learner process: bucketed versions through NIXL, out of a ring of registered buckets.

A version larger than ``bucket_mb`` does not go into the sender's two whole-version
buffers. Per bucket size and device the sender registers, once, a ring of
:data:`~raysync.transports.nixl.wire.RING_SLOTS` slots (an int64 stamp, padding, then
one bucket), and :meth:`BucketRing.stream_out` packs bucket ``k`` into the next slot —
casting each piece to the wire dtype as it copies it — and hands the hub's bucket
broker a :class:`~raysync.transports.object_store.bucket_stream.RingBucket` (which
slot, which stamp) instead of an object-store ref. Receivers READ it straight into
their staging buffer.

Flow control is the broker's, as for the object store's buckets: a slot is written
again only once every reader has taken the bucket after the one it holds (so has read
the one it holds), or the broker dropped the reader that held the others up. The ring
goes on across versions: the first buckets of version v+1 wait for v's readers to be
done with its last ones, unless v's broadcast already ended. A ring streams one version
at a time, from its hand-off to its stream's end; a version handed off while another
streams takes another ring (:mod:`raysync.transports.ring_pool` says why). So the learner holds
two buckets beyond its model, whatever the model's size (two per version streaming at
once, where its threads broadcast concurrently), and a version moves as fast as its
slowest reader reads (receivers read bucket k while the learner packs k+1).

Torn reads: a reader the broker dropped may still be reading a slot when it is written
again. The learner zeroes a slot's stamp before writing it and sets a fresh,
increasing stamp once the bucket is in; a receiver reads the stamp with the data and
again after it and keeps the bucket only if both are the one the broker named. A
learner that fails while packing sets ``ABANDONED`` and ends the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raysync.transports.base import VersionDone
from raysync.transports.buckets import pack_bucket
from raysync.transports.nixl.wire import (
    ABANDONED,
    SLOT_HEADER,
    NixlBucketStream,
    NixlRegion,
)
from raysync.transports.object_store.bucket_stream import (
    BUCKETS_IN_FLIGHT,
    RingBucket,
    StreamId,
)
from raysync.transports.object_store.buckets import Outgoing, this_actor, wait_for_room


@dataclass
class _Held:
    """The bucket a slot holds: its stream, its index, the end of its broadcast."""

    key: StreamId
    index: int
    done: VersionDone


@dataclass
class _Slot:
    tensor: torch.Tensor  #: uint8: SLOT_HEADER bytes (the stamp first), then one bucket
    held: _Held | None = None

    @property
    def stamp(self) -> torch.Tensor:
        return self.tensor[:8].view(torch.int64)

    @property
    def data(self) -> torch.Tensor:
        return self.tensor[SLOT_HEADER:]


class BucketRing:
    """A sender's registered slots for one bucket size on one device."""

    def __init__(self, tensors: list[torch.Tensor], regions: tuple[NixlRegion, ...]) -> None:
        self.regions = regions
        self._slots = [_Slot(t) for t in tensors]
        self._next = 0

    def stream_out(
        self,
        payload: NixlBucketStream,
        outgoing: Outgoing,
        done: VersionDone,
        copy: Callable[[torch.Tensor, torch.Tensor], None],
        next_stamp: Callable[[], int],
    ) -> None:
        """Pack and offer every bucket of ``payload``'s version, each once its slot is
        free; stop early if the broadcast ended (refused, or no reader left). ``copy``
        copies bytes of the same dtype; ``next_stamp`` gives a fresh stamp."""
        broker, key = payload.broker, payload.key
        sender = this_actor()
        for index in range(key.count):
            slot_number = self._next
            slot = self._slots[slot_number]
            try:  # interrupted or cancelled while it waits, too: its readers are told
                why = self._wait_until_free(broker, slot, key, done)
            except BaseException as err:
                why = f"the learner failed waiting for room for bucket {index}: {err!r}"
                broker.end.remote(key, why)
                raise
            if why is not None:
                broker.end.remote(key, why)
                return
            stamp = next_stamp()
            try:
                slot.stamp.fill_(0)
                _sync(slot.tensor)
                pack_bucket(slot.data, outgoing.plan, outgoing.sources, index, copy)
                _sync(slot.tensor)
                slot.stamp.fill_(stamp)
                _sync(slot.tensor)
            except BaseException as err:
                slot.stamp.fill_(ABANDONED)
                slot.held = None
                broker.end.remote(key, f"the learner failed packing bucket {index}: {err!r}")
                raise
            slot.held = _Held(key, index, done)
            self._next = (slot_number + 1) % len(self._slots)
            broker.offer.remote(key, index, [RingBucket(slot_number, stamp)], sender)

    @staticmethod
    def _wait_until_free(broker: Any, slot: _Slot, key: StreamId, done: VersionDone) -> str | None:
        """Wait until every reader is done with the bucket ``slot`` holds (``broker``:
        the hub's, every stream of this ring's sender has it). None, or why the version
        of ``key`` (``done``) cannot go on."""
        held = slot.held
        if held is None or (held.key != key and held.done.ended()):
            return None
        # Every reader has taken the bucket after the held one: it read the held one.
        room = held.index + BUCKETS_IN_FLIGHT
        if held.key == key:
            return wait_for_room(broker, key, room, done)
        # An older version's: also free once its broadcast ends (its readers acked or
        # were failed; a broker that lost its stream, restarted, would hold it up for
        # twice its timeout), and once its stream ended.
        why = wait_for_room(broker, held.key, room, done, until=held.done)
        return why if done.ended() else None


def _sync(tensor: torch.Tensor) -> None:
    """A stamp must not be readable before the data it vouches for (GPU copies are
    asynchronous)."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
