"""The hub's bookkeeping: models, specs, versions, receivers. Plain Python, no Ray calls.

Owned by the hub actor (``actors/hub.py``) and only touched from its event loop, so
each method runs without interruption: version assignment and registration are
totally ordered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from raysync.errors import StaleVersionError, UnknownModelError, UnknownWorkerError
from raysync.messages import (
    DeliveryMode,
    ReceiverStatus,
    ReceiverTimings,
    Registration,
)
from raysync.routing import HandedOver
from raysync.spec import WeightSpec
from raysync.transports.base import ReceiverInfo
from raysync.transports.parts import payloads_in

#: The model id used when a receiver passes a single model path.
DEFAULT_MODEL = "default"


#: Publication times kept per model, for receivers' lag in seconds.
_PUBLISHED_KEPT = 1024

#: A pull receiver whose hub watch was not heard from for this many of its heartbeats
#: is asked about: the hub forgets it if Ray says its actor died.
LEASE_BEATS = 6


@dataclass
class ModelState:
    spec: WeightSpec | None = None
    version: int = 0
    latest: HandedOver | None = None  #: the latest version, as the learner handed it over
    #: The number of the latest version if it failed at every receiver it went to (0:
    #: not so): while no receiver holds it, an explicit version may take it again (its
    #: learners send it again, as after a version in parts that never started).
    failed_everywhere: int = 0
    #: (version, time.time() it was published) of the last ``_PUBLISHED_KEPT`` versions
    published: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=_PUBLISHED_KEPT)
    )
    #: The version this hub's record of publications starts after: the one it restored
    #: after a restart, or one a receiver brought that it never published
    record_from: int = 0
    #: How many versions it published dropped out of the record (the oldest first),
    #: and the newest of them
    dropped: int = 0
    dropped_to: int = 0

    def versions_behind(self, held: int) -> int:
        """How many versions newer than ``held`` were published: counted in the record
        (versions may be numbered with gaps: training steps), at most as many as it
        published and dropped from the record below it, and by number before that.
        Walks back from the newest (versions are kept in the order they went up): a
        receiver ``k`` versions behind costs ``k`` steps, not the whole history."""
        behind = 0
        for version, _ in reversed(self.published):
            if version <= held:
                return behind
            behind += 1
        unrecorded = max(0, self._unrecorded_below() - held)
        if self.dropped:  # numbered with gaps, a version each: not one per number
            unrecorded = min(unrecorded, self.dropped + max(0, self.record_from - held))
        return behind + unrecorded

    def note_published(self, version: int, at: float) -> None:
        """Add ``version``, published at ``at``, to the record (the oldest may drop out);
        a version published again (sent again after it failed everywhere) replaces its
        first publication: one version, counted once in a receiver's lag."""
        if self.published and self.published[-1][0] == version:
            self.published.pop()
        if len(self.published) == self.published.maxlen:
            self.dropped += 1
            self.dropped_to = self.published[0][0]
        self.published.append((version, at))

    def restart_record(self, after: int) -> None:
        """The record starts after version ``after``, which it never held."""
        self.record_from = after
        self.published.clear()
        self.dropped = self.dropped_to = 0

    def behind_since(self, held: int) -> float | None:
        """When the first version newer than ``held`` was published; None if that one
        is not in the record (published before a restart, or before the oldest kept),
        or if ``held`` is the newest."""
        since = None
        for version, at in reversed(self.published):
            if version <= held:
                return since
            since = at
        return since if held >= self._unrecorded_below() else None

    def _unrecorded_below(self) -> int:
        """The newest version published that the record does not hold (0: none)."""
        return self.dropped_to if self.dropped else self.record_from


class Lag(NamedTuple):
    """How far one receiver is behind the latest version of one model."""

    versions: int  #: versions published that it lacks
    #: seconds since the first of them was published (0.0: up to date); None when not
    #: known: that version came before the hub restarted
    seconds: float | None


@dataclass
class ReceiverEntry:
    registration: Registration
    versions: dict[str, int] = field(default_factory=dict)
    #: per model, where the time of the last version it applied went
    timings: dict[str, ReceiverTimings] = field(default_factory=dict)
    #: ``time.monotonic()`` when it registered or its last heartbeat came
    heard: float = field(default_factory=time.monotonic)
    #: Its last delivery timed out and it has acked no version since
    #: (:attr:`ReceiverInfo.behind`).
    behind: bool = False

    def lapsed(self, now: float) -> bool:
        """Whether this is a watched pull receiver not heard from for ``LEASE_BEATS``
        heartbeats at ``now``: nobody calls a pull receiver, so nothing else would tell
        the hub its process died. A push receiver's death shows in the hub's calls."""
        beat = self.registration.heartbeat_s
        return (
            self.registration.mode is DeliveryMode.PULL
            and beat is not None
            and now - self.heard > LEASE_BEATS * beat
        )

    @property
    def worker(self) -> str:
        return self.registration.worker

    @property
    def transport(self) -> str:
        """The transport this receiver reads by (resolved at registration)."""
        transport = self.registration.transport
        if transport is None:  # the hub fills it in before the entry exists
            raise ValueError(f"receiver {self.worker} was registered without a transport")
        return transport

    @property
    def info(self) -> ReceiverInfo:
        r = self.registration
        return ReceiverInfo(
            worker=r.worker,
            actor=r.actor,
            node_id=r.node_id,
            process=r.process,
            pid=r.pid,
            handle=r.handle,
            kept=payloads_in(r.kept),
            attachment=r.attachment,
            entry=r.entry,
            behind=self.behind,
        )


class HubState:
    def __init__(self) -> None:
        self.models: dict[str, ModelState] = {}
        self.receivers: dict[str, ReceiverEntry] = {}
        #: The models the hub was started with (``models=[...]``): known for its life.
        self._declared: set[str] = set()

    # -- models ------------------------------------------------------------------------
    def declare(self, model: str) -> None:
        """Know ``model`` before any receiver registers it (its spec comes with the
        first broadcast or registration), for the hub's life."""
        self._declared.add(model)
        self.models.setdefault(model, ModelState())

    def check_known(self, model: str) -> None:
        """Raise UnknownModelError unless a receiver registered ``model`` (and holds it
        still, if it was never numbered: see :meth:`drop`), it was declared, or it was
        broadcast before."""
        if model not in self.models:
            raise UnknownModelError(
                f"unknown model {model!r}: no receiver registered it and the hub was not "
                f"started with it in models=[...]; the hub knows: "
                f"{', '.join(sorted(self.models)) or 'none'}"
            )

    def resolve_model(self, model: str | None) -> str:
        """The model a broadcast is for: ``model`` itself, or the only one the hub knows."""
        if model is not None:
            return model
        if not self.models:
            return DEFAULT_MODEL
        if len(self.models) == 1:
            return next(iter(self.models))
        raise UnknownModelError(
            f"the hub holds several models ({', '.join(sorted(self.models))}); "
            "pass model=... to broadcast"
        )

    def check_broadcast(self, model: str, spec: WeightSpec) -> WeightSpec:
        """Raise SpecMismatchError if ``spec`` disagrees with what the hub knows for
        ``model``; else the spec to keep: the known one (its digest already computed,
        a 1000-tensor spec hashes in ~1 ms), or ``spec`` for a model without one."""
        known = self.models.get(model)
        if known is None or known.spec is None:
            return spec
        known.spec.check_matches(
            spec, expected=f"the hub's spec of model {model!r}", got="the broadcast"
        )
        return known.spec

    def version_of(self, model: str) -> int:
        """``model``'s latest version (0: none yet)."""
        return self.models[model].version if model in self.models else 0

    def check_version(self, model: str, version: int | None) -> None:
        """Raise StaleVersionError unless ``version`` is None or above the current one;
        ValueError for one that is not an int (NaN or inf was taken: every receiver
        answered it as held, and every version after it was numbered NaN, or inf)."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(
                f"version must be an int, got {version!r} ({type(version).__name__})"
            )
        current = self.version_of(model)
        if version is not None and version <= current:
            known = self.models.get(model)
            sent_again = known is not None and known.failed_everywhere == version == current
            if sent_again and not self._held(model, version):
                return  # no receiver holds it
            raise StaleVersionError(
                f"version {version} of model {model!r} is not above the current version "
                f"{current}; versions only go up"
            )

    def publish(
        self,
        model: str,
        spec: WeightSpec,
        payloads: Mapping[str, object],
        version: int | None = None,
        at: float | None = None,
        wire_spec: WeightSpec | None = None,
        origin: str = "",
    ) -> HandedOver:
        """Make this the latest version of ``model``: ``version``, or the next one,
        published ``at`` (``time.time()``; default now). ``payloads`` holds one payload
        per hand-off, carrying ``wire_spec`` if given (a wire dtype), else ``spec``;
        ``origin`` names the learner handle that broadcast it."""
        self.check_version(model, version)
        state = self.models.setdefault(model, ModelState())
        state.spec = spec
        state.version = state.version + 1 if version is None else version
        state.failed_everywhere = 0
        state.latest = HandedOver(
            model, state.version, spec.digest, dict(payloads), wire_spec, origin
        )
        state.note_published(state.version, time.time() if at is None else at)
        return state.latest

    def failed_everywhere(self, model: str, version: int) -> None:
        """Version ``version`` of ``model`` failed at every receiver it went to, and none
        acked it: if it is still the latest, its number may be sent again while no
        receiver holds it (:meth:`check_version`)."""
        state = self.models.get(model)
        if state is not None and state.version == version:
            state.failed_everywhere = version

    def _held(self, model: str, version: int) -> bool:
        """Whether a registered receiver holds ``version`` of ``model`` or a newer one
        (acked it, or brought it when it registered)."""
        return any(entry.versions.get(model, 0) >= version for entry in self.receivers.values())

    def holds_any(self, payloads: Mapping[str, object]) -> bool:
        """Whether one of ``payloads`` is in a model's latest version (published: late
        joiners may read it)."""
        return any(
            state.latest is not None
            and any(state.latest.payloads.get(name) is p for name, p in payloads.items())
            for state in self.models.values()
        )

    def spec(self, model: str) -> WeightSpec:
        """The spec of ``model``, known once a receiver registered it or it was broadcast."""
        spec = self.models[model].spec
        if spec is None:
            raise UnknownModelError(
                f"model {model!r} has no spec yet: no receiver registered it and it was "
                "never broadcast"
            )
        return spec

    def latest(self, model: str) -> HandedOver | None:
        if model not in self.models:
            raise UnknownModelError(
                f"unknown model {model!r}; the hub knows: "
                f"{', '.join(sorted(self.models)) or 'none'}"
            )
        return self.models[model].latest

    # -- receivers -----------------------------------------------------------------------
    def register(self, registration: Registration) -> dict[str, HandedOver]:
        """Add (or replace) a receiver; return the latest updates it does not hold yet.

        Raises SpecMismatchError, naming the actor, if one of its models disagrees with
        the hub's spec; the registry is unchanged then.
        """
        for model, spec in registration.specs.items():
            known = self.models.get(model)
            if known is not None and known.spec is not None:
                known.spec.check_matches(
                    spec,
                    expected=f"the hub's spec of model {model!r}",
                    got=f"receiver {registration.worker} ({registration.actor}) model {model!r}",
                )
        for model, spec in registration.specs.items():
            state = self.models.setdefault(model, ModelState())
            if state.spec is None:
                state.spec = spec
            # A receiver may hold a version this hub never saw (the hub restarted and
            # lost its counters): the next broadcast must still go above it.
            brought = registration.versions.get(model, 0)
            if brought > state.version:
                # The record starts after it: the versions between the newest published
                # and it went by unseen, so a receiver below it lags by number, with no
                # known time (the times published before are no receiver's lag since).
                state.version = brought
                state.restart_record(after=brought)
        self.receivers[registration.worker] = ReceiverEntry(
            registration, dict(registration.versions)
        )
        return {
            model: latest
            for model in registration.specs
            if (latest := self.models[model].latest) is not None
            and lacks(
                registration.versions.get(model, 0), registration.origins.get(model, ""), latest
            )
        }

    def knows(self, worker: str, token: str) -> bool:
        entry = self.receivers.get(worker)
        return entry is not None and entry.registration.token == token

    def heartbeat(self, worker: str, token: str, now: float | None = None) -> bool:
        """A receiver's hub watch checking in: whether the hub knows this registration
        (False: register again); renews its lease (see :meth:`lapsed`)."""
        entry = self.receivers.get(worker)
        if entry is None or entry.registration.token != token:
            return False
        entry.heard = time.monotonic() if now is None else now
        return True

    def lapsed(self, now: float | None = None) -> list[tuple[str, str]]:
        """(worker, token) of each pull receiver whose heartbeats stopped, at ``now``
        (``time.monotonic()`` by default)."""
        now = time.monotonic() if now is None else now
        return [
            (worker, entry.registration.token)
            for worker, entry in self.receivers.items()
            if entry.lapsed(now)
        ]

    def shortest_heartbeat(self) -> float | None:
        """The shortest heartbeat of the watched pull receivers; None if there are none."""
        beats = [
            entry.registration.heartbeat_s
            for entry in self.receivers.values()
            if entry.registration.mode is DeliveryMode.PULL
            and entry.registration.heartbeat_s is not None
        ]
        return min(beats, default=None)

    def versions(self) -> dict[str, int]:
        """Each model's latest version (with :meth:`specs`, what survives a hub restart)."""
        return {model: state.version for model, state in self.models.items()}

    def specs(self) -> dict[str, WeightSpec]:
        return {m: state.spec for m, state in self.models.items() if state.spec is not None}

    def restore(self, versions: dict[str, int], specs: dict[str, WeightSpec]) -> None:
        for model, version in versions.items():
            self.models[model] = ModelState(
                spec=specs.get(model), version=version, record_from=version
            )

    def drop(self, worker: str, token: str) -> bool:
        """Forget ``worker`` if its current registration is ``token``; True if dropped."""
        entry = self.receivers.get(worker)
        if entry is None or entry.registration.token != token:
            return False
        del self.receivers[worker]
        return True

    def forget_unclaimed(self, models: Iterable[str], kept: Collection[str] = ()) -> None:
        """After a receiver that registered ``models`` left: forget each of them that no
        receiver registers now and that was never numbered (no version published,
        restored or brought: a late joiner loses nothing), but those in ``kept`` (a
        version of each is being assembled); a declared one stays known, without its
        spec. Kept, a model id that a receiver mistyped would make every broadcast
        naming no model ambiguous, and a mis-shaped model's spec would refuse the right
        one, for the hub's life."""
        for model in models:
            if model in kept:
                continue
            state = self.models.get(model)
            if state is None or state.version > 0 or self._registered(model):
                continue
            if model in self._declared:
                state.spec = None
            else:
                del self.models[model]

    def _registered(self, model: str) -> bool:
        """Whether a registered receiver holds ``model``."""
        return any(model in entry.registration.specs for entry in self.receivers.values())

    def targets(self, model: str, workers: tuple[str, ...] | None) -> list[ReceiverEntry]:
        """Receivers a broadcast of ``model`` goes to: all push receivers, or ``workers``."""
        if workers is not None and not workers:
            raise UnknownWorkerError("workers=[] names no receiver; pass None for all of them")
        if workers is None:
            return [
                entry
                for entry in self.receivers.values()
                if model in entry.registration.specs
                and entry.registration.mode is DeliveryMode.PUSH
            ]
        chosen = []
        for worker in dict.fromkeys(workers):  # each named worker once, in the given order
            entry = self.receivers.get(worker)
            if entry is None:
                raise UnknownWorkerError(
                    f"unknown worker {worker!r}; registered workers: "
                    f"{', '.join(sorted(self.receivers)) or 'none'}"
                )
            if model not in entry.registration.specs:
                raise UnknownModelError(
                    f"worker {worker!r} does not hold model {model!r} "
                    f"(it holds: {', '.join(sorted(entry.registration.specs))})"
                )
            if entry.registration.handle is None:
                raise UnknownWorkerError(
                    f"worker {worker!r} ({entry.registration.actor}) is a pull receiver in "
                    "a process that is no actor: nothing can call it; it takes versions "
                    "with pull_weights()"
                )
            chosen.append(entry)
        return chosen

    def transports(self) -> set[str]:
        """The transports the registered receivers read by."""
        return {entry.transport for entry in self.receivers.values()}

    def record(
        self, worker: str, model: str, version: int, timings: ReceiverTimings | None = None
    ) -> None:
        """Remember that ``worker`` holds ``version`` of ``model`` (or a newer one), and
        where the time went if it applied that version (``timings``)."""
        entry = self.receivers.get(worker)
        if entry is None:
            return
        entry.behind = False
        if version > entry.versions.get(model, 0):
            entry.versions[model] = version
            if timings is not None:
                entry.timings[model] = timings

    def timed_out(self, worker: str, token: str) -> None:
        """A delivery to ``worker``'s registration ``token`` timed out: it is behind
        until it acks a version (:attr:`ReceiverInfo.behind`)."""
        entry = self.receivers.get(worker)
        if entry is not None and entry.registration.token == token:
            entry.behind = True

    def statuses(self, now: float | None = None) -> tuple[ReceiverStatus, ...]:
        """Each receiver's versions, lag (in versions, and in seconds at ``now``,
        ``time.time()`` by default, where known: not for versions published before the
        hub restarted) and the timings of the last version it applied."""
        now = time.time() if now is None else now
        return tuple(self.status_of(worker, now) for worker in sorted(self.receivers))

    def status_of(self, worker: str, now: float | None = None) -> ReceiverStatus:
        """One registered receiver's status (see :meth:`statuses`)."""
        now = time.time() if now is None else now
        entry = self.receivers[worker]
        versions = {m: entry.versions.get(m, 0) for m in sorted(entry.registration.specs)}
        lag: dict[str, int] = {}
        lag_s: dict[str, float] = {}
        for m, v in versions.items():
            lag[m], seconds = self._lag(m, v, now)
            if seconds is not None:
                lag_s[m] = seconds
        return ReceiverStatus(
            worker=worker,
            actor=entry.registration.actor,
            mode=entry.registration.mode,
            versions=versions,
            lag=lag,
            transport=entry.transport,
            lag_s=lag_s,
            last_timings=dict(entry.timings),
            heard_s=(
                None
                if entry.registration.heartbeat_s is None
                else max(0.0, time.monotonic() - entry.heard)
            ),
        )

    def lags(self, now: float | None = None) -> dict[tuple[str, str], Lag]:
        """(worker, model) -> the lag of each receiver in each model it holds, at ``now``
        (``time.time()`` by default): what :meth:`statuses` says of their lag, without
        building the rest of each status (the hub's metrics after every broadcast)."""
        now = time.time() if now is None else now
        return {
            (worker, model): self._lag(model, entry.versions.get(model, 0), now)
            for worker, entry in self.receivers.items()
            for model in entry.registration.specs
        }

    def _lag(self, model: str, held: int, now: float) -> Lag:
        """The lag at ``now`` of a receiver holding version ``held`` of ``model``."""
        state = self.models[model]
        behind = state.versions_behind(held)
        if behind == 0:
            return Lag(0, 0.0)
        since = state.behind_since(held)
        return Lag(behind, None if since is None else max(0.0, now - since))


def lacks(held: int, origin: str, latest: HandedOver) -> bool:
    """Whether a receiver holding version ``held`` of ``latest``'s model, from learner
    ``origin`` ("": not known), lacks ``latest``: it holds an older version, or the same
    number from another learner (two learners delivering themselves guessed it, and
    the hub, restarted between, booked the other's: see :attr:`Update.origin`)."""
    return latest.version > held or (
        latest.version == held and bool(origin and latest.origin) and origin != latest.origin
    )
