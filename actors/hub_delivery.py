"""One receiver's delivery of one version, as the hub runs it: :class:`ReceiverDelivery`.

Hub process, on its event loop. The hub actor plans a broadcast and gathers one
:meth:`ReceiverDelivery.deliver` per target into its report; each one ends in an
:class:`Outcome`: acked, or failed with a reason that names the receiver and a cause
(the metrics' tag). The delivery call goes through :func:`raysync.receiver_delivery.delivery_call`
(or is the learner's own call, on the direct path); a receiver that applies at a later
safe point acks through ``hub.ack``, which :class:`AckBook` matches to the delivery
awaiting it.

Ray's word decides a death: ``ActorDiedError`` drops the receiver (it is gone for good);
``ActorUnavailableError`` (Ray restarts it, or cannot reach it for now) does not: the
delivery asks the actor which process it is now, and a new one means this one died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    RayActorError,
    RayError,
    RayTaskError,
)

from raysync.bounded import keep_newest
from raysync.hub_state import HubState, ReceiverEntry
from raysync.messages import Ack, AckStatus, ChannelLost, ReceiverTimings, Registration, Update
from raysync.metrics import FailureCause
from raysync.receiver_delivery import delivery_call
from raysync.transports import TransportError, get_transport
from raysync.transports.object_store.bucket_stream import is_bucketed

from .delivery_lanes import DeliveryLanes, Turn, leader_outcome

#: Acks that reached the hub before the delivery awaiting them started (a learner's
#: direct delivery applied at a safe point before its booking ran), kept for it.
EARLY_ACKS_KEPT = 4096
#: How often a delivery asks an unavailable receiver (restarting, or unreachable for a
#: moment) whether it answers again.
UNAVAILABLE_RETRY_S = 0.1
#: How often a delivery whose version waits for the receiver's safe point looks whether
#: the receiver is still there (registered as it was, its process alive).
DEFERRED_CHECK_S = 1.0

#: (registration token, model, version, origin): the delivery an ack answers.
AckKey = tuple[str, str, int, str]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One target's end of a broadcast: ``error`` None if it acked. For a receiver
    that applied this version, the seconds from the delivery call to its ack and its
    own timings (None when it held the version already)."""

    worker: str
    error: str | None
    delivered_s: float = 0.0
    timings: ReceiverTimings | None = None
    cause: FailureCause | None = None  #: why it failed, in one word (metrics' tag)
    #: The learner called it (direct path, channel), and the hub called it again: that
    #: call never reached it, or its reply was lost with the learner
    by_hub: bool = False


class AckBook:
    """The acks that come apart from their delivery call (``hub.ack``), each matched
    to the delivery awaiting it; one that arrives before its delivery started waits
    here for it (the newest :data:`EARLY_ACKS_KEPT`)."""

    def __init__(self) -> None:
        #: every delivery awaiting the key's ack (two catch-ups of one version may)
        self._pending: dict[AckKey, list[asyncio.Future[Ack]]] = {}
        self._early: OrderedDict[AckKey, Ack] = OrderedDict()

    def expect(self, key: AckKey) -> asyncio.Future[Ack]:
        """A delivery's future for its ack (done already if the ack came early)."""
        future: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        early = self._early.pop(key, None)
        if early is not None:
            future.set_result(early)
        self._pending.setdefault(key, []).append(future)
        return future

    def expect_again(self, key: AckKey, spent: asyncio.Future[Ack]) -> asyncio.Future[Ack]:
        """A fresh future for the same delivery (it delivers once more), in place of
        its ``spent`` one."""
        self.forget(key, spent)
        future: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append(future)
        return future

    def forget(self, key: AckKey, future: asyncio.Future[Ack]) -> None:
        """The delivery awaiting ``future`` ended: an ack for ``key`` from now on goes
        to the other deliveries awaiting it, or is kept as early."""
        waiting = self._pending.get(key, [])
        if future in waiting:
            waiting.remove(future)
        if not waiting:
            self._pending.pop(key, None)

    def arrive(self, ack: Ack) -> None:
        """An ack from a receiver (``hub.ack``): to its deliveries, or kept for them."""
        key = (ack.token, ack.model, ack.version, ack.origin)
        waiting = self._pending.get(key)
        if not waiting:  # its delivery has not started here yet (the direct path)
            self._early[key] = ack
            keep_newest(self._early, EARLY_ACKS_KEPT)
            return
        for future in waiting:
            if not future.done():
                future.set_result(ack)


class ReceiverDelivery:
    """Delivers versions to the hub's receivers, one receiver per :meth:`deliver`.

    ``state`` is the hub's registry (a receiver's process now, and what it applied);
    ``drop(worker, token)`` forgets a receiver that is gone for good;
    ``catch_up(entry, model)`` delivers the latest version of ``model`` to a receiver
    that answered at last a call it had timed out on, if it lacks it.
    ``set_aside(entry, update)``: a delivery that waits for its receiver's running call
    lets go of what its plan holds for it, if its transport's plan holds anything
    (True: :meth:`TransportPlanner.set_aside`); ``plan_again(update, entry)`` plans it
    anew if it goes after all (both given by the hub, or neither).
    """

    def __init__(
        self,
        state: HubState,
        acks: AckBook,
        drop: Callable[[str, str], None],
        catch_up: Callable[[ReceiverEntry, str], None],
        *,
        set_aside: Callable[[ReceiverEntry, Update], bool] | None = None,
        plan_again: Callable[[Update, ReceiverEntry], Awaitable[Update]] | None = None,
    ) -> None:
        self._state = state
        self._acks = acks
        self._drop = drop
        self._catch_up = catch_up
        self._set_aside = set_aside
        self._plan_again = plan_again
        self._lanes: DeliveryLanes[Outcome] = DeliveryLanes(holds=_holds)

    def called_by_learner(
        self, token: str, model: str, version: int, call: asyncio.Future[Any]
    ) -> None:
        """A learner called registration ``token`` with ``version`` of ``model`` itself
        (the direct path; ``call`` its reply): the receiver's running call until it
        returns."""
        self._lanes.calling(token, model, version, call)

    async def deliver(
        self,
        entry: ReceiverEntry,
        update: Update,
        deadline: float,
        timeout_s: float,
        first_call: Any = None,
        update_sent_at: float = 0.0,
    ) -> Outcome:
        """Deliver to one receiver: its outcome, with the reason if it failed.

        ``first_call``: the learner already called it (the direct path); that call's
        reply (its ObjectRef, or a future of it) stands for the first delivery, made at
        ``update_sent_at`` (``time.time()`` in the learner), and any retry is the hub's
        own. ``deadline`` (``time.monotonic()``) bounds the whole delivery,
        ``timeout_s`` is how the reason names it.

        A receiver whose last call of this model has not returned (busy in a long
        method) gets no other, where the update takes turns (:func:`takes_turns`): the
        delivery waits for it, and the newest version waiting then goes in place of
        the others (see :mod:`actors.delivery_lanes`).

        ``ActorUnavailableError``: the delivery waits for the actor to answer again; a
        new process (registered again from its ``__init__``) means this one died; the
        same process gets the delivery again (a version already applied acks as
        superseded).
        """
        registration = entry.registration
        turns = takes_turns(update)
        turn: Turn[Outcome] = Turn()
        set_aside = False  # what its plan held for the receiver was let go: plan again

        def set_plan_aside() -> None:
            """Let go of what this delivery's plan holds for the receiver (a shared-memory
            slot), once it may never call it: a newer version waits too (this one goes
            only if that one fails), or it ends without a call. A receiver busy for many
            versions held one slot for each."""
            nonlocal set_aside
            if self._set_aside is not None and not set_aside:
                set_aside = self._set_aside(entry, update)

        if first_call is None and turns:
            waited = await self._turn_of(registration, update, deadline, timeout_s, set_plan_aside)
            if isinstance(waited, Outcome):  # ended without a call of its own
                set_plan_aside()
                return waited
            turn = waited
        called_again: list[bool] = []  # set by _deliver if the hub called it itself
        # Its turn held while it plans again (others that come wait), until its call.
        ready = (
            self._lanes.getting_ready(registration.token, update.model, update.version)
            if set_aside
            else None
        )
        try:
            if set_aside:
                planned = await self._planned_again(entry, update, deadline, timeout_s)
                if isinstance(planned, Outcome):
                    turn.led(planned)
                    return planned
                update = planned
            outcome = await self._deliver(
                entry, update, deadline, timeout_s, first_call, update_sent_at, turns, called_again
            )
            if called_again:
                outcome = dataclasses.replace(outcome, by_hub=True)
        except BaseException as err:
            turn.led(
                Outcome(
                    registration.worker,
                    f"the hub's delivery to {registration.actor} ended: {err!r}",
                    cause=FailureCause.RAISED,
                )
            )
            raise
        finally:
            if ready is not None:  # its call took its turn over, or none was made
                retrieve_outcome(ready)
                ready.set_exception(TransportError("no call was made"))
        turn.led(outcome)
        return outcome

    async def _turn_of(
        self,
        registration: Registration,
        update: Update,
        deadline: float,
        timeout_s: float,
        passed: Callable[[], None],
    ) -> Turn[Outcome] | Outcome:
        """Wait for ``registration``'s turn (see :meth:`deliver`; ``passed`` when a newer
        version waits too): the turn to call it, or the outcome of a delivery that ends
        without a call of its own."""
        while True:
            running = self._lanes.running(registration.token, update.model)
            try:
                turn: Turn[Outcome] = await self._lanes.turn(
                    registration.token, update.model, update.version, deadline, passed
                )
            except asyncio.TimeoutError:
                self._gave_up(registration, update.model)
                return self._timed_out(
                    registration,
                    update,
                    timeout_s,
                    f"the hub makes one delivery call to it at a time, and the call that "
                    f"delivered version {running} to it had not returned",
                )
            if turn.held is not None:  # the call waited for left it holding a newer one
                self._record(registration, update.model, turn.held)
                return Outcome(registration.worker, None)
            if turn.follow is None:
                return turn
            try:
                led = await leader_outcome(turn.follow, deadline)
            except asyncio.TimeoutError:
                return self._timed_out(
                    registration,
                    update,
                    timeout_s,
                    f"it was busy, and version {turn.follow.leader}, delivered in its place "
                    f"once it was free, had not been applied by this version's deadline",
                )
            if led.error is None:  # it holds a newer version: acked, as superseded
                return Outcome(registration.worker, None, led.delivered_s)
            # that one failed: this version tries on its own

    async def _planned_again(
        self, entry: ReceiverEntry, update: Update, deadline: float, timeout_s: float
    ) -> Update | Outcome:
        """``update`` planned anew for ``entry``, whose delivery let go of its plan's hold
        while it waited and goes now (by ``deadline``), or the outcome saying why not
        (the version may no longer be readable: a newer one that does not target the
        receiver took its place). A receiver that gets no call then is free, and may
        lack the latest version: it is caught up (``catch_up``), as after a call."""
        assert self._plan_again is not None  # given with set_aside
        registration = entry.registration
        try:
            return await asyncio.wait_for(
                self._plan_again(update, entry), max(0.0, deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            failed = self._timed_out(
                registration, update, timeout_s, "its read could not be planned again in time"
            )
        except Exception as err:
            failed = Outcome(
                registration.worker,
                f"version {update.version} of model {update.model!r} could not be planned "
                f"again for {registration.actor} once its running call returned: {err}",
                cause=FailureCause.NOT_PLANNED,
            )
        if self._still_registered(registration) is not None:
            self._catch_up(entry, update.model)
        return failed

    def _timed_out(
        self, registration: Registration, update: Update, timeout_s: float, why: str = ""
    ) -> Outcome:
        """The outcome of a delivery past its deadline; the receiver is behind."""
        self._state.timed_out(registration.worker, registration.token)
        return Outcome(
            registration.worker,
            f"{registration.actor} did not apply version {update.version} of model "
            f"{update.model!r} within the {timeout_s:g} s timeout" + (f" ({why})" if why else ""),
            cause=FailureCause.TIMEOUT,
        )

    def _still_registered(self, registration: Registration) -> ReceiverEntry | None:
        """``registration``'s entry, unless its worker left or registered again."""
        entry = self._state.receivers.get(registration.worker)
        if entry is None or entry.registration.token != registration.token:
            return None
        return entry

    def _record(
        self,
        registration: Registration,
        model: str,
        version: int,
        timings: ReceiverTimings | None = None,
    ) -> None:
        """``registration`` holds ``version`` of ``model`` (unless its worker id went to
        another registration meanwhile, whose versions these are not)."""
        if self._still_registered(registration) is not None:
            self._state.record(registration.worker, model, version, timings)

    def _gave_up(self, registration: Registration, model: str) -> None:
        """A delivery to ``registration`` of ``model`` timed out while a call to it still
        ran (busy in a long method): once that call returns with no delivery waiting,
        the receiver holds what it acked, and it is free for the latest version, if it
        lacks it (``catch_up``; also after a late read that failed, as a ``nixl`` one
        of a buffer written again since does). Nothing of it if it registered again
        meanwhile, or its receiver is gone."""

        def returned(call: asyncio.Future[Any], version: int) -> None:
            if call.cancelled() or call.exception() is not None:
                return
            ack = call.result()  # None: staged, applied at its next safe point
            if isinstance(ack, Ack) and ack.status is AckStatus.NOT_ATTACHED:
                return
            entry = self._still_registered(registration)
            if entry is None:
                return
            self._record_reply(registration, model, version, ack)
            self._catch_up(entry, model)

        self._lanes.gave_up(registration.token, model, returned)

    async def _deliver(
        self,
        entry: ReceiverEntry,
        update: Update,
        deadline: float,
        timeout_s: float,
        first_call: Any,
        update_sent_at: float,
        turns: bool,
        called_again: list[bool],
    ) -> Outcome:
        """:meth:`deliver`, its turn come (``turns``: its calls take turns); notes in
        ``called_again`` when the hub calls a receiver the learner called."""
        registration = entry.registration
        call: asyncio.Future[Any] | None = None  # the last call made, until it returns
        key = (registration.token, update.model, update.version, update.origin)
        deferred_ack = self._acks.expect(key)
        delivery_started = time.perf_counter()
        if first_call is not None:  # from the learner's call, on the wall clock it sent
            delivery_started -= max(0.0, time.time() - update_sent_at)
        learners_call = False  # whether the call awaited last is the learner's
        try:
            while True:
                try:
                    learners_call = first_call is not None
                    if first_call is not None:  # awaited once: a retry is the hub's call
                        call, first_call = asyncio.ensure_future(first_call), None
                        try:
                            reply = await _reply_or_ack(call, deferred_ack, deadline)
                        except RayError as err:
                            if not _reply_lost(err):
                                raise
                            # Its learner died: the reply died with it. Asked here, the
                            # receiver acks a version it applied as held.
                            called_again.append(True)
                            continue
                        if isinstance(reply, ChannelLost):  # never reached it: deliver here
                            called_again.append(True)
                            continue
                        ack = reply
                    else:
                        call = asyncio.ensure_future(
                            delivery_call(
                                registration.handle,
                                registration.entry,
                                registration.attachment,
                                dataclasses.replace(update, token=registration.token),
                            )
                        )
                        retrieve_outcome(call)
                        if turns:
                            self._lanes.calling(
                                registration.token, update.model, update.version, call
                            )
                        ack = await asyncio.wait_for(
                            asyncio.shield(call), max(0.0, deadline - time.monotonic())
                        )
                    if ack is None:  # applied later, at the receiver's next safe point
                        waited = await self._deferred(registration, update, deferred_ack, deadline)
                        if isinstance(waited, Outcome):  # it is gone meanwhile
                            return waited
                        ack = waited
                    if ack.status is AckStatus.CONFLICT:  # holds that number from another
                        deferred_ack = self._acks.expect_again(key, deferred_ack)
                        continue  # learner's own delivery: the hub's update replaces it
                    break
                except ActorUnavailableError as err:
                    restarted = await self._restarted(registration, deadline)
                    if restarted is None:  # the same process answers again: deliver again
                        if learners_call:
                            called_again.append(True)
                        continue
                    return self._process_died(
                        registration, update, f"({type(err).__name__}: {err}); {restarted}"
                    )
        except asyncio.TimeoutError:
            if call is not None and not call.done():
                if turns:
                    self._gave_up(registration, update.model)
                else:
                    self._record_when_returned(registration, update, call)
            return self._timed_out(registration, update, timeout_s)
        except RayActorError as err:
            self._drop(registration.worker, registration.token)
            return Outcome(
                registration.worker,
                f"{registration.actor} died before applying version {update.version} of model "
                f"{update.model!r}; dropped from the registry until it registers again "
                f"({type(err).__name__}: {err})",
                cause=FailureCause.DIED,
            )
        except RayError as err:
            return Outcome(
                registration.worker,
                f"{registration.actor} raised while receiving: {err}",
                cause=FailureCause.RAISED,
            )
        except Exception as err:  # the call could not be made: this target's failure only
            return Outcome(
                registration.worker,
                f"the hub could not call {registration.actor} with version {update.version} "
                f"of model {update.model!r}: {type(err).__name__}: {err}",
                cause=FailureCause.RAISED,
            )
        finally:
            self._acks.forget(key, deferred_ack)
        if ack.status is AckStatus.NOT_ATTACHED:
            return await self._not_attached(registration, update, ack, deadline)
        if ack.status is AckStatus.FAILED:
            if ack.timings is not None:  # applied, and then its on_weights_applied raised
                self._record(registration, update.model, update.version, ack.timings)
            return Outcome(
                registration.worker,
                f"{registration.actor} failed to apply: {ack.error}",
                cause=FailureCause.APPLY_FAILED,
            )
        self._record(registration, update.model, update.version, ack.timings)
        delivered_s = time.perf_counter() - delivery_started
        if ack.timings is not None:  # two clocks on the direct path: never below its parts
            t = ack.timings
            delivered_s = max(delivered_s, t.fetch_s + t.wait_s + t.apply_s)
        return Outcome(registration.worker, None, delivered_s, ack.timings)

    def _record_when_returned(
        self, registration: Registration, update: Update, call: asyncio.Future[Any]
    ) -> None:
        """A delivery that does not take turns timed out while its call still ran: if
        the call returns with the version applied, the receiver holds it (else the
        hub's books said it was behind until its next version, which may never come)."""

        def returned(call: asyncio.Future[Any]) -> None:
            if not call.cancelled() and call.exception() is None:
                self._record_reply(registration, update.model, update.version, call.result())

        call.add_done_callback(returned)

    def _record_reply(
        self, registration: Registration, model: str, version: int, reply: Any
    ) -> None:
        """A call that delivered ``version`` of ``model`` returned ``reply`` after its
        delivery ended: if it holds that version (or a newer one), book it, with where
        its time went if it applied that one."""
        if _holds(reply):
            timings = reply.timings if reply.version == version else None
            self._record(registration, model, version, timings)

    async def _deferred(
        self,
        registration: Registration,
        update: Update,
        deferred_ack: asyncio.Future[Ack],
        deadline: float,
    ) -> Ack | Outcome:
        """The ack of a version staged for the receiver's next safe point (``hub.ack``),
        by ``deadline``; else TimeoutError. Nothing else calls the receiver meanwhile,
        so every :data:`DEFERRED_CHECK_S` this looks whether it is still there: an
        Outcome if it left or registered again, or its process died (a death raises
        Ray's error, as a delivery call's would)."""
        probe: asyncio.Future[str] | None = None
        try:
            while True:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise asyncio.TimeoutError
                waiting: set[asyncio.Future[Any]] = {deferred_ack}
                if probe is not None:
                    waiting.add(probe)
                await asyncio.wait(
                    waiting,
                    timeout=min(DEFERRED_CHECK_S, left_s),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if deferred_ack.done():
                    return deferred_ack.result()
                gone = self._gone(registration, update)
                if gone is not None:
                    return gone
                if probe is not None and probe.done():
                    if probe.result() != registration.process:  # raises if it died
                        return self._process_died(
                            registration, update, "(Ray restarted it while the version waited)"
                        )
                    probe = None
                if probe is None and registration.handle is not None:
                    probe = asyncio.wrap_future(
                        registration.handle.__ray_call__.remote(process_of).future()
                    )
                    retrieve_outcome(probe)  # an answer not awaited any more
        finally:
            if probe is not None and not probe.done():
                probe.cancel()

    def _gone(self, registration: Registration, update: Update) -> Outcome | None:
        """The outcome of a delivery whose registration the hub no longer holds (its
        process died and a new one registered, it left, or it registered again); None
        while it holds it."""
        current = self._state.receivers.get(registration.worker)
        if current is not None and current.registration.token == registration.token:
            return None
        if self._registered_anew(registration):
            return self._process_died(
                registration, update, "(Ray restarted it and the new process registered again)"
            )
        return Outcome(
            registration.worker,
            f"{registration.actor} left the hub (closed its receiver, or registered again) "
            f"before applying version {update.version} of model {update.model!r}",
            cause=FailureCause.LEFT,
        )

    async def _not_attached(
        self, registration: Registration, update: Update, ack: Ack, deadline: float
    ) -> Outcome:
        """The delivery reached a process without this registration's receiver: a new
        incarnation of the actor (the call was queued when the old one died, and Ray
        ran it on the new one), or the receiver was closed (at once if the hub knows
        it left: asking the actor which process it is would wait behind its next
        long method)."""
        gone = self._gone(registration, update)
        if gone is not None:
            return gone
        try:
            restarted = await self._restarted(registration, deadline)
        except ActorDiedError as err:  # Ray gave up on it since
            return self._process_died(registration, update, f"(Ray will not restart it: {err})")
        except (asyncio.TimeoutError, RayError) as err:
            return _died(registration, update, f"(it did not answer again: {type(err).__name__})")
        if restarted is None:  # the same process, its receiver closed: it is gone for good
            self._drop(registration.worker, registration.token)
            return Outcome(
                registration.worker,
                f"{registration.actor}: {ack.error}; dropped from the registry until it "
                f"registers again",
                cause=FailureCause.LEFT,
            )
        return self._process_died(registration, update, f"({restarted})")

    def _registered_anew(self, registration: Registration) -> bool:
        """Whether ``registration``'s worker id is registered from another process now
        (Ray restarted the actor, and the new process registered)."""
        current = self._state.receivers.get(registration.worker)
        return current is not None and current.registration.process != registration.process

    def _process_died(self, registration: Registration, update: Update, how: str) -> Outcome:
        """The process ``registration`` was made in is gone (Ray restarted the actor, or
        will not): the registration is dropped (a new process registers itself; one
        that never does was failed at every broadcast, its planner's holds kept)."""
        self._drop(registration.worker, registration.token)
        if self._registered_anew(registration):
            # The new process is in the registry: not dropped until it registers again.
            after = "its new process registered, and a registration gets the latest version"
        else:
            after = "dropped from the registry until it registers again"
        return _died(registration, update, f"{how}; {after}")

    async def _restarted(self, registration: Registration, deadline: float) -> str | None:
        """After ``ActorUnavailableError``: find out, by ``deadline``, which process the
        actor is now. None if it is still the registered one (the error was transient);
        else how it died: Ray restarted it, and the new process registered again (or not
        yet). Raises ``ActorDiedError`` if Ray gave up on it, TimeoutError past the
        deadline."""
        asked: asyncio.Future[str] | None = None
        while True:
            if self._registered_anew(registration):
                return "Ray restarted it and the new process registered again"
            if asked is None:
                asked = asyncio.wrap_future(
                    registration.handle.__ray_call__.remote(process_of).future()
                )
                # Not awaited any more once the new process registers (or the delivery
                # is cancelled) while it runs: it may fail later (the actor restarting).
                retrieve_outcome(asked)
            done, _ = await asyncio.wait({asked}, timeout=UNAVAILABLE_RETRY_S)
            if asked in done:
                try:
                    process = asked.result()
                except ActorUnavailableError:
                    asked = None  # still restarting, or unreachable: ask again
                    await asyncio.sleep(UNAVAILABLE_RETRY_S)
                else:
                    if process == registration.process:
                        return None
                    return "Ray restarted it; the new process has not registered again"
            if time.monotonic() >= deadline:
                if asked is not None:
                    asked.cancel()
                raise asyncio.TimeoutError


def _holds(reply: Any) -> bool:
    """Whether a delivery call's reply says its receiver holds the version it was
    delivered, or a newer one (:attr:`Ack.holds_version`; None: staged, to be applied
    at a safe point)."""
    return isinstance(reply, Ack) and reply.holds_version


def takes_turns(update: Update) -> bool:
    """Whether deliveries of ``update`` take turns at a busy receiver
    (:mod:`actors.delivery_lanes`): a whole version of a transport that declares it."""
    return get_transport(update.transport).one_call_at_a_time and not is_bucketed(update.payload)


async def not_delivered(worker: str, reason: str, cause: FailureCause) -> Outcome:
    """The outcome of a target the hub did not deliver to (why, and its cause)."""
    return Outcome(worker, reason, cause=cause)


def retrieve_outcome(future: asyncio.Future[Any]) -> None:
    """Retrieve ``future``'s exception once it is done, so that asyncio does not log it
    as never retrieved: for futures whose outcome nobody else awaits."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _died(registration: Registration, update: Update, how: str) -> Outcome:
    """The outcome of a delivery whose receiver's process died before it applied
    ``update`` (``how``: what became of it)."""
    return Outcome(
        registration.worker,
        f"{registration.actor} died before applying version {update.version} of model "
        f"{update.model!r} {how}",
        cause=FailureCause.DIED,
    )


def process_of(actor: Any) -> str:
    """Runs inside a receiver actor (``__ray_call__``): its process's Ray worker id."""
    return ray.get_runtime_context().get_worker_id()


def _reply_lost(err: RayError) -> bool:
    """Whether a learner's delivery call failed because its reply was lost with the
    learner (it owns the call; the hub only borrows it), not because the receiver
    raised or died."""
    return isinstance(err, ObjectLostError) and not isinstance(err, RayTaskError)


async def _reply_or_ack(
    call: Any, acked: asyncio.Future[Ack], deadline: float
) -> Ack | ChannelLost | None:
    """The first word on a learner's delivery call: the receiver's ack sent to the hub
    (``acked``; it comes straight here) or the call's own reply (which reaches the hub
    through the learner that owns it: later, but it is where a death shows). Raises what
    the call raised; ``asyncio.TimeoutError`` past ``deadline``."""
    reply = asyncio.ensure_future(call)
    done, _ = await asyncio.wait(
        {reply, acked},
        timeout=max(0.0, deadline - time.monotonic()),
        return_when=asyncio.FIRST_COMPLETED,
    )
    if acked in done:
        retrieve_outcome(reply)
        return acked.result()
    if reply in done:
        return reply.result()
    retrieve_outcome(reply)
    raise asyncio.TimeoutError
