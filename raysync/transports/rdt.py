"""Ray Direct Transport (RDT) over NIXL as the data path: Ray moves the bytes.

The Ray-native mode of the NIXL transport. The learner packs the weights (layout of
:class:`~raysync.layout.PackedLayout`) into one of a pair of buffers per spec, each
registered with Ray's NIXL agent once (``ray.experimental.register_nixl_memory``), and
publishes the buffer with ``ray.put([buffer], _tensor_transport="nixl")``: the payload
is that ObjectRef. A receiver points the ref at its own staging buffer
(``set_target_for_ref``, registered once too) and ``ray.get`` makes Ray's agent READ
straight into it. Ray handles agent metadata, descriptors and failures; each get
prepares its transfer anew (the ``nixl`` transport prepares its handles once).

Buffer reuse: an RDT object aliases the live buffer, so the learner writes a buffer
again only once Ray reports every reference to the object it last held gone
(``wait_tensor_freed``): the hub dropped it as latest, every receiver finished its get.

Ray requires ``enable_tensor_transport=True`` on every actor that sends or receives RDT
objects (otherwise a transfer waits 60 s, then the receiving worker crashes). The hub
refuses to register a receiver without it and a learner actor without it cannot open
a sender; both errors say what to add. A learner that is the driver needs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    HubContext,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    TransportSender,
)
from raysync.transports.nixl import nixl_availability

#: Seconds ``send`` waits for Ray to free the buffer it is about to overwrite.
REUSE_WAIT_S = 600.0
#: Seconds a receiver's ``ray.get`` of one version may take.
READ_TIMEOUT_S = 60.0

_REQUIREMENT = (
    "must be declared with enable_tensor_transport=True to use transport 'rdt' (Ray's "
    "NIXL tensor transport): add it to the class decorator, "
    "@ray.remote(..., enable_tensor_transport=True) (Ray ignores it in .options())"
)


@dataclass(frozen=True)
class RdtPayload:
    """One version: an RDT object holding ``[packed buffer]``. Ray passes it as a ref."""

    ref: ray.ObjectRef


def _tensor_transport_enabled(handle: Any) -> bool:
    return bool(handle._ray_enable_tensor_transport)


class RdtSender(TransportSender):
    def __init__(self) -> None:
        context = ray.get_runtime_context()
        if context.get_actor_id() is not None and not _tensor_transport_enabled(
            context.current_actor
        ):
            raise TransportError(f"the learner actor {context.get_actor_id()} {_REQUIREMENT}")
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


def _staging_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RdtReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._device = _staging_device()
        self._free: dict[WeightSpec, list[torch.Tensor]] = {}
        self._registered: list[torch.Tensor] = []
        self._leased: dict[int, tuple[Sequence[torch.Tensor], WeightSpec, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def fetch(self, payload: RdtPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        from ray.experimental import set_target_for_ref

        layout = PackedLayout.of(spec)
        with self._lock:
            staging = self._take_staging(spec, layout)
        try:
            set_target_for_ref(payload.ref, [staging])
            (received,) = ray.get(payload.ref, timeout=READ_TIMEOUT_S)
        except (ray.exceptions.RayError, ValueError) as err:
            with self._lock:
                self._free[spec].append(staging)
            raise TransportError(
                f"Ray's NIXL tensor transport could not fetch the update ({type(err).__name__}: "
                f"{err}); the learner process may have died or released it"
            ) from err
        if received.data_ptr() != staging.data_ptr():
            raise TransportError("Ray's NIXL tensor transport ignored the target buffer")
        staged = layout.views(staging)
        with self._lock:
            self._leased[id(staged)] = (staged, spec, staging)
        return staged

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if staged is None:  # never fetched: no staging buffer was leased
            return
        with self._lock:
            lease = self._leased.pop(id(staged), None)
            if lease is not None:  # None: ``close`` already let go of every buffer
                _, spec, staging = lease
                self._free[spec].append(staging)

    def _take_staging(self, spec: WeightSpec, layout: PackedLayout) -> torch.Tensor:
        from ray.experimental import register_nixl_memory

        free = self._free.setdefault(spec, [])
        if free:
            return free.pop()
        staging = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self._device)
        register_nixl_memory(staging)
        self._registered.append(staging)
        return staging

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        with self._lock:
            for staging in self._registered:
                deregister_nixl_memory(staging)
            self._registered.clear()
            self._free.clear()
            self._leased.clear()


class RdtPlanner(TransportPlanner):
    """Refuses receivers that Ray would crash on an RDT transfer."""

    async def receiver_joined(self, receiver: ReceiverInfo) -> None:
        if not _tensor_transport_enabled(receiver.handle):
            raise TransportError(f"receiver {receiver.actor} {_REQUIREMENT}")


class RdtTransport(Transport):
    name = "rdt"

    @classmethod
    def availability(cls) -> Availability:
        return nixl_availability()

    @classmethod
    def open_hub(cls, hub: HubContext) -> RdtPlanner:
        return RdtPlanner()

    @classmethod
    def open_sender(cls, hub: HubContext) -> RdtSender:
        return RdtSender()

    @classmethod
    def open_receiver(cls, info: Any) -> RdtReceiver:
        return RdtReceiver()
