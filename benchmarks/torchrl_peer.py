"""TorchRL's own Ray weight-sync scheme against raysync's, through TorchRL's RayCollector.

Runs in the TorchRL environment (``make test-torchrl`` builds ``.venv-torchrl``):
``.venv-torchrl/bin/python benchmarks/torchrl_peer.py --out benchmarks/results/torchrl_peer.json``.

For each (model size, N remote collectors) cell and each scheme — TorchRL 0.14's
``RayWeightSyncScheme`` (gloo broadcast through ``torch.distributed``) and
``raysync.torchrl.RaySyncScheme`` (default transport) — a ``RayCollector(sync=True)``
of N ``CountingEnv`` collectors is built around a policy whose action is its one
weight, plus a ballast parameter making up the size. The time is
``collector.update_policy_weights_()`` as a TorchRL user calls it (median of
``--repeats`` after ``--warmup`` untimed updates that last ``--warmup-s`` at least: Ray
deletes unused objects once a second, and until then a learner's puts land on pages it
never touched), schemes interleaved cell by cell, each cell starting one series further
along than the one before (its ``order`` in the JSON). After each timed
update one batch is collected and must show the new weight in every collector's
actions: a scheme whose update returns before the collectors hold it fails the cell.

After the timed series, ``--cpu-repeats`` more updates (unchecked but the last) run
under :class:`broadcast_bench.cpu_use.CpuMeter`: the CPU milliseconds every process of the
machine burnt per update, by kind (the learner is ``driver``). On two cores that, not
the number of hops, bounds a small update's wall time.

Beside them, in the same cells and run, raysync's own broadcast without TorchRL: a hub
(``object_store``, with ``channels=True``, and ``shared_memory``, its receivers copying
or, ``shared_memory+zero_copy``, adopting the node's segment as their model) and N
``WeightReceiver`` actors holding the same policy; the time is
``ray.get(hub.broadcast.remote(policy))``, and after each sample every receiver must
hold the new weight (``--hubs`` picks them, none to skip).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from broadcast_bench.cpu_use import CpuMeter
from broadcast_bench.environment import recorded_environment
from broadcast_bench.warmup import WarmUp, add_seconds_argument
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.collectors.distributed import RayCollector
from torchrl.testing.mocking_classes import CountingEnv
from torchrl.weight_update import RayWeightSyncScheme

from raysync import WeightHub, WeightReceiver
from raysync.torchrl import RaySyncScheme

FRAMES = 4  # per collector and batch: the batch only checks the weights
#: raysync's own broadcasts beside the schemes: a transport, and ``+`` a hub or receiver option
HUBS = ("object_store", "object_store+channels", "shared_memory", "shared_memory+zero_copy")


@dataclass(frozen=True)
class Series:
    """How each scheme's series of updates is run in a cell: ``warmup`` untimed updates
    lasting ``warmup_s`` at least, ``repeats`` timed ones, ``cpu_repeats`` measured for
    CPU (0: none)."""

    warmup: int
    warmup_s: float
    repeats: int
    cpu_repeats: int


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


def time_scheme(
    name: str, size_mb: float, n: int, series: Series
) -> tuple[list[float], dict[str, float]]:
    """Seconds per ``update_policy_weights_()`` of one scheme in one cell, and its CPU
    milliseconds per update by kind of process."""
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
    try:
        next(batches)
        return _timed_updates(
            name,
            policy,
            series,
            update=lambda _: collector.update_policy_weights_(),
            held=lambda: set(next(batches)["action"].float().flatten().tolist()),
        )
    finally:
        collector.shutdown()


def _timed_updates(
    name, policy, series: Series, update, held
) -> tuple[list[float], dict[str, float]]:
    """Seconds per ``update(i)`` after ``policy`` took the value of update ``i``;
    ``held()`` is then the set of values the receivers act with, which must be it. The
    first ``series.warmup`` updates, and any more until ``series.warmup_s`` seconds have
    passed, are not timed. Then ``series.cpu_repeats`` updates in a row, checked after
    the last: CPU ms per update."""
    samples = []
    warm_up = WarmUp(series.warmup, series.warmup_s)
    untimed = 0
    while not warm_up.over(untimed):
        value = _set(policy, untimed)
        update(untimed)
        _check(name, untimed, value, held)
        untimed += 1
    gc.collect()  # the learner's first full collection, out of the samples
    for i in range(untimed, untimed + series.repeats):
        value = _set(policy, i)
        started = time.perf_counter()
        update(i)
        elapsed = time.perf_counter() - started
        _check(name, i, value, held)
        samples.append(elapsed)
    if not series.cpu_repeats:
        return samples, {}
    meter = CpuMeter()
    meter.start()
    first = untimed + series.repeats
    for i in range(first, first + series.cpu_repeats):
        value = _set(policy, i)
        update(i)
    cpu = meter.per_op(series.cpu_repeats)
    _check(name, i, value, held)
    return samples, cpu


def _set(policy, i: int) -> float:
    """Give ``policy`` update ``i``'s value; return it."""
    value = float(i + 2)
    with torch.no_grad():
        policy.weight.fill_(value)
        policy.ballast.fill_(value)
    return value


def _check(name: str, i: int, value: float, held) -> None:
    seen = held()
    if seen != {value}:
        raise RuntimeError(f"{name}: after update {i} the receivers act with {seen}")


@ray.remote(num_cpus=0)
class HubReceiver(WeightReceiver):
    """A receiver of the benchmark's policy, written with the mixin."""

    def __init__(self, hub, size_mb: float, zero_copy: bool = False) -> None:
        self.policy = BallastPolicy(size_mb)
        self.connect_hub(hub, {"policy": "policy"}, zero_copy=zero_copy)

    def weight(self) -> float:
        return float(self.policy.weight)


def time_hub(
    variant: str, size_mb: float, n: int, series: Series
) -> tuple[list[float], dict[str, float]]:
    """Seconds per broadcast of raysync's own hub (``object_store``,
    ``object_store+channels``, ``shared_memory`` or ``shared_memory+zero_copy``) to N
    mixin receivers, each checked after its sample; and CPU ms per broadcast by kind of
    process."""
    transport, _, options = variant.partition("+")
    hub = WeightHub.remote(models=["policy"], transport=transport, channels=options == "channels")
    zero_copy = options == "zero_copy"
    receivers = [HubReceiver.remote(hub, size_mb, zero_copy) for _ in range(n)]
    ray.get([r.__ray_ready__.remote() for r in receivers])
    policy = BallastPolicy(size_mb)

    def update(i: int) -> None:
        ray.get(hub.broadcast.remote(policy))
        if i == 0:  # the first broadcast asked for the channel (untimed: a warm-up)
            hub.wait_channel("policy")

    try:
        return _timed_updates(
            variant,
            policy,
            series,
            update,
            held=lambda: set(ray.get([r.weight.remote() for r in receivers])),
        )
    finally:
        hub.release()
        ray.get(hub.close.remote())
        for actor in [hub.actor, *receivers]:
            ray.kill(actor)


def plot(cells: list[dict], path: Path) -> None:
    """Milliseconds per update, a bar pair per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['size_mb']:g} MB N={c['collectors']}" for c in cells]
    x = range(len(cells))
    names = {
        "torchrl_ray": "TorchRL Ray scheme",
        "raysync": "RaySyncScheme",
        "object_store": "raysync broadcast",
        "object_store+channels": "raysync broadcast, channels",
        "shared_memory": "raysync broadcast, shared_memory",
        "shared_memory+zero_copy": "raysync broadcast, shared_memory, zero-copy receivers",
    }
    series = [key for key in names if key in cells[0]]
    width = 0.8 / len(series)
    figure, axes = plt.subplots(figsize=(9, 4))
    for k, key in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        axes.bar(
            [i + offset for i in x], [c[key]["p50_ms"] for c in cells], width, label=names[key]
        )
    axes.set_xticks(list(x), labels)
    axes.set_ylabel("ms per update or broadcast (p50)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.0, 8.0, 64.0], help="MB")
    parser.add_argument("--collectors", nargs="+", type=int, default=[1, 4])
    # Ray's compiled graphs (channels) run their first ~10 executions several times
    # slower than later ones, even by hand: every series gets that many untimed.
    parser.add_argument("--warmup", type=int, default=10)
    add_seconds_argument(parser)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--cpu-repeats", type=int, default=30, help="updates measured for CPU, 0 to skip"
    )
    parser.add_argument(
        "--hubs",
        nargs="*",
        default=list(HUBS),
        choices=HUBS,
        help="raysync's own broadcast beside the schemes",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out's)")
    args = parser.parse_args()
    series = Series(args.warmup, args.warmup_s, args.repeats, args.cpu_repeats)
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)
    cells = []
    try:
        for size in args.sizes:
            for n in args.collectors:
                # Each cell starts its series one further along: a series that follows
                # another runs on the store that one left (Ray frees objects once a
                # second), so no series is always the one after TorchRL's scheme.
                names = ("torchrl_ray", "raysync", *args.hubs)
                turn = len(cells) % len(names)
                order = [*names[turn:], *names[:turn]]
                cell = {"size_mb": size, "collectors": n, "order": order}
                for name in order:
                    timed = time_scheme if name in ("torchrl_ray", "raysync") else time_hub
                    samples, cpu = timed(name, size, n, series)
                    cell[name] = {
                        "p50_ms": statistics.median(samples) * 1e3,
                        "all_s": samples,
                        "cpu_ms_per_update": cpu,
                    }
                cells.append(cell)
                times = ", ".join(
                    f"{name} {cell[name]['p50_ms']:.1f} ms"
                    f" (CPU {cell[name]['cpu_ms_per_update'].get('all', 0):.1f} ms)"
                    for name in ("torchrl_ray", "raysync", *args.hubs)
                )
                print(f"{size:g} MB, N={n}: {times}", flush=True)
    finally:
        ray.shutdown()
    if args.out is not None:
        # The learner's OpenMP threads spin after its last parallel op (here, setting the
        # weights) unless OMP_WAIT_POLICY says otherwise: it moves every cell (docs/latency.md).
        env = recorded_environment()
        config = dataclasses.asdict(series)
        args.out.write_text(json.dumps({"cells": cells, "env": env, "config": config}, indent=1))
    png = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if png is not None:
        plot(cells, png)


if __name__ == "__main__":
    main()
