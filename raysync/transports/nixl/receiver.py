"""Receiver process: the NIXL receiver, READing versions into registered staging buffers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.nixl.agent import device_index, memory_type, new_agent
from raysync.transports.nixl.wire import ABANDONED, Frame, NixlPayload, descs
from raysync.transports.staging import StagingPool, staging_device

logger = logging.getLogger(__name__)

#: Seconds between a receiver's looks at the stamp of a bucket not written yet.
_STAMP_POLL_S = 0.0001
#: Seconds a receiver waits for one READ before it gives up on the learner.
READ_TIMEOUT_S = 60.0
#: Polling a READ: spin (yielding the CPU) this long, then sleep between polls.
_SPIN_S = 0.002
_POLL_SLEEP_S = 0.0002


@dataclass
class _Read:
    """Prepared READs from one source buffer into one staging buffer."""

    remote: Any  #: prepped remote dlist, laid out like the local one (``descs``)
    stamps: Any  #: xfer handle: every bucket's stamp, read after the data
    data: list[Any]  #: xfer handle per bucket: its bytes
    stamp: list[Any]  #: xfer handle per bucket: its stamp

    def release(self) -> None:
        for handle in (*self.data, *self.stamp, self.stamps, self.remote):
            try:
                handle.release()
            except Exception as err:  # a request to a dead peer may refuse to abort
                logger.debug("could not release %r: %s", handle, err)


@dataclass
class _Staging:
    tensor: torch.Tensor  #: uint8, stamps + packed tensors, registered
    views: list[torch.Tensor]
    registered: Any  #: nixlRegDList
    local: Any  #: prepped local dlist (``descs``)
    reads: dict[tuple[str, int], _Read] = field(default_factory=dict)


class NixlReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._agent = new_agent("receiver")
        self._device = staging_device()
        self._pool: StagingPool[_Staging] = StagingPool(self._new_staging)
        self._sources: dict[str, int] = {}  #: agent -> registration whose metadata is loaded
        self._lock = threading.Lock()

    def fetch(self, payload: NixlPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """READ the version bucket by bucket, each once the learner has written it."""
        frame = Frame.of(spec)
        with self._lock:
            staging = self._pool.take(spec)
            try:
                if payload.region.nbytes != staging.tensor.numel():
                    raise TransportError(
                        f"learner agent {payload.agent} sent a {payload.region.nbytes}-byte "
                        f"buffer for a spec of {staging.tensor.numel()} bytes ({spec.summary()})"
                    )
                read = self._prepared(payload, staging, frame)
                stamps = frame.stamps(staging.tensor)
                for index in range(len(frame.buckets)):
                    self._await_bucket(read, index, payload, stamps)
                    self._post(read.data[index], payload, f"bucket {index}")
                self._post(read.stamps, payload, "stamps")
                for found in stamps.tolist():
                    if found != payload.stamp:
                        raise self._not_that_version(payload, found)
            except BaseException:
                self._pool.put_back(spec, staging)
                raise
            staged = list(staging.views)
            self._pool.lease(staged, spec, staging)
            return staged

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        self._pool.release(staged)

    def _await_bucket(
        self, read: _Read, index: int, payload: NixlPayload, stamps: torch.Tensor
    ) -> None:
        """Until the learner has written bucket ``index`` of this version (its stamp)."""
        started = time.monotonic()
        while True:
            self._post(read.stamp[index], payload, f"stamp of bucket {index}")
            found = int(stamps[index])
            if found == payload.stamp:
                return
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
        registered = self._agent.register_memory(tensor)
        local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            descs(tensor.data_ptr(), device_index(tensor.device), frame),
            memory_type(self._device),
        )
        return _Staging(tensor, frame.layout.views(tensor), registered, local)

    def _prepared(self, payload: NixlPayload, staging: _Staging, frame: Frame) -> _Read:
        """The READs from ``payload``'s buffer into ``staging``, prepared on first use."""
        if self._sources.get(payload.agent) != payload.registration:
            try:
                self._agent.add_remote_agent(payload.metadata)
            except Exception as err:
                raise TransportError(
                    f"could not load the metadata of learner agent {payload.agent}: {err}"
                ) from err
            self._sources[payload.agent] = payload.registration
        key = (payload.agent, payload.region.address)
        read = staging.reads.get(key)
        if read is not None:
            return read
        region, count = payload.region, len(frame.buckets)
        try:
            remote = self._agent.prep_xfer_dlist(
                payload.agent, descs(region.address, region.device_id, frame), region.mem_type
            )

            def prepped(index: int) -> Any:
                return self._agent.make_prepped_xfer(
                    "READ", staging.local, [index], remote, [index]
                )

            read = _Read(
                remote,
                stamps=prepped(0),
                data=[prepped(1 + k) for k in range(count)],
                stamp=[prepped(1 + count + k) for k in range(count)],
            )
        except Exception as err:
            self._forget(payload.agent)
            raise TransportError(
                f"could not prepare a READ from learner agent {payload.agent}: {err}"
            ) from err
        staging.reads[key] = read
        return read

    def _post(self, handle: Any, payload: NixlPayload, what: str) -> None:
        """Post one prepared READ and wait for it; TransportError on failure or timeout."""
        started = time.monotonic()
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                elapsed = time.monotonic() - started
                if elapsed > READ_TIMEOUT_S:
                    self._forget(payload.agent)
                    raise TransportError(
                        f"READ of the {what} of stamp {payload.stamp} from learner agent "
                        f"{payload.agent} did not finish within {READ_TIMEOUT_S:g} s"
                    )
                time.sleep(0 if elapsed < _SPIN_S else _POLL_SLEEP_S)
                state = self._agent.check_xfer_state(handle)
        except TransportError:
            raise
        except Exception as err:
            self._forget(payload.agent)
            raise TransportError(
                f"READ of the {what} of stamp {payload.stamp} from learner agent "
                f"{payload.agent} failed ({type(err).__name__}: {err}); the learner process "
                "may have died during the transfer"
            ) from err
        if state != "DONE":
            self._forget(payload.agent)
            raise TransportError(
                f"READ of the {what} of stamp {payload.stamp} from learner agent "
                f"{payload.agent} ended in state {state}; the learner process may have died"
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
            for agent in list(self._sources):
                self._forget(agent)
            for staging in self._pool.close():
                staging.local.release()
                self._agent.deregister_memory(staging.registered)
