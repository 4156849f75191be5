"""Both processes: creating a NIXL agent, and the memory kinds it registers."""

from __future__ import annotations

import functools
import logging
import os
import uuid
from typing import Any

import torch

from raysync.transports.base import Availability, TransportError

#: UCX settings an agent is created with in a process that sees CUDA, unless the user
#: set them. A receiver READs (a UCX GET), and UCX turns ``cuda_ipc`` GETs off when NVML
#: finds no NVLink (one GPU, or a VM): VRAM then moved over ``tcp/lo`` at 0.25 GiB/s on an
#: H100. Two processes on one GPU can still map each other's memory; UCX checks that
#: before it uses the transport. (Without CUDA, UCX loads no ``cuda_ipc`` and would warn
#: on stdout of an unused variable.)
UCX_CUDA_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def new_agent(role: str, *, shared: bool = False) -> Any:
    """A NIXL agent with the UCX backend and without nixl's progress thread (see the package
    doc); ``shared``: safe to call from several threads at once. Raises TransportError if
    UCX cannot start."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    quiet_nixl_logs()
    apply_ucx_cuda_defaults()
    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if shared else None
    agent = nixl_agent(
        f"raysync-{role}-{uuid.uuid4().hex[:12]}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync),
    )
    if "UCX" not in agent.backends:
        raise TransportError(
            "nixl has no UCX backend plugin (only: " + ", ".join(agent.get_plugin_list()) + ")"
        )
    return agent


def apply_ucx_cuda_defaults() -> None:
    """Set :data:`UCX_CUDA_DEFAULTS` in this process's environment where it sees CUDA,
    keeping any the user set. UCX reads them when a NIXL agent starts: called before
    raysync creates one, and by ``rdt``'s sender and receiver before Ray's does."""
    if torch.cuda.is_available():
        for name, value in UCX_CUDA_DEFAULTS.items():
            os.environ.setdefault(name, value)


def quiet_nixl_logs() -> None:
    """nixl sets its logger to INFO on stdout when imported, so every process with an
    agent (a user's learner too) prints "Initialized NIXL agent" and "Backend UCX was
    instantiated". raysync keeps it to warnings, and shows nixl's INFO lines when
    raysync's own logger is at DEBUG; ``NIXL_LOG_LEVEL`` set by the user wins."""
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    debug = logging.getLogger("raysync").isEnabledFor(logging.DEBUG)
    logging.getLogger("nixl").setLevel(logging.INFO if debug else logging.WARNING)


def memory_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def device_index(device: torch.device) -> int:
    return device.index if device.type == "cuda" else 0


@functools.cache
def nixl_availability() -> Availability:
    """Can nixl run here: the package imports and an agent with UCX starts (once per process)."""
    try:
        new_agent("probe")
    except ImportError as err:
        return Availability(
            False, f"the nixl package is not installed ({err}); pip install 'raysync[nixl]'"
        )
    except Exception as err:
        return Availability(False, f"nixl could not create an agent with the UCX backend: {err}")
    return Availability(True)
