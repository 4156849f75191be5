"""The command line of ``benchmarks/broadcast.py``: its flags, and the defaults of a full
run and of ``--quick`` for those left out."""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any

import broadcast_bench
from broadcast_bench.names import VARIANTS, bench_transports
from broadcast_bench.units import GiB, MiB, parse_size

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

#: Defaults of ``--quick`` for the flags left out: small models, N=1 2, one repeat.
QUICK_DEFAULTS: dict[str, Any] = {
    "sizes": [4 * MiB, 16 * MiB],
    "receivers": [1, 2],
    "tensors": [16],
    "warmup": 3,
    "repeats": 1,
    "settle_s": 2.0,
    "quiet_timeout_s": 5.0,
    "sample_quiet_timeout_s": 1.0,
    "retries": 0,
}
#: Defaults of a full run for the flags left out.
FULL_DEFAULTS: dict[str, Any] = {
    "sizes": [64 * MiB, 256 * MiB, GiB],
    "receivers": [1, 2, 4, 8],
    "tensors": [16],
    "warmup": 3,
    "repeats": None,  # by size, see cells.default_repeats
    "settle_s": 10.0,
    "quiet_timeout_s": 60.0,
    "sample_quiet_timeout_s": 5.0,
    "retries": 2,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=broadcast_bench.__doc__.split("\n\n")[0])
    p.add_argument(
        "--transports",
        nargs="+",
        choices=bench_transports(),
        help="default: every transport available here, and each one's variants ("
        + ", ".join(VARIANTS)
        + ")",
    )
    p.add_argument("--sizes", nargs="+", type=parse_size, help="default: 64MB 256MB 1GB")
    p.add_argument("--receivers", nargs="+", type=int, help="N values; default: 1 2 4 8")
    p.add_argument("--tensors", nargs="+", type=int, help="tensor counts; default: 16")
    p.add_argument("--warmup", type=int, help="untimed runs per method and cell; default 3")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed runs per method and cell; default by size: 5 up to 64 MB, 3 up to "
        "256 MB, 2 above",
    )
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the hand-written ray.put baseline in object_store cells (default: yes)",
    )
    p.add_argument("--quick", action="store_true", help="4MB 16MB, N=1 2, 1 repeat (~5 min)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/broadcast.json)")
    p.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the plot and reprint the tables of an earlier run's JSON",
    )
    p.add_argument("--object-store-gb", type=float, default=6.0)
    p.add_argument(
        "--memory-reserve-gb",
        type=float,
        default=2.5,
        help="skip a cell whose estimate does not fit in MemAvailable minus this",
    )
    p.add_argument(
        "--call-timeout-s",
        type=float,
        default=300.0,
        help="longest wait for any one call to the actors (a hang fails the cell)",
    )
    p.add_argument(
        "--cell-timeout-s",
        type=float,
        default=1800.0,
        help="longest a cell's process may run before it is killed (and the cell failed)",
    )
    p.add_argument("--cell", type=Path, help=argparse.SUPPRESS)  # internal: run one cell
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
        help="longest wait for quiet (and for memory) before a cell's timed runs "
        "(default 60; --quick: 5)",
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
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the quick or full defaults filled in where left out."""
    p = build_parser()
    args = p.parse_args(argv)
    for key, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, copy.copy(value))
    if args.out is None:
        args.out = RESULTS_DIR / ("broadcast_quick.json" if args.quick else "broadcast.json")
    if args.plot is None:
        args.plot = (args.replot or args.out).with_suffix(".png")
    if (args.repeats is not None and args.repeats < 1) or args.warmup < 0:
        p.error("need --repeats >= 1 and --warmup >= 0")
    if min(args.receivers) < 1 or min(args.tensors) < 1:
        p.error("need N >= 1 and tensor counts >= 1")
    return args
