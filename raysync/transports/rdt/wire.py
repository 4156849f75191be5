"""All processes: the RDT payload, and the actor flag Ray requires on both ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from raysync.transports.object_store.bucket_stream import BucketStream

REQUIREMENT = (
    "must be declared with enable_tensor_transport=True to use transport 'rdt' (Ray's "
    "NIXL tensor transport): add it to the class decorator, "
    "@ray.remote(..., enable_tensor_transport=True) (Ray ignores it in .options())"
)


@dataclass(frozen=True)
class RdtPayload:
    """One version: an RDT object holding ``[packed buffer]``. Ray passes it as a ref."""

    ref: ray.ObjectRef


def tensor_transport_enabled(handle: Any) -> bool:
    return bool(handle._ray_enable_tensor_transport)


@dataclass(frozen=True)
class RdtBucketStream(BucketStream):
    """A bucketed version through RDT: each bucket the broker hands out is an RDT object
    holding ``[bucket]`` (a view of one of the learner's two registered bucket slots),
    which a receiver points at the bucket's place in its staging buffer."""
