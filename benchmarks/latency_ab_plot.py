"""Plot ``results/latency_cpu_ab.json``: A/B runs of ``latency_phases.py``.

Each change was measured by running ``latency_phases.py`` (the change's ``command``)
three times on the code before it and three times on the code after, alternating, on
the same machine in the same hour: on two cores the machine's own drift between runs is
as large as most changes, so each run is shown, not only a median. One panel per
change; per run and cell, the wall time (p50) and the CPU every process burnt per
broadcast, and where the cell had one, the shared-memory owner's share.

``python benchmarks/latency_ab_plot.py`` (reads and writes beside
``benchmarks/results/latency_cpu_ab.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).parent / "results" / "latency_cpu_ab.json"


def bars(runs: dict[str, list[list[dict]]]) -> list[tuple[str, float, float, float]]:
    """(label, wall p50, CPU of all processes, CPU of the shm owner) per run and cell,
    grouped by cell, then before / after."""
    cells = sorted(
        {(c["transport"], c["receivers"]) for side in runs.values() for run in side for c in run}
    )
    out = []
    for transport, receivers in cells:
        for side in ("before", "after"):
            for number, run in enumerate(runs[side], start=1):
                for cell in run:
                    if (cell["transport"], cell["receivers"]) == (transport, receivers):
                        cpu = cell["cpu"]
                        label = f"{transport[:6]}\nN={receivers}\n{side}\n{number}"
                        out.append(
                            (label, cell["wall"]["p50"], cpu["all"], cpu.get("ShmOwner", 0.0))
                        )
    return out


def plot(data: dict, path: Path) -> None:
    changes = list(data["runs"])
    widths = [max(6.0, 0.45 * len(bars(data["runs"][c]))) for c in changes]
    fig, axes = plt.subplots(1, len(changes), figsize=(sum(widths), 5), width_ratios=widths)
    for ax, change in zip(axes, changes, strict=True):
        rows = bars(data["runs"][change])
        xs = range(len(rows))
        ax.bar([x - 0.27 for x in xs], [r[1] for r in rows], width=0.27, label="wall p50 (ms)")
        ax.bar(list(xs), [r[2] for r in rows], width=0.27, label="CPU, all processes (ms)")
        if any(r[3] for r in rows):
            ax.bar(
                [x + 0.27 for x in xs],
                [r[3] for r in rows],
                width=0.27,
                label="CPU, shm owner (ms)",
            )
        ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=6)
        ax.set_title(f"{change.replace('_', ' ')}, 1 MB", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    plot(json.loads(args.results.read_text()), args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
