"""The hub's metrics, exported through Ray's own metrics (``ray.util.metrics``).

Hub process only. Each broadcast's report is recorded after it is built (the learner's
ack future never waits for it): broadcasts and bytes by model and outcome, the
broadcast's seconds as a histogram, failed receivers by cause, and each receiver's lag
behind the latest version, in versions and in seconds (after a broadcast, only the lags
that changed, or were last set ``LAG_REFRESH_S`` ago, are set again; each heartbeat
sets its receiver's). They appear on Ray's metrics endpoint (Prometheus format, ``ray_``
prefixed) wherever Ray exports metrics: that needs Ray's dashboard agent, which
``ray[default]`` brings (``pip install raysync[metrics]``); with a plain ``ray``
install they are recorded and not exported.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping

from ray.util.metrics import Counter, Gauge, Histogram

from raysync.hub_state import Lag
from raysync.messages import BroadcastReport, ReceiverStatus

#: Histogram boundaries of a broadcast's seconds: 1 ms to 2 min.
_SECONDS_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 120]

#: Seconds after which a receiver's lag that did not change is set again after a
#: broadcast: each of Ray's exports (every 10 s by default) carries only the gauge values
#: set since the one before, and its metrics agent drops a series that two exports
#: left out.
LAG_REFRESH_S = 5.0


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
        #: (worker, model) -> the lag its gauges were last set to, and when
        #: (``time.monotonic()``)
        self._lags_set: dict[tuple[str, str], tuple[Lag, float]] = {}

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
        """Set each of ``receivers``' lag, per model it holds, changed or not (a
        heartbeat's: it keeps the series of a receiver between broadcasts)."""
        now = time.monotonic()
        for status in receivers:
            for model, versions in status.lag.items():
                self._set_lag(status.worker, model, Lag(versions, status.lag_s.get(model)), now)

    def changed_lags(self, lags: Mapping[tuple[str, str], Lag], now: float | None = None) -> None:
        """After a broadcast, with every registered receiver's lag per model it holds
        (:meth:`HubState.lags`): set those that changed since they were last set, or were
        last set ``LAG_REFRESH_S`` or more before ``now`` (``time.monotonic()`` by
        default), and forget those of the receivers that left. A receiver that stays up
        to date costs a look-up, not two gauge sets."""
        now = time.monotonic() if now is None else now
        for (worker, model), lag in lags.items():
            last = self._lags_set.get((worker, model))
            if last is None or last[0] != lag or now - last[1] >= LAG_REFRESH_S:
                self._set_lag(worker, model, lag, now)
        for gone in self._lags_set.keys() - lags.keys():
            del self._lags_set[gone]

    def _set_lag(self, worker: str, model: str, lag: Lag, now: float) -> None:
        """Set ``worker``'s lag gauges of ``model`` (its seconds only where known), and
        remember what and when."""
        tags = {**self._tags, "model": model, "worker": worker}
        self.lag_versions.set(lag.versions, tags)
        if lag.seconds is not None:
            self.lag_seconds.set(lag.seconds, tags)
        self._lags_set[(worker, model)] = (lag, now)
