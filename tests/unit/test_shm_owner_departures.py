"""The departures a node's ShmOwner (actors/shm_owner.py) remembers, driven as the plain
class it is, its clock moved on by the test: every worker's departure (it left, died, or
lapsed) reaches every node's owner, which turns away the holds for it that land after
(a relay's, or a plan's made before the hub heard). Kept for good, a long job whose
collectors come and go grew them without bound; they are kept as long as such a hold
may still land (``GONE_KEPT_S``, and no sooner than a relay still copying may bring
one), not by count, which could forget a worker whose relay's hold was still coming
and keep that slot for good."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from raysync.actors import shm_owner
from raysync.actors.shm_owner import GONE_KEPT_S, SLOT_WAIT_S, ShmOwner
from raysync.layout import HEADER_BYTES

PID = os.getpid()  # the owner runs in this process: its slots name this pid
NBYTES = 4096


class _Clock:
    """The owner's clock, which a test moves on (its waits stay real time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def owner(clock):
    owner = ShmOwner("node", max_slots=2, clock=clock)
    yield owner
    owner.close()


def test_a_hold_for_a_worker_gone_is_turned_away_while_a_relay_may_still_bring_it(owner, clock):
    """A relay sent before the departure takes its receivers' holds after waiting for a
    slot and copying the version in: landing a slot wait and more after the departure,
    and thousands of departures later, it is still turned away."""
    owner.drop_worker("w")
    for n in range(2000):  # collectors that come and go meanwhile
        clock.now += SLOT_WAIT_S / 1000
        owner.drop_worker(f"collector {n}")
    slot = owner.acquire(NBYTES, timeout_s=5.0, learner="learner")

    owner.deliver(PID, slot.seq, "m", ("w", "v"))

    assert owner.stats().holds == ("latest/m", "worker/v")


def test_the_owner_forgets_the_departures_no_hold_can_follow_any_more(owner, clock):
    """A job whose collectors come and go, one a second for an hour: the owner
    remembers the departures of the last ``GONE_KEPT_S`` only, not all 3600."""
    departed_at = {}
    for n in range(3600):
        clock.now += 1.0
        worker = f"collector {n}"
        if n % 2:
            owner.lapse(worker)  # stopped beating
        else:
            owner.drop_worker(worker)  # left, or died
        departed_at[worker] = clock.now

    remembered = [w for w, at in departed_at.items() if clock.now - at <= GONE_KEPT_S]
    assert list(owner._gone) == remembered
    assert len(remembered) == GONE_KEPT_S + 1  # one a second, both ends counted


def test_a_worker_gone_again_is_remembered_from_its_last_departure(owner, clock):
    """A worker that lapses, joins again and leaves is gone as of its last departure,
    not its first: a relay's hold may follow that one for ``GONE_KEPT_S``."""
    owner.lapse("w")
    clock.now += GONE_KEPT_S - 1
    owner.join("w")
    owner.drop_worker("w")
    clock.now += GONE_KEPT_S - 1
    owner.drop_worker("another")  # the owner forgets the departures older than it keeps
    slot = owner.acquire(NBYTES, timeout_s=5.0, learner="learner")

    owner.deliver(PID, slot.seq, "m", ("w",))

    assert owner.stats().holds == ("latest/m",)


def _fetched_after(
    clock: _Clock, owner: ShmOwner, taking_s: float, raising: bool = False
) -> Callable[[object], np.ndarray]:
    """A relay's fetch of the exported version from the object store (``ray.get``, which
    the owner calls with no timeout) that takes ``taking_s`` of the owner's clock, while
    another worker leaves (the owner then forgets the departures it keeps no longer);
    it fails instead of answering if ``raising``."""

    def fetch(ref: object) -> np.ndarray:
        clock.now += taking_s
        owner.drop_worker("a collector")
        if raising:
            raise ConnectionError("the object store lost the export")
        return np.full(NBYTES - HEADER_BYTES, 7, dtype=np.uint8)

    return fetch


def test_a_relay_copying_longer_than_departures_are_kept_takes_no_hold_for_one(
    owner, clock, monkeypatch
):
    """A relay for ``w``, sent before ``w`` left, starts a moment after its drop ran (Ray
    starts unnumbered calls late) and copies the version in for longer than
    ``GONE_KEPT_S``: the owner forgot the departure as another worker left meanwhile,
    took the relay's hold for ``w``, and kept that slot for good (nobody releases it)."""
    owner.drop_worker("w")
    clock.now += 1.0
    monkeypatch.setattr(shm_owner.ray, "get", _fetched_after(clock, owner, GONE_KEPT_S + 60))

    owner.relay(["export"], NBYTES, "m", ("w", "v"), timeout_s=5.0, version=1)

    assert owner.stats().holds == ("latest/m", "worker/v")


def test_departures_are_forgotten_again_once_the_relay_copying_failed(owner, clock, monkeypatch):
    """A relay whose fetch failed keeps no departure past ``GONE_KEPT_S`` any more."""
    owner.drop_worker("w")
    monkeypatch.setattr(
        shm_owner.ray, "get", _fetched_after(clock, owner, GONE_KEPT_S + 60, raising=True)
    )
    with pytest.raises(ConnectionError):
        owner.relay(["export"], NBYTES, "m", ("w",), timeout_s=5.0, version=1)

    owner.drop_worker("another")

    assert list(owner._gone) == ["a collector", "another"]
