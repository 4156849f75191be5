"""The names rows carry, and the order they are listed in: the benchmark's transport names
(raysync's transports, each followed by its receiver-mode variants) and the methods a
cell times."""

from __future__ import annotations

from typing import Any

from raysync.transports import known_transports

#: Methods in the order rows are listed and rounds start.
METHOD_ORDER = ("floor", "raw_read", "raysync", "baseline")
#: The methods timed before the cell's hub starts.
FLOOR_METHODS = ("floor", "raw_read")

#: Benchmark-only names for a transport run in a receiver mode: name -> (transport,
#: extra ``connect_hub`` arguments). Listed (and ranked) right after their transport.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "shared_memory_zero_copy": ("shared_memory", {"zero_copy": True}),
    "nixl_zero_copy": ("nixl", {"zero_copy": True}),
}


def hub_transport(name: str) -> str:
    """The raysync transport a cell's name runs (itself, or its variant's)."""
    return VARIANTS[name][0] if name in VARIANTS else name


def receiver_options(name: str) -> dict[str, Any]:
    """The extra ``connect_hub`` arguments a cell's receivers connect with."""
    return VARIANTS[name][1] if name in VARIANTS else {}


def bench_transports() -> tuple[str, ...]:
    """Every name a cell may run: the registry's transports, each followed by its variants."""
    names: list[str] = []
    for name in known_transports():
        names.append(name)
        names.extend(v for v, (base, _) in VARIANTS.items() if base == name)
    return tuple(names)


def transport_rank(name: str) -> int:
    """Where rows of ``name`` are listed: registry order, unknown names last."""
    known = bench_transports()
    return known.index(name) if name in known else len(known)
