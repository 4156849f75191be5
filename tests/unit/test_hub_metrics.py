"""The hub's Ray metrics (raysync/metrics.py), recorded without a cluster (Ray records
them in-process and exports nothing; tests/test_metrics.py reads them off the endpoint)."""

from __future__ import annotations

from types import SimpleNamespace

from raysync.messages import BroadcastReport, DeliveryMode, ReceiverStatus
from raysync.metrics import FailureCause, HubMetrics

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
