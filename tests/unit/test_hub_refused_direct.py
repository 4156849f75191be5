"""What the hub tells the transports of a version it refused after its learner had
delivered it to receivers itself (the direct path): each transport keeps that version
for its receivers the learner reached under their current registration, who read it
(or whose zero-copy model lives in it) whatever the hub decided."""

from __future__ import annotations

from types import SimpleNamespace

from raysync.actors.hub import WeightHubActor


def _entry(transport: str, token: str) -> SimpleNamespace:
    return SimpleNamespace(transport=transport, registration=SimpleNamespace(token=token))


def test_the_receivers_a_refused_version_reached_are_named_per_transport():
    hub = SimpleNamespace(
        _state=SimpleNamespace(
            receivers={
                "a": _entry("shared_memory", "ta"),
                "b": _entry("shared_memory", "tb"),
                "c": _entry("object_store", "tc"),
                "again": _entry("shared_memory", "new"),  # registered again since
            }
        )
    )
    request = SimpleNamespace(
        direct_calls={
            "a": ("ta", "call"),
            "b": ("tb", "call"),
            "c": ("tc", "call"),
            "again": ("old", "call"),  # reached its former registration
            "left": ("tl", "call"),  # gone since: its transport forgot it
        }
    )
    assert WeightHubActor._called_by_learner(hub, request) == {
        "shared_memory": ("a", "b"),
        "object_store": ("c",),
    }
    assert WeightHubActor._called_by_learner(hub, SimpleNamespace(direct_calls=None)) == {}
