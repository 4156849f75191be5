"""Receiver process: the NIXL receiver, READing versions into registered staging buffers.

Whole versions come from the learner's pair of buffers (see the package doc); bucketed
ones (:class:`NixlBucketStream`) bucket by bucket from its ring (see
:mod:`raysync.transports.nixl.ring`), each READ straight to its place in a staging
buffer of the version's packed layout, as the hub's bucket broker hands it out. A
bucketed version served to a late joiner by another receiver comes through the object
store (:class:`BucketStream`), read as ``object_store`` receivers read it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raysync.copies import viewed, wait_for_devices
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.buckets import BucketPlan
from raysync.transports.nixl.agent import device_index, memory_type, new_agent
from raysync.transports.nixl.wire import (
    ABANDONED,
    SLOT_HEADER,
    Frame,
    NixlBucketStream,
    NixlPayload,
    descs,
)
from raysync.transports.object_store.bucket_stream import BucketStream, RingBucket
from raysync.transports.object_store.buckets import buckets_of, give_up
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.staging import StagingPool, StillWriting, staging_device

logger = logging.getLogger(__name__)

#: Seconds between a receiver's looks at the stamp of a bucket not written yet.
_STAMP_POLL_S = 0.0001
#: Seconds a receiver waits for one READ before it gives up on the learner, plus one
#: per :data:`READ_FLOOR_BYTES_PER_S` of the READ's bytes: a whole model is one READ
#: when the learner has written it already (a 70 GB one over 10 GbE takes a minute).
READ_TIMEOUT_S = 60.0
#: The slowest rate a READ is given time for (NIXL over TCP alone measured 250-340 MB/s
#: here, docs/benchmarks.md).
READ_FLOOR_BYTES_PER_S = 100 * 2**20
#: Learner agents whose metadata and prepared READs a receiver keeps (sharded learners
#: are one agent each; a learner that released or restarted is a new one).
AGENTS_KEPT = 64
#: Polling a READ: spin (yielding the CPU) this long, then sleep between polls.
_SPIN_S = 0.002
_POLL_SLEEP_S = 0.0002


@dataclass
class _Read:
    """Prepared READs from one source buffer into one staging buffer."""

    remote: Any  #: prepped remote dlist, laid out like the local one (``descs``)
    stamps: Any  #: xfer handle: every bucket's stamp
    data: list[Any]  #: xfer handle per bucket: its bytes
    all_data: Any  #: xfer handle: every bucket's bytes, one request

    def release(self) -> None:
        for handle in (*self.data, self.all_data, self.stamps, self.remote):
            _release(handle)


@dataclass
class _Staging:
    tensor: torch.Tensor  #: uint8, stamps + packed tensors, registered
    views: Sequence[torch.Tensor]  #: with their NumPy views where on the CPU (copies.viewed)
    registered: Any  #: nixlRegDList
    local: Any  #: prepped local dlist (``descs``)
    reads: dict[tuple[str, int], _Read] = field(default_factory=dict)


@dataclass
class _RingStaging:
    """A staging buffer for bucketed versions: ``SLOT_HEADER`` bytes (where a slot's
    stamp lands), then the spec's packed layout; registered."""

    tensor: torch.Tensor
    views: Sequence[torch.Tensor]  #: with their NumPy views where on the CPU (copies.viewed)
    registered: Any  #: nixlRegDList

    @property
    def stamp(self) -> int:
        return int(self.tensor[:8].view(torch.int64)[0])


class NixlReceiver(TransportReceiver):
    def __init__(self, worker: str | None = None) -> None:
        """``worker``: this receiver's worker id, how it names itself to the hub's bucket
        broker (None: it reads whole versions only)."""
        self._worker = worker
        self._agent = new_agent("receiver")
        self._device = staging_device()
        self._pool: StagingPool[_Staging] = StagingPool(self._new_staging)
        self._ring_pool: StagingPool[_RingStaging] = StagingPool(self._new_ring_staging)
        #: Bucketed versions another receiver serves through the object store.
        self._served = ObjectStoreReceiver(worker)
        #: agent -> registration whose metadata is loaded, least recently read first
        self._sources: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def fetch(
        self, payload: NixlPayload | NixlBucketStream | BucketStream, spec: WeightSpec
    ) -> Sequence[torch.Tensor]:
        """READ the version: in one request if the learner has written every bucket,
        else bucket by bucket as it writes them (a bucketed one, each bucket once the
        broker hands it out)."""
        if isinstance(payload, NixlBucketStream):
            if self._worker is None:
                raise TransportError("this receiver reads whole versions, not buckets")
            with self._lock:
                self._check_open()
                return self._fetch_stream(payload, spec, self._worker)
        if isinstance(payload, BucketStream):
            return self._served.fetch(payload, spec)
        frame = Frame.of(spec)

        def write(staging: _Staging) -> Sequence[torch.Tensor]:
            if payload.region.nbytes != staging.tensor.numel():
                raise TransportError(
                    f"learner agent {payload.agent} sent a {payload.region.nbytes}-byte "
                    f"buffer for a spec of {staging.tensor.numel()} bytes ({spec.summary()})"
                )
            read = self._prepared(payload, staging, frame)
            stamps = frame.stamps(staging.tensor)
            count = len(frame.buckets)
            written = self._await_buckets(read, 0, payload, stamps)
            if written == count:  # the learner was done packing: one READ of it all
                what = f"buckets of stamp {payload.stamp}"
                self._post(read.all_data, payload.agent, what, payload.region.nbytes)
            else:  # read behind the learner, bucket by bucket as it writes them
                for index in range(count):
                    if index == written:
                        written = self._await_buckets(read, index, payload, stamps)
                    start, stop = frame.buckets[index]
                    what = f"bucket {index} of stamp {payload.stamp}"
                    self._post(read.data[index], payload.agent, what, stop - start)
            self._post(
                read.stamps, payload.agent, f"stamps of stamp {payload.stamp}", stamps.nbytes
            )
            for found in stamps.tolist():
                if found != payload.stamp:
                    raise self._not_that_version(payload, found)
            return staging.views

        with self._lock:
            self._check_open()
            return self._pool.fill(spec, write)

    def _check_open(self) -> None:
        """TransportError once closed (the core registered again and opened another
        receiver): staging registered now would never be let go. Holds ``_lock``."""
        if self._closed:
            raise TransportError("this NIXL receiver closed (its receiver registered again)")

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if isinstance(payload, NixlBucketStream):
            if staged is None and self._worker is not None:
                give_up(payload, self._worker)  # refused, or not read whole
            self._ring_pool.release(staged)
        elif isinstance(payload, BucketStream):
            self._served.release(payload, staged)
        else:
            self._pool.release(staged)

    def decline(self, payload: NixlPayload | NixlBucketStream | BucketStream) -> None:
        """A bucketed version (its own stream or one served through the object store) is
        let go of as the object store's receiver declines it
        (:meth:`~raysync.transports.object_store.receiver.ObjectStoreReceiver.decline`:
        a stream served for this read alone is given up, the version's own is not: a
        broadcast may be delivering it to this receiver); a whole version as
        :meth:`release` lets go of one never fetched."""
        if isinstance(payload, BucketStream):
            self._served.decline(payload)
        else:
            self.release(payload, None)

    def serve(
        self, payload: BucketStream, tensors: Mapping[str, torch.Tensor], spec: WeightSpec
    ) -> None:
        """Serve the version this receiver holds to a late joiner through the object
        store (this receiver's memory is registered for reading, not for serving)."""
        self._served.serve(payload, tensors, spec)

    def _fetch_stream(
        self, payload: NixlBucketStream, spec: WeightSpec, worker: str
    ) -> Sequence[torch.Tensor]:
        """Every bucket of a bucketed version, READ into a staging buffer as the broker
        hands it out; TransportError (the buffer freed) if one cannot be had whole."""
        plan = BucketPlan.of(spec, payload.bucket_bytes)

        def write(staging: _RingStaging) -> Sequence[torch.Tensor]:
            self._load(payload.agent, payload.metadata, payload.registration)
            for index, boxed in buckets_of(payload, plan.count, worker):
                self._read_ring_bucket(payload, staging, plan, index, boxed[0])
            return staging.views

        return self._ring_pool.fill(spec, write)

    def _read_ring_bucket(
        self,
        payload: NixlBucketStream,
        staging: _RingStaging,
        plan: BucketPlan,
        index: int,
        bucket: RingBucket,
    ) -> None:
        """READ bucket ``index`` from its ring slot to its place in ``staging``, with
        the slot's stamp, then the stamp again: both must be the one the broker named
        (else the learner wrote the slot again during the read: this receiver was
        dropped for holding the others up, or the learner failed)."""
        start = index * plan.bucket_bytes
        length = min(plan.bucket_bytes, staging.tensor.numel() - SLOT_HEADER - start)
        slot = payload.ring[bucket.slot]
        local_at, device = staging.tensor.data_ptr(), device_index(staging.tensor.device)
        remote_at, remote_device = slot.address, slot.device_id
        what = f"bucket {index} of {plan.count} (stamp {bucket.stamp})"
        self._read(
            payload.agent,
            [(local_at, 8, device), (local_at + SLOT_HEADER + start, length, device)],
            [(remote_at, 8, remote_device), (remote_at + SLOT_HEADER, length, remote_device)],
            slot.mem_type,
            what,
        )
        stamp_before = staging.stamp
        self._read(
            payload.agent,
            [(local_at, 8, device)],
            [(remote_at, 8, remote_device)],
            slot.mem_type,
            f"stamp of {what}",
        )
        for found in (stamp_before, staging.stamp):
            if found == ABANDONED:
                raise TransportError(
                    f"the learner (agent {payload.agent}) failed while writing {what}; "
                    "this version is dropped"
                )
            if found != bucket.stamp:
                raise TransportError(
                    f"the learner (agent {payload.agent}) wrote the ring slot of {what} again "
                    f"while this receiver read it (found stamp {found}): the broker had "
                    "dropped this receiver for holding the others up; this version is dropped"
                )

    def _read(
        self,
        agent: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        remote_type: str,
        what: str,
    ) -> None:
        """One READ of ``remote`` (at ``agent``) into ``local``, waited for."""
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, memory_type(self._device)),
                self._agent.get_xfer_descs(remote, remote_type),
                agent,
            )
        except Exception as err:
            self._forget(agent)
            raise TransportError(
                f"could not prepare a READ of the {what} from learner agent {agent}: {err}"
            ) from err
        try:
            self._post(handle, agent, what, sum(length for _, length, _ in local))
        finally:
            _release(handle)

    def _new_ring_staging(self, spec: WeightSpec) -> _RingStaging:
        """A staging buffer for bucketed versions of ``spec``, registered."""
        layout = PackedLayout.of(spec, SLOT_HEADER)
        tensor = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self._device)
        wait_for_devices([tensor])  # zeroed before a READ lands in it (no stream waits)
        registered = self._register(tensor, spec)
        return _RingStaging(tensor, viewed(layout.views(tensor)), registered)

    def _await_buckets(
        self, read: _Read, index: int, payload: NixlPayload, stamps: torch.Tensor
    ) -> int:
        """Read every stamp until the learner has written bucket ``index`` of this
        version; how many buckets from the first on it has written by then."""
        started = time.monotonic()
        while True:
            self._post(read.stamps, payload.agent, f"stamps of {payload.stamp}", stamps.nbytes)
            found_all = stamps.tolist()
            found = found_all[index]
            if found == payload.stamp:
                written = index + 1
                while written < len(found_all) and found_all[written] == payload.stamp:
                    written += 1
                return written
            if found != 0:
                raise self._not_that_version(payload, found)
            if time.monotonic() - started > READ_TIMEOUT_S:
                self._forget(payload.agent)
                raise TransportError(
                    f"learner agent {payload.agent} did not write bucket {index} of stamp "
                    f"{payload.stamp} within {READ_TIMEOUT_S:g} s"
                )
            time.sleep(_STAMP_POLL_S)

    @staticmethod
    def _not_that_version(payload: NixlPayload, found: int) -> TransportError:
        if found == ABANDONED:
            return TransportError(
                f"the learner (agent {payload.agent}) failed while writing stamp "
                f"{payload.stamp}; this version is dropped"
            )
        return TransportError(
            f"the learner (agent {payload.agent}) overwrote its buffer while this receiver "
            f"read it (stamp {found}, expected {payload.stamp}): two newer versions were "
            "broadcast during the read; this version is dropped"
        )

    def _new_staging(self, spec: WeightSpec) -> _Staging:
        """A staging buffer for ``spec``, registered with this receiver's agent, with
        its local descriptor list prepared."""
        frame = Frame.of(spec)
        tensor = torch.zeros(frame.layout.nbytes, dtype=torch.uint8, device=self._device)
        wait_for_devices([tensor])  # zeroed before a READ lands in it (no stream waits)
        registered = self._register(tensor, spec)
        try:
            local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                descs(tensor.data_ptr(), device_index(tensor.device), frame),
                memory_type(self._device),
            )
        except Exception as err:  # nothing keeps the buffer: its registration goes too
            self._agent.deregister_memory(registered)
            raise TransportError(
                f"NIXL could not prepare the staging buffer of {spec.summary()} on "
                f"{self._device}: {type(err).__name__}: {err}"
            ) from err
        return _Staging(tensor, viewed(frame.layout.views(tensor)), registered, local)

    def _register(self, tensor: torch.Tensor, spec: WeightSpec) -> Any:
        """``tensor``, a staging buffer of ``spec``, registered with this receiver's
        agent; TransportError saying which if NIXL refuses (pinned memory run out, a
        device UCX cannot register)."""
        try:
            return self._agent.register_memory(tensor)
        except Exception as err:
            raise TransportError(
                f"NIXL could not register a staging buffer of {tensor.nbytes} bytes for "
                f"{spec.summary()} on {self._device}: {type(err).__name__}: {err}"
            ) from err

    def _load(self, agent: str, metadata: bytes, registration: int) -> None:
        """Load learner ``agent``'s metadata unless this registration of it, or a later
        one, is loaded: an agent's metadata only grows until its learner releases it (a
        new agent), and payloads can arrive out of registration order (a learner
        streaming versions at once registers a ring for each).

        A learner that released its side, or was restarted, comes back as a new agent
        and never says the old one is gone: past ``AGENTS_KEPT`` agents, the one read
        least recently is forgotten with its prepared READs (loaded again if it
        returns; every fetch holds ``_lock``, so none is reading from it)."""
        loaded = self._sources.get(agent)
        if loaded is not None and loaded >= registration:
            self._sources.move_to_end(agent)
            return
        try:
            self._agent.add_remote_agent(metadata)
        except Exception as err:
            raise TransportError(
                f"could not load the metadata of learner agent {agent}: {err}"
            ) from err
        self._sources[agent] = registration
        self._sources.move_to_end(agent)
        while len(self._sources) > AGENTS_KEPT:
            self._forget(next(iter(self._sources)))

    def _prepared(self, payload: NixlPayload, staging: _Staging, frame: Frame) -> _Read:
        """The READs from ``payload``'s buffer into ``staging``, prepared on first use."""
        self._load(payload.agent, payload.metadata, payload.registration)
        key = (payload.agent, payload.region.address)
        read = staging.reads.get(key)
        if read is not None:
            return read
        region, count = payload.region, len(frame.buckets)
        try:
            remote = self._agent.prep_xfer_dlist(
                payload.agent, descs(region.address, region.device_id, frame), region.mem_type
            )

            def prepped(indices: list[int]) -> Any:
                return self._agent.make_prepped_xfer(
                    "READ", staging.local, indices, remote, indices
                )

            read = _Read(
                remote,
                stamps=prepped([0]),
                data=[prepped([1 + k]) for k in range(count)],
                all_data=prepped([1 + k for k in range(count)]),
            )
        except Exception as err:
            self._forget(payload.agent)
            raise TransportError(
                f"could not prepare a READ from learner agent {payload.agent}: {err}"
            ) from err
        staging.reads[key] = read
        return read

    def _post(self, handle: Any, agent: str, what: str, nbytes: int = 0) -> None:
        """Post one prepared READ of ``nbytes`` and wait for it; TransportError on
        failure or timeout (:data:`READ_TIMEOUT_S`, more for a large one)."""
        started = time.monotonic()
        limit_s = READ_TIMEOUT_S + nbytes / READ_FLOOR_BYTES_PER_S
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                elapsed = time.monotonic() - started
                if elapsed > limit_s:
                    self._forget(agent)
                    raise StillWriting(  # the agent may not abort it: a late write
                        f"READ of the {what} from learner agent {agent}"
                        f" did not finish within {limit_s:g} s"
                    )
                time.sleep(0 if elapsed < _SPIN_S else _POLL_SLEEP_S)
                state = self._agent.check_xfer_state(handle)
        except TransportError:
            raise
        except Exception as err:
            self._forget(agent)
            raise TransportError(
                f"READ of the {what} from learner agent {agent}"
                f" failed ({type(err).__name__}: {err}); the learner process "
                "may have died during the transfer"
            ) from err
        if state != "DONE":
            self._forget(agent)
            raise TransportError(
                f"READ of the {what} from learner agent {agent}"
                f" ended in state {state}; the learner process may have died"
            )

    def _forget(self, agent: str) -> None:
        """Drop every prepared READ from ``agent`` and its metadata (it failed or left)."""
        for staging in self._pool.created():
            for key in [k for k in staging.reads if k[0] == agent]:
                staging.reads.pop(key).release()
        if self._sources.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except Exception as err:  # already disconnected
                logger.debug("could not remove remote agent %s: %s", agent, err)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for agent in list(self._sources):
                self._forget(agent)
            for staging in self._pool.close():
                staging.local.release()
                self._agent.deregister_memory(staging.registered)
            for ring_staging in self._ring_pool.close():
                self._agent.deregister_memory(ring_staging.registered)
            self._served.close()


def _release(handle: Any) -> None:
    try:
        handle.release()
    except Exception as err:  # a request to a dead peer may refuse to abort
        logger.debug("could not release %r: %s", handle, err)
