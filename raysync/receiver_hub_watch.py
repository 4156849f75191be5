"""The hub watch: a receiver's daemon thread that keeps it registered with its hub.

Runs in the receiver's host process, one thread per connection: :func:`raysync.attach`
starts it (``HubWatch(core, heartbeat_s).start()``) and it ends when its
:class:`~raysync.receiver_core.ReceiverCore` closes (``close()``, or a new attach that
replaces it). Every ``interval_s`` it asks the hub whether it still knows this receiver.
If not (the hub actor restarted and rebuilds its registry from receivers, or it dropped
this receiver as dead by mistake) it registers again and delivers the newer versions the
hub answers with through the host's own method queue
(``ReceiverCore.deliver_through_host``), so they are applied at a safe point like any
broadcast (a pull receiver's are left to its next pull: nothing is applied behind the
back of a driver that reads its model outside ``using()``). A re-registration that
fails is tried again after one heartbeat, then after twice as long each time, at most
four heartbeats apart. A hub that does not answer
(restarting) is asked again at the next beat. At each beat it also pulls again the
models a push receiver could not fetch while connecting (``ReceiverCore.behind``), each
on its own: one that fails again stays behind, and the others still catch up.

What it knows of the connection, :class:`HubConnection`, is read from any thread with
:meth:`HubWatch.connection` (``AttachedReceiver.connection`` and
``WeightReceiver.weights_connection`` return it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ray.exceptions import GetTimeoutError, RayError

from raysync.errors import RaySyncError
from raysync.messages import AckStatus, DeliveryMode, Update
from raysync.receiver_core import HUB_UNANSWERED, ReceiverCore
from raysync.receiver_receipt import AckNow

logger = logging.getLogger(__name__)

#: Default seconds between a receiver's checks that its hub still knows it.
HEARTBEAT_S = 5.0
#: A failed re-registration is tried again after one heartbeat, then twice as long each
#: time, at most ``2 ** MAX_RETRY_DOUBLINGS`` heartbeats apart.
MAX_RETRY_DOUBLINGS = 2


@dataclass(frozen=True)
class HubConnection:
    """A receiver's link to its hub, as its hub watch last saw it."""

    watched: bool  #: a hub watch checks the link (``connect_hub(heartbeat_s=None)``: none)
    #: The hub knew this receiver at the last check (``connect_hub`` if none since).
    connected: bool
    #: ``time.time()`` at which the hub was first found not to know this receiver,
    #: while registering again has not succeeded yet; None otherwise.
    reregistering_since: float | None
    #: The last failure of the watch's calls (``"ErrorType: message"``): a heartbeat
    #: the hub did not answer, a re-registration, a catch-up. Kept after it recovers.
    last_error: str | None


#: The link of a receiver that no hub watch checks.
UNWATCHED = HubConnection(watched=False, connected=True, reregistering_since=None, last_error=None)


def retry_delay(interval_s: float, failures: int) -> float:
    """Seconds before registering again after ``failures`` failed tries in a row."""
    return interval_s * 2 ** min(failures - 1, MAX_RETRY_DOUBLINGS)


class HubWatch(threading.Thread):
    """Heartbeat, re-registration and catch-up of one :class:`ReceiverCore` (module doc)."""

    def __init__(self, core: ReceiverCore, interval_s: float) -> None:
        super().__init__(name=f"raysync-hub-watch-{core.worker}", daemon=True)
        self._core = core
        self._interval_s = interval_s
        self._call_timeout_s = max(4 * interval_s, 5.0)
        self._failures = 0  #: re-registrations failed in a row
        self._woken = threading.Event()
        #: Check the hub now (its core registered again and failed: the hub may have
        #: dropped its registration), or see the core closed. The event's own method:
        #: the core keeps it, and a method of the watch (which keeps the core) would make
        #: a cycle that holds a closed core, and its transport's descriptors, until the
        #: garbage collector runs.
        self.wake: Callable[[], None] = self._woken.set
        #: push receiver: the watch applies what the hub offers (a pull one pulls it)
        self._pushed = core.identity.mode is DeliveryMode.PUSH
        self._connection = HubConnection(
            watched=True, connected=True, reregistering_since=None, last_error=None
        )

    def connection(self) -> HubConnection:
        return self._connection

    def run(self) -> None:
        delay = self._interval_s
        while not self._core.closed.is_set():
            self._woken.wait(delay)
            self._woken.clear()
            if self._core.closed.is_set():
                return
            delay = self.beat()

    def beat(self) -> float:
        """Check the hub once, registering again or catching up as needed; the seconds
        until the next beat. Whatever one beat raises, the watch goes on: a thread that
        died would leave the receiver unregistered after the hub's next restart."""
        try:
            return self._beat()
        except Exception as err:
            self._failures += 1
            delay = retry_delay(self._interval_s, self._failures)
            logger.exception(
                "%s: checking its hub failed (trying again in %.3g s)",
                self._core.actor_name,
                delay,
            )
            self._connection = replace(self._connection, last_error=_describe(err))
            return delay

    def _beat(self) -> float:
        core = self._core
        try:
            known = core.hub_knows_me(self._call_timeout_s)
        except (RayError, GetTimeoutError) as err:
            self._unreachable(err)
            self._connection = replace(self._connection, connected=False)
            return self._interval_s
        try:
            if known:
                self._failures = 0
                self._connection = replace(
                    self._connection, connected=True, reregistering_since=None
                )
            elif not self._register_again():
                return retry_delay(self._interval_s, self._failures)
            core.settle_host_calls()
            if core.behind and self._pushed:
                self._catch_up()
        except (RayError, GetTimeoutError) as err:
            self._unreachable(err)
        return self._interval_s

    def _register_again(self) -> bool:
        """Register again and deliver the versions the hub answers with (none if a pull
        that found the hub not knowing this receiver either registered again first: the
        core does not register over it, and a push receiver's pull left what its welcome
        offered in ``core.behind``, caught up after); False if registering failed (tried
        again with backoff; a hub that does not answer raises)."""
        core = self._core
        since = self._connection.reregistering_since
        if since is None:
            since = time.time()
        self._connection = replace(self._connection, connected=False, reregistering_since=since)
        try:
            welcome = core.register_again(self._call_timeout_s)
        except Exception as err:  # raised here (a transport that cannot open), or by the hub
            if isinstance(err, RayError | GetTimeoutError) and not isinstance(err, RaySyncError):
                raise  # the hub did not answer: the beat says so
            self._failures += 1
            logger.error(
                "%s cannot re-register with its hub (trying again in %.3g s): %s",
                core.actor_name,
                retry_delay(self._interval_s, self._failures),
                err,
            )
            self._connection = replace(self._connection, last_error=_describe(err))
            return False
        if welcome is None:  # the receiver left or was replaced meanwhile: the watch ends
            return True
        self._failures = 0
        self._connection = replace(self._connection, connected=True, reregistering_since=None)
        for update in welcome.latest.values():
            if self._pushed:
                self._deliver_offered(update)
            else:  # a pull receiver takes versions when it pulls, not in the background
                core.decline(update)
        return True

    def _deliver_offered(self, update: Update) -> None:
        """Deliver a version the hub's welcome offers through the host; one not applied
        now (a host busy past the call's timeout, a fetch that failed) joins
        ``core.behind``, pulled again at the next beat, and the others still go."""
        core = self._core
        try:
            receipt = core.deliver_through_host(update, self._call_timeout_s)
        except RayError as err:
            core.behind.add(update.model)
            logger.debug(
                "%s did not apply version %d of %r on registering again (pulled again at "
                "the next beat): %s",
                core.actor_name,
                update.version,
                update.model,
                err,
            )
            return
        if receipt is None:  # queued behind the host's method: pulled at the next beats
            core.behind.add(update.model)
        elif isinstance(receipt, AckNow):
            if receipt.ack.status is AckStatus.FAILED:
                core.behind.add(update.model)
            core.send_ack(receipt.ack)

    def _catch_up(self) -> None:
        """Pull again what ``core.behind`` lists, each model on its own: one whose pull
        the hub failed stays behind, tried again at the next beat, and the models after
        it still catch up. A hub that is gone, restarting or does not answer in time
        ends the catch-up: the beat says so."""
        core = self._core
        for model in sorted(core.behind):
            if core.host_call_queued(model):
                # Asked for now, the latest would be planned for this receiver (a
                # shared-memory slot held for it) and then handed back unread.
                continue
            try:
                caught_up = self._pull_again(model)
            except HUB_UNANSWERED:
                raise  # the hub is gone, restarting or slow: the others would wait as long
            except Exception as err:
                logger.warning(
                    "%s could not pull %r again (tried again at the next beat): %s",
                    core.actor_name,
                    model,
                    err,
                )
                self._connection = replace(self._connection, last_error=_describe(err))
                continue
            if caught_up:
                core.behind.discard(model)

    def _pull_again(self, model: str) -> bool:
        """Fetch the latest version of ``model`` and deliver it through the host's method
        queue, so it is applied at a safe point; whether the model caught up."""
        core = self._core
        update = core.latest(model, self._call_timeout_s)
        if update is None:
            return True
        receipt = core.deliver_through_host(update, self._call_timeout_s)
        if receipt is None:  # still queued behind the host's method
            return False
        if isinstance(receipt, AckNow):
            if receipt.ack.status is AckStatus.FAILED:
                logger.debug(
                    "%s is still behind on %r: %s", core.actor_name, model, receipt.ack.error
                )
                return False
            core.send_ack(receipt.ack)
        return True

    def _unreachable(self, err: Exception) -> None:
        logger.debug("hub unreachable from %s, retrying: %s", self._core.actor_name, err)
        self._connection = replace(self._connection, last_error=_describe(err))


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"
