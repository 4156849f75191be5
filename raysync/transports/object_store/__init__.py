"""Ray's object store as the data path: one put per broadcast (one per copy thread for a
version of many small tensors), zero-copy reads per node.

Learner process: each tensor is handed to ``ray.put`` as a NumPy view of itself (its
shape and dtype; a same-size integer dtype where NumPy has none, as for bfloat16) in an
out-of-band buffer (:mod:`raysync.transports.object_store.arrays`), so Ray's serializer
writes the bytes back to back (64-byte aligned) into *one* object-store buffer (or one
per copy thread: :func:`~raysync.transports.object_store.arrays.put_version`): a single
copy from the learner's tensors into shared memory, no pickling by value and no
intermediate packing buffer. The learner process owns the
object (Ray 2.56 removed ``ray.put(_owner=...)``); the hub holds a reference to the
latest version, so it stays readable for receivers that join later while the learner
lives. If the learner dies, the next broadcast after it restarts is what late joiners get.

Receiver process: ``ray.get`` maps that buffer read-only (zero-copy on the node; Ray
pulls it once per node from elsewhere), and each tensor is a view of it.

A version larger than ``bucket_mb`` (the hub's, or the broadcast's) moves in buckets
instead, at most :data:`BUCKETS_IN_FLIGHT` in the object store at once
(:mod:`raysync.transports.object_store.buckets`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    HubContext,
    MemoryFootprint,
    Transport,
    TransportError,
    TransportReceiver,
    TransportSender,
    VersionDone,
)
from raysync.transports.object_store.arrays import (
    VersionPuts,
    arrays_of,
    as_array,
    as_tensor,
    put_arrays,
    put_version,
)
from raysync.transports.object_store.buckets import (
    BROKER_NAMESPACE,
    BUCKETS_IN_FLIGHT,
    BucketStream,
    Outgoing,
    broker_name,
    fetch_stream,
    open_broker,
    serve_stream,
    staging_buffer,
    start_stream,
    stream_out,
)
from raysync.transports.object_store.planner import ObjectStorePlanner
from raysync.transports.parts import Parts
from raysync.transports.staging import StagingPool

__all__ = [
    "BROKER_NAMESPACE",
    "BUCKETS_IN_FLIGHT",
    "BucketStream",
    "InlinePayload",
    "ObjectStorePayload",
    "ObjectStoreTransport",
    "arrays_of",
    "as_array",
    "as_tensor",
    "broker_name",
    "put_arrays",
    "put_version",
    "read_put",
]


@dataclass(frozen=True)
class ObjectStorePayload:
    """The references to one version's objects (:func:`put_version`: one, or one per
    copy thread of the learner), in spec order. Nested in an Update, Ray passes them as
    refs."""

    refs: tuple[ray.ObjectRef, ...]

    def arrays(self, timeout_s: float | None = None) -> list[np.ndarray]:
        """Reader (blocking): every array of the version, in spec order, read-only views
        of the object store. Ray's errors as they come (``GetTimeoutError`` included)."""
        values = ray.get(list(self.refs), timeout=timeout_s)
        return [array for value in values for array in arrays_of(value)]

    async def arrays_async(self) -> list[np.ndarray]:
        """:meth:`arrays`, awaited (an async actor's event loop must not block)."""
        values = await asyncio.gather(*self.refs)
        return [array for value in values for array in arrays_of(value)]


@dataclass(frozen=True)
class InlinePayload:
    """A small version carried in the update itself, as the arrays :func:`as_array`
    makes, in spec order: what a learner writes into its compiled-graph channel
    (:mod:`raysync.learner_channel`). The receiver copies them out at once (they are
    views of the channel's buffer, which the next version overwrites)."""

    arrays: tuple[np.ndarray, ...]


async def read_put(source: ObjectStorePayload | Parts, timeout_s: float) -> list[np.ndarray]:
    """The arrays of a version's put (see :func:`as_array`), in spec order; of every
    part's put for a version sent in parts. Awaited in an async resource actor (a
    blocking get would hold its event loop); ``asyncio.TimeoutError`` after
    ``timeout_s``."""
    if isinstance(source, Parts):
        per_part = await asyncio.wait_for(
            asyncio.gather(*(part.payload.arrays_async() for part in source.parts)), timeout_s
        )
        return source.in_spec_order(per_part)
    return await asyncio.wait_for(source.arrays_async(), timeout_s)


class ObjectStoreSender(TransportSender):
    def __init__(self, hub: HubContext) -> None:
        self._hub = hub
        self._broker: Any = None
        self._outgoing: dict[str, Outgoing] = {}
        self._puts = VersionPuts()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> ObjectStorePayload:
        arrays = [as_array(tensors[name]) for name in spec.names]
        return ObjectStorePayload(self._puts.put(arrays, torch.get_num_threads()))

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> BucketStream:
        if self._broker is None:
            self._broker = open_broker(self._hub)
        payload, outgoing = start_stream(self._broker, tensors, spec, bucket_bytes, stall_s)
        self._outgoing[payload.key.id] = outgoing
        return payload

    def submitted(self, payload: Any, done: VersionDone) -> None:
        if isinstance(payload, BucketStream):
            stream_out(payload, self._outgoing.pop(payload.key.id), done)

    def close(self) -> None:
        self._broker = None


class ObjectStoreReceiver(TransportReceiver):
    """Reads whole puts; and, given the receiver's worker id (``object_store``'s own
    receivers), bucketed versions too (``distributed`` and ``rpc`` read whole puts)."""

    def __init__(self, worker: str | None = None) -> None:
        self._worker = worker
        self._staging: StagingPool[torch.Tensor] = StagingPool(staging_buffer)

    def fetch(
        self, payload: ObjectStorePayload | InlinePayload | BucketStream, spec: WeightSpec
    ) -> Sequence[torch.Tensor]:
        if isinstance(payload, InlinePayload):
            return [
                as_tensor(np.array(array, copy=True), entry.dtype)
                for array, entry in zip(payload.arrays, spec.tensors, strict=True)
            ]
        if isinstance(payload, BucketStream):
            if self._worker is None:
                raise TransportError("this transport reads whole versions, not buckets")
            return fetch_stream(payload, spec, self._worker, self._staging)
        try:
            arrays = payload.arrays()
        except ray.exceptions.RayError as err:
            raise TransportError(
                f"could not read the object-store copy of the update ({type(err).__name__}); "
                "the learner that put it (its owner) may have died"
            ) from err
        with warnings.catch_warnings():
            # The arrays map the object store read-only; we only ever read from them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [
                as_tensor(array, entry.dtype)
                for array, entry in zip(arrays, spec.tensors, strict=True)
            ]

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        self._staging.release(staged)

    def serve(
        self, payload: BucketStream, tensors: Mapping[str, torch.Tensor], spec: WeightSpec
    ) -> None:
        serve_stream(payload, tensors, spec)

    def close(self) -> None:
        self._staging.close()


class ObjectStoreTransport(Transport):
    name = "object_store"
    #: The put (two versions alive while one is read); receivers read it in place.
    #: Bucketed: two buckets in the object store, one staged version per receiver.
    memory = MemoryFootprint(learner=2, per_receiver=0)
    learner_delivers = True
    buckets = True

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> ObjectStorePlanner:
        return ObjectStorePlanner()

    @classmethod
    def open_sender(cls, hub: HubContext) -> ObjectStoreSender:
        return ObjectStoreSender(hub)

    @classmethod
    def open_receiver(cls, info: Any) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(info)
