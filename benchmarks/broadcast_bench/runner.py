"""The run: parse the command line, start one Ray instance, measure the cells one after
another (each in its own learner process, skipped when it does not fit in memory or fails
twice), rewrite the JSON after every cell and report at the end; or, with ``--replot``,
only report an earlier run."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray

from broadcast_bench.cell_process import run_cell_job, run_cell_process
from broadcast_bench.cells import Cell, cell_methods
from broadcast_bench.cli import parse_args
from broadcast_bench.machine import METER, MemoryWatch
from broadcast_bench.memory import memory_estimate, wait_for_memory
from broadcast_bench.plan import RunPlan, choose_transports, plan_run
from broadcast_bench.report import (
    cell_rows,
    load_rows,
    report,
    result_document,
    row_key,
    skipped_row,
)
from broadcast_bench.units import GiB, fmt_size

#: CPUs the run's Ray instance declares (actors are num_cpus=0; this only has to be enough).
RAY_NUM_CPUS = 16


def measure_cell(
    cell: Cell,
    args: argparse.Namespace,
    workdir: Path,
    errors: list[dict],
    progress: Callable[[], str],
) -> list[dict]:
    """The rows of one cell: measured, or one row saying why it was skipped. A failed
    cell is tried once more; its errors go to ``errors``. Prints one progress line,
    starting with ``progress()``."""
    started = time.monotonic()
    estimate = memory_estimate(cell, cell_methods(cell, args.baseline))
    reason = wait_for_memory(estimate, int(args.memory_reserve_gb * GiB), args.quiet_timeout_s)
    if reason is not None:
        print(f"{progress()}{cell.describe()}: skipped, {reason}", flush=True)
        return [skipped_row(cell, reason, estimate)]
    for attempt in range(2):
        try:
            with MemoryWatch() as watch:
                result = run_cell_process(cell, args, workdir)
            break
        except RuntimeError as err:
            errors.append(
                dict(
                    transport=cell.transport,
                    size_bytes=cell.size,
                    n_receivers=cell.n,
                    n_tensors=cell.n_tensors,
                    attempt=attempt,
                    error=str(err),
                    traceback=getattr(err, "traceback", None),
                )
            )
            print(
                f"{progress()}{cell.describe()} failed ({str(err)[:300]}); "
                + ("retrying" if attempt == 0 else "skipping"),
                flush=True,
            )
            METER.wait_quiet(args.quiet_threshold, args.settle_s)
    else:
        return [skipped_row(cell, f"failed twice: {errors[-1]['error']}", estimate)]
    rows = cell_rows(cell, result, estimate, watch.peak)
    parts = [
        f"{r['method']} {r['seconds']:.4f}s"
        + ("" if r["method"] == "floor" else f" ({r['ratio_to_floor']:.2f}x)")
        for r in rows
    ]
    if "raw_read" in result.methods:
        (mine,) = [r for r in rows if r["method"] == "raysync"]
        parts.append(f"nixl/READ {mine['ratio_to_raw_read']:.2f}x")
    busy = result.busy["raysync"]
    extra = [] if busy is None else [f"cpu busy before {busy:.0%}"]
    own_idle = result.own_idle["raysync"]
    if own_idle is not None and own_idle > 0.1:
        cores = own_idle * (os.cpu_count() or 1)
        extra.append(f"connected, its processes keep {cores:.1f} cores busy")
    if watch.peak is not None:
        extra.append(f"mem peak {watch.peak / GiB:.1f} GiB, est {estimate / GiB:.1f}")
    print(
        f"{progress()}{cell.describe()} ({time.monotonic() - started:.0f}s): "
        + ", ".join(parts)
        + (f"  [{'; '.join(extra)}]" if extra else ""),
        flush=True,
    )
    return rows


def run(args: argparse.Namespace, plan: RunPlan) -> int:
    """Measure every cell of ``plan`` in one Ray instance, writing the JSON after each."""
    cells = plan.cells()
    print(
        f"transports={plan.transports} sizes={[fmt_size(s) for s in plan.sizes]} "
        f"N={plan.receivers} tensors={plan.tensor_counts} warmup={args.warmup} "
        f"repeats={plan.repeats} floor_threads={args.floor_threads} cpus={os.cpu_count()}: "
        f"{len(cells)} cells",
        flush=True,
    )
    ray.init(
        # always a fresh local instance: ray.init() alone would join a cluster that
        # `ray start` left running on this machine (and refuse num_cpus)
        address="local",
        num_cpus=RAY_NUM_CPUS,
        include_dashboard=False,
        object_store_memory=int(args.object_store_gb * GiB),
        log_to_driver=True,
    )
    rows: list[dict] = []
    errors: list[dict] = []
    started = time.time()

    def write(complete: bool) -> None:
        """Written after every cell, so a run that dies part-way keeps what it measured."""
        rows.sort(key=row_key)
        document = result_document(
            args, plan, rows, errors, total_seconds=time.time() - started, complete=complete
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")

    def progress(index: int) -> Callable[[], str]:
        return lambda: f"[{time.time() - started:6.0f}s] {index}/{len(cells)} "

    try:
        with tempfile.TemporaryDirectory(prefix="raysync-bench-") as workdir:
            for index, cell in enumerate(cells, 1):
                rows.extend(measure_cell(cell, args, Path(workdir), errors, progress(index)))
                write(complete=False)
                METER.wait_quiet(args.quiet_threshold, args.settle_s)
    finally:
        ray.shutdown()

    write(complete=not errors)
    report(rows, args.plot)
    if errors:
        print(f"\n{len(errors)} failed cell attempt(s); see 'errors' in {args.out}")
    print(f"\nwrote {args.out} and {args.plot} in {time.time() - started:.0f}s")
    return 0 if not errors else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell is not None:
        return run_cell_job(args.cell)
    if args.replot is not None:
        rows = load_rows(json.loads(args.replot.read_text()))
        report(rows, args.plot)
        print(f"\nwrote {args.plot}")
        return 0
    transports, unavailable = choose_transports(args)
    for name, reason in unavailable.items():
        print(f"warning: transport {name} is not available here, left out: {reason}")
    if not transports:
        print("no transport to run")
        return 2
    return run(args, plan_run(args, transports, unavailable))
