"""What receiving one update comes to in a receiver, and how the hub is told.

:meth:`raysync.receiver_core.ReceiverCore.receive` returns a :data:`Receipt`: either
:class:`AckNow` (applied, superseded or failed: the Ack is known when the call returns)
or :class:`AckLater` (the apply waits for the next safe point of a busy async actor,
which sends the Ack to the hub itself). Receiver process only; across the wire the hub's
delivery call (:func:`raysync.receiver_delivery.deliver`) answers the hub process with
the Ack, or with None for "later" (the hub then waits for the ack): :func:`reply_to_hub`
makes that reply and :func:`receipt_of_reply` reads it back (the hub watch delivers
through the actor's own method queue, so it gets the reply too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from raysync.messages import Ack


@dataclass(frozen=True)
class AckNow:
    """The update's outcome is known now: applied, superseded or failed (``ack.status``)."""

    ack: Ack


@dataclass(frozen=True)
class AckLater:
    """The update waits for the next safe point (an async actor is busy); the safe point
    applies it and sends its ack to the hub itself."""


ACK_LATER = AckLater()

#: What receiving one update comes to.
Receipt: TypeAlias = AckNow | AckLater


def reply_to_hub(receipt: Receipt) -> Ack | None:
    """``receipt`` as the delivery call answers the hub: the Ack, or None when the ack
    follows from the safe point (the hub then waits for it)."""
    return receipt.ack if isinstance(receipt, AckNow) else None


def receipt_of_reply(reply: Ack | None) -> Receipt:
    """What a delivery call's reply (see :func:`reply_to_hub`) stands for."""
    return ACK_LATER if reply is None else AckNow(reply)
