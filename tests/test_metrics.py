"""The hub's Ray metrics, read where a user reads them: Ray's Prometheus endpoint."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable

import ray

from tests.helpers import ready, start, start_hub, wait_dead
from tests.receivers import Collector, make_policy

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
#: The labels raysync sets (Ray adds its own: node, worker, session, ...).
_OURS = ("model", "outcome", "cause", "worker", "le")


def _samples(url: str, hub_id: str) -> dict[tuple[str, frozenset], float]:
    """This hub's series on the endpoint: (name, labels without Ray's own) -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match["name"].startswith("ray_raysync_"):
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        if labels.get("hub") != hub_id:
            continue
        mine = frozenset(
            (k, v) for k, v in labels.items() if k in ("model", "outcome", "cause", "worker", "le")
        )
        out[(match["name"], mine)] = float(match["value"])
    return out


def _scrape_until(url: str, hub_id: str, done: Callable[[dict], bool], timeout_s: float = 90):
    """Scrape until ``done`` holds (Ray exports every ``metrics_report_interval_ms``, 10 s
    by default: a value may take two exports to show)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _samples(url, hub_id)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.25)


def _get(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_the_hubs_metrics_appear_on_rays_endpoint_and_move(actors, metrics_url):
    hub = start_hub(actors, "object_store")
    steady = start(actors, Collector, hub, worker_id="steady")
    victim = start(actors, Collector, hub, worker_id="victim")
    ready([steady, victim])
    reports = [ray.get(hub.broadcast.remote(make_policy())) for _ in range(3)]
    ray.kill(victim, no_restart=True)
    wait_dead(victim)  # else the next broadcast's call may still reach it
    failed = ray.get(hub.broadcast.remote(make_policy(), raise_on_failure=False))
    assert set(failed.failed) == {"victim"}
    hub_id = hub.config.hub_id

    def counted(s: dict) -> bool:
        # Counters and gauges reach Ray's agent in separate series: a gauge not refreshed
        # by an export within two intervals is evicted there until the next one, so wait
        # for an export that carries both.
        return (
            _get(s, "ray_raysync_broadcasts_total", model="policy", outcome="ok") == 3
            and _get(s, "ray_raysync_broadcasts_total", model="policy", outcome="failed") == 1
            and _get(s, "ray_raysync_receiver_lag_versions", model="policy", worker="steady")
            is not None
        )

    samples = _scrape_until(metrics_url, hub_id, counted)
    assert counted(samples), sorted(samples)
    assert _get(samples, "ray_raysync_broadcast_bytes_total", model="policy") == sum(
        r.bytes for r in [*reports, failed]
    )
    assert _get(samples, "ray_raysync_receiver_failures_total", model="policy", cause="died") == 1
    assert _get(samples, "ray_raysync_broadcast_seconds_count", model="policy") == 4
    assert _get(samples, "ray_raysync_receiver_lag_versions", model="policy", worker="steady") == 0
    assert _get(samples, "ray_raysync_receiver_lag_seconds", model="policy", worker="steady") == 0


def test_a_receiver_behind_shows_its_lag_growing_between_broadcasts(actors, metrics_url):
    """Lag gauges were set only when a broadcast ended: a receiver left behind showed
    the lag of that moment until the next broadcast (and Ray's agent drops a gauge that
    no export refreshed). Its heartbeats set them now."""
    hub = start_hub(actors, "object_store")
    behind = start(actors, Collector, hub, worker_id="behind", mode="pull", heartbeat_s=0.5)
    ready([behind])
    ray.get(hub.broadcast.remote(make_policy()))  # it never pulls: one version behind
    hub_id = hub.config.hub_id

    def lag_s(samples: dict) -> float | None:
        return _get(samples, "ray_raysync_receiver_lag_seconds", model="policy", worker="behind")

    def lag_versions(samples: dict) -> float | None:
        return _get(samples, "ray_raysync_receiver_lag_versions", model="policy", worker="behind")

    # Each gauge reaches Ray's agent in its own series, evicted when no export refreshed
    # it: one scrape may carry one and not the other, so wait for a scrape with both.
    first = _scrape_until(
        metrics_url, hub_id, lambda s: lag_s(s) is not None and lag_versions(s) is not None
    )
    assert lag_versions(first) == 1, sorted(first)
    later = _scrape_until(metrics_url, hub_id, lambda s: (lag_s(s) or 0.0) > lag_s(first))
    assert (lag_s(later) or 0.0) > lag_s(first), (lag_s(first), lag_s(later))  # None: dropped
