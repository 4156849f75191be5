"""Relaying a bucketed version: a resource actor reads the learner's bucket stream and
passes each bucket on (``rpc``'s agent, one call per receiver; ``distributed``'s rank 0,
one collective).

A version that travels in buckets leaves the learner as the object store's bucket stream
(:mod:`raysync.transports.object_store.buckets`); sent in parts, each part is a stream
of its own, or a whole put if it fit in one bucket. :func:`relay_plan` numbers every
bucket of the version — part after part — and says where each of its pieces sits in the
receivers' staging buffer (the whole version's packed layout): the relay and the
receivers compute it alike from the payload and the spec. Who calls what:

* hub process: the planner names the relay (:func:`relay_reader`) a reader of every
  stream (:func:`~raysync.transports.object_store.bucket_stream.streams_of`) and tells
  receivers how many buckets come (:func:`bucket_count`);
* the relay (its event loop): :func:`read_buckets` reads bucket ``k + 1`` while the
  previous one is passed on, and is done with ``k`` once it asks for ``k + 2``, so the
  object store holds at most two; then
  :func:`finish`, naming the receivers that got every bucket (they may serve the
  version to a late joiner);
* receiver process: copies each bucket's pieces to their places (:func:`place`); a
  receiver that lost its relay midway (a collective broke) reads the remaining buckets
  itself with :func:`read_bucket_now`, as an object-store reader would — the relay made
  it a reader of the stream before letting go of the bucket it stopped at
  (:func:`adopt`) — and then tells the broker it is done with them (:func:`finish`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.buckets import BucketPlan
from raysync.transports.object_store.bucket_stream import BucketStream, parts_of, streams_of
from raysync.transports.object_store.wire import arrays_of, read_put

T = TypeVar("T")


def relay_reader(relay: str) -> str:
    """How relay ``relay`` (a resource actor's key) names itself to the bucket broker."""
    return f"relay-{relay}"


@dataclass(frozen=True)
class RelayedBucket:
    """Bucket ``index`` of ``payload`` (a stream; or a part's whole put, ``index`` 0):
    its pieces' places in the staging buffer, as (offset, bytes)."""

    payload: Any
    index: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.pieces)


def relay_plan(source: object, spec: WeightSpec) -> list[RelayedBucket]:
    """Every bucket of a bucketed version, in the order a relay passes them on. ``spec``:
    the whole version, as it travels (the wire dtype's)."""
    offset_of = dict(zip(spec.names, PackedLayout.of(spec).offsets, strict=True))
    plan: list[RelayedBucket] = []
    for payload, part_spec in parts_of(source):
        part_spec = part_spec or spec
        offsets = [offset_of[name] for name in part_spec.names]
        if not isinstance(payload, BucketStream):
            pieces = tuple(zip(offsets, (t.nbytes for t in part_spec.tensors), strict=True))
            plan.append(RelayedBucket(payload, 0, pieces))
            continue
        cut = BucketPlan.of(part_spec, payload.bucket_bytes)
        for index in range(cut.count):
            pieces = tuple((offsets[p.tensor] + p.start, p.nbytes) for p in cut.pieces(index))
            plan.append(RelayedBucket(payload, index, pieces))
    return plan


def bucket_count(source: object) -> int:
    """How many buckets a relay passes on for a bucketed version (``len`` of its
    :func:`relay_plan`, read off the payload: the hub plans without cutting it)."""
    return sum(
        payload.key.count if isinstance(payload, BucketStream) else 1
        for payload, _ in parts_of(source)
    )


async def read_bucket(
    bucket: RelayedBucket, reader: str, timeout_s: float, copied: int | None = None
) -> list[torch.Tensor]:
    """``bucket``'s pieces (uint8, read-only views of the object store), taken from the
    broker as ``reader`` — or read from the part's put within ``timeout_s``. ``copied``:
    how many buckets of its stream the reader is done with (default: every one before
    it). Awaited on an event loop; TransportError if it cannot be had."""
    payload, index = bucket.payload, bucket.index
    if not isinstance(payload, BucketStream):
        arrays = await _read(read_put(payload, timeout_s), "a part sent whole")
        return [_bytes(a) for a in arrays]
    count = payload.key.count
    what = f"bucket {index} of {count}"
    asked = payload.broker.take.remote(payload.key, index, reader, (), copied)
    boxed, why = await _read(asked, what)
    if why is not None:
        raise TransportError(f"{what}: {why}")
    return [_bytes(a) for a in arrays_of(await _read(boxed[0], what))]


def read_bucket_now(bucket: RelayedBucket, reader: str, timeout_s: float) -> list[torch.Tensor]:
    """:func:`read_bucket`, blocking: for a receiver's ``fetch`` (a worker thread)."""
    payload, index = bucket.payload, bucket.index
    what = (
        "a part sent whole"
        if not isinstance(payload, BucketStream)
        else (f"bucket {index} of {payload.key.count}")
    )
    try:
        if not isinstance(payload, BucketStream):
            return [_bytes(a) for a in payload.arrays(timeout_s)]
        boxed, why = ray.get(payload.broker.take.remote(payload.key, index, reader))
        if why is not None:
            raise TransportError(f"{what}: {why}")
        return [_bytes(a) for a in arrays_of(ray.get(boxed[0], timeout=timeout_s))]
    except ray.exceptions.RayError as err:  # GetTimeoutError included
        raise TransportError(
            f"could not read {what} ({type(err).__name__}); the learner or the hub's "
            "bucket broker may have died"
        ) from err


async def read_buckets(
    plan: Sequence[RelayedBucket], reader: str, timeout_s: float
) -> AsyncGenerator[tuple[RelayedBucket, list[torch.Tensor]], None]:
    """The relay: every bucket of ``plan`` (a :func:`relay_plan`) with its pieces, in
    order. Bucket ``k + 1``
    is read while the caller passes bucket ``k`` on (the broker hears that the relay
    still holds ``k``), and the relay is done with ``k`` once it asks for ``k + 2``: the
    object store still holds two buckets of a stream at most."""
    if not plan:
        return
    reading = asyncio.ensure_future(read_bucket(plan[0], reader, timeout_s))
    try:
        for number, bucket in enumerate(plan):
            pieces = await reading
            if number + 1 < len(plan):
                following = plan[number + 1]
                held = bucket.index if following.payload is bucket.payload else None
                reading = asyncio.ensure_future(read_bucket(following, reader, timeout_s, held))
            yield bucket, pieces
    finally:
        if not reading.done():
            reading.cancel()
        elif not reading.cancelled():
            reading.exception()  # retrieved: the caller stopped, or it raised above


async def adopt(source: object, readers: Sequence[str]) -> None:
    """The relay, before it gives a version up midway: ``readers`` read its streams
    themselves from the bucket it stopped at (the broker keeps it for them)."""
    await asyncio.gather(
        *(stream.broker.readers.remote(stream.key, list(readers)) for stream in streams_of(source))
    )


def finish(source: object, reader: str, passed_on: Sequence[str] = ()) -> None:
    """Done with ``source``'s streams as ``reader`` (every bucket passed on, or given
    up); ``passed_on`` got every bucket of them."""
    for stream in streams_of(source):
        stream.broker.take.remote(stream.key, stream.key.count, reader, tuple(passed_on))


def leave(source: object, reader: str) -> None:
    """``reader`` gives ``source``'s streams up (its read of a bucket failed): it does
    not hold the version, so it is not offered to serve it to a late joiner."""
    for stream in streams_of(source):
        stream.broker.leave.remote(stream.key, reader)


def place(
    buffer: torch.Tensor, places: Sequence[tuple[int, int]], pieces: Sequence[torch.Tensor]
) -> None:
    """Receiver: copy a bucket's pieces to their ``places`` ((offset, bytes), a
    :attr:`RelayedBucket.pieces`) in the staging ``buffer``; ``pieces`` holds one tensor
    per place, or all of them back to back in one."""
    if len(pieces) == 1 and len(places) > 1:
        flat, start = pieces[0].reshape(-1).view(torch.uint8), 0
        for at, size in places:
            buffer[at : at + size].copy_(flat[start : start + size])
            start += size
        return
    for (at, size), piece in zip(places, pieces, strict=True):
        buffer[at : at + size].copy_(piece.reshape(-1).view(torch.uint8))


async def _read(awaitable: Awaitable[T], what: str) -> T:
    try:
        return await awaitable
    except (ray.exceptions.RayError, asyncio.TimeoutError) as err:
        raise TransportError(
            f"could not read {what} ({type(err).__name__}); the learner or the hub's "
            "bucket broker may have died"
        ) from err


def _bytes(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only views of the object store; only read from.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).reshape(-1).view(torch.uint8)
