"""The contract every data path meets.

A transport moves one version's tensors from the learner to receivers; the hub only
forwards the small, picklable *payload* the transport hands it. Lifecycle, with the
process that calls each method:

1. learner process, once per hub handle: ``sender = Transport.open_sender(hub_actor)``.
2. learner process, each broadcast: ``payload = sender.send(tensors, spec)`` — the data
   leaves the learner here (or is made readable by receivers). ``tensors`` is the
   flat, name-sorted mapping from :func:`raysync.weights.flatten`.
3. hub process: puts ``payload`` into an :class:`~raysync.messages.Update` for each
   targeted receiver and keeps the latest one for receivers that join later. The hub
   never opens a payload, so it never imports a transport's heavy dependency.
4. receiver process, once: ``receiver = Transport.open_receiver()``.
5. receiver process, each update, *outside* the safe point:
   ``staged = receiver.fetch(payload, spec)`` returns one read-only tensor per spec
   entry, in spec order (views of staged data; any device).
6. receiver process, at the safe point: the receiver mixin copies ``staged`` into the
   model's own tensors in place, then acknowledges.

Acknowledgement: the receiver's delivery call resolves to an :class:`~raysync.messages.Ack`
once the copy is done, so a transport whose ``fetch`` returns when the data is local
gets correct ack futures without writing any. A transport whose data lands
asynchronously (a collective, a one-sided read) makes ``fetch`` wait for its own
completion, with a timeout, and raises :class:`TransportError` on failure.

Capabilities are declared as class attributes and never probed with ``hasattr``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from raysync.errors import RaySyncError
from raysync.spec import WeightSpec


class TransportError(RaySyncError, RuntimeError):
    """A transport could not move the data; the message names the likely cause."""


@dataclass(frozen=True)
class Availability:
    """Whether a transport can run in this process, and if not, why (one line)."""

    available: bool
    reason: str = ""


class TransportSender(ABC):
    """Learner-side half of a transport. One per hub handle per learner process."""

    @abstractmethod
    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> Any:
        """Make this version readable by receivers; return the payload the hub forwards."""

    def close(self) -> None:
        """Release what the sender holds. Default: nothing to release."""


class TransportReceiver(ABC):
    """Receiver-side half of a transport. One per receiver actor."""

    @abstractmethod
    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """Bring one version here; return read-only tensors in spec order."""

    def close(self) -> None:
        """Release what the receiver holds. Default: nothing to release."""


class Transport(ABC):
    """A named data path: a factory for its two halves plus declared capabilities."""

    #: Registry name, e.g. ``"object_store"``.
    name: ClassVar[str]
    #: Receivers must be on the learner's node.
    same_node_only: ClassVar[bool] = False
    #: Receivers read the source's memory without the source's CPU (RDMA-style).
    one_sided: ClassVar[bool] = False
    #: Tensors may live in GPU memory end to end.
    gpu_capable: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Can this transport run here? Cheap; imports optional dependencies lazily."""

    @classmethod
    @abstractmethod
    def open_sender(cls, hub: Any) -> TransportSender:
        """Called in the learner process with the hub's ActorHandle."""

    @classmethod
    @abstractmethod
    def open_receiver(cls) -> TransportReceiver:
        """Called in a receiver process when it registers with a hub."""
