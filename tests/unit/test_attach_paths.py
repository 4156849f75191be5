"""attach's model arguments and the process registry of attached receivers, without Ray."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from ray._private.async_compat import has_async_methods

from raysync import WeightReceiver, model_path
from raysync.attached import _entry, _model_paths
from raysync.messages import AckStatus, Entry, Update
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
    def __init__(self) -> None:
        self.received: list[tuple[Update, bool]] = []

    def receive(self, update: Update, *, write_on_host_loop: bool = False) -> AckNow:
        self.received.append((update, write_on_host_loop))
        return AckNow(SimpleNamespace(status=AckStatus.APPLIED))


def test_an_async_mixin_class_is_delivered_to_by_a_coroutine_a_sync_one_stays_sync():
    """The mixin adds a coroutine delivery method only to classes Ray makes async actors
    of: a sync class with one would become an async actor (its methods on a loop)."""

    class Sync(WeightReceiver):
        def step(self) -> None: ...

    class Async(WeightReceiver):
        async def generate(self) -> None: ...

    class Streams(WeightReceiver):
        async def stream(self):
            yield 1

    assert not has_async_methods(Sync) and _entry(Sync()) is Entry.MIXIN_METHOD
    for cls in (Async, Streams):
        assert _entry(cls()) is Entry.MIXIN_ASYNC, cls
    assert _entry(SimpleNamespace()) is Entry.RAY_CALL
    assert [e for e in Entry if e.mixin] == [Entry.MIXIN_METHOD, Entry.MIXIN_ASYNC]


def test_a_coroutine_delivery_override_is_refused_naming_the_class():
    """raysync calls ``_raysync_deliver`` on a thread: a coroutine one would return an
    unawaited coroutine for every version."""
    with pytest.raises(TypeError, match=r"Engine\._raysync_deliver is a coroutine function"):

        class Engine(WeightReceiver):
            async def _raysync_deliver(self, key, update):  # type: ignore[override]
                return None


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
        # Its write goes to an async host's loop (raysync/host_loop.py, tested there).
        assert receiver.received == [(update, True)]
    finally:
        attached.remove("unit-test-key")
