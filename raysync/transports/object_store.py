"""Ray's object store as the data path: one put per broadcast, zero-copy reads per node.

Learner process: each tensor's bytes are handed to ``ray.put`` as a uint8 NumPy view,
so Ray's serializer writes them out-of-band, back to back (64-byte aligned) into *one*
object-store buffer: a single copy from the learner's tensors into shared memory, no
pickling by value and no intermediate packing buffer. The learner process owns the
object (Ray 2.56 removed ``ray.put(_owner=...)``); the hub holds a reference to the
latest version, so it stays readable for receivers that join later while the learner
lives. If the learner dies, the next broadcast after it restarts is what late joiners get.

Receiver process: ``ray.get`` maps that buffer read-only (zero-copy on the node; Ray
pulls it once per node from elsewhere), and each tensor is a view of it.
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
)
from raysync.transports.parts import Parts


@dataclass(frozen=True)
class ObjectStorePayload:
    """The reference to one version's object. Nested in an Update, Ray passes it as a ref."""

    ref: ray.ObjectRef


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 NumPy view of a contiguous tensor's bytes (GPU tensors are copied to host)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.reshape(-1).view(torch.uint8).numpy()


async def read_put(source: ObjectStorePayload | Parts, timeout_s: float) -> list[np.ndarray]:
    """The arrays of a version's put, in spec order; of every part's put for a version
    sent in parts. Awaited in an async resource actor (a blocking get would hold its
    event loop); ``asyncio.TimeoutError`` after ``timeout_s``."""
    if isinstance(source, Parts):
        per_part = await asyncio.wait_for(
            asyncio.gather(*(part.payload.ref for part in source.parts)), timeout_s
        )
        return source.in_spec_order(per_part)
    return await asyncio.wait_for(source.ref, timeout_s)


class ObjectStoreSender(TransportSender):
    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> ObjectStorePayload:
        arrays = [_as_bytes(tensors[name]) for name in spec.names]
        return ObjectStorePayload(ray.put(arrays))


class ObjectStoreReceiver(TransportReceiver):
    def fetch(self, payload: ObjectStorePayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        try:
            arrays = ray.get(payload.ref)
        except ray.exceptions.RayError as err:
            raise TransportError(
                f"could not read the object-store copy of the update ({type(err).__name__}); "
                "the learner that put it (its owner) may have died"
            ) from err
        with warnings.catch_warnings():
            # The arrays map the object store read-only; we only ever read from them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [
                torch.from_numpy(array).view(entry.dtype).view(entry.shape)
                for array, entry in zip(arrays, spec.tensors, strict=True)
            ]


class ObjectStoreTransport(Transport):
    name = "object_store"
    #: The put (two versions alive while one is read); receivers read it in place.
    memory = MemoryFootprint(learner=2, per_receiver=0)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def open_sender(cls, hub: HubContext) -> ObjectStoreSender:
        return ObjectStoreSender()

    @classmethod
    def open_receiver(cls, info: Any) -> ObjectStoreReceiver:
        return ObjectStoreReceiver()
