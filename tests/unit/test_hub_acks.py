"""The hub's book of acks sent apart from their delivery call (``hub.ack``), without
Ray: each reaches the delivery awaiting it, one that comes before its delivery started
waits for it, and nothing else answers a delivery."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

from raysync.actors import hub_delivery
from raysync.actors.hub import WeightHubActor
from raysync.actors.hub_delivery import AckBook
from raysync.messages import Ack, AckStatus, ReceiverTimings


def ack(version: int, *, token: str = "t1", origin: str = "learner") -> Ack:
    return Ack("w", "m", version, AckStatus.APPLIED, origin=origin, token=token)


def key(version: int, *, token: str = "t1", origin: str = "learner") -> tuple:
    return (token, "m", version, origin)


def test_an_ack_reaches_the_delivery_awaiting_it_and_no_other():
    async def run():
        book = AckBook()
        waiting = book.expect(key(3))
        other = book.expect(key(3, token="t2"))  # the same actor, registered again
        book.arrive(ack(3))
        return waiting, other

    waiting, other = asyncio.run(run())
    assert waiting.result() == ack(3) and not other.done()


def test_an_ack_before_its_delivery_started_is_kept_for_it():
    async def run():
        book = AckBook()
        book.arrive(ack(4))  # the direct path: applied before the hub booked it
        early = book.expect(key(4))
        later = book.expect(key(5))
        return early, later

    early, later = asyncio.run(run())
    assert early.result() == ack(4) and not later.done()


def test_a_delivery_that_ended_or_starts_over_takes_only_new_acks():
    async def run():
        book = AckBook()
        first = book.expect(key(6))
        again = book.expect_again(key(6), first)  # a conflict: the hub delivers once more
        book.arrive(ack(6))
        book.forget(key(6), again)
        book.arrive(ack(6, origin="other learner"))
        return first, again, book.expect(key(6, origin="other learner"))

    first, again, kept = asyncio.run(run())
    assert not first.done() and again.result() == ack(6)
    assert kept.result() == ack(6, origin="other learner")


def test_two_deliveries_of_one_version_each_get_its_ack_whichever_ends_first():
    """Two catch-ups of the same latest version to one receiver overlap: the second's
    future replaced the first's, and the first, timing out, took the second's out of the
    book, so the receiver's ack reached neither (a false "did not catch up")."""

    async def run():
        book = AckBook()
        first = book.expect(key(7))
        second = book.expect(key(7))
        book.forget(key(7), first)  # the first timed out
        book.arrive(ack(7))
        return first, second

    first, second = asyncio.run(run())
    assert not first.done() and second.result() == ack(7)


def test_only_the_newest_early_acks_are_kept(monkeypatch):
    monkeypatch.setattr(hub_delivery, "EARLY_ACKS_KEPT", 2)

    async def run():
        book = AckBook()
        for version in (1, 2, 3):
            book.arrive(ack(version))
        return [book.expect(key(v)).done() for v in (1, 2, 3)]

    assert asyncio.run(run()) == [False, True, True]


def test_a_learners_call_that_found_the_actor_unavailable_is_delivered_again_by_the_hub(
    monkeypatch,
):
    """The direct path: the learner's own call raised ActorUnavailableError and the
    same process answers again: the hub delivers once more itself, rather than await
    the learner's failed call again and again; the outcome says the hub delivered it
    (the report listed it among the receivers the learner delivered to)."""
    from ray.exceptions import ActorUnavailableError

    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, Registration, Update

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")
    calls: list[Update] = []

    async def applied() -> Ack:
        return ack(3)

    def delivery_call(handle, entry, attachment, update):
        calls.append(update)
        return applied()

    async def same_process(self, registration, deadline):
        return None  # the actor answers again from the process that registered

    monkeypatch.setattr(hub_delivery, "delivery_call", delivery_call)
    monkeypatch.setattr(hub_delivery.ReceiverDelivery, "_restarted", same_process)

    async def run():
        failed: asyncio.Future = asyncio.get_running_loop().create_future()
        failed.set_exception(ActorUnavailableError("unavailable for a moment", None))
        delivery = hub_delivery.ReceiverDelivery(
            HubState(), AckBook(), lambda *_: None, lambda *_: None
        )
        entry = ReceiverEntry(registration)
        deadline = time.monotonic() + 10
        return await asyncio.wait_for(
            delivery.deliver(entry, update, deadline, 10, first_call=failed), 10
        )

    outcome = asyncio.run(run())
    assert outcome.error is None and outcome.by_hub
    assert calls == [dataclasses.replace(update, token="t1")]  # to the registration it knows


def test_a_call_the_hub_cannot_make_fails_that_receiver_only(monkeypatch):
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, Registration, Update

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")

    def delivery_call(handle, entry, attachment, update):
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(hub_delivery, "delivery_call", delivery_call)

    async def run():
        delivery = hub_delivery.ReceiverDelivery(
            HubState(), AckBook(), lambda *_: None, lambda *_: None
        )
        return await delivery.deliver(
            ReceiverEntry(registration), update, time.monotonic() + 10, 10
        )

    outcome = asyncio.run(run())
    assert "A(1)" in outcome.error and "TypeError: cannot pickle" in outcome.error


def test_an_ack_of_a_registration_replaced_meanwhile_is_not_booked_for_its_successor(
    monkeypatch,
):
    """The worker id went to a new actor (registered again, token t2) while the old
    one's delivery call ran: the old actor's ack must not count as the new one's
    version, or the new one would never be brought up to it."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, Registration, Update

    def registration(token: str) -> Registration:
        return Registration(
            "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, token
        )

    old, new = registration("t1"), registration("t2")
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")
    state = HubState()

    async def applied() -> Ack:
        state.receivers["w"] = ReceiverEntry(new)  # registered again while the call ran
        return ack(3)

    monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: applied())

    async def run():
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        return await delivery.deliver(ReceiverEntry(old), update, time.monotonic() + 10, 10)

    asyncio.run(run())
    assert state.receivers["w"].versions.get("m", 0) == 0


def test_a_version_applied_whose_hook_raised_fails_and_is_booked_as_held(monkeypatch):
    """The receiver applied version 3 and its ``on_weights_applied`` raised: the
    broadcast fails for it, naming the hook's error, and the hub's status says it holds
    3 (it said 2 until the next version, while the model held 3)."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, ReceiverTimings, Registration, Update

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    timings = ReceiverTimings(0.001, 0.0, 0.002)
    hook_failed = dataclasses.replace(
        ack(3),
        status=AckStatus.FAILED,
        error="version 3 was applied, but on_weights_applied raised: boom",
        timings=timings,
    )

    async def replied() -> Ack:
        return hook_failed

    monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: replied())

    async def run():
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        return await delivery.deliver(
            state.receivers["w"], update, time.monotonic() + 10, 10
        )

    outcome = asyncio.run(run())
    assert outcome.error is not None and "on_weights_applied raised: boom" in outcome.error
    assert state.receivers["w"].versions["m"] == 3


def test_a_deferred_ack_answers_the_registration_the_hub_delivered_to(monkeypatch):
    """The receiver applies later (a busy actor) and acks apart from the call, under the
    token its update names: the hub's registration, which the receiver may not have
    taken in yet (its registering call gave up waiting), so the delivery gets its ack."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, Registration, Update

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t2"
    )
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")
    book = AckBook()

    async def acked_apart(delivered: Update) -> None:
        book.arrive(ack(3, token=delivered.token))  # sent from the receiver's safe point
        return None  # the call's reply: the ack comes apart

    def delivery_call(handle, entry, attachment, delivered):
        return acked_apart(delivered)

    monkeypatch.setattr(hub_delivery, "delivery_call", delivery_call)

    async def run():
        delivery = hub_delivery.ReceiverDelivery(HubState(), book, lambda *_: None, lambda *_: None)
        return await delivery.deliver(ReceiverEntry(registration), update, time.monotonic() + 2, 2)

    outcome = asyncio.run(run())
    assert outcome.error is None


def test_a_call_given_up_on_that_applies_later_leaves_its_timings_in_the_status():
    """A delivery timed out while its call still ran (a slow fetch, or a receiver busy
    in a method); the call applied at last: the hub booked the version but kept the
    previous version's timings, so the status said the slowest receiver was fast."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import DeliveryMode, Entry, ReceiverTimings, Registration

    registration = Registration(
        "w", None, "key", Entry.RAY_CALL, "A(1)", "node", "p1", {}, {}, DeliveryMode.PUSH, "t1"
    )
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    state.record("w", "m", 4, ReceiverTimings(0.01, 0.0, 0.001))
    slow = ReceiverTimings(42.0, 0.0, 3.0)

    async def run() -> None:
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        call = asyncio.get_running_loop().create_future()
        delivery._lanes.calling("t1", "m", 5, call)
        delivery._gave_up(registration, "m")
        call.set_result(Ack("w", "m", 5, AckStatus.APPLIED, timings=slow, token="t1"))
        await asyncio.sleep(0)

    asyncio.run(run())
    assert (state.receivers["w"].versions["m"], state.receivers["w"].timings["m"]) == (5, slow)


def _registration(token: str = "t1", process: str = "p1", handle: object = None):
    from raysync.messages import DeliveryMode, Entry, Registration

    return Registration(
        "w", handle, "key", Entry.RAY_CALL, "A(1)", "node", process, {}, {}, DeliveryMode.PUSH,
        token,
    )


def test_a_call_that_times_out_and_applies_later_is_booked_where_calls_do_not_take_turns(
    monkeypatch,
):
    """``rpc``, ``distributed`` and bucketed versions do not take turns: a delivery
    that timed out while its call still ran, and the call then applied the version, left
    the receiver booked as behind on the version before for good (the status said so,
    and the lag gauges grew, while it held the latest)."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import Update
    from raysync.metrics import FailureCause

    registration = _registration()
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    state.record("w", "m", 4)
    update = Update("m", 5, "digest", "rpc", payload=None, origin="learner")
    assert not hub_delivery.takes_turns(update)

    async def run():
        call: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: call)
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        outcome = await delivery.deliver(ReceiverEntry(registration), update, time.monotonic(), 1)
        assert state.receivers["w"].behind
        call.set_result(Ack("w", "m", 5, AckStatus.APPLIED, token="t1"))
        await asyncio.sleep(0)
        return outcome

    outcome = asyncio.run(run())
    assert outcome.cause is FailureCause.TIMEOUT
    entry = state.receivers["w"]
    assert (entry.versions["m"], entry.behind) == (5, False)


def _deferred_delivery(monkeypatch, state, registration, during_wait, timeout_s=30.0):
    """Deliver version 3 to ``registration``: its call answers "staged, acked at a safe
    point", and ``during_wait()`` runs while the hub waits for the ack. The outcome,
    and how long the delivery took."""
    from raysync.hub_state import ReceiverEntry
    from raysync.messages import Update

    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")

    async def staged() -> None:
        return None

    monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: staged())
    monkeypatch.setattr(hub_delivery, "DEFERRED_CHECK_S", 0.01)

    async def run():
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        delivering = asyncio.ensure_future(
            delivery.deliver(ReceiverEntry(registration), update, time.monotonic() + timeout_s, 30)
        )
        await asyncio.sleep(0.02)  # the scenario: it is gone a while after the call
        during_wait()
        return await asyncio.wait_for(delivering, 5)

    started = time.monotonic()
    outcome = asyncio.run(run())
    return outcome, time.monotonic() - started


def test_a_receiver_that_leaves_while_its_version_waits_for_a_safe_point_fails_as_left(
    monkeypatch,
):
    """The version was staged for the receiver's next safe point and the receiver closed
    (it left the hub) before it: nothing acks it any more, and the delivery waited out
    the broadcast's whole timeout, then blamed a timeout."""
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.metrics import FailureCause

    registration = _registration()
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    outcome, took_s = _deferred_delivery(
        monkeypatch, state, registration, lambda: state.receivers.pop("w")
    )
    assert outcome.cause is FailureCause.LEFT and took_s < 5
    assert "A(1) left the hub" in outcome.error and "version 3 of model 'm'" in outcome.error


def test_a_receiver_restarted_while_its_version_waits_for_a_safe_point_fails_as_died(
    monkeypatch,
):
    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.metrics import FailureCause

    registration = _registration()
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)

    def restarted() -> None:
        state.receivers["w"] = ReceiverEntry(_registration("t2", process="p2"))

    outcome, took_s = _deferred_delivery(monkeypatch, state, registration, restarted)
    assert outcome.cause is FailureCause.DIED and took_s < 5
    assert "new process registered again" in outcome.error
    # The new process is registered: the error must not say it is out of the registry.
    assert "dropped from the registry" not in outcome.error, outcome.error
    assert "a registration gets the latest version" in outcome.error


def test_a_receiver_that_dies_while_its_version_waits_for_a_safe_point_fails_as_died(
    monkeypatch,
):
    """Its process died (Ray will not restart it) while the version waited for its safe
    point: nothing else calls it meanwhile, so the hub asks it which process it is now,
    and Ray's answer names the death."""
    import concurrent.futures
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.metrics import FailureCause

    asked: list[concurrent.futures.Future] = []
    questions = asyncio.Queue()  # each time the hub asks: the answer to give

    def ask(function):
        asked.append(concurrent.futures.Future())
        questions.put_nowait(asked[-1])
        return SimpleNamespace(future=lambda: asked[-1])

    handle = SimpleNamespace(__ray_call__=SimpleNamespace(remote=ask))
    registration = _registration(handle=handle)
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    dropped: list[tuple[str, str]] = []

    async def run():
        from raysync.messages import Update

        update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")

        async def staged() -> None:
            return None

        monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: staged())
        monkeypatch.setattr(hub_delivery, "DEFERRED_CHECK_S", 0.01)
        delivery = hub_delivery.ReceiverDelivery(
            state, AckBook(), lambda *dead: dropped.append(dead), lambda *_: None
        )
        delivering = asyncio.ensure_future(
            delivery.deliver(ReceiverEntry(registration), update, time.monotonic() + 30, 30)
        )
        # The hub asks the receiver which process it is: alive, the same process...
        (await asyncio.wait_for(questions.get(), 5)).set_result("p1")
        # ...and asks again a while later: it died meanwhile.
        (await asyncio.wait_for(questions.get(), 5)).set_exception(ActorDiedError())
        return await asyncio.wait_for(delivering, 5)

    outcome = asyncio.run(run())
    assert outcome.cause is FailureCause.DIED and "died before applying version 3" in outcome.error
    assert dropped == [("w", "t1")]


def test_a_delivery_reaching_a_receiver_that_left_fails_as_left_at_once(monkeypatch):
    """The delivery call queued behind the method that closed the receiver (the hub had
    dropped it): it answered "not attached", and the hub asked the actor which process
    it is, a call that waited behind its next long method until the broadcast's
    deadline, then blamed a death."""
    import concurrent.futures
    from types import SimpleNamespace

    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import Update
    from raysync.metrics import FailureCause

    never = SimpleNamespace(future=concurrent.futures.Future)
    handle = SimpleNamespace(__ray_call__=SimpleNamespace(remote=lambda function: never))
    registration = _registration(handle=handle)
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")

    async def not_attached() -> Ack:
        return Ack("w", "m", 3, AckStatus.NOT_ATTACHED, "its receiver was closed", token="t1")

    monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: not_attached())

    async def run():
        delivery = hub_delivery.ReceiverDelivery(
            HubState(), AckBook(), lambda *_: None, lambda *_: None
        )
        return await asyncio.wait_for(
            delivery.deliver(ReceiverEntry(registration), update, time.monotonic() + 30, 30), 5
        )

    outcome = asyncio.run(run())
    assert outcome.cause is FailureCause.LEFT and "A(1) left the hub" in outcome.error


def test_a_restarted_receivers_process_question_failing_late_is_retrieved(monkeypatch):
    """Ray restarts a receiver killed while its version was delivered: the call raised
    ActorUnavailableError, the hub asked the actor which process it is, and the new
    process registered before that question came back. The delivery ended (the process
    died), and the question, failing later ("the actor is restarting"), had nobody to
    retrieve its error: asyncio logged "Future exception was never retrieved"."""
    import concurrent.futures
    import gc
    from types import SimpleNamespace

    from ray.exceptions import ActorUnavailableError

    from raysync.hub_state import HubState, ReceiverEntry
    from raysync.messages import Update
    from raysync.metrics import FailureCause

    asked: list[concurrent.futures.Future] = []

    def ask(function):
        asked.append(concurrent.futures.Future())
        return SimpleNamespace(future=lambda: asked[-1])

    handle = SimpleNamespace(__ray_call__=SimpleNamespace(remote=ask))
    registration = _registration(handle=handle)
    state = HubState()
    state.receivers["w"] = ReceiverEntry(registration)
    update = Update("m", 3, "digest", "object_store", payload=None, origin="learner")

    async def killed() -> Ack:
        raise ActorUnavailableError("The actor was restarted", None)

    monkeypatch.setattr(hub_delivery, "delivery_call", lambda *_: killed())
    monkeypatch.setattr(hub_delivery, "UNAVAILABLE_RETRY_S", 0.01)
    unretrieved: list[dict] = []

    async def run():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unretrieved.append(context))
        delivery = hub_delivery.ReceiverDelivery(state, AckBook(), lambda *_: None, lambda *_: None)
        delivering = asyncio.ensure_future(
            delivery.deliver(ReceiverEntry(registration), update, time.monotonic() + 30, 30)
        )
        while not asked:  # the hub asks which process answers now
            await asyncio.sleep(0.005)
        state.receivers["w"] = ReceiverEntry(_registration("t2", process="p2"))
        outcome = await asyncio.wait_for(delivering, 5)
        assert len(asked) == 1 and not asked[0].done()
        asked.pop().set_exception(ActorUnavailableError("The actor is restarting", None))
        for _ in range(5):  # Ray lets go of its future once done: so does the test
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
        return outcome

    outcome = asyncio.run(run())
    assert outcome.cause is FailureCause.DIED and "new process registered again" in outcome.error
    assert not unretrieved, [c.get("message") for c in unretrieved]


def test_an_ack_of_a_version_applied_before_its_hook_raised_books_it_when_late_too():
    """The receiver applied the version, then its ``on_weights_applied`` raised (FAILED,
    with timings): its model holds the version. An ack that came after its delivery
    ended (or a delivery call returning late) booked nothing: ``hub.status`` showed the
    receiver behind, and the hub took the version for one that every target failed."""
    recorded: list[tuple] = []
    hub = SimpleNamespace(
        _state=SimpleNamespace(
            knows=lambda worker, token: True, record=lambda *a: recorded.append(a)
        ),
        _acks=AckBook(),
    )
    timings = ReceiverTimings(fetch_s=0.1, wait_s=0.0, apply_s=0.01)
    hooked = Ack("w", "m", 3, AckStatus.FAILED, "on_weights_applied raised", timings, token="t1")
    failed = Ack("w", "m", 4, AckStatus.FAILED, "the fetch raised", token="t1")

    async def run():
        for late in (hooked, failed):
            await WeightHubActor.ack(hub, late)

    asyncio.run(run())
    assert recorded == [("w", "m", 3, timings)]
    assert (hub_delivery._holds(hooked), hub_delivery._holds(failed)) == (True, False)
