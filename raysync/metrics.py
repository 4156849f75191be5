"""The hub's metrics, exported through Ray's own metrics (``ray.util.metrics``).

Hub process only. Each broadcast's report is recorded after it is built (the learner's
ack future never waits for it): broadcasts and bytes by model and outcome, the
broadcast's seconds as a histogram, failed receivers by cause, and each receiver's lag
behind the latest version, in versions and in seconds. They appear on Ray's metrics
endpoint (Prometheus format, ``ray_`` prefixed) wherever Ray exports metrics: that
needs Ray's dashboard agent, which ``ray[default]`` brings (``pip install
raysync[metrics]``); with a plain ``ray`` install they are recorded and not exported.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from ray.util.metrics import Counter, Gauge, Histogram

from raysync.messages import BroadcastReport, ReceiverStatus

#: Histogram boundaries of a broadcast's seconds: 1 ms to 2 min.
_SECONDS_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 120]


class FailureCause(enum.Enum):
    """Why a receiver did not apply a version, in one word: the ``cause`` tag."""

    DIED = "died"  #: its process died (Ray restarted it, or not)
    TIMEOUT = "timeout"  #: no ack within the broadcast's timeout
    RAISED = "raised"  #: the delivery call raised (not a death)
    APPLY_FAILED = "apply_failed"  #: it answered FAILED: fetch or apply raised there
    NOT_PLANNED = "not_planned"  #: its transport could not plan the delivery
    LEFT = "left"  #: it closed its receiver or left the hub


class HubMetrics:
    """The hub's counters, histogram and gauges; ``hub`` (its id) tags every series."""

    def __init__(self, hub_id: str) -> None:
        self._tags = {"hub": hub_id}
        self.broadcasts = Counter(
            "raysync_broadcasts_total",
            "Broadcasts whose report was built, by model and outcome (ok, failed).",
            tag_keys=("hub", "model", "outcome"),
        )
        self.bytes = Counter(
            "raysync_broadcast_bytes_total",
            "Bytes of each broadcast's version as it travelled (after any wire dtype).",
            tag_keys=("hub", "model"),
        )
        self.failures = Counter(
            "raysync_receiver_failures_total",
            "Receivers that did not apply a version, by cause.",
            tag_keys=("hub", "model", "cause"),
        )
        self.seconds = Histogram(
            "raysync_broadcast_seconds",
            "Seconds from the learner's broadcast call to the last ack.",
            boundaries=_SECONDS_BOUNDARIES,
            tag_keys=("hub", "model"),
        )
        self.lag_versions = Gauge(
            "raysync_receiver_lag_versions",
            "Versions a receiver is behind the latest one of a model.",
            tag_keys=("hub", "model", "worker"),
        )
        self.lag_seconds = Gauge(
            "raysync_receiver_lag_seconds",
            "Seconds since the first version a receiver lacks was published (0: current).",
            tag_keys=("hub", "model", "worker"),
        )

    def broadcast(self, report: BroadcastReport, causes: Iterable[FailureCause]) -> None:
        """Record one broadcast's report; ``causes``: one per failed receiver."""
        tags = {**self._tags, "model": report.model}
        self.broadcasts.inc(1, {**tags, "outcome": "failed" if report.failed else "ok"})
        if report.bytes:  # a model of empty tensors moves none (Ray's inc refuses 0)
            self.bytes.inc(report.bytes, tags)
        self.seconds.observe(report.seconds, tags)
        for cause in causes:
            self.failures.inc(1, {**tags, "cause": cause.value})

    def lags(self, receivers: Iterable[ReceiverStatus]) -> None:
        """Set every receiver's lag, per model it holds."""
        for status in receivers:
            for model, lag in status.lag.items():
                tags = {**self._tags, "model": model, "worker": status.worker}
                self.lag_versions.set(lag, tags)
                if model in status.lag_s:
                    self.lag_seconds.set(status.lag_s[model], tags)
