"""Where a bucketed version's time goes between buckets: the bucket broker's clock.

Every bucket of a bucketed version is handed from the learner to its readers through
the hub's bucket broker (``actors/bucket_broker.py``), and the broker hears each step
of it: the learner's ``offer`` of bucket ``k``, each reader's ``take`` of it and the
broker's answer, the learner's ``room`` for bucket ``k`` (granted once every reader has
copied the bucket whose slot ``k`` reuses). Broker process: :class:`HandOffClock`
stamps those calls on one clock (a few dicts per stream); benchmarks and users ask the
broker for :meth:`HandOffClock.summary`, a :class:`HandOff` of medians per bucket.

With :data:`~raysync.transports.object_store.bucket_stream.BUCKETS_IN_FLIGHT` slots, bucket ``k`` is
offered a *period* after bucket ``k - 1``, made of:

* the readers' turn: from the broker's answer to ``take(k - 1)`` until the slowest
  reader's ``take(k)`` arrives. A reader asks for ``k`` as soon as it has read bucket
  ``k - 2`` (two asks ahead), saying so: what the learner's ``room(k)`` waits for. The
  turn is negative when that ask arrives before the answer about ``k - 1`` leaves (the
  reader reads faster than the learner offers), and it holds the rest of the read of
  ``k - 2`` when reading is slower;
* the learner's turn: from ``room(k)`` granted until ``offer(k)`` arrives (the grant's
  way to the learner, its pack of bucket ``k``, the offer's way back).

So a period far above the bytes' own copy time is made of messages (a control plane
that costs per bucket, whatever its size), and the two turns say whose.
"""

from __future__ import annotations

import statistics
import time
from array import array
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HandOff:
    """Medians over a stream's buckets, in seconds (0.0 where no bucket had the two
    stamps a figure needs: a stream of one or two buckets has no room to wait for)."""

    buckets: int  #: buckets the learner offered
    period_s: float  #: from one bucket's offer to the next one's
    readers_turn_s: float  #: answer to ``take(k - 1)`` -> slowest reader's ``take(k)``
    learner_turn_s: float  #: ``room(k)`` granted -> ``offer(k)`` arrives
    room_wait_s: float  #: ``room(k)`` asked -> granted (the learner waiting for readers)
    take_wait_s: float  #: ``take(k)`` arrives -> answered (a reader waiting for the learner)


#: How many buckets below the highest one a reader asked for its stamps are kept: Ray
#: may handle a reader's calls out of order, never this far apart (it asks two ahead).
STAMPS_KEPT = 8


@dataclass
class HandOffClock:
    """Broker process: when each hand-off call of one stream arrived or was answered
    (``time.monotonic()``). Per bucket it keeps a few stamps; per reader, those of its
    last :data:`STAMPS_KEPT` buckets (a stream of 2,000 buckets to 1,000 readers kept a
    stamp per reader and bucket); each reader-bucket wait is one float in an array."""

    offered: dict[int, float] = field(default_factory=dict)
    room_asked: dict[int, float] = field(default_factory=dict)
    room_granted: dict[int, float] = field(default_factory=dict)
    #: reader -> bucket -> when its ``take`` arrived / was answered with the bucket
    _taken: dict[str, dict[int, float]] = field(default_factory=dict)
    _answered: dict[str, dict[int, float]] = field(default_factory=dict)
    #: reader -> the highest bucket it asked for
    _highest: dict[str, int] = field(default_factory=dict)
    #: bucket -> the slowest reader's turn before its take (see the module doc)
    _readers_turn: dict[int, float] = field(default_factory=dict)
    #: each answered take's wait, in seconds
    _take_waits: array = field(default_factory=lambda: array("d"))

    def offer(self, index: int) -> None:
        self.offered.setdefault(index, time.monotonic())

    def ask_room(self, index: int) -> None:
        self.room_asked.setdefault(index, time.monotonic())

    def grant_room(self, index: int) -> None:
        self.room_granted.setdefault(index, time.monotonic())

    def take(self, worker: str, index: int) -> None:
        taken = self._taken.setdefault(worker, {})
        if index in taken or self._forgotten(worker, index):
            return  # asked again: its first take counts
        now = taken[index] = time.monotonic()
        answered = self._answered.get(worker, {}).get(index - 1)
        if answered is not None:
            self._turn(index, now - answered)
        self._keep_last(worker, index)

    def answer(self, worker: str, index: int) -> None:
        answered = self._answered.setdefault(worker, {})
        if index in answered or self._forgotten(worker, index):
            return  # its first answer counts
        now = answered[index] = time.monotonic()
        taken = self._taken.get(worker, {})
        asked = taken.get(index)
        if asked is not None:
            self._take_waits.append(now - asked)
        following = taken.get(index + 1)
        if following is not None:  # asked ahead, before this answer left: a negative turn
            self._turn(index + 1, following - now)

    def _forgotten(self, worker: str, index: int) -> bool:
        return index < self._highest.get(worker, index) - STAMPS_KEPT

    def _keep_last(self, worker: str, index: int) -> None:
        """Forget ``worker``'s stamps more than :data:`STAMPS_KEPT` below its highest."""
        if index <= self._highest.get(worker, -1):
            return
        self._highest[worker] = index
        for stamps in (self._taken.get(worker, {}), self._answered.get(worker, {})):
            for old in [i for i in stamps if i < index - STAMPS_KEPT]:
                del stamps[old]

    def _turn(self, index: int, turn: float) -> None:
        slowest = self._readers_turn.get(index)
        self._readers_turn[index] = turn if slowest is None else max(slowest, turn)

    def summary(self) -> HandOff:
        offered = self.offered
        periods = [offered[k] - offered[k - 1] for k in offered if k - 1 in offered]
        readers_turns = [turn for k, turn in self._readers_turn.items() if k in offered]
        granted = self.room_granted
        learner_turns = [offered[k] - granted[k] for k in offered if k in granted]
        room_waits = [at - self.room_asked[k] for k, at in granted.items() if k in self.room_asked]
        return HandOff(
            buckets=len(offered),
            period_s=_median(periods),
            readers_turn_s=_median(readers_turns),
            learner_turn_s=_median(learner_turns),
            room_wait_s=_median(room_waits),
            take_wait_s=_median(list(self._take_waits)),
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
