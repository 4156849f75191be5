"""Ray's object store as the data path: one put per broadcast (one per copy thread for a
version of many small tensors), zero-copy reads per node.

Learner process: each tensor is handed to ``ray.put`` as a NumPy view of itself (its
shape and dtype; a same-size integer dtype where NumPy has none, as for bfloat16) in an
out-of-band buffer (:mod:`raysync.transports.object_store.arrays`), so Ray's serializer
writes the bytes back to back (64-byte aligned) into *one* object-store buffer (or one
per copy thread: :func:`~raysync.transports.object_store.arrays.put_version`): a single
copy from the learner's tensors into shared memory, no pickling by value and no
intermediate packing buffer. The learner process owns the
object (Ray 2.56 removed ``ray.put(_owner=...)``); the hub holds a reference to the
latest version, so it stays readable for receivers that join later while the learner
lives. If the learner dies, the next broadcast after it restarts is what late joiners get.

Receiver process: ``ray.get`` maps that buffer read-only (zero-copy on the node; Ray
pulls it once per node from elsewhere), and each tensor is a view of it.

A version larger than ``bucket_mb`` (the hub's, or the broadcast's) moves in buckets
instead, at most
:data:`~raysync.transports.object_store.bucket_stream.BUCKETS_IN_FLIGHT` in the object store at once
(:mod:`raysync.transports.object_store.buckets`).

The learner's half is :mod:`~raysync.transports.object_store.learner`, the receiver's
:mod:`~raysync.transports.object_store.receiver`, each imported when first opened: the
hub plans versions and unpickles their payloads
(:mod:`~raysync.transports.object_store.wire`) without torch, and the bucket broker's
process never imports it. (The hub's does, when a receiver registers: Ray imports an
actor's class to unpickle its handle.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raysync.transports.base import Availability, HubContext, MemoryFootprint, Transport
from raysync.transports.object_store.planner import ObjectStorePlanner

if TYPE_CHECKING:
    from raysync.transports.object_store.learner import ObjectStoreSender
    from raysync.transports.object_store.receiver import ObjectStoreReceiver


class ObjectStoreTransport(Transport):
    name = "object_store"
    #: The put (two versions alive while one is read); receivers read it in place.
    #: Bucketed: two buckets in the object store, one staged version per receiver.
    memory = MemoryFootprint(learner=2, per_receiver=0)
    learner_delivers = True
    buckets = True
    one_call_at_a_time = True  #: whole versions (a bucket stream's readers are waited for)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def open_hub(cls, hub: HubContext) -> ObjectStorePlanner:
        return ObjectStorePlanner()

    @classmethod
    def open_sender(cls, hub: HubContext) -> ObjectStoreSender:
        from raysync.transports.object_store.learner import ObjectStoreSender

        return ObjectStoreSender(hub)

    @classmethod
    def open_receiver(cls, info: Any) -> ObjectStoreReceiver:
        from raysync.transports.object_store.receiver import ObjectStoreReceiver

        return ObjectStoreReceiver(info)
