"""Calls that must run in the order their caller sent them, inside a concurrent Ray actor.

Ray starts the calls of an async actor, or of a threaded one (``max_concurrency`` > 1),
out of order (``allow_out_of_order_execution`` is forced on for async actors): two
broadcasts a learner submits back to back may reach the hub's code in either order,
and two holds the hub sends a shared-memory owner likewise. Where order carries meaning
(versions follow the learner's order; an owner frees the slots of versions older than
the one it is told about), the caller numbers its calls 1, 2, 3, ... per *stream* and
the actor waits for each call's turn before the part that must keep the order: with
:class:`InOrder` on an event loop (the hub process), with :class:`ThreadsInOrder` in a
threaded actor (shared-memory owner processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator

logger = logging.getLogger(__name__)


#: Streams with no call waiting kept, the most recently used: a stream is one learner
#: process's side of the hub (a learner that calls ``release()`` each step begins a new
#: one each time), and one forgotten costs nothing to a caller that sends its floor.
STREAMS_KEPT = 1024


class _Turns:
    """Whose turn it is, per stream: the bookkeeping both kinds of waiting share. Its
    owner calls every method with its condition's lock held. Keeps the books of every
    stream with a call waiting and of the ``streams_kept`` others used last."""

    def __init__(self, wait_s: float, streams_kept: int = STREAMS_KEPT) -> None:
        self.wait_s = wait_s
        self._streams_kept = streams_kept
        self._next: OrderedDict[str, int] = OrderedDict()  #: least recently used first
        self._waiting: dict[str, set[int]] = {}

    def streams(self) -> int:
        """How many streams it keeps books for."""
        return len(self._next)

    def came_late(self, stream: str, number: int) -> bool:
        """Whether call ``number`` arrives after the calls numbered above it had their
        turn without it (it was given up on after ``wait_s``)."""
        return self._next.get(stream, 1) > number

    def enter(self, stream: str, number: int, floor: int) -> None:
        self._next[stream] = max(self._next.get(stream, 1), floor)
        self._next.move_to_end(stream)
        self._waiting.setdefault(stream, set()).add(number)

    def has_turn(self, stream: str, number: int) -> bool:
        return self._next[stream] >= number

    def leave(self, stream: str, number: int, ran: bool) -> None:
        waiting = self._waiting[stream]
        waiting.discard(number)
        if not waiting:
            del self._waiting[stream]
        if ran:
            self._next[stream] = max(self._next[stream], number + 1)
        self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the least recently used streams with no call waiting, beyond those kept.
        A call of a forgotten stream starts from its caller's floor (the hub's learners
        send theirs); a reader of one (``passed``) waits ``wait_s`` at most, once."""
        excess = len(self._next) - len(self._waiting) - self._streams_kept
        if excess <= 0:
            return
        forgotten: list[str] = []
        for stream in self._next:
            if stream not in self._waiting:
                forgotten.append(stream)
                if len(forgotten) == excess:
                    break
        for stream in forgotten:
            del self._next[stream]

    def passed(self, stream: str, number: int) -> bool:
        return self._next.get(stream, 1) > number

    def skip_to_lowest_waiting(self, stream: str) -> None:
        """Give up on the numbers missing below the lowest section waiting."""
        lowest = min(self._waiting[stream])
        if self._next[stream] < lowest:
            logger.info(
                "stream %s: calls %d to %d did not come within %g s; going on without them",
                stream,
                self._next[stream],
                lowest - 1,
                self.wait_s,
            )
            self._next[stream] = lowest

    def log_read_without(self, stream: str, number: int) -> None:
        logger.info(
            "stream %s: call %d did not have its turn within %g s; reading without it",
            stream,
            number,
            self.wait_s,
        )


class InOrder:
    """Turns for calls numbered per stream, in their number order, on an event loop.

    A call waits for the calls numbered before it in its stream to have had their turn,
    at most ``wait_s`` (a number that never comes — a lost call — is skipped, logged,
    after that long; numbers below the caller's ``floor`` are not waited for at all). Numbering
    starts at 1; number 0 means "unordered" and never waits. What a call runs after its
    turn, up to its next ``await``, runs before any later call's turn: that is the
    order guaranteed.
    """

    def __init__(self, wait_s: float, streams_kept: int = STREAMS_KEPT) -> None:
        self._turns = _Turns(wait_s, streams_kept)
        self._changed = asyncio.Condition()

    def streams(self) -> int:
        """How many streams it keeps books for: those with a call waiting and the
        ``streams_kept`` others used last."""
        return self._turns.streams()

    async def wait_turn(self, stream: str, number: int, floor: int = 0) -> bool:
        """Return once every lower number of ``stream`` has had its turn (or ``wait_s``
        passed). ``floor``: the caller knows every number below it is done with (it
        completed or failed), so none of those is waited for — what lets a stream that
        began before this actor restarted go on at once. Returns whether the call came
        late: a call numbered above it had its turn first, after ``wait_s`` without
        it (what it carries is older than what went on); False for number 0."""
        if number <= 0:
            return False
        turns = self._turns
        async with self._changed:
            late = turns.came_late(stream, number)
            turns.enter(stream, number, floor)
            ran = False
            try:
                while not turns.has_turn(stream, number):
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: turns.has_turn(stream, number)),
                            turns.wait_s,
                        )
                    except asyncio.TimeoutError:
                        turns.skip_to_lowest_waiting(stream)
                        self._changed.notify_all()
                ran = True
            finally:
                turns.leave(stream, number, ran)
            self._changed.notify_all()
        return late

    async def wait_passed(self, stream: str, number: int) -> bool:
        """Return once call ``number`` of ``stream`` has had its turn and run up to its
        next ``await`` (or ``wait_s`` passed: a lost call is not waited for longer).
        A reader of what that call changes sees the change. Number 0, or a call that
        had its turn already, returns without awaiting: what the reader does then comes
        before any call started after it on the loop (the hub forgets a learner that
        let its side go before that process's next learner side asks for a route).
        Whether it passed (False: the reader goes on without its change)."""
        turns = self._turns
        if number <= 0 or turns.passed(stream, number):
            return True
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: turns.passed(stream, number)), turns.wait_s
                )
            except asyncio.TimeoutError:
                turns.log_read_without(stream, number)
                return False
        return True


class ThreadsInOrder:
    """:class:`InOrder` for a threaded actor. A call's turn is a section run holding
    :attr:`lock` (``with in_order.turn(stream, number): ...``), so what it does there
    runs before any later call's turn. The actor may guard the rest of its state with
    the same lock (a condition: its waits let turns pass)."""

    def __init__(self, wait_s: float) -> None:
        self._turns = _Turns(wait_s)
        self.lock = threading.Condition()

    @contextlib.contextmanager
    def turn(self, stream: str, number: int) -> Iterator[None]:
        """The turn of call ``number`` of ``stream``: entering waits for every lower
        number to have had its own (at most ``wait_s``, as :meth:`InOrder.wait_turn`).
        Number 0 only takes the lock."""
        turns = self._turns
        with self.lock:
            if number <= 0:
                yield
                return
            turns.enter(stream, number, 0)
            ran = False
            try:
                while not self.lock.wait_for(lambda: turns.has_turn(stream, number), turns.wait_s):
                    turns.skip_to_lowest_waiting(stream)
                    self.lock.notify_all()
                ran = True  # had its turn: later numbers go on, even if the section raises
                yield
            finally:
                turns.leave(stream, number, ran)
                self.lock.notify_all()

    def wait_passed(self, stream: str, number: int) -> None:
        """With :attr:`lock` held: return once call ``number`` of ``stream`` and those
        before it have had their turns (at most ``wait_s``: a lost call is not waited
        for longer). For a call that is not numbered itself (it must not hold up the
        later ones) but must come after those sent before it. Number 0 returns at once."""
        turns = self._turns
        if number > 0 and not self.lock.wait_for(
            lambda: turns.passed(stream, number), turns.wait_s
        ):
            turns.log_read_without(stream, number)
