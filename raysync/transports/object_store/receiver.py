"""The receiver's half of ``object_store``: whole versions read in place from the object
store, small ones from the update itself, bucketed ones copied into a staging buffer.
Also the reader of ``distributed``'s, ``rpc``'s and ``shared_memory``'s object-store
fallbacks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from raysync.copies import Viewed, as_tensor
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.buckets import (
    decline_stream,
    fetch_stream,
    give_up,
    serve_stream,
    staging_buffer,
)
from raysync.transports.object_store.wire import InlinePayload, ObjectStorePayload
from raysync.transports.staging import StagingPool


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
        if len(arrays) != len(spec.tensors):
            raise TransportError(
                f"the object-store copy of the update holds {len(arrays)} arrays, "
                f"its spec {len(spec.tensors)} tensors"
            )
        # Read-only views of the object store; copied from with their arrays (no tensor
        # made per array unless the receiver asks for one).
        return Viewed.over(arrays, [entry.dtype for entry in spec.tensors])

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if staged is None and isinstance(payload, BucketStream) and self._worker is not None:
            give_up(payload, self._worker)  # refused, or not read whole
        self._staging.release(staged)

    def decline(self, payload: ObjectStorePayload | InlinePayload | BucketStream) -> None:
        """A whole version holds nothing for this receiver; a bucketed one is let go of
        as :func:`~raysync.transports.object_store.buckets.decline_stream` says: a
        stream served for this read alone is given up, the version's own is not (a
        broadcast may be delivering it to this receiver)."""
        if isinstance(payload, BucketStream) and self._worker is not None:
            decline_stream(payload, self._worker)

    def serve(
        self, payload: BucketStream, tensors: Mapping[str, torch.Tensor], spec: WeightSpec
    ) -> None:
        serve_stream(payload, tensors, spec)

    def close(self) -> None:
        self._staging.close()
