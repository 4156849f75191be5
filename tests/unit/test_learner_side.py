"""What a learner process keeps for a hub (raysync/learner_side.py), without Ray: every
HubHandle on one hub in a process shares it — a handle is unpickled anew wherever it
travels — and release() ends it for all of them."""

from __future__ import annotations

import pickle

from raysync.hub_handle import HubHandle
from raysync.messages import HubConfig
from raysync.transports.base import TransportSender


class _Sender(TransportSender):
    def __init__(self) -> None:
        self.closed = False

    def send(self, tensors, spec):  # never called here
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


def _handle(hub_id: str) -> HubHandle:
    config = HubConfig(
        transport="object_store", default_timeout_s=60.0, reject_nonfinite=False, hub_id=hub_id
    )
    return HubHandle("the hub actor", config)


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
