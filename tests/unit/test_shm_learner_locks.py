"""The shared-memory learner's lock (raysync/transports/shared_memory/learner.py), without
Ray: one sender serves every model of the learner process, and a wait for a slot of one
model's full pool must not hold another model's send. A stand-in owner hands out real
segments (memfds of this process) and holds the answers for one pool until told; where
the pool's count matters, a real ShmOwner in this process answers instead."""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raysync.actors.shm_owner import ShmOwner
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.shared_memory import learner as shm_learner
from raysync.transports.shared_memory.segments import Mappings
from raysync.transports.shared_memory.wire import (
    HEADER_BYTES,
    KEPT_PER_RECEIVER,
    TOKEN_BYTES,
    Slot,
    holds_model,
    read_seq,
)

#: Bounds each wait of the test on another thread: reached only when a send hangs.
HANG_S = 5.0
#: Bounds the stand-in owner's wait for the test to free a held pool (past the test's
#: own waits, which free it at the end).
HELD_MOST_S = 4 * HANG_S
#: The learner's slot wait in the tests with a real owner: a send that waits it out
#: fails, fast.
TEST_SLOT_WAIT_S = 1.0


class _Owner:
    """A node's owner stand-in: each slot a new memfd segment numbered when answered,
    as the owner numbers it. An answer for a size in ``held`` is numbered, then waits
    until that size's event is set (``asked`` is set when it starts waiting). An answer
    for a size in ``from_dead_owner`` names an owner process that is gone; once
    ``closing_next`` is set, the next answer's descriptor is closed as it is given (an
    owner killed after answering: its descriptors closed, its pid not yet reaped).
    Records the slots given back (``abandoned``: (pid, sequence))."""

    def __init__(self) -> None:
        self.acquire = SimpleNamespace(remote=self._acquire)
        self.abandon = SimpleNamespace(remote=lambda pid, seq: self.abandoned.append((pid, seq)))
        self.leave = SimpleNamespace(remote=lambda learner: None)
        self.held: dict[int, threading.Event] = {}
        self.from_dead_owner: set[int] = set()
        self.abandoned: list[tuple[int, int]] = []
        self.closing_next = False
        self.asked = threading.Event()
        self.segments: dict[int, torch.Tensor] = {}  #: by sequence
        self._fds: list[int] = []
        self._seq = 0
        self._numbering = threading.Lock()

    def _acquire(self, nbytes: int, wait_s: float, learner: str, pid: int) -> Callable[[], Slot]:
        def answer() -> Slot:
            slot = self._segment(nbytes)
            release = self.held.get(nbytes)
            if release is not None:
                self.asked.set()
                assert release.wait(HELD_MOST_S), "the test never freed the held pool"
            return slot

        return answer

    def _segment(self, nbytes: int) -> Slot:
        with self._numbering:
            self._seq += 1
            seq = self._seq
        token = secrets.token_bytes(TOKEN_BYTES)
        fd = os.memfd_create(f"raysync-test-slot-{seq}", os.MFD_CLOEXEC)
        self._fds.append(fd)
        os.ftruncate(fd, nbytes)
        segment = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        segment[:TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        self.segments[seq] = segment
        pid = _no_process() if nbytes in self.from_dead_owner else os.getpid()
        if self.closing_next:
            self.closing_next = False
            self._fds.remove(fd)
            os.close(fd)  # the segment stays mapped here, for the test to look at
        return Slot(node_id="node", pid=pid, fd=fd, token=token, nbytes=nbytes, seq=seq)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def _no_process() -> int:
    """A pid no process has: the kernel gives pids below ``pid_max``."""
    with open("/proc/sys/kernel/pid_max") as pid_max:
        return int(pid_max.read())


class _Actor:
    """A real :class:`ShmOwner` in this process, called as the sender calls its actor:
    each call runs at once, but ``acquire``, which runs when its answer is asked for (as
    Ray may: the actor got to it just then), and ``ray.get`` (stood in) returns its
    answer, or raises what it raised. The answer of the next ``acquire`` once
    ``hold_next`` is set waits for that event (``asked`` is set when it starts
    waiting); ``waits`` records the slot wait each acquire was given."""

    def __init__(self, owner: ShmOwner) -> None:
        self.owner = owner
        self.acquire = SimpleNamespace(remote=self._acquire)
        self.abandon = SimpleNamespace(remote=self._at_once(owner.abandon))
        self.leave = SimpleNamespace(remote=self._at_once(owner.leave))
        self.hold_next: threading.Event | None = None
        self.asked = threading.Event()
        self.waits: list[float] = []

    def _acquire(self, nbytes: int, wait_s: float, learner: str, pid: int) -> Callable[[], Slot]:
        self.waits.append(wait_s)
        held, self.hold_next = self.hold_next, None

        def answer() -> Slot:
            slot = self.owner.acquire(nbytes, wait_s, learner, pid)
            if held is not None:
                self.asked.set()
                assert held.wait(HELD_MOST_S), "the test never let the held answer go"
            return slot

        return answer

    @staticmethod
    def _at_once(method: Callable[..., Any]) -> Callable[..., Callable[[], Any]]:
        def remote(*args: Any) -> Callable[[], Any]:
            answer = method(*args)
            return lambda: answer

        return remote


@pytest.fixture
def owner():
    owner = _Owner()
    yield owner
    owner.close()


@pytest.fixture
def actor():
    owner = ShmOwner("node", max_slots=2)
    yield _Actor(owner)
    owner.close()


def _sender_of(monkeypatch, owner: Any) -> shm_learner.SharedMemorySender:
    """A sender made as a learner makes it, its Ray calls answered by ``owner``."""
    stand_in_ray = SimpleNamespace(
        get=lambda answer, timeout=None: answer(),
        get_actor=lambda name, namespace: owner,
        get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "node"),
    )
    monkeypatch.setattr(shm_learner, "ray", stand_in_ray)
    hub = SimpleNamespace(
        hub_id="hub",
        actor=SimpleNamespace(__ray_ready__=SimpleNamespace(remote=lambda: lambda: True)),
        stopped=lambda: False,
    )
    return shm_learner.SharedMemorySender(hub)


@pytest.fixture
def sender(monkeypatch, owner):
    return _sender_of(monkeypatch, owner)


def _weights(n: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=generator), "b": torch.randn(7, generator=generator)}


def _send_in_thread(sender, weights: dict[str, torch.Tensor], model: str) -> tuple:
    """Start ``sender.send`` on a thread; returns the thread and where its payload (or
    the TransportError it raised) lands."""
    sent: dict[str, object] = {}

    def send() -> None:
        try:
            sent["payload"] = sender.send(weights, WeightSpec.of(weights), model)
        except TransportError as err:
            sent["error"] = err

    thread = threading.Thread(target=send, name=f"send-{model}", daemon=True)
    thread.start()
    return thread, sent


def _written(
    segment: torch.Tensor, slot: Slot, weights: dict[str, torch.Tensor], model: str
) -> bool:
    """Whether ``segment`` (``slot``'s) holds ``weights`` of ``model`` bitwise, whole."""
    header = segment.numpy()
    if read_seq(header) != slot.seq or not holds_model(header, model):
        return False
    layout = PackedLayout.of(WeightSpec.of(weights), HEADER_BYTES)
    return all(
        torch.equal(view, weights[name])
        for name, view in zip(WeightSpec.of(weights).names, layout.views(segment), strict=True)
    )


def test_a_wait_for_a_full_pool_does_not_hold_another_models_send(owner, sender):
    """Model ``big``'s pool is full: its send waits for a slot. Model ``small`` (another
    size, another pool) sends meanwhile, into its own slot, bitwise; ``big`` then
    writes its version once its slot comes."""
    big, small = _weights(4096, seed=1), _weights(64, seed=2)
    big_nbytes = PackedLayout.of(WeightSpec.of(big), HEADER_BYTES).nbytes
    freed = owner.held[big_nbytes] = threading.Event()
    waiting, big_sent = _send_in_thread(sender, big, "big")
    assert owner.asked.wait(HANG_S)  # ``big``'s send is in its slot wait
    other, small_sent = _send_in_thread(sender, small, "small")
    other.join(HANG_S)
    small_went_on = not other.is_alive()
    freed.set()  # let ``big``'s slot come, so that both threads end
    waiting.join(HANG_S)
    other.join(HANG_S)
    assert small_went_on, "model 'small' waited while model 'big' waited for a slot"
    small_slot, big_slot = small_sent["payload"].slot, big_sent["payload"].slot
    assert _written(owner.segments[small_slot.seq], small_slot, small, "small")
    assert _written(owner.segments[big_slot.seq], big_slot, big, "big")


def test_a_slot_older_than_one_written_meanwhile_is_left_for_a_newer_one(owner, sender):
    """``big``'s slot (sequence 1) is answered but held back while ``small`` writes
    sequence 2: the owner frees a learner's older slots never written whole once a newer
    version is planned, so ``big`` gives slot 1 back, asks again and writes sequence 3;
    slot 1 is never written (writes go one at a time, in the order of their slots)."""
    big, small = _weights(4096, seed=3), _weights(64, seed=4)
    big_nbytes = PackedLayout.of(WeightSpec.of(big), HEADER_BYTES).nbytes
    freed = owner.held[big_nbytes] = threading.Event()
    waiting, big_sent = _send_in_thread(sender, big, "big")
    assert owner.asked.wait(HANG_S)
    other, small_sent = _send_in_thread(sender, small, "small")
    other.join(HANG_S)
    small_went_on = not other.is_alive()
    del owner.held[big_nbytes]  # asked again, ``big`` is answered at once
    freed.set()
    waiting.join(HANG_S)
    other.join(HANG_S)
    assert small_went_on, "model 'small' waited while model 'big' waited for a slot"
    assert small_sent["payload"].slot.seq == 2
    big_slot = big_sent["payload"].slot
    assert big_slot.seq == 3
    assert _written(owner.segments[big_slot.seq], big_slot, big, "big")
    assert read_seq(owner.segments[1].numpy()) == 0
    assert not owner.segments[1][HEADER_BYTES:].any()
    assert owner.abandoned == [(os.getpid(), 1)]  # given back, not left pending


def test_a_slot_skipped_is_given_back_at_once_and_the_send_waits_once(monkeypatch, actor):
    """Models ``a`` and ``b`` of one size share the learner's pool (of 2 slots here) at a
    real owner: ``a`` is answered sequence 1, held back while ``b`` writes sequence 2.
    ``a`` skips slot 1 and asks again: slot 1, given back, is free (were it left
    pending until the hub planned ``b``'s version, the pool stayed full and ``a``
    failed after its whole slot wait), and ``a`` writes it as sequence 3. Asked again,
    the owner is given only what is left of the send's one slot wait."""
    monkeypatch.setattr(shm_learner, "SLOT_WAIT_S", TEST_SLOT_WAIT_S)
    sender = _sender_of(monkeypatch, actor)
    a, b = _weights(256, seed=5), _weights(256, seed=6)
    actor.hold_next = threading.Event()
    freed = actor.hold_next
    waiting, a_sent = _send_in_thread(sender, a, "a")
    assert actor.asked.wait(HANG_S)  # ``a`` is answered sequence 1, held back
    b_slot = sender.send(b, WeightSpec.of(b), "b").slot
    freed.set()
    waiting.join(HANG_S)
    assert not waiting.is_alive(), "model 'a' hung"
    assert "error" not in a_sent, f"model 'a' found no slot: {a_sent.get('error')}"
    a_slot = a_sent["payload"].slot
    assert (b_slot.seq, a_slot.seq) == (2, 3)
    readers = Mappings(writable=False)
    assert _written(readers.buffer(a_slot), a_slot, a, "a")
    assert _written(readers.buffer(b_slot), b_slot, b, "b")
    stats = actor.owner.stats()
    assert (stats.segments, stats.holds) == (2, ("pending", "pending"))  # 2 and 3
    assert actor.waits[2] < actor.waits[0] <= TEST_SLOT_WAIT_S  # a then b then a again
    readers.clear()


def test_a_failed_write_into_a_dead_owners_slot_keeps_the_order_of_the_live_ones(owner, sender):
    """The owner restarted: ``big`` holds sequence 1 of the live owner, answered but
    held back while ``small`` writes sequence 2. ``medium``'s answer names the owner
    that died: its mapping fails. ``big`` must still skip slot 1 (freed once the hub
    plans sequence 2, it may be given again while written: torn) and write a newer one."""
    big, small, medium = _weights(4096, seed=7), _weights(64, seed=8), _weights(512, seed=9)
    big_nbytes = PackedLayout.of(WeightSpec.of(big), HEADER_BYTES).nbytes
    owner.from_dead_owner.add(PackedLayout.of(WeightSpec.of(medium), HEADER_BYTES).nbytes)
    freed = owner.held[big_nbytes] = threading.Event()
    waiting, big_sent = _send_in_thread(sender, big, "big")
    assert owner.asked.wait(HANG_S)
    assert sender.send(small, WeightSpec.of(small), "small").slot.seq == 2
    with pytest.raises(TransportError, match="the owner may have died"):
        sender.send(medium, WeightSpec.of(medium), "medium")  # sequence 3
    del owner.held[big_nbytes]
    freed.set()
    waiting.join(HANG_S)
    big_slot = big_sent["payload"].slot
    assert big_slot.seq == 4, f"model 'big' wrote slot {big_slot.seq}, older than slot 2"
    assert _written(owner.segments[big_slot.seq], big_slot, big, "big")
    assert read_seq(owner.segments[1].numpy()) == 0
    assert owner.abandoned == [(os.getpid(), 1)]


def test_a_slot_asked_for_ahead_whose_owner_died_after_answering_is_not_written(owner, sender):
    """The slot asked for ahead once version 1 left was answered, then its owner was
    killed: its descriptors are closed while its pid is still there (not yet reaped).
    The next send asks the owner the hub restarts (here the stand-in again) and writes
    a slot of its own, bitwise, instead of failing to open the dead one's."""
    weights = _weights(256, seed=10)
    first = sender.send(weights, WeightSpec.of(weights), "m")
    owner.closing_next = True
    sender.submitted(first, None)  # asks for sequence 2 ahead; answered in the next send
    newer = _weights(256, seed=11)
    slot = sender.send(newer, WeightSpec.of(newer), "m").slot
    assert slot.seq == 3
    assert _written(owner.segments[3], slot, newer, "m")
    assert read_seq(owner.segments[2].numpy()) == 0  # the dead owner's slot, untouched


def test_a_slot_asked_for_ahead_and_refused_is_not_waited_for_again(monkeypatch, actor):
    """A receiver holds every version of ``m`` it is sent, past its room in the
    learner's pool at a real owner. The slot asked for ahead once the last version
    left is refused after the whole slot wait: the next send asks again with none of
    it left, and fails with that first refusal, not after a second wait."""
    monkeypatch.setattr(shm_learner, "SLOT_WAIT_S", TEST_SLOT_WAIT_S)
    sender = _sender_of(monkeypatch, actor)
    for version in range(1, 2 + KEPT_PER_RECEIVER + 1):  # the pool's room: 2 + kept
        weights = _weights(256, seed=20 + version)
        payload = sender.send(weights, WeightSpec.of(weights), "m")
        actor.owner.deliver(os.getpid(), payload.slot.seq, "m", ("stuck",), version=version)
        sender.submitted(payload, None)  # asks for the next version's slot ahead

    newer = _weights(256, seed=30)
    with pytest.raises(
        TransportError,
        match=rf"stayed held for {TEST_SLOT_WAIT_S:g} s by: latest/m, worker/stuck;",
    ):
        sender.send(newer, WeightSpec.of(newer), "m")
    assert actor.waits[-2:] == [TEST_SLOT_WAIT_S, 0.0]  # ahead, then what was left
