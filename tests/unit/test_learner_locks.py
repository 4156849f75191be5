"""The locks a learner's broadcasts keep their order under (``LearnerSide.submitting``,
``LearnerSide.sending_in_order``), without Ray: a HubHandle over a stand-in hub actor,
with stand-in transport senders whose ``send`` may wait, as NIXL's waits for the
model's broadcast from two versions back to end (a slow receiver of that model).

One model's wait holds up none of another model's broadcasts, whether its hand-off
needs its versions submitted in the order they were sent (a shared-memory receiver on
the hub) or it numbered its version for the learner's channel; the versions of one
model still reach the hub in the order they were sent, whether a broadcast names the
model or leaves it out before any route named it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raysync import learner_side
from raysync.hub_handle import HubHandle
from raysync.learner_side import InFlight
from raysync.messages import (
    BroadcastRequest,
    ChannelReply,
    DirectTarget,
    Entry,
    HubConfig,
    Route,
)
from raysync.spec import WeightSpec
from raysync.transports.base import TransportSender

#: Bound on every wait of these tests for another thread (none should come near it).
WAIT_S = 5.0
#: The hand-offs of a NIXL hub one of whose receivers chose shared memory: every
#: broadcast, of every model, carries both.
SHM_AND_NIXL = ("nixl", "shared_memory")
LEARNER_NODE = "the learner's node"


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


SPEC = WeightSpec.of(_weights(0.0))


class _Hub:
    """The hub actor as the learner calls it: ``submit.remote(request)`` books the
    request and returns its result at once."""

    def __init__(self) -> None:
        self.submit = SimpleNamespace(remote=self._submit)
        self.requests: list[BroadcastRequest] = []
        self._submitted: dict[str | None, threading.Event] = {}
        self._lock = threading.Lock()

    def _submit(self, request: BroadcastRequest) -> str:
        with self._lock:
            self.requests.append(request)
        self.submitted(request.model).set()
        return f"result {request.sequence}"

    def submitted(self, model: str | None) -> threading.Event:
        """Set once a broadcast of ``model`` was submitted."""
        with self._lock:
            return self._submitted.setdefault(model, threading.Event())

    def sent(self) -> list[tuple[int, str | None, dict[str, Any]]]:
        """Per submit call, in order: its number, model and payloads."""
        return [(r.sequence, r.model, r.payloads) for r in self.requests]


class _Sender(TransportSender):
    """A hand-off's learner half: its payload names the hand-off, model and the
    version's value; the first send of a model in ``held`` waits until that event is
    set (``waiting`` set meanwhile)."""

    def __init__(self, name: str, held: dict[str, threading.Event] | None = None) -> None:
        self.name = name
        self.held = dict(held or {})
        self.waiting = {model: threading.Event() for model in self.held}
        self.sends: list[str] = []
        self._lock = threading.Lock()

    def send(self, tensors, spec, model):
        payload = f"{self.name} payload of {model} v{tensors['w'][0].item():g}"
        with self._lock:
            self.sends.append(payload)
            held = self.held.pop(model, None)
        if held is not None:
            self.waiting[model].set()
            assert held.wait(WAIT_S), f"{model}'s send was never let go"
        return payload

    def close(self) -> None:
        pass


class _Channel:
    """The learner's channel to one model's receivers: each version written reaches
    every target, whose reply is in at once."""

    def __init__(self) -> None:
        self.written: list[tuple[str, int]] = []

    def write(self, targets, workers, update, timeout_s):
        self.written.append((update.model, update.version))
        return {t.worker: t.token for t in targets}

    def collect(self, written, wait_s):
        return {worker: (token, ChannelReply(None)) for worker, token in written.items()}

    def close(self) -> None:
        pass


class _ReturnedAtOnce(InFlight):
    """No submit call stays in flight: the stand-in hub's return as they are made (no
    Ray here to ask)."""

    def add(self, sequence, ref) -> None:
        pass


class _NotesWaits:
    """A route key's order lock that sets ``waited`` when a thread has to wait for it."""

    def __init__(self, lock: Any, waited: threading.Event | None = None) -> None:
        self._lock = lock
        self.waited = threading.Event() if waited is None else waited

    def __enter__(self) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.waited.set()
        assert self._lock.acquire(timeout=WAIT_S), "the lock was never let go"
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _noting_waits(
    monkeypatch,
    side: learner_side.LearnerSide,
    key: str | None,
    waited: threading.Event | None = None,
) -> _NotesWaits:
    """Have ``side`` give route key ``key``'s order lock as a :class:`_NotesWaits`."""
    notes = _NotesWaits(side.sending_in_order(key), waited)
    in_order = side.sending_in_order
    monkeypatch.setattr(
        side, "sending_in_order", lambda asked: notes if asked == key else in_order(asked)
    )
    return notes


class _RoutedHandle(HubHandle):
    """A learner's handle whose hub answers each model's route with ``routes[model]``."""

    routes: dict[str, Route]

    def _route(self, model, timeout_s):
        return self.routes[model]


@pytest.fixture(autouse=True)
def no_other_sides(monkeypatch) -> None:
    """Each test begins with no side in this process (and no Ray to ask other hubs)."""
    monkeypatch.setattr(learner_side, "_sides", {})
    monkeypatch.setattr(learner_side, "_end_sides_of_gone_hubs", lambda hubs: None)


@pytest.fixture
def learner():
    """``learner(routes, senders, channels=False)``: a handle on a stand-in hub whose
    routes are ``routes`` and whose hand-offs' senders in this process are ``senders``."""
    handles: list[HubHandle] = []

    def handle(
        routes: dict[str, Route], senders: dict[str, _Sender], channels: bool = False
    ) -> tuple[_RoutedHandle, _Hub]:
        hub = _Hub()
        config = HubConfig("nixl", 60.0, False, f"hub-{len(handles)}", channels=channels)
        made = _RoutedHandle(hub, config)
        made.routes = routes
        side = made._side
        side.senders.update(senders)
        side.in_flight = _ReturnedAtOnce()
        side.node_id = LEARNER_NODE
        handles.append(made)
        return made, hub

    yield handle
    for each in handles:
        each.release()


def _direct_route(model: str) -> Route:
    """``model``'s route with one mixin receiver on the learner's node: the learner
    writes its next version, 1, into its channel."""
    target = DirectTarget(
        f"{model}-worker",
        f"{model}-token",
        "object_store",
        f"the host actor of {model}-worker",
        Entry.MIXIN_METHOD,
        "key",
        LEARNER_NODE,
    )
    return Route(("object_store", "nixl"), model, 1, SPEC, (target,))


def _payloads(model: str, value: float) -> dict[str, str]:
    """What each of :data:`SHM_AND_NIXL` made of version ``value`` of ``model``."""
    return {name: f"{name} payload of {model} v{value:g}" for name in SHM_AND_NIXL}


def _broadcast(pool: ThreadPoolExecutor, handle: HubHandle, model: str, value: float) -> Future:
    return pool.submit(handle.broadcast.remote, _weights(value), model=model)


def _b_goes_while_a_waits(
    handle: HubHandle,
    hub: Any,
    nixl: Any,
    slow_receiver: threading.Event,
    while_a_waits: Callable[[], None] = lambda: None,
) -> None:
    """Model a's broadcast waits in NIXL's send until ``slow_receiver`` is set; meanwhile
    (after ``while_a_waits``) model b's is submitted and answered first, then a's."""
    with ThreadPoolExecutor(2) as pool:
        try:
            a = _broadcast(pool, handle, "a", 1.0)
            assert nixl.waiting["a"].wait(WAIT_S)
            while_a_waits()
            b = _broadcast(pool, handle, "b", 2.0)
            assert hub.submitted("b").wait(WAIT_S), "model b waited for model a's hand-off"
            assert b.result(WAIT_S) == "result 1"
            assert not hub.submitted("a").is_set()
        finally:
            slow_receiver.set()
        assert a.result(WAIT_S) == "result 2"


def test_one_models_wait_in_its_hand_off_holds_up_no_other_models_broadcast(learner):
    """Every broadcast carries a shared-memory payload, whose versions are submitted
    in the order they were sent: model a's, waiting in NIXL's send for a slow receiver,
    held every other model's off from their send to their submit call until its wait
    ended (up to the broadcast's timeout), again and again."""
    slow_receiver = threading.Event()
    nixl = _Sender("nixl", held={"a": slow_receiver})
    shm = _Sender("shared_memory")
    routes = {"a": Route(SHM_AND_NIXL), "b": Route(SHM_AND_NIXL)}
    handle, hub = learner(routes, {"nixl": nixl, "shared_memory": shm})
    _b_goes_while_a_waits(handle, hub, nixl, slow_receiver)
    assert hub.sent() == [(1, "b", _payloads("b", 2)), (2, "a", _payloads("a", 1))]


def test_one_models_wait_after_its_channel_write_holds_up_no_other_models_broadcast(learner):
    """With channels, a version numbered for the learner's channel held the learner's
    numbering lock, every model's, from its write through its hand-off to its submit
    call: model a's wait in NIXL's send stopped model b's broadcasts (and its channel,
    route and handles' lookups)."""
    slow_receiver = threading.Event()
    nixl = _Sender("nixl", held={"a": slow_receiver})
    channels = {"a": _Channel(), "b": _Channel()}
    routes = {"a": _direct_route("a"), "b": _direct_route("b")}
    senders = {"object_store": _Sender("object_store"), "nixl": nixl}
    handle, hub = learner(routes, senders, channels=True)
    handle._side.channels.update(channels)

    def a_written() -> None:
        assert channels["a"].written == [("a", 1)]  # its receivers apply it meanwhile

    _b_goes_while_a_waits(handle, hub, nixl, slow_receiver, while_a_waits=a_written)
    assert channels["b"].written == [("b", 1)]
    booked = [(r.sequence, r.model, r.direct_version, r.direct_calls) for r in hub.requests]
    assert booked == [
        (1, "b", 1, {"b-worker": ("b-token", ChannelReply(None))}),
        (2, "a", 1, {"a-worker": ("a-token", ChannelReply(None))}),
    ]


def test_the_versions_of_one_model_are_submitted_in_the_order_they_were_sent(learner, monkeypatch):
    """The shared-memory owner frees a learner's older slots of a model the hub never
    planned once it plans a newer one: the second version, sent while the first waits
    in NIXL's send, waits for the first's submit call before its own send."""
    slow_receiver = threading.Event()
    nixl = _Sender("nixl", held={"a": slow_receiver})
    shm = _Sender("shared_memory")
    handle, hub = learner(
        {"a": Route(("shared_memory", "nixl"))}, {"nixl": nixl, "shared_memory": shm}
    )
    side = handle._side
    order = _noting_waits(monkeypatch, side, "a")
    with ThreadPoolExecutor(2) as pool:
        try:
            first = _broadcast(pool, handle, "a", 1.0)
            assert nixl.waiting["a"].wait(WAIT_S)
            second = _broadcast(pool, handle, "a", 2.0)
            assert order.waited.wait(WAIT_S), "the second version did not wait for the first"
            assert shm.sends == ["shared_memory payload of a v1"]
        finally:
            slow_receiver.set()
        assert (first.result(WAIT_S), second.result(WAIT_S)) == ("result 1", "result 2")
    assert shm.sends == ["shared_memory payload of a v1", "shared_memory payload of a v2"]
    assert [(sequence, payloads["shared_memory"]) for sequence, _, payloads in hub.sent()] == [
        (1, "shared_memory payload of a v1"),
        (2, "shared_memory payload of a v2"),
    ]


#: The routes of a hub whose only model, "m", has no receiver the learner calls itself:
#: none names the model, so a broadcast that leaves it out does not know it. Each
#: writes its shared-memory slot, then sends by NIXL.
NO_ROUTE_NAMES_M: dict[str | None, Route] = dict.fromkeys(
    ("m", None), Route(("shared_memory", "nixl"))
)


def test_a_broadcast_leaving_its_model_out_waits_for_one_naming_it_sent_before(
    learner, monkeypatch
):
    """Keyed apart (route key None and "m"), the broadcast that left the model out,
    sent while the one naming it waited in NIXL's send, was submitted first: the hub's
    plan of it had the shared-memory owner free the older slot as one the hub refused,
    while the version it held was still to be submitted."""
    slow_receiver = threading.Event()
    nixl, shm = _Sender("nixl", held={"m": slow_receiver}), _Sender("shared_memory")
    handle, hub = learner(NO_ROUTE_NAMES_M, {"nixl": nixl, "shared_memory": shm})
    moved_on = hub.submitted(None)  # or it waited for its turn
    with ThreadPoolExecutor(2) as pool:
        try:
            named = _broadcast(pool, handle, "m", 1.0)
            assert nixl.waiting["m"].wait(WAIT_S)
            _noting_waits(monkeypatch, handle._side, None, waited=moved_on)
            unnamed = pool.submit(handle.broadcast.remote, _weights(2.0))
            assert moved_on.wait(WAIT_S)
            assert hub.sent() == [], "the version sent second was submitted first"
            assert shm.sends == ["shared_memory payload of m v1"]
        finally:
            slow_receiver.set()
        assert (named.result(WAIT_S), unnamed.result(WAIT_S)) == ("result 1", "result 2")
    assert shm.sends == ["shared_memory payload of m v1", "shared_memory payload of  v2"]
    assert hub.sent() == [(1, "m", _payloads("m", 1)), (2, None, _payloads("", 2))]


def test_a_broadcast_naming_its_model_waits_for_one_leaving_it_out_sent_before(
    learner, monkeypatch
):
    """The other way round: the broadcast naming the model, sent while the one that
    left it out (its model not known yet) waited in NIXL's send, was submitted first."""
    slow_receiver = threading.Event()
    nixl, shm = _Sender("nixl", held={"": slow_receiver}), _Sender("shared_memory")
    handle, hub = learner(NO_ROUTE_NAMES_M, {"nixl": nixl, "shared_memory": shm})
    moved_on = hub.submitted("m")  # or it waited for its turn
    with ThreadPoolExecutor(2) as pool:
        try:
            unnamed = pool.submit(handle.broadcast.remote, _weights(1.0))
            assert nixl.waiting[""].wait(WAIT_S)
            _noting_waits(monkeypatch, handle._side, "m", waited=moved_on)
            named = _broadcast(pool, handle, "m", 2.0)
            assert moved_on.wait(WAIT_S)
            assert hub.sent() == [], "the version sent second was submitted first"
            assert shm.sends == ["shared_memory payload of  v1"]
        finally:
            slow_receiver.set()
        assert (unnamed.result(WAIT_S), named.result(WAIT_S)) == ("result 1", "result 2")
    assert shm.sends == ["shared_memory payload of  v1", "shared_memory payload of m v2"]
    assert hub.sent() == [(1, None, _payloads("", 1)), (2, "m", _payloads("m", 2))]
