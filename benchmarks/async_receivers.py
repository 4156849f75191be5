"""Sync against async mixin receivers: a broadcast's time, and how long the receiver's
own calls wait while a version is read.

An async mixin class (one with coroutine methods) reads each version on raysync's
reading threads and applies it on its event loop (raysync/host_loop.py); a sync one reads
and applies on the thread Ray runs its methods on. Per cell (size, N receivers, kind):
broadcasts of 16 float32 tensors to N receivers on ``object_store``, each checked in every
receiver, p50 / p99 of the timed ones; then, with one receiver, a pinger actor calls the
receiver's cheapest method over and over while one version of ``--ping-size`` MB is
broadcast (by each of ``--ping-transports``), and the slowest of those calls is recorded.

    .venv/bin/python benchmarks/async_receivers.py --out benchmarks/results/async_receivers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch
from broadcast_bench.environment import recorded_environment

from raysync import WeightHub, WeightReceiver

TENSORS = 16


class _Model:
    def __init__(self, numel: int) -> None:
        self.model = {f"w{i}": torch.zeros(numel) for i in range(TENSORS)}

    def _first(self) -> float:
        return float(self.model["w0"][0])


@ray.remote(num_cpus=0)
class SyncReceiver(WeightReceiver, _Model):
    def __init__(self, hub, numel: int) -> None:
        _Model.__init__(self, numel)
        self.connect_hub(hub, models={"m": "model"})

    def first(self) -> float:
        return self._first()


@ray.remote(num_cpus=0)
class AsyncReceiver(WeightReceiver, _Model):
    def __init__(self, hub, numel: int) -> None:
        _Model.__init__(self, numel)
        self.connect_hub(hub, models={"m": "model"})

    async def first(self) -> float:
        return self._first()


@ray.remote(num_cpus=0)
class Pinger:
    """Calls ``receiver.first`` back to back until stopped; the slowest call, seconds."""

    def __init__(self) -> None:
        self.stopped = False
        self.calls = 0

    def ping(self, receiver) -> float:
        slowest = 0.0
        while not self.stopped:
            started = time.perf_counter()
            ray.get(receiver.first.remote())
            slowest = max(slowest, time.perf_counter() - started)
            self.calls += 1
        return slowest

    def answered(self) -> int:
        return self.calls

    def stop(self) -> None:
        self.stopped = True


_KINDS = {"sync": SyncReceiver, "async": AsyncReceiver}


def _weights(numel: int, value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((numel,), value) for i in range(TENSORS)}


def latency_cell(kind: str, size_mb: float, n: int, warmup: int, repeats: int) -> dict:
    numel = int(size_mb * 2**20 / 4 / TENSORS)
    hub = WeightHub.remote(transport="object_store", models=["m"])
    receivers = [_KINDS[kind].remote(hub, numel) for _ in range(n)]
    ray.get([r.__ray_ready__.remote() for r in receivers])
    times = []
    for k in range(warmup + repeats):
        started = time.perf_counter()
        report = ray.get(hub.broadcast.remote(_weights(numel, float(k + 1)), model="m"))
        elapsed = time.perf_counter() - started
        assert len(report.acked) == n and not report.failed, report
        if k >= warmup:
            times.append(elapsed * 1e3)
    seen = ray.get([r.first.remote() for r in receivers])
    assert seen == [float(warmup + repeats)] * n, seen
    for receiver in receivers:
        ray.kill(receiver)
    hub.release()
    ray.kill(hub.actor)
    times.sort()
    return {
        "kind": kind,
        "size_mb": size_mb,
        "receivers": n,
        "p50_ms": statistics.median(times),
        "p99_ms": times[max(0, round(0.99 * len(times)) - 1)],
    }


def ping_cell(kind: str, size_mb: float, transport: str) -> dict:
    """The slowest of the receiver's own calls while one version is broadcast."""
    numel = int(size_mb * 2**20 / 4 / TENSORS)
    hub = WeightHub.remote(transport=transport, models=["m"])
    receiver = _KINDS[kind].remote(hub, numel)
    pinger = Pinger.options(max_concurrency=2).remote()
    ray.get([receiver.__ray_ready__.remote(), pinger.__ray_ready__.remote()])
    ray.get(hub.broadcast.remote(_weights(numel, 1.0), model="m"))  # pages touched
    pinging = pinger.ping.remote(receiver)
    while not ray.get(pinger.answered.remote()):  # it calls before the version is sent
        time.sleep(0.01)
    started = time.perf_counter()
    report = ray.get(hub.broadcast.remote(_weights(numel, 2.0), model="m"))
    broadcast_s = time.perf_counter() - started
    ray.get(pinger.stop.remote())
    slowest = ray.get(pinging)
    assert report.acked and not report.failed, report
    assert ray.get(receiver.first.remote()) == 2.0
    for actor in (receiver, pinger, hub.actor):
        ray.kill(actor)
    return {
        "kind": kind,
        "size_mb": size_mb,
        "transport": transport,
        "broadcast_ms": broadcast_s * 1e3,
        "slowest_call_ms": slowest * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.0, 64.0], help="MB")
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--ping-size", type=float, default=256.0, help="MB")
    parser.add_argument("--ping-transports", nargs="+", default=["object_store", "rpc"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ray.init(num_cpus=16, include_dashboard=False)
    try:
        latency, pings = [], []
        for size in args.sizes:
            for n in args.receivers:
                for kind in _KINDS:  # interleaved, cell by cell
                    row = latency_cell(kind, size, n, args.warmup, args.repeats)
                    print(
                        f"{size:g} MB, N={n}, {kind}: p50 {row['p50_ms']:.1f} ms, "
                        f"p99 {row['p99_ms']:.1f} ms"
                    )
                    latency.append(row)
        for transport in args.ping_transports:
            for kind in _KINDS:
                row = ping_cell(kind, args.ping_size, transport)
                print(
                    f"{args.ping_size:g} MB by {transport} to one {kind} receiver: "
                    f"{row['broadcast_ms']:.0f} ms; its slowest own call meanwhile "
                    f"{row['slowest_call_ms']:.1f} ms"
                )
                pings.append(row)
    finally:
        ray.shutdown()
    if args.out:
        result = {"latency": latency, "pings": pings, "env": recorded_environment()}
        args.out.write_text(json.dumps(result, indent=1))
        _plot(latency, pings, args.out.with_suffix(".png"))


def _plot(latency: list[dict], pings: list[dict], path: Path) -> None:
    """Left: p50 per cell, sync and async side by side; right: the slowest call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2, 1.3]})
    cells = sorted({(r["size_mb"], r["receivers"]) for r in latency})
    for offset, kind in ((-0.2, "sync"), (0.2, "async")):
        p50 = {(r["size_mb"], r["receivers"]): r["p50_ms"] for r in latency if r["kind"] == kind}
        values = [p50[c] for c in cells]
        axes[0].bar([i + offset for i in range(len(cells))], values, width=0.4, label=kind)
    axes[0].set_xticks(range(len(cells)), [f"{s:g} MB, N={n}" for s, n in cells], fontsize=8)
    axes[0].set_ylabel("broadcast p50, ms")
    axes[0].legend()
    labels = [f"{r['transport']}\n{r['kind']}" for r in pings]
    axes[1].bar(range(len(pings)), [r["slowest_call_ms"] for r in pings])
    axes[1].set_xticks(range(len(pings)), labels, fontsize=7)
    axes[1].set_title(
        f"receiver's slowest own call\nduring a {pings[0]['size_mb']:g} MB broadcast, ms",
        fontsize=8,
    )
    fig.suptitle("Sync against async mixin receivers (16 tensors; left: object_store)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
