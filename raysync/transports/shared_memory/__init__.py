r"""Shared memory on each node: one write per version per node, zero-copy reads.

Who does what:

* **Owner** (``raysync.actors.shm_owner``, one per node per hub, started by the hub's
  planner): creates the segments, decides which one the next version may use, and
  frees them when it closes. A segment is an anonymous ``memfd``: it is never linked
  into ``/dev/shm`` or any file system, so there is no name to guess and nothing left
  behind when a process dies; the kernel frees it when the last descriptor and mapping
  close. Processes on the node open it as ``/proc/<owner pid>/fd/<fd>`` (same user
  only) and check the random 16-byte token in its header. It never unpacks a version:
  its process does without torch (this package opens its learner's and receiver's
  halves only when they are used), which saves each node's owner seconds of CPU at
  start and a few hundred MB.
* **Learner** (:class:`SharedMemorySender`): asks its node's owner for a free slot,
  packs the version into it once (:class:`raysync.layout.PackedLayout`: 64-byte aligned
  offsets after a 64-byte header), and hands the hub a :class:`SharedMemoryPayload`.
* **Hub** (:class:`SharedMemoryPlanner`): groups the targets by node. On the learner's
  node it asks the owner to hold the slot for them (without waiting for the answer:
  the learner's own hold covers the slot until then); for every other node it has the
  learner's owner put the slot into the object store *once* and that node's owner
  relay it into a slot of its own (one transfer per node, not per receiver).
* **Receiver** (:class:`SharedMemoryReceiver`): maps each segment once and returns
  views of the slot; the mixin copies them into the model at the safe point, then
  calls :meth:`~SharedMemoryReceiver.release`. A zero-copy receiver's model instead
  becomes those (read-only) views, and releases the slot when it moves on to a newer
  version; registering again keeps the holds on the slots its models live in.
  A release is written on the owner's *release board* (:class:`Board`): a segment of
  one int64 cell per (receiver, segment), where the receiver ``pwrite``\ s the sequence
  number it is done with and the owner reads it when it looks for a free slot (again
  every ``BOARD_POLL_S`` while it waits for one). One system call instead of one Ray
  call per receiver per version, which at 1 MB to four receivers cost the owner more
  CPU than all else it does. A receiver without a row (past ``BOARD_ROWS``), a segment
  without a column (past ``wire.BOARD_COLUMNS``), or a slot of a restarted owner (the
  receiver's row is on the dead one's board) is released by calling the owner.

The no-tearing rule: a slot is rewritten only when nobody holds it. The owner holds a
slot for the learner from ``acquire`` until the hub plans it, for each receiver it was
planned for until that receiver releases it (after its copy, or when it skips the
version) or leaves the hub, and for the latest version of each model so that late
joiners and pull receivers can still read it. A version is therefore never overwritten
while a receiver may still copy it, however far behind that receiver is; the price is
at most ``MAX_SLOTS`` slots per learner and size per node (one sender serves every
model of its process: models of one size share them), one more for the latest of each
of those models beyond the first, and one more for each slot held only for receivers,
at most ``wire.KEPT_PER_RECEIVER`` per receiver and model, as the hub keeps a call per
receiver and model (a busy receiver's queued call's, and the one its zero-copy model
lives in): receivers busy from different versions do not fill the pool. Past that the
learner waits for a release (``SLOT_WAIT_S``) and then fails naming the receivers that
hold them. Each slot's header also carries the sequence number written into it; a
receiver checks it and raises :class:`TransportError` rather than read a slot that
holds anything else.

Memory: the learner asks for its next slot once each version has left for the hub
(:meth:`SharedMemorySender.submitted`), so at steady state an owner keeps three slots
per model size (latest, in flight, next; one more latest for each other model of that
size), up to ``MAX_SLOTS`` while receivers lag, and up to ``wire.KEPT_PER_RECEIVER``
more per receiver and model holding old versions. Those are not freed as they are
released but at the next slot request of any learner on the node (or the owner's
``stats``), which frees the free slots beyond each pool's room. Segments are allocated
when created, off the path of a broadcast.

A version larger than ``bucket_mb`` does not take a slot: it travels as the object
store's bucket stream (:mod:`raysync.transports.object_store.buckets`; Ray's object
store is the node's shared memory too, and Ray moves each bucket once per node), and
receivers copy it into a private staging buffer, as ``object_store`` receivers do (a
zero-copy model lives in that buffer). Bucket-sized slots in the owner's segments are
not built.

The direct path (``learner_delivers``): the learner calls the receivers on its own node
itself with its slot, as ``object_store`` learners do, and the hub books the version in
parallel; the planner's holds for those receivers land after the call, and a receiver
that is done with the slot first has its release remembered by the owner (the
learner's ``PENDING`` hold covers the slot until the hub's holds land; a version the
hub refuses after the call is held for them instead, until each lets go). Receivers on
other nodes are delivered by the hub, through their node's relayed slot.

Each learner's sender has its own pool of slots at the owner, and the hub's planning of
a learner's newer version frees only that learner's slots it never planned: several
learners on one node (a sharded model, one part each) neither wait for nor free each
other's slots.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from raysync.transports.base import Availability, HubContext, MemoryFootprint, Transport
from raysync.transports.shared_memory.planner import SharedMemoryPlanner
from raysync.transports.shared_memory.wire import (
    BOARD_POLL_S,
    BOARD_ROWS,
    HEADER_BYTES,
    MAX_SLOTS,
    ORDER_WAIT_S,
    OWNER_NAMESPACE,
    OWNER_WAIT_S,
    SLOT_WAIT_S,
    TOKEN_BYTES,
    Board,
    SharedMemoryPayload,
    SharedMemoryReceiverInfo,
    Slot,
    owner_name,
    read_seq,
    write_seq,
)

if TYPE_CHECKING:
    from raysync.transports.shared_memory.learner import SharedMemorySender
    from raysync.transports.shared_memory.receiver import SharedMemoryReceiver

__all__ = [
    "BOARD_POLL_S",
    "BOARD_ROWS",
    "HEADER_BYTES",
    "MAX_SLOTS",
    "ORDER_WAIT_S",
    "OWNER_NAMESPACE",
    "OWNER_WAIT_S",
    "SLOT_WAIT_S",
    "TOKEN_BYTES",
    "Board",
    "SharedMemoryPayload",
    "SharedMemoryPlanner",
    "SharedMemoryReceiverInfo",
    "SharedMemoryTransport",
    "Slot",
    "owner_name",
    "read_seq",
    "write_seq",
]


class SharedMemoryTransport(Transport):
    name = "shared_memory"
    #: Three slots per node (latest, in flight, next); receivers map them. Zero-copy
    #: models live in a slot: one more.
    #: Bucketed: two buckets in the object store, one staged version per receiver.
    memory = MemoryFootprint(learner=3, per_receiver=0)
    zero_copy_memory = MemoryFootprint(learner=4, per_receiver=0)
    zero_copy = "read_only"
    buckets = True
    #: The learner calls the receivers on its node with its slot; the hub books their
    #: holds after (the owner remembers a release that comes first).
    learner_delivers = True
    learner_delivers_on_its_node = True
    plans_learner_deliveries = True
    #: The owner frees a learner's unplanned slots older than the one the hub plans.
    submits_in_send_order = True
    #: A busy receiver is called once per model at a time (a queued call's update
    #: names a slot): a delivery that waits lets go of its hold, and plans it again.
    one_call_at_a_time = True
    #: Each call queued at a busy receiver holds its slot: one, so that what a busy
    #: receiver holds (its zero-copy model's slot, its queued call's, the hub's call's
    #: once it is free) and the latest leave a slot of four for the learner's next write.
    direct_calls_running_most = 1

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, "needs Linux (memfd_create and /proc/<pid>/fd)")
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> SharedMemoryPlanner:
        return SharedMemoryPlanner(hub)

    @classmethod
    def open_sender(cls, hub: HubContext) -> SharedMemorySender:
        from raysync.transports.shared_memory.learner import SharedMemorySender

        return SharedMemorySender(hub)

    @classmethod
    def open_receiver(cls, info: SharedMemoryReceiverInfo) -> SharedMemoryReceiver:
        from raysync.transports.shared_memory.receiver import SharedMemoryReceiver

        return SharedMemoryReceiver(info)
