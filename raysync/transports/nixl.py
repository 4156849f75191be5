"""NIXL as the data path: registered memory, one-sided READs into receivers' buffers.

Learner process (:class:`NixlSender`): one NIXL agent with the UCX backend. Per weight
spec (and device) it registers, once, a *pair* of buffers laid out as a header of one
int64 stamp per *bucket* (``BUCKET_BYTES`` of the data) followed by the tensors packed
by :class:`~raysync.layout.PackedLayout`. Each version goes into the buffer of the pair
not written last time, so receivers can still read version v while the learner writes
v+1. ``send`` picks the buffer, clears its stamps and returns a small payload: the
agent's name and metadata (~0.5 KB; receivers load it only when it changes), where
the buffer is, and the version's *stamp*. ``submitted`` (right after the hub was
handed the payload) then packs the buffer bucket by bucket, setting each bucket's
stamp when it is written: receivers read bucket k while the learner packs bucket k+1,
and the pack overlaps the hub's planning instead of preceding it.

Buffer reuse, the rule: a buffer is written again only once the broadcast that last
filled it has completed (every target acked, failed or timed out): ``send`` waits for
that broadcast's ack future, which ``submitted`` hands it. That keeps every broadcast
receiver's read clean. Readers outside a broadcast (late joiners and pullers reading the
latest version, receivers still reading after their broadcast timed out) are covered by
the stamps: the learner sets a buffer's stamps to 0 before packing and each bucket's to
the version's fresh, increasing stamp once that bucket is written; a receiver reads a
bucket only once its stamp is the payload's, and after the last bucket reads every
stamp again, accepting the data only if all still hold the payload's stamp. Any write
that began after the payload was made cleared the stamps first, so a torn read is
detected, never applied. A learner that fails while packing sets the stamps to
``ABANDONED``, which fails its readers at once.

Receiver process (:class:`NixlReceiver`): one agent; per spec a registered staging
buffer with the source's layout (more only while fetched updates wait for a safe
point, see ``release``, or while a zero-copy model lives in one); per (source buffer,
staging buffer) the descriptor lists and the READ requests (per bucket its stamp and
its data, then all stamps) are prepared once and posted again for every update. A new
learner (new agent) or new registrations (new spec) make it load the agent metadata
again; a failed or timed-out read raises :class:`TransportError` naming the learner's
agent and forgets that agent, so a restarted learner starts clean.

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

import numpy
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import (
    Availability,
    HubContext,
    Transport,
    TransportError,
    TransportReceiver,
    TransportSender,
    VersionDone,
)

logger = logging.getLogger(__name__)

#: A version is written and read in pieces of this many bytes (the last one shorter):
#: receivers read one while the learner packs the next.
BUCKET_BYTES = 8 << 20
#: A bucket stamp saying the learner failed while writing that version.
ABANDONED = -1
#: Seconds between a receiver's looks at the stamp of a bucket not written yet.
_STAMP_POLL_S = 0.0001
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


@dataclass(frozen=True)
class _Frame:
    """How a version of a spec lies in a buffer (both sides compute it from the spec):
    one int64 stamp per bucket, then the packed tensors, read and written in buckets."""

    layout: PackedLayout  #: tensor offsets, after the stamps
    buckets: tuple[tuple[int, int], ...]  #: [start, end) of each bucket in the buffer

    @classmethod
    @functools.cache
    def of(cls, spec: WeightSpec) -> _Frame:
        data_bytes = PackedLayout.of(spec).nbytes
        count = -(-data_bytes // BUCKET_BYTES)
        layout = PackedLayout.of(spec, 8 * count)
        start = layout.header_bytes
        buckets = tuple(
            (start + k * BUCKET_BYTES, min(start + (k + 1) * BUCKET_BYTES, layout.nbytes))
            for k in range(count)
        )
        return cls(layout, buckets)

    def stamps(self, buffer: torch.Tensor) -> torch.Tensor:
        """The bucket stamps of ``buffer`` (int64 view)."""
        return buffer[: 8 * len(self.buckets)].view(torch.int64)


# -- learner process ---------------------------------------------------------------------


def _copy_on_this_thread(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy CPU bytes with this thread alone (numpy's memcpy, GIL released). torch's
    ``copy_`` fans a large copy out to every core, and its idle workers spin between
    buckets: the pack would then starve the very readers, hub and Ray threads it is
    meant to overlap with. One thread packs faster than one reader reads. A source on
    another device (a GPU tensor among CPU weights) goes through torch."""
    if source.device.type != "cpu":
        destination.copy_(source)
        return
    numpy.copyto(destination.numpy(), source.numpy())


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
    tensor: torch.Tensor  #: uint8, stamps + packed tensors, registered
    region: NixlRegion
    frame: _Frame
    broadcast: VersionDone | None = None  #: the end of the broadcast that last filled it
    #: The version ``send`` handed out and ``submitted`` writes: its stamp and sources.
    pending: tuple[int, list[torch.Tensor]] | None = None


@dataclass
class _SourcePair:
    buffers: tuple[_SourceBuffer, _SourceBuffer]
    registered: Any  #: nixlRegDList, for deregistration
    next: int = 0


class NixlSender(TransportSender):
    def __init__(self) -> None:
        self._agent = _new_agent("learner", shared=True)
        _start_progress(self, self._agent)
        self._pairs: dict[tuple[WeightSpec, torch.device], _SourcePair] = {}
        self._by_address: dict[int, _SourceBuffer] = {}
        self._registration = 0
        self._metadata = self._agent.get_agent_metadata()
        self._stamp = 0
        self._lock = threading.Lock()

    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> NixlPayload:
        """Pick the buffer for this version and clear its stamps; ``submitted`` writes it."""
        device = tensors[spec.names[0]].device
        with self._lock:
            pair = self._pairs.get((spec, device)) or self._register(spec, device)
            buffer = pair.buffers[pair.next]
            pair.next ^= 1
            self._wait_until_read(buffer)
            self._stamp += 1
            buffer.frame.stamps(buffer.tensor).zero_()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            buffer.pending = (self._stamp, buffer.frame.layout.byte_views(tensors))
            return NixlPayload(
                self._agent.name, self._metadata, self._registration, buffer.region, self._stamp
            )

    def submitted(self, payload: NixlPayload, done: VersionDone | None) -> None:
        """Write the version into its buffer, bucket by bucket, while receivers read it."""
        with self._lock:
            buffer = self._by_address[payload.region.address]
            buffer.broadcast = done
            pending, buffer.pending = buffer.pending, None
        if pending is None or pending[0] != payload.stamp:
            raise TransportError(f"nixl: version stamp {payload.stamp} was not sent here")
        stamp, sources = pending
        stamps = buffer.frame.stamps(buffer.tensor)
        try:
            if buffer.tensor.device.type == "cuda":
                # One pass, then the stamps: the GPU copies fast, and a stamp must not be
                # readable before the data it vouches for is.
                buffer.frame.layout.pack(sources, buffer.tensor)
                torch.cuda.synchronize(buffer.tensor.device)
                stamps.fill_(stamp)
                torch.cuda.synchronize(buffer.tensor.device)
                return
            for index, (start, end) in enumerate(buffer.frame.buckets):
                buffer.frame.layout.pack_range(
                    sources, buffer.tensor, start, end, copy=_copy_on_this_thread
                )
                stamps[index] = stamp
        except BaseException:
            stamps.fill_(ABANDONED)
            raise

    def _register(self, spec: WeightSpec, device: torch.device) -> _SourcePair:
        frame = _Frame.of(spec)
        tensors = [
            torch.zeros(frame.layout.nbytes, dtype=torch.uint8, device=device) for _ in range(2)
        ]
        registered = self._agent.register_memory(tensors)
        buffers = tuple(
            _SourceBuffer(
                t,
                NixlRegion(t.data_ptr(), t.numel(), _device_id(device), _mem_type(device)),
                frame,
            )
            for t in tensors
        )
        pair = _SourcePair(buffers, registered)
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
        done, buffer.broadcast = buffer.broadcast, None
        try:
            done.wait(REUSE_WAIT_S)
        except TimeoutError:
            logger.warning(
                "a broadcast of this learner is still running after %g s; reusing its buffer "
                "(receivers still reading it will fail that version, not apply torn data)",
                REUSE_WAIT_S,
            )

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                self._agent.deregister_memory(pair.registered)
            self._pairs.clear()
            self._by_address.clear()


# -- receiver process --------------------------------------------------------------------


def _descs(address: int, device_id: int, frame: _Frame) -> list[tuple[int, int, int]]:
    """A buffer's descriptor list, the same on both sides: every stamp, each bucket's
    bytes, each bucket's stamp."""
    count = len(frame.buckets)
    return [
        (address, 8 * count, device_id),
        *((address + start, end - start, device_id) for start, end in frame.buckets),
        *((address + 8 * k, 8, device_id) for k in range(count)),
    ]


@dataclass
class _Read:
    """Prepared READs from one source buffer into one staging buffer."""

    remote: Any  #: prepped remote dlist, laid out like the local one (``_descs``)
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
    local: Any  #: prepped local dlist (``_descs``)
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
        """READ the version bucket by bucket, each once the learner has written it."""
        frame = _Frame.of(spec)
        with self._lock:
            staging = self._take_staging(spec)
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

    def _take_staging(self, spec: WeightSpec) -> _Staging:
        """A staging buffer for ``spec`` that no waiting apply (or zero-copy model) holds."""
        free = self._free.setdefault(spec, [])
        if free:
            return free.pop()
        frame = _Frame.of(spec)
        tensor = torch.zeros(frame.layout.nbytes, dtype=torch.uint8, device=self._device)
        registered = self._agent.register_memory(tensor)
        local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _descs(tensor.data_ptr(), _device_id(tensor.device), frame),
            _mem_type(self._device),
        )
        staging = _Staging(tensor, frame.layout.views(tensor), registered, local)
        self._stagings.append(staging)
        return staging

    def _prepared(self, payload: NixlPayload, staging: _Staging, frame: _Frame) -> _Read:
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
                payload.agent, _descs(region.address, region.device_id, frame), region.mem_type
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
    zero_copy = "private"

    @classmethod
    def availability(cls) -> Availability:
        """Imports nixl and creates one UCX agent (once per process)."""
        return nixl_availability()

    @classmethod
    def open_sender(cls, hub: HubContext) -> NixlSender:
        return NixlSender()

    @classmethod
    def open_receiver(cls, info: Any) -> NixlReceiver:
        return NixlReceiver()
