"""HubSnapshot (raysync/hub_snapshot.py) without Ray: what a registration writes.

The GCS key-value store is replaced by a dict (``_put``): a registration writes the
transports and models that are new to the snapshot, nothing when nothing is, and never
a version lower than one saved before publishing.
"""

from __future__ import annotations

import pickle

import torch

from raysync.hub_snapshot import HubSnapshot
from raysync.spec import WeightSpec

POLICY = WeightSpec.of({"w": torch.zeros(2, 3)})
CRITIC = WeightSpec.of({"v": torch.zeros(3)})


def _snapshot() -> tuple[HubSnapshot, dict[str, object]]:
    written: dict[str, object] = {}
    snapshot = HubSnapshot("hub-actor")
    snapshot._put = lambda key, value: written.__setitem__(key, pickle.loads(value))
    return snapshot, written


def test_a_registration_saves_a_transport_new_to_the_snapshot():
    snapshot, written = _snapshot()
    snapshot.save({"policy": 3}, {"policy": POLICY}, ("object_store",))
    written.clear()
    snapshot.save_registered({"policy": 3}, {"policy": POLICY}, ("object_store",))
    assert written == {}  # nothing new: nothing written
    snapshot.save_registered({"policy": 3}, {"policy": POLICY}, ("object_store", "shared_memory"))
    assert written == {
        "transports": ("object_store", "shared_memory"),
        "versions": {"policy": 3},
    }


def test_a_registration_saves_a_model_new_to_the_snapshot_with_its_spec():
    snapshot, written = _snapshot()
    snapshot.save_registered({"policy": 0}, {"policy": POLICY}, ("object_store",))
    assert written == {
        "spec/policy": POLICY,
        "transports": ("object_store",),
        "versions": {"policy": 0},
    }
    written.clear()
    specs = {"policy": POLICY, "critic": CRITIC}
    snapshot.save_registered({"policy": 0, "critic": 0}, specs, ("object_store",))
    assert written == {"spec/critic": CRITIC, "versions": {"policy": 0, "critic": 0}}


def test_a_registration_never_lowers_a_version_saved_before_publishing():
    """A broadcast saves its number before the hub's state has it: a registration in
    between writes the saved number, not the state's lower one."""
    snapshot, written = _snapshot()
    snapshot.save({"policy": 5}, {"policy": POLICY}, ("object_store",))
    written.clear()
    snapshot.save_registered({"policy": 4}, {"policy": POLICY}, ("object_store", "rpc"))
    assert written["versions"] == {"policy": 5}
    written.clear()
    snapshot.save_registered({"policy": 7}, {"policy": POLICY}, ("object_store", "rpc"))
    assert written == {"versions": {"policy": 7}}  # a receiver brought a higher one


def test_a_model_the_hub_forgot_leaves_the_snapshot_with_its_spec():
    """A receiver registered a mistyped model id and left: a restarted hub read it back
    and held two models again."""
    snapshot, written = _snapshot()
    deleted = _deletions(snapshot)
    specs = {"policy": POLICY, "polcy": POLICY}
    snapshot.save_registered({"policy": 0, "polcy": 0}, specs, ("object_store",))
    written.clear()
    snapshot.save_forgotten(("polcy",), {"policy": 0}, {"policy": POLICY})
    assert (written, deleted) == ({"versions": {"policy": 0}}, ["spec/polcy"])
    written.clear()
    snapshot.save_forgotten(("polcy",), {"policy": 0}, {"policy": POLICY})
    assert (written, deleted) == ({}, ["spec/polcy"])  # forgotten already: nothing written


def test_a_declared_model_leaves_the_snapshot_only_its_spec_then_saves_the_next_one():
    snapshot, written = _snapshot()
    deleted = _deletions(snapshot)
    snapshot.save_registered({"policy": 0}, {"policy": CRITIC}, ("object_store",))
    written.clear()
    snapshot.save_forgotten(("policy",), {"policy": 0}, {})
    assert (written, deleted) == ({}, ["spec/policy"])
    # The right receiver registers: its spec is new to the snapshot, the rest is not.
    snapshot.save_registered({"policy": 0}, {"policy": POLICY}, ("object_store",))
    assert written == {"spec/policy": POLICY, "versions": {"policy": 0}}


def test_forgetting_never_drops_a_model_saved_with_a_number():
    """A version saved before publishing: a restarted hub must not number it again."""
    snapshot, written = _snapshot()
    deleted = _deletions(snapshot)
    snapshot.save({"policy": 5}, {"policy": POLICY}, ("object_store",))
    written.clear()
    snapshot.save_forgotten(("policy",), {}, {})
    assert (written, deleted) == ({}, [])


def _deletions(snapshot: HubSnapshot) -> list[str]:
    """The keys ``snapshot`` deletes from its GCS, in order."""
    deleted: list[str] = []
    snapshot._delete = deleted.append
    return deleted
