"""NIXL as the data path: registered memory, one-sided READs into receivers' buffers.

Learner process (:class:`NixlSender`): one NIXL agent with the UCX backend. Per weight
spec (and device) it registers, once, a *pair* of buffers laid out as a header of one
int64 stamp per *bucket* (``BUCKET_BYTES`` of the data) followed by the tensors packed
by :class:`~raysync.layout.PackedLayout`. Each version goes into the buffer of the pair
not written last time, so receivers can still read version v while the learner writes
v+1 (unless the version written last never became the hub's latest: abandoned, or
refused by the hub; then into that one again, the other holding the latest).
``send`` picks the buffer, clears its stamps and returns a small payload: the
agent's name and metadata (~0.5 KB; receivers load it only when it changes), where
the buffer is, and the version's *stamp*. ``submitted`` (right after the hub was
handed the payload) then packs the buffer bucket by bucket, setting each bucket's
stamp when it is written: receivers read bucket k while the learner packs bucket k+1,
and the pack overlaps the hub's planning instead of preceding it.

Buffer reuse, the rule: a buffer is written again only once the broadcast that last
filled it has completed (every target acked, failed or timed out): ``send`` waits for
that broadcast's ack future, which ``submitted`` hands it. Meanwhile the versions other
threads already handed to the hub are written: a receiver reading in the hub's order may
need one of them before it can end the broadcast waited for. That keeps every broadcast
receiver's read clean. Readers outside a broadcast (late joiners and pullers reading the
latest version, receivers still reading after their broadcast timed out) are covered by
the stamps: the learner sets a buffer's stamps to 0 before packing and each bucket's to
the version's fresh, increasing stamp once that bucket is written; a receiver reads a
bucket only once its stamp is the payload's, and after the last bucket reads every
stamp again, accepting the data only if all still hold the payload's stamp. Any write
that began after the payload was made cleared the stamps first, so a torn read is
detected, never applied. A learner that fails while packing sets the stamps to
``ABANDONED``, which fails its readers at once.

Receiver process (:class:`NixlReceiver`): one agent; per spec a registered staging
buffer with the source's layout (more only while fetched updates wait for a safe
point, see ``release``, or while a zero-copy model lives in one); per (source buffer,
staging buffer) the descriptor lists and the READ requests (all stamps, each bucket's
data, all the data at once) are prepared once and posted again for every update. A
receiver reads the stamps first: if every bucket is written already it reads the data
in one request, else each bucket as the stamps show it written; then the stamps again.
A new learner (new agent) or new registrations (new spec) make it load the agent metadata
again; a failed or timed-out read raises :class:`TransportError` naming the learner's
agent and forgets that agent, so a restarted learner starts clean.

Progress: no agent runs nixl's own progress thread, which busy-polls a core for as long
as the agent lives, idle or not (on a small machine a learner and a few receivers
starve each other that way). A receiver progresses its agent while it polls its READs.
The learner's agent is the target of those READs: where UCX has a one-sided path the data
moves without it, but a receiver's first READ connects and needs the learner to answer,
and over TCP (no cross-memory attach, no RDMA) every READ does. A daemon thread
progresses it every 0.1 ms while a broadcast of the learner runs and every 5 ms between
broadcasts (:mod:`raysync.transports.nixl.progress`).

GPU: CUDA weights are packed into VRAM buffers on their device, and a receiver process
that sees a CUDA device stages in VRAM; NIXL moves the bytes the same way. UCX's
``cuda_ipc`` does those READs (GETs) only if asked to where NVML sees no NVLink (one GPU,
a VM), else they fall back to TCP: an agent in a process that sees CUDA is created with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` unless the environment already sets it
(:data:`raysync.transports.nixl.agent.UCX_CUDA_DEFAULTS`; ``rdt`` sets it too, for Ray's agents).

Bucketed versions (``bucket_mb``): not the pair, but a ring of two registered buckets
per bucket size (one more per version streaming at the same time), handed out by the
hub's bucket broker (:mod:`raysync.transports.nixl.ring`); receivers READ each bucket
straight into a registered staging buffer of the version's layout. A late joiner reads a
bucketed version from a receiver that holds it, through the object store, as
``object_store`` receivers do.
"""

from __future__ import annotations

from raysync.transports.base import Availability, HubContext, MemoryFootprint, Transport
from raysync.transports.nixl.agent import nixl_availability
from raysync.transports.nixl.learner import REUSE_WAIT_S, NixlSender
from raysync.transports.nixl.receiver import READ_TIMEOUT_S, NixlReceiver
from raysync.transports.nixl.wire import ABANDONED, BUCKET_BYTES, NixlPayload, NixlRegion
from raysync.transports.object_store.planner import ObjectStorePlanner

__all__ = [
    "ABANDONED",
    "BUCKET_BYTES",
    "READ_TIMEOUT_S",
    "REUSE_WAIT_S",
    "NixlPayload",
    "NixlReceiver",
    "NixlRegion",
    "NixlSender",
    "NixlTransport",
    "nixl_availability",
]


class NixlTransport(Transport):
    name = "nixl"
    #: The learner's registered pair; a staging buffer in each receiver, two with zero
    #: copy (the model lives in one while the next version lands in the other).
    #: Bucketed: a ring of two buckets in the learner, one staged version per receiver.
    memory = MemoryFootprint(learner=2, per_receiver=1)
    zero_copy_memory = MemoryFootprint(learner=2, per_receiver=2)
    zero_copy = "private"
    buckets = True
    #: whole versions: a call queued behind a busy receiver reads the learner's buffer
    #: late, once the learner wrote it again (its stamps fail the read)
    one_call_at_a_time = True

    @classmethod
    def availability(cls) -> Availability:
        """Imports nixl and creates one UCX agent (once per process)."""
        return nixl_availability()

    @classmethod
    def open_hub(cls, hub: HubContext) -> ObjectStorePlanner:
        """Whole versions go as the learner sent them; bucketed ones are planned as the
        object store's (readers at the broker, late joiners served by a holder)."""
        return ObjectStorePlanner()

    @classmethod
    def open_sender(cls, hub: HubContext) -> NixlSender:
        return NixlSender(hub)

    @classmethod
    def open_receiver(cls, info: str) -> NixlReceiver:
        """``info``: the receiver's worker id (the planner's ``receiver_joined``)."""
        return NixlReceiver(info)
