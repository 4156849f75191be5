"""ShmOwner (actors/shm_owner.py), driven as the plain class it is: a receiver's release
by call may reach the owner before the hub's hold for that version (the learner
delivers its slot itself and the hub books the holds after), and either order frees the
slot for that receiver and counts as a release by call."""

from __future__ import annotations

import os

import pytest

from raysync.actors.shm_owner import ShmOwner

PID = os.getpid()  # the owner runs in this process: its slots name this pid


@pytest.fixture
def owner():
    owner = ShmOwner("node", max_slots=2)
    yield owner
    owner.close()


def test_a_release_by_call_before_or_after_the_hubs_hold_frees_the_slot_and_is_counted(owner):
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")

    owner.release(PID, slot.seq, "early")  # done with it before the hub's hold came
    owner.deliver(PID, slot.seq, "m", ("early", "late"))
    assert owner.stats().holds == ("latest/m", "worker/late")
    assert owner.stats().release_calls == 1

    owner.release(PID, slot.seq, "late")
    stats = owner.stats()
    assert stats.holds == ("latest/m",)
    assert (stats.release_calls, stats.board_releases) == (2, 0)


def test_a_release_of_a_version_the_owner_no_longer_has_is_ignored(owner):
    slot = owner.acquire(4096, timeout_s=5.0, learner="learner")
    owner.deliver(PID, slot.seq, "m", ("w0",))

    owner.release(PID + 1, slot.seq, "w0")  # a slot of another (dead) owner's process
    owner.release(PID, slot.seq + 1, "w0")  # a sequence never given out here
    stats = owner.stats()
    assert stats.holds == ("latest/m", "worker/w0")
    assert stats.release_calls == 0


def test_a_slot_is_not_handed_out_while_the_owner_exports_it(monkeypatch):
    """The owner puts a version into the object store for other nodes outside its
    lock; if a newer version becomes the latest meanwhile, the exported slot has no
    other hold left, and must still not be written before the copy is made."""
    from raysync.actors import shm_owner

    owner = ShmOwner("node", max_slots=3)
    try:
        exported = owner.acquire(4096, timeout_s=5.0, learner="learner")
        owner.deliver(PID, exported.seq, "m", ())  # held as the latest version only
        during: dict[str, object] = {}

        def put(data: object) -> str:
            newer = owner.acquire(4096, timeout_s=5.0, learner="learner")
            owner.deliver(PID, newer.seq, "m", ())  # the latest now: the old one's hold goes
            during["holds"] = owner.stats().holds
            during["next"] = owner.acquire(4096, timeout_s=5.0, learner="learner")
            return "ref"

        monkeypatch.setattr(shm_owner.ray, "put", put)
        assert owner.export(PID, exported.seq) == ["ref"]
        assert during["next"].fd != exported.fd  # another slot: the exported one is held
        assert "exporting/1" in during["holds"]
        assert "exporting/1" not in owner.stats().holds  # and free again once copied
    finally:
        owner.close()
