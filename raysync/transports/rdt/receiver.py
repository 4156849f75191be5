"""Receiver process: the RDT receiver, pointing each ref at a registered staging buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.rdt.wire import RdtPayload
from raysync.transports.staging import StagingPool, staging_device

#: Seconds a receiver's ``ray.get`` of one version may take.
READ_TIMEOUT_S = 60.0


class RdtReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._device = staging_device()
        self._pool: StagingPool[torch.Tensor] = StagingPool(self._new_staging)

    def fetch(self, payload: RdtPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        from ray.experimental import set_target_for_ref

        layout = PackedLayout.of(spec)
        staging = self._pool.take(spec)
        try:
            set_target_for_ref(payload.ref, [staging])
            (received,) = ray.get(payload.ref, timeout=READ_TIMEOUT_S)
        except (ray.exceptions.RayError, ValueError) as err:
            self._pool.put_back(spec, staging)
            raise TransportError(
                f"Ray's NIXL tensor transport could not fetch the update ({type(err).__name__}: "
                f"{err}); the learner process may have died or released it"
            ) from err
        if received.data_ptr() != staging.data_ptr():
            raise TransportError("Ray's NIXL tensor transport ignored the target buffer")
        staged = layout.views(staging)
        self._pool.lease(staged, spec, staging)
        return staged

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        self._pool.release(staged)

    def _new_staging(self, spec: WeightSpec) -> torch.Tensor:
        """A staging buffer for ``spec``, registered with Ray's NIXL agent."""
        from ray.experimental import register_nixl_memory

        staging = torch.zeros(PackedLayout.of(spec).nbytes, dtype=torch.uint8, device=self._device)
        register_nixl_memory(staging)
        return staging

    def close(self) -> None:
        from ray.experimental import deregister_nixl_memory

        for staging in self._pool.close():
            deregister_nixl_memory(staging)
