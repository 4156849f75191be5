"""Registry of transports by name. Modules are imported only when a name is used."""

from __future__ import annotations

import importlib

from raysync.transports.base import (
    Availability,
    HubContext,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    TransportSender,
)
from raysync.transports.options import DistributedOptions, RpcOptions

#: name -> "module:Class"; the module is imported on first use of the name.
_REGISTRY: dict[str, str] = {
    "object_store": "raysync.transports.object_store:ObjectStoreTransport",
    "distributed": "raysync.transports.distributed:DistributedTransport",
    "rpc": "raysync.transports.rpc:RpcTransport",
    "shared_memory": "raysync.transports.shared_memory:SharedMemoryTransport",
    "nixl": "raysync.transports.nixl:NixlTransport",
    "rdt": "raysync.transports.rdt:RdtTransport",
}

DEFAULT_TRANSPORT = "object_store"


def known_transports() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_transport(name: str) -> type[Transport]:
    """The transport class registered as ``name``; ``ValueError`` lists the known ones."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; known transports: {', '.join(known_transports())}"
        ) from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def available_transports() -> tuple[str, ...]:
    """Names of the transports that can run in this process."""
    return tuple(n for n in _REGISTRY if get_transport(n).availability().available)


__all__ = [
    "DEFAULT_TRANSPORT",
    "Availability",
    "DistributedOptions",
    "HubContext",
    "ReceiverInfo",
    "RpcOptions",
    "Transport",
    "TransportError",
    "TransportPlanner",
    "TransportReceiver",
    "TransportSender",
    "available_transports",
    "get_transport",
    "known_transports",
]
