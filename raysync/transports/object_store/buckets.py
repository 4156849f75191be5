"""Bucketed versions through the object store: a few buckets in flight, whatever the size.

A version larger than ``bucket_mb`` moves as :mod:`raysync.transports.buckets` cuts
it. Who does what, per version:

* learner process (``ObjectStoreSender``): :func:`start_stream` makes the payload, a
  :class:`BucketStream`; :func:`stream_out` (from ``submitted``) packs bucket ``k``
  from the learner's own tensors — casting each piece to the wire dtype as it goes —
  into one ``ray.put``, hands its ref to the hub's :class:`BucketBroker` and, before
  packing bucket ``k + 1``, waits until every reader has copied bucket ``k - 1``. So
  the object store holds at most :data:`BUCKETS_IN_FLIGHT` buckets of the version and
  the learner nothing beyond its model; the broadcast call returns once the last
  bucket is put (the learner's weights are the source until then);
* hub process (``ObjectStorePlanner``): tells the broker which receivers read the
  version, and which receivers died or left;
* receiver process (``ObjectStoreReceiver``): :func:`fetch_stream` copies each bucket
  into a staging buffer of the version's packed layout (reused across versions),
  outside the safe point, two asks ahead of its copying: once it has copied bucket
  ``k`` it asks the broker for ``k + 2`` (:func:`buckets_of`, which ``nixl`` and
  ``rdt`` receivers use too). The model
  changes at its safe point as for a whole version, from that buffer: a version whose
  later bucket fails never reaches the model.

Where the bytes live between broadcasts: in the receivers' models, and nowhere else
whole (the learner's tensors move on). A receiver that joins (or restarts) after a
bucketed broadcast reads the version from one that applied it: the planner makes it a
new stream and asks that receiver to :func:`serve_stream` its model into it, as the
learner would, holding its model steady meanwhile. If none can (none left, or each has
moved on), the newcomer is behind until the next broadcast, which reaches it anyway.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, VersionDone
from raysync.transports.buckets import BucketPlan
from raysync.transports.object_store.arrays import put_arrays
from raysync.transports.object_store.bucket_stream import (
    BUCKETS_IN_FLIGHT,
    BucketStream,
    SenderActor,
    StreamId,
)
from raysync.transports.object_store.wire import arrays_of
from raysync.transports.staging import StagingPool

#: Seconds between the learner's looks at whether its broadcast already ended (a
#: refused version, receivers that all failed) while it waits for room.
_LOOK_S = 0.5


@dataclass
class Outgoing:
    """A bucketed version the learner (or a receiver serving a late joiner) has yet to
    stream (``submitted``)."""

    sources: list[torch.Tensor]  #: the learner's tensors, in spec order
    plan: BucketPlan
    #: The last source flattened (its index), while its pieces are sent.
    _flat: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    def flat(self, tensor: int) -> torch.Tensor:
        """Source ``tensor`` as one flat run: a view where it is contiguous, else one
        copy kept while its pieces go (a tensor's pieces come bucket after bucket:
        flattened per bucket, a non-contiguous one spread over k buckets was copied k
        times, its whole size each)."""
        if self._flat is None or self._flat[0] != tensor:
            self._flat = (tensor, self.sources[tensor].reshape(-1))
        return self._flat[1]


def start_stream(
    broker: Any,
    tensors: Mapping[str, torch.Tensor],
    spec: WeightSpec,
    bucket_bytes: int,
    stall_s: float,
) -> tuple[BucketStream, Outgoing]:
    """Learner: the payload of a bucketed version of ``spec`` (the wire's), and what
    :func:`stream_out` needs to send it."""
    plan = BucketPlan.of(spec, bucket_bytes)
    key = StreamId(uuid.uuid4().hex, plan.count, 2 * stall_s, sender=this_actor())
    payload = BucketStream(broker, key, bucket_bytes)
    return payload, Outgoing([tensors[name] for name in spec.names], plan)


def stream_out(payload: BucketStream, outgoing: Outgoing, done: VersionDone) -> None:
    """Learner: put the buckets one after another, each once there is room; stop early
    if the broadcast ended (refused, or no reader left)."""
    broker, key = payload.broker, payload.key
    sender = this_actor()
    for index in range(key.count):
        doing = "waiting for room for"
        try:
            if not room_or_end(broker, key, index, done):
                return
            doing = "putting"
            ref = put_arrays(bucket_arrays(outgoing, index))
        except BaseException as err:  # interrupted or cancelled while it waits, too
            # Its readers stop waiting now, told why, instead of timing out on a
            # bucket that never comes.
            broker.end.remote(key, f"the learner failed {doing} bucket {index}: {err!r}")
            raise
        broker.offer.remote(key, index, [ref], sender)
        del ref  # the broker's reference keeps it until every reader took it


def serve_stream(
    payload: BucketStream, tensors: Mapping[str, torch.Tensor], spec: WeightSpec
) -> None:
    """Receiver holding the version: send its own ``tensors`` as ``spec`` (casting to the
    wire dtype, exact for values that came through it) through ``payload``; returns once
    the last bucket is put, or the reader is gone."""
    plan = BucketPlan.of(spec, payload.bucket_bytes)
    outgoing = Outgoing([tensors[name] for name in spec.names], plan)
    stream_out(payload, outgoing, _NEVER_DONE)


class _NeverDone(VersionDone):
    """A served version has no broadcast to end: the broker says when its reader is gone."""

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError("a served version ends when its reader is done")


_NEVER_DONE = _NeverDone()


def bucket_arrays(outgoing: Outgoing, index: int) -> list[np.ndarray]:
    """Bucket ``index``'s pieces as uint8 arrays, cast to the wire dtype where the
    learner's tensor has another (a piece-sized copy; the rest are views)."""
    arrays = []
    for piece in outgoing.plan.pieces(index):
        wire = outgoing.plan.spec.tensors[piece.tensor].dtype
        flat = outgoing.flat(piece.tensor)
        chunk = flat[piece.start // wire.itemsize : piece.end // wire.itemsize]
        if chunk.dtype != wire:
            chunk = chunk.to(wire)
        arrays.append(chunk.view(torch.uint8).cpu().numpy())
    return arrays


def this_actor() -> SenderActor | None:
    """This process's actor, for the broker to watch the streams it sends; None in a
    driver."""
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    return None if actor_id is None else SenderActor(actor_id, context.get_worker_id())


def wait_for_room(
    broker: Any,
    key: StreamId,
    index: int,
    done: VersionDone,
    until: VersionDone | None = None,
) -> str | None:
    """Learner: wait until bucket ``index`` of ``key``'s stream may be put (the broker's
    ``room``). None, or why the stream cannot go on (``done``: its broadcast ended).
    ``until``: stop waiting (None) once that broadcast ended too (the room asked for
    is in its stream, which then no reader holds up)."""
    room = broker.room.remote(key, index)
    while not ray.wait([room], timeout=_LOOK_S)[0]:
        if done.ended():
            return "the broadcast ended before every bucket was sent"
        if until is not None and until.ended():
            return None
    return ray.get(room)


def room_or_end(broker: Any, key: StreamId, index: int, done: VersionDone) -> bool:
    """Learner: whether bucket ``index`` of ``key``'s stream may be put, once it may (the
    first ``BUCKETS_IN_FLIGHT`` at once, each later one once the broker has room); if
    it may not, the stream is ended here and its readers are told why."""
    if index < BUCKETS_IN_FLIGHT:  # no wait: put unless the broadcast ended (refused)
        if not done.ended():
            return True
        why: str | None = "the broadcast ended before every bucket was sent"
    else:
        why = wait_for_room(broker, key, index, done)
    if why is not None:
        broker.end.remote(key, why)
    return why is None


def fetch_stream(
    payload: BucketStream, spec: WeightSpec, worker: str, pool: StagingPool[torch.Tensor]
) -> Sequence[torch.Tensor]:
    """Receiver ``worker``: copy every bucket into a staging buffer; its tensors, in
    spec order. TransportError if a bucket cannot be had (the buffer is freed)."""
    plan = BucketPlan.of(spec, payload.bucket_bytes)

    def write(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
        for index, boxed in buckets_of(payload, plan.count, worker):
            arrays = _read_bucket(boxed[0], index, plan.count, payload.key.served)
            _copy_bucket(buffer, plan, index, arrays)
        return pool.views(buffer, plan.layout)

    return pool.fill(spec, write)


def buckets_of(payload: BucketStream, count: int, worker: str) -> Iterator[tuple[int, Any]]:
    """Receiver ``worker``: each bucket's box from the broker, in order (``(index,
    boxed)``); the caller reads bucket ``k`` before it asks for the next. Done once
    every bucket was read: tells the broker. TransportError, naming the bucket, for one
    that cannot be had.

    Two asks stay ahead of the caller: once it has read bucket ``k`` it asks for bucket
    ``k + 2`` (saying it copied ``k``) while the answer about ``k + 1`` is on its way or
    already here. The broker lets the learner reuse bucket ``k``'s slot for bucket
    ``k + 2`` when every reader has said so, so that word leaves as soon as the read
    ends rather than with the next answer: a learner and readers that move bytes fast
    wait for two of Ray's messages per bucket instead of four
    (``docs/buckets.md``, "What a bucket costs beyond its bytes")."""
    broker, key = payload.broker, payload.key
    asked = {index: broker.take.remote(key, index, worker, (), 0) for index in range(min(2, count))}
    for index in range(count):
        boxed, why = _answer(asked.pop(index))
        if why is not None:
            raise TransportError(f"bucket {index} of {count}: {why}")
        yield index, boxed
        if index + 2 < count:
            asked[index + 2] = broker.take.remote(key, index + 2, worker, (), index + 1)
    broker.take.remote(key, count, worker)


def give_up(payload: BucketStream, worker: str) -> None:
    """Receiver ``worker``: it will not read (the rest of) ``payload``'s stream (it
    refused the version, or a read failed): the broker stops waiting for it at once,
    instead of holding the learner and every other reader for the stream's stall."""
    payload.broker.leave.remote(payload.key, worker)


def decline_stream(payload: BucketStream, worker: str) -> None:
    """Receiver ``worker``: it will not read ``payload``, the stream the hub planned a
    pull or a welcome's catch-up of a bucketed version with (the pull stopped waiting
    for it, or the receiver turns the catch-up down). A stream served for that read
    alone (``key.served``) is given up (:func:`give_up`): its broker and the receiver
    serving it stop waiting for this one. The version's own stream (the hub's answer
    while nobody who read it whole can serve it) is left alone: that answer named no
    reader, and the broadcast of the version may be delivering that very stream to
    ``worker`` (given up, the broker drops ``worker`` from it, and that read fails)."""
    if payload.key.served:
        give_up(payload, worker)


def closed_before_sent(payload: BucketStream, sender: str) -> TransportError:
    """Learner: ``payload`` was handed to the hub, and then its sender (``sender``: the
    transport's name) closed before streaming it (another thread released the handle,
    or the hub went). Its readers hear so from the broker now; the error to raise."""
    why = f"the {sender} sender closed before bucketed version {payload.key} was sent"
    payload.broker.end.remote(payload.key, why)
    return TransportError(why)


def _answer(asked: ray.ObjectRef) -> tuple[Any, str | None]:
    """The broker's answer to a ``take``; its death, or a ``take`` that raised, is the
    stream's end (the caller names the bucket)."""
    try:
        return ray.get(asked)
    except ray.exceptions.RayActorError as err:
        return None, f"the hub's bucket broker is gone ({type(err).__name__})"
    except ray.exceptions.RayError as err:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        return None, f"the hub's bucket broker could not answer ({lines[-1].strip()})"


def staging_buffer(spec: WeightSpec) -> torch.Tensor:
    """A receiver's staging buffer for versions of ``spec`` (the pool's ``create``)."""
    return torch.empty(PackedLayout.of(spec).nbytes, dtype=torch.uint8)


def _read_bucket(
    ref: ray.ObjectRef, index: int, count: int, served: bool
) -> Sequence[np.ndarray]:
    try:
        return arrays_of(ray.get(ref))
    except ray.exceptions.RayError as err:
        sender = "receiver serving the version" if served else "learner"
        raise TransportError(
            f"could not read bucket {index} of {count} from the object store "
            f"({type(err).__name__}); the {sender} that put it may have died"
        ) from err


def _copy_bucket(
    buffer: torch.Tensor, plan: BucketPlan, index: int, arrays: Sequence[np.ndarray]
) -> None:
    with warnings.catch_warnings():
        # The arrays map the object store read-only; they are only read from.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for piece, array in zip(plan.pieces(index), arrays, strict=True):
            buffer[piece.at : piece.at + piece.nbytes].copy_(torch.from_numpy(array))
