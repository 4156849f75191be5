"""What an object-store version is on the wire, and how a reader gets its arrays back:
read by receivers and resource actors, unpickled (never opened) by the hub. No torch
here: the hub and the bucket broker need none to pass them on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from raysync.transports.parts import Parts


@dataclass(frozen=True)
class ObjectStorePayload:
    """The references to one version's objects
    (:func:`~raysync.transports.object_store.arrays.put_version`: one, or one per copy
    thread of the learner), in spec order. Nested in an Update, Ray passes them as
    refs."""

    refs: tuple[ray.ObjectRef, ...]

    def arrays(self, timeout_s: float | None = None) -> list[np.ndarray]:
        """Reader (blocking): every array of the version, in spec order, read-only views
        of the object store. Ray's errors as they come (``GetTimeoutError`` included)."""
        values = ray.get(list(self.refs), timeout=timeout_s)
        return [array for value in values for array in arrays_of(value)]

    async def arrays_async(self) -> list[np.ndarray]:
        """:meth:`arrays`, awaited (an async actor's event loop must not block)."""
        values = await asyncio.gather(*self.refs)
        return [array for value in values for array in arrays_of(value)]


@dataclass(frozen=True)
class InlinePayload:
    """A small version carried in the update itself, as the arrays
    :func:`~raysync.transports.object_store.arrays.as_array` makes, in spec order: what a
    learner writes into its compiled-graph channel (:mod:`raysync.learner_channel`). The
    receiver copies them out at once (they are views of the channel's buffer, which the
    next version overwrites)."""

    arrays: tuple[np.ndarray, ...]


async def read_put(source: ObjectStorePayload | Parts, timeout_s: float) -> list[np.ndarray]:
    """The arrays of a version's put (see
    :func:`~raysync.transports.object_store.arrays.as_array`), in spec order; of every
    part's put for a version sent in parts. Awaited in an async resource actor (a
    blocking get would hold its event loop); ``asyncio.TimeoutError`` after
    ``timeout_s``."""
    if isinstance(source, Parts):
        per_part = await asyncio.wait_for(
            asyncio.gather(*(part.payload.arrays_async() for part in source.parts)), timeout_s
        )
        return source.in_spec_order(per_part)
    return await asyncio.wait_for(source.arrays_async(), timeout_s)


#: The first item of a :func:`~raysync.transports.object_store.arrays.put_arrays`
#: object: for each array put in chunks, the place of its first chunk among the
#: object's buffers, their count, and the array's dtype (``numpy.dtype.str``) and shape.
Join = tuple[int, int, str, tuple[int, ...]]
Joins = tuple[Join, ...]


def arrays_of(value: Sequence[Any]) -> list[np.ndarray]:
    """Reader: the arrays a :func:`~raysync.transports.object_store.arrays.put_arrays`
    object holds, given what ``ray.get`` (or awaiting its ref) returned: read-only views
    of the object store, each in its shape and dtype."""
    joins: Joins = value[0]
    buffers = [np.asarray(buffer) for buffer in value[1:]]
    if not joins:
        return buffers
    arrays: list[np.ndarray] = []
    done = 0
    for first, count, dtype, shape in joins:
        arrays.extend(buffers[done:first])
        arrays.append(_joined(buffers[first : first + count], np.dtype(dtype), shape))
        done = first + count
    arrays.extend(buffers[done:])
    return arrays


def _joined(chunks: list[np.ndarray], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """One array of ``dtype`` and ``shape`` over ``chunks`` (uint8, in order): a view
    where Ray laid them back to back in the object, as it does, else a copy. The view's
    base is the first chunk, which holds the object. Back to back is checked by the last
    chunk's address alone: Ray lays the buffers in order, so the gaps between them add
    up to that address's distance from where it would lie without any."""
    total = sum(chunk.nbytes for chunk in chunks)
    first, last = chunks[0], chunks[-1]
    if _address(last) - _address(first) == total - last.nbytes:
        whole = np.lib.stride_tricks.as_strided(
            first, shape=(total,), strides=(1,), writeable=False
        )
    else:
        whole = np.concatenate(chunks)
        whole.setflags(write=False)  # as the views are: nobody writes what it read
    return whole.view(dtype).reshape(shape)


def _address(array: np.ndarray) -> int:
    """Where ``array``'s first byte lies."""
    return int(array.__array_interface__["data"][0])
