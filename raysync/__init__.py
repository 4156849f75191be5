"""raysync: move weights from a learner to many Ray actors, fast, with acks and versions."""

from raysync.attach import AttachedReceiver, attach
from raysync.errors import (
    BroadcastError,
    HubClosedError,
    HubNotFoundError,
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
    BroadcastReport,
    BroadcastTicket,
    DeliveryMode,
    HubConfig,
    HubStatus,
    ReceiverStatus,
    RefusedRegistration,
)
from raysync.receiver import WeightReceiver, weight_receiver
from raysync.spec import TensorSpec, WeightSpec
from raysync.transports import (
    DistributedOptions,
    RpcOptions,
    available_transports,
    known_transports,
)

__all__ = [
    "AttachedReceiver",
    "BroadcastError",
    "BroadcastReport",
    "BroadcastTicket",
    "DeliveryMode",
    "DistributedOptions",
    "HubClosedError",
    "HubConfig",
    "HubHandle",
    "HubLauncher",
    "HubNotFoundError",
    "HubStatus",
    "IncompleteVersionError",
    "InvalidWeightsError",
    "ModelPathError",
    "RaySyncError",
    "ReceiverStatus",
    "RefusedRegistration",
    "RpcOptions",
    "SpecMismatchError",
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
