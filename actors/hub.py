"""WeightHubActor: raysync's control plane, an async Ray actor.

Called by the learner (``submit`` through :class:`raysync.HubHandle`), by receivers
(``register``, ``heartbeat``, ``ack``, ``latest``) and by anyone watching (``status``,
``wait_for``). It never opens a transport payload: it validates specs, assigns
versions, forwards payloads to receivers and collects their acks.

Restarts (``max_restarts``): each model's version counter and spec are kept in
Ray's GCS key-value store (:mod:`raysync.hub_snapshot`) and read back when Ray
restarts the actor, so versions never go backwards. Receivers notice that the new incarnation does
not know them (their heartbeat) and register again by themselves. The weights
themselves are not kept by the hub: receivers keep the version they hold, and the
learner's next broadcast brings everyone forward (late joiners wait for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
import warnings
from collections import OrderedDict

import ray
from ray.exceptions import RayActorError, RayError

from raysync.errors import (
    BroadcastError,
    HubClosedError,
    TransportUnavailableError,
    UnknownModelError,
)
from raysync.hub_snapshot import HubSnapshot
from raysync.hub_state import HubState, ReceiverEntry
from raysync.messages import (
    Ack,
    AckStatus,
    BroadcastReport,
    BroadcastRequest,
    BroadcastTicket,
    HubConfig,
    HubStatus,
    Registration,
    Update,
    Welcome,
)
from raysync.spec import WeightSpec
from raysync.transports import get_transport

logger = logging.getLogger(__name__)

#: Reports kept per model for ``wait_for`` after the broadcast finished.
_REPORTS_KEPT = 256


class WeightHubActor:
    """See module docstring. Created through :meth:`raysync.WeightHub.remote`."""

    def __init__(self, config: HubConfig) -> None:
        availability = get_transport(config.transport).availability()
        if not availability.available:
            raise TransportUnavailableError(
                f"transport {config.transport!r} is not available: {availability.reason}"
            )
        self._config = config
        self._transport = config.transport
        self._planner = get_transport(config.transport).open_hub(
            ray.get_runtime_context().current_actor
        )
        self._default_timeout_s = config.default_timeout_s
        self._state = HubState()
        self._boot_id = uuid.uuid4().hex
        context = ray.get_runtime_context()
        self._snapshot = HubSnapshot(context.get_actor_id())
        with warnings.catch_warnings():  # Ray's own property trips its deprecation warning
            warnings.simplefilter("ignore")
            restarted = context.was_current_actor_reconstructed
        if restarted:
            self._state.restore(*self._snapshot.load())
            logger.warning("hub restarted; model versions restored: %s", self._state.versions())
        self._reports: dict[str, OrderedDict[int, asyncio.Task[BroadcastReport]]] = {}
        self._pending_acks: dict[tuple[str, str, int], asyncio.Future[Ack]] = {}
        self._closed = False
        self._model_known = asyncio.Event()

    # -- learner -------------------------------------------------------------------------
    async def submit(self, request: BroadcastRequest) -> BroadcastReport | BroadcastTicket:
        """Validate, version and deliver one broadcast (see ``HubHandle.broadcast``)."""
        if not isinstance(request, BroadcastRequest):
            raise TypeError(
                f"submit takes the BroadcastRequest that HubHandle.broadcast builds, not a "
                f"{type(request).__name__}; get a handle with raysync.get_hub(name)"
            )
        if self._closed:
            raise HubClosedError("the hub is shutting down and accepts no more broadcasts")
        started = time.perf_counter()
        timeout_s = self._default_timeout_s if request.timeout_s is None else request.timeout_s
        if request.model is None and not self._state.models:
            await self._wait_for_first_model(timeout_s)
        model = self._state.resolve_model(request.model)
        self._state.check_broadcast(model, request.spec)
        self._state.check_version(model, request.version)
        targets = self._state.targets(model, request.workers)
        update = self._state.publish(
            model, request.spec, self._transport, request.payload, request.version
        )
        self._snapshot.save(self._state.versions(), self._state.specs())
        task = asyncio.create_task(
            self._deliver_all(
                update, request.spec, targets, timeout_s, started, request.learner_seconds
            )
        )
        reports = self._reports.setdefault(model, OrderedDict())
        reports[update.version] = task
        while len(reports) > _REPORTS_KEPT:
            reports.popitem(last=False)
        if not request.wait:
            return BroadcastTicket(model, update.version)
        report = await task
        if report.failed and request.raise_on_failure:
            raise BroadcastError(report)
        return report

    async def wait_for(
        self,
        ticket: BroadcastTicket,
        raise_on_failure: bool = True,
    ) -> BroadcastReport:
        """The report of a ``wait=False`` broadcast, once it is complete."""
        task = self._reports.get(ticket.model, {}).get(ticket.version)
        if task is None:
            raise KeyError(
                f"no report for version {ticket.version} of model {ticket.model!r}: "
                f"it is unknown or older than the last {_REPORTS_KEPT} broadcasts"
            )
        report = await asyncio.shield(task)
        if report.failed and raise_on_failure:
            raise BroadcastError(report)
        return report

    async def _wait_for_first_model(self, timeout_s: float) -> None:
        """A broadcast that names no model, before any receiver registered one, is for
        the model the first receiver registers (the usual start-up race)."""
        try:
            await asyncio.wait_for(self._model_known.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise UnknownModelError(
                f"no receiver registered a model within {timeout_s:g} s; pass model=... to "
                "broadcast before any receiver exists"
            ) from None

    # -- receivers -------------------------------------------------------------------------
    async def register(self, registration: Registration) -> Welcome:
        """Add a receiver; answer with the latest version of each of its models it lacks."""
        latest = self._state.register(registration)
        self._model_known.set()
        entry = self._state.receivers[registration.worker]
        try:
            info = await self._planner.receiver_joined(entry.info)
            for model, update in latest.items():
                payloads = await self._planner.plan(update, self._state.spec(model), [entry.info])
                latest[model] = dataclasses.replace(update, payload=payloads[entry.worker])
        except BaseException:
            self._drop(registration.worker, registration.token)
            raise
        logger.info("registered %s (%s)", registration.worker, registration.actor)
        return Welcome(self._transport, info, latest)

    async def heartbeat(self, worker: str, token: str) -> bool:
        """A receiver's check that this hub still knows it; False means register again."""
        return self._state.knows(worker, token)

    async def unregister(self, worker: str, token: str) -> None:
        self._drop(worker, token)

    def _drop(self, worker: str, token: str) -> None:
        if self._state.drop(worker, token):
            asyncio.get_running_loop().create_task(self._planner.receiver_left(worker))

    async def ack(self, ack: Ack) -> None:
        """An acknowledgement sent after the delivery call returned (deferred applies)."""
        if ack.status is not AckStatus.FAILED:
            self._state.record(ack.worker, ack.model, ack.version)
        future = self._pending_acks.get((ack.worker, ack.model, ack.version))
        if future is not None and not future.done():
            future.set_result(ack)

    async def latest(
        self, model: str, have_version: int = 0, worker: str | None = None
    ) -> Update | None:
        """Pull mode: the latest update of ``model`` if newer than ``have_version``,
        planned for ``worker`` (a registered receiver) if given, else the learner's payload."""
        update = self._state.latest(model)
        if update is None or update.version <= have_version:
            return None
        entry = self._state.receivers.get(worker) if worker is not None else None
        if entry is None:
            return update
        payload = await self._planner.plan_pull(update, self._state.spec(model), entry.info)
        return dataclasses.replace(update, payload=payload)

    # -- anyone ----------------------------------------------------------------------------
    async def status(self) -> HubStatus:
        return HubStatus(
            transport=self._transport,
            boot_id=self._boot_id,
            versions={m: s.version for m, s in sorted(self._state.models.items())},
            receivers=self._state.statuses(),
        )

    def config(self) -> HubConfig:
        return self._config

    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Refuse new broadcasts and wait for those in flight."""
        self._closed = True
        tasks = [t for reports in self._reports.values() for t in reports.values()]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._planner.close()
        self._snapshot.delete()

    # -- delivery --------------------------------------------------------------------------
    async def _deliver_all(
        self,
        update: Update,
        spec: WeightSpec,
        targets: list[ReceiverEntry],
        timeout_s: float,
        started: float,
        learner_seconds: float,
    ) -> BroadcastReport:
        deadline = time.monotonic() + timeout_s
        try:
            payloads = await asyncio.wait_for(
                self._planner.plan(update, spec, [entry.info for entry in targets]), timeout_s
            )
        except Exception as err:
            reason = f"transport {update.transport!r} could not plan the delivery: {err!r}"
            outcomes = [(entry.worker, reason) for entry in targets]
        else:
            outcomes = await asyncio.gather(
                *(
                    self._deliver_one(
                        entry,
                        dataclasses.replace(update, payload=payloads[entry.worker]),
                        deadline,
                        timeout_s,
                    )
                    for entry in targets
                )
            )
        acked = tuple(sorted(w for w, error in outcomes if error is None))
        failed = {w: error for w, error in outcomes if error is not None}
        return BroadcastReport(
            model=update.model,
            version=update.version,
            acked=acked,
            failed=failed,
            bytes=spec.nbytes,
            seconds=learner_seconds + time.perf_counter() - started,
            transport=update.transport,
        )

    async def _deliver_one(
        self, entry: ReceiverEntry, update: Update, deadline: float, timeout_s: float
    ) -> tuple[str, str | None]:
        """Deliver to one receiver; return (worker, None) on success or (worker, reason)."""
        registration = entry.registration
        key = (registration.worker, update.model, update.version)
        deferred_ack = asyncio.get_running_loop().create_future()
        self._pending_acks[key] = deferred_ack
        try:
            ref = registration.handle._raysync_deliver.remote(update)
            ack = await asyncio.wait_for(ref, max(0.0, deadline - time.monotonic()))
            if ack is None:  # applied later, at the receiver's next safe point
                ack = await asyncio.wait_for(deferred_ack, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return registration.worker, (
                f"{registration.actor} did not apply version {update.version} of model "
                f"{update.model!r} within the {timeout_s:g} s timeout"
            )
        except RayActorError as err:
            self._drop(registration.worker, registration.token)
            return registration.worker, (
                f"{registration.actor} died before applying version {update.version} of model "
                f"{update.model!r}; dropped from the registry until it registers again "
                f"({type(err).__name__}: {err})"
            )
        except RayError as err:
            return registration.worker, f"{registration.actor} raised while receiving: {err}"
        finally:
            self._pending_acks.pop(key, None)
        if ack.status is AckStatus.FAILED:
            return registration.worker, f"{registration.actor} failed to apply: {ack.error}"
        self._state.record(registration.worker, update.model, update.version)
        return registration.worker, None
