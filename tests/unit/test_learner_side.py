"""What a learner process keeps for a hub (raysync/learner_side.py), without Ray: every
HubHandle on one hub in a process shares it — a handle is unpickled anew wherever it
travels — and release() ends it for all of them."""

from __future__ import annotations

import pickle

import pytest

from raysync import learner_side
from raysync.hub_handle import HubHandle
from raysync.learner_side import InFlight, end_learner_side
from raysync.messages import HubConfig
from raysync.transports.base import TransportSender


class _Sender(TransportSender):
    def __init__(self) -> None:
        self.closed = False

    def send(self, tensors, spec, model):  # never called here
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def checked(monkeypatch) -> list[dict[str, str]]:
    """The other hubs each new side had checked (no Ray here to ask them); each test
    begins with no side in this process."""
    asked: list[dict[str, str]] = []
    monkeypatch.setattr(learner_side, "_sides", {})
    monkeypatch.setattr(learner_side, "_end_sides_of_gone_hubs", asked.append)
    return asked


def _handle(hub_id: str) -> HubHandle:
    config = HubConfig(
        transport="object_store", default_timeout_s=60.0, reject_nonfinite=False, hub_id=hub_id
    )
    return HubHandle(f"the actor of {hub_id}", config)


def test_every_handle_on_a_hub_in_a_process_shares_one_side():
    handle = _handle("hub-a")
    again = pickle.loads(pickle.dumps(handle))  # as a Ray argument arrives
    assert again is not handle and again._side is handle._side
    assert _handle("hub-b")._side is not handle._side
    opened: list[_Sender] = []

    def open_sender() -> _Sender:
        opened.append(_Sender())
        return opened[-1]

    first = handle._side.sender("object_store", open_sender)
    assert again._side.sender("object_store", open_sender) is first and len(opened) == 1
    handle.release()


def test_release_closes_the_senders_and_the_next_use_begins_anew():
    handle = _handle("hub-c")
    side = handle._side
    sender = side.sender("object_store", _Sender)
    submitter = side.submitter
    pickle.loads(pickle.dumps(handle)).release()
    assert sender.closed
    assert handle._side is not side and handle._side.submitter != submitter
    handle.release()


def test_a_submit_call_that_never_left_gives_its_number_to_the_next():
    # A number the hub never receives would hold the learner's next broadcast back (the
    # hub waits for each number's turn): only calls that left take one.
    side = _handle("hub-d")._side
    sent: list[tuple[int, int]] = []

    def send(sequence: int, floor: int) -> str:
        sent.append((sequence, floor))
        return f"result {sequence}"

    def fail(sequence: int, floor: int) -> str:
        raise RuntimeError("could not serialize the request")

    assert side.submit(send) == (1, "result 1")
    side.in_flight = InFlight()  # call 1 completed (no Ray here to ask)
    with pytest.raises(RuntimeError, match="serialize"):
        side.submit(fail)
    assert side.submit(send) == (2, "result 2")
    assert sent == [(1, 1), (2, 2)]
    end_learner_side("hub-d")


def test_a_side_begun_on_another_hub_checks_whether_the_others_closed(checked):
    # A learner moved to a new hub would otherwise keep the old one's senders (whole
    # versions in NIXL buffers or segments) until it exits.
    first, second = _handle("hub-e"), _handle("hub-f")
    first._side  # noqa: B018 - begins hub-e's side: no other side to check
    assert checked == []
    side = second._side
    assert second._side is side
    assert checked == [{"hub-e": "the actor of hub-e"}]  # once, and not itself
    first.release()
    second.release()
