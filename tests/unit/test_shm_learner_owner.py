"""The shared-memory learner's wait for its node's owner, without Ray: a fake owner and
clock stand in for the owner actor and the seconds that pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from raysync.transports.base import TransportError
from raysync.transports.shared_memory import learner as shm_learner
from raysync.transports.shared_memory.wire import OWNER_WAIT_S, SLOT_WAIT_S


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Owner:
    """An owner whose acquire takes ``waits_s`` (on the fake clock) and then dies, or
    answers ``slot`` when ``dies`` is False."""

    def __init__(self, clock: _Clock, waits_s: float, dies: bool, slot: object = None) -> None:
        self.acquire = SimpleNamespace(remote=self._acquire)
        self._clock, self._waits_s, self._dies, self._slot = clock, waits_s, dies, slot

    def _acquire(self, *args: object) -> object:
        def get() -> object:
            self._clock.now += self._waits_s
            if self._dies:
                raise RayActorError()
            return self._slot

        return get


def _sender(monkeypatch, clock: _Clock, owners: list[_Owner]) -> shm_learner.SharedMemorySender:
    monkeypatch.setattr(shm_learner, "time", clock)
    monkeypatch.setattr(shm_learner, "ray", SimpleNamespace(get=lambda pending: pending()))
    sender = object.__new__(shm_learner.SharedMemorySender)
    sender._owner, sender._learner, sender._name = owners.pop(0), "learner", "owner-x"
    sender._hub = SimpleNamespace(stopped=lambda: False)
    sender._find_owner = lambda: owners.pop(0)  # the one the hub restarted
    return sender


def test_an_owner_that_dies_deep_into_a_slot_wait_gets_the_full_wait_for_its_restart(
    monkeypatch,
):
    """It died past ``OWNER_WAIT_S`` into the call (a slot wait is longer): the restarted
    owner is still asked (the wait for one counted from the call's start, and raised
    at once that none was back)."""
    clock = _Clock()
    dying = _Owner(clock, waits_s=OWNER_WAIT_S + 5, dies=True)
    restarted = _Owner(clock, waits_s=0.1, dies=False, slot="slot")
    sender = _sender(monkeypatch, clock, [dying, restarted])
    assert sender._acquire(64) == "slot"


def test_owners_that_keep_dying_are_given_up_on_after_the_owner_wait(monkeypatch):
    clock = _Clock()
    owners = [_Owner(clock, waits_s=1.0, dies=True) for _ in range(100)]
    sender = _sender(monkeypatch, clock, owners)
    started = clock.now
    with pytest.raises(TransportError, match="died and no working one was back within"):
        sender._acquire(64, SLOT_WAIT_S)
    assert OWNER_WAIT_S < clock.now - started < OWNER_WAIT_S + 5
