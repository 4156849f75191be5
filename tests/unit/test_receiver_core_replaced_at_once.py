"""Two threads replace one zero-copy receiver at once (raysync/receiver_core.py
``ReceiverCore.register`` with ``previous``), as different workers or with different
hubs: one carries the model over, living on in the staged version it lives in; the
other, as another worker or with another hub, would move it into memory of its own and
hand that version back. Only the first to retire the receiver may replace it, and only
that one retires it: the one refused retired it too, moving the model out of the
version the winner carried over and handing that version back (a shared-memory slot
the winner's registration held, released under it, and released a second time once
the model moved on). Should the first one fail, the other is refused too (it did not
retire the receiver), and the receiver stays as it was, to be replaced again. The
other one waits for the first one also while that one waits for a pull registering the
receiver again, and up to its own timeout only. A first one that fails between
retiring the receiver and replacing it (interrupted while it waits for that pull, or
building its core) leaves it as it was too, to be replaced again.

A real ReceiverCore, its gate and zero-copy adoption; the hubs are stand-ins whose
``register`` answers (this test's ``ray.get`` passes the welcome through) only once
the other thread waits to replace the receiver too (or the test says so). The
transport is one that serves tensors by version and records what is handed back.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raysync import receiver_core
from raysync.messages import AckStatus, Update, Welcome
from raysync.receiver_core import HeldModel, ReceiverCore, ReceiverIdentity, SameObject
from raysync.receiver_delivery import attached
from raysync.spec import WeightSpec
from raysync.transports import TransportReceiver
from tests.unit.threads import SaysWhenWaitedFor, SaysWhenWaitedOn, on_a_thread

WORKER = "collector-1"
TRANSPORT = "shared_memory"  #: one whose staged versions a model may live in
#: Seconds any one step may take: a failure, not a hang, if it does not happen.
BOUND_S = 30.0
#: Who the second thread replaces the receiver as: another worker, or with another hub.
SECOND = pytest.mark.parametrize(
    ("worker", "hub_id"), [("collector-2", "hub"), (WORKER, "another hub")], ids=["worker", "hub"]
)
#: Who the receiver is replaced as afterwards: also as the same worker with the same hub.
AGAIN = pytest.mark.parametrize(
    ("worker", "hub_id"),
    [(WORKER, "hub"), ("collector-2", "hub"), (WORKER, "another hub")],
    ids=["same", "worker", "hub"],
)


class _Transport(TransportReceiver):
    """Serves ``staged[version]``; records each release as (payload, fetched or not)."""

    def __init__(self) -> None:
        self.staged: dict[int, list[torch.Tensor]] = {}
        self.released: list[tuple[int, bool]] = []

    def fetch(self, payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
        return self.staged[payload]

    def release(self, payload: int, staged: Sequence[torch.Tensor] | None) -> None:
        self.released.append((payload, staged is not None))


class _InterruptedOnce:
    """A core's ``_registering`` lock whose first taker is interrupted while it waits
    for it (a KeyboardInterrupt on a driver: a pull registering the core again holds it)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._interrupted = False

    def __enter__(self) -> None:
        if not self._interrupted:
            self._interrupted = True
            raise KeyboardInterrupt
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


class _Hub:
    """Stands for a HubHandle: records registrations and the tokens that left;
    ``register`` answers once ``answer_when`` is set (``in_flight`` says a registration
    waits for it), raising ``fails`` if set (the hub refused it). Its id is the test's
    own: a registration that a failing test left connecting (claiming its worker id in
    this process's registry) refuses none of another test's."""

    transport = TRANSPORT

    def __init__(self, hub_id: str, answer_when: threading.Event) -> None:
        self.config = SimpleNamespace(hub_id=f"{hub_id} {uuid.uuid4().hex}")
        self.registrations: list[Any] = []
        self.left: list[str] = []
        self.in_flight = threading.Event()
        self.fails: Exception | None = None
        self._answer_when = answer_when
        self.actor = SimpleNamespace(
            ack=SimpleNamespace(remote=lambda ack: None),
            leave=SimpleNamespace(remote=lambda worker, token: self.left.append(token)),
            register=SimpleNamespace(remote=self._register),
        )

    def _register(self, registration: Any) -> None:
        self.registrations.append(registration)
        self.in_flight.set()
        assert self._answer_when.wait(BOUND_S)
        if self.fails is not None:
            raise self.fails


class _ZeroCopyReceiver:
    """A zero-copy receiver (worker :data:`WORKER` of hub ``"hub"``) whose model lives
    in version 1, and the registrations that replace it, each on a thread of its own.
    The hubs answer once :attr:`hubs_answer` is set: once a registration waits for
    another one that retired the receiver first, or for its ``_registering``, unless
    the test sets it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.transport = _Transport()
        _registering_here(monkeypatch, self.transport)
        self.owner = SimpleNamespace(policy=torch.nn.Linear(3, 2))
        self.spec = HeldModel("policy", "policy").destination(self.owner)[1]
        self.identity = ReceiverIdentity(
            WORKER, "Collector(abc)", uuid.uuid4().hex, transport=TRANSPORT, zero_copy=True
        )
        self.hubs_answer = threading.Event()
        self.hubs = {
            hub_id: _Hub(hub_id, answer_when=self.hubs_answer) for hub_id in ("hub", "another hub")
        }
        model = self.owner.policy
        models = {"policy": HeldModel("policy", "policy", registered=SameObject(model))}
        self.core = ReceiverCore(
            self.owner,
            self.hubs["hub"],
            models,
            self.identity,
            Welcome(TRANSPORT, None, {}),
            "token",
            None,
            transport=self.transport,
        )
        attached.fill(self.identity.attachment, self.core)
        assert self.core.receive(self.staged(1)).ack.status is AckStatus.APPLIED
        self.core._registering = SaysWhenWaitedFor(self.hubs_answer)  # type: ignore[assignment]
        self.core._replacing_changed = SaysWhenWaitedOn(self.hubs_answer)

    def staged(self, version: int) -> Update:
        """Version ``version``, every value ``float(version)``, staged in the transport."""
        self.transport.staged[version] = [
            torch.full(entry.shape, float(version)) for entry in self.spec.tensors
        ]
        return Update("policy", version, self.spec.digest, TRANSPORT, version)

    def replace(self, worker: str, hub_id: str, timeout_s: float = BOUND_S) -> ReceiverCore:
        """Register again as ``worker`` with hub ``hub_id``, replacing :attr:`core`."""
        again = dataclasses.replace(self.identity, worker=worker, attachment=uuid.uuid4().hex)
        core, _ = ReceiverCore.register(
            self.owner,
            self.hubs[hub_id],
            {"policy": "policy"},
            again,
            previous=self.core,
            timeout_s=timeout_s,
        )
        return core

    def replace_at_once(self, worker: str, hub_id: str) -> tuple[Any, Any]:
        """The outcomes (futures) of two threads replacing :attr:`core`: the first as
        the same worker with the same hub, the second, as ``worker`` with ``hub_id``,
        once the first waits for its hub."""
        carrying_over = on_a_thread(lambda: self.replace(WORKER, "hub"))
        assert self.hubs["hub"].in_flight.wait(BOUND_S)
        return carrying_over, on_a_thread(lambda: self.replace(worker, hub_id))

    def while_a_pull_registers_again(self) -> tuple[Any, Any]:
        """The outcomes (futures) of a pull registering :attr:`core` again (the hub no
        longer knew it), waiting for its hub, and of a thread replacing it meanwhile as
        the same worker with the same hub, once that one waits for the pull (the hubs
        do not answer for that)."""
        registering = SaysWhenWaitedFor(threading.Event())
        self.core._registering = registering  # type: ignore[assignment]
        pulling = on_a_thread(lambda: self.core.register_again(BOUND_S))
        assert self.hubs["hub"].in_flight.wait(BOUND_S)
        carrying_over = on_a_thread(lambda: self.replace(WORKER, "hub"))
        assert registering.waited.wait(BOUND_S)
        return pulling, carrying_over

    def stays_as_it_was(self) -> None:
        """Assert that :attr:`core` is this process's receiver still, applying versions,
        its model living in version 1 and then in version 2."""
        assert attached.receivers() == [self.core]
        assert self.lives_in(1) and self.transport.released == []
        assert self.core.receive(self.staged(2)).ack.status is AckStatus.APPLIED
        assert self.lives_in(2) and self.transport.released == [(1, True)]

    def replaced_again(self, worker: str, hub_id: str) -> None:
        """Assert that :attr:`core` (its model living in version 2) can be replaced as
        ``worker`` with hub ``hub_id``, the model carried over as it lives if the same
        worker registers with the same hub, else moved into memory of its own."""
        self.hubs_answer.set()
        again = on_a_thread(lambda: self.replace(worker, hub_id)).result(BOUND_S)
        try:
            assert attached.receivers() == [again]
            assert torch.equal(self.owner.policy.weight, torch.full((2, 3), 2.0))
            if (worker, hub_id) == (WORKER, "hub"):
                assert self.hubs[hub_id].registrations[-1].kept == (2,)
                assert self.lives_in(2) and self.transport.released == [(1, True)]
            else:
                assert self.hubs[hub_id].registrations[-1].kept == ()
                assert not self.lives_in(2)
                assert self.transport.released == [(1, True), (2, True)]
        finally:
            again.close()

    def check_carried_over_by(self, winner: ReceiverCore) -> None:
        """``winner``, the pull's registration as the same worker with the same hub (the
        only one that reached a hub), carried the model over: it lives on in version 1,
        which nothing handed back."""
        assert [r.kept for r in self.hubs["hub"].registrations] == [(1,), (1,)]
        assert self.hubs["another hub"].registrations == []
        assert self.lives_in(1) and self.transport.released == []
        assert attached.receivers() == [winner]

    def lives_in(self, version: int) -> bool:
        """Whether the model's tensors are those staged of ``version`` (zero copy)."""
        staged = {t.data_ptr() for t in self.transport.staged[version]}
        return {t.data_ptr() for t in self.owner.policy.parameters()} == staged


def _registering_here(monkeypatch: pytest.MonkeyPatch, transport: TransportReceiver) -> None:
    """``ReceiverCore.register`` without Ray: the hub's welcome passes through, and the
    transport receiver it opens is ``transport``."""
    process = SimpleNamespace(get_node_id=lambda: "node", get_worker_id=lambda: "process")
    monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: process)
    monkeypatch.setattr(receiver_core, "_host_actor", lambda: None)
    welcome = Welcome(TRANSPORT, None, {})
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: welcome)
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: transport)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_ZeroCopyReceiver]:
    receiver = _ZeroCopyReceiver(monkeypatch)
    yield receiver
    receiver.core.close()  # closed already if replaced; else its attachment stays


@SECOND
def test_a_receiver_two_threads_replace_at_once_is_retired_by_the_one_that_wins(
    receiver, worker, hub_id
):
    """The first thread replaces the zero-copy receiver as the same worker with the
    same hub (the model lives on in version 1) and waits for the hub; the second
    replaces it meanwhile as ``worker`` with hub ``hub_id``, and is refused once the
    first one replaced it. The model still lives in version 1, which nothing handed
    back, and goes back once, when the winner's model moves on to version 2."""
    carrying_over, moving_out = receiver.replace_at_once(worker, hub_id)
    winner = carrying_over.result(BOUND_S)
    try:
        with pytest.raises(ValueError, match="replaced by another connect_hub/attach"):
            moving_out.result(BOUND_S)
        registrations = [r for hub in receiver.hubs.values() for r in hub.registrations]
        assert [r.kept for r in registrations] == [(1,)]
        assert receiver.lives_in(1), "the refused replacement moved the model out"
        assert receiver.transport.released == [], "the refused one handed version 1 back"
        assert winner.receive(receiver.staged(2)).ack.status is AckStatus.APPLIED
        assert torch.equal(receiver.owner.policy.weight, torch.full((2, 3), 2.0))
        assert receiver.transport.released == [(1, True)]
        assert attached.receivers() == [winner]
    finally:
        winner.close()


@SECOND
def test_a_receiver_whose_first_replacement_fails_stays_as_it_was(receiver, worker, hub_id):
    """As above, but the hub refuses the first registration: the second, which did not
    retire the receiver, is refused too. The receiver stays this process's, applying
    versions, its model living in version 1; the next replacement replaces it."""
    receiver.hubs["hub"].fails = RuntimeError("the hub refused it (injected)")
    first, second = receiver.replace_at_once(worker, hub_id)
    with pytest.raises(RuntimeError, match="refused it"):
        first.result(BOUND_S)
    with pytest.raises(ValueError, match="that failed to replace it: replace it again"):
        second.result(BOUND_S)
    receiver.stays_as_it_was()
    receiver.hubs["hub"].fails = None
    receiver.replaced_again(worker, hub_id)


@SECOND
def test_a_replacement_started_while_the_first_waits_for_a_pull_waits_for_that_one(
    receiver, worker, hub_id
):
    """The first thread replaces the receiver as the same worker with the same hub while
    a pull registers it again (the hub no longer knew it): it retired the receiver and
    waits for the pull. The second, as ``worker`` with hub ``hub_id``, starts then and
    waits for the first (the hubs answer only once it does), not for the pull: it is
    refused once the first replaced the receiver. The model still lives in version 1,
    which nothing handed back; the second registration never reached a hub."""
    pulling, carrying_over = receiver.while_a_pull_registers_again()
    moving_out = on_a_thread(lambda: receiver.replace(worker, hub_id))
    assert pulling.result(BOUND_S) is not None
    winner = carrying_over.result(BOUND_S)
    try:
        with pytest.raises(ValueError, match="replaced by another connect_hub/attach"):
            moving_out.result(BOUND_S)
        receiver.check_carried_over_by(winner)
    finally:
        winner.close()


@SECOND
def test_a_replacement_waits_for_the_first_up_to_its_timeout(receiver, worker, hub_id):
    """As above, but the hubs answer only once told: the second thread, which waits
    for the first up to its timeout (0.1 s), is refused then, naming the receiver; the
    first replaces it, the model living on in version 1."""
    receiver.core._replacing_changed = threading.Condition()  # no answer when waited on
    pulling, carrying_over = receiver.while_a_pull_registers_again()
    refused = r"Collector\(abc\)'s receiver \(worker 'collector-1'\) is being replaced by"
    with pytest.raises(ValueError, match=refused + ".* still connecting after 0.1 s"):
        on_a_thread(lambda: receiver.replace(worker, hub_id, timeout_s=0.1)).result(BOUND_S)
    receiver.hubs_answer.set()
    assert pulling.result(BOUND_S) is not None
    winner = carrying_over.result(BOUND_S)
    try:
        receiver.check_carried_over_by(winner)
    finally:
        winner.close()


@AGAIN
def test_a_receiver_whose_replacement_is_interrupted_waiting_for_a_pull_stays_as_it_was(
    receiver, worker, hub_id
):
    """The first replacement retired the receiver, then is interrupted while it waits
    for a pull that registers the receiver again: it never reached a hub, and the
    receiver stays as it was; the next replacement, as ``worker`` with hub ``hub_id``,
    replaces it (not refused as connecting already, nor waiting for the one
    interrupted)."""
    receiver.core._registering = _InterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        receiver.replace(WORKER, "hub")
    assert [hub.registrations for hub in receiver.hubs.values()] == [[], []]
    receiver.stays_as_it_was()
    receiver.replaced_again(worker, hub_id)


@AGAIN
def test_a_receiver_whose_replacement_fails_to_build_its_core_stays_as_it_was(
    receiver, monkeypatch, worker, hub_id
):
    """The first replacement, which the hub took in, fails building its core (no
    memory left: injected in what the receiver hands over to it): its registration is
    withdrawn from the hub, the receiver stays as it was, and the next replacement, as
    ``worker`` with hub ``hub_id``, replaces it."""

    def hubs_to_ack_later() -> dict[str, Any]:
        raise MemoryError("injected: no memory left for the new core")

    monkeypatch.setattr(receiver.core, "hubs_to_ack_later", hubs_to_ack_later)
    receiver.hubs_answer.set()
    with pytest.raises(MemoryError, match="injected"):
        receiver.replace(WORKER, "hub")
    monkeypatch.delattr(receiver.core, "hubs_to_ack_later")
    receiver.stays_as_it_was()
    [taken_in] = receiver.hubs["hub"].registrations
    assert receiver.hubs["hub"].left == [taken_in.token]
    receiver.replaced_again(worker, hub_id)
