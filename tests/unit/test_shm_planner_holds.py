"""The shared-memory planner's holds when a plan is cut short, on an event loop without
Ray: the holds it took for receivers the hub was to call go, those of receivers the
learner called itself (the direct path: they read the slot whatever becomes of the
plan) stay for them to let go, and so do those another delivery of the same version
took for the same receiver (the owner holds a slot once per worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from raysync.actors.shm_owner import ShmOwner
from raysync.background import BackgroundTasks
from raysync.transports.base import ReceiverInfo, TransportError
from raysync.transports.shared_memory.planner import SharedMemoryPlanner
from raysync.transports.shared_memory.wire import SharedMemoryPayload, Slot

HERE, THERE = "learner-node", "other-node"
SLOT = Slot(HERE, pid=11, fd=3, token=b"t", nbytes=64, seq=5)


class _Owner:
    """Stands for a node's owner actor: records each hold and each hold withdrawn; its
    export (for other nodes) never answers, so a plan that relays is cut short by its
    timeout."""

    def __init__(self) -> None:
        self.held: list[tuple[str, ...]] = []
        self.called: list[tuple[str, ...]] = []
        self.released: list[str] = []
        self.deliver = SimpleNamespace(remote=self._deliver)
        self.withdraw = SimpleNamespace(remote=self._withdraw)
        self.export = SimpleNamespace(remote=lambda *args: asyncio.Future())

    def _deliver(
        self, pid, seq, model, workers, order, version, placement=0, called=()
    ) -> asyncio.Future[Slot]:
        self.held.append(workers)
        self.called.append(called)
        answer: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        answer.set_result(SLOT)
        return answer

    async def _withdraw(self, pid: int, seq: int, workers: tuple[str, ...], placement) -> None:
        self.released.extend(workers)


class _Actor:
    """A real ShmOwner in this process, called as the planner calls its actor: each
    method's ``remote`` runs it and answers with a done future; its export (for other
    nodes) never answers, so a plan that relays is cut short by its timeout."""

    def __init__(self, owner: ShmOwner) -> None:
        self.owner = owner
        self.export = SimpleNamespace(remote=lambda *args: asyncio.Future())

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.owner, name)

        def remote(*args: Any) -> asyncio.Future[Any]:
            answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            try:
                answer.set_result(method(*args))
            except Exception as err:
                answer.set_exception(err)
            return answer

        return SimpleNamespace(remote=remote)


def _planner(owners: dict[str, Any]) -> SharedMemoryPlanner:
    planner = SharedMemoryPlanner.__new__(SharedMemoryPlanner)  # no Ray: no owners started
    planner._owners = dict[str, Any](owners)
    planner._orders = dict.fromkeys(owners, 0)
    planner._placements = itertools.count(1)
    planner._latest = {}
    planner._background = BackgroundTasks("test planner")
    return planner


def _receiver(worker: str, node_id: str, called: bool = False) -> ReceiverInfo:
    return ReceiverInfo(worker, f"R({worker})", node_id, "p", None, called_by_learner=called)


def test_a_plan_cut_short_lets_go_only_of_the_holds_of_receivers_the_hub_was_to_call():
    async def run() -> _Owner:
        here = _Owner()
        planner = _planner({HERE: here, THERE: _Owner()})
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(SLOT))
        targets = [
            _receiver("called", HERE, called=True),  # the learner delivered it itself
            _receiver("uncalled", HERE),
            _receiver("far", THERE),
        ]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(planner.plan(update, None, targets), 0.05)
        # The holds' let-go runs in the background: wait for it (and the holds' check).
        await asyncio.gather(*planner._background._tasks)
        return here

    here = asyncio.run(run())
    assert here.held == [("called", "uncalled")]  # held for both as the plan began
    assert here.called == [("called",)]  # its turn-down unread takes its hold back
    assert here.released == ["uncalled"]  # the learner's receiver keeps its hold


def test_a_plan_cut_short_leaves_the_hold_another_delivery_of_the_version_took():
    """The hub hands one worker the same slot twice: it pulled the version (or its
    welcome's catch-up read it as it registered again) and a broadcast of that version
    targets it too. The owner holds the slot once for that worker; the broadcast's
    plan, cut short, released that one hold on the worker's behalf, and the learner
    could rewrite the slot while the worker still read it from its pull (or a
    zero-copy model lived there). It withdraws only what its own calls held."""
    owner = ShmOwner(HERE, max_slots=2)
    try:
        slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
        planner = _planner({HERE: _Actor(owner), THERE: _Owner()})
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(slot))

        async def run() -> Any:
            pulled = await planner.plan_pull(update, None, _receiver("w", HERE))
            targets = [_receiver("w", HERE), _receiver("far", THERE)]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(planner.plan(update, None, targets), 0.05)
            await asyncio.gather(*planner._background._tasks)
            return pulled

        assert asyncio.run(run()) == SharedMemoryPayload(slot)
        assert owner.stats().holds == ("latest/m", "worker/w")  # for the pull, unread yet
        owner.release(slot.pid, slot.seq, "w")  # the pull's copy is done
        assert owner.stats().holds == ("latest/m",)
    finally:
        owner.close()


class _Calls:
    """Stands for a node's owner actor: records every call, in the order sent, with its
    arguments; answers each at once (the join with no board row)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> SimpleNamespace:
        def remote(*args: Any) -> asyncio.Future[Any]:
            self.sent.append((name, args))
            answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            answer.set_result(None if name == "join" else SLOT)
            return answer

        return SimpleNamespace(remote=remote)


def test_a_receivers_join_is_numbered_before_the_hold_of_any_plan_that_targets_it():
    """The hub books a registration, then (before the planner's coroutine ran) plans a
    version that targets it: the owner's join was sent from inside that coroutine, so
    the hold went out first, unnumbered against it, and Ray's threads may run the two in
    either order. A join run after the hold forgot it: the worker staged the version
    (or a zero-copy model adopted it) with nothing holding the slot but ``latest``.
    The join now leaves as the hub calls ``receiver_joined``, numbered before the
    hold, and the owner runs the hub's calls in their numbers' order."""

    async def run() -> _Calls:
        owner = _Calls()
        planner = _planner({HERE: owner})
        planner._hub_id, planner._node_of = "hub", {}
        planner._streams = SimpleNamespace(receiver_joined=_nothing)
        joining = planner.receiver_joined(_receiver("w", HERE))  # the hub booked it
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(SLOT))
        await planner.plan(update, None, [_receiver("w", HERE)])
        await joining
        await asyncio.gather(*planner._background._tasks)
        return owner

    sent = asyncio.run(run()).sent
    assert [name for name, _ in sent] == ["join", "deliver"]
    (_, join), (_, deliver) = sent
    assert join[0] == "w" and deliver[3] == ("w",)
    assert 0 < join[3] < deliver[4], "the join is numbered first in the owner's order"


async def _nothing(*args: Any) -> None:
    return None


def test_a_refused_version_is_let_go_of_before_the_holds_of_a_newer_one():
    """The hub refuses a version its learner delivered itself, then plans the next: the
    owner is told to keep the refused slot for the receivers the learner called in the
    hub's order, before the newer version's hold frees that learner's older pending
    slots (freed first, the slot could be given to the learner again under them)."""

    async def run() -> _Calls:
        owner = _Calls()
        planner = _planner({HERE: owner})
        refused = dataclasses.replace(SLOT, seq=4)
        planner.abandoned(SharedMemoryPayload(refused), ("called",))
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(SLOT))
        await planner.plan(update, None, [_receiver("called", HERE, called=True)])
        await asyncio.gather(*planner._background._tasks)
        return owner

    sent = asyncio.run(run()).sent
    assert [name for name, _ in sent] == ["abandon", "deliver"]
    (_, abandon), (_, deliver) = sent
    assert abandon[:3] == (SLOT.pid, 4, ("called",))
    assert 0 < abandon[3] < deliver[4], "the let-go is numbered first in the owner's order"


def test_a_pull_of_a_version_whose_slot_the_learner_was_handed_again_fails():
    """A late joiner's catch-up reads the latest version as the hub booked it; a newer
    version's plan, numbered first, moved the owner's ``latest`` hold off that slot and
    the learner was handed it for its next version. The pull's hold, refused, was only
    logged: the receiver read (a zero-copy model adopted) memory the learner writes
    again at its next send. The pull fails instead; the next broadcast reaches it."""
    owner = ShmOwner(HERE, max_slots=2)
    try:
        planner = _planner({HERE: _Actor(owner)})

        def published(version: int) -> Any:
            slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
            return SimpleNamespace(model="m", version=version, payload=SharedMemoryPayload(slot))

        async def run() -> None:
            first = published(1)
            await planner.plan(first, None, [])  # held as the latest only
            await planner.plan(published(2), None, [])  # the latest now
            again = owner.acquire(4096, timeout_s=5.0, learner="learner")
            assert again.fd == first.payload.slot.fd  # the first version's memory
            with pytest.raises(TransportError, match="could not be held for late.*no longer"):
                await planner.plan_pull(first, None, _receiver("late", HERE))
            await asyncio.gather(*planner._background._tasks)

        asyncio.run(run())
        assert "worker/late" not in owner.stats().holds
    finally:
        owner.close()


def test_a_departure_held_up_by_one_node_drops_no_hold_of_the_next_registration():
    """A worker left (its process died; Ray restarted it) while one node's owner did not
    answer (its node being lost). The drops went out one owner after another, so its
    own node's came only once that one answered: after the restarted worker joined
    there, whose holds it forgot, and every later hold for it was turned away. The
    drops leave at once, numbered before the join."""
    owner = ShmOwner(HERE, max_slots=2)
    try:
        slot = owner.acquire(4096, timeout_s=5.0, learner="learner")

        async def run() -> None:
            late: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            lost = SimpleNamespace(drop_worker=SimpleNamespace(remote=lambda *args: late))
            planner = _planner({"lost-node": lost, HERE: _Actor(owner)})
            planner._hub_id, planner._node_of = "hub", {}
            planner._streams = SimpleNamespace(receiver_joined=_nothing, receiver_left=_nothing)
            leaving = asyncio.ensure_future(planner.receiver_left("w"))
            await asyncio.wait({leaving}, timeout=0.05)  # the hub waited for it; it went on
            await planner.receiver_joined(_receiver("w", HERE))  # restarted
            update = SimpleNamespace(model="m", version=1, payload=SharedMemoryPayload(slot))
            await planner.plan(update, None, [_receiver("w", HERE)])
            late.set_result(None)  # the lost node's owner answers at last
            await leaving
            await asyncio.gather(*planner._background._tasks)

        asyncio.run(run())
        assert "worker/w" in owner.stats().holds
    finally:
        owner.close()


def test_a_delivery_set_aside_lets_go_of_its_own_hold_and_is_held_again_if_it_goes():
    """A delivery waits for its busy receiver's running call: the hold its plan took
    for that receiver goes (each version broadcast meanwhile held its slot for it,
    until the learner's slots ran out and every broadcast failed), but the other
    receivers' stay, and so does the receiver's hold another delivery of the version
    took. Planned again, once it goes, the slot is held for it again."""
    owner = ShmOwner(HERE, max_slots=2)
    try:
        slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
        planner = _planner({HERE: _Actor(owner)})
        update = SimpleNamespace(model="m", version=3, payload=SharedMemoryPayload(slot))
        busy, other = _receiver("busy", HERE), _receiver("other", HERE)

        async def run() -> list[tuple[str, ...]]:
            holds = []
            planned = await planner.plan(update, None, [busy, other])
            holds.append(owner.stats().holds)
            assert planner.set_aside(planned["busy"], "busy")
            await asyncio.gather(*planner._background._tasks)
            holds.append(owner.stats().holds)
            await planner.plan_pull(update, None, busy)  # it goes: planned again
            holds.append(owner.stats().holds)
            # Set aside again, another delivery's hold (this pull's) stays.
            again = await planner.plan(update, None, [busy])
            assert planner.set_aside(again["busy"], "busy")
            await asyncio.gather(*planner._background._tasks)
            holds.append(owner.stats().holds)
            return holds

        both = ("latest/m", "worker/busy", "worker/other")
        assert asyncio.run(run()) == [both, ("latest/m", "worker/other"), both, both]
        # The learner's own payload (the direct path) was held by no plan of the hub's.
        assert not planner.set_aside(SharedMemoryPayload(slot), "busy")
    finally:
        owner.close()
