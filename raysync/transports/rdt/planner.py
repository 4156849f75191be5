"""Hub process: the RDT planner, refusing receivers Ray would crash on."""

from __future__ import annotations

from raysync.transports.base import ReceiverInfo, TransportError, TransportPlanner
from raysync.transports.rdt.wire import REQUIREMENT, tensor_transport_enabled


class RdtPlanner(TransportPlanner):
    """Refuses receivers that Ray would crash on an RDT transfer."""

    async def receiver_joined(self, receiver: ReceiverInfo) -> None:
        if not tensor_transport_enabled(receiver.handle):
            raise TransportError(f"receiver {receiver.actor} {REQUIREMENT}")
