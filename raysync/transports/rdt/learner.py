"""Learner process: the RDT sender, publishing each version as an RDT object."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, TransportError, TransportSender, VersionDone
from raysync.transports.nixl.agent import apply_ucx_cuda_defaults
from raysync.transports.object_store.bucket_stream import open_broker
from raysync.transports.object_store.buckets import Outgoing, start_stream
from raysync.transports.rdt.agent import ray_agent_progress
from raysync.transports.rdt.ring import RdtRing
from raysync.transports.rdt.wire import (
    REQUIREMENT,
    RdtBucketStream,
    RdtPayload,
    tensor_transport_enabled,
)

#: Seconds ``send`` waits for Ray to free the buffer it is about to overwrite.
REUSE_WAIT_S = 600.0


class RdtSender(TransportSender):
    def __init__(self, hub: HubContext | None = None) -> None:
        """``hub``: the hub it broadcasts through, whose bucket broker hands bucketed
        versions out (None: it sends whole versions only)."""
        context = ray.get_runtime_context()
        if context.get_actor_id() is not None and not tensor_transport_enabled(
            context.current_actor
        ):
            raise TransportError(f"the learner actor {context.get_actor_id()} {REQUIREMENT}")
        apply_ucx_cuda_defaults()  # before Ray's NIXL agent starts in this process
        self._progress = ray_agent_progress()
        self._hub = hub
        self._pairs: dict[tuple[WeightSpec, torch.device], list[torch.Tensor]] = {}
        #: Bucketed versions: two registered slots per (bucket bytes, device), and each
        #: version ``send_buckets`` started until ``submitted``.
        self._rings: dict[tuple[int, torch.device], tuple[RdtRing, list[torch.Tensor]]] = {}
        self._outgoing: dict[str, tuple[RdtRing, Outgoing]] = {}
        self._lock = threading.Lock()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> RdtPayload:
        from ray.experimental import register_nixl_memory, wait_tensor_freed

        device = tensors[spec.names[0]].device
        layout = PackedLayout.of(spec)
        with self._lock:
            pair = self._pairs.get((spec, device))
            if pair is None:
                pair = [
                    torch.zeros(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(2)
                ]
                for buffer in pair:
                    register_nixl_memory(buffer)
                self._pairs[(spec, device)] = pair
            buffer = pair[0]
            pair.reverse()  # next time, the other buffer
            try:
                wait_tensor_freed(buffer, timeout=REUSE_WAIT_S)
            except TimeoutError as err:
                raise TransportError(
                    f"an earlier version in this learner's rdt buffer is still referenced after "
                    f"{REUSE_WAIT_S:g} s (a receiver or the hub still holds its ObjectRef)"
                ) from err
            layout.pack(tensors, buffer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return RdtPayload(ray.put([buffer], _tensor_transport="nixl"))

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> RdtBucketStream:
        """A version larger than a bucket: published bucket by bucket out of two
        registered slots (see :mod:`raysync.transports.rdt.ring`) by ``submitted``."""
        from ray.experimental import register_nixl_memory

        if self._hub is None:
            raise TransportError("this sender was opened without a hub: whole versions only")
        device = tensors[spec.names[0]].device
        with self._lock:
            # Opened (found) for each version: a broker that died since is started again.
            broker = open_broker(self._hub)
            entry = self._rings.get((bucket_bytes, device))
            if entry is None:
                slots = [
                    torch.zeros(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)
                ]
                for slot in slots:
                    register_nixl_memory(slot)
                entry = self._rings[(bucket_bytes, device)] = (RdtRing(slots, REUSE_WAIT_S), slots)
            stream, outgoing = start_stream(broker, tensors, spec, bucket_bytes, stall_s)
            payload = RdtBucketStream(stream.broker, stream.key, stream.bucket_bytes)
            self._outgoing[payload.key.id] = (entry[0], outgoing)
            return payload

    def submitted(self, payload: RdtPayload | RdtBucketStream, done: VersionDone) -> None:
        """Stream a bucketed version out of its ring (a whole one is already published)."""
        if self._progress is not None:
            self._progress.serving(done)
        if isinstance(payload, RdtBucketStream):
            with self._lock:
                ring, outgoing = self._outgoing.pop(payload.key.id)
            ring.stream_out(payload, outgoing, done)

    def abandoned(self, payload: RdtPayload | RdtBucketStream, why: str) -> None:
        if isinstance(payload, RdtBucketStream):
            with self._lock:
                self._outgoing.pop(payload.key.id, None)
            payload.broker.end.remote(payload.key, why)

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        with self._lock:
            for pair in self._pairs.values():
                for buffer in pair:
                    deregister_nixl_memory(buffer)
            for _, slots in self._rings.values():
                for slot in slots:
                    deregister_nixl_memory(slot)
            self._pairs.clear()
            self._rings.clear()
            self._outgoing.clear()
