"""How much memory a cell needs, and waiting until it fits: cells that would not fit are
skipped (Ray's memory monitor kills workers near the limit; the reference machine has
24 GiB). The estimate adds what the benchmark itself holds to what the cell's transport
declares it keeps alive (``Transport.memory`` / ``zero_copy_memory``); rows record the
measured peak next to it (``machine.MemoryWatch``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from broadcast_bench.machine import mem_available
from broadcast_bench.names import hub_transport, receiver_options
from broadcast_bench.units import GiB
from raysync.transports import MemoryFootprint, get_transport

if TYPE_CHECKING:
    from broadcast_bench.cells import Cell


#: What the benchmark itself holds, in units of the model's size. The learner: its
#: weights and the floor's two buffers (the raw READ's source is the floor's).
LEARNER_BENCH_COPIES = 3
#: The baseline's put (learner side), in cells that time it.
BASELINE_COPIES = 1
#: Each receiver's model (also the raw READ's destination).
RECEIVER_MODEL_COPIES = 1
#: Resident memory of one Ray worker that imported torch and raysync (hub, helpers, receivers).
PROCESS_BYTES = GiB // 4
#: Processes per cell besides the receivers: the learner, the hub, an owner / group /
#: agent actor.
HELPER_PROCESSES = 3


def transport_footprint(transport: str) -> MemoryFootprint:
    """What a benchmark transport name (a variant too) keeps alive, as its raysync
    transport declares it."""
    declared = get_transport(hub_transport(transport))
    zero_copy = bool(receiver_options(transport).get("zero_copy", False))
    footprint = declared.zero_copy_memory if zero_copy else declared.memory
    if footprint is None:
        raise ValueError(f"transport {declared.name!r} declares no memory footprint")
    return footprint


def memory_estimate(cell: Cell, methods: tuple[str, ...]) -> int:
    """Bytes ``cell`` needs when it times ``methods``."""
    footprint = transport_footprint(cell.transport)
    learner = footprint.learner + LEARNER_BENCH_COPIES
    learner += BASELINE_COPIES if "baseline" in methods else 0
    per_receiver = footprint.per_receiver + RECEIVER_MODEL_COPIES
    data = cell.size * (learner + cell.n * per_receiver)
    return data + PROCESS_BYTES * (cell.n + HELPER_PROCESSES)


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
