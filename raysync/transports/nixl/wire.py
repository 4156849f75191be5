"""Both processes: what a NIXL version looks like on the wire (payload, region, frame)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.object_store.bucket_stream import BUCKETS_IN_FLIGHT, BucketStream

#: A version is written and read in pieces of this many bytes (the last one shorter):
#: receivers read one while the learner packs the next.
BUCKET_BYTES = 8 << 20
#: A bucket stamp saying the learner failed while writing that version.
ABANDONED = -1


@dataclass(frozen=True)
class NixlRegion:
    """A registered source buffer as a receiver addresses it. Plain ints, so the hub
    that forwards payloads never needs nixl."""

    address: int
    nbytes: int  #: header plus packed tensors
    device_id: int
    mem_type: str  #: "DRAM" or "VRAM"


@dataclass(frozen=True)
class NixlPayload:
    """One version, readable from the learner's agent."""

    agent: str  #: the learner's agent name (unique per sender)
    metadata: bytes  #: the learner agent's metadata, loaded by receivers on change
    registration: int  #: bumps whenever the learner registers memory
    region: NixlRegion  #: the buffer holding this version
    stamp: int  #: what the buffer's header holds while it holds this version


@dataclass(frozen=True)
class Frame:
    """How a version of a spec lies in a buffer (both sides compute it from the spec):
    one int64 stamp per bucket, then the packed tensors, read and written in buckets."""

    layout: PackedLayout  #: tensor offsets, after the stamps
    buckets: tuple[tuple[int, int], ...]  #: [start, end) of each bucket in the buffer

    @classmethod
    @functools.cache
    def of(cls, spec: WeightSpec) -> Frame:
        data_bytes = PackedLayout.of(spec).nbytes
        count = -(-data_bytes // BUCKET_BYTES)
        layout = PackedLayout.of(spec, 8 * count)
        start = layout.header_bytes
        buckets = tuple(
            (start + k * BUCKET_BYTES, min(start + (k + 1) * BUCKET_BYTES, layout.nbytes))
            for k in range(count)
        )
        return cls(layout, buckets)

    def stamps(self, buffer: torch.Tensor) -> torch.Tensor:
        """The bucket stamps of ``buffer`` (int64 view)."""
        return buffer[: 8 * len(self.buckets)].view(torch.int64)


def descs(address: int, device_id: int, frame: Frame) -> list[tuple[int, int, int]]:
    """A buffer's descriptor list, the same on both sides: every stamp, then each
    bucket's bytes."""
    return [
        (address, 8 * len(frame.buckets), device_id),
        *((address + start, end - start, device_id) for start, end in frame.buckets),
    ]


#: Slots in a learner's ring of registered buckets: receivers read one while the
#: learner packs the other (the broker's flow control lets as many be in flight).
RING_SLOTS = BUCKETS_IN_FLIGHT
#: Bytes before a ring slot's data (its int64 stamp, then padding to the layout's
#: alignment); a receiver's staging buffer has the same header, where the stamp it
#: reads lands.
SLOT_HEADER = 64


@dataclass(frozen=True)
class NixlBucketStream(BucketStream):
    """A bucketed version through NIXL: the broker hands out
    :class:`~raysync.transports.object_store.bucket_stream.RingBucket` s
    instead of object-store refs, and receivers READ each from the learner's ring.
    Planners treat it as any bucket stream (readers, late joiners)."""

    agent: str  #: the learner's agent name
    metadata: bytes  #: the learner agent's metadata, loaded by receivers on change
    registration: int  #: bumps whenever the learner registers memory
    ring: tuple[NixlRegion, ...]  #: the slots, each ``SLOT_HEADER`` + bucket bytes
