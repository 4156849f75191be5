"""The learner's side of raysync: :class:`HubHandle`, which
:class:`~raysync.hub_launch.WeightHub` returns. ``HubHandle.broadcast.remote(weights)``
flattens and checks the weights, hands their bytes to the transport *in the learner
process*, and sends the hub only the spec and the transport's payload (and, on the
direct path, calls the receivers itself: :mod:`raysync.learner_direct`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from raysync import weights as weights_mod
from raysync.errors import (
    HubClosedError,
    HubSnapshotError,
    IncompleteVersionError,
    SpecMismatchError,
    StaleVersionError,
    UnknownModelError,
    UnknownWorkerError,
)
from raysync.learner_channel import CHANNEL_MAX_BYTES, COLLECT_WAIT_S, ReceiverChannel
from raysync.learner_direct import all_listed, deliver_directly, write_channel
from raysync.learner_side import LearnerSide, end_learner_side, learner_side
from raysync.messages import BroadcastRequest, HubConfig, Route
from raysync.spec import WeightSpec
from raysync.transports import (
    HubContext,
    TransportError,
    TransportSender,
    VersionDone,
    get_transport,
    known_transports,
    register_transport,
)
from raysync.transports.buckets import bucket_bytes_of
from raysync.transports.parts import part_stream
from raysync.wire_dtype import (
    AsIs,
    cast_to_wire,
    check_finite_on_wire,
    resolve_wire_dtype,
    wire_spec_of,
)

#: Default seconds a broadcast waits for every receiver's ack.
DEFAULT_TIMEOUT_S = 60.0
#: How often a call to a hub Ray is restarting is made again (a learner's route ask,
#: a receiver's registration: :func:`ask_through_restarts`).
_RESTARTING_LOOK_S = 0.1

logger = logging.getLogger(__name__)


class _Broadcast:
    """``hub.broadcast`` — call ``.remote(weights, ...)`` like any Ray actor method."""

    def __init__(self, handle: HubHandle) -> None:
        self._handle = handle

    def remote(
        self,
        weights: weights_mod.Weights,
        *,
        model: str | None = None,
        version: int | None = None,
        workers: Iterable[str] | None = None,
        timeout_s: float | None = None,
        wait: bool = True,
        raise_on_failure: bool = True,
        wire_dtype: torch.dtype | AsIs | None = None,
        part: int | None = None,
        parts: int | None = None,
        bucket_mb: float | None = None,
    ) -> ray.ObjectRef:
        """Broadcast a new version of ``model``; return the ack future.

        Called in the learner process. ``weights`` is an nn.Module, a TensorDict or a
        (nested) state_dict. ``model`` defaults to the only model the hub knows (a
        hub that knows none waits, within the timeout, for the first receiver to
        register one). ``version`` sets the version explicitly (for
        example the training step); it must be above the current one, and it is this
        learner's to choose: the hub does not check it against a number another
        learner of the model delivers itself (:mod:`raysync.direct_routes`), so
        explicit versions and a second learner of the same model do not mix. ``workers``
        restricts the broadcast to those worker ids. ``timeout_s`` bounds the wait for
        acks (default: the hub's). ``wire_dtype`` (default: the hub's, if it has one)
        sends floating tensors in that dtype (``torch.bfloat16``): they are cast here,
        travel at that size, and each receiver casts them into its own tensors (see
        :mod:`raysync.wire_dtype`; zero-copy receivers copy those versions);
        ``wire_dtype=raysync.AS_IS`` sends this version in its own dtypes whatever the
        hub's default (None means that default): an exact sync, or a model with a
        floating tensor narrower than the default (each part of a version sent in
        parts passes its own ``wire_dtype``).
        ``bucket_mb`` (default: the hub's, if it has one): a version that travels larger
        than this many MiB moves in buckets of that size, a few at a time, so neither
        the learner nor the object store holds it whole (each piece is cast to
        ``wire_dtype`` as it is packed); this call then returns once the last bucket
        left, and a receiver that joins afterwards reads the version from a receiver
        that holds it (see :mod:`raysync.transports.object_store.buckets`). Only
        transports that declare ``buckets`` take it (every built-in one does; a
        registered third-party one may not): ``ValueError`` otherwise, naming the
        transport.

        Sharded learners: ``part=rank, parts=world`` (with ``version=step``, which tells
        the hub which parts belong together) sends this learner's slice of the model;
        each learner calls it with its own disjoint keys. Receivers apply the version
        once every part arrived, as one version at one safe point; each part's bytes
        leave its own learner. Every part's ref resolves to the same report; a part
        that does not arrive within ``timeout_s`` of the first, parts that overlap or
        do not add up to the model's spec (the error names the keys), or that give
        different ``timeout_s`` (the version is delivered within it, counted from the
        first part's arrival), fail the version for every part, and nothing of it is
        applied (:mod:`raysync.transports.parts`).

        The returned ObjectRef resolves to a :class:`~raysync.BroadcastReport` when every
        targeted receiver applied the version; if any failed, ``ray.get`` raises
        :class:`~raysync.BroadcastError` (whose ``report`` says who and why) unless
        ``raise_on_failure=False``. With ``wait=False`` it resolves at once to a
        :class:`~raysync.BroadcastTicket` for ``hub.wait_for.remote(ticket)``.

        It returns once the learner's side of the transport has what it needs: the
        learner may change ``weights`` right after (the next training step), while
        receivers are still reading. What it blocks the calling thread on, in order:
        the hand-off list the hub sent with the previous broadcast's result (the first
        broadcast, and one sent before the previous one's result came back, wait one
        hub round trip for it, or for a hub Ray is restarting to be back, at most the
        broadcast's timeout: TimeoutError, nothing sent, from a hub that does not
        answer);
        flattening and checking ``weights``; the transport's send — one copy into the
        object store (``object_store``, ``distributed``, ``rpc``), one into the node's
        shared-memory slot (``shared_memory``), or, with ``nixl`` and ``rdt``, for the
        version read from the buffer it reuses to be acked (two versions in flight
        at most) and then the pack. It never waits for this version's acks: that is
        the returned ref. An async learner calls it in a thread
        (``await asyncio.to_thread(hub.broadcast.remote, w)``) to keep its loop free.

        Raises :class:`~raysync.InvalidWeightsError` here, before anything is sent, for
        weights that are not contiguous tensors with data (or that hold NaN/Inf when
        the hub was started with ``reject_nonfinite=True``, values ``wire_dtype``
        cannot hold then, or floating tensors narrower than ``wire_dtype``);
        ``ValueError`` for a ``wire_dtype`` that is neither a floating dtype nor
        ``raysync.AS_IS``, or a ``timeout_s`` that is not a positive number. A spec
        mismatch, a stale version, an unknown model or an unknown worker raise from
        ``ray.get`` of the result, also before any receiver is touched.
        """
        started = time.perf_counter()
        if version is not None:  # NaN or inf: every receiver took it as held, for good
            version = _whole_number("version", version)
        part, parts = _checked_part(part, parts, version)
        if isinstance(workers, str):  # iterated, it would name a worker per letter
            raise TypeError(
                f"workers is a sequence of worker ids, not a str: workers=[{workers!r}]"
            )
        if workers is not None:  # read more than once below: an iterator only the first
            workers = tuple(workers)
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)
        config = self._handle.config
        tensors = weights_mod.flatten(
            weights, what="broadcast weights", reject_nonfinite=config.reject_nonfinite
        )
        spec = WeightSpec.of(tensors)
        wire_spec = wire_spec_of(spec, resolve_wire_dtype(wire_dtype, config.wire_dtype))
        travels = wire_spec or spec
        bucket_bytes = _bucket_bytes(config.bucket_mb if bucket_mb is None else bucket_mb, travels)
        handle = self._handle
        side = handle._side
        # The last submit the route follows (read before it: the route is as new or newer).
        basis = side.last_results.get(handle._route_key(model), (0, None))[0]
        route = handle._route(model, config.default_timeout_s if timeout_s is None else timeout_s)
        route_key = handle._route_key(model)  # after _route: it may name the model
        # This learner's direct versions, by the model's name (a route that lists no
        # receiver names none).
        direct_key = route.model or route_key or ""
        direct = (
            route.next_version > 0
            and version is None
            and parts == 1
            and bucket_bytes is None
            and route.spec == spec
            and (model is not None or route.sole)  # else the hub says to name one
            and (workers is None or all_listed(workers, route))
        )
        channel = handle._channel(route, travels) if direct else None
        wire = None  # what travels of a whole version: cast once, for every hand-off
        if bucket_bytes is None:
            wire = tensors if wire_spec is None else cast_to_wire(tensors, wire_spec)
        if config.reject_nonfinite and wire_spec is not None:
            check_finite_on_wire(tensors, wire_spec, what="broadcast weights", cast=wire)
        # A version whose transport needs sends submitted in their order holds its
        # model's others off from its send to its submit call. One written into the
        # learner's channel leaves before its object-store copy is made (the receivers
        # apply it meanwhile): numbered from the write on. Other models' broadcasts go
        # on meanwhile, unless this one left its model out before a route named it: it
        # may be of any model (``LearnerSide.sending_in_order``).
        in_send_order = wire is not None and any(
            get_transport(name).submits_in_send_order for name in route.hand_offs
        )
        in_order = side.sending_in_order(route_key)
        with in_order if in_send_order or channel is not None else contextlib.nullcontext():
            written, direct_version, above = None, 0, None
            if channel is not None:
                with side.submitting:
                    if _stale(side, route_key, basis):
                        channel = None
                    else:
                        above = _above(side, direct_key)
                        direct_version = handle._next_direct_version(route)
                        if not direct_version:
                            channel = None
            if channel is not None:
                assert wire is not None  # direct: a whole version, not buckets
                written = write_channel(
                    channel,
                    route,
                    direct_version,
                    spec,
                    wire_spec,
                    wire,
                    workers,
                    handle._learner_node(),
                    side.submitter,
                    config.default_timeout_s if timeout_s is None else timeout_s,
                )
            named = route.model if model is None else model
            senders, payloads = self._hand_off(
                route,
                named if parts == 1 else part_stream(named, part, parts),
                tensors,
                wire,
                travels,
                bucket_bytes,
                bucket_mb,
                timeout_s,
            )
            try:
                request = BroadcastRequest(
                    model=route.model if direct else model,
                    version=version,
                    spec=spec,
                    payloads=payloads,
                    workers=None if workers is None else tuple(workers),
                    timeout_s=timeout_s,
                    wait=wait,
                    raise_on_failure=raise_on_failure,
                    learner_seconds=time.perf_counter() - started,
                    wire_spec=wire_spec,
                    submitter=side.submitter,
                    part=part,
                    parts=parts,
                    bucket_bytes=bucket_bytes,
                )
                # Numbers in the order the calls leave this process, after the versions
                # of its model numbered or sent in order before it.
                with in_order, side.submitting:
                    sent_at = time.time()
                    calls: dict[str, tuple[str, Any]] | None = None
                    if above is None:  # read under the lock: another thread's direct one
                        above = _above(side, direct_key)
                    if direct and written is None and _stale(side, route_key, basis):
                        direct = False  # the hub numbers it: its route's number may be taken
                    if direct and not direct_version:
                        direct_version = handle._next_direct_version(route)
                        direct = direct_version > 0  # else the hub numbers it, above
                    if direct:
                        calls = {}
                        if written is not None:
                            assert channel is not None  # written: into the channel
                            calls = channel.collect(written, COLLECT_WAIT_S)
                        called = deliver_directly(
                            route,
                            direct_version,
                            spec,
                            payloads,
                            wire_spec,
                            workers,
                            side.submitter,
                            handle._learner_node(),
                            reached=calls,
                            running=side.direct_calls.running(route.model),
                        )
                        side.direct_calls.add(route.model, called)
                        calls |= called
                    request = dataclasses.replace(
                        request,
                        above=above,
                        direct_version=direct_version,
                        direct_calls=calls,
                        sent_at=sent_at,
                        known=handle._known_receivers(route_key),
                    )

                    def send(sequence: int, floor: int) -> ray.ObjectRef:
                        numbered = dataclasses.replace(request, sequence=sequence, floor=floor)
                        return handle.actor.submit.remote(numbered)

                    sequence, result = side.submit(send)
                    side.last_results[route_key] = (sequence, result)
            except BaseException as err:
                _abandon(senders, payloads, f"the broadcast failed before it left: {err!r}")
                raise
        done = _BroadcastDone(handle.actor, result, waits=wait)
        names = list(senders)
        for at, name in enumerate(names):
            try:
                senders[name].submitted(payloads[name], done)
            except BaseException as err:
                # The later hand-offs will not be written: their readers hear so now.
                later = {n: senders[n] for n in names[at + 1 :]}
                _abandon(later, payloads, f"hand-off {name!r} failed writing it: {err!r}")
                raise
        return result

    def _hand_off(
        self,
        route: Route,
        model: str,
        tensors: dict[str, torch.Tensor],
        wire: dict[str, torch.Tensor] | None,
        travels: WeightSpec,
        bucket_bytes: int | None,
        bucket_mb: float | None,
        timeout_s: float | None,
    ) -> tuple[dict[str, TransportSender], dict[str, Any]]:
        """Hand the version to the hub's transport and those its receivers chose, in
        this process: the senders and their payloads, one per hand-off. ``model``: the
        model id (the hub's only one if none was named), or the stream of this
        learner's part of it (:func:`~raysync.transports.parts.part_stream`), as the
        hub's planners know it (a shared-memory slot names it for its owner).
        ``wire``: a whole version's tensors as they travel; buckets are cast as they
        are packed. ``bucket_mb``: the broadcast's own, None if it took the hub's."""
        handle = self._handle
        try:
            senders = {name: handle._sender(name) for name in route.hand_offs}
            config = handle.config
            stall_s = (config.default_timeout_s if timeout_s is None else timeout_s) / 2

            def send(sender: TransportSender) -> Any:
                if wire is not None:
                    return sender.send(wire, travels, model)
                assert bucket_bytes is not None  # no whole version: a bucketed one
                return sender.send_buckets(tensors, travels, bucket_bytes, stall_s)

            if wire is None:
                _check_bucketed(senders, bucket_mb, config.bucket_mb)
            payloads: dict[str, Any] = {}
            for name, sender in senders.items():
                try:
                    payloads[name] = send(sender)
                except BaseException as err:
                    _abandon(senders, payloads, f"hand-off {name!r} failed: {err!r}")
                    raise
            return senders, payloads
        except TransportError as err:
            # A closed hub has stopped its transport: say that, not what broke below it,
            # and let go of what this process holds for it (telling that hub nothing).
            if HubContext(handle.actor, handle.config.hub_id).stopped():
                end_learner_side(handle.config.hub_id, tell_hub=False)
                raise HubClosedError(
                    "the hub is shutting down or dead and accepts no more broadcasts"
                ) from err
            raise


def _stale(side: LearnerSide, key: str | None, basis: int) -> bool:
    """(``side.submitting`` held.) Whether a broadcast of route key ``key`` left this
    process since the route of the one calling was read (after submit ``basis``): that
    route's next version may be the very number the hub gave it (one sent through the
    hub from another thread), and a direct delivery of it would be taken as held by
    every receiver it reached first."""
    return side.last_results.get(key, (0, None))[0] != basis


def _above(side: LearnerSide, direct_key: str) -> int:
    """The highest version this learner delivered itself of the model ``direct_key``
    names: one the hub may not have booked (it restarted since), which the broadcast's
    number must be above. An unnamed broadcast whose route names no model (a hub that
    restarted knows no receiver yet) does not know which model it is: the highest of
    any (the hub takes one left unnamed only while it holds one model); looked up under
    "" it was none, and the hub numbered the version again as one the receivers held."""
    if direct_key:
        return side.last_direct.get(direct_key, 0)
    return max(side.last_direct.values(), default=0)


def _abandon(senders: dict[str, TransportSender], payloads: dict[str, Any], why: str) -> None:
    """Tell each of ``senders`` that made a payload that it will not be submitted
    (``TransportSender.abandoned``); a failure to is logged, ``why`` is what failed."""
    for name, sender in senders.items():
        if name in payloads:
            try:
                sender.abandoned(payloads[name], why)
            except Exception:
                logger.exception("hand-off %r could not let go of an abandoned version", name)


def _route_in(result: ray.ObjectRef) -> Route | None:
    """The next broadcast's route in a broadcast's result, if that came back with one:
    None while it is out (the learner broadcasts again without waiting) or if it
    raised (failed receivers, a refused spec, a closed hub: the learner asks)."""
    ready, _ = ray.wait([result], timeout=0, fetch_local=False)
    if not ready:
        return None
    try:
        outcome = ray.get(result)
    except ray.exceptions.RayError:
        return None
    return getattr(outcome, "route", None)


def check_seconds(name: str, value: object) -> None:
    """ValueError naming argument ``name`` unless ``value`` is a positive, finite number
    of seconds (a zero heartbeat or timeout would spin)."""
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _bucket_bytes(bucket_mb: float | None, travels: WeightSpec) -> int | None:
    """The bucket size of a version that travels as ``travels``: None (whole) without
    ``bucket_mb`` or when it fits in one bucket. ValueError for a size that is no
    positive number."""
    if bucket_mb is None:
        return None
    size = bucket_bytes_of(bucket_mb)
    return size if travels.nbytes > size else None


def _check_bucketed(
    senders: dict[str, TransportSender], bucket_mb: float | None, hub_bucket_mb: float | None
) -> None:
    """ValueError, before anything is sent, if a hand-off moves whole versions only.
    ``bucket_mb``: the broadcast's, None if it took ``hub_bucket_mb``, the hub's default."""
    whole = sorted(name for name in senders if not get_transport(name).buckets)
    if whole:
        able = [n for n in known_transports() if get_transport(n).buckets]
        raise ValueError(
            f"bucket_mb: transport {', '.join(map(repr, whole))} moves whole versions only "
            f"(transports that move buckets: {', '.join(able)}); "
            + _whole_versions_advice(bucket_mb, hub_bucket_mb)
        )


def _whole_versions_advice(bucket_mb: float | None, hub_bucket_mb: float | None) -> str:
    """How a version refused for a hand-off that moves whole versions only can go: a
    broadcast without ``bucket_mb`` takes the hub's default, ``hub_bucket_mb``, if the
    hub has one; one whose ``bucket_mb`` is above the version's size sends it whole."""
    if hub_bucket_mb is None:
        return "broadcast without bucket_mb, or have its receivers use one of those"
    source = (
        "the hub's default"
        if bucket_mb is None
        else f"this broadcast's bucket_mb={bucket_mb:g}, and without it the hub's default"
    )
    return (
        f"the bucket size is {source}, bucket_mb={hub_bucket_mb:g} (WeightHub.remote), "
        "unless a broadcast passes a bucket_mb above the version's size (it then goes "
        "whole): have its receivers use one of those, or start the hub without bucket_mb"
    )


def _checked_part(part: int | None, parts: int | None, version: int | None) -> tuple[int, int]:
    """``(part, parts)`` of a broadcast, ``(0, 1)`` for a whole model; ValueError for
    an inconsistent pair or parts without an explicit version."""
    if part is None and parts is None:
        return 0, 1
    if part is None or parts is None:
        raise ValueError(
            "part and parts go together: part=rank, parts=world (got "
            f"part={part!r}, parts={parts!r})"
        )
    part, parts = _whole_number("part", part), _whole_number("parts", parts)
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(
            f"part must be in [0, parts) and parts >= 1; got part={part}, parts={parts}"
        )
    if parts > 1 and version is None:
        raise ValueError(
            "a version sent in parts needs version=... (the training step): it is how the "
            "hub tells which parts belong together"
        )
    return part, parts


def _whole_number(name: str, value: object) -> int:
    """``value`` as an int (a NumPy or torch integer too); ValueError, naming ``name``,
    for anything else (a float, a bool)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


class _BroadcastDone(VersionDone):
    """A broadcast's end for the learner's senders: its report resolving (or raising),
    or with ``wait=False`` the hub's ``wait_for`` of the ticket it resolved to (asked
    for once, by whichever of ``wait`` and ``ended`` needs it first)."""

    def __init__(self, actor: ActorHandle, result: ray.ObjectRef, *, waits: bool) -> None:
        self._actor: Any = actor  #: Any: Ray's stubs type an ActorHandle's methods as Never
        self._result = result
        self._waits = waits
        self._report: ray.ObjectRef | None = result if waits else None
        self._lock = threading.Lock()

    def _report_ref(self, timeout_s: float) -> ray.ObjectRef:
        """The ref that resolves with the report; GetTimeoutError while there is no ticket
        (waited for outside the lock: ``ended`` asks without waiting meanwhile)."""
        report = self._report
        if report is not None:
            return report
        ticket = ray.get(self._result, timeout=timeout_s)
        with self._lock:
            if self._report is None:
                self._report = self._actor.wait_for.remote(ticket, raise_on_failure=False)
            return self._report

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            report = self._report_ref(timeout_s)
            ray.get(report, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"the broadcast did not end within {timeout_s:g} s") from err
        except ray.exceptions.RayError:
            pass  # it ended in an error (failed receivers, a refused spec): ended

    def ended(self) -> bool:
        """Whether the broadcast has ended, without waiting or fetching its report."""
        try:
            if self._report is None:
                ready, _ = ray.wait([self._result], timeout=0, fetch_local=False)
                if not ready:
                    return False
            report = self._report_ref(0)
        except ray.exceptions.GetTimeoutError:
            return False  # the ticket is on the hub's node, not yet here
        except ray.exceptions.RayError:
            return True  # the submit failed: nothing is read any more
        ready, _ = ray.wait([report], timeout=0, fetch_local=False)
        return bool(ready)

    #: What the hub's ``submit`` raises before it publishes the version (each is checked,
    #: or the version assembled, first): the version never became the model's latest.
    #: Not BroadcastError (published; some receivers failed), nor anything else (an actor
    #: that died, a cancelled call, an unforeseen error: whether it was published is
    #: not known, and a sender must then keep it readable as if it were the latest).
    _REFUSALS = (
        SpecMismatchError,
        StaleVersionError,
        UnknownModelError,
        UnknownWorkerError,
        HubClosedError,
        HubSnapshotError,
        IncompleteVersionError,
    )

    def refused(self) -> bool:
        """Whether the hub refused the version before publishing it (its submit raised
        one of ``_REFUSALS``, which Ray re-raises as that class), without waiting: asked
        by a sender in the learner process as it picks the memory of its next version.
        Only the submit's own result tells: with ``wait=False`` its ticket means the
        version was published, whatever ``wait_for`` says after."""
        try:
            ready, _ = ray.wait([self._result], timeout=0, fetch_local=False)
            if not ready:
                return False
            ray.get(self._result, timeout=0)
        except self._REFUSALS:
            return True
        except Exception:  # published, or not known (not here yet, the hub died)
            return False
        return False


def ask_through_restarts(ask: Callable[[], ray.ObjectRef], timeout_s: float) -> Any:
    """``ray.get(ask())`` (a call to the hub actor), made again every
    ``_RESTARTING_LOOK_S`` while Ray restarts the hub: a call that reached an
    incarnation that died, or went out before the new one was up, fails with
    ``ActorUnavailableError``, and no Ray call waits for a restart. Within ``timeout_s``
    in all: Ray's ``GetTimeoutError`` if the hub did not answer, its
    ``ActorUnavailableError`` if it was still restarting then. Callable from any
    process that holds the hub's handle (a learner, a receiver registering)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(ask(), timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() + _RESTARTING_LOOK_S > deadline:
                raise
            time.sleep(_RESTARTING_LOOK_S)


class HubHandle:
    """A picklable handle on a hub actor: the learner's side of the hub.

    ``broadcast`` does the learner-side work (flatten, check, hand the data to the
    transport in this process) and then calls the hub; the hub's other methods are
    its actor methods, called the Ray way: ``hub.status.remote()``,
    ``hub.wait_for.remote(ticket)``, ``hub.latest.remote(model)``,
    ``hub.transports.remote()``, ``hub.close.remote()`` (shut the hub down). Anything
    else is on ``hub.actor``. :meth:`release` frees what this process's learner side
    holds (NIXL registrations, shared-memory mappings). Pass a HubHandle (or the hub's
    name) to receivers' ``connect_hub``.
    """

    def __init__(self, actor: ActorHandle, config: HubConfig) -> None:
        #: The hub actor. Any: Ray's stubs type an ActorHandle's methods as Never.
        self.actor: Any = actor
        self.config = config
        # A receiver gets its handle by unpickling it: this is where a third-party
        # transport the hub uses becomes known in that process.
        for name, target in config.transports:
            register_transport(name, target)

    # -- the hub actor's own methods --------------------------------------------------
    @property
    def status(self) -> Any:
        """``hub.status.remote()`` -> :class:`~raysync.HubStatus`: versions, receivers, lags."""
        return self.actor.status

    @property
    def wait_for(self) -> Any:
        """``hub.wait_for.remote(ticket, raise_on_failure=True)`` -> the report of a
        ``wait=False`` broadcast, once complete."""
        return self.actor.wait_for

    @property
    def latest(self) -> Any:
        """``hub.latest.remote(model, have_version=0)`` -> the latest Update, or None."""
        return self.actor.latest

    @property
    def transports(self) -> Any:
        """``hub.transports.remote()`` -> the hand-offs a broadcast carries now."""
        return self.actor.transports

    @property
    def drop_if_dead(self) -> Any:
        """``hub.drop_if_dead.remote(workers)`` -> the worker ids of ``workers`` dropped
        because their actor died (ended by the caller: the next broadcast would fail
        them first)."""
        return self.actor.drop_if_dead

    @property
    def close(self) -> Any:
        """``hub.close.remote()``: refuse new broadcasts, wait for those in flight, stop
        the transports' resource actors."""
        return self.actor.close

    def release(self) -> None:
        """Free what this learner process holds for this hub (transport senders: NIXL
        registrations, shared-memory mappings). A later broadcast opens them again.
        Call it once this learner's broadcasts are acked: with ``nixl`` and ``rdt`` the
        latest version is read from the learner's buffers, so a receiver that joins
        after the release starts on the next broadcast instead. A hub that closed or
        died has its side let go without it once this process begins a side on another
        hub, or a transport's hand-off finds it closed (:mod:`raysync.learner_side`)."""
        end_learner_side(self.config.hub_id)

    @property
    def transport(self) -> str:
        return self.config.transport

    @property
    def broadcast(self) -> _Broadcast:
        return _Broadcast(self)

    @property
    def _side(self) -> LearnerSide:
        """What this process keeps for the hub as a learner, shared by every handle on
        it here (:mod:`raysync.learner_side`)."""
        return learner_side(self.config.hub_id, self.actor)

    def _route(self, model: str | None, timeout_s: float) -> Route:
        """This broadcast's :class:`~raysync.messages.Route`: the hand-offs it carries
        and, for the direct path, the model's next version and the receivers to call. It
        comes with the result of the previous broadcast of ``model`` (the hub makes it
        when it answers that broadcast: no round trip of its own); a broadcast whose
        previous one is still out (or failed, or the first) asks the hub for it. A
        receiver that registered since gets this version from the hub (by a new
        transport: the next version). TimeoutError if the hub, asked, does not answer
        within ``timeout_s``."""
        key = self._route_key(model)
        sequence, last = self._side.last_results.get(key, (0, None))
        route = _route_in(last) if last is not None else None
        if route is None:
            route = self._answer(
                lambda: self._ask_route(model, sequence, self._known_receivers(key)), timeout_s
            )
        if model is None and route.model:
            with self._side.submitting:
                self._side.unnamed_model = key = route.model
        filled = self._with_handles(key, route)
        if filled is None:  # left out a handle this process let go of: ask with every one
            filled = self._with_handles(
                key, self._answer(lambda: self._ask_route(model, sequence), timeout_s)
            )
        assert filled is not None  # a route with every handle needs none from here
        return filled

    def _route_key(self, model: str | None) -> str | None:
        """What this process keeps routes and receivers' handles under for broadcasts
        of ``model``: the model, the one a route named for broadcasts leaving it out
        (one model named and left out are one model: one route, one count), else None."""
        return self._side.unnamed_model if model is None else model

    def _known_receivers(self, key: str | None) -> frozenset[str]:
        """The registrations of the receivers kept under route key ``key`` whose handles
        this process holds."""
        with self._side.submitting:
            return frozenset(self._side.handles.get(key, ()))

    def _with_handles(self, key: str | None, route: Route) -> Route | None:
        """``route`` with each receiver's actor handle (the hub leaves out those this
        process holds); None if it left out one this process does not hold. Keeps the
        handles of ``route``'s receivers only: a registration it does not list is gone."""
        with self._side.submitting:
            held = self._side.handles.get(key, {})
            targets = []
            for target in route.targets:
                if target.handle is None:
                    handle = held.get(target.token)
                    if handle is None:
                        return None
                    target = dataclasses.replace(target, handle=handle)
                targets.append(target)
            self._side.handles[key] = {t.token: t.handle for t in targets}
        return dataclasses.replace(route, targets=tuple(targets)) if targets else route

    def _next_direct_version(self, route: Route) -> int:
        """The version to deliver a direct broadcast as: the route's next one, handed
        to this learner only; 0 if it is not above this learner's last direct one (the
        route was made before the hub booked that, or by a hub that restarted since):
        then the broadcast goes through the hub, which numbers it above that one (a
        number above the route's may be another learner's). Called under
        ``_submitting``."""
        if route.next_version <= self._side.last_direct.get(route.model, 0):
            return 0
        self._side.last_direct[route.model] = route.next_version
        return route.next_version

    def wait_channel(self, model: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, ...]:
        """With ``channels=True``: wait until this learner's channel to ``model``'s
        receivers is built (a broadcast that finds a new set of receivers asks for it;
        the broadcasts after it use it) and idle (the replies of the last version
        written into it are in: until then a broadcast takes the plain path); the
        workers it reaches, none if it has no channel (another learner's holds one of
        them, or none is eligible)."""
        channel = self._side.channels.get(model)
        return () if channel is None else channel.wait_ready(timeout_s)

    def _learner_node(self) -> str:
        """The node this learner process runs on (asked of Ray once)."""
        side = self._side
        if not side.node_id:
            side.node_id = ray.get_runtime_context().get_node_id()
        return side.node_id

    def _channel(self, route: Route, travels: WeightSpec) -> ReceiverChannel | None:
        """The channel to ``route``'s model's receivers, for a version that travels as
        ``travels``: None unless the hub was started with ``channels=True`` and the
        version is small enough."""
        if not self.config.channels or travels.nbytes > CHANNEL_MAX_BYTES:
            return None
        with self._side.submitting:
            channel = self._side.channels.get(route.model)
            if channel is None:
                channel = self._side.channels[route.model] = ReceiverChannel(
                    self.actor, self._side.submitter, route.model
                )
            return channel

    def _ask_route(
        self, model: str | None, after: int, known: frozenset[str] = frozenset()
    ) -> ray.ObjectRef:
        """Ask the hub for ``model``'s route after this handle's broadcast numbered
        ``after`` (the hub answers once it has versioned that one, so the route's next
        version is above it, even an explicit one), leaving out the ``known`` handles."""
        return self.actor.route.remote(model, self._side.submitter, after, known)

    def _answer(self, ask: Callable[[], ray.ObjectRef], timeout_s: float) -> Route:
        """The route the hub answers ``ask()`` with, asked again while Ray restarts the
        hub (a broadcast made then waits for the new incarnation instead of raising
        Ray's ``ActorUnavailableError`` before anything is sent). TimeoutError after
        ``timeout_s``: a hub alive but hung (or busy, or restarting, that long) must not
        hang the learner's broadcast."""
        try:
            return ask_through_restarts(ask, timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(
                f"hub {self.config.hub_id} did not answer within {timeout_s:g} s which "
                "hand-offs this broadcast takes (it is alive, but busy or hung); "
                "nothing was sent"
            ) from err
        except ray.exceptions.ActorUnavailableError as err:
            raise TimeoutError(
                f"hub {self.config.hub_id} was still restarting after "
                f"{timeout_s:g} s (Ray: {err}); nothing was sent"
            ) from err

    def _sender(self, hand_off: str) -> TransportSender:
        """The learner half of transport ``hand_off``: this process's, shared by every
        handle on this hub here (:mod:`raysync.learner_side`)."""

        def open_sender() -> TransportSender:
            chosen = get_transport(hand_off)
            return chosen.open_sender(self.config.context(self.actor, chosen))

        return self._side.sender(hand_off, open_sender)

    def __reduce__(self):
        return (HubHandle, (self.actor, self.config))

    def __repr__(self) -> str:
        return f"HubHandle({self.config.hub_id}, transport={self.transport!r})"
