"""Calls that must run in the order their caller sent them, inside an async Ray actor.

Ray starts an async actor's calls out of order (``allow_out_of_order_execution`` is
forced on for async actors): two broadcasts a learner submits back to back may reach
the hub's code in either order, and two holds the hub sends a shared-memory owner
likewise. Where order carries meaning (versions follow the learner's order; an owner
frees the slots of versions older than the one it is told about), the caller numbers
its calls 1, 2, 3, ... per *stream* and the actor waits for each call's turn with
:class:`InOrder` before the part that must keep the order.

Used in the hub process and in shared-memory owner processes (their event loops).
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class InOrder:
    """Turns for calls numbered per stream, in their number order.

    A call waits for the calls numbered before it in its stream to have had their turn,
    at most ``wait_s`` (a number that never comes — a lost call — is skipped, logged,
    after that long; numbers below the caller's ``floor`` are not waited for at all). Numbering
    starts at 1; number 0 means "unordered" and never waits. What a call runs after its
    turn, up to its next ``await``, runs before any later call's turn: that is the
    order guaranteed.
    """

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._next: dict[str, int] = {}
        self._waiting: dict[str, set[int]] = {}
        self._changed = asyncio.Condition()

    async def wait_turn(self, stream: str, number: int, floor: int = 0) -> None:
        """Return once every lower number of ``stream`` has had its turn (or ``wait_s``
        passed). ``floor``: the caller knows every number below it is done with (it
        completed or failed), so none of those is waited for — what lets a stream that
        began before this actor restarted go on at once."""
        if number > 0:
            async with self._changed:
                self._next[stream] = max(self._next.get(stream, 1), floor)
                waiting = self._waiting.setdefault(stream, set())
                waiting.add(number)
                try:
                    while self._next[stream] < number:
                        try:
                            await asyncio.wait_for(
                                self._changed.wait_for(lambda: self._next[stream] >= number),
                                self._wait_s,
                            )
                        except asyncio.TimeoutError:
                            self._skip_to_lowest_waiting(stream)
                finally:
                    waiting.discard(number)
                self._next[stream] = max(self._next[stream], number + 1)
                self._changed.notify_all()

    async def wait_passed(self, stream: str, number: int) -> None:
        """Return once call ``number`` of ``stream`` has had its turn and run up to its
        next ``await`` (or ``wait_s`` passed: a lost call is not waited for longer).
        A reader of what that call changes sees the change; number 0 returns at once."""
        if number > 0:
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._next.get(stream, 1) > number),
                        self._wait_s,
                    )
                except asyncio.TimeoutError:
                    logger.info(
                        "stream %s: call %d did not have its turn within %g s; reading without it",
                        stream,
                        number,
                        self._wait_s,
                    )

    def _skip_to_lowest_waiting(self, stream: str) -> None:
        """Give up on the numbers missing below the lowest section waiting (lock held)."""
        lowest = min(self._waiting[stream])
        if self._next[stream] < lowest:
            logger.info(
                "stream %s: calls %d to %d did not come within %g s; going on without them",
                stream,
                self._next[stream],
                lowest - 1,
                self._wait_s,
            )
            self._next[stream] = lowest
            self._changed.notify_all()
