"""The learner's object-store put of a version of many tensors: one ``ray.put`` against
``put_version`` (one put per copy thread), by tensor count and size.

Ray copies each out-of-band buffer of up to 1 MiB on the thread that puts, so a version
of 1000 small tensors is written by one core; ``put_version`` splits such a version in
runs put at the same time (``raysync/transports/object_store/arrays.py``). Each cell
first puts until this process's page tables cover the store (three puts in a row that
did not fault: ``VersionPuts`` splits only then), then alternates the two for
``--rounds`` rounds of ``--loops`` puts, the last half of each round counted, two
versions alive at a time as in a broadcast, with the page faults per counted put (a
store of 6 GiB: a put can still reach a region this process never touched). Writes JSON
and a PNG.

With ``--cold N``, a cell first puts N versions one way and N the other, alternating,
every one kept alive so that each lands on pages this process never wrote: one object
with its arrays in 1 MiB chunks (``put_arrays``) against whole (``chunked=False``,
which ``VersionPuts`` uses while cold); the median ms of the puts that were cold
(``cold()`` of their page faults), and how many were. Only the first cell of a run
finds the store untouched: one cell per run.

    python benchmarks/put_threads.py --out benchmarks/results/put_threads.json
    python benchmarks/put_threads.py --cells 16x4194304 --cold 20 --out ...
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

from raysync.transports.object_store.arrays import (
    VersionPuts,
    as_array,
    cold,
    put_arrays,
    put_version,
)

#: (tensor count, bytes per tensor): the shapes measured by default.
_CELLS = ((1000, 64 << 10), (1000, 256 << 10), (2000, 512 << 10), (1000, 1 << 20))


def _median_ms(put, loops: int) -> tuple[float, int]:
    """The median ms of the last half of ``loops`` puts, and their page faults per put
    (0 when this process's page tables already covered what they wrote)."""
    samples, alive = [], []
    for loop in range(loops):
        if loop == loops // 2:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        alive.append(put())
        samples.append(time.perf_counter() - start)
        del alive[:-2]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    counted = samples[loops // 2 :]
    return 1000 * statistics.median(counted), faults // len(counted)


def _warm_up(arrays: list, most: int = 400) -> int:
    """Put (one object each) until three puts in a row did not fault (``VersionPuts``
    would split the next one), at most ``most``; how many it took."""
    puts, warm, alive = VersionPuts(), 0, []
    for count in range(1, most + 1):
        alive.append(puts.put(arrays, threads=1))
        del alive[:-2]
        warm = warm + 1 if puts.warm else 0
        if warm == 3:
            return count
    return most


def _cold_ms(arrays: list, count: int) -> dict[str, float]:
    """Of ``count`` chunked and ``count`` whole puts of ``arrays``, alternating, none
    freed until the end: the median ms of each kind's cold ones, and their number."""
    nbytes = sum(array.nbytes for array in arrays)
    cold_ms: dict[str, list[float]] = {"chunked": [], "whole": []}
    alive = []
    for index in range(2 * count):
        kind = "chunked" if index % 2 == 0 else "whole"
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        alive.append(put_arrays(arrays, chunked=kind == "chunked"))
        elapsed = time.perf_counter() - start
        if cold(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, nbytes):
            cold_ms[kind].append(1000 * elapsed)
    del alive
    row: dict[str, float] = {}
    for kind, samples in cold_ms.items():
        row[f"cold_{kind}_ms"] = statistics.median(samples) if samples else float("nan")
        row[f"cold_{kind}_puts"] = len(samples)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=[f"{n}x{b}" for n, b in _CELLS])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loops", type=int, default=24)
    parser.add_argument("--cold", type=int, default=0, help="cold puts of each kind (0: none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/put_threads.json"))
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=6 << 30)
    rows = []
    try:
        for cell in args.cells:
            count, nbytes = (int(part) for part in cell.split("x"))
            arrays = [as_array(torch.randn(nbytes // 4)) for _ in range(count)]
            cold_row = _cold_ms(arrays, args.cold) if args.cold else {}
            if cold_row:
                print(
                    f"{count} x {nbytes} B, cold: chunked {cold_row['cold_chunked_ms']:.1f} ms "
                    f"({cold_row['cold_chunked_puts']} puts), whole "
                    f"{cold_row['cold_whole_ms']:.1f} ms ({cold_row['cold_whole_puts']} puts)"
                )
            warm_up_puts = _warm_up(arrays)
            for round_ in range(args.rounds):
                one, one_faults = _median_ms(lambda a=arrays: put_arrays(a), args.loops)
                split, split_faults = _median_ms(
                    lambda a=arrays: put_version(a, args.threads), args.loops
                )
                row = {"tensors": count, "tensor_bytes": nbytes, "round": round_}
                row.update(one_put_ms=one, put_version_ms=split, threads=args.threads)
                row.update(one_put_faults=one_faults, put_version_faults=split_faults)
                row.update(warm_up_puts=warm_up_puts, **cold_row)
                rows.append(row)
                print(
                    f"{count} x {nbytes} B: one put {one:.1f} ms ({one_faults} faults), "
                    f"put_version {split:.1f} ms ({split_faults} faults)"
                )
            del arrays
    finally:
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": vars(args) | {"out": str(args.out)}, "rows": rows}))
    _plot(rows, args.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['tensors']} x {r['tensor_bytes'] >> 10} KiB\nround {r['round']}" for r in rows]
    xs = range(len(rows))
    cold = [r for r in rows if "cold_chunked_ms" in r]
    fig, axes = plt.subplots(
        1, 2 if cold else 1, figsize=(max(6, len(rows)) * (1.6 if cold else 1), 4)
    )
    ax = axes[0] if cold else axes
    ax.bar([x - 0.2 for x in xs], [r["one_put_ms"] for r in rows], 0.4, label="one ray.put")
    ax.bar([x + 0.2 for x in xs], [r["put_version_ms"] for r in rows], 0.4, label="put_version")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ms per version (median)")
    ax.set_title("The learner's put of many tensors, warm")
    ax.legend()
    if cold:
        ax = axes[1]
        cx = range(len(cold))
        ax.bar([x - 0.2 for x in cx], [r["cold_chunked_ms"] for r in cold], 0.4, label="chunked")
        ax.bar([x + 0.2 for x in cx], [r["cold_whole_ms"] for r in cold], 0.4, label="whole")
        ax.set_xticks(list(cx), [f"{r['tensors']} x {r['tensor_bytes'] >> 10} KiB" for r in cold])
        ax.set_ylabel("ms per cold put (median)")
        ax.set_title("One put onto pages never written")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
