"""The receiver core: one receiver's connection to one hub.

:class:`ReceiverCore` registers a host's models with a hub, fetches each update from
its transport, applies it to the model at a safe point (:class:`raysync.gate.ApplyGate`)
and acknowledges it. It knows its host only as ``owner``, the object its model paths
resolve on, and an optional ``on_applied`` hook, so any actor or process can host one:
:func:`raysync.attach` makes one (and the mixin, through it).

Everything here runs in the host process. Who calls what:

* the code that connects (:func:`raysync.attach`): ``core, welcome =
  ReceiverCore.register(...)``, then ``core.apply_welcome(welcome)``;
* the hub, for every broadcast, through :func:`raysync.receiver_delivery.delivery_call`:
  Ray runs ``core.receive(update)`` in the host's method queue;
* the host's code using the model holds ``core.gate`` as a reader (the mixin's methods
  do it themselves); user-facing pulls call ``core.latest`` and ``core.apply_now``;
* the hub watch thread (:mod:`raysync.receiver_hub_watch`): ``hub_knows_me``,
  ``register_again``, ``latest``, ``deliver_through_host`` and ``send_ack``;
* whoever replaces or ends the connection: ``close()`` (``register`` closes the
  ``previous`` core it replaces itself), after ``leave_hub()`` if it ends for good.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raysync import model_path, weights
from raysync.copies import Viewed, copy_all, viewed, wait_for_devices
from raysync.errors import RaySyncError, SpecMismatchError, UnknownModelError, UnknownWorkerError
from raysync.gate import DEFERRED, ApplyGate, on_event_loop
from raysync.host_loop import call_on_host_loop
from raysync.hub_handle import HubHandle, ask_through_restarts
from raysync.messages import (
    Ack,
    AckStatus,
    DeliveryMode,
    Entry,
    ReceiverTimings,
    Registration,
    ServeRequest,
    Update,
    Welcome,
)
from raysync.receiver_delivery import attached, delivery_call
from raysync.receiver_in_flight import DeliveriesInFlight, delivery_key
from raysync.receiver_receipt import ACK_LATER, AckLater, AckNow, Receipt, receipt_of_reply
from raysync.receiver_zero_copy import AdoptedVersion, Adoption
from raysync.spec import WeightSpec
from raysync.transports import TransportError, TransportReceiver, get_transport, known_transports
from raysync.transports.parts import PartedReceiver

logger = logging.getLogger(__name__)

#: Earlier registrations whose late acks a core still sends to their hub (a version
#: deferred under one is acked there): this many back, a host reconnecting in a loop.
_EARLIER_HUBS_KEPT = 8

#: Default seconds a receiver waits for its hub when it registers or pulls.
HUB_CALL_TIMEOUT_S = 60.0
#: What a call to the hub raises when the hub is gone, restarting, or does not answer
#: in time: a pull of several models ends at once on it (the others would wait as long).
HUB_UNANSWERED: tuple[type[Exception], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.GetTimeoutError,
)


@dataclass(frozen=True)
class ReceiverIdentity:
    """Who a receiver is to its hub, and how it asks to be served."""

    worker: str  #: its name in reports and acks
    actor: str  #: "ClassName(actor_id)", for messages
    attachment: str  #: its key in the host process (:mod:`raysync.receiver_delivery`)
    entry: Entry = Entry.RAY_CALL  #: how the hub reaches the host actor
    mode: DeliveryMode = DeliveryMode.PUSH
    transport: str | None = None  #: the transport asked for; None: the hub's
    zero_copy: bool = False  #: models take staged versions as their own tensors (no copy)
    #: Seconds between its hub watch's heartbeats; None: no watch (see Registration).
    heartbeat_s: float | None = None


@dataclass
class HeldModel:
    """One model of a receiver: where it lives on the actor and which version it holds.

    Its write targets and spec are built once and reused while the model's tensors
    stay where they are (see :func:`raysync.weights.storage_fingerprint`): walking a
    1000-parameter module costs more than copying a small one.
    """

    model_id: str
    path: str
    version: int = 0
    origin: str = ""  #: the learner handle whose broadcast ``version`` is (Update.origin)
    adoption: Adoption = field(default_factory=Adoption)  #: zero-copy state
    #: The object at ``path`` when registered: a registration again carries the
    #: version over only to that same object (None: never resolved).
    registered: SameObject | None = None
    _cached: _Walked | None = None

    def spec_for(self, owner: Any, digest: str) -> WeightSpec:
        """The model's spec, to stage an update of spec ``digest``: the one found when
        the model was last walked if it has that digest, without walking the model
        again (the safe point does, before writing), else the model's spec as it is now.

        Staging needs the spec only to check and read the update; the targets it is
        written into are looked up at the safe point, where a model changed meanwhile is
        found and refused. A 1000-tensor model is walked once per update, not twice.
        """
        if self._cached is not None and self._cached.spec.digest == digest:
            return self._cached.spec
        return self.destination(owner)[1]

    def destination(self, owner: Any) -> tuple[weights.Destination, WeightSpec]:
        """The model's write targets and their spec, as the model is now."""
        walked = self._walk(owner)
        return walked.destination, walked.spec

    def targets(self, owner: Any) -> tuple[weights.Destination, WeightSpec, Sequence[torch.Tensor]]:
        """:meth:`destination`, and its tensors in spec order: with their NumPy views
        (:func:`raysync.copies.viewed`) once an update found the model where the last
        one left it, so that a model of many small tensors is copied into without a
        view made per tensor and update."""
        walked = self._walk(owner)
        if walked.reused and not isinstance(walked.targets, Viewed):
            walked.targets = viewed(walked.targets)
        return walked.destination, walked.spec, walked.targets

    def _walk(self, owner: Any) -> _Walked:
        target = model_path.resolve(owner, self.path)
        fingerprint = weights.storage_fingerprint(target)
        if fingerprint is not None and self._cached is not None:
            if self._cached.fingerprint == fingerprint:
                self._cached.reused = True
                return self._cached
        destination = weights.destinations(
            target, what=f"model {self.model_id!r} at self.{self.path}"
        )
        spec = WeightSpec.of(destination.tensors)
        targets = [destination.tensors[name] for name in spec.names]
        walked = _Walked(fingerprint, destination, spec, targets)
        self._cached = None if fingerprint is None else walked
        return walked


@dataclass
class _Walked:
    """What one walk of a model found: kept while its storage fingerprint repeats."""

    fingerprint: tuple[Any, ...] | None
    destination: weights.Destination
    spec: WeightSpec
    targets: Sequence[torch.Tensor]  #: ``destination.tensors`` in spec order
    reused: bool = False  #: found again by a later walk


class ReceiverCore:
    """A receiver's connection to one hub (see the module doc for who calls what).

    Made by :meth:`register`. Public state: ``owner``, ``hub``, ``identity``, ``worker``
    and ``actor_name``, ``models`` (model id -> :class:`HeldModel`), ``gate``,
    ``transport`` (this registration's transport receiver) and ``transport_name``,
    ``token`` (this registration's), ``behind`` (models whose latest version could not
    be fetched on connecting: a push receiver's hub watch pulls them again at each beat
    until they hold a version at least that new) and ``closed`` (set by :meth:`close`).
    """

    def __init__(
        self,
        owner: Any,
        hub: HubHandle,
        models: dict[str, HeldModel],
        identity: ReceiverIdentity,
        welcome: Welcome,
        token: str,
        on_applied: Callable[[str, int], None] | None,
        gate: ApplyGate | None = None,
        earlier_hubs: dict[str, HubHandle] | None = None,
        transport: TransportReceiver | None = None,
    ) -> None:
        """``gate``: the previous registration's, taken over (see :meth:`register`), and
        ``earlier_hubs`` the hubs of the registrations before by token (their deferred
        versions may end at that gate). ``transport``: the transport's receiver for
        ``welcome``, if opened already (else opened here)."""
        self.owner = owner
        self.hub = hub
        self.models = models
        self.identity = identity
        self.worker = identity.worker
        self.actor_name = identity.actor
        self.token = token
        # The registrations (tokens) whose hub is shutting down: a learner's own
        # delivery to one of them is refused.
        self._refused_tokens: set[str] = set()
        #: The hubs of earlier registrations of this process whose deferred versions
        #: may still end at this gate, by registration token: their acks go there.
        self._earlier_hubs = earlier_hubs or {}
        self.transport = _open_transport(welcome) if transport is None else transport
        self.transport_name = welcome.transport
        #: Deliveries received and not answered yet, to answer one delivered again.
        self._in_flight = DeliveriesInFlight()
        if gate is None:
            gate = ApplyGate(finish_deferred=self._send_deferred_ack)
        else:
            gate.finish_deferred_with(self._send_deferred_ack)
        self.gate = gate
        self.behind: set[str] = set()
        #: Per model, the hub watch's delivery call through the host that did not answer
        #: within its timeout (the host busy in a long method): still in the host's
        #: method queue (:meth:`deliver_through_host`). Only the watch thread uses it.
        self._queued_in_host: dict[str, ray.ObjectRef] = {}
        self.closed = threading.Event()
        #: Has its hub watch check the hub now (and see it closed): set by ``attach``
        self.wake_watch: Callable[[], None] = lambda: None
        #: Held by a re-registration from start to end, and to end them: a core that
        #: leaves or is replaced waits for one in flight, then never registers again.
        self._registering = threading.RLock()
        self._registering_ended = False
        #: The token the hub watch's last heartbeat found the hub no longer knows (see
        #: :meth:`hub_knows_me`): the registration its :meth:`register_again` replaces.
        #: None until one did. Only the watch thread uses it.
        self._unknown_to_heartbeat: str | None = None
        #: Set under ``_registering`` to the core of the registration that replaced this
        #: one: no other may replace it again (its gate, versions and memory went to
        #: that one), unless that one closed before it was welcomed (see
        #: :func:`_check_not_replaced`).
        self._successor: ReceiverCore | None = None
        #: The registration (its identity) that retired this core to replace it, from
        #: its :meth:`retire` until it replaced it or failed to: no other registration
        #: retires it meanwhile (it would move a zero-copy model out of the memory that
        #: one carries over, and hand that memory back). Under ``_replacing_changed``.
        self._replacing: ReceiverIdentity | None = None
        self._replacing_changed = threading.Condition()
        #: Set once :meth:`apply_welcome` applied what the hub offered: ``attach``
        #: returns this core's receiver only then.
        self._welcomed = False
        #: Set at a safe point by :meth:`retire`: versions this core staged and that
        #: reach the safe point after are not applied (a newer registration rules).
        self._retired = False
        #: The payloads of versions staged in a transport's memory and not handed back
        #: yet (waiting for a safe point, or being applied): a registration lists them
        #: in ``kept`` with those zero-copy models live in, so that registering again
        #: keeps their holds (a version applied after would be read, or lived in, from
        #: memory the learner may rewrite).
        self._staging = _StagingBook()
        self._on_applied = on_applied

    @classmethod
    def register(
        cls,
        owner: Any,
        hub: HubHandle,
        paths: Mapping[str, str],
        identity: ReceiverIdentity,
        *,
        on_applied: Callable[[str, int], None] | None = None,
        previous: ReceiverCore | None = None,
        timeout_s: float = HUB_CALL_TIMEOUT_S,
    ) -> tuple[ReceiverCore, Welcome]:
        """Register ``owner``'s models with ``hub``; the new core and the hub's Welcome.

        ``paths`` maps model ids to attribute paths on ``owner`` (``"nets.critic"``,
        ``"env.transform[0]"``). ``on_applied(model, version)`` runs at the safe point
        after each applied version; what it raises fails that version's ack.
        ``previous``, this actor's earlier core, lends each model its version if it was
        registered with the same hub (and the staged version a zero-copy model lives in,
        when this registration is zero copy by the same transport as the same worker;
        else the model first moves into memory of its own) and its gate (the user
        methods it counts as reading, such as one registering again, still hold the
        models), and is closed once the hub answered.
        The new core is in this process's registry of attached receivers
        (:data:`raysync.receiver_delivery.attached`) under ``identity.attachment``
        before the hub hears of it: a delivery that arrives while this still runs waits
        for it. Call :meth:`apply_welcome` next.

        Raises ValueError for no paths, an unknown transport name, zero copy asked
        of a transport that cannot give it, a worker id this process is attached to
        the hub as already (other than ``previous``), or a ``previous`` that another
        registration replaced, or retired first to replace it (another thread's: see
        :meth:`retire`); errors of the model paths and of the hub's checks
        (``SpecMismatchError``, ``TransportUnavailableError``) pass through.
        """
        if not paths:
            raise ValueError("connect_hub needs at least one model path")
        _check_transport(hub, identity)
        _check_not_replaced(previous, identity)
        _reserve_attachment(hub, identity, previous)
        # Versions are a hub's own numbers: another hub's would hide its latest.
        carried = previous if _same_hub(previous, hub) else None
        # The previous core's hub watch must not register it again over this one: its
        # _registering, held from the end of the block below to the hand-over.
        registering = contextlib.ExitStack()
        try:  # a model that cannot take its own copy, a path that does not resolve, a wait
            # for the previous core that timed out or was interrupted...
            if previous is not None:
                adoptions_carry = carried is not None and _adoptions_carry_over(
                    previous, identity, hub
                )
                # Not retired by this registration if another thread's did first: this
                # one is refused below, once that one is done with it.
                previous.retire(
                    carried_over=_models_carried_over(previous, paths, owner)
                    if adoptions_carry
                    else (),
                    replacing=identity,
                )
            held = {m: _carried_over(carried, m, path, owner) for m, path in paths.items()}
            registration = _registration(owner, held, identity)
            if previous is not None:
                registering.enter_context(previous._held_for(identity, timeout_s))
        except BaseException:  # ...: the previous registration stays this process's
            registering.close()  # _registering, if the wait for it just returned
            _give_attachment_back(identity, previous)
            if previous is not None:
                previous._not_replaced_by(identity)
            raise

        def undo() -> None:
            """The previous registration stays this process's (and where it was found);
            its hub watch checks the hub at once: the hub may have dropped it meanwhile
            (a broadcast reached it retired, or the hub booked this one, then failed
            it), and a zero-copy model carried over lives in memory it held."""
            _give_attachment_back(identity, previous)
            if previous is not None:
                previous._not_replaced_by(identity)
                previous.wake_watch()

        with registering:
            try:  # another thread's registration may have replaced it while this waited
                _check_replacing(previous, identity)
            except ValueError:  # retired (and closed) by that one: left as it is
                _give_attachment_back(identity, None)
                raise
            try:
                # Asked again while Ray restarts the hub: a receiver Ray restarted meanwhile
                # raised from __init__ and was dead for good.
                welcome = ask_through_restarts(
                    lambda: hub.actor.register.remote(registration), timeout_s
                )
            except BaseException as err:
                undo()
                if not isinstance(err, ray.exceptions.RayTaskError):
                    # Not answered (timed out, interrupted): the hub may still take it
                    # in, a registration nobody here holds that every broadcast then
                    # fails on. Withdrawn; the hub refuses it if it comes later.
                    hub.actor.leave.remote(identity.worker, registration.token)
                raise
            try:  # before the previous core closes: if this fails, that one stays
                transport = _open_transport(welcome)
                core = cls(
                    owner,
                    hub,
                    held,
                    identity,
                    welcome,
                    registration.token,
                    on_applied,
                    gate=None if previous is None else previous.gate,
                    earlier_hubs=None if previous is None else previous.hubs_to_ack_later(),
                    transport=transport,
                )
            except BaseException:
                undo()
                # The hub forgets this registration; under the previous one's worker id,
                # that one's hub watch registers it again at its next beat.
                try:
                    ray.get(
                        hub.actor.leave.remote(identity.worker, registration.token),
                        timeout=timeout_s,
                    )
                except Exception:  # what is raised is why the new core did not open
                    logger.exception("could not withdraw %s's registration", identity.worker)
                raise
            if previous is not None:
                previous._hand_over_to(core)  # under its _registering: see _check_not_replaced
                if not carried or previous.worker != identity.worker:
                    previous.forget_me()  # this registration does not replace it there
        attached.fill(identity.attachment, core)
        return core, welcome

    def apply_welcome(self, welcome: Welcome) -> None:
        """Apply the versions ``welcome`` (from :meth:`register`) offers, now; raise if
        one fails (the caller then closes this core: the one it replaced may be
        replaced again). One whose data cannot be read now (gone with a dead learner, or
        a data path that failed) joins :attr:`behind` instead: a push receiver's hub
        watch pulls it again at each beat, and the next broadcast brings it anyway (a
        pull receiver's next pull does)."""
        for update in welcome.latest.values():
            try:
                self.apply_now(update, "while connecting")
            except TransportError as err:
                self.behind.add(update.model)
                logger.warning(
                    "%s could not fetch version %d of model %r while connecting (pulled "
                    "again at each heartbeat): %s",
                    self.actor_name,
                    update.version,
                    update.model,
                    err,
                )
        self._welcomed = True

    def close(self) -> None:
        """End this connection: its hub watch stops, its transport receiver closes, and
        deliveries to it fail (the hub still counts it until :meth:`leave_hub`)."""
        self._end_registering()
        self.closed.set()
        self.wake_watch()
        attached.remove(self.identity.attachment)
        self.transport.close()

    def _hand_over_to(self, successor: ReceiverCore) -> None:
        """Close this core, replaced by ``successor`` (by :meth:`register`, under this
        core's ``_registering``). The staged versions its zero-copy models live in are
        ``successor``'s now (:func:`_carried_over`; :meth:`retire` moved the others
        out): this core forgets them, so that a registration replacing it again (once
        ``successor`` failed to connect) neither keeps nor hands them back a second
        time."""
        with self._replacing_changed:
            self._successor, self._replacing = successor, None
            self._replacing_changed.notify_all()
        for held in self.models.values():
            held.adoption.current = None
        self.close()

    def retire(
        self, carried_over: Collection[str] = (), replacing: ReceiverIdentity | None = None
    ) -> None:
        """Apply no more versions: called before this receiver leaves the hub or a new
        registration of this process replaces it. A version this core staged that
        reaches the safe point after is acked ``NOT_ATTACHED`` instead (applied, a
        zero-copy one would make the model live again in memory the next registration
        may copy into: a read-only segment). Zero-copy models that live in a
        transport's memory take a copy of their own (the same version) and hand that
        memory back (:meth:`Adoption.keep_privately`): the hub then holds nothing for
        them; but for those of ``carried_over`` (model ids), which the next
        registration takes over living where they are (:func:`_models_carried_over`).
        Exclusive of applies: at the gate's safe point from a thread; on an async
        host's loop, where applies run, at once (values do not change, so coroutines
        parked in a read see the same version), once no other thread applies one (a
        pull through ``asyncio.to_thread``: one that rebound a model after would leave
        it living in memory nobody holds); a later one applies nothing.

        ``replacing``: the registration that retires this core to replace it (from
        :meth:`register`). Exactly one does: the first, until it replaced this core or
        failed to (:meth:`_not_replaced_by`). For any other, nothing is done (moving
        models out, it would hand back the memory the first one carries over)."""

        def retire() -> None:
            if replacing is not None and not self._claim(replacing):
                return
            self._retired = True
            for held in self.models.values():
                # Not living in a transport's memory, or taken over there as it is.
                if held.adoption.current is None or held.model_id in carried_over:
                    continue
                try:
                    model = model_path.resolve(self.owner, held.path)
                except RaySyncError as err:  # the host let it go: nothing to keep
                    logger.warning(
                        "%s: model %r is no longer at %r (%s); its memory goes back",
                        self.actor_name,
                        held.model_id,
                        held.path,
                        err,
                    )
                    held.adoption.let_go()
                    continue
                held.adoption.keep_privately(model)

        if on_event_loop():
            self.gate.between_writes(functools.partial(setattr, self, "_retired", True))
            retire()
        else:
            self.gate.write(retire)

    def _claim(self, replacing: ReceiverIdentity) -> bool:
        """Whether registration ``replacing`` may retire this core to replace it, taking
        it for itself: no other one did so and is still connecting, nor replaced it."""
        with self._replacing_changed:
            if self._replacing is not None or self._replaced_already():
                return False
            self._replacing = replacing
            return True

    @contextlib.contextmanager
    def _held_for(self, registration: ReceiverIdentity, timeout_s: float) -> Iterator[None]:
        """Hold ``_registering`` for ``registration`` (see :meth:`register`), once no
        other registration that retired this core first is on its way to replace it:
        this one waits for that one to replace it or fail (and is refused then), up to
        ``timeout_s`` (ValueError after). Entered after ``registration``'s own
        :meth:`retire`, which came after that one's at the safe point: this thread, which
        may hold a read of the gate, never waits for a retire that waits for that read to
        end."""

        def none_other_on_its_way() -> bool:
            return self._replacing is None or self._replacing is registration

        with self._replacing_changed:
            if not self._replacing_changed.wait_for(none_other_on_its_way, timeout_s):
                raise ValueError(
                    f"{registration.actor}'s receiver (worker {self.worker!r}) is being "
                    "replaced by another connect_hub/attach, from another thread, still "
                    f"connecting after {timeout_s:g} s: replace the receiver that one returns"
                )
        with self._registering:
            yield

    def _not_replaced_by(self, replacing: ReceiverIdentity) -> None:
        """Registration ``replacing`` failed before it replaced this core: if it retired
        it, this core applies versions again, and may be retired and replaced anew."""
        with self._replacing_changed:
            if self._replacing is replacing:
                self._replacing, self._retired = None, False
                self._replacing_changed.notify_all()

    def _replaced_already(self) -> bool:
        """Whether a registration replaced this core and lives on: welcomed, or still
        connecting (one closed before it was welcomed replaced it for nothing)."""
        successor = self._successor
        return successor is not None and (successor._welcomed or not successor.closed.is_set())

    def forget_me(self) -> None:
        """Ask the hub to forget this registration, without waiting: a receiver that
        registered elsewhere (another hub, another worker id) is no longer one of its
        targets (it would fail each broadcast as one that left). A hub that is gone
        forgets it anyway."""
        self.hub.actor.leave.remote(self.worker, self.token)

    def leave_hub(self, timeout_s: float) -> None:
        """Tell the hub to forget this registration: no broadcast targets it any more.
        The hub watch registers this core no more (one registering now is waited for,
        and it is the registration that leaves)."""
        self._end_registering()
        ray.get(self.hub.actor.leave.remote(self.worker, self.token), timeout=timeout_s)

    def model_id(self, model: str | None) -> str:
        """``model`` if this core holds it; None names the only model it holds."""
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models))
            raise UnknownModelError(
                f"this receiver holds several models ({', '.join(sorted(self.models))}); name one"
            )
        if model not in self.models:
            raise UnknownModelError(
                f"this receiver holds no model {model!r} (it holds: "
                f"{', '.join(sorted(self.models))})"
            )
        return model

    # -- the hub -------------------------------------------------------------------------
    def hub_knows_me(self, timeout_s: float) -> bool:
        """Whether the hub still knows this registration (False: register again; the
        registration the hub watch's :meth:`register_again` then replaces is this one,
        not one a pull registered meanwhile)."""
        token = self.token
        known = ray.get(self.hub.actor.heartbeat.remote(self.worker, token), timeout=timeout_s)
        if not known:
            self._unknown_to_heartbeat = token
        return known

    def _end_registering(self) -> None:
        """No re-registration of this core from now on; waits for one in flight."""
        with self._registering:
            self._registering_ended = True

    def register_again(self, timeout_s: float, unknown: str | None = None) -> Welcome | None:
        """Register with the same hub again, as this core is now (the hub restarted or
        dropped it): a new token and transport receiver, in place of registration
        ``unknown``, the token the caller found the hub no longer knows (by default, the
        one the hub watch's last heartbeat found so; none found: this core's own). The
        Welcome's updates are for the caller to deliver through
        :meth:`deliver_through_host`. A registration replaced already (a pull and the hub
        watch both found it unknown, and the other one registered again while this one
        waited) is not replaced again: the hub knows this core, and the Welcome offers
        nothing (the other caller took what the hub offered: the hub watch delivers it,
        a pull declines it and lists a push receiver's models in :attr:`behind`, which
        the hub watch pulls). If the new transport receiver cannot be opened, the new
        registration is taken back from the hub (no broadcast targets one nobody here
        holds), this core keeps its token and transport (so the hub watch's next beat
        finds it unknown and tries again) and the error is raised; so too if the hub
        did not answer in time (the registration is withdrawn: the hub refuses it
        should it come). None, and no call to the hub, once this core left the hub,
        closed or was replaced."""
        with self._registering:
            if self._registering_ended:
                return None
            if self._replaced_since(unknown):
                # Nothing to open: the transport receiver is the new registration's.
                return Welcome(self.transport_name, None, {})
            registration = _registration(
                self.owner, self.models, self.identity, staged=self._staging.payloads()
            )
            try:
                welcome = ray.get(self.hub.actor.register.remote(registration), timeout=timeout_s)
            except BaseException as err:
                if not isinstance(err, ray.exceptions.RayTaskError):
                    # Not answered: the hub may still take it in, a registration nobody
                    # here holds, which broadcasts target until the next beat replaces
                    # it (a collective waits for its member). Withdrawn: the hub refuses
                    # it if it comes later.
                    self.hub.actor.leave.remote(self.worker, registration.token)
                raise
            try:
                transport = _open_transport(welcome)
            except BaseException:
                self._take_back(registration.token, timeout_s)
                raise
            previous, self.transport = self.transport, transport
            self.transport_name = welcome.transport
            self._refused_tokens.discard(self.token)
            # A version deferred under the old token acks to this hub also once a
            # registration with another hub replaced this core (see hubs_to_ack_later).
            self._earlier_hubs = _newest_hubs({**self._earlier_hubs, self.token: self.hub})
            self.token = registration.token
            previous.close()
        logger.info("%s re-registered with its hub", self.actor_name)
        return welcome

    def _replaced_since(self, unknown: str | None) -> bool:
        """Whether registration ``unknown`` (see :meth:`register_again`) is no longer
        this core's: another caller registered again since it was found unknown."""
        found = self._unknown_to_heartbeat if unknown is None else unknown
        return found is not None and found != self.token

    def _take_back(self, token: str, timeout_s: float) -> None:
        """Unregister the registration ``token`` (one this core will not hold), waiting
        for the hub so that the next beat's check sees it gone; a hub that does not
        answer is left to forget it (the next beat registers again over it)."""
        try:
            ray.get(self.hub.actor.leave.remote(self.worker, token), timeout=timeout_s)
        except ray.exceptions.RayError as err:  # GetTimeoutError among them
            logger.warning(
                "%s could not take its failed registration back: %s", self.actor_name, err
            )

    def decline(self, update: Update) -> None:
        """Hand back an update the hub planned for this receiver and that it will not
        read (a pull receiver's welcome on registering again: it takes versions when it
        pulls; a pull's answer that came after it stopped waiting): its transport lets
        go of what that plan holds for it (a shared-memory slot's hold, which would
        otherwise keep the learner from reusing that slot, a bucket stream served for
        that read alone), and of nothing another delivery of the same version holds or
        reads (the version's own bucket stream, which a broadcast may be delivering to
        this receiver). Any thread, also once closed."""
        try:
            self.transport.decline(update.payload)
        except Exception:
            logger.exception(
                "%s could not hand back version %d of model %r",
                self.actor_name,
                update.version,
                update.model,
            )

    def latest(self, model: str, timeout_s: float) -> Update | None:
        """The hub's latest update of ``model`` if newer than the version held here.

        A hub that knows this receiver no longer (it restarted, or dropped it when its
        heartbeats stopped) is registered with again, once (unless the hub watch did so
        meanwhile), and asked again: a pull receiver without a hub watch would otherwise
        never be known again. What the hub's welcome offers is declined (read by this
        pull, or, for a push receiver, caught up by its hub watch); so is what the hub
        answers a call this pull stopped waiting for (timed out, interrupted): planned
        for this receiver, it holds the version's payload for it."""
        token = self.token  # the registration the hub no longer knows, if it says so
        try:
            return self._latest(model, timeout_s)
        except UnknownWorkerError:
            welcome = self.register_again(timeout_s, unknown=token)
            if welcome is None:  # left the hub, closed or replaced meanwhile
                raise
        for offered in welcome.latest.values():
            self.decline(offered)
            if self.identity.mode is DeliveryMode.PUSH:
                self.behind.add(offered.model)
        return self._latest(model, timeout_s)

    def _latest(self, model: str, timeout_s: float) -> Update | None:
        held = self.models[model]
        call = self.hub.actor.latest.remote(
            model, held.version, worker=self.worker, have_origin=held.origin
        )
        try:
            return ray.get(call, timeout=timeout_s)
        except BaseException as err:
            if not isinstance(err, ray.exceptions.RayTaskError):
                # Not answered (timed out, interrupted): the hub may still plan the
                # version for this receiver, holding its payload for it (a shared-memory
                # slot its learner cannot reuse); nobody here reads it.
                self._decline_when_answered(call)
            raise

    def _decline_when_answered(self, call: ray.ObjectRef) -> None:
        """:meth:`decline` the update the hub answers the pull ``call`` with, once it
        does (this core may have closed by then), on a thread of its own: Ray runs a
        future's callbacks on its core worker's event thread, which a call waiting on
        Ray there blocks for good (ray-project/ray#50980), and a transport's decline may
        wait to look up its owner's actor. The hub answers once its plan's holds are
        taken (a shared-memory pull's is awaited), so the decline comes after them."""

        def answered(reply: concurrent.futures.Future[Any]) -> None:
            if reply.cancelled() or reply.exception() is not None:
                return  # the hub failed the pull: nothing was planned
            update = reply.result()
            if isinstance(update, Update) and update.payload is not None:
                threading.Thread(
                    target=self.decline, args=(update,), name="raysync-decline", daemon=True
                ).start()

        call.future().add_done_callback(answered)

    def hubs_to_ack_later(self) -> dict[str, HubHandle]:
        """For the core that replaces this one (and takes over its gate): where acks
        of versions deferred under this registration or an earlier one go, by token;
        the last :data:`_EARLIER_HUBS_KEPT` (a host that connects again and again held
        one more on every connect)."""
        return _newest_hubs({**self._earlier_hubs, self.token: self.hub})

    def send_ack(self, ack: Ack) -> None:
        """Tell the hub an outcome its delivery call did not return (deferred applies,
        user-facing applies, deliveries of the hub watch). A deferred version of an
        earlier registration (this core took over its gate) is acked to that one's hub."""
        hub = self.hub if ack.token == self.token else self._earlier_hubs.get(ack.token, self.hub)
        hub.actor.ack.remote(ack)

    def _send_deferred_ack(self, ack: Ack) -> None:
        """The gate's safe point applied (or dropped) a deferred version: its
        delivery is answered."""
        self._in_flight.acked(ack)
        self.send_ack(ack)

    # -- updates ---------------------------------------------------------------------------
    def receive(self, update: Update, *, write_on_host_loop: bool = False) -> Receipt:
        """Fetch ``update`` and apply it at the safe point (the hub's delivery call, or
        the learner's on the direct path). ``write_on_host_loop``: a delivery in the host
        actor, whose write goes to an async host's event loop while the fetch runs on
        the calling thread (see :mod:`raysync.host_loop`).

        Never raises: a failure becomes a FAILED ack carrying the traceback. The same
        delivery again while it is in flight here (the hub calls again after
        ``ActorUnavailableError``) is neither read nor released again: it answers
        "later", and the first one's outcome is acked to the hub apart from its call
        (see :mod:`raysync.receiver_in_flight`).
        """
        if update.from_learner and self.token in self._refused_tokens:
            self.transport.release(update.payload, None)
            return AckNow(
                self._ack(
                    update,
                    AckStatus.FAILED,
                    "the hub is shutting down: a learner's own delivery is refused",
                )
            )
        key = delivery_key(update, self.token)
        if not self._in_flight.begin(key):
            return ACK_LATER
        try:
            receipt: Receipt = self._stage_and_apply(update, write_on_host_loop)
        except Exception:
            receipt = AckNow(self._ack(update, AckStatus.FAILED, traceback.format_exc()))
        if isinstance(receipt, AckNow) and self._in_flight.end(key):
            self.send_ack(receipt.ack)  # the call the hub awaits is the later one
        return receipt

    def refuse_learner_deliveries(self, token: str) -> None:
        """The hub of registration ``token`` is shutting down: while this core is
        registered under it, apply no version a learner delivers itself. (A refusal
        that comes while registering again, for the new token or the old, holds for
        that token only.)"""
        self._refused_tokens.add(token)

    def serve(self, request: ServeRequest) -> str | None:
        """Send the version of ``request.model`` this receiver holds to the receiver its
        planner made ``request.payload`` for (a late joiner of a version no other process
        holds whole), holding the model steady meanwhile. None once sent, or why not
        (the planner ends the joiner's stream with it: its read fails saying so)."""
        held = self.models.get(request.model)
        if held is None:
            return f"{self.actor_name} does not hold model {request.model!r}"
        with self.gate.reading():
            if held.version != request.version:
                return (
                    f"{self.actor_name} holds version {held.version} of model "
                    f"{request.model!r}, not {request.version}"
                )
            destination, spec = held.destination(self.owner)
            # The model may have been reshaped or retyped after it applied the version:
            # its bytes are not that version's, and sliced by the joiner's layout they
            # would be applied (and acked) as if they were.
            if spec.digest != request.spec_digest:
                return (
                    f"{self.actor_name}'s model {request.model!r} changed since it applied "
                    f"version {request.version}: spec digest {spec.digest}, not "
                    f"{request.spec_digest} ({spec.summary()})"
                )
            tensors = {name: destination.tensors[name] for name in request.spec.names}
            self.transport.serve(request.payload, tensors, request.spec)
        return None

    def apply_now(self, update: Update, during: str) -> None:
        """Apply ``update`` for a user-facing call (connect, pull) and ack it; raise if
        it fails (TransportError if the transport did, RaySyncError otherwise)."""
        receipt = self._stage_and_apply(update, write_on_host_loop=False)
        if isinstance(receipt, AckLater):
            return
        if receipt.ack.status is AckStatus.FAILED:
            raise RaySyncError(
                f"{self.actor_name} could not apply version {update.version} of model "
                f"{update.model!r} {during}: {receipt.ack.error}"
            )
        self.send_ack(receipt.ack)

    def deliver_through_host(self, update: Update, timeout_s: float) -> Receipt | None:
        """Deliver ``update`` as the hub does, so it is applied at a safe point like a
        broadcast: through the host actor's own method queue, or straight to the gate in
        a process that is no actor (its readers hold the gate). Not from an actor method:
        the hub watch thread calls it.

        None if the host did not answer within ``timeout_s`` (busy in a long method):
        the call stays in its queue, and until it answers no other is made for that
        model (a host busy for many of the watch's beats got one more call per beat,
        each pinning its version's payload); :meth:`settle_host_calls` acks it then.
        An update for a model with a call still queued is handed back unread (None)."""
        handle = _host_actor()
        if handle is None:
            return self.receive(update)
        if self.host_call_queued(update.model):
            self.decline(update)  # planned for this receiver: its transport lets go
            return None
        call = delivery_call(handle, self.identity.entry, self.identity.attachment, update)
        try:
            return receipt_of_reply(ray.get(call, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            self._queued_in_host[update.model] = call
            return None

    def host_call_queued(self, model: str) -> bool:
        """Whether a delivery of ``model`` through the host is queued behind a long
        method (see :meth:`deliver_through_host`)."""
        return model in self._queued_in_host

    def settle_host_calls(self) -> None:
        """The hub watch, at each beat: ack what each delivery that
        :meth:`deliver_through_host` left queued behind a busy host applied, once it
        answered (its reply came after the watch stopped waiting: nobody else acks it).
        A model whose call failed stays in :attr:`behind`, pulled again."""
        for model, call in list(self._queued_in_host.items()):
            if not ray.wait([call], timeout=0)[0]:
                continue
            del self._queued_in_host[model]
            try:
                receipt = receipt_of_reply(ray.get(call))
            except ray.exceptions.RayError as err:
                logger.debug(
                    "%s: delivering %r through the host failed: %s", self.actor_name, model, err
                )
                continue
            if isinstance(receipt, AckNow) and receipt.ack.status is not AckStatus.FAILED:
                self.send_ack(receipt.ack)

    def _stage_and_apply(self, update: Update, write_on_host_loop: bool) -> Receipt:
        """Fetch ``update`` and apply it at the safe point (written on the async host's
        loop if ``write_on_host_loop``). The transport's hold on the payload is released
        on every path, once nothing reads the staged data."""
        # Staged data goes back to the transport that fetched it, also once the hub
        # watch opened another one (the core registered again meanwhile).
        transport = self.transport
        held = self.models.get(update.model)
        refused = None if held is None else _refusal(held, update)
        if held is None or refused is not None:
            if held is not None and get_transport(self.transport_name).reads_refused:
                self._read_and_let_go(transport, update, held)
            elif refused is not AckStatus.CONFLICT:
                transport.release(update.payload, None)
            # A learner's own delivery turned down as a CONFLICT is not handed back: the
            # hub delivers this payload itself next (under the number it booked it, or a
            # new one), and that delivery's hold on it is the one hold the payload has (a
            # shared-memory owner took this release for that hold's, and skipped it: a
            # zero-copy model then lived in a slot nobody held, written again under it).
            if held is None:
                raise UnknownModelError(f"{self.actor_name} does not hold model {update.model!r}")
            assert refused is not None  # held, so the refusal is why
            return AckNow(self._ack(update, refused))
        try:
            spec = held.spec_for(self.owner, update.spec_digest)
            _check_digest(spec, update, self.actor_name)
            fetch_started = time.perf_counter()
            tensors = transport.fetch(update.payload, update.wire_spec or spec)
        except BaseException:
            transport.release(update.payload, None)
            raise
        staged = self._staged(transport, update, spec, tensors)  # released once, if it raises
        self._staging.add(staged, update.payload)
        fetched = _Fetched(fetch_started, time.perf_counter())
        # Acked to the registration it was delivered to, also if applied after this
        # core registered again (the hub awaits it under that registration's token).
        token = update.token or self.token
        write = functools.partial(
            self.gate.write,
            functools.partial(self._apply_and_release, update, staged, fetched, token),
            # Per hub: another hub's versions (a retired registration's, in its own
            # numbers) neither supersede this one's nor follow them.
            key=(self.hub.config.hub_id, update.model),
            supersede=functools.partial(self._superseded, update, staged, token),
            # The hub's update of a number outranks a learner's own delivery of it.
            rank=(update.version, not update.from_learner),
        )
        result = call_on_host_loop(self.gate.loop, write) if write_on_host_loop else write()
        return ACK_LATER if result is DEFERRED else AckNow(result)

    def _read_and_let_go(
        self, transport: TransportReceiver, update: Update, held: HeldModel
    ) -> None:
        """Fetch a version this receiver turns down and release it at once, for a
        transport whose other receivers wait for each one to read (``reads_refused``).
        A failure is only logged: the version is turned down all the same."""
        try:
            # The model as it is now (not the spec last found: rare, and cheap when the
            # model did not change): one replaced since by one of another shape would
            # read it in a layout that is not the one sent (a collective's buffer of
            # another size breaks the others' too), so it is handed back unread instead
            # (the transport sits it out).
            spec = held.destination(self.owner)[1]
            _check_digest(spec, update, self.actor_name)
            tensors = transport.fetch(update.payload, update.wire_spec or spec)
        except Exception as err:
            logger.info(
                "%s turned version %d of model %r down and could not read it: %s",
                self.actor_name,
                update.version,
                update.model,
                err,
            )
            transport.release(update.payload, None)
            return
        transport.release(update.payload, tensors)

    def _staged(
        self,
        transport: TransportReceiver,
        update: Update,
        spec: WeightSpec,
        tensors: Sequence[torch.Tensor],
    ) -> _Staged:
        """What ``update``'s fetched ``tensors`` are staged as: themselves, or, for a
        zero-copy model of a version cast on the wire (it cannot live in bytes of another
        dtype), a copy in the model's own dtypes made here, outside the safe point, the
        transport's data handed back at once (also if the copy fails: once). A copy read
        from memory the transport lent to another version meanwhile raises
        TransportError: no check at the safe point looks at the transport's memory for
        it (see :meth:`TransportReceiver.check_intact`)."""
        if not (self.identity.zero_copy and update.wire_spec is not None):
            return _Staged(tensors, transport)
        try:
            own = [
                view.to(entry.dtype, copy=True)
                for view, entry in zip(tensors, spec.tensors, strict=True)
            ]
            wait_for_devices(own)  # read out before the transport gets its data back
            # Its hold may have gone since the fetch looked (the hub forgot this worker,
            # or it registered again): the copy may hold another version's bytes.
            transport.check_intact(update.payload)
        finally:
            transport.release(update.payload, tensors)
        return _Staged(own, None)

    def _release(self, update: Update, staged: _Staged) -> None:
        """Hand ``staged`` back to the transport if it still holds it."""
        self._staging.discard(staged)
        if staged.transport is not None:
            staged.transport.release(update.payload, staged.tensors)

    def _superseded(self, update: Update, staged: _Staged, token: str) -> Callable[[Ack], Ack]:
        """A newer version of the same model now waits for the same safe point: free
        this one's staged data; its ack (to registration ``token``) follows the newer
        one's outcome. A transport that fails to take the data back is logged: raised
        here, the gate would lose this version's ack."""
        try:
            self._release(update, staged)
        except Exception:
            logger.exception(
                "%s could not hand version %d of model %r back",
                self.actor_name,
                update.version,
                update.model,
            )
        # Its ack waits for the newer one's safe point: it keeps no reference to the
        # data (an RDT object's is the learner's buffer, which it then cannot reuse).
        update = dataclasses.replace(update, payload=None)

        def outcome(newer: Ack) -> Ack:
            return dataclasses.replace(follow(newer), token=token)

        def follow(newer: Ack) -> Ack:
            if newer.status in (AckStatus.FAILED, AckStatus.NOT_ATTACHED):
                # The model holds neither: this one is not applied either, and why.
                return self._ack(
                    update,
                    newer.status,
                    f"superseded while waiting for a safe point by version {newer.version}, "
                    f"which then was not applied: {newer.error}",
                )
            if (
                update.from_learner
                and newer.status is AckStatus.APPLIED
                and newer.version == update.version
                and newer.origin != update.origin
            ):  # another learner's delivery of this number took its place: see _refusal
                return self._ack(update, AckStatus.CONFLICT)
            return self._ack(update, AckStatus.SUPERSEDED)

        return outcome

    def _apply_and_release(
        self, update: Update, staged: _Staged, fetched: _Fetched, token: str
    ) -> Ack:
        """Apply, then hand ``staged`` back to the transport unless the model took it
        over (zero copy); the ack is registration ``token``'s. Runs at the safe point.

        Who hands it back is decided by what this apply did, not by where the model
        lives once ``on_applied`` returned: a hook that closed the receiver, connected
        again or pulled a newer version moved the model out of ``staged`` and released
        it already (a second release: a shared-memory owner took it for an early one
        of a later hold, and skipped that hold)."""
        taken = _TakenOver()
        try:
            return dataclasses.replace(self._apply(update, staged, fetched, taken), token=token)
        finally:
            if taken.over:
                # The model's Adoption owns it now: whoever moves the model out of it
                # (a newer version, retire) hands it back, once; listed there now.
                self._staging.discard(staged)
            else:
                try:
                    self._release(update, staged)
                except Exception:  # the ack says what the model holds, not this
                    logger.exception(
                        "%s could not hand version %d of model %r back to its transport",
                        self.actor_name,
                        update.version,
                        update.model,
                    )

    def _apply(self, update: Update, staged: _Staged, fetched: _Fetched, taken: _TakenOver) -> Ack:
        """Write ``staged`` into the model: point its tensors at it (zero copy, noted in
        ``taken`` at once) or copy it in place. Runs at the safe point."""
        apply_started = time.perf_counter()
        if self._retired:
            return self._ack(
                update,
                AckStatus.NOT_ATTACHED,
                f"{self.actor_name} registered again or closed before version "
                f"{update.version} of model {update.model!r} reached a safe point",
            )
        held = self.models[update.model]
        refused = _refusal(held, update)
        if refused is not None:
            return self._ack(update, refused)
        try:
            destination, spec, targets = held.targets(self.owner)
            _check_digest(spec, update, self.actor_name)
            _check_intact(staged, update)
            adopted = self.identity.zero_copy and held.adoption.take(
                model_path.resolve(self.owner, held.path),
                spec.names,
                self._version_to_adopt(update, staged),
                actor=self.actor_name,
                model_id=held.model_id,
            )
            taken.over = adopted
            if not adopted:
                if self.identity.zero_copy:  # refused: it may have left the version's
                    destination, spec, targets = held.targets(self.owner)  # memory
                copy_all(targets, staged.tensors, spec)
                try:
                    _check_intact(staged, update)
                except TransportError as err:  # rewritten while it was copied
                    raise TransportError(
                        f"{err}; {self.actor_name}'s model {update.model!r} may now hold "
                        "bytes of another version until the next one is applied"
                    ) from err
                if destination.commit is not None:
                    destination.commit()
        except Exception:
            return self._ack(update, AckStatus.FAILED, traceback.format_exc())
        held.version, held.origin = update.version, update.origin
        if self._on_applied is not None:
            try:
                self._on_applied(update.model, update.version)
            except Exception:
                # Failed, with timings: the model holds this version (the hub's status
                # says so), and the broadcast names the hook's error.
                return self._ack(
                    update,
                    AckStatus.FAILED,
                    f"version {update.version} was applied, but on_weights_applied raised:\n"
                    + traceback.format_exc(),
                    timings=_timings(fetched, apply_started),
                )
        return self._ack(update, AckStatus.APPLIED, timings=_timings(fetched, apply_started))

    def _version_to_adopt(self, update: Update, staged: _Staged) -> AdoptedVersion:
        """What a zero-copy model takes as its memory: the staged version itself (handed
        back to the transport when the model moves on), or the receiver's own copy of a
        version cast on the wire (nothing to hand back)."""
        if staged.transport is not None:
            return AdoptedVersion(staged.transport, update.payload, staged.tensors, update.version)
        return AdoptedVersion(None, None, staged.tensors, update.version)

    def _ack(
        self,
        update: Update,
        status: AckStatus,
        error: str | None = None,
        *,
        timings: ReceiverTimings | None = None,
    ) -> Ack:
        return Ack(
            self.worker,
            update.model,
            update.version,
            status,
            error,
            timings,
            origin=update.origin,
            token=update.token or self.token,
        )


def _timings(fetched: _Fetched, apply_started: float) -> ReceiverTimings:
    """Where a version's time went in this receiver, from its fetch to now (applied)."""
    return ReceiverTimings(
        fetch_s=fetched.ended - fetched.started,
        wait_s=apply_started - fetched.ended,
        apply_s=time.perf_counter() - apply_started,
    )


def _refusal(held: HeldModel, update: Update) -> AckStatus | None:
    """Why ``update`` is not applied to ``held``, or None if it is.

    An older version, or the same one again, is SUPERSEDED. The same version number
    from another learner (two learners delivering themselves guessed the same next
    version, see :attr:`Update.origin`): the hub's update is the one it booked under
    that number and replaces what is held; another learner's own delivery is a CONFLICT
    (the hub then delivers what it booked).
    """
    if update.version > held.version:
        return None
    if update.version == held.version and update.origin != held.origin and held.origin:
        return AckStatus.CONFLICT if update.from_learner else None
    return AckStatus.SUPERSEDED


@dataclass(frozen=True)
class _Staged:
    """A fetched version waiting for its safe point: the tensors, and the transport
    receiver that fetched and holds them (handed back with its ``release``), or None
    for the receiver's own copy."""

    tensors: Sequence[torch.Tensor]
    transport: TransportReceiver | None


class _StagingBook:
    """The payloads of versions staged in a transport's memory and not handed back yet
    (see :attr:`ReceiverCore._staging`). Added by a delivery's thread, discarded at the
    safe point or by a newer version superseding it, read by the hub watch's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._payloads: dict[int, Any] = {}  #: id of the _Staged -> its payload

    def add(self, staged: _Staged, payload: Any) -> None:
        if staged.transport is not None:  # a receiver's own copy holds nothing there
            with self._lock:
                self._payloads[id(staged)] = payload

    def discard(self, staged: _Staged) -> None:
        with self._lock:
            self._payloads.pop(id(staged), None)

    def payloads(self) -> tuple[Any, ...]:
        with self._lock:
            return tuple(self._payloads.values())


@dataclass
class _TakenOver:
    """Whether one apply made its zero-copy model live in the staged version: set by
    :meth:`ReceiverCore._apply` as the model takes it, read by
    :meth:`ReceiverCore._apply_and_release` (the same thread, at the safe point) to
    leave handing it back to the model's :class:`Adoption`."""

    over: bool = False


@dataclass(frozen=True)
class _Fetched:
    """When (``time.perf_counter()``) a version's fetch started and ended."""

    started: float
    ended: float


def _newest_hubs(hubs: dict[str, HubHandle]) -> dict[str, HubHandle]:
    """The last :data:`_EARLIER_HUBS_KEPT` of ``hubs`` (by token, oldest first)."""
    return dict(list(hubs.items())[-_EARLIER_HUBS_KEPT:])


def _check_intact(staged: _Staged, update: Update) -> None:
    """Raise TransportError if the memory a transport lent for ``staged`` was given to
    another version (see :meth:`TransportReceiver.check_intact`); a receiver's own copy
    cannot have been."""
    if staged.transport is not None:
        staged.transport.check_intact(update.payload)


def _open_transport(welcome: Welcome) -> TransportReceiver:
    """The transport's receiver, reading versions sent in parts too."""
    return PartedReceiver(get_transport(welcome.transport).open_receiver(welcome.transport_info))


def _check_transport(hub: HubHandle, identity: ReceiverIdentity) -> None:
    """Raise ValueError for an unknown transport name, or for zero copy asked of a
    transport whose staged data a model may not live in."""
    chosen = get_transport(identity.transport or hub.transport)
    if identity.zero_copy and chosen.zero_copy is None:
        qualify = [n for n in known_transports() if get_transport(n).zero_copy is not None]
        raise ValueError(
            f"zero_copy needs a transport whose staged data a model can live in; "
            f"{chosen.name!r} hands out data it may reuse or shares with its own "
            f"readers (those that qualify: {', '.join(qualify)})"
        )


def _check_digest(spec: WeightSpec, update: Update, actor: str) -> None:
    """Raise SpecMismatchError unless ``update`` is for a model shaped like ``spec``."""
    if spec.digest != update.spec_digest:
        raise SpecMismatchError(
            f"update version {update.version} of model {update.model!r} has spec digest "
            f"{update.spec_digest}, but {actor}'s model now has {spec.digest} (was it "
            f"replaced after connect_hub?): {spec.summary()}"
        )


def _registration(
    owner: Any,
    held: dict[str, HeldModel],
    identity: ReceiverIdentity,
    staged: Sequence[Any] = (),
) -> Registration:
    """``identity``'s registration of ``held``; its ``kept``: the payloads its zero-copy
    models live in, and ``staged`` (versions staged, not handed back yet)."""
    context = ray.get_runtime_context()
    adopted = [h.adoption.current for h in held.values()]
    return Registration(
        worker=identity.worker,
        handle=_host_actor(),
        attachment=identity.attachment,
        entry=identity.entry,
        actor=identity.actor,
        node_id=context.get_node_id(),
        process=context.get_worker_id(),
        pid=os.getpid(),
        specs={m: h.destination(owner)[1] for m, h in held.items()},
        versions={m: h.version for m, h in held.items()},
        origins={m: h.origin for m, h in held.items() if h.origin},
        mode=identity.mode,
        token=uuid.uuid4().hex,
        transport=identity.transport,
        heartbeat_s=identity.heartbeat_s,
        kept=(
            *(a.payload for a in adopted if a is not None and a.payload is not None),
            *staged,
        ),
    )


def _same_hub(previous: ReceiverCore | None, hub: HubHandle) -> bool:
    return previous is not None and previous.hub.config.hub_id == hub.config.hub_id


def _reserve_attachment(
    hub: HubHandle, identity: ReceiverIdentity, previous: ReceiverCore | None
) -> None:
    """Reserve ``identity.attachment`` (see :meth:`Attachments.reserve`), claiming it as
    ``identity.worker`` of ``hub``; ValueError if another receiver of this process is
    attached to ``hub`` as that worker, or connecting as it now (a threaded host's
    other thread): the hub keeps one registration per worker, so each would replace
    the other at every heartbeat, and broadcasts would miss the models of the one
    replaced. Checked and reserved in one step, under the registry's lock."""
    claim = (hub.config.hub_id, identity.worker)

    def check(receivers: list[Any], connecting: list[Any]) -> None:
        for other in receivers:
            if (
                isinstance(other, ReceiverCore)
                and other is not previous
                and other.worker == identity.worker
                and _same_hub(other, hub)
            ):
                _refuse_second(identity, f"models {', '.join(sorted(other.models))}")
        if claim in connecting:
            _refuse_second(identity, "connecting now, from another thread")

    attached.reserve(identity.attachment, claim, check)


def _refuse_second(identity: ReceiverIdentity, other: str) -> None:
    """Raise the ValueError of :func:`_reserve_attachment`; ``other`` says who is there."""
    raise ValueError(
        f"{identity.actor} is attached to this hub as worker {identity.worker!r} "
        f"already ({other}): attach every model in one call, pass that receiver as "
        "replaces=, close it first, or give this one another worker_id"
    )


def _check_not_replaced(previous: ReceiverCore | None, identity: ReceiverIdentity) -> None:
    """ValueError if another registration replaced ``previous`` already (two threads
    connecting again at once, both from it): this one would live beside that one, and
    take over a gate, versions and memory that are that one's now. One that closed
    before it was welcomed (its ``attach`` failed, and returned no receiver to replace)
    replaced it for nothing: ``previous`` is replaced again, from what it held."""
    if previous is not None and previous._replaced_already():
        raise ValueError(
            f"{identity.actor}'s receiver (worker {previous.worker!r}) was replaced by "
            "another connect_hub/attach already: replace the receiver that one returned"
        )


def _check_replacing(previous: ReceiverCore | None, identity: ReceiverIdentity) -> None:
    """:func:`_check_not_replaced`, and ValueError unless it is the registration
    ``identity`` that retired ``previous`` to replace it (see :meth:`ReceiverCore.retire`):
    another thread's did first, then failed (this one would replace a core it did not
    retire: its zero-copy models may live in memory that this one keeps no hold on)."""
    _check_not_replaced(previous, identity)
    if previous is not None and previous._replacing is not identity:
        raise ValueError(
            f"{identity.actor}'s receiver (worker {previous.worker!r}) was retired by "
            "another connect_hub/attach, from another thread, that failed to replace it: "
            "replace it again"
        )


def _give_attachment_back(identity: ReceiverIdentity, previous: ReceiverCore | None) -> None:
    """Undo :func:`_reserve_attachment`: the key goes back to ``previous`` if it was
    its (it stays this process's receiver), else it is free again."""
    if previous is not None and previous.identity.attachment == identity.attachment:
        attached.fill(identity.attachment, previous)
    else:
        attached.remove(identity.attachment)


def _adoptions_carry_over(
    previous: ReceiverCore, identity: ReceiverIdentity, hub: HubHandle
) -> bool:
    """Whether zero-copy models of ``previous`` may go on living in its transport's
    memory under the registration ``identity`` asks for: zero copy again, by the same
    transport, as the same worker. Otherwise they must move out first: a model copied
    into would be written in place (a shared-memory segment is mapped read-only: the
    process dies), another transport's planner does not hold the memory for it, and a
    shared-memory owner holds a slot per worker id (the old id's holds go when it
    leaves; the new one never held the slot)."""
    return (
        identity.zero_copy
        and identity.worker == previous.worker
        and (identity.transport or hub.transport) == previous.transport_name
    )


def _models_carried_over(
    previous: ReceiverCore, paths: Mapping[str, str], owner: Any
) -> frozenset[str]:
    """The models of ``previous`` a new registration of ``paths`` carries over (see
    :func:`_carried_over`): the others, left out, moved or replaced, are no longer
    its, and a zero-copy one must leave the transport's memory before it registers
    (the new registration does not keep that memory for it)."""
    return frozenset(
        model_id
        for model_id, path in paths.items()
        if _previous_of(previous, model_id, path, model_path.resolve(owner, path)) is not None
    )


def _previous_of(
    previous: ReceiverCore | None, model_id: str, path: str, model: Any
) -> HeldModel | None:
    """``previous``'s model ``model_id`` if it is ``model``, still at ``path``."""
    old = previous.models.get(model_id) if previous is not None else None
    if old is None or old.path != path or old.registered is None or not old.registered(model):
        return None
    return old


def _carried_over(previous: ReceiverCore | None, model_id: str, path: str, owner: Any) -> HeldModel:
    """A model as a new registration starts it: the version a previous registration of
    this actor left it at, and the staged version it lives in (zero copy), if the model
    id still names the same object at the same path; else a model at version 0, which
    the hub's welcome brings up to date."""
    model = model_path.resolve(owner, path)
    old = _previous_of(previous, model_id, path, model)
    if old is None:
        return HeldModel(model_id, path, registered=SameObject(model))
    return HeldModel(
        model_id,
        path,
        version=old.version,
        origin=old.origin,
        adoption=Adoption(old.adoption.current, names=old.adoption.names),
        registered=old.registered,
    )


class SameObject:
    """Whether an object is the one seen before, without keeping it alive: by a weak
    reference where it takes one (a module, a TensorDict); a plain dict, which takes
    none, by its ``id()`` and a weak reference to its first tensor. (An ``id()`` alone
    is reused: a model dropped and built again at the same path mostly gets the same
    one, and took the version the dropped one held.)"""

    def __init__(self, obj: object) -> None:
        self._id = id(obj)
        self._ref: weakref.ref[Any] | None = None
        try:
            self._ref = weakref.ref(obj)
        except TypeError:
            first = _first_tensor(obj)
            if first is not None:
                self._ref = weakref.ref(first)
        self._whole = self._ref is not None and self._ref() is obj

    def __call__(self, obj: object) -> bool:
        if self._whole:
            assert self._ref is not None
            return self._ref() is obj
        if id(obj) != self._id:
            return False
        return self._ref is None or self._ref() is _first_tensor(obj)


def _first_tensor(obj: object) -> torch.Tensor | None:
    """The first tensor value of a mapping (a state dict), None for anything else."""
    if isinstance(obj, Mapping):
        return next((v for v in obj.values() if isinstance(v, torch.Tensor)), None)
    return None


def _host_actor() -> Any:
    """The handle of the actor this process is, or None (a driver, a task)."""
    context = ray.get_runtime_context()
    return context.current_actor if context.get_actor_id() is not None else None
