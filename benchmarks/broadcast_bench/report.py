"""What a run reports: its rows (one per method and cell, or one per skipped cell), the
JSON document they are written in, the per-row table, the README's Markdown tables and,
with the targets and the plot, everything printed at the end of a run (or by ``--replot``)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch

import raysync
from broadcast_bench.names import METHOD_ORDER, hub_transport, transport_rank
from broadcast_bench.plot import plot
from broadcast_bench.targets import check_targets, print_targets
from broadcast_bench.units import DTYPE, GiB, MiB, fmt_size

if TYPE_CHECKING:
    from broadcast_bench.cells import Cell, CellResult
    from broadcast_bench.plan import RunPlan


# -- rows ---------------------------------------------------------------------------------
def cell_rows(cell: Cell, result: CellResult, estimate: int, peak: int | None) -> list[dict]:
    """One row per method of a measured cell: its median and ratios, samples and noise."""
    floor_s = statistics.median(result.samples["floor"])
    raw_s = statistics.median(result.samples["raw_read"]) if "raw_read" in result.samples else None
    rows = []
    for method in result.methods:
        sec = statistics.median(result.samples[method])
        row = dict(
            transport=cell.transport,
            method=method,
            size_bytes=cell.size,
            n_receivers=cell.n,
            n_tensors=cell.n_tensors,
            seconds=sec,
            samples=result.samples[method],
            ratio_to_floor=sec / floor_s,
            floor_seconds=floor_s,
        )
        if raw_s is not None:
            row.update(ratio_to_raw_read=sec / raw_s, raw_read_seconds=raw_s)
        if method == "raysync":
            row["hub_report_seconds"] = result.report_seconds
        row.update(
            receiver_threads=result.threads,
            cpu_busy_before_cell=result.busy[method],
            own_cpu_while_idle=result.own_idle[method],
            memory_estimate_bytes=estimate,
            memory_peak_bytes=peak,
            cell_seconds=result.seconds,
            cell_setup_seconds=result.setup_seconds,
            noise=result.noise[method],
        )
        rows.append(row)
    return rows


def skipped_row(cell: Cell, reason: str, estimate: int) -> dict:
    """The one row of a cell that was not measured, saying why."""
    return dict(
        transport=cell.transport,
        method="raysync",
        size_bytes=cell.size,
        n_receivers=cell.n,
        n_tensors=cell.n_tensors,
        skipped=reason,
        memory_estimate_bytes=estimate,
    )


def row_key(row: dict) -> tuple:
    """Rows sort by tensors, N, size, transport (registry order), method."""
    return (
        row["n_tensors"],
        row["n_receivers"],
        row["size_bytes"],
        transport_rank(row["transport"]),
        METHOD_ORDER.index(row["method"]),
    )


def load_rows(data: dict) -> list[dict]:
    """The rows of a JSON this benchmark wrote; runs from before it covered every transport
    measured object_store only and have no ``transport`` field."""
    rows = data["rows"]
    for row in rows:
        row.setdefault("transport", "object_store")
    return rows


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "skipped" not in r]


# -- the JSON document ----------------------------------------------------------------------
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


def result_document(
    args: argparse.Namespace,
    plan: RunPlan,
    rows: list[dict],
    errors: list[dict],
    total_seconds: float,
    complete: bool,
) -> dict:
    """The JSON a run writes (rewritten after every cell, ``complete`` at the end)."""
    return {
        "complete": complete,
        "config": {
            "transports": plan.transports,
            "unavailable": plan.unavailable,
            "sizes_bytes": plan.sizes,
            "receivers": plan.receivers,
            "tensor_counts": plan.tensor_counts,
            "dtype": str(DTYPE),
            "warmup": args.warmup,
            "repeats": plan.repeats,
            "statistic": "median of the timed repeats",
            "floor": "(N+1) x dst.copy_(src) of one flat buffer in one process, measured "
            "inside each cell (so its n_tensors is the cell's, not the floor's layout)",
            "raw_read": "nixl cells: N receivers each post one prepared NIXL (UCX) READ "
            "of the floor's source buffer, registered in the learner, into their "
            "model's registered flat buffer; from the calls until the last is done",
            "phases": "per cell, the floors first (no hub yet), then the transport "
            "(and the baseline); each cell in a fresh learner process",
            "baseline": "object_store cells: one ray.put of the state_dict as NumPy "
            "views, each receiver ray.get + copy_ into its tensors",
            "ratio_to_floor": "seconds / the floor's median in the same cell",
            "ratio_to_raw_read": "nixl cells: seconds / the raw READ's median in the same cell",
            "floor_threads": args.floor_threads,
            "object_store_memory_bytes": int(args.object_store_gb * GiB),
            "memory_reserve_bytes": int(args.memory_reserve_gb * GiB),
            "gbps_definition": "size_bytes * n_receivers / seconds / 1e9",
            "noise_control": {
                "quiet_threshold": args.quiet_threshold,
                "max_foreign": args.max_foreign,
                "retries": args.retries,
            },
        },
        "machine": {
            "cpus": os.cpu_count(),
            "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
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
        "total_seconds": total_seconds,
        "errors": errors,
        "targets": check_targets(rows),
        "rows": rows,
    }


# -- tables ---------------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    """Every row: seconds, delivered GB/s and the ratios to the floors."""
    print()
    print("GB/s = size_bytes * N / seconds / 1e9 (bytes delivered to receivers per second)")
    header = (
        f"{'transport':<13} {'method':<9} {'MB':>6} {'tensors':>7} {'N':>2} {'seconds':>9} "
        f"{'GB/s':>6} {'x floor':>7} {'x READ':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in sorted(rows, key=row_key):
        head = (
            f"{row['transport']:<13} {row['method']:<9} {row['size_bytes'] / MiB:>6g} "
            f"{row['n_tensors']:>7} {row['n_receivers']:>2}"
        )
        if "skipped" in row:
            print(f"{head} skipped: {row['skipped']}")
            continue
        gbps = row["size_bytes"] * row["n_receivers"] / row["seconds"] / 1e9
        raw = row.get("ratio_to_raw_read")
        print(
            f"{head} {row['seconds']:>9.4f} {gbps:>6.2f} {row['ratio_to_floor']:>7.2f} "
            + (f"{raw:>6.2f}" if raw is not None else f"{'':>6}")
        )
    sys.stdout.flush()


def markdown_table(rows: list[dict]) -> str:
    """Ratio to the floor per transport, N and size (per tensor count): the README table;
    and for nixl, the ratio to the raw READ."""
    lines = []
    sizes = sorted({r["size_bytes"] for r in rows})
    by_key = {}
    for r in measured(rows):
        by_key[(r["n_tensors"], r["n_receivers"], r["size_bytes"], r["transport"], r["method"])] = r
    skipped = {
        (r["n_tensors"], r["n_receivers"], r["size_bytes"], r["transport"])
        for r in rows
        if "skipped" in r
    }
    transports = sorted({r["transport"] for r in rows}, key=transport_rank)
    for n_tensors in sorted({r["n_tensors"] for r in rows}):
        lines.append(
            f"\n{n_tensors}-tensor float32 model: raysync's time / the floor's "
            "(N+1 memcpys) in the same cell; floor row in seconds"
        )
        lines.append("| transport | N | " + " | ".join(fmt_size(s) for s in sizes) + " |")
        lines.append("|---|---|" + "---|" * len(sizes))
        for n in sorted({r["n_receivers"] for r in rows if r["n_tensors"] == n_tensors}):
            floors = []
            for s in sizes:
                fs = [
                    r["floor_seconds"]
                    for r in measured(rows)
                    if (r["n_tensors"], r["n_receivers"], r["size_bytes"]) == (n_tensors, n, s)
                    and r["method"] == "floor"
                ]
                floors.append(f"{statistics.median(fs):.3f} s" if fs else "")
            lines.append(f"| floor | {n} | " + " | ".join(floors) + " |")
            entries = [(t, "raysync", t) for t in transports]
            if any(r["method"] == "baseline" for r in rows):
                entries.insert(1, ("object_store", "baseline", "ray.put by hand"))
            if "nixl" in transports:
                entries.append(("nixl", "raw_read", "raw NIXL READ"))
            for transport, method, label in entries:
                cells = []
                for s in sizes:
                    r = by_key.get((n_tensors, n, s, transport, method))
                    if r is not None:
                        cells.append(f"{r['ratio_to_floor']:.2f}")
                    elif (n_tensors, n, s, transport) in skipped:
                        cells.append("skipped")
                    else:
                        cells.append("")
                lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
        nixl_modes = [t for t in transports if hub_transport(t) == "nixl"]
        if nixl_modes:
            lines.append(
                f"\n{n_tensors}-tensor model: nixl's time / the raw NIXL READ's in the same cell"
            )
            lines.append("| mode | N | " + " | ".join(fmt_size(s) for s in sizes) + " |")
            lines.append("|---|---|" + "---|" * len(sizes))
            for mode in nixl_modes:
                for n in sorted({r["n_receivers"] for r in rows if r["n_tensors"] == n_tensors}):
                    cells = []
                    for s in sizes:
                        r = by_key.get((n_tensors, n, s, mode, "raysync"))
                        cells.append(f"{r['ratio_to_raw_read']:.2f}" if r else "")
                    lines.append(f"| {mode} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[dict], plot_path: Path) -> list[dict]:
    """Draw the plot, print the tables and the targets' verdicts (returned)."""
    plot(rows, plot_path)
    print_table(rows)
    print(markdown_table(rows))
    targets = check_targets(rows)
    print_targets(targets)
    return targets
