"""Start a hub, or find one: :class:`WeightHub` creates the hub actor (called from the
Ray job that owns it, usually the learner's driver) and :func:`get_hub` finds a named one
(called by receivers and learners that did not start it). Both return a
:class:`~raysync.hub_handle.HubHandle`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import ActorAlreadyExistsError

from raysync.actor_classes import HUB, actor_class
from raysync.errors import HubNotFoundError, TransportUnavailableError
from raysync.hub_handle import DEFAULT_TIMEOUT_S, HubHandle, check_seconds
from raysync.messages import HubConfig
from raysync.transports import (
    DEFAULT_TRANSPORT,
    get_transport,
    known_transports,
    registered_transports,
)
from raysync.transports.buckets import bucket_bytes_of
from raysync.wire_dtype import AsIs, resolve_wire_dtype

logger = logging.getLogger(__name__)

#: How long ``get_if_exists`` waits for a running hub's config (it may still be starting).
RUNNING_HUB_WAIT_S = 120.0


class HubLauncher:
    """``WeightHub.options(...)``: actor options waiting for ``.remote(...)``."""

    def __init__(self, actor_options: dict[str, Any]) -> None:
        self._actor_options = {"num_cpus": 0, **actor_options}

    def remote(
        self,
        *,
        transport: str = DEFAULT_TRANSPORT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reject_nonfinite: bool = False,
        models: Sequence[str] = (),
        options: object | Sequence[object] = (),
        wire_dtype: torch.dtype | AsIs | None = None,
        bucket_mb: float | None = None,
        channels: bool = False,
    ) -> HubHandle:
        """Start the hub actor (with ``get_if_exists=True`` among the options, find the
        running one of that name if there is one: the handle then carries that hub's
        own settings, and a warning names those that differ from these).

        ``transport`` names the data path (see :func:`raysync.known_transports`);
        ``timeout_s`` is the default ack timeout of a broadcast; ``reject_nonfinite``
        makes every broadcast check its tensors for NaN/Inf in the learner. ``models``
        declares model ids up front: a broadcast may name one of them before any
        receiver registered it (a learner that starts first); any other id must have
        been registered by a receiver, else the broadcast raises
        :class:`~raysync.UnknownModelError` (a typo reaches nobody silently).
        ``options`` are transport settings, one object or several, of the classes in
        :mod:`raysync.transports.options` (``DistributedOptions(timeout_s=10)``,
        ``RpcOptions(...)``); each applies wherever its transport is used by this hub,
        as its default transport or one its receivers chose. Raises ``ValueError`` for
        an unknown transport, ``TypeError`` for options that belong to no transport or
        twice the same, and :class:`~raysync.TransportUnavailableError` if the transport
        cannot run here. ``wire_dtype`` is every broadcast's default (see
        ``broadcast.remote``); ``ValueError`` if it is not a floating dtype;
        ``raysync.AS_IS`` is the same as None: no default, a broadcast that names no
        dtype travels as it is.
        ``bucket_mb`` is every broadcast's default bucket size (see
        ``broadcast.remote``); ``ValueError`` unless positive, or if ``transport``
        moves whole versions only. ``channels=True``: each learner writes versions of
        up to 2 MiB into a Ray compiled graph to the ``WeightReceiver`` actors on its
        node that read by ``object_store`` (one write for all, acks back the same way)
        instead of calling each one (see :mod:`raysync.learner_channel`); it takes the
        receivers' compiled-graph thread, so leave it off for actors that run a compiled
        graph of their own (vLLM's workers) or use ``rdt``.
        """
        wire_dtype = resolve_wire_dtype(wire_dtype, None)
        if bucket_mb is not None:
            bucket_bytes_of(bucket_mb)
            if not get_transport(transport).buckets:
                raise ValueError(f"bucket_mb: transport {transport!r} moves whole versions only")
        availability = get_transport(transport).availability()
        if not availability.available:
            raise TransportUnavailableError(
                f"transport {transport!r} is not available: {availability.reason}"
            )
        check_seconds("timeout_s", timeout_s)
        if isinstance(models, str):
            raise TypeError(f"models takes a sequence of model ids, not the string {models!r}")
        config = HubConfig(
            transport,
            timeout_s,
            reject_nonfinite,
            uuid.uuid4().hex,
            tuple(models),
            transport_options=_transport_options(options),
            transports=registered_transports(),
            wire_dtype=wire_dtype,
            bucket_mb=bucket_mb,
            channels=channels,
            restartable=self._actor_options.get("max_restarts", 0) != 0,
        )
        hub_class = ray.remote(actor_class(HUB))
        if not self._actor_options.get("get_if_exists"):
            return HubHandle(hub_class.options(**self._actor_options).remote(config), config)
        running = self._running()
        if running is None:
            # Created here unless another process's start of the same hub wins the race
            # (Ray's get_if_exists would then hand that one back with this config).
            creating = {**self._actor_options, "get_if_exists": False}
            try:
                return HubHandle(hub_class.options(**creating).remote(config), config)
            except ActorAlreadyExistsError:
                running = self._running()
                if running is None:  # gone again already
                    raise
        _warn_if_other(running.config, config)
        return running

    def _running(self) -> HubHandle | None:
        """With ``get_if_exists``: the hub of this name if it runs already (Ray would
        hand it back and ignore the arguments: its config, with its own hub_id, which
        names its resource actors, and its transport, is not the one asked for)."""
        name = self._actor_options.get("name")
        if name is None:
            return None
        try:
            actor: Any = ray.get_actor(name, namespace=self._actor_options.get("namespace"))
        except ValueError:
            return None
        namespace = self._actor_options.get("namespace")
        return HubHandle(actor, _config_of(actor, name, namespace, RUNNING_HUB_WAIT_S))


class WeightHub:
    """Creates the hub actor: ``WeightHub.remote(...)`` or ``WeightHub.options(...).remote(...)``.

    Called from the Ray job that owns the hub (usually the learner's driver).
    """

    @staticmethod
    def options(**actor_options: Any) -> HubLauncher:
        """Ray actor options for the hub: ``name``, ``namespace``, ``lifetime``,
        ``max_restarts``, ``scheduling_strategy``, resources, ... (``num_cpus`` defaults to 0)."""
        return HubLauncher(actor_options)

    #: Start a hub with default actor options: :meth:`HubLauncher.remote`.
    remote = staticmethod(HubLauncher({}).remote)


#: What a hub found with ``get_if_exists`` may differ in from what was asked.
_SETTINGS = (
    "transport",
    "default_timeout_s",
    "reject_nonfinite",
    "models",
    "transport_options",
    "wire_dtype",
    "bucket_mb",
    "channels",
)


def _warn_if_other(running: HubConfig, asked: HubConfig) -> None:
    """Log the settings a hub found with ``get_if_exists`` has other than asked for
    (Ray ignores the arguments when it hands back a running actor)."""
    other = [
        f"{name}={getattr(running, name)!r} (asked: {getattr(asked, name)!r})"
        for name in _SETTINGS
        if getattr(running, name) != getattr(asked, name)
    ]
    if other:
        logger.warning("get_if_exists found a running hub with " + ", ".join(other))


def _transport_options(options: object | Sequence[object]) -> tuple[object, ...]:
    """``options`` as a tuple, checked: each the options class of a known transport,
    no class twice (which one would apply?)."""
    given = tuple(options) if isinstance(options, (list, tuple)) else (options,)
    if not given:
        return ()
    declared = (get_transport(name).options for name in known_transports())
    classes = {c for c in declared if c is not None}
    seen: set[type] = set()
    for option in given:
        if type(option) not in classes:
            names = ", ".join(sorted(c.__name__ for c in classes))
            raise TypeError(
                f"options: {option!r} is not the options of any transport (those are: {names})"
            )
        if type(option) in seen:
            raise TypeError(f"options: two {type(option).__name__} given; pass one")
        seen.add(type(option))
    return given


def get_hub(
    name: str, namespace: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> HubHandle:
    """A HubHandle on the named hub actor (``WeightHub.options(name=...)``).

    Waits up to ``timeout_s`` for a hub of that name to exist (receivers may start
    before the hub), then raises :class:`~raysync.HubNotFoundError`; ValueError for a
    ``timeout_s`` that is no positive, finite number of seconds (NaN waited for good).
    """
    check_seconds("timeout_s", timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # Any: Ray's stubs type an ActorHandle's methods as Never.
            actor: Any = ray.get_actor(name, namespace=namespace)
            break
        except ValueError:
            if time.monotonic() >= deadline:
                raise HubNotFoundError(
                    f"no hub named {name!r} in namespace {namespace!r} appeared within "
                    f"{timeout_s:g} s"
                ) from None
            time.sleep(0.2)
    return HubHandle(actor, _config_of(actor, name, namespace, deadline - time.monotonic()))


def _config_of(actor: Any, name: str, namespace: str | None, timeout_s: float) -> HubConfig:
    """The config of the hub actor found under ``name``: TimeoutError if it does not
    answer within ``timeout_s`` (at least 1 s), HubNotFoundError if it died; each
    naming the hub."""
    timeout_s = max(1.0, timeout_s)
    where = f"hub {name!r} (namespace {namespace!r})"
    try:
        config: HubConfig = ray.get(actor.config.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise TimeoutError(
            f"{where} was found but did not answer within {timeout_s:g} s (busy, or "
            "restarting)"
        ) from err
    except ray.exceptions.RayActorError as err:
        raise HubNotFoundError(f"{where} was found but died: {err}") from err
    return config
