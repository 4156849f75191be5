#!/usr/bin/env python
"""Control-plane scaling: broadcast latency of a small model vs the number of receivers.

With a small model the data path is negligible, so the latency measures what grows
with N: the hub's per-receiver delivery call, the ack, and Ray's scheduling. Receivers
are ``num_cpus=0`` actors, started in batches; each row is the median of
``--repeats`` broadcasts once all N receivers are registered. Each row also records the
receivers' memory (PSS, which counts shared library pages once, summed over their
processes) and the machine's available memory; the run stops adding receivers below
``--min-free-gb``. Also records the pickled size of an ``Update`` control message (it
carries the spec's digest, not the spec) for 16 and 1000 tensors, which is what the
hub sends each receiver per broadcast.

Writes ``benchmarks/results/scale.json`` and ``scale.png``.

    .venv/bin/python benchmarks/scale.py                       # N = 1 4 16 32 64
    .venv/bin/python benchmarks/scale.py --receivers 1 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path

import ray
import torch
from broadcast_bench.machine import mem_available

from raysync import WeightHub, WeightReceiver, WeightSpec
from raysync.messages import Update

RESULTS = Path(__file__).parent / "results"


@ray.remote(num_cpus=0)
class SmallReceiver(WeightReceiver):
    def __init__(self, hub, name: str) -> None:
        torch.set_num_threads(1)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        self.connect_hub(hub, {"m": "model"}, worker_id=name)


def update_message_bytes(n_tensors: int) -> int:
    spec = WeightSpec.of({f"layers.{i}.weight": torch.zeros(64, 64) for i in range(n_tensors)})
    return len(pickle.dumps(Update("m", 1, spec.digest, "object_store", None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--min-free-gb", type=float, default=2.0)
    args = parser.parse_args()

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    rows = []
    try:
        hub = WeightHub.remote()
        learner = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        receivers: list = []
        for n in sorted(args.receivers):
            if _available_gb() < args.min_free_gb:
                print(f"stopping before N={n}: under {args.min_free_gb} GB available")
                break
            while len(receivers) < n:
                batch = min(8, n - len(receivers))
                new = [SmallReceiver.remote(hub, f"r{len(receivers) + i}") for i in range(batch)]
                ray.get([r.__ray_ready__.remote() for r in new])
                receivers += new
            ray.get(hub.broadcast.remote(learner))  # warm-up
            samples, hub_seconds = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                report = ray.get(hub.broadcast.remote(learner))
                samples.append(time.perf_counter() - start)
                hub_seconds.append(report.seconds)
                if len(report.acked) != n:
                    raise RuntimeError(f"only {len(report.acked)} of {n} receivers acked")
            row = {
                "receivers": n,
                "seconds_median": statistics.median(samples),
                "seconds_p90": sorted(samples)[int(0.9 * (len(samples) - 1))],
                "report_seconds_median": statistics.median(hub_seconds),
                "receivers_pss_gb": _pss_gb(receivers),
                "machine_available_gb": _available_gb(),
                "samples": samples,
            }
            rows.append(row)
            print(
                f"N={n:>4}  median {row['seconds_median'] * 1e3:7.1f} ms  "
                f"p90 {row['seconds_p90'] * 1e3:7.1f} ms  "
                f"per receiver {row['seconds_median'] / n * 1e3:6.2f} ms  "
                f"receivers' PSS {row['receivers_pss_gb']:.1f} GB, "
                f"{row['machine_available_gb']:.1f} GB left"
            )
    finally:
        ray.shutdown()

    messages = {n: update_message_bytes(n) for n in (16, 1000)}
    print(f"Update message bytes (pickled, spec digest): {messages}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "update_message_bytes": messages}, indent=2) + "\n"
    )
    _plot(rows, args.out.with_suffix(".png"))


def _pss_kb(self) -> int:
    """Runs in a receiver through ``__ray_call__``: its own proportional set size."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def _pss_gb(receivers: list) -> float:
    return sum(ray.get([r.__ray_call__.remote(_pss_kb) for r in receivers])) / 2**20


def _available_gb() -> float:
    return mem_available() / 2**30


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["receivers"] for r in rows]
    ax.plot(ns, [r["seconds_median"] * 1e3 for r in rows], marker="o", label="median")
    ax.plot(ns, [r["seconds_p90"] * 1e3 for r in rows], marker="x", label="p90")
    ax.set_xlabel("receivers")
    ax.set_ylabel("broadcast latency, small model (ms)")
    ax.set_title("raysync control plane: latency vs receivers (object_store)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
