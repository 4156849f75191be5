"""One delivery call at a time to each receiver, per model: :class:`DeliveryLanes`.

Hub process, on its event loop. A default (threaded, one call at a time) actor busy in
a long method — a rollout, a training step — queues every call made to it meanwhile,
and Ray keeps a queued call's arguments until it runs: each version delivered to it in
that time stayed pinned in the object store (the update names its payload) until the
method ended, and then it applied every one of them in turn, the newest last.

A lane keeps the last delivery call made to a receiver (its registration) for one model
while it runs. A delivery that comes meanwhile makes no call but waits for that one to
return; then those of versions no newer than the one it applied end acked (a learner's
newer call may have taken over the wait), the newest of the others goes (the
*leader*), and the rest
end with its outcome (*followers*: acked, as a receiver that already holds a newer
version acks, ``AckStatus.SUPERSEDED``; if it failed, each tries on its own). A
receiver whose last call returned gets the next one at once; one sent versions faster
than it applies them (``wait=False``) is sent the newest, like a busy one. Deliveries
take turns on transports that declare it (``Transport.one_call_at_a_time``: their
updates pin the version's bytes, and a plan left unread holds nothing), for whole
versions only (the others wait for each reader of a bucket stream).

A call that returns after a delivery gave up on it (its own, or one waiting for it,
past its deadline) with no delivery waiting is the hub's cue that its receiver is free
again: :meth:`DeliveryLanes.gave_up` says what to do then (the hub records what it
acked and delivers it the latest version, if it lacks it).

Who calls what: :class:`~actors.hub_delivery.ReceiverDelivery` calls :meth:`calling`
for each call it makes, :meth:`turn` before its own first call and :meth:`gave_up` when
its deadline passes; the hub calls :meth:`calling` for the calls a learner made itself
(the direct path) as it books them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

#: A delivery's outcome, as the hub's delivery makes it (``hub_delivery.Outcome``).
OutcomeT = TypeVar("OutcomeT")


@dataclasses.dataclass(eq=False)
class _Waiting:
    """A delivery waiting for its receiver's running call to return."""

    version: int
    turn: asyncio.Future[Turn[Any]]
    #: called once a newer version waits too (this one then goes only if that one's
    #: call fails), so that it lets go of what its plan holds
    passed: Callable[[], None] | None = None


@dataclasses.dataclass(eq=False)
class Lane(Generic[OutcomeT]):
    """A receiver's last delivery call of one model (``version``), while it runs."""

    call: asyncio.Future[Any]
    version: int
    #: the deliveries waiting for ``call`` to return, in the order they came
    waiting: list[_Waiting] = dataclasses.field(default_factory=list)
    #: once ``call`` returned: the newest version waiting, the one that goes
    leader: int | None = None
    #: the leader's outcome, for its followers to end with
    led: asyncio.Future[OutcomeT] | None = None
    #: set once a delivery gave up on ``call``: run with it and ``version`` when it
    #: returns, if no delivery waits for it (see :meth:`DeliveryLanes.gave_up`)
    then: Callable[[asyncio.Future[Any], int], None] | None = None
    #: ``call`` stands for a delivery getting ready to call (:meth:`DeliveryLanes.getting_ready`)
    getting_ready: bool = False


@dataclasses.dataclass(frozen=True)
class Turn(Generic[OutcomeT]):
    """What a delivery does once :meth:`DeliveryLanes.turn` returned: end acked if the
    call it waited for left its receiver holding its version or a newer one (``held``,
    that call's version); else call the receiver (``follow`` None), then, if it leads
    (``lead``), say its outcome with :meth:`led`; or take the outcome of ``follow``'s
    leader, a newer version that went in its place (:func:`leader_outcome`)."""

    lead: Lane[OutcomeT] | None = None
    follow: Lane[OutcomeT] | None = None
    #: the call waited for delivered this version (or a newer one) and its receiver
    #: holds it: the delivery ends acked, with no call of its own
    held: int | None = None

    def led(self, outcome: OutcomeT) -> None:
        """The leader's outcome, for the deliveries it went in place of."""
        if self.lead is not None and self.lead.led is not None and not self.lead.led.done():
            self.lead.led.set_result(outcome)


class DeliveryLanes(Generic[OutcomeT]):
    """The running delivery calls of the hub, one lane per registration and model.
    ``holds(reply)``: whether a call's reply says its receiver holds the call's version
    (or a newer one) now; the deliveries waiting for that call of versions no newer
    end at once, held (``Turn.held``)."""

    def __init__(self, holds: Callable[[Any], bool] = lambda reply: False) -> None:
        self._lanes: dict[tuple[str, str], Lane[OutcomeT]] = {}
        self._holds = holds
        #: a ``then`` whose call returned as an older version went next (its leader):
        #: the leader's call says it when it returns (the receiver still lacks the
        #: version that gave up)
        self._handed_on: dict[tuple[str, str], Callable[[asyncio.Future[Any], int], None]] = {}

    def calling(self, token: str, model: str, version: int, call: asyncio.Future[Any]) -> None:
        """A call was made to registration ``token`` with ``version`` of ``model``: the
        lane's call until it returns. One made while another runs (a learner's own, a
        process other than the hub) takes over the deliveries waiting: they wait for
        the newest call."""
        self._run(token, model, version, call, then=self._handed_on.pop((token, model), None))

    def getting_ready(self, token: str, model: str, version: int) -> asyncio.Future[Any]:
        """A delivery whose turn came gets ready to call registration ``token`` (plans
        its read again, see ``ReceiverDelivery``): its turn is held meanwhile, by the
        future returned, as by a call (the deliveries that come wait for it). Its call
        takes over (:meth:`calling`); the delivery ends the future, with an error if
        it made no call (the deliveries waiting then take turns)."""
        ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._run(token, model, version, ready, then=None, getting_ready=True)
        return ready

    def _run(
        self,
        token: str,
        model: str,
        version: int,
        call: asyncio.Future[Any],
        then: Callable[[asyncio.Future[Any], int], None] | None,
        getting_ready: bool = False,
    ) -> None:
        """:meth:`calling` of ``call``, which says ``then`` when it returns (a call made
        once its delivery got ready takes the word given meanwhile, and any handed on)."""
        key = (token, model)
        lane: Lane[OutcomeT] = Lane(call, version, then=then, getting_ready=getting_ready)
        former = self._lanes.get(key)
        if former is not None:
            lane.waiting, former.waiting = former.waiting, []
            if former.getting_ready and lane.then is None:
                lane.then, former.then = former.then, None
        self._lanes[key] = lane

        def returned(_: asyncio.Future[Any]) -> None:
            if self._lanes.get(key) is not lane:
                return  # a newer call was made: the receiver's word is that one's
            del self._lanes[key]
            held = not call.cancelled() and call.exception() is None and self._holds(call.result())
            leads = _take_turns(lane, held)
            if lane.then is None:
                return
            if leads:
                self._handed_on[key] = lane.then
            else:
                lane.then(call, lane.version)

        call.add_done_callback(returned)

    def running(self, token: str, model: str) -> int | None:
        """The version of the running call to ``token`` of ``model``; None if none runs."""
        lane = self._lanes.get((token, model))
        return None if lane is None or lane.call.done() else lane.version

    def gave_up(
        self, token: str, model: str, then: Callable[[asyncio.Future[Any], int], None]
    ) -> None:
        """A delivery to ``token`` of ``model`` ended (its deadline passed) while a call
        to it still ran, its own or the one it waited for: once that call returns,
        ``then(call, its version)`` runs, unless a newer call was made (its own return
        says) or a delivery waiting for it goes next (once that one's call returns: an
        older version than the one that gave up may go)."""
        lane = self._lanes.get((token, model))
        if lane is not None and not lane.call.done():
            lane.then = then

    async def turn(
        self,
        token: str,
        model: str,
        version: int,
        deadline: float,
        passed: Callable[[], None] | None = None,
    ) -> Turn[OutcomeT]:
        """Before a delivery of ``version`` calls registration ``token``: return at once
        if no call to it of ``model`` runs; else once that call returned, as the leader
        (the newest version waiting) or a follower. Raises ``asyncio.TimeoutError`` if
        the call is still running at ``deadline`` (``time.monotonic()``). ``passed`` is
        called (once) if a newer version waits too, meanwhile or already."""
        lane = self._lanes.get((token, model))
        if lane is None or lane.call.done():
            return Turn()
        waiting = _Waiting(version, asyncio.get_running_loop().create_future(), passed)
        lane.waiting.append(waiting)
        newest = max(w.version for w in lane.waiting)
        for each in lane.waiting:
            if each.version < newest and each.passed is not None:
                each.passed()
                each.passed = None
        try:
            done, _ = await asyncio.wait({waiting.turn}, timeout=_left(deadline))
        finally:
            if not waiting.turn.done():  # its deadline passed, or it was cancelled
                waiting.turn.cancel()
                for holder in (lane, self._lanes.get((token, model))):
                    if holder is not None and waiting in holder.waiting:
                        holder.waiting.remove(waiting)
        if not done:
            raise asyncio.TimeoutError
        return waiting.turn.result()


def _take_turns(lane: Lane[Any], held: bool) -> bool:
    """``lane``'s call returned: the deliveries waiting of versions no newer than it end
    held if it ``held``, the newest of the others goes, the rest follow it. Whether one
    goes (False if none waits, one cancelled since it began to wait being none, or
    every one waiting ended held)."""
    waiting = [w for w in lane.waiting if not w.turn.done()]
    lane.waiting = []
    if not waiting:
        return False
    if held:
        for each in waiting:
            if each.version <= lane.version:
                each.turn.set_result(Turn(held=lane.version))
        waiting = [w for w in waiting if w.version > lane.version]
        if not waiting:
            return False
    lane.leader = max(w.version for w in waiting)
    lane.led = asyncio.get_running_loop().create_future()
    leading = False
    for each in waiting:
        if each.version == lane.leader and not leading:
            leading = True
            each.turn.set_result(Turn(lead=lane))
        else:
            each.turn.set_result(Turn(follow=lane))
    return True


async def leader_outcome(lane: Lane[OutcomeT], deadline: float) -> OutcomeT:
    """The outcome of ``lane``'s leader; ``asyncio.TimeoutError`` at ``deadline``."""
    assert lane.led is not None  # followers exist once a leader was picked
    done, _ = await asyncio.wait({lane.led}, timeout=_left(deadline))
    if not done:
        raise asyncio.TimeoutError
    return lane.led.result()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
