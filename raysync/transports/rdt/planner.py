"""Hub process: the RDT planner, refusing receivers Ray would crash on."""

from __future__ import annotations

from raysync.transports.base import ReceiverInfo, TransportError
from raysync.transports.object_store.planner import ObjectStorePlanner
from raysync.transports.rdt.wire import REQUIREMENT, tensor_transport_enabled


class RdtPlanner(ObjectStorePlanner):
    """Refuses receivers that Ray would crash on an RDT transfer. Whole versions go as
    the learner sent them; bucketed ones are planned as the object store's (readers at
    the broker, late joiners served by a holder)."""

    async def receiver_joined(self, receiver: ReceiverInfo) -> str:
        """The receiver's worker id (how it names itself to the bucket broker)."""
        if not tensor_transport_enabled(receiver.handle):
            raise TransportError(f"receiver {receiver.actor} {REQUIREMENT}")
        return await super().receiver_joined(receiver)
