"""Torn-weight probes: user code never sees a model that mixes two versions."""

from __future__ import annotations

import ray

from tests.receivers import AsyncProbe, ThreadedProbe, filled, make_probe_model
from tests.test_core import ready, start, start_hub

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
