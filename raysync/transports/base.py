"""The contract every data path meets.

A transport moves one version's tensors from the learner to receivers; the hub only
forwards the small, picklable *payload* the transport hands it. Lifecycle, with the
process that calls each method:

1. hub process, once, when the hub starts: ``planner = Transport.open_hub(hub)``
   (a :class:`HubContext`). The planner may start the Ray actors that own the
   transport's resources (segments, agents, process groups; their classes come from
   :func:`raysync.actor_classes.actor_class`); ``planner.close()`` stops them.
2. hub process, each registration: ``info = await planner.receiver_joined(receiver)``;
   ``info`` (connection details, picklable) reaches the receiver in its Welcome. The
   hub calls it in the same step as it books the registration: what a planner does
   when it is called (a plain method that returns the coroutine), not once awaited,
   comes before any plan that targets this registration.
   ``await planner.receiver_left(worker)`` when a receiver dies or leaves, and
   ``await planner.receiver_lapsed(worker)`` when one Ray cannot tell alive or dead (a
   driver or a task) stopped beating.
3. learner process, once per hub handle and hand-off in use:
   ``sender = Transport.open_sender(hub)`` of the transport named by ``hand_off``
   (its own name unless it reuses another's learner half, as ``distributed`` and
   ``rpc`` reuse the object store's put).
4. learner process, each broadcast: ``payload = sender.send(tensors, spec, model)`` —
   the data leaves the learner here (or is made readable by receivers). ``tensors`` is
   the flat, name-sorted mapping from :func:`raysync.weights.flatten`; ``model`` the
   model id it is a version of. Right after, the
   learner hands the payload to the hub and tells the sender
   ``sender.submitted(payload, done)``: ``done`` (:class:`VersionDone`) is the end of
   that broadcast, so a sender that reuses its memory knows when receivers are done
   with a version. A
   sender may also finish writing the data in ``submitted`` (its receivers then wait
   for it), so the write overlaps the hub's planning and the first reads; the learner
   may change its weights once ``submitted`` returns.
5. hub process, each broadcast: ``payloads = await planner.plan(update, spec, targets)`` maps
   each targeted worker to the payload it reads (default: the learner's payload for
   all), or to :class:`Unplanned` (why there is none: that worker fails alone). This is
   where a transport relays per node. The hub keeps the latest update
   for receivers that join later and never opens a payload itself, so it never
   imports a transport's heavy dependency unless the planner does. A transport that
   declares ``learner_delivers`` lets the learner call its receivers itself with the
   payload (the direct path): the hub plans none of those deliveries, only the others
   (unless it declares ``plans_learner_deliveries``: then its planner books them too,
   once they left, and their payloads stay the learner's).
6. receiver process, once per registration: ``receiver = Transport.open_receiver(info)``.
7. receiver process, each update, *outside* the safe point:
   ``staged = receiver.fetch(payload, spec)`` returns one read-only tensor per spec
   entry, in spec order (views of staged data; any device).
8. receiver process, at the safe point: the receiver mixin copies ``staged`` into the
   model's own tensors in place, then acknowledges. A zero-copy receiver of a
   transport that declares ``zero_copy`` instead points the model's tensors at
   ``staged`` (``tensor.data = view``): no copy, and ``staged`` stays the model's
   memory until a newer version replaces it.
9. receiver process, once for every payload it was handed:
   ``receiver.release(payload, staged)`` when nothing reads ``staged`` any more —
   after the copy, which may run long after ``fetch`` (several fetched updates may
   wait for one safe point), or at once with ``staged=None`` when the update was
   skipped as stale or its fetch failed; for a version a zero-copy model took over,
   when the model moves on to a newer one. Until then ``staged`` must stay unchanged.
   A transport that reuses buffers (shared-memory slots, NIXL staging) frees them here.
   A payload the receiver never takes in (a pull's answer that came after the pull
   stopped waiting, a welcome's catch-up a pull receiver turns down) goes back by
   ``receiver.decline(payload)`` instead, from any thread, also once it closed.

Acknowledgement: the receiver's delivery call resolves to an :class:`~raysync.messages.Ack`
once the copy is done, so a transport whose ``fetch`` returns when the data is local
gets correct ack futures without writing any. A transport whose data lands
asynchronously (a collective, a one-sided read) makes ``fetch`` wait for its own
completion, with a timeout, and raises :class:`TransportError` on failure.

Capabilities are declared as class attributes and never probed with ``hasattr``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import ray

from raysync.errors import RaySyncError
from raysync.spec import WeightSpec

if TYPE_CHECKING:
    import torch

#: Seconds :meth:`HubContext.stopped` waits for the hub's answer.
_STOPPED_ASK_S = 10.0


class TransportError(RaySyncError, RuntimeError):
    """A transport could not move the data; the message names the likely cause."""


@dataclass(frozen=True)
class HubContext:
    """The hub as the transport halves see it, in the hub and learner processes."""

    actor: Any  #: the hub's ActorHandle
    #: The same across the hub's restarts: names the resource actors the hub's planners
    #: start, so a learner can find them (``HubConfig.hub_id``).
    hub_id: str
    #: This transport's options (an instance of its :attr:`Transport.options`) from
    #: ``WeightHub.remote(options=...)``; None: the transport's defaults.
    options: Any = None

    def stopped(self) -> bool:
        """Whether the hub was closed or died, so a resource actor it stopped will not
        come back: a learner-side sender waiting for one asks, and gives up at once.
        One hub round trip; a hub that is restarting is not stopped."""
        try:
            return bool(ray.get(self.actor.closed.remote(), timeout=_STOPPED_ASK_S))
        except ray.exceptions.ActorDiedError:
            return True
        except ray.exceptions.RayError:  # restarting, or slow to answer: not known stopped
            return False


@dataclass(frozen=True)
class Availability:
    """Whether a transport can run in this process, and if not, why (one line)."""

    available: bool
    reason: str = ""


class VersionDone(ABC):
    """The end of one broadcast, as the learner's handle hands it to a sender: every
    targeted receiver acked or failed the version, or the hub refused it. Lets a sender
    that reuses its memory wait for the readers of a version without knowing the hub."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until the broadcast ended (however it ended); ``TimeoutError`` after
        ``timeout_s``. Called in the learner process, from any thread."""

    def ended(self) -> bool:
        """Whether the broadcast has ended, without waiting."""
        try:
            self.wait(0)
        except TimeoutError:
            return False
        return True

    def refused(self) -> bool:
        """Whether the broadcast has ended refused by the hub before it published the
        version (so the version never became the model's latest), without waiting.
        False while it runs, and wherever that is not known. Called in the learner
        process, from any thread, by a sender choosing memory to write (the nixl
        sender writes the buffer of a refused version again rather than the one that
        may hold the latest). Default: False: a sender then keeps the version readable
        as if it were the latest, which is always safe."""
        return False


class TransportSender(ABC):
    """Learner-side half of a transport. One per hub handle per learner process."""

    @abstractmethod
    def send(self, tensors: Mapping[str, torch.Tensor], spec: WeightSpec, model: str) -> Any:
        """Make this version of model ``model`` readable by receivers; return the payload
        the hub forwards. The hub keeps each model's latest payload for receivers that
        join later, so memory it names stays readable until that model's next version."""

    def send_buckets(
        self,
        tensors: Mapping[str, torch.Tensor],
        spec: WeightSpec,
        bucket_bytes: int,
        stall_s: float,
    ) -> Any:
        """Start a version that moves in buckets of ``bucket_bytes`` (see
        :mod:`raysync.transports.buckets`); return its payload. Only for transports that
        declare ``buckets``. ``tensors`` are the learner's own (their dtypes may differ
        from ``spec``'s, the wire's: the sender casts each piece as it packs it). The
        buckets move in ``submitted``, which returns once the last is packed, so no
        process holds the whole version beside the model; a receiver that keeps the
        others waiting for more than ``stall_s`` is dropped from the version."""
        raise NotImplementedError(f"{type(self).__name__} does not send buckets")

    def submitted(self, payload: Any, done: VersionDone) -> None:
        """``payload`` went to the hub; ``done`` says when that broadcast ended. Default:
        nothing to track."""

    def abandoned(self, payload: Any, why: str) -> None:
        """``payload`` (from ``send`` or ``send_buckets``) will never be ``submitted``:
        the broadcast failed in between, for ``why``. Let go of what was set aside for
        it, and tell readers that may have been handed it. Default: nothing to do."""

    def close(self) -> None:
        """Release what the sender holds. Default: nothing to release."""


@dataclass(frozen=True)
class ReceiverInfo:
    """What a planner knows of a receiver (hub process)."""

    worker: str
    actor: str  #: "ClassName(actor_id)", for messages
    node_id: str
    process: str  #: Ray worker id of the receiver's process: new after an actor restart
    handle: Any  #: the receiver's ActorHandle
    #: The OS pid of the receiver's process on its node (0: not known): a transport's
    #: resource actor on that node can tell when it is gone (see ``receiver_lapsed``).
    pid: int = 0
    #: Payloads a live process registering again still reads: those its zero-copy
    #: models live in, and versions staged there waiting for a safe point. Their memory
    #: must not be reused under it.
    kept: tuple[Any, ...] = ()
    #: Its key in its host process and the host's entry point
    #: (:func:`raysync.receiver_delivery.serve_call` asks it to serve a version it holds).
    attachment: str = ""
    entry: Any = None
    #: Its last delivery timed out and it has acked no version since (a receiver busy
    #: in a long method, its deliveries queued behind it): a transport whose receivers
    #: move each version together may have it read the learner's copy alone instead of
    #: holding up the others (``distributed``).
    behind: bool = False
    #: Its learner delivered this version to it itself (the direct path): the plan only
    #: books what it reads (a slot's hold); it reads and lets go of that version
    #: whatever becomes of the plan, so a plan cut short must not let go for it.
    called_by_learner: bool = False


#: While the hub awaits a planner's ``plan``: the ``time.monotonic()`` by which it needs
#: the plan (the hub's own timeout; past it every target of the plan fails). A planner
#: that waits on several resources gives up on one in time for the others to be planned
#: (mapping its workers to :class:`Unplanned`). None outside a plan.
PLAN_DEADLINE: ContextVar[float | None] = ContextVar("PLAN_DEADLINE", default=None)


def plan_share_left(share: float, at_least: float = 0.0) -> float | None:
    """``share`` of what is left of the hub's plan deadline (:data:`PLAN_DEADLINE`), in
    seconds, at least ``at_least``; None outside a plan (no deadline). Called by a
    planner, in the hub process, to give one resource part of the plan's time."""
    deadline = PLAN_DEADLINE.get()
    if deadline is None:
        return None
    return max(at_least, share * (deadline - time.monotonic()))


@dataclass(frozen=True)
class Unplanned:
    """What :meth:`TransportPlanner.plan` maps a worker to when it has no payload for it
    (its node's relay failed, its node is gone): that worker fails, for ``reason``,
    and the others read theirs."""

    reason: str


class TransportPlanner:
    """Hub-side half of a transport (hub process). The default forwards the learner's
    payload to every receiver and needs no connection details."""

    async def receiver_joined(self, receiver: ReceiverInfo) -> Any:
        """Connection details for ``receiver`` (passed to ``open_receiver``). Default: None."""
        return None

    async def receiver_left(self, worker: str) -> None:
        """``worker`` died or unregistered. Default: nothing to tear down."""

    async def receiver_lapsed(self, worker: str) -> None:
        """``worker`` stopped beating and Ray cannot say whether it died (a driver or a
        task): the hub forgets it until it registers again. Default: as
        :meth:`receiver_left`; a transport whose memory a zero-copy model may live in
        keeps that memory for it."""
        await self.receiver_left(worker)

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        """Per targeted worker, the payload it reads, or :class:`Unplanned` with why it
        has none. Default: the learner's payload. A worker left out (it left the hub
        while the plan waited) fails alone.

        ``update`` is the :class:`~raysync.messages.Update` of one version, ``spec`` its
        model's spec (updates carry only its digest).
        """
        return {receiver.worker: update.payload for receiver in targets}

    async def published(self, update: Any, spec: WeightSpec) -> None:
        """A version this transport carries that none of its receivers is sent (they
        pull, or none is registered): it is the latest all the same. Default: nothing.
        A transport whose learner-side memory waits for the hub's word on each version
        (shared memory's slots) hears it here."""

    def abandoned(self, payload: Any, read_by: Sequence[str] = ()) -> None:
        """A payload of this transport's hand-off that the hub will never plan or keep:
        its version was refused (a stale or unknown version, a failed version in parts)
        or a version in parts left it out. Memory held for it until its plan may go,
        but for ``read_by``: this transport's receivers its learner delivered it to
        itself before the hub refused it (the direct path), which read it all the same
        and let go of it as of any version they read. Called for every refused payload,
        whatever its hand-off, in the same step as the refusal: a planner ignores those
        not its own. Default: nothing."""

    def set_aside(self, payload: Any, worker: str) -> bool:
        """A delivery of ``payload``, planned for ``worker``, may never make its own call
        (a transport whose deliveries take turns, :attr:`Transport.one_call_at_a_time`:
        it waits for the receiver's running call while a newer version waits too, or
        it ended without a call). A planner
        whose plan holds something per receiver lets go of it now and returns True:
        the delivery plans the read again (:meth:`plan_pull`) if it goes after all.
        Default: a plan holds nothing (False). Called in the hub process."""
        return False

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """The payload ``receiver`` reads when it pulls ``update`` outside a broadcast.
        Default: the learner's payload, read directly (transports whose sender leaves a
        copy any receiver can read)."""
        return update.payload

    async def close(self) -> None:
        """Stop what the planner started. Default: nothing."""


class TransportReceiver(ABC):
    """Receiver-side half of a transport. One per receiver actor."""

    @abstractmethod
    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """Bring one version here; return read-only tensors in spec order."""

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        """Nothing reads ``staged`` (of ``payload``; None if never fetched) any more.
        Default: nothing to free."""

    def decline(self, payload: Any) -> None:
        """Hand back ``payload``, planned for this receiver and never fetched, nor to be
        (step 9). Called in the receiver process, from any thread, also once closed.
        Default: ``release(payload, None)``. A transport whose planner may hand one
        receiver the same version twice, holding something once for both (a
        shared-memory slot), lets go of what this delivery alone held: the other may be
        read yet. So does one whose planner may answer a pull with the very payload a
        broadcast delivers to this receiver (a bucketed version's own stream, while
        nobody can serve it yet): declining it leaves this receiver's place in it."""
        self.release(payload, None)

    def check_intact(self, payload: Any) -> None:
        """Raise :class:`TransportError` if the tensors fetched for ``payload`` no longer
        hold its version: memory the transport lent (a shared-memory slot) was given to
        another version while they were staged. Called at the safe point, right before
        and right after they are copied into the model (and right after a zero-copy
        model's copy of a version cast on the wire, made as it is fetched). Default:
        fetched data is the receiver's own, nothing can rewrite it."""

    def serve(self, payload: Any, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        """Send the version this receiver's model holds (``tensors``, its own) as
        ``spec`` through ``payload``, which the planner made for another receiver to
        read (a late joiner of a version no other process holds whole). Called in the
        receiver process, under its model's read side. Only planners of transports
        whose versions live nowhere else ask for it."""
        raise NotImplementedError(f"{type(self).__name__} does not serve versions")

    def close(self) -> None:
        """Release what the receiver holds. Default: nothing to release."""


@dataclass(frozen=True)
class MemoryFootprint:
    """Copies of a version a transport keeps alive while versions flow, in units of the
    model's size, besides the learner's weights and each receiver's model: what to plan
    for on the learner's node and in each receiver (benchmarks size their cells by it)."""

    learner: int  #: on the learner's node: its sender's copies, the resource actors'
    per_receiver: int  #: in each receiver process: staging, inboxes


class Transport(ABC):
    """A named data path: a factory for its two halves plus declared capabilities."""

    #: Registry name, e.g. ``"object_store"``.
    name: ClassVar[str]
    #: The dataclass of this transport's settings (``WeightHub.remote(options=...)``),
    #: or None if it has none. Its planner finds the instance in ``HubContext.options``.
    options: ClassVar[type | None] = None
    #: Whether a zero-copy receiver (``connect_hub(zero_copy=True)``) may take the
    #: tensors ``fetch`` returns as its model's memory, and on what terms:
    #: ``"private"`` (this receiver's own memory, writable), ``"read_only"`` (shared
    #: with the node's other receivers and mapped read-only: the model must never be
    #: written in place), or None (it may not). Either way the transport leaves them
    #: unchanged until ``release``, and a planner keeps what a re-registering receiver
    #: still lives in (``ReceiverInfo.kept``).
    zero_copy: ClassVar[str | None] = None
    #: What it keeps alive for receivers that copy (None: not declared), and for
    #: zero-copy receivers where ``zero_copy`` allows them.
    memory: ClassVar[MemoryFootprint | None] = None
    zero_copy_memory: ClassVar[MemoryFootprint | None] = None
    #: Whether its planner plans a version sent in parts as one (``update.payload`` is
    #: then the :class:`~raysync.transports.parts.Parts`, and its resource actor reads
    #: every part), instead of the hub planning each part as a version of its own.
    parts_in_one_plan: ClassVar[bool] = False
    #: Whether receivers read the learner's payload as it is (its planner forwards it,
    #: at least on the learner's node): the learner may then call the receivers itself,
    #: the hub booking the version in parallel (the direct path, :class:`raysync.Route`).
    learner_delivers: ClassVar[bool] = False
    #: With ``learner_delivers``: the learner's payload is readable on its own node only
    #: (receivers elsewhere read what the planner relays there): the learner calls only
    #: the receivers on its node, and the hub delivers to the others.
    learner_delivers_on_its_node: ClassVar[bool] = False
    #: With ``learner_delivers``: its planner keeps books on every delivery (a slot held
    #: per receiver), so the hub also plans the learner's own deliveries, after they
    #: left, and ignores the payloads it returns for them. Their receivers may be done
    #: with the payload (and say so to the transport) before that plan lands.
    plans_learner_deliveries: ClassVar[bool] = False
    #: Whether a receiver reads a version it turns down (it holds that one or a newer
    #: one already): every receiver of a version takes part in moving it (a collective
    #: waits for each member), so the receiver fetches it and lets it go at once.
    reads_refused: ClassVar[bool] = False
    #: Whether the hub sends a busy receiver one call at a time per model, the newest
    #: version waiting once its last call returned (``actors/delivery_lanes.py``): a
    #: call queued behind a long method keeps its update, which pins the version's
    #: bytes, and a version planned for a receiver but never delivered holds nothing
    #: (or its planner lets go of it: :meth:`TransportPlanner.set_aside`).
    one_call_at_a_time: ClassVar[bool] = False
    #: Where deliveries take turns, how many of a learner's own calls to one receiver
    #: (and model) may run at once on the direct path before the hub delivers it
    #: instead: the last one, whose reply may still be on its way when the next
    #: broadcast leaves (the receiver acks to the hub first), and one queued behind it.
    direct_calls_running_most: ClassVar[int] = 2
    #: Whether its sender's whole versions must reach the hub in the order its ``send``
    #: made them: a learner's thread then holds off its model's other broadcasts from
    #: its send to its submit call (``shared_memory``: planning a version frees the
    #: sender's older slots the hub never planned, taken to be versions it refused).
    submits_in_send_order: ClassVar[bool] = False
    #: Whether its sender moves a version in buckets under a memory cap
    #: (``send_buckets``; ``bucket_mb`` of the hub and of a broadcast).
    buckets: ClassVar[bool] = False
    #: The transport whose learner half (sender and payload) this one uses: receivers
    #: of transports with the same hand-off share one payload per version.
    hand_off: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "hand_off" not in cls.__dict__ and "name" in cls.__dict__:
            cls.hand_off = cls.name

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Can this transport run here? Cheap; imports optional dependencies lazily."""

    @classmethod
    def open_hub(cls, hub: HubContext) -> TransportPlanner:
        """Called in the hub process, about itself. Default: forward as is."""
        return TransportPlanner()

    @classmethod
    @abstractmethod
    def open_sender(cls, hub: HubContext) -> TransportSender:
        """Called in the learner process, about the hub it broadcasts through."""

    @classmethod
    @abstractmethod
    def open_receiver(cls, info: Any) -> TransportReceiver:
        """Called in a receiver process when it registers, with its planner's ``info``."""
