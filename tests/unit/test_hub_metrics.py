"""The hub's Ray metrics (raysync/metrics.py), recorded without a cluster (Ray records
them in-process and exports nothing; tests/test_metrics.py reads them off the endpoint).

After a broadcast the hub sets only the lags that changed (or were last set
``LAG_REFRESH_S`` ago): at 1000 receivers, setting every one's two gauges took ~5 ms of
its event loop per broadcast."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from raysync import hub_state
from raysync import metrics as hub_metrics
from raysync.actors.hub import WeightHubActor
from raysync.hub_state import HubState
from raysync.messages import BroadcastReport, DeliveryMode, Entry, ReceiverStatus, Registration
from raysync.metrics import FailureCause, HubMetrics
from raysync.spec import WeightSpec

POLICY = WeightSpec.of({"w": torch.zeros(2)})

_METRICS = ("broadcasts", "bytes", "failures", "seconds", "lag_versions", "lag_seconds")


def _recording(metrics: HubMetrics) -> list[tuple[str, str, float, dict[str, str]]]:
    """Swap each of ``metrics``' Ray metrics for one that records its calls, as
    ``(metric, method, value, tags)``: what a broadcast records is then read back here,
    where Ray's own metrics keep it out of reach."""
    calls: list[tuple[str, str, float, dict[str, str]]] = []

    def recorder(metric: str, method: str):
        return lambda value, tags: calls.append((metric, method, value, tags))

    for metric in _METRICS:
        methods = {m: recorder(metric, m) for m in ("inc", "observe", "set")}
        setattr(metrics, metric, SimpleNamespace(**methods))
    return calls


def _report(nbytes: int, failed: dict[str, str]) -> BroadcastReport:
    """Version 1 of model "m", acked by "c", in 0.01 s."""
    return BroadcastReport("m", 1, ("c",), failed, nbytes, 0.01, ("object_store",))


def test_a_failed_broadcast_of_no_bytes_records_its_outcome_time_and_cause():
    """A model made of empty tensors moves 0 bytes: no bytes are counted (Ray's
    ``Counter.inc(0)`` raises), the rest is recorded as for any broadcast."""
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    metrics.broadcast(_report(0, {"d": "died"}), [FailureCause.DIED])
    tags = {"hub": "hub", "model": "m"}
    assert calls == [
        ("broadcasts", "inc", 1, {**tags, "outcome": "failed"}),
        ("seconds", "observe", 0.01, tags),
        ("failures", "inc", 1, {**tags, "cause": "died"}),
    ]


def test_a_broadcast_of_no_bytes_does_not_raise_in_rays_metrics():
    """With Ray's own metrics: ``Counter.inc(0)`` raises ValueError, so a broadcast of 0
    bytes that counted them would raise here."""
    HubMetrics("hub").broadcast(_report(0, {"d": "died"}), [FailureCause.DIED])


def test_a_broadcast_that_moved_bytes_counts_them():
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    metrics.broadcast(_report(4096, {}), [])
    tags = {"hub": "hub", "model": "m"}
    assert calls == [
        ("broadcasts", "inc", 1, {**tags, "outcome": "ok"}),
        ("bytes", "inc", 4096, tags),
        ("seconds", "observe", 0.01, tags),
    ]


def test_each_receivers_lag_is_set_per_model_it_holds():
    """Versions behind for every model; seconds only where the hub knows them (a model
    missing from ``lag_s`` lacks a version published before the hub restarted)."""
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    status = ReceiverStatus(
        worker="w1",
        actor="a1",
        mode=DeliveryMode.PUSH,
        versions={"m": 3, "n": 5},
        lag={"m": 2, "n": 1},
        transport="object_store",
        lag_s={"m": 1.5},
    )
    current = ReceiverStatus("w2", "a2", DeliveryMode.PULL, {"m": 5}, {"m": 0}, "rpc", {"m": 0.0})
    metrics.lags([status, current])
    assert calls == [
        ("lag_versions", "set", 2, {"hub": "hub", "model": "m", "worker": "w1"}),
        ("lag_seconds", "set", 1.5, {"hub": "hub", "model": "m", "worker": "w1"}),
        ("lag_versions", "set", 1, {"hub": "hub", "model": "n", "worker": "w1"}),
        ("lag_versions", "set", 0, {"hub": "hub", "model": "m", "worker": "w2"}),
        ("lag_seconds", "set", 0.0, {"hub": "hub", "model": "m", "worker": "w2"}),
    ]


# -- lags after a broadcast ---------------------------------------------------------------


def _registration(worker: str) -> Registration:
    return Registration(
        worker=worker,
        handle=None,
        attachment=f"{worker}-attachment",
        entry=Entry.RAY_CALL,
        actor=f"Collector({worker})",
        node_id="node-a",
        process=f"process-{worker}",
        specs={"policy": POLICY},
        versions={},
        mode=DeliveryMode.PUSH,
        token=f"{worker}-token",
        transport="object_store",
    )


def _hub(*workers: str) -> SimpleNamespace:
    """A hub's state with ``workers`` registered, and its metrics: what ``_record`` uses."""
    state = HubState()
    for worker in workers:
        state.register(_registration(worker))
    return SimpleNamespace(_state=state, _metrics=HubMetrics("hub"))


def _broadcast(hub: SimpleNamespace, *acked: str) -> list[tuple[str, str, float, dict]]:
    """Publish the next version of "policy", acked by ``acked``; the lag gauges that
    ``_record`` sets after it, as ``(metric, value, worker)``."""
    version = hub._state.publish("policy", POLICY, {"object_store": "payload"}).version
    for worker in acked:
        hub._state.record(worker, "policy", version)
    report = BroadcastReport("policy", version, acked, {}, 8, 0.01, ("object_store",))
    calls = _recording(hub._metrics)
    WeightHubActor._record(hub, report, [])
    return [(m, value, tags["worker"]) for m, _, value, tags in calls if m.startswith("lag")]


def test_a_receiver_that_stays_up_to_date_has_its_lag_set_once():
    """Every receiver's two gauges were set after every broadcast (with a status built
    for each): 1000 receivers up to date cost the hub's event loop ~5 ms a broadcast."""
    hub = _hub("current", "behind")
    first = _broadcast(hub, "current")
    assert ("lag_versions", 0, "current") in first and ("lag_seconds", 0.0, "current") in first
    assert [(m, w) for m, _, w in _broadcast(hub, "current")] == [
        ("lag_versions", "behind"),
        ("lag_seconds", "behind"),
    ]


def test_the_lag_of_a_receiver_behind_moves_at_each_broadcast():
    hub = _hub("behind")
    first = {m: value for m, value, _ in _broadcast(hub)}
    second = {m: value for m, value, _ in _broadcast(hub)}
    assert (first["lag_versions"], second["lag_versions"]) == (1, 2)
    assert second["lag_seconds"] >= first["lag_seconds"] >= 0.0


def test_a_receiver_that_catches_up_has_its_lag_set_to_zero():
    hub = _hub("late")
    _broadcast(hub)
    assert _broadcast(hub, "late") == [("lag_versions", 0, "late"), ("lag_seconds", 0.0, "late")]


def test_an_unchanged_lag_is_set_again_once_it_was_set_lag_refresh_s_ago():
    """Each of Ray's exports carries only the gauge values set since the one before,
    and its agent drops a series two exports left out: a receiver up to date, with no
    heartbeat, must not vanish from the endpoint while broadcasts go on."""
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    lags = {("w", "policy"): hub_state.Lag(0, 0.0)}
    refresh_s = hub_metrics.LAG_REFRESH_S
    for now in (100.0, 100.0 + refresh_s / 2, 100.0 + refresh_s, 100.0 + refresh_s * 1.5):
        metrics.changed_lags(lags, now=now)
    tags = {"hub": "hub", "model": "policy", "worker": "w"}
    assert calls == [("lag_versions", "set", 0, tags), ("lag_seconds", "set", 0.0, tags)] * 2


def test_a_lag_a_heartbeat_set_counts_as_set_after_the_next_broadcast():
    """Behind by 1 after a broadcast, up to date at a heartbeat (the gauge shows 0),
    behind by 1 again after the next broadcast, with no known seconds (published before
    the hub restarted): the gauge must go back to 1."""
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    behind = {("w", "policy"): hub_state.Lag(1, None)}
    metrics.changed_lags(behind, now=0.0)
    metrics.lags([ReceiverStatus("w", "a", DeliveryMode.PULL, {"policy": 4}, {"policy": 0}, "rpc")])
    metrics.changed_lags(behind, now=0.0)
    assert [(m, value) for m, _, value, _ in calls] == [
        ("lag_versions", 1),
        ("lag_versions", 0),
        ("lag_versions", 1),
    ]


def test_a_receiver_that_left_and_came_back_has_its_lag_set_again():
    """The lags of receivers gone are forgotten (not kept for the hub's life): one that
    registers again under the same worker id is set as new."""
    metrics = HubMetrics("hub")
    calls = _recording(metrics)
    current = {("w", "policy"): hub_state.Lag(0, 0.0)}
    metrics.changed_lags(current, now=0.0)
    metrics.changed_lags({}, now=0.0)  # it left
    metrics.changed_lags(current, now=0.0)
    assert [(m, value) for m, _, value, _ in calls] == [
        ("lag_versions", 0),
        ("lag_seconds", 0.0),
        ("lag_versions", 0),
        ("lag_seconds", 0.0),
    ]
