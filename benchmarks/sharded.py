"""Sharded learners: one version sent in 1, 2 or 4 parts, each by its own learner actor.

For each (transport, size, parts) cell: ``parts`` learner actors each hold their slice
of a float32 model of 16 tensors per part (keys dealt round robin), and N receivers
(the mixin, one state_dict) hold the whole. One timed run is every learner's
``hub.broadcast.remote(slice, version=v, part=i, parts=k)`` from the moment the driver
tells them to go until every one has the version's report (every receiver applied
it); the whole model from one learner actor (``parts=1``) is the baseline, timed the
same way. Also recorded per cell: the bytes each learner handed to its transport (its
own slice: nothing funnels through one rank) and each learner's peak RSS.

``python benchmarks/sharded.py --out benchmarks/results/sharded.json`` (JSON + PNG);
with ``--bucket-mb 64`` each learner streams its part in buckets (``object_store``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import ray
import torch

from raysync import WeightHub, WeightReceiver, available_transports
from raysync.transports import get_transport

_TENSORS_PER_PART = 16
_MODEL = "m"


def _names(parts_max: int) -> list[str]:
    return [f"w{i:03d}" for i in range(_TENSORS_PER_PART * parts_max)]


def _state(
    size_mb: int, names: list[str], value: float, only: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The model of ``size_mb`` split evenly over ``names``: the tensors in ``only``."""
    per = size_mb * 2**20 // 4 // len(names)
    return {name: torch.full((per,), value) for name in (names if only is None else only)}


@ray.remote(num_cpus=0)
class _Receiver(WeightReceiver):
    def __init__(self, hub, size_mb: int, names: list[str]):
        self.weights = _state(size_mb, names, 0.0)
        self.connect_hub(hub, {_MODEL: "weights"})

    def probe(self) -> list[float]:
        return sorted({float(t[0]) for t in self.weights.values()})


@ray.remote(num_cpus=0)
class _Learner:
    """Holds its slice of the model and sends it when told."""

    def __init__(self, hub, size_mb: int, names: list[str], mine: list[str]):
        self.hub = hub
        self.slice = _state(size_mb, names, 0.0, only=mine)

    def send(self, version: int, part: int, parts: int) -> float:
        for tensor in self.slice.values():
            tensor[0] = version
        kw = {"part": part, "parts": parts} if parts > 1 else {}
        report = ray.get(self.hub.broadcast.remote(self.slice, model=_MODEL, version=version, **kw))
        return report.phases.learner_s

    def peak_rss_mb(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def release(self) -> None:
        self.hub.release()


def measure_cell(
    transport: str,
    size_mb: int,
    parts: int,
    receivers: int,
    warmup: int,
    repeats: int,
    bucket_mb: float | None = None,
) -> dict:
    names = _names(parts)
    hub = WeightHub.remote(transport=transport, models=[_MODEL], bucket_mb=bucket_mb)
    readers = [_Receiver.remote(hub, size_mb, names) for _ in range(receivers)]
    ray.get([r.__ray_ready__.remote() for r in readers])
    learners = [_Learner.remote(hub, size_mb, names, names[i::parts]) for i in range(parts)]
    ray.get([learner.__ray_ready__.remote() for learner in learners])
    samples, learner_s = [], []
    try:
        for version in range(1, warmup + repeats + 1):
            t0 = time.perf_counter()
            spent = ray.get([lr.send.remote(version, i, parts) for i, lr in enumerate(learners)])
            elapsed = time.perf_counter() - t0
            probes = ray.get([r.probe.remote() for r in readers])
            if any(p != [float(version)] for p in probes):
                raise RuntimeError(f"version {version} did not land whole: {probes}")
            if version > warmup:
                samples.append(elapsed)
                learner_s.append(max(spent))
        rss = ray.get([learner.peak_rss_mb.remote() for learner in learners])
        ray.get([learner.release.remote() for learner in learners])
    finally:
        for handle in [*readers, *learners]:
            ray.kill(handle)
        ray.get(hub.close.remote())
        ray.kill(hub.actor)
    return {
        "transport": transport,
        "size_mb": size_mb,
        "parts": parts,
        "bucket_mb": bucket_mb,
        "receivers": receivers,
        "seconds_p50": statistics.median(samples),
        "seconds": samples,
        "learner_s_p50": statistics.median(learner_s),
        "bytes_per_learner": size_mb * 2**20 // parts,
        "learner_peak_rss_mb": rss,
    }


def print_table(cells: list[dict]) -> None:
    print(
        "| transport | size | parts | broadcast p50, ms | vs 1 part | learner p50, ms "
        "| bytes per learner | learner peak RSS, MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    whole = {(c["transport"], c["size_mb"]): c["seconds_p50"] for c in cells if c["parts"] == 1}
    for c in cells:
        base = whole.get((c["transport"], c["size_mb"]))
        ratio = f"{c['seconds_p50'] / base:.2f}x" if base else "-"
        print(
            f"| {c['transport']} | {c['size_mb']} MB | {c['parts']} | "
            f"{c['seconds_p50'] * 1e3:.0f} | {ratio} | {c['learner_s_p50'] * 1e3:.0f} | "
            f"{c['bytes_per_learner'] / 2**20:.0f} MB | "
            f"{max(c['learner_peak_rss_mb']):.0f} |"
        )


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({c["size_mb"] for c in cells})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for transport in sorted({c["transport"] for c in cells}):
            row = sorted(
                (c for c in cells if c["size_mb"] == size and c["transport"] == transport),
                key=lambda c: c["parts"],
            )
            ax.plot(
                [c["parts"] for c in row],
                [c["seconds_p50"] * 1e3 for c in row],
                marker="o",
                label=transport,
            )
        ax.set_title(f"{size} MB, {cells[0]['receivers']} receivers")
        ax.set_xlabel("learner processes (parts)")
        ax.set_ylabel("broadcast p50, ms (until every part's report)")
        ax.set_xticks(sorted({c["parts"] for c in cells}))
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", nargs="+", default=["object_store", "shared_memory", "nixl"])
    p.add_argument("--sizes", nargs="+", type=int, default=[256, 1024], help="MB")
    p.add_argument("--parts", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--object-store-gb", type=float, default=8.0)
    p.add_argument(
        "--bucket-mb",
        type=float,
        help="the hub's bucket_mb (each learner streams its part in buckets of it); "
        "transports that move whole versions are skipped",
    )
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    ray.init(
        num_cpus=32,
        include_dashboard=False,
        object_store_memory=int(args.object_store_gb * 2**30),
        log_to_driver=False,
    )
    runnable = set(available_transports())
    cells = []
    try:
        for size in args.sizes:
            for transport in args.transports:
                if transport not in runnable:
                    print(f"skipping {transport}: not available here")
                    continue
                if args.bucket_mb is not None and not get_transport(transport).buckets:
                    print(f"skipping {transport}: it moves whole versions only")
                    continue
                for parts in args.parts:
                    cell = measure_cell(
                        transport,
                        size,
                        parts,
                        args.receivers,
                        args.warmup,
                        args.repeats,
                        args.bucket_mb,
                    )
                    cells.append(cell)
                    print(
                        f"{transport} {size} MB parts={parts}: {cell['seconds_p50'] * 1e3:.0f} ms",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    print_table(cells)
    if args.out is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "cells": cells}, indent=1))
    png = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if png is not None:
        plot(cells, png)


if __name__ == "__main__":
    main()
