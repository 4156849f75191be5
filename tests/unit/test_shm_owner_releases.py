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
