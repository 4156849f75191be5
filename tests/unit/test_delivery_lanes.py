"""One delivery call at a time to a receiver (actors/delivery_lanes.py), without Ray:
deliveries that come while its call runs wait, the newest of them goes when it returns
and the others end as it did; a call whose delivery gave up on it says when it
returned with nobody waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from raysync.actors.delivery_lanes import DeliveryLanes, leader_outcome


def _later(seconds: float) -> float:
    return time.monotonic() + seconds


def test_a_delivery_goes_at_once_when_no_call_to_its_receiver_runs():
    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        returned = asyncio.get_running_loop().create_future()
        returned.set_result(None)
        lanes.calling("t", "m", 1, returned)  # a call that returned already
        first = await lanes.turn("t", "m", 2, _later(5))
        other = await lanes.turn("t", "other model", 2, _later(5))
        return first, other, lanes.running("t", "m")

    first, other, running = asyncio.run(run())
    assert (first.lead, first.follow) == (None, None)
    assert (other.lead, other.follow) == (None, None)
    assert running is None


def test_the_newest_version_waiting_goes_and_the_others_end_as_it_did():
    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        call = asyncio.get_running_loop().create_future()
        lanes.calling("t", "m", 1, call)
        assert lanes.running("t", "m") == 1
        turns = [asyncio.ensure_future(lanes.turn("t", "m", v, _later(5))) for v in (3, 4, 2)]
        await asyncio.sleep(0)  # each one waits for the call now
        assert not any(turn.done() for turn in turns)
        call.set_result("acked")
        three, four, two = await asyncio.gather(*turns)
        assert four.follow is None and four.lead is not None
        assert three.lead is None and two.lead is None
        assert three.follow is two.follow is four.lead
        four.led("version 4 applied")
        return await leader_outcome(three.follow, _later(5)), lanes.running("t", "m")

    outcome, running = asyncio.run(run())
    assert outcome == "version 4 applied"
    assert running is None


def test_versions_no_newer_than_the_one_the_call_applied_end_held():
    """A learner's newer call took over the wait: once it returns applied, the older
    versions waiting are held (no call of theirs: it would queue an older payload
    behind the receiver's method), and only a newer one goes."""

    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes(holds=lambda reply: reply == "applied")
        loop = asyncio.get_running_loop()
        older, newer = loop.create_future(), loop.create_future()
        lanes.calling("t", "m", 3, older)
        turns = [asyncio.ensure_future(lanes.turn("t", "m", v, _later(5))) for v in (4, 6)]
        await asyncio.sleep(0)
        lanes.calling("t", "m", 5, newer)  # the learner called it with version 5
        older.set_result("applied")
        await asyncio.sleep(0)
        assert not any(turn.done() for turn in turns)  # they wait for version 5's call
        newer.set_result("applied")
        return await asyncio.gather(*turns)

    four, six = asyncio.run(run())
    assert (four.held, four.lead, four.follow) == (5, None, None)
    assert six.lead is not None and six.held is None


def test_a_delivery_past_its_deadline_stops_waiting_and_is_not_the_one_that_goes():
    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        call = asyncio.get_running_loop().create_future()
        lanes.calling("t", "m", 1, call)
        patient = asyncio.ensure_future(lanes.turn("t", "m", 2, _later(5)))
        with pytest.raises(asyncio.TimeoutError):
            await lanes.turn("t", "m", 3, _later(0.01))
        call.set_result("acked")
        return await patient

    turn = asyncio.run(run())
    assert turn.lead is not None and turn.follow is None  # version 2 goes, alone


def test_a_newer_call_is_the_one_waited_for():
    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        loop = asyncio.get_running_loop()
        older, newer = loop.create_future(), loop.create_future()
        lanes.calling("t", "m", 1, older)
        lanes.calling("t", "m", 2, newer)  # a learner called it again
        waiting = asyncio.ensure_future(lanes.turn("t", "m", 3, _later(5)))
        older.set_result("acked")
        await asyncio.sleep(0)
        still = not waiting.done()
        newer.set_result("acked")
        return still, await waiting

    still_waiting, turn = asyncio.run(run())
    assert still_waiting
    assert turn.lead is not None


def test_a_call_given_up_on_says_when_it_returned_unless_a_delivery_waited_for_it():
    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        loop = asyncio.get_running_loop()
        heard: list[str] = []
        alone, waited, replaced, newer = (loop.create_future() for _ in range(4))
        lanes.calling("a", "m", 1, alone)
        lanes.gave_up("a", "m", lambda call, v: heard.append(f"a {v} {call.result()}"))
        lanes.calling("b", "m", 1, waited)
        lanes.gave_up("b", "m", lambda call, v: heard.append("b"))
        turn = asyncio.ensure_future(lanes.turn("b", "m", 2, _later(5)))
        await asyncio.sleep(0)
        lanes.calling("c", "m", 1, replaced)
        lanes.gave_up("c", "m", lambda call, v: heard.append("c"))
        lanes.calling("c", "m", 2, newer)
        for call in (alone, waited, replaced):
            call.set_result("acked")
        await asyncio.sleep(0)
        return heard, await turn

    heard, turn = asyncio.run(run())
    assert heard == ["a 1 acked"]  # b: version 2 goes; c: the newer call's word counts
    assert turn.lead is not None


def test_a_delivery_that_gave_up_waiting_hears_when_the_call_returned():
    """The call a delivery waited for past its deadline returns with nobody waiting:
    the receiver is free, and the version that gave up was never sent."""

    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        call = asyncio.get_running_loop().create_future()
        lanes.calling("t", "m", 1, call)
        heard: list[int] = []
        with pytest.raises(asyncio.TimeoutError):
            await lanes.turn("t", "m", 2, _later(0.01))
        lanes.gave_up("t", "m", lambda returned, version: heard.append(version))
        call.set_result("acked")
        await asyncio.sleep(0)
        return heard

    assert asyncio.run(run()) == [1]


def _deliveries_behind_a_running_call(
    monkeypatch,
    answers: dict[int, str],
    versions=(2, 3),
    running=(1, None),
    sent: list | None = None,
    **hub_plans,
):
    """Deliveries of ``versions`` to a receiver whose call with version ``running[0]``
    runs, replying ``running[1]`` once they wait; each call they make answers
    ``answers[version]`` (an AckStatus value): the calls made, and their outcomes.
    ``sent`` collects the payload of each call; ``hub_plans``: the hub's ``set_aside``
    and ``plan_again``."""
    from raysync.actors import hub_delivery
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import Ack, AckStatus, DeliveryMode, Entry, Registration, Update

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    calls: list[int] = []

    def delivery_call(handle, entry, attachment, update):
        calls.append(update.version)
        if sent is not None:
            sent.append(update.payload)
        status = AckStatus(answers[update.version])

        async def answer() -> Ack:
            return Ack("w", "m", update.version, status, f"version {update.version} refused")

        return answer()

    monkeypatch.setattr(hub_delivery, "delivery_call", delivery_call)

    async def run():
        delivery = hub_delivery.ReceiverDelivery(
            HubState(), hub_delivery.AckBook(), lambda *_: None, lambda *_: None, **hub_plans
        )
        call = asyncio.get_running_loop().create_future()
        delivery.called_by_learner("t1", "m", running[0], call)
        entry = ReceiverEntry(registration)
        outcomes = [
            asyncio.ensure_future(
                delivery.deliver(
                    entry, Update("m", v, "digest", "object_store", None), _later(10), 10
                )
            )
            for v in versions
        ]
        await asyncio.sleep(0)
        assert calls == []  # each one waits for the running call
        call.set_result(running[1])
        return await asyncio.gather(*outcomes)

    return calls, *asyncio.run(run())


def test_only_the_newest_version_waiting_is_sent_and_the_older_one_is_acked_with_it(
    monkeypatch,
):
    calls, two, three = _deliveries_behind_a_running_call(monkeypatch, {3: "applied"})
    assert calls == [3]
    assert (two.error, three.error) == (None, None)


def test_a_version_whose_newer_one_failed_in_its_place_is_sent_on_its_own(monkeypatch):
    calls, two, three = _deliveries_behind_a_running_call(monkeypatch, {2: "applied", 3: "failed"})
    assert calls == [3, 2]
    assert two.error is None
    assert "failed to apply: version 3 refused" in three.error


def test_an_older_version_waiting_behind_a_call_that_applied_a_newer_one_makes_no_call(
    monkeypatch,
):
    from raysync.messages import Ack, AckStatus

    applied_3 = Ack("w", "m", 3, AckStatus.APPLIED)
    calls, one, two = _deliveries_behind_a_running_call(
        monkeypatch, {}, versions=(1, 2), running=(3, applied_3)
    )
    assert calls == []  # versions 1 and 2 are held once version 3 applied
    assert (one.error, two.error) == (None, None)


def test_a_delivery_a_newer_one_waits_beside_lets_go_of_its_plan_and_the_newest_keeps_its(
    monkeypatch,
):
    """A delivery waiting for its receiver's running call, a newer one waiting too, goes
    only if that one fails: what its plan holds for the receiver (a shared-memory slot)
    goes at once, else a receiver busy for many versions held one per version. The
    newest keeps its own, and goes with it."""
    set_aside: list[int] = []
    planned_again: list[int] = []
    sent: list = []

    def let_go(entry, update) -> bool:
        set_aside.append(update.version)
        return True

    async def plan_again(update, entry):
        planned_again.append(update.version)
        return dataclasses.replace(update, payload=f"version {update.version} held again")

    calls, two, three = _deliveries_behind_a_running_call(
        monkeypatch, {3: "applied"}, sent=sent, set_aside=let_go, plan_again=plan_again
    )
    assert (set_aside, planned_again) == ([2], [])
    assert (calls, sent) == ([3], [None])
    assert (two.error, three.error) == (None, None)


def test_a_delivery_that_ends_without_a_call_lets_go_of_its_plan(monkeypatch):
    """Versions 1 and 2 wait behind a call that applied version 3: both end held, with
    no call, and what their plans held for the receiver goes (the newest waiting keeps
    its own only while it may go)."""
    from raysync.messages import Ack, AckStatus

    set_aside: list[int] = []

    def let_go(entry, update) -> bool:
        set_aside.append(update.version)
        return True

    calls, one, two = _deliveries_behind_a_running_call(
        monkeypatch,
        {},
        versions=(1, 2),
        running=(3, Ack("w", "m", 3, AckStatus.APPLIED)),
        set_aside=let_go,
        plan_again=None,
    )
    assert calls == []
    assert (one.error, two.error) == (None, None)
    assert sorted(set_aside) == [1, 2]


def test_a_delivery_set_aside_that_goes_after_all_is_planned_again(monkeypatch):
    """The newer version's call failed: the older one, set aside, tries on its own and
    reads what it is planned anew."""
    sent: list = []

    async def plan_again(update, entry):
        return dataclasses.replace(update, payload=f"version {update.version} held again")

    calls, two, three = _deliveries_behind_a_running_call(
        monkeypatch,
        {2: "applied", 3: "failed"},
        sent=sent,
        set_aside=lambda entry, update: True,
        plan_again=plan_again,
    )
    assert (calls, sent) == ([3, 2], [None, "version 2 held again"])
    assert two.error is None
    assert "failed to apply: version 3 refused" in three.error


def _planning_again(monkeypatch, fails: bool):
    """Versions 2 and 3 wait for the learner's running call of version 1; 3 goes and
    its call fails, so 2 (its plan set aside) goes on its own and plans again, which
    waits until version 4's delivery came (and fails if ``fails``). The calls made,
    those made by the time version 4 came, the receivers caught up, and the outcomes
    of versions 2 and 4."""
    from raysync.actors import hub_delivery
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import Ack, AckStatus, DeliveryMode, Entry, Registration, Update
    from raysync.transports import TransportError

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    calls: list[int] = []
    caught_up: list[str] = []

    def delivery_call(handle, entry, attachment, update):
        calls.append(update.version)
        status = AckStatus.FAILED if update.version == 3 else AckStatus.APPLIED

        async def answer() -> Ack:
            return Ack("w", "m", update.version, status, "refused")

        return answer()

    monkeypatch.setattr(hub_delivery, "delivery_call", delivery_call)

    async def run():
        fourth_came = asyncio.Event()

        async def plan_again(update, entry):
            await fourth_came.wait()
            if fails:
                raise TransportError("its slot was reused")
            return update

        state = HubState()
        entry = state.receivers["w"] = ReceiverEntry(registration)
        delivery = hub_delivery.ReceiverDelivery(
            state,
            hub_delivery.AckBook(),
            lambda *_: None,
            lambda entry, model: caught_up.append(model),
            set_aside=lambda entry, update: True,
            plan_again=plan_again,
        )
        running = asyncio.get_running_loop().create_future()
        delivery.called_by_learner("t1", "m", 1, running)

        def deliver(version: int) -> asyncio.Future:
            update = Update("m", version, "digest", "shared_memory", None)
            return asyncio.ensure_future(delivery.deliver(entry, update, _later(10), 10))

        second, third = deliver(2), deliver(3)
        await asyncio.sleep(0)
        running.set_result(None)  # it returns: 3 goes, fails, and 2 plans again
        for _ in range(10):
            await asyncio.sleep(0)
        fourth = deliver(4)
        for _ in range(3):
            await asyncio.sleep(0)
        made_by_then = list(calls)
        fourth_came.set()
        await third
        return calls, made_by_then, caught_up, await second, await fourth

    return asyncio.run(run())


def test_a_delivery_planning_again_holds_its_receivers_turn(monkeypatch):
    """While a version set aside plans its read again, a delivery that comes waits for
    it, as for a running call: no second call reaches the busy receiver."""
    calls, made_by_then, caught_up, second, fourth = _planning_again(monkeypatch, fails=False)
    assert made_by_then == [3]
    assert calls == [3, 2, 4]
    assert (second.error, fourth.error, caught_up) == (None, None, [])


def test_a_delivery_that_cannot_plan_again_catches_its_free_receiver_up(monkeypatch):
    """A version set aside cannot be planned again (a newer one took its slot): it
    makes no call and says why; the receiver is free and may lack the latest version,
    so the hub catches it up, and the delivery that waited meanwhile goes."""
    calls, made_by_then, caught_up, second, fourth = _planning_again(monkeypatch, fails=True)
    assert made_by_then == [3]
    assert calls == [3, 4]
    assert second.error == (
        "version 2 of model 'm' could not be planned again for A(1) once its running call "
        "returned: its slot was reused"
    )
    assert (fourth.error, caught_up) == (None, ["m"])


def test_a_call_given_up_on_says_when_it_returned_if_the_deliveries_waiting_were_held():
    """Version 6's delivery gave up on the running call of version 5; version 4's
    waits for it. The call returns applied: 4 ends held, no call goes, and the
    receiver still lacks 6, so the call's return must say so (the hub catches it up)."""

    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes(holds=lambda reply: reply == "applied")
        call = asyncio.get_running_loop().create_future()
        heard: list[int] = []
        lanes.calling("t", "m", 5, call)
        turn = asyncio.ensure_future(lanes.turn("t", "m", 4, _later(5)))
        await asyncio.sleep(0)
        lanes.gave_up("t", "m", lambda call, version: heard.append(version))
        call.set_result("applied")
        return heard, await turn

    heard, turn = asyncio.run(run())
    assert turn.held == 5 and heard == [5]


def test_a_call_given_up_on_hands_its_word_to_the_older_version_that_goes_after_it():
    """Version 6's delivery gave up on the running call of version 3; version 4's
    waits for it and goes when it returns. The receiver then still lacks 6: once 4's
    call returns, the hub must hear it (and catch the receiver up)."""

    async def run():
        lanes: DeliveryLanes[str] = DeliveryLanes()
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        heard: list[int] = []
        lanes.calling("t", "m", 3, first)
        turn = asyncio.ensure_future(lanes.turn("t", "m", 4, _later(5)))
        await asyncio.sleep(0)
        lanes.gave_up("t", "m", lambda call, version: heard.append(version))
        first.set_result("acked")
        lead = await turn
        assert lead.lead is not None and heard == []  # 4 goes now: not yet
        lanes.calling("t", "m", 4, second)
        second.set_result("acked")
        await asyncio.sleep(0)
        return heard

    assert asyncio.run(run()) == [4]
