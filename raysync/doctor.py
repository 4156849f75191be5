"""``python -m raysync doctor``: which transports work here, and why not; the versions that matter.

Run in any process (the command line runs it in its own): each transport's
:meth:`~raysync.transports.Transport.availability` in this process, CUDA, the room in
``/dev/shm``, and the versions of Python, raysync, Ray, torch, tensordict and nixl.
With a running Ray cluster (``--address``, or ``ray.is_initialized()`` when called from
code), the same check runs once on every alive node, in a task pinned to it, so a
transport that works on the driver's node but not on a worker node shows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from dataclasses import dataclass

#: Distributions whose versions decide what works (tensordict is optional for raysync).
_PACKAGES = ("raysync", "ray", "torch", "tensordict", "nixl")


@dataclass(frozen=True)
class TransportCheck:
    name: str
    available: bool
    reason: str  #: why not, one line; empty when available


@dataclass(frozen=True)
class ProcessReport:
    """What one process sees."""

    where: str  #: "this process", or a node's id and address
    versions: dict[str, str]  #: distribution -> version ("not installed")
    transports: tuple[TransportCheck, ...]
    cuda: str  #: "2 x NVIDIA H100 ..." or why none
    dev_shm_free_gib: float | None  #: None: no /dev/shm here
    #: Why the check could not run there (a node where raysync does not import, or
    #: whose worker never started); empty when it ran.
    error: str = ""


def check_this_process(where: str = "this process") -> ProcessReport:
    """Every registered transport's availability here, CUDA, /dev/shm and versions."""
    from raysync.transports import get_transport, known_transports

    checks = []
    for name in known_transports():
        availability = get_transport(name).availability()
        checks.append(TransportCheck(name, availability.available, availability.reason))
    return ProcessReport(
        where=where,
        versions={"python": platform.python_version(), **_versions()},
        transports=tuple(checks),
        cuda=_cuda(),
        dev_shm_free_gib=_dev_shm_free_gib(),
    )


#: How long ``check_cluster`` waits for each node's check.
NODE_CHECK_S = 60.0


def check_cluster(timeout_s: float = NODE_CHECK_S) -> list[ProcessReport]:
    """:func:`check_this_process` on every alive node of the connected Ray cluster; a
    node where it raised, or did not answer within ``timeout_s``, is reported with
    why (those are the nodes the check is for)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def check(where: str) -> ProcessReport:
        return check_this_process(where)

    asked = {
        check.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(where): where
        for node in ray.nodes()
        if node["Alive"]
        for where in [f"node {node['NodeID'][:12]} ({node['NodeManagerAddress']})"]
    }
    ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
    reports = []
    for ref, where in asked.items():
        try:
            reports.append(ray.get(ref, timeout=0))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            reports.append(_failed(where, f"no answer within {timeout_s:g} s"))
        except ray.exceptions.RayError as err:
            reports.append(_failed(where, f"{type(err).__name__}: {err}".splitlines()[0]))
    return reports


def _failed(where: str, error: str) -> ProcessReport:
    return ProcessReport(where, {}, (), cuda="", dev_shm_free_gib=None, error=error)


def render(reports: list[ProcessReport]) -> str:
    """The reports as text: versions, then one line per transport, per process."""
    lines: list[str] = []
    for report in reports:
        lines.append(f"== {report.where}")
        if report.error:
            lines.append(f"  could not check: {report.error}")
            continue
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
        lines.append(f"  cuda: {report.cuda}")
        shm = report.dev_shm_free_gib
        lines.append(f"  /dev/shm: {'none' if shm is None else f'{shm:.1f} GiB free'}")
        width = max(len(c.name) for c in report.transports)
        for check in report.transports:
            state = "ok" if check.available else f"unavailable: {check.reason}"
            lines.append(f"  {check.name:<{width}}  {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The ``doctor`` command: this process, and with ``--address`` every node."""
    parser = argparse.ArgumentParser(prog="python -m raysync doctor", description=__doc__)
    parser.add_argument(
        "--address",
        help="a running Ray cluster to check on every node (e.g. 'auto'); "
        "default: this process only",
    )
    args = parser.parse_args(argv)
    reports = [check_this_process()]
    if args.address:
        import ray

        ray.init(address=args.address, log_to_driver=False)
        try:
            reports += check_cluster()
        finally:
            ray.shutdown()
    print(render(reports))
    return 0


def _versions() -> dict[str, str]:
    versions = {}
    for package in _PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"none: torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return f"none visible (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(names)


def _dev_shm_free_gib() -> float | None:
    if not os.path.isdir("/dev/shm"):
        return None
    stats = os.statvfs("/dev/shm")
    return stats.f_bavail * stats.f_frsize / 2**30
