#!/usr/bin/env python
"""Broadcast time vs bytes and number of receivers: raysync vs a memcpy floor vs Ray by hand.

Measured in the same run, for every (size, N receivers, tensor count) cell:

* ``raysync/<transport>`` -- ``ray.get(hub.broadcast.remote(weights, model="m"))``, one
  hub per transport in ``--transports`` (default: every transport available here), timed
  on the learner (``perf_counter`` around the call and the get). Receivers are
  ``WeightReceiver`` actors that apply into their own preallocated tensors, in place;
  each hub has its own N receivers, so a cell holds (transports x N + 1) models.
* ``baseline`` -- what a user could write by hand: one ``ray.put(state_dict)`` per
  broadcast with Ray's opt-in zero-copy torch serializer
  (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, set here before ``import ray`` and passed to
  workers through ``runtime_env``); each receiver ``ray.get``s the ref (passed nested in a
  list so Ray does not resolve it) and ``copy_``s every tensor into its own preallocated
  tensors; the learner waits for all receivers. Timed from the put to the last receiver.
* ``floor``    -- N+1 memcpys of the same bytes in one process (``dst.copy_(src)`` of one
  flat buffer, N+1 times, with ``--floor-threads`` torch threads): one copy into shared
  memory plus one copy out per receiver, with no Ray at all. It is measured inside every
  cell, next to the two others, so all three see the same machine (its rows carry the
  cell's ``n_tensors``, though the floor always copies one flat buffer).

Per cell: a hub and N receivers are started, every method gets ``--warmup`` untimed
runs, the script waits for the CPU to go quiet (start-up and anything else running on
the machine skew the numbers; the reading is kept as ``cpu_busy_before``), then
``--repeats`` timed rounds run the three methods in a rotating order; the median is
reported and ``ratio_to_floor`` divides by the same cell's floor. After every broadcast
each receiver's tensors are probed to check that this version really landed. The actors
are killed between cells so at most one cell's models are in memory.

Sizes accept KB/MB/GB suffixes as powers of 1024 (``64MB`` = 64 MiB). "GB/s" in the
table is delivered bandwidth, ``bytes * N / seconds / 1e9``, for every method.

Writes JSON (``--out``, default ``benchmarks/results/broadcast.json``; ``--quick``
defaults to ``broadcast_quick.json`` so it does not overwrite a full run) and a PNG plot
next to it (``--plot`` to override).

    .venv/bin/python benchmarks/broadcast.py --quick        # ~1 min
    .venv/bin/python benchmarks/broadcast.py                # 64MB,256MB,1GB x N=1,4
    .venv/bin/python benchmarks/broadcast.py --sizes 128MB --receivers 1 2 8 --repeats 5
"""

from __future__ import annotations

import os

# Must be set before ``import ray`` (raysync imports ray) for the baseline's zero-copy
# torch serializer in the driver; workers get it through ``runtime_env`` below. raysync's
# object_store transport puts NumPy views, so it takes the same path with or without it.
ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"
os.environ[ZERO_COPY_ENV] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from raysync import WeightHub, WeightReceiver  # noqa: E402
from raysync.transports import available_transports  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BASELINES = ("baseline", "floor")
DTYPE = torch.float32
_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}


def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864 (powers of 1024); a plain number is bytes."""
    t = text.strip().upper().replace("IB", "B").replace(" ", "")
    for unit in ("KB", "MB", "GB", "B"):
        if t.endswith(unit):
            value = float(t[: -len(unit)]) * _UNITS[unit]
            break
    else:
        value = float(t)
    size = int(value)
    if size <= 0 or size % DTYPE.itemsize:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def fmt_size(nbytes: int) -> str:
    if nbytes >= 2**30 and nbytes % 2**30 == 0:
        return f"{nbytes // 2**30} GB"
    return f"{nbytes / 2**20:g} MB"


# -- models -----------------------------------------------------------------------------
def layout(size_bytes: int, n_tensors: int) -> list[tuple[str, int]]:
    """``n_tensors`` float32 tensors (name, numel) adding up to exactly ``size_bytes``."""
    numel = size_bytes // DTYPE.itemsize
    if n_tensors > numel:
        raise ValueError(f"cannot split {size_bytes} bytes into {n_tensors} tensors")
    base, extra = divmod(numel, n_tensors)
    return [(f"layer{i:04d}.weight", base + (1 if i < extra else 0)) for i in range(n_tensors)]


def make_state_dict(spec: list[tuple[str, int]], fill: float) -> dict[str, torch.Tensor]:
    """Freshly allocated tensors, every page touched (no first-touch faults in the timing)."""
    return {name: torch.empty(numel, dtype=DTYPE).fill_(fill) for name, numel in spec}


def tag(weights: dict[str, torch.Tensor], value: int) -> None:
    """Mark one version: element 0 of every tensor (cheap; checked on every receiver)."""
    for tensor in weights.values():
        tensor[0] = value


@ray.remote(num_cpus=0)
class BenchReceiver(WeightReceiver):
    """Holds one preallocated model; raysync applies into it, and so does ``apply_baseline``."""

    def __init__(self, hub, spec: list[tuple[str, int]], threads: int) -> None:
        torch.set_num_threads(threads)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.model = make_state_dict(spec, fill=0.0)
        self.connect_hub(hub, models={"m": "model"})

    def ready(self) -> int:
        return torch.get_num_threads()

    def apply_baseline(self, refs: list) -> int:
        """The hand-written receiver: get the put state_dict, copy it in place."""
        state = ray.get(refs[0])
        with torch.no_grad():
            for name, source in state.items():
                self.model[name].copy_(source)
        return len(state)

    def probe(self) -> list[float]:
        return [float(t[0]) for t in self.model.values()]


# -- measurements ---------------------------------------------------------------------------
@dataclass
class Cell:
    size: int
    n: int
    n_tensors: int


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class Floor:
    """N+1 copies of one flat ``size``-byte buffer in this process: the no-Ray floor."""

    def __init__(self, size: int) -> None:
        numel = size // DTYPE.itemsize
        self.src = torch.empty(numel, dtype=DTYPE).fill_(1.0)
        self.dst = torch.empty(numel, dtype=DTYPE).fill_(0.0)

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n + 1):
            self.dst.copy_(self.src)
        return time.perf_counter() - t0


def cpu_busy(interval_s: float) -> float | None:
    """Fraction of all cores busy over ``interval_s`` (Linux /proc/stat; None elsewhere)."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(interval_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        time.sleep(interval_s)
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(threshold: float, timeout_s: float) -> float | None:
    """Wait (up to ``timeout_s``) until the machine is idle: worker start-up, killed
    actors and anything else running here skew every method. Returns the last reading."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy(0.5)
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy(0.5)
    return busy


def check_landed(receivers, value: int, method: str) -> None:
    for probe in ray.get([r.probe.remote() for r in receivers]):
        if any(v != value for v in probe):
            bad = sorted(set(probe) - {value})[:3]
            raise RuntimeError(f"{method}: a receiver holds {bad}, expected version tag {value}")


def raysync_method(transport: str) -> str:
    return f"raysync/{transport}"


def run_cell(cell: Cell, args: argparse.Namespace, weights: dict[str, torch.Tensor], spec):
    """Start a hub and N receivers per transport; time floor, raysync and baseline; tear
    them down."""
    threads = args.receiver_threads or max(1, (os.cpu_count() or 1) // cell.n)
    hubs = {raysync_method(t): WeightHub.remote(transport=t) for t in args.transports}
    receivers_of = {
        m: [BenchReceiver.remote(hub, spec, threads) for _ in range(cell.n)]
        for m, hub in hubs.items()
    }
    methods = (*hubs, *BASELINES)
    receivers = receivers_of[methods[0]]  # the baseline's (any hub's receivers will do)
    floor = Floor(cell.size)
    try:
        ray.get([r.ready.remote() for rs in receivers_of.values() for r in rs])
        samples: dict[str, list[float]] = {m: [] for m in methods}
        report_seconds: dict[str, list[float]] = {m: [] for m in hubs}
        counter = 0

        def one(method: str, timed: bool) -> None:
            nonlocal counter
            if method == "floor":
                elapsed = floor.run(cell.n)
            else:
                counter += 1
                tag(weights, counter)
                if method in hubs:
                    t0 = time.perf_counter()
                    report = ray.get(hubs[method].broadcast.remote(weights, model="m"))
                    elapsed = time.perf_counter() - t0
                    if len(report.acked) != cell.n or report.bytes != cell.size:
                        raise RuntimeError(f"{method} report is off: {report}")
                    if timed:
                        report_seconds[method].append(report.seconds)
                else:
                    t0 = time.perf_counter()
                    ref = ray.put(weights)
                    ray.get([r.apply_baseline.remote([ref]) for r in receivers])
                    elapsed = time.perf_counter() - t0
                    del ref
                check_landed(receivers_of.get(method, receivers), counter, method)
            if timed:
                samples[method].append(elapsed)

        for method in methods:
            for _ in range(args.warmup):
                one(method, timed=False)
        busy = wait_quiet(args.quiet_threshold, args.quiet_timeout_s)
        for k in range(args.repeats):
            # rotate the order so no method always runs first (or right after another)
            order = methods[k % len(methods) :] + methods[: k % len(methods)]
            for method in order:
                one(method, timed=True)
        return samples, report_seconds, threads, busy
    finally:
        for rs in receivers_of.values():
            for r in rs:
                ray.kill(r)
        for hub in hubs.values():
            ray.kill(hub.actor)


# -- output -----------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    print()
    print("GB/s = size_bytes * N / seconds / 1e9 (bytes delivered to receivers per second)")
    header = (
        f"{'method':<22} {'MB':>7} {'tensors':>7} {'N':>3} {'seconds':>9} {'GB/s':>7} "
        f"{'x floor':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        gbps = row["size_bytes"] * row["n_receivers"] / row["seconds"] / 1e9
        print(
            f"{row['method']:<22} {row['size_bytes'] / 2**20:>7g} {row['n_tensors']:>7} "
            f"{row['n_receivers']:>3} {row['seconds']:>9.4f} {gbps:>7.2f} "
            f"{row['ratio_to_floor']:>8.2f}"
        )
    sys.stdout.flush()


def plot(rows: list[dict], tensor_counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    methods = sorted({r["method"] for r in rows} - set(BASELINES)) + list(BASELINES)
    colors = {"baseline": "tab:orange", "floor": "tab:gray"}
    for i, m in enumerate(m for m in methods if m not in colors):
        colors[m] = palette[i % len(palette)]
    ns = sorted({r["n_receivers"] for r in rows})
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(
        1, len(tensor_counts), figsize=(6.5 * len(tensor_counts), 5), squeeze=False
    )
    for ax, n_tensors in zip(axes[0], tensor_counts, strict=True):
        for method in methods:
            for i, n in enumerate(ns):
                pts = sorted(
                    (r["size_bytes"], r["seconds"])
                    for r in rows
                    if r["method"] == method
                    and r["n_receivers"] == n
                    and r["n_tensors"] == n_tensors
                )
                if not pts:
                    continue
                xs = [p[0] / 2**20 for p in pts]
                ys = [p[1] for p in pts]
                ax.plot(
                    xs,
                    ys,
                    color=colors[method],
                    linestyle=styles[i % len(styles)],
                    marker=markers[i % len(markers)],
                    alpha=0.6 if method == "floor" else 1.0,
                    label=f"{method} N={n}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("broadcast size (MiB)")
        ax.set_ylabel("seconds (median, learner wall time)")
        ax.set_title(f"{n_tensors}-tensor float32 state_dict")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("raysync per transport vs hand-written ray.put vs (N+1) memcpy floor")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, help="default: 64MB 256MB 1GB")
    p.add_argument(
        "--transports", nargs="+", help="raysync transports; default: every one available"
    )
    p.add_argument("--receivers", nargs="+", type=int, help="N values; default: 1 4")
    p.add_argument("--tensors", nargs="+", type=int, help="tensor counts; default: 16 1000")
    p.add_argument("--warmup", type=int, help="untimed runs per method and cell; default 1")
    p.add_argument("--repeats", type=int, help="timed runs per method and cell; default 3")
    p.add_argument("--quick", action="store_true", help="16MB, N=1 2, 1 repeat (~1 min)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/broadcast.json)")
    p.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    p.add_argument("--object-store-gb", type=float, default=6.0)
    p.add_argument(
        "--floor-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads for the floor's memcpys (default: all cores)",
    )
    p.add_argument(
        "--receiver-threads",
        type=int,
        default=0,
        help="torch threads per receiver actor (default 0: max(1, cores // N))",
    )
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="after a cell, wait up to this long for the killed actors to go quiet")
    p.add_argument("--quiet-threshold", type=float, default=0.25,
                   help="before timing a cell, wait until at most this fraction of CPU is busy")
    p.add_argument("--quiet-timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    quick = {"sizes": [16 * 2**20], "receivers": [1, 2], "tensors": [16, 1000],
             "warmup": 1, "repeats": 1}
    full = {"sizes": [64 * 2**20, 256 * 2**20, 2**30], "receivers": [1, 4],
            "tensors": [16, 1000], "warmup": 1, "repeats": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = RESULTS_DIR / ("broadcast_quick.json" if args.quick else "broadcast.json")
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    if args.transports is None:
        args.transports = list(available_transports())
    if args.repeats < 1 or args.warmup < 0 or min(args.receivers) < 1:
        p.error("need --repeats >= 1, --warmup >= 0 and N >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*[Zz]ero-copy.*")
    torch.set_num_threads(args.floor_threads)
    sizes, ns, tensor_counts = sorted(args.sizes), sorted(set(args.receivers)), args.tensors
    print(
        f"sizes={[fmt_size(s) for s in sizes]} N={ns} tensors={tensor_counts} "
        f"warmup={args.warmup} repeats={args.repeats} floor_threads={args.floor_threads} "
        f"cpus={os.cpu_count()}",
        flush=True,
    )
    ray.init(
        num_cpus=16,
        include_dashboard=False,
        object_store_memory=int(args.object_store_gb * 2**30),
        runtime_env={"env_vars": {ZERO_COPY_ENV: "1"}},
        log_to_driver=True,
    )
    rows: list[dict] = []
    receiver_threads: dict[int, int] = {}
    started = time.time()
    try:
        for size in sizes:
            for n_tensors in tensor_counts:
                spec = layout(size, n_tensors)
                weights = make_state_dict(spec, fill=1.0)
                for n in ns:
                    cell = Cell(size, n, n_tensors)
                    samples, report_seconds, threads, busy = run_cell(cell, args, weights, spec)
                    receiver_threads[n] = threads
                    floor_s = median(samples["floor"])
                    for method in samples:
                        sec = median(samples[method])
                        row = dict(method=method, size_bytes=size, n_receivers=n,
                                   n_tensors=n_tensors, seconds=sec, samples=samples[method],
                                   ratio_to_floor=sec / floor_s, floor_seconds=floor_s,
                                   cpu_busy_before=busy)
                        if method in report_seconds:
                            row["hub_report_seconds"] = report_seconds[method]
                        rows.append(row)
                    print(f"[{time.time() - started:6.1f}s] {fmt_size(size)} {n_tensors} tensors "
                          f"N={n}: floor {floor_s:.4f}s, "
                          + ", ".join(f"{m} {median(samples[m]):.4f}s "
                                      f"({median(samples[m]) / floor_s:.2f}x)"
                                      for m in samples if m != "floor")
                          + ("" if busy is None else f"  [cpu busy before: {busy:.0%}]"),
                          flush=True)
                    wait_quiet(args.quiet_threshold, args.settle_s)
                del weights
                gc.collect()  # the cell's floor buffers and actors are gone too
    finally:
        ray.shutdown()

    rows.sort(key=lambda r: (r["n_tensors"], r["n_receivers"], r["size_bytes"],
                             r["method"] != "floor", r["method"] == "baseline", r["method"]))
    result = {
        "config": {
            "sizes_bytes": sizes,
            "receivers": ns,
            "tensor_counts": tensor_counts,
            "transports": args.transports,
            "dtype": str(DTYPE),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "statistic": "median of the timed repeats",
            "floor": "(N+1) x dst.copy_(src) of one flat buffer in one process, measured "
            "inside each cell (so its n_tensors is the cell's, not the floor's layout)",
            "ratio_to_floor": "seconds / the floor's median in the same cell",
            "floor_threads": args.floor_threads,
            "receiver_threads_by_n": receiver_threads,
            "object_store_memory_bytes": int(args.object_store_gb * 2**30),
            "gbps_definition": "size_bytes * n_receivers / seconds / 1e9",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "torch": torch.__version__,
        },
        "total_seconds": time.time() - started,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, tensor_counts, args.plot)
    print_table(rows)
    print(f"\nwrote {args.out} and {args.plot} in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
