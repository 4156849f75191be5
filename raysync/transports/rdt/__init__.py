"""Ray Direct Transport (RDT) over NIXL as the data path: Ray moves the bytes.

The Ray-native mode of the NIXL transport. The learner packs the weights (layout of
:class:`~raysync.layout.PackedLayout`) into one of a pair of buffers per model and
spec (the hub keeps each model's latest readable), each registered with Ray's NIXL
agent once (``ray.experimental.register_nixl_memory``), and
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

Bucketed versions (``bucket_mb``): not the pair, but two registered bucket slots per
bucket size, each bucket one RDT object handed out by the hub's bucket broker
(:mod:`raysync.transports.rdt.ring`); receivers point each at its place in their
staging buffer. A late joiner reads a bucketed version from a receiver that holds it,
through the object store, as ``object_store`` receivers do.
"""

from __future__ import annotations

from raysync.transports.base import Availability, HubContext, MemoryFootprint, Transport
from raysync.transports.nixl import nixl_availability
from raysync.transports.rdt.learner import REUSE_WAIT_S, RdtSender
from raysync.transports.rdt.planner import RdtPlanner
from raysync.transports.rdt.receiver import READ_TIMEOUT_S, RdtReceiver
from raysync.transports.rdt.wire import RdtPayload

__all__ = [
    "READ_TIMEOUT_S",
    "REUSE_WAIT_S",
    "RdtPayload",
    "RdtPlanner",
    "RdtReceiver",
    "RdtSender",
    "RdtTransport",
]


class RdtTransport(Transport):
    name = "rdt"
    #: The learner's registered pair; a staging buffer in each receiver.
    #: Bucketed: two registered buckets in the learner, one staged version per receiver.
    memory = MemoryFootprint(learner=2, per_receiver=1)
    buckets = True
    #: whole versions: a queued call's update holds the learner's buffer (its RDT ref)
    one_call_at_a_time = True

    @classmethod
    def availability(cls) -> Availability:
        return nixl_availability()

    @classmethod
    def open_hub(cls, hub: HubContext) -> RdtPlanner:
        return RdtPlanner()

    @classmethod
    def open_sender(cls, hub: HubContext) -> RdtSender:
        return RdtSender(hub)

    @classmethod
    def open_receiver(cls, info: str) -> RdtReceiver:
        """``info``: the receiver's worker id (the planner's ``receiver_joined``)."""
        return RdtReceiver(info)
