"""One cell: what it is (transport, size, N receivers, tensor count), the methods it times,
and how they are timed: N receivers started, the floors first (no hub yet), then a hub,
the receivers connected and raysync's broadcast (and the baseline); medians come later
(``broadcast_bench.report``)."""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

import raysync
from broadcast_bench.floors import Floor, RawReadSource, put_by_hand
from broadcast_bench.machine import METER
from broadcast_bench.model import Layout, check_landed, tag
from broadcast_bench.names import FLOOR_METHODS, METHOD_ORDER, hub_transport, receiver_options
from broadcast_bench.receivers import receiver_class
from broadcast_bench.units import MiB, fmt_size
from raysync import WeightHub


@dataclass(frozen=True)
class Cell:
    transport: str  #: a benchmark transport name (``broadcast_bench.names``)
    size: int  #: bytes of the model
    n: int  #: receivers
    n_tensors: int

    def describe(self) -> str:
        return f"{self.transport} {fmt_size(self.size)} x{self.n_tensors} N={self.n}"


def cell_methods(cell: Cell, baseline: bool) -> tuple[str, ...]:
    """The methods ``cell`` times, in ``METHOD_ORDER``: the floor and raysync always, the
    raw READ in nixl cells, the baseline in object_store cells (unless ``--no-baseline``)."""
    methods = ["floor", "raysync"]
    if hub_transport(cell.transport) == "nixl":
        methods.append("raw_read")
    if cell.transport == "object_store" and baseline:
        methods.append("baseline")
    return tuple(m for m in METHOD_ORDER if m in methods)


def default_repeats(size: int) -> int:
    """Timed rounds per cell when ``--repeats`` is not given: fewer for big models, whose
    samples are long (and steadier) and whose cells dominate the run time."""
    if size <= 64 * MiB:
        return 5
    if size <= 256 * MiB:
        return 3
    return 2


@dataclass
class CellResult:
    methods: tuple[str, ...]
    samples: dict[str, list[float]]
    noise: dict[str, list[dict]]
    report_seconds: list[float]
    #: per method: the CPU busy before its phase's timed rounds, and the share of the
    #: cores the cell's own processes used meanwhile with nothing timed
    busy: dict[str, float | None]
    own_idle: dict[str, float | None]
    threads: int
    setup_seconds: float  #: from the start of the cell until its receivers were ready
    seconds: float  #: the whole cell, teardown included


def time_raysync(
    hub: Any, weights: dict[str, torch.Tensor], cell: Cell, timeout_s: float
) -> tuple[float, float]:
    """One broadcast, timed on the learner from the call until every receiver acked:
    (seconds, the seconds the hub's report gives)."""
    t0 = time.perf_counter()
    report = ray.get(hub.broadcast.remote(weights, model="m"), timeout=timeout_s)
    elapsed = time.perf_counter() - t0
    if len(report.acked) != cell.n or report.bytes != cell.size:
        raise RuntimeError(f"raysync report is off: {report}")
    return elapsed, report.seconds


class CellTimer:
    """Takes the samples of one cell's methods, once its receivers run; ``hub`` is set
    when the hub starts (after the floors)."""

    def __init__(
        self,
        cell: Cell,
        args: argparse.Namespace,
        weights: dict[str, torch.Tensor],
        floor: Floor,
        raw_source: RawReadSource | None,
        receivers: list[Any],
        methods: tuple[str, ...],
    ) -> None:
        self.cell, self.args, self.weights, self.floor = cell, args, weights, floor
        self.raw_source, self.receivers = raw_source, receivers
        self.hub: Any = None
        self.samples: dict[str, list[float]] = {m: [] for m in methods}
        self.noise: dict[str, list[dict]] = {m: [] for m in methods}
        self.busy: dict[str, float | None] = {}
        self.own_idle: dict[str, float | None] = {}
        self.report_seconds: list[float] = []
        self._version = 0  #: the tag of the last version sent
        self._last_report_seconds = 0.0

    def run_once(self, method: str) -> float:
        """One run of ``method`` (a new version, checked on every receiver): its seconds."""
        cell, timeout = self.cell, self.args.call_timeout_s
        if method == "floor":
            return self.floor.run(cell.n)
        self._version += 1
        if method == "raw_read":
            self.floor.src[0] = self._version
            elapsed, got = self.raw_source.read(self.receivers, timeout)
            check_landed([[v] for v in got], self._version, method)
            return elapsed
        tag(self.weights, self._version)
        if method == "raysync":
            elapsed, self._last_report_seconds = time_raysync(self.hub, self.weights, cell, timeout)
        else:  # baseline
            elapsed = put_by_hand(self.weights, self.receivers, timeout)
        probes = ray.get([r.probe.remote() for r in self.receivers], timeout=timeout)
        check_landed(probes, self._version, f"{cell.transport} {method}")
        return elapsed

    def sample(self, method: str, quiet: float) -> None:
        """One sample, taken when the machine is quiet (at most ``quiet`` of the CPU
        busy); retaken (up to --retries times) if other processes used more than
        --max-foreign of the CPU during it, keeping the attempt they disturbed least."""
        args = self.args
        attempts = []
        for _ in range(args.retries + 1):
            busy_before = METER.wait_quiet(quiet, args.sample_quiet_timeout_s)
            before = METER.snapshot()
            elapsed = self.run_once(method)
            foreign = METER.foreign(before, METER.snapshot(before[3] if before else None))
            attempts.append(
                (foreign or 0.0, elapsed, busy_before, foreign, self._last_report_seconds)
            )
            if foreign is None or foreign <= args.max_foreign:
                break
        _, elapsed, busy_before, foreign, reported = min(attempts, key=lambda a: a[0])
        self.samples[method].append(elapsed)
        self.noise[method].append(
            dict(busy_before=busy_before, foreign_during=foreign, attempts=len(attempts))
        )
        if method == "raysync":
            self.report_seconds.append(reported)

    def collect_garbage(self) -> None:
        """One full garbage collection in the learner (this process) and each receiver.

        Python runs a process's first full collection early in its life, whatever it
        does: with Ray and torch imported it walks ~200K objects (~80 ms on 2 cores). A
        cell's few samples would carry it at random; after it, full collections are
        rare (a quarter of the heap must have been promoted since). raysync's own
        actors freeze their start-up heap (actors/heap.py).
        """
        gc.collect()
        ray.get(
            [r.__ray_call__.remote(lambda _: gc.collect()) for r in self.receivers],
            timeout=self.args.call_timeout_s,
        )

    def phase(self, names: tuple[str, ...]) -> None:
        """Warm-ups, then timed rounds in a rotating order (no method always runs first,
        or right after another)."""
        args = self.args
        for method in names:
            for _ in range(args.warmup):
                self.run_once(method)
        self.collect_garbage()
        # What the cell's own processes use with nothing timed (a transport's background
        # threads, say): "quiet" means quiet apart from that, which every method pays.
        idle = METER.own_share(1.0)
        quiet = args.quiet_threshold + (idle or 0.0)
        busy_before = METER.wait_quiet(quiet, args.quiet_timeout_s)
        for method in names:
            self.busy[method], self.own_idle[method] = busy_before, idle
        for k in range(args.repeats or default_repeats(self.cell.size)):
            shift = k % len(names)
            for method in names[shift:] + names[:shift]:
                self.sample(method, quiet)


def teardown(hub: Any, receivers: list[Any], timeout_s: float) -> None:
    """Kill the receivers, close and kill the hub (its helper actors go with it). The
    learner half of the transport goes with this process."""
    for r in receivers:
        ray.kill(r)
    if hub is None:
        return
    try:
        ray.get(hub.close.remote(), timeout=timeout_s)
    except ray.exceptions.RayError as err:
        print(f"  (hub close: {type(err).__name__}; killing it)", flush=True)
    ray.kill(hub.actor)


def run_cell(
    cell: Cell,
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    spec: Layout,
    floor: Floor,
    raw_source: RawReadSource | None,
) -> CellResult:
    """Start N receivers; time the floors; start a hub, connect the receivers and time
    the transport (and the baseline); tear everything down.

    The floors go first, before the hub exists, because some transports keep threads
    busy for as long as they are connected (nixl agents, TensorPipe): measured next to
    them, a floor would carry the transport's own overhead.
    """
    started = time.perf_counter()
    threads = args.receiver_threads or max(1, (os.cpu_count() or 1) // cell.n)
    methods = cell_methods(cell, args.baseline)
    timeout = args.call_timeout_s
    receiver = receiver_class(cell.transport)
    receivers = [receiver.remote(spec, threads) for _ in range(cell.n)]
    timer = CellTimer(cell, args, weights, floor, raw_source, receivers, methods)
    try:
        mine = str(Path(raysync.__file__).parent)
        for theirs in ray.get([r.ready.remote() for r in receivers], timeout=timeout):
            if theirs != mine:
                raise RuntimeError(f"receivers import raysync from {theirs}, the learner {mine}")
        if "raw_read" in methods:
            source = raw_source.register(floor.src)
            ray.get([r.raw_setup.remote(source) for r in receivers], timeout=timeout)
        setup_seconds = time.perf_counter() - started
        timer.phase(tuple(m for m in methods if m in FLOOR_METHODS))
        if raw_source is not None:
            raw_source.close()
        timer.hub = WeightHub.remote(transport=hub_transport(cell.transport))
        options = receiver_options(cell.transport)
        ray.get([r.connect.remote(timer.hub, options) for r in receivers], timeout=timeout)
        timer.phase(tuple(m for m in methods if m not in FLOOR_METHODS))
    finally:
        teardown(timer.hub, receivers, timeout_s=30.0)
        if raw_source is not None:
            raw_source.close()
    return CellResult(
        methods,
        timer.samples,
        timer.noise,
        timer.report_seconds,
        timer.busy,
        timer.own_idle,
        threads,
        setup_seconds,
        time.perf_counter() - started,
    )
