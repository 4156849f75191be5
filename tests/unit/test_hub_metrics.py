"""The hub's Ray metrics (raysync/metrics.py), recorded without a cluster (Ray records
them in-process and exports nothing; tests/test_metrics.py reads them off the endpoint)."""

from __future__ import annotations

from raysync.messages import BroadcastReport
from raysync.metrics import FailureCause, HubMetrics


def test_a_broadcast_of_no_bytes_is_recorded():
    """A model made of empty tensors moves 0 bytes: Ray's ``Counter.inc(0)`` raised, and
    the broadcast's lag gauges were never set."""
    metrics = HubMetrics("hub")
    report = BroadcastReport("m", 1, ("c",), {"d": "died"}, 0, 0.01, ("object_store",))
    metrics.broadcast(report, [FailureCause.DIED])
