"""The learner halves of a hub's transports in this process: one per (hub, hand-off).

A :class:`~raysync.HubHandle` is unpickled anew wherever it travels — each Ray task or
actor call that takes it as an argument gets a fresh instance — so senders kept per
handle were opened again for each: a learner that received the hub with each training
step had the node's shared-memory owner make it a new pool of slots each time (never
freed while the hub lived) and registered new NIXL buffers. Every handle on one hub in
a process therefore shares the senders here; :meth:`HubHandle.release` closes them.
Called in learner processes only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from raysync.transports.base import TransportSender

_lock = threading.Lock()
_senders: dict[tuple[str, str], TransportSender] = {}


def sender_of(
    hub_id: str, hand_off: str, open_sender: Callable[[], TransportSender]
) -> TransportSender:
    """This process's sender of ``hand_off`` for hub ``hub_id``, opened with
    ``open_sender`` on first use."""
    with _lock:
        sender = _senders.get((hub_id, hand_off))
        if sender is None:
            sender = _senders[(hub_id, hand_off)] = open_sender()
        return sender


def close_senders(hub_id: str) -> None:
    """Close and forget this process's senders for hub ``hub_id`` (a later broadcast
    opens them again)."""
    with _lock:
        closing = [key for key in _senders if key[0] == hub_id]
        senders = [_senders.pop(key) for key in closing]
    for sender in senders:
        sender.close()
