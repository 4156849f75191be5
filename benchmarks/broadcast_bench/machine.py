"""What the machine is doing, from /proc: the CPU time of this benchmark's process tree
and of everything else, how busy the cores are, and the memory available."""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType

#: (total ticks, busy ticks, {pid: its ticks}, the pids looked at), or None without /proc.
Snapshot = tuple[int, int, dict[int, int], set[int]]


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
    """Splits the machine's CPU time into this benchmark's process tree (the main process,
    the cells' learner processes, Ray's raylet, hub and receivers, all started under it)
    and everything else. The machine may be shared; another job's CPU use during a sample
    skews every method."""

    def __init__(self) -> None:
        self.available = os.path.exists("/proc/stat")
        #: The process the tree hangs from: the run's main process, which started Ray.
        self.root = os.getpid()

    def snapshot(self, pids: set[int] | None = None) -> Snapshot | None:
        """(total, busy, mine, pids) now; ``pids`` defaults to the current process tree
        (``root`` and its descendants)."""
        if not self.available:
            return None
        procs = {}
        for entry in os.listdir("/proc") if pids is None else pids:
            if isinstance(entry, int) or entry.isdigit():
                info = _proc_ticks(int(entry))
                if info is not None:
                    procs[int(entry)] = info
        if pids is None:
            pids, frontier = {self.root}, [self.root]
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in procs.items():
                children.setdefault(ppid, []).append(pid)
            while frontier:
                kids = children.get(frontier.pop(), [])
                pids.update(kids)
                frontier.extend(kids)
        total, busy = _proc_stat()
        return total, busy, {p: procs[p][1] for p in pids if p in procs}, pids

    def foreign(self, before: Snapshot | None, after: Snapshot | None) -> float | None:
        """Fraction of all cores that processes outside the tree used between snapshots."""
        if before is None or after is None or after[0] <= before[0]:
            return None
        mine = sum(t - before[2][p] for p, t in after[2].items() if p in before[2])
        return max(0.0, (after[1] - before[1] - mine) / (after[0] - before[0]))

    def own_share(self, interval_s: float) -> float | None:
        """Fraction of all cores this benchmark's process tree used over ``interval_s``."""
        before = self.snapshot()
        time.sleep(interval_s)
        if before is None:
            return None
        after = self.snapshot(before[3])
        if after[0] <= before[0]:
            return None
        mine = sum(t - before[2][p] for p, t in after[2].items() if p in before[2])
        return mine / (after[0] - before[0])

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


#: The one meter of a process; a cell's process sets its ``root`` to the run's main process.
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


class MemoryWatch:
    """The largest drop in MemAvailable while a cell runs (a thread reads /proc/meminfo
    every 0.1 s). Another job's memory counts too: an indication, not an account."""

    def __init__(self) -> None:
        self.start = mem_available()
        self.low = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            free = mem_available()
            if free is not None and self.low is not None:
                self.low = min(self.low, free)

    def __enter__(self) -> MemoryWatch:
        if self.start is not None:
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def peak(self) -> int | None:
        return None if self.start is None else self.start - self.low
