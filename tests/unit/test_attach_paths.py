"""attach's model arguments and the process registry of attached receivers, without Ray."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from raysync import model_path
from raysync.attached import _model_paths
from raysync.messages import AckStatus, Update
from raysync.receiver_delivery import Attachments, attached, deliver
from raysync.receiver_receipt import AckNow


def test_one_model_object_is_the_default_model():
    policy = torch.nn.Linear(2, 2)
    resolve_on, paths = _model_paths(policy, None)
    assert paths == {"default": "given['default']"}
    assert model_path.resolve(resolve_on, paths["default"]) is policy


def test_a_state_dict_is_one_model_and_a_mapping_of_models_is_several():
    state = {"w": torch.zeros(3)}
    assert list(_model_paths(state, None)[1]) == ["default"]
    actor, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    resolve_on, paths = _model_paths({"actor": actor, "critic": critic}, None)
    assert model_path.resolve(resolve_on, paths["critic"]) is critic


def test_paths_resolve_on_the_owner_beside_given_objects():
    owner = SimpleNamespace(nets=SimpleNamespace(critic=torch.nn.Linear(2, 1)))
    only_paths = _model_paths({"critic": "nets.critic"}, owner)
    assert only_paths == (owner, {"critic": "nets.critic"})
    policy = torch.nn.Linear(2, 2)
    resolve_on, paths = _model_paths({"critic": "nets.critic", "policy": policy}, owner)
    assert model_path.resolve(resolve_on, paths["critic"]) is owner.nets.critic
    assert model_path.resolve(resolve_on, paths["policy"]) is policy


def test_paths_need_an_owner_and_models_are_needed():
    with pytest.raises(ValueError, match="'nets.critic'.*owner="):
        _model_paths({"critic": "nets.critic"}, None)
    with pytest.raises(ValueError, match="at least one model"):
        _model_paths({}, None)


def _update(version: int) -> Update:
    return Update("policy", version, spec_digest="d", transport="object_store", payload=None)


class _Receiver:
    gate = SimpleNamespace(loop=None)

    def __init__(self) -> None:
        self.received: list[Update] = []

    def receive(self, update: Update) -> AckNow:
        self.received.append(update)
        return AckNow(SimpleNamespace(status=AckStatus.APPLIED))


def test_a_delivery_waits_for_a_receiver_still_connecting():
    registry = Attachments()
    registry.reserve("k")
    found: list[object] = []
    waiter = threading.Thread(target=lambda: found.append(registry.find("k", wait_s=30)))
    waiter.start()
    receiver = _Receiver()
    registry.fill("k", receiver)
    waiter.join(30)
    assert found == [receiver]


def test_an_unknown_or_removed_key_finds_nothing_and_fails_the_delivery():
    registry = Attachments()
    assert registry.find("never", wait_s=0) is None
    registry.fill("gone", _Receiver())
    registry.remove("gone")
    assert registry.find("gone", wait_s=0) is None
    update = _update(3)
    ack = deliver(SimpleNamespace(), "not-attached-here", update)
    assert ack.status is AckStatus.NOT_ATTACHED and "not-attached-here" in ack.error


def test_deliver_hands_the_update_to_the_receiver_under_its_key():
    receiver = _Receiver()
    attached.fill("unit-test-key", receiver)
    try:
        update = _update(1)
        assert deliver(SimpleNamespace(), "unit-test-key", update).status is AckStatus.APPLIED
        assert receiver.received == [update]
    finally:
        attached.remove("unit-test-key")


def test_a_delivery_is_applied_here_when_the_loop_that_read_the_model_has_ended():
    """A sync host whose method read the model inside its own ``asyncio.run``: the gate
    saw that loop, which has ended since; the update is not handed to it."""
    receiver = _Receiver()
    loop = asyncio.new_event_loop()
    loop.close()
    receiver.gate = SimpleNamespace(loop=loop)
    attached.fill("unit-test-ended-loop", receiver)
    try:
        update = _update(2)
        ack = deliver(SimpleNamespace(), "unit-test-ended-loop", update)
        assert ack.status is AckStatus.APPLIED and receiver.received == [update]
    finally:
        attached.remove("unit-test-ended-loop")


@pytest.fixture
def handed(monkeypatch) -> threading.Event:
    """Set once ``deliver`` has handed its update to a loop."""
    event = threading.Event()
    real_hand_over = asyncio.run_coroutine_threadsafe

    def hand_over(coroutine, to):  # type: ignore[no-untyped-def]
        future = real_hand_over(coroutine, to)
        event.set()
        return future

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", hand_over)
    return event


def test_a_delivery_handed_to_a_loop_that_ends_before_its_turn_is_applied_here(handed):
    """The host's loop was running when the update was handed to it and ended before
    running it (a user method's own ``asyncio.run`` returned): the delivery waited for
    it for good, its ack never sent, its payload never released."""
    loop = asyncio.new_event_loop()
    blocking = threading.Event()

    def busy_then_stop() -> None:  # the loop's last turn: what is handed now never runs
        blocking.set()
        handed.wait(30)
        loop.stop()

    def run_loop() -> None:
        loop.call_soon(busy_then_stop)
        loop.run_forever()
        loop.close()

    receiver = _Receiver()
    receiver.gate = SimpleNamespace(loop=loop)
    looping = threading.Thread(target=run_loop, daemon=True)
    _assert_applied_once(receiver, "unit-test-loop-ends", looping, blocking)


def _assert_applied_once(
    receiver: _Receiver, key: str, looping: threading.Thread, busy: threading.Event
) -> None:
    """Start ``looping`` (the host's loop, ``busy`` once it is): an update ``deliver``
    hands over from another thread is applied once, and acked."""
    attached.fill(key, receiver)
    looping.start()
    try:
        assert busy.wait(30)
        update = _update(len(receiver.received) + 1)
        outcome = _deliver_in_a_thread(key, update)
        assert [getattr(ack, "status", ack) for ack in outcome] == [AckStatus.APPLIED]
        assert receiver.received == [update]
    finally:
        attached.remove(key)
        looping.join(30)


def _deliver_in_a_thread(key: str, update: Update) -> list[object]:
    """What ``deliver`` returned or raised, from a thread of its own (as Ray calls it)."""
    outcome: list[object] = []

    def delivering() -> None:
        try:
            outcome.append(deliver(SimpleNamespace(), key, update))
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=delivering, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the delivery waited for a loop that had ended"
    return outcome


def test_a_delivery_whose_task_asyncio_run_cancelled_is_applied_here(handed):
    """The update was handed to a method's own ``asyncio.run`` loop as its main coroutine
    returned: ``asyncio.run`` cancels the task before its first step. The delivery
    raised CancelledError for a version never tried."""
    receiver = _Receiver()
    looping = threading.Event()

    async def main() -> None:  # blocks its loop until the update is handed, then returns
        receiver.gate = SimpleNamespace(loop=asyncio.get_running_loop())
        looping.set()
        handed.wait(30)

    running = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    _assert_applied_once(receiver, "unit-test-run-cancels", running, looping)


def test_a_delivery_the_loop_ran_in_its_last_turn_is_not_applied_again(handed):
    """The loop ran the handed update in the turn it stopped in, before the reply came
    back to the delivering thread (a loop the user runs and stops, never closed): that
    thread applied the update a second time."""
    loop = asyncio.new_event_loop()
    blocking = threading.Event()

    def busy_then_stop_after_the_update() -> None:
        blocking.set()
        handed.wait(30)
        # Turns from here: the update's task is made, then runs, and the loop stops
        # with it; its reply's way to the other thread would come a turn later.
        loop.call_soon(lambda: loop.call_soon(loop.stop))

    receiver = _Receiver()
    receiver.gate = SimpleNamespace(loop=loop)
    loop.call_soon(busy_then_stop_after_the_update)
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    try:
        _assert_applied_once(receiver, "unit-test-last-turn", looping, blocking)
    finally:
        loop.close()
