"""Receiver process: the RDT receiver, pointing each ref at a registered staging buffer.

A bucketed version (:class:`RdtBucketStream`) comes one RDT object per bucket, as the
hub's bucket broker hands them out; each is pointed at the bucket's place in the
staging buffer, so Ray's agent READs it there. One served to a late joiner by another
receiver comes through the object store (:class:`BucketStream`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from ray._private import ray_constants

from raysync.copies import wait_for_devices
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.buckets import BucketPlan
from raysync.transports.nixl.agent import apply_ucx_cuda_defaults
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.buckets import buckets_of, give_up
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.rdt.agent import ray_agent_progress
from raysync.transports.rdt.wire import RdtBucketStream, RdtPayload
from raysync.transports.staging import StagingPool, StillWriting, staging_device

#: Seconds a receiver's ``ray.get`` of one RDT object may take, plus one per
#: :data:`READ_FLOOR_BYTES_PER_S` of its bytes (a whole version is one object); Ray
#: ends the fetch at its own limit before that (60 s unless
#: ``RAY_rdt_fetch_fail_timeout_milliseconds`` says otherwise).
READ_TIMEOUT_S = 60.0
#: The slowest rate a read is given time for (NIXL over TCP alone measured 250-340 MB/s
#: here, docs/benchmarks.md).
READ_FLOOR_BYTES_PER_S = 100 * 2**20


class RdtReceiver(TransportReceiver):
    def __init__(self, worker: str | None = None) -> None:
        """``worker``: this receiver's worker id, how it names itself to the hub's bucket
        broker (None: it reads whole versions only)."""
        apply_ucx_cuda_defaults()  # before Ray's NIXL agent starts in this process
        ray_agent_progress()
        self._worker = worker
        self._device = staging_device()
        self._pool: StagingPool[torch.Tensor] = StagingPool(self._new_staging, _deregister)
        #: Bucketed versions another receiver serves through the object store.
        self._served = ObjectStoreReceiver(worker)

    def fetch(
        self, payload: RdtPayload | RdtBucketStream | BucketStream, spec: WeightSpec
    ) -> Sequence[torch.Tensor]:
        if isinstance(payload, RdtBucketStream):
            if self._worker is None:
                raise TransportError("this receiver reads whole versions, not buckets")
            return self._fetch_stream(payload, spec, self._worker)
        if isinstance(payload, BucketStream):
            return self._served.fetch(payload, spec)

        def write(staging: torch.Tensor) -> Sequence[torch.Tensor]:
            _read_into(payload.ref, staging, "the update")
            return self._pool.views(staging, PackedLayout.of(spec))

        return self._pool.fill(spec, write)

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if isinstance(payload, BucketStream) and not isinstance(payload, RdtBucketStream):
            self._served.release(payload, staged)
            return
        if isinstance(payload, RdtBucketStream) and staged is None and self._worker is not None:
            give_up(payload, self._worker)  # refused, or not read whole
        self._pool.release(staged)

    def decline(self, payload: RdtPayload | RdtBucketStream | BucketStream) -> None:
        """As NIXL's receiver declines (a bucket stream through
        :meth:`~raysync.transports.object_store.receiver.ObjectStoreReceiver.decline`,
        which leaves the version's own stream to the broadcast that may deliver it
        here), and a whole version as :meth:`release` lets go of one never fetched."""
        if isinstance(payload, BucketStream):
            self._served.decline(payload)
        else:
            self.release(payload, None)

    def serve(
        self, payload: BucketStream, tensors: Mapping[str, torch.Tensor], spec: WeightSpec
    ) -> None:
        """Serve the version this receiver holds to a late joiner through the object store."""
        self._served.serve(payload, tensors, spec)

    def _fetch_stream(
        self, payload: RdtBucketStream, spec: WeightSpec, worker: str
    ) -> Sequence[torch.Tensor]:
        """Every bucket of a bucketed version, each RDT object READ to its place in a
        staging buffer as the broker hands it out; TransportError (the buffer freed) if
        one cannot be had."""
        plan = BucketPlan.of(spec, payload.bucket_bytes)

        def write(staging: torch.Tensor) -> Sequence[torch.Tensor]:
            for index, boxed in buckets_of(payload, plan.count, worker):
                start = index * plan.bucket_bytes
                place = staging[start : start + min(plan.bucket_bytes, staging.numel() - start)]
                _read_into(boxed[0], place, f"bucket {index} of {plan.count}")
                del boxed
            return self._pool.views(staging, PackedLayout.of(spec))

        return self._pool.fill(spec, write)

    def _new_staging(self, spec: WeightSpec) -> torch.Tensor:
        """A staging buffer for ``spec``, registered with Ray's NIXL agent."""
        from ray.experimental import register_nixl_memory

        staging = torch.zeros(PackedLayout.of(spec).nbytes, dtype=torch.uint8, device=self._device)
        # Zeroed before a READ lands: the zeroing is only queued on a GPU's current
        # stream, and Ray's NIXL READ waits for no stream.
        wait_for_devices([staging])
        register_nixl_memory(staging)
        return staging

    def close(self) -> None:
        for staging in self._pool.close():
            _deregister(staging)
        self._served.close()


def _deregister(staging: torch.Tensor) -> None:
    from ray.experimental import deregister_nixl_memory

    deregister_nixl_memory(staging)


def _read_into(ref: ray.ObjectRef, place: torch.Tensor, what: str) -> None:
    """READ the RDT object ``ref`` (one tensor) straight into ``place``, registered
    memory of this process; TransportError naming ``what`` if it cannot be had, or if
    Ray put it anywhere else."""
    from ray.experimental import set_target_for_ref

    limit_s = READ_TIMEOUT_S + place.nbytes / READ_FLOOR_BYTES_PER_S
    try:
        set_target_for_ref(ref, [place])
        (received,) = ray.get(ref, timeout=limit_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.ObjectFetchTimedOutError) as err:
        # Ray's READ into ``place`` may go on. Ray ends a fetch at its own limit too
        # (ObjectFetchTimedOutError, an ObjectLostError: not the learner's fault).
        ray_limit_s = ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS
        raise StillWriting(
            f"Ray's NIXL tensor transport did not fetch {what} within "
            f"{min(limit_s, ray_limit_s):g} s (Ray's own limit is {ray_limit_s:g} s: "
            "RAY_rdt_fetch_fail_timeout_milliseconds)"
        ) from err
    except (ray.exceptions.RayError, ValueError) as err:
        raise TransportError(
            f"Ray's NIXL tensor transport could not fetch {what} ({type(err).__name__}: "
            f"{err}); the learner process may have died or released it"
        ) from err
    if received.data_ptr() != place.data_ptr():
        raise TransportError(f"Ray's NIXL tensor transport ignored the target buffer of {what}")
