"""The issue's targets on one node, as data (``TARGETS``), and one function that judges
them on a run's rows (``check_targets``): each target bounds one transport's raysync
median, cell by cell, by a multiple of what it is compared against in the same cell."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from broadcast_bench.units import GiB, MiB, fmt_size

#: What a target may compare against besides another transport: a floor of the same
#: cell, through the row's ``ratio_to_<floor>`` field, and how titles name it.
FLOOR_REFERENCES = {"floor": "the floor", "raw_read": "the raw READ"}


@dataclass(frozen=True)
class Target:
    """``transport``'s raysync median is at most ``limit`` times ``against``'s, in every
    cell it ran, or only in those of ``sizes`` and ``receivers`` where given.
    ``against`` is a floor method of the same cell (``FLOOR_REFERENCES``) or another
    transport's raysync median in the same (size, N, tensors); cells without it are not
    counted."""

    transport: str
    against: str
    limit: float
    sizes: tuple[int, ...] | None = None
    receivers: tuple[int, ...] | None = None
    #: How the title names the transport (default: its name).
    label: str | None = None

    def title(self) -> str:
        who = self.label or self.transport
        ref = FLOOR_REFERENCES.get(self.against, self.against)
        if self.limit == 1 and self.against not in FLOOR_REFERENCES:
            bound = f"at or below {ref}"
        else:
            bound = f"within {self.limit:g}x of {ref}"
        scope = []
        if self.sizes is not None:
            scope.append(" and ".join(fmt_size(s) for s in self.sizes))
        if self.receivers is not None:
            scope.append("N=" + " and ".join(str(n) for n in self.receivers))
        where = "at " + ", ".join(scope) if scope else "in every cell"
        return f"{who} {bound} {where}"

    def covers(self, size: int, n: int) -> bool:
        return (self.sizes is None or size in self.sizes) and (
            self.receivers is None or n in self.receivers
        )


TARGETS = (
    Target("shared_memory", against="object_store", limit=1.0),
    Target("shared_memory", against="floor", limit=1.1, receivers=(4,)),
    Target("shared_memory_zero_copy", against="object_store", limit=1.0),
    Target("shared_memory_zero_copy", against="floor", limit=1.1, receivers=(4,)),
    Target("distributed", against="floor", limit=2.0, label="distributed (gloo)"),
    Target("nixl", against="raw_read", limit=1.25, sizes=(256 * MiB, GiB), receivers=(1, 4)),
    Target(
        "nixl_zero_copy", against="raw_read", limit=1.25, sizes=(256 * MiB, GiB), receivers=(1, 4)
    ),
)

#: A raysync row's cell: (transport, size_bytes, n_receivers, n_tensors).
CellKey = tuple[str, int, int, int]


def _verdict(target: Target, row: dict, got: dict[CellKey, dict]) -> tuple[bool, str] | None:
    """(met, what was measured) for one row, None if the cell has nothing to compare with."""
    if target.against in FLOOR_REFERENCES:
        ratio = row[f"ratio_to_{target.against}"]
        return ratio <= target.limit, f"{ratio:.2f}x"
    key = (target.against, row["size_bytes"], row["n_receivers"], row["n_tensors"])
    other = got.get(key)
    if other is None:
        return None
    ok = row["seconds"] <= target.limit * other["seconds"]
    return ok, f"{row['seconds']:.4f} s vs {other['seconds']:.4f} s"


def check_targets(rows: list[dict], targets: tuple[Target, ...] = TARGETS) -> list[dict]:
    """The targets, judged on the medians of this run: per target its title, how many
    cells it was judged in, whether it was met (None: no cell) and the failures."""
    got: dict[CellKey, dict] = {
        (r["transport"], r["size_bytes"], r["n_receivers"], r["n_tensors"]): r
        for r in rows
        if "skipped" not in r and r["method"] == "raysync"
    }
    verdicts = []
    for target in targets:
        failures, cells = [], 0
        for key, row in sorted(got.items()):
            _, size, n, n_tensors = key
            if key[0] != target.transport or not target.covers(size, n):
                continue
            verdict = _verdict(target, row, got)
            if verdict is None:
                continue
            cells += 1
            if not verdict[0]:
                failures.append(f"{fmt_size(size)} x{n_tensors} N={n}: {verdict[1]}")
        verdicts.append(
            dict(
                target=target.title(),
                cells=cells,
                ok=None if not cells else not failures,
                failures=failures,
            )
        )
    return verdicts


def print_targets(verdicts: list[dict]) -> None:
    print("\nTargets (one node, medians of this run):")
    for t in verdicts:
        verdict = {None: "not measured", True: "met", False: "MISSED"}[t["ok"]]
        print(f"  {verdict:<12} {t['target']} ({t['cells']} cells)")
        for failure in t["failures"]:
            print(f"               {failure}")
    sys.stdout.flush()
