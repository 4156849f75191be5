"""CPU time per process while a benchmark runs a series, read from Linux's ``/proc``.

On a machine with few cores a small broadcast's wall time is bounded by the CPU that
every process on its path burns (learner, hub, receivers, Ray's raylet and GCS), not by
its hops: when the processes together burn two cores' worth, a faster path has to burn
less. :class:`CpuMeter` says how much each kind of process burnt over a series, per
operation, so two schemes can be compared by what they cost as well as by how long
they take. Every process of the machine counts (a one-node Ray cluster lives on it);
the meter's own process is named ``driver``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _kind(pid: int, cmdline: str) -> str:
    """A process's kind: ``driver`` (this one), Ray's daemons by name, a Ray worker by
    its actor class (``ray::WeightHubActor`` -> ``WeightHubActor``), else ``other``."""
    if pid == os.getpid():
        return "driver"
    for daemon in ("raylet", "gcs_server"):
        if daemon in cmdline:
            return daemon
    first = cmdline.split(" ", 1)[0]
    if first.startswith("ray::"):
        return first.removeprefix("ray::").split(".", 1)[0] or "ray worker"
    return "other"


def _cpu_by_process() -> dict[int, tuple[str, float]]:
    """Per live process: its kind and the CPU seconds (user + system) it used so far."""
    seen = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])
        pid = int(entry.name)
        seen[pid] = (_kind(pid, cmdline), (utime + stime) / _TICKS_PER_S)
    return seen


class CpuMeter:
    """``start()`` before a series and ``per_op(count)`` after it: milliseconds of CPU
    per operation, by kind of process and in total (``"all"``). A process that started
    during the series counts whole; one that ended during it is missed (none should)."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[str, float]] = {}

    def start(self) -> None:
        self._before = _cpu_by_process()

    def per_op(self, count: int) -> dict[str, float]:
        used: Counter[str] = Counter()
        for pid, (kind, seconds) in _cpu_by_process().items():
            used[kind] += seconds - self._before.get(pid, (kind, 0.0))[1]
        per_op = {kind: s * 1e3 / count for kind, s in used.most_common() if s > 0}
        per_op["all"] = sum(per_op.values())
        return per_op
