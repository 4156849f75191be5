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
  its size stays the same.

``broadcast`` runs one collective in a worker thread (the event loop stays free for
``describe``) and returns ``None`` or the reason it failed. A failure shuts the
group down at once, so members still blocked in it fail fast instead of waiting out
their timeout; the planner then starts a new generation.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from raysync.actors.heap import settle_heap
from raysync.layout import PackedLayout
from raysync.transports.distributed import (
    HEADER_BYTES,
    BroadcastJob,
    Generation,
    StoreAddress,
    header,
    join_group,
    run_broadcast,
    staging_device,
)
from raysync.transports.object_store import as_tensor, read_put
from raysync.transports.options import DistributedOptions
from raysync.transports.process_groups import bound_master_store, node_ip


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
        self._address = StoreAddress(host, port)
        self._lock = threading.Lock()
        self._generation: Generation | None = None
        self._group = None
        self._buffer: torch.Tensor | None = None
        self._collectives = 0
        self._failures: list[str] = []
        settle_heap()

    async def store_address(self) -> StoreAddress:
        return self._address

    async def broadcast(self, job: BroadcastJob) -> str | None:
        """Run collective ``job.seq`` of ``job.generation`` as rank 0; None or why not."""
        arrays: list[np.ndarray] | BaseException
        try:  # read the learner's copy here: a blocking get would hold the event loop
            arrays = await read_put(job.source, job.generation.settings.timeout_s)
        except Exception as err:
            arrays = err  # the collective fails with it, so members stop waiting at once
        return await asyncio.to_thread(self._broadcast, job, arrays)

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
        with self._lock:
            generation = job.generation
            try:
                if self._generation != generation:
                    self._leave()
                    self._generation = generation
                    self._group = join_group(generation, 0, self._store)
                if self._group is None:
                    raise RuntimeError("the group broke in an earlier collective")
                buffer = self._pack(job, arrays)
                run_broadcast(self._group, buffer, generation.settings)
            except Exception as err:
                self._leave()
                reason = (
                    f"collective {job.seq} of generation {generation.number} (version "
                    f"{job.version} of model {job.model!r} to {', '.join(generation.members)}) "
                    f"failed on rank 0: {err}"
                )
                self._failures = [*self._failures[-15:], reason]
                return reason
            self._collectives += 1
            return None

    def _pack(self, job: BroadcastJob, arrays: list[np.ndarray] | BaseException) -> torch.Tensor:
        if isinstance(arrays, BaseException):
            raise RuntimeError(f"could not read the learner's copy: {arrays!r}") from arrays
        layout = PackedLayout.of(job.spec, HEADER_BYTES)
        device = staging_device(job.generation.settings)
        buffer = self._buffer
        if buffer is None or buffer.numel() != layout.nbytes or buffer.device != device:
            buffer = self._buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
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
