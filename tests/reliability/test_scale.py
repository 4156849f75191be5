"""Scale: 64 receivers on one machine (``num_cpus=0`` actors, small model).

Behind ``slow`` (64 receiver processes take ~16 GB and minutes to start on 2 cores);
``benchmarks/scale.py`` measures the latency of the same set-up.
"""

from __future__ import annotations

import pytest
import ray

from tests.helpers import assert_same, start, start_hub
from tests.receivers import Collector, make_policy, state_of

RECEIVERS = 64


@pytest.mark.slow
def test_64_receivers_all_ack_every_broadcast_bitwise(actors):
    hub = start_hub(actors, "object_store")
    receivers = []
    for batch in range(0, RECEIVERS, 8):  # a few at a time: each start imports torch
        new = [start(actors, Collector, hub, f"c{i}") for i in range(batch, batch + 8)]
        ray.get([r.version.remote() for r in new])
        receivers += new
    for _ in range(5):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert len(report.acked) == RECEIVERS and not report.failed
        expected = state_of(learner)
        for state in ray.get([r.state.remote() for r in receivers]):
            assert_same(state, expected)
    status = ray.get(hub.status.remote())
    assert {r.versions["policy"] for r in status.receivers} == {report.version}
