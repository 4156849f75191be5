"""The RPC receiver's inboxes (raysync/transports/rpc/receiver.py), without RPC:
buckets land into one staging buffer per version, ``take`` waits for the last one,
a version the agent gave up or that stops landing raises naming why, buffers are
reused, and versions never taken are dropped per model."""

from __future__ import annotations

import threading
import time
from typing import TypeVar

import pytest
import torch

from raysync.transports.base import TransportError
from raysync.transports.rpc.receiver import _BucketInbox, _Inbox

Inbox = TypeVar("Inbox", _BucketInbox, _Inbox)


def _open(inbox: Inbox) -> Inbox:
    """``inbox`` with a receiver of its process open (what lands is kept for it)."""
    inbox.opened()
    return inbox


def test_buckets_land_at_their_offsets_and_take_returns_the_whole_buffer():
    inbox = _open(_BucketInbox())
    data = torch.arange(64, dtype=torch.uint8)

    def land_all():
        for at in range(0, 64, 16):
            inbox.put(
                "hub", 1, 64, [(at, 8), (at + 8, 8)], [data[at : at + 8], data[at + 8 : at + 16]]
            )

    landing = threading.Thread(target=land_all)
    landing.start()
    buffer = inbox.take("hub", 1, count=4, timeout_s=10)
    landing.join()
    assert torch.equal(buffer, data)
    inbox.give_back(buffer)
    inbox.put("hub", 2, 64, [(0, 64)], [data])
    assert inbox.take("hub", 2, count=1, timeout_s=10).data_ptr() == buffer.data_ptr()


def test_a_version_the_agent_gave_up_raises_its_reason():
    inbox = _open(_BucketInbox())
    inbox.put("hub", 1, 64, [(0, 16)], [torch.zeros(16, dtype=torch.uint8)])
    inbox.fail("hub", 1, "bucket 1 of 4: the learner stopped sending this version")
    with pytest.raises(TransportError, match="#1 of RPC hub hub: bucket 1 of 4: the learner"):
        inbox.take("hub", 1, count=4, timeout_s=10)


def test_a_version_that_stops_landing_raises_after_the_timeout_naming_the_bucket():
    inbox = _open(_BucketInbox())
    inbox.put("hub", 1, 64, [(0, 16)], [torch.zeros(16, dtype=torch.uint8)])
    with pytest.raises(TransportError, match=r"bucket 1 of 3 did not land within 0.1 s"):
        inbox.take("hub", 1, count=3, timeout_s=0.1)


def test_versions_left_far_behind_are_dropped_when_a_newer_one_is_taken():
    """Of the versions of the taken one's model that landed before it and were never
    taken, the newest four are kept (their deliveries may still come: several run at
    once) and the older ones dropped."""
    inbox = _open(_BucketInbox())
    for seq in range(1, 6):  # never taken
        inbox.put("hub", seq, 64, [(0, 16)], [torch.ones(16, dtype=torch.uint8)])
    inbox.put("hub", 10, 64, [(0, 64)], [torch.zeros(64, dtype=torch.uint8)])
    inbox.take("hub", 10, count=1, timeout_s=10)
    assert sorted(seq for _, seq in inbox._landing) == [2, 3, 4, 5]
    with pytest.raises(TransportError, match="did not land"):
        inbox.take("hub", 1, count=1, timeout_s=0.05)


def test_another_models_version_far_behind_is_kept_for_its_own_take():
    """The numbers are the hub's, across models: a receiver of two models that takes
    model b's #10 has not given up model a's #1, which its delivery takes later."""
    inbox = _open(_BucketInbox())
    inbox.put("hub", 1, 64, [(0, 64)], [torch.ones(64, dtype=torch.uint8)], "a")
    inbox.put("hub", 10, 64, [(0, 64)], [torch.zeros(64, dtype=torch.uint8)], "b")
    inbox.take("hub", 10, count=1, timeout_s=10)
    assert torch.equal(
        inbox.take("hub", 1, count=1, timeout_s=10), torch.ones(64, dtype=torch.uint8)
    )


def test_a_version_turned_down_is_dropped_and_its_buffer_reused():
    """Turned down while its buckets land: what landed goes back for reuse, and what
    lands after is not kept (a new buffer nobody took stayed until four versions of
    its model were taken)."""
    inbox = _open(_BucketInbox())
    inbox.put("hub", 1, 64, [(0, 32)], [torch.ones(32, dtype=torch.uint8)], "a")
    inbox.discard("hub", 1)
    inbox.put("hub", 1, 64, [(32, 32)], [torch.ones(32, dtype=torch.uint8)], "a")
    assert inbox._landing == {} and list(inbox._free) == [64]
    with pytest.raises(TransportError, match="did not land"):
        inbox.take("hub", 1, count=2, timeout_s=0.05)


def test_whole_versions_far_behind_are_dropped_per_model():
    """The whole-version inbox: a version far behind of the model taken is dropped (its
    delivery never came: four newer ones landed before the one taken), another model's
    is kept, and one turned down goes at once."""
    inbox = _open(_Inbox())
    one = [torch.ones(2)]
    inbox.put("hub", 1, one, "a")
    for seq in (2, 3, 5, 6, 7):
        inbox.put("hub", seq, one, "b")
    inbox.put("hub", 10, [torch.zeros(2)], "b")
    inbox.take("hub", 10, timeout_s=10)
    assert sorted(inbox._landed["hub"]) == [1, 3, 5, 6, 7]
    assert inbox.take("hub", 1, timeout_s=10) is one
    with pytest.raises(TransportError, match="did not land"):
        inbox.take("hub", 2, timeout_s=0.05)
    inbox.discard("hub", 3)
    inbox.discard("hub", 4)  # turned down before it landed
    inbox.put("hub", 4, one, "b")
    for seq in (3, 4):
        with pytest.raises(TransportError, match="did not land"):
            inbox.take("hub", seq, timeout_s=0.05)


def test_a_buffer_a_late_bucket_still_lands_in_is_not_given_to_the_next_version(monkeypatch):
    """A bucket call that stalled is still copying when the agent gives its version up
    (the receiver's ``take`` raises and drops it): the next version gets a buffer of its
    own, not the one that copy then overwrites."""
    from raysync.transports.rpc import receiver as rpc_receiver

    real_place = rpc_receiver.place
    copying, go = threading.Event(), threading.Event()

    def stalled_place(buffer, places, pieces):
        if pieces[0][0] == 1:  # version 1's bucket: stalls mid-copy
            copying.set()
            assert go.wait(10)
        real_place(buffer, places, pieces)

    monkeypatch.setattr(rpc_receiver, "place", stalled_place)
    inbox = _open(_BucketInbox())
    late = threading.Thread(
        target=inbox.put, args=("hub", 1, 64, [(0, 64)], [torch.ones(64, dtype=torch.uint8)])
    )
    late.start()
    assert copying.wait(10)
    inbox.fail("hub", 1, "the RPC agent gave it up")
    with pytest.raises(TransportError, match="gave it up"):
        inbox.take("hub", 1, count=1, timeout_s=10)
    inbox.put("hub", 2, 64, [(0, 64)], [torch.zeros(64, dtype=torch.uint8)])
    buffer = inbox.take("hub", 2, count=1, timeout_s=10)
    go.set()
    late.join(10)
    assert torch.equal(buffer, torch.zeros(64, dtype=torch.uint8))


def test_versions_of_a_group_this_process_left_are_dropped_and_no_more_land():
    """The agent was replaced before the deliveries of what it sent here ran: the new
    group's keys never take them, so they went only when the process exited."""
    whole, buckets = _open(_Inbox()), _open(_BucketInbox())
    data = torch.zeros(64, dtype=torch.uint8)
    whole.put("old", 1, [data], "m")
    buckets.put("old", 1, 64, [(0, 16)], [data[:16]], "m")
    whole.forget("old")
    buckets.forget("old")
    whole.put("old", 2, [data], "m")  # came late
    whole.fail("old", 3, "given up")
    buckets.put("old", 2, 64, [(0, 16)], [data[:16]], "m")
    buckets.fail("old", 3, "given up")
    assert whole._landed == {} and whole._failed == {}
    assert buckets._landing == {}
    buckets.put("new", 1, 64, [(0, 64)], [data], "m")  # the left one's buffer, reused
    assert buckets.take("new", 1, count=1, timeout_s=10).numel() == 64


def test_a_give_up_no_delivery_takes_is_forgotten_once_far_behind(monkeypatch):
    """The agent's word that it gave a version up came after its delivery stopped waiting
    (or for a version turned down): a record no ``take`` pops, of no model, which the
    per-model window never dropped. Each stayed for the process's life."""
    monkeypatch.setattr("raysync.transports.rpc.receiver._FAILED_KEPT", 8)
    inbox = _open(_BucketInbox())
    inbox.discard("hub", 1)
    inbox.fail("hub", 1, "turned down first")
    inbox.fail("hub", 2, "its delivery had timed out")
    assert list(inbox._landing) == [("hub", 2)]
    inbox.put("hub", 20, 64, [(0, 64)], [torch.zeros(64, dtype=torch.uint8)], "a")
    inbox.take("hub", 20, count=1, timeout_s=10)
    assert inbox._landing == {}


def test_a_version_taken_once_is_refused_at_once_to_a_second_delivery_of_it():
    """The hub delivers to the same process again after ActorUnavailableError; the
    first call took the version (and failed after, or is superseded): the second take
    raises at once instead of waiting out its timeout with the host blocked."""
    whole, buckets = _open(_Inbox()), _open(_BucketInbox())
    whole.put("hub", 1, [torch.ones(4)], "m")
    buckets.put("hub", 2, 16, [(0, 16)], [torch.zeros(16, dtype=torch.uint8)], "m")
    whole.take("hub", 1, timeout_s=10)
    buckets.take("hub", 2, count=1, timeout_s=10)
    with pytest.raises(TransportError, match="#1 of RPC hub hub was taken by an earlier delivery"):
        whole.take("hub", 1, timeout_s=600)
    with pytest.raises(TransportError, match="#2 of RPC hub hub was taken by an earlier delivery"):
        buckets.take("hub", 2, count=1, timeout_s=600)


def test_what_lands_once_the_last_receiver_here_closed_is_not_kept():
    """A receiver closed while busy (its deliveries queued behind the host's method,
    then answered "not attached", taking nothing): the versions that had landed for it
    were kept for the process's life, each a whole model."""
    whole, buckets = _open(_Inbox()), _open(_BucketInbox())
    whole.opened()  # a second receiver of this process, closed first
    whole.put("k", 1, [torch.ones(4)], "m")
    buckets.put("k", 1, 8, [(0, 8)], [torch.ones(8, dtype=torch.uint8)], "m")
    whole.closed()
    assert list(whole._landed["k"]) == [1]  # one receiver is still open: kept for it
    whole.closed()
    buckets.closed()
    assert whole._landed == {} and buckets._landing == {} and buckets._free == {}
    whole.put("k", 2, [torch.ones(4)], "m")  # in flight when it closed
    buckets.put("k", 2, 8, [(0, 8)], [torch.ones(8, dtype=torch.uint8)], "m")
    whole.fail("k", 3, "the agent gave it up")
    assert whole._landed == {} and whole._failed == {} and buckets._landing == {}
    whole.opened()  # a receiver opens again: kept for it
    whole.put("k", 4, [torch.full((4,), 4.0)], "m")
    assert whole.take("k", 4, timeout_s=1)[0][0] == 4.0


def _waiting_take(take) -> tuple[threading.Thread, list]:
    """``take()`` on a thread of its own, once it waits in its inbox (its result or
    error in the list returned)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(take())
        except TransportError as err:
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("kind", ["whole", "buckets"])
def test_a_version_a_delivery_waits_for_is_not_dropped_by_a_far_newer_take(kind):
    """Two deliveries of one model read at once (a threaded or async host), numbered
    more than the window apart (the hub's numbers span its models): both versions
    landed, and the newer one's take ran first and dropped the older one as never
    taken, while its delivery waited for it until its timeout."""
    inbox = _open(_Inbox() if kind == "whole" else _BucketInbox())
    data = torch.arange(16, dtype=torch.uint8)

    def put(seq: int) -> None:
        if kind == "whole":
            inbox.put("hub", seq, [data + seq], "m")
        else:
            inbox.put("hub", seq, 16, [(0, 16)], [data + seq], "m")

    def take(seq: int, timeout_s: float) -> torch.Tensor:
        if kind == "whole":
            return inbox.take("hub", seq, timeout_s=timeout_s)[0]
        return inbox.take("hub", seq, count=1, timeout_s=timeout_s)

    older, outcome = _waiting_take(lambda: take(1, 5.0))
    deadline = time.monotonic() + 10
    while not inbox._cond._waiters:  # it waits for version 1 in the inbox
        assert time.monotonic() < deadline, "the take of version 1 never waited"
        time.sleep(0.001)
    with inbox._cond:  # both land and the newer one is taken before the older wakes
        put(1)
        put(9)
        assert torch.equal(take(9, 1.0), data + 9)
    older.join(10)
    assert len(outcome) == 1 and not isinstance(outcome[0], TransportError), outcome
    assert torch.equal(outcome[0], data + 1)


@pytest.mark.parametrize("kind", ["whole", "buckets"])
def test_an_older_version_whose_take_has_not_begun_is_kept_across_far_numbers(kind):
    """The hub numbers across its models: two versions of one model in a row may be
    numbered far apart. The newer one's take (another delivery thread, first) dropped
    the older one before its delivery began taking it, which then waited its timeout."""
    inbox = _open(_Inbox() if kind == "whole" else _BucketInbox())
    data = torch.arange(16, dtype=torch.uint8)
    for seq in (1, 9):
        if kind == "whole":
            inbox.put("hub", seq, [data + seq], "m")
        else:
            inbox.put("hub", seq, 16, [(0, 16)], [data + seq], "m")
    if kind == "whole":
        inbox.take("hub", 9, timeout_s=1)
        older = inbox.take("hub", 1, timeout_s=0.3)[0]
    else:
        inbox.take("hub", 9, count=1, timeout_s=1)
        older = inbox.take("hub", 1, count=1, timeout_s=0.3)
    assert torch.equal(older, data + 1)
