"""HubState (raysync/hub_state.py) without Ray: the hub's registry of models and receivers.

Registration and replacement, spec mismatches refused naming the actor, model and key
(with the registry left unchanged), versions that only go up (also past a receiver that
holds more than a restarted hub), broadcast targets (push receivers, or ``workers=...``
including pull ones), drop by registration token, declared and unknown model ids, the
models and specs forgotten with the receiver that alone brought them, and the statuses'
versions and lag. Registrations carry ``handle=None`` where Ray would put
an actor handle.
"""

from __future__ import annotations

import pytest
import torch

from raysync.direct_routes import DirectRoutes
from raysync.errors import (
    SpecMismatchError,
    StaleVersionError,
    UnknownModelError,
    UnknownWorkerError,
)
from raysync.hub_state import _PUBLISHED_KEPT as KEPT
from raysync.hub_state import DEFAULT_MODEL, LEASE_BEATS, HubState, Lag
from raysync.messages import (
    DeliveryMode,
    Entry,
    ReceiverStatus,
    ReceiverTimings,
    Registration,
    Update,
)
from raysync.routing import HandedOver
from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo

POLICY = WeightSpec.of({"net.weight": torch.zeros(4, 3), "net.bias": torch.zeros(4)})
CRITIC = WeightSpec.of({"value.weight": torch.zeros(1, 3)})

PUSH, PULL = DeliveryMode.PUSH, DeliveryMode.PULL


def _actor(worker: str) -> str:
    return f"Collector({worker}-actor-id)"


def _registration(
    worker: str,
    specs: dict[str, WeightSpec],
    *,
    versions: dict[str, int] | None = None,
    mode: DeliveryMode = PUSH,
    token: str | None = None,
    transport: str = "object_store",
    kept: tuple[object, ...] = (),
    handle: object = "an actor handle",
    heartbeat_s: float | None = None,
    origins: dict[str, str] | None = None,
) -> Registration:
    return Registration(
        worker=worker,
        handle=handle,
        attachment=f"{worker}-attachment",
        entry=Entry.RAY_CALL,
        actor=_actor(worker),
        node_id="node-a",
        process=f"process-{worker}",
        specs=dict(specs),
        versions=dict(versions or {}),
        mode=mode,
        token=token or f"{worker}-token",
        transport=transport,
        kept=kept,
        heartbeat_s=heartbeat_s,
        origins=dict(origins or {}),
    )


def _publish(
    state: HubState,
    model: str = "policy",
    version: int | None = None,
    spec: WeightSpec = POLICY,
    payload: object = "payload",
    at: float | None = None,
) -> HandedOver:
    return state.publish(model, spec, {"object_store": payload}, version, at)


def _workers(entries) -> list[str]:
    return [entry.worker for entry in entries]


# -- registration ------------------------------------------------------------------------


def test_a_first_registration_brings_the_spec_and_the_version_the_receiver_holds():
    state = HubState()
    assert state.register(_registration("w1", {"policy": POLICY}, versions={"policy": 3})) == {}
    assert state.spec("policy") == POLICY
    assert state.versions() == {"policy": 3}
    assert state.specs() == {"policy": POLICY}
    assert state.latest("policy") is None  # nothing was broadcast yet


def test_registering_returns_the_latest_update_of_each_model_it_lacks():
    state = HubState()
    _publish(state, payload="v1")
    _publish(state, payload="v2")
    expected = HandedOver("policy", 2, POLICY.digest, {"object_store": "v2"})
    assert state.register(_registration("behind", {"policy": POLICY})) == {"policy": expected}
    one_behind = _registration("one-behind", {"policy": POLICY}, versions={"policy": 1})
    assert state.register(one_behind) == {"policy": expected}
    assert (
        state.register(_registration("current", {"policy": POLICY}, versions={"policy": 2})) == {}
    )
    # A model never broadcast has no update to hand out.
    both = _registration("both", {"policy": POLICY, "critic": CRITIC})
    assert state.register(both) == {"policy": expected}


def test_registering_with_the_same_number_from_another_learner_returns_the_hubs():
    """Learner A delivered version 5 itself and the hub restarted before booking it;
    learner B's broadcast was booked as 5 meanwhile. A receiver registering again with
    A's 5 was handed nothing: it kept A's weights under B's number until version 6."""
    state = HubState()
    booked = state.publish("policy", POLICY, {"object_store": "b's"}, 5, origin="learner-b")
    with_a = _registration(
        "w1", {"policy": POLICY}, versions={"policy": 5}, origins={"policy": "learner-a"}
    )
    assert state.register(with_a) == {"policy": booked}
    with_b = _registration(
        "w2", {"policy": POLICY}, versions={"policy": 5}, origins={"policy": "learner-b"}
    )
    assert state.register(with_b) == {}
    # Held with no known origin (a receiver of a hub from before): the number decides.
    assert state.register(_registration("w3", {"policy": POLICY}, versions={"policy": 5})) == {}


def test_a_pull_with_the_same_number_from_another_learner_gets_the_hubs():
    """The same clash, met by a pull first (``pull_weights``, or the hub watch catching
    up): the welcome's offer is declined, to be read by the pull, and the pull asked
    for versions above 5: it got nothing, and kept A's weights under B's number."""
    import asyncio
    from types import SimpleNamespace

    from raysync.actors.hub import WeightHubActor

    state = HubState()
    state.publish("policy", POLICY, {"object_store": "b's"}, 5, origin="learner-b")
    hub = SimpleNamespace(_state=state, _transport="object_store")

    def pulled(origin: str) -> object:
        return asyncio.run(WeightHubActor.latest(hub, "policy", 5, have_origin=origin))

    assert pulled("learner-a").payload == "b's"
    assert pulled("learner-b") is None and pulled("") is None


def test_registering_again_replaces_the_entry_and_only_the_current_token_drops_it():
    state = HubState()
    _publish(state)
    state.register(_registration("w1", {"policy": POLICY}, token="first"))
    state.record("w1", "policy", 1)
    again = _registration("w1", {"policy": POLICY}, mode=PULL, token="second", transport="rpc")
    state.register(again)
    assert list(state.receivers) == ["w1"]
    assert state.receivers["w1"].registration is again
    assert not state.knows("w1", "first")
    assert state.knows("w1", "second")
    # The new entry starts from what the new registration says it holds.
    (status,) = state.statuses()
    assert (status.mode, status.versions, status.transport) == (PULL, {"policy": 0}, "rpc")
    # The old registration's death does not drop the new one.
    assert state.drop("w1", "first") is False
    assert state.knows("w1", "second")
    assert state.drop("w1", "second") is True
    assert state.receivers == {}
    assert state.drop("w1", "second") is False
    assert not state.knows("w1", "second")
    assert state.targets("policy", None) == []


def test_a_receiver_whose_delivery_timed_out_is_behind_until_it_acks_a_version():
    state = HubState()
    _publish(state)
    state.register(_registration("w1", {"policy": POLICY}, token="first"))
    assert state.receivers["w1"].info.behind is False
    state.timed_out("w1", "other")  # another registration's delivery: not this one's
    assert state.receivers["w1"].info.behind is False
    state.timed_out("w1", "first")
    assert state.receivers["w1"].info.behind is True
    state.record("w1", "policy", 1)  # acked (older ones too: it answers again)
    assert state.receivers["w1"].info.behind is False
    state.timed_out("w1", "first")
    state.register(_registration("w1", {"policy": POLICY}, token="second"))
    assert state.receivers["w1"].info.behind is False  # a new registration starts afresh


def test_a_watched_pull_receiver_not_heard_from_for_its_lease_lapses():
    state = HubState()
    state.register(_registration("pulls", {"policy": POLICY}, mode=PULL, heartbeat_s=2.0))
    state.register(_registration("unwatched", {"policy": POLICY}, mode=PULL))
    state.register(_registration("pushed", {"policy": POLICY}, heartbeat_s=1.0))
    registered = state.receivers["pulls"].heard
    lease = LEASE_BEATS * 2.0
    assert state.shortest_heartbeat() == 2.0  # the pushed one is called: no lease
    assert state.lapsed(registered + lease) == []
    assert state.lapsed(registered + lease + 0.1) == [("pulls", "pulls-token")]
    # A heartbeat renews it; one from an older registration neither renews nor counts.
    assert state.heartbeat("pulls", "pulls-token", now=registered + lease)
    assert not state.heartbeat("pulls", "old-token", now=registered + 3 * lease)
    assert state.lapsed(registered + 2 * lease) == []
    assert state.lapsed(registered + 2 * lease + 0.1) == [("pulls", "pulls-token")]
    # Receivers without a watch, and push receivers, never lapse.
    assert state.drop("pulls", "pulls-token")
    assert state.lapsed(registered + 100 * lease) == []
    assert state.shortest_heartbeat() is None


@pytest.mark.parametrize(
    "tensors, expected",
    [
        (
            {"net.weight": torch.zeros(4, 5), "net.bias": torch.zeros(4)},
            [
                "key 'net.weight'",
                "the hub's spec of model 'policy' has shape (4, 3) float32",
                "has shape (4, 5) float32",
                "(shape differs)",
            ],
        ),
        (
            {"net.weight": torch.zeros(4, 3), "net.bias": torch.zeros(4, dtype=torch.float64)},
            [
                "key 'net.bias'",
                "the hub's spec of model 'policy' has shape (4,) float32",
                "has shape (4,) float64",
                "(dtype differs)",
            ],
        ),
        (
            {"net.weight": torch.zeros(4, 3)},
            ["missing key(s) in receiver w2 (Collector(w2-actor-id)) model 'policy': 'net.bias'"],
        ),
        (
            {"net.weight": torch.zeros(4, 3), "net.bias": torch.zeros(4), "extra": torch.ones(1)},
            ["unexpected key(s) in receiver w2 (Collector(w2-actor-id)) model 'policy': 'extra'"],
        ),
    ],
    ids=["shape", "dtype", "missing-key", "extra-key"],
)
def test_a_mismatching_registration_is_refused_naming_actor_model_and_key(tensors, expected):
    state = HubState()
    first = _registration("w1", {"policy": POLICY})
    state.register(first)
    # "critic" is new and fine; "policy" disagrees: nothing of the registration is kept.
    wrong = _registration("w2", {"critic": CRITIC, "policy": WeightSpec.of(tensors)})
    with pytest.raises(SpecMismatchError) as info:
        state.register(wrong)
    message = str(info.value)
    assert message.startswith(
        "receiver w2 (Collector(w2-actor-id)) model 'policy' does not match "
        "the hub's spec of model 'policy'"
    ), message
    for part in expected:
        assert part in message, (part, message)
    assert list(state.receivers) == ["w1"]
    assert state.receivers["w1"].registration is first
    assert set(state.models) == {"policy"}
    assert state.spec("policy") == POLICY


def test_a_broadcast_is_checked_against_the_hubs_spec():
    state = HubState()
    state.declare("policy")
    other = WeightSpec.of({"net.weight": torch.zeros(2, 2)})
    assert state.check_broadcast("policy", other) is other  # no spec known yet: anything goes
    assert state.check_broadcast("fresh", other) is other  # unknown model: nothing to check
    state.register(_registration("w1", {"policy": POLICY}))
    known = state.spec("policy")
    equal = WeightSpec(tuple(POLICY.tensors))  # what a broadcast unpickles: equal, not known
    assert state.check_broadcast("policy", equal) is known  # kept, its digest computed once
    with pytest.raises(SpecMismatchError) as info:
        state.check_broadcast("policy", other)
    message = str(info.value)
    assert message.startswith("the broadcast does not match the hub's spec of model 'policy'"), (
        message
    )
    assert "missing key(s) in the broadcast: 'net.bias'" in message
    assert "the broadcast has shape (2, 2) float32" in message


# -- versions ----------------------------------------------------------------------------


def test_versions_count_up_from_one_or_jump_to_an_explicit_higher_one():
    state = HubState()
    assert [_publish(state).version for _ in range(2)] == [1, 2]
    assert _publish(state, version=10).version == 10
    assert _publish(state).version == 11
    assert state.versions() == {"policy": 11}
    assert state.latest("policy").version == 11


@pytest.mark.parametrize("version", [11, 5, 0, -1])
def test_a_version_not_above_the_current_one_is_refused_and_changes_nothing(version):
    state = HubState()
    _publish(state, version=11, payload="eleven")
    with pytest.raises(StaleVersionError) as info:
        _publish(state, version=version, payload="stale")
    assert str(info.value) == (
        f"version {version} of model 'policy' is not above the current version 11; "
        "versions only go up"
    )
    assert state.versions() == {"policy": 11}
    assert state.latest("policy") == HandedOver(
        "policy", 11, POLICY.digest, {"object_store": "eleven"}
    )


def test_a_version_every_receiver_failed_may_be_sent_again_under_its_number():
    """Failed at every receiver it went to (a version in parts whose part could not be
    read), no receiver holds it: its learners send it again under the same number. Once
    a receiver holds it (a late ack), or a newer version came, the number is taken."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    _publish(state, version=10)
    state.record("w1", "policy", 10)
    _publish(state, version=11, payload="lost")
    state.failed_everywhere("policy", 10)  # not the latest: nothing changes
    with pytest.raises(StaleVersionError):
        state.check_version("policy", 11)
    state.failed_everywhere("policy", 11)
    assert _publish(state, version=11, payload="again").version == 11
    assert state.latest("policy").payloads == {"object_store": "again"}
    assert state.models["policy"].versions_behind(10) == 1  # one version, not two
    with pytest.raises(StaleVersionError):  # published again: its number is taken anew
        state.check_version("policy", 11)
    state.failed_everywhere("policy", 11)
    state.record("w1", "policy", 11)  # an ack after all
    with pytest.raises(StaleVersionError):
        state.check_version("policy", 11)


def test_a_version_a_receiver_holds_is_not_sent_again_though_the_others_failed_it():
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    _publish(state, version=11)
    state.record("w1", "policy", 11)
    state.failed_everywhere("policy", 11)
    with pytest.raises(StaleVersionError):
        state.check_version("policy", 11)


def test_check_version_of_a_model_never_seen_starts_from_zero():
    state = HubState()
    state.check_version("policy", None)
    state.check_version("policy", 1)
    with pytest.raises(StaleVersionError, match="version 0 of model 'policy' is not above .* 0"):
        state.check_version("policy", 0)


def test_a_receiver_ahead_of_a_restarted_hub_raises_its_next_version():
    state = HubState()  # a hub that lost its counters
    state.register(_registration("w1", {"policy": POLICY}, versions={"policy": 7}))
    state.register(_registration("w2", {"policy": POLICY}, versions={"policy": 2}))
    assert state.versions() == {"policy": 7}  # never lowered by the receiver behind
    with pytest.raises(StaleVersionError, match="current version 7"):
        _publish(state, version=7)
    assert _publish(state).version == 8


def test_publish_keeps_every_hand_off_payload_and_hands_out_the_transports_own():
    state = HubState()
    payloads = {"object_store": "object-ref", "shared_memory": "segment"}
    handed = state.publish("policy", POLICY, payloads)
    assert state.latest("policy") is handed and handed.payloads == payloads
    assert handed.update_for("shared_memory") == Update(
        "policy", 1, POLICY.digest, "shared_memory", "segment"
    )
    assert handed.update_for("rpc") == Update("policy", 1, POLICY.digest, "rpc", "object-ref")


def test_restore_keeps_versions_and_specs_across_a_hub_restart():
    old = HubState()
    old.register(_registration("w1", {"policy": POLICY, "critic": CRITIC}))
    _publish(old, version=4)
    new = HubState()
    new.restore(old.versions(), old.specs())
    assert new.versions() == {"policy": 4, "critic": 0}
    assert new.specs() == {"policy": POLICY, "critic": CRITIC}
    assert new.latest("policy") is None and new.receivers == {}
    with pytest.raises(StaleVersionError):
        _publish(new, version=4)
    with pytest.raises(SpecMismatchError, match="receiver w2"):
        new.register(_registration("w2", {"critic": POLICY}))
    assert _publish(new).version == 5


# -- targets -----------------------------------------------------------------------------


def _four_receivers() -> HubState:
    state = HubState()
    state.register(_registration("push-a", {"policy": POLICY}))
    state.register(_registration("push-b", {"policy": POLICY, "critic": CRITIC}))
    state.register(_registration("pull", {"policy": POLICY}, mode=PULL))
    state.register(_registration("critic-only", {"critic": CRITIC}))
    return state


def test_a_broadcast_to_all_goes_to_the_push_receivers_holding_the_model():
    state = _four_receivers()
    assert _workers(state.targets("policy", None)) == ["push-a", "push-b"]
    assert _workers(state.targets("critic", None)) == ["push-b", "critic-only"]
    assert state.targets("unheld", None) == []


def test_a_broadcast_to_named_workers_goes_to_exactly_those_pull_receivers_included():
    state = _four_receivers()
    assert _workers(state.targets("policy", ("pull", "push-a"))) == ["pull", "push-a"]
    assert _workers(state.targets("critic", ("critic-only",))) == ["critic-only"]


def test_targets_refuse_no_workers_unknown_workers_and_workers_without_the_model():
    state = _four_receivers()
    with pytest.raises(UnknownWorkerError) as info:
        state.targets("policy", ())
    assert str(info.value) == "workers=[] names no receiver; pass None for all of them"
    with pytest.raises(UnknownWorkerError) as info:
        state.targets("policy", ("push-a", "ghost"))
    assert str(info.value) == (
        "unknown worker 'ghost'; registered workers: critic-only, pull, push-a, push-b"
    )
    with pytest.raises(UnknownModelError) as info:
        state.targets("policy", ("critic-only",))
    assert str(info.value) == "worker 'critic-only' does not hold model 'policy' (it holds: critic)"
    with pytest.raises(UnknownWorkerError, match="registered workers: none"):
        HubState().targets("policy", ("ghost",))


def test_a_named_pull_receiver_no_call_can_reach_is_refused_before_any_is_called():
    state = _four_receivers()
    state.register(_registration("driver", {"policy": POLICY}, mode=PULL, handle=None))
    with pytest.raises(UnknownWorkerError) as info:
        state.targets("policy", ("push-a", "driver"))
    assert "'driver'" in str(info.value) and "pull_weights()" in str(info.value)


def test_a_receiver_entry_describes_itself_to_transport_planners():
    state = HubState()
    kept = ("payload-of-a-zero-copy-model",)
    state.register(_registration("w1", {"policy": POLICY}, transport="nixl", kept=kept))
    entry = state.receivers["w1"]
    assert entry.transport == "nixl"
    assert entry.info == ReceiverInfo(
        worker="w1",
        actor=_actor("w1"),
        node_id="node-a",
        process="process-w1",
        handle="an actor handle",
        kept=kept,
        attachment="w1-attachment",
        entry=Entry.RAY_CALL,
    )


# -- model ids ---------------------------------------------------------------------------


def test_an_unknown_model_is_refused_until_declared_registered_or_broadcast():
    state = HubState()
    with pytest.raises(UnknownModelError) as info:
        state.check_known("policy")
    assert str(info.value) == (
        "unknown model 'policy': no receiver registered it and the hub was not started "
        "with it in models=[...]; the hub knows: none"
    )
    state.declare("policy")
    state.check_known("policy")
    assert state.versions() == {"policy": 0}
    assert state.specs() == {}  # declared: its spec comes later
    assert state.latest("policy") is None
    with pytest.raises(UnknownModelError, match="unknown model 'critic'.*the hub knows: policy$"):
        state.check_known("critic")
    state.register(_registration("w1", {"critic": CRITIC}))
    state.check_known("critic")
    _publish(state, model="value", spec=CRITIC)
    state.check_known("value")
    with pytest.raises(UnknownModelError, match="the hub knows: critic, policy, value$"):
        state.check_known("other")


def test_a_declared_model_takes_the_spec_of_its_first_registration():
    state = HubState()
    state.declare("policy")
    state.register(_registration("w1", {"policy": POLICY}))
    assert state.spec("policy") == POLICY
    with pytest.raises(SpecMismatchError, match="receiver w2"):
        state.register(_registration("w2", {"policy": CRITIC}))


def test_declaring_a_known_model_again_keeps_its_version_and_spec():
    state = HubState()
    _publish(state, version=3)
    state.declare("policy")
    assert state.versions() == {"policy": 3}
    assert state.spec("policy") == POLICY
    assert state.latest("policy").version == 3


def test_latest_of_an_unknown_model_names_the_known_ones():
    state = HubState()
    with pytest.raises(UnknownModelError) as info:
        state.latest("policy")
    assert str(info.value) == "unknown model 'policy'; the hub knows: none"
    state.declare("critic")
    with pytest.raises(UnknownModelError, match="the hub knows: critic$"):
        state.latest("policy")


def test_a_broadcast_without_model_goes_to_the_only_model_or_is_refused():
    state = HubState()
    assert state.resolve_model(None) == DEFAULT_MODEL == "default"
    assert state.resolve_model("anything") == "anything"
    state.declare("policy")
    assert state.resolve_model(None) == "policy"
    state.declare("critic")
    assert state.resolve_model("critic") == "critic"
    with pytest.raises(UnknownModelError) as info:
        state.resolve_model(None)
    assert str(info.value) == (
        "the hub holds several models (critic, policy); pass model=... to broadcast"
    )


# -- models a dropped receiver alone brought -----------------------------------------------

#: The first receiver's mis-shaped policy: (4, 5) where the learner's is (4, 3).
MISSHAPED = WeightSpec.of({"net.weight": torch.zeros(4, 5), "net.bias": torch.zeros(4)})


def test_a_model_id_a_dropped_receiver_alone_registered_is_forgotten():
    """A receiver attached with a mistyped id ({"polcy": net}) and closed: every later
    broadcast naming no model was refused as ambiguous, for the hub's life."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    state.register(_registration("w2", {"polcy": POLICY}))
    assert state.drop("w2", "w2-token") is True
    state.forget_unclaimed({"polcy"})
    assert state.resolve_model(None) == "policy"
    assert state.versions() == {"policy": 0} and state.specs() == {"policy": POLICY}
    with pytest.raises(UnknownModelError, match="unknown model 'polcy'.*the hub knows: policy$"):
        state.check_known("polcy")


def test_the_spec_a_dropped_receiver_alone_registered_refuses_nothing_after_it():
    """The first receiver of a model registered it mis-shaped and closed: the learner's
    correct broadcast, and the fixed receiver, were refused against its spec."""
    state = HubState()
    state.register(_registration("bad", {"policy": MISSHAPED}))
    state.drop("bad", "bad-token")
    state.forget_unclaimed({"policy"})
    assert state.check_broadcast("policy", POLICY) is POLICY
    assert state.register(_registration("fixed", {"policy": POLICY})) == {}
    assert state.spec("policy") == POLICY


def test_only_the_models_no_receiver_holds_any_more_are_forgotten():
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    state.register(_registration("w2", {"policy": POLICY, "critic": CRITIC}))
    state.drop("w2", "w2-token")
    state.forget_unclaimed({"policy", "critic"})
    assert state.versions() == {"policy": 0} and state.specs() == {"policy": POLICY}
    with pytest.raises(SpecMismatchError, match="receiver w3"):
        state.register(_registration("w3", {"policy": MISSHAPED}))


@pytest.mark.parametrize("how", ["published", "brought"])
def test_a_numbered_model_is_kept_when_its_receivers_leave(how):
    """Published (late joiners read its latest version), or a version a receiver
    brought (a restarted hub's next one must go above it): never forgotten."""
    state = HubState()
    brought = {"policy": 3} if how == "brought" else {}
    state.register(_registration("w1", {"policy": POLICY}, versions=brought))
    latest = _publish(state) if how == "published" else None
    state.drop("w1", "w1-token")
    state.forget_unclaimed({"policy"})
    assert state.versions() == {"policy": 1 if latest else 3}
    assert state.spec("policy") == POLICY and state.latest("policy") == latest
    with pytest.raises(SpecMismatchError, match="receiver late"):
        state.register(_registration("late", {"policy": MISSHAPED}))


def test_a_declared_model_stays_known_and_forgets_the_spec_a_dropped_receiver_brought():
    state = HubState()
    state.declare("policy")
    state.register(_registration("bad", {"policy": MISSHAPED}))
    state.drop("bad", "bad-token")
    state.forget_unclaimed({"policy"})
    state.check_known("policy")
    assert state.versions() == {"policy": 0} and state.specs() == {}
    assert state.resolve_model(None) == "policy"
    assert state.check_broadcast("policy", POLICY) is POLICY


def test_a_model_a_version_is_assembling_for_is_kept():
    """Its parts were checked against the spec and it is known: forgotten, the whole
    would be refused as of an unknown model once its last part came."""
    state = HubState()
    state.register(_registration("w1", {"policy": MISSHAPED}))
    state.drop("w1", "w1-token")
    state.forget_unclaimed({"policy"}, kept={"policy"})
    assert state.versions() == {"policy": 0} and state.specs() == {"policy": MISSHAPED}


def test_the_hub_saves_its_snapshot_without_the_models_a_dropped_receiver_forgot():
    """The hub's drop (actors/hub.py, with a HubSnapshot whose GCS is a dict): the typo
    leaves the snapshot (else a restarted hub knew it again), and with no model left a
    broadcast waits for the next receiver's, as at start-up."""
    import asyncio
    import functools
    import pickle
    from types import SimpleNamespace

    from raysync.actors.hub import WeightHubActor
    from raysync.hub_snapshot import HubSnapshot

    gcs: dict[str, object] = {}
    snapshot = HubSnapshot("hub-actor")
    snapshot._put = lambda key, value: gcs.__setitem__(key, pickle.loads(value))
    snapshot._delete = gcs.pop
    state = HubState()
    hub = SimpleNamespace(
        _state=state,
        _snapshot=snapshot,
        _assemblies=SimpleNamespace(arrived=dict),  # no version sent in parts
        _direct_routes=DirectRoutes(),
        _model_known=asyncio.Event(),
        _forget_in=lambda transport, worker, why, lapsed: None,
    )
    for method in ("_forget_models_of",):
        setattr(hub, method, functools.partial(getattr(WeightHubActor, method), hub))
    for worker, model in [("w1", "policy"), ("w2", "polcy")]:
        state.register(_registration(worker, {model: POLICY}))
        snapshot.save_registered(state.versions(), state.specs(), ("object_store",))
    hub._model_known.set()
    WeightHubActor._drop(hub, "w2", "w2-token", left=True)
    assert gcs == {
        "spec/policy": POLICY,
        "transports": ("object_store",),
        "versions": {"policy": 0},
    }
    assert hub._model_known.is_set()
    WeightHubActor._drop(hub, "w1", "w1-token", left=True)
    assert gcs == {"transports": ("object_store",), "versions": {}}
    assert not hub._model_known.is_set() and state.models == {}


@pytest.mark.parametrize("lapsed", [False, True], ids=["died", "lapsed"])
def test_a_receiver_that_died_keeps_its_unpublished_model_known(lapsed):
    """Ray may restart it: a broadcast naming its model meanwhile (the hub knows
    another) was refused as unknown, where it had been published for it to catch up."""
    import functools
    from types import SimpleNamespace

    from raysync.actors.hub import WeightHubActor

    state = HubState()
    state.declare("other")
    state.register(_registration("w1", {"policy": POLICY}))
    hub = SimpleNamespace(
        _state=state,
        _snapshot=None,
        _assemblies=SimpleNamespace(arrived=dict),
        _direct_routes=DirectRoutes(),
        _forget_in=lambda transport, worker, why, lapsed: None,
    )
    for method in ("_forget_models_of",):
        setattr(hub, method, functools.partial(getattr(WeightHubActor, method), hub))
    WeightHubActor._drop(hub, "w1", "w1-token", lapsed=lapsed)
    assert state.receivers == {}
    state.check_known("policy")
    assert state.check_broadcast("policy", POLICY) == POLICY


# -- acks and statuses ---------------------------------------------------------------------


def test_record_only_moves_a_receivers_version_up_and_statuses_show_the_lag():
    state = HubState()
    # Registered out of name order: statuses are sorted by worker.
    state.register(
        _registration("w-b", {"policy": POLICY, "critic": CRITIC}, mode=PULL, transport="rpc")
    )
    state.register(_registration("w-a", {"policy": POLICY}))
    for at in (10.0, 11.0, 12.0):
        _publish(state, at=at)
    _publish(state, model="critic", spec=CRITIC, version=2, at=13.0)
    applied = ReceiverTimings(fetch_s=0.01, wait_s=0.0, apply_s=0.001)
    state.record("w-a", "policy", 3, applied)
    state.record("w-b", "policy", 2)
    state.record("w-b", "policy", 1, applied)  # an older ack arriving late changes nothing
    state.record("w-b", "critic", 2)
    state.record("ghost", "policy", 3)  # a dropped receiver's ack is ignored
    assert state.statuses(now=20.0) == (
        ReceiverStatus(
            worker="w-a",
            actor=_actor("w-a"),
            mode=PUSH,
            versions={"policy": 3},
            lag={"policy": 0},
            transport="object_store",
            lag_s={"policy": 0.0},
            last_timings={"policy": applied},
        ),
        ReceiverStatus(
            worker="w-b",
            actor=_actor("w-b"),
            mode=PULL,
            versions={"critic": 2, "policy": 2},
            lag={"critic": 0, "policy": 1},
            transport="rpc",
            lag_s={"critic": 0.0, "policy": 8.0},  # lacks version 3, published at 12
        ),
    )
    _publish(state)
    _publish(state)
    assert [s.lag for s in state.statuses()] == [{"policy": 2}, {"critic": 0, "policy": 3}]


def test_the_lag_in_seconds_is_left_out_for_versions_published_before_a_hub_restart():
    """The first version it lacks came before the restart: when is not known (it was
    given as the time of the first version published after, as if it lacked only that
    one, beside a receiver that did)."""
    state = HubState()
    state.restore({"policy": 4}, {"policy": POLICY})
    state.register(_registration("w1", {"policy": POLICY}, versions={"policy": 2}))
    state.register(_registration("w2", {"policy": POLICY}, versions={"policy": 4}))
    first, second = state.statuses(now=5.0)
    assert (first.lag, first.lag_s) == ({"policy": 2}, {})
    _publish(state, at=3.0)
    first, second = state.statuses(now=5.0)
    assert (first.lag, first.lag_s) == ({"policy": 3}, {})
    assert (second.lag, second.lag_s) == ({"policy": 1}, {"policy": 2.0})


def test_the_lag_counts_versions_not_the_difference_of_their_numbers():
    """Versions numbered by training step (explicit versions): one version behind is a
    lag of 1, not the steps between them."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    for step, at in ((100, 1.0), (200, 2.0), (300, 3.0)):
        _publish(state, version=step, at=at)
    (status,) = state.statuses(now=5.0)
    assert (status.lag, status.lag_s) == ({"policy": 3}, {"policy": 4.0})
    state.record("w1", "policy", 300)
    _publish(state, version=400, at=4.0)
    (status,) = state.statuses(now=5.0)
    assert (status.lag, status.lag_s) == ({"policy": 1}, {"policy": 1.0})


def test_the_lag_of_a_receiver_far_behind_counts_versions_once_the_record_is_full():
    """Versions numbered by step (10 apart): once the record of publications was full,
    its oldest was taken as dropped already, and a receiver behind all of it lagged by
    number below it (1033 for 1024 versions, with no lag in seconds); a version more,
    1043. The versions dropped from the record count one each."""
    state = HubState()
    state.register(_registration("w", {"policy": POLICY}))
    for i in range(1, KEPT + 1):
        _publish(state, version=10 * i, at=float(i))
    status = state.status_of("w", now=2000.0)
    assert (status.lag, status.lag_s) == ({"policy": KEPT}, {"policy": 1999.0})
    for i in range(KEPT + 1, KEPT + 3):
        _publish(state, version=10 * i, at=float(i))
    assert state.status_of("w", now=2000.0).lag == {"policy": KEPT + 2}


def test_a_version_a_receiver_brought_is_where_the_record_starts():
    """A receiver registered holding a version this hub never published (it restarted
    and lost its counters): the hub goes on above it, and a receiver behind it has no
    known lag in seconds."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}, versions={"policy": 7}))
    state.register(_registration("w2", {"policy": POLICY}, versions={"policy": 5}))
    _publish(state, at=3.0)
    first, second = state.statuses(now=5.0)
    assert (first.lag, first.lag_s) == ({"policy": 1}, {"policy": 2.0})
    assert (second.lag, second.lag_s) == ({"policy": 3}, {})


def test_a_receiver_that_registered_with_a_version_reports_it_until_it_acks_more():
    state = HubState()
    _publish(state, version=5)
    state.register(_registration("w1", {"policy": POLICY}, versions={"policy": 4}))
    (status,) = state.statuses()
    assert (status.versions, status.lag) == ({"policy": 4}, {"policy": 1})
    state.record("w1", "policy", 5)
    (status,) = state.statuses()
    assert (status.versions, status.lag) == ({"policy": 5}, {"policy": 0})


def test_a_worker_named_twice_is_targeted_once():
    state = _four_receivers()
    assert _workers(state.targets("policy", ("push-a", "pull", "push-a"))) == ["push-a", "pull"]


def test_a_version_brought_above_published_ones_counts_in_the_lag_of_those_behind():
    """A receiver that applied version 2 here, then another registering with version 5
    (brought from before a restart): the first showed lag 0 (the record of 1 and 2 hid
    the versions up to 5), and after version 6 a lag of 1 with a time, though it lacks
    3 to 6 and the first of them was never published here."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY}))
    _publish(state, at=1.0)
    _publish(state, at=2.0)
    state.record("w1", "policy", 2)
    state.register(_registration("w2", {"policy": POLICY}, versions={"policy": 5}))
    behind, brought = state.statuses(now=3.0)
    assert (behind.lag, behind.lag_s) == ({"policy": 3}, {})
    assert (brought.lag, brought.lag_s) == ({"policy": 0}, {"policy": 0.0})
    _publish(state, at=4.0)
    behind, brought = state.statuses(now=5.0)
    assert (behind.lag, behind.lag_s) == ({"policy": 4}, {})
    assert (brought.lag, brought.lag_s) == ({"policy": 1}, {"policy": 1.0})


def test_the_lags_alone_are_those_the_statuses_show():
    """What the hub's metrics read after each broadcast, without a status per receiver:
    up to date, behind with a known time, and behind a version brought from before a
    restart (no known time), per model each receiver holds."""
    state = HubState()
    state.register(_registration("w1", {"policy": POLICY, "critic": CRITIC}))
    _publish(state, at=1.0)
    _publish(state, model="critic", spec=CRITIC, at=2.0)
    state.record("w1", "critic", 1)
    state.register(_registration("w2", {"policy": POLICY}, versions={"policy": 5}))
    _publish(state, at=4.0)
    state.register(_registration("w3", {"policy": POLICY}, versions={"policy": 6}))
    assert state.lags(now=10.0) == {
        ("w1", "critic"): Lag(0, 0.0),
        ("w1", "policy"): Lag(6, None),
        ("w2", "policy"): Lag(1, 6.0),
        ("w3", "policy"): Lag(0, 0.0),
    }
    assert state.lags(now=10.0) == {
        (status.worker, model): Lag(versions, status.lag_s.get(model))
        for status in state.statuses(now=10.0)
        for model, versions in status.lag.items()
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.5, True])
def test_a_version_that_is_no_int_is_refused(bad):
    """A request that did not come through HubHandle: NaN compares as above nothing
    and below nothing, and passed the check."""
    state = HubState()
    _publish(state)
    with pytest.raises(ValueError, match="version must be an int"):
        state.check_version("policy", bad)
