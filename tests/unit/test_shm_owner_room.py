"""The room of a learner's pool of slots at its node's ShmOwner (actors/shm_owner.py),
driven as the plain class it is, as the learner (``acquire``) and the hub's planner
(``deliver``) and receivers (``release``) call it: receivers busy from different
versions (collectors in their rollouts) each hold an old version's slot; those slots,
two at most per receiver and model (the hub keeps a call per receiver and model, and
models of one size share the learner's pool), do not count against ``MAX_SLOTS``, nor
does the latest of each model beyond the first, so the learner's next version still
gets a slot at once instead of failing every receiver's broadcast after the slot wait.
A receiver that holds more still fills the pool, and a pool that grew shrinks back once
its receivers let go."""

from __future__ import annotations

import os

import pytest
import torch

from raysync.actors.shm_owner import ShmOwner
from raysync.transports.base import TransportError
from raysync.transports.shared_memory.segments import Mappings
from raysync.transports.shared_memory.wire import MAX_SLOTS, RETIRED_SEQ, read_seq

PID = os.getpid()  # the owner runs in this process: its slots name this pid
#: The slots a pool keeps beyond ``MAX_SLOTS`` for each receiver and model whose old
#: versions it holds: a zero-copy model's and its queued call's
#: (``wire.KEPT_PER_RECEIVER``).
KEPT_PER_RECEIVER = 2
NBYTES = 4096
LEARNER = "learner"
MODEL = "m"
#: The learner's slot wait here: a pool with no room fails it, fast.
SHORT_WAIT_S = 0.2


@pytest.fixture
def owner():
    owner = ShmOwner("node", max_slots=MAX_SLOTS)
    yield owner
    owner.close()


class _Learner:
    """Sends versions 1, 2, ... through ``owner`` as the learner and the hub do: a slot
    for each (waiting ``SHORT_WAIT_S`` at most), then the hub's plan holding it for the
    receivers it is delivered to (and as the latest of its model, ``MODEL`` unless
    named). Versions are numbered across models (each model's still go up). Maps each
    slot as a receiver does, to see what the owner leaves in its header."""

    def __init__(self, owner: ShmOwner) -> None:
        self.owner = owner
        self.version = 0
        self.seqs: dict[int, int] = {}  #: version -> the sequence of its slot
        self.mapped: dict[int, torch.Tensor] = {}  #: version -> its slot's segment
        self._mappings = Mappings(writable=False)

    def send(self, *workers: str, model: str = MODEL) -> None:
        """Send the next version of ``model`` to ``workers``."""
        slot = self.owner.acquire(NBYTES, timeout_s=SHORT_WAIT_S, learner=LEARNER)
        self.version += 1
        self.owner.deliver(PID, slot.seq, model, workers, version=self.version)
        self.seqs[self.version] = slot.seq
        self.mapped[self.version] = self._mappings.buffer(slot)

    def retired(self) -> list[int]:
        """The versions whose segment the owner freed (retired in its header)."""
        return [v for v, mapped in self.mapped.items() if read_seq(mapped.numpy()) == RETIRED_SEQ]

    def release(self, worker: str, version: int) -> None:
        """``worker`` is done with ``version`` (copied it, or its model left its slot)."""
        self.owner.release(PID, self.seqs[version], worker)


def test_receivers_busy_from_different_versions_leave_the_learner_a_slot(owner):
    """Three collectors on the learner's node each stay busy holding the version their
    queued call names (1, 2 and 3), and version 4 is the latest: the pool's four slots
    are all held. The learner's next version waited the slot wait and failed every
    receiver's broadcast; it gets a slot at once, and so does each version after it,
    acked by a fourth receiver that is free."""
    learner = _Learner(owner)
    for busy in ("a", "b", "c"):
        learner.send(busy, "free")
        learner.release("free", learner.version)
    learner.send("free")
    learner.release("free", learner.version)
    assert owner.stats().holds == ("latest/m", "worker/a", "worker/b", "worker/c")

    for _ in range(2 * MAX_SLOTS):
        learner.send("free")
        learner.release("free", learner.version)

    stats = owner.stats()
    assert stats.segments == MAX_SLOTS + 1  # the three busy ones', the latest, the next
    assert stats.holds == ("latest/m", "worker/a", "worker/b", "worker/c")
    assert learner.version == 4 + 2 * MAX_SLOTS


def test_zero_copy_receivers_busy_from_different_versions_keep_two_slots_each(owner):
    """A busy zero-copy receiver holds the slot its model lives in and its queued
    call's: three of them, from different versions, hold six slots between them."""
    learner = _Learner(owner)
    for busy in ("a", "b", "c"):
        learner.send(busy)  # its model lives there
        learner.send(busy)  # its queued call's
    assert owner.stats().segments == 3 * KEPT_PER_RECEIVER

    for _ in range(2):
        learner.send("free")
        learner.release("free", learner.version)

    # theirs, the latest and the one before it (free again: the next version's)
    assert owner.stats().segments == 3 * KEPT_PER_RECEIVER + 2


def test_a_receiver_that_never_releases_still_fills_the_pool_and_is_named(owner):
    """One receiver holds every version it is sent: the pool grows by two slots for it
    and no more, then the learner waits the slot wait and fails naming it."""
    learner = _Learner(owner)
    for _ in range(MAX_SLOTS + KEPT_PER_RECEIVER):
        learner.send("stuck")
    assert owner.stats().segments == MAX_SLOTS + KEPT_PER_RECEIVER

    with pytest.raises(
        TransportError,
        match=rf"all {MAX_SLOTS + KEPT_PER_RECEIVER} shared-memory slots of {NBYTES} bytes "
        rf"on node node stayed held for {SHORT_WAIT_S:g} s by: latest/m, worker/stuck;",
    ):
        learner.send("stuck")


def _grown_for_three_busy_zero_copy_receivers(owner: ShmOwner) -> _Learner:
    """A pool grown to seven slots: three busy zero-copy receivers hold two each
    (versions 1 to 6), version 7 is the latest."""
    learner = _Learner(owner)
    for busy in ("a", "b", "c"):
        learner.send(busy)
        learner.send(busy)
    learner.send("free")
    learner.release("free", learner.version)
    return learner


def _all_let_go(learner: _Learner) -> None:
    for version, busy in enumerate(("a", "a", "b", "b", "c", "c"), start=1):
        learner.release(busy, version)


def test_a_pool_that_grew_frees_its_extra_slots_as_the_learner_next_asks(owner):
    """Once the busy receivers let go, the learner's next slot is one of theirs and
    the others beyond ``MAX_SLOTS`` are freed (retired: readers let their mappings go),
    not kept for good."""
    learner = _grown_for_three_busy_zero_copy_receivers(owner)
    _all_let_go(learner)
    assert learner.retired() == []

    learner.send("free")

    assert len(learner.retired()) == 3 * KEPT_PER_RECEIVER + 1 - MAX_SLOTS
    stats = owner.stats()
    assert stats.segments == MAX_SLOTS
    assert stats.holds == ("latest/m", "worker/free")


def test_a_pool_that_grew_frees_its_extra_slots_when_another_pool_is_asked(owner):
    """The model that grew the pool is sent no more (its learner now sends another
    size): its extra slots were kept, each a whole version's memory, until the learner
    left. The owner frees them as it finds any slot."""
    learner = _grown_for_three_busy_zero_copy_receivers(owner)
    _all_let_go(learner)

    owner.acquire(2 * NBYTES, timeout_s=SHORT_WAIT_S, learner=LEARNER)

    assert len(learner.retired()) == 3 * KEPT_PER_RECEIVER + 1 - MAX_SLOTS


def test_a_pool_that_grew_has_shrunk_back_when_its_stats_are_read(owner):
    """The owner's stats read the releases (as its board is read) and free what they
    leave beyond ``MAX_SLOTS`` free: a learner that stops sending does not keep them."""
    learner = _grown_for_three_busy_zero_copy_receivers(owner)
    assert owner.stats().segments == 3 * KEPT_PER_RECEIVER + 1
    _all_let_go(learner)

    stats = owner.stats()

    assert stats.segments == MAX_SLOTS
    assert stats.holds == ("latest/m",)
    assert len(learner.retired()) == 3 * KEPT_PER_RECEIVER + 1 - MAX_SLOTS


def _busy_with_every_model(learner: _Learner, busy: str, models: tuple[str, ...]) -> None:
    """``busy`` is sent a version of each of ``models`` (as is a free receiver, which
    releases it) and stays busy: the hub's call for each model queues behind its
    rollout, holding that version's slot."""
    for model in models:
        learner.send(busy, "free", model=model)
        learner.release("free", learner.version)


def _sent_to_the_free_one(learner: _Learner, models: tuple[str, ...], rounds: int) -> None:
    for _ in range(rounds):
        for model in models:
            learner.send("free", model=model)
            learner.release("free", learner.version)


def test_a_busy_receiver_of_five_same_size_models_leaves_the_learner_a_slot(owner):
    """Five models of one size share the learner's pool. A receiver copies version 1 of
    each, then stays busy: the hub's call for each model queues, holding five slots
    beside the five models' latest, and the learner needs one more. Counted two at
    most for the receiver, the pool's room was ten and the learner's next version
    failed every receiver's broadcast after the slot wait; each model's queued call
    counts, and every version gets a slot."""
    learner = _Learner(owner)
    models = tuple(f"a{n}" for n in range(5))
    for model in models:
        learner.send("busy", "free", model=model)
        learner.release("busy", learner.version)
        learner.release("free", learner.version)
    _busy_with_every_model(learner, "busy", models)

    _sent_to_the_free_one(learner, models, rounds=MAX_SLOTS)

    stats = owner.stats()
    assert stats.holds == (*[f"latest/{m}" for m in models], *["worker/busy"] * len(models))
    assert stats.segments == 2 * len(models) + 1  # the busy one's, the latest, the next
    assert learner.version == len(models) * (2 + MAX_SLOTS)


def test_a_busy_zero_copy_receiver_of_three_same_size_models_leaves_the_learner_a_slot(owner):
    """Three models of one size live, zero-copy, in a receiver's slots of version 1; it
    stays busy and each model's queued call holds another: six slots held only for
    it, two per model, beside the three latest and the learner's next. Counted two at
    most for the receiver (a room of eight), the learner's next version failed every
    receiver's broadcast after the slot wait; it gets a slot."""
    learner = _Learner(owner)
    models = ("m1", "m2", "m3")
    _busy_with_every_model(learner, "busy", models)  # each model lives there
    _busy_with_every_model(learner, "busy", models)  # each model's queued call's

    _sent_to_the_free_one(learner, models, rounds=MAX_SLOTS)

    stats = owner.stats()
    assert stats.holds == ("latest/m1", "latest/m2", "latest/m3", *["worker/busy"] * 6)
    assert stats.segments == len(models) * KEPT_PER_RECEIVER + len(models) + 1
    assert learner.version == len(models) * (2 + MAX_SLOTS)


def test_each_same_size_models_latest_leaves_the_learner_its_slots(owner):
    """The latest version of each model is kept for late joiners: ``MAX_SLOTS`` models
    of one size held every slot of the pool with their latest alone, and the learner's
    next version, of any of them, failed after the slot wait. Each model's latest
    beyond the first takes a slot beside ``MAX_SLOTS``: the learner keeps sending."""
    learner = _Learner(owner)
    models = tuple(f"head {n}" for n in range(MAX_SLOTS + 1))

    _sent_to_the_free_one(learner, models, rounds=2)

    stats = owner.stats()
    assert stats.holds == tuple(f"latest/{model}" for model in models)
    assert stats.segments == len(models) + 1  # each model's latest, and the next
    assert learner.version == 2 * len(models)


def test_a_pool_that_shrinks_keeps_a_free_slot_its_pending_versions_need(owner):
    """Three busy receivers grew the pool; the learner has three versions pending
    (written, not planned yet) beside the latest when they let go: those four holds
    alone fill the room, and shrinking freed every free slot, so the learner's next
    version waited the slot wait for one it had just had."""
    learner = _Learner(owner)
    for busy in ("a", "b", "c"):
        learner.send(busy)
    learner.send()  # the latest, held for nobody else
    for _ in range(3):
        owner.acquire(NBYTES, timeout_s=SHORT_WAIT_S, learner=LEARNER)  # pending
    for version, busy in enumerate(("a", "b", "c"), start=1):
        learner.release(busy, version)

    owner.acquire(NBYTES, timeout_s=SHORT_WAIT_S, learner=LEARNER)

    assert owner.stats().holds == ("latest/m", *["pending"] * 4)


def test_a_pool_within_its_room_keeps_its_free_slots(owner):
    """A receiver copies the three versions it was sent only once the third came, then
    lets go of all three: the pool's three slots are within ``MAX_SLOTS``, and its two
    free ones serve the learner's next versions. Its room less its size went below
    zero: the owner's look at it cut the free slots from their end and freed one, and
    the learner's next version made a new segment (a whole version's memory, allocated
    holding the owner's lock)."""
    learner = _Learner(owner)
    for _ in range(3):
        learner.send("late")
    for version in (1, 2, 3):
        learner.release("late", version)

    for _ in range(2):
        learner.send("free")
        learner.release("free", learner.version)

    assert learner.retired() == []
    assert owner.stats().segments == 3
