"""The hub's route (``WeightHubActor.route``), without Ray: a learner asks for the route
of its next broadcast right after sending one; Ray may start the two calls in either
order, so the route waits for that broadcast's turn. One that does not come within the
turns' wait leaves the route without a next version.

Every receiver's transport is a hand-off of every route: on a hub started with
``bucket_mb`` one that moves whole versions only is refused as it registers, and a
learner refusing a bucketed version for such a hand-off says where its bucket size
came from."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from raysync import learner_side
from raysync.actors.hub import WeightHubActor
from raysync.hub_handle import HubHandle
from raysync.hub_state import HubState
from raysync.messages import DeliveryMode, Entry, HubConfig, Registration, Route, Welcome
from raysync.ordering import InOrder
from raysync.spec import WeightSpec
from raysync.transports import register_transport
from tests.third_party_transport import PackedObjectTransport

#: 512 KiB: above the buckets of the hubs and broadcasts below.
WEIGHTS = {"w": torch.zeros(128, 1024)}

DIRECT = Route(("object_store",), "policy", 2)  #: the route as of now: version 2 next


def _hub() -> SimpleNamespace:
    return SimpleNamespace(
        _in_order=InOrder(0.05),
        transports=lambda: ("object_store",),
        _route=lambda model, known, submitter: DIRECT,
    )


def test_a_route_whose_broadcast_before_did_not_come_names_no_next_version():
    """The learner's broadcast just before (call 2) had not reached the hub: the route
    named the version after the latest published, the number that broadcast then took
    as it came, so the learner delivered other weights under it itself (both its own:
    receivers took them for the same version)."""
    route = asyncio.run(WeightHubActor.route(_hub(), "policy", "learner", after=2))
    assert route == Route(("object_store",))


def test_a_route_with_no_broadcast_before_it_is_the_route_as_of_now():
    assert asyncio.run(WeightHubActor.route(_hub(), "policy", "learner", after=0)) == DIRECT


@pytest.fixture(autouse=True)
def packed_object() -> None:
    """``packed_object``, a third party's transport that moves whole versions only."""
    register_transport("packed_object", PackedObjectTransport)


class _Planner:
    """A transport's planner that takes every receiver in."""

    async def receiver_joined(self, info):
        return f"connection details of {info.worker}"


def _registering_hub(bucket_mb: float | None) -> SimpleNamespace:
    """The hub's state behind ``_register``, as started with ``bucket_mb``."""
    hub = SimpleNamespace(
        _config=SimpleNamespace(bucket_mb=bucket_mb),
        _transport="object_store",
        _withdrawn=OrderedDict(),
        _leaving={},
        _default_timeout_s=30.0,
        _state=HubState(),
        _model_known=asyncio.Event(),
        _lease_keeper=None,
        _check_registering=lambda registration: None,
        _planner=lambda transport, asked_by: _Planner(),
        _save_registered=lambda: None,
    )
    hub._check_not_withdrawn = functools.partial(WeightHubActor._check_not_withdrawn, hub)
    return hub


def _registration(transport: str) -> Registration:
    return Registration(
        "r0",
        None,
        "key",
        Entry.RAY_CALL,
        "Collector(1)",
        "node",
        "p1",
        {"policy": WeightSpec.of(WEIGHTS)},
        {},
        DeliveryMode.PULL,
        "t1",
        transport=transport,
    )


def test_a_receiver_of_a_whole_version_transport_is_refused_by_a_bucketing_hub():
    """Taken in, its hand-off joined every route: each broadcast above the hub's
    bucket_mb, from every learner, was refused for it (workers=... leaving it out
    too), suggesting a broadcast without bucket_mb, which takes the hub's default."""
    hub = _registering_hub(bucket_mb=64)
    with pytest.raises(ValueError) as refused:
        asyncio.run(WeightHubActor._register(hub, _registration("packed_object")))
    message = str(refused.value)
    assert message.startswith("bucket_mb: transport 'packed_object' moves whole versions only")
    assert "started with bucket_mb=64" in message
    assert "r0 (Collector(1)) cannot register" in message
    assert "start the hub without bucket_mb" in message
    assert (hub._state.receivers, hub._state.models) == ({}, {})


@pytest.mark.parametrize(
    ("bucket_mb", "transport"), [(None, "packed_object"), (64, "object_store")]
)
def test_a_receiver_is_taken_in_where_its_transport_moves_what_the_hub_sends(bucket_mb, transport):
    hub = _registering_hub(bucket_mb)
    welcome = asyncio.run(WeightHubActor._register(hub, _registration(transport)))
    assert welcome == Welcome(transport, "connection details of r0", {})
    assert hub._state.transports() == {transport}


class _RoutedHandle(HubHandle):
    """A learner's handle whose hub lists a ``packed_object`` receiver's hand-off in
    every route."""

    def _route(self, model, timeout_s):
        return Route(("object_store", "packed_object"))


@pytest.fixture
def handle_on(monkeypatch):
    """A learner's handle on a hub started with ``bucket_mb`` (no Ray here to ask other
    hubs whether they closed)."""
    monkeypatch.setattr(learner_side, "_sides", {})
    monkeypatch.setattr(learner_side, "_end_sides_of_gone_hubs", lambda hubs: None)
    handles: list[HubHandle] = []

    def handle(bucket_mb: float | None) -> HubHandle:
        config = HubConfig("object_store", 60.0, False, f"hub-{len(handles)}", bucket_mb=bucket_mb)
        handles.append(_RoutedHandle("the hub's actor", config))
        return handles[-1]

    yield handle
    for each in handles:
        each.release()


@pytest.mark.parametrize(
    ("hub_mb", "broadcast_mb", "advice"),
    [
        (
            0.25,
            None,
            "the bucket size is the hub's default, bucket_mb=0.25 (WeightHub.remote), unless "
            "a broadcast passes a bucket_mb above the version's size (it then goes whole): "
            "have its receivers use one of those, or start the hub without bucket_mb",
        ),
        (
            0.25,
            0.125,
            "the bucket size is this broadcast's bucket_mb=0.125, and without it the hub's "
            "default, bucket_mb=0.25 (WeightHub.remote), unless a broadcast passes a "
            "bucket_mb above the version's size (it then goes whole): have its receivers "
            "use one of those, or start the hub without bucket_mb",
        ),
        (
            None,
            0.125,
            "broadcast without bucket_mb, or have its receivers use one of those",
        ),
    ],
)
def test_a_bucketed_version_for_a_whole_version_hand_off_is_refused_saying_how_to_send(
    handle_on, hub_mb, broadcast_mb, advice
):
    """A broadcast without bucket_mb on a hub started with one takes the hub's: the
    refusal told the learner to broadcast without bucket_mb, which it had done."""
    handle = handle_on(hub_mb)
    with pytest.raises(ValueError) as refused:
        handle.broadcast.remote(WEIGHTS, model="policy", bucket_mb=broadcast_mb)
    message = str(refused.value)
    assert message.startswith("bucket_mb: transport 'packed_object' moves whole versions only")
    assert message.endswith(advice)
    assert handle._side.last_results == {}  # nothing was submitted


def test_a_released_learner_is_forgotten_once_its_last_broadcast_had_its_turn():
    """``forget_learner`` (sent by ``HubHandle.release``) may start before the learner's
    last broadcast, which delivered its routed number itself: that number stays held
    until the broadcast had its turn, and for good if it never comes (a gap at worst)."""
    from raysync.direct_routes import DirectRoutes

    def held(after: int) -> bool:
        hub = SimpleNamespace(_in_order=InOrder(0.05), _direct_routes=DirectRoutes())
        hub._direct_routes.route("policy", "released", published=4)  # 5: its own
        asyncio.run(WeightHubActor.forget_learner(hub, "released", after=after))
        return hub._direct_routes.next_version("policy", "other", published=4) == 6

    assert held(after=2)  # its call 2 never had its turn here
    assert not held(after=0)  # it sent none
