"""Typed messages between the learner, the hub actor and receivers.

Every message is a frozen dataclass. Transport payloads travel inside them untouched:
an ``ObjectRef`` nested in a dataclass is passed by Ray as a reference, never resolved
by the hub.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from raysync.spec import WeightSpec
from raysync.transports.base import HubContext, Transport


class DeliveryMode(enum.Enum):
    """How a receiver gets new versions."""

    PUSH = "push"  #: the hub sends every broadcast; the receiver is in every ack
    PULL = "pull"  #: the receiver asks for the latest version when it wants it


class AckStatus(enum.Enum):
    APPLIED = "applied"  #: the receiver now holds exactly this version
    SUPERSEDED = "superseded"  #: the receiver already held this version or a newer one
    FAILED = "failed"  #: the receiver could not apply it; ``Ack.error`` says why
    #: the host process has no receiver under the registration's key: it closed it, or
    #: this is a new process (Ray restarted the actor) that has not attached again
    NOT_ATTACHED = "not attached"
    #: a learner's own delivery of a version number the receiver holds from another
    #: learner: not applied; the hub delivers the version it booked under that number
    CONFLICT = "conflict"


@dataclass(frozen=True)
class HubConfig:
    """How a hub was started; the learner-side handle needs it too."""

    transport: str
    default_timeout_s: float  #: ack timeout of a broadcast that sets none
    reject_nonfinite: bool  #: refuse weights holding NaN or Inf (checked in the learner)
    #: Random id given at launch, the same across the hub's restarts: it names the
    #: resource actors the hub's transports start and the learner looks up.
    hub_id: str
    #: Model ids a broadcast may name before any receiver registered them.
    models: tuple[str, ...] = ()
    #: Transport options (``DistributedOptions``, ``RpcOptions``, ...), one per type.
    transport_options: tuple[Any, ...] = ()
    #: Third-party transports registered where the hub was started, ``(name,
    #: "module:Class")``: the hub and every process holding its handle register them.
    transports: tuple[tuple[str, str], ...] = ()
    #: Floating tensors travel in this dtype unless a broadcast says otherwise (None:
    #: as they are); see :mod:`raysync.wire_dtype`.
    wire_dtype: Any = None
    #: Versions larger than this many MiB move in buckets of it unless a broadcast says
    #: otherwise (None: whole); see :mod:`raysync.transports.buckets`.
    bucket_mb: float | None = None
    #: Learners deliver small versions to eligible receivers through a compiled-graph
    #: channel (see :mod:`raysync.learner_channel`) instead of one Ray call each.
    channels: bool = False
    #: Ray may restart the hub actor (``max_restarts`` given and not 0): it keeps its
    #: versions and specs where a restarted incarnation reads them back
    #: (:mod:`raysync.hub_snapshot`). A hub Ray never restarts writes no snapshot.
    restartable: bool = False

    def options_of(self, options_type: type | None) -> Any:
        """The options given for a transport whose options class is ``options_type``,
        or None (its defaults)."""
        if options_type is None:
            return None
        return next((o for o in self.transport_options if isinstance(o, options_type)), None)

    def context(self, actor: Any, transport: type[Transport]) -> HubContext:
        """The hub as ``transport``'s halves see it: its handle, id and ``transport``'s
        options. Built by the hub (for planners) and the learner's handle (senders)."""
        return HubContext(actor, self.hub_id, self.options_of(transport.options))


@dataclass(frozen=True)
class BroadcastRequest:
    """Learner -> hub: one broadcast, data already handed to the transport."""

    model: str | None
    version: int | None  #: explicit version (e.g. the training step); None: the next one
    spec: WeightSpec
    payloads: dict[str, Any]  #: hand-off transport name -> its payload
    workers: tuple[str, ...] | None
    timeout_s: float | None
    wait: bool
    raise_on_failure: bool
    learner_seconds: float  #: time the learner spent packing and handing off the data
    #: What the transport carries when it differs from ``spec`` (a wire dtype); None: ``spec``.
    wire_spec: WeightSpec | None = None
    #: Which learner handle sent it and its number among that handle's broadcasts (from
    #: 1): the hub versions them in this order (Ray may start its calls out of order).
    submitter: str = ""
    sequence: int = 0
    #: Every broadcast of that handle numbered below this one is done with (its call
    #: completed or failed): the hub waits for none of them (after a hub restart, say).
    floor: int = 0
    #: This learner's slice of a version sent in parts (sharded learners, see
    #: :mod:`raysync.transports.parts`): part ``part`` of ``parts``; 1 part: the whole.
    part: int = 0
    parts: int = 1
    #: The direct path: the version the learner delivered it as (see :class:`Route`),
    #: and per worker ``(registration token, the ObjectRef of the learner's delivery
    #: call)``, or, for a receiver reached through the learner's channel, its
    #: :class:`ChannelReply` or a :class:`ChannelCall`. Nested here, Ray passes the refs
    #: to the hub as refs; the hub awaits them as its first delivery to each receiver.
    direct_version: int = 0
    direct_calls: dict[str, tuple[str, Any]] | None = None
    #: ``time.time()`` in the learner when it made ``direct_calls`` (the report's
    #: seconds and delivery phase start there).
    sent_at: float = 0.0
    #: The version moves in buckets of this many bytes (``bucket_mb``); None: whole.
    bucket_bytes: int | None = None
    #: The receivers' registrations whose actor handles the learner holds: the route
    #: the hub sends back with the result leaves those handles out.
    known: frozenset[str] = frozenset()
    #: The last version this learner delivered itself (the direct path): a broadcast
    #: the hub numbers goes above it, booked or not (one that failed after its direct
    #: calls went out left receivers holding it unbooked: never again that number).
    above: int = 0


@dataclass(frozen=True)
class DirectTarget:
    """A receiver the learner may deliver to itself, as the hub registered it."""

    worker: str
    token: str  #: its registration: a receiver that registered again is delivered by the hub
    transport: str
    #: The receiver's host actor; None in a route from the hub when the learner said it
    #: holds it already (deserializing N actor handles per broadcast costs the learner).
    handle: Any
    entry: Entry
    attachment: str
    node_id: str = ""  #: the node its host runs on (channels reach receivers on the learner's)


@dataclass(frozen=True)
class ChannelCall:
    """In ``BroadcastRequest.direct_calls`` instead of a call's ref: the learner wrote
    the version into its compiled-graph channel to this receiver; the receiver's reply
    reaches the hub in a ``channel_replies`` call (see :mod:`raysync.learner_channel`)."""

    #: The ref of the channel's loop on this receiver (Ray's ``do_exec_tasks`` task),
    #: which the learner owns: it fails with ``OwnerDiedError`` if the learner dies
    #: before it passed the reply on.
    loop: Any


@dataclass(frozen=True)
class ChannelReply:
    """In ``BroadcastRequest.direct_calls`` instead of a call's ref: the learner wrote
    the version into its channel and has the receiver's reply already."""

    reply: Any  #: Ack | ChannelLost | None, as a delivery call's reply


@dataclass(frozen=True)
class ChannelLost:
    """A receiver's reply in ``channel_replies`` when the channel broke before it came
    (a receiver of the graph died, or did not answer in time): the hub delivers that
    receiver itself, as if the learner had never called it."""

    reason: str


@dataclass(frozen=True)
class Route:
    """Hub -> learner, one broadcast ahead (in the result of the learner's previous
    broadcast, or asked for): what the next broadcast of a model carries, and whether
    the learner may deliver it itself (the direct path).

    ``hand_offs`` are the payloads to produce (always). With ``next_version`` > 0 (a
    number above the model's latest version when the route was made, handed to this
    learner only: :mod:`raysync.direct_routes`), a broadcast
    whose spec equals ``spec``, with no explicit version and no parts, whose workers
    (if named) are all in ``targets``, calls them itself as the next version and books
    it with the hub in parallel; the hub delivers every other receiver (another
    transport, joined since) and collects the acks. Versions stay the hub's: if
    another broadcast took that number first, the hub versions this one anew and
    delivers it itself (see :class:`Update` ``origin`` for how receivers stay whole).
    A broadcast that leaves the model out goes this way only if ``sole``: ``model`` was
    the only one the hub held (else the hub tells it to name one).
    """

    hand_offs: tuple[str, ...]
    model: str = ""
    next_version: int = 0
    spec: WeightSpec | None = None
    targets: tuple[DirectTarget, ...] = ()
    sole: bool = False


@dataclass(frozen=True)
class Update:
    """Hub -> receiver: version ``version`` of ``model``, readable through ``payload``.

    The receiver already holds the spec (it registered it, the hub checked it), so the
    update names it by :attr:`WeightSpec.digest` only.
    """

    model: str
    version: int
    spec_digest: str
    transport: str
    payload: Any
    #: The spec the bytes travel in when it differs from the model's (a wire dtype: the
    #: receiver fetches by it and casts into its own tensors); None: the model's.
    wire_spec: WeightSpec | None = None
    #: The learner handle that broadcast it. Versions are the hub's order; a learner
    #: delivering itself (``from_learner``) delivers the number its route named, which
    #: no other learner's route names; should two still deliver one (a number a route
    #: did not name, after a hub restart), a receiver holding a version from one
    #: learner's own delivery takes the hub's update of the same number from another
    #: (the hub's is the one that counts), and answers another learner's own delivery
    #: of it with CONFLICT.
    origin: str = ""
    #: The learner delivered it itself (the direct path; the hub awaits that call's reply).
    from_learner: bool = False
    #: The registration it is delivered to (the hub's call, or the learner's from its
    #: route), whose ack, sent now or later, the hub awaits: the receiver's own may lag
    #: the hub's (a registration whose reply it has not taken in yet, or gave up
    #: waiting for). "": the receiver's current one (its own hub watch's deliveries).
    token: str = ""


@dataclass(frozen=True)
class ServeRequest:
    """Hub's planner -> a receiver holding ``version`` of ``model``: send it, as
    ``spec`` (the keys and wire dtypes the reader expects), through ``payload`` (a
    version whose bytes no other process holds: a bucketed one, for a late joiner)."""

    model: str
    version: int
    spec: WeightSpec
    payload: Any
    #: The model's spec digest ``version`` was sent with (:attr:`Update.spec_digest`):
    #: a holder whose model was reshaped or retyped since it applied ``version`` holds
    #: other bytes under that number, and refuses to serve them.
    spec_digest: str


@dataclass(frozen=True)
class Ack:
    """Receiver -> hub: the outcome of one update on one receiver."""

    worker: str
    model: str
    version: int
    status: AckStatus
    error: str | None = None
    #: Where this receiver's time went, for a version it applied (None otherwise; a
    #: FAILED ack carries them when the version was applied and the receiver's
    #: ``on_weights_applied`` raised after). A measurement, not part of the outcome:
    #: acks compare equal without it.
    timings: ReceiverTimings | None = field(default=None, compare=False)
    #: The update's origin (see :attr:`Update.origin`): which learner's version this is.
    origin: str = ""
    #: The registration of the receiver that answered (a restarted actor registers
    #: again under a new one: its acks are not its former incarnation's). Where the
    #: ack goes, not part of the outcome: acks compare equal without it.
    token: str = field(default="", compare=False)

    @property
    def holds_version(self) -> bool:
        """Whether the receiver's model holds this version (or a newer one) once it
        answered: it applied it (also when its ``on_weights_applied`` raised after:
        FAILED, with timings), or a newer version superseded it."""
        if self.status is AckStatus.FAILED:
            return self.timings is not None
        return self.status in (AckStatus.APPLIED, AckStatus.SUPERSEDED)


@dataclass(frozen=True)
class ReceiverTimings:
    """Seconds one receiver spent on one version it applied, measured in its process."""

    fetch_s: float  #: the transport's fetch: the data moved into this process
    wait_s: float  #: staged, waiting for a safe point (user methods running)
    apply_s: float  #: writing it into the model (or adopting it, zero copy)


@dataclass(frozen=True)
class Spread:
    """The median and the maximum of one phase over the receivers that applied."""

    p50: float
    max: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        """None for no values (no receiver applied this version)."""
        if not values:
            return None
        ordered = sorted(values)
        middle = len(ordered) // 2
        p50 = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        return cls(p50, ordered[-1], len(ordered))


@dataclass(frozen=True)
class BroadcastPhases:
    """Where one broadcast's time went. The learner's and the hub's phases are one
    number each; the receivers' are spread over the receivers that applied it."""

    learner_s: float  #: flattening, checking and handing the data to the transport
    plan_s: float  #: the hub's planning (every transport's planner, in turn)
    #: Per receiver, the hub's delivery call until its ack: the phases below plus the
    #: Ray calls there and back (and a deferred ack's own call).
    deliver_s: Spread | None
    fetch_s: Spread | None
    wait_s: Spread | None
    apply_s: Spread | None

    @classmethod
    def of(
        cls, learner_s: float, plan_s: float, applied: list[tuple[float, ReceiverTimings]]
    ) -> BroadcastPhases:
        """From the receivers that applied the version: (seconds from the hub's delivery
        call to the ack, the receiver's own timings) each."""
        return cls(
            learner_s=learner_s,
            plan_s=plan_s,
            deliver_s=Spread.of([delivered for delivered, _ in applied]),
            fetch_s=Spread.of([t.fetch_s for _, t in applied]),
            wait_s=Spread.of([t.wait_s for _, t in applied]),
            apply_s=Spread.of([t.apply_s for _, t in applied]),
        )


class Entry(enum.Enum):
    """How the hub reaches a host actor."""

    RAY_CALL = "__ray_call__"  #: any actor: Ray's built-in closure call
    MIXIN_METHOD = "_raysync_deliver"  #: the WeightReceiver mixin's method
    #: The mixin's coroutine method, in an async actor: the version is read on a thread
    #: while the loop starts the actor's other calls (Ray runs a sync method, and
    #: ``__ray_call__``, where no other call starts until it returns).
    MIXIN_ASYNC = "_raysync_deliver_async"

    @property
    def mixin(self) -> bool:
        """Whether the host is a WeightReceiver: every method of its holds the gate."""
        return self is not Entry.RAY_CALL


@dataclass(frozen=True)
class Registration:
    """Receiver -> hub: who I am, which models I hold and at which versions."""

    worker: str
    #: The host actor's ActorHandle (None: a process that is no actor; pull mode only).
    handle: Any
    #: Its key in the host process (:mod:`raysync.receiver_delivery`): what the hub's
    #: delivery call names.
    attachment: str
    entry: Entry  #: how the hub's delivery call reaches the host
    actor: str  #: "ClassName(actor_id)" for messages
    node_id: str
    process: str  #: Ray worker id of the receiver's process (new after a restart)
    specs: dict[str, WeightSpec]
    versions: dict[str, int]
    mode: DeliveryMode
    #: Unique per registration: a restarted actor's entry is not dropped for the old one's death.
    token: str
    #: The transport this receiver reads by; None: the hub's.
    transport: str | None = None
    #: Payloads it still reads (a live process registering again): those its zero-copy
    #: models live in, and versions staged, waiting for a safe point.
    kept: tuple[Any, ...] = ()
    #: Seconds between its hub watch's heartbeats; None: no watch. A pull receiver is
    #: called by nobody, so its death shows only as heartbeats that stop: the hub
    #: forgets one not heard from for ``LEASE_BEATS`` of them (see ``HubState.lapsed``).
    heartbeat_s: float | None = None
    #: Per model in ``versions``, the learner whose broadcast that version is
    #: (:attr:`Update.origin`; absent: not known): two learners may have given one
    #: number two versions, and the hub's is the one that counts.
    origins: dict[str, str] = field(default_factory=dict)
    #: The OS pid of its process (0: not known), for its node's resource actors.
    pid: int = 0


@dataclass(frozen=True)
class Welcome:
    """Hub -> receiver, in answer to a Registration."""

    transport: str
    transport_info: Any  #: connection details from the transport's planner, for open_receiver
    latest: dict[str, Update]  #: per model, the latest update newer than what the receiver holds


@dataclass(frozen=True)
class BroadcastTicket:
    """What a ``wait=False`` broadcast resolves to: pass it to ``hub.wait_for``."""

    model: str
    version: int
    #: For the learner handle that sent it: the route of its next broadcast.
    route: Route | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class BroadcastReport:
    """The outcome of one broadcast, once every targeted receiver acked or failed.

    ``acked`` lists workers that hold this version or a newer one; ``failed`` maps each
    other worker to the reason (a traceback for errors raised in the receiver).
    ``seconds`` covers the learner's hand-off and the wait for the last ack.
    ``transports`` names the transports its targets read by (empty: no target).
    ``phases`` says where the time went (:class:`BroadcastPhases`).
    """

    model: str
    version: int
    acked: tuple[str, ...]
    failed: dict[str, str]
    bytes: int
    seconds: float
    transports: tuple[str, ...]
    #: Where the time went (None in reports built without timing, e.g. a refused send).
    phases: BroadcastPhases | None = None
    #: The receivers the learner delivered to itself (the direct path); the hub
    #: delivered to the others (also to one the learner's call did not reach, or whose
    #: reply was lost with the learner).
    direct: tuple[str, ...] = ()
    #: Of ``direct``, those it reached through its compiled-graph channel
    #: (``WeightHub.remote(channels=True)``, :mod:`raysync.learner_channel`).
    channel: tuple[str, ...] = ()
    #: For the learner handle that sent it: the route of its next broadcast, made when
    #: this report was (one Ray call per broadcast fewer than asking for it). None in
    #: reports from ``wait_for``.
    route: Route | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True)
class ReceiverStatus:
    worker: str
    actor: str
    mode: DeliveryMode
    versions: dict[str, int]  #: per model, the last version this receiver acked
    lag: dict[str, int]  #: per model, how many versions it is behind the latest
    transport: str  #: the transport it reads by
    #: per model, seconds since the first version it lacks was published (0: up to
    #: date; left out when not known: that version came before the hub restarted)
    lag_s: dict[str, float] = field(default_factory=dict)
    #: per model, where the time of the last version it applied went
    last_timings: dict[str, ReceiverTimings] = field(default_factory=dict)
    #: seconds since the hub last heard its hub watch (a heartbeat, or registering);
    #: None without one (``heartbeat_s=None``)
    heard_s: float | None = None


@dataclass(frozen=True)
class RefusedRegistration:
    """A receiver whose last registration (first or again) the hub refused."""

    actor: str
    error: str  #: the exception raised to the receiver, ``Type: message``
    at: float  #: ``time.time()`` in the hub


@dataclass(frozen=True)
class HubStatus:
    transport: str
    boot_id: str  #: new each time the hub actor starts (Ray restarts included)
    versions: dict[str, int]  #: per model, the latest version broadcast
    receivers: tuple[ReceiverStatus, ...] = field(default_factory=tuple)
    #: Per worker id, the last registration refused, until that worker registers: a
    #: receiver the hub no longer delivers to because it cannot get back in.
    refused: dict[str, RefusedRegistration] = field(default_factory=dict)
    #: Versions sent in parts still waiting for parts: (model, version) -> the parts
    #: arrived so far (a sharded learner that is late, or gone, shows here).
    assembling: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)
