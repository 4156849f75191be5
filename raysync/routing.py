"""Hand-offs: which payloads the learner produces for a version, and which one each
receiver reads. Plain Python; used in the hub process.

A transport names its *hand-off*: the transport whose learner half (sender and
payload) it reads — its own, or another's (``distributed`` and ``rpc`` read the
``object_store`` put). The learner hands a version over once per hand-off the hub
lists (:func:`hand_offs_for`), and the hub keeps that as a :class:`HandedOver`: a
receiver can read it exactly when its transport's hand-off is among the payloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raysync.messages import Update
from raysync.spec import WeightSpec
from raysync.transports import get_transport


def hand_off_of(transport: str) -> str:
    """The hand-off receivers of ``transport`` read."""
    return get_transport(transport).hand_off


def hand_offs_for(transports: Iterable[str]) -> tuple[str, ...]:
    """The hand-offs a version must carry for receivers of ``transports``, sorted."""
    return tuple(sorted({hand_off_of(name) for name in transports}))


@dataclass(frozen=True)
class HandedOver:
    """One version of one model as the learner handed it over: one payload per hand-off."""

    model: str
    version: int
    spec_digest: str
    payloads: Mapping[str, Any]  #: hand-off name -> the transport's payload
    wire_spec: WeightSpec | None = None  #: what the payloads carry, if not the model's spec
    origin: str = ""  #: the learner handle that broadcast it (see :attr:`Update.origin`)

    def readable_by(self, transport: str) -> bool:
        """Whether receivers of ``transport`` can read this version."""
        return hand_off_of(transport) in self.payloads

    def update_for(self, transport: str) -> Update | None:
        """This version as receivers of ``transport`` read it (the learner's payload,
        before the transport's planner plans it per receiver); None if the learner did
        not hand it over in that form (the receiver joined by a transport the learner
        had not been told of yet: the next version reaches it)."""
        if not self.readable_by(transport):
            return None
        payload = self.payloads[hand_off_of(transport)]
        return Update(
            self.model,
            self.version,
            self.spec_digest,
            transport,
            payload,
            self.wire_spec,
            origin=self.origin,
        )
