"""What a run measures: the transports it runs (and why any asked for cannot run here),
its sizes, N, tensor counts and repeats, and its cells in the order they run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from broadcast_bench.cells import Cell, default_repeats
from broadcast_bench.names import bench_transports, hub_transport
from broadcast_bench.units import fmt_size
from raysync.transports import available_transports, get_transport


@dataclass(frozen=True)
class RunPlan:
    transports: list[str]  #: benchmark transport names, in registry order
    unavailable: dict[str, str]  #: asked for, cannot run here: name -> why
    sizes: list[int]  #: bytes, ascending
    receivers: list[int]  #: N values, ascending
    tensor_counts: list[int]
    #: timed rounds per method: ``--repeats``, or per size (``fmt_size``) by default
    repeats: int | dict[str, int]

    def cells(self) -> list[Cell]:
        """Every cell; the transports of one (size, tensors, N) run back to back, so they
        see the same machine."""
        return [
            Cell(t, size, n, n_tensors)
            for size in self.sizes
            for n_tensors in self.tensor_counts
            for n in self.receivers
            for t in self.transports
        ]


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


def plan_run(
    args: argparse.Namespace, transports: list[str], unavailable: dict[str, str]
) -> RunPlan:
    sizes = sorted(args.sizes)
    return RunPlan(
        transports=transports,
        unavailable=unavailable,
        sizes=sizes,
        receivers=sorted(set(args.receivers)),
        tensor_counts=args.tensors,
        repeats=args.repeats or {fmt_size(s): default_repeats(s) for s in sizes},
    )
