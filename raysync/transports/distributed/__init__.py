"""torch.distributed as the data path: one collective broadcast per version.

Processes and roles:

* **learner process** — the object store's sender (``hand_off``) puts the version's
  tensors into the object store, exactly like the ``object_store`` transport (one
  copy, no pickling). It never touches torch.distributed.
* **hub process** — :class:`DistributedPlanner` starts one
  :class:`raysync.actors.process_group.ProcessGroupActor` per hub and decides, for every
  delivery, which *generation* of the process group carries it: the members are the
  delivery's targets (ranks 1..N in sorted worker order), the actor is rank 0. While
  the targets stay the same, consecutive versions reuse the group; a different set of
  targets (a receiver joined, left, died, or a subset broadcast), or a generation whose
  last collective failed, gets a new generation under a fresh random store prefix.
* **process-group actor** (rank 0, the source) — owns the rendezvous (a ``TCPStore``
  bound to its node's IP) and, per delivery, reads the learner's object-store copy
  (zero-copy on its node), packs it behind a 64-byte header into one uint8 buffer
  (:mod:`raysync.layout`) and runs **one** ``broadcast`` to the whole group.
* **receiver process** — :class:`DistributedReceiver` joins the generation named in
  its payload (rendezvous, then a barrier), enters the same ``broadcast`` inside
  ``fetch`` with a fresh buffer, checks the header and returns views of the buffer.

Why a source actor fed through the object store, and not the learner as rank 0: the
learner hands over its tensors *before* the hub knows who the version goes to (targets,
subsets, late joiners are the hub's business), a collective must be entered by exactly
its members, and torch.distributed state is per process — the learner may well be a
DDP rank already. A dedicated rank 0 keeps all process-group state out of the learner,
never blocks it on a slow or dead receiver, and can re-send the latest version to a
late joiner. The price is one object-store copy in the learner, the same as the
``object_store`` transport pays.

Groups are ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects built directly on a
``PrefixStore``, never the default group: a receiver that already runs its own
``init_process_group`` (tensor parallelism, say) keeps it, and switching generations
is ``shutdown()`` of one object and construction of another. A receiver is in at most
one raysync group at a time.

Order: the planner plans one delivery at a time and waits for rank 0 to finish the
previous collective before it plans the next, so each receiver is handed its deliveries
in collective order (threaded receivers also wait for their turn by sequence number),
and a failed collective is known before the next one is planned. A version whose
collective fails (a member died or never entered it within the timeout) is not lost on
the members that did not get it: each of them reads the learner's object-store copy
rank 0 was sending from (named in its payload) instead, so only the dead or absent
member fails; the next version goes to a new generation without it. A member that
fails a version before reading it (its model was replaced by one of another shape)
still enters its collectives and drops what arrives: it fails alone, and the
generation goes on. Pull mode
(``pull_weights``) and a receiver's catch-up when it registers read the learner's
object-store copy directly: the hub hands them the learner's payload, and a collective
cannot be arranged for one receiver that asks on its own schedule.

A version larger than ``bucket_mb`` leaves the learner as the object store's bucket
stream; rank 0 relays it (:mod:`raysync.transports.bucket_relay`): one collective per
bucket, each bucket taken from the hub's bucket broker once the previous collective is
done, members placing each into a staging buffer and applying the version at one safe
point. If a collective fails, rank 0 first makes every member a reader of the stream at
the broker (which still holds the bucket it stopped at), and each member that did not
get the bucket reads it and the rest from there, as an object-store receiver would: one
death still fails only the dead member. A member that pulls a bucketed version later
reads it from the broker, served by a receiver that got it.

Settings: ``WeightHub.remote(options=DistributedOptions(backend=..., timeout_s=...))``
(:class:`~raysync.transports.options.DistributedOptions`: ``gloo`` or ``nccl``, and the
timeout of every rendezvous and collective, default 30 s).

Security: the ``TCPStore`` master listens on a socket bound to the node's IP (never
``0.0.0.0``) on a random free port, and every generation uses a random 128-bit key
prefix. It lives as long as the hub. Like any TCPStore it has no authentication: any
process that can reach that port can read and write keys, so run it on a trusted
cluster network, as Ray itself expects. The gloo connections between members bind to
each process's node IP as well.
"""

from __future__ import annotations

from typing import Any

from raysync.transports.base import (
    Availability,
    HubContext,
    MemoryFootprint,
    Transport,
    TransportSender,
)
from raysync.transports.distributed.group import (
    absent_members,
    bucket_timeout_s,
    call_off,
    forget_rendezvous,
    join_group,
    run_broadcast,
    staging_device,
)
from raysync.transports.distributed.planner import DistributedPlanner
from raysync.transports.distributed.receiver import DistributedReceiver
from raysync.transports.distributed.wire import (
    HEADER_BYTES,
    BroadcastJob,
    Generation,
    GroupPayload,
    MemberInfo,
    StoreAddress,
    collective_bytes,
    header,
    process_group_name,
    rank0_reader,
)
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.options import DistributedOptions

__all__ = [
    "HEADER_BYTES",
    "BroadcastJob",
    "DistributedPlanner",
    "DistributedReceiver",
    "DistributedTransport",
    "Generation",
    "GroupPayload",
    "MemberInfo",
    "StoreAddress",
    "absent_members",
    "bucket_timeout_s",
    "call_off",
    "collective_bytes",
    "forget_rendezvous",
    "header",
    "join_group",
    "process_group_name",
    "rank0_reader",
    "run_broadcast",
    "staging_device",
]


class DistributedTransport(Transport):
    name = "distributed"
    #: The learner's put (two alive), rank 0's read of it and its packed send buffer;
    #: each receiver's receive buffer. Bucketed: two buckets in the object store, one in
    #: rank 0's send buffer, one staged version per receiver.
    memory = MemoryFootprint(learner=4, per_receiver=1)
    hand_off = "object_store"  #: the learner puts once; the hub's side reads that copy
    #: Sharded learners: its resource actor reads every part's put and sends the version
    #: whole (one collective / one call per receiver), so members enter it once.
    parts_in_one_plan = True
    #: A version's collective waits for each member: one that holds it already (it
    #: pulled it meanwhile) enters it all the same.
    reads_refused = True
    buckets = True
    options = DistributedOptions

    @classmethod
    def availability(cls) -> Availability:
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed")
        if not dist.is_gloo_available():
            return Availability(False, "this torch build has no gloo backend")
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> DistributedPlanner:
        return DistributedPlanner(hub)

    @classmethod
    def open_sender(cls, hub: HubContext) -> TransportSender:
        return ObjectStoreTransport.open_sender(hub)  # its hand-off's: never called as its own

    @classmethod
    def open_receiver(cls, info: Any) -> DistributedReceiver:
        member: MemberInfo = info
        return DistributedReceiver(member.worker, formed_before=member.formed_before)
