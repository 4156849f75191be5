#!/usr/bin/env python
"""Broadcast time vs bytes and number of receivers: raysync vs a memcpy floor vs Ray by hand.

Measured in the same run, for every (size, N receivers, tensor count) cell:

* ``raysync``  -- ``ray.get(hub.broadcast.remote(weights, model="m"))`` with the
  ``object_store`` transport, timed on the learner (``perf_counter`` around the call and
  the get). Receivers are ``WeightReceiver`` actors that apply into their own
  preallocated tensors, in place.
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
runs, then ``--repeats`` timed rounds run the three methods in a rotating order; the
median is reported and ``ratio_to_floor`` divides by the same cell's floor. The machine
may be shared (and Ray's own start-up is busy), so each timed sample waits for the CPU
to go quiet first and is retaken (``--retries``) if processes outside this benchmark's
process tree used more than ``--max-foreign`` of the CPU during it (the least
disturbed attempt is kept); each row's ``noise`` lists, per sample, the CPU busy before
it, the foreign share during it (from /proc; null where it cannot be told) and the
attempts taken. After every broadcast each receiver's tensors are probed to check that
this version really landed. The actors are killed between cells so at most one cell's
models are in memory; the JSON is rewritten after every cell (``"complete": false``
until the end), so a run that dies part-way keeps what it measured.

Threads: the floor uses ``--floor-threads`` (default: all cores); each receiver actor
``--receiver-threads`` torch threads (default ``max(1, cores // N)``, so N receivers
together use the cores the floor uses; Ray would otherwise pin a ``num_cpus=0`` actor
to ``OMP_NUM_THREADS=1``). The learner's put is Ray's own copy.

Sizes accept KB/MB/GB suffixes as powers of 1024 (``64MB`` = 64 MiB). "GB/s" in the
table is delivered bandwidth, ``bytes * N / seconds / 1e9``, for every method.

Writes JSON (``--out``, default ``benchmarks/results/broadcast.json``; ``--quick``
defaults to ``broadcast_quick.json`` so it does not overwrite a full run) and a PNG plot
next to it (``--plot`` to override); ``--replot JSON`` only redraws and reprints.

    .venv/bin/python benchmarks/broadcast.py --quick        # ~1 min on an idle machine
    .venv/bin/python benchmarks/broadcast.py                # 64MB,256MB,1GB x N=1,4
    .venv/bin/python benchmarks/broadcast.py --sizes 128MB --receivers 1 2 8 --repeats 5
    .venv/bin/python benchmarks/broadcast.py --replot benchmarks/results/broadcast.json
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
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

import raysync  # noqa: E402
from raysync import WeightHub, WeightReceiver  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
METHODS = ("raysync", "baseline", "floor")
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

    def ready(self) -> str:
        """Where this worker imported raysync from (must be where the driver did)."""
        import raysync

        return str(Path(raysync.__file__).parent)

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


def _proc_stat() -> tuple[int, int]:
    """(total, busy) clock ticks of all cores since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])  # guest time is already counted in user
    return total, total - fields[3] - fields[4]  # minus idle and iowait


def _proc_ticks(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime ticks) of one process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[11]) + int(fields[12])


class CpuMeter:
    """Splits the machine's CPU time into this benchmark's process tree (the driver, and
    Ray's raylet, hub and receivers, all started under it) and everything else. The
    machine may be shared; another job's CPU use during a sample skews every method."""

    def __init__(self) -> None:
        self.available = os.path.exists("/proc/stat")

    def snapshot(self, pids: set[int] | None = None):
        """(total, busy, mine, pids) now; ``pids`` defaults to the current process tree."""
        if not self.available:
            return None
        procs = {}
        for entry in os.listdir("/proc") if pids is None else pids:
            if isinstance(entry, int) or entry.isdigit():
                info = _proc_ticks(int(entry))
                if info is not None:
                    procs[int(entry)] = info
        if pids is None:
            pids, frontier = {os.getpid()}, [os.getpid()]
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in procs.items():
                children.setdefault(ppid, []).append(pid)
            while frontier:
                kids = children.get(frontier.pop(), [])
                pids.update(kids)
                frontier.extend(kids)
        total, busy = _proc_stat()
        return total, busy, {p: procs[p][1] for p in pids if p in procs}, pids

    def foreign(self, before, after) -> float | None:
        """Fraction of all cores that processes outside the tree used between snapshots."""
        if before is None or after is None or after[0] <= before[0]:
            return None
        mine = sum(t - before[2][p] for p, t in after[2].items() if p in before[2])
        return max(0.0, (after[1] - before[1] - mine) / (after[0] - before[0]))

    def busy(self, interval_s: float) -> float | None:
        """Fraction of all cores busy (anyone's) over ``interval_s``."""
        if not self.available:
            time.sleep(interval_s)
            return None
        total0, busy0 = _proc_stat()
        time.sleep(interval_s)
        total1, busy1 = _proc_stat()
        return (busy1 - busy0) / max(1, total1 - total0)

    def wait_quiet(self, threshold: float, timeout_s: float) -> float | None:
        """Wait (up to ``timeout_s``) until at most ``threshold`` of the CPU is busy;
        returns the last reading."""
        deadline = time.monotonic() + timeout_s
        busy = self.busy(0.25)
        while busy is not None and busy > threshold and time.monotonic() < deadline:
            busy = self.busy(0.25)
        return busy


METER = CpuMeter()


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def wait_for_memory(needed: int, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for ``needed`` bytes plus 2 GiB of headroom to be free:
    Ray's memory monitor kills workers near the limit, whoever else uses the memory."""
    deadline = time.monotonic() + timeout_s
    free = mem_available()
    while free is not None and free < needed + 2**31 and time.monotonic() < deadline:
        time.sleep(1.0)
        free = mem_available()
    if free is not None and free < needed + 2**31:
        print(
            f"warning: {free / 2**30:.1f} GiB available, this cell wants about "
            f"{needed / 2**30:.1f} GiB; Ray's memory monitor may kill receivers",
            flush=True,
        )


def check_landed(receivers, value: int, method: str) -> None:
    for probe in ray.get([r.probe.remote() for r in receivers]):
        if any(v != value for v in probe):
            bad = sorted(set(probe) - {value})[:3]
            raise RuntimeError(f"{method}: a receiver holds {bad}, expected version tag {value}")


def run_cell(cell: Cell, args: argparse.Namespace, weights: dict[str, torch.Tensor], spec):
    """Start a hub and N receivers; time floor, raysync and baseline; tear them down."""
    threads = args.receiver_threads or max(1, (os.cpu_count() or 1) // cell.n)
    hub = WeightHub.remote(transport="object_store")
    receivers = [BenchReceiver.remote(hub, spec, threads) for _ in range(cell.n)]
    floor = Floor(cell.size)
    try:
        mine = str(Path(raysync.__file__).parent)
        for theirs in ray.get([r.ready.remote() for r in receivers]):
            if theirs != mine:
                raise RuntimeError(f"receivers import raysync from {theirs}, the driver {mine}")
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        noise: dict[str, list[dict]] = {m: [] for m in METHODS}
        report_seconds: list[float] = []
        counter = 0
        last_report_seconds = 0.0

        def one(method: str) -> float:
            nonlocal counter, last_report_seconds
            if method == "floor":
                elapsed = floor.run(cell.n)
            else:
                counter += 1
                tag(weights, counter)
                if method == "raysync":
                    t0 = time.perf_counter()
                    report = ray.get(hub.broadcast.remote(weights, model="m"))
                    elapsed = time.perf_counter() - t0
                    if len(report.acked) != cell.n or report.bytes != cell.size:
                        raise RuntimeError(f"raysync report is off: {report}")
                    last_report_seconds = report.seconds
                else:
                    t0 = time.perf_counter()
                    ref = ray.put(weights)
                    ray.get([r.apply_baseline.remote([ref]) for r in receivers])
                    elapsed = time.perf_counter() - t0
                    del ref
                check_landed(receivers, counter, method)
            return elapsed

        def timed(method: str) -> None:
            """One sample, taken when the machine is quiet; retaken (up to --retries
            times) if other processes used more than --max-foreign of the CPU during it,
            keeping the attempt they disturbed least."""
            attempts = []
            for _ in range(args.retries + 1):
                busy = METER.wait_quiet(args.quiet_threshold, args.sample_quiet_timeout_s)
                before = METER.snapshot()
                elapsed = one(method)
                foreign = METER.foreign(before, METER.snapshot(before[3] if before else None))
                attempts.append((foreign or 0.0, elapsed, busy, foreign, last_report_seconds))
                if foreign is None or foreign <= args.max_foreign:
                    break
            _, elapsed, busy, foreign, reported = min(attempts, key=lambda a: a[0])
            samples[method].append(elapsed)
            noise[method].append(
                dict(busy_before=busy, foreign_during=foreign, attempts=len(attempts))
            )
            if method == "raysync":
                report_seconds.append(reported)

        for method in METHODS:
            for _ in range(args.warmup):
                one(method)
        busy = METER.wait_quiet(args.quiet_threshold, args.quiet_timeout_s)
        for k in range(args.repeats):
            # rotate the order so no method always runs first (or right after another)
            for method in METHODS[k % 3 :] + METHODS[: k % 3]:
                timed(method)
        return samples, noise, report_seconds, threads, busy
    finally:
        for r in receivers:
            ray.kill(r)
        ray.kill(hub.actor)


# -- output -----------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    print()
    print("GB/s = size_bytes * N / seconds / 1e9 (bytes delivered to receivers per second)")
    header = (
        f"{'method':<9} {'MB':>7} {'tensors':>7} {'N':>3} {'seconds':>9} {'GB/s':>7} {'x floor':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        gbps = row["size_bytes"] * row["n_receivers"] / row["seconds"] / 1e9
        print(
            f"{row['method']:<9} {row['size_bytes'] / 2**20:>7g} {row['n_tensors']:>7} "
            f"{row['n_receivers']:>3} {row['seconds']:>9.4f} {gbps:>7.2f} "
            f"{row['ratio_to_floor']:>8.2f}"
        )
    sys.stdout.flush()


def plot(rows: list[dict], tensor_counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"raysync": "tab:blue", "baseline": "tab:orange", "floor": "tab:gray"}
    ns = sorted({r["n_receivers"] for r in rows})
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(
        1, len(tensor_counts), figsize=(6.5 * len(tensor_counts), 5), squeeze=False
    )
    for ax, n_tensors in zip(axes[0], tensor_counts, strict=True):
        for method in METHODS:
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
        ticks = sorted({r["size_bytes"] / 2**20 for r in rows})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("broadcast size (MiB)")
        ax.set_ylabel("seconds (median, learner wall time)")
        ax.set_title(f"{n_tensors}-tensor float32 state_dict")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("raysync object_store vs hand-written ray.put vs (N+1) memcpy floor")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_head(path: Path) -> str | None:
    """The commit checked out where ``path`` lives, with ``-dirty`` for local changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


# -- main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, help="default: 64MB 256MB 1GB")
    p.add_argument("--receivers", nargs="+", type=int, help="N values; default: 1 4")
    p.add_argument("--tensors", nargs="+", type=int, help="tensor counts; default: 16 1000")
    p.add_argument("--warmup", type=int, help="untimed runs per method and cell; default 1")
    p.add_argument("--repeats", type=int, help="timed runs per method and cell; default 3")
    p.add_argument("--quick", action="store_true", help="16MB, N=1 2, 1 repeat (~1 min)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/broadcast.json)")
    p.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the plot and reprint the table of an earlier run's JSON",
    )
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
    p.add_argument(
        "--settle-s",
        type=float,
        help="after a cell, wait up to this long for the machine to go quiet "
        "(default 10; --quick: 2)",
    )
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.25,
        help="'quiet': at most this fraction of all cores busy",
    )
    p.add_argument(
        "--quiet-timeout-s",
        type=float,
        help="longest wait for quiet before a cell's timed runs (default 60; --quick: 5)",
    )
    p.add_argument(
        "--sample-quiet-timeout-s",
        type=float,
        help="longest wait for quiet before each timed sample (default 5; --quick: 1)",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="retake a sample if other processes used more of the CPU than this",
    )
    p.add_argument("--retries", type=int, help="retakes per sample at most (default 2; --quick: 0)")
    args = p.parse_args(argv)
    quick = {
        "sizes": [16 * 2**20],
        "receivers": [1, 2],
        "tensors": [16, 1000],
        "warmup": 1,
        "repeats": 1,
        "settle_s": 2.0,
        "quiet_timeout_s": 5.0,
        "sample_quiet_timeout_s": 1.0,
        "retries": 0,
    }
    full = {
        "sizes": [64 * 2**20, 256 * 2**20, 2**30],
        "receivers": [1, 4],
        "tensors": [16, 1000],
        "warmup": 1,
        "repeats": 3,
        "settle_s": 10.0,
        "quiet_timeout_s": 60.0,
        "sample_quiet_timeout_s": 5.0,
        "retries": 2,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = RESULTS_DIR / ("broadcast_quick.json" if args.quick else "broadcast.json")
    if args.plot is None:
        args.plot = (args.replot or args.out).with_suffix(".png")
    if args.repeats < 1 or args.warmup < 0 or min(args.receivers) < 1:
        p.error("need --repeats >= 1, --warmup >= 0 and N >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        data = json.loads(args.replot.read_text())
        plot(data["rows"], data["config"]["tensor_counts"], args.plot)
        print_table(data["rows"])
        print(f"\nwrote {args.plot}")
        return 0
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
        # always a fresh local instance: ray.init() alone would join a cluster that
        # `ray start` left running on this machine (and refuse num_cpus)
        address="local",
        num_cpus=16,
        include_dashboard=False,
        object_store_memory=int(args.object_store_gb * 2**30),
        runtime_env={"env_vars": {ZERO_COPY_ENV: "1"}},
        log_to_driver=True,
    )
    rows: list[dict] = []
    errors: list[dict] = []
    receiver_threads: dict[int, int] = {}
    started = time.time()
    order = {m: i for i, m in enumerate(("floor", "raysync", "baseline"))}

    def write(complete: bool) -> None:
        """Written after every cell, so a run that dies part-way keeps what it measured."""
        rows.sort(
            key=lambda r: (r["n_tensors"], r["n_receivers"], r["size_bytes"], order[r["method"]])
        )
        result = {
            "complete": complete,
            "config": {
                "sizes_bytes": sizes,
                "receivers": ns,
                "tensor_counts": tensor_counts,
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
                "noise_control": {
                    "quiet_threshold": args.quiet_threshold,
                    "max_foreign": args.max_foreign,
                    "retries": args.retries,
                },
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "ray": ray.__version__,
                "torch": torch.__version__,
            },
            "raysync": {
                "module": str(Path(raysync.__file__).parent),
                "git_head": git_head(Path(raysync.__file__).parent),
            },
            "argv": sys.argv[1:],
            "total_seconds": time.time() - started,
            "errors": errors,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    try:
        for size in sizes:
            for n_tensors in tensor_counts:
                spec = layout(size, n_tensors)
                weights = make_state_dict(spec, fill=1.0)
                for n in ns:
                    cell = Cell(size, n, n_tensors)
                    # the driver holds the weights and the floor's two buffers; each receiver
                    # its model; the object store up to two versions (raysync's, baseline's)
                    wait_for_memory(size * (n + 4), args.quiet_timeout_s)
                    for attempt in range(2):
                        try:
                            samples, noise, report_seconds, threads, busy = run_cell(
                                cell, args, weights, spec
                            )
                            break
                        except ray.exceptions.RayError as err:
                            # typically Ray's memory monitor killing a receiver on a busy host
                            errors.append(
                                dict(
                                    size_bytes=size,
                                    n_receivers=n,
                                    n_tensors=n_tensors,
                                    attempt=attempt,
                                    error=f"{type(err).__name__}: {err}"[:2000],
                                )
                            )
                            print(
                                f"cell {fmt_size(size)} {n_tensors} tensors N={n} failed "
                                f"({type(err).__name__}); "
                                + ("retrying" if attempt == 0 else "skipping"),
                                flush=True,
                            )
                            METER.wait_quiet(args.quiet_threshold, args.settle_s)
                    else:
                        continue
                    receiver_threads[n] = threads
                    floor_s = median(samples["floor"])
                    for method in METHODS:
                        sec = median(samples[method])
                        row = dict(
                            method=method,
                            size_bytes=size,
                            n_receivers=n,
                            n_tensors=n_tensors,
                            seconds=sec,
                            samples=samples[method],
                            ratio_to_floor=sec / floor_s,
                            floor_seconds=floor_s,
                            cpu_busy_before_cell=busy,
                            noise=noise[method],
                        )
                        if method == "raysync":
                            row["hub_report_seconds"] = report_seconds
                        rows.append(row)
                    print(
                        f"[{time.time() - started:6.1f}s] {fmt_size(size)} {n_tensors} tensors "
                        f"N={n}: floor {floor_s:.4f}s, "
                        f"raysync {median(samples['raysync']):.4f}s "
                        f"({median(samples['raysync']) / floor_s:.2f}x), "
                        f"baseline {median(samples['baseline']):.4f}s "
                        f"({median(samples['baseline']) / floor_s:.2f}x)"
                        + ("" if busy is None else f"  [cpu busy before: {busy:.0%}]"),
                        flush=True,
                    )
                    write(complete=False)
                    METER.wait_quiet(args.quiet_threshold, args.settle_s)
                del weights
                gc.collect()  # the cell's floor buffers and actors are gone too
    finally:
        ray.shutdown()

    write(complete=not errors)
    plot(rows, tensor_counts, args.plot)
    print_table(rows)
    if errors:
        print(f"\n{len(errors)} failed cell attempt(s); see 'errors' in {args.out}")
    print(f"\nwrote {args.out} and {args.plot} in {time.time() - started:.0f}s")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
