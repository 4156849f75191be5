"""Receiver process: the RDT receiver, pointing each ref at a registered staging buffer."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.rdt.wire import RdtPayload

#: Seconds a receiver's ``ray.get`` of one version may take.
READ_TIMEOUT_S = 60.0


def _staging_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RdtReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._device = _staging_device()
        self._free: dict[WeightSpec, list[torch.Tensor]] = {}
        self._registered: list[torch.Tensor] = []
        self._leased: dict[int, tuple[Sequence[torch.Tensor], WeightSpec, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def fetch(self, payload: RdtPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        from ray.experimental import set_target_for_ref

        layout = PackedLayout.of(spec)
        with self._lock:
            staging = self._take_staging(spec, layout)
        try:
            set_target_for_ref(payload.ref, [staging])
            (received,) = ray.get(payload.ref, timeout=READ_TIMEOUT_S)
        except (ray.exceptions.RayError, ValueError) as err:
            with self._lock:
                self._free[spec].append(staging)
            raise TransportError(
                f"Ray's NIXL tensor transport could not fetch the update ({type(err).__name__}: "
                f"{err}); the learner process may have died or released it"
            ) from err
        if received.data_ptr() != staging.data_ptr():
            raise TransportError("Ray's NIXL tensor transport ignored the target buffer")
        staged = layout.views(staging)
        with self._lock:
            self._leased[id(staged)] = (staged, spec, staging)
        return staged

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if staged is None:  # never fetched: no staging buffer was leased
            return
        with self._lock:
            lease = self._leased.pop(id(staged), None)
            if lease is not None:  # None: ``close`` already let go of every buffer
                _, spec, staging = lease
                self._free[spec].append(staging)

    def _take_staging(self, spec: WeightSpec, layout: PackedLayout) -> torch.Tensor:
        from ray.experimental import register_nixl_memory

        free = self._free.setdefault(spec, [])
        if free:
            return free.pop()
        staging = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self._device)
        register_nixl_memory(staging)
        self._registered.append(staging)
        return staging

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        with self._lock:
            for staging in self._registered:
                deregister_nixl_memory(staging)
            self._registered.clear()
            self._free.clear()
            self._leased.clear()
