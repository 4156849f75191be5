"""What a large copy leaves behind in the learner: torch's ``copy_`` against raysync's
``copy_all``, each timed alone in this process, then the process's CPU over the next
20 ms (GNU OpenMP's workers spin-wait after a parallel region unless
``OMP_WAIT_POLICY=PASSIVE``; ``copy_all`` runs on its own threads).

    .venv/bin/python benchmarks/omp_spin.py --out benchmarks/results/omp_spin.json

Prints one line per (size, copy) and writes the medians as JSON, with a PNG beside it
(see docs/latency.md, "raysync's own copies leave no thread spinning").
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from broadcast_bench.environment import recorded_environment

from raysync.copies import copy_all
from raysync.spec import WeightSpec

#: The CPU this process burns in this long after a copy is what it left spinning.
AFTER_S = 0.02
#: Idle time before each copy, so that no spin from the previous one is left.
SETTLE_S = 0.3


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(copy: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median ms of the copy, and of the CPU burnt in the ``AFTER_S`` after it."""
    walls, after = [], []
    for _ in range(repeats):
        time.sleep(SETTLE_S)
        started = time.perf_counter()
        copy()
        walls.append(time.perf_counter() - started)
        cpu = _cpu_s()
        time.sleep(AFTER_S)
        after.append(_cpu_s() - cpu)
    return {
        "copy_ms": statistics.median(walls) * 1e3,
        "cpu_after_ms": statistics.median(after) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 1024], help="MiB")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        source = torch.ones(size << 18)
        destination = torch.empty_like(source)
        destination.copy_(source)  # its pages touched
        spec = WeightSpec.of({"w": source})
        copies: dict[str, Callable[[], object]] = {
            "torch copy_": functools.partial(destination.copy_, source),
            "copy_all": functools.partial(copy_all, [destination], [source], spec),
        }
        for name, copy in copies.items():
            row = {"size_mib": size, "copy": name, **measure(copy, args.repeats)}
            print(
                f"{size} MiB, {name}: {row['copy_ms']:.2f} ms, then "
                f"{row['cpu_after_ms']:.1f} ms of CPU in {AFTER_S * 1e3:g} ms"
            )
            rows.append(row)
    if args.out:
        env = recorded_environment()
        result = {"rows": rows, "threads": torch.get_num_threads(), "env": env}
        args.out.write_text(json.dumps(result, indent=1))
        _plot(rows, args.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    """Per size, each copy's time and the CPU it left spinning, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [f"{r['size_mib']} MiB\n{r['copy']}" for r in rows]
    for ax, key, title in (
        (axes[0], "copy_ms", "the copy, ms"),
        (axes[1], "cpu_after_ms", f"CPU in the {AFTER_S * 1e3:g} ms after it, ms"),
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.suptitle("A large copy in the learner: torch's copy_ against raysync's copy_all")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
