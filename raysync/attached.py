"""Receive weights in any Ray actor or process: :func:`attach` and :class:`AttachedReceiver`.

Called inside the host process — an actor whose class you did not write (a TorchRL
collector, an inference engine's worker), from a method it already has, from Ray's
``__ray_call__``, or from a driver or task in pull mode. Nothing on the host's class is
needed: the hub delivers through ``__ray_call__`` (:mod:`raysync.receiver_delivery`).
The :class:`~raysync.WeightReceiver` mixin is this plus guards on its methods.

Where a version lands, and when, depends on how the host runs code:

* a default actor (one call at a time): a delivery is a call in the actor's queue, so
  it lands between the host's method calls — never inside one. A method that never
  returns keeps updates out: use ``mode="pull"`` and :meth:`AttachedReceiver.pull`
  between steps instead.
* a threaded actor (``max_concurrency > 1``) or a process whose own threads use the
  model: deliveries run beside the host's code, so the host holds the model with
  ``with receiver.using():`` around each use (a step, a batch); a version is applied
  only while nobody holds it, and waits for the current holders to let go. A host that
  holds it for long opens safe points with :meth:`AttachedReceiver.safe_point`.
* an async actor, attached from a coroutine or through ``__ray_call__`` (off its loop:
  the actor's own loop is asked of Ray): a version is written on its event loop, between
  two steps of its coroutines; one that uses the model across an ``await`` holds it
  with ``async with receiver.using_async():``, and a version that arrives while a holder
  is parked there is applied when the last holder lets go.
* a process that is no actor (the driver, a task): pull mode only.

A host that Ray restarts has no receiver in its new process until it attaches again:
attach from where the host's start-up runs (its constructor, an init hook such as
TorchRL's ``init_on_receiver``). The hub names such a receiver in the broadcasts it
fails until then; its next registration brings the latest version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import reprlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, cast

import ray
import torch
from ray._private.worker import WORKER_MODE
from ray._raylet import PythonFunctionDescriptor  # type: ignore[attr-defined]
from ray.actor import ActorHandle

from raysync.errors import RaySyncError
from raysync.hub_handle import HubHandle, check_seconds
from raysync.hub_launch import get_hub
from raysync.hub_state import DEFAULT_MODEL
from raysync.messages import DeliveryMode, Entry
from raysync.receiver_core import (
    HUB_CALL_TIMEOUT_S,
    HUB_UNANSWERED,
    ReceiverCore,
    ReceiverIdentity,
)
from raysync.receiver_hub_watch import HEARTBEAT_S, UNWATCHED, HubConnection, HubWatch
from raysync.weights import is_tensordict

logger = logging.getLogger(__name__)


class AttachedReceiver:
    """A host's link to its hub, made by :func:`attach` (see the module doc).

    Every method is called in the host process, from any thread. ``worker`` is its
    name in the hub's reports; ``core`` the :class:`~raysync.receiver_core.ReceiverCore`
    underneath. A context manager: ``with raysync.attach(...) as receiver:`` closes it
    at the end of the block (a Ray task's process is reused by the next task, which
    could not attach under the same worker id while this one stays attached).
    """

    def __init__(self, core: ReceiverCore, watch: HubWatch | None) -> None:
        self.core = core
        self.worker = core.worker
        self._watch = watch

    def version(self, model: str | None = None) -> int:
        """The version of ``model`` held here (0: none received yet); ``None`` names the
        only model."""
        return self.core.models[self.core.model_id(model)].version

    def versions(self) -> dict[str, int]:
        """The version of every model held here."""
        return {m: held.version for m, held in self.core.models.items()}

    def pull(
        self, model: str | None = None, *, timeout_s: float = HUB_CALL_TIMEOUT_S
    ) -> dict[str, int]:
        """Fetch and apply the latest version of ``model`` (default: every model) if newer
        than the one held; the versions held afterwards.

        Safe from inside :meth:`using`: the caller's own hold is let go while the version
        is applied. On an event loop while other coroutines hold the models, the version
        is staged and applied once they leave (as a broadcast's is): the versions
        returned are then those held before. ``timeout_s`` bounds each wait on the hub.

        Each model is pulled on its own: one that fails (the hub refusing its version,
        or applying it) leaves the others pulled, and the failure is raised once all
        were tried: what the one model that failed raised
        (:class:`~raysync.RaySyncError` if its version could not be applied; noted with
        its model id when others were pulled), or a :class:`~raysync.RaySyncError`
        naming each model that failed and why. A hub that is gone, or does not answer
        within ``timeout_s``, is raised at once, as Ray raised it (the other models
        would wait as long). Raises :class:`~raysync.RaySyncError` too once the receiver
        is closed.
        """
        core = self.core
        if self.closed:
            raise RaySyncError(
                f"{core.actor_name}'s receiver {self.worker!r} is closed: it pulls nothing "
                "(attach again)"
            )
        chosen = [core.model_id(model)] if model is not None else list(core.models)
        failures: dict[str, Exception] = {}
        for model_id in chosen:
            try:
                self._pull_one(model_id, timeout_s)
            except HUB_UNANSWERED:
                raise  # the hub is gone or does not answer: the others would wait as long
            except Exception as err:  # the models after it are still pulled
                failures[model_id] = err
        versions = {m: core.models[m].version for m in chosen}
        if failures:
            _raise_pull_failure(core.actor_name, failures, versions)
        return versions

    def _pull_one(self, model_id: str, timeout_s: float) -> None:
        """Fetch and apply the latest version of one model if newer (:meth:`pull`)."""
        update = self.core.latest(model_id, timeout_s)
        if update is not None:
            self.core.apply_now(update, "on pull")

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Hold the models steady: no version is applied until the block ends (threads)."""
        with self.core.gate.reading():
            yield

    @contextlib.asynccontextmanager
    async def using_async(self) -> AsyncIterator[None]:
        """:meth:`using` for coroutines of an async actor."""
        async with self.core.gate.reading_async():
            yield

    def safe_point(self) -> None:
        """Inside :meth:`using`: let a waiting version be applied now, then go on."""
        self.core.gate.safe_point()

    def connection(self) -> HubConnection:
        """The link to the hub as the hub watch last saw it (see
        :class:`~raysync.receiver_hub_watch.HubConnection`)."""
        return UNWATCHED if self._watch is None else self._watch.connection()

    @property
    def closed(self) -> bool:
        return self.core.closed.is_set()

    def __enter__(self) -> AttachedReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, *, timeout_s: float = HUB_CALL_TIMEOUT_S) -> None:
        """Leave the hub (no broadcast waits for this receiver any more) and stop
        receiving. The models keep the version they hold (a zero-copy model living in
        the node's shared memory is copied into memory of its own first). Idempotent; a
        hub that cannot be reached is only logged."""
        if self.closed:
            return
        try:
            self.core.retire()
        finally:  # whatever moving a model out raised, the hub stops targeting this one
            try:
                self.core.leave_hub(timeout_s)
            except Exception as err:  # the hub is gone or restarting: it forgets us anyway
                logger.warning(
                    "%s could not tell its hub it leaves: %s", self.core.actor_name, err
                )
            self.core.close()


def attach(
    hub: HubHandle | str,
    models: Mapping[str, Any] | Any,
    *,
    owner: Any = None,
    worker_id: str | None = None,
    mode: DeliveryMode | str = DeliveryMode.PUSH,
    transport: str | None = None,
    zero_copy: bool = False,
    namespace: str | None = None,
    timeout_s: float = HUB_CALL_TIMEOUT_S,
    heartbeat_s: float | None = HEARTBEAT_S,
    on_applied: Callable[[str, int], None] | None = None,
    replaces: AttachedReceiver | None = None,
) -> AttachedReceiver:
    """Register models of this process with ``hub``, apply their latest versions now, and
    keep them fresh; call it inside the host process (see the module doc).

    ``hub`` is a HubHandle or a named hub's name (looked up in ``namespace``); the hub
    actor's own Ray ActorHandle (``ray.get_actor(name)``) will not do.
    ``models`` is one model (an ``nn.Module``, a TensorDict, an object with
    ``state_dict()``/``load_state_dict()``; model id ``"default"``) or a mapping of model
    ids to models — each a model object, or an attribute path on ``owner``
    (``"policy"``, ``"nets.critic"``, ``"env.transform[0]"``; a path is looked up at
    each version, so a host that replaces its model object is followed). A mapping
    with tensor values is one model (a state dict). ``worker_id`` names this receiver
    in reports (default: the actor id, or the process's Ray worker id).

    ``mode="pull"`` leaves this receiver out of broadcasts (it calls
    :meth:`AttachedReceiver.pull`); push, the default, needs the host to be a Ray
    actor. ``transport`` overrides the hub's for this receiver; ``zero_copy=True`` makes
    the transport's staged copy the model's own memory (see
    :meth:`raysync.WeightReceiver.connect_hub`). ``on_applied(model, version)`` runs
    at the safe point after each applied version; what it raises fails that version's
    ack. ``replaces`` is an earlier receiver of this process that this one takes over
    from (its gate, and each model's version where the model id names the same object
    at the same path; it is closed). ``heartbeat_s``: how often a
    daemon thread checks that the hub still knows this receiver and registers again if
    not (``None``: never). ``timeout_s`` bounds every wait on the hub here.

    Raises ``TypeError`` at once, before anything is registered, if ``hub`` is neither,
    :class:`~raysync.SpecMismatchError` if a model disagrees with the hub's spec,
    :class:`~raysync.ModelPathError` if a path does not resolve, ``ValueError`` for
    push mode outside an actor, a path without ``owner`` or an unknown transport, and
    :class:`~raysync.TransportUnavailableError` if the transport cannot run here,
    ``ValueError`` for a ``heartbeat_s`` or ``timeout_s`` that is not a positive number
    of seconds, and :class:`~raysync.RaySyncError` if a version the hub welcomes it
    with fails to apply (its ``on_applied`` raised): the receiver then leaves the hub
    again; ``replaces``, closed by then, may be passed as ``replaces`` again.
    """
    hub = _hub_argument(hub)
    delivery = DeliveryMode(mode)
    if heartbeat_s is not None:
        check_seconds("heartbeat_s", heartbeat_s)
    check_seconds("timeout_s", timeout_s)
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    if actor_id is None and delivery is DeliveryMode.PUSH:
        raise ValueError(
            "attach(mode='push') needs a Ray actor to deliver to; this process is none "
            "(a driver or a task): attach with mode='pull' and call receiver.pull()"
        )
    resolve_on, paths = _model_paths(models, owner)
    handle = get_hub(hub, namespace, timeout_s=timeout_s) if isinstance(hub, str) else hub
    identity = ReceiverIdentity(
        worker=worker_id or actor_id or context.get_worker_id(),
        actor=_host_name(owner, actor_id),
        attachment=uuid.uuid4().hex,
        entry=_entry(owner),
        mode=delivery,
        transport=transport,
        zero_copy=zero_copy,
        heartbeat_s=heartbeat_s,
    )
    core, welcome = ReceiverCore.register(
        resolve_on,
        handle,
        paths,
        identity,
        on_applied=on_applied,
        previous=replaces.core if replaces is not None else None,
        timeout_s=timeout_s,
    )
    # An async host's safe points are on its event loop: the caller's (attached from a
    # coroutine), else the actor's own (attached through ``__ray_call__``, which Ray runs
    # off the loop: a version written there landed in the middle of a running coroutine).
    core.gate.note_loop(_async_actor_loop())
    watch = HubWatch(core, heartbeat_s) if heartbeat_s is not None else None
    if watch is not None:
        core.wake_watch = watch.wake
    receiver = AttachedReceiver(core, watch)
    try:
        core.apply_welcome(welcome)
    except BaseException:
        receiver.close(timeout_s=timeout_s)  # the caller gets no receiver to close
        raise
    if watch is not None:
        watch.start()
    return receiver


def _hub_argument(hub: object) -> HubHandle | str:
    """``hub`` as :func:`attach` was given it, checked in the host process before anything
    is registered: a HubHandle or a hub's name, or a TypeError saying what to pass. An
    object with a HubHandle's ``actor`` and ``config`` (a test's stand-in) passes too."""
    if isinstance(hub, HubHandle | str):
        return hub
    if not isinstance(hub, ActorHandle) and hasattr(hub, "actor") and hasattr(hub, "config"):
        return cast(HubHandle, hub)
    instead = (
        "pass the HubHandle that WeightHub.remote(...) or raysync.get_hub(name) returns, "
        "or the hub's name"
    )
    if isinstance(hub, ActorHandle):
        raise TypeError(
            "hub is a Ray ActorHandle (from ray.get_actor(...), say), not a raysync "
            f"HubHandle: {instead}"
        )
    raise TypeError(
        f"hub must be a raysync HubHandle or a hub's name, not {reprlib.repr(hub)} "
        f"({type(hub).__qualname__}): {instead}"
    )


def _raise_pull_failure(
    actor_name: str, failures: dict[str, Exception], versions: dict[str, int]
) -> None:
    """Raise what :meth:`AttachedReceiver.pull` failed with once every model was tried
    (``versions``: those held afterwards): the one failure itself, its type kept (noted
    with its model id when others were pulled), or one :class:`~raysync.RaySyncError`
    naming each model that failed and why, from the first failure."""
    pulled = {m: v for m, v in versions.items() if m not in failures}
    others = f"; it pulled the others (versions held: {pulled})" if pulled else ""
    first = next(iter(failures.values()))
    if len(failures) == 1:
        if others:
            first.add_note(f"{actor_name} could not pull model {next(iter(failures))!r}{others}")
        raise first
    why = "; ".join(f"{m!r}: {type(err).__name__}: {err}" for m, err in failures.items())
    raise RaySyncError(
        f"{actor_name} could not pull models {', '.join(map(repr, failures))} ({why}){others}"
    ) from first


class _Given:
    """What the paths of :func:`attach` resolve on when models are given as objects:
    ``given[model_id]``, and ``host.<path>`` for the paths on ``owner``."""

    def __init__(self, host: Any, given: dict[str, Any]) -> None:
        self.host = host
        self.given = given


def _model_paths(models: Any, owner: Any) -> tuple[Any, dict[str, str]]:
    """The object model paths resolve on, and each model id's path on it."""
    named = (
        dict(models)
        if isinstance(models, Mapping)
        and not is_tensordict(models)
        and not any(isinstance(v, torch.Tensor) for v in models.values())
        else {DEFAULT_MODEL: models}
    )
    if not named:
        raise ValueError("attach needs at least one model")
    paths = [repr(m) for m in named.values() if isinstance(m, str)]
    if paths and owner is None:
        raise ValueError(
            f"attach got attribute paths ({', '.join(paths)}) but no owner= to look them up on"
        )
    if len(paths) == len(named):
        return owner, named
    given = {model_id: m for model_id, m in named.items() if not isinstance(m, str)}
    on_given = {
        model_id: f"host.{m}" if isinstance(m, str) else f"given[{model_id!r}]"
        for model_id, m in named.items()
    }
    return _Given(owner, given), on_given


def _async_actor_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop this process's actor runs its calls on if it is an async actor
    (the default concurrency group's, where Ray also runs its ``__init__``), else None.
    Ray has no public accessor for it: its core worker is asked, as Ray's own executor
    asks it for ``__init__``."""
    worker: Any = ray._private.worker.global_worker
    if worker.mode != WORKER_MODE or not worker.core_worker.current_actor_is_asyncio():
        return None
    init = PythonFunctionDescriptor("", "__init__", "")
    loop, _ = worker.core_worker.get_event_loop(init, None)
    return cast(asyncio.AbstractEventLoop, loop)


def _host_name(owner: Any, actor_id: str | None) -> str:
    """The host as messages name it: ``Class(actor_id)``, or the process."""
    if actor_id is None:
        return f"process {os.getpid()}"
    if owner is not None:
        return f"{type(owner).__name__}({actor_id})"
    return repr(ray.get_runtime_context().current_actor)


def _entry(owner: Any) -> Entry:
    """How the hub reaches this host: a WeightReceiver through its own delivery method
    (the coroutine one, which the mixin gives async classes), any other host through
    ``__ray_call__``."""
    for entry in (Entry.MIXIN_ASYNC, Entry.MIXIN_METHOD):
        if callable(getattr(type(owner), entry.value, None)):
            return entry
    return Entry.RAY_CALL
