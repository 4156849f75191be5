"""raysync: move weights from a learner to many Ray actors, fast, with acks and versions.

Every public name is exported here and imported on first use (PEP 562): a process that
imports one of raysync's modules, e.g. the hub's actor process for
``raysync.actors.hub``, loads what that module needs and not torch with the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raysync.attached import AttachedReceiver, attach
    from raysync.errors import (
        BroadcastError,
        HubClosedError,
        HubNotFoundError,
        HubSnapshotError,
        IncompleteVersionError,
        InvalidWeightsError,
        ModelPathError,
        RaySyncError,
        SpecMismatchError,
        StaleVersionError,
        TransportUnavailableError,
        UnknownModelError,
        UnknownWorkerError,
    )
    from raysync.hub_handle import HubHandle
    from raysync.hub_launch import HubLauncher, WeightHub, get_hub
    from raysync.messages import (
        BroadcastPhases,
        BroadcastReport,
        BroadcastTicket,
        DeliveryMode,
        HubConfig,
        HubStatus,
        ReceiverStatus,
        RefusedRegistration,
        Spread,
    )
    from raysync.receiver import WeightReceiver, weight_receiver
    from raysync.receiver_hub_watch import HubConnection
    from raysync.spec import TensorSpec, WeightSpec
    from raysync.transports import (
        DistributedOptions,
        RpcOptions,
        available_transports,
        known_transports,
    )
    from raysync.wire_dtype import AS_IS

#: Each public name and the module that defines it.
_HOMES = {
    "AS_IS": "raysync.wire_dtype",
    "AttachedReceiver": "raysync.attached",
    "BroadcastError": "raysync.errors",
    "BroadcastPhases": "raysync.messages",
    "BroadcastReport": "raysync.messages",
    "BroadcastTicket": "raysync.messages",
    "DeliveryMode": "raysync.messages",
    "DistributedOptions": "raysync.transports",
    "HubClosedError": "raysync.errors",
    "HubSnapshotError": "raysync.errors",
    "HubConfig": "raysync.messages",
    "HubConnection": "raysync.receiver_hub_watch",
    "HubHandle": "raysync.hub_handle",
    "HubLauncher": "raysync.hub_launch",
    "HubNotFoundError": "raysync.errors",
    "HubStatus": "raysync.messages",
    "IncompleteVersionError": "raysync.errors",
    "InvalidWeightsError": "raysync.errors",
    "ModelPathError": "raysync.errors",
    "RaySyncError": "raysync.errors",
    "ReceiverStatus": "raysync.messages",
    "RefusedRegistration": "raysync.messages",
    "RpcOptions": "raysync.transports",
    "SpecMismatchError": "raysync.errors",
    "Spread": "raysync.messages",
    "StaleVersionError": "raysync.errors",
    "TensorSpec": "raysync.spec",
    "TransportUnavailableError": "raysync.errors",
    "UnknownModelError": "raysync.errors",
    "UnknownWorkerError": "raysync.errors",
    "WeightHub": "raysync.hub_launch",
    "WeightReceiver": "raysync.receiver",
    "WeightSpec": "raysync.spec",
    "attach": "raysync.attached",
    "available_transports": "raysync.transports",
    "get_hub": "raysync.hub_launch",
    "known_transports": "raysync.transports",
    "weight_receiver": "raysync.receiver",
}

__all__ = [
    "AS_IS",
    "AttachedReceiver",
    "BroadcastError",
    "BroadcastPhases",
    "BroadcastReport",
    "BroadcastTicket",
    "DeliveryMode",
    "DistributedOptions",
    "HubClosedError",
    "HubConfig",
    "HubConnection",
    "HubHandle",
    "HubLauncher",
    "HubNotFoundError",
    "HubSnapshotError",
    "HubStatus",
    "IncompleteVersionError",
    "InvalidWeightsError",
    "ModelPathError",
    "RaySyncError",
    "ReceiverStatus",
    "RefusedRegistration",
    "RpcOptions",
    "SpecMismatchError",
    "Spread",
    "StaleVersionError",
    "TensorSpec",
    "TransportUnavailableError",
    "UnknownModelError",
    "UnknownWorkerError",
    "WeightHub",
    "WeightReceiver",
    "WeightSpec",
    "attach",
    "available_transports",
    "get_hub",
    "known_transports",
    "weight_receiver",
]


def __getattr__(name: str) -> Any:
    """``raysync.<name>``: imported from its module on first use, then kept here."""
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'raysync' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
