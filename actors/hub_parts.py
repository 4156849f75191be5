"""The hub's versions sent in parts while they assemble: :class:`Assemblies`.

Hub process, on its event loop only (the hub actor's ``submit`` calls
:meth:`Assemblies.take` for each part). :class:`raysync.part_assembly.PartAssembly`
checks each part as it arrives; this module keeps one assembly per (model, version),
runs its deadline and hands every part the same outcome: the version started once its
last part arrived (the hub versions and delivers the whole, like any broadcast), or
why it failed — a part refused, a part missing at the deadline, the hub closing —
which every part waiting raises, and every part still to come.

A failed version's number is not used up: its learners may send it again. Each part is
sent once per attempt, so a part whose index the failed attempt already heard begins
the next attempt; a part it has not heard is that attempt's, late, and hears why it
failed. Once every part of a failed attempt was heard, the next part begins a new one.
A part the failed attempt had not heard that comes after the next one began is taken
into the new one if it agrees with it (its learner never heard of the failure: its
part completes the version sent again), else it is the failed attempt's, late (the
version was sent again with another timeout, number of parts or workers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from raysync.errors import IncompleteVersionError
from raysync.messages import BroadcastRequest
from raysync.part_assembly import PartAssembly
from raysync.spec import WeightSpec

from .hub_delivery import retrieve_outcome

#: Versions sent in parts that failed, kept so that their late parts are told why.
FAILED_KEPT = 64

Started = TypeVar("Started")
#: (model, version)
Key = tuple[str, int]


@dataclasses.dataclass
class _Assembling(Generic[Started]):
    """A version on its way to whole: what arrived, when the first part did, the
    version's start once whole (or why it failed), and the deadline's timer."""

    assembly: PartAssembly
    first_arrived: float  #: ``time.perf_counter()`` when the first part reached the hub
    timeout_s: float  #: the first part's: the deadline for the others, then the delivery's
    started: asyncio.Future[Started]
    timer: asyncio.TimerHandle | None = None
    #: the indices of the parts of this attempt that reached the hub, taken or refused
    heard: set[int] = dataclasses.field(default_factory=set)
    #: whether its first part named no model (the hub resolved it to the only one)
    unnamed: bool = False
    #: the failed attempt at this version it replaced, whose late parts may come yet
    replaced: _Assembling[Started] | None = None

    @property
    def failed(self) -> bool:
        return self.started.done() and self.started.exception() is not None


class Assemblies(Generic[Started]):
    """Every version sent in parts that the hub is assembling, and the last
    :data:`FAILED_KEPT` that failed.

    ``start(whole, timeout_s, first_arrived)`` versions and starts a whole request
    (the hub's own start of a broadcast); what it returns is what every part's
    :meth:`take` returns. ``unread(payloads)`` is told the payloads the whole leaves
    out (:meth:`~raysync.part_assembly.PartAssembly.unread_payloads`) as it starts.
    """

    def __init__(
        self,
        start: Callable[[BroadcastRequest, float, float], Awaitable[Started]],
        unread: Callable[[list[object]], None] = lambda payloads: None,
    ) -> None:
        self._start = start
        self._unread = unread
        self._open: OrderedDict[Key, _Assembling[Started]] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        """Whether a part of version ``key`` arrived already (the assembly is open or
        failed and kept)."""
        return key in self._open

    def model_of_unnamed(self, version: int, part: int) -> str | None:
        """The model of the attempt at ``version`` whose first part named no model, if
        one is still assembling, or failed without hearing ``part`` (which is its late
        part): a part that names none is of that one too (a model registered after the
        first part would make the hub's pick ambiguous, failing that part alone while
        the others waited out the deadline, or telling a late part to name its model
        instead of why its version failed)."""
        for (model, at), assembling in reversed(self._open.items()):
            if at != version or not assembling.unnamed:
                continue
            late = assembling.failed and part not in assembling.heard
            if late or not assembling.started.done():
                return model
        return None

    def fitting(
        self, request: BroadcastRequest, spec_of: Callable[[str], WeightSpec | None]
    ) -> list[str]:
        """The models of which a version at ``request``'s number is still assembling
        that ``request`` (a part) could be a part of (``spec_of(model)``: the model's
        spec, if the hub knows it)."""
        return [
            model
            for (model, at), assembling in self._open.items()
            if at == request.version
            and not assembling.started.done()
            and assembling.assembly.fits(request, spec_of(model))
        ]

    def begins_attempt(self, model: str, request: BroadcastRequest) -> bool:
        """Whether ``request`` (a part of ``model``) would begin an attempt at its
        version: none is open, or the one that failed heard this part already or was
        in another number of parts (the hub checks the version's number against the
        model's for a part that does)."""
        assert request.version is not None  # the hub refused a part without one
        assembling = self._open.get((model, request.version))
        if assembling is None:
            return True
        return assembling.failed and (
            request.part in assembling.heard or request.parts != assembling.assembly.parts
        )

    async def take(
        self,
        request: BroadcastRequest,
        model: str,
        known: WeightSpec | None,
        timeout_s: float,
        arrived: float,
    ) -> Started:
        """Take one part of version ``request.version`` of ``model`` (whose spec the hub
        knows as ``known``, None before any receiver registered it), arrived at
        ``arrived`` (``time.perf_counter()``). The first part starts the deadline:
        ``timeout_s`` for the others to arrive, and the whole version's delivery has
        that timeout from the first part's arrival on (a part with another timeout is
        refused: which one the version keeps would depend on which rank came first).
        Returns the version's start once every part is here; raises the part's own
        refusal, or :class:`IncompleteVersionError` saying why the version failed."""
        assert request.version is not None  # the hub refused a part without one
        key = (model, request.version)
        replaced = None
        if self.begins_attempt(model, request):
            replaced = self._open.pop(key, None)  # a failed attempt's number, sent again
        assembling = self._open.get(key)
        if assembling is None:
            assembly = PartAssembly(
                model,
                request.version,
                request.parts,
                None if request.workers is None else tuple(request.workers),
            )
            assembling = _Assembling(
                assembly,
                arrived,
                timeout_s,
                _quiet_future(),
                unnamed=request.model is None,
                replaced=replaced,
            )
            # From its arrival: it may have waited for the hub's first model, or its turn.
            left_s = max(0.0, timeout_s - (time.perf_counter() - arrived))
            assembling.timer = asyncio.get_running_loop().call_later(
                left_s, self._timed_out, key, timeout_s
            )
            self._open[key] = assembling
        elif assembling.failed:
            self._heard_late(key, assembling, request.part)
            raise _late(assembling, request.part)
        elif _late_for_replaced(assembling, request, timeout_s):
            assert assembling.replaced is not None
            assembling.replaced.heard.add(request.part)
            raise _late(assembling.replaced, request.part)
        assembling.heard.add(request.part)
        try:
            if timeout_s != assembling.timeout_s:
                raise ValueError(
                    f"part {request.part} of {assembling.assembly.what} has a timeout of "
                    f"{timeout_s:g} s, an earlier part {assembling.timeout_s:g} s: every "
                    "part of a version has the same timeout_s"
                )
            assembling.assembly.add(request, known)
        except Exception as err:
            self.fail(key, f"part {request.part} was refused ({type(err).__name__}: {err})")
            raise
        if assembling.assembly.complete:
            try:
                whole = assembling.assembly.request(known)
                self._unread(assembling.assembly.unread_payloads())
                begun = await self._start(whole, assembling.timeout_s, assembling.first_arrived)
            except Exception as err:  # no one part's fault: the whole was refused
                self.fail(key, f"the whole was refused ({type(err).__name__}: {err})")
                raise
            self._assembled(key, begun)
        try:
            return await asyncio.shield(assembling.started)
        except IncompleteVersionError as failed:
            # The failed version keeps this exception to tell late parts why: raised
            # here, it would keep this frame, and the part's payload with it.
            raise IncompleteVersionError(str(failed)) from failed.with_traceback(None)

    def refuse(self, request: BroadcastRequest, model: str, err: Exception) -> None:
        """A part the hub refused before taking it (``err``: its learner's own check):
        its version fails for every part waiting and every part to come, at once (they
        waited out the deadline, told that this part never came)."""
        assert request.version is not None  # the hub refused a part without one
        key = (model, request.version)
        if self.begins_attempt(model, request):
            self._open.pop(key, None)  # a failed attempt's number, sent again
            workers = None if request.workers is None else tuple(request.workers)
            assembly = PartAssembly(model, request.version, request.parts, workers)
            # Failed at once below: its timeout is never waited on.
            self._open[key] = _Assembling(
                assembly, time.perf_counter(), 0.0, _quiet_future(), unnamed=request.model is None
            )
        assembling = self._open[key]
        if assembling.failed:  # a late part of a failed attempt: its refusal says enough
            self._heard_late(key, assembling, request.part)
            return
        assembling.heard.add(request.part)
        self.fail(key, f"part {request.part} was refused ({type(err).__name__}: {err})")

    def fail(self, key: Key, reason: str) -> None:
        """Fail version ``key`` for every part waiting and every part to come (nothing
        of it is applied); a version already started or failed is left as it is."""
        assembling = self._open.get(key)
        if assembling is None or assembling.started.done():
            return
        if assembling.timer is not None:
            assembling.timer.cancel()
        assembling.started.set_exception(
            IncompleteVersionError(
                f"{assembling.assembly.what} failed: {reason}; nothing was applied"
            )
        )
        assembling.assembly.drop_parts()
        failed = [k for k, a in self._open.items() if a.started.done()]
        for old in failed[: max(0, len(failed) - FAILED_KEPT)]:
            del self._open[old]

    def fail_all(self, reason: str) -> None:
        """Fail every version still assembling (the hub is closing)."""
        for key in list(self._open):
            self.fail(key, reason)

    def arrived(self) -> dict[Key, tuple[int, ...]]:
        """The parts that arrived of each version still assembling (``hub.status``)."""
        return {key: a.assembly.arrived() for key, a in self._open.items() if not a.started.done()}

    def _heard_late(self, key: Key, assembling: _Assembling[Started], index: int) -> None:
        """Part ``index`` of failed attempt ``key`` arrived late; once every part was
        heard, the attempt is forgotten: the next part begins a new one."""
        assembling.heard.add(index)
        if assembling.heard >= set(range(assembling.assembly.parts)):
            del self._open[key]

    def _assembled(self, key: Key, begun: Started) -> None:
        assembling = self._open.pop(key)
        if assembling.timer is not None:
            assembling.timer.cancel()
        assembling.started.set_result(begun)

    def _timed_out(self, key: Key, timeout_s: float) -> None:
        assembling = self._open.get(key)
        if assembling is not None:
            missing = ", ".join(str(i) for i in assembling.assembly.missing())
            self.fail(key, f"part(s) {missing} did not arrive within {timeout_s:g} s of the first")


def _late(failed: _Assembling[Started], index: int) -> IncompleteVersionError:
    """What part ``index`` of the ``failed`` attempt, arriving after it failed, hears."""
    return IncompleteVersionError(
        f"part {index} of {failed.assembly.what} arrived after the version failed: "
        f"{failed.started.exception()}; to send the version again, send every part again"
    )


def _late_for_replaced(
    assembling: _Assembling[Started], request: BroadcastRequest, timeout_s: float
) -> bool:
    """Whether ``request``, a part arriving at the ``assembling`` attempt, is a late
    part of the failed attempt that attempt replaced: one it had not heard, which
    disagrees with the new attempt (taken in, it would fail the version sent again)."""
    replaced = assembling.replaced
    if replaced is None or request.part in replaced.heard:
        return False
    return timeout_s != assembling.timeout_s or not assembling.assembly.agrees(request)


def _quiet_future() -> asyncio.Future[Started]:
    """A future whose exception is not logged as never retrieved (a version may fail
    with no part left waiting for it)."""
    future: asyncio.Future[Started] = asyncio.get_running_loop().create_future()
    retrieve_outcome(future)
    return future
