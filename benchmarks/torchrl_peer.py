"""TorchRL's own Ray weight-sync scheme against raysync's, through TorchRL's RayCollector.

Runs in the TorchRL environment (``make test-torchrl`` builds ``.venv-torchrl``):
``.venv-torchrl/bin/python benchmarks/torchrl_peer.py --out benchmarks/results/torchrl_peer.json``.

For each (model size, N remote collectors) cell and each scheme — TorchRL 0.14's
``RayWeightSyncScheme`` (gloo broadcast through ``torch.distributed``) and
``raysync.torchrl.RaySyncScheme`` (default transport) — a ``RayCollector(sync=True)``
of N ``CountingEnv`` collectors is built around a policy whose action is its one
weight, plus a ballast parameter making up the size. The time is
``collector.update_policy_weights_()`` as a TorchRL user calls it (median of
``--repeats`` after ``--warmup``), schemes interleaved cell by cell. After each timed
update one batch is collected and must show the new weight in every collector's
actions: a scheme whose update returns before the collectors hold it fails the cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.collectors.distributed import RayCollector
from torchrl.testing.mocking_classes import CountingEnv
from torchrl.weight_update import RayWeightSyncScheme

from raysync.torchrl import RaySyncScheme

FRAMES = 4  # per collector and batch: the batch only checks the weights


class BallastPolicy(TensorDictModuleBase):
    """Acts with its one weight; ``ballast`` makes the policy ``size_mb`` in all."""

    def __init__(self, size_mb: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.0))
        self.ballast = nn.Parameter(torch.zeros(max(1, int(size_mb * 2**20 / 4))))
        self.in_keys = []
        self.out_keys = ["action"]

    def forward(self, tensordict):
        tensordict.set("action", self.weight.expand(tensordict.shape).clone())
        return tensordict


def time_scheme(name: str, size_mb: float, n: int, warmup: int, repeats: int) -> list[float]:
    """Seconds per ``update_policy_weights_()`` of one scheme in one cell."""
    scheme = RayWeightSyncScheme() if name == "torchrl_ray" else RaySyncScheme()
    policy = BallastPolicy(size_mb)
    collector = RayCollector(
        [CountingEnv] * n,
        policy=policy,
        frames_per_batch=FRAMES * n,
        total_frames=10**9,
        sync=True,
        remote_configs={"num_cpus": 0},
        weight_sync_schemes={"policy": scheme},
    )
    batches = iter(collector)
    samples = []
    try:
        next(batches)
        for i in range(warmup + repeats):
            value = float(i + 2)
            with torch.no_grad():
                policy.weight.fill_(value)
                policy.ballast.fill_(value)
            started = time.perf_counter()
            collector.update_policy_weights_()
            elapsed = time.perf_counter() - started
            seen = set(next(batches)["action"].float().flatten().tolist())
            if seen != {value}:
                raise RuntimeError(f"{name}: after update {i} the batch acted with {seen}")
            if i >= warmup:
                samples.append(elapsed)
    finally:
        collector.shutdown()
    return samples


def plot(cells: list[dict], path: Path) -> None:
    """Milliseconds per update, a bar pair per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['size_mb']:g} MB N={c['collectors']}" for c in cells]
    x = range(len(cells))
    figure, axes = plt.subplots(figsize=(8, 4))
    for offset, (key, name) in zip(
        (-0.2, 0.2), (("torchrl_ray", "TorchRL Ray scheme"), ("raysync", "raysync")), strict=True
    ):
        axes.bar([i + offset for i in x], [c[key]["p50_ms"] for c in cells], 0.4, label=name)
    axes.set_xticks(list(x), labels)
    axes.set_ylabel("ms per update_policy_weights_() (p50)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.0, 8.0, 64.0], help="MB")
    parser.add_argument("--collectors", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out's)")
    args = parser.parse_args()
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)
    cells = []
    try:
        for size in args.sizes:
            for n in args.collectors:
                cell = {"size_mb": size, "collectors": n}
                for name in ("torchrl_ray", "raysync"):
                    samples = time_scheme(name, size, n, args.warmup, args.repeats)
                    cell[name] = {"p50_ms": statistics.median(samples) * 1e3, "all_s": samples}
                cells.append(cell)
                theirs, ours = cell["torchrl_ray"]["p50_ms"], cell["raysync"]["p50_ms"]
                print(
                    f"{size:g} MB, N={n}: TorchRL's Ray scheme {theirs:.1f} ms, "
                    f"raysync {ours:.1f} ms",
                    flush=True,
                )
    finally:
        ray.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps({"cells": cells}, indent=1))
    png = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if png is not None:
        plot(cells, png)


if __name__ == "__main__":
    main()
