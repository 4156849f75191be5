"""The object store's put of a version of many small tensors: one object per copy thread
of the learner (``raysync.transports.object_store.arrays.put_version``), read back in
spec order by receivers, late joiners and relays alike."""

from __future__ import annotations

import ray
import torch

from tests.helpers import assert_same, ready, start, start_hub
from tests.receivers import Collector, make_many_small_model, state_of

#: Versions a fresh learner may put whole before its page tables cover the store (1 GiB
#: in the tests, 16 MiB per version).
_MOST_VERSIONS = 80


def test_many_small_tensors_travel_in_one_put_per_copy_thread_and_arrive_bitwise(actors):
    hub = start_hub(actors, "object_store")
    collectors = [
        start(actors, Collector, hub, worker_id=f"c{i}", model_factory=make_many_small_model)
        for i in range(2)
    ]
    ready(collectors)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the learner (this process) puts with two threads
    try:
        # Its first puts write pages of the store this process never touched, and stay
        # one object each (VersionPuts); it splits once a put did not fault.
        for version in range(1, _MOST_VERSIONS + 1):
            learner = make_many_small_model()
            report = ray.get(hub.broadcast.remote(learner))
            assert (report.version, report.acked) == (version, ("c0", "c1"))
            for collector in collectors:
                assert_same(ray.get(collector.state.remote()), state_of(learner))
            update = ray.get(hub.latest.remote("policy"))
            if len(update.payload.refs) == 2:
                break
    finally:
        torch.set_num_threads(threads)
    assert len(update.payload.refs) == 2, f"still one put after {_MOST_VERSIONS} versions"

    # A late joiner reads the same two objects, which the hub holds between broadcasts.
    late = start(actors, Collector, hub, worker_id="late", model_factory=make_many_small_model)
    ready([late])
    assert ray.get(late.version.remote()) == version
    assert_same(ray.get(late.state.remote()), state_of(learner))
