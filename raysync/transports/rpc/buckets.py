"""Bucketed versions over RPC: one call per bucket per receiver, a few buckets in flight.

A version larger than ``bucket_mb`` leaves the learner as an object-store bucket stream
(:mod:`raysync.transports.object_store.buckets`: at most two buckets in the object store
at once). Who does what, per version:

* hub process (``RpcPlanner``): names the agent (:func:`agent_reader`) the stream's
  reader at the hub's bucket broker, and tells each receiver how many buckets land;
* RPC agent: :func:`read_buckets` takes bucket ``k`` from the broker (zero-copy on its
  node), the agent calls ``land_bucket`` on every receiver still in the version, waits
  for those calls, then takes bucket ``k + 1`` — which tells the broker it is done with
  ``k``, so the learner may put ``k + 2``. A receiver whose call fails gets no further
  bucket of that version and fails alone; a stream that ends early (the learner died)
  is abandoned on every receiver at once. At the end the agent tells the broker which
  receivers got every bucket: they may serve the version to a late joiner;
* receiver process: ``land_bucket`` (the RPC thread pool) copies each bucket into the
  version's staging buffer (its packed layout, reused across versions); ``fetch``
  waits until every bucket landed and returns views of that buffer. The model changes
  at its safe point from the buffer, so a version whose later bucket fails never
  reaches it.

A receiver that pulls a bucketed version after its broadcast (joining, restarted)
reads it from the broker as object-store receivers do, served by a receiver that got it
(:class:`~raysync.transports.object_store.planner.BucketServing`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.buckets import BucketPlan
from raysync.transports.object_store import BucketStream, read_put
from raysync.transports.parts import Parts

T = TypeVar("T")


def agent_reader(key: str) -> str:
    """How the agent of the RPC group ``key`` names itself to the bucket broker."""
    return f"rpc-agent-{key}"


def _parts_of(source: object) -> list[object]:
    """The learner payloads of a version: one per part if sent in parts."""
    return [p.payload for p in source.parts] if isinstance(source, Parts) else [source]


def is_bucketed(source: object) -> bool:
    """Whether a version (or some part of it) travels in buckets."""
    return any(isinstance(payload, BucketStream) for payload in _parts_of(source))


def bucket_count(source: object) -> int:
    """How many buckets of a bucketed version land in each receiver: every stream's,
    and one for each part that was small enough to travel whole."""
    return sum(
        payload.key.count if isinstance(payload, BucketStream) else 1
        for payload in _parts_of(source)
    )


def streams_of(source: object) -> list[BucketStream]:
    """The bucket streams of a version (one per bucketed part if sent in parts)."""
    return [payload for payload in _parts_of(source) if isinstance(payload, BucketStream)]


@dataclass(frozen=True)
class Bucket:
    """One bucket as the agent sends it: its pieces and where each sits in the receiver's
    staging buffer (the whole version's packed layout)."""

    ats: list[int]
    tensors: list[torch.Tensor]


async def read_buckets(
    source: BucketStream | Parts, spec: WeightSpec, reader: str, timeout_s: float
) -> AsyncIterator[Bucket]:
    """Agent (its event loop): every bucket of ``source``, in order, each taken from the
    broker once the previous one is done with (the caller sends it before asking for
    the next); a part that travels whole is one bucket, read within ``timeout_s``.
    ``spec``: the whole version, as it travels. TransportError if a bucket cannot be
    had."""
    offset_of = dict(zip(spec.names, PackedLayout.of(spec).offsets, strict=True))
    parts = (
        [(source, spec)]
        if not isinstance(source, Parts)
        else [(part.payload, part.spec) for part in source.parts]
    )
    for payload, part_spec in parts:
        offsets = [offset_of[name] for name in part_spec.names]
        if not isinstance(payload, BucketStream):
            arrays = await _read(read_put(payload, timeout_s), "a part sent whole")
            yield Bucket(offsets, _tensors(arrays))
            continue
        plan = BucketPlan.of(part_spec, payload.bucket_bytes)
        for index in range(plan.count):
            what = f"bucket {index} of {plan.count}"
            boxed, why = await _read(payload.broker.take.remote(payload.key, index, reader), what)
            if why is not None:
                raise TransportError(f"{what}: {why}")
            arrays = await _read(boxed[0], what)
            ats = [offsets[p.tensor] + p.start for p in plan.pieces(index)]
            yield Bucket(ats, _tensors(arrays))


async def _read(awaitable: Awaitable[T], what: str) -> T:
    try:
        return await awaitable
    except (ray.exceptions.RayError, asyncio.TimeoutError) as err:
        raise TransportError(
            f"could not read {what} ({type(err).__name__}); the learner or the hub's "
            "bucket broker may have died"
        ) from err


def _tensors(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        # Read-only views of the object store; RPC only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [torch.from_numpy(a) for a in arrays]


def finish(source: object, reader: str, passed_on: Sequence[str]) -> None:
    """Agent: done with ``source``'s streams (every bucket sent, or given up);
    ``passed_on`` got every bucket of them."""
    for stream in streams_of(source):
        stream.broker.take.remote(stream.key, stream.key.count, reader, tuple(passed_on))
