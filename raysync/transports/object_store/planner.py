"""The object store's planner (hub process): every receiver reads the learner's payload.

A whole version's put is forwarded as it is (so the learner may deliver it itself: the
direct path). For a bucketed version (:class:`BucketStream`), the planner tells the
hub's bucket broker which receivers read it, and which receivers died or left, so the
learner never waits for a reader that is gone; and a receiver that pulls it after the
broadcast (joining, restarted) gets a new stream that a receiver which read the version
serves from its model (:func:`~raysync.transports.object_store.buckets.serve_stream`):
:class:`BucketServing`, which ``rpc``'s planner uses too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import ray

from raysync.messages import ServeRequest
from raysync.receiver_delivery import serve_call
from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo, TransportPlanner
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.parts import model_of_stream


class ObjectStorePlanner(TransportPlanner):
    def __init__(self) -> None:
        self._broker: Any = None  #: the hub's bucket broker, once a bucketed version came
        self._receivers: dict[str, ReceiverInfo] = {}
        self._serving = BucketServing(self._receivers)

    async def receiver_joined(self, receiver: ReceiverInfo) -> str:
        """The receiver's worker id: how it names itself to the bucket broker."""
        self._receivers[receiver.worker] = receiver
        self._broker = await tell_broker(self._broker, "readmit", receiver.worker)
        return receiver.worker

    async def receiver_left(self, worker: str) -> None:
        self._receivers.pop(worker, None)
        self._broker = await tell_broker(self._broker, "drop_reader", worker)

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        payload = update.payload
        if isinstance(payload, BucketStream):
            self._broker = payload.broker
            await payload.broker.readers.remote(payload.key, [t.worker for t in targets])
        return {receiver.worker: payload for receiver in targets}

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        return await self._serving.plan_pull(update, spec, receiver)

    def abandoned(self, payload: Any, read_by: Sequence[str] = ()) -> None:
        """A refused bucketed version's stream ends at the broker now, and the buckets
        its learner put before it heard of the refusal (the first two go out without
        waiting: a whole model in two buckets) are freed: unplanned, they stayed until
        the broker expired the stream, twice the broadcast's timeout. Not if receivers
        its learner called itself read it (``read_by``)."""
        if isinstance(payload, BucketStream) and not read_by:
            payload.broker.end.remote(payload.key, "the hub refused this version")

    async def close(self) -> None:
        self._serving.close()
        if self._broker is not None:
            ray.kill(self._broker)  # a dead one too: no error
            self._broker = None


class BucketServing:
    """Hub process: a bucketed version again, for a receiver that pulls it after the
    broadcast (joining, restarted). Its buckets are gone once its readers took them: a
    receiver that read it (one of ``receivers``, a planner's own, live map) serves it,
    as the puller's ``spec``, in a stream of its own that the puller reads from the
    broker as any object-store reader does."""

    def __init__(self, receivers: Mapping[str, ReceiverInfo]) -> None:
        self._receivers = receivers
        self._turn = 0  #: which holder serves the next late joiner
        self._serving: set[asyncio.Task] = set()

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """The payload ``receiver`` reads: a new stream for a bucketed version, served by
        one of its readers once one took it whole (awaited while it streams; the
        version's own stream for one of its readers, and when nobody can serve it: its
        fetch says the buckets are gone, and the next version comes), the learner's
        payload otherwise."""
        payload = update.payload
        if not isinstance(payload, BucketStream):
            return payload
        try:
            finished = await payload.broker.holders.remote(payload.key, receiver.worker)
        except ray.exceptions.RayActorError:
            return payload  # the broker is gone: its fetch says so; the next version comes
        if finished is None:
            return payload  # one of its readers: it reads the version's own stream
        holders = [
            self._receivers[w] for w in finished if w in self._receivers and w != receiver.worker
        ]
        if not holders:
            return payload
        holder = holders[self._turn % len(holders)]
        self._turn += 1
        key = StreamId(uuid.uuid4().hex, payload.key.count, payload.key.wait_s, served=True)
        served = BucketStream(payload.broker, key, payload.bucket_bytes)
        await payload.broker.readers.remote(key, [receiver.worker])
        request = ServeRequest(
            model_of_stream(update.model), update.version, spec, served, update.spec_digest
        )
        call = serve_call(holder.handle, holder.attachment, request)
        task = asyncio.ensure_future(self._served(call, served, holder.worker))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        return served

    async def _served(self, call: ray.ObjectRef, served: BucketStream, holder: str) -> None:
        """End ``served``'s stream with the reason if its holder could not serve it, so
        its reader hears it at once instead of waiting for buckets."""
        try:
            why = await call
        except ray.exceptions.RayError as err:
            why = f"{holder} failed while serving it ({type(err).__name__})"
        if why is not None:
            served.broker.end.remote(served.key, f"{holder} could not serve it: {why}")

    def close(self) -> None:
        for task in self._serving:
            task.cancel()


async def tell_broker(broker: Any, news: Literal["readmit", "drop_reader"], worker: str) -> Any:
    """Tell the hub's bucket ``broker`` (None: no bucketed version came yet) that
    ``worker`` joined (``"readmit"``: a stream opened before, from which its earlier
    process was dropped, may take it in) or left (``"drop_reader"``). The broker to keep:
    None once it is gone, with its streams (nothing there waits for anyone)."""
    if broker is None:
        return None
    try:
        await getattr(broker, news).remote(worker)
    except ray.exceptions.RayActorError:
        return None
    return broker
