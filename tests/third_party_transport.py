"""A transport written outside raysync, as a user would: registered with
``raysync.transports.register_transport`` and held to the conformance kit
(``tests/test_conformance.py``).

``packed_object``: the learner packs a version into one uint8 buffer and puts it in
Ray's object store; a receiver gets it (zero-copy on its node) and views the tensors in
place. No planner of its own: every receiver reads the learner's object.

``lost_copy``: ``packed_object`` whose planner cannot plan a late joiner's catch-up;
``stuck_plan``: one whose planner never finishes planning a broadcast.

``slow_leave``: ``packed_object`` whose planner is slow to forget a receiver that left;
``hanging_join``: one whose planner never takes a receiver in; ``no_reopen``: one whose
receiver half opens once per worker, and cannot open again when it registers again.

``put_reader``: a receiver half only, reading the ``object_store`` transport's whole put
(its ``hand_off``); it moves no buckets, so the hub refuses a bucketed version for its
receivers.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raysync.copies import as_tensor
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports import (
    Availability,
    HubContext,
    MemoryFootprint,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    TransportSender,
)
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.object_store.wire import ObjectStorePayload


@dataclass(frozen=True)
class PackedPayload:
    ref: ray.ObjectRef  #: one uint8 NumPy array: the version, packed


class PackedSender(TransportSender):
    def send(
        self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str
    ) -> PackedPayload:
        layout = PackedLayout.of(spec)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(tensors, buffer)
        return PackedPayload(ray.put(buffer.numpy()))


class PackedReceiver(TransportReceiver):
    def fetch(self, payload: PackedPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        array = ray.get(payload.ref)  # read-only, mapped from the node's object store
        with warnings.catch_warnings():  # torch warns of a read-only array: never written
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.from_numpy(array)
        return PackedLayout.of(spec).views(buffer)


class PackedObjectTransport(Transport):
    name = "packed_object"
    #: The packed put (two alive while one is read); receivers read it in place.
    memory = MemoryFootprint(learner=2, per_receiver=0)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def open_sender(cls, hub: HubContext) -> PackedSender:
        return PackedSender()

    @classmethod
    def open_receiver(cls, info: Any) -> PackedReceiver:
        return PackedReceiver()


class PutReader(TransportReceiver):
    def fetch(self, payload: ObjectStorePayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        arrays = payload.arrays()
        with warnings.catch_warnings():  # torch warns of a read-only array: never written
            warnings.simplefilter("ignore", UserWarning)
            return [as_tensor(a, e.dtype) for a, e in zip(arrays, spec.tensors, strict=True)]


class PutReaderTransport(Transport):
    name = "put_reader"
    hand_off = "object_store"
    #: The object store's put (two alive); receivers read it in place.
    memory = MemoryFootprint(learner=2, per_receiver=0)

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def open_sender(cls, hub: HubContext) -> TransportSender:
        raise NotImplementedError("its hand-off's sender sends for it")

    @classmethod
    def open_receiver(cls, info: Any) -> PutReader:
        return PutReader()


class LostCopyPlanner(TransportPlanner):
    """Plans broadcasts as the default does, but the copy a receiver joining later (or
    pulling) would read is always gone: its planning raises."""

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        raise TransportError(f"the copy of version {update.version} for {receiver.worker} is gone")


class LostCopyTransport(PackedObjectTransport):
    """``packed_object`` whose late joiners find no copy to read (``lost_copy``)."""

    name = "lost_copy"

    @classmethod
    def open_hub(cls, hub: HubContext) -> LostCopyPlanner:
        return LostCopyPlanner()


class StuckPlanner(TransportPlanner):
    """Never finishes planning a broadcast (a resource it waits on never answers)."""

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        await asyncio.Event().wait()  # cancelled by the hub at its timeout
        raise AssertionError("unreachable")


class StuckPlanTransport(PackedObjectTransport):
    """``packed_object`` whose broadcasts are never planned (``stuck_plan``)."""

    name = "stuck_plan"

    @classmethod
    def open_hub(cls, hub: HubContext) -> StuckPlanner:
        return StuckPlanner()


class StuckBucketPlanTransport(ObjectStoreTransport):
    """``object_store``'s buckets, whose broadcasts are never planned
    (``stuck_bucket_plan``): its receivers read what ``object_store``'s learner sends."""

    name = "stuck_bucket_plan"
    hand_off = "object_store"

    @classmethod
    def open_hub(cls, hub: HubContext) -> StuckPlanner:
        return StuckPlanner()


class SlowLeavePlanner(TransportPlanner):
    """Notes its receivers' joins and departures in order; a departure takes a while
    (shared memory's planner tells each node's owner in turn)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def receiver_joined(self, receiver: ReceiverInfo) -> Any:
        self.events.append(("joined", receiver.worker))
        return None

    async def receiver_left(self, worker: str) -> None:
        await asyncio.sleep(3.0)  # the owners' calls (the test re-attaches well within)
        self.events.append(("left", worker))


class SlowLeaveTransport(PackedObjectTransport):
    """``packed_object`` whose planner is slow to forget a receiver (``slow_leave``)."""

    name = "slow_leave"

    @classmethod
    def open_hub(cls, hub: HubContext) -> SlowLeavePlanner:
        return SlowLeavePlanner()


class HangingJoinPlanner(TransportPlanner):
    """Never takes a receiver in (a resource actor it asks never answers)."""

    async def receiver_joined(self, receiver: ReceiverInfo) -> Any:
        await asyncio.Event().wait()  # cancelled by the hub at its timeout
        raise AssertionError("unreachable")


class HangingJoinTransport(PackedObjectTransport):
    """``packed_object`` whose planner never takes a receiver in (``hanging_join``)."""

    name = "hanging_join"

    @classmethod
    def open_hub(cls, hub: HubContext) -> HangingJoinPlanner:
        return HangingJoinPlanner()


class OncePerWorkerPlanner(TransportPlanner):
    """Tells each worker, as connection details, whether it joined before; notes joins
    and departures in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def receiver_joined(self, receiver: ReceiverInfo) -> Any:
        again = ("joined", receiver.worker) in self.events
        self.events.append(("joined", receiver.worker))
        return again

    async def receiver_left(self, worker: str) -> None:
        self.events.append(("left", worker))


class NoReopenTransport(PackedObjectTransport):
    """``packed_object`` whose receiver half cannot open for a worker that joined
    before (a resource it needs is gone after a restart, say): ``no_reopen``."""

    name = "no_reopen"

    @classmethod
    def open_hub(cls, hub: HubContext) -> OncePerWorkerPlanner:
        return OncePerWorkerPlanner()

    @classmethod
    def open_receiver(cls, info: Any) -> PackedReceiver:
        if info:
            raise TransportError("no_reopen: this worker's receiver half cannot open again")
        return PackedReceiver()


def planner_events(hub: Any, transport: str) -> list[tuple[str, str]]:
    """Runs in the hub (``__ray_call__``): what ``transport``'s SlowLeavePlanner noted."""
    return list(hub._planners[transport].events)


class HeldJoinPlanner(TransportPlanner):
    """Takes a receiver in once the test lets it (``let_joins_go``); notes joins (once
    taken in) and departures in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.waiting = 0
        self._go: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def receiver_joined(self, receiver: ReceiverInfo) -> Any:
        self._loop = asyncio.get_running_loop()
        self._go = self._go or asyncio.Event()
        self.waiting += 1
        await self._go.wait()
        self.events.append(("joined", receiver.worker))
        return None

    async def receiver_left(self, worker: str) -> None:
        self.events.append(("left", worker))

    def let_joins_go(self) -> None:
        """From any thread: the joins waiting, and those to come, go on."""
        assert self._loop is not None and self._go is not None
        self._loop.call_soon_threadsafe(self._go.set)


class HeldJoinTransport(PackedObjectTransport):
    """``packed_object`` whose planner takes receivers in when the test says (``held_join``)."""

    name = "held_join"

    @classmethod
    def open_hub(cls, hub: HubContext) -> HeldJoinPlanner:
        return HeldJoinPlanner()


def joins_waiting(hub: Any, transport: str) -> int:
    """Runs in the hub (``__ray_call__``): how many joins ``transport``'s HeldJoinPlanner holds."""
    return hub._planners[transport].waiting


def let_joins_go(hub: Any, transport: str) -> None:
    """Runs in the hub (``__ray_call__``): ``transport``'s HeldJoinPlanner takes them in."""
    hub._planners[transport].let_joins_go()


def token_of(hub: Any, worker: str) -> str:
    """Runs in the hub (``__ray_call__``): the token ``worker`` is registered under."""
    return hub._state.receivers[worker].registration.token
