"""Learner process: a sender's rings of registered bucket slots (``nixl``, ``rdt``).

A ring streams one bucketed version at a time. The sender takes one for a version when
the version is handed off (``send_buckets``) and gives it back when its stream ends
(``submitted``) or the version is abandoned. A version handed off while another streams
(a learner broadcasting from several threads) takes another ring, made if none is free:
with one ring for both, the ring streamed them one after the other in the order the
threads reached it, while a receiver reads versions one at a time in the hub's order —
where the two orders differed, the ring waited for that receiver to read the version it
held, and the receiver waited for the other one. A learner that broadcasts one version
at a time keeps one ring per bucket size and device, whatever its models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from raysync.spec import WeightSpec
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.buckets import Outgoing, start_stream

R = TypeVar("R")


class RingPool(Generic[R]):
    """Rings per (bucket bytes, device), each held by at most one version."""

    def __init__(self, make: Callable[[int, torch.device], R]) -> None:
        """``make(bucket_bytes, device)``: a new ring, its slots registered."""
        self._make = make
        self._lock = threading.Lock()
        self._rings: dict[tuple[int, torch.device], list[R]] = {}
        self._taken: set[int] = set()  #: id() of the rings a version holds

    def take(self, bucket_bytes: int, device: torch.device) -> R:
        """A ring of this bucket size and device that no version holds, now this
        caller's: the first free one, else a new one."""
        with self._lock:
            rings = self._rings.setdefault((bucket_bytes, device), [])
            ring = next((r for r in rings if id(r) not in self._taken), None)
            if ring is None:
                ring = self._make(bucket_bytes, device)
                rings.append(ring)
            self._taken.add(id(ring))
            return ring

    def start(
        self,
        broker: Any,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> tuple[R, BucketStream, Outgoing]:
        """A version's stream at ``broker`` and the ring it streams out of, taken (given
        back if the stream cannot start)."""
        ring = self.take(bucket_bytes, tensors[spec.names[0]].device)
        try:
            stream, outgoing = start_stream(broker, tensors, spec, bucket_bytes, stall_s)
        except BaseException:
            self.give_back(ring)
            raise
        return ring, stream, outgoing

    def give_back(self, ring: R) -> None:
        """The version that held ``ring`` streamed out, or was abandoned."""
        with self._lock:
            self._taken.discard(id(ring))

    def __iter__(self) -> Iterator[R]:
        """Every ring made (to deregister their slots when the sender closes)."""
        with self._lock:
            return iter([ring for rings in self._rings.values() for ring in rings])

    def clear(self) -> None:
        with self._lock:
            self._rings.clear()
            self._taken.clear()
