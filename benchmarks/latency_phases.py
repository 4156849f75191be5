"""Where a small broadcast's time goes: one timeline per (transport, size, receivers).

Runs in the driver, which is the learner. For each cell it starts a hub and N receiver
actors (the mixin, a state_dict of ``--tensors`` float32 tensors, 16 by default),
broadcasts ``--repeats`` times after ``--warmup`` untimed broadcasts and one full garbage
collection in the learner and each receiver (Python runs each process's first early,
~80 ms with torch imported: a sample would carry it at random), and splits each
broadcast's wall time (from ``hub.broadcast.remote`` to the report, on the learner's
clock) with the report's ``phases``:

* ``learner``  -- flatten, check, hand the data to the transport (``phases.learner_s``);
* ``to_hub_and_back`` -- the wall time outside the hub's own span (``report.seconds``
  less the learner's part): the learner's submit call reaching the hub, and the report
  coming back;
* ``hub_before_delivery`` -- in the hub, before the receivers are called: ordering,
  checks, the version, the GCS snapshot write, planning (``plan_s`` is shown apart);
* ``deliver`` -- the hub's calls to the receivers until the last ack (max over
  receivers), and inside one receiver its ``fetch``, ``wait`` (for a safe point) and
  ``apply``.

Beside them, Ray's own floors in the same cluster, with no data and no work: one actor
call from the learner; the learner calling the N receivers at once; the learner calling
an async relay actor that calls the N receivers at once (the hub's shape); and one GCS
key-value write of 64 bytes (what the hub's snapshot costs per broadcast). And ``cpu``:
the CPU milliseconds per timed broadcast of every process on the machine, by kind
(``broadcast_bench.cpu_use``; the learner is ``driver``): on two cores, what bounds the
wall time.

With ``--train-step`` the learner first writes a tensor as large as the model with
torch's threads (``fill_``), as an optimizer step would, before each broadcast: GNU
OpenMP's threads then spin-wait for the next parallel region while the broadcast runs,
unless ``OMP_WAIT_POLICY=PASSIVE`` (docs/latency.md, "The learner's OpenMP threads").

``python benchmarks/latency_phases.py --out benchmarks/results/latency_phases.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from broadcast_bench.cpu_use import CpuMeter
from broadcast_bench.environment import recorded_environment
from broadcast_bench.warmup import WarmUp, add_seconds_argument
from ray.experimental import internal_kv

from raysync import WeightHub, WeightReceiver, available_transports


def _state(size_mb: float, tensors: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    per_tensor = max(1, int(size_mb * 2**20 / 4 / tensors))
    return {f"w{i}": torch.full((per_tensor,), value) for i in range(tensors)}


@ray.remote(num_cpus=0)
class _Receiver(WeightReceiver):
    def __init__(self, hub, size_mb: float, tensors: int, zero_copy: bool = False):
        self.weights = _state(size_mb, tensors)
        self.connect_hub(hub, {"m": "weights"}, zero_copy=zero_copy)

    def noop(self) -> None:
        return None


@ray.remote(num_cpus=0)
class _Relay:
    """An async actor that calls N actors at once and gathers: the hub's shape, no work."""

    async def fan_out(self, targets: list) -> None:
        await asyncio.gather(*[t.noop.remote() for t in targets])


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": statistics.median(ordered) * 1e3,
        "p99": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
    }


def _timed(call: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    samples = []
    for i in range(warmup + repeats):
        started = time.perf_counter()
        call()
        if i >= warmup:
            samples.append(time.perf_counter() - started)
    return samples


def measure_cell(
    name: str,
    size_mb: float,
    receivers: int,
    tensors: int,
    warmup: int,
    repeats: int,
    train_step: bool = False,
    warmup_s: float = 0.0,
) -> dict:
    """One cell's timeline (milliseconds, p50 and p99 over ``repeats`` broadcasts, after
    ``warmup`` untimed ones that last ``warmup_s`` at least).
    ``name`` is a transport, ``object_store+channels`` for a hub started with
    ``channels=True`` (every timed broadcast must then go by the learner's channel), or
    ``shared_memory+zero_copy`` for receivers whose model lives in the node's segment."""
    transport, _, variant = name.partition("+")
    if variant not in ("", "channels", "zero_copy"):
        raise ValueError(f"{name}: the variants are +channels and +zero_copy")
    channels = variant == "channels"
    zero_copy = variant == "zero_copy"
    hub = WeightHub.remote(transport=transport, models=["m"], channels=channels)
    actors = [_Receiver.remote(hub, size_mb, tensors, zero_copy) for _ in range(receivers)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    relay = _Relay.remote()
    ray.get(relay.__ray_ready__.remote())  # its start-up outside the CPU measured below
    walls, reports = [], []
    step = torch.empty(max(1, int(size_mb * 2**20 / 4))) if train_step else None
    meter = CpuMeter()
    warm_up = WarmUp(warmup, warmup_s)
    timing = False
    i = 0
    try:
        while len(walls) < repeats:
            if i == 1 and channels:  # the first broadcast asked for the channel
                hub.wait_channel("m")
            if not timing and warm_up.over(i):
                timing = True  # after each process's first full GC (Python runs it early)
                gc.collect()
                ray.get([a.__ray_call__.remote(lambda _: gc.collect()) for a in actors])
                meter.start()
            weights = _state(size_mb, tensors, float(i + 1))
            if step is not None:
                step.fill_(float(i))
            started = time.perf_counter()
            report = ray.get(hub.broadcast.remote(weights, model="m"))
            wall = time.perf_counter() - started
            if len(report.acked) != receivers:
                raise RuntimeError(f"{name}: broadcast {i} not acked by all: {report}")
            if channels and timing and len(report.channel) != receivers:
                raise RuntimeError(f"{name}: broadcast {i} not all by channel: {report}")
            if timing:
                walls.append(wall)
                reports.append(report)
            i += 1
        cpu = meter.per_op(repeats)
        floors = {
            "one_call": _timed(lambda: ray.get(actors[0].noop.remote()), warmup, repeats),
            "direct_fan_out": _timed(
                lambda: ray.get([a.noop.remote() for a in actors]), warmup, repeats
            ),
            "relay_fan_out": _timed(lambda: ray.get(relay.fan_out.remote(actors)), warmup, repeats),
            "gcs_kv_put": _timed(
                lambda: internal_kv._internal_kv_put(
                    "latency/versions", b"x" * 64, overwrite=True, namespace="latency"
                ),
                warmup,
                repeats,
            ),
        }
    finally:
        ray.get(hub.close.remote())
        hub.release()
        for actor in [hub.actor, *actors, relay]:
            ray.kill(actor)
    phases = [r.phases for r in reports]
    learner = [p.learner_s for p in phases]
    in_hub = [r.seconds - p.learner_s for r, p in zip(reports, phases, strict=True)]
    deliver = [p.deliver_s.max for p in phases]
    return {
        "transport": name,
        "size_mb": size_mb,
        "receivers": receivers,
        "tensors": tensors,
        "train_step": train_step,
        "wall": _ms(walls),
        "learner": _ms(learner),
        "to_hub_and_back": _ms([w - r.seconds for w, r in zip(walls, reports, strict=True)]),
        "hub_before_delivery": _ms([h - d for h, d in zip(in_hub, deliver, strict=True)]),
        "plan": _ms([p.plan_s for p in phases]),
        "deliver_max": _ms(deliver),
        "fetch": _ms([p.fetch_s.p50 for p in phases]),
        "wait": _ms([p.wait_s.p50 for p in phases]),
        "apply": _ms([p.apply_s.p50 for p in phases]),
        "floors": {name: _ms(samples) for name, samples in floors.items()},
        "cpu": cpu,
    }


_COLUMNS = (
    ("wall", lambda c: c["wall"]["p50"]),
    ("p99", lambda c: c["wall"]["p99"]),
    ("learner", lambda c: c["learner"]["p50"]),
    ("to hub+back", lambda c: c["to_hub_and_back"]["p50"]),
    ("hub pre", lambda c: c["hub_before_delivery"]["p50"]),
    ("deliver", lambda c: c["deliver_max"]["p50"]),
    ("fetch", lambda c: c["fetch"]["p50"]),
    ("apply", lambda c: c["apply"]["p50"]),
    ("ray 1 call", lambda c: c["floors"]["one_call"]["p50"]),
    ("ray direct", lambda c: c["floors"]["direct_fan_out"]["p50"]),
    ("ray relay", lambda c: c["floors"]["relay_fan_out"]["p50"]),
    ("gcs put", lambda c: c["floors"]["gcs_kv_put"]["p50"]),
    ("CPU", lambda c: c["cpu"]["all"]),
    ("CPU learner", lambda c: c["cpu"].get("driver", 0.0)),
    ("CPU hub", lambda c: c["cpu"].get("WeightHubActor", 0.0)),
    ("CPU receivers", lambda c: c["cpu"].get("_Receiver", 0.0)),
)


def print_table(cells: list[dict]) -> None:
    """A markdown table, milliseconds (p50 unless marked)."""
    print("| transport | MB | N | tensors | " + " | ".join(name for name, _ in _COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(_COLUMNS))
    for cell in cells:
        values = " | ".join(f"{value(cell):.2f}" for _, value in _COLUMNS)
        where = f"{cell['transport']} | {cell['size_mb']:g} | {cell['receivers']}"
        print(f"| {where} | {cell['tensors']} | {values} |")


_PHASES = (
    ("learner", "learner"),
    ("to hub and back", "to_hub_and_back"),
    ("hub before delivery", "hub_before_delivery"),
    ("delivery (slowest receiver)", "deliver_max"),
)


def plot(cells: list[dict], path: Path) -> None:
    """A stacked bar per cell (p50 of each phase), with Ray's floors as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{c['transport']}\n{c['size_mb']:g} MB N={c['receivers']}\n{c['tensors']} t" for c in cells
    ]
    x = range(len(cells))
    figure, axes = plt.subplots(figsize=(max(8, 0.9 * len(cells)), 5))
    bottom = [0.0] * len(cells)
    for name, key in _PHASES:
        heights = [c[key]["p50"] for c in cells]
        axes.bar(x, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for name, key, marker in (
        ("Ray: learner -> N", "direct_fan_out", "v"),
        ("Ray: learner -> relay -> N", "relay_fan_out", "^"),
    ):
        axes.scatter(x, [c["floors"][key]["p50"] for c in cells], marker=marker, c="k", label=name)
    axes.set_xticks(list(x), labels, fontsize=7)
    axes.set_ylabel("ms (p50)")
    axes.set_title("Where a small broadcast's time goes")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--transports", nargs="+", help="default: object_store, shared_memory, nixl (if here)"
    )
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.1, 1.0, 8.0], help="MB")
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--tensors", nargs="+", type=int, default=[16], help="tensor counts")
    parser.add_argument("--warmup", type=int, default=5)
    add_seconds_argument(parser)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="the learner writes a model-sized tensor with torch's threads before each broadcast",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out's)")
    args = parser.parse_args()
    transports = args.transports or [
        t for t in ("object_store", "shared_memory", "nixl") if t in available_transports()
    ]
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)
    try:
        cells = [
            measure_cell(
                t, size, n, count, args.warmup, args.repeats, args.train_step, args.warmup_s
            )
            for t in transports
            for size in args.sizes
            for n in args.receivers
            for count in args.tensors
        ]
    finally:
        ray.shutdown()
    print_table(cells)
    if args.out is not None:
        env = recorded_environment()
        config = {"warmup": args.warmup, "warmup_s": args.warmup_s, "repeats": args.repeats}
        args.out.write_text(json.dumps({"cells": cells, "env": env, "config": config}, indent=1))
    png = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if png is not None:
        plot(cells, png)


if __name__ == "__main__":
    main()
