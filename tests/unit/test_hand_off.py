"""HandOffClock.summary (raysync/transports/hand_off.py): the medians per bucket of a
stream's hand-off, from the broker's stamps, without Ray."""

from __future__ import annotations

import pytest

from raysync.transports import hand_off
from raysync.transports.hand_off import HandOff, HandOffClock


class _Clock:
    """What ``time.monotonic`` returns in hand_off while a test stamps: ``now``."""

    now = 0.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


@pytest.fixture
def at(monkeypatch):
    """Stamp calls at given times: ``at(t, call, *args)``."""
    monkeypatch.setattr(hand_off, "time", _Clock)

    def stamp(when: float, call, *args) -> None:
        _Clock.now = when
        call(*args)

    return stamp


def stamped(at, learner_s: float, reader_s: dict[str, float], count: int = 5) -> HandOffClock:
    """The calls of a steady stream: each reader's next take arrives ``reader_s`` after
    its answer, the learner's offer ``learner_s`` after its room."""
    clock, now = HandOffClock(), 0.0
    answered = now  # the answer to the previous bucket's takes
    for k in range(count):
        if k >= 2:
            at(clock.offered[k - 1] + 0.001, clock.ask_room, k)
            at(now, clock.grant_room, k)
        if k >= 1:
            now += learner_s
        for worker, turn in reader_s.items():
            at(now - 0.002 if k == 0 else answered + turn, clock.take, worker, k)
        at(now, clock.offer, k)
        for worker in reader_s:
            at(now, clock.answer, worker, k)
        answered = now
        now = answered + max(reader_s.values())
    return clock


def test_a_steady_stream_splits_its_period_into_the_readers_and_the_learners_turns(at):
    summary = stamped(at, learner_s=0.003, reader_s={"a": 0.001, "b": 0.004}).summary()
    assert summary.buckets == 5
    assert summary.readers_turn_s == pytest.approx(0.004)  # the slowest reader's
    assert summary.learner_turn_s == pytest.approx(0.003)
    assert summary.period_s == pytest.approx(0.007)
    assert summary.room_wait_s == pytest.approx(0.003)  # asked 1 ms after the offer
    # The slowest reader waits for the learner's turn, the quickest for both turns' rest.
    assert summary.take_wait_s == pytest.approx(0.003)


def test_a_stream_without_the_stamps_a_figure_needs_reports_zero_for_it():
    clock = HandOffClock()
    clock.offer(0)
    assert clock.summary() == HandOff(1, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_the_first_stamp_of_a_call_made_twice_counts():
    clock = HandOffClock()
    clock.offer(0)
    first = clock.offered[0]
    clock.offer(0)
    assert clock.offered[0] == first


@pytest.mark.parametrize(
    "calls",
    [
        # Ray ran the offer of bucket 1 (and its answer) before bucket 0's.
        [(0.0, "take", 0), (0.001, "take", 1), (0.01, "answer", 1), (0.02, "answer", 0)],
        # The reader's take of bucket 1 was answered before its take of bucket 0 arrived.
        [(0.001, "take", 1), (0.01, "answer", 1), (0.015, "take", 0), (0.02, "answer", 0)],
    ],
    ids=["answers-reordered", "takes-reordered"],
)
def test_calls_handled_out_of_order_still_count(at, calls):
    """Ray may run a reader's calls, and the learner's offers, out of order: every take
    and answer still counts once (their stamps are kept for the last few buckets)."""
    clock = HandOffClock()
    at(0.0, clock.offer, 0)
    at(0.0, clock.offer, 1)
    for when, call, index in calls:
        at(when, getattr(clock, call), "a", index)
    took = {index: when for when, call, index in calls if call == "take"}
    answered = {index: when for when, call, index in calls if call == "answer"}
    summary = clock.summary()
    waits = sorted(answered[k] - took[k] for k in (0, 1))
    assert summary.take_wait_s == pytest.approx(sum(waits) / 2)
    assert summary.readers_turn_s == pytest.approx(took[1] - answered[0])
