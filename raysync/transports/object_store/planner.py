"""The object store's planner (hub process): every receiver reads the learner's payload.

A whole version's put is forwarded as it is (so the learner may deliver it itself: the
direct path). For a bucketed version (:class:`BucketStream`), the planner tells the
hub's bucket broker which receivers read it, and which receivers died or left, so the
learner never waits for a reader that is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray

from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo, TransportPlanner
from raysync.transports.object_store.buckets import BucketStream


class ObjectStorePlanner(TransportPlanner):
    def __init__(self) -> None:
        self._broker: Any = None  #: the hub's bucket broker, once a bucketed version came

    async def receiver_joined(self, receiver: ReceiverInfo) -> str:
        """The receiver's worker id: how it names itself to the bucket broker."""
        return receiver.worker

    async def receiver_left(self, worker: str) -> None:
        if self._broker is not None:
            await self._broker.drop_reader.remote(worker)

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        payload = update.payload
        if isinstance(payload, BucketStream):
            self._broker = payload.broker
            await payload.broker.readers.remote(payload.key, [t.worker for t in targets])
        return {receiver.worker: payload for receiver in targets}

    async def close(self) -> None:
        if self._broker is not None:
            ray.kill(self._broker)
            self._broker = None
