"""WeightHubActor: raysync's control plane, an async Ray actor.

Called by the learner (``submit``, whose result carries the route of the learner's next
broadcast, and ``route`` when it has none, through :class:`raysync.HubHandle`; on the
direct path the learner has already called the receivers and ``submit`` books the
version and awaits those calls), by receivers (``register``, ``heartbeat``, ``ack``,
``latest``) and by anyone watching (``status``, ``wait_for``). It never opens a
transport payload: it validates specs, assigns versions, forwards payloads to receivers
and collects their acks.

Restarts (``max_restarts``): each model's version counter and spec are kept in
Ray's GCS key-value store (:mod:`raysync.hub_snapshot`) and read back when Ray
restarts the actor, so versions never go backwards (a hub started without
``max_restarts`` writes none: no incarnation would read it), and so are the transports
in use: the new incarnation opens them at once (a learner's next hand-off finds their
resources) and has learners hand versions to them for ``RESTORED_TRANSPORTS_S``.
Receivers notice that the new incarnation does not know them (their heartbeat) and
register again by themselves. A learner's broadcast in flight as the hub dies fails
(``submit`` is never retried: the new incarnation would publish those weights anew).
The weights themselves are not kept by the hub: receivers keep the version they hold,
and the learner's next broadcast brings everyone forward (late joiners wait for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Collection, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import ray
from ray.exceptions import ActorDiedError, RayError

from raysync.background import BackgroundTasks
from raysync.bounded import keep_newest
from raysync.channel_replies import ChannelReplies, reply_unless_learner_died
from raysync.direct_routes import DirectRoutes
from raysync.errors import (
    BroadcastError,
    HubClosedError,
    HubSnapshotError,
    RaySyncError,
    StaleVersionError,
    TransportUnavailableError,
    UnknownModelError,
    UnknownWorkerError,
)
from raysync.hub_snapshot import HubSnapshot
from raysync.hub_state import HubState, ReceiverEntry, lacks
from raysync.messages import (
    Ack,
    AckStatus,
    BroadcastPhases,
    BroadcastReport,
    BroadcastRequest,
    BroadcastTicket,
    ChannelCall,
    ChannelLost,
    ChannelReply,
    DeliveryMode,
    DirectTarget,
    HubConfig,
    HubStatus,
    RefusedRegistration,
    Registration,
    Route,
    Update,
    Welcome,
)
from raysync.metrics import FailureCause, HubMetrics
from raysync.ordering import STREAMS_KEPT, InOrder
from raysync.receiver_delivery import refuse_learner_deliveries
from raysync.routing import HandedOver, hand_off_of, hand_offs_for
from raysync.spec import WeightSpec
from raysync.transports import (
    PLAN_DEADLINE,
    Availability,
    TransportError,
    TransportPlanner,
    Unplanned,
    get_transport,
    known_transports,
    register_transport,
)
from raysync.transports.object_store.bucket_stream import (
    BucketStream,
    is_bucketed,
    open_broker,
    streams_of,
)
from raysync.transports.parts import plan_parts, plan_pull_parts, published_parts

from .heap import settle_heap
from .hub_delivery import (
    AckBook,
    Outcome,
    ReceiverDelivery,
    not_delivered,
    process_of,
    retrieve_outcome,
)
from .hub_parts import Assemblies

logger = logging.getLogger(__name__)

#: Reports kept per model for ``wait_for`` after the broadcast finished (those still
#: running are kept however many: ``wait_for`` and ``close`` wait for them).
_REPORTS_KEPT = 256
#: Refused registrations ``status`` lists (the newest, one per worker id).
_REFUSALS_KEPT = 256
#: Registrations withdrawn before they reached the hub (see :meth:`leave`), the newest.
_WITHDRAWALS_KEPT = 256
#: How long a broadcast waits for its learner's earlier ones to reach the hub (Ray may
#: start an async actor's calls out of order; after a hub restart the learner's
#: numbering goes on from where it was, so its first broadcast waits this long once).
_ORDER_WAIT_S = 1.0
#: How long a report waits, once every target's outcome is in, for the reply of the
#: learner's call to a receiver that left before the hub booked the version (acked if
#: it applied it).
_LEFT_REPLY_GRACE_S = 1.0
#: How long a restarted hub has its learners hand versions over to the transports its
#: former incarnation's receivers read by, which register again as their heartbeat
#: notices the restart (every 5 s by default; a busy host's later): one still away
#: after this gets the next version it can read.
RESTORED_TRANSPORTS_S = 60.0
#: How long ``close`` waits for receivers to hear that learners' own deliveries end.
_CLOSE_NOTICE_S = 10.0
#: How long the hub waits for a receiver it could not plan for to answer "alive?".
_ALIVE_CHECK_S = 30.0
#: How long a registration waits for the actor that holds its worker id to answer
#: "alive?" before it takes the id over.
_TAKEN_CHECK_S = 2.0
#: A bucketed version is planned whole before anyone reads it (its stream's readers
#: must all be known first), so every transport's receivers wait for the slowest
#: plan: where its receivers read by more than one transport, planning gets this share
#: of the broadcast's timeout, and a transport that never finishes planning leaves the
#: others the rest to deliver in. With one transport, nobody else waits for its plan.
BUCKETED_PLAN_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One target's delivery of a version: the update it reads, or why it gets none."""

    update: Update | None = None
    reason: str = ""
    cause: FailureCause = FailureCause.NOT_PLANNED  #: why it gets none (no update)


@dataclasses.dataclass(frozen=True)
class _Delivery:
    """One versioned broadcast as the hub delivers it: the version, its targets, and
    what the report needs of the request."""

    handed: HandedOver
    spec: WeightSpec
    targets: list[ReceiverEntry]
    timeout_s: float
    started: float  #: ``time.perf_counter()`` when the hub took the request
    learner_seconds: float  #: what the learner spent before the request left
    sent_at: float  #: ``time.time()`` when the learner made its own delivery calls
    #: the receivers the learner delivered to itself, with its call's ObjectRef (awaited
    #: as the first delivery; the hub plans and calls the others)
    first_calls: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: workers the broadcast named that left since, failed with the reason
    gone: dict[str, str] = dataclasses.field(default_factory=dict)
    #: of ``first_calls``, those the learner reached through its channel
    channel: tuple[str, ...] = ()
    #: receivers the learner delivered to that left the hub before it booked the
    #: version (one whose hook closes it once applied), with the token the learner
    #: called and its call
    left_after_call: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    #: ``time.perf_counter()`` its timeout counts from (a version sent in parts: its first
    #: part's arrival); None: from the start of its delivery
    counted_from: float | None = None

    @classmethod
    def of(
        cls,
        request: BroadcastRequest,
        handed: HandedOver,
        spec: WeightSpec,
        targets: list[ReceiverEntry],
        timeout_s: float,
        started: float,
        first_calls: dict[str, Any] | None = None,
        gone: dict[str, str] | None = None,
        counted_from: float | None = None,
    ) -> _Delivery:
        """The delivery of ``request``, versioned as ``handed``."""
        return cls(
            handed,
            spec,
            targets,
            timeout_s,
            started,
            request.learner_seconds,
            request.sent_at,
            first_calls or {},
            gone or {},
            counted_from=counted_from,
        )


@dataclasses.dataclass(frozen=True)
class _Started:
    """A broadcast the hub versioned and started delivering."""

    model: str
    version: int
    report: asyncio.Task[BroadcastReport]


class WeightHubActor:
    """See module docstring. Created through :meth:`raysync.WeightHub.remote`."""

    def __init__(self, config: HubConfig) -> None:
        self._config = config
        for name, target in config.transports:  # third-party, registered by the launcher
            register_transport(name, target)
        self._transport = config.transport
        #: One planner per transport in use: the hub's, and any a receiver asked for.
        self._planners: dict[str, TransportPlanner] = {}
        self._planner(config.transport)
        #: A hub that buckets by default starts its bucket broker now, so that its first
        #: bucketed broadcast does not wait seconds for the broker's process; learners
        #: find it by name. Otherwise the first learner that buckets starts it.
        self._broker = None
        if config.bucket_mb is not None:
            actor = ray.get_runtime_context().current_actor
            self._broker = open_broker(config.context(actor, get_transport(self._transport)))
        self._default_timeout_s = config.default_timeout_s
        self._state = HubState()
        for model in config.models:
            self._state.declare(model)
        self._boot_id = uuid.uuid4().hex
        context = ray.get_runtime_context()
        #: Where a restarted incarnation reads versions back; None if Ray never restarts it.
        self._snapshot: HubSnapshot | None = None
        if config.restartable:
            actor_id = context.get_actor_id()
            assert actor_id is not None  # runs in the hub actor's process
            self._snapshot = HubSnapshot(actor_id)
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore")
            restarted = context.was_current_actor_reconstructed
        #: Versions restored from the snapshot: their reports died with the incarnation
        self._restored: dict[str, int] = {}
        #: The transports in use before a restart, handed versions still for the
        #: receivers of the old incarnation until ``_restored_transports_until``
        #: (``time.monotonic()``): see :meth:`transports`.
        self._restored_transports: tuple[str, ...] = ()
        self._restored_transports_until = 0.0
        if restarted and self._snapshot is not None:
            self._state.restore(*self._snapshot.load())
            self._restored = self._state.versions()
            self._restored_transports = self._open_restored(self._snapshot.load_transports())
            self._restored_transports_until = time.monotonic() + RESTORED_TRANSPORTS_S
            logger.warning("hub restarted; model versions restored: %s", self._restored)
        self._reports: dict[str, OrderedDict[int, asyncio.Task[BroadcastReport]]] = {}
        self._acks = AckBook()  #: acks sent apart from their delivery call (``ack``)
        self._deliveries = ReceiverDelivery(
            self._state,
            self._acks,
            self._drop,
            self._catch_up,
            set_aside=self._set_aside,
            plan_again=self._planned_pull,
        )
        self._channel_replies = ChannelReplies()  #: learners' channels (direct path)
        self._refused: dict[str, RefusedRegistration] = {}  #: worker -> last refusal
        #: Tokens of registrations left before they registered (see :meth:`leave`).
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        #: Forgets pull receivers whose heartbeats stopped, while there are any.
        self._lease_keeper: asyncio.Task[None] | None = None
        #: Registrations whose actor Ray is being asked about (``_ask_if_alive``).
        self._asking_if_alive: set[str] = set()
        #: (learner, model) -> the highest number of that learner's calls that versioned
        #: the model (see :meth:`_superseded`), for the learners used last
        self._versioned_calls: OrderedDict[tuple[str, str], int] = OrderedDict()
        #: The version numbers routes handed to learners (the direct path): none names
        #: two broadcasts' weights.
        self._direct_routes = DirectRoutes()
        #: worker -> its planner's ``receiver_left`` still running (see :meth:`_drop`)
        self._leaving: dict[str, asyncio.Task[Any]] = {}
        self._closed = False
        self._closing = asyncio.Event()  #: set with ``_closed``: ends submits' waits
        self._model_known = asyncio.Event()
        self._in_order = InOrder(_ORDER_WAIT_S)
        self._background = BackgroundTasks("hub")
        self._metrics = HubMetrics(config.hub_id)
        #: Versions sent in parts, until whole (then started as one) or failed.
        self._assemblies: Assemblies[_Started] = Assemblies(
            self._start_assembled, self._end_streams_left_out
        )
        settle_heap()

    # -- learner -------------------------------------------------------------------------
    # Never run again on a restarted incarnation, whatever the hub's max_task_retries:
    # that one knows neither the learner's later broadcasts nor their order, and would
    # publish these (older) weights as its newest version. The learner hears the death.
    @ray.method(max_task_retries=0)
    async def submit(self, request: BroadcastRequest) -> BroadcastReport | BroadcastTicket:
        """Validate, version and deliver one broadcast (see ``HubHandle.broadcast``)."""
        if not isinstance(request, BroadcastRequest):
            raise TypeError(
                f"submit takes the BroadcastRequest that HubHandle.broadcast builds, not a "
                f"{type(request).__name__}; get a handle with raysync.get_hub(name)"
            )
        self._check_open()
        started = time.perf_counter()
        timeout_s = self._default_timeout_s if request.timeout_s is None else request.timeout_s
        try:
            begun = await self._begin(request, timeout_s, started)
        except Exception:
            if not self._state.holds_any(request.payloads):
                self._abandon(request.payloads.values(), self._called_by_learner(request))
            raise
        self._note_versioned(request, begun.model)
        if not request.wait:
            return BroadcastTicket(
                begun.model,
                begun.version,
                route=self._report_route(request),
            )
        # Shielded: a learner that cancels its call (``ray.cancel``) gives up its wait,
        # not the version, which other parts' calls, ``wait_for`` and ``close`` await.
        report = await asyncio.shield(begun.report)
        if report.failed and request.raise_on_failure:
            raise BroadcastError(report)
        # The learner's next broadcast reads its route here instead of asking for it.
        return dataclasses.replace(report, route=self._report_route(request))

    async def _begin(self, request: BroadcastRequest, timeout_s: float, started: float) -> _Started:
        """Wait for ``request``'s turn among its learner's, then book, assemble or
        version it and start its delivery; raise if it is refused."""
        late = await self._in_order.wait_turn(request.submitter, request.sequence, request.floor)
        self._check_open()  # close() may have begun while it waited its turn
        if not late:  # in its turn (Ray may start a learner's calls out of order); a late
            self._note_submitted(request)  # one is older than what its learner did since
        if late and self._superseded(request):
            self._refuse_late(request)
        if request.direct_calls is not None:
            begun = self._book_direct(request, request.direct_calls, timeout_s, started)
            if begun is not None:
                return begun
        if request.parts > 1:
            return await self._assemble(request, timeout_s, started)
        # Delivered by its learner under a number another broadcast took: receivers
        # were touched, so a named one gone since fails alone, as when booked.
        taken = request.direct_calls is not None
        return await self._version_and_start(request, timeout_s, started, gone_ok=taken)

    def _abandon(
        self, payloads: Iterable[object], read_by: Mapping[str, tuple[str, ...]] | None = None
    ) -> None:
        """Payloads of a version the hub refused, or left out of a version in parts:
        never planned, so each transport may let go of what it holds for them, but for
        ``read_by`` (transport -> its receivers the learner delivered them to itself)."""
        read_by = read_by or {}
        for payload in payloads:
            for name, planner in self._planners.items():
                try:
                    planner.abandoned(payload, read_by.get(name, ()))
                except Exception:  # the refusal is what the learner hears
                    logger.exception("transport %r could not let go of a refused payload", name)

    def _called_by_learner(self, request: BroadcastRequest) -> dict[str, tuple[str, ...]]:
        """Per transport, the receivers ``request``'s learner delivered its version to
        itself (the direct path), registered still as they were called: refused, that
        version is read by them all the same (or a zero-copy model lives in it)."""
        called: dict[str, list[str]] = {}
        for worker, (token, _) in (request.direct_calls or {}).items():
            entry = self._state.receivers.get(worker)
            if entry is not None and entry.registration.token == token:
                called.setdefault(entry.transport, []).append(worker)
        return {transport: tuple(workers) for transport, workers in called.items()}

    def _note_submitted(self, request: BroadcastRequest) -> None:
        """``request`` had its turn: its learner goes through the hub, or delivers itself
        (:meth:`DirectRoutes.submitted`), from now on as far as the hub knows. Parts of
        a version are numbered once every part had its turn."""
        try:
            model = self._state.resolve_model(request.model)
        except (UnknownModelError, ValueError):
            return  # no model yet, or the hub says which to name: no route named it
        if model not in self._state.models:
            return  # refused in its turn: no route named it
        direct = request.direct_calls is not None
        self._direct_routes.submitted(model, request.submitter, direct=direct)

    def _superseded(self, request: BroadcastRequest) -> bool:
        """Whether a later broadcast of ``request``'s learner already versioned its model
        (``request`` came late: see :meth:`_refuse_late`). Not asked of an explicit
        version or a part: a version not above the model's is refused anyway."""
        if request.version is not None or request.parts > 1:
            return False
        try:
            model = self._state.resolve_model(request.model)
        except (UnknownModelError, ValueError):
            return False
        return self._versioned_calls.get((request.submitter, model), 0) > request.sequence

    def _note_versioned(self, request: BroadcastRequest, model: str) -> None:
        """``request`` was versioned: a call of its learner numbered below it that
        reaches the hub later carries older weights of ``model``. An unnumbered call
        (``sequence`` 0: not through a ``HubHandle``) is compared with none."""
        if request.sequence <= 0:
            return
        key = (request.submitter, model)
        if request.sequence > self._versioned_calls.get(key, 0):
            self._versioned_calls[key] = request.sequence
        self._versioned_calls.move_to_end(key)
        keep_newest(self._versioned_calls, STREAMS_KEPT)

    def _refuse_late(self, request: BroadcastRequest) -> NoReturn:
        """A broadcast that reached the hub after a later one of its learner's, of the
        same model, was versioned without it (:data:`_ORDER_WAIT_S` after): its weights
        are older than what went on, so published now they would replace the newer
        ones everywhere."""
        if request.direct_calls is not None:
            self._background.spawn(_settled(request.direct_calls), "direct calls of a late one")
        raise StaleVersionError(
            f"broadcast {request.sequence} of learner {request.submitter} (model "
            f"{request.model!r}) reached the hub more than {_ORDER_WAIT_S:g} s after the "
            "learner's later broadcasts, which were versioned without it: its weights are "
            "older than theirs and are not published"
        )

    def _book_direct(
        self,
        request: BroadcastRequest,
        calls: dict[str, tuple[str, Any]],
        timeout_s: float,
        started: float,
    ) -> _Started | None:
        """A broadcast its learner delivered itself: book it under the version it was
        delivered as and start collecting the acks; None if another broadcast took that
        version first (the hub then versions it anew and delivers it itself)."""
        version = request.direct_version
        model = self._state.resolve_model(request.model)
        published = self._state.version_of(model)
        # A number routed to another learner is that one's to deliver (this learner's
        # route came from a hub before a restart).
        if version <= published or self._direct_routes.routed_to_another(
            model, request.submitter, version
        ):
            logger.info(
                "version %d of model %r, delivered by its learner, was taken by another "
                "broadcast first: versioned anew and delivered by the hub",
                version,
                model,
            )
            self._background.spawn(_settled(calls), "direct calls of a taken version")
            return None
        spec = self._state.check_broadcast(model, request.spec)
        gone: dict[str, str] = {}
        if request.workers is None:
            targets = self._state.targets(model, None)
        else:  # every one was registered when the route was made: some may be gone since
            here, gone = self._gone_since(request.workers, f"version {version} of model {model!r}")
            targets = [self._state.receivers[w] for w in here]
        try:
            self._save_snapshot(model, spec, version)
        except HubSnapshotError:
            self._background.spawn(_settled(calls), "direct calls of an unsaved version")
            raise
        handed = self._state.publish(
            model,
            spec,
            request.payloads,
            version,
            wire_spec=request.wire_spec,
            origin=request.submitter,
        )
        if request.workers is None:  # left out: joined by a transport the learner had not seen
            targets = [t for t in targets if handed.readable_by(t.transport)]
        first_calls = {
            t.worker: call
            for t in targets
            for token, call in [calls.get(t.worker, ("", None))]
            if call is not None and token == t.registration.token
        }
        unused = {w: c for w, c in calls.items() if w not in first_calls}
        # Left since the call: acked if its reply, or its ack, says it applied the version.
        left_after_call = {w: c for w, c in unused.items() if w not in self._state.receivers}
        if unused:  # left or registered again since the route: the hub delivers them
            self._background.spawn(_settled(unused), "direct calls to departed receivers")
        by_channel = sorted(w for w, call in first_calls.items() if _by_channel(call))
        replies = []  # written into the learner's channel, the reply to come apart
        for worker in by_channel:
            call = first_calls[worker]
            if isinstance(call, ChannelReply):
                first_calls[worker] = _done(call.reply)
            else:
                replies.append((request.submitter, model, version, worker))
                reply = self._channel_replies.expect(replies[-1])
                first_calls[worker] = asyncio.ensure_future(
                    reply_unless_learner_died(reply, self._channel_replies.loop_end(call.loop))
                )
                retrieve_outcome(first_calls[worker])
        # Each learner's call its receiver's running call, where deliveries take turns
        # (a channel's runs on the compiled-graph thread: it queues behind no method).
        for worker in first_calls.keys() - set(by_channel):
            if get_transport(self._state.receivers[worker].transport).one_call_at_a_time:
                call = first_calls[worker] = asyncio.ensure_future(first_calls[worker])
                retrieve_outcome(call)
                self._deliveries.called_by_learner(calls[worker][0], model, version, call)
        delivery = _Delivery.of(
            request, handed, spec, targets, timeout_s, started, first_calls, gone
        )
        begun = self._start(
            dataclasses.replace(
                delivery, channel=tuple(by_channel), left_after_call=left_after_call
            )
        )
        if replies:
            begun.report.add_done_callback(lambda _: self._channel_replies.forget(replies))
        return begun

    def _start(self, delivery: _Delivery) -> _Started:
        """Start delivering a version and keep its report for ``wait_for``."""
        handed = delivery.handed
        task: asyncio.Task[BroadcastReport] = asyncio.create_task(self._deliver_all(delivery))
        task.add_done_callback(self._note_failed_everywhere)
        reports = self._reports.setdefault(handed.model, OrderedDict())
        reports[handed.version] = task
        if len(reports) > _REPORTS_KEPT:  # the oldest ended ones go; running ones stay
            ended = (v for v, t in reports.items() if t.done())
            for version in list(itertools.islice(ended, len(reports) - _REPORTS_KEPT)):
                del reports[version]
        return _Started(handed.model, handed.version, task)

    def _note_failed_everywhere(self, task: asyncio.Task[BroadcastReport]) -> None:
        """A version every receiver it went to failed (none acked it): no receiver holds
        its number, which its learners may send again (a version in parts whose part
        could not be read, say)."""
        if task.cancelled() or task.exception() is not None:
            return
        report = task.result()
        if report.failed and not report.acked:
            self._state.failed_everywhere(report.model, report.version)

    def _save_snapshot(self, model: str, spec: WeightSpec, version: int | None) -> None:
        """Before ``version`` of ``model`` (None: its next) is published: what a restarted
        hub reads back, versions and specs (a GCS write per version, on the event loop:
        skipped by a hub Ray never restarts). A write that fails refuses the broadcast
        with nothing published: published unsaved, a version could be numbered again by
        a restarted hub, and receivers holding it would turn the new one down."""
        if self._snapshot is None:
            return
        number = self._state.version_of(model) + 1 if version is None else version
        try:
            self._snapshot.save(
                {**self._state.versions(), model: number},
                {**self._state.specs(), model: spec},
                tuple(self._transports_in_use(restored=True)),
            )
        except Exception as err:
            raise HubSnapshotError(
                f"the hub could not save version {number} of model {model!r} to Ray's GCS, "
                f"where a restarted hub reads its versions back ({type(err).__name__}: "
                f"{err}); nothing was published: broadcast it again"
            ) from err

    def _save_registered(self) -> None:
        """After a registration: the transports and models a restarted hub must know
        before the next version is saved (see ``HubSnapshot.save_registered``): a
        receiver that came to read by another transport than those of the last version
        saved, back after a restart, was otherwise offered a version handed over without
        its hand-off, which it cannot read. A write that fails is logged: the
        registration needs nothing from it."""
        if self._snapshot is None:
            return
        try:
            self._snapshot.save_registered(
                self._state.versions(),
                self._state.specs(),
                tuple(self._transports_in_use(restored=True)),
            )
        except Exception as err:
            logger.warning(
                "the hub could not save its receivers' transports to Ray's GCS (%s: %s): "
                "restarted before its next version, it hands that one over to those "
                "saved last",
                type(err).__name__,
                err,
            )

    async def route(
        self,
        model: str | None,
        submitter: str,
        after: int = 0,
        known: frozenset[str] = frozenset(),
    ) -> Route:
        """Learner, one broadcast ahead, when its last broadcast's result has no route
        yet (see :meth:`submit`): the hand-offs its next broadcast carries and, when
        some receivers can be called by the learner itself, those receivers and the
        model's next version (see :class:`~raysync.messages.Route`). ``after``: the
        number of the submitter's broadcast sent just before this call; Ray may start
        this call first, so it waits for that broadcast's turn, and the next version it
        names is above that broadcast's (an explicit version included). ``known``: the
        registrations whose actor handles the learner holds (sent without them). If
        that broadcast has not come within the turns' wait, the route names no next
        version (its broadcast goes through the hub): the learner would deliver the
        number that broadcast then takes, other weights under it, both its own."""
        if not await self._in_order.wait_passed(submitter, after):
            return Route(self.transports())
        return self._route(model, known, submitter)

    def _report_route(self, request: BroadcastRequest) -> Route:
        """The route in ``request``'s result, for its learner's next broadcast. One after
        a bucketed version names no number: that learner's next is likely bucketed too
        (not delivered by the learner), and a number held for it would make another
        learner's versions skip it; one that is not goes through the hub, and its
        result routes a number again."""
        return self._route(
            request.model,
            request.known,
            request.submitter,
            numbered=request.bucket_bytes is None,
        )

    def _route(
        self, model: str | None, known: frozenset[str], submitter: str, numbered: bool = True
    ) -> Route:
        """The route of ``model``'s next broadcast by learner ``submitter``, as of now
        (see :meth:`route`): its next version, if ``numbered``, is handed to that learner
        only (:mod:`raysync.direct_routes`)."""
        hand_offs = self.transports()
        if self._closed or not self._state.models:
            return Route(hand_offs)
        try:
            resolved = self._state.resolve_model(model)
            self._state.check_known(resolved)
            spec = self._state.spec(resolved)
        except (UnknownModelError, ValueError):
            return Route(hand_offs)  # its broadcast goes through the hub, which says why
        targets = tuple(
            DirectTarget(
                entry.worker,
                entry.registration.token,
                entry.transport,
                None if entry.registration.token in known else entry.registration.handle,
                entry.registration.entry,
                entry.registration.attachment,
                entry.registration.node_id,
            )
            for entry in self._state.targets(resolved, None)
            if get_transport(entry.transport).learner_delivers
            and hand_off_of(entry.transport) in hand_offs
        )
        if not targets:
            return Route(hand_offs)
        next_version = 0  # the receivers and their handles still, for the broadcast after
        if numbered:
            next_version = self._direct_routes.route(
                resolved, submitter, self._state.version_of(resolved)
            )
        sole = len(self._state.models) == 1
        return Route(hand_offs, resolved, next_version, spec, targets, sole)

    async def forget_learner(self, submitter: str, after: int) -> None:
        """Learner process, as it lets its side of this hub go (``HubHandle.release``):
        the numbers routed to learner ``submitter`` hold no broadcast up any more, once
        its last broadcast (its call ``after``) had its turn; if that one never comes
        within the turns' wait, its number stays held (a gap at worst)."""
        if await self._in_order.wait_passed(submitter, after):
            self._direct_routes.forget_learner(submitter)

    async def _start_assembled(
        self, request: BroadcastRequest, timeout_s: float, first_arrived: float
    ) -> _Started:
        """Version and start a version sent in parts, whole now: delivered within
        ``timeout_s`` of its first part's arrival (``first_arrived``)."""
        return await self._version_and_start(
            request, timeout_s, first_arrived, counted_from=first_arrived
        )

    async def _version_and_start(
        self,
        request: BroadcastRequest,
        timeout_s: float,
        started: float,
        gone_ok: bool = False,
        counted_from: float | None = None,
    ) -> _Started:
        """Check ``request``, give it its version and start its delivery (in the order
        its learner submitted it: nothing here awaits once the model is known).
        ``gone_ok``: named workers no longer registered fail in the report instead of
        refusing the broadcast (its learner delivered it to the others already)."""
        if not self._state.models:
            await self._wait_for_first_model(timeout_s)
        model = self._state.resolve_model(request.model)
        self._state.check_known(model)
        spec = self._state.check_broadcast(model, request.spec)
        self._state.check_version(model, request.version)
        _check_above_direct(model, request)
        version = request.version
        if version is None:
            # Above a number routed to another learner and not booked yet (it may be
            # delivering it now), and above one its own learner delivered that the hub
            # never booked.
            version = max(
                self._direct_routes.next_version(
                    model, request.submitter, self._state.version_of(model)
                ),
                request.above + 1,
            )
        workers, gone = request.workers, dict[str, str]()
        if gone_ok and workers:
            workers, gone = self._gone_since(workers, f"this version of model {model!r}")
        targets = [] if gone and not workers else self._state.targets(model, workers)
        if request.bucket_bytes is not None:
            _check_bucket_readers(targets)
        self._save_snapshot(model, spec, version)
        handed = self._state.publish(
            model,
            spec,
            request.payloads,
            version,
            wire_spec=request.wire_spec,
            origin=request.submitter,
        )
        if request.workers is None:  # left out: joined by a transport the learner had not seen
            targets = [t for t in targets if handed.readable_by(t.transport)]
        return self._start(
            _Delivery.of(
                request,
                handed,
                spec,
                targets,
                timeout_s,
                started,
                gone=gone,
                counted_from=counted_from,
            )
        )

    async def _assemble(
        self, request: BroadcastRequest, timeout_s: float, started: float
    ) -> _Started:
        """Take one part of a version sent in parts; once every part is here, version
        and start the whole (see :mod:`raysync.actors.hub_parts`). Every part's call
        returns the same start, or raises: its own refusal, or why the version failed."""
        if request.version is None:  # the learner's handle insists on one
            raise ValueError("a version sent in parts needs an explicit version")
        if not self._state.models:
            await self._wait_for_first_model(timeout_s)
        try:
            model = (
                request.model is None
                and self._assemblies.model_of_unnamed(request.version, request.part)
            ) or self._state.resolve_model(request.model)
        except RaySyncError as err:  # it names no model, and the hub holds several
            # The one version of that number assembling that it could be a part of
            # hears it (else it waited out its deadline, to be told this part never
            # came); another model's, at the same number, does not.
            assembling = self._assemblies.fitting(request, self._known_spec)
            if len(assembling) == 1:
                self._assemblies.refuse(request, assembling[0], err)
            raise
        try:
            _check_above_direct(model, request)
            if self._assemblies.begins_attempt(model, request):  # its first part
                self._state.check_known(model)
                self._state.check_version(model, request.version)
        except RaySyncError as err:  # this part's learner alone: the others hear it
            # (else a part after it took itself for the first, to be told after the
            # whole timeout that this one never came)
            self._assemblies.refuse(request, model, err)
            raise
        # Unknown to the hub still: its first part was refused, which this one hears.
        return await self._assemblies.take(
            request, model, self._known_spec(model), timeout_s, started
        )

    def _known_spec(self, model: str) -> WeightSpec | None:
        """``model``'s spec, if the hub knows the model and its spec."""
        state = self._state.models.get(model)
        return None if state is None else state.spec

    async def wait_for(
        self,
        ticket: BroadcastTicket,
        raise_on_failure: bool = True,
    ) -> BroadcastReport:
        """The report of a ``wait=False`` broadcast, once it is complete."""
        reports = self._reports.get(ticket.model)
        task = None if reports is None else reports.get(ticket.version)
        if task is None:
            if ticket.version <= self._restored.get(ticket.model, 0):
                raise KeyError(
                    f"no report for version {ticket.version} of model {ticket.model!r}: "
                    "the hub restarted since, and reports are not kept across restarts "
                    "(hub.status() shows which version each receiver holds)"
                )
            raise KeyError(
                f"no report for version {ticket.version} of model {ticket.model!r}: "
                f"it is unknown or older than the last {_REPORTS_KEPT} broadcasts"
            )
        report = await asyncio.shield(task)
        if report.failed and raise_on_failure:
            raise BroadcastError(report)
        return report

    async def _wait_for_first_model(self, timeout_s: float) -> None:
        """A broadcast sent before the hub knows any model waits for the first receiver
        to register (the usual start-up race): an unnamed one is then for that model,
        a named one must name a model that receiver registered."""
        known = asyncio.ensure_future(self._model_known.wait())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait(
                [known, closing], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            known.cancel()
            closing.cancel()
        self._check_open()
        if not self._model_known.is_set():
            raise UnknownModelError(
                f"no receiver registered a model within {timeout_s:g} s; declare the "
                "model to broadcast before any receiver exists: "
                "WeightHub.remote(models=[...])"
            )

    def _check_open(self) -> None:
        """HubClosedError once :meth:`close` has begun."""
        if self._closed:
            raise HubClosedError("the hub is shutting down and accepts no more broadcasts")

    # -- receivers -------------------------------------------------------------------------
    async def register(self, registration: Registration) -> Welcome:
        """Add a receiver; answer with the latest version of each of its models it lacks.

        The receiver reads by the transport it asked for (``connect_hub(transport=...)``),
        else by the hub's; a transport that cannot run here fails the registration, as
        does one that moves whole versions only on a hub started with ``bucket_mb``. A
        refusal is kept for ``status`` until the worker registers.
        """
        try:
            welcome = await self._register(registration)
        except Exception as err:
            if not self._registered_since(registration):
                self._refused.pop(registration.worker, None)
                self._refused[registration.worker] = RefusedRegistration(
                    registration.actor, f"{type(err).__name__}: {err}", time.time()
                )
                keep_newest(self._refused, _REFUSALS_KEPT)
            raise
        self._refused.pop(registration.worker, None)
        return welcome

    def _registered_since(self, registration: Registration) -> bool:
        """Whether another registration of ``registration``'s worker from the same
        process is in now (it withdrew this one, and registered again before this one
        failed here): this one's refusal is not the worker's (``status`` would say it
        cannot get in, while it receives)."""
        entry = self._state.receivers.get(registration.worker)
        return (
            entry is not None
            and entry.registration.token != registration.token
            and entry.registration.process == registration.process
        )

    def _check_registering(self, registration: Registration) -> None:
        """HubClosedError once :meth:`close` has begun: its planners and background
        tasks are closed, and none opens again for a registration."""
        if self._closed:
            raise HubClosedError(
                f"the hub is shutting down: {registration.worker} ({registration.actor}) "
                "cannot register with it"
            )

    def _check_not_withdrawn(self, registration: Registration) -> None:
        """RaySyncError if its receiver withdrew ``registration`` (its register call was
        not answered in time) before the hub booked it."""
        if registration.token in self._withdrawn:
            del self._withdrawn[registration.token]
            raise RaySyncError(
                f"{registration.worker} ({registration.actor}) withdrew this registration "
                "before it reached the hub (its register call was not answered in time): "
                "register again"
            )

    async def _register(self, registration: Registration) -> Welcome:
        self._check_registering(registration)
        self._check_not_withdrawn(registration)
        transport = registration.transport or self._transport
        planner = self._planner(transport, asked_by=registration.actor)
        registration = dataclasses.replace(registration, transport=transport)
        former = self._state.receivers.get(registration.worker)
        if former is not None:
            await self._check_not_taken(former.registration, registration)
        leaving = self._leaving.get(registration.worker)
        if leaving is not None:
            # Its planner forgets the registration that left first: a receiver that
            # closes and attaches again at once was otherwise joined, then dropped by
            # its own earlier departure (a shared-memory owner then held no slot for it,
            # and a zero-copy model's segment could be rewritten under it).
            await asyncio.wait({leaving}, timeout=self._default_timeout_s)
            self._check_registering(registration)
        # Withdrawn while it waited (its receiver gave up on this call meanwhile): a
        # registration nobody holds, which broadcasts would target, is not booked.
        self._check_not_withdrawn(registration)
        _check_reads_buckets(registration, transport, self._config.bucket_mb)
        latest = self._state.register(registration)
        if former is not None and former.transport != transport:  # its planner forgets it
            self._forget_in(former.transport, registration.worker, f"moved to {transport}")
        self._model_known.set()
        entry = self._state.receivers[registration.worker]
        try:
            try:  # bounded: a resource actor that hangs fails this registration alone
                # Called in the same step as the registration was booked: a planner may
                # act as it is called, before any plan that targets this registration.
                info = await asyncio.wait_for(
                    planner.receiver_joined(entry.info), self._default_timeout_s
                )
            except asyncio.TimeoutError:
                raise TransportError(
                    f"transport {transport!r} did not take {registration.worker} in within "
                    f"{self._default_timeout_s:g} s"
                ) from None
            catch_up: dict[str, Update] = {}
            for model, handed in latest.items():
                update = handed.update_for(transport)
                if update is None:  # sent before anyone read by this transport: next one
                    continue
                # Read the way a pull reads: nothing of a broadcast in flight (a
                # collective, a group's RPCs) waits for a receiver still connecting.
                try:
                    catch_up[model] = await self._planned_pull(update, entry)
                except Exception as err:  # it starts behind: the next version reaches it
                    logger.warning(
                        "%s joins without version %d of model %r: its transport %r could "
                        "not plan reading it (%r); the next broadcast reaches it",
                        registration.worker,
                        update.version,
                        model,
                        transport,
                        err,
                    )
            self._check_registering(registration)  # close() may have begun meanwhile
            if not self._state.knows(registration.worker, registration.token):
                raise RaySyncError(
                    f"{registration.worker} was dropped while it registered (it died, or "
                    "left): register again"
                )
        except BaseException:
            here = self._state.receivers.get(registration.worker)
            if self._state.knows(registration.worker, registration.token):
                self._drop(registration.worker, registration.token)
            elif here is None or here.transport != transport:
                # Dropped while its planner took it in, which took it in after it forgot
                # it: it would hold what it planned for it (a slot) for good.
                self._forget_in(transport, registration.worker, "dropped while registering")
            raise
        logger.info("registered %s (%s, %s)", registration.worker, registration.actor, transport)
        self._save_registered()
        if self._lease_keeper is None and self._state.shortest_heartbeat() is not None:
            self._lease_keeper = self._background.spawn(self._forget_lapsed(), "leases")
        return Welcome(transport, info, catch_up)

    async def _check_not_taken(self, former: Registration, registration: Registration) -> None:
        """ValueError if ``registration``'s worker id is registered by another actor
        that answers: the two would register again over each other at every heartbeat,
        each broadcast reaching (and its report naming) whichever held the id then.
        Ray's restart of an actor is the same actor; a driver's or task's receiver has
        none to ask about; one that died, or does not answer in time (busy, or on a
        node that died and Ray does not know it yet: its replacement must get in), is
        replaced, with a warning."""
        if former.handle is None or former.handle == registration.handle:
            return
        try:
            await asyncio.wait_for(former.handle.__ray_ready__.remote(), _TAKEN_CHECK_S)
        except (asyncio.TimeoutError, RayError) as err:
            logger.warning(
                "worker id %r passes from %s (%s) to %s",
                registration.worker,
                former.actor,
                "dead" if isinstance(err, ActorDiedError) else "not answering",
                registration.actor,
            )
            return
        raise ValueError(
            f"worker id {registration.worker!r} is registered by {former.actor}, which is "
            f"alive: {registration.actor} cannot take it over (each receiver needs a worker "
            "id of its own: pass another worker_id)"
        )

    async def heartbeat(self, worker: str, token: str) -> bool:
        """A receiver's check that this hub still knows it; False means register again.
        Sets its lag gauges: between broadcasts a receiver's lag in seconds grows, and
        Ray's metrics agent drops a gauge no export refreshed for two intervals."""
        known = self._state.heartbeat(worker, token)
        if known:
            self._metrics.lags((self._state.status_of(worker),))
        return known

    async def _forget_lapsed(self) -> None:
        """Forget the pull receivers whose heartbeats stopped and whose actors died:
        checked once per the shortest heartbeat while any watched pull receiver is
        registered (nobody calls a pull receiver: nothing else would tell)."""
        while (beat := self._state.shortest_heartbeat()) is not None:
            await asyncio.sleep(beat)
            for worker, _ in self._state.lapsed():
                self._ask_if_alive(self._state.receivers[worker])
        self._lease_keeper = None

    def _ask_if_alive(self, entry: ReceiverEntry) -> None:
        """Ask Ray, off the critical path, whether ``entry``'s actor is alive; drop it
        if it died (:meth:`_drop_if_dead`). One question per registration at a time."""
        token = entry.registration.token
        if token not in self._asking_if_alive:
            self._asking_if_alive.add(token)
            self._background.spawn(self._drop_if_dead(entry), f"is {entry.worker} alive")

    async def drop_if_dead(self, workers: list[str]) -> tuple[str, ...]:
        """Whoever ended actors it knows hold receivers (``RaySyncScheme.shutdown``, after
        TorchRL killed its collectors): those of ``workers`` whose actor Ray says died,
        or restarted into a new process, are dropped now, not failed by the next
        broadcast. The ones dropped; a live one (or one that does not answer within
        ``_ALIVE_CHECK_S``), and one in no actor, are kept."""
        entries = [
            entry
            for entry in map(self._state.receivers.get, workers)
            if entry is not None and entry.registration.handle is not None
        ]
        await asyncio.gather(*(self._drop_if_dead(entry) for entry in entries))
        return tuple(
            entry.worker
            for entry in entries
            if self._state.receivers.get(entry.worker) is not entry
        )

    async def leave(self, worker: str, token: str) -> None:
        """A receiver that stops receiving (``AttachedReceiver.close``): forget it. A
        registration not known yet (its receiver gave up waiting for ``register``,
        whose call may still come: Ray keeps no order between an async actor's calls)
        is refused when it does, so that no registration nobody holds stays."""
        if not self._state.knows(worker, token):
            self._withdrawn[token] = None
            keep_newest(self._withdrawn, _WITHDRAWALS_KEPT)
        self._drop(worker, token, left=True)

    def _drop(self, worker: str, token: str, *, lapsed: bool = False, left: bool = False) -> None:
        """Forget registration ``token`` of ``worker``: it left or died, or, ``lapsed``,
        it stopped beating and may be alive (its transport keeps what its model may
        live in: see ``TransportPlanner.receiver_lapsed``). One that ``left`` on its own
        takes the models it alone had registered, never published, with it
        (:meth:`_forget_models_of`). One that died or lapsed keeps them: Ray may restart
        it, and a broadcast naming its model meanwhile is published for it to catch up
        on."""
        entry = self._state.receivers.get(worker)
        if entry is None or not self._state.drop(worker, token):
            return
        self._forget_in(entry.transport, worker, "lapsed" if lapsed else "left", lapsed)
        if left:
            self._forget_models_of(entry.registration.specs)

    def _forget_models_of(self, models: Collection[str]) -> None:
        """Forget those of ``models`` (a receiver's that left) that no receiver holds
        and that were never numbered (``HubState.forget_unclaimed``), but those a version
        sent in parts is being assembled for; the snapshot too. With no model left, a
        broadcast waits for the next receiver's, as at start-up. A snapshot write that
        fails is logged: a hub restarted before its next version is saved may know them
        again."""
        assembling = {model for model, _ in self._assemblies.arrived()}
        self._state.forget_unclaimed(models, kept=assembling)
        self._direct_routes.forget(self._state.models)
        if not self._state.models:
            self._model_known.clear()
        if self._snapshot is None:
            return
        try:
            self._snapshot.save_forgotten(models, self._state.versions(), self._state.specs())
        except Exception as err:
            logger.warning(
                "the hub could not save to Ray's GCS that it forgot the unpublished models "
                "of a receiver that left (%s: %s): restarted, it may know them again",
                type(err).__name__,
                err,
            )

    def _forget_in(self, transport: str, worker: str, why: str, lapsed: bool = False) -> None:
        """``transport``'s planner forgets ``worker`` (one that ``lapsed`` as such), in
        the background; a registration of ``worker`` waits for it first (``_leaving``)."""
        planner = self._planners[transport]
        forgetting = planner.receiver_lapsed(worker) if lapsed else planner.receiver_left(worker)
        task = self._background.spawn(forgetting, f"{worker} {why}")
        self._leaving[worker] = task
        task.add_done_callback(
            lambda done: self._leaving.pop(worker) if self._leaving.get(worker) is done else None
        )

    def _catch_up(self, entry: ReceiverEntry, model: str) -> None:
        """``entry`` answered at last a call its delivery had timed out on (busy in a long
        method; no later delivery waited for it): if it lacks the latest version of
        ``model`` and that one was sent whole, deliver it that one now, as a pull reads
        it. Outside any broadcast: a failure is logged, and the next broadcast reaches
        it."""
        handed = self._state.latest(model)
        if self._closed or handed is None or handed.version <= entry.versions.get(model, 0):
            return
        if self._state.receivers.get(entry.worker) is not entry:
            return  # it left, or registered again (welcomed with the latest)
        reports = self._reports.get(model)
        running = None if reports is None else reports.get(handed.version)
        if running is not None and not running.done():
            # That version's broadcast delivers it if it targets this receiver (or fails
            # it): look again once it ended.
            running.add_done_callback(lambda _: self._catch_up(entry, model))
            return
        update = handed.update_for(entry.transport)
        if update is None or is_bucketed(update.payload):
            # Sent before anyone read by its transport; or in buckets, gone once read: a
            # holder would serve it, held up for as long as this receiver, busy again,
            # does not read. The next broadcast reaches it.
            return

        async def deliver_latest() -> None:
            assert update is not None  # checked above
            try:
                planned = await self._planned_pull(update, entry)
                current = self._state.receivers.get(entry.worker)
                if current is None or current.registration.token != entry.registration.token:
                    return  # it left, or registered again (welcomed with the latest)
                deadline = time.monotonic() + self._default_timeout_s
                outcome = await self._deliveries.deliver(
                    entry, planned, deadline, self._default_timeout_s
                )
                error = outcome.error
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
            if error is not None:
                logger.warning(
                    "%s, free again after a delivery timed out, did not catch up with "
                    "version %d of model %r: %s; the next broadcast reaches it",
                    entry.worker,
                    update.version,
                    model,
                    error,
                )

        self._background.spawn(deliver_latest(), f"{entry.worker} catches up with {model!r}")

    async def channel_replies(
        self,
        submitter: str,
        model: str,
        version: int,
        replies: dict[str, Ack | ChannelLost | None],
    ) -> None:
        """Learner: its receivers' replies to ``version``, written into its channel
        (:mod:`raysync.learner_channel`), as each delivery call's reply would be."""
        for worker, reply in replies.items():
            self._channel_replies.arrive((submitter, model, version, worker), reply)

    async def ack(self, ack: Ack) -> None:
        """An acknowledgement sent after the delivery call returned (deferred applies):
        booked for the registration that sent it only (its worker id may have gone to
        a new actor since, which does not hold that version), also when it came after
        its delivery ended (a version applied then still is the receiver's)."""
        if ack.holds_version and self._state.knows(ack.worker, ack.token):
            self._state.record(ack.worker, ack.model, ack.version, ack.timings)
        self._acks.arrive(ack)

    async def latest(
        self,
        model: str,
        have_version: int = 0,
        worker: str | None = None,
        have_origin: str = "",
    ) -> Update | None:
        """Pull mode: the latest update of ``model`` if the caller, holding version
        ``have_version`` from learner ``have_origin``, lacks it (an older version, or the
        same number from another learner, see :func:`raysync.hub_state.lacks`),
        planned for ``worker`` (a registered receiver) if given, else the learner's payload.
        Raises UnknownWorkerError for a ``worker`` the hub does not know (closed, or
        dropped when its heartbeats stopped, or the hub restarted), before it looks at
        ``model``: the learner's payload is not planned for it, nor in the form of its
        transport, and the hub may know its models only once it registered again (a hub
        restarted before its first broadcast knows none)."""
        entry = None if worker is None else self._state.receivers.get(worker)
        if worker is not None and entry is None:
            raise UnknownWorkerError(
                f"worker {worker!r} is not registered with this hub (it closed, or was "
                "dropped when its heartbeats stopped, or the hub restarted): it registers "
                "again before it pulls"
            )
        handed = self._state.latest(model)
        if handed is None or not lacks(have_version, have_origin, handed):
            return None
        if entry is None:
            return handed.update_for(self._transport)
        update = handed.update_for(entry.transport)
        if update is None:
            return None  # sent before anyone read by this transport: the next one will be
        return await self._planned_pull(update, entry)

    def _set_aside(self, entry: ReceiverEntry, update: Update) -> bool:
        """``update``'s delivery to ``entry`` may never make its own call (a newer version
        waits for the busy receiver too, or it ended without one): its transport's
        planner lets go of what it holds for it (True if anything: the delivery plans
        it again with :meth:`_planned_pull` if it goes)."""
        return self._planners[entry.transport].set_aside(update.payload, entry.worker)

    async def _planned_pull(self, update: Update, entry: ReceiverEntry) -> Update:
        """``update`` as ``entry`` reads it outside a broadcast (a pull, joining): its
        transport's planner plans it by the spec its bytes travel in, within the hub's
        default timeout (a node's owner that hangs fails this read, instead of holding
        one of the hub's calls for ever)."""
        travels = update.wire_spec or self._state.spec(update.model)
        limit_s = self._default_timeout_s
        try:
            payload = await _planned_within(
                plan_pull_parts(
                    self._planners[entry.transport],
                    update,
                    travels,
                    entry.info,
                    in_one_plan=get_transport(entry.transport).parts_in_one_plan,
                ),
                limit_s,
            )
        except asyncio.TimeoutError:
            raise TransportError(
                f"transport {entry.transport!r} could not plan {entry.worker}'s read of "
                f"version {update.version} of model {update.model!r} within {limit_s:g} s"
            ) from None
        return dataclasses.replace(update, payload=payload)

    # -- anyone ----------------------------------------------------------------------------
    async def status(self) -> HubStatus:
        return HubStatus(
            transport=self._transport,
            boot_id=self._boot_id,
            versions={m: s.version for m, s in sorted(self._state.models.items())},
            receivers=self._state.statuses(),
            refused=dict(self._refused),
            assembling=self._assemblies.arrived(),
        )

    def config(self) -> HubConfig:
        return self._config

    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Refuse new broadcasts (those waiting for their turn or a first model too)
        and wait for those in flight."""
        self._closed = True
        self._closing.set()
        await self._refuse_learner_deliveries()
        self._assemblies.fail_all("the hub is shutting down")
        tasks = [t for reports in self._reports.values() for t in reports.values()]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._background.close()
        closing = [(name, planner.close()) for name, planner in self._planners.items()]
        outcomes = await asyncio.gather(*(c for _, c in closing), return_exceptions=True)
        for (name, _), outcome in zip(closing, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # the rest of the hub still closes
                logger.warning("transport %r did not close cleanly: %r", name, outcome)
        if self._broker is not None:
            ray.kill(self._broker)  # already gone (a planner stopped it): no error
        if self._snapshot is not None:
            self._snapshot.delete()

    async def _refuse_learner_deliveries(self) -> None:
        """Shutting down: every receiver a learner may deliver to itself refuses such
        deliveries from now on (a learner may hold a route from before). Waits at most
        ``_CLOSE_NOTICE_S`` for receivers busy in a long method."""
        calls = [
            asyncio.ensure_future(
                entry.registration.handle.__ray_call__.options(max_task_retries=0).remote(
                    refuse_learner_deliveries,
                    entry.registration.attachment,
                    entry.registration.token,
                )
            )
            for entry in self._state.receivers.values()
            if entry.registration.mode is DeliveryMode.PUSH
            and get_transport(entry.transport).learner_delivers
        ]
        if calls:
            await asyncio.wait(calls, timeout=_CLOSE_NOTICE_S)
            for call in calls:
                retrieve_outcome(call)

    # -- delivery --------------------------------------------------------------------------
    async def _deliver_all(self, delivery: _Delivery) -> BroadcastReport:
        """Deliver a version to its targets and collect their acks (see :class:`_Delivery`)."""
        handed, spec, targets = delivery.handed, delivery.spec, delivery.targets
        timeout_s, started, first_calls = delivery.timeout_s, delivery.started, delivery.first_calls
        deadline = time.monotonic() + timeout_s
        waited_s = 0.0  # of its timeout, before it could go
        if delivery.counted_from is not None:  # parts: from the first one, not the last
            waited_s = time.perf_counter() - delivery.counted_from
            deadline -= waited_s
        plan_started = time.perf_counter()
        travels = handed.wire_spec or spec  # what the transports carry
        groups: dict[str, list[ReceiverEntry]] = {}
        for entry in targets:
            if entry.worker not in first_calls or _books_direct(entry):
                groups.setdefault(entry.transport, []).append(entry)
        streams = any(is_bucketed(payload) for payload in handed.payloads.values())
        # Several planners name the readers of its bucket streams, at once: the broker
        # frees no bucket, nor ends a stream none of the readers named so far reads,
        # until every one of them planned (sealed below).
        shared = streams and len(groups) > 1
        published = self._tell_published(handed, travels, groups, deadline)
        if shared:
            await asyncio.gather(published, _hold_readers(handed))
        else:
            await published
        # The learner's own deliveries need no plan (one that books them runs beside).
        planned = {
            e.worker: _Plan(update=handed.update_for(e.transport))
            for e in targets
            if e.worker in first_calls
        }
        plan_s = 0.0
        # A bucket stream's readers must all be known to its broker before the first
        # reads (else one transport's receivers may finish it before another's planner
        # named its relay): a bucketed version is planned whole before it goes, and its
        # streams' readers are sealed then (held until, above).
        unplanned = len(groups)
        all_planned = asyncio.Event()
        if streams:
            _tell_latest(handed)
        if streams and not groups:
            self._end_unread_streams(handed, targets, planned)

        def outcome_of(entry: ReceiverEntry) -> Awaitable[Outcome]:
            plan = planned[entry.worker]
            if plan.update is None:
                return not_delivered(entry.worker, plan.reason, plan.cause)
            return self._deliveries.deliver(
                entry,
                plan.update,
                deadline,
                timeout_s,
                first_calls.get(entry.worker),
                delivery.sent_at,
            )

        async def plan_and_deliver(transport: str, group: list[ReceiverEntry]) -> list[Outcome]:
            """Each transport's receivers are delivered to once their own plan is made:
            one slow to plan holds no other back (but for buckets, above)."""
            nonlocal plan_s, unplanned
            plan = await self._plan_group(
                transport,
                group,
                handed,
                travels,
                timeout_s,
                share=BUCKETED_PLAN_SHARE if streams and len(groups) > 1 else 1.0,
                waited_s=waited_s,
                called=first_calls.keys(),
            )
            plan_s = max(plan_s, time.perf_counter() - plan_started)
            own = [e for e in group if e.worker not in first_calls]
            planned.update((e.worker, plan[e.worker]) for e in own)
            unplanned -= 1
            if not unplanned:
                if streams:
                    self._end_unread_streams(handed, targets, planned)
                if shared:
                    self._background.spawn(_seal_readers(handed), "streams planned whole")
                all_planned.set()
            if streams:
                await all_planned.wait()
            return await asyncio.gather(*(outcome_of(e) for e in own))

        async def delivered_directly() -> list[Outcome]:
            return await asyncio.gather(
                *(outcome_of(e) for e in targets if e.worker in first_calls)
            )

        async def gone() -> list[Outcome]:
            return [
                await not_delivered(worker, reason, FailureCause.LEFT)
                for worker, reason in delivery.gone.items()
            ]

        async def applied_then_left() -> list[Outcome]:
            held = await asyncio.gather(
                *(
                    self._applied_before_leaving(handed, worker, token, call, deadline)
                    for worker, (token, call) in delivery.left_after_call.items()
                )
            )
            return [
                Outcome(worker, None)
                for worker, applied in zip(delivery.left_after_call, held, strict=True)
                if applied
            ]

        # Almost every broadcast has none: no task on its path for them.
        left = asyncio.ensure_future(applied_then_left()) if delivery.left_after_call else None
        outcomes = [
            outcome
            for some in await asyncio.gather(
                *(plan_and_deliver(t, group) for t, group in groups.items()),
                delivered_directly(),
                gone(),
            )
            for outcome in some
        ]
        # One that left holds the report back a moment at most (a call queued behind a
        # long method of its host: it left, the version is not its).
        left_acked: list[Outcome] = []
        if left is not None:
            await asyncio.wait({left}, timeout=_LEFT_REPLY_GRACE_S)
            left_acked = left.result() if left.done() else []
            left.cancel()
        if left_acked:  # not failed as gone, if the broadcast named it: it applied it
            named = {o.worker for o in left_acked}
            outcomes = [o for o in outcomes if o.worker not in named] + left_acked
        for entry in targets:  # a transport could not plan it: is it alive?
            plan = planned[entry.worker]
            if plan.update is None and plan.cause is FailureCause.NOT_PLANNED:
                self._ask_if_alive(entry)
        acked = tuple(sorted(o.worker for o in outcomes if o.error is None))
        failed = {o.worker: o.error for o in outcomes if o.error is not None}
        causes = [o.cause or FailureCause.RAISED for o in outcomes if o.error is not None]
        by_hub = {o.worker for o in outcomes if o.by_hub}  # the learner's call fell through
        if first_calls:  # the version left the learner before this hub heard of it
            started = min(started, time.perf_counter() - max(0.0, time.time() - delivery.sent_at))
        report = BroadcastReport(
            model=handed.model,
            version=handed.version,
            acked=acked,
            failed=failed,
            bytes=travels.nbytes,
            seconds=delivery.learner_seconds + time.perf_counter() - started,
            transports=tuple(sorted({entry.transport for entry in targets})),
            phases=_phases(delivery.learner_seconds, plan_s, outcomes),
            direct=tuple(sorted((set(first_calls) - by_hub) | {o.worker for o in left_acked})),
            channel=tuple(w for w in delivery.channel if w not in by_hub),
        )
        # Off the critical path: queued behind the wake-up of whoever awaits the report.
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._record, report, causes)
        return report

    def _end_unread_streams(
        self, handed: HandedOver, targets: list[ReceiverEntry], planned: dict[str, _Plan]
    ) -> None:
        """Every transport planned: the bucket streams of each hand-off that none of
        the version's targets reads (their transports read another, or could not plan
        it) get no readers, so that their learner stops streaming them now. It streams
        its hand-offs one after the other: it waited for a reader of that one until the
        version's timeout, and the receivers of the next timed out meanwhile."""
        read = {hand_off_of(e.transport) for e in targets if planned[e.worker].update is not None}
        unread = [
            stream
            for hand_off, payload in handed.payloads.items()
            if hand_off not in read
            for stream in streams_of(payload)
        ]
        if unread:
            self._background.spawn(_name_no_readers(unread), "streams nobody reads")

    async def _applied_before_leaving(
        self, handed: HandedOver, worker: str, token: str, call: Any, deadline: float
    ) -> bool:
        """Whether the learner's delivery to ``worker`` (registered as ``token``), which
        left the hub since, says it holds ``handed``'s version: it applied it (or a newer
        one) before it left. Its ``call`` is an ObjectRef, its channel's reply or word
        that the reply comes apart; a reply of None (the apply was deferred) is followed
        by its ack. Anything else (it raised, died, or did not answer by ``deadline``):
        it left without it, and is left out as such."""
        reply_key = (handed.origin, handed.model, handed.version, worker)
        ack_key = (token, handed.model, handed.version, handed.origin)
        try:
            if isinstance(call, ChannelReply):
                reply = call.reply
            elif isinstance(call, ChannelCall):  # its reply comes apart, from the learner
                try:
                    expected = self._channel_replies.expect(reply_key)
                    ended = self._channel_replies.loop_end(call.loop)
                    reply = await _by(reply_unless_learner_died(expected, ended), deadline)
                finally:
                    self._channel_replies.forget([reply_key])
            else:
                reply = await _by(asyncio.ensure_future(call), deadline)
            if reply is None:  # the apply was deferred: its ack comes apart
                ack = self._acks.expect(ack_key)
                try:
                    reply = await _by(ack, deadline)
                finally:
                    self._acks.forget(ack_key, ack)
        except (RayError, asyncio.TimeoutError):
            return False
        return isinstance(reply, Ack) and reply.status in (AckStatus.APPLIED, AckStatus.SUPERSEDED)

    def _gone_since(
        self, workers: Sequence[str], booked: str
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        """The named ``workers`` still registered (each once, in order), and why each
        of the others fails the version: it left before ``booked`` was booked (every
        one was registered when its learner's route was made)."""
        named = dict.fromkeys(workers)
        here = tuple(w for w in named if w in self._state.receivers)
        gone = {
            w: f"{w} left the hub (it died or closed) before {booked} was booked"
            for w in named
            if w not in self._state.receivers
        }
        return here, gone

    def _end_streams_left_out(self, payloads: list[object]) -> None:
        """A version in parts left these payloads out (not every part carried their
        hand-off): their bucket streams get no readers, so that their learner goes on
        to the hand-offs the version uses instead of waiting for a reader of these."""
        self._abandon(payloads)
        streams = [stream for payload in payloads for stream in streams_of(payload)]
        if streams:
            self._background.spawn(_name_no_readers(streams), "streams left out of a version")

    async def _drop_if_dead(self, entry: ReceiverEntry) -> None:
        """Drop a receiver nobody calls if Ray says its actor died: one its transport had
        no plan for (its node died, taking the transport's resources there with it:
        every later version would fail it again), or a pull receiver whose heartbeats
        stopped (a live one is kept, and the memory its zero-copy model lives in stays
        held for it: a busy or cut-off process must not lose it)."""
        registration = entry.registration
        if registration.handle is None:  # a driver or a task: no actor to ask Ray about
            logger.warning(
                "%s (%s, no actor) stopped beating; dropped from the registry until it "
                "registers again (its hub watch does, if it is alive)",
                registration.worker,
                registration.actor,
            )
            self._drop(registration.worker, registration.token, lapsed=True)
            self._asking_if_alive.discard(registration.token)
            return
        try:
            process = await asyncio.wait_for(
                registration.handle.__ray_call__.remote(process_of), _ALIVE_CHECK_S
            )
        except ActorDiedError:
            process = None
        except (asyncio.TimeoutError, RayError):
            return  # busy, or restarting: its next delivery or heartbeat tells
        finally:
            self._asking_if_alive.discard(registration.token)
        if process != registration.process:  # dead, or Ray restarted it into a new one
            logger.warning(
                "%s (%s) died%s; dropped from the registry until it registers again",
                registration.worker,
                registration.actor,
                "" if process is None else " and Ray restarted it",
            )
            self._drop(registration.worker, registration.token)

    def _record(self, report: BroadcastReport, causes: list[FailureCause]) -> None:
        """Ray metrics of one broadcast, and the receivers' lags it changed."""
        self._metrics.broadcast(report, causes)
        self._metrics.changed_lags(self._state.lags())

    async def _tell_published(
        self,
        handed: HandedOver,
        spec: WeightSpec,
        groups: dict[str, list[ReceiverEntry]],
        deadline: float,
    ) -> None:
        """Tell the planners none of whose receivers this version is planned for, until
        the broadcast's ``deadline`` (``time.monotonic()``)."""
        for transport, planner in list(self._planners.items()):
            update = handed.update_for(transport)
            if transport not in groups and update is not None:
                left_s = max(0.0, deadline - time.monotonic())
                await self._published(transport, planner, update, spec, left_s)

    async def _plan_group(
        self,
        transport: str,
        group: list[ReceiverEntry],
        handed: HandedOver,
        spec: WeightSpec,
        timeout_s: float,
        share: float = 1.0,
        waited_s: float = 0.0,
        called: Collection[str] = (),
    ) -> dict[str, _Plan]:
        """Per target reading by ``transport``: the update it reads, planned by its
        transport within ``share`` of ``timeout_s`` and what is left of it after
        ``waited_s`` (a version sent in parts, counted from its first part), or why
        there is none. ``called``: the targets its learner delivered it to itself."""
        update = handed.update_for(transport)
        if update is None:
            reason = (
                f"registered to read by transport {transport!r} after the learner handed "
                "this version over without it; the next version reaches it"
            )
            return dict.fromkeys((e.worker for e in group), _Plan(reason=reason))
        limit_s = min(timeout_s * share, max(0.0, timeout_s - waited_s))
        try:
            payload_of = await _planned_within(
                plan_parts(
                    self._planners[transport],
                    update,
                    spec,
                    [
                        dataclasses.replace(e.info, called_by_learner=True)
                        if e.worker in called
                        else e.info
                        for e in group
                    ],
                    in_one_plan=get_transport(transport).parts_in_one_plan,
                ),
                limit_s,
            )
        except asyncio.TimeoutError:
            within = f"the {timeout_s:g} s timeout"
            if limit_s < timeout_s * share:  # its parts' wait took the rest
                within = f"{limit_s:.3g} s (what waiting for its parts left of {within})"
            elif share < 1.0:  # a bucketed version: the others wait for every plan
                within = f"{limit_s:g} s ({share:g} of {within}, a bucketed version's share)"
            reason = (
                f"transport {transport!r} could not plan the delivery within {within} "
                "(the hub's log says what it waited for)"
            )
            return dict.fromkeys((e.worker for e in group), _Plan(reason=reason))
        except Exception as err:
            reason = f"transport {transport!r} could not plan the delivery: {err!r}"
            return dict.fromkeys((e.worker for e in group), _Plan(reason=reason))
        planned: dict[str, _Plan] = {}
        for entry in group:
            if entry.worker not in payload_of:
                reason = (
                    f"it left the hub, or registered again, while transport {transport!r} "
                    "planned the version"
                )
                planned[entry.worker] = _Plan(reason=reason, cause=FailureCause.LEFT)
            elif isinstance(unplanned := payload_of[entry.worker], Unplanned):
                reason = f"transport {transport!r} could not plan its delivery: "
                planned[entry.worker] = _Plan(reason=reason + unplanned.reason)
            else:
                planned[entry.worker] = _Plan(
                    update=dataclasses.replace(update, payload=payload_of[entry.worker])
                )
        return planned

    async def _published(
        self,
        transport: str,
        planner: TransportPlanner,
        update: Update,
        spec: WeightSpec,
        timeout_s: float,
    ) -> None:
        """Tell ``transport``'s planner of a version none of its receivers is sent,
        within ``timeout_s``."""
        try:
            await asyncio.wait_for(
                published_parts(
                    planner, update, spec, in_one_plan=get_transport(transport).parts_in_one_plan
                ),
                timeout_s,
            )
        except Exception as err:  # its receivers' next pull or version tells
            logger.warning(
                "transport %r was not told of version %d of model %r: %r",
                transport,
                update.version,
                update.model,
                err,
            )

    def _planner(self, transport: str, asked_by: str | None = None) -> TransportPlanner:
        """The planner of ``transport``, opened on first use; TransportUnavailableError
        (naming the receiver that asked for it) if it cannot run here."""
        planner = self._planners.get(transport)
        if planner is None:
            try:
                availability = get_transport(transport).availability()
            except ValueError as err:
                availability = Availability(False, str(err))
            if not availability.available:
                who = f" (asked for by {asked_by})" if asked_by else ""
                raise TransportUnavailableError(
                    f"transport {transport!r}{who} is not available: {availability.reason}"
                )
            chosen = get_transport(transport)
            actor = ray.get_runtime_context().current_actor
            planner = chosen.open_hub(self._config.context(actor, chosen))
            self._planners[transport] = planner
        return planner

    def transports(self) -> tuple[str, ...]:
        """The hand-offs a broadcast must carry now: the hub's transport's and those of
        the transports its receivers read by (called by the learner before each send).
        After a restart, for ``RESTORED_TRANSPORTS_S``, those in use before it too: the
        old incarnation's receivers register again as their heartbeats notice, and a
        version handed over without their hand-off is one they cannot read (the welcome
        offers them none: had it been the learner's last, they never got the latest)."""
        return hand_offs_for(self._transports_in_use(restored=True))

    def _transports_in_use(self, restored: bool = False) -> list[str]:
        """The hub's transport and its receivers'; with ``restored``, those in use
        before a restart too, for ``RESTORED_TRANSPORTS_S`` after it."""
        transports = {self._transport, *self._state.transports()}
        if restored and time.monotonic() < self._restored_transports_until:
            transports.update(self._restored_transports)
        return sorted(transports)

    def _open_restored(self, transports: Sequence[str]) -> tuple[str, ...]:
        """Open the planners of ``transports``, in use before a restart, as the hub
        starts again: a learner's next hand-off (by the route it was given before)
        finds their resources (a node's segment owner, which died with the former
        incarnation). Those that open."""
        opened = []
        for transport in transports:
            try:
                self._planner(transport)
            except TransportUnavailableError as err:
                logger.warning("transport %r, in use before the restart: %s", transport, err)
            else:
                opened.append(transport)
        return tuple(opened)


def _streams(handed: HandedOver) -> list[BucketStream]:
    """The bucket streams of ``handed``, every hand-off's (one per part if in parts)."""
    return [stream for payload in handed.payloads.values() for stream in streams_of(payload)]


def _tell_latest(handed: HandedOver) -> None:
    """Tell the bucket broker which streams carry the latest version of ``handed``'s
    model (see ``BucketBroker.latest``); not waited for (the hub's one broker)."""
    streams = _streams(handed)
    streams[0].broker.latest.remote(handed.model, [stream.key for stream in streams])


async def _hold_readers(handed: HandedOver) -> None:
    """Tell the bucket broker, before the planners of ``handed`` run, that several of
    them name the readers of its streams: none is planned until :func:`_seal_readers`
    (see ``BucketBroker.hold``)."""
    await _tell_streams(_streams(handed), "could not hold the readers of a stream open", "hold")


async def _seal_readers(handed: HandedOver) -> None:
    """Tell the bucket broker that every planner of ``handed`` named its streams'
    readers (see ``BucketBroker.seal``)."""
    await _tell_streams(_streams(handed), "could not seal the readers of a stream", "seal")


async def _name_no_readers(streams: list[BucketStream]) -> None:
    """Tell each stream's broker that nobody reads it (its learner stops putting it)."""
    await _tell_streams(streams, "could not end a stream nobody reads", "readers", [])


async def _tell_streams(
    streams: list[BucketStream], failed: str, call: str, *args: Any
) -> None:
    """Call each stream's broker's ``call`` (its key, then ``args``), all at once; one
    whose broker is gone is logged (``failed``): the streams went with it."""
    told = await asyncio.gather(
        *(getattr(stream.broker, call).remote(stream.key, *args) for stream in streams),
        return_exceptions=True,
    )
    for outcome in told:
        if isinstance(outcome, BaseException):
            logger.info("%s: %r", failed, outcome)


async def _planned_within(planning: Awaitable[Any], limit_s: float) -> Any:
    """``planning`` (a planner's coroutine) within ``limit_s``, its planner's waits told
    the deadline (``PLAN_DEADLINE``); ``asyncio.TimeoutError`` after."""
    deadline = PLAN_DEADLINE.set(time.monotonic() + limit_s)
    try:
        return await asyncio.wait_for(planning, limit_s)
    finally:
        PLAN_DEADLINE.reset(deadline)


async def _settled(calls: dict[str, tuple[str, Any]]) -> None:
    """Await a learner's delivery calls the hub does not count (revoked, or to a
    receiver gone since), so that their errors are retrieved, not reported as unhandled."""
    refs = (call for _, call in calls.values() if not _by_channel(call))
    await asyncio.gather(*refs, return_exceptions=True)


async def _by(awaitable: Awaitable[Any], deadline: float) -> Any:
    """``awaitable``'s result; ``asyncio.TimeoutError`` at ``deadline`` (monotonic)."""
    return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))


def _books_direct(entry: ReceiverEntry) -> bool:
    """Whether the planner of ``entry``'s transport books the learner's own deliveries."""
    return get_transport(entry.transport).plans_learner_deliveries


def _by_channel(call: Any) -> bool:
    """Whether a learner's first delivery to a receiver went through its channel (the
    reply, or word that it comes later) rather than as a Ray call (an ObjectRef)."""
    return isinstance(call, ChannelCall | ChannelReply)


def _check_above_direct(model: str, request: BroadcastRequest) -> None:
    """StaleVersionError for an explicit version at or below one its learner delivered
    itself (``request.above``) that the hub never booked (the learner failed before its
    request left): receivers hold that number with that version's weights, and would
    ack this one as held."""
    if request.version is not None and request.version <= request.above:
        raise StaleVersionError(
            f"version {request.version} of model {model!r} is not above version "
            f"{request.above}, which this learner delivered itself (its receivers may "
            "hold it); versions only go up"
        )


def _check_reads_buckets(
    registration: Registration, transport: str, bucket_mb: float | None
) -> None:
    """ValueError, before ``registration`` is booked, if its receiver would read by a
    ``transport`` that moves whole versions only on a hub started with ``bucket_mb``
    (as ``WeightHub.remote`` refuses such a transport as the hub's own): its transport
    is a hand-off of every route, so every version above the hub's default would be
    refused, from every learner, for as long as the receiver stayed registered (but
    those broadcast with a ``bucket_mb`` above their size)."""
    if bucket_mb is None or get_transport(transport).buckets:
        return
    able = ", ".join(n for n in known_transports() if get_transport(n).buckets)
    raise ValueError(
        f"bucket_mb: transport {transport!r} moves whole versions only, and this hub was "
        f"started with bucket_mb={bucket_mb:g} (every version above {bucket_mb:g} MiB moves "
        f"in buckets): {registration.worker} ({registration.actor}) cannot register with "
        f"it; connect it with a transport that moves buckets ({able}), or start the hub "
        "without bucket_mb"
    )


def _check_bucket_readers(targets: list[ReceiverEntry]) -> None:
    """ValueError, before any receiver is touched, if a target reads a bucketed version
    through a transport that reads whole versions only."""
    whole = [t for t in targets if not get_transport(t.transport).buckets]
    if whole:
        named = ", ".join(f"{t.worker} ({t.transport})" for t in whole[:5])
        raise ValueError(
            f"bucket_mb: these receivers read through transports that move whole versions "
            f"only: {named}; broadcast without bucket_mb, or leave them out (workers=...)"
        )


def _done(result: Any) -> asyncio.Future[Any]:
    """A future that holds ``result`` already."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


def _phases(learner_s: float, plan_s: float, outcomes: list[Outcome]) -> BroadcastPhases:
    applied = [(o.delivered_s, o.timings) for o in outcomes if o.timings is not None]
    return BroadcastPhases.of(learner_s, plan_s, applied)
