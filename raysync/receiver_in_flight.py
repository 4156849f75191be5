"""Receiver process: the deliveries a receiver core is still working on.

The hub delivers a version to the same process again when its call raised
``ActorUnavailableError`` and the process answers again: Ray cannot say whether the
first call ran, and it may still be running (a threaded host), or have staged the
version for a safe point. Read twice, a version whose transport hands it out once (an
RPC inbox) leaves the second read waiting out the transport's timeout, blocking its
host. So a delivery that comes while the same one is in flight here is not read again:
it answers "later" (:data:`raysync.receiver_receipt.ACK_LATER`), and the first one's
ack goes to the hub apart from its call, where the hub's second call waits for it.

:class:`ReceiverCore` calls :meth:`DeliveriesInFlight.begin` as a delivery comes,
:meth:`~DeliveriesInFlight.end` as its call returns an outcome, and
:meth:`~DeliveriesInFlight.acked` as a deferred one's ack is sent.
"""

from __future__ import annotations

import threading
from typing import TypeAlias

from raysync.bounded import keep_newest
from raysync.messages import Ack, Update

#: One delivery: the registration (token) it is for, model, version, origin, and
#: whether its learner delivered it itself (the hub's own delivery of that version is
#: another: it reads the hub's payload, which may outlive the learner's).
DeliveryKey: TypeAlias = tuple[str, str, int, str, bool]

#: The deliveries kept in flight at most: a deferred one whose ack is never sent (its
#: core closed first) is dropped, the oldest first, beyond this many.
IN_FLIGHT_KEPT = 256


def delivery_key(update: Update, token: str) -> DeliveryKey:
    """``update``'s delivery to the core registered under ``token`` (the update's own
    token, if it names one: the registration the hub delivered to)."""
    return (update.token or token, update.model, update.version, update.origin, update.from_learner)


class DeliveriesInFlight:
    """The deliveries one core is working on, from their arrival until their outcome
    is known (returned by the call, or acked apart from it); whether each was
    delivered again meanwhile. Thread-safe: deliveries arrive on Ray's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: delivery -> whether it came again while in flight
        self._came_again: dict[DeliveryKey, bool] = {}

    def begin(self, key: DeliveryKey) -> bool:
        """A delivery came: True if it is new here (the caller receives it), False if
        the same one is in flight (noted: its outcome then also goes to the hub apart
        from its call)."""
        with self._lock:
            if key in self._came_again:
                self._came_again[key] = True
                return False
            self._came_again[key] = False
            keep_newest(self._came_again, IN_FLIGHT_KEPT)
            return True

    def end(self, key: DeliveryKey) -> bool:
        """The delivery's call returns its outcome: whether it came again meanwhile
        (the caller then sends the outcome to the hub too: the call the hub awaits
        is the second one)."""
        with self._lock:
            return self._came_again.pop(key, False)

    def acked(self, ack: Ack) -> None:
        """A deferred delivery's ack is being sent to the hub (which receives it
        wherever its call was made): the delivery is no longer in flight, whether its
        learner or the hub delivered it (their acks are alike)."""
        with self._lock:
            for from_learner in (False, True):
                self._came_again.pop(
                    (ack.token, ack.model, ack.version, ack.origin, from_learner), None
                )
