"""A receiver may read by another transport than its hub's (``connect_hub(transport=...)``).

The learner hands each version over once per hand-off in use (``distributed`` and
``rpc`` read the object store's put, ``shared_memory`` and ``nixl`` need their own),
and the hub plans each receiver's delivery with its own transport's planner.
"""

from __future__ import annotations

import pytest
import ray

from raysync import available_transports
from raysync.transports import register_transport
from tests.helpers import assert_same, ready, start, start_hub
from tests.receivers import Collector, make_policy, state_of
from tests.third_party_transport import (
    PutReaderTransport,
    StuckBucketPlanTransport,
    StuckPlanTransport,
)


def test_receivers_choose_their_transport_on_an_object_store_hub(actors):
    hub = start_hub(actors, "object_store")
    plain = start(actors, Collector, hub, worker_id="plain")
    local = start(actors, Collector, hub, worker_id="local", transport="shared_memory")
    group = start(actors, Collector, hub, worker_id="group", transport="distributed")
    ready([plain, local, group])
    # distributed reads the object store's put: two hand-offs, not three.
    assert ray.get(hub.transports.remote()) == ("object_store", "shared_memory")

    for version in (1, 2):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert report.version == version and report.acked == ("group", "local", "plain")
        assert report.transports == ("distributed", "object_store", "shared_memory")
        for r in (plain, local, group):
            assert_same(ray.get(r.state.remote()), state_of(learner))
    transports = {r.worker: r.transport for r in ray.get(hub.status.remote()).receivers}
    assert transports == {"plain": "object_store", "local": "shared_memory", "group": "distributed"}

    # A late joiner reading by a transport already in use gets the latest version now.
    late = start(actors, Collector, hub, worker_id="late", transport="shared_memory")
    assert ray.get(late.version.remote()) == 2
    assert_same(ray.get(late.state.remote()), state_of(learner))


@pytest.mark.skipif("nixl" not in available_transports(), reason="nixl cannot run here")
def test_joiner_by_a_new_transport_is_served_once_the_learner_knows_it(actors):
    hub = start_hub(actors, "object_store")
    plain = start(actors, Collector, hub, worker_id="plain")
    ready([plain])
    ray.get(hub.broadcast.remote(make_policy()))
    # Version 1 exists only as an object-store put: nothing a nixl reader can read.
    newcomer = start(actors, Collector, hub, worker_id="newcomer", transport="nixl")
    assert ray.get(newcomer.version.remote()) == 0
    assert ray.get(hub.transports.remote()) == ("nixl", "object_store")

    # The learner asked for the hand-offs of version 2 while sending version 1, before
    # the newcomer existed: version 2 leaves it out (it is not a target, not a failure).
    report = ray.get(hub.broadcast.remote(make_policy()))
    assert report.version == 2 and report.acked == ("plain",) and report.failed == {}
    assert ray.get(newcomer.version.remote()) == 0

    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.version == 3 and report.acked == ("newcomer", "plain")
    for r in (plain, newcomer):
        assert_same(ray.get(r.state.remote()), state_of(learner))


def test_unknown_transport_is_refused_in_connect_hub(actors):
    hub = start_hub(actors, "object_store")
    bad = start(actors, Collector, hub, worker_id="bad", transport="carrier_pigeon")
    with pytest.raises(ray.exceptions.RayActorError, match="unknown transport 'carrier_pigeon'"):
        ready([bad])
    assert ray.get(hub.status.remote()).receivers == ()


def test_a_transport_that_never_finishes_planning_holds_no_other_back(actors):
    """The hub plans each transport's receivers at once: one whose planning never ends
    fails its own receivers at the timeout; the others were planned and delivered
    meanwhile (planned one transport after the other, they got what was left of the
    timeout after it: nothing)."""
    register_transport("stuck_plan", StuckPlanTransport)
    register_transport("put_reader", PutReaderTransport)
    hub = start_hub(actors, "object_store")
    stuck = start(actors, Collector, hub, worker_id="stuck", transport="stuck_plan")
    reader = start(actors, Collector, hub, worker_id="reader", transport="put_reader")
    ready([stuck, reader])
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, timeout_s=5, raise_on_failure=False))
    assert report.acked == ("reader",), report.failed
    assert "'stuck_plan' could not plan the delivery within the 5 s" in report.failed["stuck"]
    assert_same(ray.get(reader.state.remote()), state_of(learner))


def test_a_bucketed_version_one_transport_never_plans_reaches_the_others(actors):
    """A bucketed version is planned whole before anyone reads it, so every receiver
    waits for the slowest plan: planning gets half the timeout, and the receivers of
    the transports that planned read in the other half (before, they were left nothing)."""
    register_transport("stuck_bucket_plan", StuckBucketPlanTransport)
    hub = start_hub(actors, "object_store")
    stuck = start(actors, Collector, hub, worker_id="stuck", transport="stuck_bucket_plan")
    reader = start(actors, Collector, hub, worker_id="reader")
    ready([stuck, reader])
    learner = make_policy()
    report = ray.get(
        hub.broadcast.remote(learner, timeout_s=8, bucket_mb=0.001, raise_on_failure=False)
    )
    assert report.acked == ("reader",), report.failed
    reason = report.failed["stuck"]
    assert "could not plan the delivery within 4 s (0.5 of the 8 s timeout" in reason
    assert_same(ray.get(reader.state.remote()), state_of(learner))


def test_a_bucketed_version_read_by_one_transport_may_plan_for_the_whole_timeout(actors):
    """Half the timeout is for a version whose receivers read by several transports
    (the others wait for every plan); with one, its plan has the whole timeout (a slow
    rendezvous under load is not cut at half of it)."""
    register_transport("stuck_bucket_plan", StuckBucketPlanTransport)
    hub = start_hub(actors, "object_store")
    stuck = start(actors, Collector, hub, worker_id="stuck", transport="stuck_bucket_plan")
    ready([stuck])
    report = ray.get(
        hub.broadcast.remote(make_policy(), timeout_s=4, bucket_mb=0.001, raise_on_failure=False)
    )
    assert report.failed["stuck"].startswith(
        "transport 'stuck_bucket_plan' could not plan the delivery within the 4 s timeout"
    ), report.failed["stuck"]
