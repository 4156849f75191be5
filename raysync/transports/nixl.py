"""NIXL as the data path: registered memory, one-sided READs into receivers' buffers.

Learner process (:class:`NixlSender`): one NIXL agent with the UCX backend. Per weight
spec (and device) it registers, once, a *pair* of buffers laid out as a 64-byte header
followed by the tensors packed by :class:`~raysync.layout.PackedLayout`. Each ``send``
packs the weights into the buffer of the pair not written last time, so receivers can
still read version v while the learner writes v+1, and returns a small payload: the
agent's name and metadata (~0.5 KB; receivers load it only when it changes), where
the buffer is, and the *stamp* that buffer now holds.

Buffer reuse, the rule: a buffer is written again only once the broadcast that last
filled it has completed (every target acked, failed or timed out): ``send`` waits for
that broadcast's ack future, which ``submitted`` hands it. That keeps every broadcast
receiver's read clean. Readers outside a broadcast (late joiners and pullers reading the
latest version, receivers still reading after their broadcast timed out) are covered by
the stamp: the learner sets a buffer's header stamp to 0 before packing and to a fresh,
increasing stamp after; a receiver reads the data, *then* the header, and accepts the
data only if the header still holds the payload's stamp. Any write that began after the
payload was made changed the stamp first, so a torn read is detected, never applied.

Receiver process (:class:`NixlReceiver`): one agent; per spec a registered staging
buffer with the source's layout (more only while fetched updates wait for a safe
point, see ``release``); per (source buffer, staging buffer) the descriptor lists and
two READ requests (data, then header) are prepared once and posted again for every
update. A new learner (new agent) or new registrations (new spec) make it load the
agent metadata again; a failed or timed-out read raises :class:`TransportError` naming
the learner's agent and forgets that agent, so a restarted learner starts clean.

Progress: no agent runs nixl's own progress thread, which busy-polls a core for as long
as the agent lives, idle or not (on a small machine a learner and a few receivers
starve each other that way). A receiver progresses its agent while it polls its READs.
The learner's agent is the target of those READs: the data moves without it (one-sided),
but a receiver's first READ connects and needs the learner to answer, and an endpoint
left idle for a while needs it again; a daemon thread progresses it every
``_SOURCE_PROGRESS_S``, sleeping in between.

GPU: CUDA weights are packed into VRAM buffers on their device, and a receiver process
that sees a CUDA device stages in VRAM; NIXL moves the bytes the same way.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raysync.layout import PackedLayout
from raysync.messages import BroadcastTicket
from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    Transport,
    TransportError,
    TransportReceiver,
    TransportSender,
)

logger = logging.getLogger(__name__)

#: Bytes before the packed tensors; the first 8 hold the buffer's stamp (int64).
HEADER_BYTES = 64
#: Seconds a receiver waits for one READ before it gives up on the learner.
READ_TIMEOUT_S = 60.0
#: Upper bound on how long ``send`` waits for the broadcast that last filled a buffer.
#: Broadcasts end within their own timeout; past this bound the stamps still protect
#: readers, so the learner goes on.
REUSE_WAIT_S = 600.0
#: Polling a READ: spin (yielding the CPU) this long, then sleep between polls.
_SPIN_S = 0.002
_POLL_SLEEP_S = 0.0002
#: The learner's agent is progressed this often (seconds). It serves only connection
#: set-up and upkeep, never the data, so it can be slow: each wake-up costs little.
_SOURCE_PROGRESS_S = 0.005


@dataclass(frozen=True)
class NixlRegion:
    """A registered source buffer as a receiver addresses it. Plain ints, so the hub
    that forwards payloads never needs nixl."""

    address: int
    nbytes: int  #: header plus packed tensors
    device_id: int
    mem_type: str  #: "DRAM" or "VRAM"


@dataclass(frozen=True)
class NixlPayload:
    """One version, readable from the learner's agent."""

    agent: str  #: the learner's agent name (unique per sender)
    metadata: bytes  #: the learner agent's metadata, loaded by receivers on change
    registration: int  #: bumps whenever the learner registers memory
    region: NixlRegion  #: the buffer holding this version
    stamp: int  #: what the buffer's header holds while it holds this version


def _new_agent(role: str, *, shared: bool = False) -> Any:
    """A NIXL agent with the UCX backend and without nixl's progress thread (see module
    doc); ``shared``: safe to call from several threads at once. Raises TransportError if
    UCX cannot start."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if shared else None
    agent = nixl_agent(
        f"raysync-{role}-{uuid.uuid4().hex[:12]}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync),
    )
    if "UCX" not in agent.backends:
        raise TransportError(
            "nixl has no UCX backend plugin (only: " + ", ".join(agent.get_plugin_list()) + ")"
        )
    return agent


def _mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def _device_id(device: torch.device) -> int:
    return device.index if device.type == "cuda" else 0


def _set_stamp(buffer: torch.Tensor, stamp: int) -> None:
    buffer[:8].view(torch.int64).fill_(stamp)


def _stamp_of(buffer: torch.Tensor) -> int:
    return int(buffer[:8].view(torch.int64).item())


# -- learner process ---------------------------------------------------------------------


def _progress(agent: Any, stop: threading.Event) -> None:
    """Learner process, a daemon thread: progress ``agent`` every ``_SOURCE_PROGRESS_S``
    until ``stop`` is set (receivers connect and keep their endpoints through it)."""
    while not stop.wait(_SOURCE_PROGRESS_S):
        try:
            agent.get_new_notifs()  # progresses the agent's UCX worker
        except Exception as err:
            logger.debug("progressing nixl agent %s failed: %s", agent.name, err)


def _start_progress(owner: object, agent: Any) -> None:
    """Progress ``agent`` from a daemon thread for as long as ``owner`` lives."""
    stop = threading.Event()
    threading.Thread(
        target=_progress, args=(agent, stop), name="raysync-nixl-progress", daemon=True
    ).start()
    weakref.finalize(owner, stop.set)


@dataclass
class _SourceBuffer:
    tensor: torch.Tensor  #: uint8, header + packed tensors, registered
    region: NixlRegion
    broadcast: Any = None  #: ack future of the broadcast that last filled it


@dataclass
class _SourcePair:
    layout: PackedLayout
    buffers: tuple[_SourceBuffer, _SourceBuffer]
    registered: Any  #: nixlRegDList, for deregistration
    next: int = 0


class NixlSender(TransportSender):
    def __init__(self, hub: Any) -> None:
        self._hub = hub
        self._agent = _new_agent("learner", shared=True)
        _start_progress(self, self._agent)
        self._pairs: dict[tuple[WeightSpec, torch.device], _SourcePair] = {}
        self._by_address: dict[int, _SourceBuffer] = {}
        self._registration = 0
        self._metadata = self._agent.get_agent_metadata()
        self._stamp = 0
        self._lock = threading.Lock()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> NixlPayload:
        device = tensors[spec.names[0]].device
        with self._lock:
            pair = self._pairs.get((spec, device)) or self._register(spec, device)
            buffer = pair.buffers[pair.next]
            pair.next ^= 1
            self._wait_until_read(buffer)
            self._stamp += 1
            _set_stamp(buffer.tensor, 0)
            pair.layout.pack(tensors, buffer.tensor[HEADER_BYTES:])
            _set_stamp(buffer.tensor, self._stamp)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return NixlPayload(
                self._agent.name, self._metadata, self._registration, buffer.region, self._stamp
            )

    def submitted(self, payload: NixlPayload, result: Any) -> None:
        with self._lock:
            self._by_address[payload.region.address].broadcast = result

    def _register(self, spec: WeightSpec, device: torch.device) -> _SourcePair:
        layout = PackedLayout.of(spec)
        tensors = [
            torch.zeros(HEADER_BYTES + layout.nbytes, dtype=torch.uint8, device=device)
            for _ in range(2)
        ]
        registered = self._agent.register_memory(tensors)
        buffers = tuple(
            _SourceBuffer(
                t, NixlRegion(t.data_ptr(), t.numel(), _device_id(device), _mem_type(device))
            )
            for t in tensors
        )
        pair = _SourcePair(layout, buffers, registered)
        self._pairs[(spec, device)] = pair
        for buffer in buffers:
            self._by_address[buffer.region.address] = buffer
        self._registration += 1
        self._metadata = self._agent.get_agent_metadata()
        return pair

    def _wait_until_read(self, buffer: _SourceBuffer) -> None:
        """Wait for the broadcast that last filled ``buffer`` to complete (see module doc)."""
        if buffer.broadcast is None:
            return
        result, buffer.broadcast = buffer.broadcast, None
        try:
            outcome = ray.get(result, timeout=REUSE_WAIT_S)
            if isinstance(outcome, BroadcastTicket):
                ray.get(
                    self._hub.wait_for.remote(outcome, raise_on_failure=False),
                    timeout=REUSE_WAIT_S,
                )
        except ray.exceptions.GetTimeoutError:
            logger.warning(
                "a broadcast of this learner is still running after %g s; reusing its buffer "
                "(receivers still reading it will fail that version, not apply torn data)",
                REUSE_WAIT_S,
            )
        except ray.exceptions.RayError:
            pass  # the broadcast ended in an error (failed receivers, rejected spec): done

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                self._agent.deregister_memory(pair.registered)
            self._pairs.clear()
            self._by_address.clear()


# -- receiver process --------------------------------------------------------------------


@dataclass
class _Read:
    """Prepared READs from one source buffer into one staging buffer."""

    remote: Any  #: prepped remote dlist: [header stamp, packed tensors]
    data: Any  #: xfer handle: the packed tensors
    stamp: Any  #: xfer handle: the header's stamp, read after the data

    def release(self) -> None:
        for handle in (self.data, self.stamp, self.remote):
            try:
                handle.release()
            except Exception as err:  # a request to a dead peer may refuse to abort
                logger.debug("could not release %r: %s", handle, err)


@dataclass
class _Staging:
    tensor: torch.Tensor  #: uint8, header + packed tensors, registered
    views: list[torch.Tensor]
    registered: Any  #: nixlRegDList
    local: Any  #: prepped local dlist: [header stamp, packed tensors]
    reads: dict[tuple[str, int], _Read] = field(default_factory=dict)


def _staging_device() -> torch.device:
    """CUDA (current device) when this process sees one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class NixlReceiver(TransportReceiver):
    def __init__(self) -> None:
        self._agent = _new_agent("receiver")
        self._device = _staging_device()
        self._free: dict[WeightSpec, list[_Staging]] = {}
        self._stagings: list[_Staging] = []
        self._leased: dict[int, tuple[Sequence[torch.Tensor], WeightSpec, _Staging]] = {}
        self._sources: dict[str, int] = {}  #: agent -> registration whose metadata is loaded
        self._lock = threading.Lock()

    def fetch(self, payload: NixlPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        with self._lock:
            staging = self._take_staging(spec)
            try:
                if payload.region.nbytes != staging.tensor.numel():
                    raise TransportError(
                        f"learner agent {payload.agent} sent a {payload.region.nbytes}-byte "
                        f"buffer for a spec of {staging.tensor.numel()} bytes ({spec.summary()})"
                    )
                read = self._prepared(payload, staging)
                self._post(read.data, payload, "data")
                self._post(read.stamp, payload, "stamp")
                found = _stamp_of(staging.tensor)
                if found != payload.stamp:
                    raise TransportError(
                        f"the learner (agent {payload.agent}) overwrote its buffer while this "
                        f"receiver read it (stamp {found}, expected {payload.stamp}): two newer "
                        "versions were broadcast during the read; this version is dropped"
                    )
            except BaseException:
                self._free[spec].append(staging)
                raise
            staged = list(staging.views)
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

    def _take_staging(self, spec: WeightSpec) -> _Staging:
        """A staging buffer for ``spec`` that no waiting apply still holds."""
        free = self._free.setdefault(spec, [])
        if free:
            return free.pop()
        layout = PackedLayout.of(spec)
        tensor = torch.zeros(HEADER_BYTES + layout.nbytes, dtype=torch.uint8, device=self._device)
        registered = self._agent.register_memory(tensor)
        local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._descs(tensor), _mem_type(self._device)
        )
        staging = _Staging(tensor, layout.views(tensor[HEADER_BYTES:]), registered, local)
        self._stagings.append(staging)
        return staging

    def _descs(self, tensor: torch.Tensor) -> list[tuple[int, int, int]]:
        """[header stamp, packed tensors] of a buffer at ``tensor``."""
        device_id = _device_id(tensor.device)
        address = tensor.data_ptr()
        return [
            (address, 8, device_id),
            (address + HEADER_BYTES, tensor.numel() - HEADER_BYTES, device_id),
        ]

    def _prepared(self, payload: NixlPayload, staging: _Staging) -> _Read:
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
        region = payload.region
        remote_descs = [
            (region.address, 8, region.device_id),
            (region.address + HEADER_BYTES, region.nbytes - HEADER_BYTES, region.device_id),
        ]
        try:
            remote = self._agent.prep_xfer_dlist(payload.agent, remote_descs, region.mem_type)
            data = self._agent.make_prepped_xfer("READ", staging.local, [1], remote, [1])
            stamp = self._agent.make_prepped_xfer("READ", staging.local, [0], remote, [0])
        except Exception as err:
            self._forget(payload.agent)
            raise TransportError(
                f"could not prepare a READ from learner agent {payload.agent}: {err}"
            ) from err
        read = staging.reads[key] = _Read(remote, data, stamp)
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
        for staging in self._stagings:
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
            for staging in self._stagings:
                staging.local.release()
                self._agent.deregister_memory(staging.registered)
            self._stagings.clear()
            self._free.clear()
            self._leased.clear()


# -- the transport -----------------------------------------------------------------------


@functools.cache
def nixl_availability() -> Availability:
    """Can nixl run here: the package imports and an agent with UCX starts (once per process)."""
    try:
        _new_agent("probe")
    except ImportError as err:
        return Availability(
            False, f"the nixl package is not installed ({err}); pip install 'raysync[nixl]'"
        )
    except Exception as err:
        return Availability(False, f"nixl could not create an agent with the UCX backend: {err}")
    return Availability(True)


class NixlTransport(Transport):
    name = "nixl"
    one_sided = True
    gpu_capable = True
    private_staging = True

    @classmethod
    def availability(cls) -> Availability:
        """Imports nixl and creates one UCX agent (once per process)."""
        return nixl_availability()

    @classmethod
    def open_sender(cls, hub: Any) -> NixlSender:
        return NixlSender(hub)

    @classmethod
    def open_receiver(cls, info: Any) -> NixlReceiver:
        return NixlReceiver()
