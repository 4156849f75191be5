"""ReceiverCore (raysync/receiver_core.py) without Ray: receiving and applying updates.

Applied by copy into the model's own tensors, superseded (an older or equal version),
failed (an unknown model, another spec, a raising ``on_applied``), zero copy (the model
lives in the staged version until the next one), deferred on a busy async actor (the
receipt says so, the hub's reply is None, the ack follows from the safe point), the
user-facing ``apply_now``, a connection left behind when its data cannot be fetched,
and the transport's hold on every payload released exactly once. The hub is a stand-in
that records the acks sent to it; the transport one that serves tensors by version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import threading
import uuid
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch

from raysync import receiver_core, weights
from raysync.attached import attach
from raysync.copies import Viewed, numpy_view
from raysync.errors import RaySyncError, SpecMismatchError, UnknownModelError
from raysync.messages import Ack, AckStatus, ServeRequest, Update, Welcome
from raysync.receiver_core import (
    HeldModel,
    ReceiverCore,
    ReceiverIdentity,
    SameObject,
    _carried_over,
)
from raysync.receiver_delivery import attached, deliver
from raysync.receiver_receipt import ACK_LATER, AckLater, AckNow, receipt_of_reply, reply_to_hub
from raysync.spec import WeightSpec
from raysync.transports import TransportError, TransportReceiver
from tests.unit.threads import SaysWhenWaitedFor, SaysWhenWaitedOn

WORKER = "collector-1"


class _Hub:
    """Stands for a HubHandle: records the acks sent after a delivery call returned."""

    transport = "object_store"

    def __init__(self) -> None:
        self.acks: list[Ack] = []
        self.actor = SimpleNamespace(ack=SimpleNamespace(remote=self.acks.append))
        self.config = SimpleNamespace(hub_id=f"hub {id(self)}")


class _Transport(TransportReceiver):
    """Serves ``staged[version]``; records each release as (payload, fetched or not)."""

    def __init__(self) -> None:
        self.staged: dict[int, list[torch.Tensor]] = {}
        self.released: list[tuple[int, bool]] = []

    def fetch(self, payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if payload not in self.staged:
            raise TransportError(f"version {payload} is gone")
        return self.staged[payload]

    def release(self, payload: int, staged: Sequence[torch.Tensor] | None) -> None:
        self.released.append((payload, staged is not None))


class _Receiver:
    """A core on a one-model owner, with its stand-in hub and transport."""

    def __init__(
        self,
        *,
        zero_copy: bool = False,
        on_applied: Callable[[str, int], None] | None = None,
        model: object | None = None,
    ) -> None:
        self.owner = SimpleNamespace(policy=torch.nn.Linear(3, 2) if model is None else model)
        self.hub = _Hub()
        identity = ReceiverIdentity(WORKER, "Collector(abc)", "attachment", zero_copy=zero_copy)
        models = {"policy": HeldModel("policy", "policy")}
        welcome = Welcome("object_store", None, {})
        self.core = ReceiverCore(
            self.owner, self.hub, models, identity, welcome, "token", on_applied
        )
        self.transport = _Transport()
        self.core.transport = self.transport
        self.spec = models["policy"].destination(self.owner)[1]

    def update(self, version: int, model: str = "policy", digest: str | None = None) -> Update:
        """Version ``version``, every value ``float(version)``, staged in the transport."""
        self.transport.staged[version] = [
            torch.full(entry.shape, float(version), dtype=entry.dtype)
            for entry in self.spec.tensors
        ]
        return Update(model, version, digest or self.spec.digest, "object_store", version)

    def cast_on_the_wire(self, version: int) -> Update:
        """:meth:`update`, staged and announced as cast to bfloat16 on the wire."""
        update = self.update(version)
        wire = [t.to(torch.bfloat16) for t in self.transport.staged[version]]
        self.transport.staged[version] = wire
        wire_spec = WeightSpec.of(dict(zip(self.spec.names, wire, strict=True)))
        return dataclasses.replace(update, wire_spec=wire_spec)


def _ack(version: int, status: AckStatus) -> Ack:
    return Ack(WORKER, "policy", version, status)


def test_an_update_is_copied_into_the_models_own_tensors():
    receiver = _Receiver()
    model = receiver.owner.policy
    pointer = model.weight.data_ptr()
    assert receiver.core.receive(receiver.update(1)) == AckNow(_ack(1, AckStatus.APPLIED))
    assert model.weight.data_ptr() == pointer
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))
    assert receiver.core.models["policy"].version == 1
    assert receiver.transport.released == [(1, True)]


def test_a_transport_that_fails_to_take_a_version_back_leaves_the_ack_applied(caplog):
    """The version is in the model: its ack says so, whatever handing its staged data
    back raised (it said FAILED for a version the model holds; deferred, it sent no ack
    at all and raised into the user method that ended the read)."""
    receiver = _Receiver()

    def release(payload, staged):
        raise TransportError("the transport's owner is gone (injected)")

    receiver.transport.release = release
    assert receiver.core.receive(receiver.update(1)) == AckNow(_ack(1, AckStatus.APPLIED))
    assert receiver.core.models["policy"].version == 1
    assert "could not hand version 1 of model 'policy' back" in caplog.text


def _slot_rewritten(payload: int) -> None:
    """A transport's ``check_intact``: the memory it lent for ``payload`` was rewritten."""
    raise TransportError(f"slot of version {payload} was rewritten (injected)")


def test_a_version_whose_lent_memory_was_rewritten_before_the_safe_point_fails_untouched():
    """A transport that lends its memory (a shared-memory slot) says at the safe point
    that another version was written there since the fetch: the version fails, the
    model keeps what it held, the staged data goes back."""
    receiver = _Receiver()
    model = receiver.owner.policy
    before = model.weight.clone()

    receiver.transport.check_intact = _slot_rewritten
    receipt = receiver.core.receive(receiver.update(1))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.FAILED
    assert "slot of version 1 was rewritten" in receipt.ack.error
    assert torch.equal(model.weight, before) and receiver.core.models["policy"].version == 0
    assert receiver.transport.released == [(1, True)]


def test_a_version_whose_lent_memory_is_rewritten_during_the_copy_fails_saying_so():
    receiver = _Receiver()
    checks: list[int] = []

    def rewritten_after_the_first_look(payload):
        checks.append(payload)
        if len(checks) > 1:
            raise TransportError("slot rewritten (injected)")

    receiver.transport.check_intact = rewritten_after_the_first_look
    receipt = receiver.core.receive(receiver.update(1))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.FAILED
    assert "may now hold bytes of another version" in receipt.ack.error
    assert checks == [1, 1] and receiver.core.models["policy"].version == 0


def test_a_dict_model_whose_entry_was_replaced_gets_the_next_version_in_the_new_tensor():
    """A dict model's write targets are cached between updates (1000 entries cost ~2 ms
    to rebuild); an entry replaced meanwhile is where the next version lands."""
    model = {"w": torch.zeros(4), "nets": {"b": torch.zeros(2)}}
    receiver = _Receiver(model=model)
    assert receiver.core.receive(receiver.update(1)).ack.status is AckStatus.APPLIED
    old_w = model["w"]
    model["w"] = torch.zeros(4)  # the user swaps a tensor between versions
    assert receiver.core.receive(receiver.update(2)).ack.status is AckStatus.APPLIED
    assert torch.equal(model["w"], torch.full((4,), 2.0))
    assert torch.equal(model["nets"]["b"], torch.full((2,), 2.0))
    assert torch.equal(old_w, torch.full((4,), 1.0))  # the dropped tensor kept version 1


def test_a_model_copied_into_through_its_kept_views_gets_each_version_where_it_lives():
    """Updates read from the object store come as arrays (``Viewed.over``); from the
    second update that finds the model where the first left it the receiver copies into
    views of the model it keeps. A parameter replaced meanwhile is where the next
    version lands, not the memory the kept views point at."""
    receiver = _Receiver()
    model = receiver.owner.policy

    def as_read(version: int) -> Update:
        update = receiver.update(version)
        tensors = receiver.transport.staged[version]
        receiver.transport.staged[version] = Viewed.over(  # type: ignore[assignment]
            [numpy_view(t) for t in tensors], [t.dtype for t in tensors]
        )
        return update

    for version in (1, 2, 3):
        assert receiver.core.receive(as_read(version)).ack.status is AckStatus.APPLIED
        assert torch.equal(model.weight, torch.full((2, 3), float(version)))
    held = receiver.core.models["policy"]
    assert isinstance(held.targets(receiver.owner)[2], Viewed)
    old_weight = model.weight
    model.weight = torch.nn.Parameter(torch.zeros(2, 3))  # the user swaps a parameter
    assert receiver.core.receive(as_read(4)).ack.status is AckStatus.APPLIED
    assert torch.equal(model.weight, torch.full((2, 3), 4.0))
    assert torch.equal(model.bias, torch.full((2,), 4.0))
    assert torch.equal(old_weight, torch.full((2, 3), 3.0))  # the dropped one kept 3


def test_an_update_walks_the_model_once(monkeypatch):
    """Staging reads the update with the spec found when the model was last walked; only
    the safe point walks it again (a 1000-tensor model costs ~1 ms per walk)."""
    receiver = _Receiver()
    receiver.core.receive(receiver.update(1))
    walks: list[object] = []
    fingerprint = weights.storage_fingerprint
    monkeypatch.setattr(weights, "storage_fingerprint", lambda m: walks.append(m) or fingerprint(m))
    assert receiver.core.receive(receiver.update(2)).ack.status is AckStatus.APPLIED
    assert len(walks) == 1


def test_a_model_reshaped_between_versions_takes_an_update_of_its_new_spec():
    """The spec last found is a hint, not a verdict: an update of another spec makes the
    receiver look at its model as it is now."""
    receiver = _Receiver()
    receiver.core.receive(receiver.update(1))
    receiver.owner.policy = torch.nn.Linear(5, 2)  # the user resizes the model
    receiver.spec = WeightSpec.of(dict(receiver.owner.policy.state_dict()))
    assert receiver.core.receive(receiver.update(2)).ack.status is AckStatus.APPLIED
    assert torch.equal(receiver.owner.policy.weight, torch.full((2, 5), 2.0))


def test_a_model_retyped_between_staging_and_the_safe_point_fails_untouched():
    """The update was staged against the model's old spec; the safe point finds the
    model changed and writes nothing."""
    receiver = _Receiver()
    receiver.core.receive(receiver.update(1))
    update = receiver.update(2)

    class _Retyping(_Transport):
        def fetch(self, payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
            receiver.owner.policy.double()  # the host changes its model meanwhile
            return super().fetch(payload, spec)

    transport = _Retyping()
    transport.staged = receiver.transport.staged
    receiver.core.transport = transport
    receipt = receiver.core.receive(update)
    assert receipt.ack.status is AckStatus.FAILED
    assert "SpecMismatchError" in receipt.ack.error and "float64" in receipt.ack.error
    assert torch.equal(receiver.owner.policy.weight, torch.full((2, 3), 1.0, dtype=torch.float64))
    assert receiver.core.models["policy"].version == 1
    assert transport.released == [(2, True)]


def test_an_older_or_equal_version_is_superseded_without_a_fetch():
    receiver = _Receiver()
    receiver.core.receive(receiver.update(2))
    for version in (2, 1):
        assert receiver.core.receive(receiver.update(version)) == AckNow(
            _ack(version, AckStatus.SUPERSEDED)
        )
    assert receiver.transport.released == [(2, True), (2, False), (1, False)]
    assert torch.equal(receiver.owner.policy.bias, torch.full((2,), 2.0))


@pytest.mark.parametrize(
    ("model", "digest", "error"),
    [("critic", None, "does not hold model 'critic'"), ("policy", "other", "SpecMismatchError")],
)
def test_an_update_the_model_cannot_take_fails_and_changes_nothing(model, digest, error):
    receiver = _Receiver()
    before = receiver.owner.policy.weight.clone()
    receipt = receiver.core.receive(receiver.update(1, model=model, digest=digest))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.FAILED
    assert error in receipt.ack.error
    assert torch.equal(receiver.owner.policy.weight, before)
    assert receiver.core.models["policy"].version == 0
    assert receiver.transport.released == [(1, False)]


def test_a_version_cast_on_the_wire_is_cast_into_the_model():
    receiver = _Receiver()
    receipt = receiver.core.receive(receiver.cast_on_the_wire(3))
    assert receipt == AckNow(_ack(3, AckStatus.APPLIED))
    assert receiver.owner.policy.weight.dtype == torch.float32
    assert torch.equal(receiver.owner.policy.weight, torch.full((2, 3), 3.0))


def test_a_zero_copy_model_takes_a_cast_copy_of_a_version_cast_on_the_wire():
    """It may live in a read-only staged version: the cast lands in new tensors of its
    own dtype, made as the version is fetched (not at the safe point), and the staged
    data goes back then; the model takes the copy as its memory at the safe point."""
    receiver = _Receiver(zero_copy=True)
    receiver.core.receive(receiver.update(1))  # lives in staged version 1
    lived_in = receiver.transport.staged[1]
    update = receiver.cast_on_the_wire(2)
    wire = receiver.transport.staged[2]
    receipt = receiver.core.receive(update)
    assert receipt == AckNow(_ack(2, AckStatus.APPLIED))
    weight = receiver.owner.policy.weight
    assert weight.dtype == torch.float32 and torch.equal(weight, torch.full((2, 3), 2.0))
    assert all(weight.data_ptr() != t.data_ptr() for t in [*lived_in, *wire])
    assert all(bool((t == 1.0).all()) for t in lived_in)  # never written into
    assert receiver.transport.released == [(2, True), (1, True)]


def test_a_zero_copy_cast_that_fails_hands_the_staged_version_back_once(monkeypatch):
    """The cast copy fails (out of memory): the staged version goes back to the
    transport once (twice, a shared-memory lease of another fetch of it was counted
    down too, and its slot freed under that fetch)."""
    receiver = _Receiver(zero_copy=True)
    update = receiver.cast_on_the_wire(1)

    def out_of_memory(self, *args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(torch.Tensor, "to", out_of_memory)
    receipt = receiver.core.receive(update)
    monkeypatch.undo()
    assert receipt.ack.status is AckStatus.FAILED and "out of memory" in receipt.ack.error
    assert receiver.transport.released == [(1, True)]
    assert receiver.core.models["policy"].version == 0


def test_a_zero_copy_cast_read_from_lent_memory_rewritten_meanwhile_fails_untouched():
    """A version cast on the wire is copied for a zero-copy model as it is fetched, and
    the transport's memory goes back at once: the safe point's checks look at the copy,
    not at that memory. A slot rewritten before the copy ended (the worker's hold went:
    the hub forgot it) fails the version there, instead of applying another version's
    bytes as this one; the model keeps what it held."""
    receiver = _Receiver(zero_copy=True)
    before = receiver.owner.policy.weight.clone()

    receiver.transport.check_intact = _slot_rewritten
    receipt = receiver.core.receive(receiver.cast_on_the_wire(1))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.FAILED
    assert "slot of version 1 was rewritten" in receipt.ack.error
    assert torch.equal(receiver.owner.policy.weight, before)
    assert receiver.core.models["policy"].version == 0
    assert receiver.transport.released == [(1, True)]


def test_a_zero_copy_model_owns_every_tensor_of_a_cast_version_uncast_ones_too():
    """Tensors that travel as they are (integers) are copied as well: the model never
    lives in data handed back to the transport."""
    receiver = _Receiver(zero_copy=True)
    receiver.owner.policy.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    receiver.spec = receiver.core.models["policy"].destination(receiver.owner)[1]
    update = receiver.update(2)
    wire = [
        t if not t.is_floating_point() else t.to(torch.bfloat16)
        for t in receiver.transport.staged[2]
    ]
    receiver.transport.staged[2] = wire
    update = dataclasses.replace(
        update, wire_spec=WeightSpec.of(dict(zip(receiver.spec.names, wire, strict=True)))
    )
    assert receiver.core.receive(update) == AckNow(_ack(2, AckStatus.APPLIED))
    steps = receiver.owner.policy.steps
    assert steps.dtype == torch.int64 and torch.equal(steps, torch.full((2,), 2))
    assert all(t.data_ptr() != steps.data_ptr() for t in wire)
    assert receiver.transport.released == [(2, True)]


def test_on_applied_runs_after_each_version_and_what_it_raises_fails_the_ack():
    seen: list[tuple[str, int]] = []

    def on_applied(model: str, version: int) -> None:
        seen.append((model, version))
        if version == 2:
            raise RuntimeError("hook broke")

    receiver = _Receiver(on_applied=on_applied)
    assert receiver.core.receive(receiver.update(1)) == AckNow(_ack(1, AckStatus.APPLIED))
    receipt = receiver.core.receive(receiver.update(2))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.FAILED
    assert "version 2 was applied, but on_weights_applied raised" in receipt.ack.error
    assert "hook broke" in receipt.ack.error
    assert receipt.ack.timings is not None  # applied: the hub books it as held
    assert seen == [("policy", 1), ("policy", 2)]
    assert receiver.core.models["policy"].version == 2


def test_a_zero_copy_model_lives_in_its_staged_version_until_the_next_one():
    receiver = _Receiver(zero_copy=True)
    model = receiver.owner.policy
    receiver.core.receive(receiver.update(1))
    assert model.weight.data_ptr() == receiver.transport.staged[1][1].data_ptr()
    assert receiver.transport.released == []
    receiver.core.receive(receiver.update(2))
    assert model.weight.data_ptr() == receiver.transport.staged[2][1].data_ptr()
    assert receiver.transport.released == [(1, True)]


def test_a_zero_copy_model_that_moved_on_acks_applied_whatever_handing_back_raised(caplog):
    """The model lives in version 2 once rebound: its ack says so, and the core's books
    too, whatever handing version 1 back raised (it said FAILED and kept version 1)."""
    receiver = _Receiver(zero_copy=True)
    model = receiver.owner.policy
    receiver.core.receive(receiver.update(1))

    def release(payload, staged):
        raise TransportError("the transport's owner is gone (injected)")

    receiver.transport.release = release
    assert receiver.core.receive(receiver.update(2)) == AckNow(_ack(2, AckStatus.APPLIED))
    assert model.weight.data_ptr() == receiver.transport.staged[2][1].data_ptr()
    assert receiver.core.models["policy"].version == 2
    assert "could not hand version 1 back" in caplog.text


@pytest.mark.parametrize("hook_does", ["closes", "pulls_a_newer_version"])
def test_a_zero_copy_version_whose_hook_moved_the_model_out_is_handed_back_once(hook_does):
    """``on_weights_applied`` may close the receiver (or connect again, or pull): it
    runs inside the write, so retiring (or the newer version) moves the model out of
    version 2 and hands it back; the apply's own clean-up then found the model living
    elsewhere and handed version 2 back a second time (a shared-memory owner took the
    extra release for an early one of a later hold of that worker's)."""
    receiver: _Receiver

    def on_applied(model: str, version: int) -> None:
        if version != 2:
            return
        if hook_does == "closes":
            receiver.core.retire()
        else:
            assert receiver.core.receive(receiver.update(3)).ack.status is AckStatus.APPLIED

    receiver = _Receiver(zero_copy=True, on_applied=on_applied)
    assert receiver.core.receive(receiver.update(1)).ack.status is AckStatus.APPLIED
    assert receiver.core.receive(receiver.update(2)).ack.status is AckStatus.APPLIED
    receiver.core.retire()  # the model leaves the last version it lives in
    released = [payload for payload, _ in receiver.transport.released]
    assert released == ([1, 2] if hook_does == "closes" else [1, 2, 3])
    assert receiver.core._staging.payloads() == ()


class _Serving(_Transport):
    """:class:`_Transport` that records what it is asked to serve, as {name: tensor}."""

    def __init__(self) -> None:
        super().__init__()
        self.served: list[dict[str, torch.Tensor]] = []

    def serve(self, payload: Any, tensors: Any, spec: WeightSpec) -> None:
        self.served.append(dict(tensors))


@pytest.mark.parametrize(
    "changed",
    [torch.nn.Linear(4, 2), torch.nn.Linear(3, 2).to(torch.float64)],
    ids=["reshaped", "retyped"],
)
def test_a_holder_whose_model_changed_since_it_applied_the_version_serves_none(changed):
    """A late joiner pulls version 1, served by a receiver that applied it and whose
    user then replaced its model by one of another shape or dtype (a model changed
    between versions is supported): it streamed the model's bytes as they are now,
    sliced by the version's layout, and the joiner applied and acked them as version 1
    (or failed with a bare size error). It refuses, saying why; the unchanged model
    serves."""
    receiver = _Receiver()
    serving = _Serving()
    receiver.core.transport = receiver.transport = serving
    assert receiver.core.receive(receiver.update(1)).ack.status is AckStatus.APPLIED
    request = ServeRequest("policy", 1, receiver.spec, "stream", receiver.spec.digest)
    assert receiver.core.serve(request) is None
    assert [sorted(tensors) for tensors in serving.served] == [["bias", "weight"]]

    receiver.owner.policy = changed
    why = receiver.core.serve(request)
    assert why is not None and "changed since it applied version 1" in why
    assert receiver.spec.digest in why
    assert len(serving.served) == 1  # nothing more sent


def _while_a_method_runs(receiver: _Receiver, deliver: Callable[[], Any]) -> Any:
    """``deliver()``'s result, called on an async actor's loop while a user method is
    parked holding the model; the method returns after it."""

    async def main() -> Any:
        parked, finish = asyncio.Event(), asyncio.Event()

        async def user_method() -> None:
            async with receiver.core.gate.reading_async():
                parked.set()
                await finish.wait()

        method = asyncio.create_task(user_method())
        await parked.wait()
        result = deliver()
        finish.set()
        await method
        return result

    return asyncio.run(main())


def test_a_busy_async_actor_defers_the_apply_and_acks_it_from_the_safe_point():
    receiver = _Receiver()

    def deliver() -> Any:
        receipt = receiver.core.receive(receiver.update(1))
        assert receiver.core.models["policy"].version == 0
        assert receiver.hub.acks == []
        return receipt

    receipt = _while_a_method_runs(receiver, deliver)
    assert receipt == ACK_LATER and reply_to_hub(receipt) is None
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]
    assert receiver.core.models["policy"].version == 1


def test_a_version_staged_before_the_core_registered_again_goes_back_where_it_was_fetched():
    """The hub watch registered the core again (a new transport receiver) while a
    version waited for its safe point: it is handed back to the transport that fetched
    it, which holds it (the new one knew nothing of it: a distributed one took it for a
    version never read and entered its collective again)."""
    receiver = _Receiver()
    fetched_by, reopened = receiver.transport, _Transport()

    def deliver() -> Any:
        receipt = receiver.core.receive(receiver.update(1))
        receiver.core.transport = reopened
        return receipt

    assert _while_a_method_runs(receiver, deliver) == ACK_LATER
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]
    assert fetched_by.released == [(1, True)] and reopened.released == []


def test_a_version_staged_before_the_core_registered_again_is_acked_to_its_registration():
    """The hub awaits the ack of a delivery under the token it delivered to: one
    applied after the core registered again (a new token) still carries the old one,
    for the old delivery, superseded or applied."""
    receiver = _Receiver()

    def deliver() -> Any:
        receipts = [receiver.core.receive(receiver.update(v)) for v in (1, 2)]
        receiver.core.token = "registered again"
        return receipts

    assert _while_a_method_runs(receiver, deliver) == [ACK_LATER, ACK_LATER]
    assert receiver.hub.acks == [_ack(2, AckStatus.APPLIED), _ack(1, AckStatus.SUPERSEDED)]
    assert [ack.token for ack in receiver.hub.acks] == ["token", "token"]


def test_a_version_delivered_to_a_registration_the_core_has_not_taken_in_is_acked_to_it():
    """The hub registered the core again (the core's call gave up waiting for its reply,
    or has not taken the new token in yet) and delivers under the new registration: the
    ack, now or deferred, answers that delivery, not the token the core still holds."""
    receiver = _Receiver()
    now = receiver.core.receive(dataclasses.replace(receiver.update(1), token="the hub's"))
    assert reply_to_hub(now) == _ack(1, AckStatus.APPLIED)
    assert reply_to_hub(now).token == "the hub's"

    def deliver() -> Any:
        return receiver.core.receive(dataclasses.replace(receiver.update(2), token="the hub's"))

    assert _while_a_method_runs(receiver, deliver) == ACK_LATER
    assert receiver.hub.acks == [_ack(2, AckStatus.APPLIED)]
    assert [ack.token for ack in receiver.hub.acks] == ["the hub's"]
    assert receiver.core.token == "token"


def test_a_learners_own_delivery_replaced_by_another_learners_of_its_number_conflicts():
    """Two learners delivering themselves guessed the same next version; both wait for
    a busy async actor's safe point and the later one replaces the first. The first is
    answered CONFLICT, not SUPERSEDED: if the hub booked the first learner's under that
    number, it then delivers its own update of it (else the actor would hold the other
    learner's weights under that number, acked as the first's)."""
    receiver = _Receiver()
    first, second = (
        dataclasses.replace(receiver.update(6), origin=o, from_learner=True) for o in ("a", "b")
    )

    receipts = _while_a_method_runs(
        receiver, lambda: [receiver.core.receive(u) for u in (first, second)]
    )
    assert receipts == [ACK_LATER, ACK_LATER]
    assert [(a.origin, a.status) for a in receiver.hub.acks] == [
        ("b", AckStatus.APPLIED),
        ("a", AckStatus.CONFLICT),
    ]


def _counting_fetches(receiver: _Receiver) -> list[int]:
    """The payloads ``receiver``'s transport is asked to fetch, from now on."""
    fetched: list[int] = []
    fetch = receiver.transport.fetch

    def counted(payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
        fetched.append(payload)
        return fetch(payload, spec)

    receiver.transport.fetch = counted  # type: ignore[method-assign]
    return fetched


def test_a_delivery_made_again_while_its_version_waits_for_a_safe_point_is_read_once():
    """The hub calls the same process again after ActorUnavailableError (its first call
    ran and staged the version): the second call neither reads nor releases it again
    (an RPC inbox hands a version out once: a second read waited out its timeout);
    one ack answers both."""
    receiver = _Receiver()
    fetched = _counting_fetches(receiver)
    update = receiver.update(1)

    receipts = _while_a_method_runs(
        receiver, lambda: [receiver.core.receive(update) for _ in range(2)]
    )
    assert receipts == [ACK_LATER, ACK_LATER]
    assert fetched == [1]
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]
    assert receiver.transport.released == [(1, True)]
    assert receiver.core.receive(update) == AckNow(_ack(1, AckStatus.SUPERSEDED))


def test_a_delivery_made_again_while_the_first_call_still_reads_is_answered_by_that_call():
    """A threaded host: the first call is still fetching when the hub's second one
    comes. The second answers at once ("later"), and the first, having applied,
    sends its ack to the hub as well, since the call the hub awaits is the second."""
    receiver = _Receiver()
    update = receiver.update(1)
    fetch, reading, go_on = receiver.transport.fetch, threading.Event(), threading.Event()

    def slow_fetch(payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if not reading.is_set():  # the first call reads until let go on
            reading.set()
            go_on.wait()
        return fetch(payload, spec)

    receiver.transport.fetch = slow_fetch  # type: ignore[method-assign]
    first: list[Any] = []
    call = threading.Thread(target=lambda: first.append(receiver.core.receive(update)))
    call.start()
    reading.wait()
    try:
        again = receiver.core.receive(update)
    finally:
        go_on.set()
        call.join()
    assert again == ACK_LATER
    assert first == [AckNow(_ack(1, AckStatus.APPLIED))]
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]
    assert receiver.transport.released == [(1, True)]


def test_an_async_hosts_loop_runs_on_while_a_delivery_reads_and_the_write_runs_there():
    """Ray runs a delivery into an async actor outside its event loop. The whole receive
    was handed to the loop, fetch included: every coroutine of the host froze while a
    version was read (an RPC version that never landed: for the transport's timeout).
    The version is read on the delivering thread now, and only written on the loop."""
    appliers: list[int] = []
    receiver = _Receiver(on_applied=lambda model, version: appliers.append(threading.get_ident()))
    update = receiver.update(1)
    fetch, reading, go_on = receiver.transport.fetch, threading.Event(), threading.Event()

    def slow_fetch(payload: int, spec: WeightSpec) -> Sequence[torch.Tensor]:
        reading.set()
        go_on.wait()
        return fetch(payload, spec)

    receiver.transport.fetch = slow_fetch  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever)
    loop_thread.start()
    key = f"attachment-{uuid.uuid4().hex}"
    attached.fill(key, receiver.core)
    replies: list[Any] = []
    try:

        async def read_once() -> int:  # an async host's method: the gate notes its loop
            async with receiver.core.gate.reading_async():
                return threading.get_ident()

        loop_ident = asyncio.run_coroutine_threadsafe(read_once(), loop).result(timeout=10)
        call = threading.Thread(target=lambda: replies.append(deliver(None, key, update)))
        call.start()
        assert reading.wait(timeout=10)
        # The host's coroutines run while the version is read.
        assert asyncio.run_coroutine_threadsafe(read_once(), loop).result(timeout=10)
        go_on.set()
        call.join()
    finally:
        go_on.set()
        attached.remove(key)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()
    assert replies == [_ack(1, AckStatus.APPLIED)]
    assert appliers == [loop_ident]  # written at the loop's safe point
    assert torch.equal(receiver.owner.policy.weight, torch.full((2, 3), 1.0))


def test_an_applied_version_acks_with_where_its_time_went():
    receiver = _Receiver()
    applied = receiver.core.receive(receiver.update(1)).ack
    timings = applied.timings
    assert timings is not None and min(timings.fetch_s, timings.wait_s, timings.apply_s) >= 0
    assert receiver.core.receive(receiver.update(1)).ack.timings is None  # superseded


def test_the_safe_point_wait_is_timed_apart_from_the_fetch_and_the_apply():
    receiver = _Receiver()
    held_for_s = 0.2

    async def deliver_while_a_method_runs() -> None:
        parked = asyncio.Event()

        async def user_method() -> None:
            async with receiver.core.gate.reading_async():
                parked.set()
                await asyncio.sleep(held_for_s)  # a user method running, not a handshake

        method = asyncio.create_task(user_method())
        await parked.wait()
        receiver.core.receive(receiver.update(1))
        await method

    asyncio.run(deliver_while_a_method_runs())
    (ack,) = receiver.hub.acks
    assert ack.timings is not None and ack.timings.wait_s >= held_for_s * 0.9, ack.timings


def test_the_hubs_reply_carries_the_ack_or_none_for_later():
    ack = _ack(3, AckStatus.SUPERSEDED)
    assert reply_to_hub(AckNow(ack)) is ack
    assert receipt_of_reply(ack) == AckNow(ack)
    assert isinstance(receipt_of_reply(None), AckLater)


def test_apply_now_acks_what_it_applied_and_raises_what_failed():
    def on_applied(model: str, version: int) -> None:
        if version == 2:
            raise RuntimeError("hook broke")

    receiver = _Receiver(on_applied=on_applied)
    receiver.core.apply_now(receiver.update(1), "on pull")
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]
    with pytest.raises(RaySyncError, match="could not apply version 2 of model 'policy' on pull"):
        receiver.core.apply_now(receiver.update(2), "on pull")
    with pytest.raises(SpecMismatchError, match="has spec digest other"):
        receiver.core.apply_now(receiver.update(3, digest="other"), "on pull")
    assert receiver.hub.acks == [_ack(1, AckStatus.APPLIED)]


def test_a_welcome_whose_data_is_gone_leaves_the_model_behind():
    receiver = _Receiver()
    gone = Update("policy", 4, receiver.spec.digest, "object_store", 4)
    receiver.core.apply_welcome(Welcome("object_store", None, {"policy": gone}))
    assert receiver.core.behind == {"policy"}
    assert receiver.core.models["policy"].version == 0
    assert receiver.transport.released == [(4, False)]


def test_model_id_names_the_only_model_or_checks_the_one_named():
    receiver = _Receiver()
    assert receiver.core.model_id(None) == "policy"
    assert receiver.core.model_id("policy") == "policy"
    with pytest.raises(UnknownModelError, match="holds no model 'critic'"):
        receiver.core.model_id("critic")


def test_close_ends_the_connection():
    receiver = _Receiver()
    receiver.core.close()
    assert receiver.core.closed.is_set()


def test_registering_again_keeps_the_old_token_and_transport_if_the_new_one_fails(
    monkeypatch,
):
    """The hub knows the new registration, but its transport receiver could not be
    opened here: the core keeps what it had (the hub watch's next beat, finding the old
    token unknown, registers again) rather than a closed transport under a new token,
    and takes the new registration back from the hub (nobody here holds it)."""
    from raysync import receiver_core

    receiver = _Receiver()
    receiver.hub.actor.register = SimpleNamespace(remote=lambda registration: "welcome ref")
    left: list[tuple[str, str]] = []
    receiver.hub.actor.leave = SimpleNamespace(remote=lambda *sent: left.append(sent))
    new_token = SimpleNamespace(token="new token")  # what the hub now knows
    monkeypatch.setattr(receiver_core, "_registration", lambda *args, **kwargs: new_token)
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: Welcome("x", None, {}))

    def cannot_open(welcome: Welcome) -> TransportReceiver:
        raise TransportError("no shared memory here")

    monkeypatch.setattr(receiver_core, "_open_transport", cannot_open)
    closed: list[bool] = []
    monkeypatch.setattr(receiver.transport, "close", lambda: closed.append(True), raising=False)
    with pytest.raises(TransportError, match="no shared memory"):
        receiver.core.register_again(5.0)
    assert receiver.core.token == "token" and receiver.core.transport is receiver.transport
    assert closed == [] and left == [(receiver.core.worker, "new token")]


def test_registering_again_withdraws_a_registration_the_hub_did_not_answer_in_time(monkeypatch):
    """The hub watch's registration timed out: the hub may still take it in, under a
    token nobody here holds, which broadcasts target (a collective waits for that
    member) until the next beat replaces it. It is withdrawn; the core keeps its own."""
    from raysync import receiver_core

    receiver = _Receiver()
    receiver.hub.actor.register = SimpleNamespace(remote=lambda registration: "welcome ref")
    left: list[tuple[str, str]] = []
    receiver.hub.actor.leave = SimpleNamespace(remote=lambda *sent: left.append(sent))
    monkeypatch.setattr(
        receiver_core, "_registration", lambda *args, **kwargs: SimpleNamespace(token="late")
    )

    def not_answered(ref: Any, timeout: float | None = None) -> Any:
        raise ray.exceptions.GetTimeoutError("the hub did not answer")

    monkeypatch.setattr(receiver_core.ray, "get", not_answered)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        receiver.core.register_again(5.0)
    assert left == [(receiver.core.worker, "late")]
    assert receiver.core.token == "token" and receiver.core.transport is receiver.transport


class _Declining(_Transport):
    """:class:`_Transport` that also records each payload declined (handed back unread)."""

    def __init__(self) -> None:
        super().__init__()
        self.declined: list[int] = []
        self.handed_back = threading.Event()

    def decline(self, payload: int) -> None:
        self.declined.append(payload)
        self.handed_back.set()


@pytest.mark.parametrize("closed_first", [False, True])
@pytest.mark.parametrize(
    "gave_up", [ray.exceptions.GetTimeoutError("the hub did not answer"), KeyboardInterrupt()]
)
def test_a_pull_that_stopped_waiting_declines_what_the_hub_answers_later(
    monkeypatch, gave_up, closed_first
):
    """A pull gives up on the hub (timed out, interrupted) and the hub answers later
    all the same: the latest version, planned for this receiver with a hold on its
    payload (a shared-memory slot its learner cannot reuse). Nothing handed that hold
    back: a few such pulls took every slot of the learner's, and each broadcast then
    failed. It is declined once when the answer comes, also by a receiver closed by
    then: declined, not released, so its transport lets go of that plan's hold alone."""
    bound_s = 30.0  # a failure, not a hang: the decline follows the answer at once
    receiver = _Receiver()
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    call = SimpleNamespace(future=lambda: answer)  # the hub's ``latest`` call, unanswered
    receiver.hub.actor.latest = SimpleNamespace(remote=lambda *args, **kwargs: call)

    def not_answered(ref: Any, timeout: float | None = None) -> Any:
        raise gave_up

    monkeypatch.setattr(receiver_core.ray, "get", not_answered)
    transport = receiver.core.transport = _Declining()
    with pytest.raises(type(gave_up)):
        receiver.core.latest("policy", 5.0)
    if closed_first:
        receiver.core.close()
    answer.set_result(Update("policy", 3, receiver.spec.digest, "shared_memory", 3))
    assert transport.handed_back.wait(bound_s), "the version planned for the pull stays held"
    assert transport.declined == [3] and transport.released == []


class _RegisteringHub(_Hub):
    """A stand-in hub whose ``register`` answers once ``answer`` is set (with the test's
    ``ray.get``, :func:`_get`); records registrations and leaves, with their tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[str] = []
        self.left: list[str] = []
        self.asked = threading.Event()
        self.answer = threading.Event()

        def register(registration: Any) -> str:
            self.registered.append(registration.token)
            return "welcome"

        self.actor.register = SimpleNamespace(remote=register)
        self.actor.leave = SimpleNamespace(remote=lambda worker, token: self.left.append(token))

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if ref != "welcome":
            return None
        self.asked.set()
        assert self.answer.wait(timeout)
        return Welcome("object_store", None, {})


@pytest.fixture
def registering(monkeypatch) -> _Receiver:
    from raysync import receiver_core

    receiver = _Receiver()
    hub = receiver.core.hub = _RegisteringHub()
    monkeypatch.setattr(receiver_core.ray, "get", hub.get)
    # Made without Ray's runtime context (asking for one starts a local cluster).
    monkeypatch.setattr(
        receiver_core,
        "_registration",
        lambda *args, **kwargs: SimpleNamespace(token=uuid.uuid4().hex),
    )
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: _Transport())
    return receiver


@pytest.mark.parametrize("ends", ["leave_hub", "close"])
def test_a_core_that_left_or_closed_registers_again_no_more(registering, ends):
    core, hub = registering.core, registering.core.hub
    hub.answer.set()
    core.leave_hub(5.0) if ends == "leave_hub" else core.close()
    assert core.register_again(5.0) is None
    assert hub.registered == []


def test_leaving_waits_for_a_registration_in_flight_and_leaves_with_its_token(registering):
    """The hub watch registers again while the host leaves the hub: the registration
    the hub ends up knowing is the one that leaves, none is left behind."""
    core, hub = registering.core, registering.core.hub
    watch = threading.Thread(target=core.register_again, args=(5.0,))
    watch.start()
    assert hub.asked.wait(5.0)  # the registration is at the hub
    leaving = threading.Thread(target=core.leave_hub, args=(5.0,))
    leaving.start()
    hub.answer.set()
    watch.join(5.0)
    leaving.join(5.0)
    assert hub.left == hub.registered == [core.token]
    assert core.register_again(5.0) is None


def test_a_retired_core_applies_no_version_and_hands_the_staged_one_back():
    """Once this process's next registration replaced the core (or it closed), a
    version it staged that reaches the safe point is not applied: the model keeps its
    version, the staged data goes back, and the ack says it is no longer attached."""
    receiver = _Receiver()
    model = receiver.owner.policy
    assert receiver.core.receive(receiver.update(1)).ack.status is AckStatus.APPLIED
    receiver.core.retire()
    receipt = receiver.core.receive(receiver.update(2))
    assert isinstance(receipt, AckNow)
    assert receipt.ack.status is AckStatus.NOT_ATTACHED
    assert "registered again or closed before version 2" in (receipt.ack.error or "")
    assert torch.equal(model.weight, torch.full((2, 3), 1.0))
    assert receiver.core.models["policy"].version == 1
    assert receiver.transport.released == [(1, True), (2, True)]


def test_a_version_superseded_by_one_the_retired_core_did_not_apply_is_not_acked_held():
    """Versions 2 and 3 wait for a busy async actor's safe point (3 supersedes 2), and
    the process registers again before it comes: neither is applied, and 2 is not
    acked as held (SUPERSEDED would tell the hub this worker holds version 2)."""
    receiver = _Receiver()

    def deliver_then_register_again() -> list[Any]:
        receipts = [receiver.core.receive(receiver.update(v)) for v in (2, 3)]
        receiver.core.retire()
        return receipts

    assert _while_a_method_runs(receiver, deliver_then_register_again) == [ACK_LATER] * 2
    assert [(a.version, a.status) for a in receiver.hub.acks] == [
        (3, AckStatus.NOT_ATTACHED),
        (2, AckStatus.NOT_ATTACHED),
    ]
    assert "superseded while waiting for a safe point by version 3" in (
        receiver.hub.acks[1].error or ""
    )
    assert receiver.core.models["policy"].version == 0


def test_a_new_registrations_version_never_follows_a_retired_cores_waiting_one():
    """An async actor registers again with another hub while hub A's version 500 waits
    for its safe point: hub B's version 3 is no older than it (another hub's numbers).
    It followed version 500 (same model id, lower rank) and took its NOT_ATTACHED ack,
    so hub B dropped the new registration and the model never got version 3."""
    receiver = _Receiver()
    other_hub = _Hub()
    identity = ReceiverIdentity(WORKER, "Collector(abc)", "attachment")
    welcome = Welcome("object_store", None, {})
    models = {"policy": HeldModel("policy", "policy")}

    def deliver_then_register_elsewhere() -> list[Any]:
        first = receiver.core.receive(receiver.update(500))
        receiver.core.retire()
        again = ReceiverCore(
            receiver.owner,
            other_hub,
            models,
            identity,
            welcome,
            "token 2",
            None,
            gate=receiver.core.gate,
            earlier_hubs={"token": receiver.hub},
            transport=receiver.transport,
        )
        return [first, again.receive(receiver.update(3))]

    assert _while_a_method_runs(receiver, deliver_then_register_elsewhere) == [ACK_LATER] * 2
    assert [(a.version, a.status) for a in receiver.hub.acks] == [(500, AckStatus.NOT_ATTACHED)]
    assert [(a.version, a.status) for a in other_hub.acks] == [(3, AckStatus.APPLIED)]
    assert models["policy"].version == 3
    assert torch.equal(receiver.owner.policy.weight, torch.full((2, 3), 3.0))


def test_a_deferred_ack_of_an_earlier_registration_goes_to_that_registrations_hub():
    """A core that took over an earlier registration's gate (one that may have been
    with another hub) sends that registration's late acks to its hub, not its own."""
    receiver = _Receiver()
    earlier = _Hub()
    receiver.core._earlier_hubs = {"earlier token": earlier}
    late = Ack(WORKER, "policy", 3, AckStatus.NOT_ATTACHED, token="earlier token")
    own = Ack(WORKER, "policy", 4, AckStatus.APPLIED, token="token")
    receiver.core.send_ack(late)
    receiver.core.send_ack(own)
    assert earlier.acks == [late] and receiver.hub.acks == [own]


def test_a_version_is_carried_over_to_the_same_model_only_not_one_rebuilt_in_its_place():
    """Registering again keeps the version a model held if the path still names that
    object. A model dropped and built again at the same path mostly gets the freed one's
    ``id()``, and took its version (the hub then offered the new, untrained one
    nothing)."""
    receiver = _Receiver()
    owner = receiver.owner
    held = HeldModel("policy", "policy", version=3, registered=SameObject(owner.policy))
    receiver.core.models["policy"] = held
    assert _carried_over(receiver.core, "policy", "policy", owner).version == 3
    owner.policy = None
    gc.collect()
    owner.policy = torch.nn.Linear(3, 2)
    assert _carried_over(receiver.core, "policy", "policy", owner).version == 0


def test_a_plain_dict_model_is_the_same_while_it_holds_the_same_tensors():
    state = {"w": torch.zeros(2), "b": torch.zeros(1)}
    same = SameObject(state)
    assert same(state)
    state["w"] = torch.ones(2)  # a new first tensor: another model in the same dict
    assert not same(state)
    assert not same({"w": torch.zeros(2), "b": torch.zeros(1)})


def test_a_lazily_stacked_tensordict_model_gets_each_version_in_its_modules():
    """Its leaves are stacked anew on each access: versions were copied into those
    copies and acked APPLIED, and the modules kept their weights."""
    from tensordict import TensorDict

    modules = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    receiver = _Receiver(model=TensorDict.from_modules(*modules, lazy_stack=True))
    assert receiver.core.receive(receiver.update(1)) == AckNow(_ack(1, AckStatus.APPLIED))
    assert receiver.core.receive(receiver.update(2)) == AckNow(_ack(2, AckStatus.APPLIED))
    for module in modules:
        assert torch.equal(module.weight, torch.full((2, 3), 2.0))
        assert torch.equal(module.bias, torch.full((2,), 2.0))


def test_retiring_a_zero_copy_model_the_host_let_go_of_hands_its_memory_back():
    """The host deleted the attribute its model was attached at, then closed: retiring
    raised ModelPathError, and a receiver's close never left the hub (every broadcast
    then failed it, and its watch registered it again)."""
    receiver = _Receiver(zero_copy=True)
    receiver.core.receive(receiver.update(1))
    copying = _Receiver()  # a copied model is not looked up at all
    copying.core.receive(copying.update(1))
    del receiver.owner.policy, copying.owner.policy
    receiver.core.retire()
    copying.core.retire()
    assert receiver.transport.released == [(1, True)]
    assert receiver.core.models["policy"].adoption.current is None


def test_a_version_turned_down_by_a_reshaped_model_is_handed_back_unread(monkeypatch):
    """A transport whose receivers each take part in moving a version (a collective)
    has a turned-down version read all the same. By a model replaced since by one of
    another shape, it was read in that shape's layout (a collective's buffer of another
    size, which broke the others' collective too); it is handed back unread now, which
    such a transport sits out."""
    from raysync import receiver_core

    receiver = _Receiver()
    update = receiver.update(1)
    assert receiver.core.receive(update) == AckNow(_ack(1, AckStatus.APPLIED))
    receiver.owner.policy = torch.nn.Linear(4, 2)  # another shape, after connect_hub
    reads_refused = SimpleNamespace(reads_refused=True)
    monkeypatch.setattr(receiver_core, "get_transport", lambda name: reads_refused)
    fetched: list[int] = []
    fetch = receiver.transport.fetch
    receiver.transport.fetch = lambda payload, spec: fetched.append(payload) or fetch(payload, spec)
    assert receiver.core.receive(update) == AckNow(_ack(1, AckStatus.SUPERSEDED))
    assert fetched == [] and receiver.transport.released[-1] == (1, False)


def test_a_deferred_version_superseded_while_its_transport_fails_to_take_it_back_is_acked(
    caplog,
):
    """Two versions wait for an async host's safe point; handing the older one's data
    back raised, and the gate lost that version's ack (the hub timed it out)."""
    receiver = _Receiver()

    def deliver_two() -> list[Any]:
        first = receiver.core.receive(receiver.update(1))

        def release(payload, staged):
            raise TransportError("the transport's owner is gone (injected)")

        receiver.transport.release = release
        return [first, receiver.core.receive(receiver.update(2))]

    assert _while_a_method_runs(receiver, deliver_two) == [ACK_LATER, ACK_LATER]
    assert receiver.hub.acks == [_ack(2, AckStatus.APPLIED), _ack(1, AckStatus.SUPERSEDED)]
    assert "could not hand version 1 of model 'policy' back" in caplog.text


def test_a_core_registered_again_applies_learners_deliveries_again(registering):
    """The hub told its receivers it was shutting down (no learner's own delivery
    applied) and then came back (Ray restarted it before it ended): registered with the
    new incarnation, the core still failed every version a learner delivered itself."""
    core, hub = registering.core, registering.core.hub
    core.refuse_learner_deliveries(core.token)
    refused = core.receive(dataclasses.replace(registering.update(2), from_learner=True))
    assert isinstance(refused, AckNow) and "shutting down" in (refused.ack.error or "")
    hub.answer.set()
    assert core.register_again(5.0) is not None
    core.transport = registering.transport  # the new registration's, serving the same
    receipt = core.receive(dataclasses.replace(registering.update(3), from_learner=True))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.APPLIED


def test_a_hub_closing_while_a_core_registers_with_it_again_is_heeded(registering):
    """The hub (a new incarnation) began to close while the core registered with it
    again, and told the new registration before the core took it up: the core applied
    learners' own deliveries anyway (registering again lifted every refusal)."""
    core, hub = registering.core, registering.core.hub
    watch = threading.Thread(target=core.register_again, args=(5.0,))
    watch.start()
    assert hub.asked.wait(5.0)  # the registration is at the hub
    core.refuse_learner_deliveries(hub.registered[-1])
    hub.answer.set()
    watch.join(5.0)
    assert core.token == hub.registered[-1]
    core.transport = registering.transport  # the new registration's, serving the same
    refused = core.receive(dataclasses.replace(registering.update(2), from_learner=True))
    assert isinstance(refused, AckNow) and "shutting down" in (refused.ack.error or "")


def test_an_earlier_hubs_refusal_that_comes_late_is_not_heeded(registering):
    """The closing hub's notice to the core's earlier registration came after the core
    had registered with a new incarnation: learners' deliveries are applied."""
    core, hub = registering.core, registering.core.hub
    earlier = core.token
    hub.answer.set()
    assert core.register_again(5.0) is not None
    core.refuse_learner_deliveries(earlier)
    core.transport = registering.transport
    receipt = core.receive(dataclasses.replace(registering.update(2), from_learner=True))
    assert isinstance(receipt, AckNow) and receipt.ack.status is AckStatus.APPLIED


def test_a_core_keeps_the_hubs_of_its_last_registrations_only():
    """Each connect of a host that connects again and again handed the new core every
    earlier registration's hub, for acks of versions deferred under them: one more
    entry per connect, for the actor's life."""
    from raysync import receiver_core

    receiver = _Receiver()
    kept = receiver_core._EARLIER_HUBS_KEPT
    receiver.core._earlier_hubs = {f"earlier {n}": _Hub() for n in range(3 * kept)}
    handed = receiver.core.hubs_to_ack_later()
    assert list(handed) == [*(f"earlier {n}" for n in range(2 * kept + 1, 3 * kept)), "token"]
    assert handed["token"] is receiver.hub


def test_a_version_deferred_before_the_hub_watch_registered_again_acks_to_that_hub(monkeypatch):
    """Deferred under the first token, then the hub watch registered again (a second
    token) and the host moved to another hub: the ack of the first token went to the
    new hub, and the old one waited out its deadline for it (TIMEOUT)."""
    receiver = _Receiver()
    core, first_hub, next_hub = receiver.core, receiver.core.hub, _Hub()
    monkeypatch.setattr(
        receiver_core, "_registration", lambda *args, **kwargs: SimpleNamespace(token="T2")
    )
    first_hub.actor.register = SimpleNamespace(remote=lambda registration: "its welcome")
    welcome = Welcome("object_store", None, {})
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: welcome)
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: _Transport())

    def deliver() -> Any:
        receipt = core.receive(receiver.update(1))  # deferred under "token"
        core.register_again(5.0)  # the hub watch, with the same hub: token T2
        hubs = core.hubs_to_ack_later()
        core.retire()  # connect_hub to another hub replaces the core
        ReceiverCore(
            receiver.owner,
            next_hub,
            {"policy": HeldModel("policy", "policy")},
            core.identity,
            welcome,
            "T3",
            None,
            gate=core.gate,
            earlier_hubs=hubs,
            transport=_Transport(),
        )
        return receipt

    assert _while_a_method_runs(receiver, deliver) == ACK_LATER
    assert [(a.token, a.status) for a in first_hub.acks] == [("token", AckStatus.NOT_ATTACHED)]
    assert next_hub.acks == []


@pytest.mark.parametrize("zero_copy", [False, True])
def test_registering_again_keeps_the_versions_staged_and_the_one_lived_in(monkeypatch, zero_copy):
    """The hub watch registers again while a version waits for its safe point: the
    registration keeps it (``kept``, beside the version a zero-copy model lives in).
    The node's owner drops every hold of the worker's but those: one left out was
    applied after from a slot the learner could rewrite meanwhile (copied: failed for
    it; adopted: the model lived in memory nobody held)."""
    receiver = _Receiver(zero_copy=zero_copy)
    core = receiver.core
    registrations: list[Any] = []
    core.hub.actor.register = SimpleNamespace(remote=registrations.append)
    _registering_here(monkeypatch)
    lived_in = (1,) if zero_copy else ()
    core.receive(receiver.update(1))

    def deliver_then_register_again() -> Any:
        receipt = core.receive(receiver.update(2))
        core.register_again(5.0)
        return receipt

    assert _while_a_method_runs(receiver, deliver_then_register_again) == ACK_LATER
    assert registrations[-1].kept == (*lived_in, 2)
    assert core.models["policy"].version == 2
    core.register_again(5.0)
    assert registrations[-1].kept == ((2,) if zero_copy else ())


@pytest.mark.parametrize(
    ("worker", "transport", "carried"),
    [("w", None, True), ("w", "shared_memory", True), ("other", None, False), ("w", "nixl", False)],
)
def test_a_zero_copy_model_lives_on_in_the_staged_version_only_as_the_same_worker(
    worker, transport, carried
):
    """``attach(replaces=old, worker_id=another, zero_copy=True)``: the model went on
    living in the old registration's shared-memory slot, which the owner held for the
    old worker id alone; that hold went when the old registration left, and the learner
    could rewrite the slot under the model. Under another worker id (or transport) the
    model moves into memory of its own first."""
    previous = SimpleNamespace(worker="w", transport_name="shared_memory")
    hub = SimpleNamespace(transport="shared_memory")
    identity = ReceiverIdentity(
        worker, "Actor(1)", "attachment", transport=transport, zero_copy=True
    )
    assert receiver_core._adoptions_carry_over(previous, identity, hub) is carried


def test_a_zero_copy_model_the_next_registration_leaves_out_moves_into_its_own_memory(
    monkeypatch,
):
    """``connect_hub`` again, as the same worker by the same transport, with the critic
    left out: the critic went on living in the staged version of the registration it
    left, which no registration kept (the node's owner let its slot go) and nobody
    released. It takes a copy of its own and hands that memory back; the policy, carried
    over, lives on where it is."""
    owner = SimpleNamespace(policy=torch.nn.Linear(3, 2), critic=torch.nn.Linear(3, 2))
    hub = _Hub()
    hub.transport = "shared_memory"
    identity = ReceiverIdentity(
        WORKER, "Collector(abc)", "first", transport="shared_memory", zero_copy=True
    )
    models = {
        m: HeldModel(m, m, registered=SameObject(getattr(owner, m))) for m in ("policy", "critic")
    }
    transport = _Transport()
    welcome = Welcome("shared_memory", None, {})
    core = ReceiverCore(owner, hub, models, identity, welcome, "token", None, transport=transport)
    for payload, model in enumerate(("policy", "critic"), start=1):
        spec = models[model].destination(owner)[1]
        transport.staged[payload] = [torch.full(e.shape, float(payload)) for e in spec.tensors]
        update = Update(model, 1, spec.digest, "shared_memory", payload)
        assert core.receive(update).ack.status is AckStatus.APPLIED
    registrations: list[Any] = []
    hub.actor.register = SimpleNamespace(remote=registrations.append)
    process = SimpleNamespace(get_node_id=lambda: "node", get_worker_id=lambda: "process")
    monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: process)
    monkeypatch.setattr(receiver_core, "_host_actor", lambda: None)
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: welcome)
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: _Transport())

    again, _ = ReceiverCore.register(
        owner,
        hub,
        {"policy": "policy"},
        dataclasses.replace(identity, attachment="second"),
        previous=core,
    )
    try:
        assert registrations[-1].kept == (1,)
        assert owner.policy.weight.data_ptr() == transport.staged[1][1].data_ptr()
        slot = {t.data_ptr() for t in transport.staged[2]}
        assert not {t.data_ptr() for t in owner.critic.parameters()} & slot
        assert torch.equal(owner.critic.weight, torch.full((2, 3), 2.0))
        assert transport.released == [(2, True)]
    finally:
        again.close()


class _SaysWhoWaits(threading.Condition):
    """The gate's condition, setting ``waited`` once the thread named ``who`` waits in it."""

    def __init__(self, who: str, waited: threading.Event) -> None:
        super().__init__()
        self._who, self._waited = who, waited

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread().name == self._who:
            self._waited.set()
        return super().wait(timeout)


def test_retiring_on_an_event_loop_waits_for_a_write_another_thread_applies():
    """An async host pulls in a thread (``asyncio.to_thread``) while a coroutine closes
    the receiver: retiring ran at once on the loop and moved the zero-copy model out of
    version 1, then the pull rebound it to version 2, memory nobody holds once closed.
    Retiring waits for that write, then moves the model out of version 2."""
    bound_s = 30.0  # a failure, not a hang: each wait ends in milliseconds
    receiver = _Receiver(zero_copy=True)
    core = receiver.core
    assert core.receive(receiver.update(1)).ack.status is AckStatus.APPLIED
    update = receiver.update(2)
    applying, go_on = threading.Event(), threading.Event()

    def check_intact(payload: int) -> None:
        if payload == 2 and not applying.is_set():  # the pull, inside its apply
            applying.set()
            go_on.wait(bound_s)

    receiver.transport.check_intact = check_intact  # type: ignore[method-assign]
    waiting_or_done = threading.Event()
    core.gate._cond = _SaysWhoWaits("closing", waiting_or_done)
    pull = threading.Thread(target=lambda: core.receive(update), daemon=True)
    pull.start()
    assert applying.wait(bound_s)

    async def close_on_the_loop() -> None:
        core.retire()

    def close() -> None:
        asyncio.run(close_on_the_loop())
        waiting_or_done.set()

    closing = threading.Thread(target=close, name="closing", daemon=True)
    closing.start()
    assert waiting_or_done.wait(bound_s)
    go_on.set()
    pull.join(bound_s)
    closing.join(bound_s)
    assert not pull.is_alive() and not closing.is_alive()
    slot = {t.data_ptr() for t in receiver.transport.staged[2]}
    assert not {t.data_ptr() for t in receiver.owner.policy.parameters()} & slot
    assert receiver.transport.released.count((2, True)) == 1


def test_registering_again_that_fails_has_the_previous_registrations_watch_look_at_once(
    monkeypatch,
):
    """``connect_hub`` again whose transport receiver cannot open: the previous
    registration stays this process's, but the hub may have dropped it meanwhile (a
    broadcast reached it retired, or the hub booked the new one): its watch looked at
    its next heartbeat only, or never without one, while a zero-copy model carried over
    lived in memory nobody held."""
    owner = SimpleNamespace(policy=torch.nn.Linear(3, 2))
    hub = _Hub()
    identity = ReceiverIdentity(WORKER, "Collector(abc)", "first")
    models = {"policy": HeldModel("policy", "policy", registered=SameObject(owner.policy))}
    welcome = Welcome("object_store", None, {})
    core = ReceiverCore(
        owner, hub, models, identity, welcome, "token", None, transport=_Transport()
    )
    woken: list[bool] = []
    core.wake_watch = lambda: woken.append(True)
    hub.actor.register = SimpleNamespace(remote=lambda registration: "registered")
    hub.actor.leave = SimpleNamespace(remote=lambda worker, token: "left")
    process = SimpleNamespace(get_node_id=lambda: "node", get_worker_id=lambda: "process")
    monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: process)
    monkeypatch.setattr(receiver_core, "_host_actor", lambda: None)
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: welcome)

    def cannot_open(welcome: Welcome) -> TransportReceiver:
        raise RuntimeError("the transport receiver could not be opened")

    monkeypatch.setattr(receiver_core, "_open_transport", cannot_open)
    with pytest.raises(RuntimeError, match="could not be opened"):
        ReceiverCore.register(owner, hub, {"policy": "policy"}, identity, previous=core)
    try:
        assert woken == [True] and not core._retired
    finally:
        core.close()


class _BothInFlight:
    """A stand-in hub's ``register`` that holds each registration until the other
    thread's is in flight too (or that thread ended): two threads connecting at once.
    Each thread runs :meth:`attach` and records what it returned or raised."""

    bound_s = 30.0  # a failure, not a hang: each wait ends in milliseconds

    def __init__(self, hub: _Hub) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._ended = 0
        self.outcomes: list[Any] = []
        hub.actor.register = SimpleNamespace(remote=self._register)

    def _register(self, registration: Any) -> str:
        with self._cond:
            self._in_flight += 1
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._in_flight + self._ended >= 2, self.bound_s)
        return "welcome"

    def attach(self, connect: Callable[[], Any]) -> None:
        try:
            outcome = connect()
        except Exception as err:
            outcome = err
        with self._cond:
            self.outcomes.append(outcome)
            self._ended += 1
            self._cond.notify_all()

    def run(self, *connects: Callable[[], Any]) -> list[Any]:
        threads = [threading.Thread(target=self.attach, args=(c,), daemon=True) for c in connects]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.bound_s)
        assert not any(thread.is_alive() for thread in threads)
        return self.outcomes


def _registering_here(monkeypatch) -> None:
    """``ReceiverCore.register`` without Ray: every hub answers a Welcome at once."""
    process = SimpleNamespace(get_node_id=lambda: "node", get_worker_id=lambda: "process")
    monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: process)
    monkeypatch.setattr(receiver_core, "_host_actor", lambda: None)
    welcome = Welcome("object_store", None, {})
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: welcome)
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: _Transport())


def test_two_threads_attaching_as_one_worker_at_once_leave_one_registration(monkeypatch):
    """A threaded host attaches two models from two threads under one worker id: each
    checked that no receiver was attached as that worker while the other was still
    connecting (reserved, not yet filled), and both registered: the hub keeps one per
    worker, so each replaced the other at every heartbeat. One is refused, naming it."""
    _registering_here(monkeypatch)
    hub = _Hub()
    both = _BothInFlight(hub)
    owner = SimpleNamespace(policy=torch.nn.Linear(3, 2), critic=torch.nn.Linear(3, 2))

    def connect(model: str) -> Callable[[], ReceiverCore]:
        identity = ReceiverIdentity(WORKER, "Collector(abc)", uuid.uuid4().hex)
        return lambda: ReceiverCore.register(owner, hub, {model: model}, identity)[0]

    outcomes = both.run(connect("policy"), connect("critic"))
    try:
        refused = [o for o in outcomes if isinstance(o, ValueError)]
        assert len(refused) == 1, outcomes
        assert f"as worker {WORKER!r} already (connecting now" in str(refused[0])
        assert sum(isinstance(o, ReceiverCore) for o in outcomes) == 1
        assert [r.worker for r in attached.receivers() if isinstance(r, ReceiverCore)] == [WORKER]
    finally:
        for outcome in outcomes:
            if isinstance(outcome, ReceiverCore):
                outcome.close()


def test_a_receiver_replaced_already_is_not_replaced_again(monkeypatch):
    """Two threads connect again at once, each replacing the receiver they found (the
    mixin's ``connect_hub``), as other workers: the second waited for the first to
    replace it, then replaced it too, and both lived on, sharing its gate. It is
    refused, leaving the first's registration as it is; so is a later call still
    replacing the receiver the first one replaced."""
    bound_s = 30.0  # a failure, not a hang: each wait ends in milliseconds
    _registering_here(monkeypatch)
    owner = SimpleNamespace(policy=torch.nn.Linear(3, 2))
    hub = _Hub()
    hub.actor.leave = SimpleNamespace(remote=lambda worker, token: None)
    models = {"policy": HeldModel("policy", "policy", registered=SameObject(owner.policy))}
    first = ReceiverIdentity(WORKER, "Collector(abc)", uuid.uuid4().hex)
    welcome = Welcome("object_store", None, {})
    previous = ReceiverCore(
        owner, hub, models, first, welcome, "token", None, transport=_Transport()
    )
    attached.fill(first.attachment, previous)
    # The first registration is answered once the other thread waits to replace too: for
    # the core the first one took (it retired it first), or for its _registering.
    waited = threading.Event()
    previous._registering = SaysWhenWaitedFor(waited)  # type: ignore[assignment]
    previous._replacing_changed = SaysWhenWaitedOn(waited)
    hub.actor.register = SimpleNamespace(remote=lambda r: waited.wait(bound_s))
    outcomes: list[Any] = []

    def connect(worker: str) -> ReceiverCore:
        identity = ReceiverIdentity(worker, "Collector(abc)", uuid.uuid4().hex)
        core, _ = ReceiverCore.register(
            owner, hub, {"policy": "policy"}, identity, previous=previous
        )
        return core

    def attach(worker: str) -> None:
        try:
            outcomes.append(connect(worker))
        except ValueError as err:
            outcomes.append(err)

    threads = [threading.Thread(target=attach, args=(w,), daemon=True) for w in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(bound_s)
    cores = [o for o in outcomes if isinstance(o, ReceiverCore)]
    try:
        refused = [str(o) for o in outcomes if isinstance(o, ValueError)]
        assert len(cores) == 1 and len(refused) == 1, outcomes
        assert "was replaced by another connect_hub/attach already" in refused[0]
        assert attached.receivers() == cores and not cores[0]._retired
        with pytest.raises(ValueError, match="replaced by another"):
            connect("three")
        assert attached.receivers() == cores
    finally:
        for core in [previous, *cores]:
            core.close()


class _OfferingHub(_Hub):
    """A stand-in hub that answers each registration at once (the test's ``ray.get``
    passes it through) with a welcome offering ``latest`` to one holding an older
    version; records the registrations."""

    transport = "shared_memory"

    def __init__(self, latest: Update) -> None:
        super().__init__()
        self.latest = latest
        self.registrations: list[Any] = []
        self.actor.register = SimpleNamespace(remote=self._register)
        self.actor.leave = SimpleNamespace(remote=lambda worker, token: None)

    def _register(self, registration: Any) -> Welcome:
        self.registrations.append(registration)
        behind = registration.versions[self.latest.model] < self.latest.version
        return Welcome(self.transport, None, {self.latest.model: self.latest} if behind else {})


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_receiver_whose_replacement_failed_to_connect_is_replaced_by_the_next_try(
    monkeypatch, zero_copy
):
    """``connect_hub`` again (the mixin replaces the receiver it keeps) and the hub's
    welcome fails to apply (``on_weights_applied`` raised): the new registration had
    replaced the old one, then closed. Every ``connect_hub`` after was refused, the old
    receiver "replaced by another connect_hub/attach already", though none was
    returned. The next try replaces the old receiver: the version the failed one
    applied is offered and hooked again; each staged version a zero-copy model lived
    in goes back once (not again by the old receiver, whose model the failed one took
    over and moved on)."""
    process = SimpleNamespace(
        get_node_id=lambda: "node", get_worker_id=lambda: "process", get_actor_id=lambda: "abc"
    )
    monkeypatch.setattr(receiver_core.ray, "get_runtime_context", lambda: process)
    monkeypatch.setattr(receiver_core, "_host_actor", lambda: None)
    monkeypatch.setattr(receiver_core.ray, "get", lambda ref, timeout=None: ref)
    transport = _Transport()
    monkeypatch.setattr(receiver_core, "_open_transport", lambda welcome: transport)
    owner = SimpleNamespace(policy=torch.nn.Linear(3, 2))
    spec = HeldModel("policy", "policy").destination(owner)[1]

    def staged(version: int) -> Update:
        transport.staged[version] = [torch.full(e.shape, float(version)) for e in spec.tensors]
        return Update("policy", version, spec.digest, "shared_memory", version)

    hub = _OfferingHub(staged(1))
    hooked: list[int] = []
    failures = [RuntimeError("on_weights_applied failed (injected)")]

    def on_applied(model: str, version: int) -> None:
        hooked.append(version)
        if version == 2 and failures:
            raise failures.pop()

    def connect(replaces: Any = None) -> Any:
        return attach(
            hub,
            {"policy": "policy"},
            owner=owner,
            zero_copy=zero_copy,
            heartbeat_s=None,
            on_applied=on_applied,
            replaces=replaces,
        )

    first = connect()
    hub.latest = staged(2)
    with pytest.raises(RaySyncError, match="on_weights_applied raised"):
        connect(replaces=first)
    again = connect(replaces=first)
    try:
        assert again.version() == 2 and hooked == [1, 2, 2]
        assert torch.equal(owner.policy.weight, torch.full((2, 3), 2.0))
        assert torch.equal(owner.policy.bias, torch.full((2,), 2.0))
        assert [(r.versions, r.kept) for r in hub.registrations] == [
            ({"policy": 0}, ()),
            ({"policy": 1}, (1,) if zero_copy else ()),
            ({"policy": 1}, ()),
        ]
        # Version 1 as the model moved on from it, version 2 once the failed receiver
        # closed; the retry's lives on in the model (zero copy) or went back too.
        assert transport.released == [(1, True), (2, True), *([] if zero_copy else [(2, True)])]
    finally:
        again.close()


def test_a_learners_own_delivery_turned_down_as_a_conflict_keeps_its_hold_for_the_hubs():
    """The receiver holds another learner's version 2 when this learner's own delivery
    of its guessed 2 comes: a CONFLICT, and the hub then delivers this payload itself
    (under the number it booked it, or a new one), planned with one hold on it. Handing
    it back here released that hold (or, first, forestalled it): a shared-memory slot a
    zero-copy model then lived in was held by nobody, and written again under it."""
    receiver = _Receiver()
    receiver.core.receive(dataclasses.replace(receiver.update(2), origin="b"))
    assert receiver.transport.released == [(2, True)]
    mine = dataclasses.replace(receiver.update(2), origin="a", from_learner=True)
    assert receiver.core.receive(mine) == AckNow(
        dataclasses.replace(_ack(2, AckStatus.CONFLICT), origin="a")
    )
    assert receiver.transport.released == [(2, True)]  # nothing handed back for it
    receiver.core.receive(dataclasses.replace(mine, version=3, from_learner=False))
    assert receiver.transport.released == [(2, True), (2, True)]  # once, by the hub's
