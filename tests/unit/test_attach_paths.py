"""attach's model arguments, the process registry of attached receivers, and a pull of
several models where some fail, without Ray."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from ray._private.async_compat import has_async_methods
from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError

from raysync import WeightReceiver, model_path
from raysync.attached import AttachedReceiver, _entry, _model_paths
from raysync.errors import RaySyncError
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


class _PullCore:
    """Stands for a pull receiver's ReceiverCore: each model's latest update (or what
    fetching it raises) and what applying each version raises, from a script."""

    worker = "driver"
    actor_name = "process 1"

    def __init__(self, latest: dict[str, Update | Exception]) -> None:
        self.closed = threading.Event()
        self.models = {m: SimpleNamespace(version=0) for m in latest}
        self.latest_updates = latest
        self.apply_failures: dict[str, Exception] = {}
        self.applied: list[Update] = []

    def model_id(self, model: str | None) -> str:
        return model or "default"

    def latest(self, model: str, timeout_s: float) -> Update | None:
        scripted = self.latest_updates[model]
        if isinstance(scripted, Exception):
            raise scripted
        return scripted

    def apply_now(self, update: Update, during: str) -> None:
        if update.model in self.apply_failures:
            raise self.apply_failures[update.model]
        self.applied.append(update)
        self.models[update.model].version = update.version


def _version_of(model: str, version: int) -> Update:
    return Update(model, version, spec_digest="d", transport="object_store", payload=None)


def _buckets_gone() -> Exception:
    """What the hub's ``latest`` raising on a pull reaches the receiver as."""
    why = "version 3 of model 'policy': its buckets are gone"
    traceback = f"Traceback (most recent call last):\nRaySyncError: {why}"
    return RayTaskError("latest", traceback, RaySyncError(why)).as_instanceof_cause()


def test_a_model_that_cannot_be_pulled_leaves_the_others_pulled():
    """policy fails on every pull (its buckets are gone): obs_norm, after it, is still
    fetched and applied, and the pull raises policy's own error, noted with its name."""
    gone = _buckets_gone()
    obs_norm = _version_of("obs_norm", 4)
    core = _PullCore({"policy": gone, "obs_norm": obs_norm})
    receiver = AttachedReceiver(core, None)
    with pytest.raises(RaySyncError, match="its buckets are gone") as raised:
        receiver.pull()
    assert core.applied == [obs_norm]
    assert receiver.versions() == {"policy": 0, "obs_norm": 4}
    assert raised.value is gone
    assert raised.value.__notes__ == [
        "process 1 could not pull model 'policy'; it pulled the others "
        "(versions held: {'obs_norm': 4})"
    ]


def test_models_that_fail_are_each_named_in_one_error_from_the_first():
    gone = _buckets_gone()
    hook_failed = RaySyncError("on_applied raised ValueError('bad critic')")
    critic, obs_norm = _version_of("critic", 2), _version_of("obs_norm", 4)
    core = _PullCore({"policy": gone, "critic": critic, "obs_norm": obs_norm})
    core.apply_failures["critic"] = hook_failed
    receiver = AttachedReceiver(core, None)
    with pytest.raises(RaySyncError) as raised:
        receiver.pull()
    assert str(raised.value) == (
        f"process 1 could not pull models 'policy', 'critic' ('policy': "
        f"{type(gone).__name__}: {gone}; 'critic': RaySyncError: on_applied "
        "raised ValueError('bad critic')); it pulled the others (versions held: "
        "{'obs_norm': 4})"
    )
    assert raised.value.__cause__ is gone
    assert core.applied == [obs_norm]


@pytest.mark.parametrize(
    "hub_failure",
    [ActorDiedError(), GetTimeoutError("Get timed out: some object(s) not ready.")],
    ids=["hub-gone", "hub-not-answering"],
)
def test_a_hub_that_is_gone_or_silent_ends_the_pull_at_once(hub_failure):
    """Every other model would wait as long (k models: k timeouts) and the caller that
    reconnects on Ray's error would get another: raised at once, as it is."""
    core = _PullCore({"critic": hub_failure, "policy": _version_of("policy", 4)})
    asked = []
    latest = core.latest
    core.latest = lambda model, timeout_s: (asked.append(model), latest(model, timeout_s))[1]
    with pytest.raises(type(hub_failure)) as raised:
        AttachedReceiver(core, None).pull()
    assert raised.value is hub_failure
    assert asked == ["critic"] and core.applied == []


def test_pulling_one_model_raises_its_failure_as_it_is():
    gone = _buckets_gone()
    core = _PullCore({"policy": gone, "obs_norm": _version_of("obs_norm", 4)})
    with pytest.raises(RaySyncError) as raised:
        AttachedReceiver(core, None).pull("policy")
    assert raised.value is gone and not hasattr(raised.value, "__notes__")
    assert core.applied == []
