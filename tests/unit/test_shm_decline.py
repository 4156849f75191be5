"""The shared-memory receiver declining a payload it never read
(raysync/transports/shared_memory/receiver.py), against a real ShmOwner
(actors/shm_owner.py) and the real planner in this process: a pull's answer that came
after the pull stopped waiting holds the version's slot for the worker; declined, that
hold goes and the learner gets the slot back. The owner holds a slot once per worker,
so the decline takes back only what its own delivery held (its ``placement``): a retry
of the pull, which holds the same version for the same worker, keeps the slot until
its copy is done."""

from __future__ import annotations

import asyncio
import itertools
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raysync.actors.shm_owner import ShmOwner
from raysync.background import BackgroundTasks
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo, Unplanned
from raysync.transports.parts import Part, PartedReceiver, Parts
from raysync.transports.shared_memory import receiver as shm_receiver
from raysync.transports.shared_memory.planner import SharedMemoryPlanner
from raysync.transports.shared_memory.segments import Mappings
from raysync.transports.shared_memory.wire import (
    HEADER_BYTES,
    SharedMemoryPayload,
    SharedMemoryReceiverInfo,
    write_seq,
)

PID = os.getpid()  # the owner runs in this process: its slots name this pid
NODE = "node"
SPEC = WeightSpec.of({"w": torch.zeros(256)})
NBYTES = PackedLayout.of(SPEC, HEADER_BYTES).nbytes


class _Actor:
    """A real ShmOwner called as the planner and the receivers call its actor: each
    method's ``remote`` runs it at once; on an event loop (the planner's calls) it
    answers with a done future, elsewhere (a receiver's release or withdrawal, sent
    without waiting) with nothing."""

    def __init__(self, owner: ShmOwner) -> None:
        self.owner = owner

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.owner, name)

        def remote(*args: Any) -> asyncio.Future[Any] | None:
            result = method(*args)
            try:
                answer = asyncio.get_running_loop().create_future()
            except RuntimeError:  # no loop: a receiver's call, nobody waits for it
                return None
            answer.set_result(result)
            return answer

        return SimpleNamespace(remote=remote)


@pytest.fixture
def owner(monkeypatch):
    """The node's owner, which the receivers find by name (as its actor)."""
    context = SimpleNamespace(get_node_id=lambda: NODE, get_actor_id=lambda: None)
    monkeypatch.setattr(shm_receiver.ray, "get_runtime_context", lambda: context)
    owner = ShmOwner(NODE, max_slots=2)
    actor = _Actor(owner)
    monkeypatch.setattr(shm_receiver.ray, "get_actor", lambda name, namespace=None: actor)
    yield owner
    owner.close()


def _planner(owner: ShmOwner) -> SharedMemoryPlanner:
    planner = SharedMemoryPlanner.__new__(SharedMemoryPlanner)  # no Ray: no owners started
    planner._owners = {NODE: _Actor(owner)}
    planner._orders = {NODE: 0}
    planner._placements = itertools.count(1)
    planner._latest = {}
    planner._background = BackgroundTasks("test planner")
    return planner


def _published(owner: ShmOwner, planner: SharedMemoryPlanner, value: float) -> SimpleNamespace:
    """A version of model ``m``, every element ``value``, written by the learner into
    a slot and published by the hub (held as the latest, for pulls)."""
    slot = owner.acquire(NBYTES, timeout_s=5.0, learner="learner", pid=PID)
    learner = Mappings(writable=True)
    learner.views(slot, PackedLayout.of(SPEC, HEADER_BYTES))[0].fill_(value)
    write_seq(learner.buffer(slot).numpy(), slot.seq)
    learner.clear()
    update = SimpleNamespace(model="m", version=int(value), payload=SharedMemoryPayload(slot))
    asyncio.run(_settled(planner, planner.published(update, SPEC)))
    return update


def _pulled(planner: SharedMemoryPlanner, update: SimpleNamespace, worker: str) -> Any:
    """The payload the hub's pull of ``update`` by ``worker`` answers with (its hold
    taken: the hub awaits it before it answers)."""
    info = ReceiverInfo(worker, f"R({worker})", NODE, "p", None)
    return asyncio.run(_settled(planner, planner.plan_pull(update, SPEC, info)))


async def _settled(planner: SharedMemoryPlanner, call: Any) -> Any:
    """``call``'s result, once the planner's background checks of its holds ran."""
    result = await call
    await asyncio.gather(*planner._background._tasks)
    return result


def _receiver(owner: ShmOwner, worker: str) -> shm_receiver.SharedMemoryReceiver:
    """A transport receiver of ``worker`` as its registration opens one."""
    board = owner.join(worker)
    return shm_receiver.SharedMemoryReceiver(SharedMemoryReceiverInfo(worker, "owner", board))


def test_a_pulls_answer_declined_unread_gives_the_learner_its_slot_back(owner):
    """The pull stopped waiting; the hub's answer came after, its slot held for the
    worker. Declined, the hold goes: the learner's next versions take that slot again
    (kept, one slot per such pull went, and with both taken the learner waited out its
    slot wait and failed)."""
    planner = _planner(owner)
    receiver = _receiver(owner, "w")
    first = _published(owner, planner, 1.0)
    answer = _pulled(planner, first, "w")
    assert answer.placement > 0 and owner.stats().holds == ("latest/m", "worker/w")

    receiver.decline(answer)
    assert owner.stats().holds == ("latest/m",)
    _published(owner, planner, 2.0)  # the latest now: the first's slot is free again
    again = owner.acquire(NBYTES, timeout_s=0.0, learner="learner", pid=PID)
    assert again.column == first.payload.slot.column


def test_a_declined_pull_leaves_the_hold_of_its_retry_until_the_retry_is_copied(owner):
    """The pull timed out and was tried again: the hub planned the same version twice
    for the worker, and the owner holds its slot once for both. A decline released by
    the worker's name let go of that one hold: the retry then read a slot the learner
    could write its next version into (a copy torn, a zero-copy model rewritten under
    it). Declined by its delivery, the retry's hold stays until its copy is done."""
    planner = _planner(owner)
    receiver = _receiver(owner, "w")
    first = _published(owner, planner, 1.0)
    late = _pulled(planner, first, "w")  # the pull that gave up
    retry = _pulled(planner, first, "w")  # the pull tried again
    assert retry.placement != late.placement

    receiver.decline(late)
    assert owner.stats().holds == ("latest/m", "worker/w")
    _published(owner, planner, 2.0)  # the latest moves on, to the other slot
    again = owner.acquire(NBYTES, timeout_s=0.0, learner="learner", pid=PID)
    assert again.column != first.payload.slot.column  # the retry's slot stays its own
    staged = receiver.fetch(retry, SPEC)
    receiver.check_intact(retry)
    assert torch.equal(staged[0], torch.full((256,), 1.0))
    receiver.release(retry, staged)  # copied at the safe point
    assert owner.stats().holds == ("latest/m", "pending")


def test_a_version_in_parts_is_declined_part_by_part_but_parts_never_planned(owner):
    """A pull of a version in parts answered late, one part not planned for the worker:
    each planned part's hold goes; the part never planned holds nothing to let go."""
    planner = _planner(owner)
    receiver = PartedReceiver(_receiver(owner, "w"))
    first = _published(owner, planner, 1.0)
    answer = Parts(
        (Part(_pulled(planner, first, "w"), SPEC), Part(Unplanned("its node is gone"), SPEC))
    )
    assert owner.stats().holds == ("latest/m", "worker/w")

    receiver.decline(answer)
    assert owner.stats().holds == ("latest/m",)


def _planned(planner: SharedMemoryPlanner, update: SimpleNamespace, called: bool) -> Any:
    """The payload the hub's broadcast plan of ``update`` gives worker ``w`` (which
    the learner called itself, if ``called``: the plan books its hold only)."""
    info = ReceiverInfo("w", "R(w)", NODE, "p", None, called_by_learner=called)
    return asyncio.run(_settled(planner, planner.plan(update, SPEC, [info])))["w"]


def _written_by_learner(owner: ShmOwner) -> SimpleNamespace:
    """A version the learner wrote and delivers to its receivers itself (pending)."""
    slot = owner.acquire(NBYTES, timeout_s=5.0, learner="learner", pid=PID)
    learner = Mappings(writable=True)
    learner.views(slot, PackedLayout.of(SPEC, HEADER_BYTES))[0].fill_(3.0)
    write_seq(learner.buffer(slot).numpy(), slot.seq)
    learner.clear()
    return SimpleNamespace(model="m", version=4, payload=SharedMemoryPayload(slot))


@pytest.mark.parametrize("turned_down_first", [True, False])
def test_a_learners_own_call_turned_down_leaves_the_hub_delivering_that_slot_held(
    owner, turned_down_first
):
    """Another learner's version took the number this learner's own call carried: the
    receiver turned the call down unread and handed the slot back, and the hub
    numbered the version anew and delivered this very slot itself (no hold booked for
    the call). The owner took the hand-back for that delivery's hold: the zero-copy
    model then living in the slot was held by nobody, free to be written again."""
    planner = _planner(owner)
    receiver = _receiver(owner, "w")
    own = _written_by_learner(owner)
    if turned_down_first:
        receiver.release(own.payload, None)  # the learner's call, turned down unread
    hubs = _planned(planner, own, called=False)  # the hub's own delivery of the slot
    if not turned_down_first:
        receiver.release(own.payload, None)
    staged = receiver.fetch(hubs, SPEC)  # a zero-copy model lives here now
    assert torch.equal(staged[0], torch.full((256,), 3.0))
    assert owner.stats().holds == ("latest/m", "worker/w")
    receiver.release(hubs, staged)  # it moved on
    assert owner.stats().holds == ("latest/m",)


@pytest.mark.parametrize("turned_down_first", [True, False])
def test_a_learners_own_call_turned_down_lets_go_of_the_hold_booked_for_it(
    owner, turned_down_first
):
    """The hub booked the version as the learner delivered it, holding its slot for
    the receiver the learner called; that receiver turned the call down unread (it
    holds a newer version), before or after the hold landed: the hold goes."""
    planner = _planner(owner)
    receiver = _receiver(owner, "w")
    own = _written_by_learner(owner)
    if turned_down_first:
        receiver.release(own.payload, None)
    _planned(planner, own, called=True)
    if not turned_down_first:
        receiver.release(own.payload, None)
    assert owner.stats().holds == ("latest/m",)
