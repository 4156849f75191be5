"""The shared-memory receiver's leases (raysync/transports/shared_memory/receiver.py),
against a real ShmOwner (actors/shm_owner.py) in this process: the owner holds a slot
once per worker, so a version fetched by two transport receivers of one worker in one
process (the one a re-registration replaced, which staged it, and the new one, which
fetched it again for the welcome's catch-up) is released when both are done with it."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from raysync.actors.shm_owner import ShmOwner
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.shared_memory import receiver as shm_receiver
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


@pytest.fixture
def owner(monkeypatch):
    # The receivers ask Ray which node they run on: this one, the owner's.
    context = SimpleNamespace(get_node_id=lambda: NODE, get_actor_id=lambda: None)
    monkeypatch.setattr(shm_receiver.ray, "get_runtime_context", lambda: context)
    owner = ShmOwner(NODE, max_slots=2)
    yield owner
    owner.close()


def _written(owner: ShmOwner, workers: tuple[str, ...]) -> SharedMemoryPayload:
    """A version as the learner writes it and the hub plans it for ``workers``: the
    payload of the hub's delivery (its placement: not the learner's own call)."""
    nbytes = PackedLayout.of(SPEC, HEADER_BYTES).nbytes
    slot = owner.acquire(nbytes, timeout_s=5.0, learner="learner", pid=PID)
    learner = Mappings(writable=True)
    write_seq(learner.buffer(slot).numpy(), slot.seq)
    learner.clear()
    owner.deliver(PID, slot.seq, "m", workers, version=1, placement=1)
    return SharedMemoryPayload(slot, placement=1)


def _receiver(owner: ShmOwner, worker: str) -> shm_receiver.SharedMemoryReceiver:
    """A transport receiver of ``worker`` as its registration opens one: the hub's
    ``receiver_joined`` makes the owner ``join`` it first."""
    board = owner.join(worker)
    return shm_receiver.SharedMemoryReceiver(SharedMemoryReceiverInfo(worker, "owner", board))


def test_a_version_staged_by_a_replaced_receiver_stays_held_for_its_successors_fetch(owner):
    """The worker re-registers while version S waits at its safe point (fetched by the
    old transport receiver); the welcome's catch-up plans S again (a hold for the
    worker) and the new receiver fetches it. The old one's release (superseded by the
    new fetch at the gate) released the owner's one hold for the worker on the board:
    S was then held by nothing but ``latest``, and the learner could rewrite it before
    the new fetch was copied. (Counted per worker: another worker of this process
    releases its own hold.)"""
    old, another = _receiver(owner, "w"), _receiver(owner, "x")
    payload = _written(owner, ("w", "x"))
    staged = old.fetch(payload, SPEC)
    another.release(payload, another.fetch(payload, SPEC))
    assert "worker/x" not in owner.stats().holds
    new = _receiver(owner, "w")  # registered again: the owner forgot its holds
    owner.deliver(PID, payload.slot.seq, "m", ("w",), version=1)  # the catch-up's plan
    fetched = new.fetch(payload, SPEC)
    old.close()

    old.release(payload, staged)  # superseded at the gate by the catch-up
    assert "worker/w" in owner.stats().holds, "released while the new fetch waits to be read"
    new.release(payload, fetched)  # copied at the safe point
    assert "worker/w" not in owner.stats().holds


def test_releases_from_two_threads_open_the_board_once(owner, monkeypatch):
    """Two threads release at once (a superseded version on the loop, another on the
    hub watch): each found no board descriptor open and opened one, and one leaked."""
    receiver = _receiver(owner, "w")
    payloads = [_written(owner, ("w",)) for _ in range(2)]
    views = [receiver.fetch(p, SPEC) for p in payloads]
    opened: list[int] = []
    both_in = threading.Barrier(2, timeout=2.0)
    open_fd = shm_receiver.open_segment_fd

    def opening(slot, writable):
        try:
            both_in.wait()  # both threads are past the check before either opens
        except threading.BrokenBarrierError:
            pass  # the other one waits for this one's open (the lock): it opens alone
        fd = open_fd(slot, writable)
        opened.append(fd)
        return fd

    monkeypatch.setattr(shm_receiver, "open_segment_fd", opening)
    threads = [
        threading.Thread(target=receiver.release, args=(p, v))
        for p, v in zip(payloads, views, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    receiver.close()
    assert len(opened) == 1, opened
    assert not any(h.startswith("worker/") for h in owner.stats().holds)


@pytest.fixture
def by_call(owner, monkeypatch):
    """Releases by call reach ``owner`` at once (as its actor's ``release``)."""
    handle = SimpleNamespace(release=SimpleNamespace(remote=owner.release))
    monkeypatch.setattr(shm_receiver.ray, "get_actor", lambda name, namespace=None: handle)


def test_a_version_released_twice_before_its_second_hold_lands_is_not_held(owner, by_call):
    """Delivered twice (a pull beside a broadcast of it), the version was copied once and
    turned down once before the owner read the board, and the second delivery's hold
    landed last: the two releases were one cell's value, counted once, and the second
    hold was kept until the worker left."""
    receiver = _receiver(owner, "w")
    payload = _written(owner, ("w",))  # the first delivery's hold
    receiver.release(payload, receiver.fetch(payload, SPEC))  # copied: on the board
    receiver.release(payload, None)  # the second, turned down (holds that version)
    owner.deliver(PID, payload.slot.seq, "m", ("w",), version=1, placement=2)  # its hold
    assert "worker/w" not in owner.stats().holds


def test_a_late_release_of_a_former_version_keeps_the_release_of_the_current_one(
    owner, by_call
):
    """A segment reused for version 3 is released on the board, unread; a late release
    of version 1 (turned down, delivered again) wrote over it: version 3's hold was
    kept, and its slot with it."""
    receiver = _receiver(owner, "w")
    first = _written(owner, ("w",))
    receiver.release(first, receiver.fetch(first, SPEC))
    second = _written(owner, ("w",))
    receiver.release(second, receiver.fetch(second, SPEC))
    third = _written(owner, ("w",))
    assert third.slot.column == first.slot.column  # the first's segment again
    receiver.release(third, receiver.fetch(third, SPEC))  # on the board, unread
    receiver.release(first, None)  # late, of a version that segment no longer holds
    assert "worker/w" not in owner.stats().holds
