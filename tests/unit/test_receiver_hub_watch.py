"""The hub watch (raysync/receiver_hub_watch.py) without Ray, one beat at a time.

A hub that knows the receiver; one that forgot it (registered again, the versions it
answers with delivered and acked); re-registrations that fail (raised in the receiver
or by the hub) tried again after 1, 2, 4, 4 heartbeats, with the connection state
saying since when and why; a hub that does not answer; catch-up of models left behind,
each on its own; and the thread ending as soon as its core closes. The core is a
stand-in that answers each call from a script.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError

from raysync.errors import ModelPathError, TransportUnavailableError
from raysync.messages import Ack, AckStatus, DeliveryMode, Update, Welcome
from raysync.receiver_hub_watch import HubConnection, HubWatch, retry_delay
from raysync.receiver_receipt import ACK_LATER, AckNow, Receipt
from raysync.transports.base import TransportError

BEAT = 0.5


def _update(model: str, version: int) -> Update:
    return Update(model, version, "digest", "object_store", payload=None)


def _ack(update: Update, status: AckStatus = AckStatus.APPLIED) -> Ack:
    return Ack("collector-1", update.model, update.version, status)


class _Core:
    """Stands for a ReceiverCore: scripted heartbeats, registrations and deliveries."""

    worker = "collector-1"
    actor_name = "Collector(abc)"

    def __init__(
        self,
        heartbeats: Sequence[Any],
        registrations: Sequence[Any] = (),
        mode: DeliveryMode = DeliveryMode.PUSH,
    ) -> None:
        self.identity = SimpleNamespace(mode=mode)
        self.closed = threading.Event()
        self.behind: set[str] = set()
        self.heartbeats = list(heartbeats)
        self.registrations = list(registrations)
        self.receipts: dict[Update, Receipt | None] = {}  #: None: queued behind the host
        self.latest_updates: dict[str, Update | Exception] = {}
        self.delivered: list[Update] = []
        self.queued: set[str] = set()  #: models whose delivery waits behind the host
        self.declined: list[Update] = []
        self.acks: list[Ack] = []

    def hub_knows_me(self, timeout_s: float) -> bool:
        return _answer(self.heartbeats.pop(0))

    def register_again(self, timeout_s: float) -> Welcome:
        return _answer(self.registrations.pop(0))

    def latest(self, model: str, timeout_s: float) -> Update | None:
        return _answer(self.latest_updates.get(model))

    def deliver_through_host(self, update: Update, timeout_s: float) -> Receipt | None:
        self.delivered.append(update)
        receipt = _answer(self.receipts.get(update, AckNow(_ack(update))))
        if receipt is None:
            self.queued.add(update.model)
        return receipt

    def host_call_queued(self, model: str) -> bool:
        return model in self.queued

    def send_ack(self, ack: Ack) -> None:
        self.acks.append(ack)

    def settle_host_calls(self) -> None:
        pass  # ReceiverCore's acks what a call left queued applied; none is, here

    def decline(self, update: Update) -> None:
        self.declined.append(update)


def _answer(scripted: Any) -> Any:
    if isinstance(scripted, Exception):
        raise scripted
    return scripted


def _welcome(*updates: Update) -> Welcome:
    return Welcome("object_store", None, {u.model: u for u in updates})


def test_retries_back_off_from_one_heartbeat_to_four():
    assert [retry_delay(BEAT, n) for n in (1, 2, 3, 4, 50)] == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_a_hub_that_knows_the_receiver_is_only_asked():
    core = _Core(heartbeats=[True])
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert watch.connection() == HubConnection(
        watched=True, connected=True, reregistering_since=None, last_error=None
    )
    assert core.delivered == [] and core.acks == []


def test_a_hub_that_forgot_the_receiver_gets_it_back_with_its_versions():
    applied, deferred = _update("policy", 3), _update("critic", 2)
    core = _Core(heartbeats=[False], registrations=[_welcome(applied, deferred)])
    core.receipts[deferred] = ACK_LATER
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert core.delivered == [applied, deferred]
    assert core.acks == [_ack(applied)]  # the deferred one is acked from its safe point
    assert watch.connection().connected and watch.connection().reregistering_since is None


def test_a_pull_receiver_is_registered_again_and_left_to_pull_what_the_hub_offers():
    """Nothing is applied behind its back: not the welcome's versions, not the models
    it could not fetch while connecting. The welcome's versions are handed back (the
    hub planned reading them: a shared-memory slot is held for this receiver)."""
    offered = _update("policy", 3)
    core = _Core(
        heartbeats=[False, True],
        registrations=[_welcome(offered)],
        mode=DeliveryMode.PULL,
    )
    core.behind = {"critic"}
    core.latest_updates["critic"] = _update("critic", 2)
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT and watch.beat() == BEAT
    assert core.delivered == [] and core.acks == [] and core.behind == {"critic"}
    assert core.declined == [offered]
    assert watch.connection().connected


def test_a_version_the_busy_host_does_not_apply_on_registering_again_is_pulled_later():
    """The host is busy past the delivery call's timeout for the first model the hub
    offers: the others are still delivered, and that one is pulled again once the call
    queued behind the host answered (not before: each pull has the hub plan the
    version for this receiver, a shared-memory slot held for it, never read)."""
    busy, other = _update("policy", 3), _update("critic", 2)
    core = _Core(heartbeats=[False, True, True], registrations=[_welcome(busy, other)])
    core.receipts[busy] = None  # the host is busy: the call stays queued
    core.latest_updates["policy"] = busy
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert core.acks == [_ack(other)] and core.behind == {"policy"}
    assert watch.connection().connected
    assert watch.beat() == BEAT  # still busy: still behind, nothing acked or asked
    assert core.acks == [_ack(other)] and core.behind == {"policy"}
    assert core.delivered == [busy, other]
    assert watch.connection().last_error is None
    del core.receipts[busy]  # the host is free again: its queued call answered
    core.queued.clear()
    assert watch.beat() == BEAT
    assert core.acks == [_ack(other), _ack(busy)] and core.behind == set()


@pytest.mark.parametrize(
    "failure",
    [
        ModelPathError("self.policy is gone"),
        RayTaskError(
            "register", "Traceback...", TransportUnavailableError("no shared memory")
        ).as_instanceof_cause(),
        RuntimeError("the transport's agent could not start"),
    ],
    ids=["raised-here", "raised-by-the-hub", "any-other-error"],
)
def test_failed_re_registrations_back_off_and_are_remembered(failure):
    core = _Core(heartbeats=[False] * 5 + [False, True], registrations=[failure] * 4)
    core.registrations.append(_welcome())
    watch = HubWatch(core, BEAT)
    assert [watch.beat() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    lost = watch.connection()
    assert not lost.connected and lost.reregistering_since is not None
    assert lost.last_error == f"{type(failure).__name__}: {failure}"
    assert watch.beat() == BEAT  # registered again
    back = watch.connection()
    assert back.connected and back.reregistering_since is None
    assert back.last_error == lost.last_error  # kept after it recovered
    core.registrations.append(failure)
    assert watch.beat() == BEAT  # the count of failures in a row starts again
    assert watch.beat() == BEAT and watch.connection().connected


def test_the_time_re_registering_started_is_kept_across_failures():
    core = _Core(heartbeats=[False, False], registrations=[ModelPathError("gone")] * 2)
    watch = HubWatch(core, BEAT)
    watch.beat()
    since = watch.connection().reregistering_since
    watch.beat()
    assert watch.connection().reregistering_since == since


def test_a_hub_that_does_not_answer_is_asked_again_at_the_next_beat():
    core = _Core(heartbeats=[GetTimeoutError("hub restarting"), True])
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert watch.connection() == HubConnection(
        watched=True,
        connected=False,
        reregistering_since=None,
        last_error="GetTimeoutError: hub restarting",
    )
    assert watch.beat() == BEAT and watch.connection().connected


def test_models_left_behind_are_pulled_until_they_apply():
    update = _update("policy", 5)
    core = _Core(heartbeats=[True, True])
    core.behind = {"policy", "critic"}  # critic: the hub has nothing newer any more
    core.latest_updates["policy"] = update
    core.receipts[update] = AckNow(_ack(update, AckStatus.FAILED))
    watch = HubWatch(core, BEAT)
    watch.beat()
    assert core.behind == {"policy"} and core.acks == []
    del core.receipts[update]
    watch.beat()
    assert core.behind == set() and core.acks == [_ack(update)]


def test_a_model_whose_pull_fails_stays_behind_and_the_others_catch_up():
    """critic, sorted first, cannot be pulled: policy is still delivered and acked at the
    same beat, and critic is pulled again at the next."""
    failure = RayTaskError(
        "latest",
        "Traceback...",
        TransportError("could not plan the read of version 2 of model 'critic'"),
    ).as_instanceof_cause()
    policy, critic = _update("policy", 5), _update("critic", 2)
    core = _Core(heartbeats=[True, True])
    core.behind = {"critic", "policy"}
    core.latest_updates.update(critic=failure, policy=policy)
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert core.delivered == [policy] and core.acks == [_ack(policy)]
    assert core.behind == {"critic"}
    assert watch.connection().connected
    assert watch.connection().last_error == f"{type(failure).__name__}: {failure}"
    core.latest_updates["critic"] = critic
    assert watch.beat() == BEAT
    assert core.acks == [_ack(policy), _ack(critic)] and core.behind == set()


def test_a_hub_gone_while_catching_up_is_noticed_by_the_beat():
    """Its pulls all fail alike: the catch-up ends at the first one, and the beat says
    the hub is unreachable; every model is pulled again at the next beat."""
    core = _Core(heartbeats=[True])
    core.behind = {"critic", "policy"}
    core.latest_updates.update(critic=ActorDiedError(), policy=_update("policy", 5))
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT
    assert core.delivered == [] and core.behind == {"critic", "policy"}
    assert watch.connection().last_error == (
        "ActorDiedError: The actor died unexpectedly before finishing this task."
    )


def test_a_hub_that_does_not_answer_a_catch_up_ends_it():
    """Each model behind would wait as long, the beat held up that many timeouts: the
    catch-up ends at the first, and every model is pulled again at the next beat."""
    core = _Core(heartbeats=[True])
    core.behind = {"critic", "policy"}
    core.latest_updates.update(
        critic=GetTimeoutError("Get timed out: some object(s) not ready."),
        policy=_update("policy", 5),
    )
    HubWatch(core, BEAT).beat()
    assert core.delivered == [] and core.behind == {"critic", "policy"}


def test_the_thread_ends_as_soon_as_its_core_closes():
    core = _Core(heartbeats=[])
    watch = HubWatch(core, interval_s=60.0)
    watch.start()
    core.closed.set()  # what ReceiverCore.close does
    watch.wake()
    watch.join(timeout=10.0)
    assert not watch.is_alive()


def test_a_woken_watch_checks_the_hub_at_once():
    """Its core registered again and failed (the hub may have dropped the registration
    it kept meanwhile): the watch looked only at its next heartbeat, seconds later, or
    never with none, while a zero-copy model lived in memory nobody held."""
    asked = threading.Event()
    core = _Core(heartbeats=[True])
    knows = core.hub_knows_me
    core.hub_knows_me = lambda timeout_s: (asked.set(), knows(timeout_s))[1]  # type: ignore[method-assign]
    watch = HubWatch(core, interval_s=3600.0)
    watch.start()
    try:
        watch.wake()
        assert asked.wait(timeout=30.0), "the woken watch did not ask the hub"
    finally:
        core.closed.set()
        watch.wake()
        watch.join(timeout=10.0)


def test_a_beat_that_raises_anything_else_is_retried_and_the_watch_goes_on():
    core = _Core(heartbeats=[ValueError("a bug in a beat"), True])
    watch = HubWatch(core, BEAT)
    assert watch.beat() == BEAT  # the first failure in a row: one heartbeat
    assert watch.connection().last_error == "ValueError: a bug in a beat"
    assert watch.beat() == BEAT and watch.connection().connected
