"""Agent and receiver processes: the RPC group's rendezvous and joining it."""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from raysync.transports.options import RpcOptions
from raysync.transports.process_groups import bound_master_store, node_ip

SCHEME = "raysync-rpc"
#: Master stores made by agents in this process, by URL (the handler hands them out).
_MASTER_STORES: dict[str, Any] = {}


def open_master_store(host: str, timeout_s: float) -> tuple[str, Any]:
    """A TCPStore master bound to ``host`` on a free port; returns (url, store)."""
    port, store = bound_master_store(host, timeout_s)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    base = f"{SCHEME}://{netloc}/{uuid.uuid4().hex}"
    _MASTER_STORES[base] = store
    return f"{base}?timeout_s={timeout_s:g}", store


def _rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous handler for ``raysync-rpc://`` URLs (see ``init_rpc``)."""
    import torch.distributed as dist

    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    rank = int(query["rank"][0])
    world_size = int(query.get("world_size", ["-1"])[0])
    base = parsed._replace(query="").geturl()
    store = _MASTER_STORES.get(base)
    if store is None:
        # The URL is an agent's, from open_master_store: it names a host and a port.
        assert parsed.hostname is not None and parsed.port is not None
        timeout_s = float(query.get("timeout_s", [RpcOptions().timeout_s])[0])
        store = dist.TCPStore(
            parsed.hostname,
            parsed.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    yield dist.PrefixStore(parsed.path.strip("/") + "/", store), rank, world_size


def _register_rendezvous() -> None:
    from torch.distributed.rendezvous import register_rendezvous_handler

    register_rendezvous_handler(SCHEME, _rendezvous)


def interface_of(ip: str) -> str | None:
    """The name of the network interface that carries IPv4 address ``ip`` (Linux)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    finally:
        probe.close()
    return None


def init_rpc(name: str, rank: int, url: str, settings: RpcOptions) -> None:
    """Join the RPC group at ``url`` as ``name`` (dynamic membership); raises on timeout."""
    import torch.distributed.rpc as rpc

    host = node_ip()
    interface = interface_of(host)
    if interface is not None:
        os.environ.setdefault("TP_SOCKET_IFNAME", interface)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=url,
        rpc_timeout=settings.timeout_s,
        num_worker_threads=8,
        # TCP only for TensorPipe's control messages: its shared-memory transport polls
        # in a loop, 8-20% of a core in every idle receiver and agent (the tensors still
        # go by its channels: cross-memory attach on a node).
        _transports=["uv"],
    )
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)


_register_rendezvous()
