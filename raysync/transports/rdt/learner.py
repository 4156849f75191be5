"""Learner process: the RDT sender, publishing each version as an RDT object."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportSender
from raysync.transports.rdt.wire import REQUIREMENT, RdtPayload, tensor_transport_enabled

#: Seconds ``send`` waits for Ray to free the buffer it is about to overwrite.
REUSE_WAIT_S = 600.0


class RdtSender(TransportSender):
    def __init__(self) -> None:
        context = ray.get_runtime_context()
        if context.get_actor_id() is not None and not tensor_transport_enabled(
            context.current_actor
        ):
            raise TransportError(f"the learner actor {context.get_actor_id()} {REQUIREMENT}")
        self._pairs: dict[tuple[WeightSpec, torch.device], list[torch.Tensor]] = {}
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

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        with self._lock:
            for pair in self._pairs.values():
                for buffer in pair:
                    deregister_nixl_memory(buffer)
            self._pairs.clear()
