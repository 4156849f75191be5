"""The learner's half of ``object_store``: one put per version (one per copy thread for
many small tensors), or a bucketed version streamed through the hub's broker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, TransportSender, VersionDone
from raysync.transports.object_store.arrays import VersionPuts, as_array
from raysync.transports.object_store.bucket_stream import BucketStream, open_broker
from raysync.transports.object_store.buckets import Outgoing, start_stream, stream_out
from raysync.transports.object_store.wire import ObjectStorePayload


class ObjectStoreSender(TransportSender):
    def __init__(self, hub: HubContext) -> None:
        self._hub = hub
        self._outgoing: dict[str, Outgoing] = {}
        self._puts = VersionPuts()

    def send(
        self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str
    ) -> ObjectStorePayload:
        arrays = [as_array(tensors[name]) for name in spec.names]
        return ObjectStorePayload(self._puts.put(arrays, torch.get_num_threads()))

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> BucketStream:
        # Opened (found) for each version: a broker that died since is started again.
        broker = open_broker(self._hub)
        payload, outgoing = start_stream(broker, tensors, spec, bucket_bytes, stall_s)
        self._outgoing[payload.key.id] = outgoing
        return payload

    def submitted(self, payload: Any, done: VersionDone) -> None:
        if isinstance(payload, BucketStream):
            stream_out(payload, self._outgoing.pop(payload.key.id), done)

    def abandoned(self, payload: Any, why: str) -> None:
        if isinstance(payload, BucketStream):
            self._outgoing.pop(payload.key.id, None)
            payload.broker.end.remote(payload.key, why)
