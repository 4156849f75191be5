"""The learner's own calls on the direct path (raysync/learner_direct.py), without Ray:
each names the registration the hub's route gave for its receiver."""

from __future__ import annotations

import torch

from raysync import learner_direct
from raysync.messages import DirectTarget, Entry, Route
from raysync.routing import hand_off_of
from raysync.spec import WeightSpec


def test_each_direct_call_names_the_registration_its_route_gave(monkeypatch):
    """The hub awaits each call's ack under that registration: a deferred ack must name
    it, whichever registration the receiver believes it holds."""
    delivered: list = []

    def delivery_call(handle, entry, attachment, update):
        delivered.append((attachment, update))
        return f"call to {attachment}"

    monkeypatch.setattr(learner_direct, "delivery_call", delivery_call)
    spec = WeightSpec.of({"w": torch.zeros(2)})
    targets = tuple(
        DirectTarget(worker, token, "object_store", None, Entry.RAY_CALL, f"{worker} key")
        for worker, token in [("w1", "t1"), ("w2", "t2")]
    )
    route = Route((hand_off_of("object_store"),), "policy", 4, spec, targets)
    payloads = {hand_off_of("object_store"): "the version's payload"}

    calls = learner_direct.deliver_directly(
        route, 4, spec, payloads, None, None, origin="learner", node_id=""
    )

    assert calls == {"w1": ("t1", "call to w1 key"), "w2": ("t2", "call to w2 key")}
    assert [(key, u.token, u.version, u.from_learner) for key, u in delivered] == [
        ("w1 key", "t1", 4, True),
        ("w2 key", "t2", 4, True),
    ]
