"""Soak: many broadcasts to many receivers; object store, /dev/shm, fds, threads and the
hub's memory return to their baseline. CI runs a short soak (240 broadcasts to 8
receivers); ``-m slow`` a long one (5000 to 16). Each receiver is a process that imports
torch (~4-5 s of CPU to start on 2 cores): the short soak's receivers are what it costs."""

from __future__ import annotations

import os
import re
import time

import pytest
import ray
from ray._private.internal_api import memory_summary

from tests.helpers import ready, start, start_hub, transport_params
from tests.receivers import Collector, make_policy, process_stats


def _plasma_objects() -> int:
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary).group(1))


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _other_fds(stats: dict) -> int:
    """A process's fds that are not established TCP connections."""
    return stats["fds"] - stats["tcp"]


def _snapshot(hub, receivers) -> dict:
    return {
        "hub": ray.get(hub.actor.__ray_call__.remote(process_stats)),
        "receivers": ray.get([r.__ray_call__.remote(process_stats) for r in receivers]),
        "plasma_objects": _plasma_objects(),
        "dev_shm": _dev_shm(),
    }


def _soak(actors, transport, broadcasts: int, receiver_count: int) -> None:
    hub = start_hub(actors, transport)
    receivers = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(receiver_count)]
    ready(receivers)
    weights = make_policy()
    for _ in range(20):  # warm up: first-use allocations are not leaks
        ray.get(hub.broadcast.remote(weights))
    before = _snapshot(hub, receivers)
    in_flight = []
    for _ in range(broadcasts):
        in_flight.append(hub.broadcast.remote(weights, wait=False))
        if len(in_flight) == 8:  # keep a few broadcasts in flight at once
            ray.get([hub.wait_for.remote(t) for t in ray.get(in_flight)])
            in_flight.clear()
    ray.get([hub.wait_for.remote(t) for t in ray.get(in_flight)])
    final = ray.get(hub.broadcast.remote(weights))
    assert final.version == 20 + broadcasts + 1 and len(final.acked) == receiver_count
    after = _snapshot(hub, receivers)

    # Only the latest version stays pinned, by the hub for late joiners. Borrowers
    # report released references to the owner asynchronously: allow them a moment.
    deadline = time.monotonic() + 30
    while _plasma_objects() > before["plasma_objects"] + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _plasma_objects() <= before["plasma_objects"] + 2, (before, _plasma_objects())
    assert after["dev_shm"] - before["dev_shm"] == set()
    # The hub asks Ray whether a receiver whose heartbeat is late is alive (many busy
    # receivers on 2 cores: some are, when broadcasts overlap): that opens Ray's one
    # channel to that receiver, made on first use and kept (seen: 3 to all 16, never
    # two to one receiver), and Ray's own processes may connect once more. Every other
    # fd returns to its baseline.
    hub_before, hub_after = before["hub"], after["hub"]
    assert hub_after["tcp"] <= hub_before["tcp"] + receiver_count + 2, (hub_before, hub_after)
    assert _other_fds(hub_after) <= _other_fds(hub_before) + 5, (hub_before, hub_after)
    assert hub_after["threads"] <= hub_before["threads"] + 2, (hub_before, hub_after)
    assert hub_after["rss_mb"] <= hub_before["rss_mb"] + 64, (hub_before, hub_after)
    for b, a in zip(before["receivers"], after["receivers"], strict=True):
        assert a["fds"] <= b["fds"] + 5 and a["threads"] <= b["threads"] + 2, (b, a)
        assert a["rss_mb"] <= b["rss_mb"] + 64, (b, a)


@pytest.mark.parametrize("transport", transport_params(heavy=True))
def test_soak_short(actors, transport):
    _soak(actors, transport, broadcasts=240, receiver_count=8)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 5000 broadcasts to 16 receivers: ~5-10 min on 2 cores
def test_soak_long(actors, transport):
    _soak(actors, transport, broadcasts=5000, receiver_count=16)
