"""What the two torch.distributed transports (``distributed`` and ``rpc``) share: where
this process listens, and a rendezvous store bound to that address only.

Used in their resource actors' processes (the rendezvous owners) and in receivers.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import ray


def node_ip() -> str:
    """This process's node IP as Ray knows it: what peers on other nodes can reach."""
    return ray.util.get_node_ip_address()


def bound_master_store(host: str, timeout_s: float) -> tuple[int, Any]:
    """A ``TCPStore`` master listening on ``host`` only (never every interface, which
    is what a ``TCPStore`` given a host name does), on a free port the OS picks.
    Returns (port, store)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store closes it
    )
    return port, store
