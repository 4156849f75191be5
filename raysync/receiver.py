"""The receiver mixin: :class:`WeightReceiver` and its decorator form, :func:`weight_receiver`.

Everything here runs in the receiver actor's process. ``connect_hub`` (usually from
``__init__``) is :func:`raysync.attach` with the actor as owner: it registers the
actor's models with the hub, applies the latest versions at once and starts the hub
watch; the :class:`~raysync.attached.AttachedReceiver` it returns is kept at
``self._raysync_receiver``. Each update is fetched from the transport outside the safe
point, then written into the model when no user method is running: every public method
of the class is wrapped as a reader (``receiver.using()``) when the class is defined.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import ray

from raysync.attached import AttachedReceiver, attach
from raysync.errors import RaySyncError
from raysync.host_loop import read_off_loop
from raysync.hub_handle import HubHandle
from raysync.hub_state import DEFAULT_MODEL
from raysync.messages import Ack, DeliveryMode, Update
from raysync.receiver_core import HUB_CALL_TIMEOUT_S
from raysync.receiver_delivery import deliver
from raysync.receiver_hub_watch import HEARTBEAT_S, HubConnection


class WeightReceiver:
    """Mixin for Ray actor classes whose models a :class:`~raysync.WeightHub` keeps fresh.

    Subclass it (or decorate the class with :func:`weight_receiver`) and call
    :meth:`connect_hub` in ``__init__``. Every public method the class defines becomes a
    *reader*: a new version is applied only while none of them runs, so user code
    never sees a model that mixes two versions, under threaded and async actors too.
    A method that runs for a long time lets updates in with :meth:`weights_safe_point`.
    An async generator method (a streamed reply) reads from its first item to its
    last; sync generator methods are not guarded (hold the model through one with
    ``self._raysync_receiver.using()``).

    :meth:`weights_connection` tells how the link to the hub stands, as the hub watch
    (the heartbeat thread ``connect_hub`` starts) last saw it: a
    :class:`~raysync.receiver_hub_watch.HubConnection` with ``connected`` (the hub knew
    this receiver at the last heartbeat), ``reregistering_since`` (``time.time()`` since
    when the hub has not known it and registering again has not succeeded: the watch
    tries again after one heartbeat, then twice as long each time, at most four
    heartbeats apart), ``last_error`` (the watch's last failure, kept after it
    recovers) and ``watched`` (False with ``heartbeat_s=None``: nothing checks).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in dir(cls):
            if name.startswith("_") or name in _MIXIN_NAMES:
                continue
            raw = inspect.getattr_static(cls, name)
            if not inspect.isfunction(raw) or getattr(raw, "__raysync_guarded__", False):
                continue
            if inspect.isgeneratorfunction(raw):
                continue
            setattr(cls, name, _guard(raw))
        if inspect.iscoroutinefunction(cls._raysync_deliver):
            raise TypeError(
                f"{cls.__qualname__}._raysync_deliver is a coroutine function: raysync "
                "calls it on a thread of its own in an async actor; define it with def"
            )
        if _is_async_actor_class(cls):  # Ray makes it an async actor: see the method
            cls._raysync_deliver_async = _raysync_deliver_async  # type: ignore[attr-defined]

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
        again re-registers (after a restart this is what ``__init__`` does anyway); a
        model keeps its version only if its id still names the same object at the same
        path, so a model built anew is brought to the hub's latest version then.

        Every ``heartbeat_s`` seconds a daemon thread checks that the hub still knows
        this receiver and registers again if not (the hub restarted), backing off while
        that fails (see :meth:`weights_connection`); ``None`` turns that off.
        ``timeout_s`` bounds every wait on the hub here.

        It is :func:`raysync.attach` with ``owner=self`` (and this class's methods
        guarded); the receiver it returns is kept at ``self._raysync_receiver``.
        """
        self._raysync_receiver = attach(
            hub,
            {DEFAULT_MODEL: models} if isinstance(models, str) else dict(models),
            owner=self,
            worker_id=worker_id,
            mode=mode,
            transport=transport,
            zero_copy=zero_copy,
            namespace=namespace,
            timeout_s=timeout_s,
            heartbeat_s=heartbeat_s,
            on_applied=self.on_weights_applied,
            replaces=self.__dict__.get("_raysync_receiver"),
        )

    def weights_version(self, model: str | None = None) -> int:
        """The version of ``model`` this actor holds (0: none received yet)."""
        return self._raysync_connected().version(model)

    def pull_weights(
        self, model: str | None = None, *, timeout_s: float = HUB_CALL_TIMEOUT_S
    ) -> dict[str, int]:
        """Fetch and apply the latest version of ``model`` (default: every model) if newer.

        Returns the versions held afterwards. Safe to call from inside a user method:
        the caller's own read is released while the update is applied. In an async
        actor's coroutine while other coroutines hold the models, the version is staged
        and applied once they leave (as a broadcast's is): the versions returned are
        then those held before. Each model is pulled on its own: one that fails is
        raised once the others are pulled (see :meth:`raysync.AttachedReceiver.pull`).
        """
        return self._raysync_connected().pull(model, timeout_s=timeout_s)

    def weights_safe_point(self) -> None:
        """Apply updates waiting for this method to finish, now. For long-running methods.

        Called from the running method, in this actor. It lets in only a delivery Ray has
        already started beside this method: on a default actor (one call at a time) the
        hub's call waits in the queue behind it, so nothing comes in and each broadcast
        fails at its timeout. Give the actor ``max_concurrency=2`` or more, or give the
        method a concurrency group of its own, or make it a coroutine that awaits
        between steps (an async actor).
        """
        self._raysync_connected().safe_point()

    def weights_connection(self) -> HubConnection:
        """This receiver's link to its hub, as its hub watch last saw it (see the class doc)."""
        return self._raysync_connected().connection()

    def on_weights_applied(self, model: str, version: int) -> None:
        """Hook: runs after each version is applied, still at the safe point. Override it.

        An exception raised here reaches the learner as this worker's failure.
        """

    # Never retried on a restarted incarnation, whatever the actor's max_task_retries:
    # the hub must see the death (the new incarnation gets the latest version when it
    # registers again). A method of its own rather than ``__ray_call__``: Ray runs it
    # like the class's other methods (an async class's hub calls
    # ``_raysync_deliver_async`` instead, which calls this one on a thread).
    @ray.method(max_task_retries=0)
    def _raysync_deliver(self, key: str, update: Update) -> Ack | None:
        """Called by the hub for each broadcast; the Ack, or None if it comes later."""
        return deliver(self, key, update)

    def _raysync_connected(self) -> AttachedReceiver:
        receiver = self.__dict__.get("_raysync_receiver")
        if receiver is None:
            raise RaySyncError(f"{type(self).__name__} has not called connect_hub yet")
        return receiver


_MIXIN_NAMES = frozenset(n for n in vars(WeightReceiver) if not n.startswith("__"))


@ray.method(max_task_retries=0)
async def _raysync_deliver_async(self: WeightReceiver, key: str, update: Update) -> Ack | None:
    """The delivery method of a mixin class with coroutine methods (an async actor's),
    in place of :meth:`WeightReceiver._raysync_deliver`, which it calls on one of
    raysync's reading threads: Ray runs an async actor's sync methods (and
    ``__ray_call__``) where no other call of the actor starts until they return, and a
    version's read may take the transport's whole timeout. The loop starts the actor's
    calls meanwhile; the version's write is handed back to this loop
    (:mod:`raysync.host_loop`)."""
    sync_deliver = cast(Callable[[str, Update], Ack | None], self._raysync_deliver)
    return await read_off_loop(functools.partial(sync_deliver, key, update))


def _is_async_actor_class(cls: type) -> bool:
    """Whether Ray makes an actor of ``cls`` an async actor: it has a coroutine or async
    generator method (Ray's own test, ``ray._private.async_compat.has_async_methods``)."""
    return any(
        inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        for _, member in inspect.getmembers(cls)
    )


def _guard(method: Any) -> Any:
    """Wrap a user method so it runs as a reader of the receiver's ApplyGate."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def guarded_stream(self: WeightReceiver, *args: Any, **kwargs: Any) -> Any:
            stream = method(self, *args, **kwargs)
            receiver = self.__dict__.get("_raysync_receiver")
            try:
                if receiver is None:
                    async for item in stream:
                        yield item
                    return
                async with receiver.using_async():  # one version from first item to last
                    async for item in stream:
                        yield item
            finally:
                await stream.aclose()

        cast(Any, guarded_stream).__raysync_guarded__ = True  # an attribute of our own
        return guarded_stream

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def guarded_async(self: WeightReceiver, *args: Any, **kwargs: Any) -> Any:
            receiver = self.__dict__.get("_raysync_receiver")
            if receiver is None:
                return await method(self, *args, **kwargs)
            async with receiver.using_async():
                return await method(self, *args, **kwargs)

        cast(Any, guarded_async).__raysync_guarded__ = True  # an attribute of our own
        return guarded_async

    @functools.wraps(method)
    def guarded(self: WeightReceiver, *args: Any, **kwargs: Any) -> Any:
        receiver = self.__dict__.get("_raysync_receiver")
        if receiver is None:
            return method(self, *args, **kwargs)
        with receiver.using():
            return method(self, *args, **kwargs)

    cast(Any, guarded).__raysync_guarded__ = True  # an attribute of our own
    return guarded


def weight_receiver(cls: type) -> type:
    """Class decorator form of :class:`WeightReceiver`: ``@ray.remote @weight_receiver class C``."""
    return type(
        cls.__name__,
        (cls, WeightReceiver),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
    )
