"""The hub's plan of a version's deliveries by one transport, without Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from raysync.actors.hub import WeightHubActor
from raysync.hub_state import HubState
from raysync.messages import DeliveryMode, Entry, Registration
from raysync.metrics import FailureCause
from raysync.spec import WeightSpec

SPEC = WeightSpec.of({"w": torch.zeros(4)})


class _Forgot:
    """A planner that forgot the target as it planned (it left the hub meanwhile)."""

    async def plan(self, update, spec, targets):
        return {}


def test_a_target_its_planner_left_out_fails_as_one_that_left():
    """A receiver that left (or registered again) while its transport planned is left
    out of the plan: its report said so, but its failure counted as not planned (and
    the hub asked Ray whether it was alive), alarming whoever watches that cause at
    every scale-down."""
    state = HubState()
    state.register(
        Registration(
            "w",
            None,
            "key",
            Entry.RAY_CALL,
            "A(1)",
            "node",
            "p1",
            {"m": SPEC},
            {},
            DeliveryMode.PUSH,
            "t1",
        )
    )
    handed = state.publish("m", SPEC, {"object_store": "payload"})
    hub = SimpleNamespace(_planners={"object_store": _Forgot()})
    planning = WeightHubActor._plan_group(
        hub, "object_store", [state.receivers["w"]], handed, SPEC, 5.0
    )
    plan = asyncio.run(planning)["w"]
    assert (plan.update, plan.cause) == (None, FailureCause.LEFT)
    assert "it left the hub" in plan.reason
