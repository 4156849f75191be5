"""raysync/routing.py without Ray: which payload receivers of each transport read."""

from __future__ import annotations

from raysync.routing import HandedOver, hand_off_of, hand_offs_for


def test_process_group_transports_read_the_object_store_put():
    assert hand_off_of("distributed") == "object_store"
    assert hand_off_of("rpc") == "object_store"
    assert hand_off_of("shared_memory") == "shared_memory"
    assert hand_offs_for(["rpc", "distributed", "object_store", "nixl"]) == (
        "nixl",
        "object_store",
    )


def test_a_version_is_read_by_the_transports_whose_hand_off_it_carries():
    handed = HandedOver("policy", 3, "digest", {"object_store": "put", "nixl": "buffers"})
    update = handed.update_for("distributed")
    assert update is not None
    assert (update.model, update.version, update.spec_digest) == ("policy", 3, "digest")
    assert (update.transport, update.payload) == ("distributed", "put")
    assert handed.update_for("nixl").payload == "buffers"
    assert handed.readable_by("rpc") and not handed.readable_by("shared_memory")
    assert handed.update_for("shared_memory") is None
