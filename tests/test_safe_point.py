"""Torn-weight probes: user code never sees a model that mixes two versions."""

from __future__ import annotations

import ray

from tests.helpers import ready, start, start_hub
from tests.receivers import AsyncProbe, ThreadedProbe, filled, make_probe_model

_TEMPLATE = make_probe_model()


def _probe_while_broadcasting(
    actors, transport, probe_cls, safe_points: bool, broadcasts: int = 12
):
    hub = start_hub(actors, transport)
    probe = start(actors, probe_cls, hub)
    ready([probe])
    ray.get(hub.broadcast.remote(filled(_TEMPLATE, 1.0)))
    result_ref = probe.probe.remote(4.0, safe_points)
    acks = [
        hub.broadcast.remote(filled(_TEMPLATE, float(v)), wait=False)
        for v in range(2, broadcasts + 2)
    ]
    tickets = ray.get(acks)
    result = ray.get(result_ref)
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    assert all(r.failed == {} for r in reports)
    return result


def test_threaded_actor_with_safe_points_sees_updates_never_torn(actors, transport):
    result = _probe_while_broadcasting(actors, transport, ThreadedProbe, safe_points=True)
    assert result["reads"] > 10
    assert result["torn"] == 0
    # Updates really landed while the probe ran: it saw several versions.
    assert len(result["seen"]) > 1, result


def test_threaded_actor_without_safe_points_holds_one_version(actors, transport):
    result = _probe_while_broadcasting(actors, transport, ThreadedProbe, safe_points=False)
    assert result["torn"] == 0
    assert result["seen"] == [1.0], result


def test_async_actor_with_safe_points_sees_updates_never_torn(actors, transport):
    result = _probe_while_broadcasting(actors, transport, AsyncProbe, safe_points=True)
    assert result["reads"] > 10
    assert result["torn"] == 0
    assert len(result["seen"]) > 1, result


def test_async_actor_defers_updates_until_the_method_returns(actors, transport):
    result = _probe_while_broadcasting(actors, transport, AsyncProbe, safe_points=False)
    assert result["torn"] == 0
    assert result["seen"] == [1.0], result


def test_busy_async_actor_skips_to_the_newest_version(actors, transport):
    hub = start_hub(actors, transport)
    probe = start(actors, AsyncProbe, hub)
    ready([probe])
    ray.get(hub.broadcast.remote(filled(_TEMPLATE, 1.0)))
    busy = probe.probe.remote(4.0, False)
    tickets = ray.get(
        [hub.broadcast.remote(filled(_TEMPLATE, float(v)), wait=False) for v in range(2, 8)]
    )
    assert ray.get(busy)["seen"] == [1.0]
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    # Every version is acknowledged (the skipped ones as superseded by a newer one) ...
    assert all(r.failed == {} and len(r.acked) == 1 for r in reports)
    # ... but versions that queued up behind the busy method were never applied: only
    # the newest of them was, so the actor held one waiting version, not six.
    applied = ray.get(probe.applied_versions.remote())
    assert applied[0] == 1 and applied[-1] == 7 and applied == sorted(applied)
    assert len(applied) < 7, applied
    assert ray.get(probe.first_value.remote()) == 7.0
