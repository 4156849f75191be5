"""Agent and receiver processes: the RPC group's rendezvous and joining it."""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket
import struct
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from raysync.transports.options import RpcOptions
from raysync.transports.process_groups import bound_master_store, node_ip

logger = logging.getLogger(__name__)

SCHEME = "raysync-rpc"
#: The store key of torch's dynamic RPC membership token (torch/distributed/rpc/
#: _utils.py): the name of the process joining or leaving the group, or "".
JOIN_TOKEN_KEY = "RpcGroupManagementToken"
#: The key of the member list torch's dynamic RPC membership keeps in the store
#: (torch/csrc/distributed/rpc/agent_utils.cpp): "name-rank,name-rank,".
MEMBER_LIST_KEY = "names/_ALL_WORKER_INFOS"
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
    query = parse_qs(urlparse(url).query)
    rank = int(query["rank"][0])
    world_size = int(query.get("world_size", ["-1"])[0])
    yield _group_store(url), rank, world_size


def _group_store(url: str) -> Any:
    """The store of the RPC group at ``url`` (an agent's, from open_master_store), under
    the group's prefix: the master store in the agent's process, a client elsewhere."""
    import torch.distributed as dist

    parsed = urlparse(url)
    query = parse_qs(parsed.query)
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
    return dist.PrefixStore(parsed.path.strip("/") + "/", store)


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
    import torch.distributed as dist
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
    with rpc._init_counter_lock:  # the prefix this init_rpc gives its store keys
        prefix = f"rpc_prefix_{rpc._init_counter}"
    store = dist.PrefixStore(prefix, _group_store(url))
    mine = f"Token_for_{name}_join"
    # Set once this process gives the token back. A join that fails in torch calls
    # rpc.shutdown(), whose leave waits for this key while the join holds the token:
    # had an earlier failed join left it set, that wait returned at once, for ever.
    store.delete_key(mine)
    try:
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)
    except BaseException:
        _give_join_token_back(store, mine, f"{name}-{rank}")
        _drop_failed_agent()
        raise


def _give_join_token_back(store: Any, mine: str, entry: str) -> None:
    """After a join that failed: torch takes the group's membership token (as ``mine``)
    when a join starts and gives it back only once it succeeded (a listed member that
    died meanwhile fails it): held, it kept every later join, and the agent's repairs
    of the member list, waiting on it until they failed. Give it back if still held.

    Before that, take this process's ``entry`` ("name-rank") off the member list: torch
    lists a joiner before it calls the members, and its leave after the failure, which
    would unlist it, waits for a key deleted above. Left listed, the process's every
    later join under the same name failed ("RPC worker name ... is not unique"), and
    any other joiner failed calling it: it never caught up, and the failure spread."""
    try:
        if store.check([JOIN_TOKEN_KEY]) and store.get(JOIN_TOKEN_KEY).decode() == mine:
            if store.check([MEMBER_LIST_KEY]):  # the token is ours: no one else edits it
                listed = store.get(MEMBER_LIST_KEY).decode().split(",")
                store.set(MEMBER_LIST_KEY, "".join(f"{e}," for e in listed if e and e != entry))
            # Atomic: the agent may take over the token meanwhile (then it is not ours).
            if store.compare_set(JOIN_TOKEN_KEY, mine, "").decode() == "":
                store.set(mine, "Done")  # wakes the joins waiting for it
    except Exception:  # the store is out of reach too: nothing is held there, or no one joins
        logger.warning("could not give the RPC group's join token back", exc_info=True)


def _drop_failed_agent() -> None:
    """After a join that failed once torch had made its agent this process's (waiting
    for a listed member's address, say): torch RPC stayed initialized, and every later
    ``init_rpc`` raised "RPC is already initialized": the process could never join a
    group again. A local shutdown lets it go (none if the join failed before it)."""
    import torch.distributed.rpc as rpc

    try:
        rpc.shutdown(graceful=False)
    except Exception:  # no agent was set, or torch's own shutdown in the join let it go
        pass


_register_rendezvous()
