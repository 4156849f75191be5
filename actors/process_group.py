"""ProcessGroupActor: rank 0 of a hub's torch.distributed group, and its rendezvous.

Started by :class:`raysync.transports.distributed.DistributedPlanner` in the hub
process, one per hub, and killed with it. It owns

* the rendezvous: a ``TCPStore`` master on a socket this actor binds to its node's IP
  and a free port the OS picks (handed to the store as ``master_listen_fd``, so the
  store does not listen on every interface), for the actor's lifetime; each generation
  uses its own random key prefix under it;
* rank 0 of the current generation: a ``ProcessGroupGloo``/``ProcessGroupNCCL``
  object, never the process's default group;
* the send buffer: the learner's object-store copy packed behind a header, reused while
  its size stays the same; for a bucketed version, one bucket at a time
  (:mod:`raysync.transports.bucket_relay`: one collective per bucket).

``broadcast`` runs one collective in a worker thread (the event loop stays free for
``describe``) and returns ``None`` or the reason it failed. A failure shuts the
group down at once, so members still blocked in it fail fast instead of waiting out
their timeout; the planner then starts a new generation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raysync.bounded import keep_newest
from raysync.copies import as_tensor
from raysync.layout import PackedLayout
from raysync.transports.base import TransportError
from raysync.transports.bucket_relay import (
    adopt,
    finish,
    read_buckets,
    relay_plan,
)
from raysync.transports.distributed import (
    HEADER_BYTES,
    BroadcastJob,
    Generation,
    StoreAddress,
    absent_members,
    bucket_timeout_s,
    call_off,
    collective_bytes,
    forget_rendezvous,
    header,
    join_group,
    run_broadcast,
    staging_device,
)
from raysync.transports.object_store.bucket_stream import BucketStream, is_bucketed
from raysync.transports.object_store.wire import read_put
from raysync.transports.options import DistributedOptions
from raysync.transports.process_groups import bound_master_store, node_ip

from .heap import settle_heap

#: Failed rendezvous whose keys rank 0 keeps (see ``_rendezvous_failed``).
_FAILED_RENDEZVOUS_KEPT = 8


@dataclass(frozen=True)
class GroupStatus:
    """What ``describe`` reports: the current generation and how collectives went."""

    address: StoreAddress
    generation: int  #: 0 before the first collective
    members: tuple[str, ...]
    collectives: int  #: collectives completed, all generations
    failures: tuple[str, ...]  #: why collectives failed, oldest first (last 16)


class ProcessGroupActor:
    """See module docstring. Async actor; collectives run one at a time in a thread."""

    def __init__(self, settings: DistributedOptions) -> None:
        self._settings = settings
        host = node_ip()
        port, self._store = bound_master_store(host, settings.timeout_s)
        self._address = StoreAddress(host, port, uuid.uuid4().hex)
        self._caller: Any = None  #: a second client of the store, to call generations off
        #: the generations (the last ones) rank 0 joined and whose rendezvous keys it
        #: deleted: one called off after that goes on (its members joined), and writing
        #: its "go" key again would leave it in the store for the hub's life
        self._rendezvous_over: collections.deque[int] = collections.deque(maxlen=256)
        self._rendezvous_lock = threading.Lock()  #: the keys' deletion vs a call-off
        #: the last generations whose rendezvous failed, keys kept: a member that comes
        #: late reads there why and fails at once (an older one's keys are deleted)
        self._failed_rendezvous: collections.deque[Generation] = collections.deque()
        self._lock = threading.Lock()  #: the group and its buffer, in worker threads
        self._jobs = asyncio.Lock()  #: one version's collectives at a time
        self._generation: Generation | None = None
        self._group: Any = None  #: the generation's process group; None: none, or it broke
        self._buffer: torch.Tensor | None = None
        self._collectives = 0
        self._failures: list[str] = []
        #: generation number -> the members that never came to its rendezvous, which
        #: failed (the last :data:`_FAILED_RENDEZVOUS_KEPT`): see :meth:`absent_from`
        self._absent: dict[int, tuple[str, ...]] = {}
        settle_heap()

    async def store_address(self) -> StoreAddress:
        return self._address

    async def broadcast(self, job: BroadcastJob, reader: str) -> str | None:
        """Run collective ``job.seq`` of ``job.generation`` as rank 0 (one per bucket for
        a bucketed version, read from the hub's bucket broker as ``reader``); None or
        why not."""
        async with self._jobs:
            if is_bucketed(job.source):
                return await self._relay(job, reader)
            assert not isinstance(job.source, BucketStream)  # is_bucketed says so
            arrays: list[np.ndarray] | BaseException
            try:  # read the learner's copy here: a blocking get would hold the event loop
                arrays = await read_put(job.source, job.generation.settings.timeout_s)
            except Exception as err:
                arrays = err  # the collective fails with it, so members stop waiting at once
            return await asyncio.to_thread(self._broadcast, job, arrays)

    async def _relay(self, job: BroadcastJob, reader: str) -> str | None:
        """One collective per bucket (:mod:`raysync.transports.bucket_relay`), bucket
        ``k + 1`` read while bucket ``k``'s collective runs. If one fails, the members read
        the rest of the version from the broker themselves (they are made its readers
        first), so a dead or busy member costs the others nothing.

        The broker drops a reader that holds the stream up; this one is the stream's
        only reader until it fails, so it must fail first: it joins the generation
        before it takes a bucket, and each bucket's collective waits
        :func:`~raysync.transports.distributed.group.bucket_timeout_s` at most."""
        settings = job.generation.settings
        plan = relay_plan(job.source, job.spec)
        size = collective_bytes(job.source, job.spec)
        limit_s = bucket_timeout_s(settings, job.source)
        passed_on: tuple[str, ...] = ()
        number = 0  #: of the bucket being broadcast, from 1
        try:
            # Within a bucket's limit too: the stream's other readers (another
            # transport's) may take the first buckets meanwhile, and the broker drops
            # this reader after its stall time and frees them: the members, adopted
            # after, would find them gone and fail with the late one.
            joined = await asyncio.to_thread(
                self._collective, job, "its rendezvous", None, rendezvous_s=limit_s
            )
            if joined is not None:
                await adopt(job.source, job.generation.members)
                return joined
            async with contextlib.aclosing(
                read_buckets(plan, reader, settings.timeout_s)
            ) as buckets:
                try:
                    async for _, pieces in buckets:
                        number += 1
                        reason = await asyncio.to_thread(
                            self._broadcast_bucket, job, number, size, pieces, limit_s
                        )
                        if reason is not None:
                            await adopt(job.source, job.generation.members)
                            return reason
                except TransportError as err:
                    # The collective fails with it, so members stop waiting at once.
                    reason = await asyncio.to_thread(
                        self._broadcast_bucket, job, number + 1, size, err, limit_s
                    )
                    await adopt(job.source, job.generation.members)
                    return reason
            passed_on = job.generation.members
            return None
        finally:
            finish(job.source, reader, passed_on)

    async def call_off(self, generation: Generation, why: str) -> None:
        """The hub: a member of ``generation`` will never join it (it died, or left).
        Every member still waiting at its rendezvous, this actor's own collective
        among them, stops waiting and fails at once (then reads from the broker or the
        learner's copy) instead of waiting out the timeout."""
        await asyncio.to_thread(self._call_off, generation, why)

    async def absent_from(self, generation: int) -> tuple[str, ...]:
        """The hub, once a collective of ``generation`` failed: the members that never
        came to its rendezvous (none if it did not fail there, or long ago)."""
        return self._absent.get(generation, ())

    async def describe(self) -> GroupStatus:
        generation = self._generation
        return GroupStatus(
            address=self._address,
            generation=0 if generation is None else generation.number,
            members=() if generation is None else generation.members,
            collectives=self._collectives,
            failures=tuple(self._failures),
        )

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    # -- worker thread ---------------------------------------------------------------------
    def _broadcast(self, job: BroadcastJob, arrays: list[np.ndarray] | BaseException) -> str | None:
        return self._collective(job, f"collective {job.seq}", lambda: self._pack(job, arrays))

    def _broadcast_bucket(
        self,
        job: BroadcastJob,
        number: int,
        size: int,
        pieces: list[torch.Tensor] | BaseException,
        limit_s: float,
    ) -> str | None:
        """Bucket ``number`` (from 1) of ``job`` as one collective of ``size`` bytes: the
        header, then the bucket's pieces back to back; failed after ``limit_s``."""

        def fill() -> torch.Tensor:
            if isinstance(pieces, BaseException):
                raise RuntimeError(f"could not read the bucket: {pieces}") from pieces
            generation = job.generation
            buffer = self._send_buffer(size, staging_device(generation.settings))
            buffer[:HEADER_BYTES].copy_(header(generation.number, job.seq, size, number))
            at = HEADER_BYTES
            for piece in pieces:
                buffer[at : at + piece.numel()].copy_(piece)
                at += piece.numel()
            return buffer

        what = f"collective {job.seq} (bucket {number})"
        return self._collective(job, what, fill, agree=True, timeout_s=limit_s)

    def _collective(
        self,
        job: BroadcastJob,
        what: str,
        fill: Callable[[], torch.Tensor] | None,
        agree: bool = False,
        timeout_s: float | None = None,
        rendezvous_s: float | None = None,
    ) -> str | None:
        """Join ``job``'s generation if need be (waiting ``rendezvous_s`` at most for its
        members, if given) and broadcast the buffer ``fill`` makes (``agree``,
        ``timeout_s``: see ``run_broadcast``; no ``fill``: join only); None, or why not
        (the group is left: members blocked in it fail fast)."""
        generation = job.generation
        with self._lock:
            try:
                if self._generation != generation:
                    self._leave()
                    self._generation = generation
                    try:
                        self._group = join_group(generation, 0, self._store, rendezvous_s)
                    except Exception as err:
                        # A member that arrives after the others gave up (busy, its
                        # delivery queued) fails at once, not after its own timeout.
                        call_off(self._store, generation, f"rank 0 gave it up ({err})")
                        self._absent[generation.number] = absent_members(self._store, generation)
                        keep_newest(self._absent, _FAILED_RENDEZVOUS_KEPT)
                        self._rendezvous_failed(generation)
                        raise
                    with self._rendezvous_lock:
                        forget_rendezvous(self._store, generation)
                        self._rendezvous_over.append(generation.number)
                if self._group is None:
                    raise RuntimeError("the group broke in an earlier collective")
                if fill is None:
                    return None
                run_broadcast(
                    self._group, fill(), generation.settings, agree=agree, timeout_s=timeout_s
                )
            except Exception as err:
                self._leave()
                reason = (
                    f"{what} of generation {generation.number} (version {job.version} of "
                    f"model {job.model!r} to {', '.join(generation.members)}) failed on "
                    f"rank 0: {err}"
                )
                self._failures = [*self._failures[-15:], reason]
                return reason
            self._collectives += 1
            return None

    def _rendezvous_failed(self, generation: Generation) -> None:
        """Keep the keys of the last :data:`_FAILED_RENDEZVOUS_KEPT` failed rendezvous;
        delete an older one's (each membership change that failed left a few keys in
        the store for the hub's life). A member that arrives there now waits its
        timeout instead of reading why at once: many generations late, it is long
        behind."""
        self._failed_rendezvous.append(generation)
        if len(self._failed_rendezvous) > _FAILED_RENDEZVOUS_KEPT:
            oldest = self._failed_rendezvous.popleft()
            with self._rendezvous_lock:
                forget_rendezvous(self._store, oldest)
                self._rendezvous_over.append(oldest.number)

    def _call_off(self, generation: Generation, why: str) -> None:
        """On a client connection of its own: the store's own connection is held by a
        rendezvous wait in the collective thread for as long as it waits. A generation
        of an earlier incarnation of this actor (the hub had not heard of the restart)
        has no rendezvous here: its "go" key would stay for good."""
        import torch.distributed as dist

        if generation.store != self._address:
            return

        if self._caller is None:
            self._caller = dist.TCPStore(
                self._address.host,
                self._address.port,
                is_master=False,
                timeout=self._settings.timeout,
            )
        with self._rendezvous_lock:
            if generation.number not in self._rendezvous_over:
                call_off(self._caller, generation, why)

    def _send_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The send buffer, reused while its size and device stay the same."""
        buffer = self._buffer
        if buffer is None or buffer.numel() != nbytes or buffer.device != device:
            buffer = self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer

    def _pack(self, job: BroadcastJob, arrays: list[np.ndarray] | BaseException) -> torch.Tensor:
        if isinstance(arrays, BaseException):
            raise RuntimeError(f"could not read the learner's copy: {arrays!r}") from arrays
        layout = PackedLayout.of(job.spec, HEADER_BYTES)
        buffer = self._send_buffer(layout.nbytes, staging_device(job.generation.settings))
        with warnings.catch_warnings():
            # Read-only views of the object store; we only read from them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            layout.pack(
                [as_tensor(a, e.dtype) for a, e in zip(arrays, job.spec.tensors, strict=True)],
                buffer,
            )
        buffer[:HEADER_BYTES].copy_(header(job.generation.number, job.seq, layout.nbytes))
        return buffer

    def _leave(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()

    def _close(self) -> None:
        with self._lock:
            self._leave()
            self._generation = None
            self._buffer = None
