"""The receiver side: :class:`WeightReceiver`, a mixin for Ray actor classes.

Everything here runs in the receiver actor's process. ``connect_hub`` (usually from
``__init__``) registers the actor's models with the hub and applies the latest version
at once; afterwards the hub calls ``_raysync_deliver`` for every broadcast. Each update
is fetched from the transport outside the safe point, then copied into the model's own
tensors in place when no user method is running (see :mod:`raysync.gate`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from raysync import model_path, weights
from raysync.errors import RaySyncError, SpecMismatchError, UnknownModelError
from raysync.gate import DEFERRED, ApplyGate
from raysync.hub_handle import HubHandle, get_hub
from raysync.hub_state import DEFAULT_MODEL
from raysync.messages import Ack, AckStatus, DeliveryMode, Registration, Update, Welcome
from raysync.spec import WeightSpec
from raysync.transports import (
    TransportError,
    TransportReceiver,
    get_transport,
    known_transports,
)

logger = logging.getLogger(__name__)

#: Default seconds ``connect_hub`` and ``pull_weights`` wait for the hub.
HUB_CALL_TIMEOUT_S = 60.0
#: Default seconds between a receiver's checks that its hub still knows it.
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class _Identity:
    worker: str
    actor: str  #: "ClassName(actor_id)"
    transport: str | None  #: the transport asked for; None: the hub's
    zero_copy: bool  #: models take staged versions as their own tensors (no copy)


@dataclass(frozen=True)
class _Adopted:
    """The staged version a zero-copy model's tensors live in; handed back to its
    transport once the model moves on to a newer one."""

    transport: TransportReceiver
    payload: Any
    staged: Sequence[torch.Tensor]


@dataclass
class _HeldModel:
    """One model of this receiver: where it lives on the actor and which version it holds.

    Its write targets and spec are built once and reused while the model's tensors
    stay where they are (see :func:`raysync.weights.storage_fingerprint`): walking a
    1000-parameter module costs more than copying a small one.
    """

    model_id: str
    path: str
    version: int = 0
    adopted: _Adopted | None = None
    copies_instead: bool = False  #: zero copy was refused once (logged) for this model
    _cached: tuple[Any, weights.Destination, WeightSpec] | None = None

    def destination(self, owner: Any) -> tuple[weights.Destination, WeightSpec]:
        """The model's write targets and their spec, as the model is now."""
        target = model_path.resolve(owner, self.path)
        fingerprint = weights.storage_fingerprint(target)
        if fingerprint is not None and self._cached is not None:
            cached_fingerprint, destination, spec = self._cached
            if cached_fingerprint == fingerprint:
                return destination, spec
        destination = weights.destinations(
            target, what=f"model {self.model_id!r} at self.{self.path}"
        )
        spec = WeightSpec.of(destination.tensors)
        self._cached = None if fingerprint is None else (fingerprint, destination, spec)
        return destination, spec


class _ReceiverCore:
    """The receiver's connection to one hub; lives at ``actor._raysync_core``."""

    def __init__(
        self,
        owner: WeightReceiver,
        hub: HubHandle,
        models: dict[str, _HeldModel],
        identity: _Identity,
        mode: DeliveryMode,
        welcome: Welcome,
        token: str,
    ) -> None:
        self.owner = owner
        self.hub = hub
        self.models = models
        self.identity = identity
        self.worker = identity.worker
        self.actor_name = identity.actor
        self.mode = mode
        self.token = token
        self.transport = get_transport(welcome.transport).open_receiver(welcome.transport_info)
        self.gate = ApplyGate(finish_deferred=self._send_ack)
        self.watch: _HubWatch | None = None
        #: Models whose latest version could not be fetched on connecting: the hub watch
        #: pulls them again at each beat until they hold a version at least that new.
        self.behind: set[str] = set()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.transport.close()

    def apply_now(self, update: Update, during: str) -> None:
        """Apply ``update`` from a user-facing call (connect, pull); raise if it fails.

        A transport failure raises TransportError itself, anything else RaySyncError.
        """
        ack = self._stage_and_apply(update)
        if ack is None:  # deferred to the next safe point; acked from there
            return
        if ack.status is AckStatus.FAILED:
            raise RaySyncError(
                f"{self.actor_name} could not apply version {update.version} of model "
                f"{update.model!r} {during}: {ack.error}"
            )
        self._send_ack(ack)

    def reattach(self, timeout_s: float) -> None:
        """Register again with the same hub (it restarted or dropped us). Watch thread.

        Newer versions the hub holds are delivered through this actor's own method
        queue, so they are applied at a safe point like any broadcast.
        """
        registration = _registration(self.owner, self.models, self.identity, self.mode)
        welcome = ray.get(self.hub.actor.register.remote(registration), timeout=timeout_s)
        self.token = registration.token
        self.transport.close()
        self.transport = get_transport(welcome.transport).open_receiver(welcome.transport_info)
        logger.info("%s re-registered with its hub", self.actor_name)
        handle = ray.get_runtime_context().current_actor
        for update in welcome.latest.values():
            ack = ray.get(handle._raysync_deliver.remote(update), timeout=timeout_s)
            if ack is not None:
                self._send_ack(ack)

    def catch_up(self, timeout_s: float) -> None:
        """Pull what :attr:`behind` lists again (hub watch thread); an update goes
        through this actor's own method queue, so it is applied at a safe point."""
        handle = ray.get_runtime_context().current_actor
        for model in sorted(self.behind):
            update = ray.get(
                self.hub.actor.latest.remote(model, self.models[model].version, self.worker),
                timeout=timeout_s,
            )
            if update is not None:
                ack = ray.get(handle._raysync_deliver.remote(update), timeout=timeout_s)
                if ack is not None and ack.status is AckStatus.FAILED:
                    logger.debug("%s is still behind on %r: %s", self.actor_name, model, ack.error)
                    continue
                if ack is not None:
                    self._send_ack(ack)
            self.behind.discard(model)

    # -- updates ------------------------------------------------------------------------
    def receive(self, update: Update) -> Ack | None:
        """Fetch and apply ``update``; None if the apply waits for a safe point.

        Never raises: a failure becomes a FAILED ack carrying the traceback.
        """
        try:
            return self._stage_and_apply(update)
        except Exception:
            return self._ack(update, AckStatus.FAILED, traceback.format_exc())

    def _stage_and_apply(self, update: Update) -> Ack | None:
        """Fetch ``update`` and apply it at the safe point. The transport's hold on the
        payload is released on every path, once nothing reads the staged data."""
        held = self.models.get(update.model)
        if held is None or update.version <= held.version:
            self.transport.release(update.payload, None)
            if held is None:
                raise UnknownModelError(f"{self.actor_name} does not hold model {update.model!r}")
            return self._ack(update, AckStatus.SUPERSEDED)
        try:
            _, spec = held.destination(self.owner)
            _check_digest(spec, update, self.actor_name)
            staged = self.transport.fetch(update.payload, spec)
        except BaseException:
            self.transport.release(update.payload, None)
            raise
        result = self.gate.write(
            functools.partial(self._apply_and_release, update, staged),
            key=update.model,
            supersede=functools.partial(self._superseded, update, staged),
        )
        return None if result is DEFERRED else result

    def _superseded(self, update: Update, staged: Sequence[torch.Tensor]) -> Callable[[Ack], Ack]:
        """A newer version of the same model now waits for the same safe point: free
        this one's staged data; its ack follows the newer one's outcome."""
        self.transport.release(update.payload, staged)

        def outcome(newer: Ack) -> Ack:
            if newer.status is AckStatus.FAILED:
                return self._ack(
                    update,
                    AckStatus.FAILED,
                    f"superseded while waiting for a safe point by version {newer.version}, "
                    f"which then failed: {newer.error}",
                )
            return self._ack(update, AckStatus.SUPERSEDED)

        return outcome

    def _apply_and_release(self, update: Update, staged: Sequence[torch.Tensor]) -> Ack:
        """Apply, then hand ``staged`` back to the transport unless the model took it
        over (zero copy). Runs at the safe point."""
        held = self.models[update.model]
        try:
            return self._apply(update, staged)
        finally:
            if held.adopted is None or held.adopted.staged is not staged:
                self.transport.release(update.payload, staged)

    def _apply(self, update: Update, staged: Sequence[torch.Tensor]) -> Ack:
        """Write ``staged`` into the model: point its tensors at it (zero copy) or copy
        it in place. Runs at the safe point."""
        held = self.models[update.model]
        if update.version <= held.version:
            return self._ack(update, AckStatus.SUPERSEDED)
        try:
            destination, spec = held.destination(self.owner)
            _check_digest(spec, update, self.actor_name)
            adopted = self.identity.zero_copy and self._adopt(held, spec, update, staged)
            if not adopted:
                targets = [destination.tensors[name] for name in spec.names]
                with torch.no_grad():
                    torch._foreach_copy_(targets, list(staged))
                if destination.commit is not None:
                    destination.commit()
        except Exception:
            return self._ack(update, AckStatus.FAILED, traceback.format_exc())
        held.version = update.version
        try:
            self.owner.on_weights_applied(update.model, update.version)
        except Exception:
            return self._ack(
                update,
                AckStatus.FAILED,
                f"version {update.version} was applied, but on_weights_applied raised:\n"
                + traceback.format_exc(),
            )
        return self._ack(update, AckStatus.APPLIED)

    def _adopt(
        self, held: _HeldModel, spec: WeightSpec, update: Update, staged: Sequence[torch.Tensor]
    ) -> bool:
        """Make ``staged`` the model's own memory: each of its tensors (same Python
        object, so optimizers and hooks keep theirs) now views the staged version.
        False, with nothing changed, when a tensor cannot be replaced that way (the
        model is then copied into as usual); the version it leaves goes back to its
        transport."""
        own = weights.own_tensors(model_path.resolve(self.owner, held.path), spec.names)
        if own is None:
            return self._copies_instead(held, "its tensors are reached only by copying")
        pairs = [(own[name], view) for name, view in zip(spec.names, staged, strict=True)]
        for name, (tensor, view) in zip(spec.names, pairs, strict=True):
            if tensor.device != view.device:
                return self._copies_instead(
                    held, f"{name!r} is on {tensor.device}, the staged data on {view.device}"
                )
        with torch.no_grad():
            for tensor, view in pairs:
                tensor.data = view
        previous, held.adopted = held.adopted, _Adopted(self.transport, update.payload, staged)
        if previous is not None:
            previous.transport.release(previous.payload, previous.staged)
        return True

    def _copies_instead(self, held: _HeldModel, why: str) -> bool:
        """Log, once per model, why its zero-copy apply is a copy after all; False."""
        if not held.copies_instead:
            held.copies_instead = True
            logger.warning(
                "%s: zero_copy is off for model %r (%s); its updates are copied",
                self.actor_name,
                held.model_id,
                why,
            )
        return False

    def _ack(self, update: Update, status: AckStatus, error: str | None = None) -> Ack:
        return Ack(self.worker, update.model, update.version, status, error)

    def _send_ack(self, ack: Ack) -> None:
        """Acks of applies that ran after their delivery call returned."""
        self.hub.actor.ack.remote(ack)


def _check_digest(spec: WeightSpec, update: Update, actor: str) -> None:
    """Raise SpecMismatchError unless ``update`` is for a model shaped like ``spec``."""
    if spec.digest != update.spec_digest:
        raise SpecMismatchError(
            f"update version {update.version} of model {update.model!r} has spec digest "
            f"{update.spec_digest}, but {actor}'s model now has {spec.digest} (was it "
            f"replaced after connect_hub?): {spec.summary()}"
        )


class _HubWatch(threading.Thread):
    """Receiver-side watchdog: re-registers when the hub no longer knows this receiver.

    That happens after the hub actor restarted (its registry is rebuilt from
    receivers) or after it dropped this receiver as dead by mistake. Runs in a daemon
    thread of the receiver process, one heartbeat call every ``interval_s``. A hub that
    does not answer (restarting) is simply asked again at the next beat.
    """

    def __init__(self, core: _ReceiverCore, interval_s: float) -> None:
        super().__init__(name=f"raysync-hub-watch-{core.worker}", daemon=True)
        self._core = core
        self._interval_s = interval_s
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        core = self._core
        call_timeout = max(4 * self._interval_s, 5.0)
        while not self._stopped.wait(self._interval_s):
            try:
                known = ray.get(
                    core.hub.actor.heartbeat.remote(core.worker, core.token), timeout=call_timeout
                )
                if not known:
                    core.reattach(call_timeout)
                if core.behind:
                    core.catch_up(call_timeout)
            except (RayError, GetTimeoutError) as err:
                logger.debug("hub unreachable from %s, retrying: %s", core.actor_name, err)
            except RaySyncError as err:
                logger.error("%s cannot re-register with its hub: %s", core.actor_name, err)


def _registration(
    owner: Any, held: dict[str, _HeldModel], identity: _Identity, mode: DeliveryMode
) -> Registration:
    context = ray.get_runtime_context()
    return Registration(
        worker=identity.worker,
        handle=context.current_actor,
        actor=identity.actor,
        node_id=context.get_node_id(),
        process=context.get_worker_id(),
        specs={m: h.destination(owner)[1] for m, h in held.items()},
        versions={m: h.version for m, h in held.items()},
        mode=mode,
        token=uuid.uuid4().hex,
        transport=identity.transport,
        kept=tuple(h.adopted.payload for h in held.values() if h.adopted is not None),
    )


def _carried_over(previous: _ReceiverCore | None, model_id: str, path: str) -> _HeldModel:
    """A model as a new registration starts it: the version a previous registration of
    this actor left it at, and the staged version it lives in (zero copy), if any."""
    old = previous.models.get(model_id) if previous is not None else None
    if old is None:
        return _HeldModel(model_id, path)
    return _HeldModel(model_id, path, old.version, old.adopted if old.path == path else None)


class WeightReceiver:
    """Mixin for Ray actor classes whose models a :class:`~raysync.WeightHub` keeps fresh.

    Subclass it (or decorate the class with :func:`weight_receiver`) and call
    :meth:`connect_hub` in ``__init__``. Every public method the class defines becomes a
    *reader*: a new version is applied only while none of them runs, so user code
    never sees a model that mixes two versions, under threaded and async actors too.
    A method that runs for a long time lets updates in with :meth:`weights_safe_point`.
    Sync generator methods are not guarded.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in dir(cls):
            if name.startswith("_") or name in _MIXIN_NAMES:
                continue
            raw = inspect.getattr_static(cls, name)
            if not inspect.isfunction(raw) or getattr(raw, "__raysync_guarded__", False):
                continue
            if inspect.isgeneratorfunction(raw) or inspect.isasyncgenfunction(raw):
                continue
            setattr(cls, name, _guard(raw))

    def connect_hub(
        self,
        hub: HubHandle | str,
        models: Mapping[str, str] | str,
        *,
        worker_id: str | None = None,
        mode: DeliveryMode | str = DeliveryMode.PUSH,
        transport: str | None = None,
        zero_copy: bool = False,
        namespace: str | None = None,
        timeout_s: float = HUB_CALL_TIMEOUT_S,
        heartbeat_s: float | None = HEARTBEAT_S,
    ) -> None:
        """Register this actor's models with ``hub`` and apply the latest versions now.

        ``hub`` is a HubHandle or a named hub's name (looked up in ``namespace``).
        ``models`` maps model ids to attribute paths on ``self`` (``{"policy":
        "policy", "critic": "nets.critic", "obs_norm": "env.transform[0]"}``); a single
        path means model id ``"default"``. ``worker_id`` names this receiver in reports
        (default: the actor id). ``mode="pull"`` leaves this receiver out of
        broadcasts; it calls :meth:`pull_weights` when it wants the latest version.
        ``transport`` overrides the hub's transport for this receiver (``"shared_memory"``
        for a worker on the learner's node of an ``object_store`` hub, say); the
        learner then hands each version over in that form too.

        ``zero_copy=True`` applies a version by making the transport's staged copy the
        model's own memory (``param.data = view``) instead of copying it: no copy at
        the safe point. Parameters and buffers stay the same Python objects (optimizers
        and hooks keep working), but their storage changes at every update, so nothing
        may keep raw pointers across updates (CUDA graphs, ``data_ptr()``, a flat buffer
        the model's tensors were views of, a tensor taken with ``.data``). It needs a
        transport that declares it (``nixl``: the receiver's own staging buffers;
        ``shared_memory``: the node's segment, read-only, so the model must never be
        written in place); a model that cannot be rebound (reached only through
        ``state_dict()``, on another device than the staged data) is copied into as
        usual.

        Raises :class:`~raysync.SpecMismatchError` if a model disagrees with the hub's
        spec, :class:`~raysync.ModelPathError` if a path does not resolve, ``ValueError``
        for an unknown transport name and :class:`~raysync.TransportUnavailableError`
        (from the hub) if the transport cannot run there. Calling it
        again re-registers (after a restart this is what ``__init__`` does anyway).

        Every ``heartbeat_s`` seconds a daemon thread checks that the hub still knows
        this receiver and registers again if not (the hub restarted); ``None`` turns
        that off. ``timeout_s`` bounds every wait on the hub here.
        """
        handle = get_hub(hub, namespace, timeout_s=timeout_s) if isinstance(hub, str) else hub
        paths = {DEFAULT_MODEL: models} if isinstance(models, str) else dict(models)
        if not paths:
            raise ValueError("connect_hub needs at least one model path")
        previous = self.__dict__.get("_raysync_core")
        held = {m: _carried_over(previous, m, path) for m, path in paths.items()}
        actor_id = ray.get_runtime_context().get_actor_id()
        chosen = get_transport(transport or handle.transport)  # ValueError: unknown name
        if zero_copy and chosen.zero_copy is None:
            qualify = [n for n in known_transports() if get_transport(n).zero_copy is not None]
            raise ValueError(
                f"zero_copy needs a transport whose staged data a model can live in; "
                f"{chosen.name!r} hands out data it may reuse or shares with its own "
                f"readers (those that qualify: {', '.join(qualify)})"
            )
        identity = _Identity(
            worker_id or actor_id, f"{type(self).__name__}({actor_id})", transport, zero_copy
        )
        registration = _registration(self, held, identity, DeliveryMode(mode))
        welcome = ray.get(handle.actor.register.remote(registration), timeout=timeout_s)
        if previous is not None:
            previous.close()
        core = _ReceiverCore(
            self, handle, held, identity, registration.mode, welcome, registration.token
        )
        self._raysync_core = core
        for update in welcome.latest.values():
            try:
                core.apply_now(update, "while connecting")
            except TransportError as err:
                # Its data could not be read now (gone with a dead learner, or a data
                # path that failed): stay registered at the version held; the hub watch
                # pulls it again at each beat, and the next broadcast brings it anyway.
                core.behind.add(update.model)
                logger.warning(
                    "%s could not fetch version %d of model %r while connecting (pulled "
                    "again at each heartbeat): %s",
                    core.actor_name,
                    update.version,
                    update.model,
                    err,
                )
        if heartbeat_s is not None:
            core.watch = _HubWatch(core, heartbeat_s)
            core.watch.start()

    def weights_version(self, model: str | None = None) -> int:
        """The version of ``model`` this actor holds (0: none received yet)."""
        core = self._raysync_connected()
        return core.models[_one_model(core, model)].version

    def pull_weights(
        self, model: str | None = None, *, timeout_s: float = HUB_CALL_TIMEOUT_S
    ) -> dict[str, int]:
        """Fetch and apply the latest version of ``model`` (default: every model) if newer.

        Returns the versions held afterwards. Safe to call from inside a user method:
        the caller's own read is released while the update is applied.
        """
        core = self._raysync_connected()
        chosen = [_one_model(core, model)] if model is not None else list(core.models)
        for model_id in chosen:
            update = ray.get(
                core.hub.actor.latest.remote(
                    model_id, core.models[model_id].version, worker=core.worker
                ),
                timeout=timeout_s,
            )
            if update is not None:
                core.apply_now(update, "on pull")
        return {m: core.models[m].version for m in chosen}

    def weights_safe_point(self) -> None:
        """Apply updates waiting for this method to finish, now. For long-running methods."""
        self._raysync_connected().gate.safe_point()

    def on_weights_applied(self, model: str, version: int) -> None:
        """Hook: runs after each version is applied, still at the safe point. Override it.

        An exception raised here reaches the learner as this worker's failure.
        """

    # Never retried on a restarted incarnation, whatever the actor's max_task_retries:
    # the hub must see the death (the new incarnation gets the latest version when it
    # registers again).
    @ray.method(max_task_retries=0)
    def _raysync_deliver(self, update: Update) -> Ack | None:
        """Called by the hub for each broadcast; the Ack, or None if it comes later."""
        core = self.__dict__.get("_raysync_core")
        if core is None:
            return Ack(
                "?",
                update.model,
                update.version,
                AckStatus.FAILED,
                f"{type(self).__name__} received an update before connect_hub finished",
            )
        return core.receive(update)

    def _raysync_connected(self) -> _ReceiverCore:
        core = self.__dict__.get("_raysync_core")
        if core is None:
            raise RaySyncError(f"{type(self).__name__} has not called connect_hub yet")
        return core


_MIXIN_NAMES = frozenset(n for n in vars(WeightReceiver) if not n.startswith("__"))


def _one_model(core: _ReceiverCore, model: str | None) -> str:
    if model is None:
        if len(core.models) == 1:
            return next(iter(core.models))
        raise UnknownModelError(
            f"this receiver holds several models ({', '.join(sorted(core.models))}); name one"
        )
    if model not in core.models:
        raise UnknownModelError(
            f"this receiver holds no model {model!r} (it holds: {', '.join(sorted(core.models))})"
        )
    return model


def _guard(method: Any) -> Any:
    """Wrap a user method so it runs as a reader of the receiver's ApplyGate."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def guarded_async(self: WeightReceiver, *args: Any, **kwargs: Any) -> Any:
            core = self.__dict__.get("_raysync_core")
            if core is None:
                return await method(self, *args, **kwargs)
            async with core.gate.reading_async():
                return await method(self, *args, **kwargs)

        guarded_async.__raysync_guarded__ = True
        return guarded_async

    @functools.wraps(method)
    def guarded(self: WeightReceiver, *args: Any, **kwargs: Any) -> Any:
        core = self.__dict__.get("_raysync_core")
        if core is None:
            return method(self, *args, **kwargs)
        with core.gate.reading():
            return method(self, *args, **kwargs)

    guarded.__raysync_guarded__ = True
    return guarded


def weight_receiver(cls: type) -> type:
    """Class decorator form of :class:`WeightReceiver`: ``@ray.remote @weight_receiver class C``."""
    return type(
        cls.__name__,
        (cls, WeightReceiver),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
    )
