"""How much memory a cell needs, and waiting until it fits: cells that would not fit are
skipped (Ray's memory monitor kills workers near the limit; the reference machine has
24 GiB). The estimate adds what the benchmark itself holds to what the cell's transport
keeps alive, per ``TRANSPORT_MEMORY_FOOTPRINT``; rows record the measured peak next to it
(``machine.MemoryWatch``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broadcast_bench.machine import mem_available
from broadcast_bench.names import hub_transport, receiver_options
from broadcast_bench.units import GiB

if TYPE_CHECKING:
    from broadcast_bench.cells import Cell


@dataclass(frozen=True)
class MemoryFootprint:
    """Copies of the model a transport keeps alive at steady state, in units of the
    model's size, besides the learner's own weights and each receiver's model."""

    learner: int  #: on the learner's side: the sender's copies, the hub-side helpers'
    per_receiver: int  #: in each receiver: staging, inboxes


#: Stands for a declaration raysync's transports do not make yet: a class attribute
#: ``Transport.memory_footprint`` (per receiver mode: copying, or ``zero_copy=True``). Until
#: they declare it, the numbers come from each transport's design, keyed by (raysync
#: transport, whether receivers connect with ``zero_copy=True``).
TRANSPORT_MEMORY_FOOTPRINT: dict[tuple[str, bool], MemoryFootprint] = {
    # the put copy, two versions alive; receivers read it in place
    ("object_store", False): MemoryFootprint(learner=2, per_receiver=0),
    # latest + in flight + next slot; receivers map them
    ("shared_memory", False): MemoryFootprint(learner=3, per_receiver=0),
    # a slot more: the one the models live in
    ("shared_memory", True): MemoryFootprint(learner=4, per_receiver=0),
    # put copies, rank 0's packed buffer (1 GB N=2 peaked at 11.5 GiB)
    ("distributed", False): MemoryFootprint(learner=4, per_receiver=1),
    # put copy x2; the landed tensors in each receiver's inbox
    ("rpc", False): MemoryFootprint(learner=2, per_receiver=1),
    # the learner's registered pair; a staging buffer each
    ("nixl", False): MemoryFootprint(learner=2, per_receiver=1),
    # two staging buffers each, one of them the model's memory
    ("nixl", True): MemoryFootprint(learner=2, per_receiver=2),
    # the learner's registered pair; a staging buffer each
    ("rdt", False): MemoryFootprint(learner=2, per_receiver=1),
}

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
    """What a benchmark transport name (a variant too) keeps alive."""
    zero_copy = bool(receiver_options(transport).get("zero_copy", False))
    return TRANSPORT_MEMORY_FOOTPRINT[(hub_transport(transport), zero_copy)]


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
