"""The hub's route (``WeightHubActor.route``), without Ray: a learner asks for the route
of its next broadcast right after sending one; Ray may start the two calls in either
order, so the route waits for that broadcast's turn. One that does not come within the
turns' wait leaves the route without a next version."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from raysync.actors.hub import WeightHubActor
from raysync.messages import Route
from raysync.ordering import InOrder

DIRECT = Route(("object_store",), "policy", 2)  #: the route as of now: version 2 next


def _hub() -> SimpleNamespace:
    return SimpleNamespace(
        _in_order=InOrder(0.05),
        transports=lambda: ("object_store",),
        _route=lambda model, known: DIRECT,
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
