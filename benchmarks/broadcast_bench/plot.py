"""The PNG of a run: seconds vs bytes, log-log, a panel per N (a row of panels per tensor
count), one line per transport, with the floors."""

from __future__ import annotations

import statistics
from pathlib import Path

from broadcast_bench.names import transport_rank
from broadcast_bench.units import MiB

COLORS = {
    "object_store": "tab:blue",
    "shared_memory": "tab:green",
    "distributed": "tab:red",
    "rpc": "tab:brown",
    "nixl": "tab:purple",
    "nixl_zero_copy": "tab:pink",
    "shared_memory_zero_copy": "tab:olive",
    "rdt": "tab:cyan",
}
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def plot(rows: list[dict], path: Path) -> None:
    """Seconds vs bytes, log-log: a panel per N (a row of panels per tensor count), one
    line per transport, the floor (median of the cells' floors) in gray, the raw NIXL
    READ and the hand-written baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [r for r in rows if "skipped" not in r]
    ns = sorted({r["n_receivers"] for r in rows})
    tensor_counts = sorted({r["n_tensors"] for r in rows})
    transports = sorted({r["transport"] for r in rows}, key=transport_rank)
    fig, axes = plt.subplots(
        len(tensor_counts),
        len(ns),
        figsize=(max(4.6 * len(ns), 9.0), 4.2 * len(tensor_counts) + 1.0),
        squeeze=False,
        sharey=True,
    )
    ticks = sorted({r["size_bytes"] / MiB for r in rows})
    lines = [(f"{t}", t, "raysync", "-") for t in transports]
    lines.append(("ray.put by hand", "object_store", "baseline", ":"))
    lines.append(("raw NIXL READ", "nixl", "raw_read", "--"))
    for row_axes, n_tensors in zip(axes, tensor_counts, strict=True):
        for ax, n in zip(row_axes, ns, strict=True):
            here = [r for r in data if r["n_receivers"] == n and r["n_tensors"] == n_tensors]
            floors: dict[int, list[float]] = {}
            for r in here:
                if r["method"] == "floor":
                    floors.setdefault(r["size_bytes"], []).append(r["seconds"])
            if floors:
                xs = sorted(floors)
                ax.plot(
                    [x / MiB for x in xs],
                    [statistics.median(floors[x]) for x in xs],
                    color="gray",
                    linewidth=3,
                    marker="o",
                    alpha=0.5,
                    label="floor: (N+1) memcpy",
                )
            for i, (label, transport, method, style) in enumerate(lines):
                pts = sorted(
                    (r["size_bytes"], r["seconds"])
                    for r in here
                    if r["transport"] == transport and r["method"] == method
                )
                if not pts:
                    continue
                ax.plot(
                    [p[0] / MiB for p in pts],
                    [p[1] for p in pts],
                    color=COLORS.get(transport, "black"),
                    linestyle=style,
                    marker=MARKERS[i % len(MARKERS)],
                    alpha=0.7 if method != "raysync" else 1.0,
                    label=label,
                )
            for r in rows:
                if "skipped" in r and (r["n_receivers"], r["n_tensors"]) == (n, n_tensors):
                    ax.annotate(
                        f"{r['transport']}: skipped",
                        (r["size_bytes"] / MiB, 0),
                        xycoords=("data", "axes fraction"),
                        xytext=(0, 4 + 9 * transport_rank(r["transport"])),
                        textcoords="offset points",
                        fontsize=6,
                        ha="center",
                        color=COLORS.get(r["transport"], "black"),
                    )
            ax.set_xscale("log", base=2)
            ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)  # the same in every panel
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("broadcast size (MiB)")
            ax.set_title(f"N={n} receivers, {n_tensors} tensors")
            ax.grid(True, which="both", alpha=0.3)
        row_axes[0].set_ylabel("seconds (median, learner wall time)")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:  # none when every cell was skipped
        fig.legend(
            [handles[lab] for lab in labels],
            labels,
            loc="lower center",
            ncol=min(len(labels), 4),
            fontsize=8,
        )
    fig.suptitle("raysync broadcast per transport; floors measured in the same cells")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
