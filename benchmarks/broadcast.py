#!/usr/bin/env python
"""Broadcast time vs bytes and number of receivers, for every raysync transport, against
floors measured in the same run.

A *cell* is (transport, size, N receivers, tensor count). Each cell starts N
``WeightReceiver`` actors, times the floors, then starts a hub
(``WeightHub.remote(transport=...)``), connects the receivers to it and times the
transport. These are the *methods* of a cell:

* ``raysync``  -- ``ray.get(hub.broadcast.remote(weights, model="m"))``, timed on the
  learner (the cell's own driver process) from the call until every receiver acked.
  Receivers apply into their own preallocated tensors (views of one flat buffer per
  receiver), in place; in ``*_zero_copy`` cells they connect with ``zero_copy=True``
  and take each staged version as their model's memory instead (no copy).
* ``floor``    -- N+1 memcpys of the same bytes in one process (``dst.copy_(src)`` of one
  flat buffer, N+1 times, with ``--floor-threads`` torch threads): one copy out of the
  learner plus one copy into each receiver, with no Ray at all. Every cell has one.
* ``raw_read`` -- nixl cells only: the floor of a one-sided data path. The floor's
  source buffer is registered with a ``nixl_agent`` (UCX) in the learner; each receiver
  registers its model's flat buffer with an agent of its own and prepares one READ of
  the whole source into it (``prep_xfer_dlist`` + ``make_prepped_xfer("READ")``) once.
  Timed from the learner: all N receivers post their READ at once and poll it
  (``transfer``, then ``check_xfer_state``) until the last is done. No packing, no
  staging, no copy into the model, no control plane. The agents run without nixl's
  default progress thread, which busy-polls a core for as long as an agent lives: the
  readers poll their READs, and the learner progresses the source's agent by hand
  (every millisecond) while they read. The time ends at the last READ's completion by
  the readers' clock (the machine's monotonic clock), not when Ray returns.
* ``baseline`` -- object_store cells only (``--no-baseline`` drops it): what a user could
  write by hand with plain Ray: one ``ray.put`` of the state_dict as NumPy views
  (``tensor.numpy()``, Ray's zero-copy path), each receiver ``ray.get``s the ref (passed
  nested in a list so Ray does not resolve it) and ``copy_``s every array into its own
  tensors; timed from the put to the last receiver. No process-global serializer
  setting is needed, so every transport runs in Ray's default configuration.

The floors are timed first, before the hub exists: some transports keep threads busy for
as long as they are connected (nixl agents, TensorPipe), and a floor timed next to them
would carry the transport's own overhead. Within each phase every method gets
``--warmup`` untimed runs (default 3: they form the transports' connections and groups,
and transports that rotate buffers -- nixl and rdt two, shared_memory three slots --
have then read each of them once), then ``--repeats`` timed rounds in a rotating order;
the median is reported, ``ratio_to_floor`` divides it by the same cell's floor and, in
nixl cells, ``ratio_to_raw_read`` by the same cell's raw READ. The machine may be shared
(and Ray's own start-up is busy), so each timed sample waits for the CPU to go quiet
first -- quiet apart from what the cell's own processes use with nothing timed, measured
once per phase after the warm-up (``own_cpu_while_idle``: a connected transport's
background threads show there, and every method of its phase pays for them) -- and is
retaken (``--retries``) if processes outside this benchmark's process tree used more
than ``--max-foreign`` of the CPU during it (the least disturbed attempt is kept); each
row's ``noise`` lists, per sample, the CPU busy before it, the foreign share during it
(from /proc; null where it cannot be told) and the attempts taken. After every broadcast
and raw READ each receiver is probed to check that this version really landed.

Memory: before a cell, its memory is estimated from the transport's design (learner-side
copies and per-receiver staging, see ``MEMORY``); a cell that would not fit in
MemAvailable minus ``--memory-reserve-gb`` (Ray's memory monitor kills workers near
the limit) waits up to ``--quiet-timeout-s`` for memory and is then skipped with a row
saying why. Rows record the estimate and the measured peak (the drop in MemAvailable
during the cell). The JSON is rewritten after every cell (``"complete": false`` until
the end), so a run that dies part-way keeps what it measured.

Processes: the run starts one Ray instance; every cell runs in a fresh learner process
(this script with ``--cell``, connected to that instance), which exits with the cell, and
its actors are killed before that: a transport may leave state in the learner for as
long as the process lives (Ray's NIXL agent, created by the first rdt broadcast,
busy-polls a core until exit). A cell whose process fails (or outlives
``--cell-timeout-s``) is tried once more, then skipped with a row saying why. Cells of
the same (size, tensors, N) run back to back, transport after transport.

Threads: the floor uses ``--floor-threads`` (default: all cores); each receiver actor
``--receiver-threads`` torch threads (default ``max(1, cores // N)``, so N receivers
together use the cores the floor uses; Ray would otherwise pin a ``num_cpus=0`` actor
to ``OMP_NUM_THREADS=1``).

Sizes accept KB/MB/GB suffixes as powers of 1024 (``64MB`` = 64 MiB). "GB/s" in the
table is delivered bandwidth, ``bytes * N / seconds / 1e9``, for every method.

Writes JSON (``--out``, default ``benchmarks/results/broadcast.json``; ``--quick``
defaults to ``broadcast_quick.json`` so it does not overwrite a full run) and a PNG plot
next to it (``--plot`` to override): seconds vs bytes, one line per transport, a panel
per N. Prints a per-row table, a Markdown table (ratio to the floor) for the README and
the issue's targets. ``--replot JSON`` only redraws and reprints.

    .venv/bin/python benchmarks/broadcast.py --quick     # 4 and 16 MB, N=1 2 (~5 min)
    .venv/bin/python benchmarks/broadcast.py             # 64MB..1GB x N=1..8 (~30 min)
    .venv/bin/python benchmarks/broadcast.py --transports nixl rdt --sizes 256MB --receivers 1 4
    .venv/bin/python benchmarks/broadcast.py --replot benchmarks/results/broadcast.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

import raysync
from raysync import RaySyncError, WeightHub, WeightReceiver
from raysync.transports import available_transports, get_transport, known_transports

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPE = torch.float32
_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}
GiB = 2**30

#: Methods in the order rows are listed and rounds start.
METHOD_ORDER = ("floor", "raw_read", "raysync", "baseline")
#: The methods timed before the cell's hub starts.
FLOORS = ("floor", "raw_read")

#: Benchmark-only names for a transport run in a receiver mode: name -> (transport,
#: extra ``connect_hub`` arguments). Listed (and ranked) right after their transport.
VARIANTS = {
    "shared_memory_zero_copy": ("shared_memory", {"zero_copy": True}),
    "nixl_zero_copy": ("nixl", {"zero_copy": True}),
}


def hub_transport(name: str) -> str:
    """The raysync transport a cell's name runs (itself, or its variant's)."""
    return VARIANTS[name][0] if name in VARIANTS else name


def bench_transports() -> tuple[str, ...]:
    """Every name a cell may run: the registry's transports, each followed by its variants."""
    names: list[str] = []
    for name in known_transports():
        names.append(name)
        names.extend(v for v, (base, _) in VARIANTS.items() if base == name)
    return tuple(names)


#: Memory a cell needs, in units of the model size, besides the learner's weights and the
#: floor's two buffers (3 more) and each receiver's model (1 each): (learner side, per
#: receiver). From each transport's design; rows record the measured peak next to it.
MEMORY = {
    "object_store": (2, 0),  # the put copy, two versions alive; receivers read it in place
    "shared_memory": (3, 0),  # latest + in flight + next slot; receivers map them
    "distributed": (4, 1),  # put copies, rank 0's packed buffer (1 GB N=2 peaked at 11.5 GiB)
    "rpc": (2, 1),  # put copy x2; the landed tensors in each receiver's inbox
    "nixl": (2, 1),  # the learner's registered pair; a staging buffer each
    "nixl_zero_copy": (2, 2),  # two staging buffers each, one of them the model's memory
    "shared_memory_zero_copy": (4, 0),  # a slot more: the one the models live in
    "rdt": (2, 1),  # the learner's registered pair; a staging buffer each
}
#: The baseline's put (learner side). The raw READ needs nothing more: its source is the
#: floor's, its destination each receiver's model.
MEMORY_BASELINE = 1
#: Resident memory of one Ray worker that imported torch and raysync (hub, helpers, receivers).
PROCESS_BYTES = GiB // 4
#: Processes per cell besides the receivers: the learner, the hub, an owner / group /
#: agent actor.
HELPER_PROCESSES = 3


def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864 (powers of 1024); a plain number is bytes."""
    t = text.strip().upper().replace("IB", "B").replace(" ", "")
    for unit in ("KB", "MB", "GB", "B"):
        if t.endswith(unit):
            value = float(t[: -len(unit)]) * _UNITS[unit]
            break
    else:
        value = float(t)
    size = int(value)
    if size <= 0 or size % DTYPE.itemsize:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def fmt_size(nbytes: int) -> str:
    if nbytes >= GiB and nbytes % GiB == 0:
        return f"{nbytes // GiB} GB"
    return f"{nbytes / 2**20:g} MB"


def default_repeats(size: int) -> int:
    """Timed rounds per cell when ``--repeats`` is not given: fewer for big models, whose
    samples are long (and steadier) and whose cells dominate the run time."""
    if size <= 64 * 2**20:
        return 5
    if size <= 256 * 2**20:
        return 3
    return 2


# -- models -----------------------------------------------------------------------------
def layout(size_bytes: int, n_tensors: int) -> list[tuple[str, int]]:
    """``n_tensors`` float32 tensors (name, numel) adding up to exactly ``size_bytes``."""
    numel = size_bytes // DTYPE.itemsize
    if n_tensors > numel:
        raise ValueError(f"cannot split {size_bytes} bytes into {n_tensors} tensors")
    base, extra = divmod(numel, n_tensors)
    return [(f"layer{i:04d}.weight", base + (1 if i < extra else 0)) for i in range(n_tensors)]


def make_state_dict(spec: list[tuple[str, int]], fill: float) -> dict[str, torch.Tensor]:
    """Freshly allocated tensors, every page touched (no first-touch faults in the timing)."""
    return {name: torch.empty(numel, dtype=DTYPE).fill_(fill) for name, numel in spec}


def tag(weights: dict[str, torch.Tensor], value: int) -> None:
    """Mark one version: element 0 of every tensor (cheap; checked on every receiver)."""
    for tensor in weights.values():
        tensor[0] = value


# -- raw NIXL READ ------------------------------------------------------------------------
#: Seconds one raw READ may take before the receiver gives up.
RAW_READ_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RawSource:
    """A registered buffer in the learner, as a reader addresses it (plain ints and bytes)."""

    agent: str
    metadata: bytes
    address: int
    nbytes: int


def _nixl_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread: nixl's default one
    busy-polls a core for as long as the agent lives, idle or not. Readers progress
    their READs by polling them; the learner progresses the source's while they read
    (``RawReadSource.read``)."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(
        f"bench-raw-{role}-{uuid.uuid4().hex[:12]}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )


class RawReadSource:
    """The learner's side of the raw READ floor: per nixl cell, an agent with the floor's
    source buffer registered."""

    def __init__(self) -> None:
        self.agent = None
        self._registered = None

    def register(self, buffer: torch.Tensor) -> RawSource:
        self.agent = _nixl_agent("source")
        self._registered = self.agent.register_memory(buffer)
        nbytes = buffer.numel() * buffer.element_size()
        return RawSource(
            self.agent.name, self.agent.get_agent_metadata(), buffer.data_ptr(), nbytes
        )

    def read(self, receivers: list, timeout_s: float) -> tuple[float, list[float]]:
        """Every receiver READs the whole source at once. Returns the seconds from the
        calls until the last READ was done (by the receivers' ``perf_counter``, the
        machine's monotonic clock, so Ray's return trip is not counted) and element 0 of
        what each read. Meanwhile this process progresses the source's agent, which has
        no progress thread: a first READ connects and needs the source to answer, and
        later ones were seen to need it too now and then."""
        started = time.perf_counter()
        refs = [r.raw_read.remote() for r in receivers]
        pending, deadline = refs, time.monotonic() + timeout_s
        while pending:
            self.agent.get_new_notifs()  # progresses the agent's UCX worker
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.001)
            ray.get(done)  # a reader's error, at once
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"raw NIXL READs not done within {timeout_s:g} s")
        results = ray.get(refs)
        return max(t for t, _ in results) - started, [v for _, v in results]

    def close(self) -> None:
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
        self.agent = self._registered = None


@dataclass
class RawReader:
    """A receiver's side of the raw READ floor: its agent and the prepared READ."""

    agent: Any
    registered: Any  #: the model's flat buffer, registered
    xfer: Any  #: the prepared READ of the whole source into it


# -- receivers ---------------------------------------------------------------------------
class _BenchReceiver(WeightReceiver):
    """Holds one preallocated model; raysync applies into it, and so does ``apply_baseline``.
    In nixl cells it also hosts a raw NIXL reader (an agent of its own, used only there).
    It connects to the hub only when told (``connect``), after the floors are timed."""

    def __init__(self, spec: list[tuple[str, int]], threads: int) -> None:
        torch.set_num_threads(threads)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # The model: views of one flat buffer (every page touched), so that the raw READ
        # can land in the very memory the broadcast writes, with no buffer of its own.
        self.flat = torch.empty(sum(numel for _, numel in spec), dtype=DTYPE).fill_(0.0)
        self.model = dict(
            zip(
                [name for name, _ in spec],
                self.flat.split([numel for _, numel in spec]),
                strict=True,
            )
        )
        self.raw: RawReader | None = None

    def connect(self, hub, options: dict) -> None:
        self.connect_hub(hub, models={"m": "model"}, **options)

    def ready(self) -> str:
        """Where this worker imported raysync from (must be where the learner did)."""
        import raysync

        return str(Path(raysync.__file__).parent)

    def apply_baseline(self, refs: list) -> int:
        """The hand-written receiver: get the put arrays, copy them in place."""
        state = ray.get(refs[0])
        with torch.no_grad():
            for name, array in state.items():
                self.model[name].copy_(torch.from_numpy(array))
        return len(state)

    def probe(self) -> list[float]:
        return [float(t[0]) for t in self.model.values()]

    def raw_setup(self, source: RawSource) -> None:
        """Register the model's flat buffer and prepare one READ of the whole source into it
        (the next broadcast overwrites what the READs leave there)."""
        nbytes = self.flat.numel() * self.flat.element_size()
        if nbytes != source.nbytes:
            raise ValueError(f"the raw READ source has {source.nbytes} bytes, the model {nbytes}")
        agent = _nixl_agent("reader")
        registered = agent.register_memory(self.flat)
        agent.add_remote_agent(source.metadata)
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(self.flat.data_ptr(), nbytes, 0)], "DRAM"
        )
        remote = agent.prep_xfer_dlist(source.agent, [(source.address, nbytes, 0)], "DRAM")
        xfer = agent.make_prepped_xfer("READ", local, [0], remote, [0])
        self.raw = RawReader(agent, registered, xfer)

    def raw_read(self) -> tuple[float, float]:
        """Post the prepared READ and poll it until done: when (``perf_counter``) and
        element 0 (the source's tag)."""
        agent, xfer = self.raw.agent, self.raw.xfer
        started = time.monotonic()
        state = agent.transfer(xfer)
        while state == "PROC":
            if time.monotonic() - started > RAW_READ_TIMEOUT_S:
                raise TimeoutError(f"raw NIXL READ not done after {RAW_READ_TIMEOUT_S:g} s")
            time.sleep(0)
            state = agent.check_xfer_state(xfer)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return time.perf_counter(), float(self.flat[0])


BenchReceiver = ray.remote(num_cpus=0)(_BenchReceiver)


# Ray reads enable_tensor_transport from the class decorator only (not .options()); the
# rdt transport needs it on every receiver. The other transports run without it.
@ray.remote(num_cpus=0, enable_tensor_transport=True)
class RdtBenchReceiver(_BenchReceiver):
    pass


# -- measurements ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    transport: str
    size: int
    n: int
    n_tensors: int

    def describe(self) -> str:
        return f"{self.transport} {fmt_size(self.size)} x{self.n_tensors} N={self.n}"


def cell_methods(cell: Cell, args: argparse.Namespace) -> tuple[str, ...]:
    methods = ["floor", "raysync"]
    if hub_transport(cell.transport) == "nixl":
        methods.append("raw_read")
    if cell.transport == "object_store" and args.baseline:
        methods.append("baseline")
    return tuple(m for m in METHOD_ORDER if m in methods)


def memory_estimate(cell: Cell, args: argparse.Namespace) -> int:
    """Bytes this cell needs (see ``MEMORY``)."""
    learner, per_receiver = MEMORY[cell.transport]
    learner += 3 + (MEMORY_BASELINE if "baseline" in cell_methods(cell, args) else 0)
    per_receiver += 1  # its model
    data = cell.size * (learner + cell.n * per_receiver)
    return data + PROCESS_BYTES * (cell.n + HELPER_PROCESSES)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class Floor:
    """N+1 copies of one flat ``size``-byte buffer in this process: the no-Ray floor.
    ``src`` is also the raw READ's source in nixl cells."""

    def __init__(self, size: int) -> None:
        numel = size // DTYPE.itemsize
        self.src = torch.empty(numel, dtype=DTYPE).fill_(1.0)
        self.dst = torch.empty(numel, dtype=DTYPE).fill_(0.0)

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n + 1):
            self.dst.copy_(self.src)
        return time.perf_counter() - t0


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

    def snapshot(self, pids: set[int] | None = None):
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

    def foreign(self, before, after) -> float | None:
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


def wait_for_memory(needed: int, reserve: int, timeout_s: float) -> str | None:
    """Wait (up to ``timeout_s``) until ``needed`` bytes fit in MemAvailable minus
    ``reserve``; None if they do, else why the cell is skipped."""
    deadline = time.monotonic() + timeout_s
    free = mem_available()
    while free is not None and free - reserve < needed and time.monotonic() < deadline:
        time.sleep(1.0)
        free = mem_available()
    if free is None or free - reserve >= needed:
        return None
    return (
        f"needs about {needed / GiB:.1f} GiB (estimate), {free / GiB:.1f} GiB available "
        f"minus a {reserve / GiB:.1f} GiB reserve"
    )


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

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def peak(self) -> int | None:
        return None if self.start is None else self.start - self.low


def check_landed(values: list[list[float]], value: int, method: str) -> None:
    for probe in values:
        if any(v != value for v in probe):
            bad = sorted(set(probe) - {value})[:3]
            raise RuntimeError(f"{method}: a receiver holds {bad}, expected version tag {value}")


@dataclass
class CellResult:
    methods: tuple[str, ...]
    samples: dict[str, list[float]]
    noise: dict[str, list[dict]]
    report_seconds: list[float]
    #: per method: the CPU busy before its phase's timed rounds, and the share of the
    #: cores the cell's own processes used meanwhile with nothing timed
    busy: dict[str, float | None]
    own_idle: dict[str, float | None]
    threads: int
    setup_seconds: float  #: from the start of the cell until its receivers were ready
    seconds: float  #: the whole cell, teardown included


def teardown(hub, receivers: list, timeout_s: float) -> None:
    """Kill the receivers, close and kill the hub (its helper actors go with it). The
    learner half of the transport goes with this process."""
    for r in receivers:
        ray.kill(r)
    if hub is None:
        return
    try:
        ray.get(hub.close.remote(), timeout=timeout_s)
    except ray.exceptions.RayError as err:
        print(f"  (hub close: {type(err).__name__}; killing it)", flush=True)
    ray.kill(hub.actor)


def run_cell(
    cell: Cell,
    args: argparse.Namespace,
    weights: dict[str, torch.Tensor],
    spec: list[tuple[str, int]],
    floor: Floor,
    raw_source: RawReadSource | None,
) -> CellResult:
    """Start N receivers; time the floors; start a hub, connect the receivers and time
    the transport (and the baseline); tear everything down.

    The floors go first, before the hub exists, because some transports keep threads
    busy for as long as they are connected (nixl agents, TensorPipe): measured next to
    them, a floor would carry the transport's own overhead.
    """
    started = time.perf_counter()
    threads = args.receiver_threads or max(1, (os.cpu_count() or 1) // cell.n)
    methods = cell_methods(cell, args)
    timeout = args.call_timeout_s
    receiver_class = RdtBenchReceiver if cell.transport == "rdt" else BenchReceiver
    receivers = [receiver_class.remote(spec, threads) for _ in range(cell.n)]
    hub = None
    samples: dict[str, list[float]] = {m: [] for m in methods}
    noise: dict[str, list[dict]] = {m: [] for m in methods}
    busy: dict[str, float | None] = {}
    own_idle: dict[str, float | None] = {}
    report_seconds: list[float] = []
    counter = 0
    last_report_seconds = 0.0

    def one(method: str) -> float:
        nonlocal counter, last_report_seconds
        if method == "floor":
            return floor.run(cell.n)
        counter += 1
        if method == "raw_read":
            floor.src[0] = counter
            elapsed, got = raw_source.read(receivers, timeout)
            check_landed([[v] for v in got], counter, method)
            return elapsed
        tag(weights, counter)
        if method == "raysync":
            t0 = time.perf_counter()
            report = ray.get(hub.broadcast.remote(weights, model="m"), timeout=timeout)
            elapsed = time.perf_counter() - t0
            if len(report.acked) != cell.n or report.bytes != cell.size:
                raise RuntimeError(f"raysync report is off: {report}")
            last_report_seconds = report.seconds
        else:  # baseline
            t0 = time.perf_counter()
            ref = ray.put({name: t.numpy() for name, t in weights.items()})
            ray.get([r.apply_baseline.remote([ref]) for r in receivers], timeout=timeout)
            elapsed = time.perf_counter() - t0
            del ref
        probes = ray.get([r.probe.remote() for r in receivers], timeout=timeout)
        check_landed(probes, counter, f"{cell.transport} {method}")
        return elapsed

    def timed(method: str, quiet: float) -> None:
        """One sample, taken when the machine is quiet (at most ``quiet`` of the CPU
        busy); retaken (up to --retries times) if other processes used more than
        --max-foreign of the CPU during it, keeping the attempt they disturbed least."""
        attempts = []
        for _ in range(args.retries + 1):
            busy_before = METER.wait_quiet(quiet, args.sample_quiet_timeout_s)
            before = METER.snapshot()
            elapsed = one(method)
            foreign = METER.foreign(before, METER.snapshot(before[3] if before else None))
            attempts.append((foreign or 0.0, elapsed, busy_before, foreign, last_report_seconds))
            if foreign is None or foreign <= args.max_foreign:
                break
        _, elapsed, busy_before, foreign, reported = min(attempts, key=lambda a: a[0])
        samples[method].append(elapsed)
        noise[method].append(
            dict(busy_before=busy_before, foreign_during=foreign, attempts=len(attempts))
        )
        if method == "raysync":
            report_seconds.append(reported)

    def phase(names: tuple[str, ...]) -> None:
        """Warm-ups, then timed rounds in a rotating order (no method always runs first,
        or right after another)."""
        for method in names:
            for _ in range(args.warmup):
                one(method)
        # What the cell's own processes use with nothing timed (a transport's background
        # threads, say): "quiet" means quiet apart from that, which every method pays.
        idle = METER.own_share(1.0)
        quiet = args.quiet_threshold + (idle or 0.0)
        busy_before = METER.wait_quiet(quiet, args.quiet_timeout_s)
        for method in names:
            busy[method], own_idle[method] = busy_before, idle
        for k in range(args.repeats or default_repeats(cell.size)):
            shift = k % len(names)
            for method in names[shift:] + names[:shift]:
                timed(method, quiet)

    try:
        mine = str(Path(raysync.__file__).parent)
        for theirs in ray.get([r.ready.remote() for r in receivers], timeout=timeout):
            if theirs != mine:
                raise RuntimeError(f"receivers import raysync from {theirs}, the learner {mine}")
        if "raw_read" in methods:
            source = raw_source.register(floor.src)
            ray.get([r.raw_setup.remote(source) for r in receivers], timeout=timeout)
        setup_seconds = time.perf_counter() - started
        phase(tuple(m for m in methods if m in FLOORS))
        if raw_source is not None:
            raw_source.close()
        hub = WeightHub.remote(transport=hub_transport(cell.transport))
        options = VARIANTS[cell.transport][1] if cell.transport in VARIANTS else {}
        ray.get([r.connect.remote(hub, options) for r in receivers], timeout=timeout)
        phase(tuple(m for m in methods if m not in FLOORS))
    finally:
        teardown(hub, receivers, timeout_s=30.0)
        if raw_source is not None:
            raw_source.close()
    return CellResult(
        methods,
        samples,
        noise,
        report_seconds,
        busy,
        own_idle,
        threads,
        setup_seconds,
        time.perf_counter() - started,
    )


def cell_rows(cell: Cell, result: CellResult, estimate: int, peak: int | None) -> list[dict]:
    floor_s = median(result.samples["floor"])
    raw_s = median(result.samples["raw_read"]) if "raw_read" in result.samples else None
    rows = []
    for method in result.methods:
        sec = median(result.samples[method])
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
    return dict(
        transport=cell.transport,
        method="raysync",
        size_bytes=cell.size,
        n_receivers=cell.n,
        n_tensors=cell.n_tensors,
        skipped=reason,
        memory_estimate_bytes=estimate,
    )


def cell_process(job_path: Path) -> int:
    """Run one cell in this process (``--cell JOB``), as the learner: connect to the
    run's Ray cluster, allocate the weights and the floor, time the cell and write its
    result (or its error) where the job says."""
    job = json.loads(job_path.read_text())
    args = argparse.Namespace(**job["args"])
    cell = Cell(**job["cell"])
    METER.root = job["root_pid"]
    torch.set_num_threads(args.floor_threads)
    ray.init(address=job["ray_address"], log_to_driver=True)
    spec = layout(cell.size, cell.n_tensors)
    weights = make_state_dict(spec, fill=1.0)
    floor = Floor(cell.size)
    raw_source = RawReadSource() if hub_transport(cell.transport) == "nixl" else None
    try:
        result = dataclasses.asdict(run_cell(cell, args, weights, spec, floor, raw_source))
        out = {"result": result}
    except (ray.exceptions.RayError, RaySyncError, RuntimeError) as err:
        # Ray's memory monitor killing a receiver on a busy host, a transport failing,
        # a call past --call-timeout-s, data that did not land
        out = {
            "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(job["result_path"]).write_text(json.dumps(out))
    ray.shutdown()
    return 0


def run_cell_process(cell: Cell, args: argparse.Namespace, workdir: Path) -> CellResult:
    """One cell in a fresh learner process (this script with ``--cell``) connected to
    this run's Ray cluster. Fresh, because a transport may leave state in the learner
    for as long as the process lives: Ray's NIXL agent, created by the first rdt
    broadcast, busy-polls a core until exit; learner buffers stay registered."""
    job_path, result_path = workdir / "job.json", workdir / "result.json"
    result_path.unlink(missing_ok=True)
    job = dict(
        cell=dataclasses.asdict(cell),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        ray_address=ray.get_runtime_context().gcs_address,
        root_pid=os.getpid(),
        result_path=str(result_path),
    )
    job_path.write_text(json.dumps(job))
    try:
        code = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--cell", str(job_path)],
            timeout=args.cell_timeout_s,
        ).returncode
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the cell did not finish within {args.cell_timeout_s:g} s") from None
    if not result_path.exists():
        raise RuntimeError(f"the cell's process exited with code {code} and no result")
    out = json.loads(result_path.read_text())
    if "error" in out:
        raise CellError(out["error"], out["traceback"])
    result = out["result"]
    return CellResult(**{**result, "methods": tuple(result["methods"])})


class CellError(RuntimeError):
    """A cell failed in its own process; ``traceback`` is that process's."""

    def __init__(self, message: str, traceback_text: str) -> None:
        super().__init__(message)
        self.traceback = traceback_text


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
    estimate = memory_estimate(cell, args)
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


# -- output -----------------------------------------------------------------------------
def transport_rank(name: str) -> int:
    known = bench_transports()
    return known.index(name) if name in known else len(known)


def row_key(row: dict) -> tuple:
    return (
        row["n_tensors"],
        row["n_receivers"],
        row["size_bytes"],
        transport_rank(row["transport"]),
        METHOD_ORDER.index(row["method"]),
    )


def load_rows(data: dict) -> list[dict]:
    """The rows of a JSON this script wrote; runs from before it covered every transport
    measured object_store only and have no ``transport`` field."""
    rows = data["rows"]
    for row in rows:
        row.setdefault("transport", "object_store")
    return rows


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "skipped" not in r]


def print_table(rows: list[dict]) -> None:
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
            f"{row['transport']:<13} {row['method']:<9} {row['size_bytes'] / 2**20:>6g} "
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
    """Ratio to the floor per transport, N and size (per tensor count): the README table."""
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
                floors.append(f"{median(fs):.3f} s" if fs else "")
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


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets on one node, judged on the medians of this run."""
    got = {
        (r["transport"], r["size_bytes"], r["n_receivers"], r["n_tensors"]): r
        for r in measured(rows)
        if r["method"] == "raysync"
    }

    def cells(transport: str, where=lambda size, n: True):
        return sorted((k, r) for k, r in got.items() if k[0] == transport and where(k[1], k[2]))

    def label(key) -> str:
        return f"{fmt_size(key[1])} x{key[3]} N={key[2]}"

    targets = []

    def judge(name: str, checked: list[tuple[Any, bool, str]]) -> None:
        failures = [f"{label(k)}: {why}" for k, ok, why in checked if not ok]
        targets.append(
            dict(
                target=name,
                cells=len(checked),
                ok=None if not checked else not failures,
                failures=failures,
            )
        )

    for mode in ("shared_memory", "shared_memory_zero_copy"):
        shm_vs_os = []
        for key, r in cells(mode):
            other = got.get(("object_store", *key[1:]))
            if other is not None:
                ok = r["seconds"] <= other["seconds"]
                shm_vs_os.append((key, ok, f"{r['seconds']:.4f} s vs {other['seconds']:.4f} s"))
        judge(f"{mode} at or below object_store in every cell", shm_vs_os)
        judge(
            f"{mode} within 1.1x of the floor at N=4",
            [
                (k, r["ratio_to_floor"] <= 1.1, f"{r['ratio_to_floor']:.2f}x")
                for k, r in cells(mode, lambda size, n: n == 4)
            ],
        )
    judge(
        "distributed (gloo) within 2x of the floor in every cell",
        [
            (k, r["ratio_to_floor"] <= 2.0, f"{r['ratio_to_floor']:.2f}x")
            for k, r in cells("distributed")
        ],
    )
    for mode in ("nixl", "nixl_zero_copy"):
        judge(
            f"{mode} within 1.25x of the raw READ at 256 MB and 1 GB, N=1 and 4",
            [
                (k, r["ratio_to_raw_read"] <= 1.25, f"{r['ratio_to_raw_read']:.2f}x")
                for k, r in cells(mode, lambda size, n: size in (256 * 2**20, GiB) and n in (1, 4))
            ],
        )
    return targets


def print_targets(targets: list[dict]) -> None:
    print("\nTargets (one node, medians of this run):")
    for t in targets:
        verdict = {None: "not measured", True: "met", False: "MISSED"}[t["ok"]]
        print(f"  {verdict:<12} {t['target']} ({t['cells']} cells)")
        for failure in t["failures"]:
            print(f"               {failure}")
    sys.stdout.flush()


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

    data = measured(rows)
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
    ticks = sorted({r["size_bytes"] / 2**20 for r in rows})
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
                    [x / 2**20 for x in xs],
                    [median(floors[x]) for x in xs],
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
                    [p[0] / 2**20 for p in pts],
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
                        (r["size_bytes"] / 2**20, 0),
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


def report(rows: list[dict], plot_path: Path) -> list[dict]:
    plot(rows, plot_path)
    print_table(rows)
    print(markdown_table(rows))
    targets = check_targets(rows)
    print_targets(targets)
    return targets


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


# -- main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = p.parse_args(argv)
    quick = {
        "sizes": [4 * 2**20, 16 * 2**20],
        "receivers": [1, 2],
        "tensors": [16],
        "warmup": 3,
        "repeats": 1,
        "settle_s": 2.0,
        "quiet_timeout_s": 5.0,
        "sample_quiet_timeout_s": 1.0,
        "retries": 0,
    }
    full = {
        "sizes": [64 * 2**20, 256 * 2**20, GiB],
        "receivers": [1, 2, 4, 8],
        "tensors": [16],
        "warmup": 3,
        "repeats": None,  # by size, see default_repeats
        "settle_s": 10.0,
        "quiet_timeout_s": 60.0,
        "sample_quiet_timeout_s": 5.0,
        "retries": 2,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = RESULTS_DIR / ("broadcast_quick.json" if args.quick else "broadcast.json")
    if args.plot is None:
        args.plot = (args.replot or args.out).with_suffix(".png")
    if (args.repeats is not None and args.repeats < 1) or args.warmup < 0:
        p.error("need --repeats >= 1 and --warmup >= 0")
    if min(args.receivers) < 1 or min(args.tensors) < 1:
        p.error("need N >= 1 and tensor counts >= 1")
    return args


def choose_transports(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The transports to run, in registry order, and why any asked for cannot run here."""
    available = set(available_transports())
    if args.transports is None:
        return [t for t in bench_transports() if hub_transport(t) in available], {}
    chosen, unavailable = [], {}
    for name in bench_transports():
        if name in args.transports:
            availability = get_transport(hub_transport(name)).availability()
            if availability.available:
                chosen.append(name)
            else:
                unavailable[name] = availability.reason
    return chosen, unavailable


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cell is not None:
        return cell_process(args.cell)
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
    sizes, ns, tensor_counts = sorted(args.sizes), sorted(set(args.receivers)), args.tensors
    # The transports of one (size, tensors, N) run back to back: they see the same machine.
    cells = [
        Cell(t, size, n, n_tensors)
        for size in sizes
        for n_tensors in tensor_counts
        for n in ns
        for t in transports
    ]
    repeats = args.repeats or {fmt_size(s): default_repeats(s) for s in sizes}
    print(
        f"transports={transports} sizes={[fmt_size(s) for s in sizes]} N={ns} "
        f"tensors={tensor_counts} warmup={args.warmup} repeats={repeats} "
        f"floor_threads={args.floor_threads} cpus={os.cpu_count()}: {len(cells)} cells",
        flush=True,
    )
    ray.init(
        # always a fresh local instance: ray.init() alone would join a cluster that
        # `ray start` left running on this machine (and refuse num_cpus)
        address="local",
        num_cpus=16,
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
        result = {
            "complete": complete,
            "config": {
                "transports": transports,
                "unavailable": unavailable,
                "sizes_bytes": sizes,
                "receivers": ns,
                "tensor_counts": tensor_counts,
                "dtype": str(DTYPE),
                "warmup": args.warmup,
                "repeats": repeats,
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
            "total_seconds": time.time() - started,
            "errors": errors,
            "targets": check_targets(rows),
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

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


if __name__ == "__main__":
    sys.exit(main())
