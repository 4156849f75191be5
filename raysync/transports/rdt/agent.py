"""Learner and receiver processes: Ray's NIXL agent, made by raysync without a busy thread.

Ray makes its NIXL agent (for RDT objects) on first use with nixl's defaults, and
nixl's Python agent then runs its own progress thread with no delay: a loop that spins
one core for as long as the process lives, in the learner and in every receiver. On the
two-core machine this project is measured on, a learner and two receivers spinning
left the transfers a fraction of the CPU: 256 MiB to two receivers took 1.05 s with
Ray's agent and 0.36 s with this one (``benchmarks/buckets.py --transport rdt``).

So before Ray's first use in a process, raysync puts an agent of its own making in Ray's
place — the same name Ray would give it (the actor's id, or ``RAY-DRIVER-<uuid>`` in a
driver), UCX, no progress thread, thread-safe — and progresses it from a thread that
sleeps between looks (:class:`raysync.transports.nixl.progress.SourceProgress`: every
0.1 ms while a broadcast of this learner runs, every 5 ms otherwise). Where Ray would
pick another backend (LIBFABRIC, on hosts with EFA), where Ray already made its agent,
or where Ray's transport manager is not laid out as this module expects (another Ray
version), Ray's own agent is left as Ray makes it. So it is in a process that sees a
CUDA device, for now: ``rdt`` from and into VRAM ran on an H200 with Ray's own agent,
and this one has not run on a GPU yet (a core spun per process matters less on a GPU
node's many cores than on a small CPU machine).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import ray
import torch

from raysync.transports.nixl.agent import quiet_nixl_logs
from raysync.transports.nixl.progress import SourceProgress

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: This process's progress of the agent raysync made for Ray (None: Ray's own, or none yet).
_progress: SourceProgress | None = None
_tried = False


def ray_agent_progress() -> SourceProgress | None:
    """Make Ray's NIXL agent for this process, once, before Ray does (see the module
    doc), and return its progress thread; None where Ray's own agent is used."""
    global _progress, _tried
    with _lock:
        if not _tried:
            _tried = True
            _progress = _make_ray_agent()
        return _progress


def _make_ray_agent() -> SourceProgress | None:
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        # Imported, nixl set its logger to INFO on stdout: this agent and Ray's own would
        # print a line or two in every process.
        quiet_nixl_logs()
        if torch.cuda.is_available():
            return None
        from ray.experimental.rdt.util import get_tensor_transport_manager

        manager = get_tensor_transport_manager("NIXL")
        # NIXL's manager (Ray's NixlTensorTransport) internals: an AttributeError below
        # (another Ray version) leaves Ray's own agent.
        if manager._nixl_agent is not None or manager.select_backend() != "UCX":  # type: ignore[attr-defined]
            return None
        name = ray.get_runtime_context().get_actor_id() or f"RAY-DRIVER-{uuid.uuid4()}"
        agent: Any = nixl_agent(
            name,
            nixl_agent_config(
                enable_prog_thread=False,
                backends=["UCX"],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        manager._nixl_agent, manager._backend = agent, "UCX"  # type: ignore[attr-defined]
    except (ImportError, AttributeError, TypeError) as err:
        logger.info("rdt: Ray's NIXL agent is left as Ray makes it (%s)", err)
        return None
    return SourceProgress(agent, agent)
