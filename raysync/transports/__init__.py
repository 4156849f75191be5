"""Registry of transports by name. Modules are imported only when a name is used.

The built-in transports are always known. A third-party one is added with
:func:`register_transport` in the process that starts the hub; the hub's config
carries it (``HubConfig.transports``) to the hub process and to every process that
holds a handle on that hub (its receivers), which register it in turn.
"""

from __future__ import annotations

import importlib

from raysync.transports.base import (
    PLAN_DEADLINE,
    Availability,
    HubContext,
    MemoryFootprint,
    ReceiverInfo,
    Transport,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    TransportSender,
    Unplanned,
    VersionDone,
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

_BUILT_IN = frozenset(_REGISTRY)

DEFAULT_TRANSPORT = "object_store"


def register_transport(name: str, transport: type[Transport] | str) -> None:
    """Make ``transport`` (a :class:`Transport` subclass, or its ``"module:Class"`` path)
    known as ``name`` in this process, and to every hub started from it afterwards.

    The class must be importable by that path in every process of the job (a module
    of an installed package or one on the workers' path; not ``__main__``, not a class
    defined inside a function), and its ``name`` must be ``name``. Registering the same
    class again is a no-op. Raises ``ValueError`` for a built-in name, a name taken by
    another class, or a path that does not import to a Transport named ``name``.
    """
    target = transport if isinstance(transport, str) else _path_of(transport)
    if name in _BUILT_IN:
        raise ValueError(f"transport name {name!r} is built in; pick another name")
    if _REGISTRY.get(name, target) != target:
        raise ValueError(f"transport name {name!r} is already registered to {_REGISTRY[name]}")
    cls = _import(target)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ValueError(f"{target} is not a raysync.transports.Transport subclass")
    if getattr(cls, "name", None) != name:
        raise ValueError(
            f"{target}.name is {getattr(cls, 'name', None)!r}: register it under its own name"
        )
    _REGISTRY[name] = target


def registered_transports() -> tuple[tuple[str, str], ...]:
    """The third-party transports registered in this process: ``(name, "module:Class")``."""
    return tuple((n, t) for n, t in _REGISTRY.items() if n not in _BUILT_IN)


def _path_of(cls: type) -> str:
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(
            f"{cls.__qualname__} is defined in {cls.__module__} "
            f"{'(the script)' if cls.__module__ == '__main__' else 'inside a function'}: the "
            "hub and receivers run in other processes and must import it; define it at "
            "module level in an importable module"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(target: str) -> object:
    module_name, _, class_name = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"transport {target!r} does not import: {err}") from err


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
    "PLAN_DEADLINE",
    "Availability",
    "DistributedOptions",
    "HubContext",
    "MemoryFootprint",
    "ReceiverInfo",
    "RpcOptions",
    "Transport",
    "TransportError",
    "TransportPlanner",
    "TransportReceiver",
    "TransportSender",
    "Unplanned",
    "VersionDone",
    "available_transports",
    "get_transport",
    "known_transports",
    "register_transport",
    "registered_transports",
]
